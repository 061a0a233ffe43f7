// Element types. One list (TD_FOR_EACH_DTYPE) generates the enum's names, sizes and the dispatch
// helper td::visit; the enum's order is part of the wire format (layout fingerprints), so append
// only.
#pragma once

#include <complex>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string_view>
#include <type_traits>

#include <Eigen/Core>

#include "tensordict/export.hpp"

// X(enumerator, C++ type, name as torch prints it without the "torch." prefix)
#define TD_FOR_EACH_DTYPE(X)                     \
  X(Bool, bool, "bool")                          \
  X(UInt8, std::uint8_t, "uint8")                \
  X(Int8, std::int8_t, "int8")                   \
  X(Int16, std::int16_t, "int16")                \
  X(Int32, std::int32_t, "int32")                \
  X(Int64, std::int64_t, "int64")                \
  X(Float16, Eigen::half, "float16")             \
  X(BFloat16, Eigen::bfloat16, "bfloat16")       \
  X(Float32, float, "float32")                   \
  X(Float64, double, "float64")                  \
  X(Complex64, std::complex<float>, "complex64") \
  X(Complex128, std::complex<double>, "complex128")

namespace td {

/// Element type of a tensor; row-major like torch. The numeric values are part of the wire format.
enum class DType : std::uint8_t {
#define TD_DTYPE_ENUMERATOR(e, T, n) e,
  TD_FOR_EACH_DTYPE(TD_DTYPE_ENUMERATOR)
#undef TD_DTYPE_ENUMERATOR
};

/// Number of dtypes in the enum.
inline constexpr std::size_t kNumDTypes = 0
#define TD_DTYPE_COUNT(e, T, n) +1  // NOLINT(bugprone-macro-parentheses): one term of a sum
    TD_FOR_EACH_DTYPE(TD_DTYPE_COUNT)
#undef TD_DTYPE_COUNT
    ;

/// The dtype's name as torch spells it after "torch.": "float32", "int64", ...
TD_API std::string_view name(DType dtype);
/// The dtype named `name` as name() spells it ("float32", "int64", ...); nullopt for any other.
TD_API std::optional<DType> dtype_from_name(std::string_view name);
/// Size of one element in bytes.
TD_API std::size_t itemsize(DType dtype);

namespace detail {
template <class T>
struct DTypeOf;
#define TD_DTYPE_OF(e, T, n)                 \
  template <>                                \
  struct DTypeOf<T> {                        \
    static constexpr DType value = DType::e; \
  };
TD_FOR_EACH_DTYPE(TD_DTYPE_OF)
#undef TD_DTYPE_OF
}  // namespace detail

/// The dtype of a C++ element type: dtype_of<float> == DType::Float32.
template <class T>
inline constexpr DType dtype_of = detail::DTypeOf<std::remove_cv_t<T>>::value;

/// Calls f(std::type_identity<T>{}) with T the C++ type of `dtype`; returns what f returns.
template <class F>
decltype(auto) visit(DType dtype, F&& f) {
  switch (dtype) {
#define TD_DTYPE_CASE(e, T, n) \
  case DType::e:               \
    return std::forward<F>(f)(std::type_identity<T>{});
    TD_FOR_EACH_DTYPE(TD_DTYPE_CASE)
#undef TD_DTYPE_CASE
  }
  __builtin_unreachable();
}

/// True for Float16, BFloat16, Float32, Float64.
constexpr bool is_floating_point(DType d) {
  return d == DType::Float16 || d == DType::BFloat16 || d == DType::Float32 || d == DType::Float64;
}
/// True for Complex64 and Complex128.
constexpr bool is_complex(DType d) { return d == DType::Complex64 || d == DType::Complex128; }
/// True for the signed and unsigned integer dtypes (not Bool).
constexpr bool is_integral(DType d) {
  return d == DType::UInt8 || d == DType::Int8 || d == DType::Int16 || d == DType::Int32 ||
         d == DType::Int64;
}

}  // namespace td
