// An LD_PRELOAD shim for the fault.test_main.* tests of a rank's finalize (CMakeLists.txt),
// issue 32; it does nothing unless one of these names this rank (OMPI_COMM_WORLD_RANK):
// - TD_STALL_RANK: stops mpiexec (the rank's parent) for TD_STALL_MS milliseconds right before
//   PMIx_Finalize, as a machine too busy to run mpiexec would. Open MPI's PMIx client waits at
//   most 2 s for mpiexec to acknowledge a rank's finalize and then lets the rank exit, and the
//   woken mpiexec may see the exit before the finalize and report that the rank "exited
//   improperly", although it passed and finalized.
// - TD_FAIL_FINALIZE_RANK: MPI_Finalize finalizes, then returns MPI_ERR_OTHER, as an Open MPI
//   that failed a step of its finalize would (one before telling mpiexec leaves the process to
//   exit 0, unfinalized in mpiexec's eyes, with no other word).
#include <dlfcn.h>
#include <signal.h>
#include <unistd.h>

#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <ctime>

#include <mpi.h>

namespace {
// Whether the environment variable `var` names this rank.
bool names_this_rank(const char* var) {
  const char* rank = std::getenv("OMPI_COMM_WORLD_RANK");
  const char* which = std::getenv(var);
  return rank != nullptr && which != nullptr && std::atoi(rank) == std::atoi(which);
}
}  // namespace

// pmix_status_t PMIx_Finalize(const pmix_info_t info[], size_t ninfo), without PMIx's headers.
extern "C" int PMIx_Finalize(const void* info, std::size_t ninfo) {
  using Finalize = int (*)(const void*, std::size_t);
  const auto real = reinterpret_cast<Finalize>(dlsym(RTLD_NEXT, "PMIx_Finalize"));
  if (names_this_rank("TD_STALL_RANK")) {
    const char* stall_ms = std::getenv("TD_STALL_MS");
    const long ms = stall_ms != nullptr ? std::atol(stall_ms) : 3000;
    const pid_t mpiexec = getppid();
    if (fork() == 0) {  // wakes mpiexec up again, whatever this rank does meanwhile
      const timespec delay{ms / 1000, (ms % 1000) * 1000000L};
      nanosleep(&delay, nullptr);
      kill(mpiexec, SIGCONT);
      _exit(0);
    }
    std::fprintf(stderr, "[stall] rank %s stops mpiexec for %ld ms before PMIx_Finalize\n",
                 std::getenv("OMPI_COMM_WORLD_RANK"), ms);
    kill(mpiexec, SIGSTOP);
  }
  return real(info, ninfo);
}

extern "C" int MPI_Finalize() {
  using Finalize = int (*)();
  const auto real = reinterpret_cast<Finalize>(dlsym(RTLD_NEXT, "MPI_Finalize"));
  const int rc = real();
  return rc == MPI_SUCCESS && names_this_rank("TD_FAIL_FINALIZE_RANK") ? MPI_ERR_OTHER : rc;
}
