// The collective under test: TensorDict::all_reduce or TensorDict::reduce, the same call on a
// single tensor, and the raw-MPI baseline on a buffer packed in advance.
#pragma once

#include <cstddef>
#include <optional>
#include <string>

#include <tensordict/tensordict.hpp>

#include "raw_mpi.hpp"

namespace td_bench {

/// Which TensorDict collective the executable measures.
enum class Collective { AllReduce, Reduce };

/// dst of every reduce.
inline constexpr int kRoot = 0;

/// The collective, op and group every variant of a run uses.
struct Context {
  Collective kind = Collective::AllReduce;
  td::ReduceOp op = td::ReduceOp::SUM;
  int rank = 0;
  int ranks = 1;
  RawMpi* mpi = nullptr;
  std::string auto_size = "?";  // what bucket auto resolved to (for labels)

  /// Whether this rank holds the result afterwards.
  bool receives() const { return kind == Collective::AllReduce || rank == kRoot; }
  const char* dict_call() const {
    return kind == Collective::AllReduce ? "TensorDict.all_reduce" : "TensorDict.reduce";
  }
  const char* mpi_call() const {
    return kind == Collective::AllReduce ? "MPI_Allreduce" : "MPI_Reduce";
  }
  const char* tensor_call() const {
    return kind == Collective::AllReduce ? "td::all_reduce" : "td::reduce";
  }

  /// The TensorDict collective on `d`.
  void run_dict(td::TensorDict& d, std::optional<std::size_t> bucket_bytes) const;
  /// The td:: collective on one tensor.
  void run_tensor(td::Tensor& t) const;
  /// One raw MPI collective per `chunk_bytes` (0: one for the whole buffer) on a contiguous tensor.
  void run_raw(td::Tensor& t, std::size_t chunk_bytes) const;
};

}  // namespace td_bench
