// Sequence numbers and the flight recorder (docs/reliability.md, "When a call times out").
//
// Every call on a group takes the group's next sequence number when it starts (a CallScope, the
// one place numbers are drawn): collectives, transport, barrier and the Reducer's steps share
// one counter, which every rank of the group advances alike; point to point has a counter of its
// own (only two ranks take part), as torch's flight recorder keeps p2p apart. The last
// TD_FLIGHT_RECORDER calls (default 1024, 0: none) are kept in a ring with their times; what a
// rank is doing now (the calls its threads are inside) is always kept, so that the diagnosis of
// a timeout (diagnosis.cpp) can say where each rank is.
#pragma once

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>
#include <string_view>

namespace td::detail {

struct GroupState;

/// Which counter a call draws from.
enum class CallKind : std::uint8_t { Collective, PointToPoint, ReducerStep };

/// What a call moves and with which options, for the record.
struct CallSummary {
  std::string_view first_key;  // "" when the call has no leaves
  std::size_t leaves = 0;
  std::uint64_t bytes = 0;
  std::uint32_t dtype_mask = 0;    // bit d: some leaf has dtype d
  int root = -1;                   // root, dst, src, or the peer of point to point (-1: none)
  int reduce_op = -1;              // a td::ReduceOp, -1: none
  std::uint64_t bucket_bytes = 0;  // 0: none
  bool async = false;
};

/// A call in the ring: its group, its number and where it is kept (valid while not overwritten).
struct CallRef {
  std::uint64_t group = 0;
  std::uint64_t seq = 0;  // 0: no call
  std::uint32_t slot = 0;
  CallKind kind = CallKind::Collective;
  explicit operator bool() const { return seq != 0; }
};

/// A library call, from its start to its return, on the calling thread. The outermost scope of
/// a thread is the call (an operation built from others, such as transport over the agreement,
/// is one call); nested scopes record nothing. Movable, not copyable.
class CallScope {
 public:
  CallScope() = default;
  CallScope(GroupState& g, std::string_view op, CallKind kind, const CallSummary& summary);
  CallScope(CallScope&& other) noexcept;
  CallScope& operator=(CallScope&& other) noexcept;
  CallScope(const CallScope&) = delete;
  CallScope& operator=(const CallScope&) = delete;
  ~CallScope();

  /// The ranks agreed on the call (its agreement round completed).
  void agreed() const;
  const CallRef& ref() const { return ref_; }

 private:
  void end() noexcept;
  CallRef ref_;
  bool active_ = false;  // counted in the thread's depth
  int uncaught_ = 0;     // std::uncaught_exceptions() at the start: more at the end = failed
};

/// The call the calling thread is in (its outermost scope), or an empty ref.
CallRef current_call();

/// Executor hook (comm/executor.cpp post()): the current call's data starts moving.
void note_data_started();
/// A pending operation (WorkState) of `call` exists / settled; a call whose scope ended is
/// complete when its last operation settles.
void note_work_created(const CallRef& call);
void note_work_settled(const CallRef& call, bool ok);

/// A Reducer step begins on `g` (the first mark_ready of a step) / ends (finish returned or
/// failed): a call that spans several entries into the library.
CallRef begin_step(GroupState& g, const CallSummary& summary);
void end_step(const CallRef& step, bool ok);
/// While alive, the calling thread is inside the library on behalf of `step` (mark_ready,
/// finish): reported as in that call.
class StepScope {
 public:
  explicit StepScope(const CallRef& step);
  ~StepScope();
  StepScope(const StepScope&) = delete;
  StepScope& operator=(const StepScope&) = delete;

 private:
  bool active_ = false;
};

/// A group joins the record (make_group): gives it its id and name, the same on every member
/// (world: 0; a group made from `parent`, by new_group (`what` empty) or as a duplicate named
/// `what`: from the parent's id and its count of groups made from it, which every member of the
/// parent advances alike, since making a group is collective over the parent).
void register_group(const std::shared_ptr<GroupState>& g, const GroupState* parent,
                    std::string_view what);

/// Where this process is, relative to call `seq` of group `group` (the answer to a diagnosis
/// query, computed under the recorder's lock).
struct LocalStatus {
  int state = 0;          // td::RankStatus::State
  std::uint64_t seq = 0;  // the call it is in, or (Outside) the last it completed on the group
  std::string call;       // "all_reduce #42 on world ('grads.w', 73 leaves)"
  std::string op;         // the operation's name alone ("TensorDict.all_reduce")
  std::int64_t since_ms = 0;
  CallKind kind = CallKind::Collective;
  std::uint64_t group = 0;  // of `call`
  bool failed = false;      // Outside: `call` failed (a timeout, an error) rather than completed
  bool completed = false;   // the call asked about completed here (whatever the rank does now)
};
LocalStatus local_status(std::uint64_t group, std::uint64_t seq);
/// What the record knows of one call: its description ("TensorDict.all_reduce #42 on world
/// ('grads.w', 73 leaves)"), its operation's name, and its root or peer (-1: none).
struct CallFacts {
  std::string text;
  std::string op;
  int root = -1;
};
CallFacts call_facts(const CallRef& call);
/// The name of group `id` ("world", "group 3"), or "group <id>".
std::string group_name(std::uint64_t id);
/// The group of `id`, if still alive.
std::shared_ptr<GroupState> group_by_id(std::uint64_t id);

/// Writes the ring as JSON to `file` (docs/reliability.md, "The dump"); `reason` says why.
void write_flight_record(const std::filesystem::path& file, std::string_view reason);
/// With TD_FLIGHT_RECORDER_DIR set: writes <dir>/rank-<world rank>.json; never throws. An
/// automatic dump (a timeout, td::abort, a diagnosis query) is written once per process: the
/// first incident is the moment the other ranks were asked about, and a later td::abort must
/// not replace it; `always` (SIGUSR1) writes every time. td::dump_flight_recorder(file) counts
/// as that dump only when `file` is that same file.
void dump_to_dir(std::string_view reason, bool always = false) noexcept;

/// Time spent recording, for the cost figure: calls recorded and nanoseconds inside the recorder.
struct RecorderCost {
  std::uint64_t calls = 0;
  std::uint64_t ns = 0;
};
RecorderCost recorder_cost();

}  // namespace td::detail
