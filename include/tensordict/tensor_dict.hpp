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

#include "tensordict/dict_collectives.hpp"
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

  // The collectives: all_reduce, reduce, broadcast, send, recv, isend, irecv, all_gather,
  // all_gather_stacked, gather, scatter, reduce_scatter (each documented in
  // tensordict/dict_collectives.hpp, the one list tensorclasses take theirs from too).
  TD_DETAIL_DICT_COLLECTIVES(TD_DETAIL_DICT_DECLARE, TensorDict)

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
