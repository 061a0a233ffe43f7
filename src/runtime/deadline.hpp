// Deadlines: a call's timeout, the deadline it gives, and the watchdog of blocking data phases
// (not installed).
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <string>

#include "tensordict/collectives.hpp"

namespace td::detail {

/// The timeout of a call's options (the default of init_process_group otherwise; defined in
/// process_group.cpp, beside that default).
std::chrono::milliseconds timeout_of(const CollectiveOptions& opts);
/// now + timeout, saturating: a timeout too large to add (milliseconds::max() is the natural way
/// to say "no limit") gives a deadline that never passes instead of one in the past.
std::chrono::steady_clock::time_point deadline_after(std::chrono::milliseconds timeout);
/// Whether `deadline` is the one deadline_after gives for "no limit" (nothing to watch).
bool is_unbounded(std::chrono::steady_clock::time_point deadline);

/// While alive, the calling thread is inside a blocking MPI call of a collective's data phase,
/// which no timeout can interrupt. If `deadline` passes first, a watchdog thread prints
/// describe() as a timeout and ends the job (td::abort), as PyTorch's NCCL watchdog does: a peer
/// lost in the middle of a transfer can otherwise block the surviving ranks forever. Costs two
/// uncontended lock/unlock pairs; the watchdog thread starts on first use and sleeps otherwise.
class BlockingPhase {
 public:
  BlockingPhase(std::chrono::steady_clock::time_point deadline,
                const std::function<std::string()>& describe);
  ~BlockingPhase();
  BlockingPhase(const BlockingPhase&) = delete;
  BlockingPhase& operator=(const BlockingPhase&) = delete;

 private:
  std::uint64_t id_ = 0;  // 0: not armed (unbounded deadline)
};

}  // namespace td::detail
