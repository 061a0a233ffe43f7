// The executor: the one place where MPI calls that move data are made (docs/internals.md, "The
// executor"). Operations describe each call as a DataCall (what to post, on which
// communicator) and hand it to post(); a later feature that must see every byte that moves
// (per-call sequence numbers, the flight recorder, node-aware strategies) hooks in here once.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <mpi.h>

namespace td::detail {

class WorkState;

/// One MPI call that moves data. Built by the factory functions below, never by hand, so that a
/// call names only what its MPI routine takes.
struct DataCall {
  enum class Op : std::uint8_t {
    Send,
    Recv,
    Bcast,
    Allreduce,
    Reduce,
    Allgather,
    Gather,
    Allgatherv,
    Gatherv,
    Scatter,
    Scatterv,
    ReduceScatterBlock,
    ReduceScatter,
    Barrier,  // moves no data; here so that every call of a collective's data phase is one kind
  };
  Op op = Op::Bcast;
  MPI_Comm comm = MPI_COMM_NULL;
  MPI_Datatype type = MPI_DATATYPE_NULL;       // of the send buffer, or the one buffer
  MPI_Datatype recv_type = MPI_DATATYPE_NULL;  // of the receive buffer where it has its own
  const void* send = nullptr;                  // MPI_IN_PLACE where the routine allows it
  void* recv = nullptr;
  int count = 0;                // this rank's element count (send, or the one buffer)
  int recv_count = 0;           // elements per rank received (Allgather, Gather, Scatter, Scatterv)
  const int* counts = nullptr;  // per rank (v-collectives, ReduceScatter)
  const int* displs = nullptr;
  MPI_Op reduce_op = MPI_OP_NULL;
  int root = 0;  // the root, or the peer of Send / Recv
  int tag = 0;
  // The library's own messages (the agreement's rounds, the bucket tuner's measurement, a file's
  // outcome votes): they move no data of the call, so the flight recorder's "data started" time
  // is not taken from them. Set by control().
  bool control = false;
};

/// `call` marked as one of the library's own messages (DataCall::control).
inline DataCall control(DataCall call) {
  call.control = true;
  return call;
}

/// Posts `call` in its nonblocking form into `*req`, or runs its blocking form when `req` is null
/// (the sync path, under a BlockingPhase). Throws td::MpiError naming the routine.
void post(const DataCall& call, MPI_Request* req);

// ---- factories: one per MPI routine the library uses for data, with the routine's own
// arguments (its nonblocking form's, without the request) --------------------------------------

DataCall send_call(const void* buf, int count, MPI_Datatype type, int peer, int tag, MPI_Comm comm);
DataCall recv_call(void* buf, int count, MPI_Datatype type, int peer, int tag, MPI_Comm comm);
DataCall bcast_call(void* buf, int count, MPI_Datatype type, int root, MPI_Comm comm);
DataCall allreduce_call(const void* send, void* recv, int count, MPI_Datatype type, MPI_Op op,
                        MPI_Comm comm);
DataCall reduce_call(const void* send, void* recv, int count, MPI_Datatype type, MPI_Op op,
                     int root, MPI_Comm comm);
DataCall allgather_call(const void* send, int count, MPI_Datatype type, void* recv, int recv_count,
                        MPI_Datatype recv_type, MPI_Comm comm);
DataCall gather_call(const void* send, int count, MPI_Datatype type, void* recv, int recv_count,
                     MPI_Datatype recv_type, int root, MPI_Comm comm);
DataCall allgatherv_call(const void* send, int count, MPI_Datatype type, void* recv,
                         const int* counts, const int* displs, MPI_Datatype recv_type,
                         MPI_Comm comm);
DataCall gatherv_call(const void* send, int count, MPI_Datatype type, void* recv, const int* counts,
                      const int* displs, MPI_Datatype recv_type, int root, MPI_Comm comm);
/// gather_call to `root`, or (nullopt) allgather_call: the gather of a call that delivers to one
/// rank or to every rank.
DataCall gather_to(std::optional<int> root, const void* send, int count, MPI_Datatype type,
                   void* recv, int recv_count, MPI_Datatype recv_type, MPI_Comm comm);
/// gatherv_call to `root`, or (nullopt) allgatherv_call.
DataCall gatherv_to(std::optional<int> root, const void* send, int count, MPI_Datatype type,
                    void* recv, const int* counts, const int* displs, MPI_Datatype recv_type,
                    MPI_Comm comm);
DataCall scatter_call(const void* send, int count, MPI_Datatype type, void* recv, int recv_count,
                      MPI_Datatype recv_type, int root, MPI_Comm comm);
DataCall scatterv_call(const void* send, const int* counts, const int* displs, MPI_Datatype type,
                       void* recv, int recv_count, MPI_Datatype recv_type, int root, MPI_Comm comm);
DataCall reduce_scatter_block_call(const void* send, void* recv, int count, MPI_Datatype type,
                                   MPI_Op op, MPI_Comm comm);
DataCall reduce_scatter_call(const void* send, void* recv, const int* counts, MPI_Datatype type,
                             MPI_Op op, MPI_Comm comm);
DataCall barrier_call(MPI_Comm comm);

/// A small in-place allreduce run as an allgather of every rank's values and a reduction in rank
/// order on every rank (the same bits everywhere), where this process's libnbc runs its ring
/// (runtime/nbc_tuning.hpp): the ring's 2(p-1) rounds made a message of up to 16 KiB 2-3x slower
/// than libnbc's tree across hosts (3 hosts x 1: 200-280 against 80-150 us; x 2: 720-970 against
/// 290-400 us), the gather as fast as the tree (75-115 and 300-480 us); from 64 KiB the ring
/// wins (docs/configuration.md). post_and_wait, Step and the async buckets take this path by
/// themselves: post gather(), then reduce() once it completed.
class GatheredAllreduce {
 public:
  /// Messages below this many bytes...
  static constexpr std::size_t kMaxBytes = std::size_t{32} << 10;
  /// ... on 3 to this many ranks (the gather brings every rank's copy).
  static constexpr int kMaxRanks = 16;
  /// The gather for `call` (an in-place allreduce, nonblocking), or null where it runs as posted.
  static std::shared_ptr<GatheredAllreduce> for_call(const DataCall& call);
  GatheredAllreduce(const DataCall& call, int ranks, std::size_t bytes);
  /// What to post instead of the allreduce (its `control` flag kept).
  DataCall gather() const;
  /// Reduces the gathered values, rank 0's first, into the allreduce's buffer.
  void reduce() const;

 private:
  DataCall call_;
  int ranks_;
  std::size_t bytes_;  // one rank's values
  std::unique_ptr<std::byte[]> all_;
};

/// Posts `call` and waits for it against `deadline` (td::TimeoutError from `describe`, with
/// `hold` leaked rather than freed): a step of one call, without Step's bookkeeping (the
/// agreement's round runs on every collective). Not for receives (their counts are Step's).
void post_and_wait(const DataCall& call, std::chrono::steady_clock::time_point deadline,
                   const std::function<std::string()>& describe, std::shared_ptr<void> hold);

/// Waits for requests posted nonblocking on the sync path (under its BlockingPhase, which
/// bounds the wait): the pipeline's bucket in flight.
void wait_blocking(std::span<MPI_Request> requests);

/// Posts `call` as one request of `w`'s current phase; a receive (recv_call) has its received
/// count checked when the phase completes (`phase` names it in the error).
void post_into(WorkState& w, const DataCall& call, const char* phase = "data");

/// Where `call` goes as a gather (GatheredAllreduce::for_call), posts the gather into `w`'s
/// current phase, held by `w`, and returns it for the caller to reduce() once the phase
/// completed; otherwise posts nothing and returns null.
std::shared_ptr<GatheredAllreduce> post_gathered_into(WorkState& w, const DataCall& call,
                                                      const char* phase = "data");

// ---- blocking steps of a call, polled against its deadline ----------------------------------

/// The calls of one step of an operation that runs on the caller's thread (transport, the
/// exchange of sparse leaves): posted nonblocking, then waited for against `deadline` (a
/// td::TimeoutError, never a hang), with `hold` (everything the requests touch) leaked rather
/// than freed if they time out. Receives of point-to-point calls (recv_call) have their
/// received count checked (a short message is a td::Error naming `what`, the peer and `phase`).
class Step {
 public:
  Step(std::chrono::steady_clock::time_point deadline, std::function<std::string()> describe,
       std::shared_ptr<void> hold, std::string_view what);
  /// Requests still pending (an exception between posts, or a wait that threw) keep `hold`
  /// forever: MPI may still read or write it.
  ~Step();
  Step(const Step&) = delete;
  Step& operator=(const Step&) = delete;
  /// Posts one call of the step; `phase` names it in a short-message error (receives).
  void post(const DataCall& call, std::string phase = {});
  /// Waits for every call posted since the last wait, then checks the receives' counts.
  void wait();

 private:
  std::chrono::steady_clock::time_point deadline_;
  std::function<std::string()> describe_;
  std::shared_ptr<void> hold_;
  std::string what_;
  std::vector<MPI_Request> requests_;
  struct Check {
    std::size_t request;
    DataCall call;
    std::string phase;
  };
  std::vector<Check> checks_;
  std::vector<std::shared_ptr<GatheredAllreduce>> gathered_;  // reduced once the step completes
};

}  // namespace td::detail
