// Short-message detection for collectives, where MPI reports no received count.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

namespace td::detail {

/// A collective's receive has no status count (MPI leaves it undefined), so a peer that takes
/// part with fewer elements than it announced leaves the end of the receiver's buffer unwritten,
/// silently. The sender therefore picks a canary that differs from the last bytes (up to 8) of
/// every message it sends and announces it before the data; each receiver writes the canary at
/// the end of each receive region before posting it. A region whose end still holds the canary
/// when the call completes was not filled: a short message. Cost: a few bytes per message.
class TailGuard {
 public:
  /// Unguarded (word 0): nothing is checked.
  TailGuard() = default;
  /// The guard announced as `word` (0: none).
  explicit TailGuard(std::uint64_t word) : word_(word) {}

  /// A canary that differs from the tail of every region of `messages` (the sender's), if one of
  /// the 256 candidates does; otherwise unguarded.
  static TailGuard choose(std::span<const std::span<const std::byte>> messages);

  /// What the sender announces.
  [[nodiscard]] std::uint64_t word() const { return word_; }
  /// Writes the canary at the end of a receive region (before it is posted).
  void arm(std::span<std::byte> region) const;
  /// Whether a completed receive region still ends with the canary (it was not filled).
  [[nodiscard]] bool short_message(std::span<const std::byte> region) const;

 private:
  [[nodiscard]] std::uint64_t canary() const;
  std::uint64_t word_ = 0;  // candidate index + 1
};

/// The regions a guard covers: every message of a call, as (first byte, bytes).
using Regions = std::vector<std::span<std::byte>>;

}  // namespace td::detail
