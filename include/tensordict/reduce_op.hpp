// td::ReduceOp: how a reduction combines the ranks' values (torch.distributed.ReduceOp).
#pragma once

#include <string_view>

#include "tensordict/dtype.hpp"
#include "tensordict/export.hpp"

namespace td {

/// Reduction operations, as torch.distributed.ReduceOp. AVG is SUM followed by a division.
enum class ReduceOp { SUM, PRODUCT, MIN, MAX, AVG, BAND, BOR, BXOR };

/// "SUM", "PRODUCT", ...
TD_API std::string_view name(ReduceOp op);
/// Whether `op` is defined on `dtype` (see docs/collectives.md for the table).
TD_API bool supports(ReduceOp op, DType dtype);

}  // namespace td
