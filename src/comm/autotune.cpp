// kAutoBucketBytes: the bucket size measured on this communicator, not guessed.
//
// Model. A bucket of B bytes costs one pack copy, one blocking MPI_Allreduce and one unpack copy:
// T(B) ~ alpha + B / beta + 2 B / copy_bw while B is small enough; past some size the MPI library
// switches algorithm or the pack buffer falls out of cache and T(B) jumps (a pack buffer that no
// longer fits in L2 makes both copies slower; before init_process_group tuned malloc, a 32 MiB
// allreduce cost 13x a 16 MiB one because its temporary buffer was page-faulted in per call,
// docs/configuration.md). A dict of S bytes in buckets of B costs about (S/B) T(B), so the best
// cap is the size whose per-byte cost T(B)/B is lowest. We time that exact cycle on a ladder of
// sizes and pick the smallest size within 5% of the best per-byte cost (smaller buckets mean less
// pack memory and earlier async completion).
//
// Leaves large enough that a message of their own costs less than their share of a packed
// bucket are not packed at all: a leaf of n bytes goes alone when A(n)/n <= T(B)/B, with A(n)
// the bare allreduce (no copies) measured on the same ladder.
//
// Noise. The ladder is timed in kPasses passes over all sizes; a pass keeps the fastest of its
// repetitions of the MAX-over-ranks time (so every rank sees the same numbers and takes the same
// decisions), and a size's figure is the median over passes. Load that lasts a while makes the
// passes disagree: such a measurement is used by this process but not cached
// (autotune_model.hpp, where the decisions live as pure functions).
//
// The result is cached per group in memory and on disk per (hosts, rank count, MPI library, each
// rank's transport/binding/CPU/malloc setup: local_setup()) in $TD_CACHE_DIR or
// $XDG_CACHE_HOME/tensordict-mpi or ~/.cache/tensordict-mpi; rank 0 reads the file and
// broadcasts, so ranks agree even if their caches differ. On first use in a process a cached cap
// is spot-checked against its ladder neighbours (a few ms) and measured again if it is clearly
// off. TD_AUTOTUNE_REFRESH=1 (rank 0's) ignores the cached entry. The td-autotune tool
// (tools/td_autotune.cpp) shows, clears and re-measures the cache.
#include <algorithm>
#include <array>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <tuple>
#include <utility>
#include <vector>

#include <sched.h>
#include <unistd.h>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "comm/autotune_model.hpp"
#include "comm/collective_engine.hpp"
#include "comm/engine_internal.hpp"
#include "comm/executor.hpp"
#include "core/config.hpp"
#include "runtime/deadline.hpp"
#include "runtime/log.hpp"

namespace td::detail {

namespace {

using Clock = std::chrono::steady_clock;
using autotune::kLadder;

constexpr std::size_t kFallback = std::size_t{4} << 20;
constexpr int kPasses = 3;
// Repetitions per pass (the pass keeps the fastest): more for small sizes, whose few
// microseconds a single preemption swamps, and which cost nothing to repeat.
constexpr int kRepsPerPassSmall = 4;
constexpr int kRepsPerPass = 2;
constexpr std::size_t kSmallBytes = std::size_t{256} << 10;

// What else decides a collective's cost on this rank: the transport and collective components
// chosen through Open MPI's MCA variables (--mca on the mpirun line arrives as OMPI_MCA_*), the
// binding, how many CPUs this rank may run on, and what init_process_group did to malloc (it
// moves the large-message cliff: docs/configuration.md). Launch-specific variables (job ids,
// URIs, session directories) are left out, so the same setup finds the same cache entry.
std::string local_setup() {
  static constexpr std::array<std::string_view, 9> kPrefixes = {"OMPI_MCA_btl",
                                                                "OMPI_MCA_pml",
                                                                "OMPI_MCA_mtl",
                                                                "OMPI_MCA_coll",
                                                                "OMPI_MCA_osc",
                                                                "OMPI_MCA_mpi_yield_when_idle",
                                                                "OMPI_MCA_mpi_oversubscribe",
                                                                "OMPI_MCA_hwloc_base_binding",
                                                                "OMPI_MCA_orte_bound_at_launch"};
  std::vector<std::string> vars;
  for (char** e = environ; e && *e; ++e) {
    const std::string_view v(*e);
    for (auto prefix : kPrefixes)
      if (v.starts_with(prefix)) vars.emplace_back(v);
  }
  std::sort(vars.begin(), vars.end());
  cpu_set_t cpus;
  CPU_ZERO(&cpus);
  const int ncpu = sched_getaffinity(0, sizeof cpus, &cpus) == 0 ? CPU_COUNT(&cpus) : -1;
  const MallocTuning& m = apply_malloc_tuning();
  return fmt::format("cpus={};malloc={}/{};{}", ncpu, m.mmap_threshold, m.trim_threshold,
                     fmt::join(vars, ";"));
}

// "3 nodes of 2", "2 nodes of up to 3".
std::string node_layout(const GroupState& g) {
  return fmt::format("{} nodes of {}{}", g.nodes.nodes, g.nodes.equal ? "" : "up to ",
                     g.nodes.largest);
}

// The path a sync message takes on this group (run_blocking), for the cache key and the log:
// "flat", "flat across 3 nodes", "node-aware, 2 nodes of 2", "node-aware through the leaders, 2
// nodes of up to 3 ranks".
std::string message_path(const GroupState& g) {
  const NodeSplit& n = g.nodes;
  const std::string nodes = node_layout(g);
  if (node_aware(g))
    return fmt::format("node-aware{}, {}", config().hierarchical == 3 ? " through the leaders" : "",
                       nodes);
  return n.nodes > 1 ? fmt::format("flat across {} nodes", n.nodes) : std::string("flat");
}

constexpr std::uint64_t kFnvPrime = 1099511628211ull;

// Identifies the machines, rank count, MPI library and each rank's setup. Collective.
std::uint64_t setup_hash(GroupState& g) {
  char host[256] = {};
  gethostname(host, sizeof host - 1);
  const std::uint64_t mine = std::hash<std::string>{}(std::string(host) + "|" + local_setup());
  std::vector<std::uint64_t> all(static_cast<std::size_t>(g.size));
  post(control(allgather_call(&mine, 1, MPI_UINT64_T, all.data(), 1, MPI_UINT64_T, g.comm)),
       nullptr);
  char lib[MPI_MAX_LIBRARY_VERSION_STRING] = {};
  int len = 0;
  MPI_Get_library_version(lib, &len);
  std::uint64_t h = std::hash<std::string>{}(std::string(lib, static_cast<std::size_t>(len)));
  for (auto v : all) h = h * kFnvPrime ^ v;
  return h;
}

// Identifies the machines, rank count, MPI library, each rank's setup and the messages' path the
// measurement holds for.
std::string cache_key(GroupState& g) {
  const std::uint64_t h = setup_hash(g) * kFnvPrime ^ std::hash<std::string>{}(message_path(g));
  return fmt::format("buckets-v4-{}ranks-{:016x}", g.size, h);
}

// The path measurement's entry: the same setup, and which ranks share a node (the hosts' names
// say it, except for nodes simulated by TD_TEST_RANKS_PER_NODE).
std::string path_cache_key(GroupState& g) {
  std::uint64_t h = setup_hash(g);
  for (const int node : g.nodes.node_of) h = h * kFnvPrime ^ static_cast<std::uint64_t>(node);
  return fmt::format("{}v1-{}ranks-{:016x}", autotune::kPathFilePrefix, g.size, h);
}

// Times `op` `reps` times (after one untimed call when `warm_up`) and returns the fastest
// MAX-over-ranks time: the minimum is what the machine can do, the median would also measure
// whatever else ran meanwhile.
// `spent` adds up every call's MAX-over-ranks time, the same sum on every rank.
template <class Op>
double fastest(GroupState& g, int reps, bool warm_up, double& spent, Op&& op) {
  double best = 1e30;
  for (int r = warm_up ? -1 : 0; r < reps; ++r) {
    post(control(barrier_call(g.comm)), nullptr);
    const double start = MPI_Wtime();
    op();
    double dt = MPI_Wtime() - start;
    post(control(allreduce_call(MPI_IN_PLACE, &dt, 1, MPI_DOUBLE, MPI_MAX, g.comm)), nullptr);
    spent += dt;
    if (r >= 0) best = std::min(best, dt);  // the untimed call warms up buffers and connections
  }
  return best;
}

// Times the packed cycle (and, with `bare`, the bare allreduce) of each size in kPasses passes
// over all sizes, so that load lasting a while hits one pass of every size rather than every pass
// of one size. Passes stop early once the measured time exceeds TD_AUTOTUNE_BUDGET_MS (`*passes`
// says how many ran): a busy machine must not make the first auto-tuned call cost seconds.
// Collective; every rank returns the same values (the budget is checked on the MAX-over-ranks
// times every rank shares).
std::vector<autotune::Timings> time_sizes(GroupState& g, const std::vector<std::size_t>& sizes,
                                          bool bare, int* passes = nullptr) {
  const double budget = std::chrono::duration<double>(config().autotune_budget).count();
  double spent = 0;
  const std::size_t top = *std::max_element(sizes.begin(), sizes.end());
  auto leaves = std::make_unique<Storage>(top);  // stands for the leaves' memory
  auto pack = std::make_unique<Storage>(top);    // the pack buffer
  std::memset(leaves->data, 0, top);             // zeros: sums stay finite; pages are touched
  std::memset(pack->data, 0, top);
  std::vector<autotune::Timings> out;
  out.reserve(sizes.size());
  for (std::size_t n : sizes) out.push_back({n, {}, {}});
  int pass = 0;
  for (; pass < kPasses && (pass == 0 || spent < budget); ++pass)
    for (std::size_t i = 0; i < out.size(); ++i) {
      // A first pass that alone overruns the budget (a loaded machine) stops at the sizes it
      // reached: a ladder that ends early is still a choice among what was measured.
      if (pass == 0 && bare && i >= 2 && spent >= budget) {
        out.resize(i);
        break;
      }
      auto& t = out[i];
      const int count = static_cast<int>(t.bytes / sizeof(float));
      const int reps = t.bytes <= kSmallBytes ? kRepsPerPassSmall : kRepsPerPass;
      // Each message the way a call's goes on this group (node-aware stages, or a split across
      // nodes): the best size differs by path.
      t.packed.push_back(fastest(g, reps, pass == 0, spent, [&] {
        std::memcpy(pack->data, leaves->data, t.bytes);
        time_allreduce_message(g, pack->data, count, DType::Float32);
        std::memcpy(leaves->data, pack->data, t.bytes);
      }));
      if (bare)
        t.bare.push_back(fastest(g, reps, pass == 0, spent, [&] {
          time_allreduce_message(g, leaves->data, count, DType::Float32);
        }));
    }
  if (passes) *passes = pass;
  return out;
}

std::string kib(std::size_t bytes) { return fmt::format("{} KiB", bytes >> 10); }

// " 16KiB:0.012/0.009ms ...": each size's median packed cycle / bare allreduce.
std::string ladder_text(const std::vector<autotune::Timings>& ladder) {
  std::string text;
  for (const auto& t : ladder)
    text += fmt::format(" {}KiB:{:.3f}/{:.3f}ms", t.bytes >> 10, autotune::median(t.packed) * 1e3,
                        autotune::median(t.bare) * 1e3);
  return text;
}

// "spread across 3 passes 4% at 64 KiB, limit 25%"
std::string spread_text(const autotune::Choice& c) {
  if (c.spread_bytes == 0)
    return fmt::format("the {} passes agree within {:.0f} us where it matters", kPasses,
                       autotune::kNoiseFloorSeconds * 1e6);
  return fmt::format("spread across {} passes {:.0f}% at {}, limit {:.0f}%", kPasses,
                     c.spread * 100, kib(c.spread_bytes), autotune::kNoiseLimit * 100);
}

// What else ran on rank 0's host while we measured: the 1-minute load average (times 1000), this
// job's ranks on that host, and its online CPUs. Collective; rank 0's figures on every rank.
std::array<std::uint64_t, 3> host_load(GroupState& g) {
  std::array<std::uint64_t, 3> out{0, static_cast<std::uint64_t>(ranks_on_this_host(g.comm)), 0};
  if (g.rank == 0) {
    double load = 0;
    if (getloadavg(&load, 1) == 1) out[0] = static_cast<std::uint64_t>(load * 1000);
    out[2] = static_cast<std::uint64_t>(std::max(0L, sysconf(_SC_NPROCESSORS_ONLN)));
  }
  post(control(bcast_call(out.data(), 3, MPI_UINT64_T, 0, g.comm)), nullptr);
  return out;
}

// The notes of a cache file: when, where and how well it was measured, and the figures.
std::vector<std::string> cache_notes(const GroupState& g, const std::string& quality,
                                     const std::string& figures) {
  char host[256] = {};
  gethostname(host, sizeof host - 1);
  char lib[MPI_MAX_LIBRARY_VERSION_STRING] = {};
  int len = 0;
  MPI_Get_library_version(lib, &len);
  std::string mpi(lib, static_cast<std::size_t>(std::max(len, 0)));
  mpi = mpi.substr(0, mpi.find_first_of(",\n"));
  const std::time_t now = std::time(nullptr);
  std::tm utc{};
  gmtime_r(&now, &utc);
  char when[32] = {};
  std::strftime(when, sizeof when, "%Y-%m-%dT%H:%M:%SZ", &utc);
  double load = 0;
  getloadavg(&load, 1);
  return {fmt::format("measured {} by rank 0 on {}, {} ranks, {}", when, host, g.size, mpi),
          fmt::format("{}; load average {:.2f}", quality, load), figures};
}

// This group's entry of the bucket-size cache on disk.
struct CacheFile {
  std::filesystem::path dir;   // empty: no cache directory
  std::filesystem::path file;  // empty when `dir` is
  bool use = false;            // a directory, and TD_AUTOTUNE_CACHE on
};

// The cache file named `name` (a cache key: computed on every rank, since making one is
// collective, whatever this rank's cache directory).
CacheFile cache_file(const std::string& name) {
  CacheFile cache;
  cache.dir = autotune::cache_dir();
  if (!cache.dir.empty()) cache.file = cache.dir / name;
  cache.use = !cache.dir.empty() && config().autotune_cache;
  return cache;
}

// Rank 0's cached entry (two numbers, read by `read` unless the cache is off or
// TD_AUTOTUNE_REFRESH is set) and its TD_AUTOTUNE_REFRESH, broadcast. Collective.
struct SharedEntry {
  std::optional<std::array<std::uint64_t, 2>> entry;
  bool refresh = false;
};
SharedEntry shared_cache_entry(
    GroupState& g, const CacheFile& cache,
    const std::function<std::optional<std::array<std::uint64_t, 2>>()>& read) {
  std::array<std::uint64_t, 4> shared{0, 0, 0, 0};  // found, the two numbers, refresh
  if (g.rank == 0) {
    shared[3] = config().autotune_refresh ? 1 : 0;
    if (cache.use && shared[3] == 0)
      if (auto e = read()) shared = {1, (*e)[0], (*e)[1], 0};
  }
  post(control(bcast_call(shared.data(), 4, MPI_UINT64_T, 0, g.comm)), nullptr);
  SharedEntry out;
  if (shared[0] != 0) out.entry = {shared[1], shared[2]};
  out.refresh = shared[3] != 0;
  return out;
}

// Every pass's time of every size, at debug level; `what` says which measurement it was.
void log_passes(const std::vector<autotune::Timings>& ladder, std::string_view what) {
  log_debug([&] {
    std::string passes;
    auto ms = [](const std::vector<double>& v) {
      std::string out;
      for (double x : v) out += fmt::format("{}{:.4f}", out.empty() ? "" : "/", x * 1e3);
      return out;
    };
    for (const auto& t : ladder)
      passes += fmt::format(" {}: packed {}{} ms;",
                            t.bytes % 1024 ? fmt::format("{} B", t.bytes) : kib(t.bytes),
                            ms(t.packed), t.bare.empty() ? "" : " bare " + ms(t.bare));
    return fmt::format("auto buckets, {}: each pass's fastest of {} ({} up to {} KiB):{}", what,
                       kRepsPerPass, kRepsPerPassSmall, kSmallBytes >> 10, passes);
  });
}

// How a measurement went, for the decision to cache it.
struct Measured {
  std::string cut_short;  // why it stopped early ("2 of 3 passes, up to 1024 KiB"), or empty
  std::string noise;      // why it looks noisy, or empty
  std::string quality;    // said when it is cached ("spread across 3 passes 4% at 64 KiB, ...")
};

// Caches a measurement (rank 0 calls `write`) unless it was cut short, looks noisy or ran on a
// busy machine, or caching is off; returns the words that say which. Collective (host_load).
std::string cache_measured(GroupState& g, const Measured& m, const CacheFile& cache,
                           const std::function<bool()>& write) {
  const auto [load_milli, local_ranks, cpus] = host_load(g);
  const double load = static_cast<double>(load_milli) / 1000;
  const bool busy =
      autotune::machine_busy(load, static_cast<long>(cpus), static_cast<int>(local_ranks));
  if (!m.cut_short.empty())
    return fmt::format(
        "measured, NOT cached: {}, fit in TD_AUTOTUNE_BUDGET_MS={} (a busy or slow machine); this "
        "process uses it, the next one measures again",
        m.cut_short, config().autotune_budget.count());
  if (!m.noise.empty() || busy) {
    const std::string why =
        !m.noise.empty() ? m.noise
                         : fmt::format(
                               "load average {:.2f} on {} CPUs, of which this job's {} ranks there "
                               "explain at most {}",
                               load, cpus, local_ranks, local_ranks);
    return fmt::format(
        "measured, NOT cached: the machine looks busy ({}); this process uses it, the next one "
        "measures again (cache file {})",
        why, cache.file.empty() ? std::string("none") : cache.file.string());
  }
  if (!cache.use)
    return fmt::format("measured ({}); not cached: {}", m.quality,
                       cache.dir.empty() ? "no cache directory" : "TD_AUTOTUNE_CACHE=0");
  if (g.rank == 0 && !write())
    log_warn(
        [&] { return fmt::format("could not write the tuner's cache {}", cache.file.string()); });
  return fmt::format("measured ({}), cached in {}", m.quality, cache.file.string());
}

// The bucket sizes' measurement, cached (cache_measured).
std::string cache_measured(GroupState& g, const autotune::Choice& c,
                           const std::vector<autotune::Timings>& ladder, int passes,
                           const CacheFile& cache) {
  Measured m;
  if (passes < kPasses || ladder.size() < kLadder.size())
    m.cut_short =
        fmt::format("{} of {} passes, up to {}", passes, kPasses, kib(ladder.back().bytes));
  if (c.noisy) m.noise = spread_text(c);
  m.quality = spread_text(c);
  return cache_measured(g, m, cache, [&] {
    return autotune::write_cache_entry(
        cache.file,
        {c.cap, c.direct_bytes,
         cache_notes(g, spread_text(c),
                     "per size, median packed cycle / bare allreduce:" + ladder_text(ladder))},
        std::to_string(getpid()));
  });
}

// Resolves kAutoBucketBytes on a group of 2 ranks or more; returns it with the one line that says
// how it was found. Collective: every decision below is taken on values every rank shares
// (rank 0's broadcast cache entry, MAX-over-ranks timings).
std::pair<TunedBuckets, std::string> resolve(GroupState& g) {
  const CacheFile cache = cache_file(cache_key(g));
  const SharedEntry shared =
      shared_cache_entry(g, cache, [&]() -> std::optional<std::array<std::uint64_t, 2>> {
        if (auto c = autotune::read_cache_entry(cache.file))
          return std::array<std::uint64_t, 2>{c->cap, c->direct_bytes};
        return std::nullopt;
      });

  std::string story;
  if (shared.entry) {
    const std::size_t cap = (*shared.entry)[0];
    const auto spot = time_sizes(g, autotune::spot_check_sizes(cap), false);
    if (g.rank == 0) log_passes(spot, "spot check of the cached cap");
    const autotune::SpotCheck verdict = autotune::check_cached_cap(cap, spot);
    if (!verdict.off)
      return {{cap, (*shared.entry)[1]},
              fmt::format("from the cache {} (spot check against its neighbours: ok)",
                          cache.file.string())};
    story = fmt::format(
        "the cached cap {} ({}) is off: {} was {:.0f}% or more cheaper per byte in every pass of "
        "a spot check; measured again: ",
        kib(cap), cache.file.string(), kib(verdict.better_bytes), verdict.gain * 100);
  } else if (shared.refresh) {
    story = "TD_AUTOTUNE_REFRESH: cached entry ignored; ";
  }

  int passes = 0;
  const auto ladder =
      time_sizes(g, std::vector<std::size_t>(kLadder.begin(), kLadder.end()), true, &passes);
  const autotune::Choice c = autotune::choose(ladder);
  if (g.rank == 0) log_passes(ladder, "the ladder");
  story += cache_measured(g, c, ladder, passes, cache);
  story += fmt::format(" (per size, median packed cycle / bare allreduce:{})", ladder_text(ladder));
  return {{c.cap, c.direct_bytes}, story};
}

// Times one allreduce message of each size of kPathSizes flat and node-aware, the way a call's
// message goes on this group (run_blocking: per slice, split across nodes, as they apply), in
// kPasses passes (the order of the two paths alternating from pass to pass), within
// TD_AUTOTUNE_BUDGET_MS like the ladder (`*passes` says how many ran). Collective; every rank
// returns the same values. Leaves the group flat: the caller sets the choice.
std::vector<autotune::PathTimings> time_paths(GroupState& g, int* passes) {
  const double budget = std::chrono::duration<double>(config().autotune_budget).count();
  double spent = 0;
  const std::size_t top =
      *std::max_element(autotune::kPathSizes.begin(), autotune::kPathSizes.end());
  auto buffer = std::make_unique<Storage>(top);
  std::memset(buffer->data, 0, top);  // zeros: sums stay finite; pages are touched
  std::vector<autotune::PathTimings> out;
  out.reserve(autotune::kPathSizes.size());
  for (std::size_t n : autotune::kPathSizes) out.push_back({n, {}, {}});
  int pass = 0;
  for (; pass < kPasses && (pass == 0 || spent < budget); ++pass)
    for (auto& t : out)
      for (int k = 0; k < 2; ++k) {
        const bool aware = (pass + k) % 2 == 1;
        g.nodes.auto_node_aware.store(aware, std::memory_order_relaxed);
        const int count = static_cast<int>(t.bytes / sizeof(float));
        (aware ? t.node_aware : t.flat).push_back(fastest(g, kRepsPerPass, pass == 0, spent, [&] {
          time_allreduce_message(g, buffer->data, count, DType::Float32);
        }));
      }
  g.nodes.auto_node_aware.store(false, std::memory_order_relaxed);
  if (passes) *passes = pass;
  return out;
}

// " 256 KiB: 1.234 / 0.987 ms; 4096 KiB: ...": each size's median flat / node-aware time.
std::string path_text(const std::vector<autotune::PathTimings>& t) {
  std::string out;
  for (const auto& s : t)
    out += fmt::format("{} {}: {:.3f} / {:.3f} ms", out.empty() ? "" : ";", kib(s.bytes),
                       autotune::median(s.flat) * 1e3, autotune::median(s.node_aware) * 1e3);
  return out;
}

// Resolves the messages' path on a group TD_HIERARCHICAL=auto measures (path_to_choose): rank 0's
// cached entry, broadcast, or a measurement; returns node-aware or not with the words that say
// how it was found. Collective: every decision is taken on values every rank shares.
std::pair<bool, std::string> resolve_path(GroupState& g) {
  const CacheFile cache = cache_file(path_cache_key(g));
  const SharedEntry shared =
      shared_cache_entry(g, cache, [&]() -> std::optional<std::array<std::uint64_t, 2>> {
        if (auto e = autotune::read_path_entry(cache.file))
          return std::array<std::uint64_t, 2>{e->node_aware ? 1u : 0u, 0};
        return std::nullopt;
      });
  if (shared.entry)
    return {(*shared.entry)[0] != 0, fmt::format("from the cache {}", cache.file.string())};

  int passes = 0;
  const auto timings = time_paths(g, &passes);
  const autotune::PathChoice c = autotune::choose_path(timings);
  const std::string figures =
      fmt::format("per size, median flat / node-aware allreduce:{}", path_text(timings));
  Measured m;
  if (passes < kPasses) m.cut_short = fmt::format("{} of {} passes", passes, kPasses);
  if (c.noisy) m.noise = fmt::format("the {} passes disagree on the faster path", passes);
  m.quality = fmt::format("{} passes agree; cost per byte node-aware / flat {:.2f}", passes,
                          c.flat_cost > 0 ? c.node_cost / c.flat_cost : 0.0);
  std::string story = shared.refresh ? "TD_AUTOTUNE_REFRESH: cached entry ignored; " : "";
  story += cache_measured(g, m, cache, [&] {
    return autotune::write_path_entry(
        cache.file, {c.node_aware, cache_notes(g, m.quality, figures)}, std::to_string(getpid()));
  });
  return {c.node_aware, fmt::format("{} ({})", story, figures)};
}

// The watchdog's limit for a measurement of the machine (its own cost is bounded by
// TD_AUTOTUNE_BUDGET_MS plus the barriers around it, not charged to the call): a peer lost in it
// must not hang the others. A minute at least: under load a measurement can overrun its budget
// by a few sizes' calls.
Clock::time_point measurement_limit(Clock::time_point deadline, std::chrono::milliseconds timeout) {
  return std::max(deadline, deadline_after(std::max<std::chrono::milliseconds>(
                                               timeout, std::chrono::minutes(1)) +
                                           4 * config().autotune_budget));
}

}  // namespace

std::size_t smallest_candidate_cap() { return kLadder.front(); }

TunedBuckets tuned_buckets(GroupState& g, Clock::time_point deadline,
                           std::chrono::milliseconds timeout) {
  {
    std::lock_guard lock(g.mu);
    if (g.tuned) return *g.tuned;
  }
  TunedBuckets pick{kFallback, std::size_t{64} << 10};
  if (g.size > 1) {
    // Not charged to the call: the caller gives the call a fresh deadline afterwards.
    const auto limit = measurement_limit(deadline, timeout);
    const std::function<std::string()> describe = [&] {
      return fmt::format("measuring kAutoBucketBytes on a group of {} ranks", g.size);
    };
    const auto start = Clock::now();
    std::string story;
    {
      // The measurement posts blocking collectives on the node communicators: an earlier async
      // call's stages must all be posted first, in the same order on every rank.
      if (node_aware(g)) await_node_stages(g, limit, describe);
      BlockingPhase phase(limit, describe);
      std::tie(pick, story) = resolve(g);
    }
    const auto cost =
        std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - start).count();
    // Every rank knows the same: said once per group, not once per rank.
    log_info_once(g.rank, [&] {
      return fmt::format(
          "auto buckets: cap {}, leaves of {} or more sent alone (messages {}); found in {} ms, "
          "not counted in the call's timeout; {}",
          kib(pick.cap), kib(pick.direct_bytes), message_path(g), cost, story);
    });
  }
  std::lock_guard lock(g.mu);
  g.tuned = pick;
  return pick;
}

bool choose_message_path(GroupState& g, Clock::time_point deadline,
                         std::chrono::milliseconds timeout) {
  if (g.size < 2 || !path_to_choose(g)) return false;
  const auto limit = measurement_limit(deadline, timeout);
  const std::function<std::string()> describe = [&] {
    return fmt::format("measuring the messages' path (flat or node-aware) on a group of {} ranks",
                       g.size);
  };
  const auto start = Clock::now();
  bool aware = false;
  std::string story;
  {
    BlockingPhase phase(limit, describe);
    std::tie(aware, story) = resolve_path(g);
  }
  g.nodes.auto_node_aware.store(aware, std::memory_order_relaxed);
  g.nodes.path_chosen.store(true, std::memory_order_release);
  const auto cost =
      std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - start).count();
  log_info_once(g.rank, [&] {
    return fmt::format(
        "messages {} (TD_HIERARCHICAL=auto, {}): found in {} ms, not counted in the call's "
        "timeout; {}",
        aware ? "node-aware" : "flat", node_layout(g), cost, story);
  });
  return true;
}

}  // namespace td::detail
