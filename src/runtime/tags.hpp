// The MPI tag space of one group's communicator: which tags point to point and transport use.
#pragma once

#include <cstdint>
#include <map>
#include <mutex>
#include <string_view>
#include <tuple>

namespace td::detail {

/// Hands out the MPI tags of point-to-point calls (TensorDict::send/recv, Tensor isend/irecv)
/// and of transport (send_dict/recv_dict) on one group's communicator, so that two calls with
/// different user tags, or of different kinds, can never take each other's messages:
///
///   [0, kMaxUserTag)                      transport: MPI tag = user tag (its calls are blocking,
///                                         and messages of one tag between two ranks match in
///                                         the order they were posted)
///   [kMaxUserTag, kMaxUserTag + 2^15 * S) point to point: per (user tag, direction) a span of S
///                                         tags, cut into C blocks of B = S / C tags, one block per
///                                         call in flight (the n-th call to a peer with a tag
///                                         takes block n mod C, on both sides)
///
/// Collectives use no tags of ours (MPI keeps their traffic apart). S, C and B follow from the
/// communicator's MPI_TAG_UB (2^31 - 1 with Open MPI: S = 65535, C = 64, B = 1023); a library
/// whose MPI_TAG_UB leaves no room for point to point gets an error naming it at the call.
class TagSpace {
 public:
  /// Tags of one point-to-point block: handshake, verdict, description length and text, then data.
  static constexpr int kFirstDataTag = 4;

  /// The tag space of a communicator whose MPI_TAG_UB is `tag_ub`.
  explicit TagSpace(long long tag_ub = 32767);

  /// The MPI tag of transport with `user_tag` (in [0, kMaxUserTag)).
  [[nodiscard]] int transport(int user_tag) const;

  /// The first tag of the block of the next point-to-point call between this rank (`me`) and
  /// `peer` with `user_tag`, in the direction `sending` says; throws td::Error naming `what` when
  /// MPI_TAG_UB is too small for point to point.
  int next_call_block(int me, int peer, bool sending, int user_tag, std::string_view what);

  /// The tag of the `message`-th data message of a call whose block starts at `base`.
  [[nodiscard]] int data_tag(int base, std::uint64_t message) const;

  /// Calls in flight per (peer, direction, user tag) before their blocks repeat.
  [[nodiscard]] int calls_per_tag() const { return calls_; }
  /// Tags in one call's block.
  [[nodiscard]] int tags_per_call() const { return block_; }

 private:
  long long tag_ub_;
  int calls_ = 0;  // 0: no room for point to point
  int block_ = 0;
  std::mutex mu_;
  std::map<std::tuple<int, bool, int>, std::uint64_t> next_;  // (peer, we send, user tag) -> calls
};

}  // namespace td::detail
