#include "tensordict/key.hpp"

#include <stdexcept>
#include <utility>

#include <fmt/format.h>

namespace td {

namespace {
void check_parts(const std::vector<std::string>& parts) {
  if (parts.empty()) throw std::invalid_argument("a td::Key needs at least one name");
  for (const auto& p : parts)
    if (p.empty()) throw std::invalid_argument("a td::Key name cannot be empty");
}

bool is_control(unsigned char c) { return c < 0x20 || c == 0x7f; }

// Whether str() must quote `name`: otherwise the joined path could be read another way.
bool needs_quotes(const std::string& name, const std::string& sep) {
  if (name.empty() || (!sep.empty() && name.find(sep) != std::string::npos)) return true;
  for (const unsigned char c : name)
    if (c == '.' || c == '/' || c == '"' || c == '\\' || is_control(c)) return true;
  return false;
}

// `name` in double quotes with C escapes (\" \\ \n \t ..., other control bytes as \xHH).
void append_quoted(std::string& out, const std::string& name) {
  out += '"';
  for (const unsigned char c : name) {
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\a':
        out += "\\a";
        break;
      case '\b':
        out += "\\b";
        break;
      case '\f':
        out += "\\f";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\r':
        out += "\\r";
        break;
      case '\t':
        out += "\\t";
        break;
      case '\v':
        out += "\\v";
        break;
      default:
        if (is_control(c)) {
          out += fmt::format("\\x{:02x}", c);
        } else {
          out += static_cast<char>(c);
        }
    }
  }
  out += '"';
}
}  // namespace

Key::Key(const char* name) : Key(std::string(name)) {}
Key::Key(std::string name) : parts_{std::move(name)} { check_parts(parts_); }
Key::Key(std::initializer_list<std::string> parts) : parts_(parts) { check_parts(parts_); }
Key::Key(std::vector<std::string> parts) : parts_(std::move(parts)) { check_parts(parts_); }

Key Key::parse(std::string_view path, char sep) {
  std::vector<std::string> parts;
  std::size_t start = 0;
  while (true) {
    const std::size_t pos = path.find(sep, start);
    const std::string_view part =
        path.substr(start, pos == std::string_view::npos ? std::string_view::npos : pos - start);
    if (part.empty())
      throw std::invalid_argument(
          fmt::format("Key::parse: empty name in path '{}' (separator '{}')", path, sep));
    parts.emplace_back(part);
    if (pos == std::string_view::npos) break;
    start = pos + 1;
  }
  return Key(std::move(parts));
}

const std::vector<std::string>& Key::parts() const { return parts_; }

std::string Key::str(const std::string& sep) const {
  std::string out;
  for (std::size_t i = 0; i < parts_.size(); ++i) {
    if (i) out += sep;
    if (needs_quotes(parts_[i], sep)) {
      append_quoted(out, parts_[i]);
    } else {
      out += parts_[i];
    }
  }
  return out;
}

}  // namespace td
