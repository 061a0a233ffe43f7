// Rank 1 lets an exception escape main while rank 0 waits in a barrier (default timeout: 30
// minutes). The guard that init_process_group installs turns it into MPI_Abort: the job ends
// in seconds with a non-zero status and the message printed.
#include <stdexcept>

#include <tensordict/tensordict.hpp>

int main(int argc, char** argv) {
  td::init_process_group(argc, argv);
  if (td::get_rank() == 1) throw std::runtime_error("boom on rank 1");
  td::barrier();
  td::destroy_process_group();
  return 0;
}
