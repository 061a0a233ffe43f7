// The collective under test (collective.hpp).
#include "collective.hpp"

#include <algorithm>
#include <climits>
#include <cstddef>

namespace td_bench {

void Context::run_dict(td::TensorDict& d, std::optional<std::size_t> bucket_bytes) const {
  td::CollectiveOptions o;
  o.bucket_bytes = bucket_bytes;
  if (kind == Collective::AllReduce) {
    d.all_reduce(op, o);
  } else {
    d.reduce(kRoot, op, o);
  }
}

void Context::run_tensor(td::Tensor& t) const {
  if (kind == Collective::AllReduce) {
    td::all_reduce(t, op).wait();
  } else {
    td::reduce(t, kRoot, op).wait();
  }
}

void Context::run_raw(td::Tensor& t, std::size_t chunk_bytes) const {
  const td::DType d = t.dtype();
  const std::size_t isz = td::itemsize(d);
  const auto n = static_cast<std::size_t>(t.numel());
  std::size_t per = chunk_bytes == 0 ? n : std::max<std::size_t>(1, chunk_bytes / isz);
  per = std::min<std::size_t>(per, INT_MAX);
  auto* base = static_cast<std::byte*>(t.raw_data());
  const MPI_Datatype type = mpi->type(d);
  const MPI_Op mop = mpi->op(op, d);
  for (std::size_t first = 0; first < n; first += per) {
    const int count = static_cast<int>(std::min(per, n - first));
    void* p = base + first * isz;
    if (kind == Collective::AllReduce) {
      MPI_Allreduce(MPI_IN_PLACE, p, count, type, mop, mpi->comm());
    } else if (rank == kRoot) {
      MPI_Reduce(MPI_IN_PLACE, p, count, type, mop, kRoot, mpi->comm());
    } else {
      MPI_Reduce(p, nullptr, count, type, mop, kRoot, mpi->comm());
    }
  }
  if (op == td::ReduceOp::AVG && receives()) divide_in_place(t, ranks);
}

}  // namespace td_bench
