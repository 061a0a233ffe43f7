#include "tensordict/tensor_dict.hpp"

#include <algorithm>
#include <atomic>
#include <map>
#include <mutex>
#include <ostream>
#include <set>
#include <tuple>
#include <unordered_map>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "core/canonical_order.hpp"
#include "core/dict_internal.hpp"
#include "core/tensor_internal.hpp"

namespace td {

namespace {

using detail::shape_str;

bool starts_with(const Shape& shape, const Shape& prefix) {
  return shape.size() >= prefix.size() && std::equal(prefix.begin(), prefix.end(), shape.begin());
}
}  // namespace

namespace {
// Every structural event of any dict of the process: a version issued (an entry of some dict
// added, removed or replaced) or a TensorDict moved (its holder now reaches another Impl, or
// none). A canonical order found valid while the count stood where it stands now is still valid:
// nothing its check reads has changed since (DictAccess::canonical's one-load path, as
// TensorAccess::leaf_epoch is for the leaves' layouts).
std::atomic<std::uint64_t> g_dict_events{0};

// Versions are values of that count, so unique across all dicts of the process: a dict freed and
// another allocated at the same address never look like the same dict at the same version.
std::uint64_t next_dict_version() {
  return g_dict_events.fetch_add(1, std::memory_order_relaxed) + 1;
}
void note_dict_moved() { g_dict_events.fetch_add(1, std::memory_order_relaxed); }
}  // namespace

struct TensorDict::Impl {
  struct Entry {
    std::string name;
    std::variant<Tensor, TensorDict> value;
  };
  Shape batch_size;
  std::vector<Entry> entries;                          // insertion order
  std::unordered_map<std::string, std::size_t> index;  // name -> position in entries

  // Renewed (next_dict_version) by every structural change of this dict (not of its sub-dicts,
  // which have their own).
  std::uint64_t version = next_dict_version();

  // Canonical-order cache (see DictAccess::canonical): valid while every dict of the tree, in
  // walk order, is the same object at the same version as when it was built. Const calls may
  // run on several threads at once (as for the standard containers), and each builds or checks
  // the cache: `cache_mutex` guards every field below. `cache` and `cache_keys` are rewritten
  // only by a rebuild, which only a change of the tree (never concurrent with a const call)
  // makes necessary, so a caller may read the returned order after the lock is released.
  std::mutex cache_mutex;
  bool cache_valid = false;
  std::uint64_t cache_generation = 0;  // bumped on every rebuild
  std::uint64_t cache_checked_at = 0;  // g_dict_events when the cache was last found valid
  // The dicts of the tree in walk order (parents before their sub-dicts), each with its version
  // and where its parent holds it (node 0, this dict, has none).
  struct CacheNode {
    const Impl* impl = nullptr;
    std::uint64_t version = 0;
    std::uint32_t parent = 0;  // index in cache_nodes
    std::uint32_t entry = 0;   // index in the parent's entries
  };
  std::vector<CacheNode> cache_nodes;
  std::vector<Key> cache_keys;
  std::vector<detail::LeafRef> cache;
  std::shared_ptr<void> attachment;  // a higher layer's (DictAccess::attachment)
  // Read without the lock by DictAccess (after canonical()), hence atomic.
  std::atomic<std::uint64_t> published_generation{0};  // cache_generation, 0 while invalid

  // Positions of the entries in canonical order (core/canonical_order.hpp), and of the sub-dicts
  // among them, recomputed when `version` moved on (every change that can add, remove, rename or
  // replace an entry bumps it). Computed on first use by whichever const call walks this dict
  // first (its own canonical() or a parent's): published through `order_version`
  // (acquire/release), computed under `order_mutex`.
  mutable std::mutex order_mutex;
  mutable std::vector<std::uint32_t> ordered_positions;
  mutable std::vector<std::uint32_t> sub_positions;
  mutable std::atomic<std::uint64_t> order_version{~std::uint64_t{0}};
  void compute_order() const {
    if (order_version.load(std::memory_order_acquire) == version) return;
    const std::lock_guard lock(order_mutex);
    if (order_version.load(std::memory_order_relaxed) == version) return;
    ordered_positions = detail::canonical_entries(
        entries.size(), [&](std::uint32_t i) -> const std::string& { return entries[i].name; });
    sub_positions.clear();
    for (const std::uint32_t i : ordered_positions)
      if (std::holds_alternative<TensorDict>(entries[i].value)) sub_positions.push_back(i);
    order_version.store(version, std::memory_order_release);
  }
  // Every entry, in canonical order.
  const std::vector<std::uint32_t>& ordered() const {
    compute_order();
    return ordered_positions;
  }
  // The sub-dicts, in canonical order.
  const std::vector<std::uint32_t>& subs() const {
    compute_order();
    return sub_positions;
  }

  Entry* find(const std::string& name) {
    auto it = index.find(name);
    return it == index.end() ? nullptr : &entries[it->second];
  }
  void rebuild_index() {
    index.clear();
    for (std::size_t i = 0; i < entries.size(); ++i) index.emplace(entries[i].name, i);
  }
};

TensorDict::TensorDict(Shape batch_size) : impl_(std::make_unique<Impl>()) {
  detail::shape_numel(batch_size);
  impl_->batch_size = std::move(batch_size);
}
TensorDict::~TensorDict() = default;
TensorDict::TensorDict(const TensorDict& other) : impl_(std::make_unique<Impl>()) {
  impl_->batch_size = other.impl().batch_size;
  impl_->entries = other.impl().entries;
  impl_->rebuild_index();
}
TensorDict& TensorDict::operator=(const TensorDict& other) {
  if (this != &other) *this = TensorDict(other);
  return *this;
}
// Moving a dict changes which Impl a parent reaches: a parent's canonical order, which
// remembers the Impls of its tree, sees it on its next check (the move counts as an event, so
// that check walks the tree).
TensorDict::TensorDict(TensorDict&& other) noexcept : impl_(std::move(other.impl_)) {
  note_dict_moved();
}
TensorDict& TensorDict::operator=(TensorDict&& other) noexcept {
  impl_ = std::move(other.impl_);
  note_dict_moved();
  return *this;
}

TensorDict::Impl& TensorDict::impl() {
  if (!impl_) throw Error("use of a moved-from td::TensorDict");
  return *impl_;
}
const TensorDict::Impl& TensorDict::impl() const { return const_cast<TensorDict*>(this)->impl(); }

namespace {
// The first `n` names of `key`, printed as Key::str() does (for messages).
std::string prefix_str(const Key& key, std::size_t n) {
  const auto& parts = key.parts();
  return Key(std::vector<std::string>(parts.begin(),
                                      parts.begin() + static_cast<std::ptrdiff_t>(n)))
      .str();
}

// Why a walk along a key stopped at one of its names.
enum class Stop { Absent, AtTensor };

// The KeyError for `key`, whose name number `depth` is absent or, with more names after it, a
// tensor: the message says which, so "a.b" missing because "a" does not exist and because "a"
// is a leaf read differently.
[[noreturn]] void missing(const Key& key, std::size_t depth, Stop why) {
  std::string reason;
  if (depth + 1 < key.parts().size())
    reason = fmt::format(" ('{}' {})", prefix_str(key, depth + 1),
                         why == Stop::Absent ? "does not exist" : "is a tensor, not a sub-dict");
  throw KeyError(fmt::format("key '{}' not found{}", key.str(), reason));
}
}  // namespace

// Walks that TensorDict's members share (nested in TensorDict, so they may use impl()).
struct TensorDict::Walk {
  // The dict holding key's last name; td::KeyError with the exact reason if the path is broken.
  static TensorDict& parent(TensorDict& root, const Key& key) {
    TensorDict* d = &root;
    const auto& parts = key.parts();
    for (std::size_t i = 0; i + 1 < parts.size(); ++i) {
      Impl::Entry* e = d->impl().find(parts[i]);
      if (!e) missing(key, i, Stop::Absent);
      d = std::get_if<TensorDict>(&e->value);
      if (!d) missing(key, i, Stop::AtTensor);
    }
    return *d;
  }

  // The deepest existing dict on the way to key's last name and how many names lead to it,
  // changing nothing; td::KeyError if a name before the last holds a tensor.
  static std::pair<TensorDict*, std::size_t> existing_prefix(TensorDict& root, const Key& key) {
    TensorDict* d = &root;
    const auto& parts = key.parts();
    std::size_t i = 0;
    for (; i + 1 < parts.size(); ++i) {
      Impl::Entry* e = d->impl().find(parts[i]);
      if (!e) break;
      d = std::get_if<TensorDict>(&e->value);
      if (!d)
        throw KeyError(fmt::format("set('{}'): '{}' holds a tensor, not a sub-dict", key.str(),
                                   prefix_str(key, i + 1)));
    }
    return {d, i};
  }

  // Creates the sub-dicts for key's names [from, last) below `d` (which holds name `from - 1`),
  // each inheriting its parent's batch size; returns the dict that will hold the last name.
  static TensorDict& create_path(TensorDict& d, const Key& key, std::size_t from) {
    TensorDict* cur = &d;
    const auto& parts = key.parts();
    for (std::size_t i = from; i + 1 < parts.size(); ++i) {
      Impl& in = cur->impl();
      in.entries.push_back({parts[i], TensorDict(in.batch_size)});
      in.index.emplace(parts[i], in.entries.size() - 1);
      in.version = next_dict_version();
      cur = &std::get<TensorDict>(in.entries.back().value);
    }
    return *cur;
  }
};

// Both set()s check everything before they change anything, so a failing set leaves the dict as
// it was: the created sub-dicts would inherit the batch size of the deepest existing dict.
TensorDict& TensorDict::set(const Key& key, Tensor value) {
  if (!value.defined())
    throw std::invalid_argument(fmt::format("set('{}'): undefined tensor", key.str()));
  auto [deepest, depth] = Walk::existing_prefix(*this, key);
  const Shape& bs = deepest->impl().batch_size;
  if (!starts_with(value.shape(), bs))
    throw std::invalid_argument(
        fmt::format("set('{}'): tensor of shape {} does not start with the batch size {}",
                    key.str(), shape_str(value.shape()), shape_str(bs)));
  Impl& in = Walk::create_path(*deepest, key, depth).impl();
  const std::string& last = key.parts().back();
  if (Impl::Entry* e = in.find(last)) {
    if (std::holds_alternative<Tensor>(e->value)) {
      std::get<Tensor>(e->value) = std::move(value);  // same node: cached pointers stay valid
    } else {
      e->value = std::move(value);
      in.version = next_dict_version();
    }
  } else {
    in.entries.push_back({last, std::move(value)});
    in.index.emplace(last, in.entries.size() - 1);
    in.version = next_dict_version();
  }
  return *this;
}

TensorDict& TensorDict::set(const Key& key, TensorDict value) {
  auto [deepest, depth] = Walk::existing_prefix(*this, key);
  const Shape& bs = deepest->impl().batch_size;
  if (!starts_with(value.batch_size(), bs))
    throw std::invalid_argument(
        fmt::format("set('{}'): sub-dict batch size {} does not start with {}", key.str(),
                    shape_str(value.batch_size()), shape_str(bs)));
  Impl& in = Walk::create_path(*deepest, key, depth).impl();
  const std::string& last = key.parts().back();
  if (Impl::Entry* e = in.find(last)) {
    e->value = std::move(value);
  } else {
    in.entries.push_back({last, std::move(value)});
    in.index.emplace(last, in.entries.size() - 1);
  }
  in.version = next_dict_version();
  return *this;
}

Tensor& TensorDict::get(const Key& key) {
  Impl::Entry* e = Walk::parent(*this, key).impl().find(key.parts().back());
  if (!e) missing(key, key.parts().size() - 1, Stop::Absent);
  if (auto* t = std::get_if<Tensor>(&e->value)) return *t;
  throw KeyError(fmt::format("key '{}' is a sub-dict, not a tensor (use get_dict)", key.str()));
}
const Tensor& TensorDict::get(const Key& key) const {
  return const_cast<TensorDict*>(this)->get(key);
}

TensorDict& TensorDict::get_dict(const Key& key) {
  Impl::Entry* e = Walk::parent(*this, key).impl().find(key.parts().back());
  if (!e) missing(key, key.parts().size() - 1, Stop::Absent);
  if (auto* d = std::get_if<TensorDict>(&e->value)) return *d;
  throw KeyError(fmt::format("key '{}' is a tensor, not a sub-dict (use get)", key.str()));
}
const TensorDict& TensorDict::get_dict(const Key& key) const {
  return const_cast<TensorDict*>(this)->get_dict(key);
}

bool TensorDict::contains(const Key& key) const {
  const TensorDict* d = this;
  const auto& parts = key.parts();
  for (std::size_t i = 0; i < parts.size(); ++i) {
    const Impl::Entry* e = const_cast<Impl&>(d->impl()).find(parts[i]);
    if (!e) return false;
    if (i + 1 == parts.size()) return true;
    d = std::get_if<TensorDict>(&e->value);
    if (!d) return false;
  }
  return false;
}

bool TensorDict::is_dict(const Key& key) const {
  if (!contains(key)) return false;
  const TensorDict& parent = Walk::parent(const_cast<TensorDict&>(*this), key);
  const Impl::Entry* e = const_cast<Impl&>(parent.impl()).find(key.parts().back());
  return std::holds_alternative<TensorDict>(e->value);
}

TensorDict& TensorDict::erase(const Key& key) {
  Impl& in = Walk::parent(*this, key).impl();
  auto it = in.index.find(key.parts().back());
  if (it == in.index.end()) missing(key, key.parts().size() - 1, Stop::Absent);
  in.entries.erase(in.entries.begin() + static_cast<std::ptrdiff_t>(it->second));
  in.rebuild_index();
  in.version = next_dict_version();
  return *this;
}

namespace {
void collect_keys(const TensorDict& d, std::vector<std::string>& prefix, bool nested,
                  bool leaves_only, std::vector<Key>& out) {
  for (const Key& k : d.keys()) {
    prefix.push_back(k.parts()[0]);
    if (d.is_dict(k)) {
      if (!leaves_only) out.emplace_back(prefix);
      if (nested) collect_keys(d.get_dict(k), prefix, nested, leaves_only, out);
    } else {
      out.emplace_back(prefix);
    }
    prefix.pop_back();
  }
}
}  // namespace

std::vector<Key> TensorDict::keys(bool include_nested, bool leaves_only) const {
  std::vector<Key> out;
  if (!include_nested) {
    for (const auto& e : impl().entries)
      if (!leaves_only || std::holds_alternative<Tensor>(e.value)) out.emplace_back(e.name);
    return out;
  }
  std::vector<std::string> prefix;
  collect_keys(*this, prefix, true, leaves_only, out);
  return out;
}

std::vector<std::pair<Key, Tensor>> TensorDict::items() const {
  std::vector<std::pair<Key, Tensor>> out;
  for (const Key& k : keys(true, true)) out.emplace_back(k, get(k));
  return out;
}

std::vector<std::pair<Key, Tensor>> TensorDict::canonical_leaves() const {
  std::vector<std::pair<Key, Tensor>> out;
  for (const auto& ref : detail::DictAccess::canonical(*this))
    out.emplace_back(*ref.key, *ref.tensor);
  return out;
}

std::size_t TensorDict::size() const { return impl().entries.size(); }
bool TensorDict::empty() const { return impl().entries.empty(); }
const Shape& TensorDict::batch_size() const { return impl().batch_size; }

// apply, slice, split, cat, add_, mul_: dict_transform.cpp.

TensorDict TensorDict::clone() const {
  return apply([](const Tensor& t) { return t.clone(); });
}

TensorDict TensorDict::flatten_keys(const std::string& sep) const {
  TensorDict out(impl().batch_size);
  for (const auto& [k, t] : items()) out.set(Key(fmt::format("{}", fmt::join(k.parts(), sep))), t);
  return out;
}

TensorDict TensorDict::unflatten_keys(const std::string& sep) const {
  if (sep.empty()) throw std::invalid_argument("unflatten_keys: empty separator");
  TensorDict out(impl().batch_size);
  for (const auto& [k, t] : items()) {
    std::vector<std::string> parts;
    for (const auto& p : k.parts()) {
      std::size_t start = 0, pos;
      while ((pos = p.find(sep, start)) != std::string::npos) {
        parts.push_back(p.substr(start, pos - start));
        start = pos + sep.size();
      }
      parts.push_back(p.substr(start));
    }
    out.set(Key(std::move(parts)), t);
  }
  return out;
}

TensorDict TensorDict::select(const std::vector<Key>& ks) const {
  TensorDict out(impl().batch_size);
  for (const Key& k : ks) {
    if (is_dict(k)) {  // otherwise get() throws td::KeyError saying why k is absent
      out.set(k, get_dict(k));
    } else {
      out.set(k, get(k));
    }
  }
  return out;
}

TensorDict TensorDict::exclude(const std::vector<Key>& ks) const {
  TensorDict out(*this);
  for (const Key& k : ks)
    if (out.contains(k)) out.erase(k);
  return out;
}

TensorDict& TensorDict::update(const TensorDict& other) {
  for (const auto& [k, t] : other.items()) set(k, t);
  return *this;
}

TensorDict& TensorDict::zero_() {
  for (const auto& ref : detail::DictAccess::canonical(*this)) ref.tensor->zero_();
  return *this;
}

bool TensorDict::equal(const TensorDict& other) const {
  if (batch_size() != other.batch_size()) return false;
  const auto& a = detail::DictAccess::canonical(*this);
  const auto& b = detail::DictAccess::canonical(other);
  if (a.size() != b.size()) return false;
  for (std::size_t i = 0; i < a.size(); ++i)
    if (!(*a[i].key == *b[i].key) || !a[i].tensor->equal(*b[i].tensor)) return false;
  return true;
}

TensorDict& TensorDict::consolidate() {
  const auto& leaves = detail::DictAccess::canonical(*this);
  struct Pending {
    Tensor* leaf;
    std::int64_t offset;
  };
  std::map<DType, std::vector<Pending>> by_dtype;
  std::map<DType, std::int64_t> total;
  // Keys that alias one region keep aliasing it: each alias becomes a copy of its first
  // occurrence's new view. (Not found by slot offset: an empty leaf shares its offset with the
  // next leaf of its dtype, and an alias of it became a view of that leaf.)
  using Region = std::tuple<const void*, Shape, Shape, DType>;
  std::map<Region, const Tensor*> seen;
  std::vector<std::pair<Tensor*, const Tensor*>> aliases;  // (alias, first occurrence)
  for (const auto& ref : leaves) {
    Tensor& t = *ref.tensor;
    if (t.is_sparse()) continue;
    Region r{t.raw_data(), t.shape(), t.strides(), t.dtype()};
    if (auto it = seen.find(r); it != seen.end()) {
      aliases.emplace_back(&t, it->second);
      continue;
    }
    std::int64_t& off = total[t.dtype()];
    by_dtype[t.dtype()].push_back({&t, off});
    seen.emplace(std::move(r), &t);
    off += t.numel();
  }
  for (auto& [dtype, items] : by_dtype) {
    Tensor flat = Tensor::empty({total[dtype]}, dtype);
    for (auto& p : items) {
      Tensor v = detail::TensorAccess::view_of(flat, p.offset, p.leaf->shape());
      v.copy_(*p.leaf);
      *p.leaf = v;
    }
  }
  for (auto& [leaf, first] : aliases) *leaf = *first;
  return *this;
}

bool TensorDict::is_consolidated() const {
  // What consolidate() makes: per dtype, every dense leaf a contiguous view of one storage, the
  // leaves back to back in canonical order, a key aliasing an earlier leaf's region skipped.
  struct Run {
    const void* storage;
    std::int64_t next;  // element offset where the next leaf must start
  };
  std::map<DType, Run> runs;
  using Region = std::tuple<const void*, Shape, Shape, DType>;
  std::set<Region> seen;
  for (const auto& ref : detail::DictAccess::canonical(*this)) {
    const Tensor& t = *ref.tensor;
    if (t.is_sparse()) continue;
    Region r{t.raw_data(), t.shape(), t.strides(), t.dtype()};
    if (seen.contains(r)) continue;
    if (!t.is_contiguous()) return false;
    const void* storage = detail::TensorAccess::storage(t);
    Run& run = runs.try_emplace(t.dtype(), Run{storage, t.storage_offset()}).first->second;
    if (run.storage != storage || run.next != t.storage_offset()) return false;
    run.next += t.numel();
    seen.insert(std::move(r));
  }
  return true;
}

namespace {
void print_dict(std::string& out, const TensorDict& d, int indent) {
  const std::string pad(static_cast<std::size_t>(indent), ' ');
  out += "TensorDict(\n" + pad + "    fields={\n";
  for (const Key& k : d.keys()) {
    out += pad + "        " + k.str() + ": ";  // quoted as in messages where needed
    if (d.is_dict(k)) {
      print_dict(out, d.get_dict(k), indent + 8);
    } else {
      const Tensor& t = d.get(k);
      out += fmt::format("Tensor(shape={}, dtype={}{}{})", shape_str(t.shape()), name(t.dtype()),
                         t.is_sparse() ? ", sparse" : "",
                         !t.is_sparse() && !t.is_contiguous() ? ", strided" : "");
    }
    out += ",\n";
  }
  out += pad + "    },\n" + pad + "    batch_size=" + shape_str(d.batch_size()) + ")";
}
}  // namespace

std::string to_string(const TensorDict& d) {
  std::string out;
  print_dict(out, d, 0);
  return out;
}
std::ostream& operator<<(std::ostream& os, const TensorDict& d) { return os << to_string(d); }

namespace detail {
std::uint64_t hash_key(const Key& key) {
  std::uint64_t h = 1469598103934665603ull;  // FNV-1a over the parts, each ended by a 0 byte
  for (const auto& part : key.parts()) {
    for (unsigned char c : part) h = (h ^ c) * 1099511628211ull;
    h = (h ^ 0u) * 1099511628211ull;
  }
  return h;
}

void* DictAccess::attachment(const TensorDict& d, std::shared_ptr<void> (*make)()) {
  auto& in = const_cast<TensorDict&>(d).impl();
  const std::lock_guard lock(in.cache_mutex);
  if (!in.attachment) in.attachment = make();
  return in.attachment.get();
}

std::uint64_t DictAccess::canonical_generation(const TensorDict& d) {
  return d.impl().published_generation.load(std::memory_order_relaxed);  // canonical(d) first
}

void LeafVersions::record(std::span<const LeafRef> leaves) {
  leaf_epoch_ = TensorAccess::leaf_epoch();  // first: a change after this read moves it
  layout_ids_.clear();
  layout_ids_.reserve(leaves.size());
  without_storage_.clear();
  std::vector<std::pair<const Storage*, std::size_t>> by_storage;  // (storage, a leaf of it)
  by_storage.reserve(leaves.size());
  for (std::size_t i = 0; i < leaves.size(); ++i) {
    const Tensor& t = *leaves[i].tensor;
    layout_ids_.push_back(TensorAccess::layout_id(t));
    if (const Storage* s = TensorAccess::storage(t))
      by_storage.emplace_back(s, i);
    else
      without_storage_.push_back(i);
  }
  std::sort(by_storage.begin(), by_storage.end());
  storages_.clear();
  for (std::size_t k = 0; k < by_storage.size(); ++k) {
    if (k > 0 && by_storage[k].first == by_storage[k - 1].first) continue;
    const Storage* raw = by_storage[k].first;
    storages_.push_back({TensorAccess::weak_storage(*leaves[by_storage[k].second].tensor), raw,
                         raw->view_changes.load(std::memory_order_relaxed)});
  }
  // Storages scattered over the heap cost a cache miss each (16384 separate ones: 0.3 ms), the
  // leaves' ids in their dict's entries a sequential read: the counters pay only when the leaves
  // share storages.
  few_storages_ = storages_.size() * kLeavesPerStorage <= leaves.size();
  if (!few_storages_) storages_.clear();  // unused: no need to keep their control blocks
}

bool LeafVersions::storages_unchanged() const {
  for (const Seen& s : storages_) {
    // Expired: every tensor that viewed it let go of it, a leaf among them. Otherwise some tensor
    // holds it, so `s.raw` is alive (a dict does not change during a call that reads it).
    if (s.storage.expired() ||
        s.raw->view_changes.load(std::memory_order_relaxed) != s.view_changes)
      return false;
  }
  return true;
}

bool LeafVersions::same_layouts(std::span<const LeafRef> leaves) {
  if (leaves.size() != layout_ids_.size()) return false;
  // No leaf object of any dict changed its layout since the last look: one load. (`leaves` come
  // from canonical(), which marked every one as a leaf.)
  const std::uint64_t epoch = TensorAccess::leaf_epoch();
  if (epoch == leaf_epoch_) return true;
  if (few_storages_) {
    for (const std::size_t i : without_storage_)
      if (TensorAccess::layout_id(*leaves[i].tensor) != layout_ids_[i]) return false;
    if (storages_unchanged()) {
      leaf_epoch_ = epoch;
      return true;
    }
  }
  // A tensor object of one of the storages was assigned or moved from (maybe a leaf, maybe a
  // copy of one: a Work's), or the leaves have about a storage each. Equal layout ids mean equal
  // layouts, so equal storages too.
  ++leaf_walks_;
  for (std::size_t i = 0; i < leaves.size(); ++i)
    if (TensorAccess::layout_id(*leaves[i].tensor) != layout_ids_[i]) return false;
  if (few_storages_)  // the counters moved on, the leaves did not: remember them again
    for (Seen& s : storages_) s.view_changes = s.raw->view_changes.load(std::memory_order_relaxed);
  leaf_epoch_ = epoch;
  return true;
}

const std::vector<LeafRef>& DictAccess::canonical(const TensorDict& cd) {
  auto& d = const_cast<TensorDict&>(cd);
  TensorDict::Impl& in = d.impl();
  // One uncontended lock per call (~20 ns) makes concurrent const calls on one dict safe; the
  // order it returns stays valid after the unlock (see Impl::cache_mutex).
  const std::lock_guard lock(in.cache_mutex);
  // Whether the tree is still the one the cache was built from: every dict the same object at
  // the same version. Each node is reached through its parent's entry, checked before it (an
  // unchanged parent has the same entries, so the sub-dict it holds there is alive; one moved out
  // leaves a null one), and only its version is read: a few cache lines per sub-dict, no strings,
  // no walk of the canonical order (16384 leaves in 256 sub-dicts: checked by every collective).
  auto still_holds = [&in] {
    const auto& nodes = in.cache_nodes;
    if (nodes.empty() || nodes[0].impl != &in || nodes[0].version != in.version) return false;
    for (std::size_t k = 1; k < nodes.size(); ++k) {
      const auto& c = nodes[k];
      const TensorDict::Impl& parent = *nodes[c.parent].impl;
      if (c.entry >= parent.entries.size()) return false;
      const auto* sub = std::get_if<TensorDict>(&parent.entries[c.entry].value);
      if (sub == nullptr || sub->impl_.get() != c.impl || c.impl->version != c.version)
        return false;
    }
    return true;
  };
  // Read before the check: a structural change is never concurrent with a const call, so the
  // count cannot move during the check or the rebuild below.
  const std::uint64_t events = g_dict_events.load(std::memory_order_relaxed);
  if (in.cache_valid && (in.cache_checked_at == events || still_holds())) {
    in.cache_checked_at = events;
    return in.cache;
  }
  in.cache_checked_at = events;
  in.cache_valid = false;  // until rebuilt (the walk throws on a moved-from sub-dict)
  in.published_generation.store(0, std::memory_order_relaxed);
  in.cache_nodes.clear();
  std::vector<std::pair<Key, Tensor*>> all;
  std::vector<std::string> prefix;
  // Until the next rebuild, which any structural change forces, each leaf object stays where it
  // is: callers may keep the leaf pointers (and LeafVersions of them) while the order holds.
  // Every leaf is marked as one, so a change of its layout moves the leaf epoch.
  // Each dict's entries in canonical order, so the leaves come out in it; the dicts are recorded
  // parents first, with where each parent holds them (what the check above reads).
  auto walk = [&](auto& self, TensorDict& node, std::uint32_t parent, std::uint32_t entry) -> void {
    TensorDict::Impl& ni = node.impl();
    const auto me = static_cast<std::uint32_t>(in.cache_nodes.size());
    in.cache_nodes.push_back({&ni, ni.version, parent, entry});
    for (const std::uint32_t i : ni.ordered()) {
      auto& e = ni.entries[i];
      prefix.push_back(e.name);
      if (auto* t = std::get_if<Tensor>(&e.value)) {
        TensorAccess::mark_leaf(*t);  // its layout changes count in the leaf epoch from now on
        all.emplace_back(Key(prefix), t);
      } else {
        self(self, std::get<TensorDict>(e.value), me, i);
      }
      prefix.pop_back();
    }
  };
  walk(walk, d, 0, 0);
  in.cache_keys.clear();
  in.cache_keys.reserve(all.size());
  for (auto& [k, t] : all) in.cache_keys.push_back(std::move(k));
  in.cache.clear();
  in.cache.reserve(all.size());
  for (std::size_t i = 0; i < all.size(); ++i)
    in.cache.push_back({&in.cache_keys[i], all[i].second, hash_key(in.cache_keys[i])});
  in.cache_valid = true;
  ++in.cache_generation;
  in.published_generation.store(in.cache_generation, std::memory_order_relaxed);
  return in.cache;
}
}  // namespace detail

}  // namespace td
