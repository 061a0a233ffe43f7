// The raw-MPI baselines' MPI objects (raw_mpi.hpp).
#include "raw_mpi.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <type_traits>

#include "support/reference.hpp"

namespace td_bench {

namespace {

// A user-defined reduction of 16-bit floats: each step computes in float and rounds back.
template <class Half, class Fn>
void half_op(void* in, void* inout, int* len, MPI_Datatype* /*type*/) {
  const Half* a = static_cast<const Half*>(in);
  Half* b = static_cast<Half*>(inout);
  for (int i = 0; i < *len; ++i)
    b[i] = Half(Fn{}(static_cast<float>(a[i]), static_cast<float>(b[i])));
}

struct Min {
  float operator()(float x, float y) const { return std::min(x, y); }
};
struct Max {
  float operator()(float x, float y) const { return std::max(x, y); }
};

}  // namespace

RawMpi::RawMpi() {
  MPI_Comm_dup(MPI_COMM_WORLD, &comm_);
  create<Eigen::half>(half_);
  create<Eigen::bfloat16>(bfloat_);
}

RawMpi::~RawMpi() {
  release(half_);
  release(bfloat_);
  if (comm_ != MPI_COMM_NULL) MPI_Comm_free(&comm_);
}

MPI_Datatype RawMpi::type(td::DType d) const {
  if (d == td::DType::Float16) return half_.type;
  if (d == td::DType::BFloat16) return bfloat_.type;
  // In td::DType order: Bool (as bytes), UInt8, Int8, Int16, Int32, Int64, Float16, BFloat16,
  // Float32, Float64, Complex64, Complex128.
  const MPI_Datatype builtin[] = {MPI_UINT8_T,       MPI_UINT8_T,         MPI_INT8_T,
                                  MPI_INT16_T,       MPI_INT32_T,         MPI_INT64_T,
                                  MPI_DATATYPE_NULL, MPI_DATATYPE_NULL,   MPI_FLOAT,
                                  MPI_DOUBLE,        MPI_C_FLOAT_COMPLEX, MPI_C_DOUBLE_COMPLEX};
  static_assert(sizeof builtin / sizeof builtin[0] == td::kNumDTypes);
  return builtin[static_cast<std::size_t>(d)];
}

MPI_Op RawMpi::op(td::ReduceOp op, td::DType d) const {
  const bool half = d == td::DType::Float16 || d == td::DType::BFloat16;
  const Half& h = d == td::DType::Float16 ? half_ : bfloat_;
  switch (op) {
    case td::ReduceOp::SUM:
    case td::ReduceOp::AVG:
      return half ? h.ops[0] : MPI_SUM;
    case td::ReduceOp::PRODUCT:
      return half ? h.ops[1] : MPI_PROD;
    case td::ReduceOp::MIN:
      return half ? h.ops[2] : MPI_MIN;
    case td::ReduceOp::MAX:
      return half ? h.ops[3] : MPI_MAX;
    case td::ReduceOp::BAND:
      return half ? MPI_OP_NULL : MPI_BAND;
    case td::ReduceOp::BOR:
      return half ? MPI_OP_NULL : MPI_BOR;
    case td::ReduceOp::BXOR:
      return half ? MPI_OP_NULL : MPI_BXOR;
  }
  return MPI_OP_NULL;
}

template <class T>
void RawMpi::create(Half& h) {
  MPI_Type_contiguous(2, MPI_BYTE, &h.type);
  MPI_Type_commit(&h.type);
  MPI_Op_create(&half_op<T, std::plus<float>>, 1, &h.ops[0]);
  MPI_Op_create(&half_op<T, std::multiplies<float>>, 1, &h.ops[1]);
  MPI_Op_create(&half_op<T, Min>, 1, &h.ops[2]);
  MPI_Op_create(&half_op<T, Max>, 1, &h.ops[3]);
}

void RawMpi::release(Half& h) {
  for (auto& o : h.ops)
    if (o != MPI_OP_NULL) MPI_Op_free(&o);
  if (h.type != MPI_DATATYPE_NULL) MPI_Type_free(&h.type);
}

void divide_in_place(td::Tensor& t, int n) {
  td::visit(t.dtype(), [&](auto tag) {
    using T = typename decltype(tag)::type;
    if constexpr (tdtest::is_half_v<T>) {
      T* p = t.data<T>();
      for (std::int64_t i = 0, e = t.numel(); i < e; ++i)
        p[i] = T(static_cast<float>(p[i]) / static_cast<float>(n));
    } else if constexpr (std::is_floating_point_v<T> || tdtest::is_complex_v<T>) {
      T* p = t.data<T>();
      using Real = decltype(std::abs(T{}));
      for (std::int64_t i = 0, e = t.numel(); i < e; ++i) p[i] /= static_cast<Real>(n);
    }
  });
}

}  // namespace td_bench
