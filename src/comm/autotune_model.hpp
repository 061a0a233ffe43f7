// The bucket-size tuner without MPI: its ladder, its decisions as pure functions of the timings
// (which size to pick, whether a measurement is too noisy to keep, whether a cached size is off)
// and its cache files. Header-only, so that the library (autotune.cpp), the td-autotune tool and
// the serial tests share one copy; nothing here is exported from libtensordict.
#pragma once

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <istream>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace td::detail::autotune {

/// The sizes timed: candidate caps and direct-send sizes.
inline constexpr std::array<std::size_t, 8> kLadder = {
    std::size_t{16} << 10, std::size_t{64} << 10, std::size_t{256} << 10, std::size_t{1} << 20,
    std::size_t{2} << 20,  std::size_t{4} << 20,  std::size_t{8} << 20,   std::size_t{16} << 20};

/// The cap is the smallest size whose per-byte cost is within this fraction of the best.
inline constexpr double kPickTolerance = 0.05;
/// A measurement whose passes disagree by more than this (relative spread of one size's times
/// across passes, (max - min) / min, where it matters: see choose) is used by the process that
/// took it but not cached. Each pass keeps the fastest of its repetitions, so only load that
/// lasts through a pass moves a pass's figure.
inline constexpr double kNoiseLimit = 0.25;
/// Differences between passes smaller than this are the timer's and the scheduler's, whatever
/// their relative size (a 16 KiB allreduce takes about 10 us): they never make a measurement noisy.
inline constexpr double kNoiseFloorSeconds = 5e-6;
/// A cached cap is off when, in every pass of the spot check, a ladder neighbour costs less per
/// byte than the cap by more than this: well beyond kPickTolerance and a quiet machine's noise.
inline constexpr double kStaleMargin = 0.15;

/// One size's timings: per pass, the fastest MAX-over-ranks time (seconds) of the packed cycle
/// (copy in, allreduce, copy out) and of the bare allreduce. Every rank holds the same values.
struct Timings {
  std::size_t bytes = 0;
  std::vector<double> packed;
  std::vector<double> bare;  // empty in a spot check
};

inline double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const std::size_t m = v.size() / 2;
  return v.size() % 2 ? v[m] : 0.5 * (v[m - 1] + v[m]);
}

/// (max - min) / min of positive values; 0 for fewer than two.
inline double relative_spread(const std::vector<double>& v) {
  if (v.size() < 2) return 0;
  const auto [lo, hi] = std::minmax_element(v.begin(), v.end());
  return *lo > 0 ? (*hi - *lo) / *lo : 0;
}

/// What a ladder measurement decides.
struct Choice {
  std::size_t cap = 0;
  std::size_t direct_bytes = 0;  // leaves of this size or more are sent alone, unpacked
  double spread = 0;             // the largest relative spread across passes that matters
  std::size_t spread_bytes = 0;  // the size it was seen at
  bool noisy = false;            // spread > the noise limit: do not cache
};

/// The cap and direct size from a ladder's timings (each size's median over passes): the cap is
/// the smallest size within kPickTolerance of the best per-byte cost of the packed cycle; a leaf
/// goes alone from the smallest size (at most the cap) whose bare allreduce costs no more per
/// byte than the best packed cycle.
///
/// `noisy` when the passes disagree by more than `noise_limit` where that could change the
/// decision: at the best size, at every size whose fastest pass could be within the tolerance of
/// the best size's slowest, and, up to the cap, at every size whose bare allreduce per byte
/// overlaps the best packed cost across passes. Jitter of a size that loses (or wins) in every
/// pass whatever the noise does not count, nor differences below kNoiseFloorSeconds.
inline Choice choose(const std::vector<Timings>& ladder, double noise_limit = kNoiseLimit) {
  Choice c;
  if (ladder.empty()) return c;
  auto per_byte = [](const std::vector<double>& v, std::size_t bytes) {
    std::vector<double> out;
    out.reserve(v.size());
    for (double t : v) out.push_back(t / static_cast<double>(bytes));
    return out;
  };
  std::vector<double> cost;  // median per-byte cost of the packed cycle
  cost.reserve(ladder.size());
  for (const Timings& t : ladder) cost.push_back(median(t.packed) / static_cast<double>(t.bytes));
  const auto best_at =
      static_cast<std::size_t>(std::min_element(cost.begin(), cost.end()) - cost.begin());
  const double best = cost[best_at];
  c.cap = ladder.back().bytes;
  for (std::size_t i = 0; i < ladder.size(); ++i)
    if (cost[i] <= best * (1 + kPickTolerance)) {
      c.cap = ladder[i].bytes;
      break;
    }
  c.direct_bytes = c.cap;
  for (const Timings& t : ladder) {
    if (t.bytes > c.cap) break;
    if (median(t.bare) / static_cast<double>(t.bytes) <= best) {
      c.direct_bytes = t.bytes;
      break;
    }
  }

  const auto best_passes = per_byte(ladder[best_at].packed, ladder[best_at].bytes);
  const auto [best_lo, best_hi] = std::minmax_element(best_passes.begin(), best_passes.end());
  auto consider = [&](const std::vector<double>& series, std::size_t bytes) {
    const auto [lo, hi] = std::minmax_element(series.begin(), series.end());
    if (*hi - *lo < kNoiseFloorSeconds) return;
    const double s = relative_spread(series);
    if (s > c.spread) {
      c.spread = s;
      c.spread_bytes = bytes;
    }
  };
  for (const Timings& t : ladder) {
    const auto packed = per_byte(t.packed, t.bytes);
    if (!packed.empty() &&
        *std::min_element(packed.begin(), packed.end()) <= *best_hi * (1 + kPickTolerance))
      consider(t.packed, t.bytes);
    const auto bare = per_byte(t.bare, t.bytes);
    if (t.bytes <= c.cap && !bare.empty()) {
      const auto [lo, hi] = std::minmax_element(bare.begin(), bare.end());
      if (*lo <= *best_hi && *hi >= *best_lo) consider(t.bare, t.bytes);
    }
  }
  c.noisy = c.spread > noise_limit;
  return c;
}

/// Another program keeps the machine busy when the 1-minute load average, less this job's ranks
/// on the host, exceeds this many runnable tasks per CPU. A measurement then reflects that load
/// however well its passes agree: load that lasts through every pass shows no spread.
inline constexpr double kBusyLoadPerCpu = 0.5;

/// Whether a measurement taken at 1-minute load average `load` on a host of `cpus` CPUs that
/// runs `local_ranks` of this job is to be kept for this process only.
inline bool machine_busy(double load, long cpus, int local_ranks) {
  return cpus > 0 && load - local_ranks > kBusyLoadPerCpu * static_cast<double>(cpus);
}

/// The sizes a spot check of a cached cap times: the ladder sizes just below and just above it,
/// and the cap itself (which need not be on the ladder: cache files can be edited).
inline std::vector<std::size_t> spot_check_sizes(std::size_t cap) {
  std::vector<std::size_t> out;
  const auto above = std::upper_bound(kLadder.begin(), kLadder.end(), cap);
  const auto below = std::lower_bound(kLadder.begin(), kLadder.end(), cap);
  if (below != kLadder.begin()) out.push_back(*(below - 1));
  out.push_back(cap);
  if (above != kLadder.end()) out.push_back(*above);
  return out;
}

/// The verdict on a cached cap.
struct SpotCheck {
  bool off = false;
  std::size_t better_bytes = 0;  // the neighbour that beat the cap in every pass (when off)
  double gain = 0;  // the smallest fraction by which it did: 1 - its per-byte cost / the cap's
};

/// Whether `cap` is clearly off given the spot check's timings (spot_check_sizes(cap), packed
/// only): a neighbour cheaper per byte than the cap by more than `margin` in every pass.
inline SpotCheck check_cached_cap(std::size_t cap, const std::vector<Timings>& timings,
                                  double margin = kStaleMargin) {
  SpotCheck verdict;
  const auto at_cap = std::find_if(timings.begin(), timings.end(),
                                   [&](const Timings& t) { return t.bytes == cap; });
  if (at_cap == timings.end() || at_cap->packed.empty()) return verdict;
  for (const Timings& t : timings) {
    if (t.bytes == cap || t.packed.size() != at_cap->packed.size()) continue;
    double worst_gain = 1;
    for (std::size_t p = 0; p < t.packed.size(); ++p) {
      const double cap_cost = at_cap->packed[p] / static_cast<double>(cap);
      const double cost = t.packed[p] / static_cast<double>(t.bytes);
      worst_gain = std::min(worst_gain, cap_cost > 0 ? 1 - cost / cap_cost : 0.0);
    }
    if (worst_gain > margin && worst_gain > verdict.gain) verdict = {true, t.bytes, worst_gain};
  }
  return verdict;
}

// ---- cache files ------------------------------------------------------------------------------

/// Directory of the cache: $TD_CACHE_DIR, else $XDG_CACHE_HOME/tensordict-mpi, else
/// $HOME/.cache/tensordict-mpi; empty when none of the three is set (no file cache). Read here
/// rather than in core/config: td-autotune, which links only the public library, shares it.
inline std::filesystem::path cache_dir() {
  if (const char* d = std::getenv("TD_CACHE_DIR"); d && *d) return d;
  if (const char* x = std::getenv("XDG_CACHE_HOME"); x && *x)
    return std::filesystem::path(x) / "tensordict-mpi";
  if (const char* h = std::getenv("HOME"); h && *h)
    return std::filesystem::path(h) / ".cache" / "tensordict-mpi";
  return {};
}

/// Names of the tuner's files in the cache directory start with this.
inline constexpr std::string_view kCacheFilePrefix = "buckets-";

/// One cache file: "<cap> <direct_bytes>" on the first line, then "# " lines that say how and
/// where it was measured (read by people and `td-autotune show`, ignored by the tuner).
struct CacheEntry {
  std::size_t cap = 0;
  std::size_t direct_bytes = 0;
  std::vector<std::string> notes;  // without the "# "
};

/// The "# " lines left in `in`, without the "# ".
inline std::vector<std::string> read_notes(std::istream& in) {
  std::vector<std::string> notes;
  for (std::string line; std::getline(in, line);)
    if (line.rfind("# ", 0) == 0) notes.push_back(line.substr(2));
  return notes;
}

inline std::optional<CacheEntry> read_cache_entry(const std::filesystem::path& file) {
  std::ifstream in(file);
  CacheEntry e;
  if (!(in >> e.cap >> e.direct_bytes) || e.cap == 0 || e.direct_bytes == 0) return std::nullopt;
  e.notes = read_notes(in);
  return e;
}

/// Writes `first` and the "# " note lines to a temporary file next to `file` and renames it into
/// place, so that a job reading the cache never sees half a file. False if it could not.
inline bool write_entry_file(const std::filesystem::path& file, const std::string& first,
                             const std::vector<std::string>& notes, const std::string& unique) {
  std::error_code ec;
  std::filesystem::create_directories(file.parent_path(), ec);
  const std::filesystem::path tmp = file.string() + ".tmp-" + unique;
  {
    std::ofstream out(tmp);
    out << first << "\n";
    for (const auto& n : notes) out << "# " << n << "\n";
    if (!out) {
      std::filesystem::remove(tmp, ec);
      return false;
    }
  }
  std::filesystem::rename(tmp, file, ec);
  if (ec) std::filesystem::remove(tmp, ec);
  return !ec;
}

inline bool write_cache_entry(const std::filesystem::path& file, const CacheEntry& e,
                              const std::string& unique) {
  return write_entry_file(file, std::to_string(e.cap) + " " + std::to_string(e.direct_bytes),
                          e.notes, unique);
}

// ---- the messages' path across nodes (TD_HIERARCHICAL=auto) -----------------------------------

/// The message sizes timed on both paths: a bucket of the size the tuner picks across hosts
/// (256 KiB) and a large dict's message (4 MiB, the default max_message_bytes).
inline constexpr std::array<std::size_t, 2> kPathSizes = {std::size_t{256} << 10,
                                                          std::size_t{4} << 20};
/// Node-aware is chosen only when it costs this much less than flat: a tie stays flat (fewer
/// calls, no node communicators in the way).
inline constexpr double kPathMargin = 0.05;

/// One size's timings: per pass, the fastest MAX-over-ranks time (seconds) of one allreduce
/// message flat and node-aware. Every rank holds the same values.
struct PathTimings {
  std::size_t bytes = 0;
  std::vector<double> flat;
  std::vector<double> node_aware;
};

/// What a path measurement decides.
struct PathChoice {
  bool node_aware = false;
  double flat_cost = 0;  // the sum over sizes of the median time per byte
  double node_cost = 0;
  bool noisy = false;  // some pass alone would have decided the other way: do not cache
};

/// The sum over the sizes of the time per byte of one path: each size weighs the same, so a path
/// must do well on buckets and on large messages both. `pass`: that pass's times (the median of
/// every pass when none).
inline double path_cost(const std::vector<PathTimings>& t, bool node_aware,
                        std::optional<std::size_t> pass = std::nullopt) {
  double cost = 0;
  for (const PathTimings& s : t) {
    const std::vector<double>& v = node_aware ? s.node_aware : s.flat;
    const double time = !pass ? median(v) : *pass < v.size() ? v[*pass] : median(v);
    cost += time / static_cast<double>(s.bytes);
  }
  return cost;
}

/// Node-aware when its cost is below (1 - kPathMargin) of flat's; noisy when some pass's own
/// times would have chosen the other path.
inline PathChoice choose_path(const std::vector<PathTimings>& t) {
  PathChoice c;
  if (t.empty()) return c;
  c.flat_cost = path_cost(t, false);
  c.node_cost = path_cost(t, true);
  c.node_aware = c.node_cost < (1 - kPathMargin) * c.flat_cost;
  std::size_t passes = 0;
  for (const PathTimings& s : t) passes = std::max({passes, s.flat.size(), s.node_aware.size()});
  for (std::size_t p = 0; p < passes && passes > 1; ++p)
    if ((path_cost(t, true, p) < (1 - kPathMargin) * path_cost(t, false, p)) != c.node_aware)
      c.noisy = true;
  return c;
}

/// Names of the path files in the cache directory start with this.
inline constexpr std::string_view kPathFilePrefix = "paths-";

/// One path file: "node-aware" or "flat" on the first line, then "# " notes.
struct PathEntry {
  bool node_aware = false;
  std::vector<std::string> notes;  // without the "# "
};

inline std::optional<PathEntry> read_path_entry(const std::filesystem::path& file) {
  std::ifstream in(file);
  std::string first;
  if (!std::getline(in, first) || (first != "node-aware" && first != "flat")) return std::nullopt;
  PathEntry e;
  e.node_aware = first == "node-aware";
  e.notes = read_notes(in);
  return e;
}

inline bool write_path_entry(const std::filesystem::path& file, const PathEntry& e,
                             const std::string& unique) {
  return write_entry_file(file, e.node_aware ? "node-aware" : "flat", e.notes, unique);
}

}  // namespace td::detail::autotune
