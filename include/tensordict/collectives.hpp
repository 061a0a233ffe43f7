// Collectives on one tensor (torch.distributed.reduce / all_reduce / broadcast) and the options
// shared with the TensorDict collectives.
#pragma once

#include <chrono>
#include <cstddef>
#include <limits>
#include <optional>
#include <string_view>

#include "tensordict/bucket_bytes.hpp"
#include "tensordict/dtype.hpp"
#include "tensordict/export.hpp"
#include "tensordict/process_group.hpp"
#include "tensordict/reduce_op.hpp"
#include "tensordict/tensor.hpp"
#include "tensordict/work.hpp"

namespace td {

/// Tags of point-to-point calls (CollectiveOptions::tag) lie in [0, kMaxUserTag).
inline constexpr int kMaxUserTag = 1 << 14;

/// How float32/float64 values travel in a reduction: as they are, or rounded to 16-bit floats
/// (DDP's fp16_compress_hook / bf16_compress_hook, Horovod's Compression.fp16). Other dtypes
/// always travel as they are.
enum class Compression { None, FP16, BF16 };

/// "None", "FP16", "BF16".
TD_API std::string_view name(Compression c);

/// Options of every collective.
struct CollectiveOptions {
  /// Default: world().
  std::optional<ProcessGroup> group = std::nullopt;
  /// Return pending Works instead of waiting.
  bool async_op = false;
  /// TensorDict only. nullopt: one collective per leaf; kAutoBucketBytes: tuned on this machine.
  std::optional<std::size_t> bucket_bytes = std::nullopt;
  /// Default: InitOptions::timeout.
  std::optional<std::chrono::milliseconds> timeout = std::nullopt;
  /// Point to point only: transfers with different tags between the same two ranks never take
  /// each other's messages, whatever order threads start them in (like MPI's tag; default 0).
  /// Transfers with one tag pair up in the order each side starts them.
  std::optional<int> tag = std::nullopt;
  /// all_reduce and reduce (Tensor and TensorDict) only: float32/float64 buckets travel as 16-bit
  /// floats, SUM and AVG (AVG divides before summing). Part of what ranks agree on.
  Compression compression = Compression::None;
};

namespace detail {
/// A default-constructed CollectiveOptions: the default argument of the TensorDict collectives,
/// which tensor_dict.hpp declares without this header (core knows nothing of MPI).
TD_API const CollectiveOptions& default_collective_options();
}  // namespace detail

/// Reduces `t` across the group into rank `dst` (in place); other ranks' `t` is unspecified.
TD_API Work reduce(Tensor& t, int dst, ReduceOp op = ReduceOp::SUM,
                   const CollectiveOptions& opts = {});
/// Reduces `t` across the group into every rank (in place).
TD_API Work all_reduce(Tensor& t, ReduceOp op = ReduceOp::SUM, const CollectiveOptions& opts = {});
/// Copies rank `src`'s `t` into every rank's `t` (same shape and dtype everywhere).
TD_API Work broadcast(Tensor& t, int src, const CollectiveOptions& opts = {});

/// Sends `t` to rank `dst` of the group, whose matching recv() holds the same dtype and shape
/// (checked first: a mismatch is a td::LayoutMismatchError on both sides and moves no data).
/// With opts.async_op the returned Work is pending and `t` must not change until it completes.
TD_API Work send(const Tensor& t, int dst, const CollectiveOptions& opts = {});
/// Receives rank `src`'s send() into `t` (any strides), which holds the sender's dtype and shape.
TD_API Work recv(Tensor& t, int src, const CollectiveOptions& opts = {});
/// send() with async_op set: returns at once with a pending Work (torch.distributed.isend).
[[nodiscard]] TD_API Work isend(const Tensor& t, int dst, const CollectiveOptions& opts = {});
/// recv() with async_op set: returns at once with a pending Work (torch.distributed.irecv).
[[nodiscard]] TD_API Work irecv(Tensor& t, int src, const CollectiveOptions& opts = {});

}  // namespace td
