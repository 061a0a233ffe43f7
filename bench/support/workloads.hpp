// The workloads every benchmark draws from: named sets of leaves (keys, shapes, dtypes), from
// 16384 64-byte leaves to eight 4 MiB ones, and a 73-leaf transformer.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include <tensordict/tensordict.hpp>

namespace td_bench {

/// One leaf of a workload.
struct LeafSpec {
  std::vector<std::string> key;
  td::Shape shape;
  td::DType dtype = td::DType::Float32;
};

/// A named set of leaves.
struct Workload {
  std::string name;
  std::string what;  // one-line description for the table
  std::vector<LeafSpec> leaves;
};

inline constexpr const char* kWorkloadNames[] = {"tiny", "small", "transformer", "large", "mixed"};

std::int64_t numel_of(const td::Shape& s);

/// Builds a workload's leaf list. `dt` replaces float32 in every workload but `mixed`.
Workload make_workload(const std::string& name, td::DType dt);

/// Total bytes per dtype, in dtype order.
std::map<td::DType, std::size_t> bytes_per_dtype(const Workload& w);

/// The workload as a TensorDict; every leaf shaped {0} when `zero_size`.
td::TensorDict build_dict(const Workload& w, bool zero_size);

}  // namespace td_bench
