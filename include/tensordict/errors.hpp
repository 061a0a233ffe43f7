// The exception hierarchy. Every error the library throws is a td::Error (or, for bad arguments,
// std::invalid_argument), so callers can catch one base.
#pragma once

#include <stdexcept>
#include <string>

#include "tensordict/export.hpp"

namespace td {

/// Base of every error raised by tensordict-mpi.
struct TD_API Error : std::runtime_error {
  using std::runtime_error::runtime_error;
};
/// A key path that is not in the dict (the message names the full path).
struct TD_API KeyError : Error {
  using Error::Error;
};
/// An MPI routine returned an error code (the message names the routine and MPI's own text).
struct TD_API MpiError : Error {
  using Error::Error;
};
/// Ranks disagree on a collective's layout or arguments; raised on every rank, nothing moved.
struct TD_API LayoutMismatchError : Error {
  using Error::Error;
};
/// A collective did not complete within its timeout; its communicator is no longer usable.
struct TD_API TimeoutError : Error {
  using Error::Error;
};

}  // namespace td
