// Writes the checkpoint that open_checkpoint.py opens with Python's safetensors and tensordict:
// <dir>/state.safetensors and <dir>/state_td (a memmap directory), one process, no MPI.
// The values are the ones open_checkpoint.py expects.
#include <cstdio>
#include <filesystem>
#include <vector>

#include <tensordict/tensordict.hpp>

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: write_checkpoint DIR\n");
    return 2;
  }
  const std::filesystem::path dir = argv[1];
  std::filesystem::create_directories(dir);
  td::TensorDict d;
  d.set({"params", "w"}, td::Tensor::from_vector<float>({0, 1, 2, 3, 4, 5}, {2, 3}));
  // A strided view: written as its logical values in C order.
  d.set({"params", "w_t"}, d.get(td::Key({"params", "w"})).transpose(0, 1));
  d.set({"params", "b"}, td::Tensor::full<Eigen::half>({3}, Eigen::half(0.5F)));
  d.set({"opt", "m"}, td::Tensor::from_vector<double>({-1.5, 2.25}));
  d.set("step", td::Tensor::full<std::int64_t>({}, 42));
  d.set("mask", td::Tensor::from_vector<bool>({true, false, true}));
  d.set("empty", td::Tensor::empty({0, 4}, td::DType::Int32));
  td::save_safetensors(d, dir / "state.safetensors");
  td::save_memmap(d, dir / "state_td");
  std::printf("wrote %s\n", dir.c_str());
  return 0;
}
