// The correctness guard's inputs and checks, from the test oracle (guard.hpp).
#include "guard.hpp"

#include <cstdint>

#include <fmt/format.h>

#include "support/reference.hpp"

namespace td_bench {

void fill_known(td::TensorDict& d, td::ReduceOp op, int rank) {
  std::int64_t j = 0;
  for (auto& [key, t] : d.canonical_leaves()) tdtest::fill_input(t, op, rank, j++);
}

std::string check_reduced(const td::TensorDict& d, td::ReduceOp op, int ranks) {
  std::int64_t j = 0;
  for (const auto& [key, t] : d.canonical_leaves()) {
    std::string err = tdtest::reduction_error(t, op, ranks, j++);
    if (!err.empty()) return fmt::format("leaf '{}' ({}): {}", key.str(), td::name(t.dtype()), err);
  }
  return {};
}

void fill_constant(td::Tensor& t, double value) {
  td::visit(t.dtype(), [&](auto tag) {
    using T = typename decltype(tag)::type;
    T* p = t.data<T>();
    const T v = static_cast<T>(static_cast<float>(value));
    for (std::int64_t i = 0, n = t.numel(); i < n; ++i) p[i] = v;
  });
}

}  // namespace td_bench
