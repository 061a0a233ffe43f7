// Catch2's implementation, compiled once for every test executable (cmake/TensorDictTesting.cmake),
// and the one function of it the test main needs, so that test/main.cpp (compiled twice: serial
// and MPI) stays small. CATCH_CONFIG_RUNNER: the implementation without Catch2's own main.
#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>

// Runs the Catch2 session on the command line; `colour` false turns colour off unless the
// command line asks for it.
int td_test_run_session(int argc, char* argv[], bool colour) {
  Catch::Session session;
  if (!colour) session.configData().useColour = Catch::UseColour::No;
  const int rc = session.applyCommandLine(argc, argv);
  return rc != 0 ? rc : session.run();
}
