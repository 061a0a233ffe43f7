#include "comm/compression.hpp"

#include <stdexcept>
#include <type_traits>

#include <Eigen/Core>

#include "tensordict/collectives.hpp"

namespace td::detail {

namespace {

template <class Half, class T>
void narrow(const T* in, std::int64_t count, T scale, Half* out) {
  for (std::int64_t i = 0; i < count; ++i) out[i] = Half(static_cast<float>(in[i] * scale));
}

template <class Half, class T>
void widen(const Half* in, std::int64_t count, T* out) {
  for (std::int64_t i = 0; i < count; ++i) out[i] = static_cast<T>(static_cast<float>(in[i]));
}

// Calls f(Half*) / f(const Half*) for the wire dtype and T for the value dtype.
template <class F>
void dispatch(DType dtype, DType wire, F&& f) {
  auto with_half = [&](auto value) {
    using T = decltype(value);
    if (wire == DType::Float16) {
      f(T{}, Eigen::half{});
    } else if (wire == DType::BFloat16) {
      f(T{}, Eigen::bfloat16{});
    } else {
      throw std::logic_error("compression: the wire dtype must be float16 or bfloat16");
    }
  };
  if (dtype == DType::Float32) {
    with_half(float{});
  } else if (dtype == DType::Float64) {
    with_half(double{});
  } else {
    throw std::logic_error("compression: only float32 and float64 values are compressed");
  }
}

}  // namespace

bool compressible(DType dtype) { return dtype == DType::Float32 || dtype == DType::Float64; }

DType wire_dtype(Compression c) {
  if (c == Compression::None) throw std::logic_error("compression: None has no wire dtype");
  return c == Compression::FP16 ? DType::Float16 : DType::BFloat16;
}

void compress(const std::byte* src, DType dtype, std::int64_t count, double scale, DType wire,
              std::byte* dst) {
  dispatch(dtype, wire, [&](auto t, auto h) {
    using T = decltype(t);
    using Half = decltype(h);
    narrow(reinterpret_cast<const T*>(src), count, static_cast<T>(scale),
           reinterpret_cast<Half*>(dst));
  });
}

void decompress(const std::byte* src, DType wire, std::int64_t count, DType dtype, std::byte* dst) {
  dispatch(dtype, wire, [&](auto t, auto h) {
    using T = decltype(t);
    using Half = decltype(h);
    widen(reinterpret_cast<const Half*>(src), count, reinterpret_cast<T*>(dst));
  });
}

}  // namespace td::detail

namespace td {

std::string_view name(Compression c) {
  switch (c) {
    case Compression::None:
      return "None";
    case Compression::FP16:
      return "FP16";
    case Compression::BF16:
      return "BF16";
  }
  return "?";
}

}  // namespace td
