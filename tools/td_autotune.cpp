// td-autotune: shows, clears and re-measures the on-disk cache of td::kAutoBucketBytes, the
// bucket size the library measures on first use (docs/configuration.md#the-tuned-bucket-size), and
// of the messages' path (flat or node-aware) that TD_HIERARCHICAL=auto measures on a group that
// spans several nodes (docs/configuration.md#node-aware-collectives).
//
//   td-autotune show                       the cache directory and every entry in it
//   td-autotune clear                      removes the entries
//   mpirun -np N td-autotune measure       measures at N ranks now and stores the result
//                                          (unless the measurement was noisy)
//   mpirun -np N td-autotune check         resolves the size as a program would: the cached
//                                          entry, spot-checked, or a new measurement
//
// measure and check print the library's own account of what it did (TD_LOG_LEVEL=info) and
// then the entry stored, if any. They run the library's tuner through the public API (one
// all_reduce with kAutoBucketBytes); show and clear only read the directory.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include <fmt/format.h>

#include <tensordict/tensordict.hpp>

#include "comm/autotune_model.hpp"

namespace {

namespace fs = std::filesystem;
namespace autotune = td::detail::autotune;

constexpr const char* kUsage =
    "usage: td-autotune show | clear\n"
    "       mpirun -np N td-autotune measure | check\n"
    "\n"
    "The cache of td::kAutoBucketBytes (the tuned bucket size) and of the messages' path\n"
    "across nodes (TD_HIERARCHICAL=auto) in $TD_CACHE_DIR, else\n"
    "$XDG_CACHE_HOME/tensordict-mpi, else ~/.cache/tensordict-mpi.\n"
    "  show     list the entries: the size, and when, where and how well it was measured\n"
    "  clear    remove the entries (each job then measures again on first use)\n"
    "  measure  under mpirun, with the launch options of your jobs: measure now and store the\n"
    "           result, unless the timings were too noisy to keep (exit status 3)\n"
    "  check    under mpirun: what a program launched this way gets (the cached entry after\n"
    "           its spot check, or a new measurement)\n";

// The tuner's files (bucket sizes and paths) in `dir`, by name, with their modification times.
std::map<std::string, fs::file_time_type> entries(const fs::path& dir) {
  std::map<std::string, fs::file_time_type> out;
  std::error_code ec;
  if (dir.empty() || !fs::is_directory(dir, ec)) return out;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    const std::string name = e.path().filename().string();
    if (e.is_regular_file(ec) &&
        (name.starts_with(autotune::kCacheFilePrefix) ||
         name.starts_with(autotune::kPathFilePrefix)) &&
        name.find(".tmp-") == std::string::npos)
      out[name] = e.last_write_time(ec);
  }
  return out;
}

void print_entry(const fs::path& file) {
  if (file.filename().string().starts_with(autotune::kPathFilePrefix)) {
    const auto p = autotune::read_path_entry(file);
    if (!p) {
      fmt::print("{}\n  (not a valid entry: the library ignores it and measures again)\n",
                 file.string());
      return;
    }
    fmt::print("{}\n  messages {} (TD_HIERARCHICAL=auto)\n", file.string(),
               p->node_aware ? "node-aware" : "flat");
    for (const auto& note : p->notes) fmt::print("  {}\n", note);
    return;
  }
  const auto e = autotune::read_cache_entry(file);
  if (!e) {
    fmt::print("{}\n  (not a valid entry: the library ignores it and measures again)\n",
               file.string());
    return;
  }
  fmt::print("{}\n  cap {} KiB, leaves of {} KiB or more sent alone\n", file.string(), e->cap >> 10,
             e->direct_bytes >> 10);
  for (const auto& note : e->notes) fmt::print("  {}\n", note);
}

int show() {
  const fs::path dir = autotune::cache_dir();
  if (dir.empty()) {
    fmt::print("no cache directory: TD_CACHE_DIR, XDG_CACHE_HOME and HOME are all unset\n");
    return 0;
  }
  const auto found = entries(dir);
  fmt::print("cache directory: {} ({} entr{})\n", dir.string(), found.size(),
             found.size() == 1 ? "y" : "ies");
  for (const auto& [name, mtime] : found) print_entry(dir / name);
  if (!found.empty())
    fmt::print(
        "An entry holds for one setup: the hosts, rank count, MPI library and launch options "
        "(its name is a hash of them).\n");
  return 0;
}

int clear() {
  const fs::path dir = autotune::cache_dir();
  if (dir.empty()) {
    fmt::print("no cache directory: nothing to clear\n");
    return 0;
  }
  int removed = 0;
  for (const auto& [name, mtime] : entries(dir)) {
    std::error_code ec;
    if (fs::remove(dir / name, ec)) {
      ++removed;
    } else {
      std::fprintf(stderr, "td-autotune: cannot remove %s: %s\n", (dir / name).c_str(),
                   ec.message().c_str());
      return 1;
    }
  }
  fmt::print("removed {} entr{} from {}\n", removed, removed == 1 ? "y" : "ies", dir.string());
  return 0;
}

// measure / check: runs the library's tuner on the world group (collective).
int resolve(int argc, char** argv, bool refresh) {
  if (refresh) setenv("TD_AUTOTUNE_REFRESH", "1", 1);
  // Asked for explicitly: the whole ladder in every pass, not the first call's bounded run.
  setenv("TD_AUTOTUNE_BUDGET_MS", "60000", /*overwrite=*/0);
  const char* level = std::getenv("TD_LOG_LEVEL");
  if (!level || std::string_view(level) != "debug") setenv("TD_LOG_LEVEL", "info", 1);
  const fs::path dir = autotune::cache_dir();
  const auto before = entries(dir);

  td::init_process_group(argc, argv);
  const int rank = td::get_rank();
  const int size = td::get_world_size();
  if (size < 2) {
    if (rank == 0)
      std::fprintf(stderr,
                   "td-autotune: run it under mpirun with 2 ranks or more, as your jobs run "
                   "(a 1-rank job tunes nothing)\n");
    td::destroy_process_group();
    return 2;
  }
  // 64 KiB: above the smallest candidate cap, so the call needs the tuned size (a smaller dict
  // is packed alike by every candidate and measures nothing).
  td::TensorDict d;
  d.set("x", td::Tensor::zeros({16384}, td::DType::Float32));
  std::vector<td::Work> works =
      d.all_reduce(td::ReduceOp::SUM, {.bucket_bytes = td::kAutoBucketBytes});
  td::wait_all(works);  // a sync call: nothing pending
  td::barrier();
  td::destroy_process_group();
  if (rank != 0) return 0;

  std::vector<std::string> stored;
  for (const auto& [name, mtime] : entries(dir)) {
    const auto it = before.find(name);
    if (it == before.end() || it->second != mtime) stored.push_back(name);
  }
  for (const auto& name : stored) {
    fmt::print("stored: ");
    print_entry(dir / name);
  }
  if (stored.empty()) {
    if (!refresh) {
      fmt::print("nothing stored (the line above says where the size came from)\n");
      return 0;
    }
    fmt::print(
        "nothing stored: the line above says why (timings too noisy to keep, or the cache "
        "is off); measure again when the machine is quieter\n");
    return 3;
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string_view cmd = argc > 1 ? argv[1] : "";
  try {
    if (cmd == "show") return show();
    if (cmd == "clear") return clear();
    if (cmd == "measure" || cmd == "check") return resolve(argc, argv, cmd == "measure");
    if (cmd == "-h" || cmd == "--help" || cmd == "help") {
      std::fputs(kUsage, stdout);
      return 0;
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "td-autotune: %s\n", e.what());
    return 1;
  }
  std::fputs(kUsage, stderr);
  return 2;
}
