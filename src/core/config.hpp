// Configuration from the environment (TD_*), read once per process. See docs/configuration.md.
#pragma once

#include <chrono>
#include <cstddef>
#include <optional>
#include <string>
#include <vector>

namespace td::detail {

/// Log levels of TD_LOG_LEVEL.
enum class LogLevel { Off, Warn, Info, Debug };

/// Settings read from the environment; each is validated with a clear error.
struct Config {
  std::optional<std::chrono::milliseconds> timeout;  // TD_TIMEOUT_MS
  std::optional<std::size_t> bucket_bytes;           // TD_BUCKET_BYTES ("auto", "none" or bytes)
  bool check_layout = true;                          // TD_CHECK_LAYOUT (1/0)
  LogLevel log_level = LogLevel::Off;                // TD_LOG_LEVEL (off, warn, info, debug)
  std::optional<bool> progress_thread;  // TD_PROGRESS_THREAD (1/0); unset: on unless across hosts
  bool autotune_cache = true;           // TD_AUTOTUNE_CACHE (1/0)
  bool autotune_refresh = false;        // TD_AUTOTUNE_REFRESH (1/0), rank 0's counts
  std::chrono::milliseconds autotune_budget{1000};  // TD_AUTOTUNE_BUDGET_MS
  bool sync_pipeline = false;                       // TD_SYNC_PIPELINE (1/0)
  int progress_interval_us = 50;                    // TD_PROGRESS_INTERVAL_US
  // TD_MALLOC_MMAP_THRESHOLD (bytes, or "off" = 0): glibc's mmap threshold set at init; the trim
  // threshold becomes 4x that. See apply_malloc_tuning().
  std::size_t malloc_mmap_threshold = std::size_t{64} << 20;
  bool tune_mpi = true;   // TD_TUNE_MPI (1/0): tune_libnbc_before_init()
  bool hugepages = true;  // TD_HUGEPAGES (1/0): storages of 2 MiB or more on transparent huge pages
  std::size_t flight_recorder = 1024;  // TD_FLIGHT_RECORDER: calls kept in the ring (0: none)
  std::string flight_recorder_dir;     // TD_FLIGHT_RECORDER_DIR: where dumps go ("": none)
  std::chrono::milliseconds diagnosis{2000};  // TD_DIAGNOSIS_MS: wait for answers (0: no diagnosis)
  // TD_HIERARCHICAL: 0 flat, 1 node-aware, 2 "auto" (unset: on a group spanning several nodes
  // with more than one of its ranks on some node, the path its first all_reduce / reduce /
  // broadcast measured faster, cached like the bucket size), 3 "leaders" (node-aware through the
  // nodes' first ranks only: no per-slice stages)
  int hierarchical = 2;
  // TD_TEST_RANKS_PER_NODE (for tests only): "3,1" puts world ranks 0-2 on one simulated node and
  // every further rank on a node of its own (the last size repeats); empty: the real nodes.
  std::vector<int> test_node_sizes;
  // TD_TEST_IO_ROUND_BYTES (for tests only): the bytes one rank moves per collective MPI-IO call
  // (0: 512 MiB), so that tests cross the rounds' boundaries with small files.
  std::uint64_t test_io_round_bytes = 0;
};

/// What init_process_group did to glibc's allocator, for logs and the autotune cache key.
struct MallocTuning {
  std::size_t mmap_threshold = 0;  // 0: left alone
  std::size_t trim_threshold = 0;
  std::string reason;  // why it was left alone, if it was
};

/// Sets glibc's M_MMAP_THRESHOLD and M_TRIM_THRESHOLD from TD_MALLOC_MMAP_THRESHOLD unless the user
/// tuned malloc through its own environment variables; idempotent (the first call decides).
const MallocTuning& apply_malloc_tuning();

/// The process's configuration; throws std::invalid_argument naming the variable on a bad value.
const Config& config();

}  // namespace td::detail
