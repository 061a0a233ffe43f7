// A loop of bucketed async all_reduces across hosts, for test/cluster/fault_across_hosts.sh to
// break from outside (a host's link taken down, or a host's ranks killed).
//
// Every step refills each leaf with the step's value `old` on every rank and sums it across the
// ranks, so a completed leaf holds `old * size`. When a step fails with td::TimeoutError, each
// rank checks every leaf: it must hold `old` everywhere (its bucket never completed) or
// `old * size` everywhere (it did), never a mix. The rank prints one verdict line
//   cluster fault: rank R on HOST: TimeoutError at step S after M ms; leaves old=A new=B mixed=C:
//   ok
// ("FAILED" instead of "ok" if a leaf is mixed or the error came late), then ends the job
// with td::abort. Rank 0 prints "cluster fault: loop running" once the loop is under way: from
// then on every call has the short timeout (the first steps, which connect the ranks, a minute).
//
//   cluster_fault_loop [--timeout-ms N] [--max-seconds S] [--direct] [--verbose]
// --direct adds two leaves larger than a bucket, which MPI reduces in place (no pack buffer);
// --verbose makes rank 0 print every 100th step.
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
  bool direct = false;
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
    } else if (a == "--direct") {
      o.direct = true;
    } else if (a == "--verbose") {
      o.verbose = true;
    } else {
      std::fprintf(stderr, "cluster_fault_loop: unknown argument '%s'\n", a.c_str());
      std::exit(2);
    }
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
      d.set(keys.back(), td::Tensor::zeros({std::int64_t{256} << 10}, td::DType::Float32));
    }

  // The first steps connect the ranks across hosts (TCP) and may be slow on a loaded machine:
  // they get a minute; the short timeout applies once the loop is running.
  constexpr std::int64_t kWarmupSteps = 20;
  const td::CollectiveOptions warmup{.async_op = true,
                                     .bucket_bytes = std::size_t{16} << 10,
                                     .timeout = std::chrono::milliseconds(60000)};
  const td::CollectiveOptions copts{.async_op = true,
                                    .bucket_bytes = std::size_t{16} << 10,
                                    .timeout = std::chrono::milliseconds(opt.timeout_ms)};
  const auto loop_start = Clock::now();
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
      const bool ok = counts[2] == 0 && in_time;
      std::string what = e.what();
      if (what.size() > 200) what = what.substr(0, 200) + "...";
      std::printf(
          "cluster fault: rank %d on %s: TimeoutError at step %lld after %lld ms; leaves old=%d "
          "new=%d mixed=%d%s: %s\n  (%s)\n",
          rank, host, static_cast<long long>(step), static_cast<long long>(ms), counts[0],
          counts[1], counts[2], mixed.c_str(), ok ? "ok" : "FAILED", what.c_str());
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
    if (opt.verbose && rank == 0 && step % 100 == 0) {
      std::printf("cluster fault: step %lld\n", static_cast<long long>(step));
      std::fflush(stdout);
    }
    if (step == kWarmupSteps && rank == 0) {
      std::printf("cluster fault: loop running (%d ranks)\n", size);
      std::fflush(stdout);
    }
    if (Clock::now() - loop_start > std::chrono::seconds(opt.max_seconds))
      td::abort(fmt::format("cluster fault: no fault after {} s: FAILED", opt.max_seconds), 6);
  }
}
