// kAutoBucketBytes: the bucket size measured on this communicator, not guessed.
//
// Model. A bucket of B bytes costs one pack copy, one blocking MPI_Allreduce and one unpack copy:
// T(B) ~ alpha + B / beta + 2 B / copy_bw while B is small enough; past some size the MPI library
// switches algorithm or the pack buffer falls out of cache and T(B) jumps (a pack buffer that no
// longer fits in L2 makes both copies slower; before init_process_group tuned malloc, a 32 MiB
// allreduce cost 13x a 16 MiB one because its temporary buffer was page-faulted in per call,
// docs/configuration.md). A dict of S
// bytes in buckets of B costs about (S/B) T(B), so the best cap is the size whose per-byte cost
// T(B)/B is lowest. We time that exact cycle on a ladder of sizes (the MAX over ranks, the
// fastest of a few repetitions, so every rank sees the same numbers and picks the same B) and
// pick the smallest size within 5% of the best per-byte cost (smaller buckets mean less pack
// memory and earlier async completion).
//
// Leaves large enough that a message of their own costs less than their share of a packed
// bucket are not packed at all: a leaf of n bytes goes alone when A(n)/n <= T(B)/B, with A(n)
// the bare allreduce (no copies) measured on the same ladder.
//
// The result is cached per group in memory and on disk per (hosts, rank count, MPI library, each
// rank's transport/binding/CPU/malloc setup: local_setup()) in
// $TD_CACHE_DIR or $XDG_CACHE_HOME/tensordict-mpi or ~/.cache/tensordict-mpi; rank 0 reads the
// file and broadcasts, so ranks agree even if their caches differ.
#include <algorithm>
#include <array>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <numeric>
#include <string_view>

#include <sched.h>
#include <unistd.h>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "collective_engine.hpp"
#include "config.hpp"
#include "log.hpp"

namespace td::detail {

namespace {

using Clock = std::chrono::steady_clock;

constexpr std::array<std::size_t, 8> kLadder = {
    std::size_t{16} << 10, std::size_t{64} << 10, std::size_t{256} << 10, std::size_t{1} << 20,
    std::size_t{2} << 20,  std::size_t{4} << 20,  std::size_t{8} << 20,   std::size_t{16} << 20};
constexpr std::size_t kFallback = std::size_t{4} << 20;

std::filesystem::path cache_dir() {
  if (const char* d = std::getenv("TD_CACHE_DIR"); d && *d) return d;
  if (const char* x = std::getenv("XDG_CACHE_HOME"); x && *x)
    return std::filesystem::path(x) / "tensordict-mpi";
  if (const char* h = std::getenv("HOME"); h && *h)
    return std::filesystem::path(h) / ".cache" / "tensordict-mpi";
  return {};
}

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

// Identifies the machines, rank count, MPI library and each rank's setup the measurement holds
// for.
std::string cache_key(GroupState& g) {
  char host[256] = {};
  gethostname(host, sizeof host - 1);
  const std::uint64_t mine = std::hash<std::string>{}(std::string(host) + "|" + local_setup());
  std::vector<std::uint64_t> all(static_cast<std::size_t>(g.size));
  TD_MPI_CHECK(MPI_Allgather(&mine, 1, MPI_UINT64_T, all.data(), 1, MPI_UINT64_T, g.comm));
  char lib[MPI_MAX_LIBRARY_VERSION_STRING] = {};
  int len = 0;
  MPI_Get_library_version(lib, &len);
  std::uint64_t h = std::hash<std::string>{}(std::string(lib, static_cast<std::size_t>(len)));
  for (auto v : all) h = h * 1099511628211ull ^ v;
  return fmt::format("buckets-v3-{}ranks-{:016x}", g.size, h);
}

std::optional<TunedBuckets> read_cache(const std::filesystem::path& file) {
  std::ifstream in(file);
  TunedBuckets t;
  if (in >> t.cap >> t.direct_bytes && t.cap > 0 && t.direct_bytes > 0) return t;
  return std::nullopt;
}

// Fastest over reps of the MAX-over-ranks time of `op`: the minimum is what the machine can do,
// the median would also measure whatever else ran meanwhile.
template <class Op>
double fastest(GroupState& g, int reps, Op&& op) {
  double best = 1e30;
  for (int r = 0; r < reps + 1; ++r) {
    TD_MPI_CHECK(MPI_Barrier(g.comm));
    const double start = MPI_Wtime();
    op();
    double dt = MPI_Wtime() - start;
    TD_MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, &dt, 1, MPI_DOUBLE, MPI_MAX, g.comm));
    if (r > 0) best = std::min(best, dt);  // the first run warms up buffers and connections
  }
  return best;
}

TunedBuckets measure(GroupState& g) {
  const std::size_t top = kLadder.back();
  auto leaves = std::make_unique<Storage>(top);  // stands for the leaves' memory
  auto pack = std::make_unique<Storage>(top);    // the pack buffer
  std::memset(leaves->data, 0, top);             // zeros: sums stay finite; pages are touched
  std::memset(pack->data, 0, top);
  std::vector<double> times, per_byte, bare;
  for (std::size_t n : kLadder) {
    const int count = static_cast<int>(n / sizeof(float));
    const int reps = n >= (std::size_t{8} << 20) ? 3 : 5;
    const double t = fastest(g, reps, [&] {
      std::memcpy(pack->data, leaves->data, n);
      TD_MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, pack->data, count, MPI_FLOAT, MPI_SUM, g.comm));
      std::memcpy(leaves->data, pack->data, n);
    });
    times.push_back(t);
    per_byte.push_back(t / static_cast<double>(n));
    bare.push_back(fastest(g, reps, [&] {
      TD_MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, leaves->data, count, MPI_FLOAT, MPI_SUM, g.comm));
    }));
  }
  const double best = *std::min_element(per_byte.begin(), per_byte.end());
  TunedBuckets out{kLadder.back(), kLadder.back()};
  for (std::size_t i = 0; i < kLadder.size(); ++i)
    if (per_byte[i] <= best * 1.05) {
      out.cap = kLadder[i];
      break;
    }
  const double packed_per_byte = best;
  for (std::size_t i = 0; i < kLadder.size() && kLadder[i] <= out.cap; ++i)
    if (bare[i] / static_cast<double>(kLadder[i]) <= packed_per_byte) {
      out.direct_bytes = kLadder[i];
      break;
    }
  out.direct_bytes = std::min(out.direct_bytes, out.cap);
  log_info([&] {
    std::string ladder;
    for (std::size_t i = 0; i < kLadder.size(); ++i)
      ladder +=
          fmt::format(" {}KiB:{:.3f}/{:.3f}ms", kLadder[i] >> 10, times[i] * 1e3, bare[i] * 1e3);
    return fmt::format(
        "auto buckets: cap {} KiB, leaves of {} KiB or more sent alone (per size: packed cycle / "
        "bare allreduce{})",
        out.cap >> 10, out.direct_bytes >> 10, ladder);
  });
  return out;
}

}  // namespace

TunedBuckets tuned_buckets(GroupState& g, Clock::time_point) {
  {
    std::lock_guard lock(g.mu);
    if (g.tuned) return *g.tuned;
  }
  TunedBuckets pick{kFallback, std::size_t{64} << 10};
  if (g.size > 1) {
    const std::filesystem::path dir = cache_dir();
    const std::string key = cache_key(g);
    const bool use_cache = !dir.empty() && config().autotune_cache;
    std::array<std::uint64_t, 2> cached{0, 0};
    if (g.rank == 0 && use_cache)
      if (auto c = read_cache(dir / key)) cached = {c->cap, c->direct_bytes};
    TD_MPI_CHECK(MPI_Bcast(cached.data(), 2, MPI_UINT64_T, 0, g.comm));
    if (cached[0] > 0) {
      pick = {cached[0], cached[1]};
    } else {
      pick = measure(g);
      if (g.rank == 0 && use_cache) {
        std::error_code ec;
        std::filesystem::create_directories(dir, ec);
        std::ofstream out(dir / key);
        out << pick.cap << " " << pick.direct_bytes << "\n";
        if (!out)
          log_warn([&] {
            return fmt::format("could not write the bucket-size cache {}", (dir / key).string());
          });
      }
    }
  }
  std::lock_guard lock(g.mu);
  g.tuned = pick;
  return pick;
}

}  // namespace td::detail
