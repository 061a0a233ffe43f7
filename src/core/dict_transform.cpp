// What TensorDict computes from its leaves without MPI, as Python tensordict has it: apply (one
// dict or two), views along the batch dimension (slice, split), td::cat, in-place arithmetic
// (add_, mul_), zeros_like and allclose. Every operation checks all its leaves before it builds or
// changes anything, so bad input throws and leaves the dicts as they were.
#include <algorithm>
#include <cmath>
#include <complex>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "core/dict_internal.hpp"
#include "tensordict/tensor_dict.hpp"

namespace td {

namespace {

using detail::shape_str;

bool starts_with(const Shape& shape, const Shape& prefix) {
  return shape.size() >= prefix.size() && std::equal(prefix.begin(), prefix.end(), shape.begin());
}

Shape prefix_of(const Shape& s, std::size_t n) {
  return {s.begin(), s.begin() + static_cast<std::ptrdiff_t>(n)};
}

using LeafFn = std::function<Tensor(const Key&, const Tensor&)>;

bool has_leaves(const TensorDict& d) { return !d.keys(true, true).empty(); }

// `d` (a dict without leaves anywhere below it) with its leading batch dimensions replaced by
// `prefix`, the new batch size of its parent, which had `parent_dims` batch dimensions.
TensorDict rebase_empty(const TensorDict& d, const Shape& prefix, std::size_t parent_dims) {
  Shape bs = prefix;
  bs.insert(bs.end(), d.batch_size().begin() + static_cast<std::ptrdiff_t>(parent_dims),
            d.batch_size().end());
  TensorDict out(bs);
  for (const Key& k : d.keys()) out.set(k, rebase_empty(d.get_dict(k), bs, d.batch_size().size()));
  return out;
}

// The dict of f(key, leaf) for every leaf of `d` (same structure, insertion order). Each dict of
// the result keeps its number of batch dimensions and takes their sizes from its results (its
// leaves' and its non-empty sub-dicts'), which must agree; a dict without leaves below it follows
// its parent.
TensorDict map_leaves(const TensorDict& d, std::vector<std::string>& prefix, const LeafFn& f,
                      std::string_view what) {
  const std::size_t n = d.batch_size().size();
  struct Result {
    std::string name;
    Tensor leaf;
    TensorDict sub;
    bool is_dict = false;
  };
  std::vector<Result> results;
  std::optional<Shape> bs;
  std::string from;  // the key whose result gave `bs`
  for (const Key& k : d.keys()) {
    const std::string& name = k.parts()[0];
    prefix.push_back(name);
    const Key full(prefix);
    Result r{name, {}, TensorDict(), d.is_dict(k)};
    if (r.is_dict) {
      r.sub = map_leaves(d.get_dict(k), prefix, f, what);
      if (has_leaves(r.sub) && !bs) {
        bs = prefix_of(r.sub.batch_size(), n);
        from = full.str();
      }
    } else {
      r.leaf = f(full, d.get(k));
      if (!r.leaf.defined())
        throw std::invalid_argument(
            fmt::format("{}: fn returned an undefined tensor for key '{}'", what, full.str()));
      if (r.leaf.shape().size() < n)
        throw std::invalid_argument(fmt::format(
            "{}: fn returned a tensor of shape {} for key '{}', which has fewer dimensions than "
            "its dict's batch size {}",
            what, shape_str(r.leaf.shape()), full.str(), shape_str(d.batch_size())));
      if (!bs) {
        bs = prefix_of(r.leaf.shape(), n);
        from = full.str();
      }
    }
    prefix.pop_back();
    results.push_back(std::move(r));
  }
  const Shape new_bs = bs.value_or(d.batch_size());
  TensorDict out(new_bs);
  for (Result& r : results) {
    prefix.push_back(r.name);
    const Key full(prefix);
    prefix.pop_back();
    const Shape& got = r.is_dict ? r.sub.batch_size() : r.leaf.shape();
    if (r.is_dict && !has_leaves(r.sub)) {
      out.set(Key(r.name), rebase_empty(r.sub, new_bs, n));
      continue;
    }
    if (!starts_with(got, new_bs))
      throw std::invalid_argument(fmt::format(
          "{}: fn's result for key '{}' has {} {}, which does not start with the batch size {} "
          "that the result for key '{}' gives (the results of one dict share its batch "
          "dimensions)",
          what, full.str(), r.is_dict ? "batch size" : "shape", shape_str(got), shape_str(new_bs),
          from));
    if (r.is_dict) {
      out.set(Key(r.name), std::move(r.sub));
    } else {
      out.set(Key(r.name), std::move(r.leaf));
    }
  }
  return out;
}

TensorDict map_leaves(const TensorDict& d, const LeafFn& f, std::string_view what) {
  std::vector<std::string> prefix;
  return map_leaves(d, prefix, f, what);
}

// td::LayoutMismatchError unless `a` and `b` have the same leaf keys; names the first key that
// one of them lacks.
void check_same_keys(const TensorDict& a, const TensorDict& b, std::string_view what,
                     std::string_view a_name, std::string_view b_name) {
  const auto& la = detail::DictAccess::canonical(a);
  const auto& lb = detail::DictAccess::canonical(b);
  for (std::size_t i = 0; i < std::max(la.size(), lb.size()); ++i) {
    if (i < la.size() && i < lb.size() && *la[i].key == *lb[i].key) continue;
    if (i >= lb.size() || (i < la.size() && *la[i].key < *lb[i].key))
      throw LayoutMismatchError(fmt::format("{}: {} has no key '{}' (it needs the keys of {})",
                                            what, b_name, la[i].key->str(), a_name));
    throw LayoutMismatchError(fmt::format("{}: {} has key '{}', which {} does not have", what,
                                          b_name, lb[i].key->str(), a_name));
  }
}

// Whether `x` is an integer an int64 holds.
bool integral_value(double x) {
  return std::isfinite(x) && std::floor(x) == x && std::abs(x) < 9.2e18;
}

// y = beta * y + alpha * x elementwise (x null: y = beta * y), in y's C++ type.
template <class T>
void scale_add(T* y, const T* x, std::int64_t n, double beta, double alpha) {
  if constexpr (std::is_same_v<T, bool>) {
    (void)y, (void)x, (void)n, (void)beta, (void)alpha;  // refused before
  } else if constexpr (std::is_integral_v<T>) {
    const auto b = static_cast<std::int64_t>(beta);
    const auto a = static_cast<std::int64_t>(alpha);
    for (std::int64_t i = 0; i < n; ++i)
      y[i] = static_cast<T>(b * static_cast<std::int64_t>(y[i]) +
                            (x ? a * static_cast<std::int64_t>(x[i]) : 0));
  } else if constexpr (std::is_same_v<T, Eigen::half> || std::is_same_v<T, Eigen::bfloat16>) {
    const auto b = static_cast<float>(beta);
    const auto a = static_cast<float>(alpha);
    for (std::int64_t i = 0; i < n; ++i)
      y[i] =
          static_cast<T>(b * static_cast<float>(y[i]) + (x ? a * static_cast<float>(x[i]) : 0.f));
  } else if constexpr (std::is_floating_point_v<T>) {
    const auto b = static_cast<T>(beta);
    const auto a = static_cast<T>(alpha);
    if (x) {
      for (std::int64_t i = 0; i < n; ++i) y[i] = b * y[i] + a * x[i];
    } else {
      for (std::int64_t i = 0; i < n; ++i) y[i] *= b;
    }
  } else {  // complex
    using R = typename T::value_type;
    const auto b = static_cast<R>(beta);
    const auto a = static_cast<R>(alpha);
    for (std::int64_t i = 0; i < n; ++i) y[i] = b * y[i] + (x ? a * x[i] : T{});
  }
}

// y = beta * y + alpha * x on one leaf, any strides (a strided leaf is computed on a contiguous
// copy and written back).
void scale_add_leaf(Tensor& y, const Tensor* x, double beta, double alpha) {
  Tensor yc = y.contiguous();
  const Tensor xc = x ? x->contiguous() : Tensor();
  visit(y.dtype(), [&](auto tag) {
    using T = typename decltype(tag)::type;
    scale_add(yc.data<T>(), x ? xc.data<T>() : nullptr, yc.numel(), beta, alpha);
  });
  if (!y.is_contiguous()) y.copy_(yc);
}

// Why `factor` cannot scale leaf `t` at `key` ("" if it can).
std::string scalar_problem(const Key& key, const Tensor& t, double factor, std::string_view arg) {
  if (t.is_sparse()) return fmt::format("key '{}' is a sparse tensor", key.str());
  if (t.dtype() == DType::Bool) return fmt::format("key '{}' is a bool tensor", key.str());
  if (is_integral(t.dtype()) && !integral_value(factor))
    return fmt::format("key '{}' is {}, and {} {} is not an integer", key.str(), name(t.dtype()),
                       arg, factor);
  return {};
}

// The elements of `t` as complex<double> (exact for every dtype but large int64 values).
std::vector<std::complex<double>> values_of(const Tensor& t) {
  return visit(t.dtype(), [&](auto tag) {
    using T = typename decltype(tag)::type;
    std::vector<std::complex<double>> out;
    const auto v = t.to_vector<T>();
    out.reserve(v.size());
    for (const auto& x : v) {
      if constexpr (std::is_same_v<T, std::complex<float>> ||
                    std::is_same_v<T, std::complex<double>>) {
        out.emplace_back(static_cast<double>(x.real()), static_cast<double>(x.imag()));
      } else if constexpr (std::is_same_v<T, Eigen::half> || std::is_same_v<T, Eigen::bfloat16>) {
        out.emplace_back(static_cast<double>(static_cast<float>(x)), 0.0);
      } else {
        out.emplace_back(static_cast<double>(x), 0.0);
      }
    }
    return out;
  });
}

}  // namespace

TensorDict TensorDict::apply(const std::function<Tensor(const Tensor&)>& fn) const {
  return map_leaves(
      *this, [&fn](const Key&, const Tensor& t) { return fn(t); }, "TensorDict.apply");
}

TensorDict TensorDict::apply(const std::function<Tensor(const Tensor&, const Tensor&)>& fn,
                             const TensorDict& other) const {
  check_same_keys(*this, other, "TensorDict.apply(fn, other)", "this dict", "other");
  return map_leaves(
      *this, [&](const Key& k, const Tensor& t) { return fn(t, other.get(k)); },
      "TensorDict.apply(fn, other)");
}

TensorDict TensorDict::slice(std::int64_t start, std::int64_t stop, std::int64_t step) const {
  const Shape& bs = batch_size();
  if (bs.empty())
    throw std::invalid_argument(
        "TensorDict.slice: the batch size is [], so there is no batch dimension to slice (build "
        "the dict with one: TensorDict({rows}))");
  if (step <= 0)
    throw std::invalid_argument(fmt::format("TensorDict.slice: step {} must be positive", step));
  for (const auto& ref : detail::DictAccess::canonical(*this))
    if (ref.tensor->is_sparse())
      throw std::invalid_argument(fmt::format(
          "TensorDict.slice: key '{}' is a sparse tensor, which has no row views (to_dense() it "
          "or exclude() it first)",
          ref.key->str()));
  return map_leaves(
      *this, [&](const Key&, const Tensor& t) { return t.slice(0, start, stop, step); },
      "TensorDict.slice");
}

std::vector<TensorDict> TensorDict::split(std::int64_t rows) const {
  if (rows <= 0)
    throw std::invalid_argument(
        fmt::format("TensorDict.split: rows {} must be positive (the rows of each part)", rows));
  if (batch_size().empty())
    throw std::invalid_argument(
        "TensorDict.split: the batch size is [], so there is no batch dimension to split");
  const std::int64_t n = batch_size()[0];
  std::vector<TensorDict> parts;
  if (n == 0) parts.push_back(slice(0, 0));
  for (std::int64_t start = 0; start < n; start += rows)
    parts.push_back(slice(start, std::min(n, start + rows)));
  return parts;
}

TensorDict& TensorDict::add_(const TensorDict& other, double alpha) {
  constexpr std::string_view what = "TensorDict.add_";
  check_same_keys(*this, other, what, "this dict", "other");
  const auto& mine = detail::DictAccess::canonical(*this);
  const auto& theirs = detail::DictAccess::canonical(other);
  for (std::size_t i = 0; i < mine.size(); ++i) {
    const Tensor& y = *mine[i].tensor;
    const Tensor& x = *theirs[i].tensor;
    if (y.dtype() != x.dtype() || y.shape() != x.shape())
      throw LayoutMismatchError(fmt::format(
          "{}: key '{}' is {}{} here and {}{} in other (add_ needs the same dtype and shape)", what,
          mine[i].key->str(), name(y.dtype()), shape_str(y.shape()), name(x.dtype()),
          shape_str(x.shape())));
    std::string problem = scalar_problem(*mine[i].key, y, alpha, "alpha");
    if (problem.empty() && x.is_sparse())
      problem = fmt::format("key '{}' is a sparse tensor in other", mine[i].key->str());
    if (!problem.empty()) throw std::invalid_argument(fmt::format("{}: {}", what, problem));
  }
  for (std::size_t i = 0; i < mine.size(); ++i)
    scale_add_leaf(*mine[i].tensor, theirs[i].tensor, 1.0, alpha);
  return *this;
}

TensorDict& TensorDict::mul_(double factor) {
  const auto& leaves = detail::DictAccess::canonical(*this);
  for (const auto& ref : leaves) {
    const std::string problem = scalar_problem(*ref.key, *ref.tensor, factor, "factor");
    if (!problem.empty()) throw std::invalid_argument(fmt::format("TensorDict.mul_: {}", problem));
  }
  for (const auto& ref : leaves) scale_add_leaf(*ref.tensor, nullptr, factor, 0.0);
  return *this;
}

namespace {

struct CatArgs {
  const std::vector<TensorDict>& dicts;
  std::size_t dim;
};

// Every dict's batch size at sub-dict `path` (the root: empty) with dimension `dim` summed;
// td::LayoutMismatchError unless they agree elsewhere.
Shape cat_batch_size(const CatArgs& a, const std::vector<std::string>& path,
                     const std::vector<const TensorDict*>& nodes) {
  const std::string where =
      path.empty() ? std::string("the batch size") : fmt::format("sub-dict '{}'", Key(path).str());
  Shape out = nodes[0]->batch_size();
  for (std::size_t r = 1; r < nodes.size(); ++r) {
    const Shape& bs = nodes[r]->batch_size();
    bool same = bs.size() == out.size();
    for (std::size_t d = 0; same && d < bs.size(); ++d) same = d == a.dim || bs[d] == out[d];
    if (!same)
      throw LayoutMismatchError(
          fmt::format("td::cat: {} is {} in dicts[{}] and {} in dicts[0] (they may differ only in "
                      "dimension {})",
                      path.empty() ? "the batch size" : fmt::format("the batch size of {}", where),
                      shape_str(bs), r, shape_str(nodes[0]->batch_size()), a.dim));
    out[a.dim] += bs[a.dim];
  }
  return out;
}

TensorDict cat_node(const CatArgs& a, std::vector<std::string>& path,
                    const std::vector<const TensorDict*>& nodes) {
  TensorDict out(cat_batch_size(a, path, nodes));
  const TensorDict& first = *nodes[0];
  for (const Key& k : first.keys()) {
    path.push_back(k.parts()[0]);
    const Key full(path);
    std::vector<const TensorDict*> subs;
    std::vector<const Tensor*> leaves;
    for (std::size_t r = 0; r < nodes.size(); ++r) {
      if (!nodes[r]->contains(k) || nodes[r]->is_dict(k) != first.is_dict(k))
        throw LayoutMismatchError(fmt::format("td::cat: dicts[{}] has no {} '{}'", r,
                                              first.is_dict(k) ? "sub-dict" : "key", full.str()));
      if (first.is_dict(k)) {
        subs.push_back(&nodes[r]->get_dict(k));
      } else {
        leaves.push_back(&nodes[r]->get(k));
      }
    }
    if (!subs.empty()) {
      out.set(k, cat_node(a, path, subs));
    } else {
      const Tensor& t0 = *leaves[0];
      Shape shape = t0.shape();
      shape[a.dim] = 0;
      for (std::size_t r = 0; r < leaves.size(); ++r) {
        const Tensor& t = *leaves[r];
        if (t.is_sparse())
          throw std::invalid_argument(
              fmt::format("td::cat: key '{}' is a sparse tensor in dicts[{}] (to_dense() it first)",
                          full.str(), r));
        bool same = t.dtype() == t0.dtype() && t.dim() == t0.dim();
        for (std::size_t d = 0; same && d < t.shape().size(); ++d)
          same = d == a.dim || t.shape()[d] == t0.shape()[d];
        if (!same)
          throw LayoutMismatchError(fmt::format(
              "td::cat: key '{}' is {}{} in dicts[{}] and {}{} in dicts[0] (same dtype, and "
              "shapes that differ only in dimension {})",
              full.str(), name(t.dtype()), shape_str(t.shape()), r, name(t0.dtype()),
              shape_str(t0.shape()), a.dim));
        shape[a.dim] += t.shape()[a.dim];
      }
      Tensor joined = Tensor::empty(shape, t0.dtype());
      std::int64_t off = 0;
      for (const Tensor* t : leaves) {
        const std::int64_t rows = t->shape()[a.dim];
        joined.slice(static_cast<std::int64_t>(a.dim), off, off + rows).copy_(*t);
        off += rows;
      }
      out.set(k, std::move(joined));
    }
    path.pop_back();
  }
  return out;
}

}  // namespace

TensorDict cat(const std::vector<TensorDict>& dicts, std::int64_t dim) {
  if (dicts.empty()) throw std::invalid_argument("td::cat: no TensorDict to concatenate");
  const Shape& bs = dicts[0].batch_size();
  const auto nb = static_cast<std::int64_t>(bs.size());
  if (dim < -nb || dim >= nb)
    throw std::invalid_argument(
        nb == 0 ? std::string("td::cat: dicts[0] has batch size [], and dim must be a batch "
                              "dimension")
                : fmt::format("td::cat: dim {} is not a dimension of the batch size {} ({} to {})",
                              dim, shape_str(bs), -nb, nb - 1));
  // The same leaves everywhere first: a missing key is named by its full path.
  for (std::size_t r = 1; r < dicts.size(); ++r)
    check_same_keys(dicts[0], dicts[r], "td::cat", "dicts[0]", fmt::format("dicts[{}]", r));
  const CatArgs args{dicts, static_cast<std::size_t>(dim < 0 ? dim + nb : dim)};
  std::vector<const TensorDict*> nodes;
  nodes.reserve(dicts.size());
  for (const TensorDict& d : dicts) nodes.push_back(&d);
  std::vector<std::string> path;
  return cat_node(args, path, nodes);
}

TensorDict zeros_like(const TensorDict& dict) {
  return dict.apply([](const Tensor& t) {
    if (!t.is_sparse()) return Tensor::zeros(t.shape(), t.dtype());
    Tensor z = t.clone();
    z.zero_();
    return z;
  });
}

bool allclose(const TensorDict& a, const TensorDict& b, double rtol, double atol) {
  if (a.batch_size() != b.batch_size()) return false;
  const auto& la = detail::DictAccess::canonical(a);
  const auto& lb = detail::DictAccess::canonical(b);
  if (la.size() != lb.size()) return false;
  for (std::size_t i = 0; i < la.size(); ++i) {
    if (!(*la[i].key == *lb[i].key) || la[i].tensor->shape() != lb[i].tensor->shape()) return false;
    const auto x = values_of(*la[i].tensor);
    const auto y = values_of(*lb[i].tensor);
    for (std::size_t j = 0; j < x.size(); ++j) {
      if (x[j] == y[j]) continue;  // equal infinities included
      const bool finite = std::isfinite(x[j].real()) && std::isfinite(x[j].imag()) &&
                          std::isfinite(y[j].real()) && std::isfinite(y[j].imag());
      if (!finite) return false;  // NaN, or an infinity against anything else
      const double diff = std::abs(x[j] - y[j]);
      if (!(diff <= atol + rtol * std::abs(y[j]))) return false;  // NaN: never close
    }
  }
  return true;
}

}  // namespace td
