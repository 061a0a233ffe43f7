#include "tensordict/bucket_plan.hpp"

#include <algorithm>
#include <array>
#include <climits>
#include <limits>
#include <map>
#include <stdexcept>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "core/tensor_internal.hpp"

namespace td {

std::size_t LeafLayout::nbytes() const {
  return static_cast<std::size_t>(detail::shape_numel(shape)) * itemsize(dtype);
}

namespace {

constexpr std::size_t kNone = static_cast<std::size_t>(-1);

// A plan with its cap and message size, before any leaf is placed (see build() in
// bucket_plan.hpp for the message size).
BucketPlan empty_plan(std::optional<std::size_t> cap, std::size_t max_message_bytes) {
  if (cap && *cap == 0) throw std::invalid_argument("bucket_bytes must be positive");
  BucketPlan plan;
  plan.cap = cap;
  constexpr std::size_t kMinMessage = std::size_t{4} << 20;
  constexpr std::size_t kUncappedMessage = std::size_t{4} << 20;
  plan.max_message_bytes = max_message_bytes != 0 ? max_message_bytes
                           : cap                  ? std::max(*cap, kMinMessage)
                                                  : kUncappedMessage;
  return plan;
}

// Whether a plan leaves the leaf out: an alias of an earlier leaf, or dense without elements.
bool skipped(const LeafLayout& leaf) {
  return leaf.alias_of >= 0 || (leaf.nbytes() == 0 && !leaf.sparse);
}

// Lists leaf i among the plan's skipped or sparse leaves if it is one: whether it was.
bool set_aside(BucketPlan& plan, const LeafLayout& leaf, std::size_t i) {
  if (skipped(leaf)) {
    plan.skipped_leaves.push_back(i);
    return true;
  }
  if (leaf.sparse) {
    plan.sparse_leaves.push_back(i);
    return true;
  }
  return false;
}

// Whether `n` more bytes fit in a bucket holding `used` under `cap` (without overflowing: the
// Reducer's cap may be kAutoBucketBytes, SIZE_MAX).
bool fits(std::size_t used, std::size_t n, std::size_t cap) {
  return used <= cap && n <= cap - used;
}

// "" or why `order` is not a permutation of 0..n-1.
std::string order_problem(const std::vector<std::size_t>& order, std::size_t n) {
  if (order.size() != n) return fmt::format("order has {} entries for {} leaves", order.size(), n);
  std::vector<char> listed(n, 0);
  for (std::size_t k = 0; k < n; ++k) {
    if (order[k] >= n) return fmt::format("order names leaf {} of {}", order[k], n);
    if (listed[order[k]] != 0) return fmt::format("order names leaf {} twice", order[k]);
    listed[order[k]] = 1;
  }
  return {};
}

// check() and check_in_order(): `order` null for canonical order (build's plans).
std::string check_plan(const BucketPlan& plan, const std::vector<LeafLayout>& leaves,
                       const std::vector<std::size_t>* order) {
  // Where each leaf stands in the order the plan took the leaves in.
  std::vector<std::size_t> pos(leaves.size());
  if (order != nullptr) {
    if (std::string problem = order_problem(*order, leaves.size()); !problem.empty())
      return problem;
    if (!plan.cap) return "a plan in a given order has no cap";
    for (std::size_t k = 0; k < order->size(); ++k) pos[(*order)[k]] = k;
  } else {
    for (std::size_t i = 0; i < leaves.size(); ++i) pos[i] = i;
  }
  const char* order_name = order != nullptr ? "the given order" : "canonical order";
  std::vector<int> seen(leaves.size(), 0);
  std::array<std::size_t, kNumDTypes> last_of_dtype{};  // in order: the previous bucket of a dtype
  last_of_dtype.fill(kNone);
  std::size_t last_first = 0;
  for (std::size_t b = 0; b < plan.buckets.size(); ++b) {
    const BucketPlan::Bucket& bk = plan.buckets[b];
    if (bk.slots.empty()) return fmt::format("bucket {} is empty", b);
    std::size_t offset = 0;
    for (std::size_t s = 0; s < bk.slots.size(); ++s) {
      const BucketPlan::Slot& sl = bk.slots[s];
      if (sl.leaf >= leaves.size())
        return fmt::format("bucket {} names leaf {} of {}", b, sl.leaf, leaves.size());
      const LeafLayout& leaf = leaves[sl.leaf];
      if (s > 0 && pos[sl.leaf] <= pos[bk.slots[s - 1].leaf])
        return fmt::format("bucket {}: leaves not in {}", b, order_name);
      if (leaf.dtype != bk.dtype) return fmt::format("bucket {} mixes dtypes", b);
      if (leaf.sparse) return fmt::format("bucket {} holds sparse leaf {}", b, sl.leaf);
      if (leaf.alias_of >= 0) return fmt::format("bucket {} holds alias leaf {}", b, sl.leaf);
      // In a given order (the Reducer's) every leaf is copied into its bucket, strided or not.
      if (order == nullptr && !leaf.contiguous && bk.slots.size() > 1)
        return fmt::format("bucket {} packs non-contiguous leaf {} with others", b, sl.leaf);
      if (sl.offset != offset)
        return fmt::format("bucket {}: slot {} at offset {}, expected {}", b, s, sl.offset, offset);
      if (sl.nbytes != leaf.nbytes())
        return fmt::format("bucket {}: slot {} has {} bytes, leaf has {}", b, s, sl.nbytes,
                           leaf.nbytes());
      offset += sl.nbytes;
      ++seen[sl.leaf];
    }
    const std::size_t first = pos[bk.slots.front().leaf];
    if (b > 0 && first <= last_first)
      return fmt::format("bucket {} is not in {} of its first leaf", b, order_name);
    last_first = first;
    if (offset != bk.nbytes)
      return fmt::format("bucket {}: {} bytes recorded, slots hold {}", b, bk.nbytes, offset);
    if (plan.cap && bk.nbytes > *plan.cap && bk.slots.size() > 1)
      return fmt::format("bucket {} holds {} bytes in {} leaves, over the cap of {}", b, bk.nbytes,
                         bk.slots.size(), *plan.cap);
    if (!plan.cap && bk.slots.size() > 1)
      return fmt::format("bucket {} packs leaves without a cap", b);
    if (order == nullptr) continue;
    // One open bucket per dtype: the next one of a dtype starts after the previous one's last
    // leaf, and only because its first leaf would have passed the cap there.
    if (bk.strided) return fmt::format("bucket {} is strided in a plan in a given order", b);
    std::size_t& prev = last_of_dtype[static_cast<std::size_t>(bk.dtype)];
    if (prev != kNone) {
      const BucketPlan::Bucket& pb = plan.buckets[prev];
      if (pos[pb.slots.back().leaf] > first)
        return fmt::format("bucket {} starts before bucket {} of its dtype ends", b, prev);
      if (fits(pb.nbytes, bk.slots.front().nbytes, *plan.cap))
        return fmt::format("bucket {} opened though its first leaf fits in bucket {}", b, prev);
    }
    prev = b;
  }
  for (std::size_t i : plan.sparse_leaves) seen[i] += leaves[i].sparse ? 1 : 100;
  for (std::size_t i : plan.skipped_leaves) seen[i] += skipped(leaves[i]) ? 1 : 100;
  for (std::size_t i = 0; i < leaves.size(); ++i)
    if (seen[i] != 1) return fmt::format("leaf {} is placed {} times", i, seen[i]);
  return {};
}

}  // namespace

BucketPlan BucketPlan::build(const std::vector<LeafLayout>& leaves, std::optional<std::size_t> cap,
                             std::size_t max_message_bytes, std::size_t direct_bytes) {
  BucketPlan plan = empty_plan(cap, max_message_bytes);
  std::map<DType, std::size_t> open;  // dtype -> index of the bucket still accepting leaves
  for (std::size_t i = 0; i < leaves.size(); ++i) {
    const LeafLayout& leaf = leaves[i];
    if (set_aside(plan, leaf, i)) continue;
    const std::size_t n = leaf.nbytes();
    Bucket single{leaf.dtype, n, {Slot{i, 0, n}}, !leaf.contiguous};
    if (!leaf.contiguous || !cap || n > *cap || (direct_bytes > 0 && n >= direct_bytes)) {
      plan.buckets.push_back(std::move(single));
      continue;
    }
    auto it = open.find(leaf.dtype);
    if (it != open.end() && fits(plan.buckets[it->second].nbytes, n, *cap)) {
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

BucketPlan BucketPlan::build_in_order(const std::vector<LeafLayout>& leaves,
                                      const std::vector<std::size_t>& order, std::size_t cap,
                                      std::size_t max_message_bytes) {
  if (std::string problem = order_problem(order, leaves.size()); !problem.empty())
    throw std::invalid_argument(problem);
  BucketPlan plan = empty_plan(cap, max_message_bytes);
  std::array<std::size_t, kNumDTypes> open{};  // dtype -> the bucket still accepting leaves
  open.fill(kNone);
  for (std::size_t i : order) {
    const LeafLayout& leaf = leaves[i];
    if (set_aside(plan, leaf, i)) continue;
    const std::size_t n = leaf.nbytes();
    std::size_t& b = open[static_cast<std::size_t>(leaf.dtype)];
    if (b == kNone || !fits(plan.buckets[b].nbytes, n, cap)) {
      b = plan.buckets.size();
      plan.buckets.push_back(Bucket{leaf.dtype, 0, {}, false});
    }
    Bucket& bk = plan.buckets[b];
    bk.slots.push_back(Slot{i, bk.nbytes, n});
    bk.nbytes += n;
  }
  return plan;
}

std::string BucketPlan::check(const std::vector<LeafLayout>& leaves) const {
  return check_plan(*this, leaves, nullptr);
}

std::string BucketPlan::check_in_order(const std::vector<LeafLayout>& leaves,
                                       const std::vector<std::size_t>& order) const {
  return check_plan(*this, leaves, &order);
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
