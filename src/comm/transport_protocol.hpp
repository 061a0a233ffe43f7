// The wire protocol of transport without a prior layout (docs/transport.md): what
// td::broadcast_dict, send_dict / recv_dict, all_gather_dicts, gather_dicts and scatter_dicts
// (ops/transport.cpp) send, in which messages, and how receivers check it. Every call is the same
// four steps:
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
// Every data-moving call goes through the executor (a Step of the call).
#pragma once

#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "comm/collective_engine.hpp"
#include "comm/dict_wire.hpp"
#include "comm/tail_guard.hpp"

namespace td::detail {

// ---- what a sender announces and sends -----------------------------------------------------

/// A sender's size record: [0] bytes of its encoded layout, [1 + k] bytes of its dtype-k stream,
/// [kGuardWord] the tail guard of its messages (collectives only: comm/tail_guard.hpp).
inline constexpr int kSizeWords = 2 + static_cast<int>(kNumDTypes);
inline constexpr std::size_t kGuardWord = 1 + kNumDTypes;
using SizeRecord = std::array<std::uint64_t, kSizeWords>;

/// The dtype of stream k.
inline DType stream_dtype(std::size_t k) { return static_cast<DType>(k); }

/// One dict ready to go: its layout, leaves, encoded metadata and size record.
struct OutgoingDict {
  DictLayout layout;
  std::vector<Tensor> tensors;
  std::vector<std::byte> meta;
  SizeRecord sizes{};
};

/// `d` ready to go, or nothing and the reason noted in `err` (agreed, so every rank raises it),
/// naming the dict as `which` ("value", "parts[2]").
std::optional<OutgoingDict> try_outgoing_dict(const TensorDict& d, std::string_view which,
                                              std::string& err);

/// The counts and displacements of one v-collective (per rank, in elements) and their sum.
struct VCounts {
  std::vector<int> counts, displs;
  int total = 0;
};

/// Everything MPI reads or writes during a call (leaked, not freed, when a wait times out).
struct TransportHold {
  std::vector<Tensor> tensors;
  std::deque<std::vector<std::byte>> bytes;  // a deque: references stay valid as it grows
  std::vector<std::uint64_t> words;
  // The v-collectives' counts and displacements: MPI reads them until the request completes,
  // so they live as long as the buffers (also past a timeout, when the hold is leaked).
  VCounts meta_counts;
  std::vector<VCounts> per_dtype;
  SizeRecord sent_sizes{};  // this rank's size record, as the all-gather of the records reads it

  /// A sender's leaves, which its in-place messages read: held like every other buffer.
  void keep(const OutgoingDict& o) {
    tensors.insert(tensors.end(), o.tensors.begin(), o.tensors.end());
  }
};

/// Where one MPI call of the data phase reads or writes.
using Region = std::span<std::byte>;
/// The messages of every stream (tail_guard.hpp's Regions, one list per dtype).
using StreamMessages = std::array<Regions, kNumDTypes>;

/// Which of `o`'s dtype streams travel as one message per segment (bit k): those that are not in
/// place and whose leaves are large on average. Sent to the receivers, who post the same messages.
std::uint64_t segment_mask(const OutgoingDict& o);
/// The sender's messages of every stream of `o`: one stream (in place, or packed into `hold`) or,
/// for the streams of `mask`, one leaf's memory per segment; each cut where MPI's count ends.
StreamMessages messages_out(const OutgoingDict& o, std::uint64_t mask, TransportHold& hold);
/// The sender's streams as one message each (a v-collective takes one buffer per rank).
StreamMessages whole_streams(const OutgoingDict& o, TransportHold& hold);
/// Puts into `o`'s size record the guard a sender announces for its metadata and `data`.
void guard_record(OutgoingDict& o, const StreamMessages& data);
/// The number of elements of stream k in `r`, as MPI's count (the messages are cut to fit).
int elements_in(const Region& r, std::size_t k);

// ---- what a receiver checks ----------------------------------------------------------------

/// A peer's size record, checked the same way on every rank that holds it.
void check_size_record(const SizeRecord& s, int rank, std::string_view what);
/// Checks a received metadata buffer against the guard (a short message), then decodes it and
/// checks it against rank `rank`'s size record.
DictLayout receive_layout(const TailGuard& guard, Region meta, const SizeRecord& sizes, int rank,
                          std::string_view what);
/// Checks the filled receive regions of every stream from rank `rank` against the guard.
void check_streams_filled(const TailGuard& guard, const StreamMessages& filled, int rank,
                          const SizeRecord& sizes, std::string_view what);
/// A receiver's streams: one fresh storage per dtype the size record announces (into `streams`,
/// held by `hold`), and the messages that fill them, cut as the sender cuts its own (`mask`).
StreamMessages receive_streams(const DictLayout& layout, const SizeRecord& sizes,
                               std::uint64_t mask, TransportHold& hold,
                               std::array<Tensor, kNumDTypes>& streams);
/// The dict of a received layout whose streams are the given element ranges of `all[k]`.
TensorDict received_dict(const DictLayout& layout, const std::array<Tensor, kNumDTypes>& all,
                         const std::array<std::int64_t, kNumDTypes>& first, std::string_view what);

// ---- agreement --------------------------------------------------------------------------------

/// Options these calls reject (noted as a local error, agreed like any other).
std::string transport_option_error(const CollectiveOptions& opts);

/// A collective transport call once every rank agreed on it.
struct AgreedTransport {
  std::shared_ptr<GroupState> group;
  std::chrono::steady_clock::time_point deadline;
  CallScope scope;  // the call's sequence number, held until it returns
};
/// Step 1: the call (name, root), the options and every rank's local error, agreed on no leaves.
AgreedTransport agree_transport_call(CollectiveKind kind, int root, std::string_view what,
                                     const CollectiveOptions& opts, std::string err);

/// Where only some ranks decode or check: every rank learns whether one rejected what it
/// received (`local`, null if not), and then raises the same error: that of the highest
/// rejecting rank, whose text it broadcasts.
void agree_status(const GroupState& g, const std::exception_ptr& local,
                  std::chrono::steady_clock::time_point deadline, std::string_view what);

/// The steps of one transport call on the caller's thread: its group, deadline and name, the
/// memory MPI touches (`hold`) and the Step its calls are posted through and waited for.
struct TransportCall {
  TransportCall(const GroupState& group, std::chrono::steady_clock::time_point call_deadline,
                std::string_view call_name, std::function<std::string()> describe_call);
  const GroupState& g;
  std::chrono::steady_clock::time_point deadline;
  std::string_view what;
  std::function<std::string()> describe;  // "td.broadcast_dict from rank 0 in a group of 4 ranks"
  std::shared_ptr<TransportHold> hold;
  Step step;

  /// The status round (agree_status) over what `check` throws on this rank, run where `checks`.
  template <class Check>
  void agree_on(bool checks, Check&& check) {
    std::exception_ptr rejected;
    if (checks) {
      try {
        check();
      } catch (...) {
        rejected = std::current_exception();
      }
    }
    agree_status(g, rejected, deadline, what);
  }
};

// ---- broadcast_dict ---------------------------------------------------------------------------

/// What the receivers of one sender learn before its metadata: its size record, which of its
/// streams go one message per segment, and the guard of its messages.
struct StreamHeader {
  SizeRecord sizes{};
  std::uint64_t mask = 0;
  TailGuard guard;
};
/// The source's size record and segment mask to every rank (`out`: the source's dict, null
/// elsewhere), checked the same way on each.
StreamHeader broadcast_header(TransportCall& t, const OutgoingDict* out, std::uint64_t mask,
                              int src);
/// The source's metadata to every rank: the bytes received (armed with the guard), or the
/// source's own.
Region broadcast_metadata(TransportCall& t, const OutgoingDict* out, const StreamHeader& head,
                          int src);
/// Every message of every stream from the source (its messages_out) into the receivers'
/// (receive_streams, armed with the guard where `arm`).
void broadcast_streams(TransportCall& t, const StreamMessages& msgs, const StreamHeader& head,
                       bool arm, int src);

// ---- scatter_dicts ----------------------------------------------------------------------------

/// The source's data: per dtype, every part's stream rank after rank (what the v-collective
/// sends), into storage `hold` keeps; each part's size record gets the guard of its messages.
std::array<Tensor, kNumDTypes> pack_parts(std::vector<OutgoingDict>& parts, TransportHold& hold);
/// Every part's size record (`parts`: the source's, empty on the other ranks) to every rank,
/// checked.
std::vector<SizeRecord> scatter_size_table(TransportCall& t, const std::vector<OutgoingDict>& parts,
                                           int src);
/// The dtypes some rank sends data of; every count of the call's v-collectives (the metadata's
/// bytes, then those dtypes' elements) into `hold`, before anything is posted: a count beyond
/// INT_MAX throws on every rank alike (they hold the same table), with no request pending.
std::vector<std::size_t> count_messages(TransportHold& hold, const std::vector<SizeRecord>& table,
                                        std::string_view what);
/// This rank's part of the source's metadata (`parts`: the source's, empty on the other ranks),
/// received into a buffer armed with the guard.
Region scatter_metadata(TransportCall& t, const std::vector<OutgoingDict>& parts,
                        const TailGuard& guard, int src);
/// This rank's part of every dtype's `packed` data (the source's), into fresh `streams`; returns
/// the regions filled (armed with the guard).
StreamMessages scatter_streams(TransportCall& t, const std::array<Tensor, kNumDTypes>& packed,
                               const std::vector<std::size_t>& data_dtypes, const TailGuard& guard,
                               int src, std::array<Tensor, kNumDTypes>& streams);

// ---- all_gather_dicts, gather_dicts ---------------------------------------------------------

/// Every rank's size record (this rank's: `mine`) to every rank, checked.
std::vector<SizeRecord> allgather_size_table(TransportCall& t, const SizeRecord& mine);
/// Every rank's metadata, one after the other, to `root` (to every rank: nullopt), into a
/// buffer armed with each sender's guard; `receives`: whether this rank is one of them.
Region gather_metadata(TransportCall& t, std::optional<int> root,
                       const std::vector<SizeRecord>& table, const std::vector<std::byte>& mine,
                       bool receives);
/// The layout of every rank's part of the gathered metadata, checked against its guard first.
std::vector<DictLayout> receive_layouts(const std::vector<SizeRecord>& table, Region all,
                                        const VCounts& counts, std::string_view what);
/// Every rank's streams (this rank's: `mine`) gathered per dtype, rank after rank, into fresh
/// storage armed with each sender's guard (where `receives`).
std::array<Tensor, kNumDTypes> gather_streams(TransportCall& t, std::optional<int> root,
                                              const std::vector<SizeRecord>& table,
                                              const StreamMessages& mine,
                                              const std::vector<std::size_t>& data_dtypes,
                                              bool receives);
/// Checks every rank's part of the gathered streams against its guard.
void check_gathered_streams(const std::vector<SizeRecord>& table,
                            const std::array<Tensor, kNumDTypes>& all,
                            const std::vector<VCounts>& per_dtype,
                            const std::vector<std::size_t>& data_dtypes, std::string_view what);
/// Rank r's dict, for every r, from the gathered streams.
std::vector<TensorDict> gathered_dicts(const std::vector<DictLayout>& layouts,
                                       const std::array<Tensor, kNumDTypes>& all,
                                       const std::vector<VCounts>& per_dtype,
                                       std::string_view what);

// ---- send_dict, recv_dict ---------------------------------------------------------------------

/// The peer of a point-to-point transport call: its group, deadline and MPI tag.
struct TransportPeer {
  std::shared_ptr<GroupState> g;
  std::chrono::steady_clock::time_point deadline;
  int tag = 0;
};
/// Local checks of a point-to-point call; a peer out of range (no one to tell) throws at once,
/// the others are noted in `err`, to be sent to the peer first.
TransportPeer transport_peer(int peer, std::string_view what, std::string_view role, bool sending,
                             const CollectiveOptions& opts, std::string& err);
/// The flight recorder's summary of a point-to-point transport call: its peer.
CallSummary peer_summary(int peer);

/// send_dict's header and body: the size record, segment mask and metadata of `out`, or the
/// local error `err` (`out` null), so that the receiver raises it too.
void send_header(TransportCall& t, const OutgoingDict* out, std::uint64_t mask,
                 const std::string& err, int dst, int tag);
/// The receiver's verdict on the metadata: throws its error unless it accepted the transfer.
void await_verdict(TransportCall& t, int dst, int tag);

/// A send_dict's header as its receiver read it.
struct SendHeader {
  std::uint64_t status = 0;      // 0: ok, else the kind of the sender's error
  std::uint64_t body_bytes = 0;  // of the metadata, or of the sender's error text
  SizeRecord sizes{};
  std::uint64_t mask = 0;
};
/// The sender's header (`user_tag`: for the error when no sender comes), its body length
/// checked before anything is allocated for it.
SendHeader receive_header(TransportCall& t, int src, int tag, int user_tag);
/// The header's body: the metadata, or (a failed sender) its error, thrown here.
std::span<const std::byte> receive_body(TransportCall& t, const SendHeader& head, int src, int tag);
/// This rank's verdict on the metadata, sent back before any data moves: the decoded layout, or
/// the rejection (a local error `err`, or a bad header or layout) thrown after it was sent.
DictLayout send_verdict(TransportCall& t, const SendHeader& head, std::span<const std::byte> body,
                        const std::string& err, int src, int tag);
/// Each message of every stream, as one send to `peer` or (`sending` false) one receive from it
/// (its count checked).
void exchange_streams(TransportCall& t, const StreamMessages& msgs, bool sending, int peer,
                      int tag);

}  // namespace td::detail
