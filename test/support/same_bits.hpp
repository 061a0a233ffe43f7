// Whether a collective left identical bytes on every rank (not merely close values), for MPI tests.
#pragma once

#include <cstdint>
#include <cstring>
#include <vector>

#include <mpi.h>
#include <tensordict/tensordict.hpp>

namespace tdtest {

/// Whether every rank of `comm` holds the same bytes in t as the group's rank 0.
inline bool same_bits_everywhere(const td::Tensor& t, MPI_Comm comm = MPI_COMM_WORLD) {
  const td::Tensor c = t.contiguous();
  std::vector<unsigned char> mine(c.nbytes()), first;
  td::visit(c.dtype(), [&](auto tag) {
    using T = typename decltype(tag)::type;
    if (!mine.empty()) std::memcpy(mine.data(), c.data<T>(), mine.size());
  });
  first = mine;
  MPI_Bcast(first.data(), static_cast<int>(first.size()), MPI_BYTE, 0, comm);
  int same = first == mine ? 1 : 0;
  MPI_Allreduce(MPI_IN_PLACE, &same, 1, MPI_INT, MPI_MIN, comm);
  return same == 1;
}

/// Rank `rank`'s value at element i of a float tensor whose sum over ranks depends on the order of
/// the additions (large values of both signs): a reduction that adds in another order on some
/// rank leaves other bits there.
inline float order_sensitive(int rank, std::int64_t i) {
  return (rank % 2 == 0 ? 1.0e8f : -1.0e8f) + static_cast<float>(rank + 1) * 0.37f +
         static_cast<float>(i % 7);
}

}  // namespace tdtest
