// td::Tensor: a dtype-erased, reference-counted strided view of aligned storage, like torch.Tensor.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <iosfwd>
#include <memory>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <Eigen/Core>

#include "tensordict/dtype.hpp"
#include "tensordict/errors.hpp"
#include "tensordict/export.hpp"

namespace td {

/// A tensor's sizes, outermost first.
using Shape = std::vector<std::int64_t>;

namespace detail {
struct Storage;
struct SparseParts;
struct TensorAccess;
}  // namespace detail

/// A dense strided tensor or a sparse COO tensor. Copies share storage (like torch); use clone()
/// for a deep copy.
class TD_API Tensor {
 public:
  /// An undefined tensor (defined() is false); only assignment and defined() are valid on it.
  Tensor();
  /// A handle sharing other's storage (and layout).
  Tensor(const Tensor& other);
  /// Takes over other's handle; `other` becomes undefined.
  Tensor(Tensor&& other) noexcept;
  /// Makes this a handle sharing other's storage (this tensor's old elements are not touched).
  Tensor& operator=(const Tensor& other);
  /// Takes over other's handle; `other` becomes undefined.
  Tensor& operator=(Tensor&& other) noexcept;
  /// Releases this handle; the storage lives on while another tensor shares it.
  ~Tensor();

  /// Uninitialised contiguous tensor.
  static Tensor empty(Shape shape, DType dtype);
  /// Contiguous tensor of zeros.
  static Tensor zeros(Shape shape, DType dtype);
  /// Contiguous tensor with every element equal to `value`; its dtype is dtype_of<T>.
  template <class T>
  static Tensor full(Shape shape, T value);
  /// Contiguous tensor holding `values` in row-major order; an empty shape means 1-D.
  template <class T>
  static Tensor from_vector(std::vector<T> values, Shape shape = {});
  /// A sparse COO tensor: `indices` is int64 [ndim, nnz], `values` has nnz elements.
  static Tensor sparse_coo(Tensor indices, Tensor values, Shape shape);

  /// False only for a default-constructed tensor.
  bool defined() const noexcept;
  /// Element type.
  DType dtype() const;
  /// Sizes, outermost first.
  const Shape& shape() const;
  /// Strides in elements (not bytes), one per dimension.
  const Shape& strides() const;
  /// Offset of element [0, ..., 0] from the start of the storage, in elements.
  std::int64_t storage_offset() const;
  /// Number of elements (product of the shape; 1 for a 0-d tensor).
  std::int64_t numel() const;
  /// numel() * itemsize(dtype()).
  std::size_t nbytes() const;
  /// Number of dimensions.
  std::int64_t dim() const;
  /// Whether the elements are laid out densely in row-major order.
  bool is_contiguous() const;
  /// Whether both tensors view (part of) the same storage.
  bool shares_storage_with(const Tensor& other) const;

  /// Pointer to element [0, ..., 0]; throws td::Error if T is not this tensor's C++ type.
  template <class T>
  T* data();
  /// Pointer to element [0, ..., 0]; throws td::Error if T is not this tensor's C++ type.
  template <class T>
  const T* data() const;
  /// Untyped pointer to element [0, ..., 0].
  void* raw_data();
  /// Untyped pointer to element [0, ..., 0].
  const void* raw_data() const;

  /// The elements in logical row-major order, whatever the strides.
  template <class T>
  std::vector<T> to_vector() const;
  /// The one element of a tensor with numel() == 1 (any shape); std::invalid_argument otherwise.
  template <class T>
  T item() const;
  /// A flat Eigen array over a contiguous tensor's elements (throws if not contiguous).
  template <class T>
  Eigen::Map<Eigen::Array<T, Eigen::Dynamic, 1>> array();
  /// A read-only flat Eigen array over a contiguous tensor's elements (throws if not contiguous).
  template <class T>
  Eigen::Map<const Eigen::Array<T, Eigen::Dynamic, 1>> array() const;
  /// A row-major Eigen matrix over a contiguous 2-D tensor (throws otherwise).
  template <class T>
  Eigen::Map<Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>> matrix();
  /// A read-only row-major Eigen matrix over a contiguous 2-D tensor (throws otherwise).
  template <class T>
  Eigen::Map<const Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>> matrix()
      const;

  /// A deep copy with contiguous storage.
  Tensor clone() const;
  /// *this if already contiguous, otherwise a contiguous copy.
  Tensor contiguous() const;
  /// A view with dimensions d0 and d1 swapped (negative dims count from the end).
  Tensor transpose(std::int64_t d0, std::int64_t d1) const;
  /// A view of [start, stop) with the given step along `dim` (start/stop clamped like Python).
  Tensor slice(std::int64_t dim, std::int64_t start, std::int64_t stop,
               std::int64_t step = 1) const;
  /// A view with a new shape (one entry may be -1); requires a contiguous tensor.
  Tensor view(Shape shape) const;
  /// Copies src's elements into this tensor's elements (same shape and dtype; any strides).
  void copy_(const Tensor& src);
  /// Sets every element to zero (dense) or drops every entry (sparse).
  void zero_();
  /// Element-wise exact equality of dtype, shape and values (sparse compared densified).
  bool equal(const Tensor& other) const;

  /// Whether this is a sparse COO tensor.
  bool is_sparse() const;
  /// The dense equivalent of a sparse tensor; a dense tensor returns itself.
  Tensor to_dense() const;
  /// Sparse only: the int64 [ndim, nnz] index tensor.
  const Tensor& indices() const;
  /// Sparse only: the nnz values.
  const Tensor& values() const;
  /// Sparse only: number of stored entries.
  std::int64_t nnz() const;
  /// Sparse only: indices sorted lexicographically, duplicates summed.
  Tensor coalesce() const;
  /// Sparse only: whether indices are sorted and unique.
  bool is_coalesced() const;

 private:
  friend struct detail::TensorAccess;
  void check_dtype(DType expected) const;
  void check_dense(const char* what) const;
  void copy_out(void* dst) const;  // logical row-major order
  Eigen::Index contiguous_numel(const char* what) const;
  void check_matrix() const;  // contiguous and 2-D
  void check_single_element() const;

  // Invariants: storage_ is null only for an undefined or sparse tensor; shape_ and strides_
  // have the same length; every element offset_ + sum(i_k * strides_[k]) lies inside storage_.
  // Views share storage_ with their base; sparse_ is set only for sparse tensors.
  std::shared_ptr<detail::Storage> storage_;
  std::int64_t offset_ = 0;
  Shape shape_;
  Shape strides_;
  DType dtype_ = DType::Float32;
  std::shared_ptr<const detail::SparseParts> sparse_;
  // Names this tensor's layout (every field above): renewed wherever one is set, copied with
  // the tensor, so two tensors with the same id have the same layout. Lets a cache see that a
  // tensor is unchanged by comparing one number. 0: undefined. Changing an existing object's
  // layout (assignment, being moved from) also counts in its storage's version counter
  // (detail::Storage::view_changes), so caches over many tensors of few storages compare those.
  std::uint64_t layout_id_ = 0;
  // Set on a tensor object stored as a leaf of a TensorDict (by the dict's canonical order): a
  // flag, not a pointer. A layout change of a flagged object (assigned, moved from, re-laid out)
  // counts in the process-wide leaf epoch (detail::TensorAccess::leaf_epoch), so a cache of
  // leaves sees in one load that no leaf of any dict changed. Never copied or moved with the
  // tensor: it says where this object lives. Atomic: concurrent const calls on a dict and on
  // its sub-dict may both set it.
  std::atomic<bool> is_leaf_{false};
};

/// Prints like torch: tensor([2, 4, 6]), tensor([1., 1.]), with a dtype= suffix where torch prints
/// one.
TD_API std::string to_string(const Tensor& t);
/// Prints like to_string().
TD_API std::ostream& operator<<(std::ostream& os, const Tensor& t);

namespace detail {
/// A shape as every message and printout of the library writes it: "[2, 3]", "[]" when 0-d.
TD_API std::string shape_str(const Shape& shape);
}  // namespace detail

// ---- template definitions ---------------------------------------------------------------

// The contract's signature takes the shape by value; it is moved on.
template <class T>
// NOLINTNEXTLINE(performance-unnecessary-value-param)
Tensor Tensor::full(Shape shape, T value) {
  Tensor t = empty(std::move(shape), dtype_of<T>);
  T* p = t.data<T>();
  for (std::int64_t i = 0, n = t.numel(); i < n; ++i) p[i] = value;
  return t;
}

template <class T>
Tensor Tensor::from_vector(std::vector<T> values, Shape shape) {
  if (shape.empty()) shape = {static_cast<std::int64_t>(values.size())};
  Tensor t = empty(std::move(shape), dtype_of<T>);
  if (static_cast<std::size_t>(t.numel()) != values.size())
    throw std::invalid_argument(fmt::format("from_vector: {} values do not fill shape [{}]",
                                            values.size(), fmt::join(t.shape(), ", ")));
  T* p = t.data<T>();
  for (std::size_t i = 0; i < values.size(); ++i) p[i] = values[i];  // vector<bool> has no data()
  return t;
}

template <class T>
T* Tensor::data() {
  check_dtype(dtype_of<T>);
  return static_cast<T*>(raw_data());
}

template <class T>
const T* Tensor::data() const {
  check_dtype(dtype_of<T>);
  return static_cast<const T*>(raw_data());
}

template <class T>
std::vector<T> Tensor::to_vector() const {
  check_dtype(dtype_of<T>);
  if (is_sparse()) return to_dense().to_vector<T>();
  if constexpr (std::is_same_v<T, bool>) {
    std::vector<std::uint8_t> bytes(static_cast<std::size_t>(numel()));
    copy_out(bytes.data());
    return std::vector<bool>(bytes.begin(), bytes.end());
  } else {
    std::vector<T> out(static_cast<std::size_t>(numel()));
    copy_out(out.data());
    return out;
  }
}

template <class T>
T Tensor::item() const {
  check_dtype(dtype_of<T>);
  check_single_element();
  if (is_sparse()) return to_dense().item<T>();
  return *data<T>();
}

template <class T>
Eigen::Map<Eigen::Array<T, Eigen::Dynamic, 1>> Tensor::array() {
  Eigen::Index n = contiguous_numel("array()");
  return Eigen::Map<Eigen::Array<T, Eigen::Dynamic, 1>>(data<T>(), n);
}

template <class T>
Eigen::Map<const Eigen::Array<T, Eigen::Dynamic, 1>> Tensor::array() const {
  Eigen::Index n = contiguous_numel("array()");
  return Eigen::Map<const Eigen::Array<T, Eigen::Dynamic, 1>>(data<T>(), n);
}

template <class T>
Eigen::Map<Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>> Tensor::matrix() {
  check_matrix();
  return Eigen::Map<Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>>(
      data<T>(), shape()[0], shape()[1]);
}

template <class T>
Eigen::Map<const Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>> Tensor::matrix()
    const {
  check_matrix();
  return Eigen::Map<const Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>>(
      data<T>(), shape()[0], shape()[1]);
}

}  // namespace td

// fmt::format("{}", tensor) prints like torch. (Hidden from Doxygen, which cannot scope a
// specialisation of another library's template.)
/// @cond
template <>
struct fmt::formatter<td::Tensor> : fmt::formatter<std::string> {
  /// Formats the tensor as td::to_string() does.
  template <class FormatContext>
  auto format(const td::Tensor& t, FormatContext& ctx) const {
    return fmt::formatter<std::string>::format(td::to_string(t), ctx);
  }
};
/// @endcond
