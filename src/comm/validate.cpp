#include "comm/validate.hpp"

#include <fmt/format.h>

#include "tensordict/collectives.hpp"

namespace td::detail {

std::string timeout_problem(std::chrono::milliseconds timeout) {
  if (timeout.count() > 0) return {};
  return fmt::format("timeout must be positive (got {} ms)", timeout.count());
}

std::string bucket_bytes_problem(std::optional<std::size_t> cap) {
  if (!cap || *cap != 0) return {};
  return "bucket_bytes must be positive (or td::kAutoBucketBytes)";
}

std::string rank_problem(std::string_view role, int rank, int group_size) {
  if (rank >= 0 && rank < group_size) return {};
  return fmt::format("{} {} is out of range for a group of {} ranks", role, rank, group_size);
}

std::string tag_problem(int tag) {
  if (tag >= 0 && tag < kMaxUserTag) return {};
  return fmt::format("tag {} is out of range [0, {})", tag, kMaxUserTag);
}

std::string self_problem(std::string_view role, int peer, int me) {
  if (peer != me) return {};
  return fmt::format("{} {} is this rank itself", role, peer);
}

}  // namespace td::detail
