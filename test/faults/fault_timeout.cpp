// A rank that never joins: the others throw td::TimeoutError within a small margin of the
// timeout, sync and async, then rank 0 ends the job with td::abort.
#include <chrono>
#include <cstdio>
#include <thread>

#include <tensordict/tensordict.hpp>

int main(int argc, char** argv) {
  td::init_process_group(argc, argv);
  const int rank = td::get_rank(), size = td::get_world_size();
  if (size < 2) {
    std::printf("fault_timeout: needs at least 2 ranks\n");
    return 1;
  }
  std::vector<int> everyone;
  for (int r = 0; r < size; ++r) everyone.push_back(r);
  td::ProcessGroup async_group = td::new_group(everyone);  // collective: rank 1 takes part here
  if (rank == 1) {                                         // never joins; ended by rank 0's abort
    std::this_thread::sleep_for(std::chrono::seconds(60));
    return 0;
  }
  using namespace std::chrono;
  td::TensorDict d;
  d.set({"grad", "w"}, td::Tensor::full<float>({100}, 1.f));
  int ok = 0;
  // async on its own group: the rendezvous (the layout agreement, before any Work exists) gives up
  {
    td::Tensor t = td::Tensor::full<float>({1000}, 1.f);
    auto start = steady_clock::now();
    try {
      td::Work w =
          td::all_reduce(t, td::ReduceOp::SUM,
                         {.group = async_group, .async_op = true, .timeout = milliseconds(500)});
      w.wait();
    } catch (const td::TimeoutError& e) {
      const auto ms = duration_cast<milliseconds>(steady_clock::now() - start).count();
      std::printf("rank %d: async TimeoutError after %lld ms: %s\n", rank,
                  static_cast<long long>(ms), e.what());
      if (ms >= 500 && ms < 1500) ++ok;
    }
  }
  // sync: the layout agreement waits for rank 1
  auto start = steady_clock::now();
  try {
    d.all_reduce(td::ReduceOp::SUM, {.bucket_bytes = 1 << 20, .timeout = milliseconds(500)});
  } catch (const td::TimeoutError& e) {
    const auto ms = duration_cast<milliseconds>(steady_clock::now() - start).count();
    std::printf("rank %d: sync TimeoutError after %lld ms: %s\n", rank, static_cast<long long>(ms),
                e.what());
    const std::string msg = e.what();
    if (ms >= 500 && ms < 1500 && msg.find("all_reduce") != std::string::npos &&
        msg.find(std::to_string(size)) != std::string::npos &&
        msg.find("grad.w") != std::string::npos)
      ++ok;
  }
  // the leaf is unchanged
  if (d.get({"grad", "w"}).to_vector<float>()[0] == 1.f) ++ok;
  if (rank != 0) {  // only rank 0 reports and ends the job, so its verdict is always printed
    std::this_thread::sleep_for(std::chrono::seconds(60));
    return 0;
  }
  {
    std::printf("rank 0: %s\n", ok == 3 ? "timeout test: ok" : "timeout test: FAILED");
    std::fflush(stdout);
  }
  td::abort(ok == 3 ? "ending the job after the expected timeout" : "timeout test failed",
            ok == 3 ? 3 : 4);
}
