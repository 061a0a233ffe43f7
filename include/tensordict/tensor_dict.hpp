// td::TensorDict: a nested, insertion-ordered, string-keyed map of tensors with a batch size,
// and its collectives (bucketed over MPI). This header needs no MPI: the collectives' options
// are only declared here (tensordict/collectives.hpp defines them), so the library's core
// compiles without <mpi.h>; the collectives are defined in src/ops/.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include "tensordict/key.hpp"
#include "tensordict/reduce_op.hpp"
#include "tensordict/tensor.hpp"
#include "tensordict/work.hpp"

namespace td {

struct CollectiveOptions;  // tensordict/collectives.hpp

namespace detail {
struct DictAccess;
TD_API const CollectiveOptions& default_collective_options();  // CollectiveOptions{}
}  // namespace detail

/// A nested map from names to Tensors or TensorDicts. Leaves' leading dimensions must match
/// batch_size(). Copies share the tensors' storage but not the structure; clone() copies data.
class TD_API TensorDict {
 public:
  /// An empty dict whose leaves must all start with `batch_size`.
  explicit TensorDict(Shape batch_size = {});
  ~TensorDict();
  /// A copy of the structure sharing the leaves' storage (like copying each Tensor).
  TensorDict(const TensorDict& other);
  /// Replaces this dict with a structure copy of `other` sharing its leaves' storage.
  TensorDict& operator=(const TensorDict& other);
  /// Takes over other's contents; `other` is left empty and throws td::Error when used.
  TensorDict(TensorDict&& other) noexcept;
  /// Takes over other's contents; `other` is left empty and throws td::Error when used.
  TensorDict& operator=(TensorDict&& other) noexcept;

  /// Stores `value` at `key`, creating intermediate dicts; throws if its shape does not start
  /// with batch_size().
  TensorDict& set(const Key& key, Tensor value);
  /// Stores a sub-dict at `key`; its batch size must start with batch_size().
  TensorDict& set(const Key& key, TensorDict value);
  /// The leaf at `key`; throws td::KeyError naming the full path.
  Tensor& get(const Key& key);
  /// The leaf at `key`; throws td::KeyError naming the full path.
  const Tensor& get(const Key& key) const;
  /// The sub-dict at `key`; throws td::KeyError naming the full path.
  TensorDict& get_dict(const Key& key);
  /// The sub-dict at `key`; throws td::KeyError naming the full path.
  const TensorDict& get_dict(const Key& key) const;
  /// Whether `key` names a leaf or a sub-dict.
  bool contains(const Key& key) const;
  /// Whether `key` names a sub-dict.
  bool is_dict(const Key& key) const;
  /// Removes the entry at `key` (leaf or sub-dict); throws td::KeyError if absent.
  TensorDict& erase(const Key& key);
  /// Keys in insertion order; nested keys follow their dict's key when include_nested.
  std::vector<Key> keys(bool include_nested = false, bool leaves_only = false) const;
  /// Every leaf with its full key, in insertion order (depth first).
  std::vector<std::pair<Key, Tensor>> items() const;
  /// Every leaf with its full key, sorted by key: the order every collective walks.
  std::vector<std::pair<Key, Tensor>> canonical_leaves() const;
  /// Number of direct entries (leaves and sub-dicts).
  std::size_t size() const;
  /// Whether there is no entry at all.
  bool empty() const;
  /// The leading dimensions every leaf shares.
  const Shape& batch_size() const;

  /// A deep copy (every leaf cloned).
  TensorDict clone() const;
  /// A new dict with fn applied to every leaf (same structure). The results may change the batch
  /// size: each dict keeps its number of batch dimensions and takes their sizes from its results,
  /// which must all agree (std::invalid_argument naming the key otherwise).
  TensorDict apply(const std::function<Tensor(const Tensor&)>& fn) const;
  /// A new dict with fn(leaf, other's leaf at the same key) at every key; `other` must have the
  /// same keys (td::LayoutMismatchError naming the first that differs). Batch size as apply(fn).
  TensorDict apply(const std::function<Tensor(const Tensor&, const Tensor&)>& fn,
                   const TensorDict& other) const;
  /// Rows [start, stop) with `step` of every leaf's first dimension (clamped like Python), as
  /// views sharing storage; batch_size()[0] becomes the number of rows. Needs a batch dimension.
  TensorDict slice(std::int64_t start, std::int64_t stop, std::int64_t step = 1) const;
  /// Views of consecutive groups of `rows` rows along the first batch dimension; the last part
  /// may be shorter (torch.split). A batch of 0 rows gives one empty part.
  std::vector<TensorDict> split(std::int64_t rows) const;
  /// In place, every leaf += alpha * other's leaf at the same key (same keys, dtypes and shapes,
  /// checked before any leaf changes). Integer leaves need an integral alpha; bool leaves refuse.
  TensorDict& add_(const TensorDict& other, double alpha = 1.0);
  /// In place, every leaf *= factor (integer leaves need an integral factor; bool leaves refuse).
  TensorDict& mul_(double factor);
  /// A one-level dict whose keys are the nested paths joined by `sep`.
  TensorDict flatten_keys(const std::string& sep = ".") const;
  /// The inverse of flatten_keys: splits every key at `sep` into a nested path.
  TensorDict unflatten_keys(const std::string& sep = ".") const;
  /// A new dict with only the given keys (sharing storage); throws td::KeyError if one is absent.
  TensorDict select(const std::vector<Key>& keys) const;
  /// A new dict without the given keys (sharing storage); absent keys are ignored.
  TensorDict exclude(const std::vector<Key>& keys) const;
  /// Sets every leaf of `other` into this dict (overwriting existing entries).
  TensorDict& update(const TensorDict& other);
  /// Sets every leaf to zero in place.
  TensorDict& zero_();
  /// Moves every dense leaf of one dtype into one contiguous storage, in canonical order; leaves
  /// become views into it, so bucketed collectives run on that storage without copies.
  TensorDict& consolidate();
  /// Whether consolidate() would move nothing: per dtype, the dense leaves are contiguous and lie
  /// back to back in canonical order in one storage (keys sharing a leaf's region count once).
  bool is_consolidated() const;
  /// Same keys (any insertion order), same batch size, and equal() leaves.
  bool equal(const TensorDict& other) const;
  /// Same as equal().
  friend bool operator==(const TensorDict& a, const TensorDict& b) { return a.equal(b); }

  /// Reduces every leaf across the group into every rank. Returns the pending Works when
  /// opts.async_op, else an empty vector (everything done).
  std::vector<Work> all_reduce(
      ReduceOp op = ReduceOp::SUM,
      const CollectiveOptions& opts = detail::default_collective_options());
  /// Reduces every leaf into rank `dst`; other ranks' leaves are left unspecified.
  std::vector<Work> reduce(int dst, ReduceOp op = ReduceOp::SUM,
                           const CollectiveOptions& opts = detail::default_collective_options());
  /// Copies every leaf of rank `src` into every rank's dict (same layout on every rank).
  std::vector<Work> broadcast(int src,
                              const CollectiveOptions& opts = detail::default_collective_options());
  /// Sends every leaf to rank `dst`, whose matching recv() holds the same layout (checked first:
  /// a mismatch is a td::LayoutMismatchError on both sides naming the key, and moves no data).
  /// Leaves go in canonical order, one message per leaf; with opts.bucket_bytes one per bucket,
  /// and with kAutoBucketBytes one per dtype (consolidated). With opts.async_op the one returned
  /// Work is pending and the leaves must not change until it completes.
  std::vector<Work> send(int dst,
                         const CollectiveOptions& opts = detail::default_collective_options());
  /// Receives every leaf from rank `src` into this dict, which holds the sender's layout (the
  /// bucketing is the sender's choice). With opts.async_op the leaves are valid after wait().
  std::vector<Work> recv(int src,
                         const CollectiveOptions& opts = detail::default_collective_options());
  /// send() with async_op set (torch.distributed.isend).
  [[nodiscard]] std::vector<Work> isend(
      int dst, const CollectiveOptions& opts = detail::default_collective_options());
  /// recv() with async_op set (torch.distributed.irecv).
  [[nodiscard]] std::vector<Work> irecv(
      int src, const CollectiveOptions& opts = detail::default_collective_options());
  /// Every rank's dict: [r] is rank r's (with fresh storage). Runs to completion even with
  /// opts.async_op; the overload that fills `out` can return pending Works.
  std::vector<TensorDict> all_gather(
      const CollectiveOptions& opts = detail::default_collective_options()) const;
  /// all_gather into `out` (torch.distributed.all_gather's tensor_list): `out` is replaced by one
  /// dict per rank right away; with opts.async_op their leaves are valid after every returned
  /// Work's wait().
  std::vector<Work> all_gather(
      std::vector<TensorDict>& out,
      const CollectiveOptions& opts = detail::default_collective_options()) const;
  /// Every rank's dict stacked along a new leading dimension: each leaf becomes [size, *shape]
  /// (row r is rank r's) and the batch size [size, *batch_size]. One leaf per bucket is received
  /// straight into the stacked tensor.
  TensorDict all_gather_stacked(
      const CollectiveOptions& opts = detail::default_collective_options()) const;
  /// all_gather_stacked into `out` (replaced right away; with opts.async_op valid after wait()).
  std::vector<Work> all_gather_stacked(
      TensorDict& out, const CollectiveOptions& opts = detail::default_collective_options()) const;
  /// Every rank's dict on `dst` ([r] is rank r's); an empty vector on other ranks.
  std::vector<TensorDict> gather(
      int dst, const CollectiveOptions& opts = detail::default_collective_options()) const;
  /// gather into `out` on `dst` (emptied on other ranks); with opts.async_op valid after wait().
  std::vector<Work> gather(
      int dst, std::vector<TensorDict>& out,
      const CollectiveOptions& opts = detail::default_collective_options()) const;
  /// On src, parts[r] goes to rank r; every rank's *this already holds the layout of one part.
  std::vector<Work> scatter(int src, const std::vector<TensorDict>& parts,
                            const CollectiveOptions& opts = detail::default_collective_options());
  /// Every leaf's first dimension split evenly across the group; returns this rank's reduced shard
  /// (rows [rank * n / size, (rank + 1) * n / size) of the reduced leaf). Bucketed like
  /// all_reduce: one MPI_Reduce_scatter_block per bucket.
  TensorDict reduce_scatter(
      ReduceOp op = ReduceOp::SUM,
      const CollectiveOptions& opts = detail::default_collective_options()) const;
  /// reduce_scatter into `out` (replaced right away by the shard dict; with opts.async_op its
  /// leaves are valid after every returned Work's wait()).
  std::vector<Work> reduce_scatter(
      TensorDict& out, ReduceOp op = ReduceOp::SUM,
      const CollectiveOptions& opts = detail::default_collective_options()) const;
  /// Uneven reduce_scatter: rows_per_rank[r] rows of every leaf's first dimension go to rank r
  /// (the sizes must sum to every leaf's first dimension and agree on every rank). Returns this
  /// rank's reduced rows; one MPI_Reduce_scatter with per-rank counts per bucket. Runs to
  /// completion even with opts.async_op.
  TensorDict reduce_scatter(
      const std::vector<std::int64_t>& rows_per_rank, ReduceOp op = ReduceOp::SUM,
      const CollectiveOptions& opts = detail::default_collective_options()) const;

 private:
  friend struct detail::DictAccess;
  struct Impl;
  struct Walk;
  Impl& impl();
  const Impl& impl() const;
  std::unique_ptr<Impl> impl_;
};

/// The dicts (same keys, dtypes, shapes and batch size) stacked along a new leading dimension:
/// each leaf [n, *shape], batch size [n, *batch_size] (torch.stack of TensorDicts). Throws
/// td::LayoutMismatchError naming the first dict and key that differ.
TD_API TensorDict stack(const std::vector<TensorDict>& dicts);

/// The dicts (same keys and dtypes; shapes and batch sizes equal except along `dim`) concatenated
/// along batch dimension `dim` (negative: from the end of the batch size) into new storage
/// (torch.cat of TensorDicts). Throws td::LayoutMismatchError naming the first dict and key that
/// differ, std::invalid_argument for no dicts, a dim outside the batch size or a sparse leaf.
TD_API TensorDict cat(const std::vector<TensorDict>& dicts, std::int64_t dim = 0);

/// A dict of the same structure and batch sizes whose leaves are new zero tensors of the same
/// dtypes and shapes (sparse leaves: sparse, with no entries).
TD_API TensorDict zeros_like(const TensorDict& dict);

/// Whether both dicts have the same keys, batch sizes and leaf shapes, and every element pair
/// satisfies |a - b| <= atol + rtol * |b| (torch.allclose; NaN is never close, equal infinities
/// are). Leaves of different dtypes are compared by value.
TD_API bool allclose(const TensorDict& a, const TensorDict& b, double rtol = 1e-5,
                     double atol = 1e-8);

/// Prints the dict's structure: keys, shapes and dtypes.
TD_API std::string to_string(const TensorDict& d);
/// Prints like to_string().
TD_API std::ostream& operator<<(std::ostream& os, const TensorDict& d);

}  // namespace td
