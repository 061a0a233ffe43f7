// train_reducer: data-parallel SGD with td::Reducer, DDP's recipe in C++.
//
// The model of train_linear (y = X w + b), trained with two micro-batches per step (gradient
// accumulation, DDP's no_sync): the first backward pass accumulates into the gradients without
// marking them ready; the second marks each gradient ready as soon as it is computed (the bias
// first, as a backward pass goes from the last layer to the first), so its reduction starts
// while the next one is still being computed; finish() waits for all of them.
// Run it with:  mpirun -np 4 --oversubscribe build/bin/train_reducer
//
// RANKS: 2 3 4
// EXPECT: converged: yes
// EXPECT: parameters identical on every rank: yes
#include <cstdio>
#include <random>
#include <vector>

#include <fmt/format.h>
#include <Eigen/Core>

#include <tensordict/tensordict.hpp>

namespace {

constexpr int kFeatures = 8;
constexpr int kMicroBatch = 128;
constexpr int kMicroBatches = 2;
constexpr int kSteps = 200;
constexpr float kLearningRate = 0.05F;
constexpr float kNoise = 0.01F;
constexpr float kConvergedLoss = 1e-3F;

struct Shard {
  Eigen::MatrixXf x;
  Eigen::VectorXf y;
};

// This rank's data: kMicroBatches * kMicroBatch samples around a fixed true model.
Shard make_shard(int rank) {
  const std::vector<float> true_w = {0.5F, -1.0F, 2.0F, 0.0F, 1.5F, -0.5F, 0.25F, 1.0F};
  std::mt19937 gen(1234U + static_cast<unsigned>(rank));
  std::normal_distribution<float> normal(0.0F, 1.0F);
  const int n = kMicroBatch * kMicroBatches;
  Shard s{Eigen::MatrixXf(n, kFeatures), Eigen::VectorXf(n)};
  for (int i = 0; i < n; ++i) {
    float target = 0.3F + kNoise * normal(gen);
    for (int j = 0; j < kFeatures; ++j) {
      s.x(i, j) = normal(gen);
      target += true_w[static_cast<std::size_t>(j)] * s.x(i, j);
    }
    s.y(i) = target;
  }
  return s;
}

}  // namespace

int main(int argc, char** argv) {
  td::init_process_group(argc, argv);
  const int rank = td::get_rank();

  td::TensorDict params;
  params.set("w", td::Tensor::zeros({kFeatures}, td::DType::Float32));
  params.set("b", td::Tensor::zeros({1}, td::DType::Float32));
  if (rank == 0) {
    std::mt19937 gen(42);
    std::uniform_real_distribution<float> uniform(-1.0F, 1.0F);
    auto w = params.get("w").array<float>();
    for (Eigen::Index j = 0; j < w.size(); ++j) w(j) = uniform(gen);
  }
  params.broadcast(/*src=*/0);
  const Shard data = make_shard(rank);

  // The gradients, one leaf per parameter. The Reducer moves them into its buckets: from here
  // on, write gradients into these leaves (Eigen maps, copy_), never set new tensors.
  td::TensorDict grads;
  grads.set("w", td::Tensor::zeros({kFeatures}, td::DType::Float32));
  grads.set("b", td::Tensor::zeros({1}, td::DType::Float32));
  td::Reducer reducer(grads, {.op = td::ReduceOp::AVG});

  float loss = 0;
  for (int step = 1; step <= kSteps; ++step) {
    grads.zero_();
    loss = 0;
    auto gw = grads.get("w").array<float>();
    auto gb = grads.get("b").array<float>();
    const auto w = params.get("w").array<float>().matrix();
    const float b = params.get("b").array<float>()(0);
    for (Eigen::Index m = 0; m < kMicroBatches; ++m) {
      const auto x = data.x.middleRows(m * kMicroBatch, kMicroBatch);
      const auto y = data.y.segment(m * kMicroBatch, kMicroBatch);
      const Eigen::VectorXf residual = ((x * w).array() + b).matrix() - y;
      const float scale = 2.0F / static_cast<float>(kMicroBatch * kMicroBatches);
      loss += residual.squaredNorm() / static_cast<float>(kMicroBatch * kMicroBatches);
      const bool last = m == kMicroBatches - 1;
      // Backward, last layer first: the bias gradient is ready before the weight gradient.
      gb(0) += scale * residual.sum();
      if (last) reducer.mark_ready("b");  // its reduction starts now
      gw += scale * (x.transpose() * residual).array();
      if (last) reducer.mark_ready("w");
    }
    reducer.finish();  // both averaged over the ranks

    params.get("w").array<float>() -= kLearningRate * gw;
    params.get("b").array<float>() -= kLearningRate * gb;
    if (rank == 0 && step % 50 == 0) fmt::print("step {} loss {:.4f}\n", step, loss);
  }

  td::Tensor final_loss = td::Tensor::full<float>({1}, loss);
  td::all_reduce(final_loss, td::ReduceOp::AVG);
  td::TensorDict max_params = params.clone();
  td::TensorDict min_params = params.clone();
  max_params.all_reduce(td::ReduceOp::MAX);
  min_params.all_reduce(td::ReduceOp::MIN);
  const bool identical = max_params.equal(min_params);
  const bool converged = final_loss.to_vector<float>()[0] < kConvergedLoss;
  if (rank == 0) {
    fmt::print("final loss {:.6f}\n", final_loss.to_vector<float>()[0]);
    fmt::print("converged: {}\n", converged ? "yes" : "no");
    fmt::print("parameters identical on every rank: {}\n", identical ? "yes" : "no");
    std::fflush(stdout);
  }
  td::destroy_process_group();
  return converged && identical ? 0 : 1;
}
