// td::Reducer: PyTorch DDP's gradient Reducer over MPI. Gradients live in one storage per bucket;
// each bucket is all-reduced in place, asynchronously, as soon as all its leaves are marked ready,
// so the reduction of the last layers overlaps the backward pass of the first ones.
#pragma once

#include <chrono>
#include <cstddef>
#include <functional>
#include <memory>
#include <optional>
#include <string_view>
#include <utility>
#include <vector>

#include "tensordict/collectives.hpp"
#include "tensordict/export.hpp"
#include "tensordict/key.hpp"
#include "tensordict/process_group.hpp"
#include "tensordict/tensor_dict.hpp"
#include "tensordict/tensorclass_type.hpp"

namespace td {

// td::Compression is declared in collectives.hpp (also CollectiveOptions::compression).

/// Options of a td::Reducer.
struct ReducerOptions {
  /// SUM or AVG for compressed buckets; any op the gradients' dtypes support otherwise.
  ReduceOp op = ReduceOp::AVG;
  /// Cap of one bucket in bytes (a larger leaf is a bucket of its own); kAutoBucketBytes: the
  /// size tuned for this machine and group, as TensorDict collectives use.
  std::size_t bucket_bytes = kAutoBucketBytes;
  /// Default: world().
  std::optional<ProcessGroup> group = std::nullopt;
  /// Of every bucket's reduction, from its launch. Default: InitOptions::timeout.
  std::optional<std::chrono::milliseconds> timeout = std::nullopt;
  /// Expected order of readiness: leaf or sub-dict keys (a sub-dict: its leaves in canonical
  /// order); leaves not listed follow in reverse canonical order. Default: reverse canonical
  /// order (the last layers' gradients are ready first). Must be the same on every rank.
  std::vector<Key> ready_order = {};
  /// float32/float64 buckets travel as 16-bit floats (see docs/training.md for the error).
  Compression compression = Compression::None;
  /// Ranks may run different numbers of steps (DDP's Join): a rank out of data calls join(), and
  /// the others' steps complete with it contributing zeros. Costs one 4-byte allreduce per step
  /// (posted before the buckets, never waited for alone). SUM and AVG only.
  bool uneven_inputs = false;
};

/// Reduces a dict of gradients across a group bucket by bucket while the backward pass runs.
///
/// Construction is collective (every rank of the group, the same layout and options): it moves
/// every leaf into one storage per bucket and sets the leaf to a view of it, so that buckets are
/// reduced in place. Tensors taken from `grads` before keep the old storage and are no longer
/// reduced. A step starts with the first mark_ready() (or finish()) after construction or after
/// the previous finish(), and ends when finish() returns. Not thread-safe: call mark_ready() and
/// finish() from one thread. See docs/training.md.
class TD_API Reducer {
 public:
  /// Builds the buckets of `grads` (which must outlive the Reducer); agrees on layout and
  /// options across the group (a mismatch or bad argument is the same exception on every rank).
  explicit Reducer(TensorDict& grads, ReducerOptions opts = {});
  /// The same for a tensorclass of gradients: its fields become views of the buckets.
  /// (`Access` only defers naming tensorclass.hpp's access until a tensorclass is used.)
  template <TensorClassType T, class Access = detail::TensorClassAccess>
  explicit Reducer(T& grads, ReducerOptions opts = {})
      : Reducer(
            grads.to_tensordict(), [&grads] { return grads.to_tensordict(); }, std::move(opts)) {
    Access::rebind(grads, owned_dict());
  }
  /// Waits for buckets still in flight (it does not launch the others).
  ~Reducer();
  /// Takes over other's buckets; `other` can then only be destroyed.
  Reducer(Reducer&&) noexcept;
  /// Waits for this Reducer's buckets in flight, then takes over other's.
  Reducer& operator=(Reducer&&) noexcept;
  Reducer(const Reducer&) = delete;             ///< One Reducer per gradient dict.
  Reducer& operator=(const Reducer&) = delete;  ///< One Reducer per gradient dict.

  /// Marks a leaf, or every leaf of a sub-dict, as holding this step's gradient; launches the
  /// reduction of every bucket whose leaves are all ready and whose predecessors are launched.
  /// Throws td::KeyError for a key that is not a gradient, td::Error for a leaf already marked
  /// in this step (nothing is marked then).
  void mark_ready(const Key& key);
  /// Launches the buckets not launched yet (leaves never marked are reduced with the values they
  /// hold), waits for every bucket and ends the step: every leaf holds its reduced value.
  void finish();

  /// With ReducerOptions::uneven_inputs: this rank has no more data. Until every rank of the
  /// group has joined, it shadows the steps the others still run (its buckets zeroed, so it
  /// contributes zeros; AVG still divides by the group size); returns when every rank has
  /// joined, the Reducer ready for new steps. Throws std::invalid_argument without
  /// uneven_inputs, td::Error inside a step (that step is finished first).
  void join();

  /// Number of buckets, in launch order.
  std::size_t num_buckets() const;
  /// Keys of bucket b's leaves, in their order in its storage.
  std::vector<Key> bucket_keys(std::size_t b) const;
  /// Bytes of bucket b's storage.
  std::size_t bucket_nbytes(std::size_t b) const;
  /// Whether a step is in progress (mark_ready() was called since the last finish()).
  bool in_step() const;

 private:
  Reducer(TensorDict owned, std::function<TensorDict()> current, ReducerOptions opts);
  TensorDict& owned_dict();

  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace td
