#include "comm/tail_guard.hpp"

#include <algorithm>
#include <array>
#include <cstring>

namespace td::detail {

namespace {
constexpr std::uint64_t kBase = 0x9e3779b97f4a7c15ULL;  // any pattern unlikely at a tail
constexpr std::uint64_t kEveryByte = 0x0101010101010101ULL;
constexpr std::size_t kTailBytes = 8;

// The last min(8, n) bytes of a region, as the low bytes of a word (little end first).
std::uint64_t tail_of(std::span<const std::byte> region, std::size_t& width) {
  width = std::min(kTailBytes, region.size());
  std::uint64_t v = 0;
  std::memcpy(&v, region.data() + region.size() - width, width);
  return v;
}

std::uint64_t low_bytes(std::uint64_t v, std::size_t width) {
  return width >= kTailBytes ? v : v & ((std::uint64_t{1} << (8 * width)) - 1);
}
}  // namespace

std::uint64_t TailGuard::canary() const {
  // Candidate i: every byte of kBase xor i, so the low bytes of two candidates differ at any
  // width and each region's tail rules out at most one candidate.
  return kBase ^ ((word_ - 1) * kEveryByte);
}

TailGuard TailGuard::choose(std::span<const std::span<const std::byte>> messages) {
  std::array<bool, 256> taken{};
  for (const auto& m : messages) {
    if (m.empty()) continue;
    std::size_t width = 0;
    const std::uint64_t t = tail_of(m, width);
    // The candidate whose low `width` bytes equal t, if any: byte 0 names it.
    const auto i = static_cast<std::size_t>((t ^ kBase) & 0xff);
    if (low_bytes(TailGuard(i + 1).canary(), width) == t) taken[i] = true;
  }
  for (std::size_t i = 0; i < taken.size(); ++i)
    if (!taken[i]) return TailGuard(i + 1);
  return TailGuard();
}

void TailGuard::arm(std::span<std::byte> region) const {
  if (word_ == 0 || region.empty()) return;
  const std::uint64_t c = canary();
  const std::size_t width = std::min(kTailBytes, region.size());
  std::memcpy(region.data() + region.size() - width, &c, width);
}

bool TailGuard::short_message(std::span<const std::byte> region) const {
  if (word_ == 0 || region.empty()) return false;
  std::size_t width = 0;
  const std::uint64_t t = tail_of(region, width);
  return t == low_bytes(canary(), width);
}

}  // namespace td::detail
