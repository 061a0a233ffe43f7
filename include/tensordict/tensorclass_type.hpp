// What a tensorclass is (the concepts TensorClassType and TensorDictLike), without the machinery
// of tensordict/tensorclass.hpp: for headers that accept a tensorclass (reducer.hpp).
#pragma once

#include <concepts>
#include <type_traits>

namespace td {

class TensorDict;
template <class Derived>
class TensorClass;  // tensordict/tensorclass.hpp

namespace detail {
struct TensorClassAccess;  // tensordict/tensorclass.hpp
}  // namespace detail

/// A struct declared as `struct S : td::TensorClass<S> { ...; TD_TENSORCLASS_FIELDS(S, ...) }`.
template <class T>
concept TensorClassType = std::is_class_v<T> && requires {
  T::td_tensorclass_fields();
  T::td_tensorclass_name();
} && std::derived_from<T, TensorClass<T>>;

/// Whether T is a tensorclass (see TensorClassType).
template <class T>
inline constexpr bool is_tensorclass_v = TensorClassType<T>;

/// A TensorDict or a tensorclass: what generic code that runs collectives can accept.
template <class T>
concept TensorDictLike = std::same_as<T, TensorDict> || TensorClassType<T>;

}  // namespace td
