// Internals of td::TensorDict shared with the collectives (not installed).
#pragma once

#include <cstdint>
#include <memory>
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

struct LayoutCache;
/// A new, empty layout cache (defined by the collectives, where LayoutCache is complete).
std::shared_ptr<LayoutCache> make_layout_cache();

/// Access to TensorDict internals for the collectives.
struct DictAccess {
  /// The dict's cache of its last collective's layout analysis (see collective_engine.cpp).
  static LayoutCache& layout_cache(const TensorDict& d);
  /// Changes whenever canonical(d) is rebuilt (so caches derived from the order know to rebuild).
  static std::uint64_t canonical_generation(const TensorDict& d);
  /// The sum of the tree's leaf-change counts at the last canonical(d): unchanged means that no
  /// leaf of d's tree had its layout changed (assigned, moved from, re-laid out) since then.
  static std::uint64_t leaf_stamp(const TensorDict& d);
  /// Every leaf sorted by key. Cached per dict and rebuilt only after a dict of its tree changed
  /// structure (set of a new key, erase, a sub-dict replaced), so a training loop pays the sort
  /// once; checking the cache walks the tree without comparing keys.
  static const std::vector<LeafRef>& canonical(const TensorDict& d);
};

}  // namespace td::detail
