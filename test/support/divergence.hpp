// The divergence harness (test_mpi_divergence.cpp, docs/reliability.md): what a test needs to run
// a round on every rank and judge it, whatever the round is. A round's call is caught and
// classified (caught), each rank's outcome is exchanged over MPI_COMM_WORLD with plain MPI
// (exchange), and every rank judges every rank's outcome alike against the round's promise
// (judge): the correct result everywhere, or the same error everywhere, promptly, and the group
// still working afterwards. A watchdog thread ends the job when a rank is stuck in one phase (a
// hang no timeout caught). The rounds themselves (their kinds, collectives, calls and reference
// results) are the test's.
#pragma once

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include <tensordict/tensordict.hpp>

namespace tdtest::divergence {

using Clock = std::chrono::steady_clock;
using Ms = std::chrono::milliseconds;
using namespace std::chrono_literals;

// Sanitized builds run several times slower: every time limit below scales with kSlow.
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
constexpr int kSlow = 4;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
constexpr int kSlow = 4;
#else
constexpr int kSlow = 1;
#endif
#else
constexpr int kSlow = 1;
#endif

constexpr Ms kCallTimeout = 5s * kSlow;  // every call's opts.timeout, unless the round varies it
constexpr double kPromptSeconds = 4 * kSlow;  // an error must arrive within this (< the timeout)
constexpr auto kStuck = 20s * kSlow;          // a call (or follow-up) longer than this is a hang
constexpr auto kStuckWaiting = 25s * kSlow;   // waiting for the others: a stuck rank speaks first
constexpr auto kStuckWarmUp = 30s * kSlow;    // measuring kAutoBucketBytes for a new group

/// `s` in lower case (messages are matched without regard to case).
std::string lower(std::string s);

// ---- the watchdog -----------------------------------------------------------------------------

/// Ends the job (MPI_Abort) when one phase of a round takes longer than its limit (kStuck unless
/// the phase says): a rank blocked forever inside a collective cannot report anything itself.
class Watchdog {
 public:
  explicit Watchdog(int rank) : rank_(rank), thread_([this] { run(); }) {}
  ~Watchdog() {
    {
      std::lock_guard lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  Watchdog(const Watchdog&) = delete;
  Watchdog& operator=(const Watchdog&) = delete;

  /// A round starts (its description goes into the report): the call's phase, limit kStuck.
  void arm(std::string round) {
    std::lock_guard lock(mu_);
    round_ = std::move(round);
    phase_ = "in the call";
    note_.clear();
    limit_ = kStuck;
    since_ = Clock::now();
    armed_ = true;
  }
  /// A new phase, with its own limit; `note` (what this rank saw so far) goes into the report.
  void phase(std::string phase, Clock::duration limit, std::string note = {}) {
    std::lock_guard lock(mu_);
    phase_ = std::move(phase);
    limit_ = limit;
    if (!note.empty()) note_ = std::move(note);
    since_ = Clock::now();
  }
  /// Between rounds: nothing to watch.
  void disarm() {
    std::lock_guard lock(mu_);
    armed_ = false;
  }

 private:
  void run();

  int rank_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false, armed_ = false;
  std::string round_, phase_, note_;
  Clock::duration limit_ = kStuck;
  Clock::time_point since_;
  std::thread thread_;  // last: starts after the members it reads
};

// ---- outcomes ---------------------------------------------------------------------------------

/// The exception a rank raised, coarsely.
enum class Exc : int { None, LayoutMismatch, InvalidArgument, Timeout, Mpi, Key, OtherTd, Other };

/// "td::LayoutMismatchError", "no exception", ...
const char* exc_name(Exc e);

/// What a round's input must give: the correct result, an error on every rank, or either.
enum class Expect { Correct, Error, Either };

/// Which outcome a round must have.
struct Expectation {
  Expect expect = Expect::Correct;
  std::vector<Exc> allowed;           // error classes a rank may raise
  bool same_class = true;             // every participant raises the same class
  std::vector<std::string> keywords;  // a message names what differs: contains one of these
  int keyword_rank = -1;              // -1: every participant's message; else only this rank's
};

/// "the correct result on every rank", "an error on every rank (...)".
std::string expectation_str(const Expectation& e);

/// One rank's outcome of a round, exchanged as raw bytes.
struct Outcome {
  int participated = 0;
  int exc = 0;       // Exc
  int correct = 0;   // returned, and the result equals the reference
  int followup = 0;  // 0 not run, 1 correct, 2 wrong, 3 threw
  int followup_exc = 0;
  double followup_seconds = 0;
  double seconds = 0;
  char what[600] = {};
  char detail[300] = {};
  int first_exc = 0;  // a round with a first attempt (a bad argument, then a retry): its class
  double first_seconds = 0;
  char first_what[300] = {};
};

/// `s` into one of Outcome's texts, cut to fit.
template <std::size_t N>
void copy_text(char (&dst)[N], const std::string& s) {
  const std::size_t n = std::min(N - 1, s.size());
  std::copy_n(s.data(), n, dst);
  dst[n] = '\0';
}

/// Runs f, classifying what it throws; returns the class and the message.
template <class F>
std::pair<Exc, std::string> caught(F&& f) {
  try {
    f();
    return {Exc::None, {}};
  } catch (const td::LayoutMismatchError& e) {
    return {Exc::LayoutMismatch, e.what()};
  } catch (const td::TimeoutError& e) {
    return {Exc::Timeout, e.what()};
  } catch (const td::MpiError& e) {
    return {Exc::Mpi, e.what()};
  } catch (const td::KeyError& e) {
    return {Exc::Key, e.what()};
  } catch (const td::Error& e) {
    return {Exc::OtherTd, e.what()};
  } catch (const std::invalid_argument& e) {
    return {Exc::InvalidArgument, e.what()};
  } catch (const std::exception& e) {
    return {Exc::Other, e.what()};
  }
}

/// Every rank's outcome (collective over MPI_COMM_WORLD: `size` ranks).
std::vector<Outcome> exchange(const Outcome& mine, int size);

/// Whether the round left its group unusable (a timeout, an MPI error, or wrong values in the
/// follow-up calls): the test then goes on with a fresh group.
bool broke_group(const std::vector<Outcome>& all);

/// "0, 2": a list of ranks.
std::string ranks_str(const std::vector<int>& ranks);

/// Empty if the round kept its promise `e`, else why not; computed identically on every rank from
/// every rank's outcome. With `followed_up`, the follow-up calls ran and must have worked, unless
/// `followup_may_fail_alike` (a setting that differs for good) and they raised the same error
/// promptly on every rank.
std::string judge(const Expectation& e, const std::vector<Outcome>& all, bool followed_up,
                  bool followup_may_fail_alike);

/// One rank's outcome, for a report (" correct result after 0.01 s; next calls ok").
std::string outcome_str(const Outcome& o);
/// Every rank's outcome, one line each.
std::string outcomes_str(const std::vector<Outcome>& all);
/// Short class of a kept promise, for the summary ("correct", "error td::LayoutMismatchError").
std::string outcome_class(const std::vector<Outcome>& all);

// ---- the driver's pieces ----------------------------------------------------------------------

/// Rounds and their outcomes' classes by kind, for the summary; failures per kind.
struct Tally {
  std::map<std::string, std::map<std::string, int>> by_kind;
  int rounds = 0, failed = 0;
  void add(const std::string& kind, const std::string& cls) {
    ++rounds;
    failed += cls == "FAILED" ? 1 : 0;
    ++by_kind[kind][cls];
  }
  int failures(const std::string& kind) const {
    const auto k = by_kind.find(kind);
    if (k == by_kind.end()) return 0;
    const auto f = k->second.find("FAILED");
    return f == k->second.end() ? 0 : f->second;
  }
  std::string str() const {
    std::string out;
    for (const auto& [kind, classes] : by_kind) {
      out += fmt::format("  {:<16}", kind);
      for (const auto& [cls, n] : classes) out += fmt::format(" {} x {};", n, cls);
      out += "\n";
    }
    return out;
  }
};

/// A new group of world ranks 0..size-1 (collective over world), with its kAutoBucketBytes
/// measured outside any round: the measurement takes about a second here (far longer when
/// sanitized) and would count against the timeout of the first round that asks for it. `context`
/// goes into the watchdog's report.
td::ProcessGroup fresh_group(int size, Watchdog& dog, const std::string& context);

}  // namespace tdtest::divergence
