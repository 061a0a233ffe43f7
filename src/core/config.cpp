#include "core/config.hpp"

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <limits>
#include <stdexcept>
#include <string>

#include <fmt/format.h>

#if defined(__GLIBC__)
#include <malloc.h>
#endif

#include "tensordict/bucket_bytes.hpp"

namespace td::detail {

namespace {

std::optional<std::string> env(const char* name) {
  const char* v = std::getenv(name);
  if (!v || !*v) return std::nullopt;
  return std::string(v);
}

std::uint64_t parse_positive(const char* var, const std::string& text) {
  errno = 0;
  char* end = nullptr;
  const unsigned long long v = std::strtoull(text.c_str(), &end, 10);
  if (errno != 0 || end == text.c_str() || *end != '\0' || v == 0 || text[0] == '-')
    throw std::invalid_argument(fmt::format("{}={}: expected a positive integer", var, text));
  return v;
}

bool parse_bool(const char* var, const std::string& text) {
  if (text == "1" || text == "true" || text == "on" || text == "yes") return true;
  if (text == "0" || text == "false" || text == "off" || text == "no") return false;
  throw std::invalid_argument(
      fmt::format("{}={}: expected 1 or 0 (true/false, on/off)", var, text));
}

Config read() {
  Config c;
  if (auto v = env("TD_TIMEOUT_MS"))
    c.timeout = std::chrono::milliseconds(parse_positive("TD_TIMEOUT_MS", *v));
  if (auto v = env("TD_BUCKET_BYTES")) {
    if (*v == "auto") {
      c.bucket_bytes = kAutoBucketBytes;
    } else if (*v == "none") {
      c.bucket_bytes.reset();  // the default: one collective per leaf
    } else {
      c.bucket_bytes = parse_positive("TD_BUCKET_BYTES", *v);
    }
  }
  if (auto v = env("TD_CHECK_LAYOUT")) c.check_layout = parse_bool("TD_CHECK_LAYOUT", *v);
  if (auto v = env("TD_PROGRESS_THREAD")) c.progress_thread = parse_bool("TD_PROGRESS_THREAD", *v);
  if (auto v = env("TD_SYNC_PIPELINE")) c.sync_pipeline = parse_bool("TD_SYNC_PIPELINE", *v);
  if (auto v = env("TD_AUTOTUNE_CACHE")) c.autotune_cache = parse_bool("TD_AUTOTUNE_CACHE", *v);
  if (auto v = env("TD_AUTOTUNE_REFRESH"))
    c.autotune_refresh = parse_bool("TD_AUTOTUNE_REFRESH", *v);
  if (auto v = env("TD_AUTOTUNE_BUDGET_MS"))
    c.autotune_budget = std::chrono::milliseconds(parse_positive("TD_AUTOTUNE_BUDGET_MS", *v));
  if (auto v = env("TD_PROGRESS_INTERVAL_US"))
    c.progress_interval_us = static_cast<int>(std::min<std::uint64_t>(
        *v == "0" ? 0 : parse_positive("TD_PROGRESS_INTERVAL_US", *v), 1000000));
  if (auto v = env("TD_MALLOC_MMAP_THRESHOLD"))
    c.malloc_mmap_threshold =
        (*v == "off" || *v == "0") ? 0 : parse_positive("TD_MALLOC_MMAP_THRESHOLD", *v);
  if (auto v = env("TD_TUNE_MPI")) c.tune_mpi = parse_bool("TD_TUNE_MPI", *v);
  if (auto v = env("TD_HUGEPAGES")) c.hugepages = parse_bool("TD_HUGEPAGES", *v);
  if (auto v = env("TD_FLIGHT_RECORDER"))
    c.flight_recorder = *v == "0" ? 0
                                  : static_cast<std::size_t>(std::min<std::uint64_t>(
                                        parse_positive("TD_FLIGHT_RECORDER", *v), 1u << 24));
  if (auto v = env("TD_FLIGHT_RECORDER_DIR")) c.flight_recorder_dir = *v;
  if (auto v = env("TD_DIAGNOSIS_MS"))
    c.diagnosis = std::chrono::milliseconds(*v == "0" ? 0 : parse_positive("TD_DIAGNOSIS_MS", *v));
  if (auto v = env("TD_HIERARCHICAL")) {
    if (*v == "auto") {
      c.hierarchical = 2;
    } else if (*v == "leaders") {
      c.hierarchical = 3;
    } else {
      try {
        c.hierarchical = parse_bool("TD_HIERARCHICAL", *v) ? 1 : 0;
      } catch (const std::invalid_argument&) {
        throw std::invalid_argument(
            fmt::format("TD_HIERARCHICAL={}: expected 1, 0, auto or leaders", *v));
      }
    }
  }
  if (auto v = env("TD_TEST_RANKS_PER_NODE")) {
    std::size_t start = 0;
    for (;;) {
      const std::size_t comma = v->find(',', start);
      const std::string part = v->substr(start, comma - start);
      c.test_node_sizes.push_back(static_cast<int>(
          std::min<std::uint64_t>(parse_positive("TD_TEST_RANKS_PER_NODE", part), 1u << 20)));
      if (comma == std::string::npos) break;
      start = comma + 1;
    }
  }
  if (auto v = env("TD_TEST_IO_ROUND_BYTES"))
    c.test_io_round_bytes = std::min<std::uint64_t>(parse_positive("TD_TEST_IO_ROUND_BYTES", *v),
                                                    std::uint64_t{512} << 20);
  if (auto v = env("TD_LOG_LEVEL")) {
    if (*v == "off") {
      c.log_level = LogLevel::Off;
    } else if (*v == "warn") {
      c.log_level = LogLevel::Warn;
    } else if (*v == "info") {
      c.log_level = LogLevel::Info;
    } else if (*v == "debug") {
      c.log_level = LogLevel::Debug;
    } else {
      throw std::invalid_argument(
          fmt::format("TD_LOG_LEVEL={}: expected off, warn, info or debug", *v));
    }
  }
  return c;
}

}  // namespace

const Config& config() {
  static const Config c = read();
  return c;
}

// Why: MPI libraries allocate a temporary buffer per large collective (Open MPI's tuned allreduce
// and every libnbc MPI_Iallreduce), with malloc. glibc serves allocations above its mmap threshold
// (128 KiB, rising dynamically to at most 32 MiB) with a fresh mmap, and trims freed memory at the
// top of the heap past the trim threshold, so such buffers are new pages on every call. Each page
// then costs a page fault, which in a virtual machine is measured at several microseconds: a
// 32 MiB MPI_Allreduce ran 20x slower than two of 16 MiB, and an async all_reduce of 27 MB with
// some 30 requests in flight 10x slower than the blocking one. With the thresholds raised, the
// buffers are recycled from the heap. docs/configuration.md has the figures and the trade-off
// (up to 4x the threshold of freed memory is kept by the process rather than returned).
const MallocTuning& apply_malloc_tuning() {
  static const MallocTuning t = [] {
    MallocTuning r;
    const std::size_t want = config().malloc_mmap_threshold;
    if (want == 0) {
      r.reason = "TD_MALLOC_MMAP_THRESHOLD=off";
      return r;
    }
#if defined(__GLIBC__)
    for (const char* var :
         {"MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_"}) {
      if (env(var)) {
        r.reason = fmt::format("{} is set", var);
        return r;
      }
    }
    if (auto tun = env("GLIBC_TUNABLES");
        tun && (tun->find("malloc.mmap_threshold") != std::string::npos ||
                tun->find("malloc.trim_threshold") != std::string::npos)) {
      r.reason = "GLIBC_TUNABLES sets a malloc threshold";
      return r;
    }
    // mallopt takes an int; glibc caps the mmap threshold at 32 MiB only in its dynamic mode.
    const auto clamp_int = [](std::size_t v) {
      return static_cast<int>(std::min<std::size_t>(v, std::numeric_limits<int>::max()));
    };
    const int mmap_t = clamp_int(want);
    const int trim_t = clamp_int(want * 4);
    if (mallopt(M_MMAP_THRESHOLD, mmap_t) == 1 && mallopt(M_TRIM_THRESHOLD, trim_t) == 1) {
      r.mmap_threshold = static_cast<std::size_t>(mmap_t);
      r.trim_threshold = static_cast<std::size_t>(trim_t);
    } else {
      r.reason = fmt::format("mallopt rejected an mmap threshold of {} bytes", want);
    }
#else
    r.reason = "not glibc";
#endif
    return r;
  }();
  return t;
}

}  // namespace td::detail
