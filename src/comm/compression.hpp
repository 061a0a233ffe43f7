// 16-bit wire formats for float32/float64 values (Compression::FP16 / BF16): the conversions the
// compressed all_reduce/reduce and the gradient Reducer share (not installed).
#pragma once

#include <cstddef>
#include <cstdint>

#include "tensordict/collectives.hpp"
#include "tensordict/dtype.hpp"

namespace td::detail {

/// Whether `dtype` travels compressed (float32, float64).
bool compressible(DType dtype);
/// The 16-bit dtype a compressed bucket travels as (FP16: Float16, BF16: BFloat16); `c` is not
/// Compression::None.
DType wire_dtype(Compression c);
/// Rounds `count` elements of `src` (of `dtype`: float32 or float64), each times `scale`, to
/// `wire` (Float16 or BFloat16) into `dst`.
void compress(const std::byte* src, DType dtype, std::int64_t count, double scale, DType wire,
              std::byte* dst);
/// Widens `count` elements of `src` (of `wire`) into `dst` (of `dtype`).
void decompress(const std::byte* src, DType wire, std::int64_t count, DType dtype, std::byte* dst);

}  // namespace td::detail
