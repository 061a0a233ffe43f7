// The benchmarks' command line (options.hpp).
#include "options.hpp"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <exception>
#include <map>

#include <fmt/format.h>

namespace td_bench {

std::string size_label(std::size_t b) {
  constexpr std::size_t kKi = 1024, kMi = kKi * 1024, kGi = kMi * 1024;
  if (b >= kGi && b % kGi == 0) return fmt::format("{}GiB", b / kGi);
  if (b >= kMi && b % kMi == 0) return fmt::format("{}MiB", b / kMi);
  if (b >= kKi && b % kKi == 0) return fmt::format("{}KiB", b / kKi);
  return fmt::format("{}B", b);
}

std::string human_bytes(double b) {
  if (b >= 1024.0 * 1024 * 1024) return fmt::format("{:.2f} GiB", b / (1024.0 * 1024 * 1024));
  if (b >= 1024.0 * 1024) return fmt::format("{:.2f} MiB", b / (1024.0 * 1024));
  if (b >= 1024.0) return fmt::format("{:.2f} KiB", b / 1024.0);
  return fmt::format("{:.0f} B", b);
}

std::optional<std::size_t> parse_size(const std::string& text) {
  std::size_t pos = 0;
  double value = 0;
  try {
    value = std::stod(text, &pos);
  } catch (const std::exception&) {
    return std::nullopt;
  }
  std::string unit = text.substr(pos);
  std::transform(unit.begin(), unit.end(), unit.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  static const std::map<std::string, double> kUnits = {{"", 1},
                                                       {"b", 1},
                                                       {"k", 1024.0},
                                                       {"kib", 1024.0},
                                                       {"kb", 1e3},
                                                       {"m", 1048576.0},
                                                       {"mib", 1048576.0},
                                                       {"mb", 1e6},
                                                       {"g", 1073741824.0},
                                                       {"gib", 1073741824.0},
                                                       {"gb", 1e9}};
  auto it = kUnits.find(unit);
  if (it == kUnits.end() || !(value > 0)) return std::nullopt;
  const double bytes = std::round(value * it->second);
  if (bytes < 1 || bytes > 1e15) return std::nullopt;
  return static_cast<std::size_t>(bytes);
}

std::optional<td::ReduceOp> parse_op(const std::string& s) {
  if (s == "sum") return td::ReduceOp::SUM;
  if (s == "avg") return td::ReduceOp::AVG;
  if (s == "max") return td::ReduceOp::MAX;
  if (s == "min") return td::ReduceOp::MIN;
  if (s == "product" || s == "prod") return td::ReduceOp::PRODUCT;
  return std::nullopt;
}

std::optional<td::DType> parse_dtype(const std::string& s) {
  for (std::size_t i = 0; i < td::kNumDTypes; ++i) {
    const auto d = static_cast<td::DType>(i);
    if (td::name(d) == s) return d;
  }
  return std::nullopt;
}

std::optional<int> parse_or_exit(CLI::App& app, int argc, char** argv) {
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int rc = app.exit(e);
    td::destroy_process_group();
    return rc;
  }
  return std::nullopt;
}

}  // namespace td_bench
