// libFuzzer target: random leaf layouts and bucket caps must always give a plan whose invariants
// hold (every byte of every packable leaf in exactly one bucket, the cap, canonical order, one
// dtype per bucket, strided/sparse/aliased/empty leaves never packed with others). The same
// layout in an order drawn from the remaining bytes gives the Reducer's plan (build_in_order),
// checked by check_in_order: one target for both, since CI runs each target for its own time.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <numeric>
#include <utility>

#include <tensordict/bucket_bytes.hpp>
#include <tensordict/bucket_plan.hpp>

namespace {
struct Reader {
  const std::uint8_t* p;
  std::size_t n;
  std::uint8_t byte() {
    if (n == 0) return 0;
    --n;
    return *p++;
  }
};

void fail_if(const std::string& problem, const td::BucketPlan& plan) {
  if (problem.empty()) return;
  std::fprintf(stderr, "plan invariant broken: %s\n%s", problem.c_str(), plan.describe().c_str());
  std::abort();
}
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  Reader in{data, size};
  std::optional<std::size_t> cap;
  const std::uint8_t cap_kind = in.byte();
  if (cap_kind % 4 != 0) cap = 1 + (static_cast<std::size_t>(in.byte()) << (in.byte() % 16));
  std::vector<td::LeafLayout> leaves;
  const std::size_t count = in.byte() % 64;
  for (std::size_t i = 0; i < count; ++i) {
    td::LeafLayout l;
    l.dtype = static_cast<td::DType>(in.byte() % td::kNumDTypes);
    const std::uint8_t dims = in.byte() % 3;
    for (std::uint8_t d = 0; d < dims; ++d) l.shape.push_back(in.byte() % 40);
    const std::uint8_t flags = in.byte();
    l.contiguous = (flags & 1) == 0;
    l.sparse = (flags & 2) != 0;
    if (l.sparse) l.contiguous = false;
    if ((flags & 4) != 0 && i > 0) l.alias_of = static_cast<std::int64_t>(in.byte() % i);
    leaves.push_back(l);
  }
  const td::BucketPlan plan = td::BucketPlan::build(leaves, cap);
  fail_if(plan.check(leaves), plan);
  // A permutation from the bytes left (Fisher-Yates, a zero byte swapping nothing: no bytes left
  // is canonical order), and the cap or, without one, the Reducer's kAutoBucketBytes.
  std::vector<std::size_t> order(leaves.size());
  std::iota(order.begin(), order.end(), std::size_t{0});
  for (std::size_t i = order.size(); i > 1; --i)
    std::swap(order[i - 1], order[i - 1 - in.byte() % i]);
  const td::BucketPlan ordered =
      td::BucketPlan::build_in_order(leaves, order, cap.value_or(td::kAutoBucketBytes));
  fail_if(ordered.check_in_order(leaves, order), ordered);
  return 0;
}
