#include "runtime/tags.hpp"

#include <algorithm>

#include <fmt/format.h>

#include "tensordict/collectives.hpp"
#include "tensordict/errors.hpp"

namespace td::detail {

namespace {
constexpr long long kMaxCallsPerTag = 64;  // a bit per block in a 64-bit word (Calls::taken)
constexpr long long kMaxTagsPerCall = 1024;
// A block needs its four control tags and at least a few for data.
constexpr long long kMinTagsPerCall = TagSpace::kFirstDataTag + 4;

// The first tag of point to point: above transport's, one per (user tag, direction).
constexpr long long kFirstPointToPointTag = 2LL * kMaxUserTag;

// 1 when the sender of a transfer between `me` and `peer` is the lower rank: both sides of one
// transfer compute the same bit, the two directions between two ranks different ones.
long long direction_bit(int me, int peer, bool sending) {
  const int sender = sending ? me : peer;
  const int receiver = sending ? peer : me;
  return sender < receiver ? 1 : 0;
}
}  // namespace

TagSpace::TagSpace(long long tag_ub) : tag_ub_(tag_ub) {
  // Per (user tag, direction): the tags above the transport range, split evenly.
  const long long span = (tag_ub + 1 - kFirstPointToPointTag) / (2LL * kMaxUserTag);
  if (span < kMinTagsPerCall) return;
  const long long calls = std::min(kMaxCallsPerTag, span / kMinTagsPerCall);
  calls_ = static_cast<int>(calls);
  block_ = static_cast<int>(std::min(kMaxTagsPerCall, span / calls));
}

int TagSpace::transport(int me, int peer, bool sending, int user_tag) {
  return static_cast<int>(2LL * user_tag + direction_bit(me, peer, sending));
}

TagSpace::CallBlock TagSpace::next_call_block(int me, int peer, bool sending, int user_tag,
                                              std::string_view what) {
  if (calls_ == 0)
    throw Error(fmt::format(
        "{}: this MPI library's MPI_TAG_UB ({}) leaves no tags for point-to-point calls (they "
        "need at least {})",
        what, tag_ub_, kFirstPointToPointTag + 2LL * kMaxUserTag * kMinTagsPerCall - 1));
  const std::tuple<int, bool, int> key{peer, sending, user_tag};
  std::uint64_t block = 0;
  {
    std::lock_guard lock(book_->mu);
    Calls& c = book_->calls[key];
    block = c.started % static_cast<std::uint64_t>(calls_);
    // Call n takes block n mod C on both sides. Were call n - C still in flight here, its
    // messages and this call's would share tags, and MPI could pair one's with the other's.
    if ((c.taken >> block) & 1U)
      throw Error(fmt::format(
          "{}: {} point-to-point calls {} rank {} with tag {} are already in flight (the most "
          "this MPI library's tag space allows per peer, direction and tag; the earliest of them, "
          "call {}, has not completed): wait for it before starting another; nothing was {}",
          what, calls_, sending ? "to" : "from", peer, user_tag, c.started - calls_ + 1,
          sending ? "sent" : "received"));
    c.taken |= std::uint64_t{1} << block;
    ++c.started;
  }
  const long long span = static_cast<long long>(calls_) * block_;
  const long long first =
      kFirstPointToPointTag +
      (static_cast<long long>(user_tag) * 2 + direction_bit(me, peer, sending)) * span;
  // The lease gives the block back when the call's Work lets go of it.
  std::shared_ptr<void> lease(nullptr, [book = book_, key, block](void*) {
    std::lock_guard lock(book->mu);
    book->calls[key].taken &= ~(std::uint64_t{1} << block);
  });
  return {static_cast<int>(first + static_cast<long long>(block) * block_), std::move(lease)};
}

int TagSpace::data_tag(int base, std::uint64_t message) const {
  return base + kFirstDataTag +
         static_cast<int>(message % static_cast<std::uint64_t>(block_ - kFirstDataTag));
}

}  // namespace td::detail
