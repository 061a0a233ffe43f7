// Gather/scatter collectives of TensorDict: all_gather / gather, scatter and reduce_scatter.
// They take the engine's path (layout agreement across the group, then the bucket plan) and move
// each bucket with one MPI call; the agreement has already made sure that every rank of the group
// joined, so the data calls cannot wait for a rank that never comes.
#include <algorithm>
#include <climits>
#include <cstring>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <numeric>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "comm/collective_engine.hpp"
#include "runtime/mpi_types.hpp"
#include "tensordict/tensor_dict.hpp"

namespace td {

namespace {

using detail::CollectiveCall;
using detail::CollectiveKind;
using detail::DictAccess;
using detail::LeafRef;
using Clock = std::chrono::steady_clock;

// What is wrong with `part` as a dict of `layout`'s layout (keys, dtypes, shapes), or "".
std::string layout_difference(std::span<const LeafRef> layout, std::span<const LeafRef> part) {
  for (const auto& ref : part) {
    if (!ref.tensor->defined())
      return fmt::format("key '{}' holds an undefined tensor", ref.key->str());
    if (ref.tensor->is_sparse())
      return fmt::format("key '{}' is a sparse tensor; to_dense() it first", ref.key->str());
  }
  const auto d =
      detail::first_difference({detail::describe_leaves(layout), detail::describe_leaves(part)});
  if (!d) return {};
  if (d->holds[1].empty()) return fmt::format("it has no key '{}'", d->key);
  if (d->holds[0].empty())
    return fmt::format("it has key '{}', which this TensorDict does not have", d->key);
  return fmt::format("key '{}' is {} instead of {}", d->key, d->holds[1], d->holds[0]);
}

// Index of an earlier leaf viewing exactly the elements of leaf i (an alias the plan skips), or -1.
std::int64_t alias_target(std::span<const LeafRef> leaves, std::size_t i) {
  const Tensor& t = *leaves[i].tensor;
  if (!t.defined() || t.is_sparse() || t.numel() == 0) return -1;
  for (std::size_t j = 0; j < i; ++j) {
    const Tensor& o = *leaves[j].tensor;
    if (o.defined() && !o.is_sparse() && o.shares_storage_with(t) &&
        o.storage_offset() == t.storage_offset() && o.dtype() == t.dtype() &&
        o.shape() == t.shape() && o.strides() == t.strides())
      return static_cast<std::int64_t>(j);
  }
  return -1;
}

// A dict of d's structure (sub-dicts included, empty ones too) whose leaves are `by_key[full
// key]` and whose batch sizes are batch(d's).
TensorDict rebuild(const TensorDict& d, std::vector<std::string>& prefix,
                   const std::map<Key, Tensor>& by_key,
                   const std::function<Shape(const Shape&)>& batch) {
  TensorDict out(batch(d.batch_size()));
  for (const Key& k : d.keys()) {
    prefix.push_back(k.parts().back());
    if (d.is_dict(k)) {
      out.set(k, rebuild(d.get_dict(k), prefix, by_key, batch));
    } else {
      out.set(k, by_key.at(Key(prefix)));
    }
    prefix.pop_back();
  }
  return out;
}

TensorDict rebuild(const TensorDict& d, const std::map<Key, Tensor>& by_key,
                   const std::function<Shape(const Shape&)>& batch) {
  std::vector<std::string> prefix;
  return rebuild(d, prefix, by_key, batch);
}

// Fresh leaves for the result of a collective: make(i) for each leaf in canonical order, except
// that an alias of an earlier leaf gets that leaf's result (as in the input). Only the leaves the
// plan skipped (aliases and empty leaves) are searched for the leaf they alias.
std::vector<Tensor> fresh_leaves(std::span<const LeafRef> leaves, const BucketPlan& plan,
                                 const std::function<Tensor(const Tensor&)>& make) {
  std::vector<char> skipped(leaves.size(), 0);
  for (const std::size_t i : plan.skipped_leaves) skipped[i] = 1;
  std::vector<Tensor> out;
  out.reserve(leaves.size());
  for (std::size_t i = 0; i < leaves.size(); ++i) {
    const std::int64_t j = skipped[i] ? alias_target(leaves, i) : -1;
    out.push_back(j >= 0 ? out[static_cast<std::size_t>(j)] : make(*leaves[i].tensor));
  }
  return out;
}

std::map<Key, Tensor> by_key(std::span<const LeafRef> leaves, const std::vector<Tensor>& ts) {
  std::map<Key, Tensor> m;
  for (std::size_t i = 0; i < leaves.size(); ++i) m.emplace(*leaves[i].key, ts[i]);
  return m;
}

// Tensors a pending bucket reads or writes, with LeafRefs over them for pack / unpack (the keys
// are not needed there). Held by the bucket's Work, so the caller's dicts may go away meanwhile.
struct Leaves {
  std::vector<Tensor> tensors;
  std::vector<LeafRef> refs;
  explicit Leaves(std::vector<Tensor> ts) : tensors(std::move(ts)) {
    static const Key kKey("<leaf>");
    refs.reserve(tensors.size());
    for (auto& t : tensors) refs.push_back({&kKey, &t, 0});
  }
  Leaves(const Leaves&) = delete;
  Leaves& operator=(const Leaves&) = delete;
};

std::vector<Tensor> handles(std::span<const LeafRef> leaves) {
  std::vector<Tensor> out;
  out.reserve(leaves.size());
  for (const auto& ref : leaves) out.push_back(*ref.tensor);
  return out;
}

std::shared_ptr<detail::Storage> storage(std::size_t nbytes) {
  return std::make_shared<detail::Storage>(nbytes);
}

// all_gather and gather, into `into[r]` (rank r's leaves in canonical order) on every rank that
// receives; `stacked` (if any) holds, per leaf, the [size, ...] tensor whose row r is into[r][i],
// so a bucket of one leaf is received straight into it.
std::vector<Work> gather_leaves(std::span<const LeafRef> leaves,
                                const detail::PreparedCollective& prepared, CollectiveKind kind,
                                int root, std::string_view what,
                                const std::vector<std::shared_ptr<Leaves>>& into,
                                const std::vector<Tensor>* stacked, bool async_op) {
  const detail::GroupState& g = *prepared.group;
  const BucketPlan& plan = *prepared.plan;
  const bool receives = kind == CollectiveKind::AllGather || g.rank == root;
  const auto size = static_cast<std::size_t>(g.size);
  auto src = std::make_shared<Leaves>(handles(leaves));
  detail::BucketRunner runner(prepared.deadline, async_op);
  for (std::size_t b = 0; b < plan.buckets.size(); ++b) {
    const auto& bk = plan.buckets[b];
    auto st = runner.state(what, plan, b, leaves, g.size);
    st->held.push_back(src);
    const std::byte* send = detail::BucketRunner::place(bk, src->refs, *st, /*pack=*/true);
    const int count = detail::mpi_count(bk.nbytes / itemsize(bk.dtype), what);
    const MPI_Datatype type = detail::mpi_datatype(bk.dtype);
    std::byte* all = nullptr;
    if (receives) {
      const bool direct = stacked && bk.slots.size() == 1 && !bk.strided;
      if (direct) {
        Tensor whole = (*stacked)[bk.slots[0].leaf];
        all = static_cast<std::byte*>(whole.raw_data());
        st->keep_alive.push_back(std::move(whole));
      } else {
        auto buf = storage(size * bk.nbytes);
        all = buf->data;
        st->held.push_back(buf);
        auto bucket = std::make_shared<BucketPlan::Bucket>(bk);
        st->finish = [bucket, into, all, size] {
          for (std::size_t r = 0; r < size; ++r)
            detail::unpack_bucket(*bucket, into[r]->refs, all + r * bucket->nbytes);
        };
      }
      for (const auto& l : into) st->held.push_back(l);
    }
    const detail::DataCall call = detail::gather_to(
        kind == CollectiveKind::AllGather ? std::nullopt : std::optional<int>(root), send, count,
        type, all, count, type, g.comm);
    runner.run_one(st, [&](MPI_Request* req) { detail::post(call, req); });
  }
  return runner.works();
}

std::vector<Work> gather_into_list(const TensorDict& self, CollectiveKind kind, int root,
                                   std::string_view what, std::vector<TensorDict>& out,
                                   const CollectiveOptions& opts) {
  auto in = detail::dict_leaves(self, /*with_cache=*/false);
  const std::span<const LeafRef> leaves = in.leaves;
  const auto prepared = detail::prepare_collective(
      leaves, CollectiveCall{kind, ReduceOp::SUM, root, what, /*from_dict=*/true}, opts,
      std::move(in.error));
  const bool receives = kind == CollectiveKind::AllGather || prepared.group->rank == root;
  std::vector<TensorDict> dicts;
  std::vector<std::shared_ptr<Leaves>> into;
  if (receives) {
    for (int r = 0; r < prepared.group->size; ++r) {
      auto ts = fresh_leaves(leaves, *prepared.plan,
                             [](const Tensor& t) { return Tensor::empty(t.shape(), t.dtype()); });
      dicts.push_back(rebuild(self, by_key(leaves, ts), [](const Shape& s) { return s; }));
      into.push_back(std::make_shared<Leaves>(std::move(ts)));
    }
  }
  auto works = gather_leaves(leaves, prepared, kind, root, what, into, nullptr, opts.async_op);
  out = std::move(dicts);
  return works;
}

}  // namespace

std::vector<TensorDict> TensorDict::all_gather(const CollectiveOptions& opts) const {
  std::vector<TensorDict> out;
  CollectiveOptions sync = opts;
  sync.async_op = false;
  gather_into_list(*this, CollectiveKind::AllGather, 0, "TensorDict.all_gather", out, sync);
  return out;
}

std::vector<Work> TensorDict::all_gather(std::vector<TensorDict>& out,
                                         const CollectiveOptions& opts) const {
  return gather_into_list(*this, CollectiveKind::AllGather, 0, "TensorDict.all_gather", out, opts);
}

std::vector<TensorDict> TensorDict::gather(int dst, const CollectiveOptions& opts) const {
  std::vector<TensorDict> out;
  CollectiveOptions sync = opts;
  sync.async_op = false;
  gather_into_list(*this, CollectiveKind::Gather, dst, "TensorDict.gather", out, sync);
  return out;
}

std::vector<Work> TensorDict::gather(int dst, std::vector<TensorDict>& out,
                                     const CollectiveOptions& opts) const {
  return gather_into_list(*this, CollectiveKind::Gather, dst, "TensorDict.gather", out, opts);
}

std::vector<Work> TensorDict::all_gather_stacked(TensorDict& out,
                                                 const CollectiveOptions& opts) const {
  constexpr std::string_view what = "TensorDict.all_gather_stacked";
  auto in = detail::dict_leaves(*this, /*with_cache=*/false);
  const std::span<const LeafRef> leaves = in.leaves;
  const auto prepared = detail::prepare_collective(
      leaves, CollectiveCall{CollectiveKind::AllGather, ReduceOp::SUM, 0, what, true}, opts,
      std::move(in.error));
  const std::int64_t n = prepared.group->size;
  auto prepend = [n](const Shape& s) {
    Shape out{n};
    out.insert(out.end(), s.begin(), s.end());
    return out;
  };
  std::vector<Tensor> stacked = fresh_leaves(leaves, *prepared.plan, [&](const Tensor& t) {
    return Tensor::empty(prepend(t.shape()), t.dtype());
  });
  std::vector<std::shared_ptr<Leaves>> into;
  for (std::int64_t r = 0; r < n; ++r) {
    std::vector<Tensor> rows;
    rows.reserve(stacked.size());
    for (std::size_t i = 0; i < stacked.size(); ++i)
      rows.push_back(stacked[i].slice(0, r, r + 1).view(leaves[i].tensor->shape()));
    into.push_back(std::make_shared<Leaves>(std::move(rows)));
  }
  TensorDict result = rebuild(*this, by_key(leaves, stacked), prepend);
  auto works = gather_leaves(leaves, prepared, CollectiveKind::AllGather, 0, what, into, &stacked,
                             opts.async_op);
  out = std::move(result);
  return works;
}

TensorDict TensorDict::all_gather_stacked(const CollectiveOptions& opts) const {
  TensorDict out;
  CollectiveOptions sync = opts;
  sync.async_op = false;
  all_gather_stacked(out, sync);
  return out;
}

TensorDict stack(const std::vector<TensorDict>& dicts) {
  if (dicts.empty()) throw std::invalid_argument("td::stack: no TensorDict to stack");
  const std::vector<LeafRef>& first = DictAccess::canonical(dicts[0]);
  for (std::size_t r = 1; r < dicts.size(); ++r) {
    const std::string diff = layout_difference(first, DictAccess::canonical(dicts[r]));
    if (!diff.empty())
      throw LayoutMismatchError(
          fmt::format("td::stack: dicts[{}] does not have dicts[0]'s layout: {}", r, diff));
    if (dicts[r].batch_size() != dicts[0].batch_size())
      throw LayoutMismatchError(fmt::format("td::stack: dicts[{}] has batch size {}, dicts[0] {}",
                                            r, detail::shape_str(dicts[r].batch_size()),
                                            detail::shape_str(dicts[0].batch_size())));
  }
  const auto n = static_cast<std::int64_t>(dicts.size());
  auto prepend = [n](const Shape& s) {
    Shape out{n};
    out.insert(out.end(), s.begin(), s.end());
    return out;
  };
  std::vector<std::span<const LeafRef>> all;  // each dict's leaves, looked up once
  all.reserve(dicts.size());
  for (const TensorDict& d : dicts) all.emplace_back(DictAccess::canonical(d));
  std::vector<Tensor> stacked;
  for (std::size_t i = 0; i < first.size(); ++i) {
    const Tensor& t = *first[i].tensor;
    if (!t.defined() || t.is_sparse())
      throw std::invalid_argument(fmt::format("td::stack: key '{}' is {}", first[i].key->str(),
                                              t.defined() ? "sparse" : "undefined"));
    Tensor s = Tensor::empty(prepend(t.shape()), t.dtype());
    for (std::int64_t r = 0; r < n; ++r)
      s.slice(0, r, r + 1).view(t.shape()).copy_(*all[static_cast<std::size_t>(r)][i].tensor);
    stacked.push_back(std::move(s));
  }
  return rebuild(dicts[0], by_key(first, stacked), prepend);
}

std::vector<Work> TensorDict::scatter(int src, const std::vector<TensorDict>& parts,
                                      const CollectiveOptions& opts) {
  constexpr std::string_view what = "TensorDict.scatter";
  auto in = detail::dict_leaves(*this, /*with_cache=*/false);
  const std::span<const LeafRef> leaves = in.leaves;
  const auto group = detail::group_of(opts);
  const bool is_src = group->comm != MPI_COMM_NULL && group->rank == src;

  // On src: every part must have this dict's layout; its leaves are what is packed (any
  // strides: the packer follows each part's own).
  std::string err = std::move(in.error);
  std::vector<std::shared_ptr<Leaves>> from;
  if (is_src && err.empty()) {
    if (parts.size() != static_cast<std::size_t>(group->size)) {
      err = fmt::format("{} parts for a group of {} ranks (one part per rank)", parts.size(),
                        group->size);
    } else {
      for (std::size_t r = 0; r < parts.size(); ++r) {
        auto part = detail::dict_leaves(parts[r], /*with_cache=*/false);
        if (!part.error.empty()) {
          err = fmt::format("parts[{}]: {}", r, part.error);
          break;
        }
        const std::span<const LeafRef> pl = part.leaves;
        const std::string diff = layout_difference(leaves, pl);
        if (!diff.empty()) {
          err = fmt::format("parts[{}] does not have this TensorDict's layout: {}", r, diff);
          break;
        }
        from.push_back(std::make_shared<Leaves>(handles(pl)));
      }
    }
  }
  const auto prepared = detail::prepare_collective(
      leaves, CollectiveCall{CollectiveKind::Scatter, ReduceOp::SUM, src, what, true}, opts,
      std::move(err));
  const detail::GroupState& g = *prepared.group;
  const BucketPlan& plan = *prepared.plan;
  const auto size = static_cast<std::size_t>(g.size);
  auto mine = std::make_shared<Leaves>(handles(leaves));
  detail::BucketRunner runner(prepared.deadline, opts.async_op);
  for (std::size_t b = 0; b < plan.buckets.size(); ++b) {
    const auto& bk = plan.buckets[b];
    auto st = runner.state(what, plan, b, leaves, g.size);
    st->held.push_back(mine);
    const int count = detail::mpi_count(bk.nbytes / itemsize(bk.dtype), what);
    const MPI_Datatype type = detail::mpi_datatype(bk.dtype);
    std::byte* all = nullptr;
    if (is_src) {
      auto buf = storage(size * bk.nbytes);
      all = buf->data;
      st->held.push_back(buf);
      for (std::size_t r = 0; r < size; ++r)
        detail::pack_bucket(bk, from[r]->refs, all + r * bk.nbytes);
    }
    bool packed = false;
    std::byte* recv = detail::BucketRunner::place(bk, mine->refs, *st, /*pack=*/false, &packed);
    if (packed) {
      auto bucket = std::make_shared<BucketPlan::Bucket>(bk);
      st->finish = [bucket, mine, recv] { detail::unpack_bucket(*bucket, mine->refs, recv); };
    }
    const MPI_Comm comm = g.comm;
    runner.run_one(st, [&](MPI_Request* req) {
      detail::post(detail::scatter_call(all, count, type, recv, count, type, src, comm), req);
    });
  }
  // Skipped leaves are empty or aliases of an earlier leaf, whose storage they share.
  return runner.works();
}

namespace {

// How reduce_scatter splits every leaf's first dimension among the ranks: evenly (rank r gets
// rows [r n/size, (r+1) n/size) of a leaf of n rows), or by rows_per_rank (`first` non-empty:
// rank r gets rows [first[r], first[r+1]) of every leaf).
struct RowSplit {
  int size = 1;
  std::vector<std::int64_t> first;

  bool even() const { return first.empty(); }
  // Rows of a leaf of `rows` rows that rank r receives.
  std::int64_t rows_of(std::int64_t rows, std::size_t r) const {
    return even() ? rows / size : first[r + 1] - first[r];
  }
  // Byte offset and length of rank r's rows in a contiguous leaf of `nbytes` bytes, `rows` rows.
  std::pair<std::size_t, std::size_t> bytes_of(std::size_t nbytes, std::int64_t rows,
                                               std::size_t r) const {
    const std::size_t row = nbytes / static_cast<std::size_t>(rows);
    const auto first_row = static_cast<std::size_t>(even() ? rows / size * r : first[r]);
    return {row * first_row, row * static_cast<std::size_t>(rows_of(rows, r))};
  }
};

// What every bucket of one reduce_scatter call shares.
struct RowScatter {
  const detail::GroupState& g;
  ReduceOp op;
  const RowSplit& split;
  std::string_view what;
  std::shared_ptr<Leaves> src;     // the leaves, which the buckets read
  std::shared_ptr<Leaves> shards;  // this rank's rows of each leaf, reduced
};

// Bytes of rank r's rows of each of a bucket's leaves (of `rows` rows each).
std::vector<std::size_t> rank_bytes(const BucketPlan::Bucket& bk,
                                    const std::vector<std::int64_t>& rows, const RowSplit& split,
                                    std::size_t r) {
  std::vector<std::size_t> out;
  for (std::size_t s = 0; s < bk.slots.size(); ++s)
    out.push_back(split.bytes_of(bk.slots[s].nbytes, rows[s], r).second);
  return out;
}

// A bucket's send buffer, rank-major: rank r's rows of each of the bucket's leaves, back to
// back, so MPI hands each rank its rows packed like the bucket. A bucket of one contiguous leaf
// is that already; the others are copied into a buffer `st` holds.
const std::byte* rank_major(const BucketPlan::Bucket& bk, const Leaves& src,
                            const std::vector<std::int64_t>& rows, const RowSplit& split,
                            std::size_t size, detail::WorkState& st) {
  if (bk.slots.size() == 1 && !bk.strided)
    return static_cast<const std::byte*>(src.tensors[bk.slots[0].leaf].raw_data());
  auto buf = storage(bk.nbytes);
  st.held.push_back(buf);
  std::byte* to = buf->data;
  std::vector<Tensor> contiguous;
  for (const auto& slot : bk.slots) contiguous.push_back(src.tensors[slot.leaf].contiguous());
  for (std::size_t r = 0; r < size; ++r) {
    for (std::size_t s = 0; s < bk.slots.size(); ++s) {
      const auto [off, n] = split.bytes_of(bk.slots[s].nbytes, rows[s], r);
      std::memcpy(to, static_cast<const std::byte*>(contiguous[s].raw_data()) + off, n);
      to += n;
    }
  }
  return buf->data;
}

// Where this rank's reduced rows of a bucket arrive: the shard itself for a bucket of one leaf,
// else a buffer of `block` bytes `st` holds.
std::byte* shard_destination(const BucketPlan::Bucket& bk, Leaves& shards, std::size_t block,
                             detail::WorkState& st) {
  if (bk.slots.size() == 1)
    return static_cast<std::byte*>(shards.tensors[bk.slots[0].leaf].raw_data());
  auto buf = storage(std::max<std::size_t>(block, 1));
  st.held.push_back(buf);
  return buf->data;
}

// A bucket's finish step: AVG's division of the `block` bytes at `recv`, then, unless they
// arrived in their shard, each leaf's rows (`mine`: bytes per leaf) copied into it.
std::function<void()> shard_finish(const BucketPlan::Bucket& bk, std::shared_ptr<Leaves> shards,
                                   std::byte* recv, std::size_t block, bool avg, int divisor,
                                   std::vector<std::size_t> mine) {
  auto bucket = std::make_shared<BucketPlan::Bucket>(bk);
  const bool direct = bk.slots.size() == 1;
  const std::size_t isz = itemsize(bk.dtype);
  return [bucket, shards = std::move(shards), recv, block, direct, avg, divisor,
          mine = std::move(mine), isz] {
    if (avg)
      detail::divide_in_place(recv, static_cast<std::int64_t>(block / isz), bucket->dtype, divisor);
    if (direct) return;
    const std::byte* from = recv;
    for (std::size_t s = 0; s < bucket->slots.size(); ++s) {
      std::memcpy(shards->tensors[bucket->slots[s].leaf].raw_data(), from, mine[s]);
      from += mine[s];
    }
  };
}

// Bucket b of a reduce_scatter: one MPI_Reduce_scatter_block (even split) or MPI_Reduce_scatter
// (per-rank counts) from the rank-major send buffer into this rank's shards.
void reduce_scatter_bucket(detail::BucketRunner& runner, const BucketPlan& plan, std::size_t b,
                           std::span<const LeafRef> leaves, const RowScatter& rs) {
  const auto& bk = plan.buckets[b];
  const std::size_t isz = itemsize(bk.dtype);
  const auto size = static_cast<std::size_t>(rs.g.size);
  const auto me = static_cast<std::size_t>(rs.g.rank);
  auto st = runner.state(rs.what, plan, b, leaves, rs.g.size);
  st->held.push_back(rs.src);
  st->held.push_back(rs.shards);
  // Leaves with no elements are not in the plan: every slot's leaf has rows > 0.
  std::vector<std::int64_t> rows;
  for (const auto& slot : bk.slots) rows.push_back(rs.src->tensors[slot.leaf].shape()[0]);
  auto counts = std::make_shared<std::vector<int>>();
  for (std::size_t r = 0; r < size; ++r) {
    const std::vector<std::size_t> theirs = rank_bytes(bk, rows, rs.split, r);
    const std::size_t n = std::accumulate(theirs.begin(), theirs.end(), std::size_t{0});
    counts->push_back(detail::mpi_count(n / isz, rs.what));
  }
  st->held.push_back(counts);
  const std::byte* send = rank_major(bk, *rs.src, rows, rs.split, size, *st);
  const std::size_t block = static_cast<std::size_t>((*counts)[me]) * isz;
  std::byte* recv = shard_destination(bk, *rs.shards, block, *st);
  st->finish = shard_finish(bk, rs.shards, recv, block, rs.op == ReduceOp::AVG, rs.g.size,
                            rank_bytes(bk, rows, rs.split, me));
  const MPI_Datatype type = detail::mpi_datatype(bk.dtype);
  const MPI_Op mop = detail::mpi_op(rs.op, bk.dtype);
  const int* c = counts->data();
  const detail::DataCall call =
      rs.split.even() ? detail::reduce_scatter_block_call(send, recv, c[0], type, mop, rs.g.comm)
                      : detail::reduce_scatter_call(send, recv, c, type, mop, rs.g.comm);
  runner.run_one(st, [&](MPI_Request* req) { detail::post(call, req); });
}

// Both reduce_scatter forms: checks (`err`: this rank's bad argument), agreement, this rank's
// shards as fresh leaves of a dict of this one's structure (`out`), then the buckets.
std::vector<Work> reduce_scatter_rows(const TensorDict& self, std::span<const LeafRef> leaves,
                                      TensorDict& out, ReduceOp op, const RowSplit& split,
                                      std::string_view what, std::string err,
                                      const CollectiveOptions& opts) {
  const auto prepared = detail::prepare_collective(
      leaves, CollectiveCall{CollectiveKind::ReduceScatter, op, 0, what, true}, opts,
      std::move(err));
  const detail::GroupState& g = *prepared.group;
  const BucketPlan& plan = *prepared.plan;
  const auto me = static_cast<std::size_t>(g.rank);

  auto shards = std::make_shared<Leaves>(fresh_leaves(leaves, plan, [&](const Tensor& t) {
    Shape s = t.shape();
    s[0] = split.rows_of(s[0], me);
    return Tensor::empty(s, t.dtype());
  }));
  TensorDict result = rebuild(self, by_key(leaves, shards->tensors), [&](const Shape& s) {
    Shape b = s;
    if (!b.empty()) b[0] = split.rows_of(b[0], me);
    return b;
  });
  const RowScatter rs{g, op, split, what, std::make_shared<Leaves>(handles(leaves)), shards};
  detail::BucketRunner runner(prepared.deadline, opts.async_op);
  for (std::size_t b = 0; b < plan.buckets.size(); ++b)
    reduce_scatter_bucket(runner, plan, b, leaves, rs);
  out = std::move(result);
  return runner.works();
}

}  // namespace

std::vector<Work> TensorDict::reduce_scatter(TensorDict& out, ReduceOp op,
                                             const CollectiveOptions& opts) const {
  constexpr std::string_view what = "TensorDict.reduce_scatter";
  auto in = detail::dict_leaves(*this, /*with_cache=*/false);
  const std::span<const LeafRef> leaves = in.leaves;
  const int group_size = detail::group_of(opts)->size;
  std::string err = std::move(in.error);
  for (const auto& ref : leaves) {
    const Tensor& t = *ref.tensor;
    if (!t.defined() || t.is_sparse() || group_size <= 0) continue;  // prepare_collective says
    if (t.dim() == 0) {
      err = fmt::format("key '{}' is a 0-d tensor, which has no first dimension to split",
                        ref.key->str());
    } else if (t.shape()[0] % group_size != 0) {
      err = fmt::format(
          "key '{}' has a first dimension of {}, which is not divisible by the group size {}",
          ref.key->str(), t.shape()[0], group_size);
    }
    if (!err.empty()) break;
  }
  return reduce_scatter_rows(*this, leaves, out, op, RowSplit{std::max(group_size, 1), {}}, what,
                             std::move(err), opts);
}

TensorDict TensorDict::reduce_scatter(ReduceOp op, const CollectiveOptions& opts) const {
  TensorDict out;
  CollectiveOptions sync = opts;
  sync.async_op = false;
  reduce_scatter(out, op, sync);
  return out;
}

TensorDict TensorDict::reduce_scatter(const std::vector<std::int64_t>& rows_per_rank, ReduceOp op,
                                      const CollectiveOptions& opts) const {
  auto in = detail::dict_leaves(*this, /*with_cache=*/false);
  const std::span<const LeafRef> leaves = in.leaves;
  const int group_size = detail::group_of(opts)->size;
  std::string err = std::move(in.error);
  RowSplit split{group_size, {0}};
  // Summed without overflow: a sum that wraps could pass the first-dimension check below.
  bool overflowed = false;
  for (const std::int64_t n : rows_per_rank) {
    if (n < 0 && err.empty()) err = fmt::format("rows_per_rank holds a negative size {}", n);
    std::int64_t next = 0;
    if (__builtin_add_overflow(split.first.back(), std::max<std::int64_t>(n, 0), &next)) {
      overflowed = true;
      next = split.first.back();
    }
    split.first.push_back(next);
  }
  if (overflowed && err.empty())
    err = fmt::format("rows_per_rank [{}] sums to more than {} rows",
                      fmt::join(rows_per_rank, ", "), std::numeric_limits<std::int64_t>::max());
  const std::int64_t rows = split.first.back();
  if (err.empty() && rows_per_rank.size() != static_cast<std::size_t>(group_size))
    err = fmt::format("rows_per_rank has {} sizes for a group of {} ranks (one per rank)",
                      rows_per_rank.size(), group_size);
  for (const auto& ref : leaves) {
    const Tensor& t = *ref.tensor;
    if (!err.empty()) break;
    if (!t.defined() || t.is_sparse()) continue;  // prepare_collective says
    if (t.dim() == 0) {
      err = fmt::format("key '{}' is a 0-d tensor, which has no first dimension to split",
                        ref.key->str());
    } else if (t.shape()[0] != rows) {
      err = fmt::format("key '{}' has a first dimension of {}, but rows_per_rank sums to {}",
                        ref.key->str(), t.shape()[0], rows);
    }
  }
  // The sizes are part of the agreed call (a rank passing other sizes is a mismatch everywhere).
  const std::string what =
      fmt::format("TensorDict.reduce_scatter[rows_per_rank={}]", fmt::join(rows_per_rank, ","));
  CollectiveOptions sync = opts;
  sync.async_op = false;
  TensorDict out;
  reduce_scatter_rows(*this, leaves, out, op, split, what, std::move(err), sync);
  return out;
}

}  // namespace td
