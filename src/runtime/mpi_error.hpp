// MPI return codes as exceptions: the one check that turns a code into a td::MpiError naming
// the routine (not installed).
#pragma once

#include <mpi.h>

namespace td::detail {

/// Throws td::MpiError naming the routine and MPI's error text.
[[noreturn]] void throw_mpi_error(const char* call, int code);

/// Checks an MPI return code; the routine's name ends up in the error.
#define TD_MPI_CHECK(call)                                                           \
  do {                                                                               \
    const int td_mpi_rc_ = (call);                                                   \
    if (td_mpi_rc_ != MPI_SUCCESS) ::td::detail::throw_mpi_error(#call, td_mpi_rc_); \
  } while (0)

}  // namespace td::detail
