// The exception hierarchy. Every error the library throws is a td::Error (or, for bad arguments,
// std::invalid_argument), so callers can catch one base.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

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
/// Where one rank was when a call of its group timed out (TimeoutError::diagnosis()).
struct TD_API RankStatus {
  /// What the rank was doing when it answered (or that it did not).
  enum class State {
    InThisCall,   ///< it entered the call that timed out (and has not finished it)
    InOtherCall,  ///< it is inside another call of the library (`call` says which, on which group)
    Outside,      ///< it is outside the library: in its own code, or in MPI calls of its own
    NoAnswer      ///< it did not answer: dead, exited, unreachable, or blocked without its
                  ///< progress thread
  };
  int rank = -1;                  ///< in the group of the call that timed out
  State state = State::NoAnswer;  ///< what it was doing
  std::uint64_t seq = 0;  ///< the call it is in, or (Outside) the last it completed; 0: none
  std::string call;       ///< e.g. "TensorDict.all_reduce #42 on world ('grads.w', 73 leaves)"
  std::chrono::milliseconds since{0};  ///< how long it has been in that state
};

/// A call did not complete within its timeout; its communicator is no longer usable. The
/// message starts with the likely cause, found by asking every rank of the group where it is
/// (docs/reliability.md, "When a call times out").
struct TD_API TimeoutError : Error {
  using Error::Error;
  /// The error with its message and the answer of every rank of the group (in rank order).
  TimeoutError(const std::string& what, std::vector<RankStatus> diagnosis);
  /// One entry per rank of the call's group, in rank order; empty if unavailable (the call
  /// had no group, TD_DIAGNOSIS_MS=0, or MPI cannot be called from the timing-out thread).
  const std::vector<RankStatus>& diagnosis() const;

 private:
  std::shared_ptr<const std::vector<RankStatus>> diagnosis_;
};

}  // namespace td
