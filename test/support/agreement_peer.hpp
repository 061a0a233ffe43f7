// A rank that plays its part of a collective's agreement by hand, for tests that speak the
// protocol themselves (a peer that stalls after agreeing, a raw transport peer).
#pragma once

#include <cstdint>
#include <cstdlib>
#include <string_view>
#include <vector>

#include <mpi.h>

namespace tdtest {

/// A nonblocking in-place MAX of `words` uint64 words on `comm`, sent as the library sends its
/// own small rounds: an MPI_Iallreduce, or, where libnbc runs its ring
/// (OMPI_MCA_coll_libnbc_iallreduce_algorithm=1) on 3 to 16 ranks, an MPI_Iallgather of every
/// rank's words reduced here (src/comm/executor.hpp, GatheredAllreduce). Waits for it.
inline void raw_max_round(std::uint64_t* words, int count, MPI_Comm comm) {
  int size = 1;
  MPI_Comm_size(comm, &size);
  const char* alg = std::getenv("OMPI_MCA_coll_libnbc_iallreduce_algorithm");
  const bool gathered = alg != nullptr && std::string_view(alg) == "1" && size >= 3 && size <= 16;
  MPI_Request req = MPI_REQUEST_NULL;
  if (!gathered) {
    MPI_Iallreduce(MPI_IN_PLACE, words, count, MPI_UINT64_T, MPI_MAX, comm, &req);
    MPI_Wait(&req, MPI_STATUS_IGNORE);
    return;
  }
  std::vector<std::uint64_t> all(static_cast<std::size_t>(count) * static_cast<std::size_t>(size));
  MPI_Iallgather(words, count, MPI_UINT64_T, all.data(), count, MPI_UINT64_T, comm, &req);
  MPI_Wait(&req, MPI_STATUS_IGNORE);
  for (int r = 0; r < size; ++r)
    for (int i = 0; i < count; ++i) {
      const std::uint64_t v = all[static_cast<std::size_t>(r * count + i)];
      if (r == 0 || v > words[i]) words[i] = v;
    }
}

/// This rank's part of one agreement round on `comm`, agreeing with everything: the round is one
/// MAX of three uint64 words on the group's communicator (raw_max_round), padded with zeros to
/// the largest power of two <= the group's size where that is more (src/comm/agreement.cpp,
/// runtime/nbc_tuning.hpp padded_count, docs/internals.md), and zeros contribute nothing to a
/// maximum, so the other ranks see their own words and go on. Nonblocking, to match theirs.
inline void agree_with_everything(MPI_Comm comm) {
  int size = 1;
  MPI_Comm_size(comm, &size);
  int words = 1;
  while (words <= size / 2) words *= 2;
  if (words < 3) words = 3;
  std::vector<std::uint64_t> zeros(static_cast<std::size_t>(words), 0);
  raw_max_round(zeros.data(), words, comm);
}

}  // namespace tdtest
