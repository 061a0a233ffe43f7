// Works still pending at destroy_process_group(), destroyed afterwards (ordinary RAII order):
// destroy completes them (every rank destroys with the same operations pending), and their
// destructors then return at once, with or without the progress thread (TD_PROGRESS_THREAD=0
// once aborted the job: MPI_Testall after MPI_Finalize). The per-call timeout is long (60 s), so
// a destructor that waits for it fails the test's time limit.
#include <chrono>
#include <cstdio>
#include <vector>

#include <tensordict/tensordict.hpp>

int main(int argc, char** argv) {
  using Clock = std::chrono::steady_clock;
  td::init_process_group(argc, argv);
  const int rank = td::get_rank();
  const int size = td::get_world_size();
  Clock::time_point after_destroy;
  {
    td::TensorDict d;
    d.set("a", td::Tensor::full<float>({1000}, 1.f));
    d.set({"m", "b"}, td::Tensor::full<double>({10}, 2.0));
    td::CollectiveOptions opts;
    opts.async_op = true;
    opts.bucket_bytes = 1024;
    opts.timeout = std::chrono::seconds(60);
    std::vector<td::Work> works = d.all_reduce(td::ReduceOp::SUM, opts);
    td::Tensor t = td::Tensor::full<float>({4}, 1.f);
    td::Work single = td::all_reduce(t, td::ReduceOp::SUM, opts);
    td::destroy_process_group();
    after_destroy = Clock::now();
    // The leaves hold the result: destroy completed the operations.
    const bool ok = d.get("a").to_vector<float>()[0] == static_cast<float>(size) &&
                    d.get({"m", "b"}).to_vector<double>()[9] == 2.0 * size &&
                    t.to_vector<float>()[3] == static_cast<float>(size);
    std::printf("rank %d: results after destroy %s\n", rank, ok ? "complete" : "WRONG");
    if (!ok) return 1;
  }  // the Works are destroyed here
  const auto ms =
      std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - after_destroy).count();
  std::printf("rank %d: Work destructors took %lld ms\n", rank, static_cast<long long>(ms));
  if (ms > 1000) return 1;
  if (rank == 0) std::printf("destroy with pending works: ok\n");
  return 0;
}
