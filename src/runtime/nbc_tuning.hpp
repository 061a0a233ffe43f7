// Which algorithm Open MPI 4.1's libnbc runs for MPI_Iallreduce (not installed). libnbc reads one
// process-wide setting, coll_libnbc_iallreduce_algorithm; left at 0 it runs every in-place call
// (all of this library's) as a binomial reduce followed by a broadcast, whatever the size. The
// library sets it for the job before MPI_Init
// (docs/configuration.md#open-mpis-nonblocking-allreduce). Not per call: the setting is the whole
// process's, so a call that must match one of the library's but is posted by other code would run
// another algorithm than the library's on the other ranks (seen with the suite's raw agreement
// peers: MPI_ERR_TRUNCATE in libnbc).
#pragma once

#include <cstddef>
#include <string>

namespace td::detail {

/// libnbc's numbers for its MPI_Iallreduce algorithms.
enum class NbcAllreduce : int { LibnbcChoice = 0, Ring = 1, Binomial = 2, Rabenseifner = 3 };

/// The algorithm for a job of `ranks` ranks, `across_nodes` when they are not all on one node:
/// the ring at 2, Rabenseifner's at 4, 8, 16..., the ring at 3, 5, 6, 7, 9... 15 across nodes,
/// libnbc's own choice otherwise.
NbcAllreduce iallreduce_algorithm_for(long ranks, bool across_nodes);

/// Before MPI_Init, when this process initialises Open MPI: sets
/// OMPI_MCA_coll_libnbc_iallreduce_algorithm from the job's size and whether it spans nodes
/// (OMPI_COMM_WORLD_SIZE and OMPI_COMM_WORLD_LOCAL_SIZE, which mpirun exports) unless the user set
/// it or TD_TUNE_MPI=0. Returns what it did, for the log.
std::string tune_libnbc_before_init();

/// Whether this process's libnbc runs its ring for MPI_Iallreduce (the variable above is 1,
/// whoever set it). Read once, after MPI_Init.
bool libnbc_runs_ring();

/// How many elements a small MPI_Iallreduce of `count` elements on `ranks` ranks should carry:
/// under Rabenseifner's algorithm libnbc runs a call of fewer elements than the largest power of
/// two <= ranks as a ring, 2(p-1) rounds instead of the tree's 2 log p; padded to that many (the
/// extra elements hold the op's identity), the call keeps the tree's round count.
int padded_count(int count, int ranks);

}  // namespace td::detail
