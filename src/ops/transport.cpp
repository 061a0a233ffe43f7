// Transport without a prior layout: broadcast_dict, send_dict / recv_dict, all_gather_dicts,
// gather_dicts, scatter_dicts. Every call is the same four steps:
//   1. agreement (collectives): prepare_collective on no leaves, so that the call, its root, its
//      options and any local error (a bad argument, a dict that cannot be sent) are agreed by
//      every rank before anything moves;
//   2. sizes: a fixed record per sender (metadata bytes, then bytes per dtype), which every rank
//      of a collective receives, so all know which per-dtype data calls follow and check the
//      claimed sizes the same way;
//   3. metadata (dict_wire.hpp), decoded and validated by its receivers; where only some ranks
//      decode, one status round makes a rejection an error on every rank before any data moves;
//   4. data: one nonblocking call per dtype (Ibcast, Iallgatherv, Igatherv, Iscatterv with exact
//      counts, or point-to-point messages), from the sender's storage when its leaves of that
//      dtype lie back to back (consolidated), packed otherwise, into one fresh storage per dtype
//      on the receivers, whose dicts are views into it. Every wait is polled against the call's
//      deadline (a td::TimeoutError, not a hang).
#include "tensordict/transport.hpp"

#include <algorithm>
#include <array>
#include <climits>
#include <cstdint>
#include <cstring>
#include <deque>
#include <exception>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "comm/collective_engine.hpp"
#include "comm/dict_wire.hpp"
#include "comm/tail_guard.hpp"
#include "runtime/flight_recorder.hpp"

namespace td {

namespace {

using detail::CollectiveCall;
using detail::CollectiveKind;
using detail::DictLayout;
using Clock = std::chrono::steady_clock;

// A sender's size record: [0] bytes of its encoded layout, [1 + k] bytes of its dtype-k stream,
// [kGuardWord] the tail guard of its messages (collectives only: comm/tail_guard.hpp).
constexpr int kSizeWords = 2 + static_cast<int>(kNumDTypes);
constexpr std::size_t kGuardWord = 1 + kNumDTypes;
using Sizes = std::array<std::uint64_t, kSizeWords>;

DType dtype_at(std::size_t k) { return static_cast<DType>(k); }

// One dict ready to go: its layout, leaves, encoded metadata and size record.
struct Outgoing {
  DictLayout layout;
  std::vector<Tensor> tensors;
  std::vector<std::byte> meta;
  Sizes sizes{};
};

Outgoing outgoing(const TensorDict& d) {
  Outgoing o;
  o.layout = detail::describe_dict(d, o.tensors);
  o.meta = detail::encode_layout(o.layout);
  o.sizes[0] = o.meta.size();
  const auto bytes = o.layout.stream_bytes();
  std::copy(bytes.begin(), bytes.end(), o.sizes.begin() + 1);
  return o;
}

// outgoing(d), or nothing and the reason noted in `err` (agreed, so every rank raises it).
std::optional<Outgoing> try_outgoing(const TensorDict& d, std::string_view which,
                                     std::string& err) {
  try {
    return outgoing(d);
  } catch (const std::exception& e) {
    if (err.empty()) err = fmt::format("{}: {}", which, e.what());
    return std::nullopt;
  }
}

// The counts and displacements of one v-collective (per rank, in elements) and their sum.
struct VCounts {
  std::vector<int> counts, displs;
  int total = 0;
};

// Everything MPI reads or writes during a call (leaked, not freed, when a wait times out).
struct Hold {
  std::vector<Tensor> tensors;
  std::deque<std::vector<std::byte>> bytes;  // a deque: references stay valid as it grows
  std::vector<std::uint64_t> words;
  // The v-collectives' counts and displacements: MPI reads them until the request completes,
  // so they live as long as the buffers (also past a timeout, when the hold is leaked).
  VCounts meta_counts;
  std::vector<VCounts> per_dtype;

  // A sender's leaves, which its in-place messages read: held like every other buffer.
  void keep(const Outgoing& o) {
    tensors.insert(tensors.end(), o.tensors.begin(), o.tensors.end());
  }
};

// Stream `dtype` of `o` as one contiguous buffer: the leaves' own storage when they lie back to
// back, else packed into a buffer `hold` owns.
std::byte* stream_data(const Outgoing& o, std::size_t k, Hold& hold) {
  const DType dtype = dtype_at(k);
  if (const std::byte* p = detail::stream_in_place(o.layout, o.tensors, dtype))
    return const_cast<std::byte*>(
        p);  // NOLINT(cppcoreguidelines-pro-type-const-cast): MPI's send buffers are not const
  Tensor buf = Tensor::empty({static_cast<std::int64_t>(o.layout.stream_elems[k])}, dtype);
  detail::pack_stream(o.layout, o.tensors, dtype, buf);
  hold.tensors.push_back(buf);
  return static_cast<std::byte*>(buf.raw_data());
}

// A sender that is not consolidated sends each leaf from its own memory (no pack copy) when
// its leaves average at least this many bytes; smaller leaves are packed into one message.
constexpr std::uint64_t kSegmentBytes = std::uint64_t{64} << 10;

// Where segment `seg` of a sender's stream is: the leaf's (or its sparse part's) own memory,
// made contiguous into `hold` if it is not.
std::byte* segment_data(const Outgoing& o, const detail::StreamSegment& seg, Hold& hold) {
  const Tensor& leaf = o.tensors[seg.leaf];
  Tensor t = seg.part == 0 ? leaf : seg.part == 1 ? leaf.values() : leaf.indices();
  if (!t.is_contiguous()) t = t.contiguous();
  hold.tensors.push_back(t);
  return static_cast<std::byte*>(t.raw_data());
}
// Which of `o`'s dtype streams travel as one message per segment (bit k): those not in place
// whose leaves average at least kSegmentBytes. Sent to the receivers, who post the same messages.
std::uint64_t segment_mask(const Outgoing& o) {
  std::uint64_t mask = 0;
  for (std::size_t k = 0; k < kNumDTypes; ++k) {
    if (o.sizes[1 + k] == 0 || detail::stream_in_place(o.layout, o.tensors, dtype_at(k)) != nullptr)
      continue;
    const auto segments = detail::stream_segments(o.layout, dtype_at(k)).size();
    if (o.sizes[1 + k] >= kSegmentBytes * segments) mask |= std::uint64_t{1} << k;
  }
  return mask;
}

// The sender's messages of stream k: post(data, nbytes) once for the whole stream (in place or
// packed), or once per segment from each leaf's own memory (bit k of `mask`).
template <class Post>
void post_stream_out(const Outgoing& o, std::size_t k, std::uint64_t mask, Hold& hold,
                     Post&& post) {
  if ((mask >> k & 1U) == 0) return post(stream_data(o, k, hold), o.sizes[1 + k]);
  const std::size_t isz = itemsize(dtype_at(k));
  for (const auto& seg : detail::stream_segments(o.layout, dtype_at(k)))
    post(segment_data(o, seg, hold), seg.count * isz);
}

// The receiver's messages of stream k into `data` (the stream's storage), matching the sender's.
template <class Post>
void post_stream_in(const DictLayout& layout, std::size_t k, std::uint64_t nbytes,
                    std::uint64_t mask, std::byte* data, Post&& post) {
  if ((mask >> k & 1U) == 0) return post(data, nbytes);
  const std::size_t isz = itemsize(dtype_at(k));
  for (const auto& seg : detail::stream_segments(layout, dtype_at(k)))
    post(data + seg.offset * isz, seg.count * isz);
}

// Where one MPI call of the data phase reads or writes.
using Region = std::span<std::byte>;
using StreamMessages = std::array<std::vector<Region>, kNumDTypes>;

// Cuts (data, nbytes) of dtype k into the messages MPI takes (INT_MAX elements at most).
void cut_messages(std::byte* data, std::uint64_t nbytes, std::size_t k, std::vector<Region>& out) {
  detail::for_each_message(nbytes, dtype_at(k), SIZE_MAX, [&](std::size_t off, int count) {
    out.emplace_back(data + off, static_cast<std::size_t>(count) * itemsize(dtype_at(k)));
  });
}

// The sender's messages of every stream of `o`, as it posts them (post_stream_out), packed into
// `hold` where needed: prepared before its size record goes out, which carries their guard.
StreamMessages messages_out(const Outgoing& o, std::uint64_t mask, Hold& hold) {
  StreamMessages out;
  for (std::size_t k = 0; k < kNumDTypes; ++k) {
    if (o.sizes[1 + k] == 0) continue;
    post_stream_out(o, k, mask, hold,
                    [&](std::byte* data, std::uint64_t n) { cut_messages(data, n, k, out[k]); });
  }
  return out;
}

// The receiver's messages of stream k (the same cuts as the sender's) into `data`.
std::vector<Region> messages_in(const DictLayout& layout, std::size_t k, std::uint64_t nbytes,
                                std::uint64_t mask, std::byte* data) {
  std::vector<Region> out;
  post_stream_in(layout, k, nbytes, mask, data,
                 [&](std::byte* at, std::uint64_t n) { cut_messages(at, n, k, out); });
  return out;
}

// The guard a sender announces for its metadata and data messages.
std::uint64_t guard_of(const std::vector<std::byte>& meta, const StreamMessages& data) {
  std::vector<std::span<const std::byte>> all;
  all.emplace_back(meta.data(), meta.size());
  for (const auto& msgs : data)
    for (const Region& r : msgs) all.emplace_back(r.data(), r.size());
  return detail::TailGuard::choose(all).word();
}

// A receiver's check of regions a collective filled from rank `rank`: the first one that still
// ends with the sender's canary is a short message.
void check_filled(const detail::TailGuard& guard, std::span<const Region> regions, int rank,
                  std::uint64_t announced, std::string_view what, std::string_view phase) {
  for (const Region& r : regions)
    if (guard.short_message(r))
      throw Error(fmt::format(
          "{}: rank {} sent less {} than the {} bytes it announced (a short message: the end of "
          "a {}-byte receive was never written); the transfer is rejected",
          what, rank, phase, announced, r.size()));
}

// A segment mask from a peer: bits of dtypes only.
void check_mask(std::uint64_t mask, int rank, std::string_view what) {
  if (mask >> kNumDTypes != 0)
    throw Error(
        fmt::format("{}: rank {} sent an invalid header (segment mask {:#x})", what, rank, mask));
}

// Options these calls reject (noted as a local error, agreed like any other).
std::string option_error(const CollectiveOptions& opts) {
  if (opts.async_op)
    return "async_op is not supported by transport without a prior layout (the receivers' dicts "
           "exist only once the data arrived); call it from a thread of your own instead";
  return detail::bucket_bytes_problem(opts.bucket_bytes);
}

struct Agreed {
  std::shared_ptr<detail::GroupState> group;
  Clock::time_point deadline;
  detail::CallScope scope;  // the call's sequence number, held until it returns
};

// Step 1: the call (name, root), the options and every rank's local error, agreed on no leaves.
Agreed agree_call(CollectiveKind kind, int root, std::string_view what,
                  const CollectiveOptions& opts, std::string err) {
  auto prepared = detail::prepare_collective(
      {}, CollectiveCall{kind, ReduceOp::SUM, root, what, /*from_dict=*/false}, opts,
      std::move(err));
  return {std::move(prepared.group), prepared.deadline, std::move(prepared.scope)};
}

// A peer's size record, checked the same way on every rank that holds it.
void check_sizes(const Sizes& s, int rank, std::string_view what) {
  if (s[0] < detail::kWireMagic.size() || s[0] > detail::kWireMaxMetadataBytes)
    throw Error(
        fmt::format("{}: rank {} announced {} bytes of metadata (corrupted or not a "
                    "transport peer); no data was sent",
                    what, rank, s[0]));
  for (std::size_t k = 0; k < kNumDTypes; ++k) {
    if (s[1 + k] % itemsize(dtype_at(k)) != 0 || s[1 + k] > detail::kWireMaxStreamBytes)
      throw Error(fmt::format("{}: rank {} announced {} bytes of {} data; no data was sent", what,
                              rank, s[1 + k], name(dtype_at(k))));
  }
}

// Decodes rank `rank`'s metadata and checks it against its size record.
DictLayout decode_checked(std::span<const std::byte> bytes, const Sizes& s, int rank,
                          std::string_view what) {
  DictLayout layout;
  try {
    layout = detail::decode_layout(bytes);
  } catch (const Error& e) {
    throw Error(
        fmt::format("{}: metadata from rank {}: {}; no data was sent", what, rank, e.what()));
  }
  const auto bytes_per_dtype = layout.stream_bytes();
  for (std::size_t k = 0; k < kNumDTypes; ++k) {
    if (bytes_per_dtype[k] != s[1 + k])
      throw Error(fmt::format(
          "{}: metadata from rank {} describes {} bytes of {} data, its size record {}; no data "
          "was sent",
          what, rank, bytes_per_dtype[k], name(dtype_at(k)), s[1 + k]));
  }
  return layout;
}

// Step 3 where only some ranks decode: every rank learns whether one rejected what it received,
// and then raises the same error: that of the highest rejecting rank, whose text it broadcasts.
void agree_status(const detail::GroupState& g, const std::exception_ptr& local,
                  Clock::time_point deadline, std::string_view what) {
  auto hold = std::make_shared<Hold>();
  hold->words.assign(1, local ? static_cast<std::uint64_t>(g.rank) + 1 : 0);
  const std::function<std::string()> describe = [&] {
    return fmt::format("{}: the metadata check of a group of {} did not complete", what, g.size);
  };
  detail::Step step(deadline, describe, hold, what);
  step.post(
      detail::allreduce_call(MPI_IN_PLACE, hold->words.data(), 1, MPI_UINT64_T, MPI_MAX, g.comm));
  step.wait();
  if (hold->words[0] == 0) return;
  const int rejecting = static_cast<int>(hold->words[0] - 1);
  auto& text = hold->bytes.emplace_back();
  if (g.rank == rejecting) {
    try {
      std::rethrow_exception(local);
    } catch (const std::exception& e) {
      const std::string_view msg = e.what();
      text.resize(std::min<std::size_t>(msg.size(), detail::kWireMaxMetadataBytes));
      std::memcpy(text.data(), msg.data(), text.size());
    }
  }
  hold->words.assign(1, text.size());
  step.post(detail::bcast_call(hold->words.data(), 1, MPI_UINT64_T, rejecting, g.comm));
  step.wait();
  text.resize(hold->words[0]);
  step.post(detail::bcast_call(text.data(), detail::mpi_count(text.size(), what), MPI_BYTE,
                               rejecting, g.comm));
  step.wait();
  if (g.rank == rejecting) std::rethrow_exception(local);
  throw Error(std::string(reinterpret_cast<const char*>(text.data()), text.size()));
}

// The dict of a received layout whose streams are the given ranges of `all[k]` (element ranges).
TensorDict result_of(const DictLayout& layout, const std::array<Tensor, kNumDTypes>& all,
                     const std::array<std::int64_t, kNumDTypes>& first, std::string_view what) {
  std::array<Tensor, kNumDTypes> streams;
  for (std::size_t k = 0; k < kNumDTypes; ++k) {
    const auto n = static_cast<std::int64_t>(layout.stream_elems[k]);
    if (n > 0) streams[k] = all[k].slice(0, first[k], first[k] + n);
  }
  try {
    return detail::materialize(layout, streams);
  } catch (const Error& e) {
    throw Error(fmt::format("{}: {}", what, e.what()));
  }
}

// Element counts and displacements of a v-collective over dtype k, from every rank's record.
VCounts v_counts(const std::vector<Sizes>& table, std::size_t word, std::size_t isz,
                 std::string_view what) {
  VCounts v;
  std::size_t total = 0;
  for (const Sizes& s : table) {
    v.displs.push_back(detail::mpi_count(total, what));
    v.counts.push_back(detail::mpi_count(s[word] / isz, what));
    total += s[word] / isz;
  }
  v.total = detail::mpi_count(total, what);
  return v;
}

// The dtypes some rank sends data of.
std::vector<std::size_t> dtypes_in(const std::vector<Sizes>& table) {
  std::vector<std::size_t> out;
  for (std::size_t k = 0; k < kNumDTypes; ++k) {
    if (std::any_of(table.begin(), table.end(), [&](const Sizes& s) { return s[1 + k] != 0; }))
      out.push_back(k);
  }
  return out;
}

// Every count of a v-collective call (the metadata's bytes, then each dtype's elements), from
// every rank's record, into `hold` (MPI reads them until the requests complete), before anything
// is posted: a count beyond INT_MAX throws on every rank alike (they hold the same table), with no
// request of the call pending.
void count_messages(Hold& hold, const std::vector<Sizes>& table,
                    const std::vector<std::size_t>& data_dtypes, std::string_view what) {
  hold.meta_counts = v_counts(table, 0, 1, what);
  hold.per_dtype.assign(kNumDTypes, {});
  for (const std::size_t k : data_dtypes)
    hold.per_dtype[k] = v_counts(table, 1 + k, itemsize(dtype_at(k)), what);
}

// ---- the gathers ---------------------------------------------------------------------------

std::vector<TensorDict> gather_dicts_impl(const TensorDict& value, bool all, int dst,
                                          const CollectiveOptions& opts) {
  const std::string_view what = all ? "td.all_gather_dicts" : "td.gather_dicts";
  std::string err = option_error(opts);
  auto out = try_outgoing(value, "value", err);
  const Agreed agreed =
      agree_call(all ? CollectiveKind::AllGather : CollectiveKind::Gather, dst, what, opts, err);
  const auto& g = agreed.group;
  const Clock::time_point deadline = agreed.deadline;
  const auto size = static_cast<std::size_t>(g->size);
  const auto me = static_cast<std::size_t>(g->rank);
  const bool receives = all || g->rank == dst;
  const MPI_Comm comm = g->comm;
  auto hold = std::make_shared<Hold>();
  const std::function<std::string()> describe = [&] {
    return fmt::format("{} in a group of {} ranks", what, g->size);
  };

  // This rank's streams (one message each: a v-collective takes one buffer per rank) and the
  // guard of its messages, before its size record goes out.
  hold->keep(*out);
  StreamMessages mine;
  for (std::size_t k = 0; k < kNumDTypes; ++k)
    if (out->sizes[1 + k] > 0) mine[k].emplace_back(stream_data(*out, k, *hold), out->sizes[1 + k]);
  out->sizes[kGuardWord] = guard_of(out->meta, mine);

  // Sizes: every rank needs every record (to know which per-dtype calls follow).
  hold->words.resize(size * kSizeWords);
  detail::Step step(deadline, describe, hold, what);
  step.post(detail::allgather_call(out->sizes.data(), kSizeWords, MPI_UINT64_T, hold->words.data(),
                                   kSizeWords, MPI_UINT64_T, comm));
  step.wait();
  std::vector<Sizes> table(size);
  for (std::size_t r = 0; r < size; ++r) {
    std::copy_n(hold->words.begin() + static_cast<std::ptrdiff_t>(r * kSizeWords), kSizeWords,
                table[r].begin());
    check_sizes(table[r], static_cast<int>(r), what);
  }
  const std::vector<std::size_t> data_dtypes = dtypes_in(table);
  count_messages(*hold, table, data_dtypes, what);
  const VCounts& mc = hold->meta_counts;
  const std::vector<VCounts>& per_dtype = hold->per_dtype;

  // The region of rank r's part of a receive buffer of v-collective `v`.
  auto region_of = [&](std::byte* base, const VCounts& v, std::size_t r, std::size_t isz) {
    return Region(base + static_cast<std::size_t>(v.displs[r]) * isz,
                  static_cast<std::size_t>(v.counts[r]) * isz);
  };
  // Checks every rank's part of a filled receive buffer against that rank's guard.
  auto check_parts = [&](std::byte* base, const VCounts& v, std::size_t word, std::size_t isz,
                         const std::string& phase) {
    for (std::size_t r = 0; r < size; ++r)
      check_filled(detail::TailGuard(table[r][kGuardWord]), std::array{region_of(base, v, r, isz)},
                   static_cast<int>(r), table[r][word], what, phase);
  };

  // Metadata.
  auto& meta_all = hold->bytes.emplace_back(receives ? static_cast<std::size_t>(mc.total) : 0);
  if (receives)
    for (std::size_t r = 0; r < size; ++r)
      detail::TailGuard(table[r][kGuardWord]).arm(region_of(meta_all.data(), mc, r, 1));
  const int my_meta = mc.counts[me];
  if (all) {
    step.post(detail::allgatherv_call(out->meta.data(), my_meta, MPI_BYTE, meta_all.data(),
                                      mc.counts.data(), mc.displs.data(), MPI_BYTE, comm));
  } else {
    step.post(detail::gatherv_call(out->meta.data(), my_meta, MPI_BYTE, meta_all.data(),
                                   mc.counts.data(), mc.displs.data(), MPI_BYTE, dst, comm));
  }
  step.wait();
  std::vector<DictLayout> layouts;
  std::exception_ptr failed;
  if (receives) {
    try {
      check_parts(meta_all.data(), mc, 0, 1, "metadata");
      for (std::size_t r = 0; r < size; ++r)
        layouts.push_back(decode_checked(region_of(meta_all.data(), mc, r, 1), table[r],
                                         static_cast<int>(r), what));
    } catch (...) {
      failed = std::current_exception();
    }
  }
  // Even where every rank decoded the same bytes, one status round: a short message is seen only
  // by the ranks it reached unfilled.
  agree_status(*g, failed, deadline, what);

  // Data: one exact-size v-collective per dtype that some rank sends.
  std::array<Tensor, kNumDTypes> big;
  for (const std::size_t k : data_dtypes) {
    const DType dtype = dtype_at(k);
    const std::size_t isz = itemsize(dtype);
    const VCounts& v = per_dtype[k];
    std::byte* recv = nullptr;
    if (receives) {
      big[k] = Tensor::empty({v.total}, dtype);
      hold->tensors.push_back(big[k]);
      recv = static_cast<std::byte*>(big[k].raw_data());
      for (std::size_t r = 0; r < size; ++r)
        detail::TailGuard(table[r][kGuardWord]).arm(region_of(recv, v, r, isz));
    }
    std::byte* send = mine[k].empty() ? recv : mine[k][0].data();
    const MPI_Datatype type = detail::mpi_datatype(dtype);
    if (all) {
      step.post(detail::allgatherv_call(send, v.counts[me], type, recv, v.counts.data(),
                                        v.displs.data(), type, comm));
    } else {
      step.post(detail::gatherv_call(send, v.counts[me], type, recv, v.counts.data(),
                                     v.displs.data(), type, dst, comm));
    }
  }
  step.wait();
  if (receives) {
    try {
      for (const std::size_t k : data_dtypes)
        check_parts(static_cast<std::byte*>(big[k].raw_data()), per_dtype[k], 1 + k,
                    itemsize(dtype_at(k)), fmt::format("{} data", name(dtype_at(k))));
    } catch (...) {
      failed = std::current_exception();
    }
  }
  agree_status(*g, failed, deadline, what);
  std::vector<TensorDict> result;
  if (!receives) return result;
  for (std::size_t r = 0; r < size; ++r) {
    std::array<std::int64_t, kNumDTypes> first{};
    for (std::size_t k = 0; k < kNumDTypes; ++k)
      if (!per_dtype[k].displs.empty()) first[k] = per_dtype[k].displs[r];
    result.push_back(result_of(layouts[r], big, first, what));
  }
  return result;
}

// ---- point to point ------------------------------------------------------------------------

// The header of a send_dict: [0] 0 = ok, else the kind of the sender's error; [1] the length of
// its text, which follows instead of the metadata; [2] the dtypes sent as one message per
// segment (bit k, see stream_segments) rather than as one stream; [3..] the size record.
constexpr int kHeaderWords = 3 + kSizeWords;
constexpr std::size_t kFirstSizeWord = 3;
constexpr std::uint64_t kOk = 0, kBadArgument = 1, kFailed = 2;
// The receiver's answer: [0] one of the above, then its error text (NUL-terminated).
constexpr int kAckBytes = 512;

struct Peer {
  std::shared_ptr<detail::GroupState> g;
  Clock::time_point deadline;
  int tag = 0;
};

// Local checks of a point-to-point call; a peer out of range (no one to tell) throws at once,
// the others are returned to be sent to the peer first.
Peer peer_of(int peer, std::string_view what, std::string_view role, bool sending,
             const CollectiveOptions& opts, std::string& err) {
  Peer p{detail::group_of(opts), {}, 0};
  p.g->checked_comm(what);
  for (const std::string& problem :
       {detail::rank_problem(role, peer, p.g->size), detail::self_problem(role, peer, p.g->rank)})
    if (!problem.empty()) throw std::invalid_argument(fmt::format("{}: {}", what, problem));
  const auto timeout = detail::timeout_of(opts);
  if (err.empty()) err = detail::timeout_problem(timeout);
  p.deadline = detail::deadline_after(timeout.count() > 0 ? timeout : detail::timeout_of({}));
  const int user_tag = opts.tag.value_or(0);
  if (err.empty()) err = detail::tag_problem(user_tag);
  p.tag = detail::TagSpace::transport(p.g->rank, peer, sending,
                                      std::clamp(user_tag, 0, kMaxUserTag - 1));
  if (err.empty()) err = option_error(opts);
  return p;
}

// The flight recorder's summary of a point-to-point transport call: its peer.
detail::CallSummary peer_summary(int peer) {
  detail::CallSummary s;
  s.root = peer;
  return s;
}

[[noreturn]] void throw_kind(std::uint64_t kind, const std::string& msg) {
  if (kind == kBadArgument) throw std::invalid_argument(msg);
  throw Error(msg);
}

}  // namespace

TensorDict broadcast_dict(const TensorDict& value, int src, const CollectiveOptions& opts) {
  constexpr std::string_view what = "td.broadcast_dict";
  std::string err = option_error(opts);
  std::optional<Outgoing> out;
  {
    const auto g = detail::group_of(opts);
    if (g->comm != MPI_COMM_NULL && g->rank == src) out = try_outgoing(value, "value", err);
  }
  const Agreed agreed = agree_call(CollectiveKind::Broadcast, src, what, opts, err);
  const auto& g = agreed.group;
  const Clock::time_point deadline = agreed.deadline;
  const bool is_src = g->rank == src;
  const MPI_Comm comm = g->comm;
  auto hold = std::make_shared<Hold>();
  const std::function<std::string()> describe = [&] {
    return fmt::format("{} from rank {} in a group of {} ranks", what, src, g->size);
  };

  // The size record (with the guard of every message that follows), then the segment mask
  // (which streams go one message per leaf). The source prepares its messages first.
  StreamMessages msgs;
  hold->words.assign(kSizeWords + 1, 0);
  if (is_src) {
    const std::uint64_t mask = segment_mask(*out);
    hold->keep(*out);
    msgs = messages_out(*out, mask, *hold);
    out->sizes[kGuardWord] = guard_of(out->meta, msgs);
    std::copy(out->sizes.begin(), out->sizes.end(), hold->words.begin());
    hold->words[kSizeWords] = mask;
  }
  detail::Step step(deadline, describe, hold, what);
  step.post(detail::bcast_call(hold->words.data(), kSizeWords + 1, MPI_UINT64_T, src, comm));
  step.wait();
  Sizes sizes{};
  std::copy_n(hold->words.begin(), kSizeWords, sizes.begin());
  const std::uint64_t per_segment = hold->words[kSizeWords];
  check_sizes(sizes, src, what);
  check_mask(per_segment, src, what);
  const detail::TailGuard guard(sizes[kGuardWord]);

  auto& meta = hold->bytes.emplace_back(is_src ? out->meta : std::vector<std::byte>(sizes[0]));
  if (!is_src) guard.arm(meta);
  step.post(
      detail::bcast_call(meta.data(), detail::mpi_count(sizes[0], what), MPI_BYTE, src, comm));
  step.wait();
  DictLayout layout;
  std::exception_ptr failed;
  if (!is_src) {
    try {
      check_filled(guard, std::array{Region(meta)}, src, sizes[0], what, "metadata");
      layout = decode_checked(meta, sizes, src, what);
    } catch (...) {
      failed = std::current_exception();
    }
  }
  agree_status(*g, failed, deadline, what);

  std::array<Tensor, kNumDTypes> streams;
  for (std::size_t k = 0; k < kNumDTypes; ++k) {
    if (sizes[1 + k] == 0) continue;
    const DType dtype = dtype_at(k);
    if (!is_src) {
      streams[k] =
          Tensor::empty({static_cast<std::int64_t>(sizes[1 + k] / itemsize(dtype))}, dtype);
      hold->tensors.push_back(streams[k]);
      msgs[k] = messages_in(layout, k, sizes[1 + k], per_segment,
                            static_cast<std::byte*>(streams[k].raw_data()));
    }
    const MPI_Datatype type = detail::mpi_datatype(dtype);
    for (const Region& r : msgs[k]) {
      if (!is_src) guard.arm(r);
      step.post(detail::bcast_call(r.data(), static_cast<int>(r.size() / itemsize(dtype)), type,
                                   src, comm));
    }
  }
  step.wait();
  if (!is_src) {
    try {
      for (std::size_t k = 0; k < kNumDTypes; ++k)
        check_filled(guard, msgs[k], src, sizes[1 + k], what,
                     fmt::format("{} data", name(dtype_at(k))));
    } catch (...) {
      failed = std::current_exception();
    }
  }
  agree_status(*g, failed, deadline, what);
  if (is_src) return value;
  return result_of(layout, streams, {}, what);
}

std::vector<TensorDict> all_gather_dicts(const TensorDict& value, const CollectiveOptions& opts) {
  return gather_dicts_impl(value, /*all=*/true, 0, opts);
}

std::vector<TensorDict> gather_dicts(const TensorDict& value, int dst,
                                     const CollectiveOptions& opts) {
  return gather_dicts_impl(value, /*all=*/false, dst, opts);
}

TensorDict scatter_dicts(const std::vector<TensorDict>& parts, int src,
                         const CollectiveOptions& opts) {
  constexpr std::string_view what = "td.scatter_dicts";
  std::string err = option_error(opts);
  std::vector<Outgoing> outs;
  {
    const auto g = detail::group_of(opts);
    if (g->comm != MPI_COMM_NULL && g->rank == src) {
      if (parts.size() != static_cast<std::size_t>(g->size) && err.empty())
        err = fmt::format("{} parts for a group of {} ranks (one part per rank)", parts.size(),
                          g->size);
      for (std::size_t r = 0; r < parts.size() && err.empty(); ++r) {
        auto o = try_outgoing(parts[r], fmt::format("parts[{}]", r), err);
        if (o) outs.push_back(std::move(*o));
      }
    }
  }
  const Agreed agreed = agree_call(CollectiveKind::Scatter, src, what, opts, err);
  const auto& g = agreed.group;
  const Clock::time_point deadline = agreed.deadline;
  const auto size = static_cast<std::size_t>(g->size);
  const auto me = static_cast<std::size_t>(g->rank);
  const bool is_src = g->rank == src;
  const MPI_Comm comm = g->comm;
  auto hold = std::make_shared<Hold>();
  const std::function<std::string()> describe = [&] {
    return fmt::format("{} from rank {} in a group of {} ranks", what, src, g->size);
  };

  // The source packs every dtype's parts rank after rank (what the v-collective sends) and gives
  // each part the guard of its own messages, before the records go out.
  std::array<Tensor, kNumDTypes> packed;
  if (is_src) {
    std::vector<StreamMessages> part_msgs(size);
    for (std::size_t k = 0; k < kNumDTypes; ++k) {
      const DType dtype = dtype_at(k);
      const std::size_t isz = itemsize(dtype);
      std::uint64_t total = 0;
      for (const Outgoing& o : outs) total += o.sizes[1 + k] / isz;
      if (total == 0) continue;
      packed[k] = Tensor::empty({static_cast<std::int64_t>(total)}, dtype);
      hold->tensors.push_back(packed[k]);
      auto* base = static_cast<std::byte*>(packed[k].raw_data());
      std::uint64_t first = 0;
      for (std::size_t r = 0; r < size; ++r) {
        const std::uint64_t n = outs[r].sizes[1 + k] / isz;
        if (n == 0) continue;
        Tensor part = packed[k].slice(0, static_cast<std::int64_t>(first),
                                      static_cast<std::int64_t>(first + n));
        detail::pack_stream(outs[r].layout, outs[r].tensors, dtype, part);
        part_msgs[r][k].emplace_back(base + first * isz, n * isz);
        first += n;
      }
    }
    for (std::size_t r = 0; r < size; ++r)
      outs[r].sizes[kGuardWord] = guard_of(outs[r].meta, part_msgs[r]);
  }

  // Every rank needs every record: the data calls are per dtype that any part holds.
  hold->words.assign(size * kSizeWords, 0);
  if (is_src) {
    for (std::size_t r = 0; r < size; ++r)
      std::copy(outs[r].sizes.begin(), outs[r].sizes.end(),
                hold->words.begin() + static_cast<std::ptrdiff_t>(r * kSizeWords));
  }
  detail::Step step(deadline, describe, hold, what);
  step.post(detail::bcast_call(hold->words.data(), detail::mpi_count(hold->words.size(), what),
                               MPI_UINT64_T, src, comm));
  step.wait();
  std::vector<Sizes> table(size);
  for (std::size_t r = 0; r < size; ++r) {
    std::copy_n(hold->words.begin() + static_cast<std::ptrdiff_t>(r * kSizeWords), kSizeWords,
                table[r].begin());
    check_sizes(table[r], src, what);
  }
  const detail::TailGuard guard(table[me][kGuardWord]);
  const std::vector<std::size_t> data_dtypes = dtypes_in(table);
  count_messages(*hold, table, data_dtypes, what);
  const VCounts& mc = hold->meta_counts;
  const std::vector<VCounts>& per_dtype = hold->per_dtype;

  auto& meta_all = hold->bytes.emplace_back(is_src ? static_cast<std::size_t>(mc.total) : 0);
  if (is_src) {
    for (std::size_t r = 0; r < size; ++r)
      std::copy(outs[r].meta.begin(), outs[r].meta.end(),
                meta_all.begin() + static_cast<std::ptrdiff_t>(mc.displs[r]));
  }
  auto& meta = hold->bytes.emplace_back(static_cast<std::size_t>(mc.counts[me]));
  guard.arm(meta);
  step.post(detail::scatterv_call(meta_all.data(), mc.counts.data(), mc.displs.data(), MPI_BYTE,
                                  meta.data(), mc.counts[me], MPI_BYTE, src, comm));
  step.wait();
  DictLayout layout;
  std::exception_ptr failed;
  try {
    check_filled(guard, std::array{Region(meta)}, src, table[me][0], what, "metadata");
    layout = decode_checked(meta, table[me], src, what);
  } catch (...) {
    failed = std::current_exception();
  }
  agree_status(*g, failed, deadline, what);

  std::array<Tensor, kNumDTypes> streams;
  std::array<Region, kNumDTypes> filled{};
  for (const std::size_t k : data_dtypes) {
    const DType dtype = dtype_at(k);
    const VCounts& v = per_dtype[k];
    std::byte* send = is_src ? static_cast<std::byte*>(packed[k].raw_data()) : nullptr;
    std::byte* recv = send;
    if (v.counts[me] > 0) {
      streams[k] = Tensor::empty({v.counts[me]}, dtype);
      hold->tensors.push_back(streams[k]);
      recv = static_cast<std::byte*>(streams[k].raw_data());
      filled[k] = Region(recv, static_cast<std::size_t>(v.counts[me]) * itemsize(dtype));
      guard.arm(filled[k]);
    }
    const MPI_Datatype type = detail::mpi_datatype(dtype);
    step.post(detail::scatterv_call(send, v.counts.data(), v.displs.data(), type, recv,
                                    v.counts[me], type, src, comm));
  }
  step.wait();
  try {
    for (const std::size_t k : data_dtypes)
      check_filled(guard, std::array{filled[k]}, src, table[me][1 + k], what,
                   fmt::format("{} data", name(dtype_at(k))));
  } catch (...) {
    failed = std::current_exception();
  }
  agree_status(*g, failed, deadline, what);
  return result_of(layout, streams, {}, what);
}

void send_dict(const TensorDict& value, int dst, const CollectiveOptions& opts) {
  constexpr std::string_view what = "td.send_dict";
  std::string err;
  const Peer p = peer_of(dst, what, "dst", /*sending=*/true, opts, err);
  const detail::CallScope call(*p.g, what, detail::CallKind::PointToPoint, peer_summary(dst));
  std::optional<Outgoing> out;
  if (err.empty()) out = try_outgoing(value, "value", err);
  auto hold = std::make_shared<Hold>();
  if (out) hold->keep(*out);
  const std::function<std::string()> describe = [&] {
    return fmt::format("{} to rank {} in a group of {} ranks", what, dst, p.g->size);
  };
  const MPI_Comm comm = p.g->comm;

  // Header and metadata (or the local error, so that the receiver raises it too).
  hold->words.assign(kHeaderWords, 0);
  std::vector<std::byte>& body = hold->bytes.emplace_back();
  std::uint64_t per_segment = 0;
  if (!err.empty()) {
    hold->words[0] = kBadArgument;
    hold->words[1] = err.size();
    body.resize(err.size());
    std::memcpy(body.data(), err.data(), err.size());
  } else {
    per_segment = segment_mask(*out);
    hold->words[2] = per_segment;
    std::copy(out->sizes.begin(), out->sizes.end(),
              hold->words.begin() + static_cast<std::ptrdiff_t>(kFirstSizeWord));
    body = out->meta;
  }
  detail::Step step(p.deadline, describe, hold, what);
  step.post(detail::send_call(hold->words.data(), kHeaderWords, MPI_UINT64_T, dst, p.tag, comm));
  step.post(detail::send_call(body.data(), detail::mpi_count(body.size(), what), MPI_BYTE, dst,
                              p.tag, comm));
  step.wait();
  if (!err.empty()) throw std::invalid_argument(fmt::format("{}: {}", what, err));

  // The receiver's verdict: nothing more is sent unless it accepted the metadata.
  auto& ack = hold->bytes.emplace_back(kAckBytes);
  step.post(detail::recv_call(ack.data(), kAckBytes, MPI_BYTE, dst, p.tag, comm), "verdict");
  step.wait();
  const auto verdict = std::to_integer<std::uint64_t>(ack[0]);
  if (verdict != kOk) {
    ack.back() = std::byte{0};
    throw_kind(verdict, fmt::format("{}: rank {} did not accept the transfer: {}", what, dst,
                                    reinterpret_cast<const char*>(ack.data() + 1)));
  }

  for (std::size_t k = 0; k < kNumDTypes; ++k) {
    if (out->sizes[1 + k] == 0) continue;
    const DType dtype = dtype_at(k);
    const MPI_Datatype type = detail::mpi_datatype(dtype);
    post_stream_out(*out, k, per_segment, *hold, [&](std::byte* data, std::uint64_t nbytes) {
      detail::for_each_message(nbytes, dtype, SIZE_MAX, [&](std::size_t off, int count) {
        step.post(detail::send_call(data + off, count, type, dst, p.tag, comm));
      });
    });
  }
  step.wait();
}

TensorDict recv_dict(int src, const CollectiveOptions& opts) {
  constexpr std::string_view what = "td.recv_dict";
  std::string err;
  const Peer p = peer_of(src, what, "src", /*sending=*/false, opts, err);
  const detail::CallScope call(*p.g, what, detail::CallKind::PointToPoint, peer_summary(src));
  auto hold = std::make_shared<Hold>();
  const std::function<std::string()> describe = [&] {
    return fmt::format("{} from rank {} in a group of {} ranks", what, src, p.g->size);
  };
  const MPI_Comm comm = p.g->comm;

  hold->words.assign(kHeaderWords, 0);
  // The likely cause of a timeout here: the peer never started its send.
  detail::Step header(
      p.deadline,
      [&] {
        return fmt::format(
            "{} timed out: rank {} did not call send_dict to rank {} (with tag {}) within the "
            "timeout",
            describe(), src, p.g->rank, opts.tag.value_or(0));
      },
      hold, what);
  header.post(detail::recv_call(hold->words.data(), kHeaderWords, MPI_UINT64_T, src, p.tag, comm),
              "header");
  header.wait();
  detail::Step step(p.deadline, describe, hold, what);
  const std::uint64_t status = hold->words[0];
  const std::uint64_t per_segment = hold->words[2];
  Sizes sizes{};
  std::copy(hold->words.begin() + static_cast<std::ptrdiff_t>(kFirstSizeWord), hold->words.end(),
            sizes.begin());
  // The body's length is checked before anything is allocated for it.
  const std::uint64_t body_len = status == kOk ? sizes[0] : hold->words[1];
  if (body_len > detail::kWireMaxMetadataBytes)
    throw Error(
        fmt::format("{}: rank {} announced {} bytes of metadata (corrupted or not a "
                    "transport peer)",
                    what, src, body_len));
  auto& body = hold->bytes.emplace_back(body_len);
  step.post(
      detail::recv_call(body.data(), detail::mpi_count(body_len, what), MPI_BYTE, src, p.tag, comm),
      status == kOk ? "metadata" : "error text");
  step.wait();
  if (status != kOk)
    throw_kind(status,
               fmt::format("{}: rank {}'s send_dict failed: {}", what, src,
                           std::string(reinterpret_cast<const char*>(body.data()), body.size())));

  // Our verdict, sent back before any data moves.
  DictLayout layout;
  std::uint64_t verdict = err.empty() ? kOk : kBadArgument;
  std::string why = err;
  if (verdict == kOk) {
    try {
      check_sizes(sizes, src, what);
      check_mask(per_segment, src, what);
      layout = decode_checked(body, sizes, src, what);
    } catch (const std::exception& e) {
      verdict = kFailed;
      why = e.what();
    }
  }
  auto& ack = hold->bytes.emplace_back(kAckBytes);
  ack[0] = static_cast<std::byte>(verdict);
  std::memcpy(ack.data() + 1, why.data(), std::min<std::size_t>(why.size(), kAckBytes - 2));
  step.post(detail::send_call(ack.data(), kAckBytes, MPI_BYTE, src, p.tag, comm));
  step.wait();
  if (verdict == kBadArgument) throw std::invalid_argument(fmt::format("{}: {}", what, err));
  if (verdict != kOk) throw Error(why);

  std::array<Tensor, kNumDTypes> streams;
  for (std::size_t k = 0; k < kNumDTypes; ++k) {
    if (sizes[1 + k] == 0) continue;
    const DType dtype = dtype_at(k);
    streams[k] = Tensor::empty({static_cast<std::int64_t>(sizes[1 + k] / itemsize(dtype))}, dtype);
    hold->tensors.push_back(streams[k]);
    for (const Region& r : messages_in(layout, k, sizes[1 + k], per_segment,
                                       static_cast<std::byte*>(streams[k].raw_data())))
      step.post(detail::recv_call(r.data(), static_cast<int>(r.size() / itemsize(dtype)),
                                  detail::mpi_datatype(dtype), src, p.tag, comm),
                fmt::format("{} data", name(dtype)));
  }
  step.wait();
  return result_of(layout, streams, {}, what);
}

}  // namespace td
