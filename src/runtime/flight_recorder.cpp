// The flight recorder: sequence numbers, the ring of recent calls, what each thread is inside,
// and the JSON dump. One mutex guards it all; a call takes it four times (start, agreed, data,
// end), each for a few stores.
#include "runtime/flight_recorder.hpp"

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <mutex>
#include <unordered_map>
#include <vector>

#include <unistd.h>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "core/config.hpp"
#include "runtime/group_state.hpp"
#include "runtime/work_state.hpp"
#include "tensordict/dtype.hpp"
#include "tensordict/errors.hpp"
#include "tensordict/flight_recorder.hpp"

namespace td::detail {

namespace {

using SysClock = std::chrono::system_clock;

std::int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(SysClock::now().time_since_epoch())
      .count();
}

template <std::size_t N>
void copy_text(std::array<char, N>& to, std::string_view from) {
  const std::size_t n = std::min(from.size(), N - 1);
  if (n > 0) std::memcpy(to.data(), from.data(), n);  // an empty view may hold a null pointer
  to[n] = '\0';
}

// What names a call: kept for the calls threads are inside and for each group's last call even
// with the ring off.
struct CallInfo {
  CallRef ref;
  std::array<char, 40> op{};
  std::array<char, 64> key{};
  std::uint32_t leaves = 0;
  std::uint64_t bytes = 0;
  std::int64_t entered = 0;
};

struct Slot {
  CallInfo info;
  std::uint32_t dtype_mask = 0;
  int root = -1;
  int reduce_op = -1;
  std::uint64_t bucket_bytes = 0;
  bool async = false;
  std::int64_t agreed = 0, data_started = 0, returned = 0, finished = 0;
  std::uint32_t pending = 0;  // operations (WorkStates) not settled yet
  bool has_returned = false;
  bool failed = false;
};

struct Active {
  const void* thread;  // the thread's state, as an identity
  CallInfo info;
};

struct GroupEntry {
  std::weak_ptr<GroupState> state;
  std::string name;
  std::vector<int> world_ranks;
  std::uint64_t children = 0;  // duplicates and (world) new groups made from it
  CallInfo last;               // its last call that ended (ref.seq 0: none)
  bool last_failed = false;
};

class Recorder {
 public:
  std::mutex mu;
  std::vector<Slot> ring;
  std::uint64_t written = 0;
  std::vector<Active> active;
  std::unordered_map<std::uint64_t, GroupEntry> groups;
  std::uint64_t new_groups = 0;
  std::int64_t last_exit = 0;        // when a thread last left the library
  std::int64_t last_group_made = 0;  // when the last group joined the record (init, new_group)
  CallInfo last_call;                // the last call that ended, any group
  bool last_call_failed = false;
  std::atomic<std::uint64_t> cost_calls{0}, cost_ns{0};

  Recorder() : ring(config().flight_recorder) {}

  Slot* slot_of(const CallRef& r) {
    if (ring.empty() || !r) return nullptr;
    Slot& s = ring[r.slot % ring.size()];
    return s.info.ref.seq == r.seq && s.info.ref.group == r.group && s.info.ref.kind == r.kind
               ? &s
               : nullptr;
  }

  // Call `seq` of `group` (not point to point) in the ring, or null.
  const Slot* collective_slot(std::uint64_t group, std::uint64_t seq) const {
    for (const Slot& s : ring)
      if (s.info.ref.group == group && s.info.ref.seq == seq &&
          s.info.ref.kind != CallKind::PointToPoint)
        return &s;
    return nullptr;
  }

  CallRef begin(GroupState& g, std::string_view op, CallKind kind, const CallSummary& sum,
                const void* thread) {
    CallRef ref;
    ref.group = g.id;
    ref.kind = kind;
    ref.seq = (kind == CallKind::PointToPoint ? g.p2p_seq : g.seq)
                  .fetch_add(1, std::memory_order_relaxed) +
              1;
    CallInfo info;
    info.ref = ref;
    copy_text(info.op, op);
    copy_text(info.key, sum.first_key);
    info.leaves = static_cast<std::uint32_t>(std::min<std::size_t>(sum.leaves, UINT32_MAX));
    info.bytes = sum.bytes;
    info.entered = now_ns();
    std::lock_guard lock(mu);
    if (!ring.empty()) {
      ref.slot = static_cast<std::uint32_t>(written++ % ring.size());
      info.ref.slot = ref.slot;
      Slot& s = ring[ref.slot];
      s = Slot{};
      s.info = info;
      s.dtype_mask = sum.dtype_mask;
      s.root = sum.root;
      s.reduce_op = sum.reduce_op;
      s.bucket_bytes = sum.bucket_bytes;
      s.async = sum.async;
    }
    if (thread) active.push_back({thread, info});
    return ref;
  }

  // The thread left the library (its call returned or threw).
  void leave(const CallRef& ref, const void* thread, bool failed) {
    const std::int64_t t = now_ns();
    std::lock_guard lock(mu);
    auto it = std::find_if(active.begin(), active.end(),
                           [&](const Active& a) { return a.thread == thread; });
    CallInfo info;
    if (it != active.end()) {
      info = it->info;
      active.erase(it);
    }
    last_exit = t;
    if (!info.ref) return;
    if (Slot* s = slot_of(ref)) {
      s->has_returned = true;
      s->returned = t;
      s->failed = s->failed || failed;
      if (s->pending == 0 && s->finished == 0) s->finished = t;
    }
    ended(info, failed);
  }

  void ended(const CallInfo& info, bool failed) {
    last_call = info;
    last_call_failed = failed;
    auto g = groups.find(info.ref.group);
    if (g != groups.end() && info.ref.kind != CallKind::PointToPoint) {
      g->second.last = info;
      g->second.last_failed = failed;
    }
  }
};

Recorder& recorder() {
  static auto* r = new Recorder();  // NOLINT: lives until exit (dumps from signal handlers' helper)
  return *r;
}

// The calling thread's call: the outermost scope (or Reducer step) it is inside.
struct ThreadCall {
  CallRef ref;
  int depth = 0;
  bool data_noted = false;  // note_data_started already ran for `ref`
};
thread_local ThreadCall t_call;

// The recorder's own cost, by its own clock.
struct CostTimer {
  std::chrono::steady_clock::time_point start = std::chrono::steady_clock::now();
  ~CostTimer() {
    const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(
                        std::chrono::steady_clock::now() - start)
                        .count();
    recorder().cost_ns.fetch_add(static_cast<std::uint64_t>(ns), std::memory_order_relaxed);
  }
};

std::string summary_text(const CallInfo& i) {
  if (i.key[0] == '\0') return {};
  return fmt::format(" ('{}', {} lea{})", i.key.data(), i.leaves, i.leaves == 1 ? "f" : "ves");
}

std::string describe_locked(Recorder& r, const CallInfo& i) {
  auto g = r.groups.find(i.ref.group);
  const std::string gname =
      g != r.groups.end() ? g->second.name : fmt::format("group {}", i.ref.group);
  const char* kind = i.ref.kind == CallKind::PointToPoint ? " (point to point)" : "";
  return fmt::format("{} #{}{} on {}{}", i.op.data(), i.ref.seq, kind, gname, summary_text(i));
}

const char* kind_name(CallKind k) {
  switch (k) {
    case CallKind::Collective:
      return "collective";
    case CallKind::PointToPoint:
      return "point_to_point";
    case CallKind::ReducerStep:
      return "reducer_step";
  }
  return "collective";
}

std::int64_t ms_since(std::int64_t now, std::int64_t since) {
  return since > 0 ? (now - since) / 1000000 : 0;
}

// This rank is in `info`'s call (InThisCall or InOtherCall). Under the recorder's lock.
LocalStatus status_in(Recorder& r, const CallInfo& info, RankStatus::State state,
                      std::int64_t now) {
  LocalStatus st;
  st.state = static_cast<int>(state);
  st.seq = info.ref.seq;
  st.call = describe_locked(r, info);
  st.op = info.op.data();
  st.since_ms = ms_since(now, info.entered);
  st.kind = info.ref.kind;
  st.group = info.ref.group;
  return st;
}

// This rank is outside the library: after its last call on `group`, else after its last call
// on any group (seq 0), else having made none (since init or its last new group, the last time
// it was inside the library). Under the recorder's lock.
LocalStatus status_outside(Recorder& r, std::uint64_t group, std::int64_t now) {
  LocalStatus st;
  st.state = static_cast<int>(RankStatus::State::Outside);
  st.since_ms = ms_since(now, r.last_exit != 0 ? r.last_exit : r.last_group_made);
  auto g = r.groups.find(group);
  const bool on_group = g != r.groups.end() && g->second.last.ref;
  if (!on_group && !r.last_call.ref) return st;
  const CallInfo& last = on_group ? g->second.last : r.last_call;
  st.seq = on_group ? last.ref.seq : 0;
  st.call = describe_locked(r, last);
  st.op = last.op.data();
  st.kind = last.ref.kind;
  st.group = last.ref.group;
  st.failed = on_group ? g->second.last_failed : r.last_call_failed;
  return st;
}

// ---- the dump ----

int world_rank() {
  int rank = -1, initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (initialized && !finalized) MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  return rank;
}

// The automatic dump (TD_FLIGHT_RECORDER_DIR) was written: by an incident, or by
// td::dump_flight_recorder to the same file.
std::atomic<bool> g_dir_dump_written{false};

// <TD_FLIGHT_RECORDER_DIR>/rank-<world rank>.json, or empty without the setting.
std::filesystem::path dir_dump_path() {
  const std::string& dir = config().flight_recorder_dir;
  if (dir.empty()) return {};
  return std::filesystem::path(dir) / fmt::format("rank-{}.json", world_rank());
}

// td::dump_flight_recorder wrote `file`: when that is this rank's automatic dump, it counts as
// it, and a later incident (td::abort, a timeout) does not replace the file the program wrote.
void note_explicit_dump(const std::filesystem::path& file) {
  const std::filesystem::path own = dir_dump_path();
  std::error_code ec;
  if (!own.empty() && std::filesystem::equivalent(file, own, ec)) g_dir_dump_written = true;
}

// Who wrote the dump, where, when and why.
nlohmann::json process_json(std::string_view reason) {
  int world_size = 0, initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (initialized && !finalized) MPI_Comm_size(MPI_COMM_WORLD, &world_size);
  std::array<char, 256> host{};
  gethostname(host.data(), host.size() - 1);
  nlohmann::json doc;
  doc["format"] = "tensordict-mpi flight recorder";
  doc["version"] = 1;
  doc["rank"] = world_rank();
  doc["world_size"] = world_size;
  doc["host"] = host.data();
  doc["pid"] = static_cast<long long>(getpid());
  doc["reason"] = std::string(reason);
  doc["time_unit"] = "ns since the Unix epoch";
  doc["dumped_at"] = now_ns();
  return doc;
}

// The groups: id, name, members, this rank in it, next sequence numbers. Under the lock.
nlohmann::json groups_json(const Recorder& r) {
  nlohmann::json groups = nlohmann::json::array();
  for (const auto& [id, g] : r.groups) {
    auto st = g.state.lock();
    groups.push_back({{"id", id},
                      {"name", g.name},
                      {"world_ranks", g.world_ranks},
                      {"rank", st ? st->rank : -1},
                      {"next_seq", st ? st->seq.load() + 1 : 0},
                      {"next_p2p_seq", st ? st->p2p_seq.load() + 1 : 0}});
  }
  return groups;
}

const char* state_of(const Slot& s) {
  if (s.failed) return "failed";
  if (s.finished != 0) return "completed";
  if (s.data_started != 0) return "moving data";
  if (s.agreed != 0) return "agreed";
  return "entered";
}

nlohmann::json entry_json(const Slot& s) {
  using nlohmann::json;
  json dtypes = json::array();
  for (std::size_t d = 0; d < kNumDTypes; ++d)
    if (s.dtype_mask & (1u << d)) dtypes.push_back(name(static_cast<DType>(d)));
  return {{"seq", s.info.ref.seq},
          {"group", s.info.ref.group},
          {"kind", kind_name(s.info.ref.kind)},
          {"op", s.info.op.data()},
          {"first_key", s.info.key.data()},
          {"leaves", s.info.leaves},
          {"bytes", s.info.bytes},
          {"dtypes", std::move(dtypes)},
          {"root", s.root},
          {"reduce_op",
           s.reduce_op >= 0 ? json(name(static_cast<ReduceOp>(s.reduce_op))) : json(nullptr)},
          {"bucket_bytes", s.bucket_bytes},
          {"async", s.async},
          {"state", state_of(s)},
          {"pending_operations", s.pending},
          {"t_entered", s.info.entered},
          {"t_agreed", s.agreed},
          {"t_data_started", s.data_started},
          {"t_returned", s.returned},
          {"t_finished", s.finished}};
}

// The ring, oldest first. Under the lock.
nlohmann::json entries_json(const Recorder& r) {
  nlohmann::json entries = nlohmann::json::array();
  const std::uint64_t n = std::min<std::uint64_t>(r.written, r.ring.size());
  for (std::uint64_t i = r.written - n; i < r.written; ++i)
    entries.push_back(entry_json(r.ring[i % r.ring.size()]));
  return entries;
}

// The calls this process's threads are inside. Under the lock.
nlohmann::json inside_json(const Recorder& r) {
  nlohmann::json inside = nlohmann::json::array();
  for (const Active& a : r.active)
    inside.push_back({{"group", a.info.ref.group},
                      {"seq", a.info.ref.seq},
                      {"kind", kind_name(a.info.ref.kind)},
                      {"op", a.info.op.data()},
                      {"t_entered", a.info.entered}});
  return inside;
}

// Written to a temporary beside `file`, then renamed: a reader never sees half a dump.
void write_json_file(const std::filesystem::path& file, const nlohmann::json& doc) {
  const std::filesystem::path tmp = file.string() + ".tmp";
  {
    std::ofstream out(tmp);
    if (!out) throw Error(fmt::format("dump_flight_recorder: cannot write '{}'", tmp.string()));
    out << doc.dump(1) << '\n';
    if (!out.flush())
      throw Error(fmt::format("dump_flight_recorder: writing '{}' failed", tmp.string()));
  }
  std::filesystem::rename(tmp, file);
}

}  // namespace

CallScope::CallScope(GroupState& g, std::string_view op, CallKind kind, const CallSummary& summary)
    : active_(true), uncaught_(std::uncaught_exceptions()) {
  if (t_call.depth++ > 0) return;  // inside a call already: part of it
  CostTimer timer;
  ref_ = recorder().begin(g, op, kind, summary, &t_call);
  t_call.ref = ref_;
  t_call.data_noted = false;
  recorder().cost_calls.fetch_add(1, std::memory_order_relaxed);
}

CallScope::CallScope(CallScope&& other) noexcept
    : ref_(other.ref_), active_(other.active_), uncaught_(other.uncaught_) {
  other.active_ = false;
  other.ref_ = {};
}

CallScope& CallScope::operator=(CallScope&& other) noexcept {
  if (this != &other) {
    end();
    ref_ = other.ref_;
    active_ = other.active_;
    uncaught_ = other.uncaught_;
    other.active_ = false;
    other.ref_ = {};
  }
  return *this;
}

CallScope::~CallScope() { end(); }

void CallScope::end() noexcept {
  if (!active_) return;
  active_ = false;
  if (--t_call.depth > 0 || !ref_) return;
  t_call.ref = {};
  try {
    CostTimer timer;
    recorder().leave(ref_, &t_call, std::uncaught_exceptions() > uncaught_);
  } catch (...) {  // NOLINT(bugprone-empty-catch): recording never fails a call
  }
}

void CallScope::agreed() const {
  if (!ref_) return;
  CostTimer timer;
  const std::int64_t t = now_ns();
  Recorder& r = recorder();
  std::lock_guard lock(r.mu);
  if (Slot* s = r.slot_of(ref_)) s->agreed = t;
}

CallRef current_call() { return t_call.ref; }

void note_data_started() {
  const CallRef& ref = t_call.ref;
  // Once per call: the executor posts every message of a call, the record needs the first.
  if (!ref || t_call.data_noted) return;
  t_call.data_noted = true;
  Recorder& r = recorder();
  if (r.ring.empty()) return;
  CostTimer timer;
  std::lock_guard lock(r.mu);
  if (Slot* s = r.slot_of(ref); s && s->data_started == 0) s->data_started = now_ns();
}

void note_work_created(const CallRef& call) {
  if (!call) return;
  Recorder& r = recorder();
  if (r.ring.empty()) return;
  CostTimer timer;
  std::lock_guard lock(r.mu);
  if (Slot* s = r.slot_of(call)) ++s->pending;
}

void note_work_settled(const CallRef& call, bool ok) {
  if (!call) return;
  Recorder& r = recorder();
  if (r.ring.empty()) return;
  CostTimer timer;
  const std::int64_t t = now_ns();
  std::lock_guard lock(r.mu);
  Slot* s = r.slot_of(call);
  if (!s) return;
  if (s->pending > 0) --s->pending;
  s->failed = s->failed || !ok;
  if (s->pending == 0 && s->has_returned && s->finished == 0) s->finished = t;
}

CallRef begin_step(GroupState& g, const CallSummary& summary) {
  CostTimer timer;
  return recorder().begin(g, "Reducer step", CallKind::ReducerStep, summary, nullptr);
}

void end_step(const CallRef& step, bool ok) {
  if (!step) return;
  CostTimer timer;
  const std::int64_t t = now_ns();
  Recorder& r = recorder();
  std::lock_guard lock(r.mu);
  CallInfo info;
  info.ref = step;
  if (Slot* s = r.slot_of(step)) {
    s->has_returned = true;
    s->returned = t;
    s->failed = s->failed || !ok;
    if (s->pending == 0 && s->finished == 0) s->finished = t;
    info = s->info;
  } else {
    copy_text(info.op, "Reducer step");
  }
  r.ended(info, !ok);
}

StepScope::StepScope(const CallRef& step) {
  if (!step) return;
  active_ = true;
  if (t_call.depth++ > 0) return;  // inside a call already: part of it
  t_call.ref = step;
  t_call.data_noted = false;
  Recorder& r = recorder();
  std::lock_guard lock(r.mu);
  CallInfo info;
  if (Slot* s = r.slot_of(step)) {
    info = s->info;
  } else {
    info.ref = step;
    copy_text(info.op, "Reducer step");
    info.entered = now_ns();
  }
  r.active.push_back({&t_call, info});
}

StepScope::~StepScope() {
  if (!active_) return;
  if (--t_call.depth > 0) return;
  t_call.ref = {};
  Recorder& r = recorder();
  std::lock_guard lock(r.mu);
  std::erase_if(r.active, [](const Active& a) { return a.thread == &t_call; });
  r.last_exit = now_ns();
}

void register_group(const std::shared_ptr<GroupState>& g, const GroupState* parent,
                    std::string_view what) {
  Recorder& r = recorder();
  std::lock_guard lock(r.mu);
  if (!parent) {
    g->id = 0;
    g->name = "world";
  } else {
    GroupEntry& p = r.groups[parent->id];
    const std::uint64_t n = ++p.children;
    g->id = parent->id * 1000003 + n;
    g->name = what.empty() ? fmt::format("group {}", ++r.new_groups)
                           : fmt::format("{} (copy {} of {})", what, n, parent->name);
  }
  r.last_group_made = now_ns();
  GroupEntry& e = r.groups[g->id];
  e.state = g;
  e.name = g->name;
  e.world_ranks = g->world_ranks;
}

LocalStatus local_status(std::uint64_t group, std::uint64_t seq) {
  using State = RankStatus::State;
  Recorder& r = recorder();
  const std::int64_t t = now_ns();
  std::lock_guard lock(r.mu);
  // Whether this rank completed the call asked about, wherever it is now.
  bool completed = false;
  if (seq != 0) {
    if (const Slot* s = r.collective_slot(group, seq)) {
      // Failed here (its own timeout, an error): it did call it, and its timeout and diagnosis
      // may just have run before the asking rank's; still reported as in this call, so that
      // every rank sees the same picture. Completed here: where the rank is now, below.
      if (s->finished == 0 || s->failed) return status_in(r, s->info, State::InThisCall, t);
      completed = true;
    } else {
      // Gone from the ring: a later call on the group ended here, so this one did before it.
      auto g = r.groups.find(group);
      completed = g != r.groups.end() && g->second.last.ref.seq > seq;
    }
  }
  LocalStatus st;
  if (!r.active.empty()) {  // inside the library on behalf of a call (the oldest, if several)
    const Active& oldest = *std::min_element(
        r.active.begin(), r.active.end(),
        [](const Active& a, const Active& b) { return a.info.entered < b.info.entered; });
    const bool same = oldest.info.ref.group == group && oldest.info.ref.seq == seq &&
                      oldest.info.ref.kind != CallKind::PointToPoint;
    st = status_in(r, oldest.info, same ? State::InThisCall : State::InOtherCall, t);
  } else {
    st = status_outside(r, group, t);
  }
  st.completed = completed;
  return st;
}

CallFacts call_facts(const CallRef& call) {
  Recorder& r = recorder();
  std::lock_guard lock(r.mu);
  if (Slot* s = r.slot_of(call)) return {describe_locked(r, s->info), s->info.op.data(), s->root};
  for (const Active& a : r.active)
    if (a.info.ref.seq == call.seq && a.info.ref.group == call.group &&
        a.info.ref.kind == call.kind)
      return {describe_locked(r, a.info), a.info.op.data(), -1};
  CallInfo info;
  info.ref = call;
  copy_text(info.op, call.kind == CallKind::ReducerStep ? "Reducer step" : "call");
  return {describe_locked(r, info), info.op.data(), -1};
}

std::string group_name(std::uint64_t id) {
  Recorder& r = recorder();
  std::lock_guard lock(r.mu);
  auto g = r.groups.find(id);
  return g != r.groups.end() ? g->second.name : fmt::format("group {}", id);
}

std::shared_ptr<GroupState> group_by_id(std::uint64_t id) {
  Recorder& r = recorder();
  std::lock_guard lock(r.mu);
  auto g = r.groups.find(id);
  return g != r.groups.end() ? g->second.state.lock() : nullptr;
}

RecorderCost recorder_cost() {
  Recorder& r = recorder();
  return {r.cost_calls.load(), r.cost_ns.load()};
}

void write_flight_record(const std::filesystem::path& file, std::string_view reason) {
  Recorder& r = recorder();
  nlohmann::json doc = process_json(reason);
  {
    std::lock_guard lock(r.mu);
    doc["capacity"] = r.ring.size();
    doc["groups"] = groups_json(r);
    doc["entries"] = entries_json(r);
    doc["in_library"] = inside_json(r);
    doc["t_last_left_library"] = r.last_exit;
  }
  write_json_file(file, doc);
}

void dump_to_dir(std::string_view reason, bool always) noexcept {
  try {
    const std::filesystem::path file = dir_dump_path();
    if (file.empty()) return;
    if (g_dir_dump_written.exchange(true) && !always) return;
    std::filesystem::create_directories(file.parent_path());
    write_flight_record(file, reason);
    std::fprintf(stderr, "[td rank %d] flight recorder written to %s (%.*s)\n", world_rank(),
                 file.c_str(), static_cast<int>(reason.size()), reason.data());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "[td] could not write the flight recorder: %s\n", e.what());
  } catch (...) {  // NOLINT(bugprone-empty-catch): never fails the caller
  }
}

}  // namespace td::detail

namespace td {

void dump_flight_recorder(const std::filesystem::path& file) {
  detail::write_flight_record(file, "td::dump_flight_recorder");
  detail::note_explicit_dump(file);
}

}  // namespace td
