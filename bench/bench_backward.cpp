// A simulated backward pass over the transformer workload, with and without td::Reducer.
//
// The layers run in reverse order (h5 ... h0, then the embedding); each "computes" for a time
// proportional to its parameter count, then its gradients are ready. The total compute is
// --compute-ratio times the Reducer's communication alone (measured first). Two kinds of compute:
// idle waiting (an accelerator or I/O: a sleep) and a CPU spin. Variants, side by side, each round
// in the same order on every rank:
//   compute alone; communication alone (all_reduce auto, the Reducer's buckets, a pre-packed
//   MPI_Allreduce of the same bytes, for AVG followed by the division); backward then all_reduce
//   (auto); backward with the Reducer (and with the Reducer and BF16 compression); what
//   ReducerOptions::uneven_inputs costs when nobody joins (its buckets alone, its backward step,
//   and 100 steps of a one-bucket 1 KiB Reducer with and without it: the flag's latency).
// Besides the ratios, it prints the best step any reducer could reach with this backward pass
// (overlap_bound): the last layer's communication cannot start before all compute has ended.
// Timing: a barrier, one step timed with MPI_Wtime on every rank, the MAX over ranks; medians
// over rounds. --op avg (default, as DDP) or sum.
#include <chrono>
#include <functional>

#include <CLI/CLI.hpp>
#include <Eigen/Core>

#include "support/guard.hpp"
#include "support/options.hpp"
#include "support/report.hpp"
#include "support/runner.hpp"
#include "support/workloads.hpp"

namespace {

using Clock = std::chrono::steady_clock;

// One layer of the backward pass: its sub-dict key and its share of the compute.
struct Layer {
  std::string key;
  double share = 0;
};

std::vector<Layer> backward_layers(const td_bench::Workload& w) {
  std::map<std::string, std::int64_t> params;
  std::int64_t total = 0;
  for (const auto& l : w.leaves) {
    params[l.key.front()] += td_bench::numel_of(l.shape);
    total += td_bench::numel_of(l.shape);
  }
  std::vector<Layer> out;
  for (int h = 5; h >= 0; --h) {
    const std::string k = fmt::format("h{}", h);
    out.push_back({k, static_cast<double>(params[k]) / static_cast<double>(total)});
  }
  out.push_back({"embed", static_cast<double>(params["embed"]) / static_cast<double>(total)});
  return out;
}

// The shortest step any gradient reducer can reach with this backward pass: each layer's
// communication (its share of `comm`, one link) starts once its compute has ended and the previous
// layer's communication is done; the last layer's (the embedding, 31% of the bytes) can hide
// behind nothing. With compute = communication it is 1.31x max(compute, communication).
double overlap_bound(const std::vector<Layer>& layers, double compute, double comm) {
  double t = 0, link = 0;
  for (const auto& l : layers) {
    t += compute * l.share;
    link = std::max(link, t) + comm * l.share;
  }
  return std::max(t, link);
}

double g_sink = 0;

// Keeps this rank's core busy until `seconds` have passed.
void spin_for(double seconds) {
  const auto end = Clock::now() + std::chrono::duration<double>(seconds);
  double x = 1.0;
  while (Clock::now() < end)
    for (int i = 0; i < 256; ++i) x = x * 0.999999 + 1e-7;
  g_sink += x;
}

}  // namespace

int run(int argc, char** argv) {
  td::init_process_group(argc, argv);
  CLI::App app{"bench_backward: a simulated backward pass with and without td::Reducer"};
  int rounds = 10;
  double compute_ratio = 1.0;
  app.add_option("--rounds", rounds, "timed rounds per variant")->check(CLI::PositiveNumber);
  app.add_option("--compute-ratio", compute_ratio,
                 "total compute of a backward pass / communication alone")
      ->check(CLI::PositiveNumber);
  std::string reducer_bucket = "auto";
  app.add_option("--reducer-bucket", reducer_bucket,
                 "the Reducers' bucket_bytes: auto (td::kAutoBucketBytes) or a size (4MiB)");
  std::string op_name = "avg";
  app.add_option("--op", op_name,
                 "the reduction: avg (as DDP; the pre-packed MPI_Allreduce then also divides) or "
                 "sum");
  if (auto rc = td_bench::parse_or_exit(app, argc, argv)) return *rc;
  const auto parsed_op = td_bench::parse_op(op_name);
  if (!parsed_op || (*parsed_op != td::ReduceOp::AVG && *parsed_op != td::ReduceOp::SUM)) {
    if (td::get_rank() == 0) fmt::print(stderr, "bench_backward: --op {}: avg or sum\n", op_name);
    td::destroy_process_group();
    return 2;
  }
  const td::ReduceOp op = *parsed_op;
  std::size_t reducer_cap = td::kAutoBucketBytes;
  if (reducer_bucket != "auto") {
    const auto parsed = td_bench::parse_size(reducer_bucket);
    if (!parsed) {
      if (td::get_rank() == 0)
        fmt::print(stderr, "bench_backward: --reducer-bucket {}: not a size\n", reducer_bucket);
      td::destroy_process_group();
      return 2;
    }
    reducer_cap = *parsed;
  }
  const int rank = td::get_rank(), size = td::get_world_size();
  const auto w = td_bench::make_workload("transformer", td::DType::Float32);
  const std::vector<Layer> layers = backward_layers(w);

  // Each variant has its own gradients: a plain dict (backward then all_reduce), one owned by
  // a Reducer, one by a compressing Reducer.
  td::TensorDict plain = td_bench::build_dict(w, false);
  td::TensorDict bucketed = td_bench::build_dict(w, false);
  td::TensorDict compressed = td_bench::build_dict(w, false);
  td::TensorDict joinable = td_bench::build_dict(w, false);
  for (td::TensorDict* d : {&plain, &bucketed, &compressed, &joinable})
    td_bench::fill_known(*d, op, rank);
  const td::CollectiveOptions auto_opts{.bucket_bytes = td::kAutoBucketBytes};
  td::Reducer reducer(bucketed, {.op = op, .bucket_bytes = reducer_cap});
  td::Reducer reducer_bf16(
      compressed, {.op = op, .bucket_bytes = reducer_cap, .compression = td::Compression::BF16});
  // What uneven_inputs costs when nobody joins: one 4-byte allreduce per step before the buckets.
  td::Reducer reducer_uneven(joinable,
                             {.op = op, .bucket_bytes = reducer_cap, .uneven_inputs = true});
  // The same on a step that is nothing but latency: one 1 KiB bucket.
  td::TensorDict tiny, tiny_uneven;
  for (td::TensorDict* d : {&tiny, &tiny_uneven})
    d->set("g", td::Tensor::zeros({256}, td::DType::Float32));
  td::Reducer reducer_tiny(tiny, {.op = op});
  td::Reducer reducer_tiny_uneven(tiny_uneven, {.op = op, .uneven_inputs = true});

  // Correctness guard: one step of each path gives the same bits.
  plain.all_reduce(op, auto_opts);
  for (const auto& l : layers) reducer.mark_ready(l.key);
  reducer.finish();
  for (const auto& l : layers) reducer_uneven.mark_ready(l.key);
  reducer_uneven.finish();
  if (!td_bench::all_ranks(plain.equal(bucketed) && plain.equal(joinable))) {
    if (rank == 0) fmt::print(stderr, "bench_backward: Reducer result differs from all_reduce\n");
    td::destroy_process_group();
    return 1;
  }

  // What BF16 costs in accuracy: the compressed Reducer's result against the exact one, on
  // gradient-like values (every rank its own, magnitudes from 1e-3 to 10 across leaves).
  td::TensorDict exact_grads = td_bench::build_dict(w, false);
  for (td::TensorDict* d : {&exact_grads, &compressed}) {
    std::size_t j = 0;
    for (auto& [key, t] : d->canonical_leaves()) {
      auto* p = t.data<float>();
      const double scale = std::pow(10.0, static_cast<double>(j % 5) - 3.0);
      for (std::int64_t i = 0; i < t.numel(); ++i)
        p[i] = static_cast<float>(scale * std::sin(0.37 * static_cast<double>(i) + rank + j));
      ++j;
    }
  }
  exact_grads.all_reduce(op, auto_opts);
  for (const auto& l : layers) reducer_bf16.mark_ready(l.key);
  reducer_bf16.finish();
  double bf16_err = 0, largest = 0;
  for (const auto& [key, exact] : exact_grads.canonical_leaves()) {
    const std::vector<float> want = exact.to_vector<float>();
    const std::vector<float> got = compressed.get(key).to_vector<float>();
    for (std::size_t i = 0; i < want.size(); ++i) {
      bf16_err = std::max(bf16_err, std::abs(static_cast<double>(got[i]) - want[i]));
      largest = std::max(largest, std::abs(static_cast<double>(want[i])));
    }
  }
  const double bf16_rel = largest > 0 ? bf16_err / largest : 0;

  std::size_t total_bytes = 0;
  for (const auto& [dt, b] : td_bench::bytes_per_dtype(w)) total_bytes += b;
  td::Tensor flat =
      td::Tensor::zeros({static_cast<std::int64_t>(total_bytes / 4)}, td::DType::Float32);

  auto comm_allreduce = [&] { plain.all_reduce(op, auto_opts); };
  auto comm_reducer = [&](td::Reducer& r) {
    for (const auto& l : layers) r.mark_ready(l.key);
    r.finish();
  };
  // What a hand-written step does: one MPI_Allreduce of every gradient packed in advance, then
  // (AVG) one vectorised pass dividing by the group size (by multiplying with the exact
  // reciprocal of a power of two, as the library does).
  auto comm_raw = [&] {
    MPI_Allreduce(MPI_IN_PLACE, flat.data<float>(), static_cast<int>(flat.numel()), MPI_FLOAT,
                  MPI_SUM, MPI_COMM_WORLD);
    if (op == td::ReduceOp::AVG) {
      Eigen::Map<Eigen::ArrayXf> values(flat.data<float>(), flat.numel());
      if ((size & (size - 1)) == 0) {
        values *= 1.0F / static_cast<float>(size);
      } else {
        values /= static_cast<float>(size);
      }
    }
  };

  // The compute of a backward pass: as long as the Reducer's communication alone (median of 7),
  // the communication it has to hide; the hardest case, where neither side can cover the other.
  std::vector<double> c;
  c.reserve(7);
  for (int i = 0; i < 7; ++i)
    c.push_back(td_bench::timed_max_over_ranks([&] { comm_reducer(reducer); }));
  double compute_total = td_bench::median_of(c) * compute_ratio;
  MPI_Bcast(&compute_total, 1, MPI_DOUBLE, 0, MPI_COMM_WORLD);

  using Work = std::function<void(double)>;
  const Work idle = td_bench::idle_for, spin = spin_for;
  auto compute_alone = [&](const Work& work) {
    for (const auto& l : layers) work(compute_total * l.share);
  };
  auto then_allreduce = [&](const Work& work) {
    compute_alone(work);
    plain.all_reduce(op, auto_opts);
  };
  std::vector<double> mark_us;  // every mark_ready of the uncompressed Reducer, in microseconds
  auto with_reducer = [&](const Work& work, td::Reducer& r) {
    for (const auto& l : layers) {
      work(compute_total * l.share);
      const auto t0 = Clock::now();
      r.mark_ready(l.key);
      if (&r == &reducer)
        mark_us.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
    }
    r.finish();
  };

  struct Series {
    std::string name;
    std::function<void()> run;
    std::vector<double> t;
  };
  std::vector<Series> series = {
      {"communication: all_reduce(auto)", comm_allreduce, {}},
      {"communication: Reducer buckets", [&] { comm_reducer(reducer); }, {}},
      {"communication: Reducer buckets, BF16", [&] { comm_reducer(reducer_bf16); }, {}},
      {op == td::ReduceOp::AVG ? "communication: pre-packed MPI_Allreduce + divide"
                               : "communication: pre-packed MPI_Allreduce",
       comm_raw,
       {}},
      {"idle compute alone", [&] { compute_alone(idle); }, {}},
      {"idle: backward then all_reduce(auto)", [&] { then_allreduce(idle); }, {}},
      {"idle: backward with Reducer", [&] { with_reducer(idle, reducer); }, {}},
      {"idle: backward with Reducer, BF16", [&] { with_reducer(idle, reducer_bf16); }, {}},
      {"spin compute alone", [&] { compute_alone(spin); }, {}},
      {"spin: backward then all_reduce(auto)", [&] { then_allreduce(spin); }, {}},
      {"spin: backward with Reducer", [&] { with_reducer(spin, reducer); }, {}},
      {"communication: Reducer buckets, uneven_inputs", [&] { comm_reducer(reducer_uneven); }, {}},
      {"idle: backward with Reducer, uneven_inputs",
       [&] { with_reducer(idle, reducer_uneven); },
       {}},
      {"100 tiny steps (one 1 KiB bucket): Reducer",
       [&] {
         for (int i = 0; i < 100; ++i) {
           reducer_tiny.mark_ready("g");
           reducer_tiny.finish();
         }
       },
       {}},
      {"100 tiny steps: Reducer, uneven_inputs",
       [&] {
         for (int i = 0; i < 100; ++i) {
           reducer_tiny_uneven.mark_ready("g");
           reducer_tiny_uneven.finish();
         }
       },
       {}},
  };
  for (auto& s : series) s.run();  // warm-up
  for (int r = 0; r < rounds; ++r) {
    for (auto& s : series) s.t.push_back(td_bench::timed_max_over_ranks(s.run));
    if (rank == 0) std::fprintf(stderr, "\r[bench_backward] round %d/%d", r + 1, rounds);
  }
  if (rank == 0) std::fprintf(stderr, "\n");
  std::sort(mark_us.begin(), mark_us.end());

  if (rank == 0) {
    const auto m = td_bench::machine_info();
    auto med = [&](std::size_t i) { return td_bench::median_of(series[i].t) * 1e3; };
    fmt::print("# bench_backward: simulated backward over {} ({} leaves, {}), {}\n", w.name,
               w.leaves.size(), td_bench::human_bytes(static_cast<double>(total_bytes)),
               td::name(op));
    fmt::print("# machine: {}, {} CPUs online, {}\n# MPI: {}\n# memory: {}\n", m.host,
               m.online_cpus, m.cpu, m.mpi_version, m.memory);
    fmt::print(
        "# ranks: {}; rounds: {}; compute = {:.2f} x communication = {:.2f} ms in {} "
        "layers; Reducer: {} buckets (bucket_bytes {}); medians of the max over ranks\n",
        size, rounds, compute_ratio, compute_total * 1e3, layers.size(), reducer.num_buckets(),
        reducer_bucket);
    fmt::print("{:<50} {:>10}\n", "variant", "median ms");
    for (std::size_t i = 0; i < series.size(); ++i)
      fmt::print("{:<50} {:>10.2f}\n", series[i].name, med(i));
    const double comm = med(1), raw = med(3);
    auto summary = [&](const char* kind, std::size_t alone, std::size_t after, std::size_t red) {
      const double bound = std::max(med(alone), comm);
      const double hidden = (med(alone) + comm - med(red)) / comm * 100.0;
      const double best = overlap_bound(layers, med(alone), comm);
      fmt::print(
          "# {}: Reducer step / max(compute, communication) = {:.2f}x; hidden {:.0f}% of "
          "the communication; backward-then-all_reduce / Reducer = {:.2f}x\n",
          kind, med(red) / bound, std::clamp(hidden, 0.0, 100.0), med(after) / med(red));
      fmt::print(
          "# {}: best overlap possible (each layer's communication after its compute, the "
          "last layer's after all compute) = {:.2f} ms = {:.2f}x max(compute, communication), "
          "{:.0f}% hidden; Reducer step / best possible = {:.2f}x\n",
          kind, best, best / bound, (med(alone) + comm - best) / comm * 100.0, med(red) / best);
    };
    summary("idle", 4, 5, 6);
    fmt::print(
        "# idle, BF16: Reducer step / max(compute, communication) = {:.2f}x; "
        "backward-then-all_reduce / Reducer BF16 = {:.2f}x\n",
        med(7) / std::max(med(4), comm), med(5) / med(7));
    summary("spin", 8, 9, 10);
    fmt::print(
        "# Reducer buckets alone / pre-packed MPI_Allreduce{} = {:.2f}x; BF16 buckets alone / "
        "uncompressed = {:.2f}x; extra memory beyond the buckets: 0 B (BF16: its 16-bit "
        "copy, {})\n",
        op == td::ReduceOp::AVG ? " + divide" : "", med(1) / raw, med(2) / med(1),
        td_bench::human_bytes(static_cast<double>(total_bytes) / 2));
    fmt::print(
        "# BF16 buckets alone: {}; largest error of a BF16 step against the exact one = {:.2e} "
        "of the largest gradient\n",
        td_bench::speed_phrase(med(2), med(1), "uncompressed"), bf16_rel);
    fmt::print(
        "# uneven_inputs, nobody joined: Reducer buckets alone {:.3f}x without ({:+.3f} ms); "
        "idle backward step {:.3f}x without ({:+.3f} ms); tiny step {:.1f} us -> {:.1f} us "
        "({:+.1f} us per step)\n",
        med(11) / med(1), med(11) - med(1), med(12) / med(6), med(12) - med(6), med(13) * 10,
        med(14) * 10, (med(14) - med(13)) * 10);
  }
  if (rank == 0)
    fmt::print(
        "# mark_ready (one layer's sub-dict, launching the buckets it completes): median "
        "{:.1f} us, max {:.1f} us over {} calls\n",
        td_bench::median_of(mark_us), mark_us.back(), mark_us.size());
  td::destroy_process_group();
  return static_cast<int>(g_sink < -1);
}

int main(int argc, char** argv) noexcept {
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {
    td::abort(fmt::format("bench_backward: {}", e.what()));
  }
}
