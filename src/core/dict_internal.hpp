// Internals of td::TensorDict shared with the collectives (not installed).
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <utility>
#include <vector>

#include "tensordict/tensor_dict.hpp"

namespace td::detail {

/// One leaf in canonical order: its full key and the tensor stored in the dict.
struct LeafRef {
  const Key* key;
  Tensor* tensor;
  std::uint64_t key_hash;  // hash of the key's parts, cached with the order
};

/// A 64-bit hash of a key's parts (stable across processes of one build).
std::uint64_t hash_key(const Key& key);

struct Storage;

/// What a higher layer remembers of a list of leaves (the same tensor objects, in the same
/// order, as canonical() keeps them while the dict's structure is unchanged) to tell later that
/// none changed its layout: the leaf epoch (TensorAccess::leaf_epoch), the version counters of
/// the storages they view (Storage::view_changes) and every leaf's layout id. Checking costs one
/// load while no leaf object of any dict changed its layout; otherwise, when the leaves share
/// few storages (a consolidated dict: one per dtype; the Reducer's buckets), one load per storage
/// while no tensor object of those storages was assigned or moved from; otherwise one compare
/// per leaf.
class LeafVersions {
 public:
  /// Remembers `leaves` as they are now.
  void record(std::span<const LeafRef> leaves);
  /// Whether every leaf has the layout it had at record(); `leaves` are the same objects.
  bool same_layouts(std::span<const LeafRef> leaves);
  /// How many same_layouts() calls had to compare every leaf (for tests).
  std::uint64_t leaf_walks() const { return leaf_walks_; }

 private:
  struct Seen {
    std::weak_ptr<const Storage> storage;  // tells whether `raw` is still alive
    const Storage* raw = nullptr;
    std::uint64_t view_changes = 0;  // its counter at record()
  };
  // Leaves per storage (at least) for which the storages' counters are checked first.
  static constexpr std::size_t kLeavesPerStorage = 4;
  bool storages_unchanged() const;
  std::vector<Seen> storages_;                // distinct storages of the leaves, by address
  std::vector<std::uint64_t> layout_ids_;     // of every leaf
  std::vector<std::size_t> without_storage_;  // leaves viewing none (undefined, sparse)
  bool few_storages_ = false;     // storages_ shared by kLeavesPerStorage leaves or more on average
  std::uint64_t leaf_epoch_ = 0;  // TensorAccess::leaf_epoch() when the leaves were last matched
  std::uint64_t leaf_walks_ = 0;
};

/// Access to TensorDict internals for the collectives.
struct DictAccess {
  /// The object a higher layer keeps with the dict (the collectives' cache of its last layout
  /// analysis), made by `make` on first use; core never looks inside it. Copies of the dict start
  /// without one; a move takes it along.
  static void* attachment(const TensorDict& d, std::shared_ptr<void> (*make)());
  /// Changes whenever canonical(d) is rebuilt (so caches derived from the order know to rebuild).
  static std::uint64_t canonical_generation(const TensorDict& d);
  /// Every leaf sorted by key. Cached per dict and rebuilt only after a dict of its tree changed
  /// structure (set of a new key, erase, a sub-dict replaced), so a training loop pays the sort
  /// once; checking the cache costs one load while no dict of the process changed structure or
  /// was moved since the last check, otherwise a walk of the tree without comparing keys.
  static const std::vector<LeafRef>& canonical(const TensorDict& d);
};

}  // namespace td::detail
