// White-box tests of the runtime and the executor that need MPI: the executor's tasks (post,
// Step, post_into, post_and_wait) on real requests, the received-count check of a receive that
// got less than it posted, deadlines that expire on a posted receive nobody matches, and the
// progress thread's default for this job (runtime/process_group.cpp's progress_thread_on).
//
// Linked with the library's objects and the MPI test main (test/main.cpp with TD_TEST_MPI,
// CMakeLists.txt), not with libtensordict.so: init_process_group comes from the same objects as
// everything tested here, so there is one copy of the runtime's singletons. Registered at 1, 2
// and 3 ranks: every transfer is a ring (rank r sends to r + 1), which at 1 rank is a rank
// talking to itself.
#include <catch2/catch.hpp>

#include <chrono>
#include <memory>
#include <numeric>
#include <optional>
#include <string>
#include <vector>

#include <mpi.h>

#include <tensordict/tensordict.hpp>

#include "../support/groups.hpp"
#include "comm/executor.hpp"
#include "core/config.hpp"
#include "runtime/deadline.hpp"
#include "runtime/group_state.hpp"
#include "runtime/mpi_types.hpp"
#include "runtime/nbc_tuning.hpp"
#include "runtime/progress.hpp"
#include "runtime/work_state.hpp"

using namespace std::chrono_literals;
using td::detail::recv_call;
using td::detail::send_call;

namespace {

// How late a deadline of 300 ms may end a wait (a loaded or sanitized run included): later is
// a hang that the deadline did not end.
constexpr auto kLateAtMost = 30s;

// A tag no rank ever sends with, until the test completes the abandoned receive itself.
constexpr int kUnmatchedTag = 4242;

struct Ring {
  int rank = td::get_rank();
  int size = td::get_world_size();
  int next = (rank + 1) % size;
  int prev = (rank + size - 1) % size;
};

std::vector<int> values_of(int rank, std::size_t n) {
  std::vector<int> v(n);
  std::iota(v.begin(), v.end(), 100 * rank);
  return v;
}

// One Step of a ring on `comm`: receives into the whole of `got` from the previous rank (phase
// "payload") while sending the next rank `sent` ints of this rank's; throws what Step::wait
// throws.
void ring_step(const Ring& ring, MPI_Comm comm, const std::shared_ptr<std::vector<int>>& got,
               int sent, int tag, const char* what) {
  const std::vector<int> mine = values_of(ring.rank, static_cast<std::size_t>(sent));
  td::detail::Step step(
      td::detail::deadline_after(30s), [] { return std::string("ring"); }, got, what);
  step.post(recv_call(got->data(), static_cast<int>(got->size()), MPI_INT, ring.prev, tag, comm),
            "payload");
  step.post(send_call(mine.data(), sent, MPI_INT, ring.next, tag, comm));
  step.wait();
}

// Completes a receive from this rank with kUnmatchedTag that a test abandoned after its timeout
// (its buffer leaked, as the library does), so that nothing is pending at MPI_Finalize.
void complete_abandoned_receive(MPI_Comm comm, int count) {
  std::vector<int> payload(static_cast<std::size_t>(count), 0);
  MPI_Request req = MPI_REQUEST_NULL;
  MPI_Isend(payload.data(), count, MPI_INT, td::get_rank(), kUnmatchedTag, comm, &req);
  MPI_Wait(&req, MPI_STATUS_IGNORE);
}

}  // namespace

TEST_CASE("Step: a receive that got fewer elements than it posted is rejected, naming both counts",
          "[executor][step]") {
  const Ring ring;
  const td::ProcessGroup group = fresh_group();
  // The control: matching counts arrive whole.
  auto whole = std::make_shared<std::vector<int>>(3, -1);
  ring_step(ring, group.comm(), whole, 3, 5, "test ring");
  CHECK(*whole == values_of(ring.prev, 3));
  // A receive posted for 5 elements that gets 3: MPI accepts it silently; the Step does not.
  auto got = std::make_shared<std::vector<int>>(5, -1);
  try {
    ring_step(ring, group.comm(), got, 3, 6, "TensorDict.recv (test)");
    FAIL("a short message was accepted");
  } catch (const td::Error& e) {
    const std::string counts =
        "rank " + std::to_string(ring.prev) + " sent 3 of the 5 elements of 4 bytes of its payload";
    CHECK_THAT(e.what(), Catch::Contains("TensorDict.recv (test)") && Catch::Contains(counts) &&
                             Catch::Contains("short message"));
  }
  // Every request was waited for before the counts were judged: the message arrived.
  CHECK(std::vector<int>(got->begin(), got->begin() + 3) == values_of(ring.prev, 3));
}

TEST_CASE(
    "post_into: a pending operation whose receive got fewer elements fails naming both "
    "counts, without running finish",
    "[executor][work]") {
  const Ring ring;
  const td::ProcessGroup group = fresh_group();
  const MPI_Comm comm = group.comm();
  const std::vector<int> mine = values_of(ring.rank, 2);
  auto got = std::make_shared<std::vector<int>>(4, -1);
  td::detail::WorkState w;
  w.what = "TensorDict.irecv (test)";
  w.deadline = td::detail::deadline_after(30s);
  w.held.push_back(got);
  bool finished = false;
  w.finish = [&] { finished = true; };
  td::detail::post_into(w, recv_call(got->data(), 4, MPI_INT, ring.prev, 8, comm), "values");
  td::detail::post_into(w, send_call(mine.data(), 2, MPI_INT, ring.next, 8, comm));
  REQUIRE(w.receive_checks.size() == 1);  // the receive, not the send
  CHECK_THROWS_WITH(w.wait(), Catch::Contains("TensorDict.irecv (test)") &&
                                  Catch::Contains("sent 2 of the 4 elements") &&
                                  Catch::Contains("of its values"));
  CHECK(w.settled());
  CHECK_FALSE(finished);
}

TEST_CASE("Step: a receive nobody matches ends in td::TimeoutError at its deadline, not a hang",
          "[executor][step][deadline]") {
  const td::ProcessGroup group = fresh_group();
  const MPI_Comm comm = group.comm();
  auto hold = std::make_shared<std::vector<int>>(4, -1);
  const std::weak_ptr<std::vector<int>> watch = hold;
  const auto start = std::chrono::steady_clock::now();
  {
    td::detail::Step step(
        td::detail::deadline_after(300ms),
        [] { return std::string("the unmatched receive (test)"); }, hold, "test");
    step.post(recv_call(hold->data(), 4, MPI_INT, td::get_rank(), kUnmatchedTag, comm), "data");
    CHECK_THROWS_WITH(step.wait(), Catch::Contains("the unmatched receive (test)") &&
                                       Catch::Contains("no longer usable"));
  }
  const auto waited = std::chrono::steady_clock::now() - start;
  CHECK(waited >= 300ms);
  CHECK(waited < kLateAtMost);
  // The receive may still write into its buffer: the Step kept it alive for good.
  hold.reset();
  CHECK_FALSE(watch.expired());
  complete_abandoned_receive(comm, 4);
}

TEST_CASE("WorkState: a posted receive nobody matches ends in td::TimeoutError at its deadline",
          "[executor][work][deadline]") {
  const td::ProcessGroup group = fresh_group();
  const MPI_Comm comm = group.comm();
  {
    auto buffer = std::make_shared<std::vector<int>>(2, -1);
    td::detail::WorkState w;
    w.describe = [] { return std::string("the unmatched async receive (test)"); };
    w.held.push_back(buffer);
    td::detail::post_into(
        w, recv_call(buffer->data(), 2, MPI_INT, td::get_rank(), kUnmatchedTag, comm));
    const auto start = std::chrono::steady_clock::now();
    w.deadline = td::detail::deadline_after(300ms);
    try {
      w.wait();
      FAIL("wait() returned on a receive nobody matched");
    } catch (const td::TimeoutError& e) {
      CHECK_THAT(e.what(), Catch::Contains("the unmatched async receive (test)") &&
                               Catch::Contains("did not complete before its timeout"));
    }
    const auto waited = std::chrono::steady_clock::now() - start;
    CHECK(waited >= 300ms);
    CHECK(waited < kLateAtMost);
    CHECK(w.timed_out());
    CHECK_FALSE(w.test());  // timed out: never tested again
  }
  complete_abandoned_receive(comm, 2);
}

TEST_CASE("post_and_wait and post: collectives posted through the executor complete",
          "[executor]") {
  const Ring ring;
  const td::ProcessGroup group = fresh_group();
  const MPI_Comm comm = group.comm();
  const auto describe = [] { return std::string("post_and_wait (test)"); };
  std::vector<int> v(5, ring.rank + 1);
  td::detail::post_and_wait(
      td::detail::allreduce_call(MPI_IN_PLACE, v.data(), 5, MPI_INT, MPI_SUM, comm),
      td::detail::deadline_after(30s), describe, nullptr);
  CHECK(v == std::vector<int>(5, ring.size * (ring.size + 1) / 2));
  std::vector<int> b = values_of(ring.rank, 4);
  td::detail::post_and_wait(td::detail::bcast_call(b.data(), 4, MPI_INT, ring.size - 1, comm),
                            td::detail::deadline_after(30s), describe, nullptr);
  CHECK(b == values_of(ring.size - 1, 4));
  // The blocking form (no request): the sync path's.
  int most = ring.rank;
  td::detail::post(td::detail::allreduce_call(MPI_IN_PLACE, &most, 1, MPI_INT, MPI_MAX, comm),
                   nullptr);
  CHECK(most == ring.size - 1);
  CHECK_NOTHROW(td::detail::post(td::detail::barrier_call(comm), nullptr));
}

// The observable default against the one decision (test_internal_runtime tests the decision's
// every case). Runs on one host in `make test` (on), under TD_PROGRESS_THREAD=0 (off), and across
// hosts in the cluster suite (off under Open MPI 4).
TEST_CASE("the progress thread's default is progress_thread_on's for this job", "[progress]") {
  const int on_this_host = td::detail::ranks_on_this_host(MPI_COMM_WORLD);  // collective
  std::string version(MPI_MAX_LIBRARY_VERSION_STRING, '\0');
  int len = 0;
  MPI_Get_library_version(version.data(), &len);
  version.resize(static_cast<std::size_t>(len));
  const std::optional<bool> setting = td::detail::config().progress_thread;
  INFO(version << "; " << on_this_host << " of " << td::get_world_size()
               << " ranks on this host; TD_PROGRESS_THREAD "
               << (setting ? (*setting ? "1" : "0") : "unset"));
  CHECK(td::async_progress_enabled() ==
        td::detail::progress_thread_on(td::get_world_size(), on_this_host, version, setting));
}

// libnbc's MPI_Iallreduce algorithm for the job (runtime/nbc_tuning.hpp), and the padding of the
// library's small control messages that keeps Rabenseifner's algorithm off the ring.
TEST_CASE("libnbc's algorithm for the job, and small control messages padded for it",
          "[nbc_tuning]") {
  using td::detail::iallreduce_algorithm_for;
  using td::detail::NbcAllreduce;
  using td::detail::padded_count;
  for (bool across : {false, true}) {
    CHECK(iallreduce_algorithm_for(1, across) == NbcAllreduce::LibnbcChoice);
    CHECK(iallreduce_algorithm_for(2, across) == NbcAllreduce::Ring);
    for (long ranks : {4L, 8L, 16L, 1024L})
      CHECK(iallreduce_algorithm_for(ranks, across) == NbcAllreduce::Rabenseifner);
    CHECK(iallreduce_algorithm_for(17, across) == NbcAllreduce::LibnbcChoice);
  }
  // 3, 5, 6, 7, 9... 15 ranks: the ring across nodes only (on one node it loses on small
  // messages).
  for (long ranks : {3L, 5L, 6L, 7L, 9L, 12L, 15L}) {
    CHECK(iallreduce_algorithm_for(ranks, false) == NbcAllreduce::LibnbcChoice);
    CHECK(iallreduce_algorithm_for(ranks, true) == NbcAllreduce::Ring);
  }
  // At least the largest power of two <= ranks (libnbc: count >= nprocs_pof2).
  CHECK(padded_count(3, 1) == 3);
  CHECK(padded_count(3, 2) == 3);
  CHECK(padded_count(3, 3) == 3);
  CHECK(padded_count(3, 4) == 4);
  CHECK(padded_count(1, 4) == 4);
  CHECK(padded_count(3, 7) == 4);
  CHECK(padded_count(3, 8) == 8);
  CHECK(padded_count(1, 1000) == 512);
  CHECK(padded_count(5000, 1000) == 5000);
}
