// Internals of td::TensorDict shared with the collectives (not installed).
#pragma once

#include <cstdint>
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

/// Access to TensorDict internals for the collectives.
struct DictAccess {
  /// Every leaf sorted by key. Cached per dict and rebuilt only after some dict's structure
  /// changed (set/erase/assign), so a training loop pays the sort once.
  static const std::vector<LeafRef>& canonical(const TensorDict& d);
};

}  // namespace td::detail
