// Checkpoint files: save_safetensors / load_safetensors and save_memmap / load_memmap, by one
// process (POSIX) or by a group (collective MPI-IO for safetensors). Every save is
//   1. a manifest: this rank's keys, dtypes, shapes and batch sizes (dict_wire's layout), which a
//      group all-gathers (all_gather_dicts) so every rank computes the same union, the same
//      LayoutMismatchError for a key held differently, and the same file layout;
//   2. the bytes: each rank writes a disjoint part (a key held by several ranks is split between
//      them) into a temporary file beside the target;
//   3. the commit: fsync, then (once every rank succeeded: agree_outcome after every step) one
//      rename over the target. A failure anywhere removes the temporary file and throws the same
//      error on every rank; the previous file is never touched.
// The formats are in comm/checkpoint_format.*, the I/O in comm/file_io.* (see docs/checkpoint.md).
#include "tensordict/checkpoint.hpp"

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "comm/checkpoint_format.hpp"
#include "comm/collective_engine.hpp"
#include "comm/dict_wire.hpp"
#include "comm/file_io.hpp"
#include "comm/validate.hpp"
#include "core/tensor_internal.hpp"
#include "runtime/deadline.hpp"
#include "tensordict/transport.hpp"
#include "tensordict/version.hpp"

namespace td {

namespace {

namespace fs = std::filesystem;
using detail::CollectiveFile;
using detail::DictLayout;
using detail::ErrorNote;
using detail::FileRange;
using detail::LocalFile;
using Clock = std::chrono::steady_clock;

// ---- manifests: what a dict (or the union of every rank's) holds ----------------------------

using detail::KeyPath;

// The key of a path that is not the root.
Key key_of(const KeyPath& p) { return Key(p); }
std::string key_str(const KeyPath& p) { return p.empty() ? std::string("<root>") : Key(p).str(); }

struct LeafInfo {
  KeyPath key;
  DType dtype = DType::Float32;
  Shape shape;
  bool sparse = false;
  std::vector<int> holders;  // ranks holding it, ascending
  int mine = -1;             // index of this rank's tensor, -1 if this rank does not hold it
};
struct DictInfo {
  KeyPath key;
  Shape batch;
  std::vector<std::pair<std::string, bool>> entries;  // name, is_dict; insertion order
};
struct Manifest {
  std::vector<LeafInfo> leaves;  // canonical order once finished
  std::vector<DictInfo> dicts;   // parents first; [0] is the root
};

KeyPath child(const KeyPath& parent, const std::string& name) {
  KeyPath parts = parent;
  parts.push_back(name);
  return parts;
}

void flatten(const DictLayout& l, std::uint32_t index, const KeyPath& key,
             const std::vector<int>& holders, bool local, Manifest& m) {
  const auto& d = l.dicts[index];
  m.dicts.push_back({key, d.batch, {}});
  const std::size_t at = m.dicts.size() - 1;
  for (const auto& e : d.entries) {
    m.dicts[at].entries.emplace_back(e.name, e.is_dict);
    KeyPath k = child(key, e.name);
    if (e.is_dict) {
      flatten(l, e.index, k, holders, local, m);
      continue;
    }
    const auto& leaf = l.leaves[e.index];
    m.leaves.push_back({std::move(k), leaf.dtype, leaf.shape, leaf.sparse, holders,
                        local ? static_cast<int>(e.index) : -1});
  }
}

// The manifest of the layout `l` held by the ranks `holders` (ascending); `local`: this rank's own
// layout is one of them (LeafInfo::mine set).
Manifest manifest_of(const DictLayout& l, const std::vector<int>& holders, bool local) {
  Manifest m;
  flatten(l, 0, {}, holders, local, m);
  return m;
}

void sort_leaves(Manifest& m) {
  std::sort(m.leaves.begin(), m.leaves.end(),
            [](const LeafInfo& a, const LeafInfo& b) { return a.key < b.key; });
}

std::string describe(const LeafInfo& l) {
  return fmt::format("{}{}{}", name(l.dtype), detail::shape_str(l.shape),
                     l.sparse ? " sparse" : "");
}

// One distinct manifest of a group and the ranks that hold it, ascending.
struct Part {
  Manifest manifest;
  std::vector<int> ranks;
};

// The union of the group's distinct manifests (in the order of their lowest rank). A key held by
// several ranks must be held the same way: else the same LayoutMismatchError on every rank. One
// part (every rank holds the same dict) is its own union.
Manifest union_of(std::vector<Part> parts, std::string_view what) {
  if (parts.size() == 1) {
    Manifest u = std::move(parts[0].manifest);
    sort_leaves(u);
    return u;
  }
  Manifest u;
  std::map<KeyPath, std::size_t> leaf_at, dict_at;
  std::map<KeyPath, int> dict_owner;
  auto mismatch = [&](const KeyPath& k, int r0, const std::string& a, int r1,
                      const std::string& b) {
    return LayoutMismatchError(fmt::format(
        "{}: the ranks hold key '{}' differently: rank {}: {}; rank {}: {} (nothing was written)",
        what, key_str(k), r0, a, r1, b));
  };
  for (const Part& part : parts) {
    const int rank = part.ranks[0];
    for (const auto& d : part.manifest.dicts) {
      if (const auto it = leaf_at.find(d.key); it != leaf_at.end())
        throw mismatch(d.key, u.leaves[it->second].holders[0], describe(u.leaves[it->second]), rank,
                       "a dict");
      const auto [it, fresh] = dict_at.emplace(d.key, u.dicts.size());
      if (fresh) {
        u.dicts.push_back(d);
        dict_owner[d.key] = rank;
        continue;
      }
      DictInfo& have = u.dicts[it->second];
      if (have.batch != d.batch)
        throw mismatch(d.key, dict_owner[d.key],
                       fmt::format("a dict of batch size {}", detail::shape_str(have.batch)), rank,
                       fmt::format("a dict of batch size {}", detail::shape_str(d.batch)));
      for (const auto& e : d.entries)
        if (std::find(have.entries.begin(), have.entries.end(), e) == have.entries.end())
          have.entries.push_back(e);
    }
    for (const auto& l : part.manifest.leaves) {
      if (dict_at.count(l.key) != 0)
        throw mismatch(l.key, dict_owner[l.key], "a dict", rank, describe(l));
      const auto [it, fresh] = leaf_at.emplace(l.key, u.leaves.size());
      if (fresh) {
        u.leaves.push_back(l);
        continue;
      }
      LeafInfo& have = u.leaves[it->second];
      if (have.dtype != l.dtype || have.shape != l.shape || have.sparse != l.sparse)
        throw mismatch(l.key, have.holders[0], describe(have), rank, describe(l));
      have.holders.insert(have.holders.end(), l.holders.begin(), l.holders.end());
      if (l.mine >= 0) have.mine = l.mine;
    }
  }
  for (auto& l : u.leaves) {
    if (dict_at.count(l.key) != 0)
      throw mismatch(l.key, dict_owner[l.key], "a dict", l.holders[0], describe(l));
    std::sort(l.holders.begin(), l.holders.end());
  }
  sort_leaves(u);
  return u;
}

// This rank's dict, described: its manifest and its tensors (in the layout's leaf order).
struct Described {
  DictLayout layout;
  std::vector<Tensor> tensors;
};

// Every rank's manifest in a group (one all_gather_dicts of each rank's encoded layout, its local
// error and, from rank 0, the nonce of the temporary name), or this process's alone.
struct Gathered {
  Manifest manifest;
  std::string nonce;
};

Tensor bytes_tensor(std::span<const std::byte> b) {
  Tensor t = Tensor::empty({static_cast<std::int64_t>(b.size())}, DType::UInt8);
  if (!b.empty()) std::memcpy(t.raw_data(), b.data(), b.size());
  return t;
}
std::vector<std::byte> tensor_bytes(const TensorDict& d, const char* key) {
  const Tensor& t = d.get(key);
  std::vector<std::byte> out(t.nbytes());
  if (!out.empty()) std::memcpy(out.data(), t.raw_data(), out.size());
  return out;
}

CollectiveOptions collective_options(const FileOptions& opts) {
  CollectiveOptions c;
  c.group = opts.group;
  c.timeout = opts.timeout;
  return c;
}

// Every rank's manifest from the gathered notes, each distinct layout decoded once (this rank's
// not at all: `own` is its layout): ranks whose encoded layouts are the same bytes hold the same
// manifest (a replicated model: one part, where decoding and merging every rank's 16384 leaves
// cost more than writing them).
std::vector<Part> distinct_parts(const std::vector<TensorDict>& all, int self,
                                 const DictLayout& own) {
  std::vector<std::vector<std::byte>> layouts;
  std::vector<std::vector<int>> ranks;
  for (std::size_t r = 0; r < all.size(); ++r) {
    auto bytes = tensor_bytes(all[r], "layout");
    const auto i = static_cast<std::size_t>(std::find(layouts.begin(), layouts.end(), bytes) -
                                            layouts.begin());
    if (i == layouts.size()) {
      layouts.push_back(std::move(bytes));
      ranks.emplace_back();
    }
    ranks[i].push_back(static_cast<int>(r));
  }
  std::vector<Part> parts;
  for (std::size_t i = 0; i < layouts.size(); ++i) {
    const bool local = std::find(ranks[i].begin(), ranks[i].end(), self) != ranks[i].end();
    if (local)
      parts.push_back({manifest_of(own, ranks[i], true), ranks[i]});
    else
      parts.push_back({manifest_of(detail::decode_layout(layouts[i]), ranks[i], false), ranks[i]});
  }
  return parts;
}

Gathered gather_manifests(const TensorDict& dict, Described& mine, const FileOptions& opts,
                          std::string_view what) {
  std::string error;
  try {
    mine.layout = detail::describe_dict(dict, mine.tensors);
  } catch (const std::exception& e) {
    error = e.what();
  }
  if (!opts.group) {
    if (!error.empty()) throw Error(fmt::format("{}: {}", what, error));
    Manifest m = manifest_of(mine.layout, {0}, true);
    sort_leaves(m);
    return {std::move(m), detail::temp_nonce()};
  }
  const int rank = opts.group->rank();
  TensorDict note;
  note.set("layout", bytes_tensor(error.empty() ? detail::encode_layout(mine.layout)
                                                : std::vector<std::byte>{}));
  note.set("error", bytes_tensor(std::as_bytes(std::span(error))));
  const std::string nonce = rank == 0 ? detail::temp_nonce() : std::string();
  note.set("nonce", bytes_tensor(std::as_bytes(std::span(nonce))));
  const auto all = all_gather_dicts(note, collective_options(opts));
  for (std::size_t r = 0; r < all.size(); ++r) {
    const auto err = tensor_bytes(all[r], "error");
    if (!err.empty())
      throw Error(fmt::format("{}: rank {}: {} (nothing was written)", what, r,
                              std::string(reinterpret_cast<const char*>(err.data()), err.size())));
  }
  const auto n = tensor_bytes(all[0], "nonce");
  return {union_of(distinct_parts(all, rank, mine.layout), what),
          std::string(reinterpret_cast<const char*>(n.data()), n.size())};
}

// A leaf's bytes in C order: its own memory when contiguous, else a contiguous copy kept in
// `keep`.
std::byte* leaf_bytes(const Tensor& t, std::vector<Tensor>& keep) {
  if (t.is_contiguous())
    // NOLINTNEXTLINE(cppcoreguidelines-pro-type-const-cast): writes only read the range
    return static_cast<std::byte*>(const_cast<void*>(t.raw_data()));
  keep.push_back(t.contiguous());
  return static_cast<std::byte*>(keep.back().raw_data());
}

std::uint64_t leaf_nbytes(const LeafInfo& l) {
  std::uint64_t n = itemsize(l.dtype);
  for (const auto d : l.shape) n *= static_cast<std::uint64_t>(d);
  return n;
}

struct GroupContext {
  std::shared_ptr<detail::GroupState> g;
  Clock::time_point deadline;
};
// Agrees on every rank's outcome of a step and throws the agreed error (after `cleanup`).
void settle(const GroupContext& ctx, const ErrorNote& mine, std::string_view what,
            const std::function<void()>& cleanup = {}) {
  const ErrorNote agreed = detail::agree_outcome(*ctx.g, mine, ctx.deadline, what);
  if (!agreed) return;
  if (cleanup) cleanup();
  detail::rethrow_note(agreed);
}

// The group and deadline of a call; a bad timeout on any rank is std::invalid_argument on every
// rank (agreed under the default timeout).
GroupContext group_context(const FileOptions& opts, std::string_view what) {
  const CollectiveOptions c = collective_options(opts);
  auto g = detail::group_of(c);
  g->checked_comm(what);
  const auto timeout = detail::timeout_of(c);
  const std::string problem = detail::timeout_problem(timeout);
  GroupContext ctx{std::move(g),
                   detail::deadline_after(problem.empty() ? timeout : detail::timeout_of({}))};
  ErrorNote note;
  if (!problem.empty()) note = {'I', fmt::format("{}: {}", what, problem)};
  settle(ctx, note, what);
  return ctx;
}

// A save: its temporary name beside the target, and (in a group) the agreed steps. A failure
// anywhere removes the temporary copy (rank 0's job in a group) and throws the same error on
// every rank.
struct Save {
  fs::path tmp;
  std::string what;
  std::optional<GroupContext> ctx;  // set: a group save

  // One process: runs `body`, removing the temporary copy if it throws.
  template <class F>
  void serial(F&& body) const {
    try {
      body();
    } catch (...) {
      detail::remove_quietly(tmp);
      throw;
    }
  }
  // One agreed step of a group save; `undo` runs on every rank before the cleanup on a failure.
  template <class F>
  void step(F&& body, const std::function<void()>& undo = {}) const {
    settle(*ctx, detail::capture_error(body), what, [&] {
      if (undo) undo();
      if (ctx->g->rank == 0) detail::remove_quietly(tmp);
    });
  }
  // Every rank names the same target, and may drop its old copy's page cache.
  void agree_target(const fs::path& target) const {
    settle(*ctx, detail::check_same_path(*ctx->g, target, ctx->deadline, what), what);
  }
  // Writes `ranges` (this rank's, disjoint from the others') into the file `path` of `bytes`
  // bytes with collective MPI-IO: rank 0 creates it with its size, every rank checks that it can
  // open it, then the collective open, write, sync and close, each step agreed.
  void collective_write(const fs::path& path, std::uint64_t bytes,
                        std::span<const FileRange> ranges) const {
    const int rank = ctx->g->rank;
    step([&] {
      if (rank == 0) CollectiveFile::create_sized(path, bytes);
    });
    step([&] { CollectiveFile::check_openable(path, true); });
    std::optional<CollectiveFile> f;
    step([&] { f.emplace(CollectiveFile::open(*ctx->g, path, true, ctx->deadline)); });
    auto close_quietly = [&] { f.reset(); };
    step(
        [&] {
          f->write(ranges);
          f->sync();
        },
        close_quietly);
    step([&] { f->close(); }, close_quietly);
  }
};

// ---- safetensors -------------------------------------------------------------------------------

struct SafetensorsPlan {
  detail::EncodedHeader header;
};

SafetensorsPlan plan_safetensors(const Manifest& m, std::string_view what) {
  std::vector<detail::PlannedTensor> tensors;
  detail::DictStructure s;
  s.version = kVersion;
  std::map<std::string, const KeyPath*> flat;
  for (const auto& l : m.leaves) {
    if (l.sparse)
      throw Error(
          fmt::format("{}: key '{}' is a sparse tensor; safetensors holds dense tensors (save "
                      "to_dense() instead)",
                      what, key_str(l.key)));
    std::string f = detail::flat_name(l.key);
    if (const auto [it, fresh] = flat.emplace(f, &l.key); !fresh)
      throw Error(fmt::format("{}: keys '{}' and '{}' would both be the tensor '{}' in the file",
                              what, key_str(*it->second), key_str(l.key), f));
    const auto& parts = l.key;
    if (std::any_of(parts.begin(), parts.end(),
                    [](const std::string& p) { return p.find('.') != std::string::npos; }))
      s.keys.emplace(f, l.key);
    tensors.push_back({std::move(f), l.dtype, l.shape});
  }
  for (const auto& d : m.dicts) s.dicts.emplace_back(d.key, d.batch);
  try {
    return {detail::encode_safetensors_header(
        tensors,
        {{"format", "pt"}, {std::string(detail::kStructureMetadataKey), encode_structure(s)}})};
  } catch (const Error& e) {
    throw Error(fmt::format("{}: {}", what, e.what()));
  }
}

// Holder p of h writes bytes [share(len, h, p), share(len, h, p + 1)) of a run of len bytes
// (computed without overflow).
std::uint64_t share(std::uint64_t len, std::uint64_t h, std::uint64_t p) {
  return len / h * p + len % h * p / h;
}

// The byte ranges this rank writes: the header (rank 0), and per run of consecutive tensors with
// the same holders, an equal share of the run's bytes for each holder.
std::vector<FileRange> my_ranges(const Manifest& m, const SafetensorsPlan& plan,
                                 const Described& mine, int rank, std::vector<Tensor>& keep) {
  std::vector<FileRange> out;
  const std::uint64_t base = plan.header.bytes.size();
  if (rank == 0)
    // NOLINTNEXTLINE(cppcoreguidelines-pro-type-const-cast): writes only read the range
    out.push_back({0, const_cast<std::byte*>(plan.header.bytes.data()), base});
  std::size_t i = 0;
  while (i < m.leaves.size()) {
    std::size_t j = i + 1;
    while (j < m.leaves.size() && m.leaves[j].holders == m.leaves[i].holders) ++j;
    const auto& holders = m.leaves[i].holders;
    const auto me = std::find(holders.begin(), holders.end(), rank);
    if (me != holders.end()) {
      const std::uint64_t start = plan.header.begin[i];
      const std::uint64_t len = plan.header.begin[j - 1] + leaf_nbytes(m.leaves[j - 1]) - start;
      const std::uint64_t h = holders.size();
      const auto p = static_cast<std::uint64_t>(me - holders.begin());
      const std::uint64_t lo = start + share(len, h, p);
      const std::uint64_t hi = start + share(len, h, p + 1);
      for (std::size_t k = i; k < j && lo < hi; ++k) {
        const std::uint64_t b = plan.header.begin[k], e = b + leaf_nbytes(m.leaves[k]);
        const std::uint64_t x = std::max(b, lo), y = std::min(e, hi);
        if (x >= y) continue;
        std::byte* data =
            leaf_bytes(mine.tensors[static_cast<std::size_t>(m.leaves[k].mine)], keep);
        out.push_back({base + x, data + (x - b), y - x});
      }
    }
    i = j;
  }
  return out;
}

// What a load reads: each tensor's entry and its key, in canonical order.
struct LoadItem {
  Key key;
  const detail::SafetensorsEntry* entry = nullptr;
};

struct Loaded {
  TensorDict dict;
  std::vector<FileRange> ranges;
};

// One storage per dtype, handed out as consecutive views, so that a loaded dict is consolidated:
// each dtype's leaves back to back, in the order they are taken. count() every tensor, then
// allocate(), then take() each.
class ConsolidatedStorage {
 public:
  void count(DType dtype, const Shape& shape) {
    total_[index(dtype)] += detail::shape_numel(shape);
  }
  void allocate() {
    for (std::size_t k = 0; k < kNumDTypes; ++k)
      if (total_[k] > 0) storage_[k] = Tensor::empty({total_[k]}, static_cast<DType>(k));
  }
  // The next view of `dtype`'s storage; a tensor of its own when `shape` has no elements.
  Tensor take(DType dtype, const Shape& shape) {
    const std::size_t k = index(dtype);
    const std::int64_t n = detail::shape_numel(shape);
    Tensor t =
        n == 0 ? Tensor::empty(shape, dtype) : storage_[k].slice(0, at_[k], at_[k] + n).view(shape);
    at_[k] += n;
    return t;
  }

 private:
  static std::size_t index(DType dtype) { return static_cast<std::size_t>(dtype); }
  std::array<std::int64_t, kNumDTypes> total_{};
  std::array<Tensor, kNumDTypes> storage_;
  std::array<std::int64_t, kNumDTypes> at_{};
};

// The consolidated dict of `items` (one storage per dtype, leaves in canonical order) and the
// file ranges that fill it. `dict` already holds the structure (its sub-dicts) the leaves go into.
Loaded allocate(std::vector<LoadItem>& items, std::uint64_t data_start, TensorDict dict,
                std::string_view file) {
  std::sort(items.begin(), items.end(),
            [](const LoadItem& a, const LoadItem& b) { return a.key < b.key; });
  ConsolidatedStorage storage;
  for (const auto& it : items) storage.count(*it.entry->dtype, it.entry->shape);
  storage.allocate();
  Loaded out{std::move(dict), {}};
  for (const auto& it : items) {
    Tensor t = storage.take(*it.entry->dtype, it.entry->shape);
    if (t.numel() > 0)
      out.ranges.push_back({data_start + it.entry->begin, static_cast<std::byte*>(t.raw_data()),
                            it.entry->end - it.entry->begin});
    try {
      out.dict.set(it.key, std::move(t));
    } catch (const std::exception& e) {
      throw Error(fmt::format("{}: tensor '{}' cannot be placed at key '{}': {}", file,
                              it.entry->name, it.key.str(), e.what()));
    }
  }
  return out;
}

Loaded plan_load(const detail::SafetensorsHeader& h, const TensorDict* like,
                 const std::string& file) {
  std::map<std::string_view, const detail::SafetensorsEntry*> by_name;
  for (const auto& e : h.entries) by_name.emplace(e.name, &e);
  auto unsupported = [&](const detail::SafetensorsEntry& e) {
    return Error(fmt::format("{}: tensor '{}': dtype {} is not supported by tensordict-mpi", file,
                             e.name, e.dtype_name));
  };
  std::vector<LoadItem> items;
  if (like != nullptr) {
    TensorDict dict(like->batch_size());
    for (const Key& k : like->keys(true)) {
      if (like->is_dict(k)) {
        dict.set(k, TensorDict(like->get_dict(k).batch_size()));
        continue;
      }
      const Tensor& want = like->get(k);
      const std::string f = detail::flat_name(k.parts());
      const auto it = by_name.find(f);
      if (it == by_name.end())
        throw KeyError(
            fmt::format("{}: no tensor '{}' (key '{}' of the dict to load)", file, f, k.str()));
      const auto& e = *it->second;
      if (!e.dtype) throw unsupported(e);
      if (*e.dtype != want.dtype() || e.shape != want.shape())
        throw LayoutMismatchError(fmt::format(
            "{}: tensor '{}' is {}{} in the file, but key '{}' of the dict to load is {}{}", file,
            f, name(*e.dtype), detail::shape_str(e.shape), k.str(), name(want.dtype()),
            detail::shape_str(want.shape())));
      items.push_back({k, &e});
    }
    return allocate(items, h.data_start, std::move(dict), file);
  }
  detail::DictStructure s;
  if (const auto it = h.metadata.find(std::string(detail::kStructureMetadataKey));
      it != h.metadata.end())
    s = detail::decode_structure(it->second, file);
  Shape root;
  for (const auto& [k, batch] : s.dicts)
    if (k.empty()) root = batch;
  TensorDict dict(root);
  for (const auto& [k, batch] : s.dicts) {
    if (k.empty()) continue;
    try {
      if (!dict.contains(key_of(k))) dict.set(key_of(k), TensorDict(batch));
    } catch (const std::exception& e) {
      throw Error(fmt::format("{}: the recorded dict '{}' cannot be rebuilt: {}", file, key_str(k),
                              e.what()));
    }
  }
  for (const auto& e : h.entries) {
    if (!e.dtype) throw unsupported(e);
    Key key("x");
    if (const auto it = s.keys.find(e.name); it != s.keys.end()) {
      key = key_of(it->second);
    } else {
      try {
        key = Key::parse(e.name);
      } catch (const std::invalid_argument&) {
        throw Error(
            fmt::format("{}: tensor '{}': its name is not a key (an empty part)", file, e.name));
      }
    }
    items.push_back({std::move(key), &e});
  }
  return allocate(items, h.data_start, std::move(dict), file);
}

std::string what_of(std::string_view call, const fs::path& path) {
  return fmt::format("{} {}", call, path.string());
}

// ---- memmap ----------------------------------------------------------------------------------

// Where a key's file or directory is under `root`: one encoded directory per parent part.
fs::path memmap_path(const fs::path& root, const KeyPath& key, bool leaf) {
  fs::path p = root;
  const auto& parts = key;
  for (std::size_t i = 0; i < parts.size(); ++i) {
    const std::string enc = detail::memmap_file_name(parts[i]);
    p /= (leaf && i + 1 == parts.size()) ? enc + ".memmap" : enc;
  }
  return p;
}

void check_memmap(const Manifest& m, std::string_view what) {
  for (const auto& l : m.leaves)
    if (l.sparse)
      throw Error(fmt::format("{}: key '{}' is a sparse tensor; save to_dense() instead", what,
                              key_str(l.key)));
  for (const auto& d : m.dicts) {
    std::map<std::string, std::string> names;  // file name -> key name
    for (const auto& [n, is_dict] : d.entries) {
      if (detail::is_memmap_reserved_key(n))
        throw Error(
            fmt::format("{}: key '{}': tensordict's meta.json uses '{}' for the dict's own "
                        "field; rename the key",
                        what, key_str(child(d.key, n)), n));
      std::string f = detail::memmap_file_name(n) + (is_dict ? "" : ".memmap");
      if (f == "meta.json" || !names.emplace(f, n).second)
        throw Error(fmt::format("{}: key '{}' would take the file name '{}' of another entry", what,
                                key_str(child(d.key, n)), f));
    }
  }
}

std::string meta_json(const DictInfo& d, const std::map<KeyPath, const LeafInfo*>& leaves) {
  detail::MemmapMeta meta;
  meta.batch = d.batch;
  for (const auto& [n, is_dict] : d.entries) {
    detail::MemmapEntry e;
    e.key = n;
    e.is_dict = is_dict;
    if (!is_dict) {
      const LeafInfo& l = *leaves.at(child(d.key, n));
      e.dtype = l.dtype;
      e.shape = l.shape;
    }
    meta.entries.push_back(std::move(e));
  }
  return detail::encode_memmap_meta(meta);
}

// In a group, a leaf held by several ranks and at least this large is written by its holders
// together with collective MPI-IO (an equal share each); the others by one of their holders (leaf
// i: holder i mod the number of holders) with POSIX calls, as one process writes them.
constexpr std::uint64_t kCollectiveLeafBytes = std::uint64_t{4} << 20;

bool collective_leaf(const LeafInfo& l, bool group) {
  return group && l.holders.size() > 1 && leaf_nbytes(l) >= kCollectiveLeafBytes;
}

// Writes the leaves this rank writes alone under `root`.
void write_memmap_leaves(const Manifest& m, const Described& mine, int rank, const fs::path& root,
                         bool group) {
  std::vector<Tensor> keep;
  for (std::size_t i = 0; i < m.leaves.size(); ++i) {
    const LeafInfo& l = m.leaves[i];
    if (l.holders[i % l.holders.size()] != rank || collective_leaf(l, group)) continue;
    const std::uint64_t n = leaf_nbytes(l);
    if (n == 0) continue;  // tensordict writes no file for a leaf without elements
    keep.clear();
    std::byte* data = leaf_bytes(mine.tensors[static_cast<std::size_t>(l.mine)], keep);
    LocalFile f = LocalFile::create(memmap_path(root, l.key, true));
    const FileRange r{0, data, n};
    f.write({&r, 1});
    f.sync();
    f.close();
  }
}

// Writes the leaves a group writes together (collective_leaf), one collective file each.
void write_shared_leaves(const Save& save, const Manifest& m, const Described& mine,
                         const fs::path& root) {
  const int rank = save.ctx->g->rank;
  for (const LeafInfo& l : m.leaves) {
    if (!collective_leaf(l, true)) continue;
    const std::uint64_t n = leaf_nbytes(l);
    std::vector<Tensor> keep;
    std::vector<FileRange> ranges;
    save.step([&] {
      const auto me = std::find(l.holders.begin(), l.holders.end(), rank);
      if (me == l.holders.end()) return;
      const auto p = static_cast<std::uint64_t>(me - l.holders.begin());
      const std::uint64_t lo = share(n, l.holders.size(), p),
                          hi = share(n, l.holders.size(), p + 1);
      std::byte* data = leaf_bytes(mine.tensors[static_cast<std::size_t>(l.mine)], keep);
      if (hi > lo) ranges.push_back({lo, data + lo, hi - lo});
    });
    save.collective_write(memmap_path(root, l.key, true), n, ranges);
  }
}

void write_memmap_dirs(const Manifest& m, const fs::path& root) {
  for (const auto& d : m.dicts) fs::create_directories(memmap_path(root, d.key, false));
}

void write_memmap_meta(const Manifest& m, const fs::path& root) {
  std::map<KeyPath, const LeafInfo*> leaves;
  for (const auto& l : m.leaves) leaves.emplace(l.key, &l);
  for (auto it = m.dicts.rbegin(); it != m.dicts.rend(); ++it) {
    const fs::path dir = memmap_path(root, it->key, false);
    detail::write_small_file(dir / "meta.json", meta_json(*it, leaves));
    detail::sync_directory(dir);
  }
}

// What a memmap directory holds, from its meta.json files: every leaf with the file that holds
// it, and every dict with its meta.json, parents first ([0] is the root).
struct MemmapLeaf {
  KeyPath key;
  DType dtype = DType::Float32;
  Shape shape;
  fs::path path;
};
struct MemmapDict {
  KeyPath key;
  detail::MemmapMeta meta;
};
struct MemmapTree {
  std::vector<MemmapLeaf> leaves;
  std::vector<MemmapDict> dicts;
};

// The directory of the dict `key` under `path` (whose meta.json is `meta_file`).
fs::path memmap_dict_dir(const fs::path& path, const std::string& key, const fs::path& meta_file) {
  fs::path sub = path / detail::memmap_file_name(key);
  if (!fs::is_directory(sub) && key.find('/') == std::string::npos && fs::is_directory(path / key))
    sub = path / key;  // written by an older tensordict, without key encoding
  if (!fs::is_directory(sub))
    throw Error(fmt::format("{}: key '{}': its directory {} is missing", meta_file.string(), key,
                            sub.string()));
  return sub;
}

// The file of the leaf `key` under `path`.
fs::path memmap_leaf_file(const fs::path& path, const std::string& key) {
  fs::path file = path / (detail::memmap_file_name(key) + ".memmap");
  if (!fs::exists(file) && key.find('/') == std::string::npos &&
      fs::exists(path / (key + ".memmap")))
    file = path / (key + ".memmap");
  return file;
}

// Reads the meta.json of `dir` and of every directory below it, breadth first.
MemmapTree read_memmap_tree(const fs::path& dir) {
  MemmapTree tree;
  std::vector<std::pair<KeyPath, fs::path>> todo{{KeyPath{}, dir}};
  for (std::size_t q = 0; q < todo.size(); ++q) {
    const auto [key, path] = todo[q];
    if (key.size() > detail::kCheckpointMaxDims * 4)
      throw Error(fmt::format("{}: nested too deeply", path.string()));
    const fs::path meta_file = path / "meta.json";
    const std::string text = detail::read_small_file(meta_file, detail::kSafetensorsMaxHeaderBytes);
    detail::MemmapMeta meta = detail::decode_memmap_meta(text, meta_file.string());
    for (const auto& e : meta.entries) {
      KeyPath k = child(key, e.key);
      if (e.is_dict)
        todo.emplace_back(std::move(k), memmap_dict_dir(path, e.key, meta_file));
      else
        tree.leaves.push_back({std::move(k), e.dtype, e.shape, memmap_leaf_file(path, e.key)});
    }
    tree.dicts.push_back({key, std::move(meta)});
  }
  return tree;
}

// Fills `t` (leaf `l`'s tensor, with elements) from its file.
void read_memmap_file(const fs::path& dir, const MemmapLeaf& l, Tensor& t) {
  if (!fs::exists(l.path))
    throw Error(fmt::format("{}: key '{}': its file {} is missing", dir.string(), key_str(l.key),
                            l.path.string()));
  LocalFile f = LocalFile::open_read(l.path);
  const std::uint64_t want = t.nbytes();
  if (f.size() < want)
    throw Error(fmt::format("{}: key '{}': truncated: {} holds {} bytes, {}{} needs {}",
                            dir.string(), key_str(l.key), l.path.string(), f.size(), name(l.dtype),
                            detail::shape_str(l.shape), want));
  const FileRange r{0, static_cast<std::byte*>(t.raw_data()), want};
  f.read({&r, 1});
}

// Every leaf's tensor, read into one storage per dtype (leaves in canonical order).
std::map<KeyPath, Tensor> read_memmap_leaves(const fs::path& dir,
                                             const std::vector<MemmapLeaf>& leaves) {
  std::vector<std::size_t> order(leaves.size());
  for (std::size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::sort(order.begin(), order.end(),
            [&](std::size_t a, std::size_t b) { return leaves[a].key < leaves[b].key; });
  ConsolidatedStorage storage;
  for (const auto& l : leaves) storage.count(l.dtype, l.shape);
  storage.allocate();
  std::map<KeyPath, Tensor> tensors;
  for (const std::size_t i : order) {
    const MemmapLeaf& l = leaves[i];
    Tensor t = storage.take(l.dtype, l.shape);
    if (t.numel() > 0) read_memmap_file(dir, l, t);
    tensors.emplace(l.key, std::move(t));
  }
  return tensors;
}

// The dict of `dicts` (each entry in its meta.json's order) with the leaves `tensors`.
TensorDict assemble_memmap(const fs::path& dir, const std::vector<MemmapDict>& dicts,
                           const std::map<KeyPath, Tensor>& tensors) {
  TensorDict out(dicts[0].meta.batch);
  for (const auto& d : dicts) {
    for (const auto& e : d.meta.entries) {
      const KeyPath k = child(d.key, e.key);
      try {
        if (e.is_dict) {
          const auto sub = std::find_if(dicts.begin(), dicts.end(),
                                        [&](const MemmapDict& x) { return x.key == k; });
          out.set(key_of(k), TensorDict(sub->meta.batch));
        } else {
          out.set(key_of(k), tensors.at(k));
        }
      } catch (const std::exception& err) {
        throw Error(
            fmt::format("{}: key '{}' cannot be placed: {}", dir.string(), key_str(k), err.what()));
      }
    }
  }
  return out;
}

// Reads a memmap directory (each rank all of it).
TensorDict read_memmap(const fs::path& dir) {
  const MemmapTree tree = read_memmap_tree(dir);
  return assemble_memmap(dir, tree.dicts, read_memmap_leaves(dir, tree.leaves));
}

}  // namespace

// ---- public functions ------------------------------------------------------------------------

void save_safetensors(const TensorDict& dict, const fs::path& file, const FileOptions& opts) {
  const std::string what = what_of("save_safetensors", file);
  Described mine;
  const Gathered gathered = gather_manifests(dict, mine, opts, what);
  const Manifest& m = gathered.manifest;
  const SafetensorsPlan plan = plan_safetensors(m, what);
  Save save{detail::temp_path_beside(file, gathered.nonce), what, std::nullopt};
  const std::uint64_t total = plan.header.bytes.size() + plan.header.data_bytes;
  std::vector<Tensor> keep;

  if (!opts.group) {
    save.serial([&] {
      const auto ranges = my_ranges(m, plan, mine, 0, keep);
      detail::drop_cached(file);
      LocalFile f = LocalFile::create(save.tmp);
      f.write(ranges);
      f.sync();
      f.close();
      detail::replace_file(save.tmp, file);
    });
    return;
  }

  save.ctx = group_context(opts, what);
  save.agree_target(file);
  const int rank = save.ctx->g->rank;
  std::vector<FileRange> ranges;
  save.step([&] {
    ranges = my_ranges(m, plan, mine, rank, keep);
    detail::drop_cached(file);
  });
  save.collective_write(save.tmp, total, ranges);
  save.step([&] {
    if (rank == 0) detail::replace_file(save.tmp, file);
  });
}

namespace {

// A safetensors file's size and its header's JSON text.
struct HeaderBytes {
  std::uint64_t file_size = 0;
  std::vector<std::byte> json;
};

// Reads the header of the open file `f`: a LocalFile, or a CollectiveFile that every rank of a
// group reads. Each of the three steps (the length, its check, the JSON text) runs through
// `run_step`, where a group agrees on the step's outcome before the next collective read.
template <class File, class RunStep>
HeaderBytes read_header(File& f, const std::string& name, RunStep&& run_step) {
  HeaderBytes out;
  std::array<std::byte, 8> first{};
  run_step([&] {
    out.file_size = f.size();
    const FileRange r{0, first.data(), std::min<std::uint64_t>(out.file_size, 8)};
    f.read({&r, 1});
  });
  std::uint64_t n = 0;
  run_step([&] {
    n = detail::safetensors_header_length(first, out.file_size, name);
    out.json.resize(n);
  });
  run_step([&] {
    const FileRange r{8, out.json.data(), n};
    f.read({&r, 1});
  });
  return out;
}

// One process reads the file.
TensorDict load_safetensors_alone(const fs::path& file, const TensorDict* like) {
  const std::string name = file.string();
  LocalFile f = LocalFile::open_read(file);
  const HeaderBytes header = read_header(f, name, [](const auto& step) { step(); });
  const auto h = detail::decode_safetensors_header(header.json, header.file_size, name);
  Loaded l = plan_load(h, like, name);
  f.read(l.ranges);
  return std::move(l.dict);
}

// The ranges of `ranges` (this rank's reads) that every rank of the group reads, which are read
// once and broadcast (read_shared), and the others, which the ranks that ask for them read. Every
// rank parsed the same header `h`: entry i is the same everywhere.
void split_shared_reads(const GroupContext& ctx, const detail::SafetensorsHeader& h,
                        const std::vector<FileRange>& ranges, std::string_view what,
                        std::vector<FileRange>& shared, std::vector<FileRange>& own) {
  // Entry i of the header (sorted by offset): 1 where this rank reads it, then AND.
  std::vector<std::uint8_t> wanted(h.entries.size(), 0);
  auto entry_of = [&](const FileRange& r) {
    const std::uint64_t begin = r.offset - h.data_start;
    const auto it = std::lower_bound(
        h.entries.begin(), h.entries.end(), begin,
        [](const detail::SafetensorsEntry& e, std::uint64_t b) { return e.begin < b; });
    return static_cast<std::size_t>(it - h.entries.begin());
  };
  for (const auto& r : ranges) wanted[entry_of(r)] = 1;
  detail::and_over_ranks(*ctx.g, wanted, ctx.deadline, what);
  for (const auto& r : ranges) (wanted[entry_of(r)] != 0 ? shared : own).push_back(r);
}

// A group reads the file with collective MPI-IO, every step agreed.
TensorDict load_safetensors_together(const fs::path& file, const TensorDict* like,
                                     const FileOptions& opts) {
  const std::string name = file.string();
  const std::string what = what_of("load_safetensors", file);
  const GroupContext ctx = group_context(opts, what);
  settle(ctx, detail::check_same_path(*ctx.g, file, ctx.deadline, what), what);
  settle(ctx, detail::capture_error([&] {
           if (!fs::is_regular_file(file)) throw Error(fmt::format("{}: no such file", name));
           CollectiveFile::check_openable(file, false);
         }),
         what);
  std::optional<CollectiveFile> f;
  settle(ctx, detail::capture_error([&] {
           f.emplace(CollectiveFile::open(*ctx.g, file, false, ctx.deadline));
         }),
         what);
  const HeaderBytes header = read_header(
      *f, name, [&](const auto& step) { settle(ctx, detail::capture_error(step), what); });
  std::optional<detail::SafetensorsHeader> h;
  std::optional<Loaded> l;
  settle(ctx, detail::capture_error([&] {
           h.emplace(detail::decode_safetensors_header(header.json, header.file_size, name));
           l.emplace(plan_load(*h, like, name));
         }),
         what);
  std::vector<FileRange> shared, own;
  settle(ctx,
         detail::capture_error([&] { split_shared_reads(ctx, *h, l->ranges, what, shared, own); }),
         what);
  settle(ctx, detail::capture_error([&] { f->read_shared(shared, own); }), what);
  settle(ctx, detail::capture_error([&] { f->close(); }), what);
  return std::move(l->dict);
}

TensorDict load_safetensors_impl(const fs::path& file, const TensorDict* like,
                                 const FileOptions& opts) {
  return opts.group ? load_safetensors_together(file, like, opts)
                    : load_safetensors_alone(file, like);
}

}  // namespace

TensorDict load_safetensors(const fs::path& file, const FileOptions& opts) {
  return load_safetensors_impl(file, nullptr, opts);
}

TensorDict load_safetensors(const fs::path& file, const TensorDict& like, const FileOptions& opts) {
  return load_safetensors_impl(file, &like, opts);
}

void save_memmap(const TensorDict& dict, const fs::path& dir, const FileOptions& opts) {
  const std::string what = what_of("save_memmap", dir);
  Described mine;
  const Gathered gathered = gather_manifests(dict, mine, opts, what);
  const Manifest& m = gathered.manifest;
  check_memmap(m, what);
  Save save{detail::temp_path_beside(dir, gathered.nonce), what, std::nullopt};
  if (!opts.group) {
    save.serial([&] {
      write_memmap_dirs(m, save.tmp);
      write_memmap_leaves(m, mine, 0, save.tmp, false);
      write_memmap_meta(m, save.tmp);
      detail::replace_directory(save.tmp, dir);
    });
    return;
  }
  save.ctx = group_context(opts, what);
  save.agree_target(dir);
  const int rank = save.ctx->g->rank;
  save.step([&] {
    if (rank == 0) write_memmap_dirs(m, save.tmp);
  });
  save.step([&] { write_memmap_leaves(m, mine, rank, save.tmp, true); });
  write_shared_leaves(save, m, mine, save.tmp);
  save.step([&] {
    if (rank == 0) {
      write_memmap_meta(m, save.tmp);
      detail::replace_directory(save.tmp, dir);
    }
  });
}

TensorDict load_memmap(const fs::path& dir, const FileOptions& opts) {
  if (!opts.group) return read_memmap(dir);
  const std::string what = what_of("load_memmap", dir);
  const GroupContext ctx = group_context(opts, what);
  settle(ctx, detail::check_same_path(*ctx.g, dir, ctx.deadline, what), what);
  TensorDict out;
  settle(ctx, detail::capture_error([&] { out = read_memmap(dir); }), what);
  return out;
}

}  // namespace td
