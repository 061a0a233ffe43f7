// A rank killed (SIGKILL) while a parallel save is under way (issue 30): the previous checkpoint
// must stay intact and no partial file or directory may appear under the target's name.
//   fault_checkpoint_killed save FORMAT DIR    (under mpiexec, 2 ranks or more): saves checkpoint
//       v1, then starts saving a 256 MiB v2 while the last rank kills itself a few milliseconds
//       in. FORMAT is safetensors (DIR/ckpt.safetensors) or memmap (the directory DIR/ckpt_td).
//   fault_checkpoint_killed verify FORMAT DIR  (one process, no MPI): the target must be v1, and
//       DIR must hold nothing else under the target's name (temporary copies, hidden, may stay).
// test/faults/checkpoint_killed.sh runs both.
#include <unistd.h>

#include <chrono>
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <string>
#include <thread>

#include <fmt/format.h>
#include <tensordict/tensordict.hpp>

namespace fs = std::filesystem;

namespace {

// Checkpoint v: eight float32 layers of elems / 8 each, a step counter, and (v2 only) a key v1
// does not have, so a v2 file that reached the target's name shows.
td::TensorDict version(int v, std::int64_t elems) {
  td::TensorDict d;
  for (int i = 0; i < 8; ++i)
    d.set({"layers", fmt::format("w{}", i)},
          td::Tensor::full<float>({elems / 8}, static_cast<float>(v * 100 + i)));
  d.set("version", td::Tensor::full<std::int64_t>({}, v));
  if (v > 1) d.set("only_in_v2", td::Tensor::full<std::int32_t>({16}, v));
  return d;
}

fs::path target_of(const std::string& format, const fs::path& dir) {
  return dir / (format == "memmap" ? "ckpt_td" : "ckpt.safetensors");
}

void save(const std::string& format, const td::TensorDict& d, const fs::path& target,
          const td::FileOptions& opts) {
  if (format == "memmap")
    td::save_memmap(d, target, opts);
  else
    td::save_safetensors(d, target, opts);
}

// Whether `dir` holds the target and, besides it, only hidden temporary copies of it; says what
// else it found.
bool only_target_and_temporaries(const fs::path& dir, const fs::path& target) {
  bool ok = true;
  for (const auto& e : fs::directory_iterator(dir)) {
    const std::string n = e.path().filename().string();
    // fmt, not "." + string + "...": GCC 12's -Wrestrict misfires on that concatenation.
    const std::string prefix = fmt::format(".{}.td-tmp-", target.filename().string());
    const bool temporary = n.rfind(prefix, 0) == 0;
    if (e.path() != target && !temporary) {
      std::printf("unexpected entry beside the checkpoint: %s\n", n.c_str());
      ok = false;
    }
  }
  return ok;
}

int verify(const std::string& format, const fs::path& dir) {
  const fs::path target = target_of(format, dir);
  const td::TensorDict want = version(1, 1 << 16);
  const bool same = format == "memmap" ? td::load_memmap(target).equal(want)
                                       : td::load_safetensors(target).equal(want);
  const bool tidy = only_target_and_temporaries(dir, target);
  // A memmap directory holds v1's files only (a v2 leaf file would be a partial mix).
  const bool no_v2_file = !fs::exists(target / "only_in_v2.memmap");
  const bool intact = same && tidy && no_v2_file;
  std::printf("%s\n", intact ? "previous checkpoint intact" : "CHECKPOINT CHANGED");
  return intact ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 4) return 2;
  const std::string mode = argv[1], format = argv[2];
  if (format != "safetensors" && format != "memmap") return 2;
  if (mode == "verify") return verify(format, argv[3]);
  const fs::path target = target_of(format, argv[3]);
  td::init_process_group(argc, argv);
  const int rank = td::get_rank(), victim = td::get_world_size() - 1;
  const td::FileOptions opts{.group = td::world(), .timeout = std::chrono::seconds(20)};
  save(format, version(1, 1 << 16), target, opts);
  const td::TensorDict v2 = version(2, std::int64_t{1} << 26);  // 256 MiB of float32
  td::barrier();
  std::thread killer;
  if (rank == victim)
    killer = std::thread([rank] {
      std::this_thread::sleep_for(std::chrono::milliseconds(30));
      std::printf("rank %d: killing myself during the save\n", rank);
      std::fflush(stdout);
      std::raise(SIGKILL);
    });
  save(format, v2, target, opts);
  if (killer.joinable()) killer.join();
  std::printf("rank %d: the save completed before the kill\n", rank);
  td::destroy_process_group();
  return 0;
}
