#include "runtime/tags.hpp"

#include <algorithm>

#include <fmt/format.h>

#include "tensordict/collectives.hpp"
#include "tensordict/errors.hpp"

namespace td::detail {

namespace {
constexpr long long kMaxCallsPerTag = 64;
constexpr long long kMaxTagsPerCall = 1024;
// A block needs its four control tags and at least a few for data.
constexpr long long kMinTagsPerCall = TagSpace::kFirstDataTag + 4;
}  // namespace

TagSpace::TagSpace(long long tag_ub) : tag_ub_(tag_ub) {
  // Per (user tag, direction): the tags above the transport range, split evenly.
  const long long span = (tag_ub + 1 - kMaxUserTag) / (2LL * kMaxUserTag);
  if (span < kMinTagsPerCall) return;
  const long long calls = std::min(kMaxCallsPerTag, span / kMinTagsPerCall);
  calls_ = static_cast<int>(calls);
  block_ = static_cast<int>(std::min(kMaxTagsPerCall, span / calls));
}

int TagSpace::transport(int user_tag) const { return user_tag; }

int TagSpace::next_call_block(int me, int peer, bool sending, int user_tag, std::string_view what) {
  if (calls_ == 0)
    throw Error(fmt::format(
        "{}: this MPI library's MPI_TAG_UB ({}) leaves no tags for point-to-point calls (they "
        "need at least {})",
        what, tag_ub_, kMaxUserTag + 2LL * kMaxUserTag * kMinTagsPerCall - 1));
  std::uint64_t n = 0;
  {
    std::lock_guard lock(mu_);
    n = next_[{peer, sending, user_tag}]++;
  }
  // Transfers in the two directions between the same two ranks get different blocks (both sides
  // of one transfer compute the same direction bit): otherwise a transfer from A to B and one
  // from B to A, started at once, post messages with equal tags to each other (the layout
  // descriptions after a mismatch travel both ways), and MPI may match either with either.
  const int sender = sending ? me : peer;
  const int receiver = sending ? peer : me;
  const long long direction = sender < receiver ? 1 : 0;
  const long long span = static_cast<long long>(calls_) * block_;
  const long long first = kMaxUserTag + (static_cast<long long>(user_tag) * 2 + direction) * span;
  return static_cast<int>(first +
                          static_cast<long long>(n % static_cast<std::uint64_t>(calls_)) * block_);
}

int TagSpace::data_tag(int base, std::uint64_t message) const {
  return base + kFirstDataTag +
         static_cast<int>(message % static_cast<std::uint64_t>(block_ - kFirstDataTag));
}

}  // namespace td::detail
