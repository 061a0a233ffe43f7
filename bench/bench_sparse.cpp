// Sparse embedding gradients: all_reduce of a sparse COO leaf (gathered and coalesced) against
// densifying it first and reducing the dense table, side by side in one run.
//
// Workload: an embedding table of --rows x --dim float32; every step, each rank's gradient
// touches --touched rows (drawn per rank, so ranks overlap partly). Medians over rounds of the
// max over ranks; the correctness of the sparse result is checked against the dense one first.
#include <random>

#include <CLI/CLI.hpp>

#include "support/options.hpp"
#include "support/report.hpp"
#include "support/runner.hpp"

namespace {

td::Tensor embedding_grad(std::int64_t rows, std::int64_t dim, std::int64_t touched, int rank) {
  std::mt19937_64 rng(static_cast<std::uint64_t>(rank) * 7919 + 1);
  std::uniform_int_distribution<std::int64_t> pick(0, rows - 1);
  std::vector<std::int64_t> idx(static_cast<std::size_t>(2 * touched * dim));
  std::vector<float> vals(static_cast<std::size_t>(touched * dim));
  const auto nnz = touched * dim;
  for (std::int64_t t = 0; t < touched; ++t) {
    const std::int64_t row = pick(rng);
    for (std::int64_t c = 0; c < dim; ++c) {
      const auto j = static_cast<std::size_t>(t * dim + c);
      idx[j] = row;
      idx[static_cast<std::size_t>(nnz) + j] = c;
      vals[j] = 1.f;
    }
  }
  return td::Tensor::sparse_coo(td::Tensor::from_vector<std::int64_t>(idx, {2, nnz}),
                                td::Tensor::from_vector<float>(vals), {rows, dim});
}

}  // namespace

int main(int argc, char** argv) {
  td::init_process_group(argc, argv);
  CLI::App app{"bench_sparse: sparse vs densified all_reduce of an embedding gradient"};
  std::int64_t rows = 100000, dim = 64, touched = 512;
  int rounds = 15;
  app.add_option("--rows", rows, "embedding table rows")->check(CLI::PositiveNumber);
  app.add_option("--dim", dim, "embedding dimension")->check(CLI::PositiveNumber);
  app.add_option("--touched", touched, "rows each rank's gradient touches")
      ->check(CLI::PositiveNumber);
  app.add_option("--rounds", rounds, "timed rounds per variant")->check(CLI::PositiveNumber);
  if (auto rc = td_bench::parse_or_exit(app, argc, argv)) return *rc;
  const int rank = td::get_rank(), size = td::get_world_size();
  const td::Tensor grad = embedding_grad(rows, dim, touched, rank);

  // Correctness first: the sparse result, densified, equals the dense all_reduce.
  td::Tensor sparse = grad;
  td::all_reduce(sparse);
  td::Tensor dense = grad.to_dense();
  td::all_reduce(dense);
  int ok = sparse.to_dense().equal(dense) ? 1 : 0;
  MPI_Allreduce(MPI_IN_PLACE, &ok, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  if (!ok) {
    if (rank == 0) std::fprintf(stderr, "bench_sparse: sparse and dense results differ\n");
    td::destroy_process_group();
    return 1;
  }

  std::vector<double> t_sparse, t_densify, t_dense_only;
  td::Tensor dense_table = grad.to_dense();
  for (int r = 0; r < rounds; ++r) {
    t_sparse.push_back(td_bench::timed_max_over_ranks([&] {
      td::Tensor s = grad;
      td::all_reduce(s);
    }));
    t_densify.push_back(td_bench::timed_max_over_ranks([&] {
      td::Tensor d = grad.to_dense();
      td::all_reduce(d);
    }));
    t_dense_only.push_back(td_bench::timed_max_over_ranks([&] { td::all_reduce(dense_table); }));
    if (rank == 0) std::fprintf(stderr, "\r[bench_sparse] round %d/%d", r + 1, rounds);
  }
  if (rank == 0) {
    std::fprintf(stderr, "\n");
    const auto m = td_bench::machine_info();
    const double table_mib = static_cast<double>(rows * dim * 4) / (1 << 20);
    fmt::print(
        "# bench_sparse: embedding gradient, table {} x {} float32 ({:.1f} MiB), {} rows touched "
        "per rank "
        "({:.2f}% of the table)\n",
        rows, dim, table_mib, touched,
        100.0 * static_cast<double>(touched) / static_cast<double>(rows));
    fmt::print(
        "# machine: {}, {} CPUs, {}\n# MPI: {}\n# ranks: {}; rounds: {}; medians of the max over "
        "ranks\n",
        m.host, m.online_cpus, m.cpu, m.mpi_version, size, rounds);
    const double sp = td_bench::median_of(t_sparse) * 1e3,
                 dn = td_bench::median_of(t_densify) * 1e3,
                 only = td_bench::median_of(t_dense_only) * 1e3;
    fmt::print("{:<44} {:>10} {:>12}\n", "variant", "median ms", "vs sparse");
    fmt::print("{:<44} {:>10.3f} {:>11.2f}x\n", "sparse all_reduce (allgather + coalesce)", sp,
               1.0);
    fmt::print("{:<44} {:>10.3f} {:>11.2f}x\n", "to_dense() + dense all_reduce", dn, dn / sp);
    fmt::print("{:<44} {:>10.3f} {:>11.2f}x\n", "dense all_reduce of a ready dense table", only,
               only / sp);
  }
  td::destroy_process_group();
  return 0;
}
