// The bucket size a collective may ask for instead of a number of bytes.
#pragma once

#include <cstddef>
#include <limits>

namespace td {

/// bucket_bytes value that asks for the size tuned on this machine and group.
inline constexpr std::size_t kAutoBucketBytes = std::numeric_limits<std::size_t>::max();

}  // namespace td
