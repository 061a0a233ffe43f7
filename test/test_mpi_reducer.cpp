// td::Reducer: results bit-identical to backward-then-TensorDict::all_reduce whatever order each
// rank marks its gradients ready in, unused leaves, sub-dicts, several steps, gradient
// accumulation, subgroups, tensorclasses, compression error bounds, and every misuse.
#include <catch2/catch.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <unistd.h>

#include <tensordict/tensordict.hpp>

using td::DType;
using td::Key;
using td::ReduceOp;
using td::Reducer;
using td::Tensor;
using td::TensorDict;

namespace {

struct LeafSpec {
  Key key;
  td::Shape shape;
  DType dtype;
};

// Two dtypes, nested sub-dicts, a non-contiguous leaf, an empty leaf, a scalar.
std::vector<LeafSpec> specs() {
  return {{Key({"enc", "w"}), {16, 8}, DType::Float32},
          {Key({"enc", "b"}), {8}, DType::Float32},
          {Key({"dec", "w"}), {8, 12}, DType::Float32},
          {Key({"dec", "b"}), {12}, DType::Float64},
          {Key({"dec", "ln", "g"}), {12}, DType::Float32},
          {Key("empty"), {0}, DType::Float32},
          {Key("scale"), {}, DType::Float64},
          {Key("head"), {40}, DType::Float32}};
}

// Small integers: exact in every float dtype and for any order of summation, so results compare
// bit for bit whatever algorithm MPI picks for a message size.
double exact_value(int rank, std::size_t leaf, std::int64_t i, int step) {
  return static_cast<double>((rank + 1) * (i % 7 + 1) + static_cast<int>(leaf) + step);
}

// Writes value(leaf index, element index) into every float leaf of `d`, in place (any strides).
template <class F>
void fill_with(TensorDict& d, F&& value) {
  const auto s = specs();
  for (std::size_t l = 0; l < s.size(); ++l) {
    if (!d.contains(s[l].key)) continue;
    Tensor& t = d.get(s[l].key);
    std::vector<double> p(static_cast<std::size_t>(t.numel()));
    for (std::size_t i = 0; i < p.size(); ++i) p[i] = value(l, static_cast<std::int64_t>(i));
    td::visit(t.dtype(), [&](auto tag) {
      using T = typename decltype(tag)::type;
      if constexpr (std::is_floating_point_v<T> || std::is_same_v<T, Eigen::half> ||
                    std::is_same_v<T, Eigen::bfloat16>) {
        Tensor c = Tensor::empty(t.shape(), t.dtype());
        auto* q = c.data<T>();
        for (std::size_t i = 0; i < p.size(); ++i) {
          if constexpr (std::is_same_v<T, double>) {
            q[i] = p[i];
          } else {
            q[i] = static_cast<T>(static_cast<float>(p[i]));
          }
        }
        t.copy_(c);
      }
    });
  }
}

void fill(TensorDict& d, int rank, int step) {
  fill_with(d, [&](std::size_t l, std::int64_t i) { return exact_value(rank, l, i, step); });
}

TensorDict make_grads(int rank) {
  TensorDict d;
  for (const auto& s : specs()) {
    if (s.key == Key({"dec", "w"})) {  // a transposed view: the Reducer copies it into a bucket
      d.set(s.key, Tensor::zeros({12, 8}, s.dtype).transpose(0, 1));
    } else {
      d.set(s.key, Tensor::zeros(s.shape, s.dtype));
    }
  }
  fill(d, rank, 0);
  return d;
}

// Every leaf key, shuffled with a per-rank seed: each rank marks in its own order.
std::vector<Key> shuffled_keys(int seed) {
  std::vector<Key> keys;
  for (const auto& s : specs()) keys.push_back(s.key);
  std::mt19937 gen(static_cast<unsigned>(seed));
  std::shuffle(keys.begin(), keys.end(), gen);
  return keys;
}

bool bit_equal(const TensorDict& a, const TensorDict& b) { return a.equal(b); }

}  // namespace

TEST_CASE("reducer: bit-identical to all_reduce, any ready order per rank, several steps",
          "[reducer]") {
  const int rank = td::get_rank();
  for (const ReduceOp op : {ReduceOp::SUM, ReduceOp::AVG, ReduceOp::MAX}) {
    for (const std::size_t cap : {std::size_t{64}, std::size_t{512}, td::kAutoBucketBytes}) {
      CAPTURE(td::name(op), cap);
      TensorDict grads = make_grads(rank);
      Reducer reducer(grads, {.op = op, .bucket_bytes = cap});
      for (int step = 0; step < 3; ++step) {
        fill(grads, rank, step);
        TensorDict expected = grads.clone();
        expected.all_reduce(op, {.bucket_bytes = td::kAutoBucketBytes});
        for (const Key& k : shuffled_keys(rank * 31 + step)) reducer.mark_ready(k);
        CHECK(reducer.in_step());
        reducer.finish();
        CHECK_FALSE(reducer.in_step());
        CHECK(bit_equal(grads, expected));
      }
    }
  }
}

// The progress thread posts the buckets whenever it gets to them, on the Reducer's own
// communicator: the caller's collectives on the same group in between, sync and async, must not
// be matched against a bucket's on another rank.
TEST_CASE("reducer: the group's other collectives between mark_ready calls", "[reducer]") {
  const int rank = td::get_rank();
  const int size = td::get_world_size();
  TensorDict grads = make_grads(rank);
  Reducer reducer(grads, {.op = ReduceOp::SUM, .bucket_bytes = 64});
  REQUIRE(reducer.num_buckets() > 4);
  for (int step = 0; step < 3; ++step) {
    fill(grads, rank, step);
    TensorDict expected = grads.clone();
    expected.all_reduce(ReduceOp::SUM);
    int calls = 0;
    for (const Key& k : shuffled_keys(rank * 17 + step)) {
      reducer.mark_ready(k);
      TensorDict other;
      other.set("x", Tensor::full({1000}, static_cast<double>(rank + calls)));
      if (calls % 2 == 0) {
        other.all_reduce(ReduceOp::SUM);
      } else {
        auto works = other.all_reduce(ReduceOp::SUM, {.async_op = true});
        td::wait_all(works);
      }
      const double want = size * (size - 1) / 2.0 + static_cast<double>(size * calls);
      CHECK(other.get("x").to_vector<double>() == std::vector<double>(1000, want));
      ++calls;
    }
    reducer.finish();
    CHECK(bit_equal(grads, expected));
  }
}

// Each Reducer duplicates the group's communicator (a collective call) and frees it with itself:
// Reducers built and destroyed in turn, as a program running several trainings does, keep working.
TEST_CASE("reducer: Reducers built one after another", "[reducer]") {
  const int rank = td::get_rank();
  for (int i = 0; i < 40; ++i) {
    TensorDict grads = make_grads(rank);
    TensorDict expected = grads.clone();
    expected.all_reduce(ReduceOp::SUM);
    Reducer reducer(grads, {.op = ReduceOp::SUM, .bucket_bytes = 256});
    reducer.finish();
    REQUIRE(bit_equal(grads, expected));
  }
}

TEST_CASE("reducer: random float values at 2 ranks are bit-identical too", "[reducer]") {
  if (td::get_world_size() > 2) return;  // a + b = b + a; three values depend on MPI's order
  const int rank = td::get_rank();
  TensorDict grads = make_grads(rank);
  std::mt19937 gen(static_cast<unsigned>(rank) + 7U);
  std::normal_distribution<double> normal(0.0, 1.0);
  fill_with(grads, [&](std::size_t, std::int64_t) { return normal(gen); });
  TensorDict expected = grads.clone();
  expected.all_reduce(ReduceOp::AVG, {.bucket_bytes = td::kAutoBucketBytes});
  Reducer reducer(grads, {.bucket_bytes = 256});
  for (const Key& k : shuffled_keys(rank)) reducer.mark_ready(k);
  reducer.finish();
  CHECK(bit_equal(grads, expected));
}

TEST_CASE("reducer: buckets are the leaves' storage, in reverse canonical order by default",
          "[reducer]") {
  const int rank = td::get_rank();
  TensorDict grads = make_grads(rank);
  const Tensor before = grads.get("head");  // a handle taken before: keeps the old storage
  Reducer reducer(grads, {.op = ReduceOp::SUM, .bucket_bytes = 1 << 20});
  // One bucket per dtype, numbered by their first leaf in reverse canonical order ("scale" is
  // last in canonical order); the empty leaf is in none.
  REQUIRE(reducer.num_buckets() == 2);
  CHECK(reducer.bucket_keys(0) == std::vector<Key>{Key("scale"), Key({"dec", "b"})});
  CHECK(reducer.bucket_nbytes(0) == std::size_t{1 + 12} * 8);
  const std::vector<Key> f32 = reducer.bucket_keys(1);
  const std::vector<Key> expected_f32 = {Key("head"), Key({"enc", "w"}), Key({"enc", "b"}),
                                         Key({"dec", "w"}), Key({"dec", "ln", "g"})};
  CHECK(f32 == expected_f32);
  CHECK(reducer.bucket_nbytes(1) == std::size_t{40 + 128 + 8 + 96 + 12} * 4);
  // Back to back in one storage, contiguous (the transposed leaf was copied into place).
  const float* p = grads.get("head").data<float>();
  CHECK(grads.get({"enc", "w"}).data<float>() == p + 40);
  CHECK(grads.get({"dec", "w"}).is_contiguous());
  for (const Key& k : f32) reducer.mark_ready(k);
  reducer.finish();
  const double n = td::get_world_size();
  CHECK(grads.get("head").to_vector<float>()[0] == static_cast<float>(n * (n + 1) / 2 + 7 * n));
  CHECK(before.to_vector<float>()[0] == static_cast<float>(rank + 1 + 7));  // untouched
}

TEST_CASE("reducer: ready_order, sub-dicts, unused leaves", "[reducer]") {
  const int rank = td::get_rank();
  TensorDict grads = make_grads(rank);
  TensorDict expected = grads.clone();
  expected.all_reduce(ReduceOp::SUM);
  Reducer reducer(grads, {.op = ReduceOp::SUM,
                          .bucket_bytes = 128,
                          .ready_order = {Key("enc"), Key("head"), Key({"dec", "w"})}});
  CHECK(reducer.bucket_keys(0).front() == Key({"enc", "b"}));  // enc's leaves, canonical order
  reducer.mark_ready("enc");                                   // a sub-dict: both its leaves
  if (rank % 2 == 0) reducer.mark_ready("head");               // unused on odd ranks
  reducer.finish();                                            // reduces the rest as they are
  CHECK(bit_equal(grads, expected));
}

TEST_CASE("reducer: gradient accumulation (no mark_ready in accumulation steps)", "[reducer]") {
  const int rank = td::get_rank();
  TensorDict grads = make_grads(rank);
  grads.zero_();
  Reducer reducer(grads, {.op = ReduceOp::SUM, .bucket_bytes = 256});
  TensorDict micro = make_grads(rank);
  for (int m = 0; m < 3; ++m) {  // three backward passes accumulate into the bucket views
    fill(micro, rank, m);
    for (const auto& s : specs()) {
      Tensor& g = grads.get(s.key);
      Tensor sum = g.clone();
      td::visit(g.dtype(), [&](auto tag) {
        using T = typename decltype(tag)::type;
        if constexpr (std::is_floating_point_v<T>) {
          const std::vector<T> add = micro.get(s.key).to_vector<T>();
          for (std::size_t i = 0; i < add.size(); ++i) sum.data<T>()[i] += add[i];
        }
      });
      g.copy_(sum);  // in place: the leaf stays the view of its bucket
    }
    if (m == 2)
      for (const Key& k : shuffled_keys(rank)) reducer.mark_ready(k);
  }
  reducer.finish();
  const double n = td::get_world_size();
  // element 0 of leaf "head" (index 7): sum over ranks and micro-batches of (r+1) + 7 + m
  CHECK(grads.get("head").to_vector<float>()[0] ==
        static_cast<float>(3 * (n * (n + 1) / 2) + n * (3 * 7 + 3)));
}

TEST_CASE("reducer: float16 and bfloat16 leaves, bit-identical to all_reduce", "[reducer]") {
  const int rank = td::get_rank();
  for (const DType dt : {DType::Float16, DType::BFloat16}) {
    TensorDict grads;
    grads.set("a", Tensor::zeros({33}, dt));
    grads.set("b", Tensor::zeros({5, 3}, dt));
    for (const char* k : {"a", "b"}) {
      Tensor& t = grads.get(k);
      td::visit(dt, [&](auto tag) {
        using T = typename decltype(tag)::type;
        for (std::int64_t i = 0; i < t.numel(); ++i)
          t.data<T>()[i] = static_cast<T>(static_cast<float>((rank + 1) * (i % 5)));
      });
    }
    TensorDict expected = grads.clone();
    expected.all_reduce(ReduceOp::AVG, {.bucket_bytes = td::kAutoBucketBytes});
    Reducer reducer(grads, {.bucket_bytes = 16});
    reducer.mark_ready(rank % 2 == 0 ? "a" : "b");
    reducer.finish();
    CHECK(bit_equal(grads, expected));
  }
}

TEST_CASE("reducer: a subgroup", "[reducer]") {
  const int size = td::get_world_size(), rank = td::get_rank();
  if (size < 2) return;
  const td::ProcessGroup g = td::new_group({0, size - 1});  // every world rank calls it
  if (rank != 0 && rank != size - 1) return;
  TensorDict grads = make_grads(rank);
  Reducer reducer(grads, {.op = ReduceOp::SUM, .bucket_bytes = 200, .group = g});
  for (const Key& k : shuffled_keys(rank)) reducer.mark_ready(k);
  reducer.finish();
  // element 0 of "head": (0 + 1) + (size - 1 + 1) + 2 * 7
  CHECK(grads.get("head").to_vector<float>()[0] == static_cast<float>(1 + size + 14));
}

namespace {
struct Grads : td::TensorClass<Grads> {
  Tensor w, b;
  TD_TENSORCLASS_FIELDS(Grads, w, b)
};
}  // namespace

TEST_CASE("reducer: a tensorclass of gradients", "[reducer]") {
  const int rank = td::get_rank();
  const double n = td::get_world_size();
  Grads g;
  g.w = Tensor::full<float>({4, 4}, static_cast<float>(rank + 1));
  g.b = Tensor::full<double>({4}, static_cast<double>(rank));
  Reducer reducer(g, {.op = ReduceOp::SUM, .bucket_bytes = 1024});
  CHECK(reducer.num_buckets() == 2);
  for (int step = 0; step < 2; ++step) {
    g.w.copy_(Tensor::full<float>({4, 4}, static_cast<float>(rank + 1)));  // writes in place
    reducer.mark_ready("b");
    reducer.mark_ready("w");
    reducer.finish();
    CHECK(g.w.to_vector<float>()[5] == static_cast<float>(n * (n + 1) / 2));
  }
  g.w = Tensor::zeros({4, 4}, DType::Float32);  // a field replaced: detected
  reducer.mark_ready("w");
  CHECK_THROWS_WITH(reducer.finish(), Catch::Contains("'w' was replaced"));
}

TEST_CASE("reducer: misuse is a clear error naming the key", "[reducer][errors]") {
  const int rank = td::get_rank();
  TensorDict grads = make_grads(rank);
  Reducer reducer(grads, {.op = ReduceOp::SUM, .bucket_bytes = 128});

  CHECK_THROWS_AS(reducer.mark_ready("nope"), td::KeyError);
  CHECK_THROWS_WITH(reducer.mark_ready(Key({"enc", "x"})), Catch::Contains("'enc.x'"));
  // A typo lists the nearest keys (issue 31); a key far from all of them lists none.
  CHECK_THROWS_WITH(reducer.mark_ready(Key({"enc", "ww"})),
                    Catch::Contains("(did you mean 'enc.w'"));
  CHECK_THROWS_WITH(reducer.mark_ready("dce"), Catch::Contains("did you mean 'dec'"));
  CHECK_THROWS_WITH(reducer.mark_ready("nope"), !Catch::Contains("did you mean"));
  CHECK_FALSE(reducer.in_step());

  reducer.mark_ready({"enc", "w"});
  CHECK_THROWS_WITH(reducer.mark_ready({"enc", "w"}),
                    Catch::Contains("'enc.w' is already marked ready in this step"));
  // A sub-dict with one leaf already marked: an error, and its other leaf stays unmarked.
  CHECK_THROWS_AS(reducer.mark_ready("enc"), td::Error);
  reducer.mark_ready({"enc", "b"});
  reducer.finish();

  // Skipping finish(): the next backward pass marks a key of the unfinished step again.
  reducer.mark_ready("head");
  CHECK_THROWS_WITH(reducer.mark_ready("head"), Catch::Contains("was finish() skipped"));
  reducer.finish();

  SECTION("a leaf replaced") {
    grads.set("head", Tensor::zeros({40}, DType::Float32));
    reducer.mark_ready("head");
    CHECK_THROWS_WITH(reducer.finish(), Catch::Contains("'head' was replaced"));
    CHECK_THROWS_WITH(reducer.mark_ready("head"), Catch::Contains("a previous finish() failed"));
  }
  SECTION("a leaf resized") {
    grads.set("head", Tensor::zeros({41}, DType::Float32));
    CHECK_THROWS_WITH(reducer.finish(), Catch::Contains("'head' was resized"));
  }
  SECTION("a key added") {
    grads.set({"enc", "extra"}, Tensor::zeros({2}, DType::Float32));
    CHECK_THROWS_WITH(reducer.finish(), Catch::Contains("'enc.extra' was added"));
  }
  SECTION("a key removed") {
    grads.erase("scale");
    CHECK_THROWS_WITH(reducer.finish(), Catch::Contains("'scale' was removed"));
  }
  SECTION("writes in place are not layout changes") {
    grads.get("head").copy_(Tensor::full<float>({40}, 1.0F));
    grads.zero_();
    reducer.finish();
    CHECK(grads.get("head").to_vector<float>()[3] == 0.0F);
  }
}

TEST_CASE("reducer: bad construction arguments raise on every rank", "[reducer][errors]") {
  const int rank = td::get_rank();
  const int size = td::get_world_size();
  {
    TensorDict grads = make_grads(rank);
    grads.set("steps", Tensor::zeros({3}, DType::Int64));
    CHECK_THROWS_WITH(Reducer(grads, {.op = ReduceOp::SUM, .compression = td::Compression::FP16}),
                      Catch::Contains("key 'steps' is int64"));
  }
  {
    TensorDict grads = make_grads(rank);
    CHECK_THROWS_WITH(Reducer(grads, {.ready_order = {Key("missing")}}),
                      Catch::Contains("'missing' is not a leaf or sub-dict"));
    CHECK_THROWS_WITH(Reducer(grads, {.ready_order = {Key("enc"), Key({"enc", "b"})}}),
                      Catch::Contains("listed twice"));
    CHECK_THROWS_AS(Reducer(grads, {.bucket_bytes = 0}), std::invalid_argument);
    CHECK_THROWS_WITH(Reducer(grads, {.op = ReduceOp::MAX, .compression = td::Compression::BF16}),
                      Catch::Contains("SUM and AVG"));
  }
  {
    TensorDict grads = make_grads(rank);
    grads.set("tied", grads.get("head"));
    CHECK_THROWS_WITH(Reducer(grads), Catch::Contains("'tied' shares its elements"));
  }
  if (size > 1) {
    TensorDict grads = make_grads(rank);
    // Ranks that disagree on the ready order (it decides the buckets) or on compression.
    const std::vector<Key> order = rank == 0 ? std::vector<Key>{Key("head")} : std::vector<Key>{};
    CHECK_THROWS_AS(Reducer(grads, {.ready_order = order}), td::LayoutMismatchError);
    const auto c = rank == 0 ? td::Compression::FP16 : td::Compression::BF16;
    CHECK_THROWS_AS(Reducer(grads, {.compression = c}), td::LayoutMismatchError);
  }
}

namespace {
// Every rank's random gradient (each rank can compute every other's from its seed).
double random_value(int rank, std::int64_t i) {
  std::mt19937_64 gen(static_cast<std::uint64_t>(rank) * 1000003ULL +
                      static_cast<std::uint64_t>(i));
  return std::uniform_real_distribution<double>(-1.0, 1.0)(gen);
}
}  // namespace

// Its own oracle, not reference.hpp's: random values, which 16-bit floats do not hold (the
// oracle's inputs are exact in them by design, so they could not show the bound), against their
// exact sum in double and the error bound docs/training.md states.
TEST_CASE("reducer: compression error stays within its bound", "[reducer][compression]") {
  const int rank = td::get_rank();
  const int size = td::get_world_size();
  constexpr std::int64_t kN = 3000;
  for (const auto c : {td::Compression::FP16, td::Compression::BF16}) {
    for (const ReduceOp op : {ReduceOp::SUM, ReduceOp::AVG}) {
      for (const DType dt : {DType::Float32, DType::Float64}) {
        CAPTURE(td::name(c), td::name(op), td::name(dt));
        TensorDict grads;
        grads.set("g", Tensor::zeros({kN}, dt));
        grads.set("h", Tensor::zeros({7}, dt));
        Reducer reducer(grads, {.op = op, .bucket_bytes = 4096, .compression = c});
        for (int step = 0; step < 2; ++step) {
          Tensor& g = grads.get("g");
          for (std::int64_t i = 0; i < kN; ++i) {
            const double v = random_value(rank, i + step);
            if (dt == DType::Float32) {
              g.data<float>()[i] = static_cast<float>(v);
            } else {
              g.data<double>()[i] = v;
            }
          }
          reducer.mark_ready("g");
          reducer.mark_ready("h");
          reducer.finish();
          // One rounding of each rank's value and one per addition (size - 1): relative to the
          // sum of magnitudes, below (size + 1) units of 2^-11 (FP16) or 2^-8 (BF16), the
          // bound docs/training.md states.
          const double unit = c == td::Compression::FP16 ? std::ldexp(1.0, -11) : 0.00390625;
          double worst = 0;
          for (std::int64_t i = 0; i < kN; ++i) {
            double exact = 0, magnitude = 0;
            for (int r = 0; r < size; ++r) {
              exact += random_value(r, i + step);
              magnitude += std::abs(random_value(r, i + step));
            }
            if (op == ReduceOp::AVG) {
              exact /= size;
              magnitude /= size;
            }
            const double got = dt == DType::Float32 ? static_cast<double>(g.data<float>()[i])
                                                    : g.data<double>()[i];
            worst = std::max(worst, std::abs(got - exact) / (magnitude + 1e-6));
          }
          CHECK(worst <= (size + 1) * unit);
        }
      }
    }
  }
}

TEST_CASE("reducer: FP16 AVG divides before summing, so large gradients do not overflow",
          "[reducer][compression]") {
  TensorDict grads;
  grads.set("g", Tensor::full<float>({16}, 60000.0F));  // FP16's largest value is 65504
  Reducer reducer(grads, {.compression = td::Compression::FP16});
  reducer.mark_ready("g");
  reducer.finish();
  const float v = grads.get("g").to_vector<float>()[0];
  CHECK(std::isfinite(v));
  CHECK(std::abs(v - 60000.0F) <= 60000.0F * 0.002F);
}

TEST_CASE("without the progress thread, mark_ready moves launched buckets along",
          "[reducer][progress]") {
  // Bucket 0 is "a"; bucket 1 holds 200 one-element leaves, marked one by one (a backward pass).
  // Without a progress thread in the process (TD_PROGRESS_THREAD=0, the default across hosts:
  // test_mpi_reducer.no_progress_thread), nothing but the library's own calls advances a
  // nonblocking collective, so bucket 0 must complete during the later mark_ready calls, not
  // only in finish(): "a" (a view of its storage, reduced in place) holds the sum before the
  // last leaf is marked. (With the thread running, it drives Open MPI's progress itself, and the
  // step is only checked at its end.)
  const int rank = td::get_rank();
  const auto n = static_cast<float>(td::get_world_size());
  const bool was = td::async_progress_enabled();
  td::set_async_progress(false);
  TensorDict g;
  g.set("a", Tensor::full<float>({512}, 1.f + static_cast<float>(rank)));
  std::vector<std::string> small;
  for (int i = 0; i < 200; ++i) {
    std::string name = std::to_string(1000 + i);  // "c000" to "c199": canonical order
    name[0] = 'c';
    small.push_back(name);
    g.set(small.back(), Tensor::full<float>({1}, 1.f));
  }
  const float sum = n * (n + 1) / 2;  // 1 + 2 + ... + n
  {
    Reducer r(g, {.op = ReduceOp::SUM, .bucket_bytes = 2048, .ready_order = {"a"}});
    REQUIRE(r.num_buckets() == 2);
    r.mark_ready("a");
    // Bucket 0 is read while in flight only where no other thread of this process is inside MPI
    // (no progress thread started): then MPI writes it only inside this thread's calls.
    const char* env = std::getenv("TD_PROGRESS_THREAD");
    const bool no_thread = env != nullptr && std::string(env) == "0";
    std::size_t marked_when_done = small.size();
    for (std::size_t i = 0; no_thread && i + 1 < small.size(); ++i) {
      // Up to 2 s in all: a loaded machine (sanitizers, ctest -j) may deschedule a peer a while.
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
      r.mark_ready(small[i]);
      if (g.get("a").to_vector<float>() == std::vector<float>(512, sum)) {
        marked_when_done = i + 1;
        break;
      }
    }
    INFO("bucket 0 held its sum after " << marked_when_done << " of " << small.size()
                                        << " leaves of bucket 1 were marked");
    if (no_thread) CHECK(marked_when_done < small.size());
    const std::size_t from = no_thread ? std::min(marked_when_done, small.size() - 1) : 0;
    for (std::size_t i = from; i < small.size(); ++i) r.mark_ready(small[i]);
    r.finish();
    CHECK(g.get("a").to_vector<float>() == std::vector<float>(512, sum));
    CHECK(g.get("c199").to_vector<float>() == std::vector<float>(1, n));
  }
  td::set_async_progress(was);
}

TEST_CASE("set_async_progress toggled between two mark_ready calls keeps the bucket order",
          "[reducer][progress]") {
  // Two float buckets of one leaf each ("a" is bucket 0, "b" bucket 1 in ready order a, b):
  // with the toggle mid-step, bucket 1 must not be posted before bucket 0 (queued on the
  // progress thread), or the ranks sum a into b.
  const int rank = td::get_rank();
  const auto n = static_cast<float>(td::get_world_size());
  const bool was = td::async_progress_enabled();
  for (const bool first : {true, false}) {
    for (int step = 0; step < 3; ++step) {
      TensorDict g;
      g.set("a", Tensor::full<float>({512}, 1.f));
      g.set("b", Tensor::full<float>({512}, 100.f));
      td::set_async_progress(first);
      Reducer r(g, {.op = ReduceOp::SUM, .bucket_bytes = 2048, .ready_order = {"a", "b"}});
      for (int s = 0; s <= step; ++s) {
        g.get("a").copy_(Tensor::full<float>({512}, 1.f + static_cast<float>(rank)));
        g.get("b").copy_(Tensor::full<float>({512}, 100.f));
        td::set_async_progress(first);
        r.mark_ready("a");
        // Odd ranks give their progress thread time to post bucket 0 first; even ranks go on at
        // once, so that a bucket 1 posted out of order meets the others' bucket 0.
        if (rank % 2 == 1) std::this_thread::sleep_for(std::chrono::milliseconds(5));
        td::set_async_progress(!first);
        r.mark_ready("b");
        r.finish();
        INFO("progress " << first << " then " << !first << ", step " << s);
        const float a = n * (n + 1) / 2;  // 1 + 2 + ... + n
        CHECK(g.get("a").to_vector<float>() == std::vector<float>(512, a));
        CHECK(g.get("b").to_vector<float>() == std::vector<float>(512, 100.f * n));
      }
    }
  }
  td::set_async_progress(was);
}

namespace {
// What the library writes to stderr while fn runs (fd 2 redirected to a temporary file).
std::string stderr_of(const std::function<void()>& fn) {
  std::fflush(stderr);
  std::FILE* tmp = std::tmpfile();
  REQUIRE(tmp != nullptr);
  const int saved = dup(2);
  dup2(fileno(tmp), 2);
  fn();
  std::fflush(stderr);
  dup2(saved, 2);
  close(saved);
  std::rewind(tmp);
  std::string out;
  char buf[4096];
  for (std::size_t n; (n = std::fread(buf, 1, sizeof buf, tmp)) > 0;) out.append(buf, n);
  std::fclose(tmp);
  return out;
}
}  // namespace

TEST_CASE("reducer: a handle taken before construction is reported at the first finish()",
          "[reducer][errors]") {
  const int rank = td::get_rank();
  TensorDict grads = make_grads(rank);
  Tensor stale = grads.get({"enc", "w"});  // before construction: never reduced
  std::string said = stderr_of([&] {
    Reducer reducer(grads, {.op = ReduceOp::SUM, .bucket_bytes = 128});
    reducer.finish();
    reducer.finish();  // said once
  });
  CHECK_THAT(said, Catch::Contains("key 'enc.w' held before the Reducer was built"));
  CHECK(said.find("Reducer: the storage") == said.rfind("Reducer: the storage"));
  CHECK_FALSE(stale.shares_storage_with(grads.get({"enc", "w"})));
  // Handles taken after construction: nothing said.
  TensorDict fresh = make_grads(rank);
  said = stderr_of([&] {
    Reducer reducer(fresh, {.op = ReduceOp::SUM, .bucket_bytes = 128});
    Tensor ok = fresh.get({"enc", "w"});
    reducer.finish();
    CHECK(ok.shares_storage_with(fresh.get({"enc", "w"})));
  });
  CHECK_THAT(said, !Catch::Contains("before the Reducer was built"));
}
