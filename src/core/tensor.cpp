#include "tensordict/tensor.hpp"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <ostream>
#include <utility>

#include <fmt/ranges.h>

#include "core/storage_pool.hpp"
#include "core/tensor_internal.hpp"

namespace td {

namespace detail {

// Every storage comes from the storage pool (core/storage_pool.hpp). Shared-memory MPI copies
// between processes with process_vm_readv, which pins every page of both buffers on every call:
// a dict of separately created 256 KiB-1 MiB leaves on 4 KiB pages all_reduced 2x slower than
// the same bytes on 2 MiB pages. So storages of 16 KiB-1.75 MiB are carved from 2 MiB-aligned
// chunks marked MADV_HUGEPAGE (Linux's default THP mode serves only marked memory), by size
// class, and larger ones get 2 MiB-aligned memory of their own, marked too, as PyTorch does for
// large CPU tensors (THP_MEM_ALLOC_ENABLE); smaller ones, and all with TD_HUGEPAGES=0, come from
// aligned_alloc(64). docs/configuration.md#huge-pages has the figures and the memory overhead.
Storage::Storage(std::size_t n) : nbytes(n) {
  const StorageBlock b = storage_pool().allocate(n);
  data = b.data;
  owner = b.owner;
}

Storage::~Storage() { storage_pool().release(data, nbytes, owner); }

Shape contiguous_strides(const Shape& shape) {
  Shape strides(shape.size());
  std::int64_t s = 1;
  for (std::size_t i = shape.size(); i-- > 0;) {
    strides[i] = s;
    s *= std::max<std::int64_t>(shape[i], 1);
  }
  return strides;
}

namespace {
// The product of `sizes`, a size 0 counted as 1, bounds the element count and every contiguous
// stride: checking it once keeps every later product of sizes (strides, offsets, numel) free of
// signed overflow. Errors name `shape`, the shape the caller was given.
std::int64_t checked_numel(const Shape& sizes, const Shape& shape) {
  std::int64_t bound = 1;
  bool has_zero = false;
  for (auto s : sizes) {
    if (s < 0)
      throw std::invalid_argument(
          fmt::format("negative size in shape [{}]", fmt::join(shape, ", ")));
    has_zero = has_zero || s == 0;
    if (__builtin_mul_overflow(bound, std::max<std::int64_t>(s, 1), &bound))
      throw std::invalid_argument(fmt::format(
          "shape [{}] has more elements than an int64 can count", fmt::join(shape, ", ")));
  }
  return has_zero ? 0 : bound;
}
}  // namespace

std::int64_t shape_numel(const Shape& shape) { return checked_numel(shape, shape); }

std::size_t shape_nbytes(const Shape& shape, DType dtype) {
  const std::int64_t n = shape_numel(shape);
  std::int64_t bytes = 0;  // at most PTRDIFF_MAX: pointer differences inside it must be defined
  if (__builtin_mul_overflow(n, static_cast<std::int64_t>(itemsize(dtype)), &bytes) ||
      bytes > PTRDIFF_MAX)
    throw std::invalid_argument(fmt::format("shape [{}] of {} needs more bytes than fit in memory",
                                            fmt::join(shape, ", "), name(dtype)));
  return static_cast<std::size_t>(bytes);
}

void strided_copy(std::byte* dst, const Shape& dst_strides, const std::byte* src,
                  const Shape& src_strides, const Shape& shape, std::size_t isz) {
  const std::int64_t n = shape_numel(shape);
  if (n == 0) return;
  const std::size_t nd = shape.size();
  if (nd == 0) {
    std::memcpy(dst, src, isz);
    return;
  }
  // Walk every index but the innermost with an odometer; the innermost row is a memcpy when
  // both sides are dense there.
  const std::int64_t inner = shape[nd - 1];
  const std::int64_t ds = dst_strides[nd - 1], ss = src_strides[nd - 1];
  const bool dense_rows = ds == 1 && ss == 1;
  std::vector<std::int64_t> idx(nd, 0);
  const std::int64_t rows = n / inner;
  const auto bytes = static_cast<std::int64_t>(isz);
  for (std::int64_t r = 0; r < rows; ++r) {
    std::int64_t doff = 0, soff = 0;
    for (std::size_t k = 0; k + 1 < nd; ++k) {
      doff += idx[k] * dst_strides[k];
      soff += idx[k] * src_strides[k];
    }
    std::byte* d = dst + doff * bytes;
    const std::byte* s = src + soff * bytes;
    if (dense_rows) {
      std::memcpy(d, s, static_cast<std::size_t>(inner) * isz);
    } else {
      for (std::int64_t i = 0; i < inner; ++i)
        std::memcpy(d + i * ds * bytes, s + i * ss * bytes, isz);
    }
    for (std::size_t k = nd - 1; k-- > 0;) {  // advance the odometer over the outer dims
      if (++idx[k] < shape[k]) break;
      idx[k] = 0;
    }
  }
}

namespace {
std::atomic<std::uint64_t> g_leaf_epoch{0};
}  // namespace

std::uint64_t TensorAccess::leaf_epoch() { return g_leaf_epoch.load(std::memory_order_relaxed); }

void TensorAccess::renew_layout_id(Tensor& t) {
  static std::atomic<std::uint64_t> next{1};
  t.layout_id_ = next.fetch_add(1, std::memory_order_relaxed);
  if (t.is_leaf_.load(std::memory_order_relaxed))
    g_leaf_epoch.fetch_add(1, std::memory_order_relaxed);
}

Tensor TensorAccess::view_of(const Tensor& base, std::int64_t offset, Shape shape) {
  Tensor t;
  t.storage_ = base.storage_;
  t.dtype_ = base.dtype_;
  t.offset_ = offset;
  t.strides_ = contiguous_strides(shape);
  t.shape_ = std::move(shape);
  renew_layout_id(t);
  return t;
}

}  // namespace detail

using detail::contiguous_strides;
using detail::shape_numel;

namespace {
// An existing tensor object (its storage and its is_leaf_) is about to change its layout and
// leave, or lose, that storage: one more change in the storage's version counter (see
// detail::Storage::view_changes), and in the leaf epoch if the object is a dict's leaf.
void count_view_change(const std::shared_ptr<detail::Storage>& storage,
                       const std::atomic<bool>& is_leaf) {
  if (storage) storage->view_changes.fetch_add(1, std::memory_order_relaxed);
  if (is_leaf.load(std::memory_order_relaxed))
    detail::g_leaf_epoch.fetch_add(1, std::memory_order_relaxed);
}
}  // namespace

Tensor::Tensor() = default;
// Copies and moves carry the layout (and its id), never is_leaf_ (where the object lives).
// Every assignment, and being moved from, changes an existing object's layout: it counts in the
// version of the storage it viewed, and in the leaf epoch if the object is a leaf.
Tensor::Tensor(const Tensor& other)
    : storage_(other.storage_),
      offset_(other.offset_),
      shape_(other.shape_),
      strides_(other.strides_),
      dtype_(other.dtype_),
      sparse_(other.sparse_),
      layout_id_(other.layout_id_) {}
// A moved-from tensor is undefined, with layout id 0: a dict leaf moved out of is seen as
// changed by the collectives' layout cache (which compares ids), never as the old layout.
Tensor::Tensor(Tensor&& other) noexcept
    : storage_(std::move(other.storage_)),
      offset_(std::exchange(other.offset_, 0)),
      shape_(std::move(other.shape_)),
      strides_(std::move(other.strides_)),
      dtype_(other.dtype_),
      sparse_(std::move(other.sparse_)),
      layout_id_(std::exchange(other.layout_id_, 0)) {
  count_view_change(storage_, other.is_leaf_);  // other no longer views it
  other.shape_.clear();
  other.strides_.clear();
}
Tensor::~Tensor() = default;

Tensor& Tensor::operator=(const Tensor& other) {
  count_view_change(storage_, is_leaf_);
  if (this != &other) {
    storage_ = other.storage_;
    offset_ = other.offset_;
    shape_ = other.shape_;
    strides_ = other.strides_;
    dtype_ = other.dtype_;
    sparse_ = other.sparse_;
    layout_id_ = other.layout_id_;
  }
  return *this;
}

Tensor& Tensor::operator=(Tensor&& other) noexcept {
  count_view_change(storage_, is_leaf_);
  if (this == &other) return *this;
  count_view_change(other.storage_, other.is_leaf_);  // other no longer views it
  storage_ = std::move(other.storage_);
  offset_ = std::exchange(other.offset_, 0);
  shape_ = std::move(other.shape_);
  strides_ = std::move(other.strides_);
  dtype_ = other.dtype_;
  sparse_ = std::move(other.sparse_);
  layout_id_ = std::exchange(other.layout_id_, 0);
  other.shape_.clear();
  other.strides_.clear();
  return *this;
}

Tensor Tensor::empty(Shape shape, DType dtype) {
  Tensor t;
  t.storage_ = std::make_shared<detail::Storage>(detail::shape_nbytes(shape, dtype));
  t.dtype_ = dtype;
  t.strides_ = contiguous_strides(shape);
  t.shape_ = std::move(shape);
  detail::TensorAccess::renew_layout_id(t);
  return t;
}

Tensor Tensor::zeros(Shape shape, DType dtype) {
  Tensor t = empty(std::move(shape), dtype);
  std::memset(t.storage_->data, 0, t.storage_->nbytes);
  return t;
}

bool Tensor::defined() const noexcept { return storage_ != nullptr || sparse_ != nullptr; }

namespace {
void require_defined(const Tensor& t) {
  if (!t.defined()) throw Error("operation on an undefined td::Tensor");
}
}  // namespace

DType Tensor::dtype() const {
  require_defined(*this);
  return dtype_;
}
const Shape& Tensor::shape() const {
  require_defined(*this);
  return shape_;
}
const Shape& Tensor::strides() const {
  check_dense("strides()");
  return strides_;
}
std::int64_t Tensor::storage_offset() const {
  check_dense("storage_offset()");
  return offset_;
}
std::int64_t Tensor::numel() const { return shape_numel(shape()); }
std::size_t Tensor::nbytes() const { return static_cast<std::size_t>(numel()) * itemsize(dtype()); }
std::int64_t Tensor::dim() const { return static_cast<std::int64_t>(shape().size()); }

bool Tensor::is_contiguous() const {
  if (is_sparse()) return false;
  require_defined(*this);
  std::int64_t expected = 1;
  for (std::size_t i = shape_.size(); i-- > 0;) {
    if (shape_[i] == 1) continue;  // the stride of a size-1 dim never matters
    if (shape_[i] == 0) return true;
    if (strides_[i] != expected) return false;
    expected *= shape_[i];
  }
  return true;
}

bool Tensor::shares_storage_with(const Tensor& other) const {
  return storage_ && storage_ == other.storage_;
}

void Tensor::check_dtype(DType expected) const {
  if (dtype() != expected)
    throw Error(fmt::format("tensor has dtype {}, accessed as {}", name(dtype_), name(expected)));
}

void Tensor::check_dense(const char* what) const {
  require_defined(*this);
  if (sparse_) throw Error(fmt::format("{} is not defined for a sparse tensor", what));
}

void* Tensor::raw_data() {
  check_dense("data()");
  return storage_->data + offset_ * static_cast<std::int64_t>(itemsize(dtype_));
}
const void* Tensor::raw_data() const { return const_cast<Tensor*>(this)->raw_data(); }

void Tensor::copy_out(void* dst) const {
  check_dense("copy");
  detail::strided_copy(static_cast<std::byte*>(dst), contiguous_strides(shape_),
                       static_cast<const std::byte*>(raw_data()), strides_, shape_,
                       itemsize(dtype_));
}

Eigen::Index Tensor::contiguous_numel(const char* what) const {
  check_dense(what);
  if (!is_contiguous())
    throw Error(fmt::format("{} needs a contiguous tensor; call contiguous() first", what));
  return static_cast<Eigen::Index>(numel());
}

void Tensor::check_matrix() const {
  contiguous_numel("matrix()");
  if (dim() != 2) throw Error(fmt::format("matrix() needs a 2-D tensor, got {} dims", dim()));
}

void Tensor::check_single_element() const {
  if (numel() != 1)
    throw std::invalid_argument(
        fmt::format("item() needs a tensor with one element, got shape [{}] ({} elements)",
                    fmt::join(shape(), ", "), numel()));
}

Tensor Tensor::clone() const {
  require_defined(*this);
  if (sparse_) return sparse_coo(sparse_->indices.clone(), sparse_->values.clone(), shape_);
  Tensor t = empty(shape_, dtype_);
  copy_out(t.raw_data());
  return t;
}

Tensor Tensor::contiguous() const { return is_contiguous() ? *this : clone(); }

namespace {
std::int64_t wrap_dim(std::int64_t d, std::int64_t ndim, const char* what) {
  const std::int64_t w = d < 0 ? d + ndim : d;
  if (w < 0 || w >= ndim)
    throw std::invalid_argument(
        fmt::format("{}: dimension {} out of range for a {}-d tensor", what, d, ndim));
  return w;
}
}  // namespace

Tensor Tensor::transpose(std::int64_t d0, std::int64_t d1) const {
  check_dense("transpose()");
  Tensor t = *this;
  const auto a = static_cast<std::size_t>(wrap_dim(d0, dim(), "transpose"));
  const auto b = static_cast<std::size_t>(wrap_dim(d1, dim(), "transpose"));
  std::swap(t.shape_[a], t.shape_[b]);
  std::swap(t.strides_[a], t.strides_[b]);
  detail::TensorAccess::renew_layout_id(t);
  return t;
}

Tensor Tensor::slice(std::int64_t d, std::int64_t start, std::int64_t stop,
                     std::int64_t step) const {
  check_dense("slice()");
  if (step <= 0) throw std::invalid_argument("slice: step must be positive");
  const auto k = static_cast<std::size_t>(wrap_dim(d, dim(), "slice"));
  const std::int64_t size = shape_[k];
  auto clamp = [size](std::int64_t i) {
    return std::clamp(i < 0 ? i + size : i, std::int64_t{0}, size);
  };
  start = clamp(start);
  stop = std::max(clamp(stop), start);
  Tensor t = *this;
  t.offset_ += start * strides_[k];
  t.shape_[k] = (stop - start + step - 1) / step;
  t.strides_[k] *= step;
  detail::TensorAccess::renew_layout_id(t);
  return t;
}

Tensor Tensor::view(Shape shape) const {
  check_dense("view()");
  if (!is_contiguous()) throw Error("view() needs a contiguous tensor; call contiguous() first");
  int infer = -1;
  for (std::size_t i = 0; i < shape.size(); ++i) {
    if (shape[i] != -1) continue;
    if (infer >= 0)
      throw std::invalid_argument(
          fmt::format("view: only one dimension can be -1 in [{}]", fmt::join(shape, ", ")));
    infer = static_cast<int>(i);
  }
  if (infer >= 0) {
    Shape known_dims = shape;
    known_dims[static_cast<std::size_t>(infer)] = 1;
    const std::int64_t known = detail::checked_numel(known_dims, shape);
    if (known == 0)
      throw std::invalid_argument(fmt::format(
          "view: the -1 in [{}] is ambiguous with a size-0 dimension", fmt::join(shape, ", ")));
    shape[static_cast<std::size_t>(infer)] = numel() / known;
  }
  if (shape_numel(shape) != numel())
    throw std::invalid_argument(fmt::format("view: shape [{}] is invalid for {} elements",
                                            fmt::join(shape, ", "), numel()));
  return detail::TensorAccess::view_of(*this, offset_, std::move(shape));
}

namespace {
// The elements [first, last] of its storage that a dense tensor with elements can reach.
std::pair<std::int64_t, std::int64_t> element_extent(std::int64_t offset, const Shape& shape,
                                                     const Shape& strides) {
  std::int64_t first = offset, last = offset;
  for (std::size_t k = 0; k < shape.size(); ++k) {
    const std::int64_t reach = (shape[k] - 1) * strides[k];
    (reach < 0 ? first : last) += reach;
  }
  return {first, last};
}
}  // namespace

void Tensor::copy_(const Tensor& src) {
  check_dense("copy_()");
  Tensor s = src.to_dense();
  if (s.dtype() != dtype_ || s.shape() != shape_)
    throw std::invalid_argument(
        fmt::format("copy_: source {}[{}] does not match destination {}[{}]", name(s.dtype()),
                    fmt::join(s.shape(), ", "), name(dtype_), fmt::join(shape_, ", ")));
  if (numel() == 0) return;
  // A source that shares memory with this tensor (a transpose or a shifted slice of it) would be
  // overwritten while it is read: the same view copies nothing, any other overlap copies from a
  // snapshot of the source's values.
  if (s.storage_ == storage_) {
    if (s.offset_ == offset_ && s.strides_ == strides_) return;
    const auto [d_first, d_last] = element_extent(offset_, shape_, strides_);
    const auto [s_first, s_last] = element_extent(s.offset_, s.shape_, s.strides_);
    if (s_first <= d_last && d_first <= s_last) s = s.clone();
  }
  detail::strided_copy(static_cast<std::byte*>(raw_data()), strides_,
                       static_cast<const std::byte*>(s.raw_data()), s.strides_, shape_,
                       itemsize(dtype_));
}

void Tensor::zero_() {
  require_defined(*this);
  if (sparse_) {
    const auto ndim = static_cast<std::int64_t>(shape_.size());
    sparse_ = std::make_shared<detail::SparseParts>(
        detail::SparseParts{zeros({ndim, 0}, DType::Int64), zeros({0}, dtype_), true});
    detail::TensorAccess::renew_layout_id(*this);
    return;
  }
  if (is_contiguous()) {
    std::memset(raw_data(), 0, nbytes());
    return;
  }
  copy_(zeros(shape_, dtype_));
}

bool Tensor::equal(const Tensor& other) const {
  if (!defined() || !other.defined()) return defined() == other.defined();
  if (dtype() != other.dtype() || shape() != other.shape()) return false;
  const Tensor a = to_dense().contiguous(), b = other.to_dense().contiguous();
  return visit(dtype_, [&](auto tag) {
    using T = typename decltype(tag)::type;
    const T* x = static_cast<const T*>(a.raw_data());
    const T* y = static_cast<const T*>(b.raw_data());
    for (std::int64_t i = 0, n = a.numel(); i < n; ++i)
      if (!(x[i] == y[i])) return false;
    return true;
  });
}

// ---- sparse -----------------------------------------------------------------------------

// The contract's signature takes the parts by value (tensors are cheap handles).
// NOLINTNEXTLINE(performance-unnecessary-value-param)
Tensor Tensor::sparse_coo(Tensor indices, Tensor values, Shape shape) {
  if (!indices.defined() || !values.defined())
    throw std::invalid_argument("sparse_coo: undefined indices or values");
  if (indices.is_sparse() || values.is_sparse())
    throw std::invalid_argument("sparse_coo: indices and values must be dense");
  const auto ndim = static_cast<std::int64_t>(shape.size());
  if (indices.dtype() != DType::Int64 || indices.dim() != 2 || indices.shape()[0] != ndim)
    throw std::invalid_argument(
        fmt::format("sparse_coo: indices must be int64 [{}, nnz], got {}[{}]", ndim,
                    name(indices.dtype()), fmt::join(indices.shape(), ", ")));
  const std::int64_t nnz = indices.shape()[1];
  if (values.dim() != 1 || values.shape()[0] != nnz)
    throw std::invalid_argument(
        fmt::format("sparse_coo: values must be 1-D with {} elements, got [{}]", nnz,
                    fmt::join(values.shape(), ", ")));
  detail::shape_nbytes(shape, values.dtype());  // its dense form must be addressable
  const auto idx = indices.to_vector<std::int64_t>();
  for (std::int64_t d = 0; d < ndim; ++d)
    for (std::int64_t j = 0; j < nnz; ++j) {
      const std::int64_t i = idx[static_cast<std::size_t>(d * nnz + j)];
      if (i < 0 || i >= shape[static_cast<std::size_t>(d)])
        throw std::invalid_argument(
            fmt::format("sparse_coo: index {} out of range for dimension {} of size {}", i, d,
                        shape[static_cast<std::size_t>(d)]));
    }
  Tensor t;
  t.dtype_ = values.dtype();
  t.shape_ = std::move(shape);
  t.sparse_ = std::make_shared<detail::SparseParts>(
      detail::SparseParts{indices.contiguous(), values.contiguous(), false});
  detail::TensorAccess::renew_layout_id(t);
  return t;
}

bool Tensor::is_sparse() const { return sparse_ != nullptr; }

namespace {
const detail::SparseParts& sparse_parts(const std::shared_ptr<const detail::SparseParts>& p,
                                        const char* what) {
  if (!p) throw Error(fmt::format("{} is only defined for a sparse tensor", what));
  return *p;
}

// Row-major linear index of each stored entry.
std::vector<std::int64_t> linear_indices(const Tensor& indices, const Shape& shape) {
  const auto idx = indices.to_vector<std::int64_t>();
  const std::int64_t nnz = indices.shape()[1];
  const Shape strides = contiguous_strides(shape);
  std::vector<std::int64_t> lin(static_cast<std::size_t>(nnz), 0);
  for (std::size_t d = 0; d < shape.size(); ++d)
    for (std::int64_t j = 0; j < nnz; ++j)
      lin[static_cast<std::size_t>(j)] +=
          idx[d * static_cast<std::size_t>(nnz) + static_cast<std::size_t>(j)] * strides[d];
  return lin;
}

template <class T>
void accumulate(T& acc, const T& v) {
  if constexpr (std::is_same_v<T, bool>) {
    acc = acc || v;
  } else {
    acc = static_cast<T>(acc + v);
  }
}
}  // namespace

const Tensor& Tensor::indices() const { return sparse_parts(sparse_, "indices()").indices; }
const Tensor& Tensor::values() const { return sparse_parts(sparse_, "values()").values; }
std::int64_t Tensor::nnz() const { return values().numel(); }
bool Tensor::is_coalesced() const { return sparse_parts(sparse_, "is_coalesced()").coalesced; }

Tensor Tensor::to_dense() const {
  require_defined(*this);
  if (!sparse_) return *this;
  Tensor out = zeros(shape_, dtype_);
  const auto lin = linear_indices(sparse_->indices, shape_);
  visit(dtype_, [&](auto tag) {
    using T = typename decltype(tag)::type;
    T* o = out.data<T>();
    const T* v = sparse_->values.data<T>();
    for (std::size_t j = 0; j < lin.size(); ++j) accumulate(o[lin[j]], v[j]);
  });
  return out;
}

Tensor Tensor::coalesce() const {
  const auto& parts = sparse_parts(sparse_, "coalesce()");
  if (parts.coalesced) return *this;
  const auto lin = linear_indices(parts.indices, shape_);
  std::vector<std::size_t> order(lin.size());
  std::iota(order.begin(), order.end(), std::size_t{0});
  std::stable_sort(order.begin(), order.end(),
                   [&](std::size_t a, std::size_t b) { return lin[a] < lin[b]; });
  std::vector<std::int64_t> unique_lin;
  std::vector<std::size_t> slot(lin.size());
  for (std::size_t j : order) {
    if (unique_lin.empty() || unique_lin.back() != lin[j]) unique_lin.push_back(lin[j]);
    slot[j] = unique_lin.size() - 1;
  }
  const auto nnz = static_cast<std::int64_t>(unique_lin.size());
  const auto ndim = static_cast<std::int64_t>(shape_.size());
  Tensor values = zeros({nnz}, dtype_);
  visit(dtype_, [&](auto tag) {
    using T = typename decltype(tag)::type;
    T* o = values.data<T>();
    const T* v = parts.values.data<T>();
    for (std::size_t j = 0; j < lin.size(); ++j) accumulate(o[slot[j]], v[j]);
  });
  Tensor indices = empty({ndim, nnz}, DType::Int64);
  auto* ip = indices.data<std::int64_t>();
  const Shape strides = contiguous_strides(shape_);
  for (std::int64_t j = 0; j < nnz; ++j) {
    std::int64_t rest = unique_lin[static_cast<std::size_t>(j)];
    for (std::int64_t d = 0; d < ndim; ++d) {
      ip[d * nnz + j] = rest / strides[static_cast<std::size_t>(d)];
      rest %= strides[static_cast<std::size_t>(d)];
    }
  }
  Tensor t = *this;
  t.sparse_ = std::make_shared<detail::SparseParts>(detail::SparseParts{indices, values, true});
  detail::TensorAccess::renew_layout_id(t);
  return t;
}

}  // namespace td
