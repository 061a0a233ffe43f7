#include "comm/compression.hpp"

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <type_traits>

#include <Eigen/Core>

#include "core/half_convert.hpp"
#include "tensordict/collectives.hpp"

namespace td::detail {

namespace {

// The 16-bit conversions of whole buffers (core/half_convert.hpp: vectorised); float64 values
// go through float in chunks, as the element-wise conversion did (double * scale -> float -> 16).
template <class Half>
void narrow_floats(const float* in, std::int64_t n, float scale, Half* out) {
  auto* bits = reinterpret_cast<std::uint16_t*>(out);
  if constexpr (std::is_same_v<Half, Eigen::half>) {
    float_to_fp16(in, n, scale, bits);
  } else {
    float_to_bf16(in, n, scale, bits);
  }
}

template <class Half>
void widen_floats(const Half* in, std::int64_t n, float* out) {
  const auto* bits = reinterpret_cast<const std::uint16_t*>(in);
  if constexpr (std::is_same_v<Half, Eigen::half>) {
    fp16_to_float(bits, n, out);
  } else {
    bf16_to_float(bits, n, out);
  }
}

constexpr std::int64_t kChunk = 1024;

template <class Half, class T>
void narrow(const T* in, std::int64_t count, T scale, Half* out) {
  if constexpr (std::is_same_v<T, float>) {
    narrow_floats(in, count, scale, out);
  } else {
    float tmp[kChunk];
    for (std::int64_t i = 0; i < count; i += kChunk) {
      const std::int64_t m = std::min(kChunk, count - i);
      for (std::int64_t j = 0; j < m; ++j) tmp[j] = static_cast<float>(in[i + j] * scale);
      narrow_floats(tmp, m, 1.0f, out + i);
    }
  }
}

template <class Half, class T>
void widen(const Half* in, std::int64_t count, T* out) {
  if constexpr (std::is_same_v<T, float>) {
    widen_floats(in, count, out);
  } else {
    float tmp[kChunk];
    for (std::int64_t i = 0; i < count; i += kChunk) {
      const std::int64_t m = std::min(kChunk, count - i);
      widen_floats(in + i, m, tmp);
      for (std::int64_t j = 0; j < m; ++j) out[i + j] = static_cast<T>(tmp[j]);
    }
  }
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
