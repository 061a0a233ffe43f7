#include "config.hpp"

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <stdexcept>
#include <string>

#include <fmt/format.h>

#include "tensordict/collectives.hpp"

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
  if (auto v = env("TD_PROGRESS_INTERVAL_US"))
    c.progress_interval_us = static_cast<int>(std::min<std::uint64_t>(
        *v == "0" ? 0 : parse_positive("TD_PROGRESS_INTERVAL_US", *v), 1000000));
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

}  // namespace td::detail
