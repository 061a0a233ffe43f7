// Catch2's implementation, compiled once for every test executable (cmake/TensorDictTesting.cmake),
// and what the test main needs of it (test/session.hpp), so that test/main.cpp (compiled twice:
// serial and MPI) stays small. CATCH_CONFIG_RUNNER: the implementation without Catch2's own main.
#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>

#include <algorithm>
#include <atomic>
#include <cstring>

#include "session.hpp"

namespace {

// Written by the listener below on the main thread, read by the test main's exit reports, one
// of which is a signal handler: a fixed buffer and lock-free flags, no allocation.
char g_current_case[256] = "";
std::atomic<bool> g_in_case{false};
std::atomic<bool> g_fatal{false};
TdTestTotals g_totals;

// Follows the session: which test case runs, whether Catch2 saw a fatal signal, the totals.
class SessionListener : public Catch::TestEventListenerBase {
 public:
  using TestEventListenerBase::TestEventListenerBase;

  void testCaseStarting(const Catch::TestCaseInfo& info) override {
    g_current_case[0] = '\0';
    const std::size_t n = std::min(info.name.size(), sizeof g_current_case - 1);
    std::memcpy(g_current_case, info.name.data(), n);
    g_current_case[n] = '\0';
    g_in_case.store(true);
    TestEventListenerBase::testCaseStarting(info);
  }
  // Catch2's signal handler reports the signal as a failed assertion, then ends the test case
  // and the run before it hands the signal on: the test case still counts as the one running.
  bool assertionEnded(const Catch::AssertionStats& stats) override {
    if (stats.assertionResult.getResultType() == Catch::ResultWas::FatalErrorCondition)
      g_fatal.store(true);
    return TestEventListenerBase::assertionEnded(stats);
  }
  void testCaseEnded(const Catch::TestCaseStats& stats) override {
    if (!g_fatal.load()) g_in_case.store(false);
    TestEventListenerBase::testCaseEnded(stats);
  }
  void testRunEnded(const Catch::TestRunStats& stats) override {
    g_totals.assertions_passed = stats.totals.assertions.passed;
    g_totals.assertions_failed = stats.totals.assertions.failed;
    g_totals.cases_passed = stats.totals.testCases.passed;
    g_totals.cases_failed = stats.totals.testCases.failed;
    TestEventListenerBase::testRunEnded(stats);
  }
};

}  // namespace

CATCH_REGISTER_LISTENER(SessionListener)

int td_test_run_session(int argc, char* argv[], bool colour) {
  Catch::Session session;
  if (!colour) session.configData().useColour = Catch::UseColour::No;
  const int rc = session.applyCommandLine(argc, argv);
  return rc != 0 ? rc : session.run();
}

TdTestTotals td_test_totals() { return g_totals; }
const char* td_test_current_case() { return g_current_case; }
bool td_test_in_case() { return g_in_case.load(); }
bool td_test_fatal_error() { return g_fatal.load(); }
