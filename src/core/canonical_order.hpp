// The canonical order of a dict's leaves: the one order every rank, the wire format and the
// checkpoint files use (docs/internals.md, "Canonical order"). It is the order of the full keys
// sorted part by part, which is the order of a depth-first walk that visits each dict's entries
// sorted by name (no two entries of one dict share a name, so the first part where two keys
// differ decides). Both walks of the library, a TensorDict's (core/tensor_dict.cpp) and a
// peer's layout (comm/dict_wire.cpp), visit entries in the order given here.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <numeric>
#include <vector>

namespace td::detail {

/// Positions 0..n-1 of one dict's entries in canonical order: sorted by `name_of(position)`.
/// With `duplicate`, sets it to the position of an entry whose name another entry also has, or to
/// `n` when every name differs (a TensorDict's cannot repeat; a peer's metadata can).
template <class NameOf>
std::vector<std::uint32_t> canonical_entries(std::size_t n, NameOf&& name_of,
                                             std::size_t* duplicate = nullptr) {
  std::vector<std::uint32_t> order(n);
  std::iota(order.begin(), order.end(), 0U);
  std::sort(order.begin(), order.end(),
            [&](std::uint32_t a, std::uint32_t b) { return name_of(a) < name_of(b); });
  if (duplicate != nullptr) {
    *duplicate = n;
    for (std::size_t i = 1; i < n; ++i)
      if (name_of(order[i - 1]) == name_of(order[i])) {
        *duplicate = order[i];
        break;
      }
  }
  return order;
}

}  // namespace td::detail
