#include "tensordict/key.hpp"

#include <stdexcept>
#include <utility>

namespace td {

namespace {
void check_parts(const std::vector<std::string>& parts) {
  if (parts.empty()) throw std::invalid_argument("a td::Key needs at least one name");
  for (const auto& p : parts)
    if (p.empty()) throw std::invalid_argument("a td::Key name cannot be empty");
}
}  // namespace

Key::Key(const char* name) : Key(std::string(name)) {}
Key::Key(std::string name) : parts_{std::move(name)} { check_parts(parts_); }
Key::Key(std::initializer_list<std::string> parts) : parts_(parts) { check_parts(parts_); }
Key::Key(std::vector<std::string> parts) : parts_(std::move(parts)) { check_parts(parts_); }

const std::vector<std::string>& Key::parts() const { return parts_; }

std::string Key::str(const std::string& sep) const {
  std::string out;
  for (std::size_t i = 0; i < parts_.size(); ++i) {
    if (i) out += sep;
    out += parts_[i];
  }
  return out;
}

}  // namespace td
