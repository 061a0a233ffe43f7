// A rank killed (SIGKILL) while a parallel save_safetensors is under way (issue 30): the previous
// checkpoint must stay intact and no partial file may appear under the target's name.
//   fault_checkpoint_killed save DIR    (under mpiexec, 2 ranks or more): saves checkpoint v1,
//       then starts saving a 256 MiB v2 while rank 1 kills itself a few milliseconds in;
//   fault_checkpoint_killed verify DIR  (one process, no MPI): DIR/ckpt.safetensors must be v1.
// test/faults/checkpoint_killed.sh runs both.
#include <unistd.h>

#include <chrono>
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <string>
#include <thread>

#include <tensordict/tensordict.hpp>

namespace {

td::TensorDict version(int v, std::int64_t elems) {
  td::TensorDict d;
  for (int i = 0; i < 8; ++i)
    d.set({"layers", fmt::format("w{}", i)},
          td::Tensor::full<float>({elems / 8}, static_cast<float>(v * 100 + i)));
  d.set("version", td::Tensor::full<std::int64_t>({}, v));
  return d;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3) return 2;
  const std::string mode = argv[1];
  const std::filesystem::path file = std::filesystem::path(argv[2]) / "ckpt.safetensors";
  if (mode == "verify") {
    const bool intact = td::load_safetensors(file).equal(version(1, 1 << 16));
    std::printf("%s\n", intact ? "previous checkpoint intact" : "CHECKPOINT CHANGED");
    return intact ? 0 : 1;
  }
  td::init_process_group(argc, argv);
  const int rank = td::get_rank();
  const td::FileOptions opts{.group = td::world(), .timeout = std::chrono::seconds(20)};
  td::save_safetensors(version(1, 1 << 16), file, opts);
  const td::TensorDict v2 = version(2, std::int64_t{1} << 26);  // 256 MiB of float32
  td::barrier();
  std::thread killer;
  if (rank == 1)
    killer = std::thread([] {
      std::this_thread::sleep_for(std::chrono::milliseconds(30));
      std::printf("rank 1: killing myself during the save\n");
      std::fflush(stdout);
      std::raise(SIGKILL);
    });
  td::save_safetensors(v2, file, opts);
  if (killer.joinable()) killer.join();
  std::printf("rank %d: the save completed before the kill\n", rank);
  td::destroy_process_group();
  return 0;
}
