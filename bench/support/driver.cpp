// The whole of bench_allreduce and bench_reduce (driver.hpp).
#include "driver.hpp"

#include <algorithm>
#include <cstdio>
#include <exception>
#include <iterator>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <mpi.h>
#include <CLI/CLI.hpp>

#include <tensordict/tensordict.hpp>

#include "options.hpp"
#include "report.hpp"
#include "runner.hpp"
#include "workloads.hpp"

namespace td_bench {

int run_main(int argc, char** argv, Collective kind) {
  td::init_process_group(argc, argv);
  const int rank = td::get_rank();
  const int ranks = td::get_world_size();
  const char* stem = kind == Collective::AllReduce ? "allreduce" : "reduce";

  Options opt;
  CLI::App app{fmt::format(
      "Benchmarks TensorDict::{} (per-leaf, bucketed, consolidated) against a pre-packed "
      "{}; run under mpirun.",
      kind == Collective::AllReduce ? "all_reduce" : "reduce",
      kind == Collective::AllReduce ? "MPI_Allreduce" : "MPI_Reduce")};
  app.add_option("--workloads", opt.workloads, "tiny,small,transformer,large,mixed")
      ->delimiter(',')
      ->capture_default_str();
  app.add_option("--buckets", opt.buckets,
                 "bucket sizes (64KiB, 1MiB, 65536; K/M/G = KiB/MiB/GiB), 'none', 'auto'")
      ->delimiter(',')
      ->capture_default_str();
  app.add_option("--op", opt.op, "sum|avg|max|min|product")->capture_default_str();
  app.add_option("--dtype", opt.dtype,
                 "dtype of every workload but mixed (float32, float64, bfloat16, int64, ...)")
      ->capture_default_str();
  auto* iters =
      app.add_option("--iters", opt.iters, "timed rounds per variant (default: from --min-time)");
  auto* min_time =
      app.add_option("--min-time", opt.min_time, "seconds of timed calls each variant aims for")
          ->capture_default_str();
  iters->excludes(min_time);
  app.add_option("--min-rounds", opt.min_rounds, "fewest timed rounds per variant")
      ->capture_default_str();
  app.add_option("--max-rounds", opt.max_rounds, "most timed rounds per variant")
      ->capture_default_str();
  app.add_option("--warmup", opt.warmup, "untimed rounds before timing")->capture_default_str();
  app.add_option("--csv", opt.csv, "write one row per (workload, variant) to this file");
  app.add_option("--plot-dir", opt.plot_dir, "where <stem>.png, .gp and .dat go")
      ->capture_default_str();
  app.add_option("--samples-csv", opt.samples_csv,
                 "write every timed round (workload,variant,round,ms)");
  app.add_flag("--no-plot", opt.no_plot, "write no plot");
  app.add_option("--progress", opt.progress,
                 "progress on stderr: line (one line rewritten in place), log (a few lines per "
                 "workload), none, auto (line if stderr is a terminal, else log)")
      ->capture_default_str();
  bool quiet = false;
  app.add_flag("--quiet", quiet, "same as --progress none");
  app.add_option("--inject-fault", opt.inject_fault,
                 "corrupt this variant's checked result (tests the guard)")
      ->group("");

  auto finish = [&](int code) {
    td::destroy_process_group();
    return code;
  };
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    int code = e.get_exit_code();
    if (rank == 0) {
      code = app.exit(e);
    }
    return finish(code);
  }
  auto fail = [&](const std::string& msg) {
    if (rank == 0) std::fprintf(stderr, "bench_%s: %s\n", stem, msg.c_str());
    return finish(2);
  };

  const auto op = parse_op(opt.op);
  if (!op) return fail("unknown --op '" + opt.op + "' (sum, avg, max, min, product)");
  const auto dtype = parse_dtype(opt.dtype);
  if (!dtype || *dtype == td::DType::Bool)
    return fail("unknown or unsupported --dtype '" + opt.dtype + "'");
  if (!td::supports(*op, *dtype))
    return fail(fmt::format("op {} is not defined for dtype {}", td::name(*op), td::name(*dtype)));
  if (opt.min_rounds < 1 || opt.max_rounds < opt.min_rounds)
    return fail("need 1 <= --min-rounds <= --max-rounds");
  std::vector<BucketChoice> buckets;
  for (const auto& b : opt.buckets) {
    BucketChoice c;
    if (b == "auto") {
      c.bytes = td::kAutoBucketBytes;
    } else if (b != "none") {
      c.bytes = parse_size(b);
      if (!c.bytes) return fail("bad bucket size '" + b + "' (64KiB, 1MiB, 65536, none, auto)");
    }
    if (std::none_of(buckets.begin(), buckets.end(),
                     [&](const BucketChoice& x) { return x.bytes == c.bytes; }))
      buckets.push_back(c);
  }
  if (quiet) opt.progress = "none";
  const auto progress_mode = parse_progress(opt.progress);
  if (!progress_mode)
    return fail("unknown --progress '" + opt.progress + "' (line, log, none, auto)");
  for (const auto& w : opt.workloads)
    if (std::find(std::begin(kWorkloadNames), std::end(kWorkloadNames), w) ==
        std::end(kWorkloadNames))
      return fail("unknown workload '" + w + "' (tiny, small, transformer, large, mixed)");

  std::vector<WorkloadResult> results;
  MachineInfo machine;
  AutoProbe probe;
  try {
    RawMpi mpi;
    Context ctx;
    ctx.kind = kind;
    ctx.op = *op;
    ctx.rank = rank;
    ctx.ranks = ranks;
    ctx.mpi = &mpi;
    machine = machine_info();
    probe = probe_auto();
    ctx.auto_size = auto_label(probe);
    if (rank == 0) print_header(machine, ctx, opt, opt.dtype, buckets, probe);
    Progress progress(rank == 0 ? *progress_mode : ProgressMode::Off);
    for (const auto& name : opt.workloads) {
      Workload w = make_workload(name, *dtype);
      std::string unsupported;
      for (const auto& [d, b] : bytes_per_dtype(w))
        if (!td::supports(*op, d)) unsupported = std::string(td::name(d));
      if (!unsupported.empty()) {
        if (rank == 0)
          fmt::print("\n== {}: skipped: op {} is not defined for its {} leaves\n", name,
                     td::name(*op), unsupported);
        continue;
      }
      results.push_back(run_workload(w, ctx, opt, buckets, progress));
      if (rank == 0) print_workload(results.back(), ranks);
    }
  } catch (const WrongResult& e) {
    if (rank == 0) std::fprintf(stderr, "bench_%s: %s\n", stem, e.what());
    return finish(1);
  } catch (const std::exception& e) {
    // An error on one rank must not leave the others waiting in a collective.
    std::fprintf(stderr, "bench_%s: rank %d: error: %s\n", stem, rank, e.what());
    std::fflush(stderr);
    MPI_Abort(MPI_COMM_WORLD, 3);
  }
  // Files and gnuplot after MPI is finalized: fork() under an initialized MPI is not safe
  // everywhere.
  td::destroy_process_group();
  if (rank != 0) return 0;
  try {
    if (!opt.csv.empty()) {
      write_csv(opt.csv, results, ranks);
      fmt::print("\ncsv: {}\n", opt.csv);
    }
    if (!opt.samples_csv.empty()) {
      write_samples(opt.samples_csv, results);
      fmt::print("samples: {}\n", opt.samples_csv);
    }
    if (!opt.no_plot && !results.empty()) {
      const std::string dtypes = std::all_of(opt.workloads.begin(), opt.workloads.end(),
                                             [](const std::string& w) { return w != "mixed"; })
                                     ? opt.dtype
                                     : opt.dtype + ", mixed: 4 dtypes";
      PlotText text;
      text.mpi_call = kind == Collective::AllReduce ? "MPI_Allreduce" : "MPI_Reduce";
      text.auto_size = auto_label(probe) + " here";
      text.title = fmt::format(
          "{}({}): median time per call relative to raw {} on buffers packed in advance "
          "(lower is better)",
          kind == Collective::AllReduce ? "TensorDict.all_reduce" : "TensorDict.reduce",
          td::name(*op), text.mpi_call);
      text.subtitle = fmt::format("{} ranks, {}, host {}; dtype {}", ranks, machine.mpi_short,
                                  machine.host, dtypes);
      fmt::print("{}\n", write_plot(opt.plot_dir, stem, text, results, buckets));
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_%s: %s\n", stem, e.what());
    return 1;
  }
  return 0;
}

int guarded_main(int argc, char** argv, Collective kind) noexcept {
  try {
    return run_main(argc, argv, kind);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench: error: %s\n", e.what());
  } catch (...) {
    std::fprintf(stderr, "bench: unknown error\n");
  }
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (initialized && !finalized) MPI_Abort(MPI_COMM_WORLD, 3);
  return 3;
}

}  // namespace td_bench
