// The workloads (workloads.hpp).
#include "workloads.hpp"

#include <utility>

#include <fmt/format.h>

namespace td_bench {

namespace {

std::uint64_t splitmix64(std::uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

}  // namespace

std::int64_t numel_of(const td::Shape& s) {
  std::int64_t n = 1;
  for (auto d : s) n *= d;
  return n;
}

Workload make_workload(const std::string& name, td::DType dt) {
  Workload w;
  w.name = name;
  auto add = [&](std::vector<std::string> key, td::Shape shape, td::DType d) {
    w.leaves.push_back(LeafSpec{std::move(key), std::move(shape), d});
  };
  if (name == "tiny" || name == "small") {
    // tiny: 16384 leaves of 16 elements (64 B in float32); small: 4096 leaves of 256 (1 KiB).
    const int n = name == "tiny" ? 16384 : 4096;
    const std::int64_t numel = name == "tiny" ? 16 : 256;
    for (int i = 0; i < n; ++i)
      add({fmt::format("block{}", i / 64), fmt::format("p{}", i % 64)}, {numel}, dt);
    w.what = fmt::format("{} leaves of {} elements", n, numel);
  } else if (name == "transformer") {
    // A 6-layer, hidden 256, vocabulary 8192 model: the token embedding [8192, 256] (tied with
    // the output head, no learned position embedding) plus 12 leaves per layer:
    //   attn.qkv [768,256]+[768], attn.out [256,256]+[256], ln1 [256]+[256],
    //   mlp.fc1 [1024,256]+[1024], mlp.fc2 [256,1024]+[256], ln2 [256]+[256]
    // = 789,760 elements per layer; 2,097,152 + 6 * 789,760 = 6,835,712 elements, 73 leaves,
    // 27,342,848 B (27.3 MB, 26.08 MiB) in float32. A [512,256] position embedding would make
    // it 74 leaves, so it is left out to match the 73-leaf target.
    constexpr std::int64_t H = 256, V = 8192, F = 4 * H;
    add({"embed", "weight"}, {V, H}, dt);
    for (int l = 0; l < 6; ++l) {
      const std::string b = fmt::format("h{}", l);
      add({b, "attn", "qkv", "weight"}, {3 * H, H}, dt);
      add({b, "attn", "qkv", "bias"}, {3 * H}, dt);
      add({b, "attn", "out", "weight"}, {H, H}, dt);
      add({b, "attn", "out", "bias"}, {H}, dt);
      add({b, "ln1", "weight"}, {H}, dt);
      add({b, "ln1", "bias"}, {H}, dt);
      add({b, "mlp", "fc1", "weight"}, {F, H}, dt);
      add({b, "mlp", "fc1", "bias"}, {F}, dt);
      add({b, "mlp", "fc2", "weight"}, {H, F}, dt);
      add({b, "mlp", "fc2", "bias"}, {H}, dt);
      add({b, "ln2", "weight"}, {H}, dt);
      add({b, "ln2", "bias"}, {H}, dt);
    }
    w.what = "6-layer transformer, hidden 256, vocab 8192";
  } else if (name == "large") {
    for (int i = 0; i < 8; ++i) add({fmt::format("w{}", i)}, {1024, 1024}, dt);
    w.what = "8 leaves of 1M elements";
  } else if (name == "mixed") {
    // 3000 leaves of 64..4096 elements (sizes from a fixed hash), dtypes cycling float32,
    // float64, int64, bfloat16 in key order (zero-padded names keep key order = index order).
    constexpr td::DType kCycle[] = {td::DType::Float32, td::DType::Float64, td::DType::Int64,
                                    td::DType::BFloat16};
    for (int i = 0; i < 3000; ++i) {
      const auto numel =
          static_cast<std::int64_t>(64 + splitmix64(static_cast<std::uint64_t>(i)) % 4033);
      add({fmt::format("g{:02}", i / 100), fmt::format("t{:02}", i % 100)}, {numel}, kCycle[i % 4]);
    }
    w.what = "3000 leaves of 64-4096 elements, 4 dtypes interleaved";
  }
  return w;
}

std::map<td::DType, std::size_t> bytes_per_dtype(const Workload& w) {
  std::map<td::DType, std::size_t> out;
  for (const auto& l : w.leaves)
    out[l.dtype] += static_cast<std::size_t>(numel_of(l.shape)) * td::itemsize(l.dtype);
  return out;
}

td::TensorDict build_dict(const Workload& w, bool zero_size) {
  td::TensorDict d;
  for (const auto& l : w.leaves)
    d.set(td::Key(l.key),
          zero_size ? td::Tensor::empty({0}, l.dtype) : td::Tensor::zeros(l.shape, l.dtype));
  return d;
}

}  // namespace td_bench
