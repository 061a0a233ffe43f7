// Collectives on one tensor: every op x dtype, every root, views, zero-size, async, groups, errors.
#include <catch2/catch.hpp>

#include <tensordict/tensordict.hpp>

#include "support/reference.hpp"

using td::DType;
using td::ReduceOp;
using td::Tensor;
using namespace tdtest;

TEST_CASE("all_reduce: every op on every dtype it supports; a clear error otherwise",
          "[collectives]") {
  const int rank = td::get_rank(), size = td::get_world_size();
  for (std::size_t d = 0; d < td::kNumDTypes; ++d) {
    const auto dtype = static_cast<DType>(d);
    td::visit(dtype, [&](auto tag) {
      using T = typename decltype(tag)::type;
      for (ReduceOp op : kAllOps) {
        INFO(td::name(dtype) << " " << td::name(op));
        Tensor t = make_input<T>(op, rank, {3, 5});
        if (!td::supports(op, dtype)) {
          CHECK_THROWS_AS(td::all_reduce(t, op), std::invalid_argument);
          CHECK(holds_input<T>(t, op, rank));
          continue;
        }
        td::all_reduce(t, op);
        CHECK(holds_expected<T>(t, op, size));
      }
    });
  }
}

TEST_CASE("the documented unsupported pairs throw naming op and dtype", "[collectives]") {
  Tensor f = Tensor::zeros({2}, DType::Float32);
  Tensor i = Tensor::zeros({2}, DType::Int64);
  Tensor c = Tensor::zeros({2}, DType::Complex64);
  auto message = [](auto fn) {
    try {
      fn();
    } catch (const std::invalid_argument& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  CHECK(message([&] { td::all_reduce(f, ReduceOp::BAND); }).find("BAND") != std::string::npos);
  CHECK(message([&] { td::all_reduce(f, ReduceOp::BAND); }).find("float32") != std::string::npos);
  CHECK(message([&] { td::all_reduce(i, ReduceOp::AVG); }).find("int64") != std::string::npos);
  CHECK(message([&] { td::all_reduce(c, ReduceOp::MIN); }).find("complex64") != std::string::npos);
}

TEST_CASE("reduce to every dst and broadcast from every src", "[collectives]") {
  const int rank = td::get_rank(), size = td::get_world_size();
  for (int root = 0; root < size; ++root) {
    INFO("root " << root);
    Tensor t = make_input<float>(ReduceOp::SUM, rank, {7});
    td::reduce(t, root, ReduceOp::SUM);
    if (rank == root) CHECK(holds_expected<float>(t, ReduceOp::SUM, size));
    CHECK(t.numel() == 7);  // never freed or resized elsewhere

    Tensor b = make_input<std::int64_t>(ReduceOp::SUM, rank, {2, 3});
    td::broadcast(b, root);
    CHECK(holds_input<std::int64_t>(b, ReduceOp::SUM, root));
  }
}

TEST_CASE("a non-contiguous tensor is reduced in place and stays a view", "[collectives]") {
  const int rank = td::get_rank(), size = td::get_world_size();
  Tensor base = make_input<double>(ReduceOp::SUM, rank, {4, 6});
  Tensor view = base.transpose(0, 1).slice(0, 0, 6, 2);  // [3, 4], strided
  REQUIRE_FALSE(view.is_contiguous());
  const auto untouched_before = base.slice(1, 1, 6, 2).to_vector<double>();
  std::vector<double> expect;
  {
    const auto in = view.to_vector<double>();
    // element (i, j) of the view is base[j][2i], whose flat index is j*6 + 2i
    for (std::int64_t i = 0; i < 3; ++i)
      for (std::int64_t j = 0; j < 4; ++j)
        expect.push_back(expected<double>(ReduceOp::SUM, size, j * 6 + 2 * i));
    (void)in;
  }
  td::all_reduce(view);
  CHECK(view.shares_storage_with(base));
  CHECK(view.to_vector<double>() == expect);
  CHECK(base.slice(1, 1, 6, 2).to_vector<double>() == untouched_before);  // other columns untouched
}

TEST_CASE("zero-size and 0-d tensors", "[collectives]") {
  const int size = td::get_world_size();
  Tensor empty = Tensor::zeros({0, 3}, DType::Float32);
  td::all_reduce(empty);
  td::broadcast(empty, 0);
  td::reduce(empty, 0);
  CHECK(empty.numel() == 0);
  Tensor scalar = Tensor::full<std::int32_t>({}, 2);
  td::all_reduce(scalar);
  CHECK(scalar.to_vector<std::int32_t>()[0] == 2 * size);
}

TEST_CASE("async: a pending Work completes and wait() leaves the result", "[collectives][async]") {
  const int rank = td::get_rank(), size = td::get_world_size();
  Tensor t = make_input<float>(ReduceOp::MAX, rank, {1000});
  td::CollectiveOptions opts;
  opts.async_op = true;
  td::Work w = td::all_reduce(t, ReduceOp::MAX, opts);
  while (!w.is_completed()) {
  }
  w.wait();
  w.wait();  // waiting twice is fine
  CHECK(holds_expected<float>(t, ReduceOp::MAX, size));

  // the Work owns what its request touches: dropping the caller's handle early is safe
  std::vector<td::Work> works;
  for (int k = 0; k < 4; ++k) {
    Tensor tmp = make_input<float>(ReduceOp::SUM, rank, {257});
    works.push_back(td::all_reduce(tmp, ReduceOp::SUM, opts));
  }
  td::wait_all(works);

  // AVG async on a strided view
  Tensor base = make_input<double>(ReduceOp::AVG, rank, {8, 2});
  Tensor col = base.slice(1, 0, 1);
  td::Work a = td::all_reduce(col, ReduceOp::AVG, opts);
  a.wait();
  for (std::int64_t i = 0; i < 8; ++i)
    CHECK(col.to_vector<double>()[static_cast<std::size_t>(i)] ==
          expected<double>(ReduceOp::AVG, size, 2 * i));
}

TEST_CASE("groups: members reduce among themselves, non-members get a clear error",
          "[collectives][group]") {
  const int rank = td::get_rank(), size = td::get_world_size();
  std::vector<int> evens;
  for (int r = 0; r < size; r += 2) evens.push_back(r);
  td::ProcessGroup g = td::new_group(evens);
  td::CollectiveOptions opts;
  opts.group = g;
  Tensor t = Tensor::full<std::int64_t>({3}, rank + 1);
  if (rank % 2 == 0) {
    CHECK(g.is_member());
    td::all_reduce(t, ReduceOp::SUM, opts);
    std::int64_t expect = 0;
    for (int r : evens) expect += r + 1;
    CHECK(t.to_vector<std::int64_t>() == std::vector<std::int64_t>(3, expect));
    Tensor b = Tensor::full<std::int64_t>({2}, rank);
    td::broadcast(b, static_cast<int>(evens.size()) - 1, opts);
    CHECK(b.to_vector<std::int64_t>()[0] == evens.back());
  } else {
    CHECK_FALSE(g.is_member());
    CHECK(g.rank() == -1);
    CHECK_THROWS_AS(td::all_reduce(t, ReduceOp::SUM, opts), std::invalid_argument);
    CHECK(t.to_vector<std::int64_t>()[0] == rank + 1);
  }
  td::barrier();
}

TEST_CASE("a root out of range, or different across ranks, is an error on every rank",
          "[collectives][errors]") {
  const int rank = td::get_rank(), size = td::get_world_size();
  Tensor t = Tensor::full<float>({4}, 1.f);
  CHECK_THROWS_AS(td::reduce(t, size), std::invalid_argument);
  CHECK_THROWS_AS(td::broadcast(t, -1), std::invalid_argument);
  // only one rank passes a bad root: every rank still gets an error, nobody hangs
  CHECK_THROWS_AS(td::reduce(t, rank == size - 1 ? size + 3 : 0), std::invalid_argument);
  if (size > 1) {
    CHECK_THROWS_AS(td::broadcast(t, rank == 0 ? 1 : 0), td::LayoutMismatchError);
    CHECK_THROWS_AS(td::all_reduce(t, rank == 0 ? ReduceOp::MAX : ReduceOp::SUM),
                    td::LayoutMismatchError);
  }
  CHECK(t.to_vector<float>() == std::vector<float>(4, 1.f));
}

// Sanitizers bring their own allocator (no mallopt, no mallinfo2 figures): nothing to test there.
#if defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
#define TD_TEST_FOREIGN_MALLOC 1
#endif
#endif
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define TD_TEST_FOREIGN_MALLOC 1
#endif

#if defined(__GLIBC__) && !defined(TD_TEST_FOREIGN_MALLOC)
#include <malloc.h>
#define TD_TEST_GLIBC_MALLOC 1
#endif

#include <cstdlib>
#include <cstring>

// init_process_group raises glibc's mmap threshold (TD_MALLOC_MMAP_THRESHOLD, default 64 MiB) so
// that the temporary buffers MPI mallocs per large collective come back from the heap instead of
// being fresh, page-faulting mmaps. 48 MiB is above glibc's own dynamic maximum (32 MiB): without
// the tuning it is always mmapped. The same test runs with TD_MALLOC_MMAP_THRESHOLD=off
// (test_mpi_collectives.malloc_off), where it must be mmapped: the setting is what decides.
TEST_CASE("init_process_group keeps MPI's large temporary buffers on the heap", "[malloc]") {
  constexpr std::size_t kBytes = std::size_t{48} << 20;
#if defined(TD_TEST_GLIBC_MALLOC)
  const char* setting = std::getenv("TD_MALLOC_MMAP_THRESHOLD");
  const bool off = setting != nullptr && std::strcmp(setting, "off") == 0;
  const std::size_t mapped_before = mallinfo2().hblkhd;
  void* p = std::malloc(kBytes);
  REQUIRE(p != nullptr);
  std::memset(p, 1, 4096);
  const std::size_t mapped_during = mallinfo2().hblkhd;
  std::free(p);
  if (off) {
    CHECK(mapped_during >= mapped_before + kBytes);
  } else {
    CHECK(mapped_during < mapped_before + kBytes);
  }
#else
  WARN("not glibc's malloc (a sanitizer's): only the collective below is checked");
#endif
  // And a collective of that size still sums correctly with either setting.
  const int size = td::get_world_size();
  Tensor t = Tensor::full({static_cast<std::int64_t>(kBytes / sizeof(float))}, 1.0f);
  td::all_reduce(t, ReduceOp::SUM);
  CHECK(t.data<float>()[0] == static_cast<float>(size));
  CHECK(t.data<float>()[kBytes / sizeof(float) - 1] == static_cast<float>(size));
}

// MPI_T reads the value Open MPI actually uses, not just our environment.
static int libnbc_iallreduce_algorithm() {
  int provided = 0;
  if (MPI_T_init_thread(MPI_THREAD_SINGLE, &provided) != MPI_SUCCESS) return -2;
  int index = -1, value = -1, count = 0;
  MPI_T_cvar_handle handle;
  if (MPI_T_cvar_get_index("coll_libnbc_iallreduce_algorithm", &index) == MPI_SUCCESS &&
      MPI_T_cvar_handle_alloc(index, nullptr, &handle, &count) == MPI_SUCCESS) {
    MPI_T_cvar_read(handle, &value);
    MPI_T_cvar_handle_free(&handle);
  }
  MPI_T_finalize();
  return value;
}

// Open MPI's libnbc runs every in-place MPI_Iallreduce of a job under 4 ranks as a binomial
// reduce + broadcast; at 2 ranks its ring is faster at every size, and at 4, 8, 16... ranks
// Rabenseifner's algorithm, so init_process_group selects them there, and the ring for 3, 5, 6, 7,
// 9... 15 ranks across nodes (TD_TUNE_MPI=0 or the user's
// own OMPI_MCA_coll_libnbc_iallreduce_algorithm: left alone). Every size still sums right, small
// ones (below a power of two of elements: libnbc's ring under Rabenseifner's setting) included.
TEST_CASE("a 2-rank Open MPI job runs MPI_Iallreduce with libnbc's ring, 4 ranks Rabenseifner's",
          "[tune_mpi]") {
  const int algorithm = libnbc_iallreduce_algorithm();
  if (algorithm < 0) {
    WARN("not Open MPI's libnbc (no coll_libnbc_iallreduce_algorithm control variable)");
    return;
  }
  const char* user = std::getenv("OMPI_MCA_coll_libnbc_iallreduce_algorithm");
  const char* tune = std::getenv("TD_TUNE_MPI");
  const bool off = tune != nullptr && std::strcmp(tune, "0") == 0;
  const int size = td::get_world_size();
  // Across nodes (make test-cluster) a job of 3, 5, 6, 7, 9... 15 ranks gets the ring too.
  const char* local_text = std::getenv("OMPI_COMM_WORLD_LOCAL_SIZE");
  const bool across_nodes = local_text != nullptr && std::atoi(local_text) < size;
  const bool ring_across = across_nodes && size >= 3 && size <= 15 && (size & (size - 1)) != 0;
  const int expected = off ? 0 : size == 2 || ring_across ? 1 : size == 4 ? 3 : 0;
  if (expected != 0) {
    CHECK(algorithm == expected);
    REQUIRE(user != nullptr);
    CHECK(std::string(user) == std::to_string(expected));
  } else if (user == nullptr) {
    CHECK(algorithm == 0);  // libnbc decides by itself (1 and 3 ranks, or TD_TUNE_MPI=0)
  }
  for (std::int64_t n : {std::int64_t{1}, std::int64_t{3}, std::int64_t{8} << 10,
                         std::int64_t{100} << 10, std::int64_t{1} << 20}) {
    Tensor t = Tensor::zeros({n}, DType::Int64);
    for (std::int64_t i = 0; i < n; ++i) t.data<std::int64_t>()[i] = i + td::get_rank();
    td::all_reduce(t, ReduceOp::SUM, {.async_op = true}).wait();
    std::int64_t wrong = 0;
    const std::int64_t ranks_sum = static_cast<std::int64_t>(size) * (size - 1) / 2;
    for (std::int64_t i = 0; i < n; ++i) wrong += t.data<std::int64_t>()[i] != i * size + ranks_sum;
    CHECK(wrong == 0);
  }
}
