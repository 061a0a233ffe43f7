// TensorDict send / recv, all_gather / gather, scatter and reduce_scatter, against values every
// rank computes locally.
#include <catch2/catch.hpp>

#include <optional>
#include <stdexcept>
#include <vector>

#include <tensordict/tensordict.hpp>

#include "reference.hpp"

using td::DType;
using td::Key;
using td::ReduceOp;
using td::Tensor;
using td::TensorDict;

namespace {

constexpr std::int64_t kRows = 12;  // divisible by every group size from 1 to 4

struct Spec {
  Key key;
  DType dtype;
  td::Shape shape;
  bool transposed;  // stored as a transposed (non-contiguous) view
  int id;
};

// Every leaf starts with kRows (the dict's batch size); nested keys, a non-contiguous leaf and a
// leaf without elements.
std::vector<Spec> specs(bool floats_only = false) {
  std::vector<Spec> s = {
      {Key("w"), DType::Float32, {kRows, 3}, false, 0},
      {Key({"nested", "deep", "t"}), DType::Float64, {kRows, 5}, true, 2},
      {Key({"nested", "empty"}), DType::Float32, {kRows, 0}, false, 3},
      {Key("bias"), DType::Float64, {kRows}, false, 5},
  };
  if (!floats_only) {
    s.push_back({Key({"nested", "b"}), DType::Int64, {kRows}, false, 1});
    s.push_back({Key({"nested", "count"}), DType::Int32, {kRows, 2}, false, 4});
  }
  return s;
}

// Element i (row-major) of leaf `id` of the dict of "rank" `who`: small integers, exact in every
// dtype used, so sums and averages compare exactly.
double value(int who, int id, std::int64_t i) {
  return who * 1000.0 + id * 100.0 + static_cast<double>(i);
}

Tensor make_leaf(const Spec& s, int who) {
  return td::visit(s.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    Tensor t;
    if (s.transposed) {
      t = Tensor::empty({s.shape[1], s.shape[0]}, s.dtype).transpose(0, 1);
    } else {
      t = Tensor::empty(s.shape, s.dtype);
    }
    if constexpr (std::is_arithmetic_v<T>) {
      std::vector<T> v(static_cast<std::size_t>(td::detail::shape_numel_for_test(s.shape)));
      for (std::size_t i = 0; i < v.size(); ++i)
        v[i] = static_cast<T>(value(who, s.id, static_cast<std::int64_t>(i)));
      t.copy_(Tensor::from_vector<T>(v, s.shape));
    }
    return t;
  });
}

// Rank `who`'s dict; keys are inserted in an order that depends on `who`.
TensorDict make_dict(int who, bool floats_only = false) {
  auto ss = specs(floats_only);
  if (who % 2) std::reverse(ss.begin(), ss.end());
  TensorDict d({kRows});
  for (const auto& s : ss) d.set(s.key, make_leaf(s, who));
  return d;
}

// Whether leaf `s` of `d` holds f(i) at every logical position i, with the given shape.
template <class F>
bool holds(const TensorDict& d, const Spec& s, const td::Shape& shape, F&& f) {
  const Tensor& t = d.get(s.key);
  if (t.dtype() != s.dtype || t.shape() != shape) return false;
  return td::visit(s.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    if constexpr (std::is_arithmetic_v<T>) {
      const auto v = t.to_vector<T>();
      for (std::size_t i = 0; i < v.size(); ++i)
        if (static_cast<double>(v[i]) != f(static_cast<std::int64_t>(i))) return false;
      return true;
    } else {
      return false;
    }
  });
}

// Whether `d` is exactly `who`'s dict.
bool is_dict_of(const TensorDict& d, int who, bool floats_only = false) {
  const auto ss = specs(floats_only);
  if (d.canonical_leaves().size() != ss.size()) return false;
  if (d.batch_size() != td::Shape{kRows}) return false;
  for (const auto& s : ss)
    if (!holds(d, s, s.shape, [&](std::int64_t i) { return value(who, s.id, i); })) return false;
  return true;
}

struct Variant {
  bool async_op;
  std::optional<std::size_t> bucket_bytes;
};
const Variant kVariants[] = {{false, std::nullopt}, {false, 256}, {true, std::nullopt}, {true, 256}};

td::CollectiveOptions options(const Variant& v, std::optional<td::ProcessGroup> group = {}) {
  td::CollectiveOptions o;
  o.async_op = v.async_op;
  o.bucket_bytes = v.bucket_bytes;
  o.group = std::move(group);
  return o;
}

}  // namespace
