// Internals of the comm layer, shared by its files and ops/reduce.cpp (not installed):
//   layout.cpp     the local analysis of a call's leaves and the per-dict layout cache
//   agreement.cpp  the agreement across ranks, plan lookup, prepare_collective
//   packer.cpp     copies between leaves and bucket buffers
//   runner.cpp     BucketRunner, the sync in-place path, async all_reduce/reduce/broadcast, stats
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "comm/collective_engine.hpp"
#include "comm/compression.hpp"
#include "runtime/mpi_types.hpp"

namespace td::detail {

using Clock = std::chrono::steady_clock;

inline std::uint64_t mix(std::uint64_t h, std::uint64_t v) {
  h ^= v + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2);
  return h * 0xff51afd7ed558ccdull;
}

/// Keeps the first error found.
inline void note_error(std::string& err, std::string msg) {
  if (err.empty()) err = std::move(msg);
}

// ---- layout.cpp ------------------------------------------------------------------------------

/// What a rank knows of its leaves before the agreement.
struct Analysis {
  std::uint32_t dtype_mask = 0;  // bit d set when some leaf has dtype d
  bool any_sparse = false;
  std::uint64_t total_bytes = 0;  // of every leaf's elements (the flight recorder's summary)
  std::vector<LeafLayout> layout;
  std::string arg_error;          // first bad argument found on this rank ("" if none)
  std::uint64_t layout_hash = 0;  // keys + layouts: the plan cache key
  // Where each dense leaf's elements start, and its storage (null for undefined and sparse
  // leaves): stable while the layout ids are, so the packer reads flat arrays instead of
  // chasing dict entry -> tensor -> storage for every leaf of every call.
  std::shared_ptr<LeafMemory> memory;
};

// What a dict remembers of its last collective's analysis: valid while its canonical order is
// unchanged and every leaf still has the same storage, offset, dtype, shape and strides. Kept
// with the dict as its DictAccess::attachment.
struct LayoutCache {
  std::uint64_t generation = 0;      // of the dict's canonical order the snapshots follow
  std::uint64_t generation_now = 0;  // set by the caller: the order's generation for this call
  LeafVersions versions;             // of every leaf when `analysis` was made
  Analysis analysis;
};

/// The dict's layout cache, told the order generation of this call (after
/// DictAccess::canonical(d)).
LayoutCache& layout_cache_for_call(const TensorDict& d);

/// The analysis of `leaves`, from `cache` while no leaf changed (else computed, into `scratch`
/// when there is no cache).
const Analysis& analyse_cached(std::span<const LeafRef> leaves, LayoutCache* cache,
                               Analysis& scratch);
/// The op-dependent checks ("" or the first problem, naming the key).
std::string check_ops(std::span<const LeafRef> leaves, const Analysis& a,
                      const CollectiveCall& call);

// ---- agreement.cpp ---------------------------------------------------------------------------

/// The call's header line: everything agreed besides the layout.
std::string call_header(const CollectiveCall& call, std::optional<std::size_t> cap, bool async_op,
                        Compression compression, int group_size);

// ---- packer.cpp ------------------------------------------------------------------------------

/// bucket_is_contiguous_in_memory on the flat LeafMemory arrays (the sync path).
bool bucket_is_contiguous_in_memory(const BucketPlan::Bucket& b, const LeafMemory& m);
/// Copies a bucket's contiguous leaves into `buf` / back from it, from the flat arrays; merges
/// leaves that lie back to back and copies small leaves with inlined moves.
void pack_slots(const BucketPlan::Bucket& b, const LeafMemory& m, std::byte* buf);
void unpack_slots(const BucketPlan::Bucket& b, const LeafMemory& m, const std::byte* buf);

// ---- runner.cpp ------------------------------------------------------------------------------

struct Roles {
  bool sends;     // this rank's data is an input
  bool receives;  // this rank holds the result afterwards
};

// Whether this rank divides its result by the group size afterwards (AVG is a SUM, then a
// division on the ranks that hold the result).
/// Whether this rank divides its result by the group size afterwards (AVG = SUM, then a
/// division on the ranks that hold the result).
bool divides_result(const CollectiveCall& call, Roles roles);
/// This rank's roles in an in-place collective (all_reduce, reduce, broadcast).
Roles roles_of(const CollectiveCall& call, int rank);
/// Posts (req) or runs (req null) one message of an in-place collective.
void start_or_run(const CollectiveCall& call, int rank, MPI_Comm comm, std::byte* p, int count,
                  DType dtype, MPI_Request* req);
/// One bucket of all_reduce / reduce / broadcast as it travels, the same on the sync path, the
/// async path and the Reducer's: `p` holds its elements in the bucket's dtype (the leaves' own
/// memory, or a pack buffer when `packed`); MPI reads and writes `w`: `p` itself, or a 16-bit
/// copy of it when the bucket travels compressed (the caller points `w` at that buffer). The
/// paths differ only in where a buffer comes from and in when finish() runs.
struct WireBucket {
  DType dtype;
  std::int64_t count;  // elements
  std::byte* p;
  bool packed;
  std::byte* w;
  DType wire;       // w's dtype
  bool compressed;  // w is a compressed (16-bit) copy of p
  bool avg;         // this rank divides its result by the group size
  bool sends;       // this rank's data is an input
  bool receives;    // this rank holds the result afterwards

  /// A bucket of `nbytes` of `dt` at `at`; with `compress_to` (Float16 or BFloat16) a float
  /// bucket travels in that type.
  WireBucket(DType dt, std::size_t nbytes, std::byte* at, bool is_packed,
             const CollectiveCall& call, Roles roles, std::optional<DType> compress_to);
  /// Bytes MPI moves.
  std::size_t wire_bytes() const { return static_cast<std::size_t>(count) * itemsize(wire); }
  /// Compressed: writes p's elements into w (AVG: divided by the group size first).
  void compress_into_wire(const CollectiveCall& call, int group_size) const;
  /// Posts (reqs) or runs (reqs null) the bucket's messages of at most `max_message` bytes.
  void start(const CollectiveCall& call, const GroupState& g, std::size_t max_message,
             std::vector<MPI_Request>* reqs) const;
  /// Posts the messages as requests of `st`: flat (start), or node-aware on a group that is
  /// (node_aware: three stages per message, later ones as `st`'s next phases, each stage in the
  /// order the group's messages started on every rank).
  void post(const CollectiveCall& call, const std::shared_ptr<GroupState>& g,
            std::size_t max_message, WorkState& st) const;
  /// After the messages completed: widens, divides and, when packed, unpack(p) copies back.
  template <class Unpack>
  void finish(int group_size, Unpack&& unpack) const {
    if (!receives) return;
    if (compressed) decompress(w, wire, count, dtype, p);
    if (avg) divide_in_place(p, count, dtype, group_size);
    if (packed) unpack(static_cast<const std::byte*>(p));
  }
};
/// Packer statistics.
void note_extra_bytes(std::size_t n);
void note_plan(bool hit);
void note_node_aware(std::size_t messages, bool per_slice);
void note_gathered_allreduce();
/// Before a sync call on a node-aware group posts its stages as blocking collectives: waits
/// until every stage an earlier async call drew has been posted (each node communicator's
/// collectives must be issued in one order on every rank), driving their progress without the
/// progress thread; td::TimeoutError at `deadline`.
void await_node_stages(GroupState& g, Clock::time_point deadline,
                       const std::function<std::string()>& describe);
/// One sync all_reduce message (SUM) of `count` elements at `p`, the way a call's message goes
/// on this group (flat, split across nodes, or node-aware): what the bucket tuner times. Its
/// messages are control() calls, not counted in packer_stats(). On a node-aware group the caller
/// has run await_node_stages first.
void time_allreduce_message(const GroupState& g, std::byte* p, int count, DType dtype);
/// Every rank consolidated: each dtype's span in place.
void run_spans(const BucketPlan& plan, const CollectiveCall& call, GroupState& g,
               const LeafMemory& mem);
/// The sync bucketed path: one reused pack buffer, in-place buckets where possible.
void run_sync(const std::shared_ptr<const BucketPlan>& plan_ptr, std::span<const LeafRef> leaves,
              const CollectiveCall& call, GroupState& g, const LeafMemory& mem);
/// all_reduce / reduce / broadcast through BucketRunner, one Work per bucket (sync or async);
/// with `wire` (Float16 or BFloat16), float32/float64 buckets travel compressed.
std::vector<Work> run_buckets(const BucketPlan& plan, std::span<const LeafRef> leaves,
                              const CollectiveCall& call, const std::shared_ptr<GroupState>& g,
                              Clock::time_point deadline, bool async_op, std::optional<DType> wire);

}  // namespace td::detail
