// Configuration from the environment (TD_*), read once per process. See docs/configuration.md.
#pragma once

#include <chrono>
#include <cstddef>
#include <optional>

namespace td::detail {

/// Log levels of TD_LOG_LEVEL.
enum class LogLevel { Off, Warn, Info, Debug };

/// Settings read from the environment; each is validated with a clear error.
struct Config {
  std::optional<std::chrono::milliseconds> timeout;  // TD_TIMEOUT_MS
  std::optional<std::size_t> bucket_bytes;           // TD_BUCKET_BYTES ("auto", "none" or bytes)
  bool check_layout = true;                          // TD_CHECK_LAYOUT (1/0)
  LogLevel log_level = LogLevel::Off;                // TD_LOG_LEVEL (off, warn, info, debug)
  bool progress_thread = true;                       // TD_PROGRESS_THREAD (1/0)
  bool autotune_cache = true;                        // TD_AUTOTUNE_CACHE (1/0)
  bool sync_pipeline = false;                        // TD_SYNC_PIPELINE (1/0)
  int progress_interval_us = 50;                     // TD_PROGRESS_INTERVAL_US
};

/// The process's configuration; throws std::invalid_argument naming the variable on a bad value.
const Config& config();

}  // namespace td::detail
