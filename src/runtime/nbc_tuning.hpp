// Which algorithm Open MPI 4.1's libnbc runs for each MPI_Iallreduce of the library (not
// installed). libnbc reads one process-wide control variable, coll_libnbc_iallreduce_algorithm, as
// each call starts; left at 0 it runs every in-place call (all of this library's) as a binomial
// reduce followed by a broadcast, whatever the size. The library sets it through MPI_T for each of
// its own calls, from the call's size and the communicator's, and puts the previous value back
// after (docs/configuration.md#open-mpis-nonblocking-allreduce).
#pragma once

#include <cstddef>
#include <string>

#include <mpi.h>

namespace td::detail {

/// libnbc's numbers for its MPI_Iallreduce algorithms.
enum class NbcAllreduce : int { LibnbcChoice = 0, Ring = 1, Binomial = 2, Rabenseifner = 3 };

/// The algorithm for an in-place MPI_Iallreduce of `bytes` over `ranks` ranks: the same on every
/// rank for the same call (it depends on nothing else).
NbcAllreduce iallreduce_algorithm_for(int ranks, std::size_t bytes);

/// After MPI_Init: takes the control variable over unless TD_TUNE_MPI=0, or the user chose an
/// algorithm (OMPI_MCA_coll_libnbc_iallreduce_algorithm, mpirun --mca, mca-params.conf), or this
/// MPI has no such variable. Returns what it did, for the log.
std::string start_iallreduce_tuning();
/// Before MPI_Finalize: releases the control variable (idempotent).
void stop_iallreduce_tuning();
/// Whether the library chooses the algorithm of its MPI_Iallreduce calls.
bool iallreduce_tuning_active();

/// MPI_Iallreduce with the algorithm chosen for it (plain MPI_Iallreduce when tuning is off).
int tuned_iallreduce(const void* send, void* recv, int count, MPI_Datatype type, MPI_Op op,
                     MPI_Comm comm, MPI_Request* req);

}  // namespace td::detail
