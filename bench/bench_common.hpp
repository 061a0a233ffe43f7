// The driver shared by bench_allreduce and bench_reduce: workloads, the variants measured side by
// side (per-leaf, bucketed, consolidated, raw MPI on a pre-packed buffer), the correctness guard,
// the interleaved timing loop and the outputs (table, CSV, gnuplot figure).
//
// Timing method, the same for every variant: a barrier, then one call timed with MPI_Wtime on
// every rank; the round's time is the MAX over ranks (what the slowest rank waited), and a
// variant's figure is the median over rounds. Every round runs each variant once in a shuffled
// order, each on its own copy of the data, so machine noise and cache warmth favour none of them.
#pragma once

#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <climits>
#include <cmath>
#include <complex>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <exception>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <map>
#include <optional>
#include <random>
#include <set>
#include <stdexcept>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <mpi.h>
#include <CLI/CLI.hpp>

#include <tensordict/tensordict.hpp>

namespace td_bench {

/// Which TensorDict collective the executable measures.
enum class Collective { AllReduce, Reduce };

/// dst of every reduce.
inline constexpr int kRoot = 0;
/// Message size of the "ideal, chunked" variant.
inline constexpr std::size_t kIdealChunkBytes = std::size_t{4} << 20;

// ---- sizes ------------------------------------------------------------------------------------

/// "64KiB", "1MiB" for exact binary multiples, else "12345B".
inline std::string size_label(std::size_t b) {
  constexpr std::size_t kKi = 1024, kMi = kKi * 1024, kGi = kMi * 1024;
  if (b >= kGi && b % kGi == 0) return fmt::format("{}GiB", b / kGi);
  if (b >= kMi && b % kMi == 0) return fmt::format("{}MiB", b / kMi);
  if (b >= kKi && b % kKi == 0) return fmt::format("{}KiB", b / kKi);
  return fmt::format("{}B", b);
}

/// "26.08 MiB" (binary units, two decimals).
inline std::string human_bytes(double b) {
  if (b >= 1024.0 * 1024 * 1024) return fmt::format("{:.2f} GiB", b / (1024.0 * 1024 * 1024));
  if (b >= 1024.0 * 1024) return fmt::format("{:.2f} MiB", b / (1024.0 * 1024));
  if (b >= 1024.0) return fmt::format("{:.2f} KiB", b / 1024.0);
  return fmt::format("{:.0f} B", b);
}

/// Parses "65536", "64KiB", "64K", "1MiB", "1.5MB": K/M/G and KiB/MiB/GiB are binary, KB/MB/GB
/// decimal, B or nothing is bytes (case-insensitive). nullopt if malformed or zero.
inline std::optional<std::size_t> parse_size(const std::string& text) {
  std::size_t pos = 0;
  double value = 0;
  try {
    value = std::stod(text, &pos);
  } catch (const std::exception&) {
    return std::nullopt;
  }
  std::string unit = text.substr(pos);
  std::transform(unit.begin(), unit.end(), unit.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  static const std::map<std::string, double> kUnits = {{"", 1},
                                                       {"b", 1},
                                                       {"k", 1024.0},
                                                       {"kib", 1024.0},
                                                       {"kb", 1e3},
                                                       {"m", 1048576.0},
                                                       {"mib", 1048576.0},
                                                       {"mb", 1e6},
                                                       {"g", 1073741824.0},
                                                       {"gib", 1073741824.0},
                                                       {"gb", 1e9}};
  auto it = kUnits.find(unit);
  if (it == kUnits.end() || !(value > 0)) return std::nullopt;
  const double bytes = std::round(value * it->second);
  if (bytes < 1 || bytes > 1e15) return std::nullopt;
  return static_cast<std::size_t>(bytes);
}

// ---- options ----------------------------------------------------------------------------------

/// The command line.
struct Options {
  std::vector<std::string> workloads{"tiny", "small", "transformer", "large", "mixed"};
  std::vector<std::string> buckets{"none", "64KiB", "256KiB", "1MiB", "4MiB", "16MiB", "auto"};
  std::string op = "sum";
  std::string dtype = "float32";
  int iters = 0;          // 0: chosen per variant from min_time
  double min_time = 0.5;  // seconds of timed calls each variant aims for
  int min_rounds = 5;
  int max_rounds = 50;
  int warmup = 2;
  std::string csv;
  std::string plot_dir = "build/bench";
  bool no_plot = false;
  std::string progress = "auto";
  std::string samples_csv;   // every round's time, for looking at the noise
  std::string inject_fault;  // hidden: corrupts this variant's result once, to test the guard
};

/// One entry of --buckets: nullopt is `none` (one collective per leaf).
struct BucketChoice {
  std::optional<std::size_t> bytes;
};

inline std::optional<td::ReduceOp> parse_op(const std::string& s) {
  if (s == "sum") return td::ReduceOp::SUM;
  if (s == "avg") return td::ReduceOp::AVG;
  if (s == "max") return td::ReduceOp::MAX;
  if (s == "min") return td::ReduceOp::MIN;
  if (s == "product" || s == "prod") return td::ReduceOp::PRODUCT;
  return std::nullopt;
}

inline std::optional<td::DType> parse_dtype(const std::string& s) {
  for (std::size_t i = 0; i < td::kNumDTypes; ++i) {
    const auto d = static_cast<td::DType>(i);
    if (td::name(d) == s) return d;
  }
  return std::nullopt;
}

// ---- workloads --------------------------------------------------------------------------------

/// One leaf of a workload.
struct LeafSpec {
  std::vector<std::string> key;
  td::Shape shape;
  td::DType dtype = td::DType::Float32;
};

/// A named set of leaves.
struct Workload {
  std::string name;
  std::string what;  // one-line description for the table
  std::vector<LeafSpec> leaves;
};

inline constexpr const char* kWorkloadNames[] = {"tiny", "small", "transformer", "large", "mixed"};

inline std::int64_t numel_of(const td::Shape& s) {
  std::int64_t n = 1;
  for (auto d : s) n *= d;
  return n;
}

inline std::uint64_t splitmix64(std::uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

/// Builds a workload's leaf list. `dt` replaces float32 in every workload but `mixed`.
inline Workload make_workload(const std::string& name, td::DType dt) {
  Workload w;
  w.name = name;
  auto add = [&](std::vector<std::string> key, td::Shape shape, td::DType d) {
    w.leaves.push_back(LeafSpec{std::move(key), std::move(shape), d});
  };
  if (name == "tiny" || name == "small") {
    // tiny: 16384 leaves of 16 elements (64 B in float32); small: 4096 leaves of 256 (1 KiB).
    const int n = name == "tiny" ? 16384 : 4096;
    const std::int64_t numel = name == "tiny" ? 16 : 256;
    for (int i = 0; i < n; ++i)
      add({fmt::format("block{}", i / 64), fmt::format("p{}", i % 64)}, {numel}, dt);
    w.what = fmt::format("{} leaves of {} elements", n, numel);
  } else if (name == "transformer") {
    // A 6-layer, hidden 256, vocabulary 8192 model: the token embedding [8192, 256] (tied with
    // the output head, no learned position embedding) plus 12 leaves per layer:
    //   attn.qkv [768,256]+[768], attn.out [256,256]+[256], ln1 [256]+[256],
    //   mlp.fc1 [1024,256]+[1024], mlp.fc2 [256,1024]+[256], ln2 [256]+[256]
    // = 789,760 elements per layer; 2,097,152 + 6 * 789,760 = 6,835,712 elements, 73 leaves,
    // 27,342,848 B (27.3 MB, 26.08 MiB) in float32. A [512,256] position embedding would make
    // it 74 leaves, so it is left out to match the 73-leaf target.
    constexpr std::int64_t H = 256, V = 8192, F = 4 * H;
    add({"embed", "weight"}, {V, H}, dt);
    for (int l = 0; l < 6; ++l) {
      const std::string b = fmt::format("h{}", l);
      add({b, "attn", "qkv", "weight"}, {3 * H, H}, dt);
      add({b, "attn", "qkv", "bias"}, {3 * H}, dt);
      add({b, "attn", "out", "weight"}, {H, H}, dt);
      add({b, "attn", "out", "bias"}, {H}, dt);
      add({b, "ln1", "weight"}, {H}, dt);
      add({b, "ln1", "bias"}, {H}, dt);
      add({b, "mlp", "fc1", "weight"}, {F, H}, dt);
      add({b, "mlp", "fc1", "bias"}, {F}, dt);
      add({b, "mlp", "fc2", "weight"}, {H, F}, dt);
      add({b, "mlp", "fc2", "bias"}, {H}, dt);
      add({b, "ln2", "weight"}, {H}, dt);
      add({b, "ln2", "bias"}, {H}, dt);
    }
    w.what = "6-layer transformer, hidden 256, vocab 8192";
  } else if (name == "large") {
    for (int i = 0; i < 8; ++i) add({fmt::format("w{}", i)}, {1024, 1024}, dt);
    w.what = "8 leaves of 1M elements";
  } else if (name == "mixed") {
    // 3000 leaves of 64..4096 elements (sizes from a fixed hash), dtypes cycling float32,
    // float64, int64, bfloat16 in key order (zero-padded names keep key order = index order).
    constexpr td::DType kCycle[] = {td::DType::Float32, td::DType::Float64, td::DType::Int64,
                                    td::DType::BFloat16};
    for (int i = 0; i < 3000; ++i) {
      const auto numel =
          static_cast<std::int64_t>(64 + splitmix64(static_cast<std::uint64_t>(i)) % 4033);
      add({fmt::format("g{:02}", i / 100), fmt::format("t{:02}", i % 100)}, {numel}, kCycle[i % 4]);
    }
    w.what = "3000 leaves of 64-4096 elements, 4 dtypes interleaved";
  }
  return w;
}

/// Total bytes per dtype, in dtype order.
inline std::map<td::DType, std::size_t> bytes_per_dtype(const Workload& w) {
  std::map<td::DType, std::size_t> out;
  for (const auto& l : w.leaves)
    out[l.dtype] += static_cast<std::size_t>(numel_of(l.shape)) * td::itemsize(l.dtype);
  return out;
}

/// The workload as a TensorDict; every leaf shaped {0} when `zero_size`.
inline td::TensorDict build_dict(const Workload& w, bool zero_size) {
  td::TensorDict d;
  for (const auto& l : w.leaves)
    d.set(td::Key(l.key),
          zero_size ? td::Tensor::empty({0}, l.dtype) : td::Tensor::zeros(l.shape, l.dtype));
  return d;
}

// ---- element values for the correctness guard -------------------------------------------------

template <class T>
inline constexpr bool kIsHalf =
    std::is_same_v<T, Eigen::half> || std::is_same_v<T, Eigen::bfloat16>;
template <class T>
struct IsComplex : std::false_type {};
template <class R>
struct IsComplex<std::complex<R>> : std::true_type {};

template <class T>
T from_double(double v) {
  if constexpr (kIsHalf<T>) {
    return T(static_cast<float>(v));
  } else if constexpr (IsComplex<T>::value) {
    return T(static_cast<typename T::value_type>(v), 0);
  } else {
    return static_cast<T>(v);
  }
}

template <class T>
double to_double(T v) {
  if constexpr (kIsHalf<T>) {
    return static_cast<double>(static_cast<float>(v));
  } else if constexpr (IsComplex<T>::value) {
    return static_cast<double>(v.real());
  } else {
    return static_cast<double>(v);
  }
}

/// Rank r's value of element i of leaf j: small integers, exact in every dtype, different on
/// every rank and every leaf so that a swapped, missed or doubly reduced leaf shows.
inline int pattern(std::size_t leaf, std::size_t i, int rank) {
  return 1 + static_cast<int>((i + 7 * leaf + static_cast<std::size_t>(rank)) % 3);
}

/// Writes pattern(leaf, ., rank) into a contiguous tensor.
inline void fill_pattern(td::Tensor& t, std::size_t leaf, int rank) {
  td::visit(t.dtype(), [&](auto tag) {
    using T = typename decltype(tag)::type;
    T* p = t.data<T>();
    for (std::size_t i = 0, n = static_cast<std::size_t>(t.numel()); i < n; ++i)
      p[i] = from_double<T>(pattern(leaf, i, rank));
  });
}

/// Sets every element of a contiguous tensor to `value`.
inline void fill_constant(td::Tensor& t, double value) {
  td::visit(t.dtype(), [&](auto tag) {
    using T = typename decltype(tag)::type;
    T* p = t.data<T>();
    const T v = from_double<T>(value);
    for (std::int64_t i = 0, n = t.numel(); i < n; ++i) p[i] = v;
  });
}

/// What the collective should leave in element i of leaf j, as a double (integers wrap like the
/// dtype does).
template <class T>
double expected_value(td::ReduceOp op, int ranks, std::size_t leaf, std::size_t i) {
  std::int64_t acc = pattern(leaf, i, 0);
  for (int r = 1; r < ranks; ++r) {
    const std::int64_t v = pattern(leaf, i, r);
    switch (op) {
      case td::ReduceOp::SUM:
      case td::ReduceOp::AVG:
        acc += v;
        break;
      case td::ReduceOp::PRODUCT:
        acc *= v;
        break;
      case td::ReduceOp::MAX:
        acc = std::max(acc, v);
        break;
      case td::ReduceOp::MIN:
        acc = std::min(acc, v);
        break;
      default:
        break;
    }
  }
  if (op == td::ReduceOp::AVG) return static_cast<double>(acc) / ranks;
  if constexpr (std::is_integral_v<T>) return static_cast<double>(static_cast<T>(acc));
  return static_cast<double>(acc);
}

/// Relative tolerance of a result in dtype T (AVG divides; 16-bit floats round).
template <class T>
double tolerance() {
  if constexpr (std::is_same_v<T, Eigen::bfloat16>) return 1e-2;
  if constexpr (std::is_same_v<T, Eigen::half>) return 2e-3;
  if constexpr (std::is_same_v<T, float> || std::is_same_v<T, std::complex<float>>) return 1e-6;
  if constexpr (std::is_floating_point_v<T> || IsComplex<T>::value) return 1e-12;
  return 0.0;
}

/// "" if leaf j holds the expected result, else the first wrong element.
inline std::string check_tensor(const td::Tensor& t, std::size_t leaf, td::ReduceOp op, int ranks) {
  return td::visit(t.dtype(), [&](auto tag) -> std::string {
    using T = typename decltype(tag)::type;
    const T* p = t.data<T>();
    for (std::size_t i = 0, n = static_cast<std::size_t>(t.numel()); i < n; ++i) {
      const double got = to_double(p[i]);
      const double want = expected_value<T>(op, ranks, leaf, i);
      if (!(std::abs(got - want) <= tolerance<T>() * std::max(1.0, std::abs(want))))
        return fmt::format("element {}: got {}, expected {}", i, got, want);
    }
    return {};
  });
}

// ---- raw MPI for the ideal variants -----------------------------------------------------------

template <class Half, class F>
void half_apply(const void* in, void* inout, const int* len, F f) {
  const Half* a = static_cast<const Half*>(in);
  Half* b = static_cast<Half*>(inout);
  for (int i = 0; i < *len; ++i) b[i] = Half(f(static_cast<float>(a[i]), static_cast<float>(b[i])));
}
template <class Half>
void half_sum(void* in, void* inout, int* len, MPI_Datatype*) {
  half_apply<Half>(in, inout, len, [](float x, float y) { return x + y; });
}
template <class Half>
void half_prod(void* in, void* inout, int* len, MPI_Datatype*) {
  half_apply<Half>(in, inout, len, [](float x, float y) { return x * y; });
}
template <class Half>
void half_min(void* in, void* inout, int* len, MPI_Datatype*) {
  half_apply<Half>(in, inout, len, [](float x, float y) { return std::min(x, y); });
}
template <class Half>
void half_max(void* in, void* inout, int* len, MPI_Datatype*) {
  half_apply<Half>(in, inout, len, [](float x, float y) { return std::max(x, y); });
}

/// What the ideal variants hand to MPI: our own communicator, and a datatype and operations for
/// the 16-bit floats, which MPI lacks (user-defined, like any program without the library would).
class RawMpi {
 public:
  RawMpi() {
    MPI_Comm_dup(MPI_COMM_WORLD, &comm_);
    create<Eigen::half>(half_);
    create<Eigen::bfloat16>(bfloat_);
  }
  ~RawMpi() {
    release(half_);
    release(bfloat_);
    if (comm_ != MPI_COMM_NULL) MPI_Comm_free(&comm_);
  }
  RawMpi(const RawMpi&) = delete;
  RawMpi& operator=(const RawMpi&) = delete;

  MPI_Comm comm() const { return comm_; }

  MPI_Datatype type(td::DType d) const {
    switch (d) {
      case td::DType::Bool:
      case td::DType::UInt8:
        return MPI_UINT8_T;
      case td::DType::Int8:
        return MPI_INT8_T;
      case td::DType::Int16:
        return MPI_INT16_T;
      case td::DType::Int32:
        return MPI_INT32_T;
      case td::DType::Int64:
        return MPI_INT64_T;
      case td::DType::Float16:
        return half_.type;
      case td::DType::BFloat16:
        return bfloat_.type;
      case td::DType::Float32:
        return MPI_FLOAT;
      case td::DType::Float64:
        return MPI_DOUBLE;
      case td::DType::Complex64:
        return MPI_C_FLOAT_COMPLEX;
      case td::DType::Complex128:
        return MPI_C_DOUBLE_COMPLEX;
    }
    return MPI_DATATYPE_NULL;
  }

  MPI_Op op(td::ReduceOp op, td::DType d) const {
    if (d == td::DType::Float16 || d == td::DType::BFloat16) {
      const Half& h = d == td::DType::Float16 ? half_ : bfloat_;
      switch (op) {
        case td::ReduceOp::SUM:
        case td::ReduceOp::AVG:
          return h.ops[0];
        case td::ReduceOp::PRODUCT:
          return h.ops[1];
        case td::ReduceOp::MIN:
          return h.ops[2];
        case td::ReduceOp::MAX:
          return h.ops[3];
        default:
          return MPI_OP_NULL;
      }
    }
    switch (op) {
      case td::ReduceOp::SUM:
      case td::ReduceOp::AVG:
        return MPI_SUM;
      case td::ReduceOp::PRODUCT:
        return MPI_PROD;
      case td::ReduceOp::MIN:
        return MPI_MIN;
      case td::ReduceOp::MAX:
        return MPI_MAX;
      case td::ReduceOp::BAND:
        return MPI_BAND;
      case td::ReduceOp::BOR:
        return MPI_BOR;
      case td::ReduceOp::BXOR:
        return MPI_BXOR;
    }
    return MPI_OP_NULL;
  }

 private:
  struct Half {
    MPI_Datatype type = MPI_DATATYPE_NULL;
    MPI_Op ops[4] = {MPI_OP_NULL, MPI_OP_NULL, MPI_OP_NULL, MPI_OP_NULL};  // sum prod min max
  };
  template <class T>
  static void create(Half& h) {
    MPI_Type_contiguous(2, MPI_BYTE, &h.type);
    MPI_Type_commit(&h.type);
    MPI_Op_create(&half_sum<T>, 1, &h.ops[0]);
    MPI_Op_create(&half_prod<T>, 1, &h.ops[1]);
    MPI_Op_create(&half_min<T>, 1, &h.ops[2]);
    MPI_Op_create(&half_max<T>, 1, &h.ops[3]);
  }
  static void release(Half& h) {
    for (auto& o : h.ops)
      if (o != MPI_OP_NULL) MPI_Op_free(&o);
    if (h.type != MPI_DATATYPE_NULL) MPI_Type_free(&h.type);
  }
  MPI_Comm comm_ = MPI_COMM_NULL;
  Half half_, bfloat_;
};

/// Divides a contiguous floating tensor by `n` in place (AVG = SUM / ranks, as the library does).
inline void divide_in_place(td::Tensor& t, int n) {
  td::visit(t.dtype(), [&](auto tag) {
    using T = typename decltype(tag)::type;
    if constexpr (kIsHalf<T>) {
      T* p = t.data<T>();
      for (std::int64_t i = 0, e = t.numel(); i < e; ++i)
        p[i] = T(static_cast<float>(p[i]) / static_cast<float>(n));
    } else if constexpr (std::is_floating_point_v<T> || IsComplex<T>::value) {
      T* p = t.data<T>();
      using Real = decltype(std::abs(T{}));
      for (std::int64_t i = 0, e = t.numel(); i < e; ++i) p[i] /= static_cast<Real>(n);
    }
  });
}

// ---- the collective under test ----------------------------------------------------------------

/// The collective, op and group every variant of a run uses.
struct Context {
  Collective kind = Collective::AllReduce;
  td::ReduceOp op = td::ReduceOp::SUM;
  int rank = 0;
  int ranks = 1;
  RawMpi* mpi = nullptr;
  std::string auto_size = "?";  // what bucket auto resolved to (for labels)

  /// Whether this rank holds the result afterwards.
  bool receives() const { return kind == Collective::AllReduce || rank == kRoot; }
  const char* dict_call() const {
    return kind == Collective::AllReduce ? "TensorDict.all_reduce" : "TensorDict.reduce";
  }
  const char* mpi_call() const {
    return kind == Collective::AllReduce ? "MPI_Allreduce" : "MPI_Reduce";
  }
  const char* tensor_call() const {
    return kind == Collective::AllReduce ? "td::all_reduce" : "td::reduce";
  }

  void run_dict(td::TensorDict& d, std::optional<std::size_t> bucket_bytes) const {
    td::CollectiveOptions o;
    o.bucket_bytes = bucket_bytes;
    if (kind == Collective::AllReduce) {
      d.all_reduce(op, o);
    } else {
      d.reduce(kRoot, op, o);
    }
  }

  void run_tensor(td::Tensor& t) const {
    if (kind == Collective::AllReduce) {
      td::all_reduce(t, op).wait();
    } else {
      td::reduce(t, kRoot, op).wait();
    }
  }

  /// One raw MPI collective per `chunk_bytes` (0: one for the whole buffer) on a contiguous tensor.
  void run_raw(td::Tensor& t, std::size_t chunk_bytes) const {
    const td::DType d = t.dtype();
    const std::size_t isz = td::itemsize(d);
    const auto n = static_cast<std::size_t>(t.numel());
    std::size_t per = chunk_bytes == 0 ? n : std::max<std::size_t>(1, chunk_bytes / isz);
    per = std::min<std::size_t>(per, INT_MAX);
    auto* base = static_cast<std::byte*>(t.raw_data());
    const MPI_Datatype type = mpi->type(d);
    const MPI_Op mop = mpi->op(op, d);
    for (std::size_t first = 0; first < n; first += per) {
      const int count = static_cast<int>(std::min(per, n - first));
      void* p = base + first * isz;
      if (kind == Collective::AllReduce) {
        MPI_Allreduce(MPI_IN_PLACE, p, count, type, mop, mpi->comm());
      } else if (rank == kRoot) {
        MPI_Reduce(MPI_IN_PLACE, p, count, type, mop, kRoot, mpi->comm());
      } else {
        MPI_Reduce(p, nullptr, count, type, mop, kRoot, mpi->comm());
      }
    }
    if (op == td::ReduceOp::AVG && receives()) divide_in_place(t, ranks);
  }
};

// ---- variants and results ---------------------------------------------------------------------

/// What a variant is, for the summary, the CSV and the plot.
enum class Role { PerLeaf, Bucket, Auto, Consolidated, Tensor, Ideal, IdealChunks, CheckPlan };

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

/// One variant's figures (kept after the workload's buffers are freed).
struct Row {
  std::string label, id, csv_bucket;
  Role role = Role::Bucket;
  std::size_t bucket = 0;
  bool packer = false;
  int rounds = 0;
  double median = 0, min = 0;  // seconds
  std::size_t peak_extra = 0;
  std::uint64_t plan_misses = 0;
  std::vector<double> samples;  // seconds per round, in round order
};

/// One workload's results.
struct WorkloadResult {
  std::string name, what, dtypes;
  std::size_t leaves = 0;
  std::size_t bytes = 0;
  std::vector<Row> rows;
  double seconds = 0;  // wall time of the whole workload

  const Row* find(Role r) const {
    for (const auto& row : rows)
      if (row.role == r) return &row;
    return nullptr;
  }
  double best_ideal() const {
    double best = 0;
    for (const auto& row : rows)
      if ((row.role == Role::Ideal || row.role == Role::IdealChunks) &&
          (best == 0 || row.median < best))
        best = row.median;
    return best;
  }
};

/// Time of f() on this rank, started after a barrier, as the maximum over the world's ranks.
template <class F>
double timed_max_over_ranks(F&& f) {
  td::barrier();
  const double start = MPI_Wtime();
  f();
  double t = MPI_Wtime() - start;
  MPI_Allreduce(MPI_IN_PLACE, &t, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  return t;
}

/// Parses a small benchmark's command line; on --help or an error, finalizes and returns the
/// exit code for main to return.
inline std::optional<int> parse_or_exit(CLI::App& app, int argc, char** argv) {
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int rc = app.exit(e);
    td::destroy_process_group();
    return rc;
  }
  return std::nullopt;
}

inline double median_of(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const std::size_t m = v.size() / 2;
  return v.size() % 2 ? v[m] : 0.5 * (v[m - 1] + v[m]);
}

// ---- progress on rank 0's stderr --------------------------------------------------------------

/// How progress is shown. Results always go to stdout and progress to stderr, so
/// `bench_allreduce > results.txt` holds nothing but results; `Line` keeps a terminal that shows
/// both streams readable too.
enum class ProgressMode {
  Off,   // nothing
  Line,  // one status line on stderr, rewritten in place and erased before results are printed
  Log,   // a few plain lines per workload on stderr (for a log file)
};

/// "auto": Line when stderr is a terminal, else Log. Under mpirun the ranks' stderr is a pipe
/// even when mpirun's is a terminal, so `make bench` asks for `line` itself (mpirun forwards a
/// line without its newline as it comes).
inline std::optional<ProgressMode> parse_progress(const std::string& s) {
  if (s == "auto") return isatty(STDERR_FILENO) != 0 ? ProgressMode::Line : ProgressMode::Log;
  if (s == "line") return ProgressMode::Line;
  if (s == "log") return ProgressMode::Log;
  if (s == "none" || s == "off") return ProgressMode::Off;
  return std::nullopt;
}

/// The status of a running benchmark, on stderr.
class Progress {
 public:
  explicit Progress(ProgressMode mode) : mode_(mode) {}
  /// A `milestone` is also printed, as its own line, in Log mode; other updates only in Line mode.
  void show(const std::string& line, bool milestone) {
    if (mode_ == ProgressMode::Line) {
      std::fprintf(stderr, "\r\033[K%s", line.c_str());
      dirty_ = true;
    } else if (mode_ == ProgressMode::Log && milestone) {
      std::fprintf(stderr, "%s\n", line.c_str());
    }
    std::fflush(stderr);
  }
  /// Erases the status line (before results go to stdout, which may be the same terminal).
  void clear() {
    if (mode_ == ProgressMode::Line && dirty_) std::fprintf(stderr, "\r\033[K");
    dirty_ = false;
    std::fflush(stderr);
  }

 private:
  ProgressMode mode_;
  bool dirty_ = false;
};

/// The logical AND of `ok` over all ranks (returned on every rank).
inline bool all_ranks(bool ok) {
  int v = ok ? 1 : 0;
  MPI_Allreduce(MPI_IN_PLACE, &v, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  return v != 0;
}

/// Thrown (on every rank alike) when a variant computed a wrong result.
struct WrongResult : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// ---- one workload -----------------------------------------------------------------------------

/// Checks, warms up and times every variant of one workload.
inline WorkloadResult run_workload(const Workload& w, const Context& ctx, const Options& opt,
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
  auto fill_dict = [&ctx](td::TensorDict& d) {
    std::size_t j = 0;
    for (auto& [key, t] : d.canonical_leaves()) fill_pattern(t, j++, ctx.rank);
  };
  auto check_dict = [&ctx](const td::TensorDict& d) -> std::string {
    if (!ctx.receives()) return {};
    std::size_t j = 0;
    for (const auto& [key, t] : d.canonical_leaves()) {
      std::string err = check_tensor(t, j++, ctx.op, ctx.ranks);
      if (!err.empty())
        return fmt::format("leaf '{}' ({}): {}", key.str(), td::name(t.dtype()), err);
    }
    return {};
  };
  auto neutral_dict = [neutral](td::TensorDict& d) {
    for (auto& [key, t] : d.canonical_leaves()) fill_constant(t, neutral);
  };

  std::vector<Variant> vs;
  auto dict_variant = [&](Variant v, std::optional<std::size_t> cap, bool consolidate) {
    td::TensorDict& d = dicts.emplace_back(base.clone());
    if (consolidate) d.consolidate();  // one storage per dtype: buckets are slices, no packing
    v.packer = true;
    v.run = [&ctx, &d, cap] { ctx.run_dict(d, cap); };
    v.fill_known = [&fill_dict, &d] { fill_dict(d); };
    v.check = [&check_dict, &d] { return check_dict(d); };
    v.fill_neutral = [&neutral_dict, &d] { neutral_dict(d); };
    v.corrupt = [&d] { fill_constant(d.canonical_leaves().back().second, 1000); };
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
      for (auto& t : f) fill_pattern(t, 0, ctx.rank);
    };
    v.check = [&f, &ctx]() -> std::string {
      if (!ctx.receives()) return {};
      for (const auto& t : f) {
        std::string err = check_tensor(t, 0, ctx.op, ctx.ranks);
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

// ---- what "auto" resolves to ------------------------------------------------------------------

/// td::kAutoBucketBytes as resolved on the world group, seen from outside.
struct AutoProbe {
  std::size_t largest_bucket = 0;  // largest packed bucket of the probe dict (max over ranks)
  double first_call = 0;           // seconds of the first auto call (includes any tuning)
};

/// No API names the resolved size, so pack 4096 leaves of 4 KiB (16 MiB) with bucket auto and read
/// the largest pack buffer: the cap rounded down to 4 KiB, or 16 MiB if the cap is larger. The
/// first auto call also pays the library's one-time tuning, which this keeps out of the timings.
inline AutoProbe probe_auto() {
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

inline std::string auto_label(const AutoProbe& p) {
  constexpr std::size_t kProbeTotal = std::size_t{16} << 20;
  if (p.largest_bucket >= kProbeTotal) return ">=" + size_label(kProbeTotal);
  if (p.largest_bucket == 0) return "<8KiB";
  return size_label(p.largest_bucket);
}

// ---- text output ------------------------------------------------------------------------------

inline std::string ratio_str(double r) {
  return r > 0 ? fmt::format("{:.2f}x", r) : std::string("-");
}

/// "3.74x faster than per-leaf", "1.02x slower than per-leaf" or "as fast as per-leaf (1.00x)"
/// for a call that took `seconds` against `baseline_seconds`: the factor is never below 1, the
/// word says which way it goes.
inline std::string speed_phrase(double seconds, double baseline_seconds, const std::string& than) {
  if (!(seconds > 0) || !(baseline_seconds > 0)) return "not comparable with " + than;
  const double faster = baseline_seconds / seconds;
  if (faster >= 0.995 && faster < 1.005) return fmt::format("as fast as {} (1.00x)", than);
  if (faster >= 1) return fmt::format("{:.2f}x faster than {}", faster, than);
  return fmt::format("{:.2f}x slower than {}", 1 / faster, than);
}

/// The table and the one-line summary of one workload.
inline void print_workload(const WorkloadResult& res, int ranks) {
  const Row* per_leaf = res.find(Role::PerLeaf);
  const Row* autob = res.find(Role::Auto);
  const double ideal = res.best_ideal();
  fmt::print("\n== {}: {} ({}), {} leaves, {} ({:.1f} MB), {} ranks\n", res.name, res.what,
             res.dtypes, res.leaves, human_bytes(static_cast<double>(res.bytes)),
             static_cast<double>(res.bytes) / 1e6, ranks);
  fmt::print("{:<36} {:>6} {:>11} {:>10} {:>8} {:>11} {:>9} {:>10}\n", "variant", "rounds",
             "median ms", "min ms", "GB/s", "speedup", "x ideal", "extra MiB");
  fmt::print("{}\n", std::string(36 + 7 + 12 + 11 + 9 + 12 + 10 + 11, '-'));
  for (const auto& r : res.rows) {
    const bool moves_data = r.role != Role::CheckPlan;
    const std::string gbps =
        moves_data && r.median > 0
            ? fmt::format("{:.3f}", static_cast<double>(res.bytes) / r.median / 1e9)
            : "-";
    const std::string speedup =
        moves_data && per_leaf && r.median > 0 ? ratio_str(per_leaf->median / r.median) : "-";
    const std::string vs_ideal = moves_data && ideal > 0 ? ratio_str(r.median / ideal) : "-";
    const std::string extra =
        r.packer ? fmt::format("{:.2f}", static_cast<double>(r.peak_extra) / 1048576.0) : "-";
    std::string note;
    if (r.role == Role::CheckPlan && autob && autob->median > 0)
      note = fmt::format("  = {:.1f}% of bucket auto", 100.0 * r.median / autob->median);
    if (r.plan_misses > 0) note += fmt::format("  ({} plan rebuilds while timed)", r.plan_misses);
    fmt::print("{:<36} {:>6} {:>11.3f} {:>10.3f} {:>8} {:>11} {:>9} {:>10}{}\n", r.label, r.rounds,
               r.median * 1e3, r.min * 1e3, gbps, speedup, vs_ideal, extra, note);
  }
  // Summary: best fixed bucket size, and auto against the ideal and per-leaf.
  const Row* best = nullptr;
  for (const auto& r : res.rows)
    if (r.role == Role::Bucket && (!best || r.median < best->median)) best = &r;
  std::string s = fmt::format("summary {}:", res.name);
  if (best)
    s += fmt::format(" best bucket {} ({:.3f} ms, {} ideal);", size_label(best->bucket),
                     best->median * 1e3, ratio_str(ideal > 0 ? best->median / ideal : 0));
  if (autob) {
    s += fmt::format(" auto {} ideal", ratio_str(ideal > 0 ? autob->median / ideal : 0));
    if (per_leaf) s += ", " + speed_phrase(autob->median, per_leaf->median, "per-leaf");
    s += ";";
  }
  if (const Row* c = res.find(Role::Consolidated))
    s += fmt::format(" consolidated {} ideal;", ratio_str(ideal > 0 ? c->median / ideal : 0));
  if (const Row* cp = res.find(Role::CheckPlan); cp && autob && autob->median > 0)
    s += fmt::format(" check+plan {:.3f} ms = {:.1f}% of auto", cp->median * 1e3,
                     100.0 * cp->median / autob->median);
  fmt::print("{}\n", s);
  std::fflush(stdout);
}

/// Facts about the machine and MPI for the header.
struct MachineInfo {
  std::string host, cpu, mpi_version, mpi_short;
  std::string memory;  // what decides page sizes and malloc behaviour (printed with the results)
  long online_cpus = 0;
  int bound_cpus = 0;
};

inline MachineInfo machine_info() {
  MachineInfo m;
  char host[256] = {};
  gethostname(host, sizeof host - 1);
  m.host = host;
  m.online_cpus = sysconf(_SC_NPROCESSORS_ONLN);
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof set, &set) == 0) m.bound_cpus = CPU_COUNT(&set);
  std::ifstream cpuinfo("/proc/cpuinfo");
  for (std::string line; std::getline(cpuinfo, line);) {
    if (line.rfind("model name", 0) == 0) {
      const auto colon = line.find(':');
      m.cpu = colon == std::string::npos ? line : line.substr(colon + 2);
      break;
    }
  }
  if (m.cpu.empty()) m.cpu = "unknown";
  char version[MPI_MAX_LIBRARY_VERSION_STRING] = {};
  int len = 0;
  MPI_Get_library_version(version, &len);
  m.mpi_version = std::string(version, static_cast<std::size_t>(std::max(len, 0)));
  m.mpi_version = m.mpi_version.substr(0, m.mpi_version.find('\n'));
  while (!m.mpi_version.empty() && (m.mpi_version.back() == '\0' || m.mpi_version.back() == ' '))
    m.mpi_version.pop_back();
  m.mpi_short = m.mpi_version.substr(0, m.mpi_version.find(','));
  std::ifstream thp("/sys/kernel/mm/transparent_hugepage/enabled");
  std::string thp_mode = "unknown";
  if (std::getline(thp, thp_mode)) {
    const auto lo = thp_mode.find('['), hi = thp_mode.find(']');
    if (lo != std::string::npos && hi != std::string::npos)
      thp_mode = thp_mode.substr(lo + 1, hi - lo - 1);
  }
  auto env_or = [](const char* name, const char* dflt) {
    const char* v = std::getenv(name);
    return std::string(v && *v ? v : dflt);
  };
  m.memory = fmt::format("THP {}; GLIBC_TUNABLES={}; TD_HUGEPAGES={}; TD_MALLOC_MMAP_THRESHOLD={}",
                         thp_mode, env_or("GLIBC_TUNABLES", "(unset)"), env_or("TD_HUGEPAGES", "1"),
                         env_or("TD_MALLOC_MMAP_THRESHOLD", "64 MiB"));
  return m;
}

inline void print_header(const MachineInfo& m, const Context& ctx, const Options& opt,
                         const std::string& dtype, const std::vector<BucketChoice>& buckets,
                         const AutoProbe& probe) {
  const std::string call = ctx.kind == Collective::AllReduce
                               ? "TensorDict::all_reduce"
                               : fmt::format("TensorDict::reduce(dst={})", kRoot);
  fmt::print("# bench: {} vs per-leaf and a pre-packed {}\n", call, ctx.mpi_call());
  fmt::print("# machine: {}, {} CPUs online (rank 0 may use {}), {}\n", m.host, m.online_cpus,
             m.bound_cpus, m.cpu);
  fmt::print("# MPI: {}\n", m.mpi_version);
  fmt::print("# memory: {}\n", m.memory);
  fmt::print("# tensordict-mpi {}, compiler {}\n", td::kVersion, __VERSION__);
  fmt::print("# ranks: {}; op: {}; dtype: {} (mixed: its own dtypes)\n", ctx.ranks,
             td::name(ctx.op), dtype);
  std::string bl;
  for (const auto& b : buckets)
    bl += (bl.empty() ? "" : ",") + (!b.bytes                           ? std::string("none")
                                     : *b.bytes == td::kAutoBucketBytes ? std::string("auto")
                                                                        : size_label(*b.bytes));
  fmt::print("# buckets: {}\n", bl);
  fmt::print("# bucket auto (td::kAutoBucketBytes) resolves to {} here (largest pack buffer of a\n",
             auto_label(probe));
  fmt::print(
      "#   probe with 4 KiB leaves); its first call took {:.1f} ms incl. any one-time tuning\n",
      probe.first_call * 1e3);
  if (opt.iters > 0) {
    fmt::print("# iterations: {} timed rounds per variant, {} warm-up\n", opt.iters, opt.warmup);
  } else {
    fmt::print("# iterations: per variant clamp(ceil({} s / fastest warm-up call), {}, {}) timed\n",
               opt.min_time, opt.min_rounds, opt.max_rounds);
    fmt::print("#   rounds (column 'rounds'), after {} warm-up rounds\n", std::max(opt.warmup, 1));
  }
  fmt::print(
      "{}",
      "# timings: median over rounds of the MAX over ranks of one call (MPI_Wtime, barrier\n"
      "#   before each call). Each round runs every variant once, in a freshly shuffled\n"
      "#   order (same on all ranks); each variant works on its own copy of the data.\n"
      "#   GB/s = payload bytes / median (algorithm bandwidth); 'speedup' = per-leaf median /\n"
      "#   median (below 1.00x: slower than per-leaf); 'x ideal' = median / the faster of the\n"
      "#   two 'ideal' rows (raw MPI on buffers packed in advance; lower is better, below\n"
      "#   1.00x: faster than both); 'extra MiB' = packer_stats().peak_extra_bytes (max over\n"
      "#   calls and ranks).\n"
      "#   Every variant was first checked against known values before being timed.\n");
  for (char** e = environ; e && *e; ++e)
    if (std::string_view(*e).substr(0, 3) == "TD_")
      fmt::print("# NOTE: environment {} (may change what is measured)\n", *e);
  std::fflush(stdout);
}

// ---- CSV and plot (rank 0, after MPI is finalized) -------------------------------------------

inline void write_csv(const std::string& path, const std::vector<WorkloadResult>& results,
                      int ranks) {
  const std::filesystem::path p(path);
  if (p.has_parent_path()) std::filesystem::create_directories(p.parent_path());
  std::ofstream out(p);
  if (!out) throw std::runtime_error("cannot write " + path);
  out << "workload,variant,bucket_bytes,ranks,iters,median_ms,min_ms,gbps,speedup_vs_per_leaf,"
         "ratio_to_ideal,"
         "peak_extra_bytes\n";
  for (const auto& res : results) {
    const Row* per_leaf = res.find(Role::PerLeaf);
    const double ideal = res.best_ideal();
    for (const auto& r : res.rows) {
      const bool moves = r.role != Role::CheckPlan;
      out << fmt::format(
          "{},{},{},{},{},{:.6f},{:.6f},{},{},{},{}\n", res.name, r.id, r.csv_bucket, ranks,
          r.rounds, r.median * 1e3, r.min * 1e3,
          moves && r.median > 0
              ? fmt::format("{:.4f}", static_cast<double>(res.bytes) / r.median / 1e9)
              : "",
          moves && per_leaf && r.median > 0 ? fmt::format("{:.4f}", per_leaf->median / r.median)
                                            : "",
          moves && ideal > 0 ? fmt::format("{:.4f}", r.median / ideal) : "",
          r.packer ? std::to_string(r.peak_extra) : "");
    }
  }
}

/// Ticks for a log axis over [lo, hi]: whole decades if that gives at least four, else the
/// 1-2-5 series, else a finer one, so a panel spanning less than a decade is not left with a
/// single labelled tick.
inline std::vector<double> log_ticks(double lo, double hi) {
  static const std::vector<std::vector<double>> kSeries = {
      {1}, {1, 2, 5}, {1, 1.5, 2, 3, 5, 7}, {1, 1.2, 1.5, 2, 2.5, 3, 4, 5, 6, 8}};
  std::vector<double> out;
  if (!(lo > 0) || !(hi > lo)) return out;
  const int first = static_cast<int>(std::floor(std::log10(lo)));
  const int last = static_cast<int>(std::ceil(std::log10(hi)));
  for (const auto& series : kSeries) {
    out.clear();
    for (int e = first; e <= last; ++e)
      for (double m : series) {
        const double v = m * std::pow(10.0, e);
        if (v >= lo && v <= hi) out.push_back(v);
      }
    if (out.size() >= 4) break;
  }
  return out;
}

/// `set <axis>tics (...)` with labels "<value><suffix>" ("%g" of the value).
inline std::string tics_command(const std::string& axis, const std::vector<double>& ticks,
                                const std::string& suffix) {
  std::string list;
  for (double v : ticks)
    list += fmt::format("{}'{:g}{}' {:.6g}", list.empty() ? "" : ", ", v, suffix, v);
  return fmt::format("set {}tics ({})\n", axis, list);
}

/// The y range of a panel whose values span [lo, hi]: the top part left free for the key.
inline std::pair<double, double> panel_yrange(double lo, double hi, std::size_t key_lines) {
  const double bottom = lo / 1.4;
  const double span = std::max(hi / bottom, 1.5);
  // On a log axis the key takes a fixed fraction of the height: raise the top by that fraction.
  const double key_fraction = std::min(0.6, 0.07 * static_cast<double>(key_lines) + 0.05);
  const double top = bottom * std::pow(span * 1.15, 1.0 / (1.0 - key_fraction));
  return {bottom, top};
}

inline void write_samples(const std::string& path, const std::vector<WorkloadResult>& results) {
  const std::filesystem::path p(path);
  if (p.has_parent_path()) std::filesystem::create_directories(p.parent_path());
  std::ofstream out(p);
  if (!out) throw std::runtime_error("cannot write " + path);
  out << "workload,variant,round,ms\n";
  for (const auto& res : results)
    for (const auto& r : res.rows)
      for (std::size_t k = 0; k < r.samples.size(); ++k)
        out << fmt::format("{},{},{},{:.6f}\n", res.name, r.id, k, r.samples[k] * 1e3);
}

/// `s` for the inside of a gnuplot double-quoted string, where backslash escapes apply.
inline std::string gp_escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (c == '\\' || c == '"') out += '\\';
    out += c;
  }
  return out;
}

inline std::string gp_quote(const std::string& s) {
  std::string out = "'";
  for (char c : s) out += c == '\'' ? std::string("''") : std::string(1, c);
  return out + "'";
}

/// What the figure says about the run, in words.
struct PlotText {
  std::string title;     // what was measured: true for every panel
  std::string subtitle;  // where: ranks, MPI, host, dtypes
  std::string mpi_call;  // MPI_Allreduce or MPI_Reduce: the raw-MPI reference
  std::string auto_size;
};

/// Writes <dir>/<stem>.dat and <stem>.gp and runs gnuplot if present; returns a note for stdout.
///
/// Every panel shows one workload's median times divided by its reference: the faster of the
/// two raw-MPI variants ("ideal" rows of the table), so one of them sits exactly at 1x and the
/// other where it really is. The right axis gives the same times in ms. The figure explains
/// itself in a footnote, so it can be read without the README.
inline std::string write_plot(const std::string& dir, const std::string& stem, const PlotText& text,
                              const std::vector<WorkloadResult>& results,
                              const std::vector<BucketChoice>& buckets) {
  namespace fs = std::filesystem;
  fs::create_directories(dir);
  const fs::path dat = fs::absolute(fs::path(dir) / (stem + ".dat"));
  const fs::path gp = fs::absolute(fs::path(dir) / (stem + ".gp"));
  const fs::path png = fs::absolute(fs::path(dir) / (stem + ".png"));

  std::set<std::size_t> xs;
  for (const auto& b : buckets)
    if (b.bytes && *b.bytes != td::kAutoBucketBytes) xs.insert(*b.bytes);
  if (xs.empty()) xs.insert(kIdealChunkBytes);
  const double xmin = static_cast<double>(*xs.begin()) / 2,
               xmax = static_cast<double>(*xs.rbegin()) * 2;

  std::ofstream d(dat);
  d << "# median time / reference (the faster raw-MPI variant) per bucket size; one block per "
       "workload (gnuplot index)\n";
  std::vector<bool> has_points;
  for (const auto& res : results) {
    const double ref = res.best_ideal();
    d << "# " << res.name << ": bucket_bytes ratio_to_reference median_ms\n";
    bool any = false;
    for (const auto& r : res.rows) {
      if (r.role != Role::Bucket || ref <= 0) continue;
      d << fmt::format("{} {:.6g} {:.6g}\n", r.bucket, r.median / ref, r.median * 1e3);
      any = true;
    }
    if (!any) d << fmt::format("{} nan nan\n", *xs.begin());
    has_points.push_back(any);
    d << "\n\n";
  }
  d.close();

  const std::size_t panels = results.size() + (results.size() > 1 ? 1 : 0);
  const std::size_t cols = std::min<std::size_t>(3, panels), rows = (panels + cols - 1) / cols;
  constexpr int kSidePx = 90, kGapPx = 170, kPanelWidthPx = 430;
  const int width =
      2 * kSidePx + kPanelWidthPx * static_cast<int>(cols) + kGapPx * (static_cast<int>(cols) - 1);

  // The footnote: what the axes, the reference and each line are, wrapped to the figure's width.
  const std::string chunks = size_label(kIdealChunkBytes);
  const std::vector<std::string> paragraphs = {
      "Lower is better. Each panel is one workload (its leaves and dtypes in the panel title). "
      "Left axis: median time of one call divided by the panel's reference (log scale); right "
      "axis: the same time in ms.",
      fmt::format("Reference (1x): the faster of two raw-MPI baselines on buffers packed in "
                  "advance, one per dtype: one {0} per dtype, or the same buffers in {1} calls "
                  "('{1} chunks'). They copy and check nothing; a call can still land a little "
                  "below 1x, within run-to-run noise or where its message sizes suit MPI better.",
                  text.mpi_call, chunks),
      fmt::format("x axis: bucket_bytes, the largest packed message. per-leaf: one collective per "
                  "leaf (no bucket_bytes). auto: bucket_bytes = td::kAutoBucketBytes, tuned on "
                  "this machine ({}). consolidated: auto on a consolidate()d dict (one buffer "
                  "per dtype, nothing to pack).",
                  text.auto_size)};
  const auto line_chars = static_cast<std::size_t>((width - 30) / 7);
  std::vector<std::string> footnote;
  for (const auto& para : paragraphs) {
    std::string line;
    std::size_t start = 0;
    while (start < para.size()) {
      std::size_t end = para.find(' ', start);
      if (end == std::string::npos) end = para.size();
      const std::string word = para.substr(start, end - start);
      if (!line.empty() && line.size() + 1 + word.size() > line_chars) {
        footnote.push_back(line);
        line.clear();
      }
      line += (line.empty() ? "" : " ") + word;
      start = end + 1;
    }
    if (!line.empty()) footnote.push_back(line);
  }
  constexpr int kLinePx = 16, kAxisPx = 62, kHeaderPx = 80, kPanelPx = 420;
  const int footer_px = kAxisPx + kLinePx * static_cast<int>(footnote.size()) + 12;
  const int height = kHeaderPx + kPanelPx * static_cast<int>(rows) + footer_px;
  const double bottom_margin = static_cast<double>(footer_px) / height;
  const double top_margin = 1.0 - static_cast<double>(kHeaderPx) / height;

  std::ofstream s(gp);
  s << "# generated by bench_common.hpp: gnuplot " << gp.string() << "\n";
  s << fmt::format(
      "if (strstrt(GPVAL_TERMINALS, 'pngcairo') > 0) {{\n"
      "  set terminal pngcairo size {0},{1} noenhanced font 'Sans,10'\n"
      "}} else {{\n"
      "  set terminal png size {0},{1} noenhanced\n"
      "}}\n",
      width, height);
  s << "set output " << gp_quote(png.string()) << "\n";
  s << "data = " << gp_quote(dat.string()) << "\n";
  for (std::size_t k = 0; k < footnote.size(); ++k) {
    const int y_px = 8 + kLinePx * static_cast<int>(footnote.size() - 1 - k);
    s << fmt::format("set label {} {} at screen 0.012, screen {:.4f} left font ',9.5'\n", k + 1,
                     gp_quote(footnote[k]), static_cast<double>(y_px) / height);
  }
  s << fmt::format(
      "set multiplot layout {},{} title \"{}\" font ',13' margins {:.4f}, {:.4f}, {:.4f}, {:.4f} "
      "spacing {:.4f}, {:.4f}\n",
      rows, cols, gp_escape(text.title) + "\\n" + gp_escape(text.subtitle),
      static_cast<double>(kSidePx) / width, 1.0 - static_cast<double>(kSidePx) / width,
      bottom_margin, top_margin, static_cast<double>(kGapPx) / width,
      static_cast<double>(kAxisPx + 40) / height);
  s << "set logscale x 2\nset logscale y 10\n";
  s << fmt::format("set xrange [{}:{}]\n", xmin, xmax);
  std::string tics;
  for (auto x : xs)
    tics += (tics.empty() ? "" : ", ") + gp_quote(size_label(x)) + " " + std::to_string(x);
  s << "set xtics (" << tics << ")\n";
  s << "set grid xtics ytics\nset key top right font ',9' opaque box samplen 3\n";
  s << "set xlabel 'bucket_bytes (largest packed message)'\n";
  s << "set ylabel 'time / reference (lower is better)'\n";
  const char* colors[] = {"#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd",
                          "#8c564b", "#e377c2", "#7f7f7f"};
  for (std::size_t i = 0; i < results.size(); ++i) {
    const auto& res = results[i];
    const double ref = res.best_ideal();
    s << fmt::format(
        "set title {}\n",
        gp_quote(fmt::format("{}: {} leaves, {} ({}); reference {:.3f} ms", res.name, res.leaves,
                             human_bytes(static_cast<double>(res.bytes)), res.dtypes, ref * 1e3)));
    std::vector<std::string> parts;
    if (has_points[i])
      parts.push_back(
          fmt::format("data index {} using 1:2 with linespoints lw 2 pt 7 ps 1.3 lc rgb '#1f77b4' "
                      "title 'bucket_bytes = x'",
                      i));
    double lo = 1, hi = 1;
    for (const auto& r : res.rows)
      if (r.role == Role::Bucket && ref > 0 && r.median > 0) {
        lo = std::min(lo, r.median / ref);
        hi = std::max(hi, r.median / ref);
      }
    auto hline = [&](Role role, const std::string& name, const char* color, int dash) {
      const Row* r = res.find(role);
      if (!r || ref <= 0 || r->median <= 0) return;
      const double ratio = r->median / ref;
      lo = std::min(lo, ratio);
      hi = std::max(hi, ratio);
      parts.push_back(fmt::format("{:.6g} with lines lw 2 dt {} lc rgb '{}' title {}", ratio, dash,
                                  color, gp_quote(fmt::format("{} ({:.2f}x)", name, ratio))));
    };
    hline(Role::PerLeaf, "per-leaf", "#d62728", 2);
    hline(Role::Auto, "auto (" + text.auto_size + ")", "#17becf", 4);
    hline(Role::Consolidated, "consolidated, auto", "#2ca02c", 3);
    hline(Role::Ideal, fmt::format("{} per dtype", text.mpi_call), "black", 1);
    hline(Role::IdealChunks, fmt::format("{} in {} chunks", text.mpi_call, chunks), "#7f7f7f", 5);
    const auto [bottom, top] = panel_yrange(lo, hi, parts.size());
    s << fmt::format("set yrange [{:.6g}:{:.6g}]\n", bottom, top);
    s << tics_command("y", log_ticks(bottom, top), "x");
    if (ref > 0) {
      // The right axis: the same range in ms.
      const double ms = ref * 1e3;
      s << fmt::format("set logscale y2 10\nset y2range [{:.6g}:{:.6g}]\n", bottom * ms, top * ms);
      s << tics_command("y2", log_ticks(bottom * ms, top * ms), "");
      s << "set y2label 'median time per call (ms)'\n";
    }
    s << "plot ";
    for (std::size_t k = 0; k < parts.size(); ++k) s << (k ? ", \\\n     " : "") << parts[k];
    s << "\n";
    if (i == 0)
      for (std::size_t k = 0; k < footnote.size(); ++k) s << "unset label " << k + 1 << "\n";
  }
  s << "unset y2tics\nunset y2label\nunset logscale y2\n";
  if (results.size() > 1) {
    double lo = 1, hi = 1;
    for (const auto& res : results)
      for (const auto& r : res.rows)
        if (r.role == Role::Bucket && res.best_ideal() > 0) {
          lo = std::min(lo, r.median / res.best_ideal());
          hi = std::max(hi, r.median / res.best_ideal());
        }
    s << "set title 'all workloads: bucketed time / each workload''s reference'\n";
    const auto [bottom, top] = panel_yrange(lo, hi, results.size() + 1);
    s << fmt::format("set yrange [{:.6g}:{:.6g}]\n", bottom, top);
    s << tics_command("y", log_ticks(bottom, top), "x");
    s << "plot ";
    bool first = true;
    for (std::size_t i = 0; i < results.size(); ++i) {
      if (!has_points[i]) continue;
      s << (first ? "" : ", \\\n     ")
        << fmt::format("data index {} using 1:2 with linespoints lw 2 pt 7 lc rgb '{}' title {}", i,
                       colors[i % std::size(colors)], gp_quote(results[i].name));
      first = false;
    }
    s << (first ? "" : ", \\\n     ") << "1 with lines lw 2 lc rgb 'black' title 'reference'\n";
  }
  s << "unset multiplot\n";
  s.close();

  if (std::system("command -v gnuplot >/dev/null 2>&1") != 0)
    return fmt::format("plot: gnuplot not found; skipped (script {}, data {})", gp.string(),
                       dat.string());
  const std::string cmd = "gnuplot \"" + gp.string() + "\"";
  if (std::system(cmd.c_str()) != 0) return fmt::format("plot: gnuplot failed on {}", gp.string());
  return fmt::format("plot: {} (script {})", png.string(), gp.string());
}

// ---- main -------------------------------------------------------------------------------------

/// The whole benchmark: parses the command line, runs every workload, prints and writes results.
inline int run_main(int argc, char** argv, Collective kind) {
  td::init_process_group(argc, argv);
  const int rank = td::get_rank();
  const int ranks = td::get_world_size();
  const char* stem = kind == Collective::AllReduce ? "allreduce" : "reduce";

  Options opt;
  CLI::App app{fmt::format(
      "Benchmarks TensorDict::{} (per-leaf, bucketed, consolidated) against a pre-packed "
      "{}; run under mpirun.",
      kind == Collective::AllReduce ? "all_reduce" : "reduce",
      kind == Collective::AllReduce ? "MPI_Allreduce" : "MPI_Reduce")};
  app.add_option("--workloads", opt.workloads, "tiny,small,transformer,large,mixed")
      ->delimiter(',')
      ->capture_default_str();
  app.add_option("--buckets", opt.buckets,
                 "bucket sizes (64KiB, 1MiB, 65536; K/M/G = KiB/MiB/GiB), 'none', 'auto'")
      ->delimiter(',')
      ->capture_default_str();
  app.add_option("--op", opt.op, "sum|avg|max|min|product")->capture_default_str();
  app.add_option("--dtype", opt.dtype,
                 "dtype of every workload but mixed (float32, float64, bfloat16, int64, ...)")
      ->capture_default_str();
  auto* iters =
      app.add_option("--iters", opt.iters, "timed rounds per variant (default: from --min-time)");
  auto* min_time =
      app.add_option("--min-time", opt.min_time, "seconds of timed calls each variant aims for")
          ->capture_default_str();
  iters->excludes(min_time);
  app.add_option("--min-rounds", opt.min_rounds, "fewest timed rounds per variant")
      ->capture_default_str();
  app.add_option("--max-rounds", opt.max_rounds, "most timed rounds per variant")
      ->capture_default_str();
  app.add_option("--warmup", opt.warmup, "untimed rounds before timing")->capture_default_str();
  app.add_option("--csv", opt.csv, "write one row per (workload, variant) to this file");
  app.add_option("--plot-dir", opt.plot_dir, "where <stem>.png, .gp and .dat go")
      ->capture_default_str();
  app.add_option("--samples-csv", opt.samples_csv,
                 "write every timed round (workload,variant,round,ms)");
  app.add_flag("--no-plot", opt.no_plot, "write no plot");
  app.add_option("--progress", opt.progress,
                 "progress on stderr: line (one line rewritten in place), log (a few lines per "
                 "workload), none, auto (line if stderr is a terminal, else log)")
      ->capture_default_str();
  bool quiet = false;
  app.add_flag("--quiet", quiet, "same as --progress none");
  app.add_option("--inject-fault", opt.inject_fault,
                 "corrupt this variant's checked result (tests the guard)")
      ->group("");

  auto finish = [&](int code) {
    td::destroy_process_group();
    return code;
  };
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    int code = e.get_exit_code();
    if (rank == 0) {
      code = app.exit(e);
    }
    return finish(code);
  }
  auto fail = [&](const std::string& msg) {
    if (rank == 0) std::fprintf(stderr, "bench_%s: %s\n", stem, msg.c_str());
    return finish(2);
  };

  const auto op = parse_op(opt.op);
  if (!op) return fail("unknown --op '" + opt.op + "' (sum, avg, max, min, product)");
  const auto dtype = parse_dtype(opt.dtype);
  if (!dtype || *dtype == td::DType::Bool)
    return fail("unknown or unsupported --dtype '" + opt.dtype + "'");
  if (!td::supports(*op, *dtype))
    return fail(fmt::format("op {} is not defined for dtype {}", td::name(*op), td::name(*dtype)));
  if (opt.min_rounds < 1 || opt.max_rounds < opt.min_rounds)
    return fail("need 1 <= --min-rounds <= --max-rounds");
  std::vector<BucketChoice> buckets;
  for (const auto& b : opt.buckets) {
    BucketChoice c;
    if (b == "auto") {
      c.bytes = td::kAutoBucketBytes;
    } else if (b != "none") {
      c.bytes = parse_size(b);
      if (!c.bytes) return fail("bad bucket size '" + b + "' (64KiB, 1MiB, 65536, none, auto)");
    }
    if (std::none_of(buckets.begin(), buckets.end(),
                     [&](const BucketChoice& x) { return x.bytes == c.bytes; }))
      buckets.push_back(c);
  }
  if (quiet) opt.progress = "none";
  const auto progress_mode = parse_progress(opt.progress);
  if (!progress_mode)
    return fail("unknown --progress '" + opt.progress + "' (line, log, none, auto)");
  for (const auto& w : opt.workloads)
    if (std::find(std::begin(kWorkloadNames), std::end(kWorkloadNames), w) ==
        std::end(kWorkloadNames))
      return fail("unknown workload '" + w + "' (tiny, small, transformer, large, mixed)");

  std::vector<WorkloadResult> results;
  MachineInfo machine;
  AutoProbe probe;
  try {
    RawMpi mpi;
    Context ctx;
    ctx.kind = kind;
    ctx.op = *op;
    ctx.rank = rank;
    ctx.ranks = ranks;
    ctx.mpi = &mpi;
    machine = machine_info();
    probe = probe_auto();
    ctx.auto_size = auto_label(probe);
    if (rank == 0) print_header(machine, ctx, opt, opt.dtype, buckets, probe);
    Progress progress(rank == 0 ? *progress_mode : ProgressMode::Off);
    for (const auto& name : opt.workloads) {
      Workload w = make_workload(name, *dtype);
      std::string unsupported;
      for (const auto& [d, b] : bytes_per_dtype(w))
        if (!td::supports(*op, d)) unsupported = std::string(td::name(d));
      if (!unsupported.empty()) {
        if (rank == 0)
          fmt::print("\n== {}: skipped: op {} is not defined for its {} leaves\n", name,
                     td::name(*op), unsupported);
        continue;
      }
      results.push_back(run_workload(w, ctx, opt, buckets, progress));
      if (rank == 0) print_workload(results.back(), ranks);
    }
  } catch (const WrongResult& e) {
    if (rank == 0) std::fprintf(stderr, "bench_%s: %s\n", stem, e.what());
    return finish(1);
  } catch (const std::exception& e) {
    // An error on one rank must not leave the others waiting in a collective.
    std::fprintf(stderr, "bench_%s: rank %d: error: %s\n", stem, rank, e.what());
    std::fflush(stderr);
    MPI_Abort(MPI_COMM_WORLD, 3);
  }
  // Files and gnuplot after MPI is finalized: fork() under an initialized MPI is not safe
  // everywhere.
  td::destroy_process_group();
  if (rank != 0) return 0;
  try {
    if (!opt.csv.empty()) {
      write_csv(opt.csv, results, ranks);
      fmt::print("\ncsv: {}\n", opt.csv);
    }
    if (!opt.samples_csv.empty()) {
      write_samples(opt.samples_csv, results);
      fmt::print("samples: {}\n", opt.samples_csv);
    }
    if (!opt.no_plot && !results.empty()) {
      const std::string dtypes = std::all_of(opt.workloads.begin(), opt.workloads.end(),
                                             [](const std::string& w) { return w != "mixed"; })
                                     ? opt.dtype
                                     : opt.dtype + ", mixed: 4 dtypes";
      PlotText text;
      text.mpi_call = kind == Collective::AllReduce ? "MPI_Allreduce" : "MPI_Reduce";
      text.auto_size = auto_label(probe) + " here";
      text.title = fmt::format(
          "{}({}): median time per call relative to raw {} on buffers packed in advance "
          "(lower is better)",
          kind == Collective::AllReduce ? "TensorDict.all_reduce" : "TensorDict.reduce",
          td::name(*op), text.mpi_call);
      text.subtitle = fmt::format("{} ranks, {}, host {}; dtype {}", ranks, machine.mpi_short,
                                  machine.host, dtypes);
      fmt::print("{}\n", write_plot(opt.plot_dir, stem, text, results, buckets));
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_%s: %s\n", stem, e.what());
    return 1;
  }
  return 0;
}

/// run_main for main(): an exception that escapes (MPI not initialised, out of memory) ends the
/// job with a message instead of std::terminate.
inline int guarded_main(int argc, char** argv, Collective kind) noexcept {
  try {
    return run_main(argc, argv, kind);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench: error: %s\n", e.what());
  } catch (...) {
    std::fprintf(stderr, "bench: unknown error\n");
  }
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (initialized && !finalized) MPI_Abort(MPI_COMM_WORLD, 3);
  return 3;
}

}  // namespace td_bench
