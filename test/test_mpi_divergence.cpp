// Ranks that differ in one input: every rank gets the correct result or the same error,
// promptly, and the group keeps working afterwards (docs/reliability.md, issue 16).
//
// Each round derives everything from its seed (TD_DIVERGENCE_SEED + round number), identically on
// every rank: a kind of divergence, a collective, a small nested dict (several dtypes, nested keys,
// some leaves larger than others, some transposed views), the call's options, and a deviant rank
// that differs from the others in exactly one input. Every rank runs its call with a short timeout
// and catches what it throws; then, over MPI_COMM_WORLD with plain MPI, the ranks exchange one
// outcome record each (exception class, message, seconds, whether the result equals the reference,
// which every rank computes locally since it knows every rank's inputs) and judge the round the
// same way: either no rank raised and every result is correct, or every rank raised promptly, the
// error the docs promise for that input, naming what differs. After an error other than a timeout,
// a small all_reduce (and for point to point a small transfer between the same two ranks) must
// still work on the same group. A rank stuck inside a call (a hang no timeout catches) is reported
// by a watchdog thread, which ends the job. That harness (the watchdog, outcomes, judging, the
// tally, fresh groups) is test/support/divergence.hpp; the kinds, the collectives, the rounds
// and their reference results are here.
//
// Kinds: what the deviant does differently -> what the docs promise (docs/reliability.md,
// errors.md, collectives.md). A td::TimeoutError fails every kind: the promise is the result or a
// prompt error, never a wait for the timeout.
//   op, root                  -> td::LayoutMismatchError on every rank naming op= / dst= / src=
//                                (an op a leaf's dtype lacks: std::invalid_argument naming it)
//   async, bucket             -> LayoutMismatchError naming async / bucket_bytes, or the correct
//                                result (both keep the promise)
//   bad_root, zero_bucket     -> std::invalid_argument on every rank (one rank's bad argument)
//   key_missing, key_renamed  -> LayoutMismatchError naming the key (renamed includes {"a", "b"}
//   shape, dtype                 flattened to "a.b", which prints alike)
//   contiguity                -> LayoutMismatchError naming the key (contiguity is agreed), or
//                                the correct result
//   tag, timeout              -> correct (collectives ignore tags; timeouts, max() included, only
//                                bound waits)
//   consolidate               -> correct (memory layout only), or, when the dict holds a
//                                transposed leaf (consolidate() makes it contiguous, and
//                                contiguity is agreed), LayoutMismatchError naming it
//   moved_from                -> the same error on every rank, naming "moved-from"
//   part_contiguity           -> correct (scatter: src's parts hold a leaf as a transposed view)
//   p2p_bucket, p2p_async,    -> correct (the sender chooses the messages, the receiver follows;
//   p2p_timeout, p2p_contiguity, p2p_consolidate   a non-contiguous side is read or filled)
//   p2p_key, p2p_shape, p2p_dtype -> LayoutMismatchError naming the key, on both sides
//   p2p_zero_bucket           -> sender: std::invalid_argument at once, and its corrected retry
//                                pairs with the waiting recv; receiver: ignored, or an error on
//                                both sides
//   p2p_tag_same              -> correct (a control round: both sides use one non-default tag)
//   compression               -> all_reduce/reduce with SUM or AVG: LayoutMismatchError naming
//                                compression; elsewhere std::invalid_argument on every rank
// Point-to-point rounds run one way (send/recv, others idle) or both ways at once (isend/irecv).
//
// Environment:
//   TD_DIVERGENCE_SEED=S     first round's seed (default 16000); round i uses S + i, so
//                            TD_DIVERGENCE_SEED=S TD_DIVERGENCE_ROUNDS=1 replays one round
//   TD_DIVERGENCE_ROUNDS=N   number of rounds (default 416: sixteen of each kind; four when
//                            sanitized). After kMaxFailures failed rounds, a kind's later rounds
//                            are skipped (each may cost a timeout).
//   TD_DIVERGENCE_KINDS=a,b  run only the rounds of these kinds (names as in the summary;
//                            "list" prints them); test/divergence/run_kinds.sh runs each alone
//   TD_DIVERGENCE_VERBOSE=1  print one line per round (rank 0)
//
// The hidden test case [divergence_env] runs under an MPMD launch where one rank gets another
// TD_* setting (test/divergence/DivergenceTests.cmake): settings are read once per process, so
// they cannot differ per round.
#include <catch2/catch.hpp>

#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <optional>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include <tensordict/tensordict.hpp>

#include "support/divergence.hpp"
#include "support/reference.hpp"

using td::DType;
using td::Key;
using td::ReduceOp;
using td::Tensor;
using td::TensorDict;
using namespace std::chrono_literals;
using namespace tdtest::divergence;

namespace {

constexpr std::uint64_t kDefaultSeed = 16000;
constexpr int kMaxFailures = 3;

// ---- configuration --------------------------------------------------------------------------

std::optional<std::string> env(const char* name) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return std::nullopt;
  return std::string(v);
}

std::uint64_t env_u64(const char* name, std::uint64_t fallback) {
  const auto v = env(name);
  return v ? std::stoull(*v) : fallback;
}

// ---- rounds -----------------------------------------------------------------------------------

enum class Coll { AllReduce, Reduce, Broadcast, AllGather, Gather, Scatter, ReduceScatter, P2P };

const char* coll_name(Coll c) {
  switch (c) {
    case Coll::AllReduce:
      return "all_reduce";
    case Coll::Reduce:
      return "reduce";
    case Coll::Broadcast:
      return "broadcast";
    case Coll::AllGather:
      return "all_gather";
    case Coll::Gather:
      return "gather";
    case Coll::Scatter:
      return "scatter";
    case Coll::ReduceScatter:
      return "reduce_scatter";
    case Coll::P2P:
      return "send/recv";
  }
  return "?";
}

bool reduces(Coll c) {
  return c == Coll::AllReduce || c == Coll::Reduce || c == Coll::ReduceScatter;
}
bool has_root(Coll c) {
  return c == Coll::Reduce || c == Coll::Broadcast || c == Coll::Gather || c == Coll::Scatter;
}

struct Leaf {
  Key key;
  DType dtype;
  td::Shape shape;
  bool transposed = false;  // a transposed view of a [shape[1], shape[0]] tensor
  std::int64_t offset = 0;  // element i holds the reference value of index i + offset
};

// What one rank passes.
struct Call {
  Coll coll = Coll::AllReduce;
  ReduceOp op = ReduceOp::SUM;
  int root = 0;  // dst/src of a rooted collective
  bool async_op = false;
  std::optional<std::size_t> bucket;
  std::optional<int> tag;
  std::optional<Ms> timeout = kCallTimeout;
  td::Compression compression = td::Compression::None;
  bool consolidate = false;
  bool moved_from = false;  // the call is made on a moved-from dict
  std::vector<Leaf> layout;
  std::vector<Leaf> parts_layout;  // scatter: the layout of src's parts
};

struct Round {
  std::uint64_t seed = 0;
  std::string kind;
  int size = 0;
  int deviant = -1;                   // -1: no rank differs in its call (the environment may)
  int p2p_src = 0, p2p_dst = 1;       // point to point: the pair; the other ranks are idle
  ReduceOp value_op = ReduceOp::SUM;  // the inputs are reference::value<T>(value_op, rank, i)
  std::vector<Leaf> layout;           // every non-deviant rank's (the reference's) layout
  Call base, dev;
  std::string differs;                   // what the deviant passes differently, for messages
  std::string replay;                    // how to run this round alone
  bool followup_may_fail_alike = false;  // the next call may raise the same error everywhere
  bool sender_retries = false;  // the deviant sender's call fails, then it retries with `base`
  bool bidirectional = false;   // point to point: each of the pair sends to the other at once
  Expectation expectation;

  const Call& call_of(int rank) const { return rank == deviant ? dev : base; }
  bool participates(int rank) const {
    return base.coll != Coll::P2P || rank == p2p_src || rank == p2p_dst;
  }
};

// ---- describing ----------------------------------------------------------------------------

std::string shape_str(const td::Shape& s) {
  std::string out = "[";
  for (std::size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "]";
}

std::string key_str(const Key& k) {
  if (k.parts().size() == 1) return "'" + k.parts()[0] + "'";
  std::string out = "{";
  for (std::size_t i = 0; i < k.parts().size(); ++i)
    out += (i ? ", " : "") + std::string("\"") + k.parts()[i] + "\"";
  return out + "}";
}

std::string layout_str(const std::vector<Leaf>& layout) {
  std::string out;
  for (const Leaf& l : layout) {  // appends (GCC 12 -Wrestrict misfires on chained +)
    if (!out.empty()) out.append(" ");
    out.append(key_str(l.key)).append(":").append(td::name(l.dtype)).append(shape_str(l.shape));
    if (l.transposed) out.append("^T");
  }
  return out;
}

std::string bucket_str(const std::optional<std::size_t>& b) {
  if (!b) return "none";
  if (*b == td::kAutoBucketBytes) return "auto";
  return std::to_string(*b);
}

std::string timeout_str(const std::optional<Ms>& t) {
  if (!t) return "default";
  if (*t == Ms::max()) return "max";
  return std::to_string(t->count()) + "ms";
}

std::string call_str(const Call& c) {
  std::ostringstream s;
  s << coll_name(c.coll);
  if (reduces(c.coll)) s << " op=" << td::name(c.op);
  if (has_root(c.coll)) s << " root=" << c.root;
  s << " async=" << c.async_op << " bucket=" << bucket_str(c.bucket)
    << " tag=" << (c.tag ? std::to_string(*c.tag) : "none") << " timeout=" << timeout_str(c.timeout)
    << " consolidated=" << c.consolidate;
  if (c.compression != td::Compression::None) s << " compression=" << td::name(c.compression);
  if (c.moved_from) s << " moved-from";
  return s.str();
}

std::string round_str(const Round& r) {
  std::ostringstream s;
  s << "round seed " << r.seed << " (replay: " << r.replay << "), " << r.size << " ranks, kind '"
    << r.kind << "' on " << coll_name(r.base.coll);
  if (r.base.coll == Coll::P2P)
    s << " " << r.p2p_src << (r.bidirectional ? " <-> " : " -> ") << r.p2p_dst;
  if (r.deviant >= 0) s << ", deviant rank " << r.deviant << ": " << r.differs;
  s << "\n  call: " << call_str(r.base) << "\n  layout: " << layout_str(r.layout);
  if (r.deviant >= 0) {
    s << "\n  deviant's call: " << call_str(r.dev);
    if (layout_str(r.dev.layout) != layout_str(r.layout))
      s << "\n  deviant's layout: " << layout_str(r.dev.layout);
    if (!r.dev.parts_layout.empty() && layout_str(r.dev.parts_layout) != layout_str(r.layout))
      s << "\n  deviant's parts: " << layout_str(r.dev.parts_layout);
  }
  return s.str();
}

// ---- building dicts and checking results ---------------------------------------------------

Tensor make_leaf(const Leaf& l, ReduceOp op, int value_rank) {
  return td::visit(l.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    Tensor values = Tensor::empty(l.shape, l.dtype);
    T* p = values.data<T>();
    for (std::int64_t i = 0; i < values.numel(); ++i)
      p[i] = tdtest::value<T>(op, value_rank, i + l.offset);
    if (!l.transposed) return values;
    Tensor t = Tensor::empty({l.shape[1], l.shape[0]}, l.dtype).transpose(0, 1);
    t.copy_(values);
    return t;
  });
}

TensorDict build(const std::vector<Leaf>& layout, ReduceOp op, int value_rank) {
  TensorDict d;
  for (const Leaf& l : layout) d.set(l.key, make_leaf(l, op, value_rank));
  return d;
}

// What a dict must hold: rank value_rank's inputs, or the reduction over the group; with
// shard >= 0, rows [shard * n / size, (shard + 1) * n / size) of it (reduce_scatter).
struct Reference {
  bool reduced = false;
  ReduceOp op = ReduceOp::SUM;
  int value_rank = 0;
  int size = 1;
  int shard = -1;
};

// Empty if d holds the reference for every leaf of `layout`, else the first difference.
std::string difference(const TensorDict& d, const std::vector<Leaf>& layout, const Reference& ref) {
  try {
    for (const Leaf& l : layout) {
      if (!d.contains(l.key)) return "key " + key_str(l.key) + " is missing";
      const Tensor& t = d.get(l.key);
      td::Shape want = l.shape;
      std::int64_t first = 0;
      if (ref.shard >= 0) {
        want[0] /= ref.size;
        std::int64_t n = 1;
        for (auto x : want) n *= x;
        first = ref.shard * n;
      }
      if (t.dtype() != l.dtype || t.shape() != want)
        return "key " + key_str(l.key) + " is " + std::string(td::name(t.dtype())) +
               shape_str(t.shape()) + ", expected " + std::string(td::name(l.dtype)) +
               shape_str(want);
      std::string bad = td::visit(l.dtype, [&](auto tag) -> std::string {
        using T = typename decltype(tag)::type;
        const std::vector<T> v = t.to_vector<T>();
        // A reduction within the oracle's tolerance (0 at the rank counts this test runs at: the
        // inputs are small integers); a rank's own input exactly.
        const double tol = ref.reduced ? tdtest::tolerance<T>(ref.op, ref.size) : 0.0;
        for (std::size_t j = 0; j < v.size(); ++j) {
          const std::int64_t i = first + static_cast<std::int64_t>(j) + l.offset;
          const T want_v = ref.reduced ? tdtest::expected<T>(ref.op, ref.size, i)
                                       : tdtest::value<T>(ref.op, ref.value_rank, i);
          if (!tdtest::matches<T>(v[j], want_v, tol))
            return "key " + key_str(l.key) + " element " + std::to_string(j) + " is " +
                   fmt::format("{}", tdtest::as_complex<T>(v[j]).real()) + ", expected " +
                   fmt::format("{}", tdtest::as_complex<T>(want_v).real());
        }
        return {};
      });
      if (!bad.empty()) return bad;
    }
  } catch (const std::exception& e) {
    return std::string("checking the result threw: ") + e.what();
  }
  return {};
}

// ---- running a round -----------------------------------------------------------------------

Outcome execute(const Round& r, int rank, const td::ProcessGroup& group) {
  Outcome o;
  if (!r.participates(rank)) {
    o.correct = 1;
    return o;
  }
  o.participated = 1;
  const Call& c = r.call_of(rank);
  TensorDict d = build(c.layout, r.value_op, rank);
  if (c.consolidate) d.consolidate();
  std::vector<TensorDict> parts;
  if (c.coll == Coll::Scatter && rank == c.root)
    for (int q = 0; q < r.size; ++q) parts.push_back(build(c.parts_layout, r.value_op, q + r.size));
  TensorDict taken;
  if (c.moved_from) taken = std::move(d);

  td::CollectiveOptions opts{.group = group,
                             .async_op = c.async_op,
                             .bucket_bytes = c.bucket,
                             .timeout = c.timeout,
                             .tag = c.tag,
                             .compression = c.compression};
  std::vector<TensorDict> list;
  TensorDict shard;
  TensorDict incoming;  // bidirectional point to point: receives the peer's dict
  if (r.bidirectional) {
    incoming = build(c.layout, r.value_op, rank + 2 * r.size);
    if (c.consolidate) incoming.consolidate();
  }
  if (r.sender_retries && rank == r.deviant) {
    // A bad argument of the sender's: raised at once, before any state changes, so that the
    // corrected retry pairs with the receiver's recv, which is still waiting.
    const auto t_first = Clock::now();
    const auto [first, first_what] = caught([&] {
      std::vector<td::Work> works = d.send(r.p2p_dst, opts);
      td::wait_all(works);
    });
    o.first_seconds = std::chrono::duration<double>(Clock::now() - t_first).count();
    o.first_exc = static_cast<int>(first);
    copy_text(o.first_what, first_what);
    opts.bucket_bytes = r.base.bucket;
  }
  const auto t0 = Clock::now();
  const auto [exc, what] = caught([&] {
    std::vector<td::Work> works;
    switch (c.coll) {
      case Coll::AllReduce:
        works = d.all_reduce(c.op, opts);  // NOLINT(bugprone-use-after-move): on purpose
        break;
      case Coll::Reduce:
        works = d.reduce(c.root, c.op, opts);
        break;
      case Coll::Broadcast:
        works = d.broadcast(c.root, opts);
        break;
      case Coll::AllGather:
        works = d.all_gather(list, opts);
        break;
      case Coll::Gather:
        works = d.gather(c.root, list, opts);
        break;
      case Coll::Scatter:
        works = d.scatter(c.root, parts, opts);
        break;
      case Coll::ReduceScatter:
        works = d.reduce_scatter(shard, c.op, opts);
        break;
      case Coll::P2P:
        if (r.bidirectional) {
          const int peer = rank == r.p2p_src ? r.p2p_dst : r.p2p_src;
          works = d.isend(peer, opts);
          for (td::Work& w : incoming.irecv(peer, opts)) works.push_back(std::move(w));
        } else {
          works = rank == r.p2p_src ? d.send(r.p2p_dst, opts) : d.recv(r.p2p_src, opts);
        }
        break;
    }
    td::wait_all(works);
  });
  o.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  o.exc = static_cast<int>(exc);
  copy_text(o.what, what);
  if (exc != Exc::None) return o;

  // The reference, from the inputs every rank can compute.
  const ReduceOp op = r.value_op;
  std::string bad;
  auto input_of = [&](int q) { return Reference{false, op, q, r.size, -1}; };
  const Reference reduced{true, op, 0, r.size, -1};
  switch (c.coll) {
    case Coll::AllReduce:
      bad = difference(d, r.layout, reduced);
      break;
    case Coll::Reduce:
      if (rank == c.root) bad = difference(d, r.layout, reduced);
      break;
    case Coll::Broadcast:
      bad = difference(d, r.layout, input_of(c.root));
      break;
    case Coll::AllGather:
    case Coll::Gather:
      if (c.coll == Coll::Gather && rank != c.root) {
        if (!list.empty()) bad = "gather left a list of " + std::to_string(list.size()) + " dicts";
      } else if (list.size() != static_cast<std::size_t>(r.size)) {
        bad = "got " + std::to_string(list.size()) + " dicts";
      } else {
        for (int q = 0; q < r.size && bad.empty(); ++q) {
          bad = difference(list[static_cast<std::size_t>(q)], r.layout, input_of(q));
          if (!bad.empty()) bad = "rank " + std::to_string(q) + "'s dict: " + bad;
        }
      }
      break;
    case Coll::Scatter:
      bad = difference(d, r.layout, input_of(rank + r.size));
      break;
    case Coll::ReduceScatter:
      bad = difference(shard, r.layout, Reference{true, op, 0, r.size, rank});
      break;
    case Coll::P2P:
      if (r.bidirectional) {
        bad = difference(incoming, r.layout, input_of(rank == r.p2p_src ? r.p2p_dst : r.p2p_src));
        if (!bad.empty()) bad = "received: " + bad;
        if (bad.empty()) bad = difference(d, r.layout, input_of(rank));
        if (!bad.empty() && bad.rfind("received", 0) != 0) bad = "sent dict changed: " + bad;
      } else {
        bad = difference(d, r.layout, input_of(r.p2p_src));
      }
      break;
  }
  o.correct = bad.empty() ? 1 : 0;
  copy_text(o.detail, bad);
  return o;
}

// After the round: a transfer between the same pair (point to point) and an all_reduce on the
// same group must still work.
void follow_up(const Round& r, int rank, const td::ProcessGroup& group, Outcome& o) {
  std::string bad;
  const auto t0 = Clock::now();
  const auto [exc, what] = caught([&] {
    if (r.base.coll == Coll::P2P && r.participates(rank)) {
      TensorDict m;
      const bool src = rank == r.p2p_src;
      m.set("f", Tensor::full<float>({3}, src ? 7.f : 0.f));
      td::CollectiveOptions opts{.group = group, .timeout = kCallTimeout, .tag = r.base.tag};
      if (src) {
        m.send(r.p2p_dst, opts);
      } else {
        m.recv(r.p2p_src, opts);
        if (m.get("f").to_vector<float>() != std::vector<float>(3, 7.f))
          bad = "the next transfer between the pair received wrong values";
      }
    }
    Tensor t = Tensor::full<float>({5}, static_cast<float>(rank + 1));
    td::all_reduce(t, ReduceOp::SUM, {.group = group, .timeout = kCallTimeout});
    const auto want = static_cast<float>(r.size * (r.size + 1) / 2);
    if (bad.empty() && t.to_vector<float>() != std::vector<float>(5, want))
      bad = "the next all_reduce gave wrong values";
  });
  o.followup_exc = static_cast<int>(exc);
  o.followup_seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  if (exc != Exc::None) {
    o.followup = 3;
    copy_text(o.detail, std::string("the next call raised ") + exc_name(exc) + ": " + what);
  } else {
    o.followup = bad.empty() ? 1 : 2;
    if (!bad.empty()) copy_text(o.detail, bad);
  }
}

// Empty if the round kept the promise, else why not. Computed identically on every rank: a
// sender's first attempt (sender_retries), then the harness's judge.
std::string judge(const Round& r, const std::vector<Outcome>& all, bool followed_up) {
  if (r.sender_retries) {
    const Outcome& o = all[static_cast<std::size_t>(r.deviant)];
    if (static_cast<Exc>(o.first_exc) != Exc::InvalidArgument ||
        lower(o.first_what).find("bucket_bytes") == std::string::npos ||
        o.first_seconds > kPromptSeconds)
      return "the sender's first attempt did not raise std::invalid_argument naming bucket_bytes "
             "promptly: " +
             std::string(exc_name(static_cast<Exc>(o.first_exc))) + " after " +
             fmt::format("{:.2f}", o.first_seconds) + " s: " + o.first_what;
  }
  return tdtest::divergence::judge(r.expectation, all, followed_up, r.followup_may_fail_alike);
}

// ---- generating rounds ----------------------------------------------------------------------

using Rng = std::mt19937_64;

template <class T>
const T& pick(Rng& rng, const std::vector<T>& v) {
  return v[std::uniform_int_distribution<std::size_t>(0, v.size() - 1)(rng)];
}
int uniform(Rng& rng, int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); }
bool coin(Rng& rng, double p) { return std::bernoulli_distribution(p)(rng); }

const std::vector<DType> kFloatTypes = {DType::Float32, DType::Float64, DType::BFloat16,
                                        DType::Float16};
const std::vector<DType> kIntTypes = {DType::Int32, DType::Int64, DType::UInt8};
const std::vector<ReduceOp> kEveryOp = {ReduceOp::SUM, ReduceOp::PRODUCT, ReduceOp::MIN,
                                        ReduceOp::MAX, ReduceOp::AVG,     ReduceOp::BAND,
                                        ReduceOp::BOR, ReduceOp::BXOR};
const std::vector<std::optional<std::size_t>> kBuckets = {std::nullopt, 64, 1024, 1 << 16,
                                                          td::kAutoBucketBytes};

// A small nested dict: 3-6 leaves, first dimension 6 or 12 (divisible by 2 and 3, for
// reduce_scatter), some 2-D leaves (one at least, with both dimensions > 1), some larger.
std::vector<Leaf> random_layout(Rng& rng, bool floats_only) {
  std::vector<Key> keys = {Key("a"),          Key({"enc", "w"}),      Key({"enc", "b"}),
                           Key({"dec", "w"}), Key({"dec", "x", "y"}), Key("s"),
                           Key({"z", "q"})};
  std::shuffle(keys.begin(), keys.end(), rng);
  const int n = uniform(rng, 3, 6);
  std::vector<DType> types = kFloatTypes;
  if (!floats_only) types.insert(types.end(), kIntTypes.begin(), kIntTypes.end());
  std::vector<Leaf> out;
  bool has_2d = false;
  for (int i = 0; i < n; ++i) {
    Leaf l{keys[static_cast<std::size_t>(i)], pick(rng, types), {}, false, i * 13};
    const std::int64_t rows = coin(rng, 0.5) ? 6 : 12;
    const int form = uniform(rng, 0, 9);
    if (form < 3) {
      l.shape = {rows};
    } else if (form < 8) {
      l.shape = {rows, uniform(rng, 1, 8)};
    } else {
      l.shape = {rows, uniform(rng, 40, 120)};
    }
    if (l.shape.size() == 2 && l.shape[1] > 1) {
      has_2d = true;
      l.transposed = coin(rng, 0.3);
    }
    out.push_back(std::move(l));
  }
  if (!has_2d) out[0].shape = {6, 3};
  return out;
}

// Indices of the leaves that can be a transposed view (2-D, both dimensions > 1).
std::vector<std::size_t> two_d_leaves(const std::vector<Leaf>& layout) {
  std::vector<std::size_t> out;
  for (std::size_t i = 0; i < layout.size(); ++i)
    if (layout[i].shape.size() == 2 && layout[i].shape[1] > 1) out.push_back(i);
  return out;
}

bool op_supported(ReduceOp op, const std::vector<Leaf>& layout) {
  return std::all_of(layout.begin(), layout.end(),
                     [&](const Leaf& l) { return td::supports(op, l.dtype); });
}

const std::vector<Coll> kCollectives = {Coll::AllReduce,    Coll::Reduce, Coll::Broadcast,
                                        Coll::AllGather,    Coll::Gather, Coll::Scatter,
                                        Coll::ReduceScatter};
const std::vector<Coll> kRooted = {Coll::Reduce, Coll::Broadcast, Coll::Gather, Coll::Scatter};
const std::vector<Coll> kReducing = {Coll::AllReduce, Coll::Reduce, Coll::ReduceScatter};

// Every kind, in the order seeds cycle through them (seed % count).
const std::vector<std::string> kKinds = {"op",
                                         "root",
                                         "bad_root",
                                         "async",
                                         "bucket",
                                         "zero_bucket",
                                         "tag",
                                         "timeout",
                                         "key_missing",
                                         "key_renamed",
                                         "shape",
                                         "dtype",
                                         "contiguity",
                                         "consolidate",
                                         "moved_from",
                                         "part_contiguity",
                                         "p2p_bucket",
                                         "p2p_zero_bucket",
                                         "p2p_async",
                                         "p2p_timeout",
                                         "p2p_contiguity",
                                         "p2p_consolidate",
                                         "p2p_key",
                                         "p2p_shape",
                                         "p2p_dtype",
                                         "p2p_tag_same",
                                         "compression"};

const Expectation kLayoutError{Expect::Error, {Exc::LayoutMismatch}, true, {}, -1};
const Expectation kArgError{Expect::Error, {Exc::InvalidArgument}, true, {}, -1};
const Expectation kCorrect{Expect::Correct, {}, true, {}, -1};
const Expectation kEither{
    Expect::Either, {Exc::LayoutMismatch, Exc::InvalidArgument}, true, {}, -1};

Expectation with_keywords(Expectation e, std::vector<std::string> keywords) {
  e.keywords = std::move(keywords);
  return e;
}

// A leaf key the deviant changes, and the deviant's layout without it / renamed.
void change_key(Round& r, Rng& rng) {
  const std::size_t k = std::uniform_int_distribution<std::size_t>(0, r.layout.size() - 1)(rng);
  const Key old = r.layout[k].key;
  if (coin(rng, 0.4)) {
    r.dev.layout.erase(r.dev.layout.begin() + static_cast<std::ptrdiff_t>(k));
    r.differs = "has no key " + key_str(old);
    r.expectation.keywords = {old.str()};
    return;
  }
  // Renamed: a nested key flattened into one name with dots (what flatten_keys gives: it prints
  // like the nested one, and the message must still tell them apart), or another last name.
  Key renamed = old;
  if (old.parts().size() > 1 && coin(rng, 0.5)) {
    renamed = Key(old.str());
  } else {
    std::vector<std::string> parts = old.parts();
    parts.back() += "2";
    renamed = Key(parts);
  }
  r.dev.layout[k].key = renamed;
  r.differs = "key " + key_str(old) + " is named " + key_str(renamed);
  r.expectation.keywords = {old.str(), renamed.str()};
}

Round make_round(std::uint64_t seed, int size) {
  Round r;
  r.seed = seed;
  r.size = size;
  r.replay = "TD_DIVERGENCE_SEED=" + std::to_string(seed) + " TD_DIVERGENCE_ROUNDS=1";
  r.kind = kKinds[seed % kKinds.size()];
  Rng rng(seed * 0x9E3779B97F4A7C15ull + 12345);
  const std::string& kind = r.kind;
  const bool p2p = kind.rfind("p2p_", 0) == 0;

  std::vector<Coll> colls = kCollectives;
  if (kind == "op") colls = kReducing;
  if (kind == "root" || kind == "bad_root") colls = kRooted;
  if (kind == "part_contiguity") colls = {Coll::Scatter};
  if (kind == "compression")  // mostly where it is agreed, sometimes where it is rejected
    colls = {Coll::AllReduce, Coll::Reduce,        Coll::AllReduce,
             Coll::Reduce,    Coll::ReduceScatter, Coll::Broadcast};
  if (p2p) colls = {Coll::P2P};
  Call& b = r.base;
  b.coll = pick(rng, colls);

  const bool floats_only = coin(rng, 0.3);
  r.layout = random_layout(rng, floats_only);
  if (reduces(b.coll)) {
    std::vector<ReduceOp> ops = {ReduceOp::SUM, ReduceOp::MAX, ReduceOp::MIN, ReduceOp::PRODUCT};
    if (floats_only) ops.push_back(ReduceOp::AVG);
    b.op = pick(rng, ops);
    if (kind == "compression" && coin(rng, 0.75))
      b.op = floats_only && coin(rng, 0.5) ? ReduceOp::AVG : ReduceOp::SUM;
  }
  r.value_op = b.op;
  b.root = uniform(rng, 0, size - 1);
  b.async_op = coin(rng, 0.3);
  b.bucket = pick(rng, kBuckets);
  if (coin(rng, 0.25)) b.tag = uniform(rng, 0, 99);
  b.consolidate = coin(rng, 0.2);
  // consolidate() makes every leaf contiguous: it would undo the deviant's transposed view.
  if (kind == "contiguity" || kind == "p2p_contiguity") b.consolidate = false;
  b.layout = r.layout;
  b.parts_layout = r.layout;
  if (p2p) {
    r.p2p_src = uniform(rng, 0, 1);
    r.p2p_dst = 1 - r.p2p_src;
    r.deviant = coin(rng, 0.5) ? r.p2p_src : r.p2p_dst;
    // Both ways at once (isend and irecv on both sides: sync calls would wait for each other).
    if (kind != "p2p_async" && kind != "p2p_zero_bucket" && coin(rng, 0.35)) {
      r.bidirectional = true;
      b.async_op = true;
    }
  } else {
    r.deviant = uniform(rng, 0, size - 1);
  }
  if (kind == "part_contiguity") r.deviant = b.root;
  r.dev = b;
  Call& d = r.dev;
  const std::string who = p2p ? (r.deviant == r.p2p_src ? "the sender" : "the receiver") : "";

  auto toggle_contiguity = [&](std::vector<Leaf>& layout) {
    const auto candidates = two_d_leaves(layout);
    const std::size_t k = pick(rng, candidates);
    layout[k].transposed = !layout[k].transposed;
    return layout[k];
  };

  if (kind == "op") {
    std::vector<ReduceOp> others;
    for (ReduceOp op : kEveryOp)
      if (op != b.op) others.push_back(op);
    d.op = pick(rng, others);
    r.differs = "op " + std::string(td::name(d.op)) + " instead of " + std::string(td::name(b.op));
    // An op the deviant's dtypes do not support is that rank's bad argument (invalid_argument on
    // every rank, naming it); a supported one is a disagreement.
    r.expectation = op_supported(d.op, d.layout)
                        ? with_keywords(kLayoutError, {"op="})
                        : with_keywords(kArgError, {"op " + std::string(td::name(d.op))});
  } else if (kind == "root") {
    d.root = (b.root + uniform(rng, 1, size - 1)) % size;
    r.differs = "root " + std::to_string(d.root) + " instead of " + std::to_string(b.root);
    r.expectation = with_keywords(kLayoutError, {"dst=", "src="});
  } else if (kind == "bad_root") {
    d.root = pick(rng, std::vector<int>{-1, size, size + 2});
    r.differs = "root " + std::to_string(d.root) + " (out of range)";
    r.expectation = with_keywords(kArgError, {"out of range"});
  } else if (kind == "async") {
    d.async_op = !b.async_op;
    r.differs = d.async_op ? "async_op=true" : "async_op=false";
    r.expectation = with_keywords(kEither, {"async"});
  } else if (kind == "bucket" || kind == "p2p_bucket") {
    std::vector<std::optional<std::size_t>> others;
    for (const auto& x : kBuckets)
      if (x != b.bucket) others.push_back(x);
    d.bucket = pick(rng, others);
    r.differs = "bucket_bytes=" + bucket_str(d.bucket) + " instead of " + bucket_str(b.bucket);
    // Collectives: the docs list a differing bucket size as a LayoutMismatchError; a correct result
    // keeps the promise too. Point to point: the sender chooses, the receiver's is ignored.
    r.expectation = p2p ? kCorrect : with_keywords(kEither, {"bucket_bytes"});
  } else if (kind == "zero_bucket") {
    d.bucket = 0;
    r.differs = "bucket_bytes=0";
    r.expectation = with_keywords(kArgError, {"bucket_bytes"});
  } else if (kind == "p2p_zero_bucket") {
    d.bucket = 0;
    r.differs = who + " passes bucket_bytes=0";
    if (r.deviant == r.p2p_src) {
      // The sender's bad argument (issue 16, hole 6): std::invalid_argument naming it, raised
      // before any state changes, so its corrected retry pairs with the receiver's recv.
      r.sender_retries = true;
      r.differs += ", raises, then retries with bucket_bytes=" + bucket_str(b.bucket);
      r.expectation = kCorrect;
    } else {
      // The receiver's bucket_bytes is ignored; rejecting it on both sides is fine too.
      r.expectation = {Expect::Either, {Exc::InvalidArgument, Exc::LayoutMismatch}, false, {}, -1};
    }
  } else if (kind == "tag") {
    d.tag = d.tag ? (*d.tag + 1) % 100 : 7;
    r.differs = "tag " + std::to_string(*d.tag) + " (collectives ignore tags)";
    r.expectation = kCorrect;
  } else if (kind == "p2p_tag_same") {
    // Not a divergence: both sides pass the same non-default tag (a control round).
    b.tag = d.tag = uniform(rng, 1, td::kMaxUserTag - 1);
    r.differs = "nothing (both use tag " + std::to_string(*d.tag) + ")";
    r.expectation = kCorrect;
  } else if (kind == "timeout" || kind == "p2p_timeout") {
    d.timeout = pick(rng, std::vector<std::optional<Ms>>{std::nullopt, 1500ms, 30s, Ms::max()});
    r.differs = "timeout=" + timeout_str(d.timeout);
    r.expectation = kCorrect;
  } else if (kind == "key_missing" || kind == "key_renamed" || kind == "p2p_key") {
    r.expectation = kLayoutError;
    if (kind == "key_missing") {
      const std::size_t k = std::uniform_int_distribution<std::size_t>(0, r.layout.size() - 1)(rng);
      r.differs = "has no key " + key_str(r.layout[k].key);
      r.expectation.keywords = {r.layout[k].key.str()};
      d.layout.erase(d.layout.begin() + static_cast<std::ptrdiff_t>(k));
    } else if (kind == "key_renamed") {
      do {
        d.layout = b.layout;
        change_key(r, rng);
      } while (d.layout.size() != b.layout.size());
    } else {
      change_key(r, rng);
    }
  } else if (kind == "shape" || kind == "p2p_shape") {
    const std::size_t k = std::uniform_int_distribution<std::size_t>(0, r.layout.size() - 1)(rng);
    Leaf& l = d.layout[k];
    if (l.shape.size() == 1) {
      l.shape.push_back(2);
    } else {
      l.shape[1] += 1;
    }
    r.differs = "key " + key_str(l.key) + " has shape " + shape_str(l.shape);
    r.expectation = with_keywords(kLayoutError, {l.key.str()});
  } else if (kind == "dtype" || kind == "p2p_dtype") {
    const std::size_t k = std::uniform_int_distribution<std::size_t>(0, r.layout.size() - 1)(rng);
    Leaf& l = d.layout[k];
    std::vector<DType> others;
    for (DType t : kFloatTypes)
      if (t != l.dtype && (!reduces(b.coll) || td::supports(b.op, t))) others.push_back(t);
    for (DType t : kIntTypes)
      if (t != l.dtype && (!reduces(b.coll) || td::supports(b.op, t))) others.push_back(t);
    l.dtype = pick(rng, others);
    r.differs = "key " + key_str(l.key) + " is " + std::string(td::name(l.dtype));
    r.expectation = with_keywords(kLayoutError, {l.key.str()});
  } else if (kind == "contiguity") {
    const Leaf l = toggle_contiguity(d.layout);
    r.differs =
        "key " + key_str(l.key) + (l.transposed ? " is a transposed view" : " is contiguous");
    // Contiguity is part of the agreement (docs/reliability.md): a LayoutMismatchError naming
    // the key keeps the promise, and so does a correct result.
    r.expectation = with_keywords(kEither, {l.key.str()});
  } else if (kind == "p2p_contiguity") {
    const Leaf l = toggle_contiguity(d.layout);
    r.differs =
        who + "'s " + key_str(l.key) + (l.transposed ? " is a transposed view" : " is contiguous");
    r.expectation = kCorrect;  // the handshake compares keys, dtypes and shapes only
  } else if (kind == "part_contiguity") {
    const Leaf l = toggle_contiguity(d.parts_layout);
    r.differs = "src's parts hold " + key_str(l.key) +
                (l.transposed ? " as a transposed view" : " contiguous");
    r.expectation = kCorrect;
  } else if (kind == "consolidate" || kind == "p2p_consolidate") {
    d.consolidate = !b.consolidate;
    r.differs = d.consolidate ? "consolidated" : "not consolidated";
    // Memory layout only, except that consolidate() also makes a transposed leaf contiguous,
    // and contiguity is part of what a collective's ranks agree on (docs/reliability.md; point
    // to point agrees on keys, dtypes and shapes only): then the same error naming it.
    bool any_transposed = false;
    for (const Leaf& l : d.layout) any_transposed = any_transposed || l.transposed;
    r.expectation =
        kind == "consolidate" && any_transposed
            ? with_keywords(Expectation{Expect::Either, {Exc::LayoutMismatch}, true, {}, -1},
                            {"non-contiguous"})
            : kCorrect;
  } else if (kind == "p2p_async") {
    d.async_op = !b.async_op;
    r.differs = who + (d.async_op ? " is async" : " is sync");
    r.expectation = kCorrect;
  } else if (kind == "compression") {
    d.compression = coin(rng, 0.5) ? td::Compression::FP16 : td::Compression::BF16;
    r.differs = "compression=" + std::string(td::name(d.compression));
    // Agreed for all_reduce and reduce with SUM or AVG; anywhere else the deviant's bad argument.
    const bool allowed = (b.coll == Coll::AllReduce || b.coll == Coll::Reduce) &&
                         (b.op == ReduceOp::SUM || b.op == ReduceOp::AVG);
    r.expectation = with_keywords(allowed ? kLayoutError : kArgError, {"compression"});
  }
  // A deviant scatter src scatters parts of its own layout (else its parts would not match its
  // dict: a bad argument of its own, not the divergence this round is about).
  if (kind == "key_missing" || kind == "key_renamed" || kind == "shape" || kind == "dtype")
    d.parts_layout = d.layout;
  if (kind == "moved_from") {
    d.moved_from = true;
    r.differs = "calls on a moved-from dict";
    // docs/reliability.md: the local error enters the agreement; td::Error on every rank.
    r.expectation = {Expect::Error,
                     {Exc::OtherTd, Exc::InvalidArgument, Exc::LayoutMismatch},
                     true,
                     {"moved-from"},
                     -1};
  }
  return r;
}

std::set<std::string> kinds_filter() {
  std::set<std::string> out;
  if (auto v = env("TD_DIVERGENCE_KINDS")) {
    std::stringstream s(*v);
    for (std::string k; std::getline(s, k, ',');)
      if (!k.empty()) out.insert(k);
  }
  return out;
}

// Runs one round on every rank and judges it; returns the verdict (empty: kept the promise) and
// the class of outcome for the summary. Replaces `group` when the round broke it.
std::pair<std::string, std::string> play(const Round& r, int rank, td::ProcessGroup& group,
                                         std::vector<td::ProcessGroup>& broken, Watchdog& dog,
                                         const std::string& extra) {
  dog.arm(round_str(r) + extra);
  Outcome mine = execute(r, rank, group);
  dog.phase("waiting for the other ranks to return from the call", kStuckWaiting,
            "\n  this rank's call:" + outcome_str(mine));
  std::vector<Outcome> all = exchange(mine, r.size);
  // After a timeout the communicator is unusable (docs/errors.md): no follow-up then.
  bool followed_up = false;
  if (!broke_group(all)) {
    dog.phase("in the follow-up calls (a small all_reduce / transfer after the round)", kStuck);
    follow_up(r, rank, group, mine);
    dog.phase("waiting for the other ranks to return from the follow-up calls", kStuckWaiting);
    all = exchange(mine, r.size);
    followed_up = true;
  }
  dog.disarm();
  std::string verdict = judge(r, all, followed_up);
  if (broke_group(all)) {
    broken.push_back(group);  // kept alive: its abandoned requests may still complete
    group = fresh_group(r.size, dog, extra);
  }
  if (!verdict.empty())
    verdict += "\n" + round_str(r) + extra + "\n  expected: " + expectation_str(r.expectation) +
               "\n  observed:" + outcomes_str(all);
  return {verdict, verdict.empty() ? outcome_class(all) : "FAILED"};
}

}  // namespace

TEST_CASE("ranks that differ in one input: the correct result or the same error, promptly",
          "[divergence]") {
  const int rank = td::get_rank(), size = td::get_world_size();
  if (env("TD_DIVERGENCE_KINDS") == "list") {  // for test/divergence/run_kinds.sh
    if (rank == 0)
      for (const std::string& k : kKinds) std::printf("%s\n", k.c_str());
    return;
  }
  if (size < 2) {
    SUCCEED("needs two ranks or more");
    return;
  }
  const std::uint64_t first_seed = env_u64("TD_DIVERGENCE_SEED", kDefaultSeed);
  const std::uint64_t rounds =
      env_u64("TD_DIVERGENCE_ROUNDS", (kSlow > 1 ? 4 : 16) * kKinds.size());
  const std::set<std::string> only = kinds_filter();
  const bool verbose = env("TD_DIVERGENCE_VERBOSE").has_value();
  std::map<std::string, int> skipped;
  Watchdog dog(rank);
  td::ProcessGroup group = fresh_group(size, dog, "");
  std::vector<td::ProcessGroup> broken;
  Tally tally;
  for (std::uint64_t i = 0; i < rounds; ++i) {
    const Round r = make_round(first_seed + i, size);
    if (!only.empty() && only.count(r.kind) == 0) continue;
    // A kind that failed kMaxFailures times says enough (and each failure may cost a timeout).
    if (tally.failures(r.kind) >= kMaxFailures) {
      ++skipped[r.kind];
      continue;
    }
    const auto [verdict, cls] = play(r, rank, group, broken, dog, "");
    tally.add(r.kind, cls);
    if (rank == 0 && !verdict.empty()) FAIL_CHECK(verdict);
    if (rank == 0 && verbose)
      std::printf("seed %llu: %s on %s, deviant rank %d (%s): %s\n",
                  static_cast<unsigned long long>(r.seed), r.kind.c_str(), coll_name(r.base.coll),
                  r.deviant, r.differs.c_str(), cls.c_str());
  }
  if (rank == 0) {
    std::printf("divergence: %d ranks, seeds %llu..%llu: %d rounds, %d failed\n%s", size,
                static_cast<unsigned long long>(first_seed),
                static_cast<unsigned long long>(first_seed + rounds - 1), tally.rounds,
                tally.failed, tally.str().c_str());
    for (const auto& [kind, n] : skipped)
      std::printf("  %s: %d later rounds skipped after %d failures\n", kind.c_str(), n,
                  kMaxFailures);
    std::fflush(stdout);
  }
}

// Run by an MPMD launch in which ranks differ in one TD_* setting (see the file comment).
TEST_CASE("a TD_* setting that differs between ranks: the correct result or the same error",
          "[.][divergence_env]") {
  const int rank = td::get_rank(), size = td::get_world_size();
  if (size < 2) {
    SUCCEED("needs two ranks or more");
    return;
  }
  // Which settings differ, from every rank's environment.
  const std::vector<std::string> names = {"TD_SYNC_PIPELINE", "TD_CHECK_LAYOUT",
                                          "TD_BUCKET_BYTES",  "TD_PROGRESS_THREAD",
                                          "TD_TIMEOUT_MS",    "TD_HIERARCHICAL"};
  constexpr int kLen = 32;
  std::vector<char> mine(names.size() * kLen, '\0');
  for (std::size_t i = 0; i < names.size(); ++i) {
    const std::string v = env(names[i].c_str()).value_or("unset");
    std::copy_n(v.data(), std::min<std::size_t>(kLen - 1, v.size()), &mine[i * kLen]);
  }
  std::vector<char> every(mine.size() * static_cast<std::size_t>(size));
  MPI_Allgather(mine.data(), static_cast<int>(mine.size()), MPI_CHAR, every.data(),
                static_cast<int>(mine.size()), MPI_CHAR, MPI_COMM_WORLD);
  std::string differing, settings;
  bool must_be_correct = true;
  std::vector<std::string> keywords;
  for (std::size_t i = 0; i < names.size(); ++i) {
    std::vector<std::string> values;
    for (int q = 0; q < size; ++q)
      values.emplace_back(&every[static_cast<std::size_t>(q) * mine.size() + i * kLen]);
    if (std::adjacent_find(values.begin(), values.end(), std::not_equal_to<>()) == values.end())
      continue;
    differing += (differing.empty() ? "" : ", ") + names[i];
    settings += "\n  " + names[i] + ":";
    for (int q = 0; q < size; ++q)
      settings += " rank " + std::to_string(q) + " " + values[static_cast<std::size_t>(q)] + ";";
    // A progress thread or a default timeout cannot change what is sent: correct results only.
    if (names[i] != "TD_PROGRESS_THREAD" && names[i] != "TD_TIMEOUT_MS") must_be_correct = false;
    keywords.push_back(names[i]);
    if (names[i] == "TD_SYNC_PIPELINE") keywords.emplace_back("pipeline");
    if (names[i] == "TD_CHECK_LAYOUT") keywords.emplace_back("check_layout");
    if (names[i] == "TD_BUCKET_BYTES") keywords.emplace_back("bucket_bytes");
  }
  const std::string extra =
      "\n  settings that differ: " + (differing.empty() ? std::string("none") : differing) +
      settings;

  const std::uint64_t first_seed = env_u64("TD_DIVERGENCE_SEED", kDefaultSeed);
  Watchdog dog(rank);
  td::ProcessGroup group = fresh_group(size, dog, extra);
  std::vector<td::ProcessGroup> broken;
  Tally tally;
  // The calls the settings change: bucketed sync (pipelined or not), the default cap, async,
  // consolidated spans, rooted calls, the default timeout, point to point.
  struct Variant {
    const char* name;
    Coll coll;
    bool async_op;
    std::optional<std::size_t> bucket;
    bool consolidate;
    std::optional<Ms> timeout;
  };
  const std::vector<Variant> variants = {
      {"sync bucketed", Coll::AllReduce, false, 1024, false, kCallTimeout},
      {"sync default cap", Coll::AllReduce, false, std::nullopt, false, kCallTimeout},
      {"async bucketed", Coll::AllReduce, true, 1024, false, kCallTimeout},
      {"sync auto cap", Coll::AllReduce, false, td::kAutoBucketBytes, false, kCallTimeout},
      {"sync consolidated", Coll::AllReduce, false, 1024, true, kCallTimeout},
      {"broadcast", Coll::Broadcast, false, 4096, false, kCallTimeout},
      {"async reduce, default cap", Coll::Reduce, true, std::nullopt, false, kCallTimeout},
      {"sync, default timeout", Coll::AllReduce, false, 1024, false, std::nullopt},
      {"send/recv", Coll::P2P, false, 1024, false, kCallTimeout},
      {"reduce_scatter", Coll::ReduceScatter, false, 1024, false, kCallTimeout},
      {"async all_gather", Coll::AllGather, true, 1024, false, kCallTimeout},
  };
  for (std::uint64_t it = 0; it < 2; ++it) {
    for (std::size_t v = 0; v < variants.size(); ++v) {
      const Variant& var = variants[v];
      Round r;
      r.seed = first_seed + it * 100 + v;
      r.kind = std::string("env: ") + var.name;
      r.size = size;
      r.replay = "the same launch";
      Rng rng(r.seed);
      r.layout = random_layout(rng, true);
      Call& c = r.base;
      c.coll = var.coll;
      c.op = coin(rng, 0.5) ? ReduceOp::SUM : ReduceOp::AVG;
      r.value_op = reduces(c.coll) ? c.op : ReduceOp::SUM;
      c.root = size - 1;
      c.async_op = var.async_op;
      c.bucket = var.bucket;
      c.timeout = var.timeout;
      c.consolidate = var.consolidate;
      c.layout = c.parts_layout = r.layout;
      r.dev = c;
      r.expectation = must_be_correct ? kCorrect : with_keywords(kEither, keywords);
      r.followup_may_fail_alike = !must_be_correct;
      const auto [verdict, cls] = play(r, rank, group, broken, dog, extra);
      tally.add(var.name, cls);
      if (rank == 0 && !verdict.empty()) FAIL_CHECK(verdict);
    }
  }
  if (rank == 0) {
    std::printf("divergence (environment; differing: %s): %d ranks: %d calls, %d failed\n%s",
                differing.empty() ? "none" : differing.c_str(), size, tally.rounds, tally.failed,
                tally.str().c_str());
    std::fflush(stdout);
  }
}
