// Parallel checkpoints (FileOptions::group): replicated and sharded keys saved with collective
// MPI-IO into one safetensors file (the same bytes a single process writes for the union), loads
// by every rank or of each rank's own keys, and the failure guarantees: a key held differently is
// the same LayoutMismatchError on every rank, nothing is written, the previous file is kept and no
// temporary file is left. The memmap layout in parallel too.
#include <catch2/catch.hpp>

#include <sys/resource.h>
#include <unistd.h>

#include <csignal>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include <tensordict/tensordict.hpp>

#include "support/names.hpp"

namespace fs = std::filesystem;
using Catch::Matchers::Contains;

namespace {

int rank() { return td::get_rank(); }
int size() { return td::get_world_size(); }

// One directory shared by every rank of the job (named after rank 0's process id).
struct SharedDir {
  fs::path path;
  SharedDir() {
    Tensor id = Tensor::full<std::int64_t>({1}, ::getpid());
    td::broadcast(id, 0);
    static int counter = 0;
    path = fs::temp_directory_path() /
           fmt::format("td-ckpt-mpi-{}-{}", id.item<std::int64_t>(), counter++);
    if (rank() == 0) {
      fs::remove_all(path);
      fs::create_directories(path);
    }
    td::barrier();
  }
  ~SharedDir() {
    td::barrier();
    if (rank() == 0) fs::remove_all(path);
  }
  SharedDir(const SharedDir&) = delete;
  SharedDir& operator=(const SharedDir&) = delete;
  std::vector<std::string> entries() const {
    std::vector<std::string> out;
    for (const auto& e : fs::directory_iterator(path)) out.push_back(e.path().filename().string());
    std::sort(out.begin(), out.end());
    return out;
  }
};

std::vector<char> read_bytes(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()};
}

td::FileOptions group_opts() {
  td::FileOptions o;
  o.group = td::world();
  o.timeout = std::chrono::seconds(60);
  return o;
}

// A model every rank holds the same way (several dtypes, a strided view, a 0-d and an empty leaf,
// one leaf large enough to be split between the ranks at an odd byte).
TensorDict model() {
  TensorDict d;
  std::vector<float> w(std::size_t{3} * 1001);
  for (std::size_t i = 0; i < w.size(); ++i) w[i] = static_cast<float>(i) * 0.5F;
  d.set(Key({"layer0", "weight"}), Tensor::from_vector<float>(w, {3, 1001}));
  d.set(Key({"layer0", "weight_t"}), d.get(Key({"layer0", "weight"})).transpose(0, 1));
  d.set(Key({"layer0", "bias"}), Tensor::full<Eigen::half>({1001}, Eigen::half(0.25F)));
  d.set("step", Tensor::full<std::int64_t>({}, 12345));
  d.set("mask", Tensor::from_vector<bool>({true, false, true, true, false}));
  d.set("empty", Tensor::empty({0, 3}, DType::Float64));
  d.set(Key({"opt", "m"}), Tensor::full<std::uint8_t>({7}, 3));
  return d;
}

// Rank r's shard: keys only it holds, values it and every other rank can compute.
Tensor shard_values(int r) {
  return Tensor::from_vector<std::int32_t>({r, r * 10 + 1, r * 10 + 2, r * 10 + 3, 7 - r});
}
TensorDict shard_of(int r) {
  TensorDict d;
  d.set(Key({"experts", fmt::format("e{}", r), "w"}), shard_values(r));
  d.set("shared_bias", Tensor::full<double>({4}, 1.5));  // replicated on every rank
  return d;
}
TensorDict union_of_shards() {
  TensorDict d;
  for (int r = 0; r < size(); ++r) d.update(shard_of(r));
  return d;
}

// Whether every rank's message is the same (compared by length and a hash of it).
bool same_on_every_rank(const std::string& msg) {
  const auto h = static_cast<std::int64_t>(std::hash<std::string>{}(msg) >> 2);
  Tensor lo = Tensor::full<std::int64_t>({2}, h), hi = Tensor::full<std::int64_t>({2}, h);
  lo.data<std::int64_t>()[1] = static_cast<std::int64_t>(msg.size());
  hi.data<std::int64_t>()[1] = static_cast<std::int64_t>(msg.size());
  td::all_reduce(lo, ReduceOp::MIN);
  td::all_reduce(hi, ReduceOp::MAX);
  return lo.equal(hi);
}

}  // namespace

TEST_CASE("a replicated model is written by every rank together, as one process writes it",
          "[checkpoint][safetensors]") {
  SharedDir dir;
  const fs::path par = dir.path / "par.safetensors";
  td::save_safetensors(model(), par, group_opts());
  if (rank() == 0) td::save_safetensors(model(), dir.path / "serial.safetensors");
  td::barrier();
  CHECK(read_bytes(par) == read_bytes(dir.path / "serial.safetensors"));
  const TensorDict back = td::load_safetensors(par, group_opts());
  CHECK(back.equal(model()));
  CHECK(back.is_consolidated());
  CHECK(td::load_safetensors(par).equal(model()));
}

TEST_CASE("sharded keys: the file holds the union; each rank loads its own keys",
          "[checkpoint][safetensors]") {
  SharedDir dir;
  const fs::path f = dir.path / "sharded.safetensors";
  td::save_safetensors(shard_of(rank()), f, group_opts());
  CHECK(td::load_safetensors(f).equal(union_of_shards()));
  CHECK(td::load_safetensors(f, group_opts()).equal(union_of_shards()));
  // Each rank reads only its shard (collective reads of different ranges per rank).
  TensorDict like;
  like.set(Key({"experts", fmt::format("e{}", rank()), "w"}), Tensor::zeros({5}, DType::Int32));
  const TensorDict mine = td::load_safetensors(f, like, group_opts());
  CHECK(mine.keys(true, true).size() == 1);
  CHECK(mine.get(Key({"experts", fmt::format("e{}", rank()), "w"})).equal(shard_values(rank())));
  // A rank asking for a key the file lacks: the same KeyError on every rank.
  TensorDict absent = like.clone();
  if (rank() == size() - 1) absent.set("not_saved", Tensor::zeros({1}, DType::Float32));
  std::string msg;
  try {
    (void)td::load_safetensors(f, absent, group_opts());
  } catch (const td::KeyError& e) {
    msg = e.what();
  }
  CHECK_THAT(msg, Contains("not_saved") && Contains(f.string()));
  CHECK(same_on_every_rank(msg));
}

TEST_CASE(
    "a key held differently is the same LayoutMismatchError on every rank, and nothing "
    "is written",
    "[checkpoint][safetensors][errors]") {
  if (size() < 2) return;
  SharedDir dir;
  const fs::path f = dir.path / "ckpt.safetensors";
  td::save_safetensors(model(), f, group_opts());
  const auto before = read_bytes(f);
  TensorDict d = model();
  if (rank() == 1) d.set(Key({"layer0", "bias"}), Tensor::zeros({1000}, DType::Float16));
  std::string msg;
  try {
    td::save_safetensors(d, f, group_opts());
  } catch (const td::LayoutMismatchError& e) {
    msg = e.what();
  }
  CHECK_THAT(msg, Contains("'layer0.bias'") && Contains("float16[1001]") &&
                      Contains("float16[1000]") && Contains("nothing was written"));
  CHECK(same_on_every_rank(msg));
  td::barrier();
  CHECK(read_bytes(f) == before);
  CHECK(dir.entries() == std::vector<std::string>{"ckpt.safetensors"});
}

TEST_CASE("one rank's bad leaf or a failed rename fails every rank; the previous file is kept",
          "[checkpoint][safetensors][errors]") {
  SharedDir dir;
  const fs::path f = dir.path / "ckpt.safetensors";
  td::save_safetensors(model(), f, group_opts());
  const auto before = read_bytes(f);
  TensorDict d = model();
  if (rank() == size() - 1) d.set("z", Tensor::from_vector<std::complex<double>>({{1, 2}}));
  std::string msg;
  try {
    td::save_safetensors(d, f, group_opts());
  } catch (const td::Error& e) {
    msg = e.what();
  }
  CHECK_THAT(msg, Contains("'z'") && Contains("complex128"));
  CHECK(same_on_every_rank(msg));
  // The data is written and flushed, then the rename over a directory fails on rank 0: every
  // rank throws, the temporary file is removed.
  const fs::path target = dir.path / "a_directory";
  if (rank() == 0) fs::create_directories(target / "keep");
  td::barrier();
  std::string rename_msg;
  try {
    td::save_safetensors(model(), target, group_opts());
  } catch (const td::Error& e) {
    rename_msg = e.what();
  }
  CHECK_THAT(rename_msg, Contains("rank 0") && Contains("rename"));
  CHECK(same_on_every_rank(rename_msg));
  td::barrier();
  CHECK(read_bytes(f) == before);
  CHECK(dir.entries() == std::vector<std::string>{"a_directory", "ckpt.safetensors"});
}

TEST_CASE("a truncated file is the same error on every rank of a group load",
          "[checkpoint][safetensors][errors]") {
  SharedDir dir;
  const fs::path f = dir.path / "cut.safetensors";
  td::save_safetensors(model(), f, group_opts());
  if (rank() == 0) fs::resize_file(f, fs::file_size(f) - 3);
  td::barrier();
  std::string msg;
  try {
    (void)td::load_safetensors(f, group_opts());
  } catch (const td::Error& e) {
    msg = e.what();
  }
  CHECK_THAT(msg, Contains(f.string()) && Contains("truncated"));
  CHECK(same_on_every_rank(msg));
}

TEST_CASE("memmap in parallel: the union, each leaf written once", "[checkpoint][memmap]") {
  SharedDir dir;
  const fs::path root = dir.path / "td";
  td::save_memmap(shard_of(rank()), root, group_opts());
  CHECK(td::load_memmap(root).equal(union_of_shards()));
  CHECK(td::load_memmap(root, group_opts()).equal(union_of_shards()));
  CHECK(fs::exists(root / "experts" / "e0" / "w.memmap"));
  CHECK(fs::exists(root / "shared_bias.memmap"));
  td::barrier();
  CHECK(dir.entries() == std::vector<std::string>{"td"});
}

TEST_CASE("a non-positive timeout on one rank is std::invalid_argument on every rank",
          "[checkpoint][errors]") {
  SharedDir dir;
  td::FileOptions o = group_opts();
  if (rank() == size() - 1) o.timeout = std::chrono::milliseconds(0);
  std::string msg;
  try {
    (void)td::load_safetensors(dir.path / "absent.safetensors", o);
  } catch (const std::invalid_argument& e) {
    msg = e.what();
  }
  CHECK_THAT(msg, Contains("timeout must be positive"));
  CHECK(same_on_every_rank(msg));
}

TEST_CASE("tensors every rank loads are read once and broadcast; the others by their rank",
          "[checkpoint][safetensors]") {
  SharedDir dir;
  const fs::path f = dir.path / "mixed.safetensors";
  TensorDict d = union_of_shards();
  d.update(model());
  if (rank() == 0) td::save_safetensors(d, f);
  td::barrier();
  // Every rank: the whole model (split between the readers at odd bytes) and its own expert.
  TensorDict like = model();
  like.set(Key({"experts", fmt::format("e{}", rank()), "w"}), Tensor::zeros({5}, DType::Int32));
  const TensorDict got = td::load_safetensors(f, like, group_opts());
  CHECK(got.keys(true, true).size() == like.keys(true, true).size());
  CHECK(got.get(Key({"experts", fmt::format("e{}", rank()), "w"})).equal(shard_values(rank())));
  CHECK(got.exclude({Key("experts")}).equal(model()));
  CHECK(td::load_safetensors(f, group_opts()).equal(d));
}

TEST_CASE("every rank of a group must name the same file", "[checkpoint][errors]") {
  if (size() < 2) return;
  SharedDir dir;
  const fs::path mine = dir.path / fmt::format("rank{}.safetensors", rank());
  std::string msg;
  try {
    td::save_safetensors(model(), mine, group_opts());
  } catch (const td::Error& e) {
    msg = e.what();
  }
  CHECK_THAT(msg, Contains("rank 1:") && Contains("rank1.safetensors") &&
                      Contains("rank0.safetensors") && Contains("the same path"));
  CHECK(same_on_every_rank(msg));
  td::barrier();
  CHECK(dir.entries().empty());  // nothing written, no temporary file left
  std::string load_msg;
  try {
    (void)td::load_safetensors(mine, group_opts());
  } catch (const td::Error& e) {
    load_msg = e.what();
  }
  CHECK_THAT(load_msg, Contains("the same path"));
  CHECK(same_on_every_rank(load_msg));
}

namespace {
// Runs f with the working directory `d` on this rank, restored afterwards.
template <class F>
void in_directory(const fs::path& d, F&& f) {
  const fs::path before = fs::current_path();
  fs::current_path(d);
  try {
    f();
  } catch (...) {
    fs::current_path(before);
    throw;
  }
  fs::current_path(before);
}
}  // namespace

TEST_CASE("a file that opens on rank 0 but not on another rank is the same error everywhere",
          "[checkpoint][errors]") {
  // The same relative path names a directory that exists under rank 0's working directory and
  // not under the others'. MPI_File_open (Open MPI's ompio) hung every rank when the open
  // failed on a rank other than 0; the group checks that it can open the file first.
  if (size() < 2) return;
  SharedDir dir;
  if (rank() == 0) {
    fs::create_directories(dir.path / "a" / "sub");
    fs::create_directories(dir.path / "b");
  }
  td::barrier();
  const fs::path cwd = dir.path / (rank() == 0 ? "a" : "b");
  const fs::path rel = fs::path("sub") / "ckpt.safetensors";
  std::string save_msg, load_msg, memmap_msg;
  in_directory(cwd, [&] {
    try {
      td::save_safetensors(model(), rel, group_opts());
    } catch (const td::Error& e) {
      save_msg = e.what();
    }
    if (rank() == 0) td::save_safetensors(model(), rel);
    td::barrier();
    try {
      (void)td::load_safetensors(rel, group_opts());
    } catch (const td::Error& e) {
      load_msg = e.what();
    }
    try {
      td::save_memmap(model(), fs::path("sub") / "td", group_opts());
    } catch (const td::Error& e) {
      memmap_msg = e.what();
    }
  });
  CHECK_THAT(save_msg, Contains("rank 1:") && Contains("ckpt.safetensors") &&
                           Contains("No such file or directory"));
  CHECK(same_on_every_rank(save_msg));
  CHECK_THAT(load_msg, Contains("rank 1:") && Contains("ckpt.safetensors"));
  CHECK(same_on_every_rank(load_msg));
  CHECK_THAT(memmap_msg, Contains("rank 1:") && Contains("No such file or directory"));
  CHECK(same_on_every_rank(memmap_msg));
  td::barrier();
  // Only the serial save's file is left in rank 0's directory: no temporary copies.
  std::vector<std::string> left;
  for (const auto& e : fs::directory_iterator(dir.path / "a" / "sub"))
    left.push_back(e.path().filename().string());
  CHECK(left == std::vector<std::string>{"ckpt.safetensors"});
}

TEST_CASE("memmap in parallel: a large replicated leaf is written by its holders together",
          "[checkpoint][memmap]") {
  SharedDir dir;
  const fs::path root = dir.path / "big";
  TensorDict d = model();
  std::vector<float> big((std::size_t{5} << 20) / 4 + 3);  // above the collective threshold
  for (std::size_t i = 0; i < big.size(); ++i) big[i] = static_cast<float>(i % 4099);
  d.set(Key({"layer1", "weight"}),
        Tensor::from_vector<float>(big, {static_cast<int64_t>(big.size())}));
  td::save_memmap(d, root, group_opts());
  CHECK(fs::file_size(root / "layer1" / "weight.memmap") == big.size() * 4);
  CHECK(td::load_memmap(root).equal(d));
  td::barrier();
  CHECK(dir.entries() == std::vector<std::string>{"big"});
}

namespace {

// A dict of `leaves` float32 leaves of 64 KiB each (below the collective threshold of memmap:
// each leaf file is written by one rank with POSIX calls), values from `v`.
TensorDict many_leaves(int v, int leaves) {
  TensorDict d;
  for (int i = 0; i < leaves; ++i)
    d.set(Key({"layers", fmt::format("w{}", i)}),
          Tensor::full<float>({16384}, static_cast<float>(v * 100 + i)));
  d.set("version", Tensor::full<std::int64_t>({}, v));
  return d;
}

// Runs f with this process's file size limit at `bytes` when `limited` (writes beyond it fail
// with EFBIG, SIGXFSZ ignored), restored afterwards: a real write error on one rank mid-save.
template <class F>
void with_file_size_limit(bool limited, rlim_t bytes, F&& f) {
  if (!limited) return f();
  rlimit old{};
  REQUIRE(::getrlimit(RLIMIT_FSIZE, &old) == 0);
  rlimit lim = old;
  lim.rlim_cur = bytes;
  const auto old_handler = std::signal(SIGXFSZ, SIG_IGN);
  REQUIRE(::setrlimit(RLIMIT_FSIZE, &lim) == 0);
  try {
    f();
  } catch (...) {
    ::setrlimit(RLIMIT_FSIZE, &old);
    std::signal(SIGXFSZ, old_handler);
    throw;
  }
  ::setrlimit(RLIMIT_FSIZE, &old);
  std::signal(SIGXFSZ, old_handler);
}

// The message of the td::Error that f throws ("" if none).
template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const td::Error& e) {
    return e.what();
  }
  return {};
}

}  // namespace

TEST_CASE("a write failing on one rank mid-save fails every rank; the previous copy is kept",
          "[checkpoint][safetensors][memmap][errors]") {
  SharedDir dir;
  const TensorDict v1 = many_leaves(1, 4 * size()), v2 = many_leaves(2, 4 * size());
  SECTION("safetensors: rank 0 cannot give the temporary file its size") {
    const fs::path f = dir.path / "ckpt.safetensors";
    td::save_safetensors(v1, f, group_opts());
    const auto before = read_bytes(f);
    std::string msg;
    with_file_size_limit(rank() == 0, 4096, [&] {
      msg = error_of([&] { td::save_safetensors(v2, f, group_opts()); });
    });
    CHECK_THAT(msg, Contains("rank 0:") && Contains("File too large"));
    CHECK(same_on_every_rank(msg));
    td::barrier();
    CHECK(read_bytes(f) == before);
    CHECK(td::load_safetensors(f, group_opts()).equal(v1));
    CHECK(dir.entries() == std::vector<std::string>{"ckpt.safetensors"});
  }
  SECTION("memmap: the last rank's leaf files cannot be written") {
    const fs::path root = dir.path / "td";
    td::save_memmap(v1, root, group_opts());
    std::string msg;
    with_file_size_limit(rank() == size() - 1, 4096,
                         [&] { msg = error_of([&] { td::save_memmap(v2, root, group_opts()); }); });
    CHECK_THAT(msg, Contains(fmt::format("rank {}:", size() - 1)) && Contains("File too large"));
    CHECK(same_on_every_rank(msg));
    td::barrier();
    CHECK(td::load_memmap(root, group_opts()).equal(v1));
    CHECK(dir.entries() == std::vector<std::string>{"td"});
  }
}

TEST_CASE("ranks holding the same dict and ranks holding another: the file holds the union",
          "[checkpoint][safetensors][memmap]") {
  // Even ranks hold one dict and odd ranks another (at 3 ranks, ranks 0 and 2 send the same
  // layout): each distinct layout is decoded once for all its ranks, and the shared keys are
  // split between every rank holding them.
  SharedDir dir;
  auto dict_of = [](int r) {
    TensorDict d = model();
    d.set(r % 2 == 0 ? "even" : "odd", Tensor::full<std::int16_t>({3, 2}, r % 2 == 0 ? 2 : 1));
    return d;
  };
  TensorDict all = dict_of(0);
  if (size() > 1) all.update(dict_of(1));
  const fs::path par = dir.path / "par.safetensors", serial = dir.path / "serial.safetensors";
  td::save_safetensors(dict_of(rank()), par, group_opts());
  if (rank() == 0) td::save_safetensors(all, serial);
  td::barrier();
  CHECK(read_bytes(par) == read_bytes(serial));
  CHECK(td::load_safetensors(par, group_opts()).equal(all));
  td::save_memmap(dict_of(rank()), dir.path / "td", group_opts());
  CHECK(td::load_memmap(dir.path / "td", group_opts()).equal(all));
}
