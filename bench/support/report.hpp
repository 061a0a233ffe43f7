// What the benchmarks report: the header (machine, MPI, method), a table and summary per workload
// on stdout, and, on rank 0 after MPI is finalized, the CSV, the per-round samples and the
// gnuplot figure.
#pragma once

#include <string>
#include <vector>

#include "collective.hpp"
#include "options.hpp"
#include "runner.hpp"

namespace td_bench {

/// "3.74x faster than per-leaf", "1.02x slower than per-leaf" or "as fast as per-leaf (1.00x)"
/// for a call that took `seconds` against `baseline_seconds`: the factor is never below 1, the
/// word says which way it goes.
std::string speed_phrase(double seconds, double baseline_seconds, const std::string& than);

/// The table and the one-line summary of one workload.
void print_workload(const WorkloadResult& res, int ranks);

/// Facts about the machine and MPI for the header.
struct MachineInfo {
  std::string host, cpu, mpi_version, mpi_short;
  std::string memory;  // what decides page sizes and malloc behaviour (printed with the results)
  long online_cpus = 0;
  int bound_cpus = 0;
};

MachineInfo machine_info();

/// The "# ..." lines before the tables: what is measured, where, and how.
void print_header(const MachineInfo& m, const Context& ctx, const Options& opt,
                  const std::string& dtype, const std::vector<BucketChoice>& buckets,
                  const AutoProbe& probe);

/// One row per (workload, variant).
void write_csv(const std::string& path, const std::vector<WorkloadResult>& results, int ranks);

/// Every timed round: workload,variant,round,ms.
void write_samples(const std::string& path, const std::vector<WorkloadResult>& results);

/// Ticks for a log axis over [lo, hi]: whole decades if that gives at least four, else the
/// 1-2-5 series, else a finer one, so a panel spanning less than a decade is not left with a
/// single labelled tick.
std::vector<double> log_ticks(double lo, double hi);

/// What the figure says about the run, in words.
struct PlotText {
  std::string title;     // what was measured: true for every panel
  std::string subtitle;  // where: ranks, MPI, host, dtypes
  std::string mpi_call;  // MPI_Allreduce or MPI_Reduce: the raw-MPI reference
  std::string auto_size;
};

/// Writes <dir>/<stem>.dat and <stem>.gp and runs gnuplot if present; returns a note for stdout.
///
/// Every panel shows one workload's median times divided by its reference: the faster of the
/// two raw-MPI variants ("ideal" rows of the table), so one of them sits exactly at 1x and the
/// other where it really is. The right axis gives the same times in ms. The figure explains
/// itself in a footnote, so it can be read without the README.
std::string write_plot(const std::string& dir, const std::string& stem, const PlotText& text,
                       const std::vector<WorkloadResult>& results,
                       const std::vector<BucketChoice>& buckets);

}  // namespace td_bench
