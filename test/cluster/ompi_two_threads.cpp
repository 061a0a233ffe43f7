// Open MPI 4.1's stall with two threads, without this library: why the progress thread is off
// by default when a job spans several hosts (docs/cluster.md, "Two threads in MPI across hosts").
// Not a registered test: it fails some of the time by design, and it is what to run again on
// another MPI library or version before turning the progress thread on across hosts.
//
// Every rank runs N iterations of an 8000-byte MPI_Iallreduce on one duplicate of
// MPI_COMM_WORLD and N iterations of a 64-byte one on another: with --threads, each stream on a
// thread of its own (the second sleeps 20 us between its tests, as a progress thread does);
// without it, both from the main thread, posted in an order that differs by rank and iteration.
// An iteration that takes more than 30 s is reported as a stall and aborts the job; a wrong sum
// aborts it too.
//
//   td-cluster up 2
//   td-cluster run -- mpirun -np 4 --host td-h1:2,td-h2:2 --mca pml ob1
//       --mca btl self,tcp build/bin/ompi_two_threads --threads 3000   (one line)
//
// Measured 2026-12-04 (Open MPI 4.1.4, 4 ranks on 2 namespace hosts over TCP, two busy loops
// beside it and a build running): --threads stalled in 3 of 6 runs, the one-thread form in 0 of
// 5. With only the build beside it, --threads without the 20 us pause passed 6 of 6: load makes
// the stall likely, two threads make it possible.
#include <mpi.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

namespace {

constexpr auto kStall = std::chrono::seconds(30);

int g_rank = 0;
int g_size = 1;

// Posts an in-place sum of `data` on `comm` into `req`.
void post(std::vector<double>& data, MPI_Comm comm, MPI_Request* req) {
  MPI_Iallreduce(MPI_IN_PLACE, data.data(), static_cast<int>(data.size()), MPI_DOUBLE, MPI_SUM,
                 comm, req);
}

// Tests `reqs` until they complete, sleeping `pause` between tests (as a progress thread does);
// aborts the job after kStall.
void finish(std::vector<MPI_Request>& reqs, const char* what, long iteration,
            std::chrono::microseconds pause = {}) {
  const auto start = std::chrono::steady_clock::now();
  int done = 0;
  while (done == 0) {
    MPI_Testall(static_cast<int>(reqs.size()), reqs.data(), &done, MPI_STATUSES_IGNORE);
    if (done == 0 && pause.count() > 0) std::this_thread::sleep_for(pause);
    if (done == 0 && std::chrono::steady_clock::now() - start > kStall) {
      std::fprintf(stderr, "rank %d: %s iteration %ld stalled\n", g_rank, what, iteration);
      MPI_Abort(MPI_COMM_WORLD, 3);
    }
  }
}

// The values every rank put in, summed.
void check(const std::vector<double>& data, double each_rank_plus, long iteration) {
  const double want = g_size * (g_size - 1) / 2.0 + g_size * each_rank_plus;
  if (data[0] != want) {
    std::fprintf(stderr, "rank %d: wrong sum %g (want %g) at iteration %ld\n", g_rank, data[0],
                 want, iteration);
    MPI_Abort(MPI_COMM_WORLD, 4);
  }
}

// One stream of allreduces on `comm`, `count` doubles each.
void stream(MPI_Comm comm, std::size_t count, long iterations, const char* what,
            std::chrono::microseconds pause = {}) {
  std::vector<double> data(count);
  std::vector<MPI_Request> req(1);
  for (long i = 0; i < iterations; ++i) {
    data.assign(count, g_rank + static_cast<double>(i));
    post(data, comm, req.data());
    finish(req, what, i, pause);
    check(data, static_cast<double>(i), i);
  }
}

}  // namespace

int main(int argc, char** argv) {
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  MPI_Comm_rank(MPI_COMM_WORLD, &g_rank);
  MPI_Comm_size(MPI_COMM_WORLD, &g_size);
  bool threads = false;
  long iterations = 3000;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--threads") == 0) {
      threads = true;
    } else {
      iterations = std::stol(argv[i]);
    }
  }
  if (threads && provided != MPI_THREAD_MULTIPLE) {
    std::fprintf(stderr, "MPI_THREAD_MULTIPLE is not provided\n");
    MPI_Abort(MPI_COMM_WORLD, 2);
  }
  MPI_Comm big = MPI_COMM_NULL, small = MPI_COMM_NULL;
  MPI_Comm_dup(MPI_COMM_WORLD, &big);
  MPI_Comm_dup(MPI_COMM_WORLD, &small);
  if (threads) {
    std::thread side(
        [&] { stream(small, 8, iterations, "thread 2 (64 B)", std::chrono::microseconds(20)); });
    stream(big, 1000, iterations, "thread 1 (8000 B)");
    side.join();
  } else {
    std::vector<double> a(1000), b(8);
    std::vector<MPI_Request> reqs(2);
    for (long i = 0; i < iterations; ++i) {
      a.assign(a.size(), g_rank + static_cast<double>(i));
      b.assign(b.size(), g_rank + static_cast<double>(i));
      const bool big_first = (g_rank + i) % 2 != 0;
      post(big_first ? a : b, big_first ? big : small, &reqs[0]);
      post(big_first ? b : a, big_first ? small : big, &reqs[1]);
      finish(reqs, "one thread", i);
      check(a, static_cast<double>(i), i);
      check(b, static_cast<double>(i), i);
    }
  }
  MPI_Barrier(MPI_COMM_WORLD);
  if (g_rank == 0)
    std::printf("ok: %ld iterations%s\n", iterations, threads ? " on two threads" : "");
  MPI_Comm_free(&big);
  MPI_Comm_free(&small);
  MPI_Finalize();
  return 0;
}
