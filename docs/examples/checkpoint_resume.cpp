// checkpoint_resume: data-parallel training that checkpoints every N steps and resumes from the
// file, as a job restarted after a failure would.
//
// The state (parameters, the optimizer's momentum and the step counter) is one TensorDict, the
// same on every rank, saved with td::save_safetensors over the world group: every rank writes its
// share of the file with collective MPI-IO, and the file replaces the previous checkpoint only
// once every rank's part is on disk. Python opens it with safetensors.torch.load_file(path) (the
// keys are "params.w", "params.b", "opt.w", "opt.b", "step").
//
// The program trains 100 steps without stopping, then starts over: 60 steps (checkpoints at 20,
// 40, 60), "crashes", loads the step-60 checkpoint into a fresh state (load_safetensors with the
// state as `like`: its keys, dtypes and shapes are checked) and trains to 100. Each step's data
// depends only on the step and the rank, so the resumed run must end with exactly the same
// parameters. Run it with:  mpirun -np 2 build/bin/checkpoint_resume [directory]
//
// RANKS: 1 2 3
// EXPECT: checkpoint at step 20, 40, 60
// EXPECT: resumed from step 60
// EXPECT: parameters identical to an uninterrupted run: yes
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <random>
#include <string>

#include <fmt/format.h>

#include <tensordict/tensordict.hpp>

namespace {

constexpr int kFeatures = 4;
constexpr int kBatch = 32;
constexpr int kCheckpointEvery = 20;
constexpr float kLearningRate = 0.05F;
constexpr float kMomentum = 0.9F;

td::TensorDict initial_state() {
  td::TensorDict s;
  s.set({"params", "w"}, td::Tensor::zeros({kFeatures}, td::DType::Float32));
  s.set({"params", "b"}, td::Tensor::zeros({1}, td::DType::Float32));
  s.set({"opt", "w"}, td::Tensor::zeros({kFeatures}, td::DType::Float32));
  s.set({"opt", "b"}, td::Tensor::zeros({1}, td::DType::Float32));
  s.set("step", td::Tensor::full<std::int64_t>({}, 0));
  return s;
}

// One SGD step with momentum on this rank's batch of step `step` (y = x . [1, -2, 3, 0.5] + 1),
// the gradient averaged across ranks.
void train_step(td::TensorDict& s) {
  const auto step = s.get("step").item<std::int64_t>();
  std::mt19937 gen(static_cast<unsigned>(step * 1000 + td::get_rank()));
  std::normal_distribution<float> normal;
  const float true_w[kFeatures] = {1.0F, -2.0F, 3.0F, 0.5F};
  float* w = s.get({"params", "w"}).data<float>();
  float* b = s.get({"params", "b"}).data<float>();
  td::TensorDict grads;
  grads.set("w", td::Tensor::zeros({kFeatures}, td::DType::Float32));
  grads.set("b", td::Tensor::zeros({1}, td::DType::Float32));
  float* gw = grads.get("w").data<float>();
  float* gb = grads.get("b").data<float>();
  for (int i = 0; i < kBatch; ++i) {
    float x[kFeatures], y = 1.0F, pred = *b;
    for (int f = 0; f < kFeatures; ++f) {
      x[f] = normal(gen);
      y += true_w[f] * x[f];
      pred += w[f] * x[f];
    }
    const float err = pred - y;
    for (int f = 0; f < kFeatures; ++f) gw[f] += 2.0F * err * x[f] / kBatch;
    *gb += 2.0F * err / kBatch;
  }
  grads.all_reduce(td::ReduceOp::AVG, {.bucket_bytes = td::kAutoBucketBytes});
  for (const char* p : {"w", "b"}) {
    float* param = s.get({"params", p}).data<float>();
    float* m = s.get({"opt", p}).data<float>();
    const float* g = grads.get(p).data<float>();
    for (std::int64_t k = 0; k < grads.get(p).numel(); ++k) {
      m[k] = kMomentum * m[k] + g[k];
      param[k] -= kLearningRate * m[k];
    }
  }
  s.get("step").data<std::int64_t>()[0] = step + 1;
}

}  // namespace

int main(int argc, char** argv) {
  td::init_process_group(argc, argv);
  const int rank = td::get_rank();
  // One directory for every rank (rank 0's process id names it), or the one given.
  td::Tensor id = td::Tensor::full<std::int64_t>({1}, ::getpid());
  td::broadcast(id, 0);
  const std::filesystem::path dir =
      argc > 1 ? std::filesystem::path(argv[1])
               : std::filesystem::temp_directory_path() /
                     fmt::format("td-checkpoint-resume-{}", id.item<std::int64_t>());
  if (rank == 0) std::filesystem::create_directories(dir);
  td::barrier();
  const std::filesystem::path file = dir / "state.safetensors";
  const td::FileOptions opts{.group = td::world()};

  // The reference: 100 steps without a stop.
  td::TensorDict uninterrupted = initial_state();
  for (int i = 0; i < 100; ++i) train_step(uninterrupted);

  // The same training, checkpointed every 20 steps, lost after step 60...
  std::string saved;
  {
    td::TensorDict state = initial_state();
    while (state.get("step").item<std::int64_t>() < 60) {
      train_step(state);
      const auto step = state.get("step").item<std::int64_t>();
      if (step % kCheckpointEvery == 0) {
        td::save_safetensors(state, file, opts);
        saved += fmt::format("{}{}", saved.empty() ? "" : ", ", step);
      }
    }
  }
  if (rank == 0) fmt::print("checkpoint at step {}\n", saved);

  // ... and resumed from the file into a fresh state.
  td::TensorDict state = td::load_safetensors(file, initial_state(), opts);
  if (rank == 0) fmt::print("resumed from step {}\n", state.get("step").item<std::int64_t>());
  while (state.get("step").item<std::int64_t>() < 100) train_step(state);

  const bool same = state.equal(uninterrupted);
  if (rank == 0) {
    fmt::print("parameters identical to an uninterrupted run: {}\n", same ? "yes" : "no");
    const auto w = state.get({"params", "w"}).to_vector<float>();
    fmt::print("w = [{:.3f}, {:.3f}, {:.3f}, {:.3f}], b = {:.3f}\n", w[0], w[1], w[2], w[3],
               state.get({"params", "b"}).item<float>());
    if (argc <= 1) std::filesystem::remove_all(dir);
  }
  td::destroy_process_group();
  return same ? 0 : 1;
}
