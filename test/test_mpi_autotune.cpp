// kAutoBucketBytes on a group's first call: its measurement of the machine is not charged to the
// call's timeout, a dict too small for any candidate cap to matter is not measured for, and the
// info log says what a measurement cost. Each case uses a fresh group (the tuned size is kept per
// group); the run registered with TD_AUTOTUNE_CACHE=0 (CMakeLists.txt) measures on every group,
// the plain runs may take a cached size (then only a spot check runs).
#include <catch2/catch.hpp>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <unistd.h>

#include <tensordict/tensordict.hpp>

#include "support/groups.hpp"

using td::DType;
using td::ReduceOp;
using td::Tensor;
using td::TensorDict;

namespace {

// 64 leaves of 4 KiB: 256 KiB, above the smallest candidate cap (16 KiB).
TensorDict grads(float value) {
  TensorDict d;
  for (int i = 0; i < 64; ++i) {
    std::string key = "w";
    key.append(std::to_string(100 + i));  // append: GCC 12 warns falsely on "w" + to_string
    d.set(key, Tensor::full<float>({1024}, value));
  }
  return d;
}

// What `fn` writes to stderr (fd 2), captured through a temporary file.
template <class F>
std::string stderr_of(F&& fn) {
  std::fflush(stderr);
  char path[] = "/tmp/td_autotune_logXXXXXX";
  const int fd = mkstemp(path);
  REQUIRE(fd >= 0);
  const int saved = dup(2);
  dup2(fd, 2);
  try {
    fn();
  } catch (...) {
    std::fflush(stderr);
    dup2(saved, 2);
    close(saved);
    close(fd);
    std::remove(path);
    throw;
  }
  std::fflush(stderr);
  dup2(saved, 2);
  close(saved);
  close(fd);
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  std::remove(path);
  return text.str();
}

}  // namespace

TEST_CASE("the first auto-tuned call does not spend its timeout on measuring", "[autotune]") {
  const auto n = static_cast<float>(td::get_world_size());
  for (const bool async : {false, true}) {
    INFO((async ? "async" : "sync"));
    td::CollectiveOptions opts;
    opts.group = fresh_group();
    opts.bucket_bytes = td::kAutoBucketBytes;
    opts.async_op = async;
    // Less than a measurement usually takes here (0.8-2.6 s), far more than the call needs.
    opts.timeout = std::chrono::milliseconds(1000);
    TensorDict d = grads(1.f);
    const auto start = std::chrono::steady_clock::now();
    auto works = d.all_reduce(ReduceOp::SUM, opts);
    td::wait_all(works);
    const auto took = std::chrono::steady_clock::now() - start;
    // Only a call that took longer than its timeout (a measurement ran) tests the point; a
    // cached size makes the call quick, which passes without testing it.
    if (took < opts.timeout.value())
      WARN("the first call took "
           << std::chrono::duration_cast<std::chrono::milliseconds>(took).count()
           << " ms: no long measurement ran (cached size?)");
    CHECK(d.get("w100").to_vector<float>() == std::vector<float>(1024, n));
    CHECK(d.get("w163").to_vector<float>() == std::vector<float>(1024, n));
  }
}

TEST_CASE("a dict smaller than the smallest candidate cap is not measured for", "[autotune]") {
  if (td::get_world_size() < 2) return;  // a group of one never measures
  td::CollectiveOptions opts;
  opts.group = fresh_group();
  opts.bucket_bytes = td::kAutoBucketBytes;
  TensorDict small;
  small.set("a", Tensor::full<float>({256}, 1.f));  // 1.5 KiB in all
  small.set({"b", "c"}, Tensor::full<double>({64}, 2.0));
  const std::string quiet = stderr_of([&] { small.all_reduce(ReduceOp::SUM, opts); });
  const auto n = static_cast<float>(td::get_world_size());
  CHECK(small.get("a").to_vector<float>() == std::vector<float>(256, n));
  CHECK(small.get({"b", "c"}).to_vector<double>() == std::vector<double>(64, 2.0 * n));
  // A Reducer over such a model builds without measuring either.
  TensorDict model = small.clone();
  const std::string reducer_log = stderr_of([&] {
    td::Reducer reducer(model, {.op = ReduceOp::SUM, .group = opts.group});
    reducer.mark_ready("a");
    reducer.mark_ready("b");
    reducer.finish();
  });
  CHECK(model.get("a").to_vector<float>() == std::vector<float>(256, n * n));
  // The log says a measurement ran only once a larger dict needs one (TD_LOG_LEVEL=info in the
  // registered runs; rank 0 of the group prints it).
  TensorDict d = grads(1.f);
  const std::string measured = stderr_of([&] { d.all_reduce(ReduceOp::SUM, opts); });
  const char* level = std::getenv("TD_LOG_LEVEL");
  if (td::get_rank() == 0 && level != nullptr && std::string(level) == "info") {
    INFO("small dict: " << quiet << "\nReducer: " << reducer_log << "\nlarger dict: " << measured);
    CHECK(quiet.find("auto buckets:") == std::string::npos);
    CHECK(reducer_log.find("auto buckets:") == std::string::npos);
    CHECK(measured.find("auto buckets:") != std::string::npos);
    CHECK(measured.find("not counted in the call's timeout") != std::string::npos);
  }
  CHECK(d.get("w120").to_vector<float>() == std::vector<float>(1024, n));
}
