// Transport without a prior layout: broadcast_dict, send_dict / recv_dict, all_gather_dicts,
// gather_dicts, scatter_dicts. Each call is a sequence of the protocol's steps
// (comm/transport_protocol.hpp, which also says what every step sends and checks): the
// agreement, the size records, the metadata and the data, each check agreed by every rank.
#include "tensordict/transport.hpp"

#include <array>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "comm/transport_protocol.hpp"

namespace td {

namespace {

using detail::CollectiveKind;
using detail::OutgoingDict;
using detail::StreamMessages;
using detail::TransportCall;
using Streams = std::array<Tensor, kNumDTypes>;

// The call's group when this rank is its root, else null: only the root reads its input before
// the agreement.
std::shared_ptr<detail::GroupState> group_if_root(const CollectiveOptions& opts, int root) {
  auto g = detail::group_of(opts);
  if (g->comm != MPI_COMM_NULL && g->rank == root) return g;
  return nullptr;
}

// scatter_dicts' parts ready to go on the source (none elsewhere); a part that cannot be sent,
// or a count that is not the group's size, is noted in `err`.
std::vector<OutgoingDict> outgoing_parts(const std::vector<TensorDict>& parts, int src,
                                         const CollectiveOptions& opts, std::string& err) {
  std::vector<OutgoingDict> outs;
  const auto g = group_if_root(opts, src);
  if (!g) return outs;
  if (parts.size() != static_cast<std::size_t>(g->size) && err.empty())
    err =
        fmt::format("{} parts for a group of {} ranks (one part per rank)", parts.size(), g->size);
  for (std::size_t r = 0; r < parts.size() && err.empty(); ++r) {
    auto o = detail::try_outgoing_dict(parts[r], fmt::format("parts[{}]", r), err);
    if (o) outs.push_back(std::move(*o));
  }
  return outs;
}

std::vector<TensorDict> gather_dicts_impl(const TensorDict& value, bool all, int dst,
                                          const CollectiveOptions& opts) {
  const std::string_view what = all ? "td.all_gather_dicts" : "td.gather_dicts";
  std::string err = detail::transport_option_error(opts);
  auto out = detail::try_outgoing_dict(value, "value", err);
  const auto agreed = detail::agree_transport_call(
      all ? CollectiveKind::AllGather : CollectiveKind::Gather, dst, what, opts, err);
  const std::optional<int> root = all ? std::nullopt : std::optional<int>(dst);
  const bool receives = all || agreed.group->rank == dst;
  TransportCall t(*agreed.group, agreed.deadline, what, [&] {
    return fmt::format("{} in a group of {} ranks", what, agreed.group->size);
  });

  // This rank's streams (one message each: a v-collective takes one buffer per rank) and the
  // guard of its messages, before its size record goes out to every rank (which then knows
  // which per-dtype calls follow).
  t.hold->keep(*out);
  const StreamMessages mine = detail::whole_streams(*out, *t.hold);
  detail::guard_record(*out, mine);
  const auto table = detail::allgather_size_table(t, out->sizes);
  const auto data_dtypes = detail::count_messages(*t.hold, table, what);

  const detail::Region meta = detail::gather_metadata(t, root, table, out->meta, receives);
  std::vector<detail::DictLayout> layouts;
  // Even where every rank decoded the same bytes, one status round: a short message is seen only
  // by the ranks it reached unfilled.
  t.agree_on(receives,
             [&] { layouts = detail::receive_layouts(table, meta, t.hold->meta_counts, what); });
  // Data: one exact-size v-collective per dtype that some rank sends.
  const Streams gathered = detail::gather_streams(t, root, table, mine, data_dtypes, receives);
  t.agree_on(receives, [&] {
    detail::check_gathered_streams(table, gathered, t.hold->per_dtype, data_dtypes, what);
  });
  if (!receives) return {};
  return detail::gathered_dicts(layouts, gathered, t.hold->per_dtype, what);
}

}  // namespace

TensorDict broadcast_dict(const TensorDict& value, int src, const CollectiveOptions& opts) {
  constexpr std::string_view what = "td.broadcast_dict";
  std::string err = detail::transport_option_error(opts);
  std::optional<OutgoingDict> out;
  if (group_if_root(opts, src)) out = detail::try_outgoing_dict(value, "value", err);
  const auto agreed = detail::agree_transport_call(CollectiveKind::Broadcast, src, what, opts, err);
  const bool is_src = agreed.group->rank == src;
  TransportCall t(*agreed.group, agreed.deadline, what, [&] {
    return fmt::format("{} from rank {} in a group of {} ranks", what, src, agreed.group->size);
  });

  // The source prepares its messages first: its size record carries their guard, then the
  // segment mask (which streams go one message per leaf).
  StreamMessages msgs;
  std::uint64_t mask = 0;
  if (is_src) {
    mask = detail::segment_mask(*out);
    t.hold->keep(*out);
    msgs = detail::messages_out(*out, mask, *t.hold);
    detail::guard_record(*out, msgs);
  }
  const OutgoingDict* sent = is_src ? &*out : nullptr;
  const detail::StreamHeader head = detail::broadcast_header(t, sent, mask, src);
  const detail::Region meta = detail::broadcast_metadata(t, sent, head, src);
  detail::DictLayout layout;
  t.agree_on(!is_src,
             [&] { layout = detail::receive_layout(head.guard, meta, head.sizes, src, what); });

  Streams streams;
  if (!is_src) msgs = detail::receive_streams(layout, head.sizes, head.mask, *t.hold, streams);
  detail::broadcast_streams(t, msgs, head, /*arm=*/!is_src, src);
  t.agree_on(!is_src,
             [&] { detail::check_streams_filled(head.guard, msgs, src, head.sizes, what); });
  if (is_src) return value;
  return detail::received_dict(layout, streams, {}, what);
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
  std::string err = detail::transport_option_error(opts);
  std::vector<OutgoingDict> outs = outgoing_parts(parts, src, opts, err);
  const auto agreed = detail::agree_transport_call(CollectiveKind::Scatter, src, what, opts, err);
  TransportCall t(*agreed.group, agreed.deadline, what, [&] {
    return fmt::format("{} from rank {} in a group of {} ranks", what, src, agreed.group->size);
  });

  // The source packs every part (giving each the guard of its own messages) before the records
  // go out; every rank needs every record: the data calls are per dtype that any part holds.
  Streams packed;
  if (agreed.group->rank == src) packed = detail::pack_parts(outs, *t.hold);
  const auto table = detail::scatter_size_table(t, outs, src);
  const detail::SizeRecord& mine = table[static_cast<std::size_t>(agreed.group->rank)];
  const detail::TailGuard guard(mine[detail::kGuardWord]);
  const auto data_dtypes = detail::count_messages(*t.hold, table, what);

  const detail::Region meta = detail::scatter_metadata(t, outs, guard, src);
  detail::DictLayout layout;
  t.agree_on(true, [&] { layout = detail::receive_layout(guard, meta, mine, src, what); });
  Streams streams;
  const StreamMessages filled =
      detail::scatter_streams(t, packed, data_dtypes, guard, src, streams);
  t.agree_on(true, [&] { detail::check_streams_filled(guard, filled, src, mine, what); });
  return detail::received_dict(layout, streams, {}, what);
}

void send_dict(const TensorDict& value, int dst, const CollectiveOptions& opts) {
  constexpr std::string_view what = "td.send_dict";
  std::string err;
  const auto p = detail::transport_peer(dst, what, "dst", /*sending=*/true, opts, err);
  const detail::CallScope call(*p.g, what, detail::CallKind::PointToPoint,
                               detail::peer_summary(dst));
  std::optional<OutgoingDict> out;
  if (err.empty()) out = detail::try_outgoing_dict(value, "value", err);
  TransportCall t(*p.g, p.deadline, what, [&] {
    return fmt::format("{} to rank {} in a group of {} ranks", what, dst, p.g->size);
  });
  if (out) t.hold->keep(*out);

  // Header and metadata (or the local error, so that the receiver raises it too); nothing more
  // is sent unless the receiver accepted the metadata.
  const std::uint64_t mask = out ? detail::segment_mask(*out) : 0;
  detail::send_header(t, out ? &*out : nullptr, mask, err, dst, p.tag);
  if (!err.empty()) throw std::invalid_argument(fmt::format("{}: {}", what, err));
  detail::await_verdict(t, dst, p.tag);
  detail::exchange_streams(t, detail::messages_out(*out, mask, *t.hold), /*sending=*/true, dst,
                           p.tag);
}

TensorDict recv_dict(int src, const CollectiveOptions& opts) {
  constexpr std::string_view what = "td.recv_dict";
  std::string err;
  const auto p = detail::transport_peer(src, what, "src", /*sending=*/false, opts, err);
  const detail::CallScope call(*p.g, what, detail::CallKind::PointToPoint,
                               detail::peer_summary(src));
  TransportCall t(*p.g, p.deadline, what, [&] {
    return fmt::format("{} from rank {} in a group of {} ranks", what, src, p.g->size);
  });

  const detail::SendHeader head = detail::receive_header(t, src, p.tag, opts.tag.value_or(0));
  const auto body = detail::receive_body(t, head, src, p.tag);
  // Our verdict goes back before any data moves.
  const detail::DictLayout layout = detail::send_verdict(t, head, body, err, src, p.tag);
  Streams streams;
  detail::exchange_streams(t,
                           detail::receive_streams(layout, head.sizes, head.mask, *t.hold, streams),
                           /*sending=*/false, src, p.tag);
  return detail::received_dict(layout, streams, {}, what);
}

}  // namespace td
