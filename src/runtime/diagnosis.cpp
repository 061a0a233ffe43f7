// Live diagnosis of a timeout: the query, the answering thread, and the verdict's wording.
//
// Protocol, on a duplicate of MPI_COMM_WORLD made at init (nothing else uses it): a query is 7
// int64 words {version, group id, seq, reply tag, kind, querier's world rank, dump} sent with
// tag 1 (dump: the asking rank writes its flight recorder, TD_FLIGHT_RECORDER_DIR, and asks the
// others to write theirs, so that the directory holds every rank's view of the same moment);
// the answer, on the reply tag, is 9 int64 words {state, seq, since ms, kind, group, op bytes,
// call bytes, failed, completed} followed by the two texts. The asking rank waits at most
// TD_DIAGNOSIS_MS for the answers; a rank that does not answer in time is NoAnswer, and its late
// answer is never read (the receive is cancelled).
#include "runtime/diagnosis.hpp"

#include <algorithm>
#include <array>
#include <atomic>
#include <condition_variable>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <thread>

#include <fmt/format.h>

#include "core/config.hpp"
#include "runtime/group_state.hpp"
#include "runtime/rank_list.hpp"
#include "tensordict/collectives.hpp"

namespace td {

TimeoutError::TimeoutError(const std::string& what, std::vector<RankStatus> diagnosis)
    : Error(what),
      diagnosis_(std::make_shared<const std::vector<RankStatus>>(std::move(diagnosis))) {}

const std::vector<RankStatus>& TimeoutError::diagnosis() const {
  static const std::vector<RankStatus> none;
  return diagnosis_ ? *diagnosis_ : none;
}

}  // namespace td

namespace td::detail {

namespace {

using State = RankStatus::State;
constexpr int kQueryTag = 1;
constexpr int kQueryWords = 7;
constexpr int kReplyWords = 9;
constexpr std::size_t kReplyBytes = 4096;
constexpr std::int64_t kVersion = 2;

std::atomic<bool> g_dump_requested{false};

extern "C" void on_sigusr1(int /*signal*/) { g_dump_requested.store(true); }

bool thread_multiple() {
  int initialized = 0, finalized = 0, provided = MPI_THREAD_SINGLE;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (!initialized || finalized) return false;
  MPI_Query_thread(&provided);
  return provided == MPI_THREAD_MULTIPLE;
}

std::vector<std::byte> encode_reply(const LocalStatus& st) {
  const std::size_t op = std::min<std::size_t>(st.op.size(), 256);
  const std::size_t call =
      std::min(st.call.size(), kReplyBytes - kReplyWords * sizeof(std::int64_t) - op);
  std::array<std::int64_t, kReplyWords> w{st.state,
                                          static_cast<std::int64_t>(st.seq),
                                          st.since_ms,
                                          static_cast<std::int64_t>(st.kind),
                                          static_cast<std::int64_t>(st.group),
                                          static_cast<std::int64_t>(op),
                                          static_cast<std::int64_t>(call),
                                          st.failed ? 1 : 0,
                                          st.completed ? 1 : 0};
  std::vector<std::byte> out(sizeof(w) + op + call);
  std::memcpy(out.data(), w.data(), sizeof(w));
  std::memcpy(out.data() + sizeof(w), st.op.data(), op);
  std::memcpy(out.data() + sizeof(w) + op, st.call.data(), call);
  return out;
}

bool decode_reply(const std::byte* p, std::size_t n, LocalStatus& st) {
  std::array<std::int64_t, kReplyWords> w{};
  if (n < sizeof(w)) return false;
  std::memcpy(w.data(), p, sizeof(w));
  if (w[0] < 0 || w[0] > static_cast<int>(State::NoAnswer) || w[5] < 0 || w[6] < 0 ||
      sizeof(w) + static_cast<std::size_t>(w[5]) + static_cast<std::size_t>(w[6]) > n)
    return false;
  st.state = static_cast<int>(w[0]);
  st.seq = static_cast<std::uint64_t>(w[1]);
  st.since_ms = w[2];
  st.kind = static_cast<CallKind>(std::clamp<std::int64_t>(w[3], 0, 2));
  st.group = static_cast<std::uint64_t>(w[4]);
  st.failed = w[7] != 0;
  st.completed = w[8] != 0;
  const char* text = reinterpret_cast<const char*>(p + sizeof(w));
  st.op.assign(text, static_cast<std::size_t>(w[5]));
  st.call.assign(text + w[5], static_cast<std::size_t>(w[6]));
  return true;
}

// Leaked on purpose: MPI may still read a send buffer whose request was freed unfinished.
void leak_buffer(std::vector<std::byte>&& b) {
  static std::mutex mu;
  static auto* kept = new std::vector<std::vector<std::byte>>();  // NOLINT: never freed
  std::lock_guard lock(mu);
  kept->push_back(std::move(b));
}

class Diagnoser {
 public:
  void start() {
    if (comm_ != MPI_COMM_NULL) return;
    // Collective over MPI_COMM_WORLD on every rank, whatever its settings, so that ranks that
    // differ in TD_DIAGNOSIS_MS still make the same MPI calls at init.
    if (MPI_Comm_dup(MPI_COMM_WORLD, &comm_) != MPI_SUCCESS) {
      comm_ = MPI_COMM_NULL;
      return;
    }
    MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN);
    if (!config().flight_recorder_dir.empty()) {
      struct sigaction old {};
      if (sigaction(SIGUSR1, nullptr, &old) == 0 && old.sa_handler == SIG_DFL) {
        struct sigaction sa {};
        sa.sa_handler = &on_sigusr1;
        sigemptyset(&sa.sa_mask);
        sa.sa_flags = SA_RESTART;
        sigaction(SIGUSR1, &sa, nullptr);
      }
    }
    // Its own thread, also where async operations get no progress thread by default (across
    // hosts under Open MPI 4); TD_PROGRESS_THREAD=0 turns both off, and only
    // MPI_THREAD_MULTIPLE lets it call MPI beside the caller.
    const bool answer = config().diagnosis.count() > 0 && thread_multiple() &&
                        config().progress_thread.value_or(true);
    if (answer || !config().flight_recorder_dir.empty()) {
      stopping_ = false;
      thread_ = std::thread([this, answer] { loop(answer); });
    }
  }

  void stop() {
    if (thread_.joinable()) {
      {
        std::lock_guard lock(mu_);
        stopping_ = true;
      }
      cv_.notify_all();
      thread_.join();
    }
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (comm_ != MPI_COMM_NULL && !finalized) MPI_Comm_free(&comm_);
    comm_ = MPI_COMM_NULL;
  }

  MPI_Comm comm() const { return comm_; }
  bool answering() const { return answering_.load(); }

  int next_reply_tag() { return 2 + static_cast<int>(next_query_++ % 32000); }

 private:
  void loop(bool answer) {
    std::array<std::int64_t, kQueryWords> query{};
    MPI_Request req = MPI_REQUEST_NULL;
    if (answer && MPI_Irecv(query.data(), kQueryWords, MPI_INT64_T, MPI_ANY_SOURCE, kQueryTag,
                            comm_, &req) == MPI_SUCCESS)
      answering_ = true;
    std::unique_lock lock(mu_);
    while (!stopping_) {
      cv_.wait_for(lock, std::chrono::milliseconds(5));
      if (stopping_) break;
      lock.unlock();
      if (g_dump_requested.exchange(false)) dump_to_dir("SIGUSR1", /*always=*/true);
      if (req != MPI_REQUEST_NULL) {
        int done = 0;
        MPI_Status status;
        if (MPI_Test(&req, &done, &status) != MPI_SUCCESS) {
          req = MPI_REQUEST_NULL;
          answering_ = false;
        } else if (done) {
          if (query[0] == kVersion) {
            reply(query, status.MPI_SOURCE);
            if (query[6] != 0)
              dump_to_dir(fmt::format("asked by world rank {} after its timeout", query[5]));
          }
          if (MPI_Irecv(query.data(), kQueryWords, MPI_INT64_T, MPI_ANY_SOURCE, kQueryTag, comm_,
                        &req) != MPI_SUCCESS) {
            req = MPI_REQUEST_NULL;
            answering_ = false;
          }
        }
      }
      lock.lock();
    }
    if (req != MPI_REQUEST_NULL) {
      MPI_Cancel(&req);
      MPI_Wait(&req, MPI_STATUS_IGNORE);
    }
    answering_ = false;
  }

  void reply(const std::array<std::int64_t, kQueryWords>& q, int source) {
    std::vector<std::byte> out = encode_reply(
        local_status(static_cast<std::uint64_t>(q[1]), static_cast<std::uint64_t>(q[2])));
    MPI_Request req = MPI_REQUEST_NULL;
    if (MPI_Isend(out.data(), static_cast<int>(out.size()), MPI_BYTE, source,
                  static_cast<int>(q[3]), comm_, &req) != MPI_SUCCESS)
      return;
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(1);
    int done = 0;
    while (!done && std::chrono::steady_clock::now() < until) {
      if (MPI_Test(&req, &done, MPI_STATUS_IGNORE) != MPI_SUCCESS) break;
      if (!done) std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
    if (!done) {
      MPI_Request_free(&req);
      leak_buffer(std::move(out));
    }
  }

  MPI_Comm comm_ = MPI_COMM_NULL;
  std::thread thread_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool stopping_ = false;
  std::atomic<bool> answering_{false};
  std::atomic<std::uint64_t> next_query_{0};
};

Diagnoser& diagnoser() {
  static Diagnoser d;
  return d;
}

std::string seconds(std::int64_t ms) {
  return fmt::format("{:.1f} s", static_cast<double>(ms) / 1000.0);
}

std::string state_text(const RankStatus& s) {
  switch (s.state) {
    case State::InThisCall:
      return fmt::format("in {} for {}", s.call, seconds(s.since.count()));
    case State::InOtherCall:
      return fmt::format("in another call: {}, for {}", s.call, seconds(s.since.count()));
    case State::Outside:
      return s.call.empty()
                 ? fmt::format(
                       "outside the library for {} (since init or its last new_group), no call "
                       "made yet",
                       seconds(s.since.count()))
                 : fmt::format("outside the library for {}, after {}{}", seconds(s.since.count()),
                               s.call, s.seq == 0 ? " (its last call, on another group)" : "");
    case State::NoAnswer:
      break;
  }
  return "no answer (dead, exited, unreachable, or blocked in MPI without its progress thread)";
}

struct Reply {
  RankStatus status;
  std::string op;
  CallKind kind = CallKind::Collective;
  std::uint64_t group = 0;
  bool failed = false;
  bool completed = false;  // its part of the call asked about completed
};

Reply reply_of(int rank, const LocalStatus& st) {
  Reply r;
  r.status.rank = rank;
  r.status.state = static_cast<State>(st.state);
  r.status.seq = st.seq;
  r.status.call = st.call;
  r.status.since = std::chrono::milliseconds(st.since_ms);
  r.op = st.op;
  r.kind = st.kind;
  r.group = st.group;
  r.failed = st.failed;
  r.completed = st.completed;
  return r;
}

// The replies to the diagnosis of one call, by where each rank is relative to it.
struct Sides {
  const std::vector<Reply>& replies;
  const CallRef& call;
  const CallFacts& facts;
  std::string gname;         // the call's group
  std::string this_call;     // "TensorDict.all_reduce #42 on world"
  std::vector<int> same;     // in this call
  std::vector<int> done;     // done with it: its part completed here (an async call's rank whose
                             // buckets all completed without the others), wherever it is now
  std::vector<int> missing;  // not called it: elsewhere, or no answer
};

Sides sides_of(const std::vector<Reply>& replies, const CallRef& call, const CallFacts& facts) {
  Sides s{replies, call, facts, group_name(call.group), {}, {}, {}, {}};
  s.this_call = fmt::format("{} #{} on {}", facts.op, call.seq, s.gname);
  for (const Reply& r : replies) {
    if (r.status.state == State::InThisCall && r.op == facts.op) {
      s.same.push_back(r.status.rank);
    } else if (r.completed) {  // only an answer says so
      s.done.push_back(r.status.rank);
    } else {
      s.missing.push_back(r.status.rank);
    }
  }
  return s;
}

// Ranks in a call of the same number but another operation: different collectives ("" if none).
std::string different_collectives(const Sides& s) {
  for (const Reply& r : s.replies) {
    if (r.status.state != State::InThisCall || r.op == s.facts.op) continue;
    std::vector<int> others;
    for (const Reply& o : s.replies)
      if (o.status.state == State::InThisCall && o.op == r.op) others.push_back(o.status.rank);
    return fmt::format(
        "{} wait in {} while {} wait{} in {} #{}: the ranks called different "
        "collectives",
        ranks_text(s.same), s.this_call, ranks_text(others), others.size() == 1 ? "s" : "", r.op,
        s.call.seq);
  }
  return {};
}

// No rank is missing: the call itself stalled.
std::string stalled(const Sides& s) {
  if (s.done.empty())
    return fmt::format(
        "every rank of {} is in {}: the ranks called the same collective and it did not "
        "complete (its data stalled: a slow or lost link, or a rank stopped inside MPI)",
        s.gname, s.this_call);
  return fmt::format(
      "every rank of {} called {}: {} completed {} part while {} still wait{} in it (its data "
      "stalled: a slow or lost link, or a rank stopped inside MPI)",
      s.gname, s.this_call, ranks_text(s.done), s.done.size() == 1 ? "its" : "their",
      ranks_text(s.same), s.same.size() == 1 ? "s" : "");
}

// The first missing rank and the missing ranks in the same situation.
struct Absent {
  const Reply& first;
  std::vector<int> alike;
  bool one() const { return alike.size() == 1; }
  std::string who() const { return ranks_text(alike); }
  std::string has() const { return one() ? "has" : "have"; }
};

Absent absent_of(const Sides& s) {
  Absent a{s.replies[static_cast<std::size_t>(s.missing.front())], {}};
  for (int m : s.missing) {
    const RankStatus& r = s.replies[static_cast<std::size_t>(m)].status;
    if (r.state == a.first.status.state && r.seq == a.first.status.seq &&
        r.call == a.first.status.call)
      a.alike.push_back(m);
  }
  return a;
}

constexpr const char* kUnevenHint =
    "ranks with uneven data need ReducerOptions::uneven_inputs and Reducer::join()";

// Missing ranks outside the library: since which call, or having made none.
std::string outside_cause(const Sides& s, const Absent& a) {
  const RankStatus& st = a.first.status;
  const std::string they = a.one() ? "it has" : "they have";
  const std::string since = seconds(st.since.count());
  if (st.call.empty())
    return fmt::format(
        "{} {} not called {}: {} made no call yet, and {} been outside the library for {} (since "
        "init or {} last new_group)",
        a.who(), a.has(), s.this_call, they, a.has(), since, a.one() ? "its" : "their");
  const std::string outside = fmt::format("{} {} not called {}: {} been outside the library for {}",
                                          a.who(), a.has(), s.this_call, they, since);
  std::string out;
  if (st.seq == 0) {  // no call on this group: its last call on another
    out = fmt::format("{} since {}{} (no call on {} yet)", outside, st.call,
                      a.first.failed ? " failed" : "", s.gname);
  } else if (a.first.failed) {
    out = fmt::format("{} since {} failed", outside, st.call);
  } else {
    out = fmt::format("{} since {} completed {}", outside, a.one() ? "it" : "they", st.call);
  }
  if (s.call.kind == CallKind::ReducerStep && a.first.kind == CallKind::ReducerStep &&
      a.first.group == s.call.group && st.seq < s.call.seq && !s.same.empty()) {
    const std::uint64_t more = s.call.seq - st.seq;
    out += fmt::format(
        "; {} run{} {} Reducer step{} more than {}: the ranks ran different numbers of "
        "steps ({})",
        ranks_text(s.same), s.same.size() == 1 ? "s" : "",
        more == 1 ? std::string("one") : std::to_string(more), more == 1 ? "" : "s", a.who(),
        kUnevenHint);
  }
  return out;
}

// Missing ranks inside another call of the library.
std::string other_call_cause(const Sides& s, const Absent& a) {
  const RankStatus& st = a.first.status;
  std::string out =
      fmt::format("{} {} not called {}: {} in {} for {}", a.who(), a.has(), s.this_call,
                  a.one() ? "it waits" : "they wait", st.call, seconds(st.since.count()));
  if (s.call.kind == CallKind::ReducerStep && a.first.kind == CallKind::ReducerStep)
    out += fmt::format("; the ranks ran different numbers of Reducer steps ({})", kUnevenHint);
  return out;
}

std::string cause_of(const std::vector<Reply>& replies, const CallRef& call,
                     const CallFacts& facts) {
  if (call.kind == CallKind::PointToPoint && facts.root >= 0 &&
      facts.root < static_cast<int>(replies.size())) {
    const RankStatus& peer = replies[static_cast<std::size_t>(facts.root)].status;
    return fmt::format("rank {}, the peer of {}, is {}", peer.rank, facts.text, state_text(peer));
  }
  const Sides s = sides_of(replies, call, facts);
  if (std::string other = different_collectives(s); !other.empty()) return other;
  if (s.missing.empty()) return stalled(s);
  const Absent a = absent_of(s);
  switch (a.first.status.state) {
    case State::Outside:
      return outside_cause(s, a);
    case State::InOtherCall:
      return other_call_cause(s, a);
    case State::NoAnswer:
    case State::InThisCall:
      break;
  }
  return fmt::format(
      "{} did not answer within {} ms: {} dead, exited, unreachable, or blocked in "
      "MPI without {} progress thread",
      a.who(), config().diagnosis.count(), a.one() ? "it is" : "they are",
      a.one() ? "its" : "their");
}

}  // namespace

void diagnosis_start() { diagnoser().start(); }
void diagnosis_stop() { diagnoser().stop(); }

namespace {

// One diagnosis's messages: a query to every other rank of the group and a receive of its
// answer, on the diagnosis communicator.
struct Exchange {
  std::vector<std::vector<std::byte>> buffers;  // the answers
  std::vector<MPI_Request> recvs, sends;
  std::vector<char> answered;
  // On the heap: a query whose send does not complete is leaked with its request.
  std::vector<std::byte> query_bytes = std::vector<std::byte>(kQueryWords * sizeof(std::int64_t));
};

// The query about `call`: {version, group id, seq (0: point to point), reply tag, kind, this
// rank in world, dump}.
std::array<std::int64_t, kQueryWords> query_of(const CallRef& call, int tag) {
  int world_rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &world_rank);
  return {kVersion,
          static_cast<std::int64_t>(call.group),
          static_cast<std::int64_t>(call.kind == CallKind::PointToPoint ? 0 : call.seq),
          tag,
          static_cast<std::int64_t>(call.kind),
          world_rank,
          config().flight_recorder_dir.empty() ? 0 : 1};
}

void post_queries(const GroupState& g, MPI_Comm comm, int tag, Exchange& x) {
  const std::size_t n = static_cast<std::size_t>(g.size);
  x.buffers.resize(n);
  x.recvs.assign(n, MPI_REQUEST_NULL);
  x.sends.assign(n, MPI_REQUEST_NULL);
  x.answered.assign(n, 0);
  x.answered[static_cast<std::size_t>(g.rank)] = 1;
  for (std::size_t r = 0; r < n; ++r) {
    if (static_cast<int>(r) == g.rank) continue;
    x.buffers[r].resize(kReplyBytes);
    const int peer = g.world_ranks[r];
    if (MPI_Irecv(x.buffers[r].data(), static_cast<int>(kReplyBytes), MPI_BYTE, peer, tag, comm,
                  &x.recvs[r]) != MPI_SUCCESS)
      x.recvs[r] = MPI_REQUEST_NULL;
    if (MPI_Isend(x.query_bytes.data(), kQueryWords, MPI_INT64_T, peer, kQueryTag, comm,
                  &x.sends[r]) != MPI_SUCCESS)
      x.sends[r] = MPI_REQUEST_NULL;
  }
}

// One pass over the answers not yet read; returns whether every rank has answered (or cannot).
bool read_answers(Exchange& x, std::vector<Reply>& replies) {
  bool all = true;
  for (std::size_t r = 0; r < x.recvs.size(); ++r) {
    if (x.answered[r] || x.recvs[r] == MPI_REQUEST_NULL) continue;
    int done = 0;
    MPI_Status status;
    if (MPI_Test(&x.recvs[r], &done, &status) != MPI_SUCCESS) {
      x.recvs[r] = MPI_REQUEST_NULL;
      continue;
    }
    if (!done) {
      all = false;
      continue;
    }
    x.answered[r] = 1;
    int bytes = 0;
    MPI_Get_count(&status, MPI_BYTE, &bytes);
    LocalStatus st;
    if (decode_reply(x.buffers[r].data(), static_cast<std::size_t>(std::max(bytes, 0)), st))
      replies[r] = reply_of(static_cast<int>(r), st);
  }
  return all;
}

// Late answers are never read (their receives cancelled); unfinished queries are leaked.
void finish_exchange(Exchange& x) {
  bool unfinished = false;
  for (std::size_t r = 0; r < x.recvs.size(); ++r) {
    if (x.recvs[r] != MPI_REQUEST_NULL && !x.answered[r]) {
      MPI_Cancel(&x.recvs[r]);
      MPI_Wait(&x.recvs[r], MPI_STATUS_IGNORE);
    }
    if (x.sends[r] != MPI_REQUEST_NULL) {
      int done = 0;
      MPI_Test(&x.sends[r], &done, MPI_STATUS_IGNORE);
      if (!done) {
        MPI_Request_free(&x.sends[r]);
        unfinished = true;
      }
    }
  }
  if (unfinished) leak_buffer(std::move(x.query_bytes));
}

}  // namespace

Diagnosis diagnose(const CallRef& call) {
  Diagnosis d;
  if (!call || config().diagnosis.count() <= 0) return d;
  const std::shared_ptr<GroupState> g = group_by_id(call.group);
  Diagnoser& dg = diagnoser();
  if (!g || g->comm == MPI_COMM_NULL || dg.comm() == MPI_COMM_NULL) return d;
  // Asking from a thread other than the caller's (the watchdog) needs MPI_THREAD_MULTIPLE.
  if (!thread_multiple() && current_call().seq != call.seq) return d;
  const CallFacts facts = call_facts(call);
  std::vector<Reply> replies(static_cast<std::size_t>(g->size));
  for (std::size_t r = 0; r < replies.size(); ++r) replies[r].status.rank = static_cast<int>(r);
  Exchange x;
  const auto query = query_of(call, dg.next_reply_tag());
  std::memcpy(x.query_bytes.data(), query.data(), x.query_bytes.size());
  post_queries(*g, dg.comm(), static_cast<int>(query[3]), x);
  // This rank's own answer.
  replies[static_cast<std::size_t>(g->rank)] =
      reply_of(g->rank, local_status(call.group, query[2] == 0 ? 0 : call.seq));
  const auto until = std::chrono::steady_clock::now() + config().diagnosis;
  while (!read_answers(x, replies) && std::chrono::steady_clock::now() < until)
    std::this_thread::sleep_for(std::chrono::microseconds(500));
  finish_exchange(x);
  d.cause = cause_of(replies, call, facts);
  for (const Reply& r : replies) {
    d.details += fmt::format(
        "\n  rank {}{}: {}{}", r.status.rank, r.status.rank == g->rank ? " (this rank)" : "",
        state_text(r.status),
        r.completed ? fmt::format(" (its part of #{} completed)", call.seq) : std::string());
    d.ranks.push_back(r.status);
  }
  return d;
}

namespace {

// One diagnosis per call: an async call's buckets are Works of one call, and each one that times
// out (wait_all waits for all of them) would otherwise ask again and wait TD_DIAGNOSIS_MS for the
// same silent ranks, so that 14 buckets took 28 s more to fail than one. The first timeout of a
// call asks; the later ones (and the watchdog's report of it) reuse that answer. `first` tells
// the caller whether this one asked.
Diagnosis diagnose_once(const CallRef& call, bool& first) {
  static std::mutex mu;
  static CallRef last_call;
  static Diagnosis last;
  const auto same = [&call] {
    return last_call && last_call.group == call.group && last_call.seq == call.seq &&
           last_call.kind == call.kind;
  };
  {
    std::lock_guard lock(mu);
    if (same()) {
      first = false;
      return last;
    }
  }
  first = true;
  Diagnosis d;
  try {
    d = diagnose(call);
  } catch (...) {  // NOLINT(bugprone-empty-catch): the timeout is reported without it
    return d;
  }
  if (!d.ranks.empty()) {
    std::lock_guard lock(mu);
    last_call = call;
    last = d;
  }
  return d;
}

}  // namespace

TimeoutError timeout_error(const CallRef& call, const std::string& message) {
  bool first = true;
  Diagnosis d = diagnose_once(call, first);
  if (d.ranks.empty()) {
    dump_to_dir("timeout");
    return TimeoutError(message);
  }
  std::string text = fmt::format("{}. {}\nwhere each rank is:{}", d.cause, message, d.details);
  if (first) {  // said once per call, not once per bucket
    int rank = -1;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    std::fprintf(stderr, "[td rank %d] td::TimeoutError: %s\n", rank, text.c_str());
    std::fflush(stderr);
    dump_to_dir("timeout");
  }
  return TimeoutError(text, std::move(d.ranks));
}

std::string diagnosis_report(const CallRef& call) {
  try {
    bool first = true;
    const Diagnosis d = diagnose_once(call, first);
    if (d.ranks.empty()) return {};
    return fmt::format("{}; where each rank is:{}", d.cause, d.details);
  } catch (...) {
    return {};
  }
}

}  // namespace td::detail
