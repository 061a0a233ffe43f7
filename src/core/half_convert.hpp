// float <-> float16 / bfloat16 over whole buffers, vectorised: the conversions of compressed
// collectives (CollectiveOptions::compression, the Reducer) and of the 16-bit MPI reductions.
// Element for element the same bits as Eigen::half / Eigen::bfloat16 (round to nearest even),
// NaN payloads aside (a NaN stays a NaN of the same sign).
#pragma once

#include <cstdint>

namespace td::detail {

/// out[i] = bfloat16(in[i] * scale).
void float_to_bf16(const float* in, std::int64_t n, float scale, std::uint16_t* out);
/// out[i] = float(in[i]) (exact).
void bf16_to_float(const std::uint16_t* in, std::int64_t n, float* out);
/// out[i] = float16(in[i] * scale): the CPU's F16C instructions where it has them.
void float_to_fp16(const float* in, std::int64_t n, float scale, std::uint16_t* out);
/// out[i] = float(in[i]) (exact).
void fp16_to_float(const std::uint16_t* in, std::int64_t n, float* out);

}  // namespace td::detail
