// Rank-prefixed logging to stderr, off unless TD_LOG_LEVEL asks for it.
#pragma once

#include <string>

#include "config.hpp"

namespace td::detail {

/// Writes "[td rank R] message" to stderr.
void log_line(LogLevel level, const std::string& message);

/// Logs the message `make()` returns at debug level; make() only runs when debug is on.
template <class F>
void log_debug(F&& make) {
  if (config().log_level >= LogLevel::Debug) log_line(LogLevel::Debug, make());
}

/// Logs at warn level.
template <class F>
void log_warn(F&& make) {
  if (config().log_level >= LogLevel::Warn) log_line(LogLevel::Warn, make());
}

/// Logs at info level.
template <class F>
void log_info(F&& make) {
  if (config().log_level >= LogLevel::Info) log_line(LogLevel::Info, make());
}

}  // namespace td::detail
