// The progress thread and manual progress of pending operations (not installed).
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace td::detail {

class WorkState;  // work_state.hpp

/// Hands a pending operation to the progress thread (started on first use when MPI runs with
/// MPI_THREAD_MULTIPLE and TD_PROGRESS_THREAD is not 0), which tests it until it completes so the
/// communication advances while the caller computes. Without the thread, wait() and
/// is_completed() drive progress.
void progress_add(const std::shared_ptr<WorkState>& work);
/// progress_add for several operations at once (started together: hand them over once all are
/// started, so the thread does not contend with the starting thread for MPI's locks).
void progress_add(const std::vector<std::shared_ptr<WorkState>>& works);
/// Who drives an operation: the progress thread, or waits (without the thread).
enum class ProgressMode { Thread, Manual };
/// progress_add with the mode decided by the caller (the Reducer decides once per step, so that
/// set_async_progress toggled mid-step cannot split one step's buckets between the two).
void progress_add(const std::vector<std::shared_ptr<WorkState>>& works, ProgressMode mode);
/// Without the progress thread: tests every other pending phased operation handed to
/// progress_add (wait() and is_completed() call it, as MPI's waits progress every request).
void progress_others(const WorkState* except);
/// Stops and joins the progress thread (before MPI_Finalize).
void progress_stop();
/// destroy_process_group: waits for every pending operation handed to progress_add (each until
/// its own deadline), then fails those still pending with td::Error naming `why`, so that their
/// Works' destructors return at once and nothing calls MPI after MPI_Finalize.
void progress_settle_all(const std::string& why);
/// Registers a thread blocked in wait() on an operation the progress thread drives; while there
/// is one, the thread polls without sleeping between rounds.
void progress_waiter(int delta);

/// Whether the progress thread runs by default (defined in process_group.cpp): from the world's
/// size, the ranks on this host, MPI_Get_library_version's text and TD_PROGRESS_THREAD (off
/// across hosts under Open MPI before 5, whose TCP path stalls with two threads in MPI).
bool progress_thread_on(int world_size, int ranks_on_host, std::string_view library_version,
                        std::optional<bool> setting);
/// Sets whether async operations get the progress thread, unless TD_PROGRESS_THREAD or
/// td::set_async_progress() already decided it; true if this call decided it.
bool progress_thread_default(bool on);

}  // namespace td::detail
