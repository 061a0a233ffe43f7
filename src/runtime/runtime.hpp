// Internals of the MPI runtime shared by the library's sources (not installed).
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include <mpi.h>

#include "core/tensor_internal.hpp"
#include "runtime/flight_recorder.hpp"
#include "runtime/tags.hpp"
#include "tensordict/bucket_plan.hpp"
#include "tensordict/collectives.hpp"
#include "tensordict/process_group.hpp"

namespace td::detail {

/// Throws td::MpiError naming the routine and MPI's error text.
[[noreturn]] void throw_mpi_error(const char* call, int code);

/// Checks an MPI return code; the routine's name ends up in the error.
#define TD_MPI_CHECK(call)                                                           \
  do {                                                                               \
    const int td_mpi_rc_ = (call);                                                   \
    if (td_mpi_rc_ != MPI_SUCCESS) ::td::detail::throw_mpi_error(#call, td_mpi_rc_); \
  } while (0)

/// kAutoBucketBytes resolved on a group: the cap, and the size from which leaves go alone.
struct TunedBuckets {
  std::size_t cap = 0;
  std::size_t direct_bytes = 0;
};

/// A group split by node (MPI_COMM_TYPE_SHARED, or TD_TEST_RANKS_PER_NODE's simulated nodes),
/// made once with the group: the communicators of the node-aware strategy of all_reduce / reduce
/// / broadcast (comm/runner.cpp) and the order its stages are posted in.
struct NodeSplit {
  MPI_Comm within = MPI_COMM_NULL;   // this rank's node: the first stage (reduce, or broadcast)
  MPI_Comm within2 = MPI_COMM_NULL;  // a duplicate of `within`: the last stage (broadcast)
  MPI_Comm leaders = MPI_COMM_NULL;  // rank 0 of every node (MPI_COMM_NULL elsewhere)
  int local_rank = 0;                // in `within`: by group rank, so the node's lowest is 0
  int nodes = 1;
  int largest = 1;            // ranks on the fullest node
  std::vector<int> node_of;   // per group rank: its node (its leader's rank in `leaders`)
  std::vector<int> local_of;  // per group rank: its rank on its node
  // Stage s of every node-aware message is posted in the order the messages started (tickets
  // drawn when they start), whichever thread posts it: the ranks of a communicator must post
  // its collectives in one order, and a message's later stages are posted when its earlier ones
  // complete, which happens in different orders on different ranks.
  std::atomic<std::uint64_t> drawn[3] = {0, 0, 0};
  std::atomic<std::uint64_t> posted[3] = {0, 0, 0};
};

/// Shared state of one process group: its communicator and what is cached per group.
struct GroupState {
  MPI_Comm comm = MPI_COMM_NULL;  // our own duplicate; MPI_COMM_NULL on non-members
  int rank = -1;
  int size = 0;
  std::vector<int> world_ranks;
  bool destroyed = false;  // destroy_process_group ran; any use throws
  // The flight recorder's identity of the group, the same on every member
  // (runtime/flight_recorder.hpp), and its sequence numbers: the last drawn.
  std::uint64_t id = 0;
  std::string name;
  std::atomic<std::uint64_t> seq{0};      // collectives, transport, barrier, Reducer steps
  std::atomic<std::uint64_t> p2p_seq{0};  // point to point

  std::mutex mu;  // guards the caches below
  std::unordered_map<std::uint64_t, std::shared_ptr<const BucketPlan>> plans;  // by layout+cap
  std::uint64_t plan_hits = 0, plan_misses = 0;
  std::optional<TunedBuckets> tuned;  // kAutoBucketBytes resolved on this group
  std::shared_ptr<Storage> scratch;   // reused pack buffer of sync calls
  std::optional<TagSpace> tags;       // point to point and transport (members only)
  NodeSplit nodes;                    // members only

  GroupState() = default;
  GroupState(const GroupState&) = delete;
  GroupState& operator=(const GroupState&) = delete;
  ~GroupState();

  /// The communicator for a collective named `what`; throws if not a member or destroyed.
  MPI_Comm checked_comm(std::string_view what) const;
};

/// What the library reads of a ProcessGroup, and how it makes one (the public class hides both).
struct GroupAccess {
  static ProcessGroup wrap(std::shared_ptr<GroupState> state) {
    return ProcessGroup(std::move(state));
  }
  static const std::shared_ptr<GroupState>& state(const ProcessGroup& group) {
    return group.state_;
  }
};

/// How many ranks of `comm` share this rank's memory (its host). Collective over `comm`.
int ranks_on_this_host(MPI_Comm comm);

/// Whether all_reduce / reduce / broadcast on `g` run node-aware: TD_HIERARCHICAL, else whether
/// the group spans several nodes with more than one of its ranks on some node.
bool node_aware(const GroupState& g);

/// The group of a call's options (world() by default).
std::shared_ptr<GroupState> group_of(const CollectiveOptions& opts);
/// A new group of the same ranks over its own duplicate of g's communicator (collective over
/// g: every member calls it), released by destroy_process_group like every group.
std::shared_ptr<GroupState> duplicate_group(const GroupState& g, std::string_view what);
/// The timeout of a call's options (the default of init_process_group otherwise).
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

/// Keeps `p` alive for the rest of the process: memory that a request still pending after a
/// timeout or an error may read or write.
void leak(std::shared_ptr<void> p);

/// Polls `req` until it completes; throws td::TimeoutError (message from `describe`) when
/// `deadline` passes first. On timeout `buffers` (what the request touches) is deliberately
/// leaked: MPI may still write into it.
void wait_until(MPI_Request& req, std::chrono::steady_clock::time_point deadline,
                const std::function<std::string()>& describe, std::shared_ptr<void> buffers = {},
                MPI_Status* status = nullptr);

/// Throws td::Error when a completed point-to-point receive got another number of elements of
/// `type` than `expected` (MPI accepts a shorter message silently): names the operation, the
/// peer, the phase and both counts.
void check_received(const MPI_Status& status, MPI_Datatype type, int expected, int peer,
                    std::string_view what, std::string_view phase);

/// A pending operation: its MPI requests and everything they touch, and what to do once done.
class WorkState {
 public:
  /// Of the call the calling thread is in (its flight-recorder entry counts the operation).
  WorkState();
  std::vector<MPI_Request> requests;
  std::function<void()> finish;  // runs once after every request completed
  // A next phase, if any: runs (under the state's lock) once every request completed, may post
  // new requests into `requests` (the operation then waits for them, and may set `then` again)
  // or throw (the operation fails with that error; finish() does not run).
  std::function<void(WorkState&)> then;
  std::shared_ptr<Storage> buffer;          // packed bucket, if any
  std::vector<Tensor> keep_alive;           // leaves the requests read or write
  std::vector<std::shared_ptr<void>> held;  // other memory the requests touch
  std::function<std::string()> describe;    // "all_reduce of bucket 2 (float32, ...)" for errors
  std::chrono::steady_clock::time_point deadline;
  /// A point-to-point receive of the current phase whose received count is checked when the
  /// phase completes (check_received): requests[request] must bring `count` elements.
  struct ReceiveCheck {
    std::size_t request;
    MPI_Datatype type;
    int count;
    int peer;
    const char* phase;
  };
  std::vector<ReceiveCheck> receive_checks;  // cleared with `requests` at each phase
  std::string what;                          // the operation's name, for the checks' errors
  CallRef call;                              // the call it belongs to (sequence number)

  /// Tests the requests (non-blocking); runs finish() once all completed.
  bool test();
  /// Waits until done or the deadline; rethrows the error of a failed operation.
  void wait();
  /// Whether the operation can no longer touch its buffers.
  bool settled();
  /// Whether a wait() gave up on it (its buffers are leaked; nothing more to wait for).
  bool timed_out();
  /// Fails a still pending operation with `error` without waiting (its buffers are leaked: MPI
  /// may still write into them); later wait()s rethrow it. No effect on a settled operation.
  void abandon(std::exception_ptr error);
  /// Set by the progress thread when it takes the operation over: wait() then sleeps until the
  /// thread completes it instead of calling MPI from a second thread (which would only contend
  /// with the progress thread for Open MPI's locks).
  std::atomic<bool> on_progress_thread{false};
  /// Set by Work::wait() and Work::is_completed(): a Work destroyed before either was called
  /// is a dropped result (Work::~Work warns once per process).
  std::atomic<bool> observed{false};

  ~WorkState();

 private:
  enum class Status { Pending, Done, Failed };
  bool complete_locked();
  void fail_locked(std::exception_ptr error);
  void leak_buffers();  // what the requests touch, kept forever (they may still be pending)
  std::mutex mu_;
  std::condition_variable settled_cv_;
  Status status_ = Status::Pending;
  std::exception_ptr error_;
  bool timed_out_ = false;
};

/// How the library hands out a pending operation as a td::Work (whose constructor is hidden).
struct WorkAccess {
  static Work wrap(std::shared_ptr<WorkState> state) { return Work(std::move(state)); }
};

}  // namespace td::detail

namespace td::detail {

/// Hands a pending operation to the progress thread (started on first use when MPI runs with
/// MPI_THREAD_MULTIPLE and TD_PROGRESS_THREAD is not 0), which tests it until it completes so the
/// communication advances while the caller computes. Without the thread, wait() and
/// is_completed() drive progress.
void progress_add(const std::shared_ptr<WorkState>& work);
/// progress_add for several operations at once (started together: hand them over once all are
/// started, so the thread does not contend with the starting thread for MPI's locks).
void progress_add(const std::vector<std::shared_ptr<WorkState>>& works);
/// Who drives an operation: the progress thread, or waits (without the thread).
enum class ProgressMode { Thread, Manual };
/// progress_add with the mode decided by the caller (the Reducer decides once per step, so that
/// set_async_progress toggled mid-step cannot split one step's buckets between the two).
void progress_add(const std::vector<std::shared_ptr<WorkState>>& works, ProgressMode mode);
/// Without the progress thread: tests every other pending phased operation handed to
/// progress_add (wait() and is_completed() call it, as MPI's waits progress every request).
void progress_others(const WorkState* except);
/// Stops and joins the progress thread (before MPI_Finalize).
void progress_stop();
/// destroy_process_group: waits for every pending operation handed to progress_add (each until
/// its own deadline), then fails those still pending with td::Error naming `why`, so that their
/// Works' destructors return at once and nothing calls MPI after MPI_Finalize.
void progress_settle_all(const std::string& why);
/// Registers a thread blocked in wait() on an operation the progress thread drives; while there
/// is one, the thread polls without sleeping between rounds.
void progress_waiter(int delta);

/// Sets whether async operations get the progress thread, unless TD_PROGRESS_THREAD or
/// td::set_async_progress() already decided it; true if this call decided it.
bool progress_thread_default(bool on);

}  // namespace td::detail
