// reduce_scatter_gradients: sharded data parallelism (ZeRO / FSDP style) with reduce_scatter.
//
// Every rank computes gradients for all parameters, but each rank owns (and updates) only a shard
// of every parameter: rows [rank * n / size, (rank + 1) * n / size). reduce_scatter(AVG) hands
// each rank the mean gradient of exactly its rows, bucketed like all_reduce (one
// MPI_Reduce_scatter_block per bucket instead of one per leaf); the rank applies the SGD step to
// its shard, and all_gather_stacked reassembles the full parameters: its leaves are
// [size, n / size, ...], which is the full leaf once viewed as [n, ...].
// Run it with:  mpirun -np 3 --oversubscribe build/bin/reduce_scatter_gradients
//
// RANKS: 2 3 4
// EXPECT: w: 12 rows, every element 0.9000
// EXPECT: b: 12 rows, every element 0.8000
#include <algorithm>
#include <cstdio>
#include <vector>

#include <fmt/format.h>

#include <tensordict/tensordict.hpp>

int main(int argc, char** argv) {
  td::init_process_group(argc, argv);
  const int rank = td::get_rank();
  const int size = td::get_world_size();
  constexpr std::int64_t kRows = 12;  // divisible by 1, 2, 3 and 4 ranks
  constexpr float kLearningRate = 0.1f;

  td::TensorDict params({kRows});
  params.set("w", td::Tensor::full<float>({kRows, 2}, 1.0f));
  params.set("b", td::Tensor::full<float>({kRows}, 1.0f));

  // This rank's gradients: 1 for w and 2 for b, plus an offset that cancels out across ranks.
  const float offset = 0.25f * (static_cast<float>(rank) - static_cast<float>(size - 1) / 2.0f);
  td::TensorDict grads({kRows});
  grads.set("w", td::Tensor::full<float>({kRows, 2}, 1.0f + offset));
  grads.set("b", td::Tensor::full<float>({kRows}, 2.0f + offset));

  // The mean gradient of this rank's rows only, every leaf in one bucket.
  const td::TensorDict shard_grads =
      grads.reduce_scatter(td::ReduceOp::AVG, {.bucket_bytes = td::kAutoBucketBytes});

  // This rank's rows of the parameters: a view, so the step updates them in place.
  const std::int64_t rows = kRows / size;
  td::TensorDict shard({rows});
  for (const auto& [key, p] : params.canonical_leaves())
    shard.set(key, p.slice(0, rank * rows, (rank + 1) * rows));
  for (auto& [key, p] : shard.canonical_leaves()) {
    td::Tensor g = shard_grads.get(key);
    p.array<float>() -= kLearningRate * g.array<float>();
  }

  // Every rank's updated shard, stacked: [size, rows, ...] -> the full [kRows, ...] parameters.
  const td::TensorDict stacked = shard.all_gather_stacked();
  for (const char* name : {"w", "b"}) {
    td::Shape full = params.get(name).shape();
    const td::Tensor gathered = stacked.get(name).view(full);
    params.get(name).copy_(gathered);
  }

  if (rank == 0) {
    for (const char* name : {"w", "b"}) {
      const auto v = params.get(name).to_vector<float>();
      const auto [lo, hi] = std::minmax_element(v.begin(), v.end());
      if (*lo == *hi) {
        fmt::print("{}: {} rows, every element {:.4f}\n", name, kRows, *lo);
      } else {
        fmt::print("{}: {} rows, from {:.4f} to {:.4f}\n", name, kRows, *lo, *hi);
      }
    }
    std::fflush(stdout);
  }
  td::destroy_process_group();
  return 0;
}
