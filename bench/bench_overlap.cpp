// How much of an async bucketed all_reduce hides behind computation.
//
// Per round, side by side: the communication alone (async all_reduce of the transformer
// workload, then wait), a computation alone calibrated to take as long, and the two overlapped
// (start the all_reduce, compute, wait) with the progress thread on and off. Hidden fraction =
// (comm + compute - overlapped) / comm, from medians of the max over ranks.
//
// Two kinds of "compute": `cpu` keeps this rank's core busy (a CPU-bound model step), `wait`
// leaves it idle for the same time (an accelerator computing while the host waits). Shared-memory
// MPI moves data with the CPU, so with every core busy there is nothing to hide the copies
// behind; the `wait` rows show what the progress thread achieves when a core is free.
#include <array>
#include <cmath>
#include <functional>

#include <CLI/CLI.hpp>

#include "support/options.hpp"
#include "support/report.hpp"
#include "support/runner.hpp"
#include "support/workloads.hpp"

namespace {

// CPU-bound work on a cache-resident array, so it competes with the transfer for cores but not
// for memory bandwidth.
float g_sink = 0;
void compute(std::int64_t iters) {
  std::array<float, 1024> x{};
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>(i) * 1e-3f;
  for (std::int64_t k = 0; k < iters; ++k)
    for (auto& v : x) v = v * 0.999f + 0.001f;
  g_sink += x[7];
}

}  // namespace

int main(int argc, char** argv) {
  td::init_process_group(argc, argv);
  CLI::App app{"bench_overlap: async all_reduce hidden behind compute"};
  int rounds = 15;
  std::string workload = "transformer";
  app.add_option("--rounds", rounds, "timed rounds per variant")->check(CLI::PositiveNumber);
  app.add_option("--workload", workload, "tiny, small, transformer, large or mixed");
  if (auto rc = td_bench::parse_or_exit(app, argc, argv)) return *rc;
  const int rank = td::get_rank(), size = td::get_world_size();
  const auto w = td_bench::make_workload(workload, td::DType::Float32);
  td::TensorDict d = td_bench::build_dict(w, false);
  const td::CollectiveOptions async{.async_op = true, .bucket_bytes = td::kAutoBucketBytes};

  auto comm = [&] {
    auto works = d.all_reduce(td::ReduceOp::SUM, async);
    td::wait_all(works);
  };
  comm();  // tunes the bucket size, builds the plan, warms the buffers

  // Calibrate the compute to last as long as the communication alone: scale the iteration count
  // by the measured ratio until they agree within 5% (a first guess from a short probe is off by
  // up to 2x here, the core's speed depending on what the other rank does).
  std::vector<double> c;
  for (int i = 0; i < 7; ++i) c.push_back(td_bench::timed_max_over_ranks(comm));
  const double t_comm_est = td_bench::median_of(c);
  std::int64_t iters = 2000;
  for (int step = 0; step < 6; ++step) {
    std::vector<double> probes;
    for (int i = 0; i < 3; ++i)
      probes.push_back(td_bench::timed_max_over_ranks([&] { compute(iters); }));
    const double ratio = t_comm_est / td_bench::median_of(probes);
    iters =
        std::max<std::int64_t>(1, static_cast<std::int64_t>(static_cast<double>(iters) * ratio));
    MPI_Bcast(&iters, 1, MPI_INT64_T, 0, MPI_COMM_WORLD);
    if (std::abs(ratio - 1.0) < 0.05) break;
  }

  struct Series {
    std::vector<double> alone, prog, noprog;
  };
  std::vector<double> t_comm;
  Series cpu, wait;
  const std::function<void()> cpu_work = [&] { compute(iters); };
  const std::function<void()> idle_work = [&] { td_bench::idle_for(t_comm_est); };
  auto overlapped = [&](const std::function<void()>& work) {
    return td_bench::timed_max_over_ranks([&] {
      auto works = d.all_reduce(td::ReduceOp::SUM, async);
      work();
      td::wait_all(works);
    });
  };
  // Two phases, each a whole run of rounds with one setting: switching the thread off and on
  // between single calls made the next few overlapped calls erratic (one in two or three took
  // compute + communication), which is not how a program uses it.
  td::set_async_progress(true);
  for (int r = 0; r < rounds; ++r) {
    t_comm.push_back(td_bench::timed_max_over_ranks(comm));
    wait.alone.push_back(td_bench::timed_max_over_ranks(idle_work));
    wait.prog.push_back(overlapped(idle_work));
    cpu.alone.push_back(td_bench::timed_max_over_ranks(cpu_work));
    cpu.prog.push_back(overlapped(cpu_work));
    if (rank == 0)
      std::fprintf(stderr, "\r[bench_overlap] progress thread on: round %d/%d", r + 1, rounds);
  }
  td::set_async_progress(false);
  comm();  // one untimed round in the new setting
  for (int r = 0; r < rounds; ++r) {
    wait.noprog.push_back(overlapped(idle_work));
    cpu.noprog.push_back(overlapped(cpu_work));
    if (rank == 0)
      std::fprintf(stderr, "\r[bench_overlap] progress thread off: round %d/%d", r + 1, rounds);
  }
  td::set_async_progress(true);
  if (rank == 0) {
    std::fprintf(stderr, "\n");
    const auto m = td_bench::machine_info();
    const double comm_ms = td_bench::median_of(t_comm) * 1e3;
    fmt::print("# bench_overlap: {} ({} leaves), async all_reduce SUM, bucket_bytes=auto\n", w.name,
               w.leaves.size());
    fmt::print(
        "# machine: {}, {} CPUs, {}\n# MPI: {}\n# memory: {}\n# ranks: {}; rounds: {}; medians of "
        "the max over ranks\n",
        m.host, m.online_cpus, m.cpu, m.mpi_version, m.memory, size, rounds);
    fmt::print("{:<44} {:>10} {:>10}\n", "variant", "median ms", "hidden");
    fmt::print("{:<44} {:>10.2f}\n", "communication alone", comm_ms);
    auto rows = [&](const char* kind, const Series& s) {
      const double alone = td_bench::median_of(s.alone) * 1e3;
      auto hidden = [&](const std::vector<double>& both) {
        return std::clamp((comm_ms + alone - td_bench::median_of(both) * 1e3) / comm_ms, 0.0, 1.0) *
               100.0;
      };
      fmt::print("{:<44} {:>10.2f}\n", fmt::format("{} alone", kind), alone);
      fmt::print("{:<44} {:>10.2f} {:>9.1f}%\n",
                 fmt::format("{} + all_reduce, progress thread on", kind),
                 td_bench::median_of(s.prog) * 1e3, hidden(s.prog));
      fmt::print("{:<44} {:>10.2f} {:>9.1f}%\n",
                 fmt::format("{} + all_reduce, progress thread off", kind),
                 td_bench::median_of(s.noprog) * 1e3, hidden(s.noprog));
    };
    rows("idle wait", wait);
    rows("cpu compute", cpu);
  }
  td::set_async_progress(true);
  td::destroy_process_group();
  return static_cast<int>(g_sink < -1);
}
