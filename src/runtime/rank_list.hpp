// Lists of ranks as messages print them: "rank 2", "ranks 0, 1", "ranks 0-3, 5". Header-only
// (fmt), shared by the diagnosis of a timeout and the td-flight tool.
#pragma once

#include <string>
#include <vector>

#include <fmt/format.h>

namespace td::detail {

/// `ranks` (ascending) with runs of three or more written as a range.
inline std::string ranks_text(const std::vector<int>& ranks) {
  std::string out;
  for (std::size_t i = 0; i < ranks.size();) {
    std::size_t j = i;
    while (j + 1 < ranks.size() && ranks[j + 1] == ranks[j] + 1) ++j;
    if (!out.empty()) out += ", ";
    out += j == i ? std::to_string(ranks[i])
                  : fmt::format("{}{}{}", ranks[i], j == i + 1 ? ", " : "-", ranks[j]);
    i = j + 1;
  }
  return fmt::format("rank{} {}", ranks.size() == 1 ? "" : "s", out);
}

}  // namespace td::detail
