// The one path every collective takes: leaves -> layout agreement -> bucket plan -> MPI.
#pragma once

#include <span>
#include <string_view>
#include <vector>

#include "dict_internal.hpp"
#include "runtime.hpp"

namespace td::detail {

/// Which collective runs.
enum class CollectiveKind : std::uint8_t { AllReduce, Reduce, Broadcast };

/// A collective's arguments that every rank must agree on.
struct CollectiveCall {
  CollectiveKind kind = CollectiveKind::AllReduce;
  ReduceOp op = ReduceOp::SUM;
  int root = 0;            // dst of reduce, src of broadcast
  std::string_view name;   // "all_reduce", "TensorDict.reduce", ... for messages
  bool from_dict = false;  // bucket_bytes applies (and TD_BUCKET_BYTES)
};

/// Runs `call` on `leaves` (canonical order): checks arguments and layout across the group,
/// plans buckets and moves the data. Returns pending Works when opts.async_op, else none.
std::vector<Work> run_collective(std::span<const LeafRef> leaves, const CollectiveCall& call,
                                 const CollectiveOptions& opts);

/// Resolves kAutoBucketBytes for a group: measured once per group (collective), then cached.
std::size_t tuned_bucket_bytes(GroupState& group, std::chrono::steady_clock::time_point deadline);

}  // namespace td::detail
