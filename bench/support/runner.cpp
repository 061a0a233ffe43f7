// The timing runner (runner.hpp).
#include "runner.hpp"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <random>
#include <thread>
#include <utility>

#include <fmt/format.h>

#include <tensordict/diagnostics.hpp>

#include "guard.hpp"
#include "support/reference.hpp"

namespace td_bench {

namespace {

/// One way of reducing the workload, and its measurements.
struct Variant {
  std::string label;       // table
  std::string id;          // CSV "variant"
  std::string csv_bucket;  // CSV "bucket_bytes"
  Role role = Role::Bucket;
  std::size_t bucket = 0;  // Role::Bucket / IdealChunks: bytes (plot x)
  bool packer = false;     // goes through the packer: peak_extra_bytes applies
  std::function<void()> run;
  std::function<void()> fill_known;    // pattern values, before the correctness run
  std::function<std::string()> check;  // "" or what is wrong (on this rank)
  std::function<void()> fill_neutral;  // values that a reduction leaves unchanged
  std::function<void()> corrupt;       // --inject-fault: spoils one result element

  int rounds = 0;
  double estimate = 0;  // seconds: the fastest warm-up call (max over ranks)
  std::vector<double> samples;
  std::size_t peak_extra = 0;
  std::uint64_t plan_misses = 0;
};

}  // namespace

double median_of(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const std::size_t m = v.size() / 2;
  return v.size() % 2 ? v[m] : 0.5 * (v[m - 1] + v[m]);
}

void idle_for(double seconds) {
  std::this_thread::sleep_for(std::chrono::duration<double>(seconds));
}

bool all_ranks(bool ok) {
  int v = ok ? 1 : 0;
  MPI_Allreduce(MPI_IN_PLACE, &v, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  return v != 0;
}

std::optional<ProgressMode> parse_progress(const std::string& s) {
  if (s == "auto") return isatty(STDERR_FILENO) != 0 ? ProgressMode::Line : ProgressMode::Log;
  if (s == "line") return ProgressMode::Line;
  if (s == "log") return ProgressMode::Log;
  if (s == "none" || s == "off") return ProgressMode::Off;
  return std::nullopt;
}

void Progress::show(const std::string& line, bool milestone) {
  if (mode_ == ProgressMode::Line) {
    std::fprintf(stderr, "\r\033[K%s", line.c_str());
    dirty_ = true;
  } else if (mode_ == ProgressMode::Log && milestone) {
    std::fprintf(stderr, "%s\n", line.c_str());
  }
  std::fflush(stderr);
}

void Progress::clear() {
  if (mode_ == ProgressMode::Line && dirty_) std::fprintf(stderr, "\r\033[K");
  dirty_ = false;
  std::fflush(stderr);
}

const Row* WorkloadResult::find(Role r) const {
  for (const auto& row : rows)
    if (row.role == r) return &row;
  return nullptr;
}

double WorkloadResult::best_ideal() const {
  double best = 0;
  for (const auto& row : rows)
    if ((row.role == Role::Ideal || row.role == Role::IdealChunks) &&
        (best == 0 || row.median < best))
      best = row.median;
  return best;
}

WorkloadResult run_workload(const Workload& w, const Context& ctx, const Options& opt,
                            const std::vector<BucketChoice>& buckets, Progress& progress) {
  const auto t_start = std::chrono::steady_clock::now();
  WorkloadResult res;
  res.name = w.name;
  res.what = w.what;
  res.leaves = w.leaves.size();
  const auto per_dtype = bytes_per_dtype(w);
  for (const auto& [d, b] : per_dtype) {
    res.bytes += b;
    res.dtypes += (res.dtypes.empty() ? "" : "/") + std::string(td::name(d));
  }
  progress.show(fmt::format("[bench] {}: building {} leaves", w.name, w.leaves.size()), false);

  // Every variant reduces its own copy of the data, so none finds its input warm in the cache
  // because another variant just touched the same memory.
  const td::TensorDict base = build_dict(w, false);
  std::deque<td::TensorDict> dicts;           // deque: stable addresses for the lambdas
  std::deque<std::vector<td::Tensor>> flats;  // the ideal's pre-packed buffers, one per dtype
  td::TensorDict empty = build_dict(w, true);

  const double neutral = ctx.op == td::ReduceOp::PRODUCT ? 1.0 : 0.0;
  auto neutral_dict = [neutral](td::TensorDict& d) {
    for (auto& [key, t] : d.canonical_leaves()) fill_constant(t, neutral);
  };

  std::vector<Variant> vs;
  // A variant whose result is dict `d`: filled, checked and corrupted (--inject-fault) there.
  auto checks_on = [&](Variant& v, td::TensorDict& d) {
    v.fill_known = [&ctx, &d] { fill_known(d, ctx.op, ctx.rank); };
    v.check = [&ctx, &d] {
      return ctx.receives() ? check_reduced(d, ctx.op, ctx.ranks) : std::string();
    };
    v.fill_neutral = [&neutral_dict, &d] { neutral_dict(d); };
    v.corrupt = [&d] { fill_constant(d.canonical_leaves().back().second, 1000); };
  };
  auto dict_variant = [&](Variant v, std::optional<std::size_t> cap, bool consolidate) {
    td::TensorDict& d = dicts.emplace_back(base.clone());
    if (consolidate) d.consolidate();  // one storage per dtype: buckets are slices, no packing
    v.packer = true;
    v.run = [&ctx, &d, cap] { ctx.run_dict(d, cap); };
    checks_on(v, d);
    vs.push_back(std::move(v));
  };
  for (const auto& b : buckets) {
    Variant v;
    if (!b.bytes) {
      v.label = "per-leaf (no bucket_bytes)";
      v.id = "per_leaf";
      v.csv_bucket = "none";
      v.role = Role::PerLeaf;
    } else if (*b.bytes == td::kAutoBucketBytes) {
      v.label = "bucket auto (=" + ctx.auto_size + ")";
      v.id = "bucket_auto";
      v.csv_bucket = "auto";
      v.role = Role::Auto;
    } else {
      v.label = "bucket " + size_label(*b.bytes);
      v.id = "bucket_" + size_label(*b.bytes);
      v.csv_bucket = std::to_string(*b.bytes);
      v.role = Role::Bucket;
      v.bucket = *b.bytes;
    }
    dict_variant(std::move(v), b.bytes, false);
  }
  {
    Variant v;
    v.label = "consolidated, bucket auto (=" + ctx.auto_size + ")";
    v.id = "consolidated_auto";
    v.csv_bucket = "auto";
    v.role = Role::Consolidated;
    dict_variant(std::move(v), td::kAutoBucketBytes, true);
  }
  // `run` receives the variant's own buffers.
  auto flat_variant = [&](Variant v, std::function<void(std::vector<td::Tensor>&)> run) {
    std::vector<td::Tensor>& f = flats.emplace_back();
    for (const auto& [d, b] : per_dtype)
      f.push_back(td::Tensor::zeros({static_cast<std::int64_t>(b / td::itemsize(d))}, d));
    v.run = [&f, run = std::move(run)] { run(f); };
    v.fill_known = [&f, &ctx] {
      for (auto& t : f) tdtest::fill_input(t, ctx.op, ctx.rank);
    };
    v.check = [&f, &ctx]() -> std::string {
      if (!ctx.receives()) return {};
      for (const auto& t : f) {
        std::string err = tdtest::reduction_error(t, ctx.op, ctx.ranks);
        if (!err.empty()) return fmt::format("{} buffer: {}", td::name(t.dtype()), err);
      }
      return {};
    };
    v.fill_neutral = [&f, neutral] {
      for (auto& t : f) fill_constant(t, neutral);
    };
    v.corrupt = [&f] { fill_constant(f.back(), 1000); };
    vs.push_back(std::move(v));
  };
  {
    Variant v;
    v.label = fmt::format("{}, 1 tensor/dtype", ctx.tensor_call());
    v.id = "tensor_per_dtype";
    v.role = Role::Tensor;
    flat_variant(std::move(v), [&ctx](std::vector<td::Tensor>& f) {
      for (auto& t : f) ctx.run_tensor(t);
    });
  }
  {
    Variant v;
    v.label = fmt::format("ideal: 1 {}/dtype", ctx.mpi_call());
    v.id = "ideal";
    v.role = Role::Ideal;
    flat_variant(std::move(v), [&ctx](std::vector<td::Tensor>& f) {
      for (auto& t : f) ctx.run_raw(t, 0);
    });
  }
  {
    Variant v;
    v.label = fmt::format("ideal: {} chunks", size_label(kIdealChunkBytes));
    v.id = "ideal_" + size_label(kIdealChunkBytes) + "_chunks";
    v.csv_bucket = std::to_string(kIdealChunkBytes);
    v.role = Role::IdealChunks;
    v.bucket = kIdealChunkBytes;
    flat_variant(std::move(v), [&ctx](std::vector<td::Tensor>& f) {
      for (auto& t : f) ctx.run_raw(t, kIdealChunkBytes);
    });
  }
  {
    // What a program would write by hand to reduce separately allocated leaves in few calls:
    // copy every leaf into one buffer per dtype, reduce those as the fastest ideal does, copy
    // back. Its time is the copy floor the bucketed path is held to (docs/benchmarks.md).
    Variant v;
    v.label = fmt::format("copy floor: memcpy+{}+memcpy", size_label(kIdealChunkBytes));
    v.id = "copy_floor";
    v.csv_bucket = std::to_string(kIdealChunkBytes);
    v.role = Role::CopyFloor;
    td::TensorDict& d = dicts.emplace_back(base.clone());
    std::vector<td::Tensor>& f = flats.emplace_back();
    for (const auto& [dt, b] : per_dtype)
      f.push_back(td::Tensor::zeros({static_cast<std::int64_t>(b / td::itemsize(dt))}, dt));
    // Each leaf's place: its dtype's buffer and byte offset (canonical order within a dtype).
    struct Place {
      std::byte* leaf;
      std::byte* flat;
      std::size_t nbytes;
    };
    auto places = std::make_shared<std::vector<Place>>();
    {
      std::map<td::DType, std::size_t> offset;
      for (auto& [key, t] : d.canonical_leaves()) {
        std::size_t k = 0;
        for (const auto& [dt, b] : per_dtype) {
          if (dt == t.dtype()) break;
          ++k;
        }
        const std::size_t n = t.nbytes();
        places->push_back({static_cast<std::byte*>(t.raw_data()),
                           static_cast<std::byte*>(f[k].raw_data()) + offset[t.dtype()], n});
        offset[t.dtype()] += n;
      }
    }
    v.run = [&ctx, &f, places] {
      for (const Place& p : *places) std::memcpy(p.flat, p.leaf, p.nbytes);
      for (auto& t : f) ctx.run_raw(t, kIdealChunkBytes);
      if (ctx.receives())
        for (const Place& p : *places) std::memcpy(p.leaf, p.flat, p.nbytes);
    };
    checks_on(v, d);
    vs.push_back(std::move(v));
  }
  {
    // No API runs only the layout agreement; a dict of the same keys with zero-size leaves goes
    // through analysis, agreement and the (cached) plan, and moves no data.
    Variant v;
    v.label = "check+plan (0-size leaves, auto)";
    v.id = "check_plan";
    v.csv_bucket = "auto";
    v.role = Role::CheckPlan;
    v.packer = true;
    v.run = [&ctx, &empty] { ctx.run_dict(empty, td::kAutoBucketBytes); };
    v.fill_known = [] {};
    v.check = [] { return std::string(); };
    v.fill_neutral = [] {};
    v.corrupt = [] {};
    vs.push_back(std::move(v));
  }
  const std::size_t nv = vs.size();
  {
    const td::StoragePoolStats ps = td::storage_pool_stats();
    res.storage_bytes = ps.pooled_requested + ps.large_requested + ps.heap_requested;
    const std::size_t in_use = ps.touched > ps.spare ? ps.touched - ps.spare : 0;
    res.pool_extra_bytes = in_use > ps.pooled_requested ? in_use - ps.pooled_requested : 0;
    res.pool_spare_bytes = ps.spare;
  }

  // 1. Correctness: every variant once on known values; a wrong one stops the run.
  std::vector<std::string> wrong;
  for (std::size_t i = 0; i < nv; ++i) {
    progress.show(
        fmt::format("[bench] {}: checking {}/{} variants ({})", w.name, i + 1, nv, vs[i].label),
        false);
    vs[i].fill_known();
    td::barrier();
    vs[i].run();
    if (vs[i].id == opt.inject_fault && ctx.rank == kRoot) vs[i].corrupt();
    const std::string err = vs[i].check();
    if (!err.empty())
      std::fprintf(stderr, "[bench] rank %d: %s / %s: WRONG RESULT: %s\n", ctx.rank, w.name.c_str(),
                   vs[i].label.c_str(), err.c_str());
    if (!all_ranks(err.empty())) wrong.push_back(vs[i].label);
  }
  if (!wrong.empty()) {
    std::string list;
    for (const auto& s : wrong) list += (list.empty() ? "'" : ", '") + s + "'";
    throw WrongResult(
        fmt::format("workload {}: {} gave a wrong result ({} with op {}); no timings reported",
                    w.name, list, ctx.dict_call(), td::name(ctx.op)));
  }
  progress.show(fmt::format("[bench] {}: {} variants checked, results correct", w.name, nv), false);
  for (auto& v : vs) v.fill_neutral();

  // 2. Warm-up (caches, plans, pages); the fastest warm-up call sets the variant's round count.
  const bool auto_rounds = opt.iters <= 0;
  const int warmups = std::max(opt.warmup, auto_rounds ? 1 : 0);
  std::vector<double> local(nv), fastest(nv, 1e30);
  for (int r = 0; r < warmups; ++r) {
    progress.show(fmt::format("[bench] {}: warm-up {}/{}", w.name, r + 1, warmups), false);
    for (std::size_t i = 0; i < nv; ++i) {
      td::barrier();
      const double t0 = MPI_Wtime();
      vs[i].run();
      local[i] = MPI_Wtime() - t0;
    }
    MPI_Allreduce(MPI_IN_PLACE, local.data(), static_cast<int>(nv), MPI_DOUBLE, MPI_MAX,
                  MPI_COMM_WORLD);
    for (std::size_t i = 0; i < nv; ++i) fastest[i] = std::min(fastest[i], local[i]);
  }
  int max_rounds = 0;
  for (std::size_t i = 0; i < nv; ++i) {
    auto& v = vs[i];
    v.estimate = fastest[i];  // the fastest warm-up round: noise only ever adds time
    if (auto_rounds) {
      const double want = std::ceil(opt.min_time / std::max(v.estimate, 1e-7));
      v.rounds = static_cast<int>(std::clamp(want, static_cast<double>(opt.min_rounds),
                                             static_cast<double>(opt.max_rounds)));
    } else {
      v.rounds = opt.iters;
    }
    max_rounds = std::max(max_rounds, v.rounds);
  }
  progress.show(
      fmt::format("[bench] {}: {} variants checked, results correct; timing, up to {} rounds",
                  w.name, nv, max_rounds),
      true);

  // 3. Timed rounds: every variant once per round, in an order shuffled afresh each round (the
  //    same on every rank), so no variant always follows the same neighbour: after a variant that
  //    burnt a lot of CPU, the scheduler of a loaded machine tends to preempt the next call.
  std::size_t finished = 0;
  std::vector<std::size_t> active;
  std::mt19937 order_rng(12345);
  for (int round = 0; round < max_rounds; ++round) {
    active.clear();
    for (std::size_t i = 0; i < nv; ++i)
      if (round < vs[i].rounds) active.push_back(i);
    std::shuffle(active.begin(), active.end(), order_rng);
    for (std::size_t a = 0; a < active.size(); ++a) {
      Variant& v = vs[active[a]];
      if (v.packer) td::reset_packer_stats();
      td::barrier();
      const double t0 = MPI_Wtime();
      v.run();
      local[a] = MPI_Wtime() - t0;
      if (v.packer) {
        const td::PackerStats s = td::packer_stats();
        v.peak_extra = std::max(v.peak_extra, s.peak_extra_bytes);
        v.plan_misses += s.plan_misses;
      }
    }
    MPI_Allreduce(MPI_IN_PLACE, local.data(), static_cast<int>(active.size()), MPI_DOUBLE, MPI_MAX,
                  MPI_COMM_WORLD);
    for (std::size_t a = 0; a < active.size(); ++a) {
      Variant& v = vs[active[a]];
      v.samples.push_back(local[a]);
      if (static_cast<int>(v.samples.size()) == v.rounds) {
        ++finished;
        progress.show(fmt::format("[bench] {}: {}/{} variants timed ({}: {} rounds)", w.name,
                                  finished, nv, v.label, v.rounds),
                      false);
      }
    }
    progress.show(fmt::format("[bench] {}: round {}/{}, {}/{} variants timed", w.name, round + 1,
                              max_rounds, finished, nv),
                  false);
  }

  // 4. Figures: memory and plan misses are per rank; keep the largest.
  std::vector<unsigned long long> mem(nv), misses(nv);
  for (std::size_t i = 0; i < nv; ++i) {
    mem[i] = vs[i].peak_extra;
    misses[i] = vs[i].plan_misses;
  }
  MPI_Allreduce(MPI_IN_PLACE, mem.data(), static_cast<int>(nv), MPI_UNSIGNED_LONG_LONG, MPI_MAX,
                MPI_COMM_WORLD);
  MPI_Allreduce(MPI_IN_PLACE, misses.data(), static_cast<int>(nv), MPI_UNSIGNED_LONG_LONG, MPI_MAX,
                MPI_COMM_WORLD);
  for (std::size_t i = 0; i < nv; ++i) {
    const Variant& v = vs[i];
    Row row;
    row.label = v.label;
    row.id = v.id;
    row.csv_bucket = v.csv_bucket;
    row.role = v.role;
    row.bucket = v.bucket;
    row.packer = v.packer;
    row.rounds = v.rounds;
    row.median = median_of(v.samples);
    row.min = v.samples.empty() ? 0 : *std::min_element(v.samples.begin(), v.samples.end());
    row.peak_extra = static_cast<std::size_t>(mem[i]);
    row.plan_misses = misses[i];
    row.samples = v.samples;
    res.rows.push_back(std::move(row));
  }
  res.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t_start).count();
  progress.show(fmt::format("[bench] {}: done in {:.1f} s", w.name, res.seconds), true);
  progress.clear();
  return res;
}

AutoProbe probe_auto() {
  constexpr int kLeaves = 4096;
  td::TensorDict d;
  for (int i = 0; i < kLeaves; ++i)
    d.set({fmt::format("b{:02}", i / 64), fmt::format("p{:02}", i % 64)},
          td::Tensor::zeros({1024}, td::DType::Float32));
  AutoProbe p;
  td::barrier();
  const double t0 = MPI_Wtime();
  td::reset_packer_stats();
  td::CollectiveOptions o;
  o.bucket_bytes = td::kAutoBucketBytes;
  d.all_reduce(td::ReduceOp::SUM, o);
  p.first_call = MPI_Wtime() - t0;
  unsigned long long peak = td::packer_stats().peak_extra_bytes;
  MPI_Allreduce(MPI_IN_PLACE, &peak, 1, MPI_UNSIGNED_LONG_LONG, MPI_MAX, MPI_COMM_WORLD);
  MPI_Allreduce(MPI_IN_PLACE, &p.first_call, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  p.largest_bucket = static_cast<std::size_t>(peak);
  return p;
}

std::string auto_label(const AutoProbe& p) {
  constexpr std::size_t kProbeTotal = std::size_t{16} << 20;
  if (p.largest_bucket >= kProbeTotal) return ">=" + size_label(kProbeTotal);
  if (p.largest_bucket == 0) return "<8KiB";
  return size_label(p.largest_bucket);
}

}  // namespace td_bench
