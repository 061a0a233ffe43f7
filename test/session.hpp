// What the test main (test/main.cpp) needs of Catch2's session (test/catch_impl.cpp), without
// including Catch2: running it, and what it did, for the main's end-of-run report.
#pragma once

#include <cstddef>

/// Runs the Catch2 session on the command line; `colour` false turns colour off unless the
/// command line asks for it. Returns Catch2's exit code (the number of failed assertions, capped).
int td_test_run_session(int argc, char* argv[], bool colour);

/// This process's counts once the session has run (zeros before, or if no test ran).
struct TdTestTotals {
  std::size_t assertions_passed = 0;
  std::size_t assertions_failed = 0;
  std::size_t cases_passed = 0;
  std::size_t cases_failed = 0;
};
TdTestTotals td_test_totals();

/// The name of the test case this process is running or ran last ("" before the first), in a
/// fixed buffer that a signal handler may read.
const char* td_test_current_case();
/// Whether a test case of this process is running (Catch2 started it and has not ended it).
bool td_test_in_case();
/// Whether Catch2 reported a fatal error (a signal inside a test case) in this process.
bool td_test_fatal_error();
