// White-box tests of the vectorised 16-bit conversions (core/half_convert.hpp) against Eigen's
// element-wise Eigen::half / Eigen::bfloat16, which the library used before: the same bits for
// every 16-bit pattern widened and for every float narrowed (a dense sweep of float bit patterns
// plus the special values), NaN payloads aside. Linked with the library's objects; no MPI.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include <Eigen/Core>

#include "core/half_convert.hpp"

namespace {

float from_bits(std::uint32_t u) {
  float f = 0;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// Every 2^11-th float bit pattern, both signs, and the values where rounding is decided: exact
// halfway points, the largest finite values, subnormals, zeros, infinities, NaNs.
std::vector<float> sample_floats() {
  std::vector<float> v;
  for (std::uint64_t u = 0; u <= 0xFFFFFFFFull; u += 2047)
    v.push_back(from_bits(static_cast<std::uint32_t>(u)));
  for (std::uint32_t u :
       {0x00000000u, 0x80000000u, 0x7F800000u, 0xFF800000u, 0x7FC00000u, 0x7F800001u, 0xFFC00001u,
        0x3F808000u, 0x3F818000u, 0x3F80C000u, 0x477FE000u, 0x477FF000u, 0x38800000u, 0x33800000u,
        0x33000000u, 0x00000001u, 0x007FFFFFu, 0x7F7FFFFFu})
    v.push_back(from_bits(u));
  for (float f : {65504.f, 65519.f, 65520.f, 1e-8f, 6.1e-5f, 5.96e-8f, 2.98e-8f, 1.f / 3.f})
    v.push_back(f), v.push_back(-f);
  return v;
}

bool same_or_both_nan(float a, float b) {
  if (std::isnan(a) || std::isnan(b)) return std::isnan(a) && std::isnan(b);
  std::uint32_t x = 0, y = 0;
  std::memcpy(&x, &a, 4);
  std::memcpy(&y, &b, 4);
  return x == y;
}

}  // namespace

TEST_CASE("widening every 16-bit pattern gives Eigen's float", "[half]") {
  std::vector<std::uint16_t> all(65536);
  for (std::uint32_t i = 0; i < 65536; ++i) all[i] = static_cast<std::uint16_t>(i);
  std::vector<float> fp16(all.size()), bf16(all.size());
  td::detail::fp16_to_float(all.data(), static_cast<std::int64_t>(all.size()), fp16.data());
  td::detail::bf16_to_float(all.data(), static_cast<std::int64_t>(all.size()), bf16.data());
  std::size_t bad = 0;
  for (std::uint32_t i = 0; i < 65536; ++i) {
    const auto h = static_cast<std::uint16_t>(i);
    if (!same_or_both_nan(fp16[i], static_cast<float>(Eigen::numext::bit_cast<Eigen::half>(h))))
      ++bad;
    if (!same_or_both_nan(bf16[i], static_cast<float>(Eigen::numext::bit_cast<Eigen::bfloat16>(h))))
      ++bad;
  }
  CHECK(bad == 0);
}

TEST_CASE("narrowing floats gives Eigen's 16-bit values, at any length and scale", "[half]") {
  const std::vector<float> in = sample_floats();
  for (const float scale : {1.0f, 0.25f, 3.0f}) {
    std::vector<std::uint16_t> fp16(in.size()), bf16(in.size());
    td::detail::float_to_fp16(in.data(), static_cast<std::int64_t>(in.size()), scale, fp16.data());
    td::detail::float_to_bf16(in.data(), static_cast<std::int64_t>(in.size()), scale, bf16.data());
    std::size_t bad_fp16 = 0, bad_bf16 = 0;
    for (std::size_t i = 0; i < in.size(); ++i) {
      const float x = in[i] * scale;
      const Eigen::half h(x);
      const Eigen::bfloat16 b(x);
      const auto hf = Eigen::numext::bit_cast<Eigen::half>(fp16[i]);
      const auto bf = Eigen::numext::bit_cast<Eigen::bfloat16>(bf16[i]);
      if (std::isnan(x)) {
        bad_fp16 += !Eigen::numext::isnan(hf);
        bad_bf16 += !Eigen::numext::isnan(bf) || ((bf16[i] ^ b.value) & 0x8000) != 0;
      } else {
        bad_fp16 += fp16[i] != h.x;
        bad_bf16 += bf16[i] != b.value;
      }
    }
    INFO("scale " << scale << ", " << in.size() << " values");
    CHECK(bad_fp16 == 0);
    CHECK(bad_bf16 == 0);
  }
  // Lengths around the vector width: the tails are converted too.
  for (std::int64_t n = 0; n < 20; ++n) {
    std::vector<float> x(static_cast<std::size_t>(n));
    for (std::int64_t i = 0; i < n; ++i)
      x[static_cast<std::size_t>(i)] = 0.1f * static_cast<float>(i) - 0.7f;
    std::vector<std::uint16_t> h(x.size() + 1, 0xABCD);
    td::detail::float_to_fp16(x.data(), n, 1.0f, h.data());
    for (std::int64_t i = 0; i < n; ++i)
      CHECK(h[static_cast<std::size_t>(i)] == Eigen::half(x[static_cast<std::size_t>(i)]).x);
    CHECK(h.back() == 0xABCD);  // nothing written past the end
  }
}
