// td::Key: a path of names into a nested TensorDict, like tensordict's tuple keys.
#pragma once

#include <initializer_list>
#include <string>
#include <vector>

#include "tensordict/export.hpp"

namespace td {

/// A path of names: Key("obs") is one level, Key({"agent", "obs"}) is nested. A name is taken
/// literally (a "." inside it is not a separator).
struct TD_API Key {
  /// A one-level key.
  Key(const char* name);  // NOLINT(google-explicit-constructor): keys convert like Python strings
  /// A one-level key.
  Key(std::string name);  // NOLINT(google-explicit-constructor)
  /// A nested key, outermost name first.
  Key(std::initializer_list<std::string> parts);
  /// A nested key, outermost name first.
  explicit Key(std::vector<std::string> parts);

  /// The names, outermost first.
  const std::vector<std::string>& parts() const;
  /// The names joined by `sep` ("a.b.c").
  std::string str(const std::string& sep = ".") const;

  /// Lexicographic comparison of the parts: the canonical leaf order.
  friend bool operator==(const Key&, const Key&) = default;
  /// Lexicographic comparison of the parts: the canonical leaf order.
  friend auto operator<=>(const Key& a, const Key& b) { return a.parts_ <=> b.parts_; }

 private:
  std::vector<std::string> parts_;
};

}  // namespace td
