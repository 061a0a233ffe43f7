// td::Reducer: buckets of gradients, each one storage that its leaves are views of, all-reduced in
// place (or through a 16-bit copy when compressed) as soon as its leaves are ready, in bucket
// order on every rank. Construction goes through the collectives' agreement; the hot path
// (mark_ready) is a hash lookup, a few counters and, for a bucket that becomes ready, a Work
// handed to the progress thread, which compresses and posts it on the Reducer's own communicator.
#include "tensordict/reducer.hpp"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <exception>
#include <optional>
#include <span>
#include <string>
#include <type_traits>
#include <unordered_map>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "comm/engine_internal.hpp"
#include "core/dict_internal.hpp"
#include "runtime/deadline.hpp"
#include "runtime/log.hpp"
#include "runtime/nbc_tuning.hpp"
#include "runtime/progress.hpp"

namespace td {

namespace {

constexpr std::size_t kNoBucket = static_cast<std::size_t>(-1);

// A key's parts joined with a separator no name contains in practice: the lookup key of
// mark_ready (Key::str() quotes names, which costs more and is not needed here).
std::string lookup_string(const Key& key) {
  std::string s;
  for (const auto& p : key.parts()) {
    s += p;
    s += '\x1f';
  }
  return s;
}

// Levenshtein distance (for the keys a mistyped mark_ready key most likely meant).
std::size_t edit_distance(std::string_view a, std::string_view b) {
  std::vector<std::size_t> row(b.size() + 1);
  for (std::size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (std::size_t i = 1; i <= a.size(); ++i) {
    std::size_t diag = row[0];
    row[0] = i;
    for (std::size_t j = 1; j <= b.size(); ++j) {
      const std::size_t up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diag + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diag = up;
    }
  }
  return row[b.size()];
}

// " (did you mean 'x', 'y'?)": the leaf and sub-dict keys nearest to `key`, at most 3, or "".
std::string nearest_keys(const Key& key, const std::vector<Key>& leaf_keys) {
  std::vector<std::string> names;  // every leaf and sub-dict key, printed
  for (const Key& k : leaf_keys) {
    std::vector<std::string> parts;
    for (const auto& p : k.parts()) {
      parts.push_back(p);
      names.push_back(Key(parts).str());
    }
  }
  std::sort(names.begin(), names.end());
  names.erase(std::unique(names.begin(), names.end()), names.end());
  const std::string want = key.str();
  const std::size_t limit = std::max<std::size_t>(2, want.size() / 3);
  std::vector<std::pair<std::size_t, std::string>> near;
  for (auto& n : names) {
    const std::size_t d = edit_distance(want, n);
    if (d <= limit) near.emplace_back(d, std::move(n));
  }
  if (near.empty()) return {};
  std::stable_sort(near.begin(), near.end(),
                   [](const auto& x, const auto& y) { return x.first < y.first; });
  std::vector<std::string> quoted;
  for (std::size_t i = 0; i < std::min<std::size_t>(3, near.size()); ++i)
    quoted.push_back("'" + near[i].second + "'");
  return fmt::format(" (did you mean {}?)", fmt::join(quoted, ", "));
}

}  // namespace

struct Reducer::Impl {
  struct Leaf {
    Leaf(Key k, std::uint64_t hash) : key(std::move(k)), key_hash(hash) {}
    Key key;
    std::size_t bucket = kNoBucket;  // kNoBucket: no elements, nothing to reduce
    bool ready = false;
    // What the leaf must still be: a view of its bucket (checked when the dict changed).
    std::byte* data = nullptr;
    DType dtype = DType::Float32;
    Shape shape, strides;
    std::uint64_t key_hash = 0;
    std::uint64_t layout_id = 0;
  };
  struct Bucket {
    DType dtype = DType::Float32;
    std::size_t nbytes = 0;
    Tensor storage;                   // flat: the leaves are views of it
    Tensor wire;                      // its 16-bit copy when compressed (undefined otherwise)
    std::vector<std::size_t> leaves;  // in their order in `storage`
    std::size_t pending = 0;          // leaves not marked ready in this step
    std::shared_ptr<detail::WorkState> work;  // in flight in this step
    std::string describe;
  };

  TensorDict owned;                     // the tensorclass case: the dict of its fields
  TensorDict* dict = nullptr;           // the user's dict, or `owned`
  std::function<TensorDict()> current;  // tensorclass: its fields as a dict now (for checks)
  ReduceOp op = ReduceOp::AVG;
  Compression compression = Compression::None;
  std::chrono::milliseconds timeout{};
  std::shared_ptr<detail::GroupState> group;
  // The buckets' own communicator (a duplicate of the group's): with the progress thread, that
  // thread posts the buckets, so their order on it must not depend on when the caller's thread
  // runs its other collectives on the group.
  std::shared_ptr<detail::GroupState> lane;
  std::size_t max_message_bytes = 0;

  std::vector<Leaf> leaves;  // canonical order
  std::vector<Bucket> buckets;
  std::unordered_map<std::string, std::vector<std::size_t>> members;  // key -> leaves
  std::size_t next = 0;   // first bucket not launched in this step
  std::size_t poked = 0;  // first launched bucket not seen complete by poke_in_flight
  std::chrono::steady_clock::time_point last_poke{};
  bool in_step = false;
  // Whether this step's buckets go to the progress thread, decided once per step: buckets must
  // be posted in bucket order on every rank, and a bucket queued on the thread is posted only
  // when the thread gets to it, so a step that mixed the two (set_async_progress toggled between
  // two mark_ready calls) could post bucket 1 before bucket 0 and sum buckets crosswise.
  bool step_on_thread = false;
  std::string layout_error;  // a layout change found in this step: finish() throws it
  std::string failure;       // a failed finish(): every later call throws it
  // The step in the flight recorder: a call on `lane` from the step's first mark_ready (or
  // finish) to the end of finish().
  detail::CallRef step_ref;
  std::string first_key;  // of the summary below
  detail::CallSummary step_summary;

  void record_step() {
    if (step_summary.bytes == 0)
      for (const Bucket& b : buckets) {
        step_summary.bytes += b.nbytes;
        step_summary.dtype_mask |= 1u << static_cast<unsigned>(b.dtype);
      }
    step_ref = detail::begin_step(*lane, step_summary);
  }
  void end_record(bool ok) {
    detail::end_step(step_ref, ok);
    step_ref = {};
  }
  // What the dict's leaves were when last found to be the bucket views: the order's generation
  // and the leaves' versions (the bucket storages' counters, one load each per check).
  std::uint64_t generation = 0;
  detail::LeafVersions versions;
  std::vector<std::shared_ptr<detail::WorkState>> launched;  // by this call (capacity reserved)
  // uneven_inputs (DDP's Join): every step starts with `flag`, a one-int32 SUM bucket holding
  // this rank's vote (1: it runs the step, 0: it has joined), posted on the lane before the
  // step's buckets, so the k-th flag of every rank matches. A joined rank reads the sum: the
  // number of ranks still running steps.
  bool uneven = false;
  Bucket flag;
  // The storage each leaf had before construction, watched until the first finish(): still
  // alive then means a tensor taken from `grads` before construction (or the buffer the leaves
  // were views of) is still in use, and it is never reduced. Said once, naming the key.
  std::vector<std::weak_ptr<const detail::Storage>> old_storage;

  ~Impl() {
    for (Bucket* b : in_flight()) {
      try {
        b->work->wait();
      } catch (...) {  // NOLINT(bugprone-empty-catch): a destructor reports nothing
      }
    }
  }

  // The buckets (the flag first) launched in this step.
  std::vector<Bucket*> in_flight() {
    std::vector<Bucket*> out;
    if (flag.work) out.push_back(&flag);
    for (auto& b : buckets)
      if (b.work) out.push_back(&b);
    return out;
  }

  void check_usable(std::string_view what) const {
    if (!failure.empty())
      throw Error(fmt::format("Reducer.{}: a previous finish() failed ({}); build a new Reducer",
                              what, failure));
  }

  // Why `t`, found at leaf i's key, is no longer the view of its bucket (empty if it is).
  std::string leaf_change(std::size_t i, const Tensor& t) const {
    const Leaf& l = leaves[i];
    if (!t.defined()) return fmt::format("key '{}' now holds an undefined tensor", l.key.str());
    if (t.is_sparse()) return fmt::format("key '{}' now holds a sparse tensor", l.key.str());
    if (t.dtype() != l.dtype || t.shape() != l.shape)
      return fmt::format("key '{}' was resized or changed dtype ({}{} -> {}{})", l.key.str(),
                         name(l.dtype), fmt::join(l.shape, ","), name(t.dtype()),
                         fmt::join(t.shape(), ","));
    if (l.data != nullptr &&
        (t.strides() != l.strides || detail::TensorAccess::data(t, itemsize(t.dtype())) != l.data))
      return fmt::format(
          "key '{}' was replaced by another tensor (it must stay the view of its bucket: write "
          "gradients into it, e.g. with copy_() or its Eigen map, instead of setting a new tensor)",
          l.key.str());
    return {};
  }

  // Compares the dict's leaves with the buckets: O(sub-dicts) when nothing changed.
  std::string find_layout_change() {
    if (current) {  // a tensorclass: its fields, as a dict sharing their storage
      TensorDict now;
      try {
        now = current();
      } catch (const std::exception& e) {
        return e.what();
      }
      const auto& refs = detail::DictAccess::canonical(now);
      return compare_leaves(refs);
    }
    std::span<const detail::LeafRef> refs;
    try {
      refs = detail::DictAccess::canonical(*dict);
    } catch (const std::exception& e) {  // moved from
      return e.what();
    }
    const std::uint64_t gen = detail::DictAccess::canonical_generation(*dict);
    if (gen == generation && versions.same_layouts(refs)) return {};
    std::string err = compare_leaves(refs);
    if (err.empty()) {
      generation = gen;
      versions.record(refs);
    }
    return err;
  }

  std::string compare_leaves(std::span<const detail::LeafRef> refs) {
    for (std::size_t i = 0; i < std::min(refs.size(), leaves.size()); ++i) {
      if (refs[i].key_hash != leaves[i].key_hash || *refs[i].key != leaves[i].key) {
        const Key& first = std::min(*refs[i].key, leaves[i].key);
        return fmt::format("key '{}' was {} after the Reducer was built", first.str(),
                           first == leaves[i].key ? "removed" : "added");
      }
      const Tensor& t = *refs[i].tensor;
      if (detail::TensorAccess::layout_id(t) == leaves[i].layout_id) continue;
      std::string err = leaf_change(i, t);
      if (!err.empty()) return err;
    }
    if (refs.size() > leaves.size())
      return fmt::format("key '{}' was added after the Reducer was built",
                         refs[leaves.size()].key->str());
    if (refs.size() < leaves.size())
      return fmt::format("key '{}' was removed after the Reducer was built",
                         leaves[refs.size()].key.str());
    return {};
  }

  void begin_step() {
    in_step = true;
    record_step();
    step_on_thread = async_progress_enabled();
    layout_error = find_layout_change();
    if (uneven) {
      const detail::StepScope inside(step_ref);
      launch_flag(1);
    }
  }

  // Posts this rank's vote for the next step (see `flag`).
  void launch_flag(std::int32_t runs_step) {
    flag.storage.data<std::int32_t>()[0] = runs_step;
    launched.clear();
    launch(flag, ReduceOp::SUM);
    detail::progress_add(
        launched, step_on_thread ? detail::ProgressMode::Thread : detail::ProgressMode::Manual);
  }

  // Starts bucket b's reduction in place (the bucket's storage, or its 16-bit copy when
  // compressed); its finish step (on whichever thread completes it) divides or decompresses
  // into the bucket, as for every all_reduce bucket (detail::WireBucket). With the progress
  // thread, that thread compresses and posts it (the Work's first phase, run in the order the
  // buckets were handed over): mark_ready then posts nothing and converts nothing (its only MPI
  // calls are async_progress_enabled()'s thread-level queries), and never waits on Open MPI's
  // locks while the thread is inside MPI. Without it, here.
  void launch(Bucket& bk, ReduceOp bucket_op) {
    auto st = std::make_shared<detail::WorkState>();
    st->deadline = detail::deadline_after(timeout);
    st->describe = [d = bk.describe] { return d; };
    st->keep_alive.reserve(2);  // no reallocation: moving a tensor counts in its storage's version
    st->keep_alive.push_back(bk.storage);
    const detail::CollectiveCall call{detail::CollectiveKind::AllReduce, bucket_op, 0, "Reducer",
                                      true};
    std::optional<DType> compress_to;
    if (bk.wire.defined()) compress_to = bk.wire.dtype();
    detail::WireBucket ib(bk.dtype, bk.nbytes,
                          detail::TensorAccess::data(bk.storage, itemsize(bk.dtype)),
                          /*is_packed=*/false, call, {true, true}, compress_to);
    if (ib.compressed) {
      st->keep_alive.push_back(bk.wire);
      ib.w = detail::TensorAccess::data(bk.wire, itemsize(ib.wire));
    }
    const int size = lane->size;
    st->finish = [ib, size] { ib.finish(size, [](const std::byte*) {}); };
    auto post = [ib, call, size, l = lane, max = max_message_bytes](detail::WorkState& s) {
      if (ib.compressed) ib.compress_into_wire(call, size);
      ib.post(call, l, max, s);
    };
    if (step_on_thread) {
      st->then = std::move(post);
    } else {
      post(*st);
    }
    launched.push_back(st);
    bk.work = std::move(st);
  }

  // Launches the buckets now complete, in order, and hands them to the progress thread together:
  // while it polls, each MPI call of this thread waits on Open MPI's locks.
  void launch_ready(bool all = false) {
    launched.clear();
    const auto mode = step_on_thread ? detail::ProgressMode::Thread : detail::ProgressMode::Manual;
    try {
      while (next < buckets.size() && (all || buckets[next].pending == 0))
        launch(buckets[next++], op);
    } catch (...) {
      if (!launched.empty()) detail::progress_add(launched, mode);
      throw;
    }
    if (!launched.empty()) detail::progress_add(launched, mode);
  }

  // Without the progress thread nothing advances the launched buckets between the caller's
  // library calls: libnbc's nonblocking collectives take a step only inside an MPI call, and a
  // node-aware bucket posts its next stage only once its previous one is seen complete. So the
  // backward pass's mark_ready calls give them a turn, at most once per 100 us: a test of the
  // launched buckets in order, up to the first one still in flight (one MPI_Testall runs Open
  // MPI's progress for all of them). Its failures stay in the bucket's Work, for finish().
  void poke_in_flight() {
    if (step_on_thread || poked >= next) return;
    const auto now = std::chrono::steady_clock::now();
    if (now - last_poke < std::chrono::microseconds(100)) return;
    last_poke = now;
    if (flag.work && !flag.work->test()) return;
    while (poked < next) {
      const auto& w = buckets[poked].work;
      if (w && !w->test()) return;
      ++poked;
    }
  }

  void warn_stale_handles() {
    std::vector<std::string> keys;
    for (std::size_t i = 0; i < old_storage.size(); ++i)
      if (!old_storage[i].expired()) keys.push_back("'" + leaves[i].key.str() + "'");
    old_storage.clear();
    if (keys.empty()) return;
    if (keys.size() > 3) {
      const std::size_t more = keys.size() - 3;
      keys.resize(3);
      keys.push_back(fmt::format("{} more", more));
    }
    detail::log_line(
        detail::LogLevel::Warn,
        fmt::format(
            "Reducer: the storage that key {} held before the Reducer was built is still in use "
            "outside the dict at the first finish() (a td::Tensor taken from the gradients "
            "before construction, or the buffer they were views of): the Reducer moved the "
            "gradients into its buckets, so that tensor is never reduced. Take handles from the "
            "dict after constructing the Reducer (said once per Reducer, whatever "
            "TD_LOG_LEVEL)",
            fmt::join(keys, ", ")));
  }

  // The leaves in canonical order, and for every key prefix (a leaf or a sub-dict) its leaves.
  void index_leaves(std::span<const detail::LeafRef> refs) {
    leaves.reserve(refs.size());
    for (std::size_t i = 0; i < refs.size(); ++i) {
      leaves.emplace_back(*refs[i].key, refs[i].key_hash);
      std::string prefix;
      for (const auto& p : refs[i].key->parts()) {
        prefix += p;
        prefix += '\x1f';
        members[prefix].push_back(i);
      }
    }
  }

  // What the flight recorder says of every step.
  void summarize_steps(std::span<const detail::LeafRef> refs, ReduceOp reduce_op) {
    first_key = refs.empty() ? std::string() : refs[0].key->str();
    step_summary.first_key = first_key;
    step_summary.leaves = refs.size();
    step_summary.reduce_op = static_cast<int>(reduce_op);
    step_summary.async = true;
  }

  // The buckets of `plan` and which leaves each holds.
  void assign_buckets(const BucketPlan& plan) {
    buckets.resize(plan.buckets.size());
    for (std::size_t b = 0; b < plan.buckets.size(); ++b) {
      const BucketPlan::Bucket& pb = plan.buckets[b];
      Bucket& bk = buckets[b];
      bk.dtype = pb.dtype;
      bk.nbytes = pb.nbytes;
      for (const BucketPlan::Slot& sl : pb.slots) {
        bk.leaves.push_back(sl.leaf);
        leaves[sl.leaf].bucket = b;
      }
    }
  }

  // Moves the gradients into the buckets' storage (with a 16-bit wire copy per compressed
  // bucket); the dict's leaves become views. Setting a leaf may rebuild the dict's canonical
  // order, so the old tensors are taken out first.
  void move_into_buckets(TensorDict& grads, std::span<const detail::LeafRef> refs,
                         const BucketPlan& plan) {
    std::vector<Tensor> old_leaves;
    old_leaves.reserve(refs.size());
    for (const auto& ref : refs) old_leaves.push_back(*ref.tensor);
    old_storage.resize(refs.size());
    for (std::size_t i = 0; i < refs.size(); ++i)
      if (leaves[i].bucket != kNoBucket)
        old_storage[i] = detail::TensorAccess::weak_storage(old_leaves[i]);
    for (std::size_t b = 0; b < buckets.size(); ++b) {
      Bucket& bk = buckets[b];
      const std::size_t isz = itemsize(bk.dtype);
      const auto numel = static_cast<std::int64_t>(bk.nbytes / isz);
      bk.storage = Tensor::empty({numel}, bk.dtype);
      for (const BucketPlan::Slot& sl : plan.buckets[b].slots) {
        const Tensor& old = old_leaves[sl.leaf];
        Tensor view = detail::TensorAccess::view_of(
            bk.storage, static_cast<std::int64_t>(sl.offset / isz), old.shape());
        view.copy_(old);
        grads.set(leaves[sl.leaf].key, view);
      }
      if (compression != Compression::None && detail::compressible(bk.dtype))
        bk.wire = Tensor::empty({numel}, detail::wire_dtype(compression));
      bk.pending = bk.leaves.size();
      bk.describe = bucket_description(b);
    }
  }

  // Bucket b in a timeout's message.
  std::string bucket_description(std::size_t b) const {
    const Bucket& bk = buckets[b];
    std::string text = fmt::format(
        "Reducer bucket {} of {} ({}, {} B{}, {} leaves, first key '{}') in "
        "a group of {} ranks",
        b, buckets.size(), name(bk.dtype), bk.nbytes,
        bk.wire.defined() ? fmt::format(" sent as {}", name(bk.wire.dtype())) : std::string(),
        bk.leaves.size(), leaves[bk.leaves[0]].key.str(), group->size);
    // What a timeout of a bucket most often means: the ranks ran different numbers of steps.
    if (!uneven)
      text +=
          " (if the ranks ran different numbers of steps, e.g. an extra finish() on one rank "
          "with ragged data: ReducerOptions::uneven_inputs and Reducer::join() handle that)";
    return text;
  }

  // uneven_inputs: the step flag (see `flag`).
  void make_flag() {
    // One vote, padded with zeros (SUM's identity) so that libnbc keeps its tree on 4, 8...
    // ranks (runtime/nbc_tuning.hpp).
    const int words = detail::padded_count(1, group->size);
    flag.dtype = DType::Int32;
    flag.nbytes = static_cast<std::size_t>(words) * sizeof(std::int32_t);
    flag.storage = Tensor::zeros({words}, DType::Int32);
    flag.describe = fmt::format(
        "Reducer step flag (uneven_inputs: the vote of every rank for the next step) in a "
        "group of {} ranks (a rank out of data must call join(); one that stopped calling the "
        "Reducer without join() leaves the others waiting here)",
        group->size);
  }

  // Remembers what each leaf of `grads` is now (its bucket view), for every step's layout check.
  void remember_views(const TensorDict& grads) {
    const auto& refs = detail::DictAccess::canonical(grads);
    for (std::size_t i = 0; i < refs.size(); ++i) {
      const Tensor& t = *refs[i].tensor;
      Leaf& l = leaves[i];
      l.layout_id = detail::TensorAccess::layout_id(t);
      if (!t.defined()) continue;
      l.dtype = t.dtype();
      l.shape = t.shape();
      l.strides = t.strides();
      if (l.bucket != kNoBucket) l.data = detail::TensorAccess::data(t, itemsize(t.dtype()));
    }
    generation = detail::DictAccess::canonical_generation(grads);
    versions.record(refs);
  }

  void reset_step() {
    for (auto& l : leaves) l.ready = false;
    for (auto& b : buckets) {
      b.pending = b.leaves.size();
      b.work.reset();
    }
    flag.work.reset();
    next = 0;
    poked = 0;
    in_step = false;
    layout_error.clear();
  }
};

namespace {

// The leaves in ready order: `order`'s keys first (a sub-dict: its leaves in canonical order),
// then the others in reverse canonical order. Sets `err` for an unknown or repeated key.
std::vector<std::size_t> ready_sequence(
    const std::vector<Key>& order, std::size_t n,
    const std::unordered_map<std::string, std::vector<std::size_t>>& members, std::string& err) {
  std::vector<std::size_t> seq;
  std::vector<char> placed(n, 0);
  for (const Key& k : order) {
    auto it = members.find(lookup_string(k));
    if (it == members.end()) {
      if (err.empty())
        err = fmt::format("ready_order: key '{}' is not a leaf or sub-dict of the gradients",
                          k.str());
      continue;
    }
    for (std::size_t i : it->second) {
      if (placed[i] != 0) {
        if (err.empty()) err = fmt::format("ready_order: key '{}' is listed twice", k.str());
        continue;
      }
      placed[i] = 1;
      seq.push_back(i);
    }
  }
  for (std::size_t i = n; i-- > 0;)
    if (placed[i] == 0) seq.push_back(i);
  return seq;
}

// The first problem of this rank's gradients and options, leaf by leaf, then the options ("" if
// none; undefined leaves are the agreement's analysis to report).
std::string argument_problem(std::span<const detail::LeafRef> leaves, const ReducerOptions& opts) {
  for (const auto& ref : leaves) {
    const Tensor& t = *ref.tensor;
    if (!t.defined()) continue;
    if (t.is_sparse())
      return fmt::format(
          "key '{}' is a sparse tensor; a Reducer needs dense gradients (to_dense() it first)",
          ref.key->str());
    if (opts.compression != Compression::None && t.dtype() != DType::Float32 &&
        t.dtype() != DType::Float64 && t.dtype() != DType::Float16 && t.dtype() != DType::BFloat16)
      return fmt::format("compression {} applies to floating-point gradients; key '{}' is {}",
                         name(opts.compression), ref.key->str(), name(t.dtype()));
  }
  if (opts.compression != Compression::None && opts.op != ReduceOp::SUM && opts.op != ReduceOp::AVG)
    return fmt::format("compression {} supports SUM and AVG, not {}", name(opts.compression),
                       name(opts.op));
  if (opts.uneven_inputs && opts.op != ReduceOp::SUM && opts.op != ReduceOp::AVG)
    return fmt::format(
        "uneven_inputs supports SUM and AVG (a joined rank contributes zeros), not {}",
        name(opts.op));
  return {};
}

// The Reducer's call name. Ranks must also agree on what the layout check does not see: the
// ready order (it decides the buckets), the compression and uneven inputs. All go into the
// name, which is fingerprinted.
std::string reducer_call_name(const ReducerOptions& opts, const std::vector<std::size_t>& seq) {
  std::string call_name = "Reducer";
  if (!opts.ready_order.empty()) {
    std::uint64_t h = 0x7265616479ULL;
    for (std::size_t i : seq) h = detail::mix(h, i);
    call_name += fmt::format("[ready_order {:016x}]", h);
  }
  if (opts.compression != Compression::None)
    call_name += fmt::format("[compression {}]", name(opts.compression));
  if (opts.uneven_inputs) call_name += "[uneven_inputs]";
  return call_name;
}

// The options of the construction's agreement: an async bucketed all_reduce.
CollectiveOptions collective_options_of(const ReducerOptions& opts) {
  CollectiveOptions copts;
  copts.group = opts.group;
  copts.async_op = true;
  copts.bucket_bytes = opts.bucket_bytes;
  copts.timeout = opts.timeout;
  return copts;
}

// The agreed plan skips aliases of an earlier key; the layout (aliasing included) is agreed, so
// every rank throws this together.
void reject_tied_leaves(const BucketPlan& agreed, std::span<const detail::LeafRef> leaves,
                        std::string_view call_name) {
  for (std::size_t i : agreed.skipped_leaves) {
    const Tensor& t = *leaves[i].tensor;
    if (t.numel() > 0)
      throw std::invalid_argument(fmt::format(
          "{}: key '{}' shares its elements with another key; a Reducer gives every key its own "
          "place in a bucket, so tied gradients must be one key",
          call_name, leaves[i].key->str()));
  }
}

}  // namespace

// By value as reducer.hpp declares it (the public signature), read through const helpers.
// NOLINTNEXTLINE(performance-unnecessary-value-param)
Reducer::Reducer(TensorDict& grads, ReducerOptions opts) : impl_(std::make_unique<Impl>()) {
  Impl& m = *impl_;
  m.dict = &grads;
  m.op = opts.op;
  m.compression = opts.compression;
  m.uneven = opts.uneven_inputs;

  auto in = detail::dict_leaves(grads, /*with_cache=*/false);
  m.index_leaves(in.leaves);
  std::string err = std::move(in.error);
  detail::note_error(err, argument_problem(in.leaves, opts));
  const std::vector<std::size_t> seq =
      ready_sequence(opts.ready_order, m.leaves.size(), m.members, err);
  const std::string call_name = reducer_call_name(opts, seq);
  const CollectiveOptions copts = collective_options_of(opts);
  const detail::CollectiveCall call{detail::CollectiveKind::AllReduce, opts.op, 0, call_name, true};
  auto prepared = detail::prepare_collective(in.leaves, call, copts, std::move(err));
  m.group = prepared.group;
  // After the agreement (every rank got here, or every rank threw): a collective call.
  m.lane = detail::duplicate_group(*m.group, call_name);
  m.summarize_steps(in.leaves, opts.op);
  m.timeout = detail::timeout_of(copts);
  reject_tied_leaves(*prepared.plan, in.leaves, call_name);

  // Buckets in ready order (BucketPlan::build_in_order): one open bucket per dtype, closed when
  // the next leaf would pass the cap, numbered by their first leaf, which is the order they
  // launch in. Every leaf is copied into its bucket, so the plan sees each as contiguous; no
  // alias with elements is left (rejected above).
  const BucketPlan plan = BucketPlan::build_in_order(detail::plain_layout(in.leaves), seq,
                                                     prepared.plan->cap.value_or(kAutoBucketBytes),
                                                     prepared.plan->max_message_bytes);
  m.max_message_bytes = plan.max_message_bytes;
  m.assign_buckets(plan);
  m.move_into_buckets(grads, in.leaves, plan);
  if (m.uneven) m.make_flag();
  m.launched.reserve(m.buckets.size());
  m.remember_views(grads);
}

Reducer::Reducer(TensorDict owned, std::function<TensorDict()> current, ReducerOptions opts)
    : Reducer(owned, std::move(opts)) {
  // `owned` was the constructor's parameter: keep it (its storage is the buckets').
  impl_->owned = std::move(owned);
  impl_->dict = &impl_->owned;
  impl_->current = std::move(current);
}

Reducer::~Reducer() = default;
Reducer::Reducer(Reducer&&) noexcept = default;
Reducer& Reducer::operator=(Reducer&&) noexcept = default;

TensorDict& Reducer::owned_dict() { return impl_->owned; }

void Reducer::mark_ready(const Key& key) {
  Impl& m = *impl_;
  m.check_usable("mark_ready");
  auto it = m.members.find(lookup_string(key));
  if (it == m.members.end()) {
    std::vector<Key> known;
    known.reserve(m.leaves.size());
    for (const auto& l : m.leaves) known.push_back(l.key);
    throw KeyError(fmt::format(
        "Reducer.mark_ready: key '{}' is not a leaf or sub-dict of the Reducer's gradients{}",
        key.str(), nearest_keys(key, known)));
  }
  for (std::size_t i : it->second)
    if (m.leaves[i].ready)
      throw Error(fmt::format(
          "Reducer.mark_ready: key '{}' is already marked ready in this step (each leaf once "
          "per step; was finish() skipped after the previous backward pass?)",
          m.leaves[i].key.str()));
  if (!m.in_step) m.begin_step();
  const detail::StepScope inside(m.step_ref);
  for (std::size_t i : it->second) {
    Impl::Leaf& l = m.leaves[i];
    l.ready = true;
    if (l.bucket != kNoBucket) --m.buckets[l.bucket].pending;
  }
  m.launch_ready();
  m.poke_in_flight();
}

void Reducer::finish() {
  Impl& m = *impl_;
  m.check_usable("finish");
  if (!m.in_step) {
    m.begin_step();
  } else if (m.layout_error.empty()) {
    m.layout_error = m.find_layout_change();
  }
  std::optional<detail::StepScope> inside(std::in_place, m.step_ref);
  // Every rank launches every bucket, in order, whatever it found: a rank that stopped here
  // alone would leave the others waiting for its buckets until their timeout.
  std::string error;
  try {
    m.launch_ready(/*all=*/true);
  } catch (const std::exception& e) {
    error = e.what();
  }
  std::exception_ptr first;
  for (Impl::Bucket* b : m.in_flight()) {
    try {
      b->work->wait();
    } catch (const std::exception& e) {
      if (!first) first = std::current_exception();
      if (error.empty()) error = e.what();
    }
  }
  if (!m.old_storage.empty()) m.warn_stale_handles();
  const std::string layout_error = m.layout_error;
  m.reset_step();
  inside.reset();
  m.end_record(!first && error.empty() && layout_error.empty());
  if (first) {
    m.failure = error;
    std::rethrow_exception(first);
  }
  if (!error.empty()) {
    m.failure = error;
    throw Error(fmt::format("Reducer.finish: {}", error));
  }
  if (!layout_error.empty()) {
    m.failure = layout_error;
    throw Error(
        fmt::format("Reducer: the gradients' layout changed: {}; their reduced values are "
                    "in the buckets, not in the new tensors",
                    layout_error));
  }
}

void Reducer::join() {
  Impl& m = *impl_;
  m.check_usable("join");
  if (!m.uneven)
    throw std::invalid_argument(
        "Reducer.join: needs ReducerOptions::uneven_inputs = true at construction, on every rank "
        "(without it, every rank must run the same number of steps)");
  if (m.in_step) {
    finish();
    throw Error(
        "Reducer.join: called inside a step (mark_ready() since the last finish()); that step "
        "was finished with this rank's gradients. Call join() after finish(), when this rank "
        "has no data for another step");
  }
  for (;;) {
    // The flag and the shadowed step's buckets go the same way (see Impl::step_on_thread).
    m.step_on_thread = async_progress_enabled();
    m.record_step();  // the step this rank shadows (or the last vote, when all have joined)
    try {
      const detail::StepScope inside(m.step_ref);
      m.launch_flag(0);
      m.flag.work->wait();
    } catch (const std::exception& e) {
      m.failure = e.what();
      m.reset_step();
      m.end_record(false);
      throw;
    }
    const std::int32_t running = m.flag.storage.data<std::int32_t>()[0];
    m.flag.work.reset();
    if (running == 0) {
      m.end_record(true);
      break;
    }
    // Shadow the step the others run: the same buckets, in the same order, holding zeros
    // (finish() ends the step's record).
    for (auto& b : m.buckets) b.storage.zero_();
    m.in_step = true;
    finish();
  }
  m.reset_step();
}

std::size_t Reducer::num_buckets() const { return impl_->buckets.size(); }

std::vector<Key> Reducer::bucket_keys(std::size_t b) const {
  std::vector<Key> out;
  for (std::size_t i : impl_->buckets.at(b).leaves) out.push_back(impl_->leaves[i].key);
  return out;
}

std::size_t Reducer::bucket_nbytes(std::size_t b) const { return impl_->buckets.at(b).nbytes; }

bool Reducer::in_step() const { return impl_->in_step; }

}  // namespace td
