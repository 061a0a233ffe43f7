// A rank killed (SIGKILL) in the middle of a loop of collectives: mpirun must end the job with
// a non-zero status in seconds; no surviving rank spins forever.
#include <csignal>
#include <cstdio>

#include <tensordict/tensordict.hpp>

int main(int argc, char** argv) {
  td::init_process_group(argc, argv);
  const int rank = td::get_rank();
  td::TensorDict d;
  for (int i = 0; i < 64; ++i) d.set(fmt::format("p{}", i), td::Tensor::full<float>({256}, 1.f));
  for (int step = 0; step < 1000000; ++step) {
    if (rank == 1 && step == 50) {
      std::printf("rank 1: killing myself at step 50\n");
      std::fflush(stdout);
      std::raise(SIGKILL);
    }
    d.all_reduce(td::ReduceOp::AVG, {.bucket_bytes = 4096});
  }
  td::destroy_process_group();
  return 0;
}
