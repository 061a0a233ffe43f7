// The whole of bench_allreduce and bench_reduce: the command line, every workload's variants
// checked and timed (runner.hpp), and the report (report.hpp).
#pragma once

#include "collective.hpp"

namespace td_bench {

/// Parses the command line, runs every workload, prints and writes results.
int run_main(int argc, char** argv, Collective kind);

/// run_main for main(): an exception that escapes (MPI not initialised, out of memory) ends the
/// job with a message instead of std::terminate.
int guarded_main(int argc, char** argv, Collective kind) noexcept;

}  // namespace td_bench
