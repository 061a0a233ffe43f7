// Deadlines and the watchdog of blocking MPI calls.
//
// A collective polls its agreement against its deadline, and async Works are polled by wait(),
// but the data phase of a sync collective is one blocking MPI call (MPI_Allreduce, MPI_Bcast,
// ...): the fastest form Open MPI has, and one no timeout can interrupt. When a peer is lost in
// the middle of such a call, the surviving ranks would block forever. The watchdog turns that
// into a bounded failure: it prints which collective stalled, as a timeout, and ends the job
// (td::abort), like PyTorch's NCCL watchdog. A communicator in that state is unusable anyway.
#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "runtime/deadline.hpp"
#include "runtime/diagnosis.hpp"
#include "runtime/work_state.hpp"
#include "tensordict/process_group.hpp"

namespace td::detail {

namespace {

using Clock = std::chrono::steady_clock;

// Far enough to mean "never", near enough that adding it to now() or converting it to another
// clock cannot overflow.
constexpr std::chrono::hours kNever{24 * 365 * 100};
// How often the watchdog thread looks at the armed calls (it sleeps otherwise).
constexpr std::chrono::milliseconds kPoll{200};

class Watchdog {
 public:
  std::uint64_t arm(Clock::time_point deadline, const std::function<std::string()>* describe,
                    const CallRef& call) {
    std::lock_guard lock(mu_);
    if (!thread_.joinable()) thread_ = std::thread([this] { loop(); });
    const std::uint64_t id = next_id_++;
    // No notify: the thread looks again within kPoll anyway, and waking it on every call would
    // cost a context switch per collective on a machine whose cores MPI is using.
    active_.push_back({id, deadline, describe, call});
    return id;
  }

  void disarm(std::uint64_t id) {
    std::lock_guard lock(mu_);
    std::erase_if(active_, [id](const Entry& e) { return e.id == id; });
  }

  ~Watchdog() {
    {
      std::lock_guard lock(mu_);
      stopping_ = true;
      cv_.notify_one();
    }
    if (thread_.joinable()) thread_.join();
  }

 private:
  struct Entry {
    std::uint64_t id;
    Clock::time_point deadline;
    const std::function<std::string()>* describe;
    CallRef call;  // of the blocked thread, for the diagnosis
  };

  void loop() {
    std::unique_lock lock(mu_);
    for (;;) {
      if (stopping_) return;
      const auto now = Clock::now();
      if (active_.empty()) {
        cv_.wait_until(lock, now + kPoll);
        continue;
      }
      const auto first =
          std::min_element(active_.begin(), active_.end(),
                           [](const Entry& a, const Entry& b) { return a.deadline < b.deadline; });
      if (now < first->deadline) {
        // A call armed meanwhile is seen within kPoll: that bounds how late the watchdog can
        // be, without a notify per call.
        cv_.wait_until(lock, std::min(first->deadline, now + kPoll));
        continue;
      }
      // The caller is still blocked inside MPI (its entry is still armed, and describe() lives
      // in its frame until it disarms under this lock).
      const std::string what = (*first->describe)();
      const CallRef call = first->call;
      // The diagnosis asks the other ranks (up to TD_DIAGNOSIS_MS) without this lock: the
      // blocked thread stays blocked either way, others may arm and disarm meanwhile.
      lock.unlock();
      end_job(what, diagnosis_report(call));
    }
  }

  [[noreturn]] static void end_job(const std::string& what, const std::string& diagnosis) {
    // MPI_Abort normally ends every process of the job; if it cannot (the peer that broke the
    // collective may also be the one that cannot be reached), end this process regardless.
    std::thread([] {
      std::this_thread::sleep_for(std::chrono::seconds(10));
      // Said, so that this way out is not a silent one (issue 32).
      std::fputs("[td] the watchdog's MPI_Abort did not end the job within 10 s: exiting\n",
                 stderr);
      std::_Exit(1);
    }).detach();
    td::abort(fmt::format("td::TimeoutError: {} did not complete before its timeout, inside a "
                          "blocking MPI call that cannot be interrupted (a peer lost or stalled "
                          "in the data phase); the watchdog ends the job{}{}",
                          what, diagnosis.empty() ? "" : ". ", diagnosis),
              1);
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<Entry> active_;
  std::thread thread_;
  std::uint64_t next_id_ = 1;
  bool stopping_ = false;
};

Watchdog& watchdog() {
  static Watchdog w;
  return w;
}

}  // namespace

Clock::time_point deadline_after(std::chrono::milliseconds timeout) {
  const auto now = Clock::now();
  if (timeout >= kNever) return now + kNever;
  return now + std::max(timeout, std::chrono::milliseconds(0));
}

bool is_unbounded(Clock::time_point deadline) { return deadline - Clock::now() > kNever / 2; }

BlockingPhase::BlockingPhase(Clock::time_point deadline,
                             const std::function<std::string()>& describe) {
  if (!is_unbounded(deadline)) id_ = watchdog().arm(deadline, &describe, current_call());
}

BlockingPhase::~BlockingPhase() {
  if (id_ != 0) watchdog().disarm(id_);
}

}  // namespace td::detail
