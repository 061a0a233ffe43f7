// Ways a rank can leave a test early, run under the test main (test/main.cpp) by the
// fault.test_main.* tests (CMakeLists.txt), each of which checks that the output names the rank
// and where it was (issue 32: a rank that left silently). Hidden test cases: run one by tag.
#include <catch2/catch.hpp>

#include <csignal>
#include <cstdlib>

#include <tensordict/tensordict.hpp>

TEST_CASE("rank 1 calls exit(0) in the middle of a test", "[.exit]") {
  td::barrier();
  if (td::get_rank() == 1) std::exit(0);
  td::barrier();  // rank 0 waits here until the job ends
}

TEST_CASE("rank 1 dies of SIGSEGV in the middle of a test", "[.signal]") {
  td::barrier();
  if (td::get_rank() == 1) std::raise(SIGSEGV);
  td::barrier();
}

TEST_CASE("rank 1 fails an assertion, rank 0 passes", "[.fail]") {
  CHECK(td::get_rank() != 1);
  td::barrier();
}

TEST_CASE("every rank passes", "[.pass]") {
  CHECK(td::get_world_size() >= 1);
  td::barrier();
}
