// train_linear: data-parallel SGD on a linear regression y = X w + b.
//
// The recipe of torch's DistributedDataParallel, by hand: every rank starts from the same
// parameters, computes gradients on its own shard of the data, averages the gradients with one
// bucketed all_reduce, and takes the same SGD step, so the parameters stay identical everywhere
// without ever being sent again. Run it with:  mpirun -np 4 --oversubscribe build/bin/train_linear
//
// RANKS: 1 2 4
// EXPECT: converged: yes
// EXPECT: parameters identical on every rank: yes
#include <cstdint>
#include <cstdio>
#include <random>
#include <vector>

#include <fmt/format.h>
#include <Eigen/Core>

#include <tensordict/tensordict.hpp>

namespace {

constexpr int kFeatures = 8;
constexpr int kSamplesPerRank = 256;
constexpr int kSteps = 200;
constexpr float kLearningRate = 0.05F;
constexpr float kNoise = 0.01F;
// The best achievable mean squared error is about kNoise^2 = 1e-4, whatever the rank count;
// ten times that leaves room for sampling noise and float32 rounding.
constexpr float kConvergedLoss = 1e-3F;

// This rank's shard: X [N, 8] and y [N] drawn around a fixed true model. Seeding by rank gives
// every rank different data (that is the point of data parallelism), yet every run the same.
struct Shard {
  td::Tensor x, y;
};
Shard make_shard(int rank) {
  const std::vector<float> true_w = {0.5F, -1.0F, 2.0F, 0.0F, 1.5F, -0.5F, 0.25F, 1.0F};
  const float true_b = 0.3F;
  std::mt19937 gen(1234U + static_cast<unsigned>(rank));
  std::normal_distribution<float> normal(0.0F, 1.0F);

  Shard s{td::Tensor::empty({kSamplesPerRank, kFeatures}, td::DType::Float32),
          td::Tensor::empty({kSamplesPerRank}, td::DType::Float32)};
  auto x = s.x.matrix<float>();  // Eigen maps: views of the tensors' storage, no copies
  auto y = s.y.array<float>();
  for (int i = 0; i < kSamplesPerRank; ++i) {
    float target = true_b + kNoise * normal(gen);
    for (int j = 0; j < kFeatures; ++j) {
      x(i, j) = normal(gen);
      target += true_w[static_cast<std::size_t>(j)] * x(i, j);
    }
    y(i) = target;
  }
  return s;
}

// Mean squared error of the shard, and its gradients written into `out`
// ({"grad": {"w", "b"}, "loss"}). Returning the loss in the same dict as the gradients means
// one all_reduce averages both: no extra collective just for logging.
void loss_and_gradients(Shard& data, td::TensorDict& params, td::TensorDict& out) {
  const auto x = data.x.matrix<float>();
  const auto y = data.y.array<float>().matrix();
  const auto w = params.get("w").array<float>().matrix();
  const float b = params.get("b").array<float>()(0);

  const Eigen::VectorXf residual = ((x * w).array() + b).matrix() - y;
  const float n = static_cast<float>(kSamplesPerRank);
  out.get({"grad", "w"}).array<float>() = (2.0F / n) * (x.transpose() * residual).array();
  out.get({"grad", "b"}).array<float>()(0) = (2.0F / n) * residual.sum();
  out.get("loss").array<float>()(0) = residual.squaredNorm() / n;
}

}  // namespace

int main(int argc, char** argv) {
  td::init_process_group(argc, argv);
  const int rank = td::get_rank();

  // Parameters: rank 0 draws them, the others hold zeros until the broadcast. Starting from
  // rank 0's values everywhere is what keeps the ranks in lockstep from the first step.
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

  Shard data = make_shard(rank);

  // Allocated once and overwritten each step: the same layout every step lets the library reuse
  // its cached bucket plan instead of rebuilding it.
  td::TensorDict out;
  out.set({"grad", "w"}, td::Tensor::zeros({kFeatures}, td::DType::Float32));
  out.set({"grad", "b"}, td::Tensor::zeros({1}, td::DType::Float32));
  out.set("loss", td::Tensor::zeros({1}, td::DType::Float32));

  for (int step = 1; step <= kSteps; ++step) {
    loss_and_gradients(data, params, out);

    // Every shard has the same size, so the average of the shards' gradients is the gradient of
    // the loss over all the data. async_op hands back the pending Works; a real model would
    // launch this per layer during the backward pass and overlap it with the remaining layers.
    std::vector<td::Work> works =
        out.all_reduce(td::ReduceOp::AVG, {.async_op = true, .bucket_bytes = td::kAutoBucketBytes});
    td::wait_all(works);  // the averaged values may be read only after this

    // The same averaged gradient on every rank gives the same update on every rank.
    params.get("w").array<float>() -= kLearningRate * out.get({"grad", "w"}).array<float>();
    params.get("b").array<float>() -= kLearningRate * out.get({"grad", "b"}).array<float>();

    if (rank == 0 && step % 20 == 0)
      fmt::print("step {} loss {:.4f}\n", step, out.get("loss").array<float>()(0));
  }

  // The loss at the final parameters, averaged over every rank's shard.
  loss_and_gradients(data, params, out);
  td::all_reduce(out.get("loss"), td::ReduceOp::AVG);
  const float final_loss = out.get("loss").array<float>()(0);

  // Lockstep check: if every rank holds the same parameters, the element-wise MAX and MIN over
  // the ranks are equal bit for bit. Reduce clones, so the parameters themselves stay intact.
  td::TensorDict max_params = params.clone();
  td::TensorDict min_params = params.clone();
  max_params.all_reduce(td::ReduceOp::MAX);
  min_params.all_reduce(td::ReduceOp::MIN);
  const bool identical = max_params.equal(min_params);

  const bool converged = final_loss < kConvergedLoss;
  if (rank == 0) {
    fmt::print("final loss {:.6f}\n", final_loss);
    fmt::print("converged: {}\n", converged ? "yes" : "no");
    fmt::print("parameters identical on every rank: {}\n", identical ? "yes" : "no");
    std::fflush(stdout);
  }

  td::destroy_process_group();
  // final_loss and identical are the same on every rank (both come from all_reduce), so every
  // rank returns the same exit code.
  return converged && identical ? 0 : 1;
}
