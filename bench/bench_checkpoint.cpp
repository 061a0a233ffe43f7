// Checkpoint throughput (issue 30's figures), side by side in one run on one file system:
//   large: the transformer workload's 73 float32 leaves with their first dimension scaled so the
//          dict holds about --large-bytes (1 GiB by default);
//   small: --small-leaves leaves of --small-bytes each (16384 x 4 KiB by default);
// each saved with td::save_safetensors and loaded with td::load_safetensors (the large one also
// with td::save_memmap / td::load_memmap), against a raw sequential write() + fsync() of the same
// number of bytes from one buffer, and read() of them into a freshly allocated one (what a program
// with no format and no library would do at best), and into a fresh td::Tensor's storage (which
// shows what the allocation's first touch costs). At
// 1 rank the library runs its serial path (POSIX); at N ranks every rank holds the same dict (a
// replicated model) and the save and load are collective over the world group (MPI-IO), each rank
// writing 1/N of the bytes; the raw baselines run on rank 0 alone while the others wait. Figures:
// the median over --rounds rounds (the max over ranks for collective calls) and GB/s (1e9 bytes per
// second). The first round's save is loaded back and compared before anything is timed.
#include <fcntl.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <vector>

#include <CLI/CLI.hpp>

#include "support/options.hpp"
#include "support/report.hpp"
#include "support/runner.hpp"
#include "support/workloads.hpp"

namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

double secs_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

td::TensorDict large_dict(std::size_t target_bytes) {
  const auto w = td_bench::make_workload("transformer", td::DType::Float32);
  std::size_t base = 0;
  for (const auto& l : w.leaves) base += static_cast<std::size_t>(td_bench::numel_of(l.shape)) * 4;
  const auto scale = static_cast<std::int64_t>(std::max<std::size_t>(1, target_bytes / base));
  td::TensorDict d;
  std::int64_t i = 0;
  for (const auto& l : w.leaves) {
    td::Shape s = l.shape;
    if (!s.empty()) s[0] *= scale;
    td::Tensor t = td::Tensor::empty(s, td::DType::Float32);
    float* p = t.data<float>();
    for (std::int64_t k = 0; k < t.numel(); ++k) p[k] = static_cast<float>((k + i) % 1000);
    d.set(td::Key(l.key), std::move(t));
    ++i;
  }
  return d;
}

td::TensorDict small_dict(std::int64_t leaves, std::int64_t bytes) {
  td::TensorDict d;
  for (std::int64_t i = 0; i < leaves; ++i)
    d.set({fmt::format("block{:03}", i / 128), fmt::format("p{:03}", i % 128)},
          td::Tensor::full<float>({bytes / 4}, static_cast<float>(i)));
  return d;
}

std::size_t dict_bytes(const td::TensorDict& d) {
  std::size_t n = 0;
  for (const auto& [k, t] : d.canonical_leaves()) n += t.nbytes();
  return n;
}

// The raw baselines: one buffer written sequentially with write() and fsync(), read back with
// read().
double raw_write(const fs::path& p, const std::vector<char>& buf) {
  const auto t0 = Clock::now();
  const int fd = ::open(p.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  std::size_t done = 0;
  while (fd >= 0 && done < buf.size()) {
    const ssize_t w =
        ::write(fd, buf.data() + done, std::min<std::size_t>(buf.size() - done, 1 << 30));
    if (w <= 0) break;
    done += static_cast<std::size_t>(w);
  }
  if (fd < 0 || done != buf.size() || ::fsync(fd) != 0 || ::close(fd) != 0) {
    std::fprintf(stderr, "bench_checkpoint: raw write of %s failed\n", p.c_str());
    std::exit(1);
  }
  return secs_since(t0);
}
// read() of the file's first `bytes` bytes into `buf`.
void read_into(const fs::path& p, char* buf, std::size_t bytes) {
  const int fd = ::open(p.c_str(), O_RDONLY);
  std::size_t done = 0;
  while (fd >= 0 && done < bytes) {
    const ssize_t r = ::read(fd, buf + done, std::min<std::size_t>(bytes - done, 1 << 30));
    if (r <= 0) break;
    done += static_cast<std::size_t>(r);
  }
  if (fd < 0 || done != bytes || ::close(fd) != 0) {
    std::fprintf(stderr, "bench_checkpoint: raw read of %s failed\n", p.c_str());
    std::exit(1);
  }
}
// Into a fresh buffer each time, as a load must allocate its tensors (both pay the page faults).
double raw_read(const fs::path& p, std::size_t bytes) {
  const auto t0 = Clock::now();
  const std::unique_ptr<char[]> buf(new char[bytes]);  // NOLINT(modernize-avoid-c-arrays)
  read_into(p, buf.get(), bytes);
  return secs_since(t0);
}
// The same read into the storage of a fresh td::Tensor (the library's allocator: transparent huge
// pages for large storages unless TD_HUGEPAGES=0), as load_safetensors allocates its storage:
// the difference to raw_read is the allocation's first touch alone.
double raw_read_tensor(const fs::path& p, std::size_t bytes) {
  const auto t0 = Clock::now();
  td::Tensor t = td::Tensor::empty({static_cast<std::int64_t>(bytes)}, td::DType::UInt8);
  read_into(p, static_cast<char*>(t.raw_data()), bytes);
  return secs_since(t0);
}

struct Row {
  std::string what;
  double bytes = 0;
  std::vector<double> times;
  int baseline = -1;  // index of the row it is compared with
};

}  // namespace

int main(int argc, char** argv) {
  td::init_process_group(argc, argv);
  CLI::App app{"bench_checkpoint: safetensors save/load against raw write()/read()"};
  int rounds = 3;
  std::string large_text = "1GiB", small_text = "4KiB", dir_text;
  std::int64_t small_leaves = 16384;
  app.add_option("--rounds", rounds, "timed rounds")->check(CLI::PositiveNumber);
  app.add_option("--large-bytes", large_text, "size of the scaled transformer dict");
  app.add_option("--small-leaves", small_leaves, "leaves of the small dict")
      ->check(CLI::PositiveNumber);
  app.add_option("--small-bytes", small_text, "bytes per small leaf (a multiple of 4)");
  app.add_option("--dir", dir_text, "directory of the files (default: the temporary directory)");
  if (auto rc = td_bench::parse_or_exit(app, argc, argv)) return *rc;
  const auto large_bytes = td_bench::parse_size(large_text);
  const auto small_bytes = td_bench::parse_size(small_text);
  const int rank = td::get_rank(), size = td::get_world_size();
  if (!large_bytes || !small_bytes || *small_bytes % 4 != 0 || *small_bytes == 0) {
    if (rank == 0) std::fprintf(stderr, "bench_checkpoint: bad --large-bytes or --small-bytes\n");
    td::destroy_process_group();
    return 2;
  }
  // Every rank's files in one directory named after rank 0's process id.
  td::Tensor id = td::Tensor::full<std::int64_t>({1}, ::getpid());
  td::broadcast(id, 0);
  const fs::path dir = (dir_text.empty() ? fs::temp_directory_path() : fs::path(dir_text)) /
                       fmt::format("td-bench-ckpt-{}", id.item<std::int64_t>());
  if (rank == 0) fs::create_directories(dir);
  td::barrier();

  td::FileOptions opts;
  if (size > 1) opts.group = td::world();
  const std::string mode = size > 1 ? fmt::format("collective over {} ranks, MPI-IO", size)
                                    : std::string("one process, POSIX");
  struct Case {
    std::string name;
    td::TensorDict dict;
  };
  std::vector<Case> cases;
  cases.push_back({"large", large_dict(*large_bytes)});
  cases.push_back({"small", small_dict(small_leaves, static_cast<std::int64_t>(*small_bytes))});

  std::vector<Row> rows;
  bool ok = true;
  for (const auto& c : cases) {
    const double bytes = static_cast<double>(dict_bytes(c.dict));
    const fs::path st = dir / (c.name + ".safetensors"), raw = dir / (c.name + ".raw");
    std::vector<char> buf(rank == 0 ? dict_bytes(c.dict) : 0, 1);
    // Correctness first.
    td::save_safetensors(c.dict, st, opts);
    ok = ok && td::load_safetensors(st, opts).equal(c.dict);
    const std::size_t base = rows.size();
    // The memmap directory of the large dict too (one file per leaf; 16384 files of the small
    // dict would time 16384 fsyncs).
    const bool memmap = c.name == "large";
    const fs::path mm = dir / (c.name + "_td");
    if (memmap) {
      td::save_memmap(c.dict, mm, opts);
      ok = ok && td::load_memmap(mm, opts).equal(c.dict);
    }
    rows.push_back({c.name + ": raw write() + fsync()", bytes, {}, -1});
    rows.push_back({c.name + ": save_safetensors", bytes, {}, static_cast<int>(base)});
    rows.push_back({c.name + ": raw read()", bytes, {}, -1});
    rows.push_back(
        {c.name + ": raw read() into a td::Tensor", bytes, {}, static_cast<int>(base + 2)});
    rows.push_back({c.name + ": load_safetensors", bytes, {}, static_cast<int>(base + 2)});
    if (memmap) {
      rows.push_back({c.name + ": save_memmap", bytes, {}, static_cast<int>(base)});
      rows.push_back({c.name + ": load_memmap", bytes, {}, static_cast<int>(base + 2)});
    }
    // Alternating within each round: baseline, library call, baseline, library call.
    for (int r = 0; r < rounds; ++r) {
      double t = 0;
      if (rank == 0) t = raw_write(raw, buf);
      td::barrier();
      rows[base].times.push_back(t);
      rows[base + 1].times.push_back(
          td_bench::timed_max_over_ranks([&] { td::save_safetensors(c.dict, st, opts); }));
      if (rank == 0) t = raw_read(raw, buf.size());
      td::barrier();
      rows[base + 2].times.push_back(t);
      if (rank == 0) t = raw_read_tensor(raw, buf.size());
      td::barrier();
      rows[base + 3].times.push_back(t);
      rows[base + 4].times.push_back(
          td_bench::timed_max_over_ranks([&] { (void)td::load_safetensors(st, opts); }));
      if (memmap) {
        rows[base + 5].times.push_back(
            td_bench::timed_max_over_ranks([&] { td::save_memmap(c.dict, mm, opts); }));
        rows[base + 6].times.push_back(
            td_bench::timed_max_over_ranks([&] { (void)td::load_memmap(mm, opts); }));
      }
      if (rank == 0)
        std::fprintf(stderr, "\r[bench_checkpoint] %s: round %d/%d", c.name.c_str(), r + 1, rounds);
    }
    if (rank == 0) std::fprintf(stderr, "\n");
  }
  ok = td_bench::all_ranks(ok);
  td::barrier();
  if (rank == 0) fs::remove_all(dir);
  if (!ok) {
    if (rank == 0)
      std::fprintf(stderr, "bench_checkpoint: a loaded dict differs from the saved one\n");
    td::destroy_process_group();
    return 1;
  }
  if (rank == 0) {
    const auto m = td_bench::machine_info();
    fmt::print(
        "# bench_checkpoint: large = transformer leaves scaled to {} (73 float32 leaves), small = "
        "{} leaves of {}; safetensors files in {}\n",
        td_bench::human_bytes(static_cast<double>(dict_bytes(cases[0].dict))), small_leaves,
        td_bench::size_label(*small_bytes), dir.parent_path().string());
    fmt::print(
        "# machine: {}, {} CPUs, {}\n# MPI: {}\n# ranks: {} ({}; every rank holds the same "
        "dict); rounds: {}; medians (collective calls: of the max over ranks)\n",
        m.host, m.online_cpus, m.cpu, m.mpi_version, size, mode, rounds);
    fmt::print("{:<36} {:>10} {:>8} {:>16}\n", "variant", "median ms", "GB/s", "vs raw");
    for (const auto& r : rows) {
      const double med = td_bench::median_of(r.times);
      std::string vs;
      if (r.baseline >= 0)
        vs = fmt::format(
            "{:.2f}x raw time",
            med / td_bench::median_of(rows[static_cast<std::size_t>(r.baseline)].times));
      fmt::print("{:<36} {:>10.1f} {:>8.2f} {:>16}\n", r.what, med * 1e3, r.bytes / med / 1e9, vs);
    }
  }
  td::destroy_process_group();
  return 0;
}
