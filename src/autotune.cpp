// kAutoBucketBytes: the bucket size measured on this communicator, not guessed.
//
// Model. One blocking MPI_Allreduce of n bytes costs T(n) ~ alpha + n / beta while n is small
// enough; past some size the implementation switches algorithm or runs out of cache and T(n)
// jumps (here: 32 MiB costs ~4x 16 MiB). A bucketed all_reduce of S bytes with buckets of B bytes
// costs about ceil(S/B) * T(B) plus the pack copies, so the best B is the size whose
// per-byte cost T(B)/B is lowest. We time a ladder of sizes (the MAX over ranks, the fastest of a
// few repetitions, so every rank sees the same numbers and picks the same B), fit alpha and beta on
// the sizes before the cliff for the log, and pick the smallest size within 5% of the best
// per-byte cost (smaller buckets mean less pack memory and earlier async completion).
//
// The result is cached per group in memory and on disk per (hosts, rank count, MPI library) in
// $TD_CACHE_DIR or $XDG_CACHE_HOME/tensordict-mpi or ~/.cache/tensordict-mpi; rank 0 reads the
// file and broadcasts, so ranks agree even if their caches differ.
#include <unistd.h>
#include <algorithm>
#include <array>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <numeric>

#include <fmt/format.h>

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

// Identifies the machines, rank count and MPI library the measurement holds for.
std::string cache_key(GroupState& g) {
  char host[256] = {};
  gethostname(host, sizeof host - 1);
  const std::uint64_t mine = std::hash<std::string>{}(host);
  std::vector<std::uint64_t> all(static_cast<std::size_t>(g.size));
  TD_MPI_CHECK(MPI_Allgather(&mine, 1, MPI_UINT64_T, all.data(), 1, MPI_UINT64_T, g.comm));
  char lib[MPI_MAX_LIBRARY_VERSION_STRING] = {};
  int len = 0;
  MPI_Get_library_version(lib, &len);
  std::uint64_t h = std::hash<std::string>{}(std::string(lib, static_cast<std::size_t>(len)));
  for (auto v : all) h = h * 1099511628211ull ^ v;
  return fmt::format("bucket-{}ranks-{:016x}", g.size, h);
}

std::optional<std::size_t> read_cache(const std::filesystem::path& file) {
  std::ifstream in(file);
  std::size_t v = 0;
  if (in >> v && v > 0) return v;
  return std::nullopt;
}

// Fastest over reps of the MAX-over-ranks time of one MPI_Allreduce of n bytes: the minimum is
// what the machine can do, the median would also measure whatever else ran meanwhile.
double time_allreduce(GroupState& g, std::byte* buf, std::size_t n, int reps) {
  std::vector<double> t;
  const int count = static_cast<int>(n / sizeof(float));
  for (int r = 0; r < reps + 1; ++r) {
    TD_MPI_CHECK(MPI_Barrier(g.comm));
    const double start = MPI_Wtime();
    TD_MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, buf, count, MPI_FLOAT, MPI_SUM, g.comm));
    double dt = MPI_Wtime() - start;
    TD_MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, &dt, 1, MPI_DOUBLE, MPI_MAX, g.comm));
    if (r > 0) t.push_back(dt);  // the first call warms up buffers and connections
  }
  return *std::min_element(t.begin(), t.end());
}

std::size_t measure(GroupState& g) {
  auto buf = std::make_unique<Storage>(kLadder.back());
  std::memset(buf->data, 0, buf->nbytes);  // zeros: sums stay finite and pages are touched
  std::vector<double> per_byte;
  std::vector<double> times;
  for (std::size_t n : kLadder) {
    const int reps = n >= (std::size_t{8} << 20) ? 3 : 5;
    const double t = time_allreduce(g, buf->data, n, reps);
    times.push_back(t);
    per_byte.push_back(t / static_cast<double>(n));
  }
  const double best = *std::min_element(per_byte.begin(), per_byte.end());
  std::size_t pick = kLadder.back();
  for (std::size_t i = 0; i < kLadder.size(); ++i)
    if (per_byte[i] <= best * 1.05) {
      pick = kLadder[i];
      break;
    }
  // alpha/beta by least squares over the sizes up to the pick (for the log only)
  double sx = 0, sy = 0, sxx = 0, sxy = 0, m = 0;
  for (std::size_t i = 0; i < kLadder.size() && kLadder[i] <= pick; ++i, ++m) {
    const auto x = static_cast<double>(kLadder[i]);
    sx += x;
    sy += times[i];
    sxx += x * x;
    sxy += x * times[i];
  }
  const double slope = m > 1 ? (m * sxy - sx * sy) / (m * sxx - sx * sx) : 0;
  const double alpha = m > 0 ? (sy - slope * sx) / m : 0;
  log_info([&] {
    std::string ladder;
    for (std::size_t i = 0; i < kLadder.size(); ++i)
      ladder += fmt::format(" {}KiB:{:.3f}ms", kLadder[i] >> 10, times[i] * 1e3);
    return fmt::format("auto bucket size: {} KiB (alpha {:.1f} us, beta {:.2f} GB/s; ladder{})",
                       pick >> 10, alpha * 1e6, slope > 0 ? 1e-9 / slope : 0.0, ladder);
  });
  return pick;
}

}  // namespace

std::size_t tuned_bucket_bytes(GroupState& g, Clock::time_point) {
  {
    std::lock_guard lock(g.mu);
    if (g.tuned_bucket_bytes) return *g.tuned_bucket_bytes;
  }
  std::size_t pick = kFallback;
  if (g.size > 1) {
    const std::filesystem::path dir = cache_dir();
    const std::string key = cache_key(g);
    const bool use_cache = !dir.empty() && config().autotune_cache;
    std::uint64_t cached = 0;
    if (g.rank == 0 && use_cache) cached = read_cache(dir / key).value_or(0);
    TD_MPI_CHECK(MPI_Bcast(&cached, 1, MPI_UINT64_T, 0, g.comm));
    if (cached > 0) {
      pick = cached;
    } else {
      pick = measure(g);
      if (g.rank == 0 && use_cache) {
        std::error_code ec;
        std::filesystem::create_directories(dir, ec);
        std::ofstream out(dir / key);
        out << pick << "\n";
        if (!out)
          log_warn([&] { return fmt::format("could not write the bucket-size cache {}", (dir / key).string()); });
      }
    }
  }
  std::lock_guard lock(g.mu);
  g.tuned_bucket_bytes = pick;
  return pick;
}

}  // namespace td::detail
