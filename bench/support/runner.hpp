// The timing runner. The method, the same for every variant: a barrier, then one call timed with
// MPI_Wtime on every rank; the round's time is the MAX over ranks (what the slowest rank waited),
// and a variant's figure is the median over rounds. bench_allreduce and bench_reduce run every
// variant of a workload once per round in a shuffled order, each on its own copy of the data, so
// machine noise and cache warmth favour none of them; every variant is first checked against
// the test oracle (guard.hpp).
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include <mpi.h>

#include <tensordict/tensordict.hpp>

#include "collective.hpp"
#include "options.hpp"
#include "workloads.hpp"

namespace td_bench {

/// Message size of the "ideal, chunked" variant.
inline constexpr std::size_t kIdealChunkBytes = std::size_t{4} << 20;

/// Time of f() on this rank, started after a barrier, as the maximum over the world's ranks.
template <class F>
double timed_max_over_ranks(F&& f) {
  td::barrier();
  const double start = MPI_Wtime();
  f();
  double t = MPI_Wtime() - start;
  MPI_Allreduce(MPI_IN_PLACE, &t, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  return t;
}

double median_of(std::vector<double> v);

/// Compute that leaves this rank's core free for `seconds` (an accelerator computing while the
/// host waits): a sleep.
void idle_for(double seconds);

/// The logical AND of `ok` over all ranks (returned on every rank).
bool all_ranks(bool ok);

// ---- progress on rank 0's stderr --------------------------------------------------------------

/// How progress is shown. Results always go to stdout and progress to stderr, so
/// `bench_allreduce > results.txt` holds nothing but results; `Line` keeps a terminal that shows
/// both streams readable too.
enum class ProgressMode {
  Off,   // nothing
  Line,  // one status line on stderr, rewritten in place and erased before results are printed
  Log,   // a few plain lines per workload on stderr (for a log file)
};

/// "auto": Line when stderr is a terminal, else Log. Under mpirun the ranks' stderr is a pipe
/// even when mpirun's is a terminal, so `make bench` asks for `line` itself (mpirun forwards a
/// line without its newline as it comes).
std::optional<ProgressMode> parse_progress(const std::string& s);

/// The status of a running benchmark, on stderr.
class Progress {
 public:
  explicit Progress(ProgressMode mode) : mode_(mode) {}
  /// A `milestone` is also printed, as its own line, in Log mode; other updates only in Line mode.
  void show(const std::string& line, bool milestone);
  /// Erases the status line (before results go to stdout, which may be the same terminal).
  void clear();

 private:
  ProgressMode mode_;
  bool dirty_ = false;
};

// ---- results ----------------------------------------------------------------------------------

/// What a variant is, for the summary, the CSV and the plot.
/// What a variant is. CopyFloor: a hand-written pack (memcpy of every leaf into one buffer per
/// dtype), the ideal MPI calls on it, and the unpack: the floor of any bucketed path on leaves
/// that are not back to back.
enum class Role {
  PerLeaf,
  Bucket,
  Auto,
  Consolidated,
  Tensor,
  Ideal,
  IdealChunks,
  CopyFloor,
  CheckPlan
};

/// One variant's figures (kept after the workload's buffers are freed).
struct Row {
  std::string label, id, csv_bucket;
  Role role = Role::Bucket;
  std::size_t bucket = 0;
  bool packer = false;
  int rounds = 0;
  double median = 0, min = 0;  // seconds
  std::size_t peak_extra = 0;
  std::uint64_t plan_misses = 0;
  std::vector<double> samples;  // seconds per round, in round order
};

/// One workload's results.
struct WorkloadResult {
  std::string name, what, dtypes;
  std::size_t leaves = 0;
  std::size_t bytes = 0;
  std::vector<Row> rows;
  double seconds = 0;  // wall time of the whole workload
  // Memory once every variant's buffers exist (rank 0): bytes the live storages asked for, and
  // what the storage pool's huge-page chunks hold beyond what its storages asked for.
  // Its empty chunks kept for reuse (at most 32 MiB in all) are counted apart.
  std::size_t storage_bytes = 0;
  std::size_t pool_extra_bytes = 0;
  std::size_t pool_spare_bytes = 0;

  const Row* find(Role r) const;
  /// The faster of the two raw-MPI variants' medians (0 if neither ran).
  double best_ideal() const;
};

/// Thrown (on every rank alike) when a variant computed a wrong result.
struct WrongResult : std::runtime_error {
  using std::runtime_error::runtime_error;
};

/// Checks, warms up and times every variant of one workload.
WorkloadResult run_workload(const Workload& w, const Context& ctx, const Options& opt,
                            const std::vector<BucketChoice>& buckets, Progress& progress);

// ---- what "auto" resolves to ------------------------------------------------------------------

/// td::kAutoBucketBytes as resolved on the world group, seen from outside.
struct AutoProbe {
  std::size_t largest_bucket = 0;  // largest packed bucket of the probe dict (max over ranks)
  double first_call = 0;           // seconds of the first auto call (includes any tuning)
};

/// No API names the resolved size, so pack 4096 leaves of 4 KiB (16 MiB) with bucket auto and read
/// the largest pack buffer: the cap rounded down to 4 KiB, or 16 MiB if the cap is larger. The
/// first auto call also pays the library's one-time tuning, which this keeps out of the timings.
AutoProbe probe_auto();

/// "1MiB", ">=16MiB", "<8KiB": what the probe saw.
std::string auto_label(const AutoProbe& p);

}  // namespace td_bench
