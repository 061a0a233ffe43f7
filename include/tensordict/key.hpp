// td::Key: a path of names into a nested TensorDict, like tensordict's tuple keys.
#pragma once

#include <initializer_list>
#include <string>
#include <string_view>
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

  /// Splits `path` at every `sep` ("a.b" -> {"a", "b"}). Nothing is unescaped: parse() is the
  /// inverse of str() only for names that str() prints unquoted. An empty name (an empty path,
  /// two separators in a row, a separator at either end) throws std::invalid_argument.
  static Key parse(std::string_view path, char sep = '.');

  /// The names, outermost first.
  const std::vector<std::string>& parts() const;
  /// The names joined by `sep`, unambiguously: a name that is empty or contains `sep`, '.', '/',
  /// '"', '\\' or a control character is written in double quotes with C escapes, so {"a.b"}
  /// prints "a.b" (with the quotes) and {"a", "b"} prints a.b. Every message and print uses it.
  std::string str(const std::string& sep = ".") const;

  /// Lexicographic comparison of the parts: the canonical leaf order.
  friend bool operator==(const Key&, const Key&) = default;
  /// Lexicographic comparison of the parts: the canonical leaf order.
  friend auto operator<=>(const Key& a, const Key& b) { return a.parts_ <=> b.parts_; }

 private:
  std::vector<std::string> parts_;
};

}  // namespace td
