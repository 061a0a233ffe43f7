// The diagnosis of a timeout (issue 29): one program per situation, run at 2, 3 and 4 ranks.
// The last rank (rank L) misbehaves in one way; the ranks that time out check the
// td::RankStatus entries of their TimeoutError and its first sentence. Every rank's verdict is
// combined on a group the misbehaving rank can still join, then rank 0 prints it and ends the
// job (the timed-out group is unusable, as after every timeout).
//
//   fault_diagnosis sleep            L sleeps in its own code         -> Outside, after call #1
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
#include <mpi.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
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

// The all_reduce of the ranks that wait (call `seq` on `g`), expected to time out.
td::TimeoutError timed_out_all_reduce(td::TensorDict& d, const td::ProcessGroup& g) {
  try {
    d.all_reduce(td::ReduceOp::SUM, {.group = g, .timeout = milliseconds(1000)});
  } catch (const td::TimeoutError& e) {
    print(e);
    return e;
  }
  check(false, "the all_reduce did not time out");
  return td::TimeoutError("none");
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
  const int rank = td::get_rank(), size = td::get_world_size();
  const int last = size - 1;
  if (size < 2) {
    std::printf("fault_diagnosis: needs at least 2 ranks\n");
    return 1;
  }
  std::vector<int> everyone, waiting;
  for (int r = 0; r < size; ++r) everyone.push_back(r);
  for (int r = 0; r < last; ++r) waiting.push_back(r);
  // Collective over world, in this order on every rank: group 1 (the call under test), group 2
  // (another group), group 3 (the verdict, without the last rank).
  td::ProcessGroup d_group = td::new_group(everyone);
  td::ProcessGroup e_group = td::new_group(everyone);
  td::ProcessGroup verdict_group = td::new_group(waiting);
  td::TensorDict d;
  d.set({"grads", "w"}, td::Tensor::full<float>({64}, 1.f));
  d.set({"grads", "b"}, td::Tensor::full<float>({8}, 1.f));
  d.all_reduce(td::ReduceOp::SUM, {.group = d_group});  // call #1 on group 1, by everyone
  const std::string this_call = "TensorDict.all_reduce #2 on group 1";
  const std::string who = last == 1 ? "rank 1" : "rank " + std::to_string(last);
  const std::string waiters = last == 1   ? std::string("rank 0")
                              : last == 2 ? std::string("ranks 0, 1")
                                          : "ranks 0-" + std::to_string(last - 1);
  bool verdict_with_last = true;

  if (scenario == "sleep") {
    if (rank == last) {
      std::this_thread::sleep_for(seconds(3));
    } else {
      const td::TimeoutError e = timed_out_all_reduce(d, d_group);
      check_waiting(e, last, 2);
      const td::RankStatus& s = status_of(e, last);
      check(s.state == State::Outside, "the sleeping rank is outside the library");
      check(s.seq == 1, "it completed call #1");
      check(contains(s.call, "TensorDict.all_reduce #1 on group 1 ('grads.b', 2 leaves)"),
            "its last call is named: " + s.call);
      check(s.since >= milliseconds(800), "it has been outside for about the timeout");
      check(contains(e.what(), who + " has not called " + this_call +
                                   ": it has been outside the library for "),
            "first sentence");
      check(contains(e.what(), "since it completed TensorDict.all_reduce #1 on group 1"),
            "first sentence names the last call");
    }
  } else if (scenario == "other_collective") {
    // Agreed like every collective: a LayoutMismatchError on every rank, not a timeout (before
    // issue 29 a bare MPI_Ibarrier completed against the others' agreement round).
    try {
      if (rank == last) {
        td::barrier(d_group);
      } else {
        d.all_reduce(td::ReduceOp::SUM, {.group = d_group, .timeout = milliseconds(5000)});
      }
      check(false, "no error");
    } catch (const td::LayoutMismatchError& e) {
      std::printf("rank %d: LayoutMismatchError: %s\n", rank, e.what());
      check(contains(e.what(), "ranks called different collectives"), "names the cause");
      check(contains(e.what(), "barrier(") && contains(e.what(), "TensorDict.all_reduce("),
            "names both calls");
    } catch (const std::exception& e) {
      std::printf("rank %d: other error: %s\n", rank, e.what());
      check(false, "expected a LayoutMismatchError");
    }
  } else if (scenario == "other_call") {
    if (rank == last) {
      try {
        td::recv_dict(0, {.group = d_group, .timeout = milliseconds(1500)});
        check(false, "recv_dict did not time out");
      } catch (const td::TimeoutError& e) {
        print(e);
        check(status_of(e, 0).state == State::Outside, "rank 0 is outside (after its timeout)");
        check(contains(e.what(), "rank 0, the peer of td.recv_dict #1 (point to point) on group 1"),
              "first sentence names the peer");
      }
    } else {
      const td::TimeoutError e = timed_out_all_reduce(d, d_group);
      check_waiting(e, last, 2);
      const td::RankStatus& s = status_of(e, last);
      check(s.state == State::InOtherCall, "the last rank is in another call");
      check(contains(s.call, "td.recv_dict #1 (point to point) on group 1"), "names it: " + s.call);
      check(contains(e.what(), who + " has not called " + this_call +
                                   ": it waits in "
                                   "td.recv_dict #1 (point to point) on group 1"),
            "first sentence");
      std::this_thread::sleep_for(seconds(2));
    }
  } else if (scenario == "other_group") {
    if (rank == last) {
      try {
        d.all_reduce(td::ReduceOp::SUM, {.group = e_group, .timeout = milliseconds(1500)});
        check(false, "the all_reduce on group 2 did not time out");
      } catch (const td::TimeoutError& e) {
        print(e);
        for (int r = 0; r < last; ++r) {
          check(status_of(e, r).state == State::Outside,
                "rank " + std::to_string(r) + " is outside (after its timeout)");
          check(status_of(e, r).seq == 0, "no call on group 2");
        }
        check(contains(e.what(), "not called TensorDict.all_reduce #1 on group 2"),
              "first sentence");
        check(contains(e.what(),
                       "since TensorDict.all_reduce #2 on group 1 ('grads.b', 2 leaves) "
                       "failed (no call on group 2 yet)"),
              "names their last call");
      }
    } else {
      const td::TimeoutError e = timed_out_all_reduce(d, d_group);
      check_waiting(e, last, 2);
      const td::RankStatus& s = status_of(e, last);
      check(s.state == State::InOtherCall, "the last rank is in another call");
      check(s.seq == 1, "call #1 of group 2");
      check(contains(s.call, "TensorDict.all_reduce #1 on group 2"), "names it: " + s.call);
      check(contains(e.what(), who + " has not called " + this_call +
                                   ": it waits in "
                                   "TensorDict.all_reduce #1 on group 2"),
            "first sentence");
      std::this_thread::sleep_for(seconds(2));
    }
  } else if (scenario == "exited") {
    verdict_with_last = false;
    if (rank == last) {
      // Gone without a word: no finalize (a process in MPI_Finalize while another calls
      // MPI_Abort leaves Open MPI 4.1's mpiexec hanging now and then). The test runs with
      // orte_allowed_exit_without_sync, so that mpiexec lets the others go on.
      std::fflush(stdout);
      std::_Exit(0);
    }
    const td::TimeoutError e = timed_out_all_reduce(d, d_group);
    check_waiting(e, last, 2);
    check(status_of(e, last).state == State::NoAnswer, "the exited rank does not answer");
    check(contains(e.what(), who + " did not answer within"), "first sentence");
  } else if (scenario == "silent_async") {
    // An async call of 12 buckets, one Work each: rank L joins it (so the agreement passes), then
    // neither progresses it nor answers (no progress thread, asleep in its own code; a rank that
    // exited on this host is seen gone at once, a cut link is not). The others' buckets time out
    // one after the other: that must cost one timeout and one diagnosis, not one TD_DIAGNOSIS_MS
    // of silence per bucket (a cut link once took 3 + 14 x 2 s to report).
    verdict_with_last = false;
    td::TensorDict many;
    for (int i = 0; i < 12; ++i)
      many.set("w" + std::to_string(i), td::Tensor::full<float>({1024}, 1.f));
    const auto start = steady_clock::now();
    std::vector<td::Work> works = many.all_reduce(
        td::ReduceOp::SUM,
        {.group = d_group, .async_op = true, .bucket_bytes = 4096, .timeout = milliseconds(1000)});
    if (rank == last) {
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
          check(status_of(e, last).state == State::NoAnswer, "the silent rank does not answer");
          check(contains(e.what(), who + " did not answer within"), "first sentence");
        }
      }
    }
    const auto waited = duration_cast<milliseconds>(steady_clock::now() - start).count();
    std::printf("rank %d: %d of %zu buckets timed out, after %lld ms in all\n", rank, timeouts,
                works.size(), static_cast<long long>(waited));
    // 1 s timeout + 2 s diagnosis (TD_DIAGNOSIS_MS's default) + slack for a loaded machine.
    check(waited < 8000, "failed after one diagnosis, not one per bucket");
    // A rank's buckets may all complete without rank L (at 3 ranks, rank 1's do): some rank's
    // must have timed out several times, else this run tests nothing.
    td::Tensor most = td::Tensor::full<int>({1}, timeouts);
    td::all_reduce(most, td::ReduceOp::MAX, {.group = verdict_group});
    check(most.to_vector<int>()[0] >= 2, "some rank had several buckets time out");
  } else if (scenario == "extra_step") {
    td::TensorDict grads;
    grads.set("w", td::Tensor::full<float>({256}, 1.f));
    td::Reducer reducer(grads, {.group = d_group, .timeout = milliseconds(1000)});
    for (int step = 0; step < 2; ++step) {
      reducer.mark_ready("w");
      reducer.finish();
    }
    if (rank == last) {
      try {
        reducer.mark_ready("w");
        reducer.finish();
        check(false, "the extra step did not time out");
      } catch (const td::TimeoutError& e) {
        print(e);
        for (int r = 0; r < last; ++r) {
          check(status_of(e, r).state == State::Outside,
                "rank " + std::to_string(r) + " is outside");
          check(status_of(e, r).seq == 2, "after step #2");
        }
        check(status_of(e, last).state == State::InThisCall && status_of(e, last).seq == 3,
              "this rank is in step #3");
        check(contains(e.what(), "not called Reducer step #3 on Reducer"), "first sentence");
        check(contains(e.what(), "completed Reducer step #2"), "names the last step");
        check(contains(e.what(), "rank " + std::to_string(last) +
                                     " runs one Reducer step more than " + waiters),
              "names the misuse");
      }
    } else {
      std::this_thread::sleep_for(seconds(3));
    }
  } else if (scenario == "raw_mpi") {
    MPI_Comm raw;
    MPI_Comm_dup(MPI_COMM_WORLD, &raw);
    if (rank == last) {
      int x = 0;
      MPI_Recv(&x, 1, MPI_INT, 0, 99, raw, MPI_STATUS_IGNORE);  // until rank 0 has its verdict
    } else {
      const td::TimeoutError e = timed_out_all_reduce(d, d_group);
      check_waiting(e, last, 2);
      check(status_of(e, last).state == State::NoAnswer, "the blocked rank does not answer");
      check(contains(e.what(), who + " did not answer within"), "first sentence");
      if (rank == 0) {
        int x = 1;
        MPI_Send(&x, 1, MPI_INT, last, 99, raw);
      }
    }
  } else {
    std::printf("fault_diagnosis: unknown scenario '%s'\n", scenario.c_str());
    td::abort("bad arguments", 2);
  }

  // Every rank's verdict, then rank 0 reports and ends the job.
  td::Tensor failures = td::Tensor::full<int>({1}, g_failures);
  if (verdict_with_last || rank != last)
    td::all_reduce(failures, td::ReduceOp::SUM,
                   {.group = verdict_with_last ? td::world() : verdict_group});
  if (rank != 0) {
    std::this_thread::sleep_for(seconds(30));  // ended by rank 0's abort
    return 0;
  }
  const bool ok = failures.to_vector<int>()[0] == 0;
  std::printf("rank 0: diagnosis %s: %s\n", scenario.c_str(), ok ? "ok" : "FAILED");
  std::fflush(stdout);
  td::abort(ok ? "ending the job after the expected timeout" : "diagnosis test failed", ok ? 3 : 4);
}
