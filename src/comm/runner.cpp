// BucketRunner (the one place a bucket becomes MPI calls and a Work), the sync in-place path
// of all_reduce / reduce / broadcast (spans, one reused pack buffer), their async path, and the
// packer statistics.
#include <algorithm>
#include <array>
#include <climits>
#include <cstring>
#include <thread>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "comm/compression.hpp"
#include "comm/engine_internal.hpp"
#include "comm/executor.hpp"
#include "core/config.hpp"
#include "runtime/deadline.hpp"
#include "runtime/diagnosis.hpp"
#include "runtime/log.hpp"
#include "runtime/mpi_types.hpp"
#include "runtime/progress.hpp"
#include "tensordict/diagnostics.hpp"

namespace td::detail {

// Whether this rank divides its result by the group size afterwards (AVG is a SUM, then a
// division on the ranks that hold the result).
bool divides_result(const CollectiveCall& call, Roles roles) {
  return roles.receives && call.op == ReduceOp::AVG && call.kind != CollectiveKind::Broadcast;
}

Roles roles_of(const CollectiveCall& call, int rank) {
  switch (call.kind) {
    case CollectiveKind::AllReduce:
      return {true, true};
    case CollectiveKind::Reduce:
      return {true, rank == call.root};
    case CollectiveKind::Broadcast:
      return {rank == call.root, rank != call.root};
    default:
      throw std::logic_error("roles_of: not an in-place collective");
  }
}

namespace {
// `c` as the call sends it: a control() call for the library's own messages.
DataCall as_sent(const CollectiveCall& call, DataCall c) {
  c.control = call.control;
  return c;
}
}  // namespace

void start_or_run(const CollectiveCall& call, int rank, MPI_Comm comm, std::byte* p, int count,
                  DType dtype, MPI_Request* req) {
  const MPI_Datatype type = mpi_datatype(dtype);
  switch (call.kind) {
    case CollectiveKind::AllReduce: {
      const MPI_Op op = mpi_op(call.op, dtype);
      detail::post(as_sent(call, detail::allreduce_call(MPI_IN_PLACE, p, count, type, op, comm)),
                   req);
      break;
    }
    case CollectiveKind::Reduce: {
      const MPI_Op op = mpi_op(call.op, dtype);
      const bool root = rank == call.root;
      void* send = root ? MPI_IN_PLACE : p;
      void* recv = root ? p : nullptr;
      detail::post(as_sent(call, detail::reduce_call(send, recv, count, type, op, call.root, comm)),
                   req);
      break;
    }
    case CollectiveKind::Broadcast:
      detail::post(as_sent(call, detail::bcast_call(p, count, type, call.root, comm)), req);
      break;
    default:
      throw std::logic_error("start_or_run: not an in-place collective");
  }
}

namespace {
std::mutex g_stats_mu;
PackerStats g_stats;
}  // namespace

void note_extra_bytes(std::size_t n) {
  std::lock_guard lock(g_stats_mu);
  g_stats.peak_extra_bytes = std::max(g_stats.peak_extra_bytes, n);
}

void note_plan(bool hit) {
  std::lock_guard lock(g_stats_mu);
  ++(hit ? g_stats.plan_hits : g_stats.plan_misses);
}

void note_node_aware(std::size_t messages, bool per_slice) {
  std::lock_guard lock(g_stats_mu);
  g_stats.node_aware_messages += messages;
  if (per_slice) g_stats.node_aware_slice_messages += messages;
}

void note_gathered_allreduce() {
  std::lock_guard lock(g_stats_mu);
  ++g_stats.gathered_allreduce_messages;
}

namespace {
void note_split_allreduce() {
  std::lock_guard lock(g_stats_mu);
  ++g_stats.split_allreduce_messages;
}

void run_blocking(const CollectiveCall& call, const GroupState& g, std::byte* p, int count,
                  DType dtype);
}  // namespace

// Every rank holds each dtype's leaves as one span of one storage (a consolidated dict): one
// pass per span, in place, in the plan's messages (max(cap, 4 MiB)), whatever the buckets. The
// sequence of messages depends only on the agreed layout, so it is the same on every rank.
void run_spans(const BucketPlan& plan, const CollectiveCall& call, GroupState& g,
               const LeafMemory& mem) {
  const Roles roles = roles_of(call, g.rank);
  const bool avg = divides_result(call, roles);
  for (const auto& sp : mem.spans) {
    for_each_message(sp.nbytes, sp.dtype, plan.max_message_bytes, [&](std::size_t off, int count) {
      run_blocking(call, g, sp.data + off, count, sp.dtype);
    });
    if (avg)
      divide_in_place(sp.data, static_cast<std::int64_t>(sp.nbytes / itemsize(sp.dtype)), sp.dtype,
                      g.size);
  }
}

// Where each of the plan's buckets runs in place on the leaves' memory, null for a bucket that is
// packed (cached in `mem` per plan).
std::shared_ptr<const std::vector<std::byte*>> direct_buckets(
    const std::shared_ptr<const BucketPlan>& plan, const LeafMemory& mem) {
  std::lock_guard lock(mem.direct_mu);
  if (mem.direct_plan != plan) {
    auto at = std::make_shared<std::vector<std::byte*>>(plan->buckets.size(), nullptr);
    for (std::size_t b = 0; b < plan->buckets.size(); ++b) {
      const auto& bk = plan->buckets[b];
      if (bucket_is_contiguous_in_memory(bk, mem)) (*at)[b] = mem.data[bk.slots[0].leaf];
    }
    mem.direct = std::move(at);
    mem.direct_plan = plan;
  }
  return mem.direct;
}

WireBucket::WireBucket(DType dt, std::size_t nbytes, std::byte* at, bool is_packed,
                       const CollectiveCall& call, Roles roles, std::optional<DType> compress_to)
    : dtype(dt),
      count(static_cast<std::int64_t>(nbytes / itemsize(dt))),
      p(at),
      packed(is_packed),
      w(at),
      wire(dt),
      compressed(compress_to.has_value() && compressible(dt)),
      // Compressed, AVG divides before summing (the sum of N values of a 16-bit float overflows
      // where N averages do not).
      avg(!compressed && divides_result(call, roles)),
      sends(roles.sends),
      receives(roles.receives) {
  if (compressed) wire = *compress_to;
}

void WireBucket::compress_into_wire(const CollectiveCall& call, int group_size) const {
  if (compressed && sends)
    compress(p, dtype, count, call.op == ReduceOp::AVG ? 1.0 / group_size : 1.0, wire, w);
}

void WireBucket::start(const CollectiveCall& call, const GroupState& g, std::size_t max_message,
                       std::vector<MPI_Request>* reqs) const {
  if (reqs && node_aware(g))  // run_collective sends these through post()
    throw std::logic_error("WireBucket::start: nonblocking messages of a node-aware group");
  for_each_message(wire_bytes(), wire, max_message, [&](std::size_t off, int n) {
    if (!reqs) return run_blocking(call, g, w + off, n, wire);
    reqs->push_back(MPI_REQUEST_NULL);
    start_or_run(call, g.rank, g.comm, w + off, n, wire, &reqs->back());
  });
}

namespace {

// Stage s (0 and 2 within each node, 1 between the nodes) of one message of a node-aware
// all_reduce / reduce / broadcast: this rank's one call, or none where it takes no part.
//   all_reduce: reduce onto each node's rank 0; all-reduce between those leaders; broadcast
//               within each node.
//   reduce:     the same reduce; reduce between the leaders onto the root's node; broadcast
//               within the root's node when the root is not its rank 0.
//   broadcast:  within the root's node from the root; between the leaders from the root's node;
//               within every other node from its leader.
std::optional<DataCall> node_stage(const CollectiveCall& call, const GroupState& g, int stage,
                                   std::byte* p, int count, DType dtype) {
  const NodeSplit& n = g.nodes;
  const MPI_Datatype type = mpi_datatype(dtype);
  const bool leader = n.leaders != MPI_COMM_NULL;
  const int my_node = n.node_of[static_cast<std::size_t>(g.rank)];
  const int root_node = n.node_of[static_cast<std::size_t>(call.root)];
  const int root_local = n.local_of[static_cast<std::size_t>(call.root)];
  if (call.kind == CollectiveKind::Broadcast) {
    if (stage == 0)
      return my_node == root_node ? std::optional(bcast_call(p, count, type, root_local, n.within))
                                  : std::nullopt;
    if (stage == 1)
      return leader ? std::optional(bcast_call(p, count, type, root_node, n.leaders))
                    : std::nullopt;
    return my_node != root_node ? std::optional(bcast_call(p, count, type, 0, n.within2))
                                : std::nullopt;
  }
  const MPI_Op op = mpi_op(call.op, dtype);
  if (stage == 0)
    return n.local_rank == 0 ? reduce_call(MPI_IN_PLACE, p, count, type, op, 0, n.within)
                             : reduce_call(p, nullptr, count, type, op, 0, n.within);
  if (call.kind == CollectiveKind::AllReduce) {
    if (stage == 1)
      return leader ? std::optional(allreduce_call(MPI_IN_PLACE, p, count, type, op, n.leaders))
                    : std::nullopt;
    return bcast_call(p, count, type, 0, n.within2);
  }
  if (stage == 1) {
    if (!leader) return std::nullopt;
    const bool here = my_node == root_node;
    return reduce_call(here ? MPI_IN_PLACE : p, here ? p : nullptr, count, type, op, root_node,
                       n.leaders);
  }
  return my_node == root_node && root_local != 0
             ? std::optional(bcast_call(p, count, type, 0, n.within2))
             : std::nullopt;
}

// Whether a sync all_reduce message of `count` elements runs node-aware per slice: every node has
// the same number of ranks (so each local rank has a peer on every node), more than one, and the
// message has an element for each (TD_HIERARCHICAL=leaders: never).
bool per_slice(const CollectiveCall& call, const GroupState& g, int count) {
  const NodeSplit& n = g.nodes;
  return call.kind == CollectiveKind::AllReduce && config().hierarchical != 3 && n.equal &&
         n.largest > 1 && n.nodes > 1 && count >= n.largest;
}

// `count` elements cut into `parts` consecutive pieces, the first count % parts one larger: the
// counts and displacements of a reduce-scatter and allgatherv.
std::pair<std::vector<int>, std::vector<int>> even_split(int count, int parts) {
  std::vector<int> counts(static_cast<std::size_t>(parts)), displs(counts.size());
  for (int i = 0, at = 0; i < parts; ++i) {
    counts[static_cast<std::size_t>(i)] = count / parts + (i < count % parts ? 1 : 0);
    displs[static_cast<std::size_t>(i)] = at;
    at += counts[static_cast<std::size_t>(i)];
  }
  return {std::move(counts), std::move(displs)};
}

// Messages of at least this many bytes on 3, 5, 6 or 7 ranks across nodes run as a reduce-scatter
// and an allgather (allreduce_across_nodes)...
constexpr std::size_t kSplitAllreduceBytes = std::size_t{512} << 10;
// ... on at most this many ranks: at 12 ranks on 3 hosts the split was 2.5x slower than Open
// MPI's own allreduce (928 vs 369 ms for a consolidated 27 MB dict), at 3 and 6 faster.
constexpr int kSplitAllreduceMaxRanks = 7;

// An in-place allreduce of `count` elements on `comm` (`ranks` ranks), whose ranks sit on several
// nodes. Open MPI 4.1's own choice for a large allreduce on a number of ranks that is not a power
// of two was 3x its ring across hosts (3 ranks on 3 hosts, 27 MB: 1000-1070 vs 350-400 ms; a
// reduce-scatter then an allgatherv of it, 340-346 ms; 27 MB in 512 KiB messages 1657-1934 vs
// 1959-2262 ms, no clear gain below: docs/cluster.md); a reduce-scatter then an
// allgather moves what the ring moves, 2(H-1)/H of the bytes over each node's link. Such messages
// go that way; others, and every power of two, as one MPI_Allreduce. Every rank ends with the
// same bits: each block is reduced once, by one rank, and copied. Only the library's ops reach
// here (all commutative).
void allreduce_across_nodes(const CollectiveCall& call, MPI_Comm comm, int ranks, std::byte* p,
                            int count, MPI_Datatype type, MPI_Op op, std::size_t item) {
  const bool power_of_two = (ranks & (ranks - 1)) == 0;
  if (power_of_two || ranks > kSplitAllreduceMaxRanks || count < ranks ||
      static_cast<std::size_t>(count) * item < kSplitAllreduceBytes) {
    post(as_sent(call, allreduce_call(MPI_IN_PLACE, p, count, type, op, comm)), nullptr);
    return;
  }
  if (!call.control) note_split_allreduce();
  const auto [counts, displs] = even_split(count, ranks);
  int me = 0;
  MPI_Comm_rank(comm, &me);
  const auto mine = static_cast<std::size_t>(me);
  std::byte* block = p + static_cast<std::size_t>(displs[mine]) * item;
  post(as_sent(call, reduce_scatter_call(MPI_IN_PLACE, p, counts.data(), type, op, comm)), nullptr);
  if (block != p) std::memmove(block, p, static_cast<std::size_t>(counts[mine]) * item);
  post(as_sent(call, allgatherv_call(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, p, counts.data(),
                                     displs.data(), type, comm)),
       nullptr);
}

// One all_reduce message, node-aware per slice: each of a node's L ranks owns 1/L of the message
// (its slice). A reduce-scatter within the node leaves each rank its slice summed over the node
// (MPI_IN_PLACE puts it at the buffer's start: moved to its place); the ranks of one local rank,
// one per node, all-reduce that slice between the nodes, L such calls at once, so every rank and
// every connection of a node carries 1/L of the bytes; an allgather within the node gives every
// rank every slice. The same bits on every rank: each slice is reduced once and copied.
void run_per_slice(const CollectiveCall& call, const GroupState& g, std::byte* p, int count,
                   DType dtype) {
  const NodeSplit& n = g.nodes;
  const MPI_Datatype type = mpi_datatype(dtype);
  const MPI_Op op = mpi_op(call.op, dtype);
  const int local = n.largest;
  const auto [counts, displs] = even_split(count, local);
  const auto mine = static_cast<std::size_t>(n.local_rank);
  const std::size_t item = itemsize(dtype);
  std::byte* slice = p + static_cast<std::size_t>(displs[mine]) * item;
  post(as_sent(call, reduce_scatter_call(MPI_IN_PLACE, p, counts.data(), type, op, n.within)),
       nullptr);
  if (slice != p) std::memmove(slice, p, static_cast<std::size_t>(counts[mine]) * item);
  allreduce_across_nodes(call, n.slices, n.nodes, slice, counts[mine], type, op, item);
  post(as_sent(call, allgatherv_call(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, p, counts.data(),
                                     displs.data(), type, n.within2)),
       nullptr);
}

// One message of a sync call: the flat collective, or on a node-aware group its three stages one
// after the other, as blocking collectives on the node communicators (per slice where that
// applies). Not libnbc's nonblocking ones, which the async path pipelines: Open MPI 4.1's
// nonblocking reduce and broadcast of large messages are several times slower than the blocking
// ones (docs/cluster.md), and a sync call has nothing to overlap. The caller has waited for every
// stage an earlier async call drew (await_node_stages).
void run_blocking(const CollectiveCall& call, const GroupState& g, std::byte* p, int count,
                  DType dtype) {
  if (!node_aware(g)) {
    if (call.kind == CollectiveKind::AllReduce && g.nodes.nodes > 1)
      return allreduce_across_nodes(call, g.comm, g.size, p, count, mpi_datatype(dtype),
                                    mpi_op(call.op, dtype), itemsize(dtype));
    return start_or_run(call, g.rank, g.comm, p, count, dtype, nullptr);
  }
  const bool slices = per_slice(call, g, count);
  if (!call.control) note_node_aware(1, slices);
  if (slices) return run_per_slice(call, g, p, count, dtype);
  for (int s = 0; s < 3; ++s) {
    if (s == 1 && call.kind == CollectiveKind::AllReduce) {  // between the nodes' first ranks
      if (g.nodes.leaders != MPI_COMM_NULL)
        allreduce_across_nodes(call, g.nodes.leaders, g.nodes.nodes, p, count, mpi_datatype(dtype),
                               mpi_op(call.op, dtype), itemsize(dtype));
      continue;
    }
    if (auto c = node_stage(call, g, s, p, count, dtype)) post(as_sent(call, *c), nullptr);
  }
}

// One node-aware bucket as it travels: its messages, each through the three stages in turn, in
// waves (each a phase of the Work): wave k posts message k's first stage, k-1's second and k-2's
// third, so that one message crosses the network while the next is reduced within the node.
struct NodeAwareTransfer {
  WireBucket ib;
  CollectiveCall call;
  std::shared_ptr<GroupState> g;
  std::vector<std::pair<std::size_t, int>> messages;  // byte offset in ib.w, element count
  std::array<std::uint64_t, 3> first{};  // message 0's ticket in each stage (NodeSplit::posted)
  std::array<std::size_t, 3> next{};     // per stage, the next message to post
  // Stage-1 allreduces of the last phase that went as a gather (GatheredAllreduce: small ones
  // where libnbc runs its ring): reduced once that phase completed, before stage 2 reads them.
  std::vector<std::shared_ptr<GatheredAllreduce>> gathered;
};

void advance_stages(const std::shared_ptr<NodeAwareTransfer>& t, WorkState& st) {
  NodeSplit& n = t->g->nodes;
  const std::size_t total = t->messages.size();
  const std::array<std::size_t, 3> done = t->next;  // a phase runs once all it posted completed
  for (const auto& g : std::exchange(t->gathered, {})) g->reduce();
  for (int s = 2; s >= 0; --s) {
    const auto stage = static_cast<std::size_t>(s);
    const std::size_t limit = s == 0 ? std::min(total, done[0] + 1) : done[stage - 1];
    while (t->next[stage] < limit) {
      const std::uint64_t ticket = t->first[stage] + t->next[stage];
      if (n.posted[stage].load(std::memory_order_acquire) != ticket)
        break;  // an earlier one's turn
      const auto [off, count] = t->messages[t->next[stage]];
      if (auto c = node_stage(t->call, *t->g, s, t->ib.w + off, count, t->ib.wire)) {
        if (auto gathered = post_gathered_into(st, *c, "node-aware stage")) {  // stage 1
          t->gathered.push_back(std::move(gathered));
        } else {
          post_into(st, *c, "node-aware stage");
        }
      }
      ++t->next[stage];
      n.posted[stage].store(ticket + 1, std::memory_order_release);
    }
  }
  if (t->next[2] < total) st.then = [t](WorkState& w) { advance_stages(t, w); };
}

}  // namespace

void time_allreduce_message(const GroupState& g, std::byte* p, int count, DType dtype) {
  CollectiveCall call;
  call.name = "kAutoBucketBytes measurement";
  call.control = true;
  run_blocking(call, g, p, count, dtype);
}

void await_node_stages(GroupState& g, Clock::time_point deadline,
                       const std::function<std::string()>& describe) {
  NodeSplit& n = g.nodes;
  auto all_posted = [&n] {
    for (std::size_t s = 0; s < 3; ++s)
      if (n.posted[s].load(std::memory_order_acquire) != n.drawn[s].load(std::memory_order_acquire))
        return false;
    return true;
  };
  const auto start = Clock::now();
  for (std::uint64_t spin = 0; !all_posted(); ++spin) {
    if (async_progress_enabled()) {
      if (spin >= 256) std::this_thread::yield();  // the progress thread posts them
    } else {
      progress_others(nullptr);
    }
    if (Clock::now() > deadline)
      throw timeout_error(
          current_call(),
          fmt::format(
              "{}: an earlier async call's node-aware stages were not all started after "
              "{} ms (they wait for other ranks); the communicator is no longer usable",
              describe(),
              std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - start).count()));
  }
}

void WireBucket::post(const CollectiveCall& call, const std::shared_ptr<GroupState>& g,
                      std::size_t max_message, WorkState& st) const {
  if (!node_aware(*g)) {
    // A small all_reduce bucket (one message) where libnbc runs its ring: gathered, then reduced
    // in rank order once the gather completed (GatheredAllreduce).
    if (call.kind == CollectiveKind::AllReduce && wire_bytes() > 0 && wire_bytes() <= max_message) {
      const auto count = static_cast<int>(wire_bytes() / itemsize(wire));
      const DataCall whole =
          as_sent(call, allreduce_call(MPI_IN_PLACE, w, count, mpi_datatype(wire),
                                       mpi_op(call.op, wire), g->comm));
      if (auto gathered = post_gathered_into(st, whole)) {
        st.then = [gathered](WorkState&) { gathered->reduce(); };
        return;
      }
    }
    return start(call, *g, max_message, &st.requests);
  }
  auto t = std::make_shared<NodeAwareTransfer>(NodeAwareTransfer{*this, call, g, {}, {}, {}, {}});
  for_each_message(wire_bytes(), wire, max_message,
                   [&](std::size_t off, int n) { t->messages.emplace_back(off, n); });
  for (std::size_t s = 0; s < 3; ++s)
    t->first[s] = g->nodes.drawn[s].fetch_add(t->messages.size(), std::memory_order_relaxed);
  note_node_aware(t->messages.size(), false);
  advance_stages(t, st);
}

namespace {

// The group's pack buffer, taken by one sync call for as long as it runs and given back after:
// the group keeps one between calls, and two threads calling collectives at once never share it
// (the second allocates its own).
class ScratchLease {
 public:
  // At least `nbytes` (none for 0).
  ScratchLease(GroupState& g, std::size_t nbytes) : g_(g) {
    if (nbytes == 0) return;
    {
      std::lock_guard lock(g_.mu);
      scratch_ = std::move(g_.scratch);
    }
    if (!scratch_ || scratch_->nbytes < nbytes) scratch_ = std::make_shared<Storage>(nbytes);
    note_extra_bytes(nbytes);
  }
  ~ScratchLease() {
    if (!scratch_) return;
    std::lock_guard lock(g_.mu);
    if (!g_.scratch || g_.scratch->nbytes < scratch_->nbytes) g_.scratch = std::move(scratch_);
  }
  ScratchLease(const ScratchLease&) = delete;
  ScratchLease& operator=(const ScratchLease&) = delete;
  std::byte* data() const { return scratch_->data; }

 private:
  GroupState& g_;
  std::shared_ptr<Storage> scratch_;
};

}  // namespace

void run_sync(const std::shared_ptr<const BucketPlan>& plan_ptr, std::span<const LeafRef> leaves,
              const CollectiveCall& call, GroupState& g, const LeafMemory& mem) {
  const BucketPlan& plan = *plan_ptr;
  const Roles roles = roles_of(call, g.rank);
  std::size_t need = 0;
  const auto direct_ptr = direct_buckets(plan_ptr, mem);
  const std::vector<std::byte*>& direct = *direct_ptr;
  for (std::size_t b = 0; b < plan.buckets.size(); ++b)
    if (!direct[b]) need = std::max(need, plan.buckets[b].nbytes);
  // TD_SYNC_PIPELINE=1: pack bucket k+1 while bucket k is in flight as a nonblocking collective
  // (two pack buffers). Off by default: measured here, Open MPI 4.1's nonblocking allreduce is so
  // much slower than the blocking one that the overlap loses (docs/bucketing.md, benchmarks.md).
  const bool pipeline = config().sync_pipeline;
  const std::size_t slots = pipeline ? 2 : 1;
  const std::size_t stride = (need + 63) / 64 * 64;  // each slot starts aligned for any dtype
  const ScratchLease scratch(g, need > 0 ? stride * slots : 0);
  auto bucket = [&](std::size_t b) {
    const auto& bk = plan.buckets[b];
    if (direct[b]) return WireBucket(bk.dtype, bk.nbytes, direct[b], false, call, roles, {});
    return WireBucket(bk.dtype, bk.nbytes, scratch.data() + (b % slots) * stride, true, call, roles,
                      {});
  };
  auto finish = [&](std::size_t b) {
    const auto& bk = plan.buckets[b];
    bucket(b).finish(g.size, [&](const std::byte* p) {
      if (bk.strided) {
        unpack_bucket(bk, leaves, p);
      } else {
        unpack_slots(bk, mem, p);
      }
    });
  };
  std::vector<MPI_Request> in_flight;
  for (std::size_t b = 0; b < plan.buckets.size(); ++b) {
    const auto& bk = plan.buckets[b];
    const WireBucket ib = bucket(b);
    if (ib.packed && roles.sends) {  // overlaps bucket b-1 when pipelining
      if (bk.strided) {
        pack_bucket(bk, leaves, ib.p);
      } else {
        pack_slots(bk, mem, ib.p);
      }
    }
    if (!pipeline) {
      ib.start(call, g, plan.max_message_bytes, nullptr);
      finish(b);
      continue;
    }
    std::vector<MPI_Request> started;
    ib.start(call, g, plan.max_message_bytes, &started);
    if (b > 0) {
      wait_blocking(in_flight);
      finish(b - 1);
    }
    in_flight = std::move(started);
  }
  if (pipeline && !plan.buckets.empty()) {
    wait_blocking(in_flight);
    finish(plan.buckets.size() - 1);
  }
}

namespace {

// The finish step's copy-back of a packed bucket, from the Work's own tensor handles (so it stays
// valid even if the dict was dropped meanwhile): the bucket renumbered onto them.
void unpack_into_handles(const BucketPlan::Bucket& bucket, std::vector<Tensor>& handles,
                         const std::byte* p) {
  static const Key kLeaf("<leaf>");
  std::vector<LeafRef> refs;
  refs.reserve(bucket.slots.size());
  for (auto& t : handles) refs.push_back({&kLeaf, &t, 0});
  BucketPlan::Bucket local = bucket;
  for (std::size_t s = 0; s < local.slots.size(); ++s) local.slots[s].leaf = s;
  unpack_bucket(local, refs, p);
}

}  // namespace

// all_reduce / reduce / broadcast, one Work per bucket, in place or through a pack buffer the
// Work owns; the finish step widens (compressed), divides (AVG) and copies back.
std::vector<Work> run_buckets(const BucketPlan& plan, std::span<const LeafRef> leaves,
                              const CollectiveCall& call, const std::shared_ptr<GroupState>& g,
                              Clock::time_point deadline, bool async_op,
                              std::optional<DType> wire) {
  const Roles roles = roles_of(call, g->rank);
  BucketRunner runner(deadline, async_op);
  std::size_t buffered = 0;  // every Work owns its pack buffer until it completes
  for (std::size_t b = 0; b < plan.buckets.size(); ++b) {
    const auto& bk = plan.buckets[b];
    auto st = runner.state(call.name, plan, b, leaves, g->size);
    // Reserved: a reallocation would move the copies, which counts in the leaves' storage
    // versions and costs the next call a compare per leaf (core/dict_internal.hpp LeafVersions).
    st->keep_alive.reserve(st->keep_alive.size() + bk.slots.size());
    for (const auto& slot : bk.slots) st->keep_alive.push_back(*leaves[slot.leaf].tensor);
    bool packed = false;
    std::byte* p = BucketRunner::place(bk, leaves, *st, roles.sends, &packed);
    if (packed) buffered += bk.nbytes;
    WireBucket ib(bk.dtype, bk.nbytes, p, packed, call, roles, wire);
    if (ib.compressed) {  // float buckets travel as 16-bit values in a buffer of their own
      auto buf = std::make_shared<Storage>(ib.wire_bytes());
      ib.w = buf->data;
      st->held.push_back(std::move(buf));
      ib.compress_into_wire(call, g->size);
    }
    auto bucket = std::make_shared<BucketPlan::Bucket>(bk);
    WorkState* raw = st.get();
    st->finish = [raw, bucket, ib, size = g->size] {
      ib.finish(size, [&](const std::byte* from) {
        unpack_into_handles(*bucket, raw->keep_alive, from);
      });
    };
    runner.run(st, [&](std::vector<MPI_Request>* reqs) {
      if (reqs) return ib.post(call, g, plan.max_message_bytes, *st);
      ib.start(call, *g, plan.max_message_bytes, nullptr);
    });
  }
  note_extra_bytes(buffered);
  return runner.works();
}

BucketRunner::BucketRunner(Clock::time_point deadline, bool async_op)
    : deadline_(deadline), async_(async_op) {}

std::shared_ptr<WorkState> BucketRunner::state(std::string_view what, const BucketPlan& plan,
                                               std::size_t b, std::span<const LeafRef> leaves,
                                               int group_size) const {
  auto st = std::make_shared<WorkState>();
  st->deadline = deadline_;
  st->describe = [d = bucket_description(what, plan, b, leaves, group_size)] { return d; };
  return st;
}

std::byte* BucketRunner::place(const BucketPlan::Bucket& bk, std::span<const LeafRef> leaves,
                               WorkState& st, bool pack_from_leaves, bool* packed,
                               std::size_t nbytes) {
  const bool direct = bucket_is_contiguous_in_memory(bk, leaves);
  if (packed) *packed = !direct;
  if (direct) return TensorAccess::data(*leaves[bk.slots[0].leaf].tensor, itemsize(bk.dtype));
  auto buf = std::make_shared<Storage>(nbytes != 0 ? nbytes : bk.nbytes);
  if (pack_from_leaves) pack_bucket(bk, leaves, buf->data);
  std::byte* p = buf->data;
  st.held.push_back(std::move(buf));
  return p;
}

void BucketRunner::run(const std::shared_ptr<WorkState>& st,
                       const std::function<void(std::vector<MPI_Request>*)>& start) {
  if (!async_) {
    {
      const BlockingPhase watched(st->deadline, st->describe);
      start(nullptr);
    }
    st->wait();  // no requests: runs the finish step now (and releases the buffers)
    return;
  }
  start(&st->requests);
  states_.push_back(st);
  works_.push_back(WorkAccess::wrap(st));
}

void BucketRunner::run_one(const std::shared_ptr<WorkState>& st,
                           const std::function<void(MPI_Request*)>& start) {
  run(st, [&](std::vector<MPI_Request>* reqs) {
    if (reqs == nullptr) return start(nullptr);
    reqs->push_back(MPI_REQUEST_NULL);
    start(&reqs->back());
  });
}

std::vector<Work> BucketRunner::works() {
  // Only now does the progress thread see them: while this thread is still starting buckets,
  // a second thread inside MPI makes every MPI_I* call here wait on Open MPI's locks (measured:
  // starting 64 buckets took 20x longer with the thread polling than without it).
  progress_add(states_);
  states_.clear();
  return std::move(works_);
}

std::string bucket_description(std::string_view what, const BucketPlan& plan, std::size_t b,
                               std::span<const LeafRef> leaves, int group_size) {
  const auto& bk = plan.buckets[b];
  return fmt::format(
      "{} of bucket {} of {} ({}, {} B, {} leaves, first key '{}') in a group of {} ranks", what, b,
      plan.buckets.size(), name(bk.dtype), bk.nbytes, bk.slots.size(),
      leaves[bk.slots[0].leaf].key->str(), group_size);
}

int mpi_count(std::size_t count, std::string_view what) {
  if (count > static_cast<std::size_t>(INT_MAX))
    throw Error(fmt::format("{}: {} elements are too many for one message (at most {})", what,
                            count, INT_MAX));
  return static_cast<int>(count);
}

}  // namespace td::detail

namespace td {

PackerStats packer_stats() {
  using detail::g_stats;
  using detail::g_stats_mu;
  std::lock_guard lock(g_stats_mu);
  return g_stats;
}

void reset_packer_stats() {
  using detail::g_stats;
  using detail::g_stats_mu;
  std::lock_guard lock(g_stats_mu);
  g_stats = {};
}

}  // namespace td
