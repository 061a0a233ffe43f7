// Argument checks every operation shares (as c10d's Utils.hpp has assertRootRank and the like):
// one wording per problem. Each returns the problem's text, or "" when the argument is fine; the
// caller notes it as a local error (agreed like any other) or throws it where no peer can be told.
#pragma once

#include <chrono>
#include <cstddef>
#include <optional>
#include <string>
#include <string_view>

namespace td::detail {

/// "timeout must be positive (got 0 ms)".
std::string timeout_problem(std::chrono::milliseconds timeout);
/// "bucket_bytes must be positive (or td::kAutoBucketBytes)" for a cap of 0.
std::string bucket_bytes_problem(std::optional<std::size_t> cap);
/// "dst 3 is out of range for a group of 3 ranks" (`role`: dst, src, root ...).
std::string rank_problem(std::string_view role, int rank, int group_size);
/// "tag 20000 is out of range [0, 16384)".
std::string tag_problem(int tag);
/// "dst 1 is this rank itself": a point-to-point call to itself.
std::string self_problem(std::string_view role, int peer, int me);

}  // namespace td::detail
