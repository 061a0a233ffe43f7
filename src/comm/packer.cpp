// Copies between leaves and bucket buffers (the packer).
#include <algorithm>
#include <climits>
#include <cstring>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "comm/engine_internal.hpp"
#include "core/config.hpp"
#include "runtime/log.hpp"

namespace td::detail {

// Whether a bucket's leaves lie back to back in one storage, so it can run on them directly.
// Runs per bucket per call: unchecked field reads (every slot holds a dense, defined leaf).
// These LeafRef forms look at each leaf's own strides rather than trusting the plan's
// contiguity flags: the leaves they are given need not be the ones the plan was built from (a
// scatter's parts, a point-to-point peer's plan, a gather's fresh results), and only dtype and
// shape are agreed for those.
bool bucket_is_contiguous_in_memory(const BucketPlan::Bucket& b, std::span<const LeafRef> leaves) {
  const std::size_t isz = itemsize(b.dtype);
  const Tensor& head = *leaves[b.slots[0].leaf].tensor;
  if (!head.is_contiguous()) return false;
  const Storage* storage = TensorAccess::storage(head);
  const std::byte* first = TensorAccess::data(head, isz);
  for (std::size_t s = 1; s < b.slots.size(); ++s) {
    const Tensor& t = *leaves[b.slots[s].leaf].tensor;
    if (TensorAccess::storage(t) != storage || !t.is_contiguous() ||
        TensorAccess::data(t, isz) != first + b.slots[s].offset)
      return false;
  }
  return true;
}

void pack_bucket(const BucketPlan::Bucket& b, std::span<const LeafRef> leaves, std::byte* dst) {
  const std::size_t isz = itemsize(b.dtype);
  for (const auto& slot : b.slots) {
    const Tensor& t = *leaves[slot.leaf].tensor;
    if (!t.is_contiguous()) {
      strided_copy(dst + slot.offset, contiguous_strides(t.shape()), TensorAccess::data(t, isz),
                   t.strides(), t.shape(), isz);
    } else {
      std::memcpy(dst + slot.offset, TensorAccess::data(t, isz), slot.nbytes);
    }
  }
}

void unpack_bucket(const BucketPlan::Bucket& b, std::span<const LeafRef> leaves,
                   const std::byte* src) {
  const std::size_t isz = itemsize(b.dtype);
  for (const auto& slot : b.slots) {
    const Tensor& t = *leaves[slot.leaf].tensor;
    if (!t.is_contiguous()) {
      strided_copy(TensorAccess::data(t, isz), t.strides(), src + slot.offset,
                   contiguous_strides(t.shape()), t.shape(), isz);
    } else {
      std::memcpy(TensorAccess::data(t, isz), src + slot.offset, slot.nbytes);
    }
  }
}

// The same three on the flat LeafMemory arrays (the sync path's hot loops). A bucket of one
// strided leaf takes the LeafRef versions above.
bool bucket_is_contiguous_in_memory(const BucketPlan::Bucket& b, const LeafMemory& m) {
  if (b.strided) return false;
  const Storage* storage = m.storage[b.slots[0].leaf];
  const std::byte* first = m.data[b.slots[0].leaf];
  for (std::size_t s = 1; s < b.slots.size(); ++s) {
    const std::size_t leaf = b.slots[s].leaf;
    if (m.storage[leaf] != storage || m.data[leaf] != first + b.slots[s].offset) return false;
  }
  return true;
}

// Copies a bucket's leaves, merging leaves that lie back to back into one copy, and copying
// small leaves (the common case of many tiny gradients) with inlined fixed-size moves.
namespace {

template <bool kPack>
void copy_slots(const BucketPlan::Bucket& b, const LeafMemory& m, std::byte* buf) {
  auto copy = [buf](std::size_t offset, std::byte* leaf, std::size_t n) {
    std::byte* dst = kPack ? buf + offset : leaf;
    const std::byte* src = kPack ? leaf : buf + offset;
    if (n > 256) {
      std::memcpy(dst, src, n);
      return;
    }
    std::size_t i = 0;
    for (; i + 16 <= n; i += 16) std::memcpy(dst + i, src + i, 16);
    for (; i < n; ++i) dst[i] = src[i];
  };
  std::size_t run_offset = 0, run_bytes = 0;
  std::byte* run_start = nullptr;
  // Leaves are scattered over the heap: fetch 8 ahead. Measured (2 ranks, auto buckets, median
  // of 4 runs each, 2026-12-01): tiny 0.27 -> 0.21 ms, small 0.82 -> 0.75 ms, mixed 8.3 -> 6.9 ms.
  constexpr std::size_t kAhead = 8;
  const std::size_t n = b.slots.size();
  for (std::size_t k = 0; k < n; ++k) {
    const auto& slot = b.slots[k];
    if (k + kAhead < n) __builtin_prefetch(m.data[b.slots[k + kAhead].leaf], kPack ? 0 : 1);
    std::byte* p = m.data[slot.leaf];
    if (run_start != nullptr && p == run_start + run_bytes &&
        slot.offset == run_offset + run_bytes) {
      run_bytes += slot.nbytes;
      continue;
    }
    if (run_start != nullptr) copy(run_offset, run_start, run_bytes);
    run_start = p;
    run_offset = slot.offset;
    run_bytes = slot.nbytes;
  }
  if (run_start != nullptr) copy(run_offset, run_start, run_bytes);
}

}  // namespace

void pack_slots(const BucketPlan::Bucket& b, const LeafMemory& m, std::byte* buf) {
  copy_slots<true>(b, m, buf);
}
void unpack_slots(const BucketPlan::Bucket& b, const LeafMemory& m, const std::byte* buf) {
  copy_slots<false>(b, m, const_cast<std::byte*>(buf));  // NOLINT: only read when unpacking
}

}  // namespace td::detail
