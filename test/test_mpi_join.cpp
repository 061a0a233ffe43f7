// td::Reducer with uneven inputs (ReducerOptions::uneven_inputs, Reducer::join(): DDP's Join):
// ranks run different numbers of steps; every step of the ranks still running completes, the
// joined ranks contributing zeros, and AVG divides by the group size. 0, 1 and all but one ranks
// joining early, ranks that each run a different number of steps, SUM and AVG, with and without
// compression, a second round after everyone joined, a tensorclass, and the misuses.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include <tensordict/tensordict.hpp>

using td::Compression;
using td::DType;
using td::Key;
using td::ReduceOp;
using td::Reducer;
using td::Tensor;
using td::TensorDict;

namespace {

const std::vector<Key>& keys() {
  static const std::vector<Key> k{Key("w"), Key({"v", "x"}), Key("b")};
  return k;
}

// float32 [64], float64 [10] nested, float32 [3]: with 64-byte buckets, several buckets.
TensorDict make_grads() {
  TensorDict g;
  g.set("w", Tensor::zeros({64}, DType::Float32));
  g.set({"v", "x"}, Tensor::zeros({10}, DType::Float64));
  g.set("b", Tensor::zeros({3}, DType::Float32));
  return g;
}

// Small integers: exact in float32, float64 and bfloat16, whatever the order of the sum.
double value(int rank, std::size_t leaf, std::int64_t i, int step) {
  return static_cast<double>((rank + 1) * (i % 5 + 1) + static_cast<int>(leaf) + step);
}

void fill(TensorDict& g, int rank, int step) {
  for (std::size_t l = 0; l < keys().size(); ++l) {
    Tensor& t = g.get(keys()[l]);
    for (std::int64_t i = 0; i < t.numel(); ++i) {
      if (t.dtype() == DType::Float32) {
        t.data<float>()[i] = static_cast<float>(value(rank, l, i, step));
      } else {
        t.data<double>()[i] = value(rank, l, i, step);
      }
    }
  }
}

// What leaf l, element i holds after step `step` when the ranks with steps_of(r) > step run it.
template <class Steps>
double expected(std::size_t l, std::int64_t i, int step, ReduceOp op, int size, Steps steps_of) {
  double sum = 0;
  for (int r = 0; r < size; ++r)
    if (steps_of(r) > step) sum += value(r, l, i, step);
  return op == ReduceOp::AVG ? sum / size : sum;
}

// Checks every element of `g` against expected(); `tol`: relative to the value's magnitude.
template <class Steps>
void check_step(const TensorDict& g, int step, ReduceOp op, int size, Steps steps_of, double tol) {
  for (std::size_t l = 0; l < keys().size(); ++l) {
    const Tensor& t = g.get(keys()[l]);
    std::vector<double> got(static_cast<std::size_t>(t.numel()));
    if (t.dtype() == DType::Float32) {
      const auto v = t.to_vector<float>();
      std::copy(v.begin(), v.end(), got.begin());
    } else {
      got = t.to_vector<double>();
    }
    int bad = 0;
    for (std::int64_t i = 0; i < t.numel(); ++i) {
      const double want = expected(l, i, step, op, size, steps_of);
      if (std::abs(got[static_cast<std::size_t>(i)] - want) > tol * std::max(1.0, std::abs(want)))
        ++bad;
    }
    INFO("leaf " << keys()[l].str() << ", step " << step);
    CHECK(bad == 0);
  }
}

// Runs one epoch: rank r runs steps_of(r) steps, then joins. Checks every step's result, and the
// joined ranks' leaves after join(): the last step they shadowed.
template <class Steps>
void run_epoch(Reducer& reducer, TensorDict& g, ReduceOp op, Steps steps_of, double tol,
               int step_offset = 0) {
  const int rank = td::get_rank(), size = td::get_world_size();
  const int mine = steps_of(rank);
  int most = 0;
  for (int r = 0; r < size; ++r) most = std::max(most, steps_of(r));
  auto shifted = [&](int r) { return steps_of(r) + step_offset; };
  for (int s = 0; s < mine; ++s) {
    fill(g, rank, s + step_offset);
    // Ranks mark in different orders; a sub-dict by its key.
    if ((rank + s) % 2 == 0) {
      for (const Key& k : keys()) reducer.mark_ready(k);
    } else {
      reducer.mark_ready("b");
      reducer.mark_ready("v");
      reducer.mark_ready("w");
    }
    reducer.finish();
    check_step(g, s + step_offset, op, size, shifted, tol);
  }
  reducer.join();
  CHECK_FALSE(reducer.in_step());
  if (most > mine) check_step(g, most - 1 + step_offset, op, size, shifted, tol);
}

struct Scenario {
  const char* name;
  int (*steps)(int rank, int size);
};

const Scenario kScenarios[] = {
    {"nobody joins early", [](int, int) { return 3; }},
    {"the last rank joins early", [](int r, int size) { return r == size - 1 ? 1 : 3; }},
    {"all but rank 0 join early", [](int r, int) { return r == 0 ? 4 : 1; }},
    {"every rank a different count, one with none", [](int r, int) { return r; }},
};

}  // namespace

TEST_CASE("join: uneven steps complete with zeros from joined ranks, SUM and AVG, compressed",
          "[join]") {
  const int size = td::get_world_size();
  for (const Scenario& sc : kScenarios) {
    for (ReduceOp op : {ReduceOp::SUM, ReduceOp::AVG}) {
      for (Compression c : {Compression::None, Compression::BF16, Compression::FP16}) {
        // Uncompressed: float32's rounding of AVG's division. Compressed: the values are exact
        // 16-bit integers, but AVG divides before the sum, which rounds: within (N + 1) * 2^-8
        // (BF16) or 2^-11 (FP16) of the mean's magnitude (docs/training.md's bound).
        double tol = 1e-6;
        if (c != Compression::None && op == ReduceOp::AVG)
          tol = (size + 1) * std::ldexp(1.0, c == Compression::BF16 ? -8 : -11);
        INFO(sc.name << ", " << td::name(op) << ", compression " << td::name(c));
        TensorDict g = make_grads();
        Reducer reducer(g, {.op = op,
                            .bucket_bytes = 64,
                            .timeout = std::chrono::seconds(60),
                            .compression = c,
                            .uneven_inputs = true});
        REQUIRE(reducer.num_buckets() >= 3);
        auto steps = [&](int r) { return sc.steps(r, size); };
        run_epoch(reducer, g, op, steps, tol);
        // After everyone joined, the next epoch runs again, the other way round.
        auto reversed = [&](int r) { return sc.steps(size - 1 - r, size); };
        run_epoch(reducer, g, op, reversed, tol, /*step_offset=*/5);
      }
    }
  }
}

TEST_CASE("join: without it a Reducer with uneven_inputs works as before", "[join]") {
  const int rank = td::get_rank(), size = td::get_world_size();
  TensorDict with = make_grads();
  TensorDict without = make_grads();
  Reducer a(with, {.op = ReduceOp::AVG, .bucket_bytes = 64, .uneven_inputs = true});
  Reducer b(without, {.op = ReduceOp::AVG, .bucket_bytes = 64});
  for (int s = 0; s < 3; ++s) {
    fill(with, rank, s);
    fill(without, rank, s);
    a.finish();  // finish() alone: a step that marks nothing still votes
    b.finish();
    CHECK(td::allclose(with, without, 0.0, 0.0));
  }
  (void)size;
}

namespace {
struct Grads : td::TensorClass<Grads> {
  Tensor w;
  Tensor b;
  TD_TENSORCLASS_FIELDS(Grads, w, b)
};
}  // namespace

TEST_CASE("join: a tensorclass of gradients", "[join][tensorclass]") {
  const int rank = td::get_rank(), size = td::get_world_size();
  Grads g;
  g.w = Tensor::zeros({5}, DType::Float32);
  g.b = Tensor::zeros({2}, DType::Float64);
  Reducer reducer(g, {.op = ReduceOp::SUM, .uneven_inputs = true});
  const int mine = rank == 0 ? 2 : 1;
  for (int s = 0; s < mine; ++s) {
    g.w.zero_();
    g.w.array<float>() += static_cast<float>(rank + 1);
    g.b.zero_();
    reducer.mark_ready("w");
    reducer.mark_ready("b");
    reducer.finish();
    const double want = s == 0 ? size * (size + 1) / 2.0 : 1.0;  // step 1: rank 0 alone
    CHECK(g.w.to_vector<float>()[4] == static_cast<float>(want));
  }
  reducer.join();
}

TEST_CASE("join: misuse is a clear error", "[join][errors]") {
  TensorDict g = make_grads();
  {
    Reducer plain(g, {.op = ReduceOp::SUM});
    try {
      plain.join();
      FAIL("join() without uneven_inputs must throw");
    } catch (const std::invalid_argument& e) {
      CHECK(std::string(e.what()).find("uneven_inputs") != std::string::npos);
    }
  }
  // uneven_inputs needs an op for which zeros are neutral: raised on every rank.
  TensorDict h = make_grads();
  try {
    Reducer bad(h, {.op = ReduceOp::MAX, .uneven_inputs = true});
    FAIL("MAX with uneven_inputs must throw");
  } catch (const std::invalid_argument& e) {
    CHECK(std::string(e.what()).find("uneven_inputs supports SUM and AVG") != std::string::npos);
  }
  // join() inside a step: the step is finished (so no rank hangs), then td::Error.
  TensorDict k = make_grads();
  Reducer r(k, {.op = ReduceOp::SUM, .uneven_inputs = true});
  fill(k, td::get_rank(), 0);
  r.mark_ready("w");
  try {
    r.join();
    FAIL("join() inside a step must throw");
  } catch (const td::Error& e) {
    CHECK(std::string(e.what()).find("inside a step") != std::string::npos);
  }
  CHECK_FALSE(r.in_step());
  check_step(
      k, 0, ReduceOp::SUM, td::get_world_size(), [](int) { return 1; }, 0.0);
  r.join();  // and the Reducer is still usable
}
