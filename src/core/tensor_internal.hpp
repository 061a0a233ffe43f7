// Internals of td::Tensor shared by the library's sources (not installed).
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>

#include "tensordict/tensor.hpp"

namespace td::detail {

/// Aligned bytes owned by one or more tensors, from the storage pool (core/storage_pool.hpp):
/// at least 64-byte aligned; medium and large ones on transparent huge pages.
struct Storage {
  explicit Storage(std::size_t nbytes);  // throws std::bad_alloc
  ~Storage();
  Storage(const Storage&) = delete;
  Storage& operator=(const Storage&) = delete;
  std::byte* data = nullptr;
  std::size_t nbytes = 0;
  void* owner = nullptr;  // where data came from (StoragePool::release)
  // The storage's version counter (as c10's TensorImpl keeps one): bumped whenever a tensor
  // object viewing this storage changes its layout (assigned, moved from). Unchanged since a
  // read: every tensor object that viewed the storage then still views it with the same layout.
  // New views do not count: they change no existing object. Atomic: two threads may change two
  // tensors of one storage.
  mutable std::atomic<std::uint64_t> view_changes{0};
};

/// The two dense tensors behind a sparse COO tensor.
struct SparseParts {
  Tensor indices;  // int64 [ndim, nnz]
  Tensor values;   // [nnz]
  bool coalesced = false;
};

/// Access to Tensor's private fields for the library's internals.
struct TensorAccess {
  static const Storage* storage(const Tensor& t) { return t.storage_.get(); }
  /// Unchecked field reads for the hot loops of the collectives (t must be defined).
  static const Shape& shape(const Tensor& t) { return t.shape_; }
  static const Shape& strides(const Tensor& t) { return t.strides_; }
  static std::int64_t offset(const Tensor& t) { return t.offset_; }
  static DType dtype(const Tensor& t) { return t.dtype_; }
  static const void* sparse_parts(const Tensor& t) { return t.sparse_.get(); }
  /// Address of element [0,...,0] of a dense tensor whose elements are `isz` bytes.
  static std::byte* data(const Tensor& t, std::size_t isz) {
    return t.storage_->data + t.offset_ * static_cast<std::int64_t>(isz);
  }
  /// The id of t's layout (see Tensor::layout_id_): equal ids mean equal layouts.
  static std::uint64_t layout_id(const Tensor& t) { return t.layout_id_; }
  /// Gives t a new layout id (after setting any of its layout fields); a leaf's counts in the
  /// leaf epoch.
  static void renew_layout_id(Tensor& t);
  /// Marks t as a leaf of a dict (see Tensor::is_leaf_): its layout changes count in leaf_epoch().
  static void mark_leaf(Tensor& t) {
    // Concurrent const calls mark the same leaves: skip the store (and the cache-line write).
    if (!t.is_leaf_.load(std::memory_order_relaxed))
      t.is_leaf_.store(true, std::memory_order_relaxed);
  }
  /// Counts every layout change of a tensor object marked as a leaf, in any dict of the process:
  /// unchanged since a read, no leaf object of any dict changed its layout since then.
  static std::uint64_t leaf_epoch();
  /// How many tensors share t's storage (1: no other tensor can alias it).
  static long storage_use_count(const Tensor& t) { return t.storage_.use_count(); }
  /// Observes t's storage without keeping it alive (expired once no tensor holds it).
  static std::weak_ptr<const Storage> weak_storage(const Tensor& t) { return t.storage_; }
  /// A contiguous view of `base`'s storage starting at element `offset` (used by consolidate).
  static Tensor view_of(const Tensor& base, std::int64_t offset, Shape shape);
  /// Byte address of element [0,...,0] relative to the storage start.
  static std::int64_t byte_offset(const Tensor& t) {
    return t.offset_ * static_cast<std::int64_t>(itemsize(t.dtype_));
  }
};

/// Row-major strides of a contiguous tensor of `shape`.
Shape contiguous_strides(const Shape& shape);
/// Product of the sizes (1 for a 0-d shape); throws std::invalid_argument naming the shape on a
/// negative size, or when the product (a size 0 counted as 1, so every stride) overflows int64.
std::int64_t shape_numel(const Shape& shape);
/// Bytes of a contiguous tensor of `shape` and `dtype`; throws std::invalid_argument naming the
/// shape when they exceed PTRDIFF_MAX (or shape_numel throws).
std::size_t shape_nbytes(const Shape& shape, DType dtype);

/// Copies a strided region element by element into another strided region of the same shape.
void strided_copy(std::byte* dst, const Shape& dst_strides, const std::byte* src,
                  const Shape& src_strides, const Shape& shape, std::size_t itemsize);

}  // namespace td::detail
