// A rank that plays its part of a collective's agreement by hand, for tests that speak the
// protocol themselves (a peer that stalls after agreeing, a raw transport peer).
#pragma once

#include <cstdint>
#include <vector>

#include <mpi.h>

namespace tdtest {

/// This rank's part of one agreement round on `comm`, agreeing with everything: the round is one
/// MPI_Iallreduce (MAX) of three uint64 words on the group's communicator, padded with zeros to
/// the largest power of two <= the group's size where that is more (src/comm/agreement.cpp,
/// runtime/nbc_tuning.hpp padded_count, docs/internals.md), and zeros contribute nothing to a
/// maximum, so the other ranks see their own words and go on. Nonblocking, to match their
/// MPI_Iallreduce.
inline void agree_with_everything(MPI_Comm comm) {
  int size = 1;
  MPI_Comm_size(comm, &size);
  int words = 1;
  while (words <= size / 2) words *= 2;
  if (words < 3) words = 3;
  std::vector<std::uint64_t> zeros(static_cast<std::size_t>(words), 0);
  MPI_Request req = MPI_REQUEST_NULL;
  MPI_Iallreduce(MPI_IN_PLACE, zeros.data(), words, MPI_UINT64_T, MPI_MAX, comm, &req);
  MPI_Wait(&req, MPI_STATUS_IGNORE);
}

}  // namespace tdtest
