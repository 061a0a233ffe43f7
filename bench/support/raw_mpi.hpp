// The raw-MPI baselines' MPI objects: what a program without the library hands to MPI (its own
// communicator, and a datatype and user-defined operations for the 16-bit floats, which MPI
// lacks), so the "ideal" variants model exactly that program.
#pragma once

#include <mpi.h>

#include <tensordict/tensordict.hpp>

namespace td_bench {

/// A duplicate of MPI_COMM_WORLD, and the MPI datatype and operation of every dtype and op.
class RawMpi {
 public:
  RawMpi();
  ~RawMpi();
  RawMpi(const RawMpi&) = delete;
  RawMpi& operator=(const RawMpi&) = delete;

  MPI_Comm comm() const { return comm_; }
  MPI_Datatype type(td::DType d) const;
  /// AVG is MPI's SUM: the caller divides.
  MPI_Op op(td::ReduceOp op, td::DType d) const;

 private:
  struct Half {
    MPI_Datatype type = MPI_DATATYPE_NULL;
    MPI_Op ops[4] = {MPI_OP_NULL, MPI_OP_NULL, MPI_OP_NULL, MPI_OP_NULL};  // sum prod min max
  };
  template <class T>
  static void create(Half& h);
  static void release(Half& h);
  MPI_Comm comm_ = MPI_COMM_NULL;
  Half half_, bfloat_;
};

/// Divides a contiguous floating tensor by `n` in place (AVG = SUM / ranks, as the library does).
void divide_in_place(td::Tensor& t, int n);

}  // namespace td_bench
