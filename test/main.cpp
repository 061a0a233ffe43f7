// The one test main, compiled twice (cmake/TensorDictTesting.cmake): without TD_TEST_MPI for
// serial tests, and with it for MPI tests, where every rank runs the same Catch2 session. Only
// rank 0 reports; another rank's report is printed (to stderr, prefixed with its rank) only when
// that rank saw a failure, so a 4-rank run reads like a 1-rank run unless something differs
// between ranks. All ranks exit with the worst rank's code, so mpiexec's status is the truth.
// Catch2's implementation and session are test/catch_impl.cpp (compiled once).

#include <iostream>
#include <sstream>
#include <string>

#ifdef TD_TEST_MPI
#include <mpi.h>

#include <tensordict/tensordict.hpp>
#endif

int td_test_run_session(int argc, char* argv[], bool colour);  // test/catch_impl.cpp

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

}  // namespace

int main(int argc, char* argv[]) {
#ifdef TD_TEST_MPI
  td::init_process_group(argc, argv);
  const int rank = td::get_rank();
#else
  const int rank = 0;
#endif

  // Catch2 v2 binds its console reporter to std::cout's buffer when the session builds its
  // config, so swapping the buffer first captures the whole report of this rank.
  std::ostringstream captured;
  std::streambuf* const cout_buffer = rank != 0 ? std::cout.rdbuf(captured.rdbuf()) : nullptr;

  // mpiexec gives each rank a pseudo-terminal, so Catch2 would colour output that ends up in a
  // CTest log; --use-colour on the command line still wins.
#ifdef TD_TEST_MPI
  const int result = td_test_run_session(argc, argv, /*colour=*/false);
#else
  const int result = td_test_run_session(argc, argv, /*colour=*/true);
#endif

  if (cout_buffer != nullptr) {
    std::cout.rdbuf(cout_buffer);
    if (result != 0) {
      print_prefixed(captured.str(), rank);
    }
  }
  std::cout << std::flush;

#ifdef TD_TEST_MPI
  int agreed = result;
  MPI_Allreduce(&result, &agreed, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  td::destroy_process_group();
  return agreed;
#else
  return result;
#endif
}
