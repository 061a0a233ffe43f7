// Printing tensors the way torch prints them (torch/_tensor_str.py, default print options:
// precision 4, threshold 1000, edgeitems 3, linewidth 80 not enforced), except that 1-D tensors
// are not padded to a common width: torch's documentation prints them that way.
#include <algorithm>
#include <cmath>
#include <ostream>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "core/tensor_internal.hpp"
#include "tensordict/tensor.hpp"

namespace td {

namespace {

constexpr std::int64_t kThreshold = 1000;
constexpr std::int64_t kEdgeItems = 3;

// How floating-point elements are printed, chosen once per tensor like torch's _Formatter.
struct FloatStyle {
  enum Mode { Integer, Fixed, Scientific } mode = Fixed;
};

FloatStyle choose_style(const std::vector<double>& values) {
  std::vector<double> finite;
  for (double v : values)
    if (std::isfinite(v)) finite.push_back(std::abs(v));
  FloatStyle s;
  if (finite.empty()) {
    s.mode = FloatStyle::Integer;
    return s;
  }
  const bool all_int = std::all_of(values.begin(), values.end(),
                                   [](double v) { return !std::isfinite(v) || v == std::ceil(v); });
  std::vector<double> nonzero;
  for (double v : finite)
    if (v != 0) nonzero.push_back(v);
  const double mx = nonzero.empty() ? 0 : *std::max_element(nonzero.begin(), nonzero.end());
  const double mn = nonzero.empty() ? 0 : *std::min_element(nonzero.begin(), nonzero.end());
  if (all_int) {
    s.mode = mx > 1e8 ? FloatStyle::Scientific : FloatStyle::Integer;
  } else if (!nonzero.empty() && (mx / mn > 1000. || mx > 1e8 || mn < 1e-4)) {
    s.mode = FloatStyle::Scientific;
  } else {
    s.mode = FloatStyle::Fixed;
  }
  return s;
}

std::string format_float(double v, FloatStyle s) {
  if (std::isnan(v)) return "nan";
  if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  switch (s.mode) {
    case FloatStyle::Integer:
      return fmt::format("{:.0f}.", v);
    case FloatStyle::Fixed:
      return fmt::format("{:.4f}", v);
    case FloatStyle::Scientific:
      return fmt::format("{:.4e}", v);
  }
  return {};
}

// Every element as text, in logical order, with the elements elided by summarisation dropped.
struct Cells {
  std::vector<std::string> text;
  std::size_t width = 0;
};

template <class T>
double as_double(const T& v) {
  return static_cast<double>(v);
}

Cells format_cells(const Tensor& t) {
  Cells c;
  visit(t.dtype(), [&](auto tag) {
    using T = typename decltype(tag)::type;
    const std::vector<T> vals = t.to_vector<T>();
    if constexpr (std::is_same_v<T, bool>) {
      for (bool v : vals) c.text.emplace_back(v ? "True" : "False");
    } else if constexpr (std::is_integral_v<T>) {
      for (T v : vals) c.text.push_back(fmt::format("{}", static_cast<std::int64_t>(v)));
    } else if constexpr (std::is_same_v<T, std::complex<float>> ||
                         std::is_same_v<T, std::complex<double>>) {
      std::vector<double> re, im;
      for (const auto& v : vals) {
        re.push_back(v.real());
        im.push_back(v.imag());
      }
      const FloatStyle rs = choose_style(re), is = choose_style(im);
      for (std::size_t i = 0; i < vals.size(); ++i) {
        std::string imag = format_float(std::abs(im[i]), is);
        c.text.push_back(
            fmt::format("{}{}{}j", format_float(re[i], rs), std::signbit(im[i]) ? "-" : "+", imag));
      }
    } else {
      std::vector<double> d;
      d.reserve(vals.size());
      for (const auto& v : vals) d.push_back(as_double(v));
      const FloatStyle s = choose_style(d);
      for (double v : d) c.text.push_back(format_float(v, s));
    }
  });
  for (const auto& s : c.text) c.width = std::max(c.width, s.size());
  return c;
}

void render(std::string& out, const Cells& cells, const Shape& shape, const Shape& strides,
            std::size_t dim, std::int64_t offset, std::size_t indent, bool summarize) {
  const std::int64_t n = shape[dim];
  // Columns of a matrix are aligned as torch does; a 1-D tensor prints unpadded, as torch's
  // documentation shows it (tensor([2, 4, 6, 8, 10])).
  const std::size_t width = shape.size() > 1 ? cells.width : 0;
  auto pad = [&](const std::string& s) {
    return std::string(width > s.size() ? width - s.size() : 0, ' ') + s;
  };
  std::vector<std::int64_t> shown;
  const bool elide = summarize && n > 2 * kEdgeItems;
  for (std::int64_t i = 0; i < n; ++i)
    if (!elide || i < kEdgeItems || i >= n - kEdgeItems) shown.push_back(i);
  out += '[';
  for (std::size_t k = 0; k < shown.size(); ++k) {
    const std::int64_t i = shown[k];
    if (k > 0) {
      if (dim + 1 == shape.size()) {
        out += ", ";
      } else {
        out += ',';
        out += std::string(shape.size() - dim - 1, '\n');
        out += std::string(indent + 1, ' ');
      }
    }
    if (elide && k == static_cast<std::size_t>(kEdgeItems)) {
      if (dim + 1 == shape.size()) {
        out += " ..., ";  // torch's ellipsis cell is " ..."
      } else {
        out += "...";
        out += ',';
        out += std::string(shape.size() - dim - 1, '\n');
        out += std::string(indent + 1, ' ');
      }
    }
    const std::int64_t off = offset + i * strides[dim];
    if (dim + 1 == shape.size()) {
      out += pad(cells.text[static_cast<std::size_t>(off)]);
    } else {
      render(out, cells, shape, strides, dim + 1, off, indent + 1, summarize);
    }
  }
  out += ']';
}

bool prints_dtype(DType d) {
  return d != DType::Float32 && d != DType::Int64 && d != DType::Bool && d != DType::Complex64;
}

std::string dense_to_string(const Tensor& t, std::size_t indent) {
  std::string out = "tensor(";
  const Shape& shape = t.shape();
  const Cells cells = format_cells(t);
  if (t.numel() == 0) {
    out += "[]";
    if (shape.size() != 1)
      out += fmt::format(", size=({}{})", fmt::join(shape, ", "), shape.size() == 1 ? "," : "");
  } else if (shape.empty()) {
    out += cells.text[0];
  } else {
    render(out, cells, shape, detail::contiguous_strides(shape), 0, 0, indent + 7,
           t.numel() > kThreshold);
  }
  const bool empty_non_float = t.numel() == 0 && t.dtype() != DType::Float32;
  if (prints_dtype(t.dtype()) || empty_non_float)
    out += fmt::format(", dtype=torch.{}", name(t.dtype()));
  out += ')';
  return out;
}

}  // namespace

std::string detail::shape_str(const Shape& shape) {
  return fmt::format("[{}]", fmt::join(shape, ", "));
}

std::string to_string(const Tensor& t) {
  if (!t.defined()) return "tensor(undefined)";
  if (!t.is_sparse()) return dense_to_string(t, 0);
  const Shape& shape = t.shape();
  return fmt::format(
      "tensor(indices={},\n       values={},\n       size=({}{}), nnz={}, layout=torch.sparse_coo)",
      dense_to_string(t.indices(), 15), dense_to_string(t.values(), 14), fmt::join(shape, ", "),
      shape.size() == 1 ? "," : "", t.nnz());
}

std::ostream& operator<<(std::ostream& os, const Tensor& t) { return os << to_string(t); }

}  // namespace td
