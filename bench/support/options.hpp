// The benchmarks' command line: byte sizes ("64KiB"), the options of bench_allreduce and
// bench_reduce, and CLI11 parsing that finalizes MPI on --help or an error.
#pragma once

#include <cstddef>
#include <optional>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include <tensordict/tensordict.hpp>

namespace td_bench {

/// "64KiB", "1MiB" for exact binary multiples, else "12345B".
std::string size_label(std::size_t b);

/// "26.08 MiB" (binary units, two decimals).
std::string human_bytes(double b);

/// Parses "65536", "64KiB", "64K", "1MiB", "1.5MB": K/M/G and KiB/MiB/GiB are binary, KB/MB/GB
/// decimal, B or nothing is bytes (case-insensitive). nullopt if malformed or zero.
std::optional<std::size_t> parse_size(const std::string& text);

/// The command line of bench_allreduce and bench_reduce.
struct Options {
  std::vector<std::string> workloads{"tiny", "small", "transformer", "large", "mixed"};
  std::vector<std::string> buckets{"none", "64KiB", "256KiB", "1MiB", "4MiB", "16MiB", "auto"};
  std::string op = "sum";
  std::string dtype = "float32";
  int iters = 0;          // 0: chosen per variant from min_time
  double min_time = 0.5;  // seconds of timed calls each variant aims for
  int min_rounds = 5;
  int max_rounds = 50;
  int warmup = 2;
  std::string csv;
  std::string plot_dir = "build/bench";
  bool no_plot = false;
  std::string progress = "auto";
  std::string samples_csv;   // every round's time, for looking at the noise
  std::string inject_fault;  // hidden: corrupts this variant's result once, to test the guard
};

/// One entry of --buckets: nullopt is `none` (one collective per leaf).
struct BucketChoice {
  std::optional<std::size_t> bytes;
};

/// "sum", "avg", "max", "min", "product" (or "prod"); nullopt otherwise.
std::optional<td::ReduceOp> parse_op(const std::string& s);

/// A dtype by its name ("float32", "bfloat16", ...); nullopt otherwise.
std::optional<td::DType> parse_dtype(const std::string& s);

/// Parses a small benchmark's command line; on --help or an error, finalizes and returns the
/// exit code for main to return.
std::optional<int> parse_or_exit(CLI::App& app, int argc, char** argv);

}  // namespace td_bench
