// The test oracle: what rank r holds, what a reduction over the ranks must give, and how close a
// result must come to it. Shared by the MPI tests and the benchmarks' correctness guard
// (bench/support/guard.cpp), so both mean the same by "the right result".
//
// Two input patterns, one reduction: value<T> (small integers, exact under every op in every
// dtype: the reductions' tests) and distinct_value (every element of every rank its own value:
// the tests of what moves where, gathers, scatters and transfers); reduce_over combines either
// over the ranks, as the library defines each op.
#pragma once

#include <algorithm>
#include <cmath>
#include <complex>
#include <cstdint>
#include <functional>
#include <limits>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include <fmt/format.h>

#include <tensordict/tensordict.hpp>

namespace tdtest {

template <class T>
constexpr bool is_half_v = std::is_same_v<T, Eigen::half> || std::is_same_v<T, Eigen::bfloat16>;
template <class T>
constexpr bool is_complex_v =
    std::is_same_v<T, std::complex<float>> || std::is_same_v<T, std::complex<double>>;

/// Element i of rank r's input: small integers, so every supported reduction is exact (see
/// tolerance). `leaf` shifts the pattern, so that leaves of one dict differ and a swapped or
/// misplaced leaf shows; leaf 0 is a lone tensor.
template <class T>
T value(td::ReduceOp op, int rank, std::int64_t i, std::int64_t leaf = 0) {
  const int v = op == td::ReduceOp::PRODUCT
                    ? 1 + static_cast<int>((rank + i + leaf) % 2)
                    : static_cast<int>((std::int64_t{rank} * 7 + i * 3 + leaf * 5) % 11) + 1;
  if constexpr (std::is_same_v<T, bool>) {
    return op == td::ReduceOp::PRODUCT || op == td::ReduceOp::MIN || op == td::ReduceOp::BAND
               ? (rank + i + leaf) % 5 != 0
               : (rank + i + leaf) % 3 == 0;
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

/// `sum` divided by n as the library's AVG divides (dtypes without AVG, the integers: unchanged).
template <class T>
T average(T sum, int n) {
  if constexpr (is_half_v<T>) {
    return T(static_cast<float>(sum) / static_cast<float>(n));
  } else if constexpr (is_complex_v<T>) {
    return sum / static_cast<typename T::value_type>(n);
  } else if constexpr (std::is_floating_point_v<T>) {
    return sum / static_cast<T>(n);
  } else {
    return sum;
  }
}

/// Every rank takes part (reduce_over's default).
inline constexpr auto all_take_part = [](int) { return true; };

/// The reduction by `op` of input(r) over the ranks r in 0..size-1 for which takes_part(r), in
/// rank order, as combine<T> defines each op; AVG divides the sum by `avg_divisor`, or by the
/// number of ranks that took part when it is 0 (a group of those ranks). A rank that does not
/// take part contributes nothing, as a joined rank's zeros add nothing to a SUM (and count in
/// AVG's divisor: pass the group size); none taking part gives T{}.
template <class T, class Input, class TakesPart = decltype(all_take_part)>
T reduce_over(td::ReduceOp op, int size, const Input& input,
              const TakesPart& takes_part = all_take_part, int avg_divisor = 0) {
  T acc{};
  int taking_part = 0;
  for (int r = 0; r < size; ++r) {
    if (!takes_part(r)) continue;
    const T x = static_cast<T>(input(r));
    acc = taking_part++ == 0 ? x : combine<T>(op, acc, x);
  }
  if (op != td::ReduceOp::AVG || taking_part == 0) return acc;
  return average<T>(acc, avg_divisor != 0 ? avg_divisor : taking_part);
}

/// The reduction of element i of leaf `leaf` over ranks 0..size-1.
template <class T>
T expected(td::ReduceOp op, int size, std::int64_t i, std::int64_t leaf = 0) {
  return reduce_over<T>(op, size, [&](int r) { return value<T>(op, r, i, leaf); });
}

/// Element i of leaf `leaf` of rank r's input where every element of every rank must differ, so
/// that an element in the wrong place or from the wrong rank shows: gathers, scatters and
/// transfers (value<T> repeats every 11 ranks and elements, and the scatter tests' parts come
/// from "ranks" r + 10 and r + 20). Integers, exact in every dtype of 32 bits or more, as are
/// their sums, averages, minima and maxima over a few ranks (reduce_over<double>), not their
/// products. Negative ranks give a placeholder that no rank's input equals.
inline double distinct_value(int rank, std::int64_t i, std::int64_t leaf = 0) {
  return rank * 1000.0 + static_cast<double>(leaf) * 100.0 + static_cast<double>(i);
}

/// The reduction of element i of leaf `leaf` of distinct_value over ranks 0..size-1 for which
/// takes_part(r) (SUM, AVG, MIN, MAX; AVG divided by the ranks that take part).
template <class TakesPart = decltype(all_take_part)>
double distinct_expected(td::ReduceOp op, int size, std::int64_t i, std::int64_t leaf,
                         const TakesPart& takes_part = all_take_part) {
  return reduce_over<double>(
      op, size, [&](int r) { return distinct_value(r, i, leaf); }, takes_part);
}

/// The element-wise reduction of whole tensors over ranks 0..size-1: input(r) is rank r's tensor
/// (one shape and dtype on every rank, any strides); the result is contiguous.
inline td::Tensor reduce_tensors(td::ReduceOp op, int size,
                                 const std::function<td::Tensor(int)>& input) {
  std::vector<td::Tensor> inputs;
  for (int r = 0; r < size; ++r) inputs.push_back(input(r).contiguous());
  td::Tensor out = td::Tensor::empty(inputs.at(0).shape(), inputs.at(0).dtype());
  td::visit(out.dtype(), [&](auto tag) {
    using T = typename decltype(tag)::type;
    T* o = out.data<T>();
    for (std::int64_t i = 0; i < out.numel(); ++i)
      o[i] = reduce_over<T>(
          op, size, [&](int r) { return inputs[static_cast<std::size_t>(r)].data<T>()[i]; });
  });
  return out;
}

/// The real type of T's values (T itself unless complex).
template <class T>
struct RealOf {
  using type = T;
};
template <class R>
struct RealOf<std::complex<R>> {
  using type = R;
};

/// How far a reduction over `size` ranks may lie from expected<T>, relative to
/// max(1, |expected|). 0 (equal, bit for bit) wherever every partial result is an integer that T
/// holds exactly: integers (which wrap alike), MIN and MAX, PRODUCT of real values (powers of
/// two), and SUM or AVG while the total (at most 11 per rank) fits T's significand, which is every
/// dtype at the rank counts the tests run at and only 16-bit floats at many ranks (bfloat16 from
/// 24 ranks, float16 from 187) lack. Beyond that each of the size - 1 steps may round, in an
/// order the library or MPI picks.
template <class T>
double tolerance(td::ReduceOp op, int size) {
  if constexpr (std::is_integral_v<T>) {
    return 0.0;
  } else {
    using Real = typename RealOf<T>::type;
    double largest = 11.0 * size;  // SUM, AVG
    if (op == td::ReduceOp::MIN || op == td::ReduceOp::MAX) return 0.0;
    if (op == td::ReduceOp::PRODUCT) {
      if constexpr (!is_complex_v<T>) return 0.0;
      largest = std::pow(std::sqrt(8.0), size);  // |(2+2i)^size|
    }
    const int digits = std::numeric_limits<Real>::digits;
    if (largest <= std::ldexp(1.0, digits)) return 0.0;
    return size * std::ldexp(1.0, 1 - digits);
  }
}

/// `x` as a complex double (for comparing and printing any dtype alike).
template <class T>
std::complex<double> as_complex(T x) {
  if constexpr (is_complex_v<T>) {
    return {static_cast<double>(x.real()), static_cast<double>(x.imag())};
  } else if constexpr (is_half_v<T>) {
    return static_cast<double>(static_cast<float>(x));
  } else {
    return static_cast<double>(x);
  }
}

/// Whether `got` is `want` within relative tolerance `tol` (0: equal).
template <class T>
bool matches(T got, T want, double tol) {
  if (got == want) return true;
  if (tol == 0) return false;
  const std::complex<double> g = as_complex(got), w = as_complex(want);
  return std::abs(g - w) <= tol * std::max(1.0, std::abs(w));
}

/// A tensor of `shape` holding rank r's inputs for `op`.
template <class T>
td::Tensor make_input(td::ReduceOp op, int rank, const td::Shape& shape, std::int64_t leaf = 0) {
  td::Tensor t = td::Tensor::empty(shape, td::dtype_of<T>);
  T* p = t.data<T>();
  for (std::int64_t i = 0; i < t.numel(); ++i) p[i] = value<T>(op, rank, i, leaf);
  return t;
}

/// Writes rank r's inputs for `op` into t (any dtype, any strides).
inline void fill_input(td::Tensor& t, td::ReduceOp op, int rank, std::int64_t leaf = 0) {
  td::visit(t.dtype(), [&](auto tag) {
    using T = typename decltype(tag)::type;
    if (!t.is_contiguous()) {
      t.copy_(make_input<T>(op, rank, t.shape(), leaf));
      return;
    }
    T* p = t.data<T>();
    for (std::int64_t i = 0, n = t.numel(); i < n; ++i) p[i] = value<T>(op, rank, i, leaf);
  });
}

/// The first logical position i at which t (any strides) does not hold expected<T>(op, size, i,
/// leaf) within `tol` (by default tolerance<T>(op, size)); nullopt if there is none.
template <class T>
std::optional<std::int64_t> first_wrong(const td::Tensor& t, td::ReduceOp op, int size,
                                        std::int64_t leaf = 0,
                                        std::optional<double> tol_override = std::nullopt) {
  const auto v = t.to_vector<T>();
  const double tol = tol_override.value_or(tolerance<T>(op, size));
  for (std::size_t i = 0; i < v.size(); ++i) {
    const auto at = static_cast<std::int64_t>(i);
    if (!matches<T>(v[i], expected<T>(op, size, at, leaf), tol)) return at;
  }
  return std::nullopt;
}

/// Whether t (any strides) holds expected<T>(op, size, i) at logical position i.
template <class T>
bool holds_expected(const td::Tensor& t, td::ReduceOp op, int size) {
  return !first_wrong<T>(t, op, size).has_value();
}

/// "" if t (any dtype) holds the reduction of leaf `leaf` over `size` ranks within `tol` (by
/// default tolerance<T>(op, size): a test whose result is legitimately less exact, a compressed
/// one, passes its own), else its first wrong element ("element 7: got 3, expected 4").
inline std::string reduction_error(const td::Tensor& t, td::ReduceOp op, int size,
                                   std::int64_t leaf = 0,
                                   std::optional<double> tol = std::nullopt) {
  return td::visit(t.dtype(), [&](auto tag) -> std::string {
    using T = typename decltype(tag)::type;
    const auto i = first_wrong<T>(t, op, size, leaf, tol);
    if (!i) return {};
    auto text = [](std::complex<double> z) {
      return z.imag() == 0 ? fmt::format("{}", z.real())
                           : fmt::format("{}{:+}i", z.real(), z.imag());
    };
    const std::vector<T> v = t.to_vector<T>();
    return fmt::format("element {}: got {}, expected {}", *i,
                       text(as_complex<T>(v[static_cast<std::size_t>(*i)])),
                       text(as_complex<T>(expected<T>(op, size, *i, leaf))));
  });
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
