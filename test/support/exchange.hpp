// What the tests of the gather, scatter and reduce_scatter collectives share (test_mpi_exchange
// on dicts, test_mpi_tensorclass on structs): the rows of every input, the element check, and the
// ways a collective is called. Each element's value and their reductions are the oracle's
// (reference.hpp: distinct_value, distinct_expected).
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <type_traits>
#include <utility>

#include <tensordict/tensordict.hpp>

#include "reference.hpp"

namespace tdtest {

/// The first dimension of every leaf (the batch size): divisible by every group size from 1 to 4.
inline constexpr std::int64_t kRows = 12;

/// Whether `t` has `shape` and holds f(i) at every logical position i.
template <class F>
bool holds(const td::Tensor& t, const td::Shape& shape, F&& f) {
  if (!t.defined() || t.shape() != shape) return false;
  return td::visit(t.dtype(), [&](auto tag) {
    using T = typename decltype(tag)::type;
    if constexpr (std::is_arithmetic_v<T>) {
      const auto v = t.to_vector<T>();
      for (std::size_t i = 0; i < v.size(); ++i)
        if (static_cast<double>(v[i]) != f(static_cast<std::int64_t>(i))) return false;
      return true;
    } else {
      return false;
    }
  });
}

/// One way of calling a collective: sync or async, bucketed or not.
struct Variant {
  bool async_op;
  std::optional<std::size_t> bucket_bytes;
};

/// The options of variant `v` (in `group`, or the world).
inline td::CollectiveOptions options(const Variant& v, std::optional<td::ProcessGroup> group = {}) {
  td::CollectiveOptions o;
  o.async_op = v.async_op;
  o.bucket_bytes = v.bucket_bytes;
  o.group = std::move(group);
  return o;
}

}  // namespace tdtest
