#include "core/half_convert.hpp"

#include <cstring>

#include <Eigen/Core>

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#include <immintrin.h>
#define TD_HAVE_X86 1
#endif

namespace td::detail {

namespace {

// bfloat16 is float32's upper half: rounding to nearest even is integer arithmetic, written
// without branches so that the compiler vectorises the loop (Eigen::bfloat16's constructor
// branches on NaN, which keeps GCC's loop scalar). NaN: 0x7FC0 / 0xFFC0, as Eigen gives.
inline std::uint16_t bf16_bits(float f) {
  std::uint32_t u = 0;
  std::memcpy(&u, &f, sizeof u);
  const std::uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  const std::uint32_t nan = (u & 0x7FFFFFFFu) > 0x7F800000u ? 0xFFFFFFFFu : 0u;
  const std::uint32_t quiet = (u >> 16 & 0x8000u) | 0x7FC0u;
  return static_cast<std::uint16_t>((rounded & ~nan) | (quiet & nan));
}

#if TD_HAVE_X86
// F16C and AVX (its 256-bit registers) in CPUID leaf 1, and the OS saving the YMM state (XCR0
// bits 1 and 2): what _mm256_cvtps_ph needs. Read directly, as clang's __builtin_cpu_supports
// knows no "f16c".
bool has_f16c() {
  static const bool yes = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (__get_cpuid(1, &a, &b, &c, &d) == 0) return false;
    const bool osxsave = (c >> 27 & 1U) != 0, avx = (c >> 28 & 1U) != 0, f16c = (c >> 29 & 1U) != 0;
    if (!osxsave || !avx || !f16c) return false;
    unsigned lo = 0, hi = 0;
    __asm__("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    return (lo & 6U) == 6U;
  }();
  return yes;
}

__attribute__((target("avx,f16c"))) void float_to_fp16_f16c(const float* in, std::int64_t n,
                                                            float scale, std::uint16_t* out) {
  const __m256 s = _mm256_set1_ps(scale);
  std::int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_mul_ps(_mm256_loadu_ps(in + i), s);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i),
                     _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
  }
  for (; i < n; ++i) {
    const __m128 v = _mm_set_ss(in[i] * scale);
    out[i] = static_cast<std::uint16_t>(
        _mm_extract_epi16(_mm_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT), 0));
  }
}

__attribute__((target("avx,f16c"))) void fp16_to_float_f16c(const std::uint16_t* in, std::int64_t n,
                                                            float* out) {
  std::int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(out + i,
                     _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(in + i))));
  for (; i < n; ++i) out[i] = _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(in[i])));
}
#endif

}  // namespace

void float_to_bf16(const float* in, std::int64_t n, float scale, std::uint16_t* out) {
  std::int64_t i = 0;
#if TD_HAVE_X86
  // SSE2 (every x86-64): the same integer rounding on 8 values at a time. SSE2 packs 32-bit
  // lanes to 16 bits with signed saturation only, so the values are offset by 0x8000 first.
  const __m128 s = _mm_set1_ps(scale);
  const __m128i one = _mm_set1_epi32(1), bias = _mm_set1_epi32(0x7FFF);
  const __m128i abs_mask = _mm_set1_epi32(0x7FFFFFFF), inf = _mm_set1_epi32(0x7F800000);
  const __m128i sign16 = _mm_set1_epi32(0x8000), quiet_nan = _mm_set1_epi32(0x7FC0);
  const __m128i offset32 = _mm_set1_epi32(0x8000), offset16 = _mm_set1_epi16(-0x8000);
  auto four = [&](const float* p) {
    const __m128i u = _mm_castps_si128(_mm_mul_ps(_mm_loadu_ps(p), s));
    const __m128i lsb = _mm_and_si128(_mm_srli_epi32(u, 16), one);
    const __m128i rounded = _mm_srli_epi32(_mm_add_epi32(_mm_add_epi32(u, bias), lsb), 16);
    const __m128i nan = _mm_cmpgt_epi32(_mm_and_si128(u, abs_mask), inf);
    const __m128i quiet = _mm_or_si128(_mm_and_si128(_mm_srli_epi32(u, 16), sign16), quiet_nan);
    const __m128i r = _mm_or_si128(_mm_andnot_si128(nan, rounded), _mm_and_si128(nan, quiet));
    return _mm_sub_epi32(r, offset32);
  };
  for (; i + 8 <= n; i += 8) {
    const __m128i packed = _mm_packs_epi32(four(in + i), four(in + i + 4));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), _mm_xor_si128(packed, offset16));
  }
#endif
  for (; i < n; ++i) out[i] = bf16_bits(in[i] * scale);
}

void bf16_to_float(const std::uint16_t* in, std::int64_t n, float* out) {
  std::int64_t i = 0;
#if TD_HAVE_X86
  const __m128i zero = _mm_setzero_si128();
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(in + i));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), _mm_unpacklo_epi16(zero, h));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i + 4), _mm_unpackhi_epi16(zero, h));
  }
#endif
  for (; i < n; ++i) {
    const std::uint32_t u = static_cast<std::uint32_t>(in[i]) << 16;
    std::memcpy(out + i, &u, sizeof u);
  }
}

void float_to_fp16(const float* in, std::int64_t n, float scale, std::uint16_t* out) {
#if TD_HAVE_X86
  if (has_f16c()) return float_to_fp16_f16c(in, n, scale, out);
#endif
  for (std::int64_t i = 0; i < n; ++i) out[i] = Eigen::half(in[i] * scale).x;
}

void fp16_to_float(const std::uint16_t* in, std::int64_t n, float* out) {
#if TD_HAVE_X86
  if (has_f16c()) return fp16_to_float_f16c(in, n, out);
#endif
  for (std::int64_t i = 0; i < n; ++i)
    out[i] = static_cast<float>(Eigen::numext::bit_cast<Eigen::half>(in[i]));
}

}  // namespace td::detail
