// A loop of bucketed all_reduces across hosts, for test/cluster/fault_across_hosts.sh and
// link_cut_sync.sh to break from outside (a host's link taken down, or a host's ranks killed).
//
// Every step refills each leaf with the step's value `old` on every rank and sums it across the
// ranks, so a completed leaf holds `old * size`. Every rank prints "cluster fault: rank R runs on
// HOST" at start, and rank 0 prints "cluster fault: loop running" once the loop is under way:
// from then on every call has the short timeout (the first steps, which connect the ranks, a
// minute).
//
// Async (default): each step is an async all_reduce and wait_all. When a step fails with
// td::TimeoutError, each rank checks every leaf: it must hold `old` everywhere (its bucket never
// completed) or `old * size` everywhere (it did), never a mix. The rank prints one verdict line
//   cluster fault: rank R on HOST: TimeoutError at step S after M ms; leaves old=A new=B mixed=C;
//   no answer from ranks L; in this call ranks M: ok
// (L: the ranks the error's diagnosis lists as NoAnswer, comma-separated; "-" none, "?" no
// diagnosis; M: those it lists as InThisCall, "-" none)
// ("FAILED" instead of "ok" if a leaf is mixed or the error came late), then ends the job
// with td::abort.
//
// --sync: each step is a sync all_reduce. A fault ends a rank's step in one of two ways:
// - in the agreement (before any data moves): the call throws td::TimeoutError at its deadline,
//   every leaf must still hold `old`, and the rank prints
//     cluster fault: rank R on HOST: TimeoutError in the agreement at step S after M ms; leaves
//     old=A new=B mixed=C; no answer from ranks L; in this call ranks M: ok
//   then ends the job with td::abort, as in async mode;
// - in the data phase (a blocking MPI call): the library's watchdog prints
//     [td rank R] aborting the job: td::TimeoutError: TensorDict.all_reduce ... the watchdog
//     ends the job
//   at the call's deadline and ends the job; this program prints nothing more.
//
//   cluster_fault_loop [--timeout-ms N] [--max-seconds S] [--sync] [--direct] [--direct-kib K]
//                      [--pause-ms P] [--verbose]
// --direct adds two float32 leaves of K KiB each (default 1024), larger than a bucket, which MPI
// reduces in place (no pack buffer); with --sync they make most of a step's time data phase.
// --pause-ms sleeps P ms after every step once the loop runs (the computation between two
// collectives): a fault during the pause meets the next call's agreement.
// --verbose makes rank 0 print every 20th step and the mean step time.
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include <tensordict/tensordict.hpp>

namespace {

using Clock = std::chrono::steady_clock;

struct Options {
  long timeout_ms = 3000;
  long max_seconds = 120;
  bool sync = false;
  bool direct = false;
  long direct_kib = 1024;
  long pause_ms = 0;
  bool verbose = false;
};

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--timeout-ms" && i + 1 < argc) {
      o.timeout_ms = std::strtol(argv[++i], nullptr, 10);
    } else if (a == "--max-seconds" && i + 1 < argc) {
      o.max_seconds = std::strtol(argv[++i], nullptr, 10);
    } else if (a == "--sync") {
      o.sync = true;
    } else if (a == "--direct") {
      o.direct = true;
    } else if (a == "--pause-ms" && i + 1 < argc) {
      o.pause_ms = std::strtol(argv[++i], nullptr, 10);
    } else if (a == "--direct-kib" && i + 1 < argc) {
      o.direct_kib = std::strtol(argv[++i], nullptr, 10);
    } else if (a == "--verbose") {
      o.verbose = true;
    } else {
      std::fprintf(stderr, "cluster_fault_loop: unknown argument '%s'\n", a.c_str());
      std::exit(2);
    }
  }
  if (o.timeout_ms <= 0 || o.max_seconds <= 0 || o.direct_kib < 64 || o.pause_ms < 0) {
    std::fprintf(
        stderr,
        "cluster_fault_loop: bad --timeout-ms, --max-seconds, --pause-ms or --direct-kib\n");
    std::exit(2);
  }
  return o;
}

// Fills every leaf of `d` with `value` (float32 and int64 leaves).
void fill(td::TensorDict& d, const std::vector<td::Key>& keys, std::int64_t value) {
  for (const auto& k : keys) {
    td::Tensor& t = d.get(k);
    const std::int64_t n = t.numel();
    if (t.dtype() == td::DType::Float32) {
      auto* p = t.data<float>();
      for (std::int64_t i = 0; i < n; ++i) p[i] = static_cast<float>(value);
    } else {
      auto* p = t.data<std::int64_t>();
      for (std::int64_t i = 0; i < n; ++i) p[i] = value;
    }
  }
}

// Whether every element of leaf `t` equals v (as a double: our values are small integers).
enum class Leaf { Old, New, Mixed };
Leaf classify(const td::Tensor& t, std::int64_t old_v, std::int64_t new_v) {
  std::int64_t n_old = 0, n_new = 0;
  const std::int64_t n = t.numel();
  for (std::int64_t i = 0; i < n; ++i) {
    const std::int64_t v = t.dtype() == td::DType::Float32
                               ? static_cast<std::int64_t>(t.data<float>()[i])
                               : t.data<std::int64_t>()[i];
    if (v == old_v) {
      ++n_old;
    } else if (v == new_v) {
      ++n_new;
    }
  }
  if (n_old == n) return Leaf::Old;
  if (n_new == n) return Leaf::New;
  return Leaf::Mixed;
}

}  // namespace

int main(int argc, char** argv) {
  const Options opt = parse(argc, argv);
  td::init_process_group(argc, argv);
  const int rank = td::get_rank();
  const int size = td::get_world_size();
  char host[256] = {};
  gethostname(host, sizeof host - 1);
  std::printf("cluster fault: rank %d runs on %s\n", rank, host);
  std::fflush(stdout);

  // 48 float32 leaves of 4 KiB and 16 int64 leaves of 2 KiB in 16 KiB buckets: every bucket
  // holds several leaves, so each is packed, reduced in a pack buffer and copied back.
  td::TensorDict d;
  std::vector<td::Key> keys;
  for (int i = 0; i < 48; ++i) {
    keys.emplace_back(std::vector<std::string>{"packed", fmt::format("w{:02}", i)});
    d.set(keys.back(), td::Tensor::zeros({1024}, td::DType::Float32));
  }
  for (int i = 0; i < 16; ++i) {
    keys.emplace_back(std::vector<std::string>{"packed", fmt::format("n{:02}", i)});
    d.set(keys.back(), td::Tensor::zeros({256}, td::DType::Int64));
  }
  if (opt.direct)
    for (int i = 0; i < 2; ++i) {
      keys.emplace_back(std::vector<std::string>{"direct", fmt::format("big{}", i)});
      d.set(keys.back(),
            td::Tensor::zeros({std::int64_t{256} * opt.direct_kib}, td::DType::Float32));
    }

  // The first steps connect the ranks across hosts (TCP) and may be slow on a loaded machine:
  // they get a minute; the short timeout applies once the loop is running.
  constexpr std::int64_t kWarmupSteps = 20;
  const td::CollectiveOptions warmup{.async_op = !opt.sync,
                                     .bucket_bytes = std::size_t{16} << 10,
                                     .timeout = std::chrono::milliseconds(60000)};
  const td::CollectiveOptions copts{.async_op = !opt.sync,
                                    .bucket_bytes = std::size_t{16} << 10,
                                    .timeout = std::chrono::milliseconds(opt.timeout_ms)};
  const auto loop_start = Clock::now();
  auto report_start = loop_start;
  for (std::int64_t step = 0;; ++step) {
    const std::int64_t old_v = step % 1000 + 1, new_v = old_v * size;
    fill(d, keys, old_v);
    const auto call_start = Clock::now();
    try {
      std::vector<td::Work> works =
          d.all_reduce(td::ReduceOp::SUM, step < kWarmupSteps ? warmup : copts);
      td::wait_all(works);
    } catch (const td::TimeoutError& e) {
      const auto ms =
          std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - call_start).count();
      int counts[3] = {0, 0, 0};
      std::string mixed;
      for (const auto& k : keys) {
        const Leaf c = classify(d.get(k), old_v, new_v);
        ++counts[static_cast<int>(c)];
        if (c == Leaf::Mixed) mixed += " " + k.str();
      }
      // The error comes at the call's deadline; a little later on a loaded machine is fine.
      const bool in_time =
          step >= kWarmupSteps && ms >= opt.timeout_ms && ms < opt.timeout_ms + 5000;
      // A sync call throws only from its agreement, before any data moved (a stall in the data
      // phase is the watchdog's): every leaf still holds `old`.
      const bool leaves_ok = opt.sync ? counts[0] == static_cast<int>(keys.size()) : counts[2] == 0;
      const bool ok = leaves_ok && in_time;
      // The diagnosis (issue 29): the ranks that did not answer, "-" if every rank did, "?" if
      // there was none. The script checks they are the cut host's ranks.
      // And the ranks it found in this very call ("-" none): the script checks they are all
      // the others.
      std::string silent, inside;
      for (const td::RankStatus& st : e.diagnosis()) {
        if (st.state == td::RankStatus::State::NoAnswer)
          silent += (silent.empty() ? "" : ",") + std::to_string(st.rank);
        if (st.state == td::RankStatus::State::InThisCall)
          inside += (inside.empty() ? "" : ",") + std::to_string(st.rank);
      }
      if (silent.empty()) silent = e.diagnosis().empty() ? "?" : "-";
      if (inside.empty()) inside = "-";
      std::string what = e.what();
      if (what.size() > 200) what = what.substr(0, 200) + "...";
      std::printf(
          "cluster fault: rank %d on %s: TimeoutError%s at step %lld after %lld ms; leaves old=%d "
          "new=%d mixed=%d%s; no answer from ranks %s; in this call ranks %s: %s\n  (%s)\n",
          rank, host, opt.sync ? " in the agreement" : "", static_cast<long long>(step),
          static_cast<long long>(ms), counts[0], counts[1], counts[2], mixed.c_str(),
          silent.c_str(), inside.c_str(), ok ? "ok" : "FAILED", what.c_str());
      std::fflush(stdout);
      // Give the other ranks' verdicts time to reach mpirun before the job is torn down.
      std::this_thread::sleep_for(std::chrono::seconds(2));
      td::abort(ok ? "ending the job after the expected timeout" : "cluster fault test failed",
                ok ? 3 : 4);
    }
    // A completed step holds the sum everywhere.
    for (const auto& k : keys)
      if (classify(d.get(k), old_v, new_v) != Leaf::New)
        td::abort(fmt::format("cluster fault: step {}: leaf {} is wrong: FAILED", step, k.str()),
                  5);
    if (opt.verbose && rank == 0 && step % 20 == 0 && step > 0) {
      const auto now = Clock::now();
      const double mean_ms =
          std::chrono::duration<double, std::milli>(now - report_start).count() / 20;
      report_start = now;
      std::printf("cluster fault: step %lld (%.2f ms per step)\n", static_cast<long long>(step),
                  mean_ms);
      std::fflush(stdout);
    }
    if (step == kWarmupSteps && rank == 0) {
      std::printf("cluster fault: loop running (%d ranks, %s)\n", size,
                  opt.sync ? "sync" : "async");
      std::fflush(stdout);
    }
    // Time outside the collective (a training step's computation): a fault that falls here
    // meets the next call's agreement.
    if (opt.pause_ms > 0 && step >= kWarmupSteps)
      std::this_thread::sleep_for(std::chrono::milliseconds(opt.pause_ms));
    if (Clock::now() - loop_start > std::chrono::seconds(opt.max_seconds))
      td::abort(fmt::format("cluster fault: no fault after {} s: FAILED", opt.max_seconds), 6);
  }
}
