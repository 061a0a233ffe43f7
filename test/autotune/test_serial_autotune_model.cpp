// The bucket-size tuner's and the path measurement's decisions on given timings
// (src/comm/autotune_model.hpp): no MPI, no clock.
#include <catch2/catch.hpp>

#include <unistd.h>

#include <filesystem>
#include <fstream>

#include "comm/autotune_model.hpp"

namespace autotune = td::detail::autotune;
using autotune::Timings;

namespace {

constexpr std::size_t KiB = 1024, MiB = 1024 * KiB;

// A quiet machine's ladder: per-byte cost of the packed cycle falls until 1 MiB, then rises; the
// bare allreduce is cheaper per byte than the best packed cycle from 256 KiB on. Three passes
// that agree within `jitter` (relative), with `extra` added to pass 1 of the size `busy_at`.
std::vector<Timings> ladder(double jitter, std::size_t busy_at = 0, double extra = 0) {
  const std::vector<std::pair<double, double>> ns_per_byte = {
      {2.0, 1.5},   {0.9, 0.6},   {0.5, 0.32}, {0.4, 0.25},
      {0.41, 0.26}, {0.43, 0.27}, {0.5, 0.3},  {0.6, 0.35}};
  std::vector<Timings> out;
  for (std::size_t i = 0; i < autotune::kLadder.size(); ++i) {
    Timings t;
    t.bytes = autotune::kLadder[i];
    for (int pass = 0; pass < 3; ++pass) {
      const double wobble = 1 + jitter * (pass - 1);  // 1 - j, 1, 1 + j
      double packed = ns_per_byte[i].first * 1e-9 * static_cast<double>(t.bytes) * wobble;
      const double bare = ns_per_byte[i].second * 1e-9 * static_cast<double>(t.bytes) * wobble;
      if (t.bytes == busy_at && pass == 1) packed *= 1 + extra;
      t.packed.push_back(packed);
      t.bare.push_back(bare);
    }
    out.push_back(t);
  }
  return out;
}

}  // namespace

TEST_CASE("quiet timings: the smallest size within 5% of the best per-byte cost, kept",
          "[autotune]") {
  const autotune::Choice c = autotune::choose(ladder(0.02));
  CHECK(c.cap == 1 * MiB);
  CHECK(c.direct_bytes == 256 * KiB);
  CHECK(c.spread == Approx(0.04 / 0.98).epsilon(1e-9));
  CHECK_FALSE(c.noisy);
}

TEST_CASE("a pass that disagrees by more than the noise limit makes the measurement noisy",
          "[autotune]") {
  // One pass of the best size (1 MiB) ran while something else had the CPU: 60% slower. The
  // median over passes still picks well, but the measurement is not to be cached.
  const autotune::Choice c = autotune::choose(ladder(0.01, 1 * MiB, 0.6));
  CHECK(c.cap == 1 * MiB);
  CHECK(c.noisy);
  CHECK(c.spread_bytes == 1 * MiB);
  CHECK(c.spread > autotune::kNoiseLimit);
  // The same at 2 MiB, a contender within the pick tolerance of the best: noisy too.
  CHECK(autotune::choose(ladder(0.01, 2 * MiB, 0.6)).noisy);
  // Just under the limit: kept.
  CHECK_FALSE(autotune::choose(ladder(0.0, 1 * MiB, 0.2)).noisy);
  // The limit is a parameter of the rule.
  CHECK_FALSE(autotune::choose(ladder(0.01, 1 * MiB, 0.6), 0.7).noisy);
}

TEST_CASE("noise where it cannot change the decision does not count", "[autotune]") {
  // 16 KiB costs 5x the best per byte: even doubled in one pass it is no candidate.
  const autotune::Choice c = autotune::choose(ladder(0.01, 16 * KiB, 1.0));
  CHECK(c.cap == 1 * MiB);
  CHECK_FALSE(c.noisy);
  CHECK(c.spread < 0.05);
  // The same burst at 256 KiB: its packed cycle loses to 1 MiB in every pass, and its bare
  // allreduce beats the best packed cycle in every pass, so neither decision can change.
  CHECK_FALSE(autotune::choose(ladder(0.01, 256 * KiB, 1.0)).noisy);
}

TEST_CASE("differences below the timer's noise floor do not count", "[autotune]") {
  // 10 us vs 14 us is a 40% spread, but 4 us is one preemption or timer tick.
  std::vector<Timings> tiny_ladder = {{16 * KiB, {10e-6, 14e-6, 10e-6}, {9e-6, 9e-6, 9e-6}},
                                      {64 * KiB, {60e-6, 60e-6, 61e-6}, {50e-6, 50e-6, 50e-6}}};
  CHECK_FALSE(autotune::choose(tiny_ladder).noisy);
  tiny_ladder[0].packed[1] = 20e-6;  // 10 us more: counts
  CHECK(autotune::choose(tiny_ladder).noisy);
}

TEST_CASE("a busy host: load beyond this job's own ranks", "[autotune]") {
  CHECK_FALSE(autotune::machine_busy(2.1, 2, 2));   // our 2 ranks on 2 CPUs
  CHECK_FALSE(autotune::machine_busy(0.3, 2, 2));   // the job has just started
  CHECK(autotune::machine_busy(5.5, 2, 2));         // three more runnable tasks on 2 CPUs
  CHECK_FALSE(autotune::machine_busy(4.2, 2, 4));   // 4 ranks oversubscribing 2 CPUs: all ours
  CHECK(autotune::machine_busy(60, 64, 16));        // another job on a 64-CPU node
  CHECK_FALSE(autotune::machine_busy(40, 64, 16));  // ... using fewer than half of it
  CHECK_FALSE(autotune::machine_busy(5, 0, 1));     // CPU count unknown: no judgement
}

TEST_CASE("relative spread and median", "[autotune]") {
  CHECK(autotune::relative_spread({1.0, 1.5, 1.2}) == Approx(0.5));
  CHECK(autotune::relative_spread({2.0}) == 0);
  CHECK(autotune::median({3.0, 1.0, 2.0}) == 2.0);
  CHECK(autotune::median({4.0, 1.0, 2.0, 3.0}) == 2.5);
}

TEST_CASE("spot check sizes: the cap and its ladder neighbours", "[autotune]") {
  CHECK(autotune::spot_check_sizes(1 * MiB) ==
        std::vector<std::size_t>{256 * KiB, 1 * MiB, 2 * MiB});
  CHECK(autotune::spot_check_sizes(16 * KiB) == std::vector<std::size_t>{16 * KiB, 64 * KiB});
  CHECK(autotune::spot_check_sizes(16 * MiB) == std::vector<std::size_t>{8 * MiB, 16 * MiB});
  // Not on the ladder (an edited file): the ladder sizes around it.
  CHECK(autotune::spot_check_sizes(1 * KiB) == std::vector<std::size_t>{1 * KiB, 16 * KiB});
  CHECK(autotune::spot_check_sizes(3 * MiB) == std::vector<std::size_t>{2 * MiB, 3 * MiB, 4 * MiB});
}

namespace {
// Spot-check timings: per-byte costs (ns) per pass for each size.
Timings spot(std::size_t bytes, std::vector<double> ns_per_byte) {
  Timings t;
  t.bytes = bytes;
  for (double c : ns_per_byte) t.packed.push_back(c * 1e-9 * static_cast<double>(bytes));
  return t;
}
}  // namespace

TEST_CASE("a cached cap is off only when a neighbour beats it clearly in every pass",
          "[autotune]") {
  // Cached 256 KiB (measured on a busy machine); now 1 MiB is 30-40% cheaper per byte.
  auto verdict = autotune::check_cached_cap(
      256 * KiB, {spot(64 * KiB, {0.9, 0.9, 0.95}), spot(256 * KiB, {0.6, 0.62, 0.7}),
                  spot(1 * MiB, {0.4, 0.41, 0.42})});
  CHECK(verdict.off);
  CHECK(verdict.better_bytes == 1 * MiB);
  CHECK(verdict.gain == Approx(1 - 0.4 / 0.6));  // its smallest margin over the passes
  // Within the margin: kept (the pick tolerance and ordinary noise are smaller than the margin).
  CHECK_FALSE(autotune::check_cached_cap(
                  1 * MiB, {spot(256 * KiB, {0.5, 0.5, 0.5}), spot(1 * MiB, {0.4, 0.4, 0.4}),
                            spot(2 * MiB, {0.38, 0.37, 0.39})})
                  .off);
  // Beaten clearly in two passes but not in the third (a burst of load): kept.
  CHECK_FALSE(autotune::check_cached_cap(
                  256 * KiB, {spot(256 * KiB, {0.6, 0.6, 0.6}), spot(1 * MiB, {0.4, 0.4, 0.58})})
                  .off);
  // No timings at the cap: nothing to judge.
  CHECK_FALSE(autotune::check_cached_cap(1 * MiB, {spot(2 * MiB, {0.1})}).off);
}

TEST_CASE("cache entries: written whole, read back with their notes", "[autotune]") {
  const auto dir =
      std::filesystem::temp_directory_path() / ("td_autotune_model_" + std::to_string(::getpid()));
  const auto file = dir / "buckets-v4-2ranks-0123";
  REQUIRE(
      autotune::write_cache_entry(file, {1 * MiB, 256 * KiB, {"measured here", "quiet"}}, "test"));
  const auto e = autotune::read_cache_entry(file);
  REQUIRE(e);
  CHECK(e->cap == 1 * MiB);
  CHECK(e->direct_bytes == 256 * KiB);
  CHECK(e->notes == std::vector<std::string>{"measured here", "quiet"});
  // Files of earlier versions hold the two numbers only.
  std::ofstream(file) << "65536 65536\n";
  CHECK(autotune::read_cache_entry(file)->cap == 64 * KiB);
  std::ofstream(file) << "garbage\n";
  CHECK_FALSE(autotune::read_cache_entry(file));
  std::size_t leftovers = 0;
  for (const auto& f : std::filesystem::directory_iterator(dir))
    leftovers += f.path().filename().string().find(".tmp-") != std::string::npos;
  CHECK(leftovers == 0);
  std::filesystem::remove_all(dir);
}

namespace {

// Path timings of three passes: per size, flat and node-aware times (seconds) scaled per pass by
// 1 - jitter, 1, 1 + jitter; node-aware's times in pass `flip` (if any) times `flip_factor`.
std::vector<autotune::PathTimings> path_timings(double flat_256k, double node_256k, double flat_4m,
                                                double node_4m, double jitter = 0.0, int flip = -1,
                                                double flip_factor = 1.0) {
  std::vector<autotune::PathTimings> out = {{256 * KiB, {}, {}}, {4 * MiB, {}, {}}};
  const double flat[2] = {flat_256k, flat_4m}, node[2] = {node_256k, node_4m};
  for (int pass = 0; pass < 3; ++pass)
    for (std::size_t i = 0; i < 2; ++i) {
      const double wobble = 1 + jitter * (pass - 1);
      out[i].flat.push_back(flat[i] * wobble);
      out[i].node_aware.push_back(node[i] * wobble * (pass == flip ? flip_factor : 1.0));
    }
  return out;
}

}  // namespace

TEST_CASE("the messages' path: node-aware only when clearly cheaper over both sizes",
          "[autotune]") {
  // Faster at both sizes: node-aware, and the passes agree.
  auto c = autotune::choose_path(path_timings(2e-3, 1.5e-3, 40e-3, 30e-3, 0.02));
  CHECK(c.node_aware);
  CHECK_FALSE(c.noisy);
  CHECK(c.node_cost < c.flat_cost);
  // Within the 5% margin: a tie stays flat.
  c = autotune::choose_path(path_timings(2e-3, 1.95e-3, 40e-3, 39e-3));
  CHECK_FALSE(c.node_aware);
  // Cheaper for large messages but much dearer for buckets: each size weighs the same per byte
  // (256 KiB 1.5x dearer, 4 MiB 0.9x: 1.17x flat's cost), so flat.
  c = autotune::choose_path(path_timings(2e-3, 3e-3, 40e-3, 36e-3));
  CHECK_FALSE(c.node_aware);
  // The other way round, a clear gain on the large message outweighs a small loss on buckets.
  c = autotune::choose_path(path_timings(2e-3, 2.1e-3, 40e-3, 20e-3));
  CHECK(c.node_aware);
  // Nothing measured: flat.
  CHECK_FALSE(autotune::choose_path({}).node_aware);
}

TEST_CASE("the messages' path: a pass that alone would choose the other path is noise",
          "[autotune]") {
  // Node-aware 20% cheaper, but in pass 1 node-aware took 1.5x as long: that pass alone would
  // have chosen flat. The median still chooses node-aware; the measurement is not to be cached.
  const auto c = autotune::choose_path(path_timings(2e-3, 1.6e-3, 40e-3, 32e-3, 0.0, 1, 1.5));
  CHECK(c.node_aware);
  CHECK(c.noisy);
  // A single pass cannot disagree with itself.
  auto one = path_timings(2e-3, 1.6e-3, 40e-3, 32e-3);
  for (auto& s : one) {
    s.flat.resize(1);
    s.node_aware.resize(1);
  }
  CHECK_FALSE(autotune::choose_path(one).noisy);
}

TEST_CASE("path entries: written whole, read back, anything else is no entry", "[autotune]") {
  const auto dir =
      std::filesystem::temp_directory_path() / ("td_path_model_" + std::to_string(::getpid()));
  const auto file = dir / "paths-v1-4ranks-0123";
  for (const bool node_aware : {true, false}) {
    REQUIRE(autotune::write_path_entry(file, {node_aware, {"measured here", "figures"}}, "test"));
    const auto e = autotune::read_path_entry(file);
    REQUIRE(e);
    CHECK(e->node_aware == node_aware);
    CHECK(e->notes == std::vector<std::string>{"measured here", "figures"});
  }
  std::ofstream(file) << "65536 65536\n";  // a bucket entry is not a path entry
  CHECK_FALSE(autotune::read_path_entry(file));
  std::filesystem::remove(file);
  CHECK_FALSE(autotune::read_path_entry(file));
  std::filesystem::remove_all(dir);
}
