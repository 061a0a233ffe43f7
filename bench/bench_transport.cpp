// Transport without a prior layout against the layout-checked calls that need the receivers to
// hold the layout beforehand (issue 18's figures), side by side in one run at 2 ranks or more:
//   broadcast: td::broadcast_dict of the transformer workload to ranks holding nothing, vs
//              TensorDict::broadcast into a dict that already has the layout;
//   ragged all_gather: td::all_gather_dicts of 64 leaves with (r + 1) * --rows rows on rank r, vs
//              the same-layout TensorDict::all_gather moving the same bytes (every rank the mean
//              row count) and vs padding every rank to the largest row count first;
//   point to point: td::send_dict / recv_dict of the transformer (rank 0 to rank 1) vs
//              TensorDict::send / recv into a dict holding the layout;
//   metadata: encode + decode of the 16384-leaf "tiny" workload's layout (no MPI).
// Each round runs every variant once; a variant's figure is the median over rounds of the max
// over ranks (the timing method of bench/support/runner.hpp). The results are checked once before
// timing.
#include <chrono>

#include <CLI/CLI.hpp>

#include "comm/dict_wire.hpp"  // internal (td_formats, CMakeLists.txt): its encoder is timed here
#include "support/guard.hpp"
#include "support/options.hpp"
#include "support/report.hpp"
#include "support/runner.hpp"
#include "support/workloads.hpp"

namespace {

td::TensorDict filled_workload(const std::string& name, int rank) {
  const auto w = td_bench::make_workload(name, td::DType::Float32);
  td::TensorDict d = td_bench::build_dict(w, false);
  td_bench::fill_known(d, td::ReduceOp::SUM, rank);
  return d;
}

// 64 float32 leaves of [rows, cols] (rows may differ per rank), leaf j filled with rank + j.
td::TensorDict ragged(std::int64_t rows, std::int64_t cols, int rank) {
  td::TensorDict d(td::Shape{rows});
  for (int j = 0; j < 64; ++j)
    d.set({fmt::format("l{:02}", j / 8), fmt::format("p{}", j % 8)},
          td::Tensor::full<float>({rows, cols}, static_cast<float>(rank + j)));
  return d;
}

// `d` with every leaf's first dimension padded to `rows` (the padding tensordict applies).
td::TensorDict padded(const td::TensorDict& d, std::int64_t rows) {
  td::TensorDict out(td::Shape{rows});
  for (const auto& [key, t] : d.canonical_leaves()) {
    td::Shape s = t.shape();
    s[0] = rows;
    td::Tensor p = td::Tensor::zeros(s, t.dtype());
    p.slice(0, 0, t.shape()[0]).copy_(t);
    out.set(key, p);
  }
  return out;
}

struct Row {
  std::string what;
  std::vector<double> times;
};

}  // namespace

int main(int argc, char** argv) {
  td::init_process_group(argc, argv);
  CLI::App app{"bench_transport: transport without a prior layout vs layout-checked calls"};
  int rounds = 15;
  std::int64_t rows = 128, cols = 256;
  std::string bucket_text = "4MiB";
  app.add_option("--rounds", rounds, "timed rounds")->check(CLI::PositiveNumber);
  app.add_option("--rows", rows, "rows of rank 0's ragged leaves (rank r: (r + 1) * rows)")
      ->check(CLI::PositiveNumber);
  app.add_option("--cols", cols, "columns of the ragged leaves")->check(CLI::PositiveNumber);
  app.add_option("--bucket", bucket_text, "bucket_bytes of the layout-checked calls");
  if (auto rc = td_bench::parse_or_exit(app, argc, argv)) return *rc;
  const auto bucket = td_bench::parse_size(bucket_text);
  const int rank = td::get_rank(), size = td::get_world_size();
  if (!bucket || size < 2) {
    if (rank == 0) std::fprintf(stderr, "bench_transport: needs 2 ranks or more and a --bucket\n");
    td::destroy_process_group();
    return 2;
  }
  const td::CollectiveOptions opts{.bucket_bytes = *bucket};

  // Inputs.
  const td::TensorDict model = filled_workload("transformer", 0);
  td::TensorDict model_consolidated = model.clone();
  model_consolidated.consolidate();
  td::TensorDict model_copy = model.clone();  // the layout-checked calls' own dict
  td::TensorDict model_copy_consolidated = model_consolidated.clone();
  model_copy_consolidated.consolidate();
  const td::TensorDict mine = ragged((rank + 1) * rows, cols, rank);
  const std::int64_t mean_rows = rows * (size + 1) / 2, max_rows = rows * size;
  const td::TensorDict same_bytes = ragged(mean_rows, cols, rank);

  // Correctness first.
  bool ok = td::broadcast_dict(rank == 0 ? model : td::TensorDict(), 0).equal(model);
  const auto gathered = td::all_gather_dicts(mine);
  for (int r = 0; r < size; ++r)
    ok = ok && gathered[static_cast<std::size_t>(r)].equal(ragged((r + 1) * rows, cols, r));
  if (rank == 0) td::send_dict(model, 1);
  if (rank == 1) ok = ok && td::recv_dict(0).equal(model);
  if (!td_bench::all_ranks(ok)) {
    if (rank == 0) std::fprintf(stderr, "bench_transport: a result differs from its input\n");
    td::destroy_process_group();
    return 1;
  }

  std::vector<Row> rowsout = {
      {"broadcast: TensorDict::broadcast, layout known", {}},
      {"broadcast: same, both sides consolidated", {}},
      {"broadcast: broadcast_dict, receivers hold nothing", {}},
      {"broadcast: broadcast_dict, consolidated source", {}},
      {"all_gather: all_gather_dicts, ragged", {}},
      {"all_gather: TensorDict::all_gather, same bytes", {}},
      {"all_gather: pad to the largest + all_gather", {}},
      {"p2p: TensorDict::send/recv, layout known", {}},
      {"p2p: send_dict/recv_dict, receiver holds nothing", {}},
      {"p2p: send_dict/recv_dict, consolidated source", {}},
  };
  for (int round = 0; round < rounds; ++round) {
    std::size_t i = 0;
    rowsout[i++].times.push_back(
        td_bench::timed_max_over_ranks([&] { model_copy.broadcast(0, opts); }));
    rowsout[i++].times.push_back(td_bench::timed_max_over_ranks(
        [&] { model_copy_consolidated.broadcast(0, {.bucket_bytes = td::kAutoBucketBytes}); }));
    rowsout[i++].times.push_back(td_bench::timed_max_over_ranks(
        [&] { (void)td::broadcast_dict(rank == 0 ? model : td::TensorDict(), 0); }));
    rowsout[i++].times.push_back(td_bench::timed_max_over_ranks(
        [&] { (void)td::broadcast_dict(rank == 0 ? model_consolidated : td::TensorDict(), 0); }));
    rowsout[i++].times.push_back(
        td_bench::timed_max_over_ranks([&] { (void)td::all_gather_dicts(mine); }));
    rowsout[i++].times.push_back(
        td_bench::timed_max_over_ranks([&] { (void)same_bytes.all_gather(opts); }));
    rowsout[i++].times.push_back(
        td_bench::timed_max_over_ranks([&] { (void)padded(mine, max_rows).all_gather(opts); }));
    rowsout[i++].times.push_back(td_bench::timed_max_over_ranks([&] {
      if (rank == 0) model_copy.send(1, opts);
      if (rank == 1) model_copy.recv(0, opts);
    }));
    rowsout[i++].times.push_back(td_bench::timed_max_over_ranks([&] {
      if (rank == 0) td::send_dict(model, 1);
      if (rank == 1) (void)td::recv_dict(0);
    }));
    rowsout[i++].times.push_back(td_bench::timed_max_over_ranks([&] {
      if (rank == 0) td::send_dict(model_consolidated, 1);
      if (rank == 1) (void)td::recv_dict(0);
    }));
    if (rank == 0) std::fprintf(stderr, "\r[bench_transport] round %d/%d", round + 1, rounds);
  }

  // Metadata of 16384 leaves, on rank 0 alone: walking the dict (describe_dict, through the
  // public TensorDict API), encoding, decoding (with validation and the stream plan).
  std::vector<double> t_describe, t_encode, t_decode;
  std::size_t meta_bytes = 0;
  if (rank == 0) {
    const td::TensorDict tiny = filled_workload("tiny", 0);
    using Clock = std::chrono::steady_clock;
    auto secs = [](Clock::time_point a, Clock::time_point b) {
      return std::chrono::duration<double>(b - a).count();
    };
    for (int round = 0; round < rounds; ++round) {
      std::vector<td::Tensor> tensors;
      const auto t0 = Clock::now();
      const auto described = td::detail::describe_dict(tiny, tensors);
      const auto t1 = Clock::now();
      const auto bytes = td::detail::encode_layout(described);
      const auto t2 = Clock::now();
      const auto layout = td::detail::decode_layout(bytes);
      const auto t3 = Clock::now();
      t_describe.push_back(secs(t0, t1));
      t_encode.push_back(secs(t1, t2));
      t_decode.push_back(secs(t2, t3));
      meta_bytes = bytes.size();
      if (layout.leaves.size() != 16384) return 1;
    }
  }

  if (rank == 0) {
    std::fprintf(stderr, "\n");
    const auto m = td_bench::machine_info();
    fmt::print(
        "# bench_transport: transformer {} (73 leaves, float32); ragged: 64 leaves of "
        "[(r+1)*{}, {}] float32 on rank r; layout-checked calls with bucket_bytes {}\n",
        td_bench::human_bytes(27342848.0), rows, cols, td_bench::size_label(*bucket));
    fmt::print(
        "# machine: {}, {} CPUs, {}\n# MPI: {}\n# ranks: {}; rounds: {}; medians of the max over "
        "ranks\n",
        m.host, m.online_cpus, m.cpu, m.mpi_version, size, rounds);
    fmt::print("{:<52} {:>10}\n", "variant", "median ms");
    for (const auto& r : rowsout)
      fmt::print("{:<52} {:>10.3f}\n", r.what, td_bench::median_of(r.times) * 1e3);
    fmt::print("{:<52} {:>10.3f}\n", "metadata, 16384 leaves: walk the dict (describe)",
               td_bench::median_of(t_describe) * 1e3);
    fmt::print("{:<52} {:>10.3f}   ({} bytes)\n", "metadata, 16384 leaves: encode",
               td_bench::median_of(t_encode) * 1e3, meta_bytes);
    fmt::print("{:<52} {:>10.3f}\n", "metadata, 16384 leaves: decode + validate",
               td_bench::median_of(t_decode) * 1e3);
  }
  td::destroy_process_group();
  return 0;
}
