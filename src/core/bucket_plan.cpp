#include "tensordict/bucket_plan.hpp"

#include <algorithm>
#include <climits>
#include <limits>
#include <map>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "core/tensor_internal.hpp"

namespace td {

std::size_t LeafLayout::nbytes() const {
  return static_cast<std::size_t>(detail::shape_numel(shape)) * itemsize(dtype);
}

BucketPlan BucketPlan::build(const std::vector<LeafLayout>& leaves, std::optional<std::size_t> cap,
                             std::size_t max_message_bytes, std::size_t direct_bytes) {
  if (cap && *cap == 0) throw std::invalid_argument("bucket_bytes must be positive");
  BucketPlan plan;
  plan.cap = cap;
  constexpr std::size_t kMinMessage = std::size_t{4} << 20;  // see build() in bucket_plan.hpp
  constexpr std::size_t kUncappedMessage = std::size_t{4} << 20;
  plan.max_message_bytes = max_message_bytes != 0 ? max_message_bytes
                           : cap                  ? std::max(*cap, kMinMessage)
                                                  : kUncappedMessage;
  std::map<DType, std::size_t> open;  // dtype -> index of the bucket still accepting leaves
  for (std::size_t i = 0; i < leaves.size(); ++i) {
    const LeafLayout& leaf = leaves[i];
    const std::size_t n = leaf.nbytes();
    if (leaf.alias_of >= 0 || (n == 0 && !leaf.sparse)) {
      plan.skipped_leaves.push_back(i);
      continue;
    }
    if (leaf.sparse) {
      plan.sparse_leaves.push_back(i);
      continue;
    }
    Bucket single{leaf.dtype, n, {Slot{i, 0, n}}, !leaf.contiguous};
    if (!leaf.contiguous || !cap || n > *cap || (direct_bytes > 0 && n >= direct_bytes)) {
      plan.buckets.push_back(std::move(single));
      continue;
    }
    auto it = open.find(leaf.dtype);
    if (it != open.end() && plan.buckets[it->second].nbytes + n <= *cap) {
      Bucket& b = plan.buckets[it->second];
      b.slots.push_back(Slot{i, b.nbytes, n});
      b.nbytes += n;
    } else {
      open[leaf.dtype] = plan.buckets.size();
      plan.buckets.push_back(std::move(single));
    }
  }
  return plan;
}

std::string BucketPlan::check(const std::vector<LeafLayout>& leaves) const {
  std::vector<int> seen(leaves.size(), 0);
  std::size_t last_first = 0;
  for (std::size_t b = 0; b < buckets.size(); ++b) {
    const Bucket& bk = buckets[b];
    if (bk.slots.empty()) return fmt::format("bucket {} is empty", b);
    if (b > 0 && bk.slots.front().leaf <= last_first)
      return fmt::format("bucket {} is not in canonical order of its first leaf", b);
    last_first = bk.slots.front().leaf;
    std::size_t offset = 0;
    for (std::size_t s = 0; s < bk.slots.size(); ++s) {
      const Slot& sl = bk.slots[s];
      if (sl.leaf >= leaves.size())
        return fmt::format("bucket {} names leaf {} of {}", b, sl.leaf, leaves.size());
      const LeafLayout& leaf = leaves[sl.leaf];
      if (s > 0 && sl.leaf <= bk.slots[s - 1].leaf)
        return fmt::format("bucket {}: leaves not in canonical order", b);
      if (leaf.dtype != bk.dtype) return fmt::format("bucket {} mixes dtypes", b);
      if (leaf.sparse) return fmt::format("bucket {} holds sparse leaf {}", b, sl.leaf);
      if (leaf.alias_of >= 0) return fmt::format("bucket {} holds alias leaf {}", b, sl.leaf);
      if (!leaf.contiguous && bk.slots.size() > 1)
        return fmt::format("bucket {} packs non-contiguous leaf {} with others", b, sl.leaf);
      if (sl.offset != offset)
        return fmt::format("bucket {}: slot {} at offset {}, expected {}", b, s, sl.offset, offset);
      if (sl.nbytes != leaf.nbytes())
        return fmt::format("bucket {}: slot {} has {} bytes, leaf has {}", b, s, sl.nbytes,
                           leaf.nbytes());
      offset += sl.nbytes;
      ++seen[sl.leaf];
    }
    if (offset != bk.nbytes)
      return fmt::format("bucket {}: {} bytes recorded, slots hold {}", b, bk.nbytes, offset);
    if (cap && bk.nbytes > *cap && bk.slots.size() > 1)
      return fmt::format("bucket {} holds {} bytes in {} leaves, over the cap of {}", b, bk.nbytes,
                         bk.slots.size(), *cap);
    if (!cap && bk.slots.size() > 1) return fmt::format("bucket {} packs leaves without a cap", b);
  }
  for (std::size_t i : sparse_leaves) seen[i] += leaves[i].sparse ? 1 : 100;
  for (std::size_t i : skipped_leaves) {
    const bool skippable =
        leaves[i].alias_of >= 0 || (leaves[i].nbytes() == 0 && !leaves[i].sparse);
    seen[i] += skippable ? 1 : 100;
  }
  for (std::size_t i = 0; i < leaves.size(); ++i)
    if (seen[i] != 1) return fmt::format("leaf {} is placed {} times", i, seen[i]);
  return {};
}

std::string BucketPlan::describe() const {
  std::string out = fmt::format("{} buckets (cap {}), {} sparse, {} skipped\n", buckets.size(),
                                cap ? fmt::format("{} B", *cap) : std::string("none"),
                                sparse_leaves.size(), skipped_leaves.size());
  for (std::size_t b = 0; b < buckets.size(); ++b) {
    const Bucket& bk = buckets[b];
    out +=
        fmt::format("  bucket {}: {} {} B, {} leaves (first #{}){}\n", b, name(bk.dtype), bk.nbytes,
                    bk.slots.size(), bk.slots.front().leaf, bk.strided ? ", strided" : "");
  }
  return out;
}

}  // namespace td
