// bench_allreduce: TensorDict::all_reduce per leaf, bucketed at several sizes, bucketed "auto" and
// on a consolidated dict, against one MPI_Allreduce on a pre-packed buffer (the ideal), over five
// workloads from 16384 64-byte leaves to eight 4 MiB leaves. The method: bench/support/runner.hpp.
//   mpirun --allow-run-as-root -np 2 build/bin/bench_allreduce --csv build/bench/allreduce.csv
#include "support/driver.hpp"

int main(int argc, char** argv) {
  return td_bench::guarded_main(argc, argv, td_bench::Collective::AllReduce);
}
