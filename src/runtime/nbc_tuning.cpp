#include "runtime/nbc_tuning.hpp"

#include <cstdlib>
#include <mutex>

#include <fmt/format.h>

#include "core/config.hpp"

namespace td::detail {

namespace {

constexpr const char* kVariable = "coll_libnbc_iallreduce_algorithm";

struct Tuning {
  std::mutex mu;  // a write of the variable and the call that reads it, from any thread
  bool active = false;
  MPI_T_cvar_handle handle = MPI_T_CVAR_HANDLE_NULL;
  int original = 0;
};

Tuning& tuning() {
  static Tuning t;
  return t;
}

}  // namespace

// Measured on this project's machines (docs/configuration.md): at 2 ranks the ring is faster at
// every size, 16 B to 8 MiB (2.6x at 8 MiB). From 3 ranks the binomial tree is fastest on small
// messages (the fewest rounds; the ring takes 2(p-1)). On large ones, at 4 ranks Rabenseifner's
// reduce-scatter + allgather is 1.3-1.5x faster than the binomial tree on one host and 2.7x across
// 2 hosts (the Reducer's buckets, 672 -> 252 ms); libnbc runs it only on a power of two number of
// ranks (else an extra step), so at 3, 5, 6... ranks the ring, which beats the tree from about
// 1 MiB (1.6x at 1 and 8 MiB, 3 ranks) and loses below 64 KiB.
NbcAllreduce iallreduce_algorithm_for(int ranks, std::size_t bytes) {
  if (ranks < 2) return NbcAllreduce::LibnbcChoice;
  if (ranks == 2) return NbcAllreduce::Ring;
  if (bytes < (std::size_t{64} << 10)) return NbcAllreduce::Binomial;
  if ((ranks & (ranks - 1)) == 0) return NbcAllreduce::Rabenseifner;
  return bytes >= (std::size_t{512} << 10) ? NbcAllreduce::Ring : NbcAllreduce::Binomial;
}

std::string start_iallreduce_tuning() {
  Tuning& t = tuning();
  std::lock_guard lock(t.mu);
  if (t.active) return "";
  if (!config().tune_mpi) return "left to libnbc (TD_TUNE_MPI=0)";
  if (std::getenv((std::string("OMPI_MCA_") + kVariable).c_str()) != nullptr)
    return fmt::format("left to OMPI_MCA_{} (set by the user)", kVariable);
  int provided = 0;
  if (MPI_T_init_thread(MPI_THREAD_MULTIPLE, &provided) != MPI_SUCCESS)
    return "left to libnbc (no MPI_T)";
  int index = -1, count = 0;
  if (MPI_T_cvar_get_index(kVariable, &index) != MPI_SUCCESS ||
      MPI_T_cvar_handle_alloc(index, nullptr, &t.handle, &count) != MPI_SUCCESS || count != 1 ||
      MPI_T_cvar_read(t.handle, &t.original) != MPI_SUCCESS) {
    if (t.handle != MPI_T_CVAR_HANDLE_NULL) MPI_T_cvar_handle_free(&t.handle);
    MPI_T_finalize();
    return fmt::format("left to the MPI library (no control variable {})", kVariable);
  }
  if (t.original != 0) {  // chosen in a file (mca-params.conf) or by mpirun --mca
    MPI_T_cvar_handle_free(&t.handle);
    MPI_T_finalize();
    return fmt::format("left to {}={} (set by the user)", kVariable, t.original);
  }
  t.active = true;
  return "libnbc's MPI_Iallreduce algorithm chosen per call (2 ranks: ring; from 3: binomial "
         "below 64 KiB, else Rabenseifner on 4, 8, 16... ranks, ring from 512 KiB on others)";
}

void stop_iallreduce_tuning() {
  Tuning& t = tuning();
  std::lock_guard lock(t.mu);
  if (!t.active) return;
  t.active = false;
  MPI_T_cvar_handle_free(&t.handle);
  MPI_T_finalize();
}

bool iallreduce_tuning_active() {
  Tuning& t = tuning();
  std::lock_guard lock(t.mu);
  return t.active;
}

int tuned_iallreduce(const void* send, void* recv, int count, MPI_Datatype type, MPI_Op op,
                     MPI_Comm comm, MPI_Request* req) {
  Tuning& t = tuning();
  std::unique_lock lock(t.mu);
  if (!t.active) {
    lock.unlock();
    return MPI_Iallreduce(send, recv, count, type, op, comm, req);
  }
  int ranks = 1, type_size = 0;
  MPI_Comm_size(comm, &ranks);
  MPI_Type_size(type, &type_size);
  const auto bytes = static_cast<std::size_t>(count) * static_cast<std::size_t>(type_size);
  int algorithm = static_cast<int>(iallreduce_algorithm_for(ranks, bytes));
  MPI_T_cvar_write(t.handle, &algorithm);
  const int rc = MPI_Iallreduce(send, recv, count, type, op, comm, req);
  MPI_T_cvar_write(t.handle, &t.original);
  return rc;
}

}  // namespace td::detail
