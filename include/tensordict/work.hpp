// td::Work: the handle of one pending (or completed) operation, like torch's Work / async handle.
#pragma once

#include <chrono>
#include <memory>
#include <optional>
#include <vector>

#include "tensordict/export.hpp"

namespace td {

namespace detail {
class WorkState;
struct WorkAccess;
}  // namespace detail

/// Move-only handle of one operation. The operation's buffers and tensors live in it until it
/// completes; destroying a pending Work waits for it (errors are then printed, not thrown).
class TD_API Work {
 public:
  /// A completed no-op.
  Work();
  /// Waits for a pending operation (errors are printed, not thrown).
  ~Work();
  /// Takes over other's operation; `other` becomes a completed no-op.
  Work(Work&& other) noexcept;
  /// Waits for the operation this handle held, then takes over other's.
  Work& operator=(Work&& other) noexcept;
  Work(const Work&) = delete;             ///< Move-only: one handle per operation.
  Work& operator=(const Work&) = delete;  ///< Move-only: one handle per operation.

  /// Blocks until done (copying bucketed results back into the leaves); rethrows the operation's
  /// error, td::TimeoutError after the operation's timeout. Calling it again returns at once.
  void wait();
  /// Non-blocking check; finishes the operation (copy-back included) when MPI has completed it.
  bool is_completed();

 private:
  friend struct detail::WorkAccess;  // the library's operations hand out their pending states
  explicit Work(std::shared_ptr<detail::WorkState> state);
  std::shared_ptr<detail::WorkState> state_;
};

/// Waits for every Work in order; rethrows the first error after waiting for all of them.
TD_API void wait_all(std::vector<Work>& works);

/// Turns the background progress thread on or off for operations started from now on (default
/// on, or TD_PROGRESS_THREAD). With it, async collectives advance while the caller computes;
/// without it they advance only inside wait() and is_completed().
TD_API void set_async_progress(bool enabled);
/// Whether new async operations get the progress thread (needs MPI_THREAD_MULTIPLE).
TD_API bool async_progress_enabled();

}  // namespace td
