#include "tensordict/dtype.hpp"

namespace td {

std::string_view name(DType dtype) {
  return visit(dtype, [&](auto tag) -> std::string_view {
    using T = typename decltype(tag)::type;
#define TD_DTYPE_NAME(e, U, n) \
  if constexpr (std::is_same_v<T, U>) return n;
    TD_FOR_EACH_DTYPE(TD_DTYPE_NAME)
#undef TD_DTYPE_NAME
    return "?";
  });
}

std::optional<DType> dtype_from_name(std::string_view n) {
  for (std::size_t i = 0; i < kNumDTypes; ++i) {
    const auto d = static_cast<DType>(i);
    if (name(d) == n) return d;
  }
  return std::nullopt;
}

std::size_t itemsize(DType dtype) {
  return visit(dtype, [](auto tag) { return sizeof(typename decltype(tag)::type); });
}

}  // namespace td
