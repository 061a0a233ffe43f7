// Live diagnosis of a timeout (docs/reliability.md, "When a call times out"): before a
// TimeoutError is thrown, the rank asks every rank of the call's group where it is, over a
// communicator kept for this, and a thread of each process (started with the progress thread)
// answers from its flight recorder, whatever the process's own threads are doing.
#pragma once

#include <string>
#include <vector>

#include "runtime/flight_recorder.hpp"
#include "tensordict/errors.hpp"

namespace td::detail {

/// At init (collective over MPI_COMM_WORLD): the diagnosis communicator, the answering thread,
/// the SIGUSR1 dump. At destroy: stops the thread and frees the communicator (before finalize).
void diagnosis_start();
void diagnosis_stop();

/// The TimeoutError of `call` with `message`: the message is prefixed by the likely cause (one
/// sentence) and followed by where every rank is; printed on stderr; the ring dumped with
/// TD_FLIGHT_RECORDER_DIR. Without a call, diagnosis or MPI: the plain error.
TimeoutError timeout_error(const CallRef& call, const std::string& message);

/// The same for the watchdog's report (its thread asks while the caller is blocked in MPI):
/// the cause and the per-rank lines, "" when unavailable.
std::string diagnosis_report(const CallRef& call);

/// What the diagnosis found (exposed for tests of the wording).
struct Diagnosis {
  std::vector<RankStatus> ranks;
  std::string cause;    // the first sentence
  std::string details;  // one line per rank
};
Diagnosis diagnose(const CallRef& call);

}  // namespace td::detail
