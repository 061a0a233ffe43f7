// tensordict_allreduce: averaging a whole nested dict of gradients in a few large messages.
//
// A model's gradients are hundreds of small tensors. One MPI collective per tensor would pay
// the per-message latency hundreds of times; TensorDict::all_reduce with bucket_bytes packs
// same-dtype leaves into buckets and reduces each bucket as one message.
// Run it with:  mpirun -np 3 --oversubscribe build/bin/tensordict_allreduce
//
// RANKS: 2 3
// EXPECT: 1 MiB buckets: averaged 300 leaves: ok
// EXPECT: consolidated, auto buckets: averaged 300 leaves: ok
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include <fmt/format.h>

#include <tensordict/tensordict.hpp>

namespace {

// 2 parts x 50 layers x 3 leaves = 300 leaves: float32 weights and biases, and a float64
// statistic, so the packer has two dtypes to keep apart (a buffer holds one dtype only).
td::TensorDict make_gradients(double value) {
  td::TensorDict grads;
  for (const char* part : {"encoder", "decoder"}) {
    for (int layer = 0; layer < 50; ++layer) {
      const std::string name = "layer" + std::to_string(layer);
      grads.set({part, name, "weight"}, td::Tensor::full<float>({8, 8}, static_cast<float>(value)));
      grads.set({part, name, "bias"}, td::Tensor::full<float>({8}, static_cast<float>(value)));
      grads.set({part, name, "running_var"}, td::Tensor::full<double>({8}, value));
    }
  }
  return grads;
}

// Overwrites every leaf in place. canonical_leaves() returns tensors that share storage with
// the dict, so writing through them writes into the dict.
void fill(td::TensorDict& d, double value) {
  for (auto& [key, t] : d.canonical_leaves()) {
    if (t.dtype() == td::DType::Float32)
      t.array<float>().setConstant(static_cast<float>(value));
    else
      t.array<double>().setConstant(value);
  }
}

// Number of leaves with an element off `expected`. A small tolerance, because AVG may be
// computed as a multiplication by 1/size rather than a division.
std::int64_t count_wrong(const td::TensorDict& d, double expected) {
  std::int64_t wrong = 0;
  for (const auto& [key, t] : d.canonical_leaves()) {
    bool ok = true;
    if (t.dtype() == td::DType::Float32) {
      for (float x : t.to_vector<float>()) ok = ok && std::abs(x - expected) < 1e-6;
    } else {
      for (double x : t.to_vector<double>()) ok = ok && std::abs(x - expected) < 1e-12;
    }
    if (!ok) {
      fmt::print(stderr, "rank {}: leaf {} is wrong: {}\n", td::get_rank(), key.str(), t);
      ++wrong;
    }
  }
  return wrong;
}

// Every rank checked its own copy; sum the failures so that every rank returns the same exit
// code and rank 0 can speak for all of them.
bool all_ranks_ok(std::int64_t wrong_here) {
  td::Tensor wrong = td::Tensor::from_vector<std::int64_t>({wrong_here});
  td::all_reduce(wrong, td::ReduceOp::SUM);
  return wrong.to_vector<std::int64_t>()[0] == 0;
}

}  // namespace

int main(int argc, char** argv) {
  td::init_process_group(argc, argv);
  const int rank = td::get_rank();
  const int size = td::get_world_size();

  // Rank r contributes r + 1, so the average is (1 + ... + size) / size = (size + 1) / 2.
  const double expected = (size + 1) / 2.0;
  td::TensorDict grads = make_gradients(rank + 1);
  const auto n_leaves = grads.canonical_leaves().size();

  // 1. An explicit cap: buckets of at most 1 MiB. Every rank walks the leaves in sorted key
  //    order and first checks that all ranks hold the same keys, dtypes and shapes, so a
  //    mismatch is a td::LayoutMismatchError on every rank instead of silently pairing the
  //    wrong tensors. The call is synchronous: every leaf is averaged when it returns.
  grads.all_reduce(td::ReduceOp::AVG, {.bucket_bytes = std::size_t{1} << 20});
  const bool ok1 = all_ranks_ok(count_wrong(grads, expected));

  // 2. consolidate() moves all leaves of one dtype into one storage (leaves become views into
  //    it), so a bucket is already a contiguous slice and needs no packing copy. It replaces the
  //    leaves' storage: take tensors from the dict again afterwards, not from before the call.
  //    kAutoBucketBytes lets the library pick the cap it tuned for this machine, and async_op
  //    returns the pending Works instead of blocking.
  grads.consolidate();
  fill(grads, rank + 1);
  std::vector<td::Work> works =
      grads.all_reduce(td::ReduceOp::AVG, {.async_op = true, .bucket_bytes = td::kAutoBucketBytes});
  td::wait_all(works);  // the leaves are valid only after their Work has been waited for
  const bool ok2 = all_ranks_ok(count_wrong(grads, expected));

  if (rank == 0) {
    fmt::print("1 MiB buckets: averaged {} leaves: {}\n", n_leaves, ok1 ? "ok" : "FAILED");
    fmt::print("consolidated, auto buckets: averaged {} leaves: {}\n", n_leaves,
               ok2 ? "ok" : "FAILED");
    fmt::print("averaged {} leaves across {} ranks: {}\n", n_leaves, size,
               ok1 && ok2 ? "ok" : "FAILED");
    std::fflush(stdout);
  }

  td::destroy_process_group();
  return ok1 && ok2 ? 0 : 1;
}
