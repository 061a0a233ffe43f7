// The one path every collective takes: leaves -> layout agreement -> bucket plan -> MPI.
#pragma once

#include <algorithm>
#include <climits>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string_view>
#include <vector>

#include "comm/executor.hpp"
#include "comm/validate.hpp"
#include "core/dict_internal.hpp"
#include "runtime/flight_recorder.hpp"
#include "runtime/group_state.hpp"
#include "runtime/work_state.hpp"

namespace td::detail {

struct LayoutCache;  // engine_internal.hpp: what a dict remembers of its last analysis

/// Which collective runs.
enum class CollectiveKind : std::uint8_t {
  AllReduce,
  Reduce,
  Broadcast,
  AllGather,
  Gather,
  Scatter,
  ReduceScatter,
  Barrier,
};

/// Whether the collective combines values with a ReduceOp.
constexpr bool reduces(CollectiveKind k) {
  return k == CollectiveKind::AllReduce || k == CollectiveKind::Reduce ||
         k == CollectiveKind::ReduceScatter;
}
/// Whether the collective has a root rank (dst or src).
constexpr bool has_root(CollectiveKind k) {
  return k == CollectiveKind::Reduce || k == CollectiveKind::Broadcast ||
         k == CollectiveKind::Gather || k == CollectiveKind::Scatter;
}
/// "dst" for collectives that deliver to the root, "src" for those that send from it.
constexpr const char* root_name(CollectiveKind k) {
  return k == CollectiveKind::Broadcast || k == CollectiveKind::Scatter ? "src" : "dst";
}
/// Whether sparse leaves are supported (the others reject them before moving data).
constexpr bool sparse_supported(CollectiveKind k) {
  return k == CollectiveKind::AllReduce || k == CollectiveKind::Reduce ||
         k == CollectiveKind::Broadcast;
}

/// A collective's arguments that every rank must agree on.
struct CollectiveCall {
  CollectiveKind kind = CollectiveKind::AllReduce;
  ReduceOp op = ReduceOp::SUM;
  int root = 0;            // dst of reduce, src of broadcast
  std::string_view name;   // "all_reduce", "TensorDict.reduce", ... for messages
  bool from_dict = false;  // bucket_bytes applies (and TD_BUCKET_BYTES)
  // The library's own messages (the bucket tuner timing the path a call's messages take): posted
  // as control() calls, not counted in packer_stats().
  bool control = false;
};

/// Where each leaf's elements start and which storage holds them (null for undefined and sparse
/// leaves), in canonical order.
struct LeafMemory {
  std::vector<std::byte*> data;
  std::vector<const Storage*> storage;
  // Per bucket of `direct_plan`, where it starts when its leaves lie back to back in one storage
  // (it runs in place there), null otherwise; computed on first use with that plan: the leaves'
  // addresses cannot change while this LeafMemory is used. One array read in bucket order: a
  // bucket's own slot list, one heap block per bucket, was a cache miss per bucket of a
  // per-leaf call (16384 of them for a dict of 16384 leaves).
  mutable std::mutex direct_mu;
  mutable std::shared_ptr<const BucketPlan> direct_plan;
  mutable std::shared_ptr<const std::vector<std::byte*>> direct;
  // Set when, for every dtype, the dense leaves that a plan reduces (not aliases, not empty) lie
  // back to back in canonical order in one storage, as after TensorDict::consolidate(): then
  // spans[k] covers all of one dtype's leaves, in order of each dtype's first leaf.
  struct Span {
    DType dtype;
    std::byte* data;
    std::size_t nbytes;
  };
  bool one_span_per_dtype = false;
  std::vector<Span> spans;
};

/// What a collective knows once every rank agreed: its group, its bucket plan and its deadline.
struct PreparedCollective {
  std::shared_ptr<GroupState> group;
  std::shared_ptr<const BucketPlan> plan;
  std::chrono::steady_clock::time_point deadline;
  std::shared_ptr<const LeafMemory> memory;  // of the leaves the collective was prepared on
  // Every rank's leaves are one span per dtype (LeafMemory::spans) and the call is bucketed:
  // the sync path may run each span as a whole, whatever the buckets.
  bool spans_everywhere = false;
  // The call in the flight recorder (its sequence number): held until the caller returns.
  CallScope scope;
};

/// The bucket cap a call asks for: opts.bucket_bytes, else TD_BUCKET_BYTES, for a TensorDict
/// call (`from_dict`); nullopt (one message per leaf) for a single tensor. Unvalidated: 0 and
/// kAutoBucketBytes are returned as they are.
std::optional<std::size_t> requested_cap(const CollectiveOptions& opts, bool from_dict);

/// Everything a collective does before moving data: group membership, argument and layout
/// agreement across the group (throws the same error on every rank), the bucket plan (cached).
/// `extra_arg_error`, if not empty, is a bad argument found by the caller on this rank.
/// `cache` (a dict's) lets repeated calls on an unchanged dict skip the per-leaf analysis.
PreparedCollective prepare_collective(std::span<const LeafRef> leaves, const CollectiveCall& call,
                                      const CollectiveOptions& opts,
                                      std::string extra_arg_error = {},
                                      LayoutCache* cache = nullptr);

/// Calls f(byte offset, element count) for each message of a bucket of `nbytes` bytes: messages of
/// at most max_message_bytes, and never more than INT_MAX elements.
template <class F>
void for_each_message(std::size_t nbytes, DType dtype, std::size_t max_message_bytes, F&& f) {
  const std::size_t isz = itemsize(dtype);
  const std::size_t per =
      std::max<std::size_t>(1, std::min<std::size_t>(max_message_bytes / isz, INT_MAX));
  const std::size_t total = nbytes / isz;
  for (std::size_t first = 0; first < total; first += per)
    f(first * isz, static_cast<int>(std::min(per, total - first)));
}

/// Copies a bucket's leaves into `dst` (bucket.nbytes bytes), strided leaves included.
void pack_bucket(const BucketPlan::Bucket& bucket, std::span<const LeafRef> leaves, std::byte* dst);
/// Copies `src` back into the bucket's leaves.
void unpack_bucket(const BucketPlan::Bucket& bucket, std::span<const LeafRef> leaves,
                   const std::byte* src);
/// Whether the bucket's leaves lie back to back in one storage (so it needs no pack copy).
bool bucket_is_contiguous_in_memory(const BucketPlan::Bucket& bucket,
                                    std::span<const LeafRef> leaves);

/// The one place where a bucket becomes MPI calls and a Work: every collective's buckets go
/// through it, except those of a sync all_reduce/reduce/broadcast, which reuse the group's pack
/// buffer and make no Work (runner.cpp's run_sync; it shares each bucket's start and finish with
/// the async path of those three, run_buckets, which uses this class). An op supplies, per bucket,
/// a WorkState holding its buffers and finish step, and `start`, which posts the bucket's MPI calls
/// (into `requests`) or, for a sync call (`requests` null), runs them blocking. Sync: start, then
/// the finish step, under the data-phase watchdog. Async: the Works are handed to the progress
/// thread together by works().
class BucketRunner {
 public:
  BucketRunner(std::chrono::steady_clock::time_point deadline, bool async_op);
  /// The state of bucket `b` of `plan`: the call's deadline and, for errors, its
  /// bucket_description.
  std::shared_ptr<WorkState> state(std::string_view what, const BucketPlan& plan, std::size_t b,
                                   std::span<const LeafRef> leaves, int group_size) const;
  /// Where a bucket's elements are for MPI: the leaves' own memory when they lie back to back in
  /// one storage (in place), else a pack buffer of `nbytes` (default: the bucket's) held by `st`,
  /// filled from the leaves when `pack`. `packed` tells which.
  static std::byte* place(const BucketPlan::Bucket& bk, std::span<const LeafRef> leaves,
                          WorkState& st, bool pack, bool* packed = nullptr, std::size_t nbytes = 0);
  /// Runs one bucket (see the class comment).
  void run(const std::shared_ptr<WorkState>& st,
           const std::function<void(std::vector<MPI_Request>*)>& start);
  /// run() of a bucket that is one MPI call: `start` gets a request to post into, or null.
  void run_one(const std::shared_ptr<WorkState>& st,
               const std::function<void(MPI_Request*)>& start);
  /// The pending Works of an async call (none for a sync call), handed to the progress thread.
  std::vector<Work> works();

 private:
  std::chrono::steady_clock::time_point deadline_;
  bool async_;
  std::vector<Work> works_;
  std::vector<std::shared_ptr<WorkState>> states_;
};

// ---- layout description, difference and hash: one of each, for collectives, point to point,
// scatter's parts and td::stack (comm/layout.cpp) ---------------------------------------------

/// How messages print a tensor's layout: "float32[3, 4]", "int64[5] sparse", "undefined".
std::string describe_tensor(const Tensor& t);
/// How messages print an analysed leaf (the collectives' view): as describe_tensor, plus
/// " non-contiguous" and " alias of 'k'" (`leaves` names the alias target).
std::string describe_leaf(const LeafLayout& l, std::span<const LeafRef> leaves);
/// Leaves as "key\tdescription" lines in canonical order: what ranks exchange after a mismatch.
/// With `layout` (analysed leaves) the collectives' view, else describe_tensor's.
std::vector<std::string> describe_leaves(std::span<const LeafRef> leaves,
                                         const std::vector<LeafLayout>* layout = nullptr);
/// Where several sides' describe_leaves lines first differ: the smallest key at the first
/// differing position, and what each side holds for it ("" where it has no such key).
struct LayoutDifference {
  std::string key;
  std::vector<std::string> holds;
};
std::optional<LayoutDifference> first_difference(
    const std::vector<std::vector<std::string>>& sides);
/// One 64-bit hash of keys (LeafRef::key_hash) and layouts, never 0.
std::uint64_t layout_hash(std::span<const LeafRef> leaves, std::span<const LeafLayout> layout);
/// Dtype and shape of each leaf, every one contiguous, dense and unaliased: the layout point to
/// point agrees on (each side packs by its own strides), and what the Reducer's buckets are
/// planned from (every leaf is copied into its bucket).
std::vector<LeafLayout> plain_layout(std::span<const LeafRef> leaves);

/// "<what> of bucket b of n (dtype, bytes, leaves, first key) in a group of N ranks", for errors.
std::string bucket_description(std::string_view what, const BucketPlan& plan, std::size_t b,
                               std::span<const LeafRef> leaves, int group_size);

/// An element count as MPI's int, checked: a count larger than INT_MAX is a td::Error naming
/// `what` (the same on every rank: counts follow from the agreed layout).
int mpi_count(std::size_t count, std::string_view what);

/// Runs `call` on `leaves` (canonical order): checks arguments and layout across the group,
/// plans buckets and moves the data. Returns pending Works when opts.async_op, else none.
std::vector<Work> run_collective(std::span<const LeafRef> leaves, const CollectiveCall& call,
                                 const CollectiveOptions& opts, LayoutCache* cache = nullptr,
                                 std::string extra_arg_error = {});

/// A TensorDict's leaves for a collective: its canonical order and layout cache, or, when the
/// dict cannot take part (moved from), no leaves and the reason, which the caller passes to
/// the agreement as a local error so that every rank raises it instead of this one alone.
struct DictLeaves {
  std::span<const LeafRef> leaves;
  LayoutCache* cache = nullptr;
  std::string error;
};
DictLeaves dict_leaves(const TensorDict& d, bool with_cache = true);

/// Resolves kAutoBucketBytes for a group: measured once per group (collective, bounded by
/// TD_AUTOTUNE_BUDGET_MS, under a watchdog of at least `deadline` and `timeout` past its start),
/// then cached.
TunedBuckets tuned_buckets(GroupState& group, std::chrono::steady_clock::time_point deadline,
                           std::chrono::milliseconds timeout);
/// Under TD_HIERARCHICAL=auto (the default), on a group that spans several nodes with more than
/// one of its ranks on some node, the first all_reduce / reduce / broadcast chooses whether the
/// group's messages go node-aware: from the cache, or timing one allreduce message of 256 KiB and
/// of 4 MiB both ways (collective, bounded like tuned_buckets). True if it chose now (the caller
/// then gives the call a fresh deadline); false if there was nothing to choose.
bool choose_message_path(GroupState& group, std::chrono::steady_clock::time_point deadline,
                         std::chrono::milliseconds timeout);
/// The smallest cap the measurement chooses from: a dict of at most this many bytes is packed the
/// same way by every candidate, and needs no measurement.
std::size_t smallest_candidate_cap();

}  // namespace td::detail
