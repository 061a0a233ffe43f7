// DType -> MPI datatype and ReduceOp -> MPI operation, including the user-defined ones for the
// 16-bit floats that Open MPI 4.1 lacks.
#include <algorithm>
#include <array>
#include <cstdint>
#include <type_traits>

#include <fmt/format.h>
#include <Eigen/Core>

#include "core/half_convert.hpp"
#include "runtime/mpi_error.hpp"
#include "runtime/mpi_types.hpp"

namespace td {

std::string_view name(ReduceOp op) {
  switch (op) {
    case ReduceOp::SUM:
      return "SUM";
    case ReduceOp::PRODUCT:
      return "PRODUCT";
    case ReduceOp::MIN:
      return "MIN";
    case ReduceOp::MAX:
      return "MAX";
    case ReduceOp::AVG:
      return "AVG";
    case ReduceOp::BAND:
      return "BAND";
    case ReduceOp::BOR:
      return "BOR";
    case ReduceOp::BXOR:
      return "BXOR";
  }
  return "?";
}

bool supports(ReduceOp op, DType dtype) {
  const bool bitwise = op == ReduceOp::BAND || op == ReduceOp::BOR || op == ReduceOp::BXOR;
  if (dtype == DType::Bool) return op != ReduceOp::AVG;  // SUM/MAX = or, PRODUCT/MIN = and
  if (is_integral(dtype)) return op != ReduceOp::AVG;
  if (is_floating_point(dtype)) return !bitwise;
  return op == ReduceOp::SUM || op == ReduceOp::PRODUCT || op == ReduceOp::AVG;  // complex
}

namespace detail {

namespace {

// Half-precision reductions: each step computes in float and rounds back to the 16-bit type,
// a chunk at a time through the vectorised conversions (core/half_convert.hpp).
template <class Half, class Fn>
void half_reduce(void* in, void* inout, int* len, Fn fn) {
  constexpr bool fp16 = std::is_same_v<Half, Eigen::half>;
  const auto* a = static_cast<const std::uint16_t*>(in);
  auto* b = static_cast<std::uint16_t*>(inout);
  constexpr int kChunk = 256;
  float fa[kChunk], fb[kChunk];
  for (int i = 0; i < *len; i += kChunk) {
    const int m = std::min(kChunk, *len - i);
    if constexpr (fp16) {
      fp16_to_float(a + i, m, fa);
      fp16_to_float(b + i, m, fb);
    } else {
      bf16_to_float(a + i, m, fa);
      bf16_to_float(b + i, m, fb);
    }
    for (int j = 0; j < m; ++j) fb[j] = fn(fa[j], fb[j]);
    if constexpr (fp16) {
      float_to_fp16(fb, m, 1.0f, b + i);
    } else {
      float_to_bf16(fb, m, 1.0f, b + i);
    }
  }
}

template <class Half>
void half_sum(void* in, void* inout, int* len, MPI_Datatype*) {
  half_reduce<Half>(in, inout, len, [](float x, float y) { return x + y; });
}
template <class Half>
void half_prod(void* in, void* inout, int* len, MPI_Datatype*) {
  half_reduce<Half>(in, inout, len, [](float x, float y) { return x * y; });
}
template <class Half>
void half_min(void* in, void* inout, int* len, MPI_Datatype*) {
  half_reduce<Half>(in, inout, len, [](float x, float y) { return std::min(x, y); });
}
template <class Half>
void half_max(void* in, void* inout, int* len, MPI_Datatype*) {
  half_reduce<Half>(in, inout, len, [](float x, float y) { return std::max(x, y); });
}

struct HalfTypes {
  MPI_Datatype type = MPI_DATATYPE_NULL;
  std::array<MPI_Op, 4> ops{MPI_OP_NULL, MPI_OP_NULL, MPI_OP_NULL,
                            MPI_OP_NULL};  // sum prod min max
};
HalfTypes g_float16, g_bfloat16;

template <class Half>
void create(HalfTypes& h) {
  if (h.type != MPI_DATATYPE_NULL) return;
  TD_MPI_CHECK(MPI_Type_contiguous(2, MPI_BYTE, &h.type));
  TD_MPI_CHECK(MPI_Type_commit(&h.type));
  TD_MPI_CHECK(MPI_Op_create(&half_sum<Half>, 1, &h.ops[0]));
  TD_MPI_CHECK(MPI_Op_create(&half_prod<Half>, 1, &h.ops[1]));
  TD_MPI_CHECK(MPI_Op_create(&half_min<Half>, 1, &h.ops[2]));
  TD_MPI_CHECK(MPI_Op_create(&half_max<Half>, 1, &h.ops[3]));
}

void release(HalfTypes& h) {
  for (auto& op : h.ops)
    if (op != MPI_OP_NULL) MPI_Op_free(&op);
  if (h.type != MPI_DATATYPE_NULL) MPI_Type_free(&h.type);
}

}  // namespace

void create_mpi_types() {
  create<Eigen::half>(g_float16);
  create<Eigen::bfloat16>(g_bfloat16);
}

void free_mpi_types() {
  release(g_float16);
  release(g_bfloat16);
}

MPI_Datatype mpi_datatype(DType dtype) {
  switch (dtype) {
    case DType::Bool:  // 0/1 bytes: MAX = or, MIN = and, bitwise ops exact
    case DType::UInt8:
      return MPI_UINT8_T;
    case DType::Int8:
      return MPI_INT8_T;
    case DType::Int16:
      return MPI_INT16_T;
    case DType::Int32:
      return MPI_INT32_T;
    case DType::Int64:
      return MPI_INT64_T;
    case DType::Float16:
      return g_float16.type;
    case DType::BFloat16:
      return g_bfloat16.type;
    case DType::Float32:
      return MPI_FLOAT;
    case DType::Float64:
      return MPI_DOUBLE;
    case DType::Complex64:
      return MPI_C_FLOAT_COMPLEX;
    case DType::Complex128:
      return MPI_C_DOUBLE_COMPLEX;
  }
  return MPI_DATATYPE_NULL;
}

MPI_Op mpi_op(ReduceOp op, DType dtype) {
  if (dtype == DType::Float16 || dtype == DType::BFloat16) {
    const HalfTypes& h = dtype == DType::Float16 ? g_float16 : g_bfloat16;
    switch (op) {
      case ReduceOp::SUM:
      case ReduceOp::AVG:
        return h.ops[0];
      case ReduceOp::PRODUCT:
        return h.ops[1];
      case ReduceOp::MIN:
        return h.ops[2];
      case ReduceOp::MAX:
        return h.ops[3];
      default:
        return MPI_OP_NULL;
    }
  }
  if (dtype == DType::Bool) {
    if (op == ReduceOp::SUM) return MPI_MAX;
    if (op == ReduceOp::PRODUCT) return MPI_MIN;
  }
  switch (op) {
    case ReduceOp::SUM:
    case ReduceOp::AVG:
      return MPI_SUM;
    case ReduceOp::PRODUCT:
      return MPI_PROD;
    case ReduceOp::MIN:
      return MPI_MIN;
    case ReduceOp::MAX:
      return MPI_MAX;
    case ReduceOp::BAND:
      return MPI_BAND;
    case ReduceOp::BOR:
      return MPI_BOR;
    case ReduceOp::BXOR:
      return MPI_BXOR;
  }
  return MPI_OP_NULL;
}

// Through Eigen's packet math: GCC -O2 leaves a plain loop of divisions scalar (one divss per
// element, several times slower than the vector division). Eigen's division is IEEE division
// too, so the results are the same bits. A power-of-two divisor (2, 4, 8 ranks...) multiplies by
// its reciprocal instead, cheaper still and the same bits: 1/2^k is exact, and x * 2^-k and
// x / 2^k are both the correctly rounded value of the same real number. Complex values divide as
// their real and imaginary parts, as std::complex's operator/= by a real does.
void divide_in_place(void* data, std::int64_t count, DType dtype, int divisor) {
  visit(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    if constexpr (std::is_same_v<T, Eigen::half> || std::is_same_v<T, Eigen::bfloat16>) {
      T* p = static_cast<T*>(data);
      for (std::int64_t i = 0; i < count; ++i)
        p[i] = T(static_cast<float>(p[i]) / static_cast<float>(divisor));
    } else if constexpr (std::is_floating_point_v<T> || std::is_same_v<T, std::complex<float>> ||
                         std::is_same_v<T, std::complex<double>>) {
      using Real = decltype(std::abs(T{}));
      constexpr std::int64_t kParts = std::is_same_v<T, Real> ? 1 : 2;  // complex: 2 parts
      Eigen::Map<Eigen::Array<Real, Eigen::Dynamic, 1>> values(static_cast<Real*>(data),
                                                               count * kParts);
      if ((divisor & (divisor - 1)) == 0) {
        values *= Real(1) / static_cast<Real>(divisor);
      } else {
        values /= static_cast<Real>(divisor);
      }
    } else {
      throw std::invalid_argument(fmt::format("AVG is not defined for {}", name(dtype)));
    }
  });
}

}  // namespace detail
}  // namespace td
