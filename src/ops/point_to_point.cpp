// Point to point: send / recv / isend / irecv of a Tensor or a TensorDict.
//
// Every transfer is one td::Work that runs in phases (WorkState::then), so the async forms need
// no thread of their own and advance on the progress thread like the collectives:
//   1. handshake: the sender's header (layout fingerprint, bucket cap, message size) travels to
//      the receiver, whose verdict travels back. Nothing else moves before both agree, so a
//      receiver of another layout never has a byte written into its leaves.
//   2. on a mismatch both sides swap a description of their layout and fail with an error that
//      names the first differing key; otherwise the data moves: one message per leaf, or (with
//      bucket_bytes) one per bucket of the same plan the collectives use, which with
//      kAutoBucketBytes is one message per dtype.
// Tags: each call takes a block of tags from its group's TagSpace (runtime/tags.hpp), whose
// per-(peer, direction, user tag) counter runs in step on both sides, so back-to-back and
// overlapping transfers between the same two ranks, and calls with different user tags, cannot
// take each other's messages.
#include <array>
#include <climits>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "comm/collective_engine.hpp"
#include "runtime/deadline.hpp"
#include "runtime/mpi_types.hpp"
#include "runtime/progress.hpp"
#include "tensordict/tensor_dict.hpp"

namespace td {

namespace {

using detail::LeafRef;
using detail::WorkState;
using Clock = std::chrono::steady_clock;

// ---- what travels ---------------------------------------------------------------------------

// One side of a transfer: handles sharing the leaves' storage, in canonical order.
struct Transfer {
  std::vector<Key> keys;
  std::vector<Tensor> tensors;
  std::vector<LeafRef> refs;  // into keys / tensors (for pack / unpack)
  std::string error;          // what makes the dict unfit for point to point on this rank

  void index() {
    refs.clear();
    for (std::size_t i = 0; i < tensors.size(); ++i)
      refs.push_back({&keys[i], &tensors[i], detail::hash_key(keys[i])});
  }
};

std::shared_ptr<Transfer> transfer_of(std::span<const LeafRef> leaves, std::string error) {
  auto x = std::make_shared<Transfer>();
  x->error = std::move(error);  // the dict cannot take part (moved from): the handshake fails
  x->keys.reserve(leaves.size());
  x->tensors.reserve(leaves.size());
  for (const auto& ref : leaves) {
    x->keys.push_back(*ref.key);
    x->tensors.push_back(*ref.tensor);
    if (!x->error.empty()) continue;
    if (!ref.tensor->defined())
      x->error = fmt::format("key '{}' holds an undefined tensor", ref.key->str());
    else if (ref.tensor->is_sparse())
      x->error = fmt::format("key '{}' is a sparse tensor; to_dense() it first", ref.key->str());
  }
  x->index();
  return x;
}

// The fingerprint of the keys, dtypes and shapes in canonical order: the collectives' layout
// hash over the plain layout (never 0, which a sender whose dict cannot be sent uses to make the
// receiver fail too).
std::uint64_t fingerprint(const Transfer& x) {
  return detail::layout_hash(x.refs, detail::plain_layout(x.refs));
}

// "key\tdtype[shape]" per leaf, one per line: what a mismatch sends the other side.
std::string describe_layout(const Transfer& x) {
  if (!x.error.empty()) return "!" + x.error;
  std::string out;
  for (const std::string& line : detail::describe_leaves(x.refs)) out += line + "\n";
  return out;
}

// The first difference between two layouts described by describe_layout, in words.
std::string difference(const std::string& mine, const std::string& theirs, const char* them) {
  if (!theirs.empty() && theirs[0] == '!')
    return fmt::format("the {} could not take part: {}", them, theirs.substr(1));
  auto lines = [](const std::string& s) {
    std::vector<std::string> out;
    std::size_t start = 0;
    for (std::size_t end; (end = s.find('\n', start)) != std::string::npos; start = end + 1)
      out.push_back(s.substr(start, end - start));
    return out;
  };
  const auto d = detail::first_difference({lines(mine), lines(theirs)});
  if (!d) return "the layouts differ";
  if (d->holds[0].empty())
    return fmt::format("the {} has key '{}', which this one lacks", them, d->key);
  if (d->holds[1].empty()) return fmt::format("the {} lacks key '{}'", them, d->key);
  return fmt::format("key '{}' is {} here but {} on the {}", d->key, d->holds[0], d->holds[1],
                     them);
}

// ---- the transfer ---------------------------------------------------------------------------

struct Peer {
  std::shared_ptr<detail::GroupState> group;
  MPI_Comm comm;
  int rank;  // the peer, in the group
  int base;  // tag base of this call
  std::string what;
  std::shared_ptr<void> block;  // the call's tag block, taken until its Work completes
};

Peer start_peer_call(int peer, std::string_view what, const char* peer_name, bool sending,
                     const CollectiveOptions& opts) {
  auto g = detail::group_of(opts);
  MPI_Comm comm = g->checked_comm(what);
  const int user_tag = opts.tag.value_or(0);
  for (const std::string& problem :
       {detail::rank_problem(peer_name, peer, g->size),
        detail::self_problem(peer_name, peer, g->rank),
        detail::timeout_problem(detail::timeout_of(opts)), detail::tag_problem(user_tag)})
    if (!problem.empty()) throw std::invalid_argument(fmt::format("{}: {}", what, problem));
  detail::TagSpace::CallBlock block =
      g->tags->next_call_block(g->rank, peer, sending, user_tag, what);
  return {std::move(g), comm, peer, block.base, std::string(what), std::move(block.lease)};
}

// The bucket cap the sender asks for: 0 is one message per leaf.
std::uint64_t cap_of(const CollectiveOptions& opts, bool from_dict, std::string_view what) {
  const std::optional<std::size_t> cap = detail::requested_cap(opts, from_dict);
  if (!cap) return 0;
  if (const std::string problem = detail::bucket_bytes_problem(cap); !problem.empty())
    throw std::invalid_argument(fmt::format("{}: {}", what, problem));
  // kAutoBucketBytes: everything of one dtype in one bucket (consolidated).
  return *cap == kAutoBucketBytes ? std::uint64_t{1} << 62 : *cap;
}

// Point to point has no cliff to avoid in the way MPI_Allreduce has; messages are capped only so
// that a consolidated transfer streams in pieces the transport pipelines well.
constexpr std::uint64_t kMaxMessageBytes = std::uint64_t{16} << 20;

// Both sides build it from what the handshake agreed (keys, dtypes, shapes), never from their
// own leaves' strides: a leaf may be a strided view on one side and contiguous on the other, and
// both must still post the same messages. Strided leaves are packed by their own strides.
BucketPlan plan_of(const Transfer& x, std::uint64_t cap) {
  std::vector<LeafLayout> layout;
  layout.reserve(x.tensors.size());
  for (const Tensor& t : x.tensors) layout.push_back({t.dtype(), t.shape(), /*contiguous=*/true});
  return BucketPlan::build(layout, cap == 0 ? std::nullopt : std::optional<std::size_t>(cap),
                           kMaxMessageBytes);
}

// Posts one message per piece of every bucket, from (sending) or into the leaves' memory when a
// bucket's leaves lie back to back, else through a pack buffer held by the Work.
void post_data(WorkState& w, const std::shared_ptr<Transfer>& x, std::uint64_t cap, bool sending,
               const Peer& p) {
  auto plan = std::make_shared<const BucketPlan>(plan_of(*x, cap));
  std::vector<std::pair<std::size_t, std::byte*>> unpack_later;  // bucket, buffer
  std::size_t message = 0;
  for (std::size_t b = 0; b < plan->buckets.size(); ++b) {
    const auto& bk = plan->buckets[b];
    bool packed = false;
    std::byte* data = detail::BucketRunner::place(bk, x->refs, w, /*pack=*/sending, &packed);
    if (packed && !sending) unpack_later.emplace_back(b, data);
    const MPI_Datatype type = detail::mpi_datatype(bk.dtype);
    detail::for_each_message(
        bk.nbytes, bk.dtype, plan->max_message_bytes, [&](std::size_t off, int count) {
          const int tag = p.group->tags->data_tag(p.base, message++);
          if (sending) {
            detail::post_into(w, detail::send_call(data + off, count, type, p.rank, tag, p.comm));
          } else {
            detail::post_into(w, detail::recv_call(data + off, count, type, p.rank, tag, p.comm),
                              "data");
          }
        });
  }
  if (!unpack_later.empty())
    w.finish = [x, plan, unpack_later = std::move(unpack_later)] {
      for (const auto& [b, data] : unpack_later)
        detail::unpack_bucket(plan->buckets[b], x->refs, data);
    };
}

// After a mismatch: both sides send their layout (length, then text) and read the other's, then
// fail naming the first difference. `fail` builds the error from it.
void swap_descriptions(WorkState& w, const std::shared_ptr<Transfer>& x, const Peer& p,
                       const char* them, std::function<void(const std::string&)> fail) {
  auto mine = std::make_shared<std::string>(describe_layout(*x));
  auto lengths = std::make_shared<std::array<std::uint64_t, 2>>();  // [mine, theirs]
  (*lengths)[0] = mine->size();
  w.held.push_back(mine);
  w.held.push_back(lengths);
  // Tags base+2 (length) and base+3 (text): both directions use the same tags, which is fine
  // since each side receives only from the other.
  detail::post_into(w,
                    detail::send_call(&(*lengths)[0], 1, MPI_UINT64_T, p.rank, p.base + 2, p.comm));
  detail::post_into(w, detail::send_call(mine->data(), static_cast<int>(mine->size()), MPI_CHAR,
                                         p.rank, p.base + 3, p.comm));
  detail::post_into(w,
                    detail::recv_call(&(*lengths)[1], 1, MPI_UINT64_T, p.rank, p.base + 2, p.comm),
                    "layout description length");
  w.then = [p, mine, lengths, them, fail = std::move(fail)](WorkState& w2) {
    auto theirs = std::make_shared<std::string>((*lengths)[1], '\0');
    w2.held.push_back(theirs);
    detail::post_into(w2,
                      detail::recv_call(theirs->data(), detail::mpi_count(theirs->size(), p.what),
                                        MPI_CHAR, p.rank, p.base + 3, p.comm),
                      "layout description");
    w2.then = [mine, theirs, them, fail](WorkState&) { fail(difference(*mine, *theirs, them)); };
  };
}

Work finish_start(const std::shared_ptr<WorkState>& st, const CollectiveOptions& opts) {
  if (!opts.async_op) {
    st->wait();
    return Work();
  }
  detail::progress_add(st);
  return detail::WorkAccess::wrap(st);
}

// A transfer under way: its peer, its leaves, and its Work holding the handshake's two buffers
// (header: fingerprint and bucket cap; verdict).
struct TransferState {
  Peer p;
  std::shared_ptr<Transfer> x;
  std::shared_ptr<WorkState> st;
  std::shared_ptr<std::array<std::uint64_t, 2>> header;
  std::shared_ptr<int> verdict;
};

TransferState begin_transfer(std::span<const LeafRef> leaves, int peer, std::string_view what,
                             bool sending, const CollectiveOptions& opts, std::string local_error) {
  TransferState t{start_peer_call(peer, what, sending ? "dst" : "src", sending, opts),
                  transfer_of(leaves, std::move(local_error)), std::make_shared<WorkState>(),
                  std::make_shared<std::array<std::uint64_t, 2>>(), std::make_shared<int>(0)};
  // The Work alone holds the call's tag block (copies of the Peer in its steps must not).
  t.st->held.push_back(std::exchange(t.p.block, nullptr));
  t.st->deadline = detail::deadline_after(detail::timeout_of(opts));
  t.st->describe = [p = t.p, direction = sending ? "to" : "from"] {
    return fmt::format("{} {} rank {} of the group of {} ranks", p.what, direction, p.rank,
                       p.group->size);
  };
  t.st->keep_alive = t.x->tensors;
  t.st->what = what;
  t.st->held.push_back(t.header);
  t.st->held.push_back(t.verdict);
  return t;
}

// The call in the flight recorder (point to point's own sequence numbers), its Works counted.
detail::CallScope p2p_call(std::span<const LeafRef> leaves, int peer, std::string_view what,
                           const CollectiveOptions& opts) {
  const std::string first_key = leaves.empty() ? std::string() : leaves[0].key->str();
  detail::CallSummary s;
  s.first_key = first_key;
  s.leaves = leaves.size();
  s.root = peer;
  s.async = opts.async_op;
  return detail::CallScope(*detail::group_of(opts), what, detail::CallKind::PointToPoint, s);
}

// The handshake said no (a layout difference, or a side that could not take part and offered
// fingerprint 0): both sides swap their layouts and throw the error naming the first difference.
void reject(WorkState& w, const std::shared_ptr<Transfer>& x, const Peer& p, bool sending) {
  swap_descriptions(
      w, x, p, sending ? "receiver" : "sender", [p, x, sending](const std::string& diff) {
        if (!x->error.empty()) throw std::invalid_argument(fmt::format("{}: {}", p.what, x->error));
        if (sending)
          throw LayoutMismatchError(
              fmt::format("{}: the receiver (rank {}) does not hold the sender's layout (keys, "
                          "dtypes and shapes in sorted key order): {}; nothing was sent",
                          p.what, p.rank, diff));
        throw LayoutMismatchError(
            fmt::format("{}: this TensorDict does not hold the sender's (rank {}) layout "
                        "(keys, dtypes and shapes in sorted key order): {}; nothing was "
                        "received",
                        p.what, p.rank, diff));
      });
}

Work start_send(std::span<const LeafRef> leaves, int dst, const CollectiveOptions& opts,
                std::string_view what, bool from_dict, std::string local_error = {}) {
  // Every argument is checked before start_peer_call takes this call's tag block, so a bad
  // call changes nothing and a corrected retry pairs with the receiver's pending recv.
  const std::uint64_t cap = cap_of(opts, from_dict, what);
  const detail::CallScope call = p2p_call(leaves, dst, what, opts);
  TransferState t =
      begin_transfer(leaves, dst, what, /*sending=*/true, opts, std::move(local_error));
  const Peer& p = t.p;
  *t.header = {t.x->error.empty() ? fingerprint(*t.x) : 0, cap};
  detail::post_into(*t.st,
                    detail::send_call(t.header->data(), 2, MPI_UINT64_T, dst, p.base, p.comm));
  detail::post_into(*t.st, detail::recv_call(t.verdict.get(), 1, MPI_INT, dst, p.base + 1, p.comm),
                    "verdict");
  t.st->then = [x = t.x, p, cap, verdict = t.verdict](WorkState& w) {
    if (*verdict == 1) {
      post_data(w, x, cap, /*sending=*/true, p);
    } else {
      reject(w, x, p, /*sending=*/true);
    }
  };
  return finish_start(t.st, opts);
}

Work start_recv(std::span<const LeafRef> leaves, int src, const CollectiveOptions& opts,
                std::string_view what, std::string local_error = {}) {
  const detail::CallScope call = p2p_call(leaves, src, what, opts);
  TransferState t =
      begin_transfer(leaves, src, what, /*sending=*/false, opts, std::move(local_error));
  const Peer& p = t.p;
  detail::post_into(
      *t.st, detail::recv_call(t.header->data(), 2, MPI_UINT64_T, src, p.base, p.comm), "header");
  t.st->then = [x = t.x, p, header = t.header, verdict = t.verdict](WorkState& w) {
    const auto [theirs, cap] = *header;
    const bool ok = x->error.empty() && theirs != 0 && theirs == fingerprint(*x);
    *verdict = ok ? 1 : 0;
    detail::post_into(w, detail::send_call(verdict.get(), 1, MPI_INT, p.rank, p.base + 1, p.comm));
    if (ok) {
      post_data(w, x, cap, /*sending=*/false, p);
      return;
    }
    w.then = [x, p](WorkState& w2) { reject(w2, x, p, /*sending=*/false); };
  };
  return finish_start(t.st, opts);
}

std::vector<Work> as_vector(Work w, const CollectiveOptions& opts) {
  std::vector<Work> out;
  if (opts.async_op) out.push_back(std::move(w));
  return out;
}

CollectiveOptions async_of(CollectiveOptions opts) {
  opts.async_op = true;
  return opts;
}

LeafRef tensor_ref(Tensor& t) {
  static const Key kKey("<tensor>");
  return {&kKey, &t, 0};
}

}  // namespace

std::vector<Work> TensorDict::send(int dst, const CollectiveOptions& opts) {
  auto in = detail::dict_leaves(*this, /*with_cache=*/false);
  return as_vector(
      start_send(in.leaves, dst, opts, "TensorDict.send", /*from_dict=*/true, std::move(in.error)),
      opts);
}

std::vector<Work> TensorDict::recv(int src, const CollectiveOptions& opts) {
  auto in = detail::dict_leaves(*this, /*with_cache=*/false);
  return as_vector(start_recv(in.leaves, src, opts, "TensorDict.recv", std::move(in.error)), opts);
}

std::vector<Work> TensorDict::isend(int dst, const CollectiveOptions& opts) {
  return send(dst, async_of(opts));
}

std::vector<Work> TensorDict::irecv(int src, const CollectiveOptions& opts) {
  return recv(src, async_of(opts));
}

Work send(const Tensor& t, int dst, const CollectiveOptions& opts) {
  Tensor handle = t;
  const LeafRef ref = tensor_ref(handle);
  return start_send(std::span<const LeafRef>(&ref, 1), dst, opts, "send", false);
}

Work recv(Tensor& t, int src, const CollectiveOptions& opts) {
  const LeafRef ref = tensor_ref(t);
  return start_recv(std::span<const LeafRef>(&ref, 1), src, opts, "recv");
}

Work isend(const Tensor& t, int dst, const CollectiveOptions& opts) {
  return send(t, dst, async_of(opts));
}

Work irecv(Tensor& t, int src, const CollectiveOptions& opts) {
  return recv(t, src, async_of(opts));
}

}  // namespace td
