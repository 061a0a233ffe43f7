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

namespace td {

namespace {

using detail::CollectiveCall;
using detail::CollectiveKind;
using detail::DictLayout;
using Clock = std::chrono::steady_clock;

// A sender's size record: [0] bytes of its encoded layout, [1 + k] bytes of its dtype-k stream.
constexpr int kSizeWords = 1 + static_cast<int>(kNumDTypes);
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

// Everything MPI reads or writes during a call (leaked, not freed, when a wait times out).
struct Hold {
  std::vector<Tensor> tensors;
  std::deque<std::vector<std::byte>> bytes;  // a deque: references stay valid as it grows
  std::deque<std::vector<int>> ints;
  std::vector<std::uint64_t> words;
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
  if (opts.bucket_bytes && *opts.bucket_bytes == 0)
    return "bucket_bytes must be positive (or td::kAutoBucketBytes)";
  return {};
}

struct Agreed {
  std::shared_ptr<detail::GroupState> group;
  Clock::time_point deadline;
};

// Step 1: the call (name, root), the options and every rank's local error, agreed on no leaves.
Agreed agree_call(CollectiveKind kind, int root, std::string_view what,
                  const CollectiveOptions& opts, std::string err) {
  auto prepared = detail::prepare_collective(
      {}, CollectiveCall{kind, ReduceOp::SUM, root, what, /*from_dict=*/false}, opts,
      std::move(err));
  return {std::move(prepared.group), prepared.deadline};
}

void wait_all(std::vector<MPI_Request>& reqs, Clock::time_point deadline,
              const std::function<std::string()>& describe, const std::shared_ptr<Hold>& hold) {
  for (auto& r : reqs) detail::wait_until(r, deadline, describe, hold);
  reqs.clear();
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
  std::vector<MPI_Request> reqs(1, MPI_REQUEST_NULL);
  TD_MPI_CHECK(MPI_Iallreduce(MPI_IN_PLACE, hold->words.data(), 1, MPI_UINT64_T, MPI_MAX, g.comm,
                              reqs.data()));
  wait_all(reqs, deadline, describe, hold);
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
  reqs.assign(1, MPI_REQUEST_NULL);
  TD_MPI_CHECK(MPI_Ibcast(hold->words.data(), 1, MPI_UINT64_T, rejecting, g.comm, reqs.data()));
  wait_all(reqs, deadline, describe, hold);
  text.resize(hold->words[0]);
  reqs.assign(1, MPI_REQUEST_NULL);
  TD_MPI_CHECK(MPI_Ibcast(text.data(), detail::mpi_count(text.size(), what), MPI_BYTE, rejecting,
                          g.comm, reqs.data()));
  wait_all(reqs, deadline, describe, hold);
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
struct VCounts {
  std::vector<int> counts, displs;
  int total = 0;
};
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
  const bool receives = all || g->rank == dst;
  const MPI_Comm comm = g->comm;
  auto hold = std::make_shared<Hold>();
  const std::function<std::string()> describe = [&] {
    return fmt::format("{} in a group of {} ranks", what, g->size);
  };

  // Sizes: every rank needs every record (to know which per-dtype calls follow).
  hold->words.resize(size * kSizeWords);
  std::vector<MPI_Request> reqs(1, MPI_REQUEST_NULL);
  TD_MPI_CHECK(MPI_Iallgather(out->sizes.data(), kSizeWords, MPI_UINT64_T, hold->words.data(),
                              kSizeWords, MPI_UINT64_T, comm, reqs.data()));
  wait_all(reqs, deadline, describe, hold);
  std::vector<Sizes> table(size);
  for (std::size_t r = 0; r < size; ++r) {
    std::copy_n(hold->words.begin() + static_cast<std::ptrdiff_t>(r * kSizeWords), kSizeWords,
                table[r].begin());
    check_sizes(table[r], static_cast<int>(r), what);
  }

  // Metadata.
  const VCounts mc = v_counts(table, 0, 1, what);
  auto& meta_all = hold->bytes.emplace_back(receives ? static_cast<std::size_t>(mc.total) : 0);
  reqs.assign(1, MPI_REQUEST_NULL);
  const int my_meta = mc.counts[static_cast<std::size_t>(g->rank)];
  if (all) {
    TD_MPI_CHECK(MPI_Iallgatherv(out->meta.data(), my_meta, MPI_BYTE, meta_all.data(),
                                 mc.counts.data(), mc.displs.data(), MPI_BYTE, comm, reqs.data()));
  } else {
    TD_MPI_CHECK(MPI_Igatherv(out->meta.data(), my_meta, MPI_BYTE, meta_all.data(),
                              mc.counts.data(), mc.displs.data(), MPI_BYTE, dst, comm,
                              reqs.data()));
  }
  wait_all(reqs, deadline, describe, hold);
  std::vector<DictLayout> layouts;
  std::exception_ptr failed;
  if (receives) {
    try {
      for (std::size_t r = 0; r < size; ++r)
        layouts.push_back(
            decode_checked(std::span(meta_all).subspan(static_cast<std::size_t>(mc.displs[r]),
                                                       static_cast<std::size_t>(mc.counts[r])),
                           table[r], static_cast<int>(r), what));
    } catch (...) {
      failed = std::current_exception();
    }
  }
  // all_gather: every rank decoded the same bytes, so every rank reached the same verdict.
  if (all && failed) std::rethrow_exception(failed);
  if (!all) agree_status(*g, failed, deadline, what);

  // Data: one exact-size v-collective per dtype that some rank sends.
  std::array<Tensor, kNumDTypes> big;
  std::vector<VCounts> per_dtype(kNumDTypes);
  for (const std::size_t k : dtypes_in(table)) {
    const DType dtype = dtype_at(k);
    VCounts& v = per_dtype[k] = v_counts(table, 1 + k, itemsize(dtype), what);
    std::byte* recv = nullptr;
    if (receives) {
      big[k] = Tensor::empty({v.total}, dtype);
      recv = static_cast<std::byte*>(big[k].raw_data());
    }
    const int mine = v.counts[static_cast<std::size_t>(g->rank)];
    std::byte* send = mine > 0 ? stream_data(*out, k, *hold) : recv;
    hold->tensors.push_back(big[k]);
    const MPI_Datatype type = detail::mpi_datatype(dtype);
    reqs.push_back(MPI_REQUEST_NULL);
    if (all) {
      TD_MPI_CHECK(MPI_Iallgatherv(send, mine, type, recv, v.counts.data(), v.displs.data(), type,
                                   comm, &reqs.back()));
    } else {
      TD_MPI_CHECK(MPI_Igatherv(send, mine, type, recv, v.counts.data(), v.displs.data(), type, dst,
                                comm, &reqs.back()));
    }
  }
  wait_all(reqs, deadline, describe, hold);
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

// Tags above the blocks TensorDict::send/recv use (point_to_point.cpp takes blocks of 1024 tags
// below floor(tag_ub / 1024) * 1024): the remaining top tags are ours, one per user tag modulo
// their number.
int transport_tag(MPI_Comm comm, int user_tag) {
  int* ub = nullptr;
  int flag = 0;
  MPI_Comm_get_attr(comm, MPI_TAG_UB, static_cast<void*>(&ub), &flag);
  const long long tag_ub = flag && ub ? *ub : 32767;
  const long long base = tag_ub / 1024 * 1024;
  return static_cast<int>(base + user_tag % (tag_ub - base + 1));
}

struct Peer {
  std::shared_ptr<detail::GroupState> g;
  Clock::time_point deadline;
  int tag = 0;
};

// Local checks of a point-to-point call; a peer out of range (no one to tell) throws at once,
// the others are returned to be sent to the peer first.
Peer peer_of(int peer, std::string_view what, std::string_view role, const CollectiveOptions& opts,
             std::string& err) {
  Peer p{detail::group_of(opts), {}, 0};
  p.g->checked_comm(what);
  if (peer < 0 || peer >= p.g->size)
    throw std::invalid_argument(fmt::format("{}: {} {} is out of range for a group of {} ranks",
                                            what, role, peer, p.g->size));
  if (peer == p.g->rank)
    throw std::invalid_argument(fmt::format("{}: {} {} is this rank", what, role, peer));
  const auto timeout = detail::timeout_of(opts);
  if (timeout.count() <= 0 && err.empty())
    err = fmt::format("timeout must be positive (got {} ms)", timeout.count());
  p.deadline = detail::deadline_after(timeout.count() > 0 ? timeout : detail::timeout_of({}));
  const int user_tag = opts.tag.value_or(0);
  if ((user_tag < 0 || user_tag >= kMaxUserTag) && err.empty())
    err = fmt::format("tag {} is out of range [0, {})", user_tag, kMaxUserTag);
  p.tag = transport_tag(p.g->comm, std::clamp(user_tag, 0, kMaxUserTag - 1));
  if (err.empty()) err = option_error(opts);
  return p;
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

  // The size record, then the segment mask (which streams go one message per leaf).
  hold->words.assign(kSizeWords + 1, 0);
  if (is_src) {
    std::copy(out->sizes.begin(), out->sizes.end(), hold->words.begin());
    hold->words[kSizeWords] = segment_mask(*out);
  }
  std::vector<MPI_Request> reqs(1, MPI_REQUEST_NULL);
  TD_MPI_CHECK(
      MPI_Ibcast(hold->words.data(), kSizeWords + 1, MPI_UINT64_T, src, comm, reqs.data()));
  wait_all(reqs, deadline, describe, hold);
  Sizes sizes{};
  std::copy_n(hold->words.begin(), kSizeWords, sizes.begin());
  const std::uint64_t per_segment = hold->words[kSizeWords];
  check_sizes(sizes, src, what);
  check_mask(per_segment, src, what);

  auto& meta = hold->bytes.emplace_back(is_src ? out->meta : std::vector<std::byte>(sizes[0]));
  reqs.assign(1, MPI_REQUEST_NULL);
  TD_MPI_CHECK(
      MPI_Ibcast(meta.data(), detail::mpi_count(sizes[0], what), MPI_BYTE, src, comm, reqs.data()));
  wait_all(reqs, deadline, describe, hold);
  DictLayout layout;
  std::exception_ptr failed;
  if (!is_src) {
    try {
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
    const MPI_Datatype type = detail::mpi_datatype(dtype);
    auto post = [&](std::byte* p, std::uint64_t nbytes) {
      detail::for_each_message(nbytes, dtype, SIZE_MAX, [&](std::size_t off, int count) {
        reqs.push_back(MPI_REQUEST_NULL);
        TD_MPI_CHECK(MPI_Ibcast(p + off, count, type, src, comm, &reqs.back()));
      });
    };
    if (is_src) {
      post_stream_out(*out, k, per_segment, *hold, post);
      continue;
    }
    streams[k] = Tensor::empty({static_cast<std::int64_t>(sizes[1 + k] / itemsize(dtype))}, dtype);
    hold->tensors.push_back(streams[k]);
    post_stream_in(layout, k, sizes[1 + k], per_segment,
                   static_cast<std::byte*>(streams[k].raw_data()), post);
  }
  wait_all(reqs, deadline, describe, hold);
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

  // Every rank needs every record: the data calls are per dtype that any part holds.
  hold->words.assign(size * kSizeWords, 0);
  if (is_src) {
    for (std::size_t r = 0; r < size; ++r)
      std::copy(outs[r].sizes.begin(), outs[r].sizes.end(),
                hold->words.begin() + static_cast<std::ptrdiff_t>(r * kSizeWords));
  }
  std::vector<MPI_Request> reqs(1, MPI_REQUEST_NULL);
  TD_MPI_CHECK(MPI_Ibcast(hold->words.data(), detail::mpi_count(hold->words.size(), what),
                          MPI_UINT64_T, src, comm, reqs.data()));
  wait_all(reqs, deadline, describe, hold);
  std::vector<Sizes> table(size);
  for (std::size_t r = 0; r < size; ++r) {
    std::copy_n(hold->words.begin() + static_cast<std::ptrdiff_t>(r * kSizeWords), kSizeWords,
                table[r].begin());
    check_sizes(table[r], src, what);
  }

  const VCounts mc = v_counts(table, 0, 1, what);
  auto& meta_all = hold->bytes.emplace_back(is_src ? static_cast<std::size_t>(mc.total) : 0);
  if (is_src) {
    for (std::size_t r = 0; r < size; ++r)
      std::copy(outs[r].meta.begin(), outs[r].meta.end(),
                meta_all.begin() + static_cast<std::ptrdiff_t>(mc.displs[r]));
  }
  auto& meta = hold->bytes.emplace_back(static_cast<std::size_t>(mc.counts[me]));
  reqs.assign(1, MPI_REQUEST_NULL);
  TD_MPI_CHECK(MPI_Iscatterv(meta_all.data(), mc.counts.data(), mc.displs.data(), MPI_BYTE,
                             meta.data(), mc.counts[me], MPI_BYTE, src, comm, reqs.data()));
  wait_all(reqs, deadline, describe, hold);
  DictLayout layout;
  std::exception_ptr failed;
  try {
    layout = decode_checked(meta, table[me], src, what);
  } catch (...) {
    failed = std::current_exception();
  }
  agree_status(*g, failed, deadline, what);

  std::array<Tensor, kNumDTypes> streams;
  for (const std::size_t k : dtypes_in(table)) {
    const DType dtype = dtype_at(k);
    const VCounts v = v_counts(table, 1 + k, itemsize(dtype), what);
    std::byte* send = nullptr;
    if (is_src) {
      Tensor all = Tensor::empty({v.total}, dtype);
      for (std::size_t r = 0; r < size; ++r) {
        if (v.counts[r] == 0) continue;
        Tensor part = all.slice(0, v.displs[r], v.displs[r] + v.counts[r]);
        detail::pack_stream(outs[r].layout, outs[r].tensors, dtype, part);
      }
      hold->tensors.push_back(all);
      send = static_cast<std::byte*>(all.raw_data());
    }
    std::byte* recv = send;
    if (v.counts[me] > 0) {
      streams[k] = Tensor::empty({v.counts[me]}, dtype);
      hold->tensors.push_back(streams[k]);
      recv = static_cast<std::byte*>(streams[k].raw_data());
    }
    hold->ints.push_back(v.counts);
    const int* counts = hold->ints.back().data();
    hold->ints.push_back(v.displs);
    const int* displs = hold->ints.back().data();
    const MPI_Datatype type = detail::mpi_datatype(dtype);
    reqs.push_back(MPI_REQUEST_NULL);
    TD_MPI_CHECK(MPI_Iscatterv(send, counts, displs, type, recv, v.counts[me], type, src, comm,
                               &reqs.back()));
  }
  wait_all(reqs, deadline, describe, hold);
  return result_of(layout, streams, {}, what);
}

void send_dict(const TensorDict& value, int dst, const CollectiveOptions& opts) {
  constexpr std::string_view what = "td.send_dict";
  std::string err;
  const Peer p = peer_of(dst, what, "dst", opts, err);
  std::optional<Outgoing> out;
  if (err.empty()) out = try_outgoing(value, "value", err);
  auto hold = std::make_shared<Hold>();
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
  std::vector<MPI_Request> reqs(2, MPI_REQUEST_NULL);
  TD_MPI_CHECK(
      MPI_Isend(hold->words.data(), kHeaderWords, MPI_UINT64_T, dst, p.tag, comm, &reqs[0]));
  TD_MPI_CHECK(MPI_Isend(body.data(), detail::mpi_count(body.size(), what), MPI_BYTE, dst, p.tag,
                         comm, &reqs[1]));
  wait_all(reqs, p.deadline, describe, hold);
  if (!err.empty()) throw std::invalid_argument(fmt::format("{}: {}", what, err));

  // The receiver's verdict: nothing more is sent unless it accepted the metadata.
  auto& ack = hold->bytes.emplace_back(kAckBytes);
  reqs.assign(1, MPI_REQUEST_NULL);
  TD_MPI_CHECK(MPI_Irecv(ack.data(), kAckBytes, MPI_BYTE, dst, p.tag, comm, reqs.data()));
  wait_all(reqs, p.deadline, describe, hold);
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
        reqs.push_back(MPI_REQUEST_NULL);
        TD_MPI_CHECK(MPI_Isend(data + off, count, type, dst, p.tag, comm, &reqs.back()));
      });
    });
  }
  wait_all(reqs, p.deadline, describe, hold);
}

TensorDict recv_dict(int src, const CollectiveOptions& opts) {
  constexpr std::string_view what = "td.recv_dict";
  std::string err;
  const Peer p = peer_of(src, what, "src", opts, err);
  auto hold = std::make_shared<Hold>();
  const std::function<std::string()> describe = [&] {
    return fmt::format("{} from rank {} in a group of {} ranks", what, src, p.g->size);
  };
  const MPI_Comm comm = p.g->comm;

  hold->words.assign(kHeaderWords, 0);
  std::vector<MPI_Request> reqs(1, MPI_REQUEST_NULL);
  TD_MPI_CHECK(
      MPI_Irecv(hold->words.data(), kHeaderWords, MPI_UINT64_T, src, p.tag, comm, reqs.data()));
  wait_all(reqs, p.deadline, describe, hold);
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
  reqs.assign(1, MPI_REQUEST_NULL);
  TD_MPI_CHECK(MPI_Irecv(body.data(), detail::mpi_count(body_len, what), MPI_BYTE, src, p.tag, comm,
                         reqs.data()));
  wait_all(reqs, p.deadline, describe, hold);
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
  reqs.assign(1, MPI_REQUEST_NULL);
  TD_MPI_CHECK(MPI_Isend(ack.data(), kAckBytes, MPI_BYTE, src, p.tag, comm, reqs.data()));
  wait_all(reqs, p.deadline, describe, hold);
  if (verdict == kBadArgument) throw std::invalid_argument(fmt::format("{}: {}", what, err));
  if (verdict != kOk) throw Error(why);

  std::array<Tensor, kNumDTypes> streams;
  for (std::size_t k = 0; k < kNumDTypes; ++k) {
    if (sizes[1 + k] == 0) continue;
    const DType dtype = dtype_at(k);
    streams[k] = Tensor::empty({static_cast<std::int64_t>(sizes[1 + k] / itemsize(dtype))}, dtype);
    hold->tensors.push_back(streams[k]);
    auto* data = static_cast<std::byte*>(streams[k].raw_data());
    const MPI_Datatype type = detail::mpi_datatype(dtype);
    post_stream_in(layout, k, sizes[1 + k], per_segment, data,
                   [&](std::byte* at, std::uint64_t nbytes) {
                     detail::for_each_message(nbytes, dtype, SIZE_MAX, [&](std::size_t off, int n) {
                       reqs.push_back(MPI_REQUEST_NULL);
                       TD_MPI_CHECK(MPI_Irecv(at + off, n, type, src, p.tag, comm, &reqs.back()));
                     });
                   });
  }
  wait_all(reqs, p.deadline, describe, hold);
  return result_of(layout, streams, {}, what);
}

}  // namespace td
