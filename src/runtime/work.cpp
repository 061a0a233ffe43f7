#include "tensordict/work.hpp"

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <mutex>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "runtime/diagnosis.hpp"
#include "runtime/log.hpp"
#include "runtime/mpi_error.hpp"
#include "runtime/progress.hpp"
#include "runtime/work_state.hpp"

namespace td {

namespace detail {

// Buffers of requests abandoned after a timeout or an error: MPI may still write into them, so
// they are never freed (the communicator is unusable after a timeout anyway). They are kept
// reachable from a process-lifetime list rather than dropped, so LeakSanitizer does not report a
// program that handled a TimeoutError (a timeout test in the suite) as leaking.
void leak(std::shared_ptr<void> p) {
  if (!p) return;
  static std::mutex mu;
  static auto* kept = new std::vector<std::shared_ptr<void>>();  // NOLINT: never freed
  std::lock_guard lock(mu);
  kept->push_back(std::move(p));
}

namespace {

// Polling loops test without pausing at first (a small collective completes within microseconds),
// then yield the core every few polls: with more ranks and threads than cores (oversubscribed
// jobs, a progress thread per rank) a rank that never yields starves the very peer it waits for.
// sched_yield returns at once when nothing else wants the core.
void pause_polling(std::uint64_t spin) {
  if (spin >= 256 && (spin & 15) == 0) std::this_thread::yield();
}
}  // namespace

void check_received(const MPI_Status& status, MPI_Datatype type, int expected, int peer,
                    std::string_view what, std::string_view phase) {
  int got = MPI_UNDEFINED;
  TD_MPI_CHECK(MPI_Get_count(&status, type, &got));
  if (got == expected) return;
  int type_size = 0;
  MPI_Type_size(type, &type_size);
  const std::string unit =
      type_size == 1 ? "bytes" : fmt::format("elements of {} bytes", type_size);
  throw Error(fmt::format(
      "{}: rank {} sent {} of the {} {} of its {} (a short message); the "
      "transfer is rejected",
      what, peer, got == MPI_UNDEFINED ? std::string("a fraction") : std::to_string(got), expected,
      unit, phase));
}

void wait_until(MPI_Request& req, std::chrono::steady_clock::time_point deadline,
                const std::function<std::string()>& describe, std::shared_ptr<void> buffers,
                MPI_Status* status) {
  const auto start = std::chrono::steady_clock::now();
  for (std::uint64_t spin = 0;; ++spin) {
    int done = 0;
    TD_MPI_CHECK(MPI_Test(&req, &done, status ? status : MPI_STATUS_IGNORE));
    if (done) return;
    pause_polling(spin);
    // Checking the clock costs more than MPI_Test's fast path; look at it every few polls.
    if ((spin & 63) == 0 && std::chrono::steady_clock::now() > deadline) {
      leak(std::move(buffers));
      const auto waited = std::chrono::duration_cast<std::chrono::milliseconds>(
          std::chrono::steady_clock::now() - start);
      throw timeout_error(
          current_call(),
          fmt::format("{} (waited {} ms); the communicator is no longer usable: end the job "
                      "(td::abort) or stop using this group",
                      describe(), waited.count()));
    }
  }
}

WorkState::WorkState() : call(current_call()) { note_work_created(call); }

bool WorkState::settled() {
  std::lock_guard lock(mu_);
  return status_ != Status::Pending;
}

bool WorkState::timed_out() {
  std::lock_guard lock(mu_);
  return timed_out_;
}

bool WorkState::complete_locked() {
  try {
    if (finish) finish();
    status_ = Status::Done;
  } catch (...) {
    error_ = std::current_exception();
    status_ = Status::Failed;
  }
  note_work_settled(call, status_ == Status::Done);
  finish = nullptr;
  buffer.reset();
  keep_alive.clear();
  held.clear();
  settled_cv_.notify_all();
  return true;
}

void WorkState::abandon(std::exception_ptr error) {
  std::lock_guard lock(mu_);
  if (status_ != Status::Pending) return;
  leak_buffers();
  then = nullptr;
  fail_locked(std::move(error));
}

void WorkState::leak_buffers() {
  leak(std::move(buffer));
  for (auto& t : keep_alive) leak(std::make_shared<Tensor>(std::move(t)));
  for (auto& h : held) leak(std::move(h));
  keep_alive.clear();
  held.clear();
}

void WorkState::fail_locked(std::exception_ptr error) {
  // A phase that failed part-way (its next phase threw after posting some requests) may leave
  // requests pending: MPI may still read or write what they touch, so it is never freed.
  if (std::any_of(requests.begin(), requests.end(),
                  [](MPI_Request r) { return r != MPI_REQUEST_NULL; }))
    leak_buffers();
  error_ = std::move(error);
  status_ = Status::Failed;
  note_work_settled(call, false);
  finish = nullptr;
  settled_cv_.notify_all();
}

bool WorkState::test() {
  std::lock_guard lock(mu_);
  if (status_ != Status::Pending) return true;
  if (timed_out_) return false;
  int done = 0;
  std::vector<MPI_Status> statuses(receive_checks.empty() ? 0 : requests.size());
  const int rc = requests.empty()
                     ? MPI_SUCCESS
                     : MPI_Testall(static_cast<int>(requests.size()), requests.data(), &done,
                                   statuses.empty() ? MPI_STATUSES_IGNORE : statuses.data());
  if (requests.empty()) done = 1;
  if (rc != MPI_SUCCESS) {
    try {
      throw_mpi_error("MPI_Testall", rc);
    } catch (...) {
      fail_locked(std::current_exception());
    }
    return true;
  }
  if (!done) return false;
  if (!receive_checks.empty()) {
    try {
      for (const ReceiveCheck& c : receive_checks)
        check_received(statuses[c.request], c.type, c.count, c.peer, what, c.phase);
    } catch (...) {
      receive_checks.clear();
      fail_locked(std::current_exception());
      return true;
    }
    receive_checks.clear();
  }
  if (then) {
    auto next = std::move(then);
    then = nullptr;
    requests.clear();
    try {
      next(*this);
    } catch (...) {
      fail_locked(std::current_exception());
      return true;
    }
    if (!requests.empty() || then) return false;  // the next test() looks at the new phase
  }
  return complete_locked();
}

void WorkState::wait() {
  const auto start = std::chrono::steady_clock::now();
  // Called with mu_ held: marks the operation timed out and gives the message. The error itself
  // (which asks every rank where it is: up to TD_DIAGNOSIS_MS) is made after the lock is let go,
  // so the progress thread is not held up meanwhile.
  auto timeout_message = [&] {
    timed_out_ = true;
    const auto waited = std::chrono::duration_cast<std::chrono::milliseconds>(
        std::chrono::steady_clock::now() - start);
    return fmt::format(
        "{} did not complete before its timeout (waited {} ms in wait()); the communicator is "
        "no longer usable: end the job (td::abort) or stop using this group",
        describe ? describe() : std::string("operation"), waited.count());
  };
  std::string timed_out;
  if (on_progress_thread.load(std::memory_order_acquire)) {
    // The progress thread drives it: sleep until it has settled, and let the thread know that
    // someone waits (it then polls without pausing).
    progress_waiter(+1);
    struct Unregister {
      ~Unregister() { progress_waiter(-1); }
    } unregister;
    {
      std::unique_lock lock(mu_);
      while (status_ == Status::Pending && timed_out.empty()) {
        if (settled_cv_.wait_until(lock, deadline) == std::cv_status::timeout &&
            status_ == Status::Pending)
          timed_out = timeout_message();
      }
      if (timed_out.empty()) {
        if (status_ == Status::Failed) std::rethrow_exception(error_);
        return;
      }
    }
    throw timeout_error(call, timed_out);
  }
  for (std::uint64_t spin = 0; !test(); ++spin) {
    progress_others(this);
    pause_polling(spin);
    if ((spin & 63) == 0 && std::chrono::steady_clock::now() > deadline) {
      {
        std::lock_guard lock(mu_);
        timed_out = timeout_message();
      }
      throw timeout_error(call, timed_out);
    }
  }
  std::lock_guard lock(mu_);
  if (status_ == Status::Failed) std::rethrow_exception(error_);
}

WorkState::~WorkState() {
  if (status_ == Status::Pending) leak_buffers();
}

}  // namespace detail

Work::Work() = default;
Work::Work(std::shared_ptr<detail::WorkState> state) : state_(std::move(state)) {}
Work::Work(Work&& other) noexcept = default;
Work& Work::operator=(Work&& other) noexcept {
  if (this != &other) {
    Work old(std::move(*this));  // waits for what this handle held
    state_ = std::move(other.state_);
  }
  return *this;
}

namespace {
// An async call's Works thrown away unwaited (`d.all_reduce(op, {.async_op = true});` as a
// statement): the destructor then blocks, so the call is silently sync, and an error of the
// operation would go unseen. Said once per process, whatever TD_LOG_LEVEL.
void warn_dropped(detail::WorkState& st) {
  static std::atomic<bool> said{false};
  if (said.exchange(true)) return;
  detail::log_line(
      detail::LogLevel::Warn,
      fmt::format("a td::Work ({}) was destroyed before wait() or is_completed() was called on "
                  "it: its destructor waits for the operation, so the call did not overlap "
                  "anything, and its errors are only printed. Keep the Works an async call "
                  "returns and call td::wait_all() on them (said once per process)",
                  st.describe ? st.describe() : std::string("an operation")));
}
}  // namespace

Work::~Work() {
  if (!state_) return;
  const bool dropped = !state_->observed.load(std::memory_order_relaxed);
  if (dropped) warn_dropped(*state_);
  // A timed-out operation was already reported by wait(); its buffers are leaked on purpose. A
  // settled one that was waited for has nothing left to report.
  if (state_->timed_out() || (state_->settled() && !dropped)) return;
  try {
    state_->wait();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "[td] a td::Work was destroyed and its operation failed: %s\n", e.what());
  }
}

void Work::wait() {
  if (!state_) return;
  state_->observed.store(true, std::memory_order_relaxed);
  state_->wait();
}

bool Work::is_completed() {
  if (!state_) return true;
  state_->observed.store(true, std::memory_order_relaxed);
  if (state_->test()) return true;
  if (!state_->on_progress_thread.load(std::memory_order_acquire))
    detail::progress_others(state_.get());
  return false;
}

void wait_all(std::vector<Work>& works) {
  std::exception_ptr first;
  for (auto& w : works) {
    try {
      w.wait();
    } catch (...) {
      if (!first) first = std::current_exception();
    }
  }
  if (first) std::rethrow_exception(first);
}

}  // namespace td
