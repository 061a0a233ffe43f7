#include "runtime/log.hpp"

#include <cstdio>

#include <mpi.h>

namespace td::detail {

void log_line(LogLevel level, const std::string& message) {
  int rank = -1, initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (initialized && !finalized) MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  const char* tag = level == LogLevel::Debug ? "debug" : level == LogLevel::Info ? "info" : "warn";
  std::fprintf(stderr, "[td rank %d %s] %s\n", rank, tag, message.c_str());
}

}  // namespace td::detail
