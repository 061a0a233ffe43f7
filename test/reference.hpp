// Reference values for collective tests: what rank r holds, and the reduction computed locally.
#pragma once

#include <complex>
#include <type_traits>

#include <tensordict/tensordict.hpp>

namespace tdtest {

template <class T>
constexpr bool is_half_v = std::is_same_v<T, Eigen::half> || std::is_same_v<T, Eigen::bfloat16>;
template <class T>
constexpr bool is_complex_v =
    std::is_same_v<T, std::complex<float>> || std::is_same_v<T, std::complex<double>>;

/// Element i of rank r's input: small integers, so every supported reduction is exact.
template <class T>
T value(td::ReduceOp op, int rank, std::int64_t i) {
  const int v = op == td::ReduceOp::PRODUCT ? 1 + static_cast<int>((rank + i) % 2)
                                            : static_cast<int>((rank * 7 + i * 3) % 11) + 1;
  if constexpr (std::is_same_v<T, bool>) {
    return op == td::ReduceOp::PRODUCT || op == td::ReduceOp::MIN || op == td::ReduceOp::BAND
               ? (rank + i) % 5 != 0
               : (rank + i) % 3 == 0;
  } else if constexpr (is_complex_v<T>) {
    return T(static_cast<typename T::value_type>(v), static_cast<typename T::value_type>(v % 3));
  } else if constexpr (is_half_v<T>) {
    return T(static_cast<float>(v));
  } else {
    return static_cast<T>(v);
  }
}

/// a op b as the library defines it (bool: SUM/MAX = or, PRODUCT/MIN = and).
template <class T>
T combine(td::ReduceOp op, T a, T b) {
  using td::ReduceOp;
  if constexpr (std::is_same_v<T, bool>) {
    switch (op) {
      case ReduceOp::SUM:
      case ReduceOp::MAX:
      case ReduceOp::BOR:
        return a || b;
      case ReduceOp::PRODUCT:
      case ReduceOp::MIN:
      case ReduceOp::BAND:
        return a && b;
      case ReduceOp::BXOR:
        return a != b;
      default:
        return a;
    }
  } else if constexpr (is_half_v<T>) {
    const float x = static_cast<float>(a), y = static_cast<float>(b);
    switch (op) {
      case ReduceOp::SUM:
      case ReduceOp::AVG:
        return T(x + y);
      case ReduceOp::PRODUCT:
        return T(x * y);
      case ReduceOp::MIN:
        return T(std::min(x, y));
      case ReduceOp::MAX:
        return T(std::max(x, y));
      default:
        return a;
    }
  } else if constexpr (is_complex_v<T>) {
    return op == ReduceOp::PRODUCT ? a * b : a + b;
  } else {
    switch (op) {
      case ReduceOp::SUM:
      case ReduceOp::AVG:
        return static_cast<T>(a + b);
      case ReduceOp::PRODUCT:
        return static_cast<T>(a * b);
      case ReduceOp::MIN:
        return std::min(a, b);
      case ReduceOp::MAX:
        return std::max(a, b);
      default:
        break;
    }
    if constexpr (std::is_integral_v<T>) {
      if (op == ReduceOp::BAND) return static_cast<T>(a & b);
      if (op == ReduceOp::BOR) return static_cast<T>(a | b);
      if (op == ReduceOp::BXOR) return static_cast<T>(a ^ b);
    }
    return a;
  }
}

/// The reduction of element i over ranks 0..size-1 (AVG divided like the library does).
template <class T>
T expected(td::ReduceOp op, int size, std::int64_t i) {
  T acc = value<T>(op, 0, i);
  for (int r = 1; r < size; ++r) acc = combine<T>(op, acc, value<T>(op, r, i));
  if (op == td::ReduceOp::AVG) {
    if constexpr (is_half_v<T>) {
      acc = T(static_cast<float>(acc) / static_cast<float>(size));
    } else if constexpr (is_complex_v<T>) {
      acc /= static_cast<typename T::value_type>(size);
    } else if constexpr (std::is_floating_point_v<T>) {
      acc /= static_cast<T>(size);
    }
  }
  return acc;
}

/// A tensor of `shape` holding rank r's inputs for `op`.
template <class T>
td::Tensor make_input(td::ReduceOp op, int rank, const td::Shape& shape) {
  td::Tensor t = td::Tensor::empty(shape, td::dtype_of<T>);
  T* p = t.data<T>();
  for (std::int64_t i = 0; i < t.numel(); ++i) p[i] = value<T>(op, rank, i);
  return t;
}

/// Whether t (any strides) holds expected<T>(op, size, i) at logical position i.
template <class T>
bool holds_expected(const td::Tensor& t, td::ReduceOp op, int size) {
  const auto v = t.to_vector<T>();
  for (std::size_t i = 0; i < v.size(); ++i)
    if (!(v[i] == expected<T>(op, size, static_cast<std::int64_t>(i)))) return false;
  return true;
}

/// Whether t holds rank r's inputs.
template <class T>
bool holds_input(const td::Tensor& t, td::ReduceOp op, int rank) {
  const auto v = t.to_vector<T>();
  for (std::size_t i = 0; i < v.size(); ++i)
    if (!(v[i] == value<T>(op, rank, static_cast<std::int64_t>(i)))) return false;
  return true;
}

inline constexpr td::ReduceOp kAllOps[] = {
    td::ReduceOp::SUM, td::ReduceOp::PRODUCT, td::ReduceOp::MIN, td::ReduceOp::MAX,
    td::ReduceOp::AVG, td::ReduceOp::BAND,    td::ReduceOp::BOR, td::ReduceOp::BXOR};

}  // namespace tdtest
