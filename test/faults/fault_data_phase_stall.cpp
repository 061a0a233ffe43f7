// A peer that passes the layout agreement and then never enters the data phase (as a peer lost
// in the middle of a transfer looks to the others): the blocking MPI call of a sync collective
// cannot be interrupted, so the watchdog must print the stalled collective as a timeout and end
// the job shortly after the call's deadline, instead of leaving rank 0 blocked forever.
//
// White-box: rank 1 answers the agreement by hand (test/support/agreement_peer.hpp): rank 0 sees
// agreement and enters MPI_Allreduce with the data.
#include <mpi.h>

#include <chrono>
#include <cstdio>
#include <thread>

#include <tensordict/tensordict.hpp>

#include "../support/agreement_peer.hpp"

int main(int argc, char** argv) {
  td::init_process_group(argc, argv);
  const int rank = td::get_rank();
  if (td::get_world_size() != 2) {
    std::printf("fault_data_phase_stall: needs 2 ranks\n");
    return 1;
  }
  if (rank == 1) {
    tdtest::agree_with_everything(td::world().comm());
    std::this_thread::sleep_for(std::chrono::seconds(60));  // ended by rank 0's watchdog
    return 0;
  }
  td::TensorDict d;
  d.set({"grad", "w"}, td::Tensor::full<float>({1000}, 1.f));
  d.set({"grad", "b"}, td::Tensor::full<float>({10}, 1.f));
  std::printf("rank 0: entering the sync all_reduce (timeout 2000 ms)\n");
  std::fflush(stdout);
  td::CollectiveOptions opts;
  opts.bucket_bytes = 1 << 20;  // not kAutoBucketBytes: tuning it is a collective of its own
  opts.timeout = std::chrono::milliseconds(2000);
  d.all_reduce(td::ReduceOp::SUM, opts);
  std::printf("rank 0: the all_reduce returned, which it cannot have done correctly\n");
  return 0;
}
