// Point-to-point and gather/scatter collectives of TensorDict: send / recv, all_gather / gather,
// scatter and reduce_scatter. The collectives take the engine's path (layout agreement across the
// group, then the bucket plan) and move each bucket with one blocking MPI call; the agreement has
// already made sure that every rank of the group joined, so the data calls cannot wait for a rank
// that never comes. send / recv agree on the layout with a handshake between the two ranks.
#include <algorithm>
#include <climits>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "collective_engine.hpp"
#include "tensordict/tensor_dict.hpp"

namespace td {

namespace {

using detail::CollectiveCall;
using detail::CollectiveKind;
using detail::DictAccess;
using detail::LeafRef;
using Clock = std::chrono::steady_clock;

std::string shape_str(const Shape& s) { return fmt::format("[{}]", fmt::join(s, ", ")); }

// An element count as MPI's int; a bucket or leaf larger than that is refused (the same on every
// rank: the count follows from the agreed layout).
int mpi_count(std::size_t count, std::string_view what) {
  if (count > static_cast<std::size_t>(INT_MAX))
    throw Error(fmt::format("{}: {} elements are too many for one message (at most {})", what,
                            count, INT_MAX));
  return static_cast<int>(count);
}

std::unique_ptr<std::byte[]> buffer(std::size_t nbytes) {
  return std::make_unique_for_overwrite<std::byte[]>(nbytes);
}

// What is wrong with `part` as a dict of `layout`'s layout (keys, dtypes, shapes), or "".
std::string layout_difference(const std::vector<LeafRef>& layout,
                              const std::vector<LeafRef>& part) {
  for (std::size_t i = 0; i < std::max(layout.size(), part.size()); ++i) {
    if (i >= part.size()) return fmt::format("it has no key '{}'", layout[i].key->str());
    if (i >= layout.size() || !(*layout[i].key == *part[i].key))
      return fmt::format("it has key '{}', which this TensorDict does not have",
                         part[i].key->str());
    const Tensor& want = *layout[i].tensor;
    const Tensor& got = *part[i].tensor;
    if (!got.defined())
      return fmt::format("key '{}' holds an undefined tensor", part[i].key->str());
    if (got.is_sparse())
      return fmt::format("key '{}' is a sparse tensor; to_dense() it first", part[i].key->str());
    if (want.defined() && (got.dtype() != want.dtype() || got.shape() != want.shape()))
      return fmt::format("key '{}' is {}{} instead of {}{}", part[i].key->str(), name(got.dtype()),
                         shape_str(got.shape()), name(want.dtype()), shape_str(want.shape()));
  }
  return {};
}

// Leaves the plan skipped because they view exactly the elements of an earlier leaf: in a dict
// built by clone() they are separate tensors, so they get a copy of that leaf's result.
void copy_aliases(const BucketPlan& plan, const std::vector<LeafRef>& local,
                  const std::vector<LeafRef>& out) {
  for (std::size_t i : plan.skipped_leaves) {
    const Tensor& t = *local[i].tensor;
    if (t.numel() == 0) continue;
    for (std::size_t j = 0; j < i; ++j) {
      const Tensor& o = *local[j].tensor;
      if (o.defined() && !o.is_sparse() && o.shares_storage_with(t) &&
          o.storage_offset() == t.storage_offset() && o.dtype() == t.dtype() &&
          o.shape() == t.shape() && o.strides() == t.strides()) {
        out[i].tensor->copy_(*out[j].tensor);
        break;
      }
    }
  }
}

// all_gather and gather: every rank's leaves, bucket by bucket, into clones of this dict.
std::vector<TensorDict> gather_dicts(const TensorDict& self, CollectiveKind kind, int root,
                                     std::string_view what, const CollectiveOptions& opts) {
  const std::vector<LeafRef>& leaves = DictAccess::canonical(self);
  const auto prepared = detail::prepare_collective(
      leaves, CollectiveCall{kind, ReduceOp::SUM, root, what, /*from_dict=*/true}, opts);
  const detail::GroupState& g = *prepared.group;
  const BucketPlan& plan = *prepared.plan;
  const bool receives = kind == CollectiveKind::AllGather || g.rank == root;
  const auto size = static_cast<std::size_t>(g.size);

  std::vector<TensorDict> out;
  std::vector<std::vector<LeafRef>> out_leaves;
  if (receives) {
    out.reserve(size);
    for (std::size_t r = 0; r < size; ++r) out.push_back(self.clone());
    for (std::size_t r = 0; r < size; ++r) out_leaves.push_back(DictAccess::canonical(out[r]));
  }
  for (const auto& bk : plan.buckets) {
    const int count = mpi_count(bk.nbytes / itemsize(bk.dtype), what);
    const MPI_Datatype type = detail::mpi_datatype(bk.dtype);
    std::unique_ptr<std::byte[]> packed;
    const std::byte* send;
    if (detail::bucket_is_contiguous_in_memory(bk, leaves)) {
      send = static_cast<const std::byte*>(leaves[bk.slots[0].leaf].tensor->raw_data());
    } else {
      packed = buffer(bk.nbytes);
      detail::pack_bucket(bk, leaves, packed.get());
      send = packed.get();
    }
    std::unique_ptr<std::byte[]> all = receives ? buffer(size * bk.nbytes) : nullptr;
    if (kind == CollectiveKind::AllGather) {
      TD_MPI_CHECK(MPI_Allgather(send, count, type, all.get(), count, type, g.comm));
    } else {
      TD_MPI_CHECK(MPI_Gather(send, count, type, all.get(), count, type, root, g.comm));
    }
    if (receives)
      for (std::size_t r = 0; r < size; ++r)
        detail::unpack_bucket(bk, out_leaves[r], all.get() + r * bk.nbytes);
  }
  if (receives)
    for (std::size_t r = 0; r < size; ++r) copy_aliases(plan, leaves, out_leaves[r]);
  return out;
}

// ---- send / recv ---------------------------------------------------------------------------

// A 64-bit FNV-1a fingerprint of the keys, dtypes and shapes in canonical order (never 0, which
// a sender whose dict cannot be sent uses to make the receiver fail too).
std::uint64_t fingerprint(const std::vector<LeafRef>& leaves) {
  std::uint64_t h = 0xcbf29ce484222325ull;
  auto byte = [&](unsigned char c) {
    h ^= c;
    h *= 0x100000001b3ull;
  };
  auto u64 = [&](std::uint64_t v) {
    for (int k = 0; k < 8; ++k) byte(static_cast<unsigned char>(v >> (8 * k)));
  };
  u64(leaves.size());
  for (const auto& ref : leaves) {
    const auto& parts = ref.key->parts();
    u64(parts.size());
    for (const auto& p : parts) {
      u64(p.size());
      for (char c : p) byte(static_cast<unsigned char>(c));
    }
    const Tensor& t = *ref.tensor;
    byte(static_cast<unsigned char>(t.dtype()));
    u64(t.shape().size());
    for (auto s : t.shape()) u64(static_cast<std::uint64_t>(s));
  }
  return h == 0 ? 1 : h;
}

// What makes this dict unfit for send / recv on this rank, or "".
std::string local_error(const std::vector<LeafRef>& leaves) {
  for (const auto& ref : leaves) {
    if (!ref.tensor->defined())
      return fmt::format("key '{}' holds an undefined tensor", ref.key->str());
    if (ref.tensor->is_sparse())
      return fmt::format("key '{}' is a sparse tensor; to_dense() it first", ref.key->str());
  }
  return {};
}

// Calls to one peer are numbered on both sides (the sender's n-th send to a peer meets the
// peer's n-th recv from it), so each call gets its own tags and two transfers to the same peer
// from different threads cannot take each other's messages. Kept per group: a group freed and
// another created at the same address starts again from zero, as its peers do.
struct PeerCounters {
  std::weak_ptr<detail::GroupState> group;
  std::map<std::pair<int, bool>, unsigned> next;  // (peer, we send) -> calls so far
};
std::mutex g_tags_mu;
std::map<const detail::GroupState*, PeerCounters> g_tags;

constexpr int kTagsPerCall = 10000;  // handshake (2), then one tag per leaf (wrapping)

int next_tag_base(const std::shared_ptr<detail::GroupState>& g, int peer, bool sending) {
  int* ub = nullptr;
  int flag = 0;
  TD_MPI_CHECK(MPI_Comm_get_attr(g->comm, MPI_TAG_UB, &ub, &flag));
  const int tag_ub = flag && ub ? *ub : 32767;
  const unsigned slots = static_cast<unsigned>(std::max(1, std::min(1000, tag_ub / kTagsPerCall)));
  std::lock_guard lock(g_tags_mu);
  std::erase_if(g_tags, [](const auto& e) { return e.second.group.expired(); });
  PeerCounters& pc = g_tags[g.get()];
  if (pc.group.lock() != g) pc = PeerCounters{g, {}};
  const unsigned n = pc.next[{peer, sending}]++;
  return static_cast<int>(n % slots) * kTagsPerCall;
}

int leaf_tag(int base, std::size_t leaf) {
  return base + 2 + static_cast<int>(leaf % (kTagsPerCall - 2));
}

struct PeerCall {
  std::shared_ptr<detail::GroupState> group;
  MPI_Comm comm;
  int base;  // tag base of this call
  Clock::time_point deadline;
};

PeerCall start_peer_call(int peer, std::string_view what, const char* peer_name, bool sending,
                         const CollectiveOptions& opts) {
  auto g = detail::group_of(opts);
  MPI_Comm comm = g->checked_comm(what);
  if (peer < 0 || peer >= g->size)
    throw std::invalid_argument(fmt::format("{}: {} {} is out of range for a group of {} ranks",
                                            what, peer_name, peer, g->size));
  if (peer == g->rank)
    throw std::invalid_argument(
        fmt::format("{}: {} {} is this rank itself", what, peer_name, peer));
  const int base = next_tag_base(g, peer, sending);
  return {std::move(g), comm, base, Clock::now() + detail::timeout_of(opts)};
}

// One small handshake message, honouring the call's timeout (the peer may never come).
template <class T>
void handshake(bool send, T value_or_dummy, T* out, int peer, int tag, const PeerCall& c,
               std::string_view what) {
  auto buf = std::make_shared<T>(value_or_dummy);
  MPI_Request req = MPI_REQUEST_NULL;
  const MPI_Datatype type = sizeof(T) == 8 ? MPI_UINT64_T : MPI_INT;
  if (send) {
    TD_MPI_CHECK(MPI_Isend(buf.get(), 1, type, peer, tag, c.comm, &req));
  } else {
    TD_MPI_CHECK(MPI_Irecv(buf.get(), 1, type, peer, tag, c.comm, &req));
  }
  detail::wait_until(
      req, c.deadline,
      [&] {
        return fmt::format("{}: rank {} of the group of {} did not take part in the handshake",
                           what, peer, c.group->size);
      },
      buf);
  if (out) *out = *buf;
}

}  // namespace

// send / recv run synchronously even with async_op (an empty vector: everything is done when
// they return), which the contract allows.
std::vector<Work> TensorDict::send(int dst, const CollectiveOptions& opts) {
  constexpr std::string_view what = "TensorDict.send";
  const PeerCall c = start_peer_call(dst, what, "dst", /*sending=*/true, opts);
  const std::vector<LeafRef>& leaves = detail::DictAccess::canonical(*this);
  const std::string err = local_error(leaves);
  handshake<std::uint64_t>(true, err.empty() ? fingerprint(leaves) : 0, nullptr, dst, c.base, c,
                           what);
  int verdict = 0;
  handshake<int>(false, 0, &verdict, dst, c.base + 1, c, what);
  if (!err.empty()) throw std::invalid_argument(fmt::format("{}: {}", what, err));
  if (verdict != 1)
    throw LayoutMismatchError(fmt::format(
        "{}: the receiver's TensorDict (rank {}) does not have the sender's layout (keys, dtypes "
        "and shapes in sorted key order); nothing was sent",
        what, dst));
  for (std::size_t i = 0; i < leaves.size(); ++i) {
    const Tensor t = leaves[i].tensor->contiguous();
    if (t.numel() == 0) continue;
    TD_MPI_CHECK(MPI_Send(t.raw_data(), mpi_count(static_cast<std::size_t>(t.numel()), what),
                          detail::mpi_datatype(t.dtype()), dst, leaf_tag(c.base, i), c.comm));
  }
  return {};
}

std::vector<Work> TensorDict::recv(int src, const CollectiveOptions& opts) {
  constexpr std::string_view what = "TensorDict.recv";
  const PeerCall c = start_peer_call(src, what, "src", /*sending=*/false, opts);
  const std::vector<LeafRef>& leaves = detail::DictAccess::canonical(*this);
  const std::string err = local_error(leaves);
  std::uint64_t theirs = 0;
  handshake<std::uint64_t>(false, 0, &theirs, src, c.base, c, what);
  const bool ok = err.empty() && theirs != 0 && theirs == fingerprint(leaves);
  handshake<int>(true, ok ? 1 : 0, nullptr, src, c.base + 1, c, what);
  if (!err.empty()) throw std::invalid_argument(fmt::format("{}: {}", what, err));
  if (theirs == 0)
    throw LayoutMismatchError(fmt::format(
        "{}: the sender (rank {}) could not send its TensorDict (see its error); nothing was "
        "received",
        what, src));
  if (!ok)
    throw LayoutMismatchError(fmt::format(
        "{}: this TensorDict does not have the sender's (rank {}) layout (keys, dtypes and shapes "
        "in sorted key order); nothing was received",
        what, src));
  for (std::size_t i = 0; i < leaves.size(); ++i) {
    Tensor& t = *leaves[i].tensor;
    if (t.numel() == 0) continue;
    Tensor into = t.is_contiguous() ? t : Tensor::empty(t.shape(), t.dtype());
    TD_MPI_CHECK(MPI_Recv(into.raw_data(), mpi_count(static_cast<std::size_t>(t.numel()), what),
                          detail::mpi_datatype(t.dtype()), src, leaf_tag(c.base, i), c.comm,
                          MPI_STATUS_IGNORE));
    if (!t.is_contiguous()) t.copy_(into);
  }
  return {};
}

// The gather/scatter collectives below also run synchronously when opts.async_op is set, and
// scatter then returns an empty vector (completed work), which the contract allows.

std::vector<TensorDict> TensorDict::all_gather(const CollectiveOptions& opts) const {
  return gather_dicts(*this, CollectiveKind::AllGather, 0, "TensorDict.all_gather", opts);
}

std::vector<TensorDict> TensorDict::gather(int dst, const CollectiveOptions& opts) const {
  return gather_dicts(*this, CollectiveKind::Gather, dst, "TensorDict.gather", opts);
}

std::vector<Work> TensorDict::scatter(int src, const std::vector<TensorDict>& parts,
                                      const CollectiveOptions& opts) {
  constexpr std::string_view what = "TensorDict.scatter";
  const std::vector<LeafRef>& leaves = DictAccess::canonical(*this);
  const auto group = detail::group_of(opts);
  const bool is_src = group->comm != MPI_COMM_NULL && group->rank == src;

  // On src: every part must have this dict's layout; its leaves, contiguous, are what is packed.
  std::string err;
  std::vector<std::vector<Tensor>> part_tensors;
  std::vector<std::vector<LeafRef>> part_leaves;
  if (is_src) {
    if (parts.size() != static_cast<std::size_t>(group->size)) {
      err = fmt::format("{} parts for a group of {} ranks (one part per rank)", parts.size(),
                        group->size);
    } else {
      for (std::size_t r = 0; r < parts.size() && err.empty(); ++r) {
        const std::vector<LeafRef>& pl = DictAccess::canonical(parts[r]);
        const std::string diff = layout_difference(leaves, pl);
        if (!diff.empty()) {
          err = fmt::format("parts[{}] does not have this TensorDict's layout: {}", r, diff);
          break;
        }
        auto& ts = part_tensors.emplace_back();
        ts.reserve(pl.size());
        for (const auto& ref : pl) ts.push_back(ref.tensor->contiguous());
        auto& refs = part_leaves.emplace_back();
        for (std::size_t i = 0; i < pl.size(); ++i)
          refs.push_back({pl[i].key, &ts[i], pl[i].key_hash});
      }
    }
  }
  const auto prepared = detail::prepare_collective(
      leaves, CollectiveCall{CollectiveKind::Scatter, ReduceOp::SUM, src, what, true}, opts,
      std::move(err));
  const detail::GroupState& g = *prepared.group;
  const auto size = static_cast<std::size_t>(g.size);
  for (const auto& bk : prepared.plan->buckets) {
    const int count = mpi_count(bk.nbytes / itemsize(bk.dtype), what);
    const MPI_Datatype type = detail::mpi_datatype(bk.dtype);
    std::unique_ptr<std::byte[]> all;
    if (is_src) {
      all = buffer(size * bk.nbytes);
      for (std::size_t r = 0; r < size; ++r)
        detail::pack_bucket(bk, part_leaves[r], all.get() + r * bk.nbytes);
    }
    const bool direct = detail::bucket_is_contiguous_in_memory(bk, leaves);
    std::unique_ptr<std::byte[]> mine = direct ? nullptr : buffer(bk.nbytes);
    std::byte* recv =
        direct ? static_cast<std::byte*>(leaves[bk.slots[0].leaf].tensor->raw_data()) : mine.get();
    TD_MPI_CHECK(MPI_Scatter(all.get(), count, type, recv, count, type, src, g.comm));
    if (!direct) detail::unpack_bucket(bk, leaves, recv);
  }
  // Skipped leaves are empty or aliases of an earlier leaf, whose storage they share.
  return {};
}

namespace {

// A copy of `d`'s structure whose leaves are `shards` (by full key) and whose batch sizes have
// their first dimension divided by `size`.
TensorDict shard_structure(const TensorDict& d, const std::vector<std::string>& prefix,
                           const std::map<Key, Tensor>& shards, int size) {
  Shape bs = d.batch_size();
  if (!bs.empty()) bs[0] /= size;
  TensorDict out(bs);
  for (const Key& k : d.keys()) {
    std::vector<std::string> full = prefix;
    full.push_back(k.parts().back());
    if (d.is_dict(k)) {
      out.set(k, shard_structure(d.get_dict(k), full, shards, size));
    } else {
      out.set(k, shards.at(Key(full)));
    }
  }
  return out;
}

}  // namespace

TensorDict TensorDict::reduce_scatter(ReduceOp op, const CollectiveOptions& opts) const {
  constexpr std::string_view what = "TensorDict.reduce_scatter";
  const std::vector<LeafRef>& leaves = DictAccess::canonical(*this);
  const int group_size = detail::group_of(opts)->size;
  std::string err;
  for (const auto& ref : leaves) {
    const Tensor& t = *ref.tensor;
    if (!t.defined() || group_size <= 0) continue;  // reported by prepare_collective
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
  const auto prepared = detail::prepare_collective(
      leaves, CollectiveCall{CollectiveKind::ReduceScatter, op, 0, what, true}, opts,
      std::move(err));
  const detail::GroupState& g = *prepared.group;

  // One MPI_Reduce_scatter_block per leaf, on a contiguous copy (bucketing would interleave the
  // leaves' shards, so it would need a transposing pack).
  std::map<Key, Tensor> shards;
  for (const auto& ref : leaves) {
    const Tensor& t = *ref.tensor;
    Shape shape = t.shape();
    shape[0] /= g.size;
    Tensor shard = Tensor::empty(shape, t.dtype());
    if (shard.numel() > 0) {
      const Tensor in = t.contiguous();
      TD_MPI_CHECK(MPI_Reduce_scatter_block(
          in.raw_data(), shard.raw_data(), mpi_count(static_cast<std::size_t>(shard.numel()), what),
          detail::mpi_datatype(t.dtype()), detail::mpi_op(op, t.dtype()), g.comm));
      if (op == ReduceOp::AVG)
        detail::divide_in_place(shard.raw_data(), shard.numel(), t.dtype(), g.size);
    }
    shards.emplace(*ref.key, std::move(shard));
  }
  return shard_structure(*this, {}, shards, g.size);
}

}  // namespace td
