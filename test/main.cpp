// The one test main, compiled twice (cmake/TensorDictTesting.cmake): without TD_TEST_MPI for
// serial tests, and with it for MPI tests, where every rank runs the same Catch2 session. Only
// rank 0 reports; another rank's report is printed (to stderr, prefixed with its rank) only when
// that rank saw a failure, so a 4-rank run reads like a 1-rank run unless something differs
// between ranks. All ranks exit with the worst rank's code, so mpiexec's status is the truth.
// Catch2's implementation and session are test/catch_impl.cpp (compiled once, test/session.hpp).
//
// How every rank left is never a mystery (issue 32). Before anyone finalizes, rank 0 prints one
// line with every rank's own result. Every other way out prints a line on stderr naming the rank
// and where it was (a test case, or a step of this main): an exception out of the session or out
// of destroy_process_group, exit() or quick_exit() called before this main's end, a fatal
// signal, the SIGTERM with which mpiexec ends a job, a destroy_process_group that leaves MPI
// initialised, and one slow enough that mpiexec may have missed the rank's finalize. td::abort
// (the watchdog, the terminate handler) prints its own line.

#include <iostream>
#include <sstream>
#include <string>

#include "session.hpp"

#ifdef TD_TEST_MPI
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <vector>

#include <mpi.h>

#include <tensordict/tensordict.hpp>
#endif

namespace {

// Writes `text` to stderr with "[rank R] " before every line, in one write so that lines from
// different ranks do not interleave mid-line.
void print_prefixed(const std::string& text, int rank) {
  const std::string prefix = "[rank " + std::to_string(rank) + "] ";
  std::string out;
  std::istringstream lines(text);
  for (std::string line; std::getline(lines, line);) {
    out += prefix + line + '\n';
  }
  std::cerr << out << std::flush;
}

#ifdef TD_TEST_MPI

// Where this rank is, for the exit reports (read by a signal handler: a sig_atomic_t).
enum Phase : int {
  kStarting,    // before the session
  kInSession,   // Catch2 runs the tests
  kAgreeing,    // gathering every rank's result
  kDestroying,  // in destroy_process_group (which finalizes MPI)
  kReturning,   // MPI finalized, main returns: static destructors, then exit
};
volatile std::sig_atomic_t g_phase = kStarting;
int g_rank = -1;
// A rank other than 0's captured Catch2 report, printed if the rank leaves early.
const std::ostringstream* g_captured = nullptr;

// MPI_Finalize tells mpiexec that this rank finalized, and Open MPI's PMIx client waits at most
// 2 s for mpiexec to acknowledge it before going on; a rank that exits before mpiexec took note
// is reported as having "exited improperly" (issue 32; _TD_TEST_MAIN_ENV in
// cmake/TensorDictTesting.cmake). A destroy_process_group at least this long is therefore said,
// with the time (which also covers the settling of pending operations).
constexpr double kSlowDestroySeconds = 1.5;

// Async-signal-safe line building: appends `s` to buf (of size n) at *len.
void append(char* buf, std::size_t n, std::size_t* len, const char* s) {
  while (*s != '\0' && *len + 1 < n) buf[(*len)++] = *s++;
  buf[*len] = '\0';
}
void append_int(char* buf, std::size_t n, std::size_t* len, int v) {
  char digits[16];
  int i = 0;
  unsigned u = v < 0 ? 0U - static_cast<unsigned>(v) : static_cast<unsigned>(v);
  do {
    digits[i++] = static_cast<char>('0' + u % 10);
    u /= 10;
  } while (u != 0 && i < 15);
  if (v < 0) append(buf, n, len, "-");
  while (i > 0) {
    const char d[2] = {digits[--i], '\0'};
    append(buf, n, len, d);
  }
}
void write_all(const char* s, std::size_t len) {
  while (len > 0) {
    const ssize_t w = ::write(STDERR_FILENO, s, len);
    if (w <= 0) return;
    s += w;
    len -= static_cast<std::size_t>(w);
  }
}

// " during test case 'x'", " after the tests, in destroy_process_group", ... (signal-safe).
void append_where(char* buf, std::size_t n, std::size_t* len) {
  switch (g_phase) {
    case kStarting:
      append(buf, n, len, " before the tests");
      break;
    case kInSession:
      if (td_test_in_case()) {
        append(buf, n, len, " during test case '");
      } else if (td_test_current_case()[0] != '\0') {
        append(buf, n, len, " between test cases (the last one started: '");
      } else {
        append(buf, n, len, " in the Catch2 session, before any test case");
        break;
      }
      append(buf, n, len, td_test_current_case());
      append(buf, n, len, td_test_in_case() ? "'" : "')");
      break;
    case kAgreeing:
      append(buf, n, len, " after its tests, while gathering the ranks' results");
      break;
    case kDestroying:
      append(buf, n, len, " after its tests, in destroy_process_group (MPI_Finalize)");
      break;
    default:
      append(buf, n, len, " after MPI_Finalize, while leaving main (a static destructor?)");
      break;
  }
}

const char* signal_name(int sig) {
  switch (sig) {
    case SIGSEGV:
      return "SIGSEGV";
    case SIGBUS:
      return "SIGBUS";
    case SIGFPE:
      return "SIGFPE";
    case SIGILL:
      return "SIGILL";
    case SIGABRT:
      return "SIGABRT";
    case SIGTERM:
      return "SIGTERM";
    default:
      return "a signal";
  }
}

constexpr int kReportedSignals[] = {SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT, SIGTERM};
struct sigaction g_previous[std::size(kReportedSignals)];

// Says which rank got the signal and where it was, then hands the signal to whoever had it
// before (Open MPI's backtrace handler, or the default action), which ends the process. Catch2's
// own handler runs first inside a test case and reports into this rank's captured report; that
// report is then printed too (Catch2 has already allocated in its handler, so this is no worse).
extern "C" void on_signal(int sig) {
  char line[512];
  std::size_t len = 0;
  append(line, sizeof line, &len, "[rank ");
  append_int(line, sizeof line, &len, g_rank);
  append(line, sizeof line, &len, "] ");
  const std::size_t prefix_len = len;  // "[rank R] ", also before each line of the report
  append(line, sizeof line, &len, sig == SIGTERM ? "got " : "killed by ");
  append(line, sizeof line, &len, signal_name(sig));
  append(line, sizeof line, &len, " (signal ");
  append_int(line, sizeof line, &len, sig);
  append(line, sizeof line, &len, ")");
  append_where(line, sizeof line, &len);
  if (sig == SIGTERM)
    append(line, sizeof line, &len, " (how mpiexec ends a job after a rank failed)");
  append(line, sizeof line, &len, "\n");
  if (td_test_fatal_error() && g_captured != nullptr) {
    const std::string report = g_captured->str();
    std::size_t start = 0;
    while (start < report.size()) {
      std::size_t end = report.find('\n', start);
      end = end == std::string::npos ? report.size() : end + 1;
      write_all(line, prefix_len);
      write_all(report.data() + start, end - start);
      start = end;
    }
  }
  write_all(line, len);
  for (std::size_t i = 0; i < std::size(kReportedSignals); ++i) {
    if (kReportedSignals[i] == sig) sigaction(sig, &g_previous[i], nullptr);
  }
  std::raise(sig);  // blocked until this handler returns, then taken by the previous action
}

// exit() or quick_exit() before this main returned: a test, the library or Catch2 left early.
// Said with this rank's report; the job then ends with MPI_Abort (td::abort) rather than leave
// the other ranks waiting for a rank that exits without finalizing.
void on_early_exit() {
  if (g_phase == kReturning) return;
  std::size_t len = 0;
  char where[400];
  where[0] = '\0';
  append_where(where, sizeof where, &len);
  if (g_captured != nullptr) print_prefixed(g_captured->str(), g_rank);
  std::cout << std::flush;
  td::abort("[rank " + std::to_string(g_rank) + "] exit() or quick_exit() was called" + where +
                ", before the test main finalized MPI",
            1);
}

void install_exit_reports(int rank) {
  g_rank = rank;
  struct sigaction sa {};
  sa.sa_handler = on_signal;
  sigemptyset(&sa.sa_mask);
  for (std::size_t i = 0; i < std::size(kReportedSignals); ++i)
    sigaction(kReportedSignals[i], &sa, &g_previous[i]);
  std::atexit(on_early_exit);
  std::at_quick_exit(on_early_exit);
}

// "1 assertion", "2 assertions".
std::string count(long long n, const char* what) {
  return std::to_string(n) + " " + what + (n == 1 ? "" : "s");
}

// One line on rank 0 (world size > 1): every rank's own result, gathered before anyone finalizes,
// e.g. "[ranks] every rank finished its tests: 0 passed (70 assertions), 1 FAILED (2 of 66
// assertions, 1 test case), ...; all finalize now".
int gather_results(int rank, int size, int result) {
  const TdTestTotals totals = td_test_totals();
  const long long mine[4] = {result, static_cast<long long>(totals.assertions_passed),
                             static_cast<long long>(totals.assertions_failed),
                             static_cast<long long>(totals.cases_failed)};
  std::vector<long long> all(4 * static_cast<std::size_t>(size));
  MPI_Allgather(mine, 4, MPI_LONG_LONG, all.data(), 4, MPI_LONG_LONG, MPI_COMM_WORLD);
  long long agreed = 0;
  std::string line = "[ranks] every rank finished its tests:";
  for (int r = 0; r < size; ++r) {
    const long long* v = &all[4 * static_cast<std::size_t>(r)];
    agreed = std::max(agreed, v[0]);
    line += r == 0 ? " " : ", ";
    line += std::to_string(r);
    if (v[0] == 0) {
      line += " passed (" + count(v[1], "assertion") + ")";
    } else if (v[2] > 0) {
      line += " FAILED (" + std::to_string(v[2]) + " of " + count(v[1] + v[2], "assertion") + ", " +
              count(v[3], "test case") + ")";
    } else {
      line += " FAILED (exit code " + std::to_string(v[0]) + ", no failed assertion)";
    }
  }
  if (rank == 0 && size > 1) std::cout << line + "; all finalize now\n" << std::flush;
  return static_cast<int>(std::min<long long>(agreed, 255));
}

#endif  // TD_TEST_MPI

}  // namespace

int main(int argc, char* argv[]) {
#ifdef TD_TEST_MPI
  td::init_process_group(argc, argv);
  const int rank = td::get_rank();
  install_exit_reports(rank);
#else
  const int rank = 0;
#endif

  // Catch2 v2 binds its console reporter to std::cout's buffer when the session builds its
  // config, so swapping the buffer first captures the whole report of this rank.
  std::ostringstream captured;
  std::streambuf* const cout_buffer = rank != 0 ? std::cout.rdbuf(captured.rdbuf()) : nullptr;

  // mpiexec gives each rank a pseudo-terminal, so Catch2 would colour output that ends up in a
  // CTest log; --use-colour on the command line still wins.
  int result = 0;
  std::string escaped;  // what escaped the session, if anything did
#ifdef TD_TEST_MPI
  if (rank != 0) g_captured = &captured;
  g_phase = kInSession;
  constexpr bool colour = false;
#else
  constexpr bool colour = true;
#endif
  try {
    result = td_test_run_session(argc, argv, colour);
  } catch (const std::exception& e) {
    escaped = e.what();
  } catch (...) {
    escaped = "an exception of a type not derived from std::exception";
  }

  if (cout_buffer != nullptr) {
    std::cout.rdbuf(cout_buffer);
    if (result != 0 || !escaped.empty()) print_prefixed(captured.str(), rank);
  }
  std::cout << std::flush;
  const std::string exception_line = "an exception escaped the Catch2 session: " + escaped;

#ifdef TD_TEST_MPI
  g_captured = nullptr;  // printed above if it mattered
  // The other ranks may be inside a collective of a test: end the job rather than leave them.
  if (!escaped.empty()) td::abort("[rank " + std::to_string(rank) + "] " + exception_line, 1);
  g_phase = kAgreeing;
  const int agreed = gather_results(rank, td::get_world_size(), result);

  g_phase = kDestroying;
  const auto t0 = std::chrono::steady_clock::now();
  try {
    td::destroy_process_group();
  } catch (const std::exception& e) {
    td::abort("[rank " + std::to_string(rank) + "] destroy_process_group threw: " + e.what(), 1);
  }
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized)
    td::abort("[rank " + std::to_string(rank) +
                  "] destroy_process_group returned with MPI still initialised (not finalized)",
              1);
  // Each line in one write: std::cerr's pieces would interleave with the other ranks' lines.
  const std::string took = "[rank " + std::to_string(rank) + "] " +
                           (std::getenv("TD_TEST_TRACE_EXIT") != nullptr ? "trace: " : "") +
                           "destroy_process_group took " + std::to_string(seconds) + " s";
  if (seconds >= kSlowDestroySeconds) {
    std::cerr << took +
                     " (Open MPI's PMIx client waits at most 2 s for mpiexec to acknowledge the "
                     "finalize, then lets the rank exit: mpiexec may see the exit first and report "
                     "that the rank exited improperly, unless orte_allowed_exit_without_sync is "
                     "set as under CTest)\n"
              << std::flush;
  } else if (std::getenv("TD_TEST_TRACE_EXIT") != nullptr) {
    std::cerr << took + "\n" << std::flush;
  }
  g_phase = kReturning;
  return agreed;
#else
  if (!escaped.empty()) {
    std::cerr << exception_line + '\n' << std::flush;
    return 1;
  }
  return result;
#endif
}
