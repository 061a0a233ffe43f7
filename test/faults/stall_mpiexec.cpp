// An LD_PRELOAD shim for fault.test_main.slow_mpiexec (CMakeLists.txt), issue 32. On the rank
// named by TD_STALL_RANK it stops mpiexec (the rank's parent) for TD_STALL_MS milliseconds right
// before PMIx_Finalize, as a machine too busy to run mpiexec would: Open MPI's PMIx client waits
// at most 2 s for mpiexec to acknowledge a rank's finalize and then lets the rank exit, and the
// woken mpiexec may see the exit before the finalize and report that the rank "exited
// improperly", although it passed and finalized.
#include <dlfcn.h>
#include <signal.h>
#include <unistd.h>

#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <ctime>

// pmix_status_t PMIx_Finalize(const pmix_info_t info[], size_t ninfo), without PMIx's headers.
extern "C" int PMIx_Finalize(const void* info, std::size_t ninfo) {
  using Finalize = int (*)(const void*, std::size_t);
  const auto real = reinterpret_cast<Finalize>(dlsym(RTLD_NEXT, "PMIx_Finalize"));
  const char* rank = std::getenv("OMPI_COMM_WORLD_RANK");
  const char* stall_rank = std::getenv("TD_STALL_RANK");
  const char* stall_ms = std::getenv("TD_STALL_MS");
  if (rank != nullptr && stall_rank != nullptr && std::atoi(rank) == std::atoi(stall_rank)) {
    const pid_t mpiexec = getppid();
    const long ms = stall_ms != nullptr ? std::atol(stall_ms) : 3000;
    if (fork() == 0) {  // wakes mpiexec up again, whatever this rank does meanwhile
      const timespec delay{ms / 1000, (ms % 1000) * 1000000L};
      nanosleep(&delay, nullptr);
      kill(mpiexec, SIGCONT);
      _exit(0);
    }
    std::fprintf(stderr, "[stall] rank %s stops mpiexec for %ld ms before PMIx_Finalize\n", rank,
                 ms);
    kill(mpiexec, SIGSTOP);
  }
  return real(info, ninfo);
}
