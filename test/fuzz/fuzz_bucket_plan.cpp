// libFuzzer target: random leaf layouts and bucket caps must always give a plan whose invariants
// hold (every byte of every packable leaf in exactly one bucket, the cap, canonical order, one
// dtype per bucket, strided/sparse/aliased/empty leaves never packed with others).
#include <cstdint>
#include <cstdio>
#include <cstdlib>

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
  const std::string problem = plan.check(leaves);
  if (!problem.empty()) {
    std::fprintf(stderr, "plan invariant broken: %s\n%s", problem.c_str(), plan.describe().c_str());
    std::abort();
  }
  return 0;
}
