#include "runtime/nbc_tuning.hpp"

#include <algorithm>
#include <cstdlib>
#include <exception>

#include <fmt/format.h>

#include "core/config.hpp"

namespace td::detail {

// Measured on this project's machines (docs/configuration.md): at 2 ranks the ring is faster at
// every size, 16 B to 8 MiB (2.6x at 8 MiB). At 4 ranks Rabenseifner's reduce-scatter + allgather
// is as fast as libnbc's binomial tree on small messages and 1.3-1.5x faster on large ones on one
// host, and 2.8x across 2 hosts (the Reducer's buckets, 654 -> 232 ms); libnbc runs it only on a
// power of two number of ranks. At 3, 5, 6... ranks both alternatives lose on small messages.
NbcAllreduce iallreduce_algorithm_for(long ranks) {
  if (ranks == 2) return NbcAllreduce::Ring;
  if (ranks >= 4 && (ranks & (ranks - 1)) == 0) return NbcAllreduce::Rabenseifner;
  return NbcAllreduce::LibnbcChoice;
}

std::string tune_libnbc_before_init() {
  constexpr const char* kVar = "OMPI_MCA_coll_libnbc_iallreduce_algorithm";
  if (!config().tune_mpi || std::getenv(kVar) != nullptr) return "";
  const char* size_text = std::getenv("OMPI_COMM_WORLD_SIZE");
  if (size_text == nullptr) return "";
  long ranks = 0;
  try {
    ranks = std::stol(size_text);
  } catch (const std::exception&) {
    return "";
  }
  const NbcAllreduce a = iallreduce_algorithm_for(ranks);
  if (a == NbcAllreduce::LibnbcChoice) return "";
  if (setenv(kVar, a == NbcAllreduce::Ring ? "1" : "3", 0) != 0) return "";
  return a == NbcAllreduce::Ring
             ? fmt::format("{}=1 (ring: a 2-rank job)", kVar)
             : fmt::format("{}=3 (Rabenseifner: a job of {} ranks)", kVar, ranks);
}

int padded_count(int count, int ranks) {
  int pof2 = 1;
  while (pof2 <= ranks / 2) pof2 *= 2;
  return std::max(count, pof2);
}

}  // namespace td::detail
