// A rank that plays its part of a collective's agreement by hand, for tests that speak the
// protocol themselves (a peer that stalls after agreeing, a raw transport peer).
#pragma once

#include <array>
#include <cstdint>

#include <mpi.h>

namespace tdtest {

/// This rank's part of one agreement round on `comm`, agreeing with everything: the round is one
/// MPI_Iallreduce (MAX) of three uint64 words on the group's communicator (src/comm/agreement.cpp,
/// docs/internals.md), and zeros contribute nothing to a maximum, so the other ranks see their
/// own words and go on. Nonblocking, to match their MPI_Iallreduce.
inline void agree_with_everything(MPI_Comm comm) {
  std::array<std::uint64_t, 3> zeros{};
  MPI_Request req = MPI_REQUEST_NULL;
  MPI_Iallreduce(MPI_IN_PLACE, zeros.data(), 3, MPI_UINT64_T, MPI_MAX, comm, &req);
  MPI_Wait(&req, MPI_STATUS_IGNORE);
}

}  // namespace tdtest
