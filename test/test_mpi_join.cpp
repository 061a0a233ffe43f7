// td::Reducer with uneven inputs (ReducerOptions::uneven_inputs, Reducer::join(): DDP's Join):
// ranks run different numbers of steps; every step of the ranks still running completes, the
// joined ranks contributing zeros, and AVG divides by the group size. 0, 1 and all but one ranks
// joining early, ranks that each run a different number of steps, SUM and AVG, with and without
// compression, a second round after everyone joined, a tensorclass, and the misuses.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include <tensordict/tensordict.hpp>

#include "support/reference.hpp"

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

// Leaf l's inputs at step `step`: the oracle's leaf pattern l + 3 * step (reference.hpp: small
// integers, exact in float32, float64 and the 16-bit floats whatever the order of the sum), so
// that a step's result differs from the last one's.
std::int64_t leaf_at(std::size_t l, int step) { return static_cast<std::int64_t>(l) + 3 * step; }

void fill(TensorDict& g, int rank, int step) {
  for (std::size_t l = 0; l < keys().size(); ++l)
    tdtest::fill_input(g.get(keys()[l]), ReduceOp::SUM, rank, leaf_at(l, step));
}

// Checks that every element of `g` holds the reduction of step `step` over the ranks with
// steps_of(r) > step, the joined ones contributing zeros (AVG divides by the group size), within
// `tol` (relative to the value's magnitude; by default the oracle's tolerance).
template <class Steps>
void check_step(const TensorDict& g, int step, ReduceOp op, int size, Steps steps_of,
                std::optional<double> tol = std::nullopt) {
  for (std::size_t l = 0; l < keys().size(); ++l) {
    const Tensor& t = g.get(keys()[l]);
    int bad = 0;
    td::visit(t.dtype(), [&](auto tag) {
      using T = typename decltype(tag)::type;
      if constexpr (std::is_floating_point_v<T>) {
        const std::vector<T> got = t.to_vector<T>();
        const double within = tol.value_or(tdtest::tolerance<T>(op, size));
        for (std::size_t i = 0; i < got.size(); ++i) {
          const auto at = static_cast<std::int64_t>(i);
          const T want = tdtest::reduce_over<T>(
              op, size,
              [&](int r) { return tdtest::value<T>(ReduceOp::SUM, r, at, leaf_at(l, step)); },
              [&](int r) { return steps_of(r) > step; }, size);
          if (!tdtest::matches<T>(got[i], want, within)) ++bad;
        }
      } else {
        FAIL("a gradient of dtype " << td::name(t.dtype()));
      }
    });
    INFO("leaf " << keys()[l].str() << ", step " << step);
    CHECK(bad == 0);
  }
}

// Runs one epoch: rank r runs steps_of(r) steps, then joins. Checks every step's result, and the
// joined ranks' leaves after join(): the last step they shadowed.
template <class Steps>
void run_epoch(Reducer& reducer, TensorDict& g, ReduceOp op, Steps steps_of,
               std::optional<double> tol, int step_offset = 0) {
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
        // Uncompressed: the oracle's tolerance (its inputs and their sums are exact). Compressed
        // (this test's own bound): the values are exact 16-bit integers, but AVG divides before
        // the sum, which rounds: within (N + 1) * 2^-8 (BF16) or 2^-11 (FP16) of the mean's
        // magnitude (docs/training.md's bound).
        std::optional<double> tol;
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
  check_step(k, 0, ReduceOp::SUM, td::get_world_size(), [](int) { return 1; });
  r.join();  // and the Reducer is still usable
}
