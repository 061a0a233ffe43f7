// The progress thread. Open MPI advances a nonblocking collective only inside MPI calls made by
// the process; without them an MPI_Iallreduce started before a long computation does nothing
// until wait(). This thread tests the pending operations every few tens of microseconds (sleeping
// in between, so it costs the caller's computation little CPU) and sleeps on a condition
// variable when nothing is pending.
#include <atomic>
#include <condition_variable>
#include <mutex>
#include <span>
#include <thread>

#ifdef __linux__
#include <sys/prctl.h>
#endif

#include <fmt/format.h>

#include "core/config.hpp"
#include "runtime/log.hpp"
#include "runtime/progress.hpp"
#include "runtime/work_state.hpp"
#include "tensordict/errors.hpp"

namespace td::detail {

namespace {

class ProgressEngine {
 public:
  void add(std::span<const std::shared_ptr<WorkState>> works) {
    if (works.empty()) return;
    std::lock_guard lock(mu_);
    if (!started_) {
      stopping_ = false;
      thread_ = std::thread([this] { loop(); });
      started_ = true;
    }
    for (const auto& w : works) {
      w->on_progress_thread.store(true, std::memory_order_release);
      pending_.push_back(w);
    }
    cv_.notify_one();
  }

  void stop() {
    {
      std::lock_guard lock(mu_);
      if (!started_) return;
      stopping_ = true;
      cv_.notify_one();
    }
    thread_.join();
    std::lock_guard lock(mu_);
    started_ = false;
    pending_.clear();
  }

  ~ProgressEngine() {
    if (thread_.joinable()) {
      {
        std::lock_guard lock(mu_);
        stopping_ = true;
        cv_.notify_one();
      }
      thread_.join();
    }
  }

 private:
  void loop() {
    const auto interval = std::chrono::microseconds(config().progress_interval_us);
#ifdef __linux__
    // Linux lets a sleep run up to 50 us late by default (timer slack), which would double a
    // 50 us polling interval; this thread's sleeps should be as short as asked.
    prctl(PR_SET_TIMERSLACK, 1UL, 0UL, 0UL, 0UL);
#endif
    std::vector<std::shared_ptr<WorkState>> batch;
    for (;;) {
      {
        std::unique_lock lock(mu_);
        cv_.wait(lock, [&] { return stopping_ || !pending_.empty(); });
        if (stopping_) return;
        batch.clear();
        std::erase_if(pending_, [](const std::weak_ptr<WorkState>& w) { return w.expired(); });
        for (auto& w : pending_)
          if (auto s = w.lock()) batch.push_back(std::move(s));
      }
      for (auto& s : batch) s->test();
      {
        std::lock_guard lock(mu_);
        std::erase_if(pending_, [](const std::weak_ptr<WorkState>& w) {
          auto s = w.lock();
          return !s || s->settled();
        });
      }
      batch.clear();  // never keep a Work's state alive from here
      if (interval.count() == 0 || waiters_.load(std::memory_order_relaxed) > 0) {
        std::this_thread::yield();
      } else {
        std::this_thread::sleep_for(interval);
      }
    }
  }

  friend void td::detail::progress_waiter(int delta);
  std::atomic<int> waiters_{0};  // threads blocked in wait() on an operation of this thread
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<std::weak_ptr<WorkState>> pending_;
  std::thread thread_;
  bool started_ = false;
  bool stopping_ = false;
};

std::atomic<int> g_enabled{-1};  // -1: not decided yet (TD_PROGRESS_THREAD decides)

ProgressEngine& engine() {
  static ProgressEngine e;
  return e;
}

}  // namespace

// Without the thread: operations that run in phases (a transfer's handshake, then its data) post
// their next phase only when they are tested, so waiting on one of them must test the others too,
// or two ranks each wait on a transfer that only the other's test would advance (a ring of async
// send/recv: rank A waits on its send while B waits on its own). MPI's own waits progress every
// request of the process; these are the operations MPI cannot progress by itself.
class ManualProgress {
 public:
  void add(std::span<const std::shared_ptr<WorkState>> works) {
    std::lock_guard lock(mu_);
    for (const auto& w : works)
      if (w->then) pending_.push_back(w);
  }
  void run(const WorkState* except) {
    std::vector<std::shared_ptr<WorkState>> batch;
    {
      std::lock_guard lock(mu_);
      if (pending_.empty()) return;
      std::erase_if(pending_, [&](const std::weak_ptr<WorkState>& w) {
        auto s = w.lock();
        if (!s || s->settled() || s->timed_out()) return true;
        if (s.get() != except) batch.push_back(std::move(s));
        return false;
      });
    }
    for (auto& s : batch) s->test();
  }

 private:
  std::mutex mu_;
  std::vector<std::weak_ptr<WorkState>> pending_;
};

ManualProgress& manual() {
  static ManualProgress m;
  return m;
}

namespace {
// Every operation handed over and not yet known to be settled, whichever mode drives it, for
// destroy_process_group to settle.
struct LiveWorks {
  std::mutex mu;
  std::vector<std::weak_ptr<WorkState>> works;
};
LiveWorks& live() {
  static LiveWorks l;
  return l;
}

void add_pending(std::span<const std::shared_ptr<WorkState>> works, bool on_thread) {
  {
    LiveWorks& l = live();
    std::lock_guard lock(l.mu);
    // Pruned as it grows: amortised O(1) per added operation.
    if (l.works.size() >= 64 && l.works.size() % 64 == 0)
      std::erase_if(l.works, [](const std::weak_ptr<WorkState>& w) {
        auto s = w.lock();
        return !s || s->settled();
      });
    l.works.insert(l.works.end(), works.begin(), works.end());
  }
  if (on_thread) {
    engine().add(works);
  } else {
    manual().add(works);
  }
}
}  // namespace

void progress_settle_all(const std::string& why) {
  std::vector<std::shared_ptr<WorkState>> pending;
  {
    LiveWorks& l = live();
    std::lock_guard lock(l.mu);
    for (auto& w : l.works)
      if (auto s = w.lock(); s && !s->settled()) pending.push_back(std::move(s));
    l.works.clear();
  }
  for (auto& s : pending) {
    try {
      s->wait();     // until its own deadline; the progress thread, if any, still runs
    } catch (...) {  // NOLINT(bugprone-empty-catch): the error stays in the state for wait()
    }
    s->abandon(std::make_exception_ptr(Error(fmt::format(
        "{}: {}", why, s->describe ? s->describe() : std::string("a pending operation")))));
  }
}

void progress_add(const std::shared_ptr<WorkState>& work) {
  add_pending(std::span<const std::shared_ptr<WorkState>>(&work, 1), async_progress_enabled());
}
void progress_add(const std::vector<std::shared_ptr<WorkState>>& works) {
  add_pending(works, async_progress_enabled());
}
void progress_add(const std::vector<std::shared_ptr<WorkState>>& works, ProgressMode mode) {
  add_pending(works, mode == ProgressMode::Thread);
}
void progress_others(const WorkState* except) { manual().run(except); }
void progress_stop() { engine().stop(); }
void progress_waiter(int delta) { engine().waiters_.fetch_add(delta, std::memory_order_relaxed); }

bool progress_thread_default(bool on) {
  int undecided = -1;
  return g_enabled.compare_exchange_strong(undecided, on ? 1 : 0);
}

}  // namespace td::detail

namespace td {

void set_async_progress(bool enabled) { detail::g_enabled = enabled ? 1 : 0; }

bool async_progress_enabled() {
  if (detail::g_enabled < 0)
    detail::g_enabled = detail::config().progress_thread.value_or(true) ? 1 : 0;
  if (detail::g_enabled == 0) return false;
  int provided = MPI_THREAD_SINGLE, initialized = 0;
  MPI_Initialized(&initialized);
  if (initialized) MPI_Query_thread(&provided);
  if (provided != MPI_THREAD_MULTIPLE) {
    static std::once_flag warned;
    std::call_once(warned, [] {
      detail::log_warn([] {
        return std::string(
            "MPI was initialised without MPI_THREAD_MULTIPLE: no progress thread; async "
            "collectives advance only inside wait() and is_completed()");
      });
    });
    return false;
  }
  return true;
}

}  // namespace td
