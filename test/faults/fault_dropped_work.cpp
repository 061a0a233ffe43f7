// The Works of an async call thrown away (`d.all_reduce(op, {.async_op = true});` as a
// statement): the destructor still completes the operation, and the library says so once per
// process on stderr, naming the operation; Works that were waited for or tested say nothing.
// Each rank captures its own stderr around the calls and checks what was written.
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include <tensordict/tensordict.hpp>

namespace {

// What f() writes to this process's stderr (fd 2).
template <class F>
std::string captured_stderr(F&& f) {
  char path[] = "/tmp/td_dropped_work_XXXXXX";
  const int fd = mkstemp(path);
  if (fd < 0) std::abort();
  std::fflush(stderr);
  const int saved = dup(2);
  dup2(fd, 2);
  f();
  std::fflush(stderr);
  dup2(saved, 2);
  close(saved);
  std::string text;
  if (FILE* in = std::fopen(path, "r")) {
    char buf[4096];
    std::size_t n = 0;
    while ((n = std::fread(buf, 1, sizeof buf, in)) > 0) text.append(buf, n);
    std::fclose(in);
  }
  close(fd);
  std::remove(path);
  return text;
}

std::size_t count(const std::string& text, const std::string& what) {
  std::size_t n = 0;
  for (auto at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

}  // namespace

int main(int argc, char** argv) {
  td::init_process_group(argc, argv);
  const int rank = td::get_rank();
  const int size = td::get_world_size();
  td::CollectiveOptions async;
  async.async_op = true;
  async.bucket_bytes = 4096;
  int failures = 0;
  auto expect = [&](bool ok, const char* what) {
    if (!ok) {
      std::printf("rank %d: FAILED: %s\n", rank, what);
      ++failures;
    }
  };
  td::TensorDict d;
  d.set("a", td::Tensor::full<float>({4096}, 1.f));
  d.set({"m", "b"}, td::Tensor::full<double>({100}, 1.0));

  // Kept and waited for, or polled until done: nothing is said.
  const std::string quiet = captured_stderr([&] {
    std::vector<td::Work> works = d.all_reduce(td::ReduceOp::SUM, async);
    td::wait_all(works);
    std::vector<td::Work> polled = d.all_reduce(td::ReduceOp::SUM, async);
    for (auto& w : polled)
      while (!w.is_completed()) {
      }
  });
  expect(quiet.find("destroyed before wait()") == std::string::npos,
         "a waited Work printed the dropped-Work warning");

  // Dropped, twice: both complete (the destructor waits), the warning comes once.
  const std::string said = captured_stderr([&] {
    d.all_reduce(td::ReduceOp::SUM, async);
    d.all_reduce(td::ReduceOp::SUM, async);
  });
  expect(count(said, "destroyed before wait() or is_completed()") == 1,
         "the dropped-Work warning did not appear exactly once");
  expect(said.find("TensorDict.all_reduce") != std::string::npos,
         "the warning does not name the operation");
  // Four SUMs over `size` ranks of ones: size^4.
  const double want = static_cast<double>(size) * size * size * size;
  expect(d.get("a").to_vector<float>()[4095] == static_cast<float>(want),
         "the dropped calls did not complete");
  expect(d.get({"m", "b"}).to_vector<double>()[0] == want, "the dropped calls did not complete");
  std::fputs(said.c_str(), stderr);  // shown in the test's log
  td::destroy_process_group();
  if (failures != 0) return 1;
  if (rank == 0) std::printf("dropped works: ok\n");
  return 0;
}
