// A rank that runs one more Reducer step than the others (ragged data, no uneven_inputs): its
// extra finish() times out, and the message points at ReducerOptions::uneven_inputs and
// Reducer::join(). Rank 0 runs the extra step, reports and ends the job with td::abort.
#include <chrono>
#include <cstdio>
#include <string>
#include <thread>

#include <tensordict/tensordict.hpp>

int main(int argc, char** argv) {
  td::init_process_group(argc, argv);
  const int rank = td::get_rank(), size = td::get_world_size();
  if (size < 2) {
    std::printf("fault_extra_finish: needs at least 2 ranks\n");
    return 1;
  }
  td::TensorDict grads;
  grads.set("w", td::Tensor::zeros({8}, td::DType::Float32));
  td::Reducer reducer(grads, {.timeout = std::chrono::milliseconds(500)});
  reducer.mark_ready("w");
  reducer.finish();  // every rank: step 1
  if (rank != 0) {   // out of data; ended by rank 0's abort
    std::this_thread::sleep_for(std::chrono::seconds(60));
    return 0;
  }
  bool ok = false;
  try {
    reducer.mark_ready("w");
    reducer.finish();  // rank 0 alone: step 2
  } catch (const td::TimeoutError& e) {
    const std::string msg = e.what();
    std::printf("rank 0: %s\n", e.what());
    ok = msg.find("ReducerOptions::uneven_inputs") != std::string::npos &&
         msg.find("Reducer::join()") != std::string::npos;
  }
  std::printf("rank 0: %s\n", ok ? "extra finish: ok" : "extra finish: FAILED");
  std::fflush(stdout);
  td::abort(ok ? "ending the job after the expected timeout" : "extra finish test failed",
            ok ? 3 : 4);
}
