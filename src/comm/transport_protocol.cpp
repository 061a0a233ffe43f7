// The wire protocol of transport without a prior layout: see transport_protocol.hpp.
#include "comm/transport_protocol.hpp"

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <utility>

#include <fmt/format.h>

#include "runtime/deadline.hpp"
#include "runtime/mpi_types.hpp"

namespace td::detail {

namespace {

using Clock = std::chrono::steady_clock;

OutgoingDict outgoing_dict(const TensorDict& d) {
  OutgoingDict o;
  o.layout = describe_dict(d, o.tensors);
  o.meta = encode_layout(o.layout);
  o.sizes[0] = o.meta.size();
  const auto bytes = o.layout.stream_bytes();
  std::copy(bytes.begin(), bytes.end(), o.sizes.begin() + 1);
  return o;
}

// Stream `dtype` of `o` as one contiguous buffer: the leaves' own storage when they lie back to
// back, else packed into a buffer `hold` owns.
std::byte* stream_data(const OutgoingDict& o, std::size_t k, TransportHold& hold) {
  const DType dtype = stream_dtype(k);
  if (const std::byte* p = stream_in_place(o.layout, o.tensors, dtype))
    return const_cast<std::byte*>(
        p);  // NOLINT(cppcoreguidelines-pro-type-const-cast): MPI's send buffers are not const
  Tensor buf = Tensor::empty({static_cast<std::int64_t>(o.layout.stream_elems[k])}, dtype);
  pack_stream(o.layout, o.tensors, dtype, buf);
  hold.tensors.push_back(buf);
  return static_cast<std::byte*>(buf.raw_data());
}

// A sender that is not consolidated sends each leaf from its own memory (no pack copy) when
// its leaves average at least this many bytes; smaller leaves are packed into one message.
constexpr std::uint64_t kSegmentBytes = std::uint64_t{64} << 10;

// Where segment `seg` of a sender's stream is: the leaf's (or its sparse part's) own memory,
// made contiguous into `hold` if it is not.
std::byte* segment_data(const OutgoingDict& o, const StreamSegment& seg, TransportHold& hold) {
  const Tensor& leaf = o.tensors[seg.leaf];
  Tensor t = seg.part == 0 ? leaf : seg.part == 1 ? leaf.values() : leaf.indices();
  if (!t.is_contiguous()) t = t.contiguous();
  hold.tensors.push_back(t);
  return static_cast<std::byte*>(t.raw_data());
}

// Cuts (data, nbytes) of dtype k into the messages MPI takes (INT_MAX elements at most).
void cut_messages(std::byte* data, std::uint64_t nbytes, std::size_t k, Regions& out) {
  for_each_message(nbytes, stream_dtype(k), SIZE_MAX, [&](std::size_t off, int count) {
    out.emplace_back(data + off, static_cast<std::size_t>(count) * itemsize(stream_dtype(k)));
  });
}

// The guard a sender announces for its metadata and data messages.
std::uint64_t guard_of(const std::vector<std::byte>& meta, const StreamMessages& data) {
  std::vector<std::span<const std::byte>> all;
  all.emplace_back(meta.data(), meta.size());
  for (const auto& msgs : data)
    for (const Region& r : msgs) all.emplace_back(r.data(), r.size());
  return TailGuard::choose(all).word();
}

// A receiver's check of regions a collective filled from rank `rank`: the first one that still
// ends with the sender's canary is a short message.
void check_filled(const TailGuard& guard, std::span<const Region> regions, int rank,
                  std::uint64_t announced, std::string_view what, std::string_view phase) {
  for (const Region& r : regions)
    if (guard.short_message(r))
      throw Error(fmt::format(
          "{}: rank {} sent less {} than the {} bytes it announced (a short message: the end of "
          "a {}-byte receive was never written); the transfer is rejected",
          what, rank, phase, announced, r.size()));
}

// What a receive of stream k is called in errors ("float32 data").
std::string data_phase(std::size_t k) { return fmt::format("{} data", name(stream_dtype(k))); }

// A segment mask from a peer: bits of dtypes only.
void check_segment_mask(std::uint64_t mask, int rank, std::string_view what) {
  if (mask >> kNumDTypes != 0)
    throw Error(
        fmt::format("{}: rank {} sent an invalid header (segment mask {:#x})", what, rank, mask));
}

// Decodes rank `rank`'s metadata and checks it against its size record.
DictLayout decode_checked(std::span<const std::byte> bytes, const SizeRecord& s, int rank,
                          std::string_view what) {
  DictLayout layout;
  try {
    layout = decode_layout(bytes);
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
          what, rank, bytes_per_dtype[k], name(stream_dtype(k)), s[1 + k]));
  }
  return layout;
}

// A fresh receive storage of `elems` elements for stream k, held by `hold`.
Tensor new_stream(std::size_t k, std::int64_t elems, TransportHold& hold) {
  Tensor t = Tensor::empty({elems}, stream_dtype(k));
  hold.tensors.push_back(t);
  return t;
}

// The first byte of `t`'s elements, writable (a handle shares its storage: MPI's buffers are not
// const).
std::byte* bytes_of(const Tensor& t) {
  Tensor handle = t;
  return static_cast<std::byte*>(handle.raw_data());
}

// Element counts and displacements of a v-collective over dtype k, from every rank's record.
VCounts v_counts(const std::vector<SizeRecord>& table, std::size_t word, std::size_t isz,
                 std::string_view what) {
  VCounts v;
  std::size_t total = 0;
  for (const SizeRecord& s : table) {
    v.displs.push_back(mpi_count(total, what));
    v.counts.push_back(mpi_count(s[word] / isz, what));
    total += s[word] / isz;
  }
  v.total = mpi_count(total, what);
  return v;
}

// The records of `words` (one per rank, checked): each announced by its own rank, or all by
// `sender`.
std::vector<SizeRecord> checked_size_table(std::span<const std::uint64_t> words,
                                           std::optional<int> sender, std::string_view what) {
  std::vector<SizeRecord> table(words.size() / kSizeWords);
  for (std::size_t r = 0; r < table.size(); ++r) {
    std::copy_n(words.begin() + static_cast<std::ptrdiff_t>(r * kSizeWords), kSizeWords,
                table[r].begin());
    check_size_record(table[r], sender.value_or(static_cast<int>(r)), what);
  }
  return table;
}

// The region of rank r's part of a receive buffer of v-collective `v`.
Region part_of(std::byte* base, const VCounts& v, std::size_t r, std::size_t isz) {
  return {base + static_cast<std::size_t>(v.displs[r]) * isz,
          static_cast<std::size_t>(v.counts[r]) * isz};
}

// Arms every rank's part of a receive buffer with that rank's guard.
void arm_parts(const std::vector<SizeRecord>& table, std::byte* base, const VCounts& v,
               std::size_t isz) {
  for (std::size_t r = 0; r < table.size(); ++r)
    TailGuard(table[r][kGuardWord]).arm(part_of(base, v, r, isz));
}

// Checks every rank's part of a filled receive buffer against that rank's guard.
void check_parts(const std::vector<SizeRecord>& table, std::byte* base, const VCounts& v,
                 std::size_t word, std::size_t isz, std::string_view what, std::string_view phase) {
  for (std::size_t r = 0; r < table.size(); ++r)
    check_filled(TailGuard(table[r][kGuardWord]), std::array{part_of(base, v, r, isz)},
                 static_cast<int>(r), table[r][word], what, phase);
}

// ---- the header of send_dict ------------------------------------------------------------------

// The header of a send_dict: [0] 0 = ok, else the kind of the sender's error; [1] the length of
// its text, which follows instead of the metadata; [2] the dtypes sent as one message per
// segment (bit k, see stream_segments) rather than as one stream; [3..] the size record.
constexpr int kHeaderWords = 3 + kSizeWords;
constexpr std::size_t kFirstSizeWord = 3;
constexpr std::uint64_t kOk = 0, kBadArgument = 1, kFailed = 2;
// The receiver's answer: [0] one of the above, then its error text (NUL-terminated).
constexpr int kAckBytes = 512;

[[noreturn]] void throw_kind(std::uint64_t kind, const std::string& msg) {
  if (kind == kBadArgument) throw std::invalid_argument(msg);
  throw Error(msg);
}

}  // namespace

// ---- what a sender announces and sends -----------------------------------------------------

std::optional<OutgoingDict> try_outgoing_dict(const TensorDict& d, std::string_view which,
                                              std::string& err) {
  try {
    return outgoing_dict(d);
  } catch (const std::exception& e) {
    if (err.empty()) err = fmt::format("{}: {}", which, e.what());
    return std::nullopt;
  }
}

std::uint64_t segment_mask(const OutgoingDict& o) {
  std::uint64_t mask = 0;
  for (std::size_t k = 0; k < kNumDTypes; ++k) {
    if (o.sizes[1 + k] == 0 || stream_in_place(o.layout, o.tensors, stream_dtype(k)) != nullptr)
      continue;
    const auto segments = stream_segments(o.layout, stream_dtype(k)).size();
    if (o.sizes[1 + k] >= kSegmentBytes * segments) mask |= std::uint64_t{1} << k;
  }
  return mask;
}

StreamMessages messages_out(const OutgoingDict& o, std::uint64_t mask, TransportHold& hold) {
  StreamMessages out;
  for (std::size_t k = 0; k < kNumDTypes; ++k) {
    if (o.sizes[1 + k] == 0) continue;
    if ((mask >> k & 1U) == 0) {
      cut_messages(stream_data(o, k, hold), o.sizes[1 + k], k, out[k]);
      continue;
    }
    const std::size_t isz = itemsize(stream_dtype(k));
    for (const auto& seg : stream_segments(o.layout, stream_dtype(k)))
      cut_messages(segment_data(o, seg, hold), seg.count * isz, k, out[k]);
  }
  return out;
}

StreamMessages whole_streams(const OutgoingDict& o, TransportHold& hold) {
  StreamMessages out;
  for (std::size_t k = 0; k < kNumDTypes; ++k)
    if (o.sizes[1 + k] > 0) out[k].emplace_back(stream_data(o, k, hold), o.sizes[1 + k]);
  return out;
}

void guard_record(OutgoingDict& o, const StreamMessages& data) {
  o.sizes[kGuardWord] = guard_of(o.meta, data);
}

int elements_in(const Region& r, std::size_t k) {
  return static_cast<int>(r.size() / itemsize(stream_dtype(k)));
}

// ---- what a receiver checks ----------------------------------------------------------------

void check_size_record(const SizeRecord& s, int rank, std::string_view what) {
  if (s[0] < kWireMagic.size() || s[0] > kWireMaxMetadataBytes)
    throw Error(
        fmt::format("{}: rank {} announced {} bytes of metadata (corrupted or not a "
                    "transport peer); no data was sent",
                    what, rank, s[0]));
  for (std::size_t k = 0; k < kNumDTypes; ++k) {
    if (s[1 + k] % itemsize(stream_dtype(k)) != 0 || s[1 + k] > kWireMaxStreamBytes)
      throw Error(fmt::format("{}: rank {} announced {} bytes of {} data; no data was sent", what,
                              rank, s[1 + k], name(stream_dtype(k))));
  }
}

DictLayout receive_layout(const TailGuard& guard, Region meta, const SizeRecord& sizes, int rank,
                          std::string_view what) {
  check_filled(guard, std::array{meta}, rank, sizes[0], what, "metadata");
  return decode_checked(meta, sizes, rank, what);
}

void check_streams_filled(const TailGuard& guard, const StreamMessages& filled, int rank,
                          const SizeRecord& sizes, std::string_view what) {
  for (std::size_t k = 0; k < kNumDTypes; ++k)
    if (!filled[k].empty()) check_filled(guard, filled[k], rank, sizes[1 + k], what, data_phase(k));
}

StreamMessages receive_streams(const DictLayout& layout, const SizeRecord& sizes,
                               std::uint64_t mask, TransportHold& hold,
                               std::array<Tensor, kNumDTypes>& streams) {
  StreamMessages in;
  for (std::size_t k = 0; k < kNumDTypes; ++k) {
    if (sizes[1 + k] == 0) continue;
    const std::size_t isz = itemsize(stream_dtype(k));
    streams[k] = new_stream(k, static_cast<std::int64_t>(sizes[1 + k] / isz), hold);
    std::byte* data = bytes_of(streams[k]);
    if ((mask >> k & 1U) == 0) {
      cut_messages(data, sizes[1 + k], k, in[k]);
      continue;
    }
    for (const auto& seg : stream_segments(layout, stream_dtype(k)))
      cut_messages(data + seg.offset * isz, seg.count * isz, k, in[k]);
  }
  return in;
}

TensorDict received_dict(const DictLayout& layout, const std::array<Tensor, kNumDTypes>& all,
                         const std::array<std::int64_t, kNumDTypes>& first, std::string_view what) {
  std::array<Tensor, kNumDTypes> streams;
  for (std::size_t k = 0; k < kNumDTypes; ++k) {
    const auto n = static_cast<std::int64_t>(layout.stream_elems[k]);
    if (n > 0) streams[k] = all[k].slice(0, first[k], first[k] + n);
  }
  try {
    return materialize(layout, streams);
  } catch (const Error& e) {
    throw Error(fmt::format("{}: {}", what, e.what()));
  }
}

// ---- agreement --------------------------------------------------------------------------------

std::string transport_option_error(const CollectiveOptions& opts) {
  if (opts.async_op)
    return "async_op is not supported by transport without a prior layout (the receivers' dicts "
           "exist only once the data arrived); call it from a thread of your own instead";
  return bucket_bytes_problem(opts.bucket_bytes);
}

AgreedTransport agree_transport_call(CollectiveKind kind, int root, std::string_view what,
                                     const CollectiveOptions& opts, std::string err) {
  auto prepared =
      prepare_collective({}, CollectiveCall{kind, ReduceOp::SUM, root, what, /*from_dict=*/false},
                         opts, std::move(err));
  return {std::move(prepared.group), prepared.deadline, std::move(prepared.scope)};
}

void agree_status(const GroupState& g, const std::exception_ptr& local, Clock::time_point deadline,
                  std::string_view what) {
  auto hold = std::make_shared<TransportHold>();
  hold->words.assign(1, local ? static_cast<std::uint64_t>(g.rank) + 1 : 0);
  const std::function<std::string()> describe = [&] {
    return fmt::format("{}: the metadata check of a group of {} did not complete", what, g.size);
  };
  Step step(deadline, describe, hold, what);
  step.post(allreduce_call(MPI_IN_PLACE, hold->words.data(), 1, MPI_UINT64_T, MPI_MAX, g.comm));
  step.wait();
  if (hold->words[0] == 0) return;
  const int rejecting = static_cast<int>(hold->words[0] - 1);
  auto& text = hold->bytes.emplace_back();
  if (g.rank == rejecting) {
    try {
      std::rethrow_exception(local);
    } catch (const std::exception& e) {
      const std::string_view msg = e.what();
      text.resize(std::min<std::size_t>(msg.size(), kWireMaxMetadataBytes));
      std::memcpy(text.data(), msg.data(), text.size());
    }
  }
  hold->words.assign(1, text.size());
  step.post(bcast_call(hold->words.data(), 1, MPI_UINT64_T, rejecting, g.comm));
  step.wait();
  text.resize(hold->words[0]);
  step.post(bcast_call(text.data(), mpi_count(text.size(), what), MPI_BYTE, rejecting, g.comm));
  step.wait();
  if (g.rank == rejecting) std::rethrow_exception(local);
  throw Error(std::string(reinterpret_cast<const char*>(text.data()), text.size()));
}

TransportCall::TransportCall(const GroupState& group, Clock::time_point call_deadline,
                             std::string_view call_name, std::function<std::string()> describe_call)
    : g(group),
      deadline(call_deadline),
      what(call_name),
      describe(std::move(describe_call)),
      hold(std::make_shared<TransportHold>()),
      step(deadline, describe, hold, what) {}

// ---- broadcast_dict ---------------------------------------------------------------------------

StreamHeader broadcast_header(TransportCall& t, const OutgoingDict* out, std::uint64_t mask,
                              int src) {
  auto& words = t.hold->words;
  words.assign(kSizeWords + 1, 0);
  if (out) {
    std::copy(out->sizes.begin(), out->sizes.end(), words.begin());
    words[kSizeWords] = mask;
  }
  t.step.post(bcast_call(words.data(), kSizeWords + 1, MPI_UINT64_T, src, t.g.comm));
  t.step.wait();
  StreamHeader head;
  std::copy_n(words.begin(), kSizeWords, head.sizes.begin());
  head.mask = words[kSizeWords];
  check_size_record(head.sizes, src, t.what);
  check_segment_mask(head.mask, src, t.what);
  head.guard = TailGuard(head.sizes[kGuardWord]);
  return head;
}

Region broadcast_metadata(TransportCall& t, const OutgoingDict* out, const StreamHeader& head,
                          int src) {
  auto& meta = t.hold->bytes.emplace_back(out ? out->meta : std::vector<std::byte>(head.sizes[0]));
  if (!out) head.guard.arm(meta);
  t.step.post(bcast_call(meta.data(), mpi_count(head.sizes[0], t.what), MPI_BYTE, src, t.g.comm));
  t.step.wait();
  return meta;
}

void broadcast_streams(TransportCall& t, const StreamMessages& msgs, const StreamHeader& head,
                       bool arm, int src) {
  for (std::size_t k = 0; k < kNumDTypes; ++k) {
    if (msgs[k].empty()) continue;
    const MPI_Datatype type = mpi_datatype(stream_dtype(k));
    for (const Region& r : msgs[k]) {
      if (arm) head.guard.arm(r);
      t.step.post(bcast_call(r.data(), elements_in(r, k), type, src, t.g.comm));
    }
  }
  t.step.wait();
}

// ---- scatter_dicts ----------------------------------------------------------------------------

std::array<Tensor, kNumDTypes> pack_parts(std::vector<OutgoingDict>& parts, TransportHold& hold) {
  std::array<Tensor, kNumDTypes> packed;
  std::vector<StreamMessages> part_msgs(parts.size());
  for (std::size_t k = 0; k < kNumDTypes; ++k) {
    const DType dtype = stream_dtype(k);
    const std::size_t isz = itemsize(dtype);
    std::uint64_t total = 0;
    for (const OutgoingDict& o : parts) total += o.sizes[1 + k] / isz;
    if (total == 0) continue;
    packed[k] = new_stream(k, static_cast<std::int64_t>(total), hold);
    std::byte* base = bytes_of(packed[k]);
    std::uint64_t first = 0;
    for (std::size_t r = 0; r < parts.size(); ++r) {
      const std::uint64_t n = parts[r].sizes[1 + k] / isz;
      if (n == 0) continue;
      Tensor part = packed[k].slice(0, static_cast<std::int64_t>(first),
                                    static_cast<std::int64_t>(first + n));
      pack_stream(parts[r].layout, parts[r].tensors, dtype, part);
      part_msgs[r][k].emplace_back(base + first * isz, n * isz);
      first += n;
    }
  }
  for (std::size_t r = 0; r < parts.size(); ++r) guard_record(parts[r], part_msgs[r]);
  return packed;
}

std::vector<SizeRecord> scatter_size_table(TransportCall& t, const std::vector<OutgoingDict>& parts,
                                           int src) {
  auto& words = t.hold->words;
  words.assign(static_cast<std::size_t>(t.g.size) * kSizeWords, 0);
  for (std::size_t r = 0; r < parts.size(); ++r)
    std::copy(parts[r].sizes.begin(), parts[r].sizes.end(),
              words.begin() + static_cast<std::ptrdiff_t>(r * kSizeWords));
  t.step.post(
      bcast_call(words.data(), mpi_count(words.size(), t.what), MPI_UINT64_T, src, t.g.comm));
  t.step.wait();
  return checked_size_table(words, src, t.what);
}

std::vector<std::size_t> count_messages(TransportHold& hold, const std::vector<SizeRecord>& table,
                                        std::string_view what) {
  std::vector<std::size_t> data_dtypes;
  for (std::size_t k = 0; k < kNumDTypes; ++k) {
    if (std::any_of(table.begin(), table.end(), [&](const SizeRecord& s) { return s[1 + k] != 0; }))
      data_dtypes.push_back(k);
  }
  hold.meta_counts = v_counts(table, 0, 1, what);
  hold.per_dtype.assign(kNumDTypes, {});
  for (const std::size_t k : data_dtypes)
    hold.per_dtype[k] = v_counts(table, 1 + k, itemsize(stream_dtype(k)), what);
  return data_dtypes;
}

Region scatter_metadata(TransportCall& t, const std::vector<OutgoingDict>& parts,
                        const TailGuard& guard, int src) {
  const VCounts& mc = t.hold->meta_counts;
  const auto me = static_cast<std::size_t>(t.g.rank);
  auto& meta_all =
      t.hold->bytes.emplace_back(parts.empty() ? 0 : static_cast<std::size_t>(mc.total));
  for (std::size_t r = 0; r < parts.size(); ++r)
    std::copy(parts[r].meta.begin(), parts[r].meta.end(),
              meta_all.begin() + static_cast<std::ptrdiff_t>(mc.displs[r]));
  auto& meta = t.hold->bytes.emplace_back(static_cast<std::size_t>(mc.counts[me]));
  guard.arm(meta);
  t.step.post(scatterv_call(meta_all.data(), mc.counts.data(), mc.displs.data(), MPI_BYTE,
                            meta.data(), mc.counts[me], MPI_BYTE, src, t.g.comm));
  t.step.wait();
  return meta;
}

StreamMessages scatter_streams(TransportCall& t, const std::array<Tensor, kNumDTypes>& packed,
                               const std::vector<std::size_t>& data_dtypes, const TailGuard& guard,
                               int src, std::array<Tensor, kNumDTypes>& streams) {
  const auto me = static_cast<std::size_t>(t.g.rank);
  StreamMessages filled;
  for (const std::size_t k : data_dtypes) {
    const VCounts& v = t.hold->per_dtype[k];
    std::byte* send = packed[k].defined() ? bytes_of(packed[k]) : nullptr;
    std::byte* recv = send;
    if (v.counts[me] > 0) {
      streams[k] = new_stream(k, v.counts[me], *t.hold);
      recv = bytes_of(streams[k]);
      filled[k].emplace_back(recv,
                             static_cast<std::size_t>(v.counts[me]) * itemsize(stream_dtype(k)));
      guard.arm(filled[k].back());
    }
    const MPI_Datatype type = mpi_datatype(stream_dtype(k));
    t.step.post(scatterv_call(send, v.counts.data(), v.displs.data(), type, recv, v.counts[me],
                              type, src, t.g.comm));
  }
  t.step.wait();
  return filled;
}

// ---- all_gather_dicts, gather_dicts ---------------------------------------------------------

std::vector<SizeRecord> allgather_size_table(TransportCall& t, const SizeRecord& mine) {
  auto& words = t.hold->words;
  words.resize(static_cast<std::size_t>(t.g.size) * kSizeWords);
  // MPI reads the record until the request completes: a copy in the hold, which outlives a
  // timeout, not the caller's.
  const SizeRecord& sent = t.hold->sent_sizes = mine;
  t.step.post(allgather_call(sent.data(), kSizeWords, MPI_UINT64_T, words.data(), kSizeWords,
                             MPI_UINT64_T, t.g.comm));
  t.step.wait();
  return checked_size_table(words, std::nullopt, t.what);
}

Region gather_metadata(TransportCall& t, std::optional<int> root,
                       const std::vector<SizeRecord>& table, const std::vector<std::byte>& mine,
                       bool receives) {
  const VCounts& mc = t.hold->meta_counts;
  auto& all = t.hold->bytes.emplace_back(receives ? static_cast<std::size_t>(mc.total) : 0);
  if (receives) arm_parts(table, all.data(), mc, 1);
  const int my_bytes = mc.counts[static_cast<std::size_t>(t.g.rank)];
  const auto& sent = t.hold->bytes.emplace_back(mine);  // read by MPI until done (see above)
  t.step.post(gatherv_to(root, sent.data(), my_bytes, MPI_BYTE, all.data(), mc.counts.data(),
                         mc.displs.data(), MPI_BYTE, t.g.comm));
  t.step.wait();
  return all;
}

std::vector<DictLayout> receive_layouts(const std::vector<SizeRecord>& table, Region all,
                                        const VCounts& counts, std::string_view what) {
  std::byte* base = all.data();
  check_parts(table, base, counts, 0, 1, what, "metadata");
  std::vector<DictLayout> layouts;
  for (std::size_t r = 0; r < table.size(); ++r)
    layouts.push_back(
        decode_checked(part_of(base, counts, r, 1), table[r], static_cast<int>(r), what));
  return layouts;
}

std::array<Tensor, kNumDTypes> gather_streams(TransportCall& t, std::optional<int> root,
                                              const std::vector<SizeRecord>& table,
                                              const StreamMessages& mine,
                                              const std::vector<std::size_t>& data_dtypes,
                                              bool receives) {
  const auto me = static_cast<std::size_t>(t.g.rank);
  std::array<Tensor, kNumDTypes> all;
  for (const std::size_t k : data_dtypes) {
    const VCounts& v = t.hold->per_dtype[k];
    std::byte* recv = nullptr;
    if (receives) {
      all[k] = new_stream(k, v.total, *t.hold);
      recv = bytes_of(all[k]);
      arm_parts(table, recv, v, itemsize(stream_dtype(k)));
    }
    std::byte* send = mine[k].empty() ? recv : mine[k][0].data();
    const MPI_Datatype type = mpi_datatype(stream_dtype(k));
    t.step.post(gatherv_to(root, send, v.counts[me], type, recv, v.counts.data(), v.displs.data(),
                           type, t.g.comm));
  }
  t.step.wait();
  return all;
}

void check_gathered_streams(const std::vector<SizeRecord>& table,
                            const std::array<Tensor, kNumDTypes>& all,
                            const std::vector<VCounts>& per_dtype,
                            const std::vector<std::size_t>& data_dtypes, std::string_view what) {
  for (const std::size_t k : data_dtypes)
    check_parts(table, bytes_of(all[k]), per_dtype[k], 1 + k, itemsize(stream_dtype(k)), what,
                data_phase(k));
}

std::vector<TensorDict> gathered_dicts(const std::vector<DictLayout>& layouts,
                                       const std::array<Tensor, kNumDTypes>& all,
                                       const std::vector<VCounts>& per_dtype,
                                       std::string_view what) {
  std::vector<TensorDict> result;
  for (std::size_t r = 0; r < layouts.size(); ++r) {
    std::array<std::int64_t, kNumDTypes> first{};
    for (std::size_t k = 0; k < kNumDTypes; ++k)
      if (!per_dtype[k].displs.empty()) first[k] = per_dtype[k].displs[r];
    result.push_back(received_dict(layouts[r], all, first, what));
  }
  return result;
}

// ---- send_dict, recv_dict ---------------------------------------------------------------------

TransportPeer transport_peer(int peer, std::string_view what, std::string_view role, bool sending,
                             const CollectiveOptions& opts, std::string& err) {
  TransportPeer p{group_of(opts), {}, 0};
  p.g->checked_comm(what);
  for (const std::string& problem :
       {rank_problem(role, peer, p.g->size), self_problem(role, peer, p.g->rank)})
    if (!problem.empty()) throw std::invalid_argument(fmt::format("{}: {}", what, problem));
  const auto timeout = timeout_of(opts);
  if (err.empty()) err = timeout_problem(timeout);
  p.deadline = deadline_after(timeout.count() > 0 ? timeout : timeout_of({}));
  const int user_tag = opts.tag.value_or(0);
  if (err.empty()) err = tag_problem(user_tag);
  p.tag = TagSpace::transport(p.g->rank, peer, sending, std::clamp(user_tag, 0, kMaxUserTag - 1));
  if (err.empty()) err = transport_option_error(opts);
  return p;
}

CallSummary peer_summary(int peer) {
  CallSummary s;
  s.root = peer;
  return s;
}

void send_header(TransportCall& t, const OutgoingDict* out, std::uint64_t mask,
                 const std::string& err, int dst, int tag) {
  auto& words = t.hold->words;
  words.assign(kHeaderWords, 0);
  std::vector<std::byte>& body = t.hold->bytes.emplace_back();
  if (!out) {
    words[0] = kBadArgument;
    words[1] = err.size();
    body.resize(err.size());
    std::memcpy(body.data(), err.data(), err.size());
  } else {
    words[2] = mask;
    std::copy(out->sizes.begin(), out->sizes.end(),
              words.begin() + static_cast<std::ptrdiff_t>(kFirstSizeWord));
    body = out->meta;
  }
  t.step.post(send_call(words.data(), kHeaderWords, MPI_UINT64_T, dst, tag, t.g.comm));
  t.step.post(send_call(body.data(), mpi_count(body.size(), t.what), MPI_BYTE, dst, tag, t.g.comm));
  t.step.wait();
}

void await_verdict(TransportCall& t, int dst, int tag) {
  auto& ack = t.hold->bytes.emplace_back(kAckBytes);
  t.step.post(recv_call(ack.data(), kAckBytes, MPI_BYTE, dst, tag, t.g.comm), "verdict");
  t.step.wait();
  const auto verdict = std::to_integer<std::uint64_t>(ack[0]);
  if (verdict == kOk) return;
  ack.back() = std::byte{0};
  throw_kind(verdict, fmt::format("{}: rank {} did not accept the transfer: {}", t.what, dst,
                                  reinterpret_cast<const char*>(ack.data() + 1)));
}

SendHeader receive_header(TransportCall& t, int src, int tag, int user_tag) {
  auto& words = t.hold->words;
  words.assign(kHeaderWords, 0);
  // The likely cause of a timeout here: the peer never started its send.
  Step header(
      t.deadline,
      [&] {
        return fmt::format(
            "{} timed out: rank {} did not call send_dict to rank {} (with tag {}) within the "
            "timeout",
            t.describe(), src, t.g.rank, user_tag);
      },
      t.hold, t.what);
  header.post(recv_call(words.data(), kHeaderWords, MPI_UINT64_T, src, tag, t.g.comm), "header");
  header.wait();
  SendHeader head;
  head.status = words[0];
  head.mask = words[2];
  std::copy(words.begin() + static_cast<std::ptrdiff_t>(kFirstSizeWord), words.end(),
            head.sizes.begin());
  head.body_bytes = head.status == kOk ? head.sizes[0] : words[1];
  if (head.body_bytes > kWireMaxMetadataBytes)
    throw Error(
        fmt::format("{}: rank {} announced {} bytes of metadata (corrupted or not a "
                    "transport peer)",
                    t.what, src, head.body_bytes));
  return head;
}

std::span<const std::byte> receive_body(TransportCall& t, const SendHeader& head, int src,
                                        int tag) {
  auto& body = t.hold->bytes.emplace_back(head.body_bytes);
  t.step.post(
      recv_call(body.data(), mpi_count(head.body_bytes, t.what), MPI_BYTE, src, tag, t.g.comm),
      head.status == kOk ? "metadata" : "error text");
  t.step.wait();
  if (head.status != kOk)
    throw_kind(head.status,
               fmt::format("{}: rank {}'s send_dict failed: {}", t.what, src,
                           std::string(reinterpret_cast<const char*>(body.data()), body.size())));
  return body;
}

DictLayout send_verdict(TransportCall& t, const SendHeader& head, std::span<const std::byte> body,
                        const std::string& err, int src, int tag) {
  DictLayout layout;
  std::uint64_t verdict = err.empty() ? kOk : kBadArgument;
  std::string why = err;
  if (verdict == kOk) {
    try {
      check_size_record(head.sizes, src, t.what);
      check_segment_mask(head.mask, src, t.what);
      layout = decode_checked(body, head.sizes, src, t.what);
    } catch (const std::exception& e) {
      verdict = kFailed;
      why = e.what();
    }
  }
  auto& ack = t.hold->bytes.emplace_back(kAckBytes);
  ack[0] = static_cast<std::byte>(verdict);
  std::memcpy(ack.data() + 1, why.data(), std::min<std::size_t>(why.size(), kAckBytes - 2));
  t.step.post(send_call(ack.data(), kAckBytes, MPI_BYTE, src, tag, t.g.comm));
  t.step.wait();
  if (verdict == kBadArgument) throw std::invalid_argument(fmt::format("{}: {}", t.what, err));
  if (verdict != kOk) throw Error(why);
  return layout;
}

void exchange_streams(TransportCall& t, const StreamMessages& msgs, bool sending, int peer,
                      int tag) {
  for (std::size_t k = 0; k < kNumDTypes; ++k) {
    if (msgs[k].empty()) continue;
    const MPI_Datatype type = mpi_datatype(stream_dtype(k));
    for (const Region& r : msgs[k]) {
      if (sending) {
        t.step.post(send_call(r.data(), elements_in(r, k), type, peer, tag, t.g.comm));
      } else {
        t.step.post(recv_call(r.data(), elements_in(r, k), type, peer, tag, t.g.comm),
                    data_phase(k));
      }
    }
  }
  t.step.wait();
}

}  // namespace td::detail
