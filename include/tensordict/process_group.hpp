// Process groups: who takes part in a collective. init_process_group / world / new_group mirror
// torch.distributed; a ProcessGroup owns a duplicated MPI communicator.
#pragma once

#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <mpi.h>

#include "tensordict/export.hpp"

namespace td {

namespace detail {
struct GroupState;
struct GroupAccess;
}  // namespace detail

/// A set of ranks with its own MPI communicator (a duplicate, so our traffic never matches the
/// caller's). Copies share the communicator; it is freed when the last copy goes, unless MPI has
/// already been finalized.
class TD_API ProcessGroup {
 public:
  /// This process's rank in the group, or -1 when it is not a member.
  int rank() const;
  /// Number of ranks in the group.
  int size() const;
  /// The group's communicator (MPI_COMM_NULL on non-members).
  MPI_Comm comm() const;
  /// Whether this process belongs to the group.
  bool is_member() const;
  /// The world ranks of the members, in group-rank order.
  const std::vector<int>& world_ranks() const;
  /// Whether both handles refer to the same group.
  friend bool operator==(const ProcessGroup& a, const ProcessGroup& b) {
    return a.state_ == b.state_;
  }

 private:
  friend struct detail::GroupAccess;  // the library's runtime makes groups and reads their state
  explicit ProcessGroup(std::shared_ptr<detail::GroupState> state);
  std::shared_ptr<detail::GroupState> state_;
};

/// Options of init_process_group.
struct InitOptions {
  /// Default timeout of every collective's rendezvous (overridden by TD_TIMEOUT_MS, then per call).
  std::chrono::milliseconds timeout{std::chrono::minutes(30)};
  /// Install a std::terminate handler that prints the uncaught exception with this rank's number
  /// and calls MPI_Abort, so one rank's exception ends the whole job instead of hanging the others.
  bool abort_on_uncaught_exception = true;
};

/// Initialises MPI (MPI_THREAD_MULTIPLE) unless the caller already did; idempotent.
TD_API void init_process_group(const InitOptions& options = {});
/// Initialises MPI with the program's arguments unless the caller already did; idempotent.
TD_API void init_process_group(int& argc, char**& argv, const InitOptions& options = {});
/// Frees the groups' state and finalizes MPI if (and only if) init_process_group initialised it;
/// throws td::MpiError if MPI_Finalize fails.
TD_API void destroy_process_group();
/// Whether init_process_group has run (and destroy_process_group has not).
TD_API bool is_initialized();
/// The group of every process; throws td::Error before init_process_group.
TD_API ProcessGroup world();
/// A group of the given world ranks; must be called by every world rank (non-members get a group
/// whose collectives throw std::invalid_argument).
TD_API ProcessGroup new_group(const std::vector<int>& world_ranks);
/// This process's rank in the world group.
TD_API int get_rank();
/// Number of processes in the world group.
TD_API int get_world_size();
/// Blocks until every rank of the group (default: world) has entered; honours the timeout.
TD_API void barrier(const std::optional<ProcessGroup>& group = {});
/// The default timeout set by init_process_group (or TD_TIMEOUT_MS).
TD_API std::chrono::milliseconds default_timeout();
/// Prints `message` to stderr with this rank's number, then ends every rank of the job (MPI_Abort).
[[noreturn]] TD_API void abort(const std::string& message, int exit_code = 1);

}  // namespace td
