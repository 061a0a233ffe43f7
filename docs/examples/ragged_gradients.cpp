// ragged_gradients: data-parallel gradients when every rank holds a different number of samples.
//
// Rank r holds 3 + 2r samples of a linear regression (y = x . w). The loss the program means is
// the mean squared error over ALL samples, as one process holding every sample would compute it.
// Two recipes with td::Reducer:
//   - per-rank mean gradient, then AVG: the mean of per-rank means, which weighs a sample of a
//     small rank more than one of a large rank; silently a different loss when ranks differ;
//   - per-rank SUM of per-sample gradients divided by the GLOBAL sample count (one all_reduce of
//     the counts), then SUM: exactly the single-process gradient.
// Both train 20 SGD steps; rank 0 checks them against a single-process run over every rank's
// samples (each rank can regenerate any rank's data).
// Run it with:  mpirun -np 3 --oversubscribe build/bin/ragged_gradients
//
// RANKS: 2 3 4
// EXPECT: global-count SUM recipe matches the single-process run: yes
// EXPECT: per-rank mean then AVG matches it: no
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <vector>

#include <fmt/format.h>

#include <tensordict/tensordict.hpp>

namespace {

constexpr int kFeatures = 3;
constexpr int kSteps = 20;
constexpr double kLearningRate = 0.05;

std::int64_t samples_of(int rank) { return 3 + 2 * static_cast<std::int64_t>(rank); }

// Rank r's samples: batch [n], "x" [n, 3], "y" [n]; a rank-dependent offset makes the per-rank
// means differ.
td::TensorDict shard_of(int rank) {
  const std::int64_t n = samples_of(rank);
  std::vector<double> x, y;
  for (std::int64_t i = 0; i < n; ++i) {
    double target = 0.5 * rank;
    for (int f = 0; f < kFeatures; ++f) {
      const double v = std::sin(1.0 + static_cast<double>(rank * 17 + i * kFeatures + f));
      x.push_back(v);
      target += (f + 1) * v;
    }
    y.push_back(target);
  }
  td::TensorDict d({n});
  d.set("x", td::Tensor::from_vector(x, {n, kFeatures}));
  d.set("y", td::Tensor::from_vector(y, {n}));
  return d;
}

// Sum over the shard's samples of the gradient of (x . w - y)^2 with respect to w.
std::vector<double> gradient_sum(const td::TensorDict& shard, const std::vector<double>& w) {
  const auto x = shard.get("x").to_vector<double>();
  const auto y = shard.get("y").to_vector<double>();
  std::vector<double> g(kFeatures, 0.0);
  for (std::size_t i = 0; i < y.size(); ++i) {
    double err = -y[i];
    for (int f = 0; f < kFeatures; ++f) err += x[i * kFeatures + f] * w[f];
    for (int f = 0; f < kFeatures; ++f) g[f] += 2.0 * err * x[i * kFeatures + f];
  }
  return g;
}

// 20 SGD steps with a Reducer of `op`; each rank's gradient is its sample sum times `scale`.
std::vector<double> train(const td::TensorDict& shard, td::ReduceOp op, double scale) {
  std::vector<double> w(kFeatures, 0.0);
  td::TensorDict grads;
  grads.set("w", td::Tensor::zeros({kFeatures}, td::DType::Float64));
  td::Reducer reducer(grads, {.op = op});
  for (int step = 0; step < kSteps; ++step) {
    const std::vector<double> g = gradient_sum(shard, w);
    double* out = grads.get("w").data<double>();  // a handle taken after construction
    for (int f = 0; f < kFeatures; ++f) out[f] = g[f] * scale;
    reducer.mark_ready("w");
    reducer.finish();
    for (int f = 0; f < kFeatures; ++f) w[f] -= kLearningRate * out[f];
  }
  return w;
}

double max_difference(const std::vector<double>& a, const std::vector<double>& b) {
  double d = 0;
  for (std::size_t i = 0; i < a.size(); ++i) d = std::max(d, std::abs(a[i] - b[i]));
  return d;
}

}  // namespace

int main(int argc, char** argv) {
  td::init_process_group(argc, argv);
  const int rank = td::get_rank(), size = td::get_world_size();
  const td::TensorDict shard = shard_of(rank);
  const auto mine = static_cast<double>(shard.batch_size()[0]);

  // The global sample count: one all_reduce of every rank's count.
  td::Tensor count = td::Tensor::full<std::int64_t>({1}, static_cast<std::int64_t>(mine));
  td::all_reduce(count, td::ReduceOp::SUM);
  const auto total = static_cast<double>(count.item<std::int64_t>());

  const std::vector<double> right = train(shard, td::ReduceOp::SUM, 1.0 / total);
  const std::vector<double> mean_of_means = train(shard, td::ReduceOp::AVG, 1.0 / mine);

  if (rank == 0) {
    // One process holding every rank's samples: the loss the program means.
    std::vector<td::TensorDict> all;
    for (int r = 0; r < size; ++r) all.push_back(shard_of(r));
    const td::TensorDict everything = td::cat(all);
    std::vector<double> w(kFeatures, 0.0);
    for (int step = 0; step < kSteps; ++step) {
      const std::vector<double> g = gradient_sum(everything, w);
      for (int f = 0; f < kFeatures; ++f) w[f] -= kLearningRate * g[f] / total;
    }
    const double off_right = max_difference(right, w), off_wrong = max_difference(mean_of_means, w);
    fmt::print("{} samples on {} ranks; single-process w = [{:.4f}, {:.4f}, {:.4f}]\n",
               static_cast<std::int64_t>(total), size, w[0], w[1], w[2]);
    fmt::print("global-count SUM recipe: max difference {:.1e}\n", off_right);
    fmt::print("per-rank mean then AVG: max difference {:.1e}\n", off_wrong);
    fmt::print("global-count SUM recipe matches the single-process run: {}\n",
               off_right < 1e-12 ? "yes" : "no");
    fmt::print("per-rank mean then AVG matches it: {}\n", off_wrong < 1e-12 ? "yes" : "no");
    std::fflush(stdout);
  }
  td::destroy_process_group();
  return 0;
}
