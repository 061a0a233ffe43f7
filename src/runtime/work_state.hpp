// A pending operation's state behind a td::Work: its requests, phases, buffers and finish step,
// and the waits that poll MPI requests against a deadline (not installed).
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include <mpi.h>

#include "core/tensor_internal.hpp"
#include "runtime/flight_recorder.hpp"
#include "tensordict/work.hpp"

namespace td::detail {

/// Keeps `p` alive for the rest of the process: memory that a request still pending after a
/// timeout or an error may read or write.
void leak(std::shared_ptr<void> p);

/// Polls `req` until it completes; throws td::TimeoutError (message from `describe`) when
/// `deadline` passes first. On timeout `buffers` (what the request touches) is deliberately
/// leaked: MPI may still write into it.
void wait_until(MPI_Request& req, std::chrono::steady_clock::time_point deadline,
                const std::function<std::string()>& describe, std::shared_ptr<void> buffers = {},
                MPI_Status* status = nullptr);

/// Throws td::Error when a completed point-to-point receive got another number of elements of
/// `type` than `expected` (MPI accepts a shorter message silently): names the operation, the
/// peer, the phase and both counts.
void check_received(const MPI_Status& status, MPI_Datatype type, int expected, int peer,
                    std::string_view what, std::string_view phase);

/// A pending operation: its MPI requests and everything they touch, and what to do once done.
class WorkState {
 public:
  /// Of the call the calling thread is in (its flight-recorder entry counts the operation).
  WorkState();
  std::vector<MPI_Request> requests;
  std::function<void()> finish;  // runs once after every request completed
  // A next phase, if any: runs (under the state's lock) once every request completed, may post
  // new requests into `requests` (the operation then waits for them, and may set `then` again)
  // or throw (the operation fails with that error; finish() does not run).
  std::function<void(WorkState&)> then;
  std::shared_ptr<Storage> buffer;          // packed bucket, if any
  std::vector<Tensor> keep_alive;           // leaves the requests read or write
  std::vector<std::shared_ptr<void>> held;  // other memory the requests touch
  std::function<std::string()> describe;    // "all_reduce of bucket 2 (float32, ...)" for errors
  std::chrono::steady_clock::time_point deadline;
  /// A point-to-point receive of the current phase whose received count is checked when the
  /// phase completes (check_received): requests[request] must bring `count` elements.
  struct ReceiveCheck {
    std::size_t request;
    MPI_Datatype type;
    int count;
    int peer;
    const char* phase;
  };
  std::vector<ReceiveCheck> receive_checks;  // cleared with `requests` at each phase
  std::string what;                          // the operation's name, for the checks' errors
  CallRef call;                              // the call it belongs to (sequence number)

  /// Tests the requests (non-blocking); runs finish() once all completed.
  bool test();
  /// Waits until done or the deadline; rethrows the error of a failed operation.
  void wait();
  /// Whether the operation can no longer touch its buffers.
  bool settled();
  /// Whether a wait() gave up on it (its buffers are leaked; nothing more to wait for).
  bool timed_out();
  /// Fails a still pending operation with `error` without waiting (its buffers are leaked: MPI
  /// may still write into them); later wait()s rethrow it. No effect on a settled operation.
  void abandon(std::exception_ptr error);
  /// Set by the progress thread when it takes the operation over: wait() then sleeps until the
  /// thread completes it instead of calling MPI from a second thread (which would only contend
  /// with the progress thread for Open MPI's locks).
  std::atomic<bool> on_progress_thread{false};
  /// Set by Work::wait() and Work::is_completed(): a Work destroyed before either was called
  /// is a dropped result (Work::~Work warns once per process).
  std::atomic<bool> observed{false};

  ~WorkState();

 private:
  enum class Status { Pending, Done, Failed };
  bool complete_locked();
  void fail_locked(std::exception_ptr error);
  void leak_buffers();  // what the requests touch, kept forever (they may still be pending)
  std::mutex mu_;
  std::condition_variable settled_cv_;
  Status status_ = Status::Pending;
  std::exception_ptr error_;
  bool timed_out_ = false;
};

/// How the library hands out a pending operation as a td::Work (whose constructor is hidden).
struct WorkAccess {
  static Work wrap(std::shared_ptr<WorkState> state) { return Work(std::move(state)); }
};

}  // namespace td::detail
