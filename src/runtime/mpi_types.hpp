// MPI datatypes and operations of the library's dtypes and ReduceOps (half floats included), and
// AVG's division (not installed).
#pragma once

#include <cstdint>

#include <mpi.h>

#include "tensordict/dtype.hpp"
#include "tensordict/reduce_op.hpp"

namespace td::detail {

/// The MPI datatype of one element of `dtype` (user-defined for Float16 and BFloat16).
MPI_Datatype mpi_datatype(DType dtype);
/// The MPI operation that implements `op` on `dtype` (AVG maps to SUM); `op` must be supported.
MPI_Op mpi_op(ReduceOp op, DType dtype);
/// Creates the user-defined datatypes and operations (after MPI_Init).
void create_mpi_types();
/// Frees them (before MPI_Finalize).
void free_mpi_types();

/// Divides every element of a contiguous buffer by `divisor` (AVG = SUM / group size).
void divide_in_place(void* data, std::int64_t count, DType dtype, int divisor);

}  // namespace td::detail
