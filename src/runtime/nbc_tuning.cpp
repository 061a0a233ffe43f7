#include "runtime/nbc_tuning.hpp"

#include <algorithm>
#include <cstdlib>
#include <exception>
#include <string_view>

#include <fmt/format.h>

#include "core/config.hpp"

namespace td::detail {

namespace {
constexpr const char* kVar = "OMPI_MCA_coll_libnbc_iallreduce_algorithm";

// A count Open MPI exported for the job, or 0.
long job_count(const char* name) {
  const char* text = std::getenv(name);
  if (text == nullptr) return 0;
  try {
    return std::stol(text);
  } catch (const std::exception&) {
    return 0;
  }
}
}  // namespace

// Measured on this project's machines (docs/configuration.md): at 2 ranks the ring is faster at
// every size, 16 B to 8 MiB (2.6x at 8 MiB). At 4 ranks Rabenseifner's reduce-scatter + allgather
// is as fast as libnbc's binomial tree on small messages and 1.3-1.5x faster on large ones on one
// host, and 2.8x across 2 hosts (the Reducer's buckets, 654 -> 232 ms); libnbc runs it only on a
// power of two number of ranks. At 3, 5, 6... ranks on one host both alternatives lose on small
// messages; across hosts the ring moved the Reducer's buckets 2.3x (3 hosts x 1), 2.6x (3 x 2)
// and 4.6x (3 x 4) faster than the tree, and small messages, slower under it, go another way
// (comm/executor.hpp, GatheredAllreduce). Not above 15 ranks: not measured there.
NbcAllreduce iallreduce_algorithm_for(long ranks, bool across_nodes) {
  if (ranks == 2) return NbcAllreduce::Ring;
  if (ranks >= 4 && (ranks & (ranks - 1)) == 0) return NbcAllreduce::Rabenseifner;
  if (across_nodes && ranks >= 3 && ranks <= 15) return NbcAllreduce::Ring;
  return NbcAllreduce::LibnbcChoice;
}

std::string tune_libnbc_before_init() {
  if (!config().tune_mpi || std::getenv(kVar) != nullptr) return "";
  const long ranks = job_count("OMPI_COMM_WORLD_SIZE");
  if (ranks <= 0) return "";
  // Every rank sees the same answer: a job on one node has all its ranks there.
  const long local = job_count("OMPI_COMM_WORLD_LOCAL_SIZE");
  const bool across_nodes = local > 0 && local < ranks;
  const NbcAllreduce a = iallreduce_algorithm_for(ranks, across_nodes);
  if (a == NbcAllreduce::LibnbcChoice) return "";
  if (setenv(kVar, a == NbcAllreduce::Ring ? "1" : "3", 0) != 0) return "";
  if (a == NbcAllreduce::Rabenseifner)
    return fmt::format("{}=3 (Rabenseifner: a job of {} ranks)", kVar, ranks);
  return ranks == 2 ? fmt::format("{}=1 (ring: a 2-rank job)", kVar)
                    : fmt::format("{}=1 (ring: a job of {} ranks across nodes)", kVar, ranks);
}

bool libnbc_runs_ring() {
  static const bool ring = [] {
    const char* v = std::getenv(kVar);
    return v != nullptr && std::string_view(v) == "1";
  }();
  return ring;
}

int padded_count(int count, int ranks) {
  int pof2 = 1;
  while (pof2 <= ranks / 2) pof2 *= 2;
  return std::max(count, pof2);
}

}  // namespace td::detail
