// worker_model_startup: workers that know nothing of the model receive it from rank 0 at start-up
// with td::broadcast_dict (Python tensordict's broadcast / from_remote_init).
//
// Rank 0 builds (or would load) the model: a tensorclass with nested fields of two dtypes. The
// workers pass an empty dict: broadcast_dict sends the keys, dtypes, shapes and batch sizes
// first, then the values, one message per dtype. Each worker turns the result back into the
// tensorclass with from_tensordict; its leaves are views into one storage per dtype
// (consolidated), ready for layout-checked collectives such as all_reduce of gradients.
// Run it with:  mpirun -np 3 --oversubscribe build/bin/worker_model_startup
//
// RANKS: 2 3
// EXPECT: every rank holds the model: 3 leaves, 4225 parameters, checksum 6272.0
#include <cstdint>
#include <cstdio>

#include <fmt/format.h>

#include <tensordict/tensordict.hpp>

namespace {

struct Layer : td::TensorClass<Layer> {
  td::Tensor weight;  // float32 [out, in]
  td::Tensor bias;    // float32 [out]
  TD_TENSORCLASS_FIELDS(Layer, weight, bias)
};

struct Model : td::TensorClass<Model> {
  Layer hidden;
  td::Tensor step;  // int64, 0-d: the training step the weights come from
  TD_TENSORCLASS_FIELDS(Model, hidden, step)
};

// What rank 0 would load from a checkpoint.
Model load_model() {
  Model m;
  m.hidden.weight = td::Tensor::empty({64, 65}, td::DType::Float32);
  float* w = m.hidden.weight.data<float>();
  for (std::int64_t i = 0; i < m.hidden.weight.numel(); ++i)
    w[i] = static_cast<float>(i % 13) * 0.25f;
  m.hidden.bias = td::Tensor::full<float>({64}, 0.5f);
  m.step = td::Tensor::full<std::int64_t>({}, 1200);
  return m;
}

double checksum(const Model& m) {
  double s = 0;
  for (const float v : m.hidden.weight.to_vector<float>()) s += v;
  for (const float v : m.hidden.bias.to_vector<float>()) s += v;
  return s;
}

}  // namespace

int main(int argc, char** argv) {
  td::init_process_group(argc, argv);
  const int rank = td::get_rank();

  // Only rank 0 has a model; the others know nothing of its layout.
  const td::TensorDict sent = rank == 0 ? load_model().to_tensordict() : td::TensorDict();
  const Model model = Model::from_tensordict(td::broadcast_dict(sent, /*src=*/0));

  // Every rank checks what it holds; rank 0 reports once all agree.
  const double mine = checksum(model);
  double low = mine, high = mine;
  MPI_Allreduce(MPI_IN_PLACE, &low, 1, MPI_DOUBLE, MPI_MIN, MPI_COMM_WORLD);
  MPI_Allreduce(MPI_IN_PLACE, &high, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  const std::int64_t params = model.hidden.weight.numel() + model.hidden.bias.numel() + 1;
  if (rank == 0 && low == high && model.step.item<std::int64_t>() == 1200)
    fmt::print("every rank holds the model: {} leaves, {} parameters, checksum {:.1f}\n",
               model.to_tensordict().keys(true, true).size(), params, mine);
  td::destroy_process_group();
}
