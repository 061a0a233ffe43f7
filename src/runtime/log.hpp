// Rank-prefixed logging to stderr, off unless TD_LOG_LEVEL asks for it.
#pragma once

#include <string>
#include <utility>

#include "core/config.hpp"

namespace td::detail {

/// Writes "[td rank R level] message" to stderr (R: the rank in MPI_COMM_WORLD).
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

/// Logs at info level on rank 0 of a group only: for what every rank of a collective knows alike
/// (the tuned bucket size), which would otherwise be printed once per rank.
template <class F>
void log_info_once(int group_rank, F&& make) {
  if (group_rank == 0) log_info(std::forward<F>(make));
}

}  // namespace td::detail
