// reduce / all_reduce / broadcast of a Tensor and a TensorDict: sparse leaves, then the dense
// buckets (comm/runner.cpp).
#include <algorithm>
#include <cstring>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "comm/engine_internal.hpp"
#include "core/config.hpp"
#include "runtime/deadline.hpp"
#include "runtime/log.hpp"
#include "runtime/mpi_types.hpp"

namespace td::detail {

namespace {

// A sparse leaf's entries as they travel: `nnz` indices as [nnz, ndim] int64 (entry-major, so
// ranks' parts concatenate) and their [nnz] values.
struct SparseEntries {
  std::int64_t nnz = 0;
  Tensor indices;
  Tensor values;
};

// The entries of a sparse leaf.
SparseEntries entries_of(const Tensor& leaf) {
  return {leaf.nnz(), leaf.indices().transpose(0, 1).contiguous(), leaf.values().contiguous()};
}

// A count of entries (or of their index elements) as MPI's int, checked.
int entry_count(std::int64_t n, std::string_view counted) {
  return mpi_count(static_cast<std::size_t>(n), counted);
}

// The root's entries to every rank: their number, then indices and values (into fresh tensors
// off the root).
void broadcast_entries(SparseEntries& e, std::int64_t ndim, DType dtype, const CollectiveCall& call,
                       const GroupState& g, std::string_view counted) {
  post(bcast_call(&e.nnz, 1, MPI_INT64_T, call.root, g.comm), nullptr);
  if (g.rank != call.root) {
    e.indices = Tensor::empty({e.nnz, ndim}, DType::Int64);
    e.values = Tensor::empty({e.nnz}, dtype);
  }
  post(bcast_call(e.indices.raw_data(), entry_count(e.nnz * ndim, counted), MPI_INT64_T, call.root,
                  g.comm),
       nullptr);
  post(bcast_call(e.values.raw_data(), entry_count(e.nnz, counted), mpi_datatype(dtype), call.root,
                  g.comm),
       nullptr);
}

// Every rank's entries, rank after rank, to every rank (`to`: nullopt) or to one: their numbers
// first, then indices and values. Empty where nothing is received.
SparseEntries gather_entries(const SparseEntries& mine, std::int64_t ndim, DType dtype,
                             std::optional<int> to, const GroupState& g, std::string_view counted) {
  const bool gathers = !to || g.rank == *to;
  std::vector<std::int64_t> counts(static_cast<std::size_t>(g.size));
  post(gather_to(to, &mine.nnz, 1, MPI_INT64_T, counts.data(), 1, MPI_INT64_T, g.comm), nullptr);
  std::vector<int> ecount(counts.size()), edispl(counts.size()), vcount(counts.size()),
      vdispl(counts.size());
  std::int64_t total = 0;
  if (gathers) {
    for (std::size_t r = 0; r < counts.size(); ++r) {
      vcount[r] = entry_count(counts[r], counted);
      vdispl[r] = entry_count(total, counted);
      ecount[r] = entry_count(counts[r] * ndim, counted);
      edispl[r] = entry_count(total * ndim, counted);
      total += counts[r];
    }
    entry_count(total * ndim, counted);
  }
  SparseEntries all{total, Tensor::empty({gathers ? total * ndim : 0}, DType::Int64),
                    Tensor::empty({gathers ? total : 0}, dtype)};
  const MPI_Datatype vtype = mpi_datatype(dtype);
  post(gatherv_to(to, mine.indices.raw_data(), entry_count(mine.nnz * ndim, counted), MPI_INT64_T,
                  all.indices.raw_data(), ecount.data(), edispl.data(), MPI_INT64_T, g.comm),
       nullptr);
  post(gatherv_to(to, mine.values.raw_data(), entry_count(mine.nnz, counted), vtype,
                  all.values.raw_data(), vcount.data(), vdispl.data(), vtype, g.comm),
       nullptr);
  return all;
}

// The leaf made of received entries: a reduction's coalesced (duplicates summed) and, for AVG,
// divided by the group size; a broadcast's as they are.
Tensor sparse_result(const SparseEntries& e, const Shape& shape, const CollectiveCall& call,
                     int group_size) {
  const auto ndim = static_cast<std::int64_t>(shape.size());
  Tensor indices = e.indices.view({e.nnz, ndim}).transpose(0, 1).contiguous();
  Tensor result = Tensor::sparse_coo(indices, e.values, shape);
  if (call.kind == CollectiveKind::Broadcast) return result;
  result = result.coalesce();
  if (call.op == ReduceOp::AVG) {
    Tensor v = result.values();
    divide_in_place(v.raw_data(), v.numel(), v.dtype(), group_size);
  }
  return result;
}

}  // namespace

// Sparse leaves: every rank's (index, value) entries are gathered and duplicates summed, so the
// result, densified, equals the dense reduction of the densified inputs. Never bucketed.
void run_sparse(Tensor& leaf, const CollectiveCall& call, GroupState& g) {
  const Shape shape = leaf.shape();
  const DType dtype = leaf.dtype();
  const auto ndim = static_cast<std::int64_t>(shape.size());
  const bool root = g.rank == call.root;
  const std::string counted = fmt::format("{}: a sparse leaf's entries", call.name);
  SparseEntries
      mine;  // what this rank sends: every rank's of a reduction, the root's of a broadcast
  if (call.kind != CollectiveKind::Broadcast || root) mine = entries_of(leaf);
  if (call.kind == CollectiveKind::Broadcast) {
    broadcast_entries(mine, ndim, dtype, call, g, counted);
    if (!root) leaf = sparse_result(mine, shape, call, g.size);
    return;
  }
  const std::optional<int> to =
      call.kind == CollectiveKind::AllReduce ? std::nullopt : std::optional<int>(call.root);
  const SparseEntries all = gather_entries(mine, ndim, dtype, to, g, counted);
  if (call.kind == CollectiveKind::AllReduce || root)
    leaf = sparse_result(all, shape, call, g.size);
}

void run_sparse_leaves(const BucketPlan& plan, std::span<const LeafRef> leaves,
                       const CollectiveCall& call, GroupState& g) {
  for (std::size_t i : plan.sparse_leaves) run_sparse(*leaves[i].tensor, call, g);
}

std::vector<Work> run_collective(std::span<const LeafRef> leaves, const CollectiveCall& call,
                                 const CollectiveOptions& opts, LayoutCache* cache,
                                 std::string extra_arg_error) {
  // Named members, not a structured binding: clang 14 cannot capture those in a lambda.
  const PreparedCollective prepared =
      prepare_collective(leaves, call, opts, std::move(extra_arg_error), cache);
  const std::shared_ptr<GroupState>& g = prepared.group;
  const std::shared_ptr<const BucketPlan>& plan = prepared.plan;
  const Clock::time_point deadline = prepared.deadline;
  const std::shared_ptr<const LeafMemory>& memory = prepared.memory;
  const bool spans = prepared.spans_everywhere;
  const std::function<std::string()> describe = [&, n = plan->buckets.size()] {
    return fmt::format("{} ({} buckets, {} sparse leaves, first key '{}') in a group of {} ranks",
                       call.name, n, plan->sparse_leaves.size(),
                       leaves.empty() ? std::string("<none>") : leaves[0].key->str(), g->size);
  };
  // Sparse leaves run first, blocking, before any dense bucket: their sizes are only known after
  // a first exchange, and a sparse leaf's values may be (a view of) a dense leaf of the same
  // dict, which must not be reduced before the sparse pass has read it.
  if (!plan->sparse_leaves.empty()) {
    const BlockingPhase watched(deadline, describe);
    run_sparse_leaves(*plan, leaves, call, *g);
  }
  // Async or compressed: one BucketRunner loop; the sync uncompressed path below keeps its one
  // reused pack buffer (or the consolidated spans). Node-aware, the async loop pipelines each
  // bucket's stages as nonblocking collectives, and so does a sync call with TD_SYNC_PIPELINE=1
  // (then it waits for them here); a plain sync call runs them as blocking collectives below.
  const bool nodes = node_aware(*g);
  const bool nodes_async = nodes && config().sync_pipeline;
  if (nodes && !opts.async_op && !nodes_async) await_node_stages(*g, deadline, describe);
  if (opts.async_op || opts.compression != Compression::None || nodes_async) {
    std::optional<DType> wire;
    if (opts.compression != Compression::None) wire = wire_dtype(opts.compression);
    std::vector<Work> works =
        run_buckets(*plan, leaves, call, g, deadline, opts.async_op || nodes_async, wire);
    if (opts.async_op) return works;
    for (Work& w : works) w.wait();
    return {};
  }
  const BlockingPhase watched(deadline, describe);
  if (spans) {
    const std::size_t n_spans = memory->spans.size();  // (a lambda may not capture a binding)
    log_debug([&call, n_spans] {
      return fmt::format("{}: every rank consolidated: {} spans of one dtype each, no buckets",
                         call.name, n_spans);
    });
    run_spans(*plan, call, *g, *memory);
  } else {
    run_sync(plan, leaves, call, *g, *memory);
  }
  return {};
}

}  // namespace td::detail

namespace td {

// ---- the public entry points -----------------------------------------------------------------

const CollectiveOptions& detail::default_collective_options() {
  static const CollectiveOptions kDefaults{};
  return kDefaults;
}

namespace {
std::vector<Work> run_on_tensor(Tensor& t, const detail::CollectiveCall& call,
                                const CollectiveOptions& opts) {
  static const Key kKey("<tensor>");
  const detail::LeafRef ref{&kKey, &t, detail::hash_key(kKey)};
  return detail::run_collective(std::span<const detail::LeafRef>(&ref, 1), call, opts);
}

Work single(std::vector<Work> works) {
  if (works.empty()) return Work();
  return std::move(works.front());
}
}  // namespace

Work reduce(Tensor& t, int dst, ReduceOp op, const CollectiveOptions& opts) {
  return single(run_on_tensor(t, {detail::CollectiveKind::Reduce, op, dst, "reduce", false}, opts));
}
Work all_reduce(Tensor& t, ReduceOp op, const CollectiveOptions& opts) {
  return single(
      run_on_tensor(t, {detail::CollectiveKind::AllReduce, op, 0, "all_reduce", false}, opts));
}
Work broadcast(Tensor& t, int src, const CollectiveOptions& opts) {
  return single(run_on_tensor(
      t, {detail::CollectiveKind::Broadcast, ReduceOp::SUM, src, "broadcast", false}, opts));
}

namespace {
std::vector<Work> run_on_dict(TensorDict& d, const detail::CollectiveCall& call,
                              const CollectiveOptions& opts) {
  auto in = detail::dict_leaves(d);
  return detail::run_collective(in.leaves, call, opts, in.cache, std::move(in.error));
}
}  // namespace

std::vector<Work> TensorDict::all_reduce(ReduceOp op, const CollectiveOptions& opts) {
  return run_on_dict(
      *this, {detail::CollectiveKind::AllReduce, op, 0, "TensorDict.all_reduce", true}, opts);
}
std::vector<Work> TensorDict::reduce(int dst, ReduceOp op, const CollectiveOptions& opts) {
  return run_on_dict(*this, {detail::CollectiveKind::Reduce, op, dst, "TensorDict.reduce", true},
                     opts);
}
std::vector<Work> TensorDict::broadcast(int src, const CollectiveOptions& opts) {
  return run_on_dict(
      *this, {detail::CollectiveKind::Broadcast, ReduceOp::SUM, src, "TensorDict.broadcast", true},
      opts);
}

// Agreed like every collective: a rank in barrier while the others are in another collective
// of the group is a LayoutMismatchError on every rank ("ranks called different collectives"),
// where a bare MPI_Ibarrier could complete against the others' collective and let it go on
// with wrong data.
void barrier(const std::optional<ProcessGroup>& group) {
  CollectiveOptions opts;
  opts.group = group;
  const auto prepared = detail::prepare_collective(
      {},
      detail::CollectiveCall{detail::CollectiveKind::Barrier, ReduceOp::SUM, 0, "barrier", false},
      opts);
  const detail::GroupState& g = *prepared.group;
  const auto timeout = detail::timeout_of(opts);
  detail::Step step(
      prepared.deadline,
      [&] {
        return fmt::format("barrier of a group of {} ranks did not complete within {} ms", g.size,
                           timeout.count());
      },
      {}, "barrier");
  step.post(detail::barrier_call(g.comm));
  step.wait();
}

}  // namespace td
