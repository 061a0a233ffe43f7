// The MPI tag space of one group's communicator: which tags point to point and transport use.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string_view>
#include <tuple>

namespace td::detail {

/// Hands out the MPI tags of point-to-point calls (TensorDict::send/recv, Tensor isend/irecv)
/// and of transport (send_dict/recv_dict) on one group's communicator, so that two calls with
/// different user tags, or of different kinds, can never take each other's messages:
///
///   [0, 2 * kMaxUserTag)                  transport: per (user tag, direction) one tag (its
///                                         calls are blocking, and messages of one tag between
///                                         two ranks match in the order they were posted)
///   [2 * kMaxUserTag, ... + 2^15 * S)     point to point: per (user tag, direction) a span of S
///                                         tags, cut into C blocks of B = S / C tags, one block per
///                                         call in flight (the n-th call to a peer with a tag
///                                         takes block n mod C, on both sides; a call whose block
///                                         is still held by call n - C is refused)
///
/// The direction (whether the sender's rank is the lower one) is part of every tag: a transfer
/// from A to B and one from B to A with the same user tag, at once, would otherwise post
/// messages with equal tags to each other, and MPI may match either with either.
/// Collectives use no tags of ours (MPI keeps their traffic apart). S, C and B follow from the
/// communicator's MPI_TAG_UB (2^31 - 1 with Open MPI: S = 65535, C = 64, B = 1023); a library
/// whose MPI_TAG_UB leaves no room for point to point gets an error naming it at the call.
class TagSpace {
 public:
  /// Tags of one point-to-point block: handshake, verdict, description length and text, then data.
  static constexpr int kFirstDataTag = 4;

  /// The tag space of a communicator whose MPI_TAG_UB is `tag_ub`.
  explicit TagSpace(long long tag_ub = 32767);

  /// The MPI tag of a transport transfer with `user_tag` (in [0, kMaxUserTag)) between this
  /// rank (`me`) and `peer`, in the direction `sending` says.
  [[nodiscard]] static int transport(int me, int peer, bool sending, int user_tag);

  /// The block of one point-to-point call: its first tag, and a lease that keeps the block
  /// taken until it is released (the Work that uses it holds it until it completes).
  struct CallBlock {
    int base = 0;
    std::shared_ptr<void> lease;
  };

  /// The block of the next point-to-point call between this rank (`me`) and `peer` with
  /// `user_tag`, in the direction `sending` says. Throws td::Error naming `what`, and takes
  /// nothing, when MPI_TAG_UB is too small for point to point, or when the call's block is still
  /// held by the call C calls earlier (C = calls_per_tag() in flight): reusing it could pair
  /// this call's messages with that one's.
  CallBlock next_call_block(int me, int peer, bool sending, int user_tag, std::string_view what);

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
  // Per (peer, we send, user tag): calls started, and which blocks are taken (bit b: block b).
  // Shared with the leases, which may outlive the group's state.
  struct Calls {
    std::uint64_t started = 0;
    std::uint64_t taken = 0;
  };
  struct Book {
    std::mutex mu;
    std::map<std::tuple<int, bool, int>, Calls> calls;
  };
  std::shared_ptr<Book> book_ = std::make_shared<Book>();
};

}  // namespace td::detail
