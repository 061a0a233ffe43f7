// parameter_server: a parameter-server exchange with TensorDict send / recv.
//
// Rank 0 holds the parameters. Every step each worker (rank 1..N-1) receives the current
// parameters, computes a gradient and sends it back; the server receives one gradient per worker,
// averages them and applies an SGD step. The server posts everything with isend / irecv, so the
// workers' gradients arrive in any order; the leaves travel as one message per dtype
// (bucket_bytes = td::kAutoBucketBytes). A worker whose dict had another layout would make both
// sides raise td::LayoutMismatchError naming the key, before any data moved.
// Run it with:  mpirun -np 3 --oversubscribe build/bin/parameter_server
//
// RANKS: 2 3 4
// EXPECT: step 3: w = [0.8750, 1.7500, 2.6250], b = 0.4375
#include <cstdio>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <tensordict/tensordict.hpp>

namespace {

td::TensorDict zeros_like_params() {
  td::TensorDict d;
  d.set({"layer", "w"}, td::Tensor::zeros({3}, td::DType::Float32));
  d.set({"layer", "b"}, td::Tensor::zeros({1}, td::DType::Float32));
  return d;
}

// The gradient worker `w` of `workers` computes: the distance to a fixed target, plus noise that
// cancels out across the workers (so the result does not depend on their number).
td::TensorDict gradient(const td::TensorDict& params, int w, int workers) {
  const float noise = 0.1f * (static_cast<float>(w) - static_cast<float>(workers + 1) / 2.0f);
  td::TensorDict g = params.clone();
  auto weights = g.get({"layer", "w"}).array<float>();
  for (Eigen::Index i = 0; i < weights.size(); ++i) weights[i] -= static_cast<float>(i + 1) - noise;
  g.get({"layer", "b"}).array<float>() -= 0.5f - noise;
  return g;
}

}  // namespace

int main(int argc, char** argv) {
  td::init_process_group(argc, argv);
  const int rank = td::get_rank();
  const int workers = td::get_world_size() - 1;
  const td::CollectiveOptions consolidated{.bucket_bytes = td::kAutoBucketBytes};
  constexpr float kLearningRate = 0.5f;

  td::TensorDict params = zeros_like_params();
  for (int step = 1; step <= 3; ++step) {
    if (rank == 0) {
      // Parameters out to every worker, then their gradients in, all in flight at once.
      std::vector<td::Work> pending;
      std::vector<td::TensorDict> grads;
      for (int w = 1; w <= workers; ++w) grads.push_back(zeros_like_params());
      for (int w = 1; w <= workers; ++w) {
        for (auto& work : params.isend(w, consolidated)) pending.push_back(std::move(work));
        for (auto& work : grads[static_cast<std::size_t>(w - 1)].irecv(w))
          pending.push_back(std::move(work));
      }
      td::wait_all(pending);
      // SGD on the mean gradient.
      for (auto& [key, p] : params.canonical_leaves()) {
        Eigen::ArrayXf sum = Eigen::ArrayXf::Zero(p.numel());
        for (auto& g : grads) sum += g.get(key).array<float>();
        p.array<float>() -= kLearningRate * sum / static_cast<float>(workers);
      }
      fmt::print("step {}: w = [{:.4f}], b = {:.4f}\n", step,
                 fmt::join(params.get({"layer", "w"}).to_vector<float>(), ", "),
                 params.get({"layer", "b"}).to_vector<float>()[0]);
      std::fflush(stdout);
    } else {
      params.recv(0);
      gradient(params, rank, workers).send(0, consolidated);
    }
  }
  td::destroy_process_group();
  return 0;
}
