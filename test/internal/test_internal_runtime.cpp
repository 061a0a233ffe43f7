// White-box tests of the runtime's parts that the library does not export: the tag space of a
// group (runtime/tags.hpp), deadlines (runtime/watchdog.cpp), a pending operation's phases
// without requests (runtime/work.cpp), the progress thread's default (runtime/progress.cpp,
// runtime/process_group.cpp) and AVG's division (runtime/mpi_types.cpp). Linked with the
// library's objects, without MPI_Init: nothing here calls MPI (a WorkState without requests makes
// no MPI call). test/internal/test_internal_mpi.cpp has the runtime's tests that need MPI.
#include <catch2/catch.hpp>

#include <chrono>
#include <cmath>
#include <complex>
#include <cstdint>
#include <cstring>
#include <exception>
#include <functional>
#include <limits>
#include <memory>
#include <optional>
#include <set>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "runtime/deadline.hpp"
#include "runtime/group_state.hpp"
#include "runtime/mpi_types.hpp"
#include "runtime/progress.hpp"
#include "runtime/tags.hpp"
#include "runtime/work_state.hpp"
#include "tensordict/collectives.hpp"
#include "tensordict/errors.hpp"
#include "tensordict/work.hpp"

using td::detail::TagSpace;

namespace {

// Every tag a point-to-point block starting at `base` can use.
std::pair<long long, long long> block_range(const TagSpace& t, int base) {
  return {base, static_cast<long long>(base) + t.tags_per_call() - 1};
}

}  // namespace

TEST_CASE("point-to-point blocks of different tags, calls and directions never overlap",
          "[runtime][tags]") {
  for (const long long tag_ub : {2147483647LL, 1LL << 28, (1LL << 23) + 12345}) {
    INFO("MPI_TAG_UB " << tag_ub);
    TagSpace t(tag_ub);
    REQUIRE(t.calls_per_tag() > 0);
    REQUIRE(t.tags_per_call() > TagSpace::kFirstDataTag);
    // Ranks 0 and 1: rank 0 sends (direction 1) and receives (direction 0), every boundary tag,
    // through more calls than there are blocks per tag.
    std::set<std::pair<long long, long long>> seen;  // ranges, by first tag
    for (const int user_tag : {0, 1, 1023, 1024, td::kMaxUserTag - 2, td::kMaxUserTag - 1}) {
      for (const bool sending : {true, false}) {
        std::set<int> bases;
        for (int n = 0; n < 3 * t.calls_per_tag(); ++n) {
          const int base = t.next_call_block(0, 1, sending, user_tag, "test").base;
          bases.insert(base);
          const auto [first, last] = block_range(t, base);
          CHECK(first >= 2 * td::kMaxUserTag);  // above transport's tags
          CHECK(last <= tag_ub);
          CHECK(t.data_tag(base, 0) == base + TagSpace::kFirstDataTag);
          CHECK(t.data_tag(base, 1u << 20) <= last);
        }
        // Blocks repeat every calls_per_tag() calls, and only then.
        CHECK(bases.size() == static_cast<std::size_t>(t.calls_per_tag()));
        for (int base : bases) seen.insert(block_range(t, base));
      }
    }
    // No two blocks of the set share a tag.
    long long previous_last = -1;
    for (const auto& [first, last] : seen) {
      CHECK(first > previous_last);
      previous_last = last;
    }
    // The other side of a transfer computes the same block: rank 1's n-th receive from rank 0
    // with a tag meets rank 0's n-th send to rank 1 with it.
    TagSpace a(tag_ub), b(tag_ub);
    for (int n = 0; n < 5; ++n)
      CHECK(a.next_call_block(0, 1, true, 77, "test").base ==
            b.next_call_block(1, 0, false, 77, "test").base);
  }
}

// The defect this guards against: a 65th call in flight took the block of the first, still in
// flight, so MPI could pair either call's messages with the other's (a receiver that tested its
// later call first got the earlier call's data, with every count matching).
TEST_CASE("a point-to-point call whose block is still taken is refused, and takes nothing",
          "[runtime][tags]") {
  TagSpace t(2147483647LL);
  const int calls = t.calls_per_tag();
  std::vector<TagSpace::CallBlock> in_flight;
  for (int n = 0; n < calls; ++n) in_flight.push_back(t.next_call_block(0, 1, true, 5, "test"));
  CHECK_THROWS_WITH(t.next_call_block(0, 1, true, 5, "TensorDict.send"),
                    Catch::Contains("TensorDict.send") &&
                        Catch::Contains("64 point-to-point calls to rank 1 with tag 5") &&
                        Catch::Contains("call 1, has not completed") &&
                        Catch::Contains("nothing was sent"));
  // Other tags, the other direction and other peers have blocks of their own.
  CHECK_NOTHROW(t.next_call_block(0, 1, true, 6, "test"));
  CHECK_NOTHROW(t.next_call_block(0, 1, false, 5, "test"));
  CHECK_NOTHROW(t.next_call_block(0, 2, true, 5, "test"));
  // A later call completing frees only its own block: the next call still needs block 0.
  in_flight[1] = {};
  CHECK_THROWS(t.next_call_block(0, 1, true, 5, "test"));
  // Once the first call is done, the refused call gets its block, as the peer's does.
  const int first_base = in_flight[0].base;
  in_flight[0] = {};
  TagSpace peer(2147483647LL);
  for (int n = 0; n < calls; ++n) CHECK_NOTHROW(peer.next_call_block(1, 0, false, 5, "test"));
  const TagSpace::CallBlock again = t.next_call_block(0, 1, true, 5, "test");
  CHECK(again.base == first_base);
  CHECK(peer.next_call_block(1, 0, false, 5, "test").base == again.base);
}

// The defect this guards against: transport used the user tag in both directions, so a
// send_dict from A to B and one from B to A at once (one on a thread of each rank's own) could
// take each other's messages: a verdict of 512 bytes matched a 512-byte data message.
TEST_CASE("transport tags: one per user tag and direction, below every point-to-point block",
          "[runtime][tags]") {
  TagSpace t(2147483647LL);
  std::set<int> seen;
  for (const int user_tag : {0, 1023, 1024, td::kMaxUserTag - 1}) {
    // Both sides of one transfer compute the same tag...
    const int up = TagSpace::transport(0, 1, true, user_tag);
    CHECK(TagSpace::transport(1, 0, false, user_tag) == up);
    const int down = TagSpace::transport(1, 0, true, user_tag);
    CHECK(TagSpace::transport(0, 1, false, user_tag) == down);
    // ...and the two directions different ones.
    CHECK(up != down);
    CHECK(seen.insert(up).second);
    CHECK(seen.insert(down).second);
    CHECK(up >= 0);
    CHECK(down < 2 * td::kMaxUserTag);
  }
  CHECK(t.next_call_block(0, 1, true, 0, "test").base >= 2 * td::kMaxUserTag);
}

TEST_CASE("an MPI_TAG_UB too small for point to point is an error naming it", "[runtime][tags]") {
  TagSpace t(32767);  // the least the MPI standard allows
  CHECK(TagSpace::transport(0, 1, true, td::kMaxUserTag - 1) <= 32767);
  CHECK_THROWS_WITH(t.next_call_block(0, 1, true, 0, "TensorDict.send"),
                    Catch::Contains("TensorDict.send") && Catch::Contains("MPI_TAG_UB (32767)"));
}

// ---- AVG's division (runtime/mpi_types.cpp) --------------------------------------------------

namespace {

// AVG's division runs vectorised, and by multiplication for a power-of-two group: the results
// must still be the bits of dividing each element on its own (what the test oracle and a
// hand-written loop give), subnormals, infinities and the largest values included.
template <class T>
std::vector<T> avg_inputs() {
  std::vector<T> v;
  std::uint64_t s = 0x9e3779b97f4a7c15ULL;
  for (int i = 0; i < 4099; ++i) {  // not a multiple of any packet size
    s = s * 6364136223846793005ULL + 1442695040888963407ULL;
    const auto bits = static_cast<std::conditional_t<sizeof(T) == 4, std::uint32_t, std::uint64_t>>(
        sizeof(T) == 4 ? (s >> 32) : s);
    T x;
    std::memcpy(&x, &bits, sizeof x);
    if (std::isnan(x)) x = T(1.5);
    v.push_back(x);
  }
  for (T x : {std::numeric_limits<T>::denorm_min(), std::numeric_limits<T>::min(),
              std::numeric_limits<T>::max(), -std::numeric_limits<T>::max(),
              std::numeric_limits<T>::infinity(), T(0), -T(0), T(3), T(1) / T(3)})
    v.push_back(x);
  return v;
}

}  // namespace

TEMPLATE_TEST_CASE("divide_in_place gives the bits of an element-wise division", "[avg]", float,
                   double) {
  using T = TestType;
  const td::DType dt = std::is_same_v<T, float> ? td::DType::Float32 : td::DType::Float64;
  for (int divisor = 1; divisor <= 9; ++divisor) {
    CAPTURE(divisor);
    std::vector<T> got = avg_inputs<T>();
    std::vector<T> want = got;
    volatile T d = static_cast<T>(divisor);  // a division the compiler cannot rewrite
    for (T& x : want) x = x / d;
    td::detail::divide_in_place(got.data(), static_cast<std::int64_t>(got.size()), dt, divisor);
    CHECK(std::memcmp(got.data(), want.data(), got.size() * sizeof(T)) == 0);
  }
  // Complex values: real and imaginary parts each divided.
  std::vector<std::complex<T>> c = {{T(1), T(-3)}, {std::numeric_limits<T>::denorm_min(), T(7)}};
  td::detail::divide_in_place(
      c.data(), 2, std::is_same_v<T, float> ? td::DType::Complex64 : td::DType::Complex128, 3);
  volatile T three = 3;
  CHECK(c[0].real() == T(1) / three);
  CHECK(c[0].imag() == T(-3) / three);
  CHECK(c[1].real() == std::numeric_limits<T>::denorm_min() / three);
  CHECK(c[1].imag() == T(7) / three);
}

// ---- deadlines (runtime/watchdog.cpp) -------------------------------------------------------

TEST_CASE("deadline_after: now + timeout, saturating; is_unbounded tells 'no limit' apart",
          "[runtime][deadline]") {
  using std::chrono::hours;
  using std::chrono::milliseconds;
  using Clock = std::chrono::steady_clock;
  constexpr auto kYear = hours(24 * 365);
  // A finite timeout: now + timeout, and a deadline that is watched.
  auto before = Clock::now();
  auto d = td::detail::deadline_after(milliseconds(1500));
  auto after = Clock::now();
  CHECK(d >= before + milliseconds(1500));
  CHECK(d <= after + milliseconds(1500));
  CHECK_FALSE(td::detail::is_unbounded(d));
  // Zero and negative timeouts: now (a negative one is not a deadline in the past).
  before = Clock::now();
  d = td::detail::deadline_after(milliseconds(-5000));
  after = Clock::now();
  CHECK(d >= before);
  CHECK(d <= after);
  CHECK_FALSE(td::detail::is_unbounded(d));
  CHECK_FALSE(td::detail::is_unbounded(td::detail::deadline_after(milliseconds(0))));
  // A long but finite timeout is still a deadline.
  CHECK_FALSE(td::detail::is_unbounded(td::detail::deadline_after(kYear)));
  // milliseconds::max() (the natural "no limit") saturates: no overflow into the past, and a
  // deadline the watchdog does not watch. So does any timeout of a century or more.
  for (const milliseconds forever : {milliseconds::max(), milliseconds::max() / 2,
                                     std::chrono::duration_cast<milliseconds>(100 * kYear)}) {
    const auto unbounded = td::detail::deadline_after(forever);
    CHECK(unbounded > Clock::now() + 50 * kYear);
    CHECK(td::detail::is_unbounded(unbounded));
  }
  // Deadlines nobody made with deadline_after.
  CHECK(td::detail::is_unbounded(Clock::time_point::max()));
  CHECK_FALSE(td::detail::is_unbounded(Clock::now()));
  CHECK_FALSE(td::detail::is_unbounded(Clock::time_point{}));
}

// ---- a pending operation's phases (runtime/work.cpp) ----------------------------------------
// A WorkState without requests completes its phase at once: test() makes no MPI call then, so
// the phase machinery (next phases, finish, errors, abandon, the timeout of wait) runs here
// without MPI. The tests with requests are test_internal_mpi's.

TEST_CASE("WorkState: finish runs once, after every phase, in order", "[runtime][work]") {
  td::detail::WorkState w;
  std::vector<int> order;
  w.then = [&](td::detail::WorkState& s) {
    order.push_back(1);
    s.then = [&](td::detail::WorkState&) { order.push_back(2); };  // a phase posting nothing
  };
  w.finish = [&] { order.push_back(3); };
  CHECK_FALSE(w.settled());
  CHECK_FALSE(w.test());  // phase 1 ran and set a next phase: not done yet
  CHECK(order == std::vector<int>{1});
  CHECK_FALSE(w.settled());
  CHECK(w.test());  // phase 2, then finish
  CHECK(order == std::vector<int>{1, 2, 3});
  CHECK(w.settled());
  // Later tests and waits run nothing again.
  CHECK(w.test());
  w.wait();
  w.wait();
  CHECK(order == std::vector<int>{1, 2, 3});
  CHECK_FALSE(w.timed_out());
}

TEST_CASE("WorkState: wait() drives the phases itself and releases what the operation held",
          "[runtime][work]") {
  td::detail::WorkState w;
  int phases = 0, finished = 0;
  auto held = std::make_shared<int>(7);
  const std::weak_ptr<int> watch = held;
  w.held.push_back(std::move(held));
  w.then = [&](td::detail::WorkState& s) {
    ++phases;
    s.then = [&](td::detail::WorkState&) { ++phases; };
  };
  w.finish = [&] { ++finished; };
  w.deadline = td::detail::deadline_after(std::chrono::seconds(30));
  w.wait();
  CHECK(phases == 2);
  CHECK(finished == 1);
  CHECK(watch.expired());  // completed: its buffers are let go
}

TEST_CASE("WorkState: a failing phase's error is what wait() rethrows; finish never runs",
          "[runtime][work]") {
  td::detail::WorkState w;
  bool finished = false, later_phase = false;
  w.then = [&](td::detail::WorkState& s) {
    s.then = [&](td::detail::WorkState&) { later_phase = true; };
    throw std::runtime_error("the handshake said no");
  };
  w.finish = [&] { finished = true; };
  CHECK(w.test());  // settled: failed
  CHECK(w.settled());
  CHECK_THROWS_WITH(w.wait(), "the handshake said no");
  CHECK_THROWS_AS(w.wait(), std::runtime_error);  // every wait() rethrows it
  CHECK(w.test());
  CHECK_FALSE(finished);
  CHECK_FALSE(later_phase);
}

TEST_CASE("WorkState: an error thrown by finish is the operation's error", "[runtime][work]") {
  td::detail::WorkState w;
  w.finish = [] { throw td::Error("copying back failed"); };
  CHECK(w.test());
  CHECK(w.settled());
  CHECK_THROWS_AS(w.wait(), td::Error);
  CHECK_THROWS_WITH(w.wait(), "copying back failed");
}

TEST_CASE(
    "WorkState: abandon fails a pending operation and keeps its buffers; settled ones are "
    "left alone",
    "[runtime][work]") {
  td::detail::WorkState pending;
  bool ran = false;
  auto held = std::make_shared<int>(1);
  const std::weak_ptr<int> watch = held;
  pending.held.push_back(std::move(held));
  pending.then = [&](td::detail::WorkState&) { ran = true; };
  pending.finish = [&] { ran = true; };
  pending.abandon(std::make_exception_ptr(td::Error("destroy_process_group: given up")));
  CHECK(pending.settled());
  CHECK_THROWS_WITH(pending.wait(), "destroy_process_group: given up");
  CHECK(pending.test());
  CHECK_FALSE(ran);              // neither its next phase nor finish
  CHECK_FALSE(watch.expired());  // leaked on purpose: MPI may still write into it

  td::detail::WorkState done;
  done.finish = [] {};
  CHECK(done.test());
  done.abandon(std::make_exception_ptr(td::Error("too late")));
  CHECK_NOTHROW(done.wait());
}

TEST_CASE(
    "WorkState: wait() ends a phase that never completes with td::TimeoutError at its "
    "deadline",
    "[runtime][work][deadline]") {
  td::detail::WorkState w;
  int phases = 0;
  std::function<void(td::detail::WorkState&)> again = [&](td::detail::WorkState& s) {
    ++phases;
    s.then = again;  // always one more phase: never done
  };
  w.then = again;
  w.describe = [] { return std::string("all_reduce of bucket 3 (test)"); };
  const auto start = std::chrono::steady_clock::now();
  w.deadline = td::detail::deadline_after(std::chrono::milliseconds(200));
  CHECK_THROWS_AS(w.wait(), td::TimeoutError);
  const auto waited = std::chrono::steady_clock::now() - start;
  CHECK(waited >= std::chrono::milliseconds(200));
  CHECK(waited < std::chrono::seconds(20));
  CHECK(w.timed_out());
  CHECK_FALSE(w.settled());
  // The message names the operation and what the timeout means.
  td::detail::WorkState v;
  v.then = again;
  v.describe = w.describe;
  v.deadline = std::chrono::steady_clock::now();
  CHECK_THROWS_WITH(v.wait(), Catch::Contains("all_reduce of bucket 3 (test)") &&
                                  Catch::Contains("did not complete before its timeout"));
  // A timed-out operation runs no more phases.
  const int seen = phases;
  CHECK_FALSE(w.test());
  CHECK(phases == seen);
}

// ---- the progress thread's default (runtime/progress.cpp, runtime/process_group.cpp) --------

// The process-wide decision: made once, by whoever comes first of TD_PROGRESS_THREAD (read by
// async_progress_enabled), td::set_async_progress and init's default. One test case: the
// decision is the process's.
TEST_CASE("progress_thread_default decides only what nothing decided before",
          "[runtime][progress]") {
  CHECK(td::detail::progress_thread_default(false));       // undecided: this call decides (off)
  CHECK_FALSE(td::async_progress_enabled());               // off: no MPI call needed to say so
  CHECK_FALSE(td::detail::progress_thread_default(true));  // decided already: no change
  CHECK_FALSE(td::async_progress_enabled());
  td::set_async_progress(true);  // the user's call overrides the default...
  CHECK_FALSE(td::detail::progress_thread_default(false));  // ...and a later default does not
  td::set_async_progress(false);
  CHECK_FALSE(td::async_progress_enabled());
}

TEST_CASE("progress_thread_on: off only across hosts under Open MPI before 5; the setting wins",
          "[runtime][progress]") {
  using td::detail::progress_thread_on;
  const std::string v41 =
      "Open MPI v4.1.4, package: Debian OpenMPI, ident: 4.1.4, repo rev: v4.1.4";
  const std::string v3 = "Open MPI v3.1.6, package: Open MPI, ident: 3.1.6";
  const std::string v5 = "Open MPI v5.0.3, package: Open MPI, ident: 5.0.3";
  const std::string v10 = "Open MPI v10.0.0, package: Open MPI";  // not "v1."
  const std::string mpich = "MPICH Version:\t4.0\nMPICH Release date: Fri Jan 21 10:42:29 CST 2022";
  // One host (every rank here), or one rank: on, whatever the library.
  for (const std::string& v : {v41, v3, v5, mpich}) {
    CHECK(progress_thread_on(4, 4, v, std::nullopt));
    CHECK(progress_thread_on(1, 1, v, std::nullopt));
  }
  // Several hosts: off under Open MPI 1-4, on under 5 and later and other libraries.
  CHECK_FALSE(progress_thread_on(4, 2, v41, std::nullopt));
  CHECK_FALSE(progress_thread_on(3, 1, v41, std::nullopt));
  CHECK_FALSE(progress_thread_on(4, 2, v3, std::nullopt));
  CHECK_FALSE(progress_thread_on(2, 1, "Open MPI v4", std::nullopt));
  CHECK(progress_thread_on(4, 2, v5, std::nullopt));
  CHECK(progress_thread_on(4, 2, v10, std::nullopt));
  CHECK(progress_thread_on(4, 2, mpich, std::nullopt));
  CHECK(progress_thread_on(4, 2, "", std::nullopt));
  CHECK(progress_thread_on(4, 2, "Open MPI v", std::nullopt));
  // TD_PROGRESS_THREAD decides either way, on one host or several.
  for (const std::string& v : {v41, v5}) {
    CHECK(progress_thread_on(4, 2, v, true));
    CHECK_FALSE(progress_thread_on(4, 2, v, false));
    CHECK(progress_thread_on(4, 4, v, true));
    CHECK_FALSE(progress_thread_on(4, 4, v, false));
    CHECK_FALSE(progress_thread_on(1, 1, v, false));
  }
}
