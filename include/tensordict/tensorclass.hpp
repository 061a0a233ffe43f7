// td::TensorClass: a user struct of named tensor fields (and nested such structs) that converts to
// and from a TensorDict and has every TensorDict collective, like Python tensordict's
// @tensorclass. The fields are declared once, with TD_TENSORCLASS_FIELDS; no other per-field code.
#pragma once

#include <array>
#include <concepts>
#include <cstddef>
#include <exception>
#include <functional>
#include <optional>
#include <ostream>
#include <stdexcept>
#include <string>
#include <string_view>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "tensordict/collectives.hpp"
#include "tensordict/errors.hpp"
#include "tensordict/key.hpp"
#include "tensordict/tensor.hpp"
#include "tensordict/tensor_dict.hpp"
#include "tensordict/tensorclass_type.hpp"
#include "tensordict/transport.hpp"
#include "tensordict/work.hpp"

/// @cond
// A tensorclass's member for one entry of TD_DETAIL_DICT_COLLECTIVES: TensorDict's member of the
// same name on the fields' dict, through TensorClass::td_dict_call_<access>.
#define TD_DETAIL_TC_CONST_in_place
#define TD_DETAIL_TC_CONST_reads const
#define TD_DETAIL_TC_COLLECTIVE(access, attr, ret, name, params, args, cv)                  \
  attr ret name params TD_DETAIL_TC_CONST_##access {                                        \
    auto call = [](TensorDict& d, auto&&... a) {                                            \
      return d.name(std::forward<decltype(a)>(a)...);                                       \
    };                                                                                      \
    /* args is a parenthesised argument list: */                                            \
    return this->td_dict_call_##access(call) args; /* NOLINT(bugprone-macro-parentheses) */ \
  }
/// @endcond

namespace td {

namespace detail {

// One declared field: its name (the key) and its member pointer. Owner may be a base of the
// tensorclass when the member is inherited; `object.*member` works on the derived object.
template <class Owner, class Member>
struct TensorClassField {
  using owner_type = Owner;
  using member_type = Member;
  std::string_view name;
  Member Owner::*member;
};

template <class Owner, class Member>
constexpr TensorClassField<Owner, Member> tensorclass_field(std::string_view name,
                                                            Member Owner::*member) noexcept {
  return {name, member};
}

// Everything that walks the declared fields. A friend of every TensorClass<>, so that a parent
// can read and write its nested tensorclasses' batch sizes.
struct TensorClassAccess {
  template <class T>
  static constexpr auto fields() {
    return T::td_tensorclass_fields();
  }

  template <class T>
  static constexpr std::size_t count() {
    return std::tuple_size_v<decltype(T::td_tensorclass_fields())>;
  }

  template <class T>
  static constexpr std::array<std::string_view, count<T>()> names() {
    return std::apply(
        [](const auto&... f) { return std::array<std::string_view, count<T>()>{f.name...}; },
        fields<T>());
  }

  template <class T>
  static constexpr bool names_unique() {
    constexpr auto n = names<T>();
    for (std::size_t i = 0; i < n.size(); ++i)
      for (std::size_t j = i + 1; j < n.size(); ++j)
        if (n[i] == n[j]) return false;
    return true;
  }

  template <class M>
  static constexpr bool valid_field_type() {
    return std::is_same_v<M, Tensor> || TensorClassType<M>;
  }

  template <class T>
  static constexpr bool field_types_valid() {
    return std::apply(
        [](const auto&... f) {
          return (valid_field_type<typename std::remove_cvref_t<decltype(f)>::member_type>() &&
                  ...);
        },
        fields<T>());
  }

  // Whether every field is a member of T (or of a base of T): catches a macro whose first
  // argument names another struct than the one it is in.
  template <class T>
  static constexpr bool fields_belong_to() {
    return std::apply(
        [](const auto&... f) {
          return (std::is_base_of_v<typename std::remove_cvref_t<decltype(f)>::owner_type, T> &&
                  ...);
        },
        fields<T>());
  }

  // Compile-time checks, instantiated by every operation on T. The fields are walked only when
  // they pass, so a mistake is reported by one static_assert rather than by a cascade.
  template <class T>
  static constexpr bool well_formed() {
    static_assert(TensorClassType<T>,
                  "a tensorclass derives publicly from td::TensorClass<itself> and declares its "
                  "fields with TD_TENSORCLASS_FIELDS(Type, field...)");
    if constexpr (TensorClassType<T>) {
      static_assert(field_types_valid<T>(),
                    "every field listed in TD_TENSORCLASS_FIELDS must be a (non-const) td::Tensor "
                    "or a tensorclass");
      static_assert(names_unique<T>(), "a field is listed twice in TD_TENSORCLASS_FIELDS");
      static_assert(fields_belong_to<T>(),
                    "TD_TENSORCLASS_FIELDS(Type, ...) must name the struct it is declared in");
      static_assert(std::is_default_constructible_v<T>,
                    "a tensorclass must be default-constructible (from_tensordict builds one)");
      return field_types_valid<T>() && names_unique<T>() && fields_belong_to<T>();
    } else {
      return false;
    }
  }

  template <class T, class F>
  static void for_each_field(F&& fn) {
    if constexpr (well_formed<T>())
      std::apply([&](const auto&... f) { (fn(f), ...); }, fields<T>());
  }

  static std::string join(const std::string& prefix, std::string_view name) {
    return prefix.empty() ? std::string(name) : prefix + "." + std::string(name);
  }

  // The dict of `obj`, sharing every field's storage. A nested tensorclass whose batch size is
  // empty takes its parent's.
  template <class T>
  static TensorDict build(const T& obj, const Shape& inherited, const std::string& prefix,
                          std::string_view root) {
    const Shape& bs = obj.batch_size_.empty() ? inherited : obj.batch_size_;
    TensorDict d(bs);
    for_each_field<T>([&](const auto& f) {
      using M = typename std::remove_cvref_t<decltype(f)>::member_type;
      const std::string path = join(prefix, f.name);
      const M& value = obj.*(f.member);
      try {
        if constexpr (std::is_same_v<M, Tensor>) {
          if (!value.defined())
            throw Error(
                fmt::format("{}.to_tensordict: field '{}' ({}::{}) is an undefined "
                            "td::Tensor; assign a tensor to it first",
                            root, path, T::td_tensorclass_name(), f.name));
          d.set(Key(std::string(f.name)), value);
        } else {
          d.set(Key(std::string(f.name)), build(value, bs, path, root));
        }
      } catch (const std::invalid_argument& e) {
        if constexpr (std::is_same_v<M, Tensor>) {
          throw std::invalid_argument(
              fmt::format("{}.to_tensordict: field '{}': {}", root, path, e.what()));
        } else {
          throw;  // the nested call already named the field
        }
      }
    });
    return d;
  }

  // Fills `obj` from `d`: every field from the key of its name; no other key allowed.
  template <class T>
  static void load(T& obj, const TensorDict& d, const std::string& prefix, std::string_view root) {
    constexpr auto names_of_t = names<T>();
    for (const Key& k : d.keys()) {
      const std::string& name = k.parts()[0];
      bool known = false;
      for (std::string_view n : names_of_t) known = known || n == name;
      if (!known)
        throw Error(
            fmt::format("{}::from_tensordict: key '{}' is not a field of {}; exclude() it "
                        "first",
                        root, join(prefix, name), T::td_tensorclass_name()));
    }
    obj.batch_size_ = d.batch_size();
    for_each_field<T>([&](const auto& f) {
      using M = typename std::remove_cvref_t<decltype(f)>::member_type;
      const std::string path = join(prefix, f.name);
      const Key key(std::string(f.name));
      if (!d.contains(key))
        throw KeyError(fmt::format("{}::from_tensordict: key '{}' not found (field {}::{})", root,
                                   path, T::td_tensorclass_name(), f.name));
      if constexpr (std::is_same_v<M, Tensor>) {
        if (d.is_dict(key))
          throw Error(
              fmt::format("{}::from_tensordict: key '{}' holds a sub-dict, but {}::{} is "
                          "a td::Tensor",
                          root, path, T::td_tensorclass_name(), f.name));
        obj.*(f.member) = d.get(key);
      } else {
        if (!d.is_dict(key))
          throw Error(
              fmt::format("{}::from_tensordict: key '{}' holds a tensor, but {}::{} is "
                          "a tensorclass ({})",
                          root, path, T::td_tensorclass_name(), f.name, M::td_tensorclass_name()));
        load(obj.*(f.member), d.get_dict(key), path, root);
      }
    });
  }

  // Points every field at the leaf of the same key in `d` (built by build() from `obj`), without
  // touching batch sizes. After an in-place collective this is a no-op for leaves updated in
  // place and picks up leaves the collective replaced (sparse results, consolidate()).
  template <class T>
  static void rebind(T& obj, const TensorDict& d) {
    for_each_field<T>([&](const auto& f) {
      using M = typename std::remove_cvref_t<decltype(f)>::member_type;
      const Key key(std::string(f.name));
      if constexpr (std::is_same_v<M, Tensor>) {
        obj.*(f.member) = d.get(key);
      } else {
        rebind(obj.*(f.member), d.get_dict(key));
      }
    });
  }

  template <class T>
  static bool equal(const T& a, const T& b, const Shape& inherited_a, const Shape& inherited_b) {
    const Shape& bs_a = a.batch_size_.empty() ? inherited_a : a.batch_size_;
    const Shape& bs_b = b.batch_size_.empty() ? inherited_b : b.batch_size_;
    if (bs_a != bs_b) return false;
    bool same = true;
    for_each_field<T>([&](const auto& f) {
      using M = typename std::remove_cvref_t<decltype(f)>::member_type;
      if (!same) return;
      const M& x = a.*(f.member);
      const M& y = b.*(f.member);
      if constexpr (std::is_same_v<M, Tensor>) {
        same = x.defined() == y.defined() && (!x.defined() || x.equal(y));
      } else {
        same = equal(x, y, bs_a, bs_b);
      }
    });
    return same;
  }

  // The layout of TensorDict's printer, with the struct names and the declaration order.
  template <class T>
  static void print(std::string& out, const T& obj, const Shape& inherited, int indent) {
    const std::string pad(static_cast<std::size_t>(indent), ' ');
    const Shape& bs = obj.batch_size_.empty() ? inherited : obj.batch_size_;
    out += std::string(T::td_tensorclass_name()) + "(\n" + pad + "    fields={\n";
    for_each_field<T>([&](const auto& f) {
      using M = typename std::remove_cvref_t<decltype(f)>::member_type;
      const M& value = obj.*(f.member);
      out += pad + "        " + std::string(f.name) + ": ";
      if constexpr (std::is_same_v<M, Tensor>) {
        if (!value.defined()) {
          out += "Tensor(undefined)";
        } else {
          out += fmt::format("Tensor(shape={}, dtype={}{}{})", detail::shape_str(value.shape()),
                             name(value.dtype()), value.is_sparse() ? ", sparse" : "",
                             !value.is_sparse() && !value.is_contiguous() ? ", strided" : "");
        }
      } else {
        print(out, value, bs, indent + 8);
      }
      out += ",\n";
    });
    out += pad + "    },\n" + pad + "    batch_size=" + detail::shape_str(bs) + ")";
  }
};

// ---- A tensorclass's collectives: TensorDict's, with the structs converted --------------

// The struct a collective works on in place: passed as its dict, its fields rebound after.
template <class D>
struct InPlace {
  D& self;
};

// A struct (or list of structs) read on the root only, like TensorDict's `parts` and
// broadcast_dict's `value`: other ranks pass an empty dict (list) without converting theirs.
template <class T>
struct ReadOn {
  const T& value;
  bool here;
};

// This rank's rank in the call's group (-1 if it is not a member or nothing is initialised).
inline int rank_in(const CollectiveOptions& opts) {
  if (opts.group) return opts.group->rank();
  return is_initialized() ? get_rank() : -1;
}

template <class T>
ReadOn<T> read_on(int root, const CollectiveOptions& opts, const T& value) {
  return {value, rank_in(opts) == root};
}

// A result of TensorDict's function as the tensorclass returns it.
template <class D>
std::vector<Work> as_struct(std::vector<Work>&& works) {
  return std::move(works);
}
template <class D>
D as_struct(TensorDict&& d) {
  return D::from_tensordict(d);
}
template <class D>
std::vector<D> as_struct(std::vector<TensorDict>&& dicts) {
  std::vector<D> out;
  out.reserve(dicts.size());
  for (const TensorDict& d : dicts) out.push_back(D::from_tensordict(d));
  return out;
}

// How call_with_dicts passes one argument A (as deduced by a forwarding reference: T& for an
// lvalue, T for an rvalue) to TensorDict's function, and what
// it writes back when that succeeds. Anything that is not a struct passes through.
template <class D, class A>
struct DictArg {
  A&& value;
  DictArg(A&& v, std::exception_ptr&) : value(std::forward<A>(v)) {}
  A&& get() { return std::forward<A>(value); }
  void write_back() {}
};

// Converts a struct (or each of a list) to its dict; a conversion that throws (an undefined
// field, a shape off the batch size) is kept in `failed` and an empty dict (list) takes its
// place, so that this rank still joins the call and its peers fail instead of waiting for it.
template <class D, class In, class Out>
Out converted(const In& in, std::exception_ptr& failed) {
  try {
    if constexpr (std::is_same_v<In, D>) {
      return in.to_tensordict();
    } else {
      Out out;
      out.reserve(in.size());
      for (const D& x : in) out.push_back(x.to_tensordict());
      return out;
    }
  } catch (...) {
    if (!failed) failed = std::current_exception();
    return Out{};
  }
}

template <class D>
struct DictArg<D, const D&> {  // a struct read
  TensorDict dict;
  DictArg(const D& v, std::exception_ptr& failed) : dict(converted<D, D, TensorDict>(v, failed)) {}
  TensorDict& get() { return dict; }
  void write_back() {}
};
template <class D>
struct DictArg<D, const std::vector<D>&> {  // structs read
  std::vector<TensorDict> dicts;
  DictArg(const std::vector<D>& v, std::exception_ptr& failed)
      : dicts(converted<D, std::vector<D>, std::vector<TensorDict>>(v, failed)) {}
  std::vector<TensorDict>& get() { return dicts; }
  void write_back() {}
};
template <class D, class T>
struct DictArg<D, ReadOn<T>> {  // read on the root only
  using Dicts = std::conditional_t<std::is_same_v<T, D>, TensorDict, std::vector<TensorDict>>;
  Dicts dicts;
  DictArg(ReadOn<T> v, std::exception_ptr& failed)
      : dicts(v.here ? converted<D, T, Dicts>(v.value, failed) : Dicts{}) {}
  Dicts& get() { return dicts; }
  void write_back() {}
};
template <class D>
struct DictArg<D, InPlace<D>> {  // the struct the call writes
  D& self;
  TensorDict dict;
  DictArg(InPlace<D> v, std::exception_ptr& failed)
      : self(v.self), dict(converted<D, D, TensorDict>(v.self, failed)) {}
  TensorDict& get() { return dict; }
  void write_back() { TensorClassAccess::rebind(self, dict); }
};
template <class D>
struct DictArg<D, D&> {  // a struct the call fills (`out`)
  D& out;
  TensorDict dict;
  DictArg(D& v, std::exception_ptr&) : out(v) {}
  TensorDict& get() { return dict; }
  void write_back() { out = D::from_tensordict(dict); }
};
template <class D>
struct DictArg<D, std::vector<D>&> {  // structs the call fills (`out`)
  std::vector<D>& out;
  std::vector<TensorDict> dicts;
  DictArg(std::vector<D>& v, std::exception_ptr&) : out(v) {}
  std::vector<TensorDict>& get() { return dicts; }
  void write_back() { out = as_struct<D>(std::move(dicts)); }
};

// Calls fn (a TensorDict collective or transport function) with every struct argument passed as
// its dict, then writes the results back into the structs and returns fn's result as structs.
// A struct that cannot be converted is an empty dict in the call (see converted()): the peers
// get the call's error (a layout mismatch, a missing key) and this rank throws its own.
template <class D, class F, class... A>
auto call_with_dicts(F& fn, A&&... a) {
  std::exception_ptr failed;
  std::tuple<DictArg<D, A>...> args{DictArg<D, A>(std::forward<A>(a), failed)...};
  auto call = [&] { return std::apply([&](auto&... x) { return fn(x.get()...); }, args); };
  using R = decltype(call());
  if constexpr (std::is_void_v<R>) {
    try {
      call();
    } catch (...) {
      if (!failed) throw;
    }
    if (failed) std::rethrow_exception(failed);
    std::apply([](auto&... x) { (x.write_back(), ...); }, args);
  } else {
    std::optional<R> result;
    try {
      result.emplace(call());
    } catch (...) {
      if (!failed) throw;
    }
    if (failed) std::rethrow_exception(failed);
    std::apply([](auto&... x) { (x.write_back(), ...); }, args);
    return as_struct<D>(std::move(*result));
  }
}

}  // namespace detail

/// CRTP base of a tensorclass: a struct of td::Tensor fields and nested tensorclasses that
/// converts to and from a TensorDict (keys = field names, nested tensorclasses = sub-dicts) and
/// runs every TensorDict collective on its fields in place. Declare the fields once:
///
/// ```cpp
/// struct Obs : td::TensorClass<Obs> {
///   td::Tensor pixels, joints;
///   TD_TENSORCLASS_FIELDS(Obs, pixels, joints)
/// };
/// ```
///
/// Every member forwards to to_tensordict(), whose leaves share the fields' storage, so the
/// semantics (canonical sorted key order, layout agreement, bucketing, errors) are
/// TensorDict's. A field that is an undefined td::Tensor makes every operation but equal() and
/// printing throw td::Error naming it. See docs/tensorclass.md.
///
/// Collectives: every collective member of TensorDict, generated from the same list
/// (tensordict/dict_collectives.hpp), with the same parameters and defaults; a TensorDict in a
/// parameter or result is a struct of this type. all_reduce, reduce, broadcast, recv, irecv and
/// scatter write the fields in place (a field the collective replaces, such as a sparse one, is
/// rebound); the others are const. The transport functions (broadcast_dict, send_dict,
/// recv_dict<T>, all_gather_dicts, gather_dicts, scatter_dicts) take and return structs too. A
/// rank whose struct cannot be converted (an undefined field, a shape off the batch size) still
/// joins the call with an empty dict, so its peers fail (a layout mismatch or a missing key)
/// instead of waiting for it, and then throws its own error.
template <class Derived>
class TensorClass {
 public:
  /// The batch size (leading dimensions every field shares); empty by default. A nested
  /// tensorclass whose batch size is empty takes its parent's when converted.
  const Shape& batch_size() const noexcept { return batch_size_; }
  /// Sets the batch size, checked against the fields by the next conversion; returns *this.
  Derived& set_batch_size(Shape batch_size) {
    batch_size_ = std::move(batch_size);
    return derived();
  }

  /// The declared field names (the keys), in declaration order.
  static constexpr auto field_names() { return detail::TensorClassAccess::names<Derived>(); }

  /// A TensorDict whose leaves share the fields' storage (nested tensorclasses become
  /// sub-dicts), in declaration order. Throws td::Error naming an undefined field, and
  /// std::invalid_argument naming a field whose shape does not start with the batch size.
  TensorDict to_tensordict() const {
    return detail::TensorClassAccess::build(derived(), {}, "", Derived::td_tensorclass_name());
  }
  /// The tensorclass holding `d`'s leaves (sharing storage) and batch sizes. Throws td::KeyError
  /// naming a missing key, and td::Error naming a key that is not a field or that holds a tensor
  /// where the field is a tensorclass (or the reverse).
  static Derived from_tensordict(const TensorDict& d) {
    Derived out{};
    detail::TensorClassAccess::load(out, d, "", Derived::td_tensorclass_name());
    return out;
  }

  /// A copy whose fields are deep copies (members that are not fields are copied as they are).
  Derived clone() const {
    Derived out = derived();
    detail::TensorClassAccess::rebind(out, to_tensordict().clone());
    return out;
  }
  /// A copy with fn applied to every field; the results may change the batch size, as
  /// TensorDict::apply (members that are not fields are copied as they are).
  Derived apply(const std::function<Tensor(const Tensor&)>& fn) const {
    return with_dict(to_tensordict().apply(fn));
  }
  /// A copy with fn(field, other's same field) in every field (TensorDict::apply(fn, other)).
  Derived apply(const std::function<Tensor(const Tensor&, const Tensor&)>& fn,
                const Derived& other) const {
    return with_dict(to_tensordict().apply(fn, other.to_tensordict()));
  }
  /// Rows [start, stop) with `step` of every field, as views (TensorDict::slice).
  Derived slice(std::int64_t start, std::int64_t stop, std::int64_t step = 1) const {
    return with_dict(to_tensordict().slice(start, stop, step));
  }
  /// Views of consecutive groups of `rows` rows; the last may be shorter (TensorDict::split).
  std::vector<Derived> split(std::int64_t rows) const {
    std::vector<Derived> out;
    for (const TensorDict& d : to_tensordict().split(rows)) out.push_back(with_dict(d));
    return out;
  }
  /// In place, every field += alpha * other's same field (TensorDict::add_; checked first).
  Derived& add_(const Derived& other, double alpha = 1.0) {
    const TensorDict theirs = other.to_tensordict();
    in_place([&](TensorDict& d) {
      d.add_(theirs, alpha);
      return std::vector<Work>{};
    });
    return derived();
  }
  /// In place, every field *= factor (TensorDict::mul_).
  Derived& mul_(double factor) {
    in_place([&](TensorDict& d) {
      d.mul_(factor);
      return std::vector<Work>{};
    });
    return derived();
  }
  /// Sets every field to zero in place.
  Derived& zero_() {
    in_place([](TensorDict& d) {
      d.zero_();
      return std::vector<Work>{};
    });
    return derived();
  }
  /// TensorDict::consolidate(): every dense field becomes a view into one storage per dtype, so
  /// bucketed collectives need no pack copies. Tensors taken from the fields before still point
  /// to the old storage.
  Derived& consolidate() {
    in_place([](TensorDict& d) {
      d.consolidate();
      return std::vector<Work>{};
    });
    return derived();
  }
  /// Same batch size and equal fields (Tensor::equal; two undefined fields are equal). Members
  /// that are not fields are not compared.
  bool equal(const Derived& other) const {
    return detail::TensorClassAccess::equal(derived(), other, {}, {});
  }
  /// Same as equal().
  friend bool operator==(const Derived& a, const Derived& b) { return a.equal(b); }

  /// @cond
  // Every TensorDict collective (tensordict/dict_collectives.hpp), on the fields: see the class
  // comment.
  TD_DETAIL_DICT_COLLECTIVES(TD_DETAIL_TC_COLLECTIVE, Derived)
  /// @endcond

 private:
  friend struct detail::TensorClassAccess;

  Derived& derived() noexcept { return static_cast<Derived&>(*this); }
  const Derived& derived() const noexcept { return static_cast<const Derived&>(*this); }

  // The generated collectives' bodies: fn(dict of the fields, adapted arguments...) through
  // detail::call_with_dicts, the fields rebound to the result's leaves (in_place) or not (reads).
  template <class F>
  auto td_dict_call_in_place(F fn) {
    return [this, fn](auto&&... a) {
      return detail::call_with_dicts<Derived>(fn, detail::InPlace<Derived>{derived()},
                                              std::forward<decltype(a)>(a)...);
    };
  }
  template <class F>
  auto td_dict_call_reads(F fn) const {
    return [this, fn](auto&&... a) {
      return detail::call_with_dicts<Derived>(fn, derived(), std::forward<decltype(a)>(a)...);
    };
  }

  // Runs fn on a dict sharing the fields' storage, then points the fields at its leaves (a
  // collective may replace a leaf, e.g. a sparse one, rather than write into it).
  template <class F>
  std::vector<Work> in_place(F&& fn) {
    TensorDict d = to_tensordict();
    std::vector<Work> works = std::forward<F>(fn)(d);
    detail::TensorClassAccess::rebind(derived(), d);
    return works;
  }

  // A copy of this struct (members that are not fields included) holding `d`'s leaves and batch
  // sizes: what an operation that may change the batch size returns.
  Derived with_dict(const TensorDict& d) const {
    Derived out = derived();
    detail::TensorClassAccess::load(out, d, "", Derived::td_tensorclass_name());
    return out;
  }

  // Invariant: the batch size the struct was given, or empty (then a parent's applies).
  Shape batch_size_;
};

/// Generic code's conversion: a TensorDict is returned as a structure copy sharing storage.
inline TensorDict to_tensordict(const TensorDict& d) { return d; }
/// Generic code's conversion: same as x.to_tensordict().
template <TensorClassType T>
TensorDict to_tensordict(const T& x) {
  return x.to_tensordict();
}

// ---- Transport without a prior layout (transport.hpp), for tensorclasses: the struct type is
// known on every rank, its fields' dtypes and shapes need not be. A rank whose struct cannot be
// converted still takes part (its peers get an error naming the missing key), then throws.

/// td::broadcast_dict for a tensorclass: rank `src`'s struct on every rank of the group (`value`
/// is read on src only; other ranks may pass a default-constructed struct).
template <TensorClassType T>
T broadcast_dict(const T& value, int src, const CollectiveOptions& opts = {}) {
  auto call = [](auto&&... a) { return ::td::broadcast_dict(a...); };
  return detail::call_with_dicts<T>(call, detail::read_on(src, opts, value), src, opts);
}
/// td::send_dict for a tensorclass: the receiver calls recv_dict<T>() knowing only the type.
template <TensorClassType T>
void send_dict(const T& value, int dst, const CollectiveOptions& opts = {}) {
  auto call = [](auto&&... a) { ::td::send_dict(a...); };
  detail::call_with_dicts<T>(call, value, dst, opts);
}
/// td::recv_dict for a tensorclass: the struct rank `src` passes to send_dict(), whatever its
/// fields' dtypes and shapes (`td::recv_dict<Batch>(src)`).
template <TensorClassType T>
T recv_dict(int src, const CollectiveOptions& opts = {}) {
  auto call = [](auto&&... a) { return ::td::recv_dict(a...); };
  return detail::call_with_dicts<T>(call, src, opts);
}
/// td::all_gather_dicts for a tensorclass: every rank's struct ([r] is rank r's); their fields'
/// dtypes and shapes may differ per rank.
template <TensorClassType T>
std::vector<T> all_gather_dicts(const T& value, const CollectiveOptions& opts = {}) {
  auto call = [](auto&&... a) { return ::td::all_gather_dicts(a...); };
  return detail::call_with_dicts<T>(call, value, opts);
}
/// td::gather_dicts for a tensorclass: every rank's struct on `dst`; empty on other ranks.
template <TensorClassType T>
std::vector<T> gather_dicts(const T& value, int dst, const CollectiveOptions& opts = {}) {
  auto call = [](auto&&... a) { return ::td::gather_dicts(a...); };
  return detail::call_with_dicts<T>(call, value, dst, opts);
}
/// td::scatter_dicts for a tensorclass: on `src`, parts[r] goes to rank r (`parts` is read on
/// src only); returns this rank's struct.
template <TensorClassType T>
T scatter_dicts(const std::vector<T>& parts, int src, const CollectiveOptions& opts = {}) {
  auto call = [](auto&&... a) { return ::td::scatter_dicts(a...); };
  return detail::call_with_dicts<T>(call, detail::read_on(src, opts, parts), src, opts);
}

/// The structs concatenated along batch dimension `dim` into new storage (td::cat of their
/// dicts); members that are not fields are copied from xs[0].
template <TensorClassType T>
T cat(const std::vector<T>& xs, std::int64_t dim = 0) {
  std::vector<TensorDict> dicts;
  dicts.reserve(xs.size());
  for (const T& x : xs) dicts.push_back(x.to_tensordict());
  const TensorDict joined = cat(dicts, dim);  // throws for an empty list before xs[0] is read
  T out = xs[0];
  detail::TensorClassAccess::load(out, joined, "", T::td_tensorclass_name());
  return out;
}
/// A copy whose fields are new zero tensors of the same dtypes and shapes.
template <TensorClassType T>
T zeros_like(const T& x) {
  T out = x;
  detail::TensorClassAccess::rebind(out, zeros_like(x.to_tensordict()));
  return out;
}
/// td::allclose of the two structs' dicts.
template <TensorClassType T>
bool allclose(const T& a, const T& b, double rtol = 1e-5, double atol = 1e-8) {
  return allclose(a.to_tensordict(), b.to_tensordict(), rtol, atol);
}

/// Prints the struct's fields (shapes and dtypes) in declaration order, like TensorDict's
/// to_string() with the struct names.
template <TensorClassType T>
std::string to_string(const T& x) {
  std::string out;
  detail::TensorClassAccess::print(out, x, {}, 0);
  return out;
}
/// Prints like to_string().
template <TensorClassType T>
std::ostream& operator<<(std::ostream& os, const T& x) {
  return os << to_string(x);
}

}  // namespace td

/// Declares the fields of a tensorclass, inside its body: `TD_TENSORCLASS_FIELDS(Type, f1, f2)`
/// with 1 to 64 data members of Type, each a td::Tensor or a tensorclass. Each name becomes a key.
/// Expands to public static members named td_tensorclass_*, and leaves the access `public`.
#define TD_TENSORCLASS_FIELDS(Type, ...)                                                  \
 public:                                                                                  \
  static constexpr std::string_view td_tensorclass_name() noexcept { return #Type; }      \
  static constexpr auto td_tensorclass_fields() noexcept {                                \
    return std::make_tuple(TD_DETAIL_TC_FOR_EACH(TD_DETAIL_TC_FIELD, Type, __VA_ARGS__)); \
  }

/// @cond
#define TD_DETAIL_TC_FIELD(Type, field) ::td::detail::tensorclass_field(#field, &Type::field)
#define TD_DETAIL_TC_TOO_MANY_FIELDS(m, t, ...) TD_TENSORCLASS_FIELDS_takes_at_most_64_fields
// clang-format off
// FE_n applies m(t, x) to n fields, comma separated; PICK selects FE_n by counting the fields.
#define TD_DETAIL_TC_FE_1(m, t, x) m(t, x)
#define TD_DETAIL_TC_FE_2(m, t, x, ...) m(t, x), TD_DETAIL_TC_FE_1(m, t, __VA_ARGS__)
#define TD_DETAIL_TC_FE_3(m, t, x, ...) m(t, x), TD_DETAIL_TC_FE_2(m, t, __VA_ARGS__)
#define TD_DETAIL_TC_FE_4(m, t, x, ...) m(t, x), TD_DETAIL_TC_FE_3(m, t, __VA_ARGS__)
#define TD_DETAIL_TC_FE_5(m, t, x, ...) m(t, x), TD_DETAIL_TC_FE_4(m, t, __VA_ARGS__)
#define TD_DETAIL_TC_FE_6(m, t, x, ...) m(t, x), TD_DETAIL_TC_FE_5(m, t, __VA_ARGS__)
#define TD_DETAIL_TC_FE_7(m, t, x, ...) m(t, x), TD_DETAIL_TC_FE_6(m, t, __VA_ARGS__)
#define TD_DETAIL_TC_FE_8(m, t, x, ...) m(t, x), TD_DETAIL_TC_FE_7(m, t, __VA_ARGS__)
#define TD_DETAIL_TC_FE_9(m, t, x, ...) m(t, x), TD_DETAIL_TC_FE_8(m, t, __VA_ARGS__)
#define TD_DETAIL_TC_FE_10(m, t, x, ...) m(t, x), TD_DETAIL_TC_FE_9(m, t, __VA_ARGS__)
#define TD_DETAIL_TC_FE_11(m, t, x, ...) m(t, x), TD_DETAIL_TC_FE_10(m, t, __VA_ARGS__)
#define TD_DETAIL_TC_FE_12(m, t, x, ...) m(t, x), TD_DETAIL_TC_FE_11(m, t, __VA_ARGS__)
#define TD_DETAIL_TC_FE_13(m, t, x, ...) m(t, x), TD_DETAIL_TC_FE_12(m, t, __VA_ARGS__)
#define TD_DETAIL_TC_FE_14(m, t, x, ...) m(t, x), TD_DETAIL_TC_FE_13(m, t, __VA_ARGS__)
#define TD_DETAIL_TC_FE_15(m, t, x, ...) m(t, x), TD_DETAIL_TC_FE_14(m, t, __VA_ARGS__)
#define TD_DETAIL_TC_FE_16(m, t, x, ...) m(t, x), TD_DETAIL_TC_FE_15(m, t, __VA_ARGS__)
#define TD_DETAIL_TC_FE_17(m, t, x, ...) m(t, x), TD_DETAIL_TC_FE_16(m, t, __VA_ARGS__)
#define TD_DETAIL_TC_FE_18(m, t, x, ...) m(t, x), TD_DETAIL_TC_FE_17(m, t, __VA_ARGS__)
#define TD_DETAIL_TC_FE_19(m, t, x, ...) m(t, x), TD_DETAIL_TC_FE_18(m, t, __VA_ARGS__)
#define TD_DETAIL_TC_FE_20(m, t, x, ...) m(t, x), TD_DETAIL_TC_FE_19(m, t, __VA_ARGS__)
#define TD_DETAIL_TC_FE_21(m, t, x, ...) m(t, x), TD_DETAIL_TC_FE_20(m, t, __VA_ARGS__)
#define TD_DETAIL_TC_FE_22(m, t, x, ...) m(t, x), TD_DETAIL_TC_FE_21(m, t, __VA_ARGS__)
#define TD_DETAIL_TC_FE_23(m, t, x, ...) m(t, x), TD_DETAIL_TC_FE_22(m, t, __VA_ARGS__)
#define TD_DETAIL_TC_FE_24(m, t, x, ...) m(t, x), TD_DETAIL_TC_FE_23(m, t, __VA_ARGS__)
#define TD_DETAIL_TC_FE_25(m, t, x, ...) m(t, x), TD_DETAIL_TC_FE_24(m, t, __VA_ARGS__)
#define TD_DETAIL_TC_FE_26(m, t, x, ...) m(t, x), TD_DETAIL_TC_FE_25(m, t, __VA_ARGS__)
#define TD_DETAIL_TC_FE_27(m, t, x, ...) m(t, x), TD_DETAIL_TC_FE_26(m, t, __VA_ARGS__)
#define TD_DETAIL_TC_FE_28(m, t, x, ...) m(t, x), TD_DETAIL_TC_FE_27(m, t, __VA_ARGS__)
#define TD_DETAIL_TC_FE_29(m, t, x, ...) m(t, x), TD_DETAIL_TC_FE_28(m, t, __VA_ARGS__)
#define TD_DETAIL_TC_FE_30(m, t, x, ...) m(t, x), TD_DETAIL_TC_FE_29(m, t, __VA_ARGS__)
#define TD_DETAIL_TC_FE_31(m, t, x, ...) m(t, x), TD_DETAIL_TC_FE_30(m, t, __VA_ARGS__)
#define TD_DETAIL_TC_FE_32(m, t, x, ...) m(t, x), TD_DETAIL_TC_FE_31(m, t, __VA_ARGS__)
#define TD_DETAIL_TC_FE_33(m, t, x, ...) m(t, x), TD_DETAIL_TC_FE_32(m, t, __VA_ARGS__)
#define TD_DETAIL_TC_FE_34(m, t, x, ...) m(t, x), TD_DETAIL_TC_FE_33(m, t, __VA_ARGS__)
#define TD_DETAIL_TC_FE_35(m, t, x, ...) m(t, x), TD_DETAIL_TC_FE_34(m, t, __VA_ARGS__)
#define TD_DETAIL_TC_FE_36(m, t, x, ...) m(t, x), TD_DETAIL_TC_FE_35(m, t, __VA_ARGS__)
#define TD_DETAIL_TC_FE_37(m, t, x, ...) m(t, x), TD_DETAIL_TC_FE_36(m, t, __VA_ARGS__)
#define TD_DETAIL_TC_FE_38(m, t, x, ...) m(t, x), TD_DETAIL_TC_FE_37(m, t, __VA_ARGS__)
#define TD_DETAIL_TC_FE_39(m, t, x, ...) m(t, x), TD_DETAIL_TC_FE_38(m, t, __VA_ARGS__)
#define TD_DETAIL_TC_FE_40(m, t, x, ...) m(t, x), TD_DETAIL_TC_FE_39(m, t, __VA_ARGS__)
#define TD_DETAIL_TC_FE_41(m, t, x, ...) m(t, x), TD_DETAIL_TC_FE_40(m, t, __VA_ARGS__)
#define TD_DETAIL_TC_FE_42(m, t, x, ...) m(t, x), TD_DETAIL_TC_FE_41(m, t, __VA_ARGS__)
#define TD_DETAIL_TC_FE_43(m, t, x, ...) m(t, x), TD_DETAIL_TC_FE_42(m, t, __VA_ARGS__)
#define TD_DETAIL_TC_FE_44(m, t, x, ...) m(t, x), TD_DETAIL_TC_FE_43(m, t, __VA_ARGS__)
#define TD_DETAIL_TC_FE_45(m, t, x, ...) m(t, x), TD_DETAIL_TC_FE_44(m, t, __VA_ARGS__)
#define TD_DETAIL_TC_FE_46(m, t, x, ...) m(t, x), TD_DETAIL_TC_FE_45(m, t, __VA_ARGS__)
#define TD_DETAIL_TC_FE_47(m, t, x, ...) m(t, x), TD_DETAIL_TC_FE_46(m, t, __VA_ARGS__)
#define TD_DETAIL_TC_FE_48(m, t, x, ...) m(t, x), TD_DETAIL_TC_FE_47(m, t, __VA_ARGS__)
#define TD_DETAIL_TC_FE_49(m, t, x, ...) m(t, x), TD_DETAIL_TC_FE_48(m, t, __VA_ARGS__)
#define TD_DETAIL_TC_FE_50(m, t, x, ...) m(t, x), TD_DETAIL_TC_FE_49(m, t, __VA_ARGS__)
#define TD_DETAIL_TC_FE_51(m, t, x, ...) m(t, x), TD_DETAIL_TC_FE_50(m, t, __VA_ARGS__)
#define TD_DETAIL_TC_FE_52(m, t, x, ...) m(t, x), TD_DETAIL_TC_FE_51(m, t, __VA_ARGS__)
#define TD_DETAIL_TC_FE_53(m, t, x, ...) m(t, x), TD_DETAIL_TC_FE_52(m, t, __VA_ARGS__)
#define TD_DETAIL_TC_FE_54(m, t, x, ...) m(t, x), TD_DETAIL_TC_FE_53(m, t, __VA_ARGS__)
#define TD_DETAIL_TC_FE_55(m, t, x, ...) m(t, x), TD_DETAIL_TC_FE_54(m, t, __VA_ARGS__)
#define TD_DETAIL_TC_FE_56(m, t, x, ...) m(t, x), TD_DETAIL_TC_FE_55(m, t, __VA_ARGS__)
#define TD_DETAIL_TC_FE_57(m, t, x, ...) m(t, x), TD_DETAIL_TC_FE_56(m, t, __VA_ARGS__)
#define TD_DETAIL_TC_FE_58(m, t, x, ...) m(t, x), TD_DETAIL_TC_FE_57(m, t, __VA_ARGS__)
#define TD_DETAIL_TC_FE_59(m, t, x, ...) m(t, x), TD_DETAIL_TC_FE_58(m, t, __VA_ARGS__)
#define TD_DETAIL_TC_FE_60(m, t, x, ...) m(t, x), TD_DETAIL_TC_FE_59(m, t, __VA_ARGS__)
#define TD_DETAIL_TC_FE_61(m, t, x, ...) m(t, x), TD_DETAIL_TC_FE_60(m, t, __VA_ARGS__)
#define TD_DETAIL_TC_FE_62(m, t, x, ...) m(t, x), TD_DETAIL_TC_FE_61(m, t, __VA_ARGS__)
#define TD_DETAIL_TC_FE_63(m, t, x, ...) m(t, x), TD_DETAIL_TC_FE_62(m, t, __VA_ARGS__)
#define TD_DETAIL_TC_FE_64(m, t, x, ...) m(t, x), TD_DETAIL_TC_FE_63(m, t, __VA_ARGS__)
#define TD_DETAIL_TC_PICK(_1, _2, _3, _4, _5, _6, _7, _8, _9, _10, _11, _12, _13, _14, _15, _16, _17, _18, _19, _20, _21, _22, _23, _24, _25, _26, _27, _28, _29, _30, _31, _32, _33, _34, _35, _36, _37, _38, _39, _40, _41, _42, _43, _44, _45, _46, _47, _48, _49, _50, _51, _52, _53, _54, _55, _56, _57, _58, _59, _60, _61, _62, _63, _64, _65, name, ...) name
#define TD_DETAIL_TC_FOR_EACH(m, t, ...) TD_DETAIL_TC_PICK(__VA_ARGS__, TD_DETAIL_TC_TOO_MANY_FIELDS, TD_DETAIL_TC_FE_64, TD_DETAIL_TC_FE_63, TD_DETAIL_TC_FE_62, TD_DETAIL_TC_FE_61, TD_DETAIL_TC_FE_60, TD_DETAIL_TC_FE_59, TD_DETAIL_TC_FE_58, TD_DETAIL_TC_FE_57, TD_DETAIL_TC_FE_56, TD_DETAIL_TC_FE_55, TD_DETAIL_TC_FE_54, TD_DETAIL_TC_FE_53, TD_DETAIL_TC_FE_52, TD_DETAIL_TC_FE_51, TD_DETAIL_TC_FE_50, TD_DETAIL_TC_FE_49, TD_DETAIL_TC_FE_48, TD_DETAIL_TC_FE_47, TD_DETAIL_TC_FE_46, TD_DETAIL_TC_FE_45, TD_DETAIL_TC_FE_44, TD_DETAIL_TC_FE_43, TD_DETAIL_TC_FE_42, TD_DETAIL_TC_FE_41, TD_DETAIL_TC_FE_40, TD_DETAIL_TC_FE_39, TD_DETAIL_TC_FE_38, TD_DETAIL_TC_FE_37, TD_DETAIL_TC_FE_36, TD_DETAIL_TC_FE_35, TD_DETAIL_TC_FE_34, TD_DETAIL_TC_FE_33, TD_DETAIL_TC_FE_32, TD_DETAIL_TC_FE_31, TD_DETAIL_TC_FE_30, TD_DETAIL_TC_FE_29, TD_DETAIL_TC_FE_28, TD_DETAIL_TC_FE_27, TD_DETAIL_TC_FE_26, TD_DETAIL_TC_FE_25, TD_DETAIL_TC_FE_24, TD_DETAIL_TC_FE_23, TD_DETAIL_TC_FE_22, TD_DETAIL_TC_FE_21, TD_DETAIL_TC_FE_20, TD_DETAIL_TC_FE_19, TD_DETAIL_TC_FE_18, TD_DETAIL_TC_FE_17, TD_DETAIL_TC_FE_16, TD_DETAIL_TC_FE_15, TD_DETAIL_TC_FE_14, TD_DETAIL_TC_FE_13, TD_DETAIL_TC_FE_12, TD_DETAIL_TC_FE_11, TD_DETAIL_TC_FE_10, TD_DETAIL_TC_FE_9, TD_DETAIL_TC_FE_8, TD_DETAIL_TC_FE_7, TD_DETAIL_TC_FE_6, TD_DETAIL_TC_FE_5, TD_DETAIL_TC_FE_4, TD_DETAIL_TC_FE_3, TD_DETAIL_TC_FE_2, TD_DETAIL_TC_FE_1)(m, t, __VA_ARGS__)
// clang-format on

// fmt::format("{}", batch) prints like td::to_string(batch).
template <class T>
struct fmt::formatter<T, char, std::enable_if_t<td::is_tensorclass_v<T>>>
    : fmt::formatter<std::string> {
  template <class FormatContext>
  auto format(const T& x, FormatContext& ctx) const {
    return fmt::formatter<std::string>::format(td::to_string(x), ctx);
  }
};
/// @endcond
