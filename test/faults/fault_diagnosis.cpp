// The diagnosis of a timeout (issue 29): one program per situation, run at 2, 3 and 4 ranks.
// The last rank (rank L) misbehaves in one way; the ranks that time out check the
// td::RankStatus entries of their TimeoutError and its first sentence. Every rank's verdict is
// combined on a group the misbehaving rank can still join, then rank 0 prints it and ends the
// job (the timed-out group is unusable, as after every timeout).
//
//   fault_diagnosis sleep            L sleeps in its own code         -> Outside, after call #1
//   fault_diagnosis no_call          L sleeps before any call          -> Outside, no call made,
//                                    (the others' call is #1)             since init
//   fault_diagnosis other_collective L calls barrier, the others      -> LayoutMismatchError
//                                    all_reduce                          on every rank
//   fault_diagnosis other_call       L waits in recv_dict (same group) -> InOtherCall
//   fault_diagnosis other_group      L calls all_reduce on group E     -> InOtherCall (group E)
//   fault_diagnosis exited           L exited (without finalize)       -> NoAnswer
//   fault_diagnosis extra_step       L runs one more Reducer step      -> the others Outside after
//                                                                       step #2; "one Reducer
//                                                                       step more"
//   fault_diagnosis raw_mpi          L blocks in a raw MPI_Recv with   -> NoAnswer
//                                    TD_PROGRESS_THREAD=0
//   fault_diagnosis silent_async     L joins an async call of 12       -> NoAnswer, one
//                                    buckets, then sleeps without its     diagnosis for all
//                                    progress thread                      the buckets
//
// With TD_FLIGHT_RECORDER_DIR set, every rank that times out or is asked writes its dump there
// (test/faults/flight_analyzer.sh reads them back with td-flight); other_collective, which ends
// in a LayoutMismatchError (no dump), writes each rank's own with td::dump_flight_recorder.
#include <mpi.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include <tensordict/tensordict.hpp>

namespace {

using namespace std::chrono;
using State = td::RankStatus::State;

int g_failures = 0;

void check(bool ok, const std::string& what) {
  if (!ok) {
    ++g_failures;
    std::printf("rank %d: CHECK FAILED: %s\n", td::get_rank(), what.c_str());
    std::fflush(stdout);
  }
}

bool contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

const char* state_name(State s) {
  switch (s) {
    case State::InThisCall:
      return "InThisCall";
    case State::InOtherCall:
      return "InOtherCall";
    case State::Outside:
      return "Outside";
    case State::NoAnswer:
      return "NoAnswer";
  }
  return "?";
}

void print(const td::TimeoutError& e) {
  std::printf("rank %d: TimeoutError: %s\n", td::get_rank(), e.what());
  for (const td::RankStatus& s : e.diagnosis())
    std::printf("rank %d:   status of rank %d: %s seq %llu since %lld ms: %s\n", td::get_rank(),
                s.rank, state_name(s.state), static_cast<unsigned long long>(s.seq),
                static_cast<long long>(s.since.count()), s.call.c_str());
  std::fflush(stdout);
}

// `call()`, expected to throw a TimeoutError: that error, printed.
template <class Call>
td::TimeoutError timed_out(const std::string& what, Call&& call) {
  try {
    call();
  } catch (const td::TimeoutError& e) {
    print(e);
    return e;
  }
  check(false, what + " did not time out");
  return td::TimeoutError("none");
}

// The all_reduce of the ranks that wait (call `seq` on `g`), expected to time out.
td::TimeoutError timed_out_all_reduce(td::TensorDict& d, const td::ProcessGroup& g) {
  return timed_out("the all_reduce", [&] {
    d.all_reduce(td::ReduceOp::SUM, {.group = g, .timeout = milliseconds(1000)});
  });
}

// Ranks [0, L) are in the call: InThisCall at `seq`.
void check_waiting(const td::TimeoutError& e, int last, std::uint64_t seq) {
  const auto& d = e.diagnosis();
  check(static_cast<int>(d.size()) == last + 1, "one status per rank of the group");
  for (int r = 0; r < last && r < static_cast<int>(d.size()); ++r) {
    check(d[r].rank == r, "statuses in rank order");
    check(d[r].state == State::InThisCall, "rank " + std::to_string(r) + " is in this call");
    check(d[r].seq == seq, "rank " + std::to_string(r) + " is in call #" + std::to_string(seq));
  }
}

const td::RankStatus& status_of(const td::TimeoutError& e, int r) {
  static const td::RankStatus none;
  return r < static_cast<int>(e.diagnosis().size()) ? e.diagnosis()[r] : none;
}

// What every scenario shares: the groups, the dict, the names of the call under test.
struct Setup {
  int rank = 0, size = 0, last = 0;
  // Made in main (new_group, collective over world); world until then.
  td::ProcessGroup d_group = td::world(), e_group = td::world(), verdict_group = td::world();
  td::TensorDict d;
  std::string this_call;   // "TensorDict.all_reduce #2 on group 1"
  std::string who;         // the last rank: "rank 2"
  std::string waiters;     // the others: "ranks 0, 1"
  bool first_call = true;  // every rank made call #1 on group 1 (all but no_call)
};

// Each returns whether the last rank joins the verdict (false: it is gone or unreachable).
using Scenario = bool (*)(Setup&);

// The last rank sleeps in its own code: after call #1 (sleep), or before making any call
// (no_call: outside the library since init and its groups' creation, not "for 0.0 s").
bool sleep_scenario(Setup& s) {
  if (s.rank == s.last) {
    std::this_thread::sleep_for(seconds(3));
    return true;
  }
  const td::TimeoutError e = timed_out_all_reduce(s.d, s.d_group);
  check_waiting(e, s.last, s.first_call ? 2 : 1);
  const td::RankStatus& st = status_of(e, s.last);
  check(st.state == State::Outside, "the sleeping rank is outside the library");
  check(st.since >= milliseconds(800),
        "it has been outside for about the timeout: " + std::to_string(st.since.count()) + " ms");
  const std::string first = s.who + " has not called " + s.this_call + ": it has ";
  if (!s.first_call) {
    check(st.seq == 0 && st.call.empty(), "it made no call: " + st.call);
    check(contains(e.what(), first + "made no call yet, and has been outside the library for "),
          "first sentence");
    return true;
  }
  check(st.seq == 1, "it completed call #1");
  check(contains(st.call, "TensorDict.all_reduce #1 on group 1 ('grads.b', 2 leaves)"),
        "its last call is named: " + st.call);
  check(contains(e.what(), first + "been outside the library for "), "first sentence");
  check(contains(e.what(), "since it completed TensorDict.all_reduce #1 on group 1"),
        "first sentence names the last call");
  return true;
}

// Agreed like every collective: a LayoutMismatchError on every rank, not a timeout (before
// issue 29 a bare MPI_Ibarrier completed against the others' agreement round).
bool other_collective_scenario(Setup& s) {
  try {
    if (s.rank == s.last) {
      td::barrier(s.d_group);
    } else {
      s.d.all_reduce(td::ReduceOp::SUM, {.group = s.d_group, .timeout = milliseconds(5000)});
    }
    check(false, "no error");
  } catch (const td::LayoutMismatchError& e) {
    std::printf("rank %d: LayoutMismatchError: %s\n", s.rank, e.what());
    check(contains(e.what(), "ranks called different collectives"), "names the cause");
    check(contains(e.what(), "barrier(") && contains(e.what(), "TensorDict.all_reduce("),
          "names both calls");
  } catch (const std::exception& e) {
    std::printf("rank %d: other error: %s\n", s.rank, e.what());
    check(false, "expected a LayoutMismatchError");
  }
  // No incident writes a dump here: the program writes each rank's own, in the directory's
  // file, which rank 0's td::abort then leaves as it is.
  if (const char* dir = std::getenv("TD_FLIGHT_RECORDER_DIR"))
    td::dump_flight_recorder(std::filesystem::path(dir) /
                             ("rank-" + std::to_string(s.rank) + ".json"));
  return true;
}

// The ranks that wait in call #2, while the last rank waits in call #1 `other` (of another
// kind or group). Returns true: the last rank joins the verdict.
bool waiting_for_one_in(Setup& s, const std::string& other) {
  const td::TimeoutError e = timed_out_all_reduce(s.d, s.d_group);
  check_waiting(e, s.last, 2);
  const td::RankStatus& st = status_of(e, s.last);
  check(st.state == State::InOtherCall, "the last rank is in another call");
  check(st.seq == 1, "its call #1");
  check(contains(st.call, other), "names it: " + st.call);
  check(contains(e.what(), s.who + " has not called " + s.this_call + ": it waits in " + other),
        "first sentence");
  std::this_thread::sleep_for(seconds(2));
  return true;
}

bool other_call_scenario(Setup& s) {
  if (s.rank != s.last) return waiting_for_one_in(s, "td.recv_dict #1 (point to point) on group 1");
  const td::TimeoutError e = timed_out(
      "recv_dict", [&] { td::recv_dict(0, {.group = s.d_group, .timeout = milliseconds(1500)}); });
  check(status_of(e, 0).state == State::Outside, "rank 0 is outside (after its timeout)");
  check(contains(e.what(), "rank 0, the peer of td.recv_dict #1 (point to point) on group 1"),
        "first sentence names the peer");
  return true;
}

bool other_group_scenario(Setup& s) {
  if (s.rank != s.last) return waiting_for_one_in(s, "TensorDict.all_reduce #1 on group 2");
  const td::TimeoutError e = timed_out("the all_reduce on group 2", [&] {
    s.d.all_reduce(td::ReduceOp::SUM, {.group = s.e_group, .timeout = milliseconds(1500)});
  });
  for (int r = 0; r < s.last; ++r) {
    check(status_of(e, r).state == State::Outside,
          "rank " + std::to_string(r) + " is outside (after its timeout)");
    check(status_of(e, r).seq == 0, "no call on group 2");
  }
  check(contains(e.what(), "not called TensorDict.all_reduce #1 on group 2"), "first sentence");
  check(contains(e.what(),
                 "since TensorDict.all_reduce #2 on group 1 ('grads.b', 2 leaves) "
                 "failed (no call on group 2 yet)"),
        "names their last call");
  return true;
}

bool exited_scenario(Setup& s) {
  if (s.rank == s.last) {
    // Gone without a word: no finalize (a process in MPI_Finalize while another calls
    // MPI_Abort leaves Open MPI 4.1's mpiexec hanging now and then). The test runs with
    // orte_allowed_exit_without_sync, so that mpiexec lets the others go on.
    std::fflush(stdout);
    std::_Exit(0);
  }
  const td::TimeoutError e = timed_out_all_reduce(s.d, s.d_group);
  check_waiting(e, s.last, 2);
  check(status_of(e, s.last).state == State::NoAnswer, "the exited rank does not answer");
  check(contains(e.what(), s.who + " did not answer within"), "first sentence");
  return false;
}

// An async call of 12 buckets, one Work each: rank L joins it (so the agreement passes), then
// neither progresses it nor answers (no progress thread, asleep in its own code; a rank that
// exited on this host is seen gone at once, a cut link is not). The others' buckets time out
// one after the other: that must cost one timeout and one diagnosis, not one TD_DIAGNOSIS_MS
// of silence per bucket (a cut link once took 3 + 14 x 2 s to report).
bool silent_async_scenario(Setup& s) {
  td::TensorDict many;
  for (int i = 0; i < 12; ++i) {
    std::string name = "w";  // appended: GCC 12 -Wrestrict misfires on "w" + std::to_string(i)
    name += std::to_string(i);
    many.set(name, td::Tensor::full<float>({1024}, 1.f));
  }
  const auto start = steady_clock::now();
  std::vector<td::Work> works = many.all_reduce(
      td::ReduceOp::SUM,
      {.group = s.d_group, .async_op = true, .bucket_bytes = 4096, .timeout = milliseconds(1000)});
  if (s.rank == s.last) {
    std::this_thread::sleep_for(seconds(30));  // ended by rank 0's abort
    std::_Exit(0);
  }
  check(works.size() >= 12, "one Work per bucket");
  int timeouts = 0;
  for (td::Work& w : works) {  // as td::wait_all does
    try {
      w.wait();
    } catch (const td::TimeoutError& e) {
      if (timeouts++ == 0) {
        print(e);
        check(status_of(e, s.last).state == State::NoAnswer, "the silent rank does not answer");
        check(contains(e.what(), s.who + " did not answer within"), "first sentence");
      }
    }
  }
  const auto waited = duration_cast<milliseconds>(steady_clock::now() - start).count();
  std::printf("rank %d: %d of %zu buckets timed out, after %lld ms in all\n", s.rank, timeouts,
              works.size(), static_cast<long long>(waited));
  // 1 s timeout + 2 s diagnosis (TD_DIAGNOSIS_MS's default) + slack for a loaded machine.
  check(waited < 8000, "failed after one diagnosis, not one per bucket");
  // A rank's buckets may all complete without rank L (at 3 ranks, rank 1's do): some rank's
  // must have timed out several times, else this run tests nothing.
  td::Tensor most = td::Tensor::full<int>({1}, timeouts);
  td::all_reduce(most, td::ReduceOp::MAX, {.group = s.verdict_group});
  check(most.to_vector<int>()[0] >= 2, "some rank had several buckets time out");
  return false;
}

bool extra_step_scenario(Setup& s) {
  td::TensorDict grads;
  grads.set("w", td::Tensor::full<float>({256}, 1.f));
  td::Reducer reducer(grads, {.group = s.d_group, .timeout = milliseconds(1000)});
  for (int step = 0; step < 2; ++step) {
    reducer.mark_ready("w");
    reducer.finish();
  }
  if (s.rank != s.last) {
    std::this_thread::sleep_for(seconds(3));
    return true;
  }
  const td::TimeoutError e = timed_out("the extra step", [&] {
    reducer.mark_ready("w");
    reducer.finish();
  });
  for (int r = 0; r < s.last; ++r) {
    check(status_of(e, r).state == State::Outside, "rank " + std::to_string(r) + " is outside");
    check(status_of(e, r).seq == 2, "after step #2");
  }
  check(status_of(e, s.last).state == State::InThisCall && status_of(e, s.last).seq == 3,
        "this rank is in step #3");
  check(contains(e.what(), "not called Reducer step #3 on Reducer"), "first sentence");
  check(contains(e.what(), "completed Reducer step #2"), "names the last step");
  check(contains(e.what(), s.who + " runs one Reducer step more than " + s.waiters),
        "names the misuse");
  return true;
}

bool raw_mpi_scenario(Setup& s) {
  MPI_Comm raw;
  MPI_Comm_dup(MPI_COMM_WORLD, &raw);
  if (s.rank == s.last) {
    int x = 0;
    MPI_Recv(&x, 1, MPI_INT, 0, 99, raw, MPI_STATUS_IGNORE);  // until rank 0 has its verdict
    return true;
  }
  const td::TimeoutError e = timed_out_all_reduce(s.d, s.d_group);
  check_waiting(e, s.last, 2);
  check(status_of(e, s.last).state == State::NoAnswer, "the blocked rank does not answer");
  check(contains(e.what(), s.who + " did not answer within"), "first sentence");
  if (s.rank == 0) {
    int x = 1;
    MPI_Send(&x, 1, MPI_INT, s.last, 99, raw);
  }
  return true;
}

const std::map<std::string, Scenario>& scenarios() {
  static const std::map<std::string, Scenario> all{{"sleep", &sleep_scenario},
                                                   {"no_call", &sleep_scenario},
                                                   {"other_collective", &other_collective_scenario},
                                                   {"other_call", &other_call_scenario},
                                                   {"other_group", &other_group_scenario},
                                                   {"exited", &exited_scenario},
                                                   {"silent_async", &silent_async_scenario},
                                                   {"extra_step", &extra_step_scenario},
                                                   {"raw_mpi", &raw_mpi_scenario}};
  return all;
}

std::string ranks_below(int last) {
  if (last == 1) return "rank 0";
  if (last == 2) return "ranks 0, 1";
  return "ranks 0-" + std::to_string(last - 1);
}

}  // namespace

int main(int argc, char** argv) {
  const std::string scenario = argc > 1 ? argv[1] : "";
  // raw_mpi: the last rank runs without its progress thread (decided before init).
  const char* wr = std::getenv("OMPI_COMM_WORLD_RANK");
  const char* ws = std::getenv("OMPI_COMM_WORLD_SIZE");
  if ((scenario == "raw_mpi" || scenario == "silent_async") && wr && ws &&
      std::atoi(wr) == std::atoi(ws) - 1)
    setenv("TD_PROGRESS_THREAD", "0", 1);
  td::init_process_group(argc, argv);
  auto found = scenarios().find(scenario);
  if (found == scenarios().end()) {
    std::printf("fault_diagnosis: unknown scenario '%s'\n", scenario.c_str());
    td::abort("bad arguments", 2);
  }
  Setup s;
  s.rank = td::get_rank();
  s.size = td::get_world_size();
  s.last = s.size - 1;
  if (s.size < 2) {
    std::printf("fault_diagnosis: needs at least 2 ranks\n");
    return 1;
  }
  std::vector<int> everyone, waiting;
  for (int r = 0; r < s.size; ++r) everyone.push_back(r);
  for (int r = 0; r < s.last; ++r) waiting.push_back(r);
  // Collective over world, in this order on every rank: group 1 (the call under test), group 2
  // (another group), group 3 (the verdict, without the last rank).
  s.d_group = td::new_group(everyone);
  s.e_group = td::new_group(everyone);
  s.verdict_group = td::new_group(waiting);
  s.d.set({"grads", "w"}, td::Tensor::full<float>({64}, 1.f));
  s.d.set({"grads", "b"}, td::Tensor::full<float>({8}, 1.f));
  s.first_call = scenario != "no_call";
  if (s.first_call) s.d.all_reduce(td::ReduceOp::SUM, {.group = s.d_group});  // #1, by everyone
  s.this_call = std::string("TensorDict.all_reduce #") + (s.first_call ? "2" : "1") + " on group 1";
  s.who = "rank " + std::to_string(s.last);
  s.waiters = ranks_below(s.last);
  const bool verdict_with_last = found->second(s);

  // Every rank's verdict, then rank 0 reports and ends the job.
  td::Tensor failures = td::Tensor::full<int>({1}, g_failures);
  if (verdict_with_last || s.rank != s.last)
    td::all_reduce(failures, td::ReduceOp::SUM,
                   {.group = verdict_with_last ? td::world() : s.verdict_group});
  if (s.rank != 0) {
    std::this_thread::sleep_for(seconds(30));  // ended by rank 0's abort
    return 0;
  }
  const bool ok = failures.to_vector<int>()[0] == 0;
  std::printf("rank 0: diagnosis %s: %s\n", scenario.c_str(), ok ? "ok" : "FAILED");
  std::fflush(stdout);
  td::abort(ok ? "ending the job after the expected timeout" : "diagnosis test failed", ok ? 3 : 4);
}
