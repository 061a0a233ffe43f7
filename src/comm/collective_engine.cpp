#include "comm/collective_engine.hpp"

#include <algorithm>
#include <climits>
#include <cstring>
#include <numeric>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "core/config.hpp"
#include "runtime/log.hpp"

namespace td {

namespace detail {

namespace {

using Clock = std::chrono::steady_clock;

std::uint64_t mix(std::uint64_t h, std::uint64_t v) {
  h ^= v + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2);
  return h * 0xff51afd7ed558ccdull;
}

std::string shape_str(const Shape& s) { return fmt::format("[{}]", fmt::join(s, ", ")); }

std::string leaf_str(const LeafLayout& l, std::span<const LeafRef> leaves) {
  std::string s = fmt::format("{}{}", name(l.dtype), shape_str(l.shape));
  if (l.sparse) s += " sparse";
  if (!l.contiguous && !l.sparse) s += " non-contiguous";
  if (l.alias_of >= 0)
    s += fmt::format(" alias of '{}'", leaves[static_cast<std::size_t>(l.alias_of)].key->str());
  return s;
}

std::string cap_str(std::optional<std::size_t> cap) {
  if (!cap) return "none";
  if (*cap == kAutoBucketBytes) return "auto";
  return std::to_string(*cap);
}

}  // namespace

// ---- local analysis of the leaves --------------------------------------------------------

struct Analysis {
  std::uint32_t dtype_mask = 0;  // bit d set when some leaf has dtype d
  bool any_sparse = false;
  std::vector<LeafLayout> layout;
  std::string arg_error;          // first bad argument found on this rank ("" if none)
  std::uint64_t layout_hash = 0;  // keys + layouts: the plan cache key
  // Where each dense leaf's elements start, and its storage (null for undefined and sparse
  // leaves): stable while the layout ids are, so the packer reads flat arrays instead of
  // chasing dict entry -> tensor -> storage for every leaf of every call.
  std::shared_ptr<LeafMemory> memory;
};

namespace {

void note_error(std::string& err, std::string msg) {
  if (err.empty()) err = std::move(msg);
}

// Element offsets (in bytes from the storage start) of a strided view, sorted.
std::vector<std::int64_t> element_offsets(const Tensor& t) {
  std::vector<std::int64_t> out;
  const auto isz = static_cast<std::int64_t>(itemsize(t.dtype()));
  const Shape& shape = t.shape();
  const Shape& strides = t.strides();
  std::vector<std::int64_t> idx(shape.size(), 0);
  const std::int64_t base = TensorAccess::byte_offset(t);
  for (std::int64_t n = 0, total = t.numel(); n < total; ++n) {
    std::int64_t off = 0;
    for (std::size_t k = 0; k < shape.size(); ++k) off += idx[k] * strides[k];
    out.push_back(base + off * isz);
    for (std::size_t k = shape.size(); k-- > 0;) {
      if (++idx[k] < shape[k]) break;
      idx[k] = 0;
    }
  }
  std::sort(out.begin(), out.end());
  return out;
}

// Finds keys that view the same elements (reduced once: later ones become aliases) and rejects
// keys whose views overlap without being identical.
void find_aliases(std::span<const LeafRef> leaves, Analysis& a) {
  struct Extent {
    const Storage* storage;
    std::int64_t lo, hi;
    std::size_t leaf;
  };
  std::vector<Extent> ext;
  for (std::size_t i = 0; i < leaves.size(); ++i) {
    const Tensor& t = *leaves[i].tensor;
    if (!t.defined() || t.is_sparse() || t.numel() == 0) continue;
    if (TensorAccess::storage_use_count(t) < 2) continue;  // nobody else holds this storage
    const auto isz = static_cast<std::int64_t>(itemsize(t.dtype()));
    std::int64_t span = 0;
    for (std::size_t k = 0; k < t.shape().size(); ++k) span += (t.shape()[k] - 1) * t.strides()[k];
    const std::int64_t lo = TensorAccess::byte_offset(t);
    ext.push_back({TensorAccess::storage(t), lo, lo + (span + 1) * isz, i});
  }
  if (ext.size() < 2) return;
  auto by_place = [](const Extent& x, const Extent& y) {
    return std::tie(x.storage, x.lo, x.leaf) < std::tie(y.storage, y.lo, y.leaf);
  };
  if (!std::is_sorted(ext.begin(), ext.end(), by_place))
    std::sort(ext.begin(), ext.end(), by_place);
  std::vector<std::size_t>
      active;  // earlier extents of this storage that may reach the current one
  for (std::size_t e = 0; e < ext.size(); ++e) {
    if (e > 0 && ext[e].storage != ext[e - 1].storage) active.clear();
    const Extent& cur = ext[e];
    std::erase_if(active, [&](std::size_t p) { return ext[p].hi <= cur.lo; });
    for (std::size_t p : active) {
      const Tensor& x = *leaves[ext[p].leaf].tensor;
      const Tensor& y = *leaves[cur.leaf].tensor;
      const bool identical = ext[p].lo == cur.lo && x.dtype() == y.dtype() &&
                             x.shape() == y.shape() && x.strides() == y.strides();
      if (identical) {
        // the first key in canonical order owns the region; ext is sorted by leaf among equals
        const std::size_t owner = a.layout[ext[p].leaf].alias_of >= 0
                                      ? static_cast<std::size_t>(a.layout[ext[p].leaf].alias_of)
                                      : ext[p].leaf;
        a.layout[cur.leaf].alias_of = static_cast<std::int64_t>(owner);
        break;
      }
      bool overlap = x.is_contiguous() && y.is_contiguous();
      if (!overlap) {
        const auto ox = element_offsets(x), oy = element_offsets(y);
        std::vector<std::int64_t> common;
        std::set_intersection(ox.begin(), ox.end(), oy.begin(), oy.end(),
                              std::back_inserter(common));
        overlap = !common.empty();
      }
      if (overlap) {
        note_error(
            a.arg_error,
            fmt::format("keys '{}' and '{}' hold overlapping but different views of one storage; "
                        "reducing both would count shared elements twice",
                        leaves[ext[p].leaf].key->str(), leaves[cur.leaf].key->str()));
      }
    }
    if (a.layout[cur.leaf].alias_of < 0) active.push_back(e);
  }
}

// Whether each dtype's reduced dense leaves lie back to back, in canonical order, in one storage
// (LeafMemory::spans). The leaves a plan skips (aliases, empty) and sparse leaves do not count.
void find_spans(Analysis& a) {
  LeafMemory& m = *a.memory;
  m.spans.clear();
  m.one_span_per_dtype = false;
  std::array<int, kNumDTypes> span_of{};
  span_of.fill(-1);
  std::array<const Storage*, kNumDTypes> storage_of{};
  for (std::size_t i = 0; i < a.layout.size(); ++i) {
    const LeafLayout& l = a.layout[i];
    if (m.data[i] == nullptr || l.sparse || l.alias_of >= 0) continue;  // undefined, sparse, alias
    const std::size_t n = l.nbytes();
    if (n == 0) continue;
    if (!l.contiguous) return;
    const auto d = static_cast<std::size_t>(l.dtype);
    if (span_of[d] < 0) {
      span_of[d] = static_cast<int>(m.spans.size());
      storage_of[d] = m.storage[i];
      m.spans.push_back({l.dtype, m.data[i], n});
      continue;
    }
    auto& sp = m.spans[static_cast<std::size_t>(span_of[d])];
    if (m.storage[i] != storage_of[d] || m.data[i] != sp.data + sp.nbytes) return;
    sp.nbytes += n;
  }
  m.one_span_per_dtype = true;
}

// The op-independent part: layouts, aliasing, undefined leaves, the layout hash.
Analysis analyse_layout(std::span<const LeafRef> leaves) {
  Analysis a;
  a.layout.resize(leaves.size());
  std::uint64_t h = 0x51ed270b27ull;
  for (std::size_t i = 0; i < leaves.size(); ++i) {
    const Tensor& t = *leaves[i].tensor;
    LeafLayout& l = a.layout[i];
    if (!t.defined()) {
      note_error(a.arg_error,
                 fmt::format("key '{}' holds an undefined tensor", leaves[i].key->str()));
      continue;
    }
    l.dtype = t.dtype();
    l.shape = t.shape();
    l.sparse = t.is_sparse();
    l.contiguous = !l.sparse && t.is_contiguous();
    a.dtype_mask |= 1u << static_cast<unsigned>(l.dtype);
    a.any_sparse = a.any_sparse || l.sparse;
  }
  a.memory = std::make_shared<LeafMemory>();
  a.memory->data.resize(leaves.size(), nullptr);
  a.memory->storage.resize(leaves.size(), nullptr);
  for (std::size_t i = 0; i < leaves.size(); ++i) {
    const Tensor& t = *leaves[i].tensor;
    if (!t.defined() || a.layout[i].sparse) continue;
    a.memory->data[i] = TensorAccess::data(t, itemsize(t.dtype()));
    a.memory->storage[i] = TensorAccess::storage(t);
  }
  find_aliases(leaves, a);
  find_spans(a);
  for (std::size_t i = 0; i < leaves.size(); ++i) {
    const LeafLayout& l = a.layout[i];
    h = mix(h, leaves[i].key_hash);
    h = mix(h, static_cast<std::uint64_t>(l.dtype) | (std::uint64_t{l.contiguous} << 8) |
                   (std::uint64_t{l.sparse} << 9) |
                   (static_cast<std::uint64_t>(l.alias_of + 1) << 10));
    h = mix(h, l.shape.size());
    for (auto s : l.shape) h = mix(h, static_cast<std::uint64_t>(s));
  }
  a.layout_hash = mix(h, leaves.size());
  return a;
}

// The op-dependent checks. Only when some dtype present does not support the op, or a sparse
// leaf is present, does it walk the leaves to name the first offending key.
std::string check_ops(std::span<const LeafRef> leaves, const Analysis& a,
                      const CollectiveCall& call) {
  bool all_supported = true;
  if (reduces(call.kind))
    for (std::size_t d = 0; d < kNumDTypes; ++d)
      if ((a.dtype_mask >> d & 1u) && !supports(call.op, static_cast<DType>(d)))
        all_supported = false;
  if (all_supported && !a.any_sparse) return {};
  std::string err;
  for (std::size_t i = 0; i < leaves.size() && err.empty(); ++i) {
    const LeafLayout& l = a.layout[i];
    if (!leaves[i].tensor->defined()) continue;
    if (reduces(call.kind) && !supports(call.op, l.dtype))
      err = fmt::format("op {} is not defined for dtype {} (key '{}')", name(call.op),
                        name(l.dtype), leaves[i].key->str());
    else if (l.sparse && !sparse_supported(call.kind))
      err =
          fmt::format("key '{}' is a sparse tensor, which {} does not support; to_dense() it first",
                      leaves[i].key->str(), call.name);
    else if (l.sparse && reduces(call.kind) && call.op != ReduceOp::SUM && call.op != ReduceOp::AVG)
      err = fmt::format(
          "op {} has no meaning for the sparse leaf '{}' (its missing entries are zeros); use SUM "
          "or "
          "AVG, or to_dense() it first",
          name(call.op), leaves[i].key->str());
  }
  return err;
}

}  // namespace

// What a dict remembers of its last collective's analysis: valid while its canonical order is
// unchanged and every leaf still has the same storage, offset, dtype, shape and strides.
struct LayoutCache {
  std::uint64_t generation = 0;           // of the dict's canonical order the snapshots follow
  std::uint64_t generation_now = 0;       // set by the caller: the order's generation for this call
  std::uint64_t stamp = 0;                // the dict's leaf stamp when the ids were last compared
  std::uint64_t stamp_now = 0;            // set by the caller: DictAccess::leaf_stamp for this call
  std::vector<std::uint64_t> layout_ids;  // of every leaf when `analysis` was made
  Analysis analysis;
};

std::shared_ptr<LayoutCache> make_layout_cache() { return std::make_shared<LayoutCache>(); }

// The dict's layout cache, told the order generation and leaf stamp of this call (after
// DictAccess::canonical(d)).
LayoutCache& layout_cache_for_call(const TensorDict& d) {
  LayoutCache& cache = DictAccess::layout_cache(d);
  cache.generation_now = DictAccess::canonical_generation(d);
  cache.stamp_now = DictAccess::leaf_stamp(d);
  return cache;
}

DictLeaves dict_leaves(const TensorDict& d, bool with_cache) {
  DictLeaves out;
  try {
    out.leaves = DictAccess::canonical(d);
    if (with_cache) out.cache = &layout_cache_for_call(d);
  } catch (const Error& e) {  // a moved-from dict (or sub-dict)
    out.leaves = {};
    out.cache = nullptr;
    out.error = e.what();
  }
  return out;
}

namespace {

const Analysis& analyse_cached(std::span<const LeafRef> leaves, LayoutCache* cache,
                               Analysis& scratch) {
  const std::uint64_t generation = cache ? cache->generation_now : 0;
  if (!cache) {
    scratch = analyse_layout(leaves);
    return scratch;
  }
  bool hit = cache->generation == generation && cache->layout_ids.size() == leaves.size();
  // Same order, same leaf stamp: no leaf object was assigned, moved from or re-laid out since the
  // ids were compared, so they still match (O(sub-dicts), computed by canonical()). Otherwise
  // one load and compare per leaf (equal layout ids mean equal layouts).
  if (hit && cache->stamp != cache->stamp_now) {
    const std::uint64_t* ids = cache->layout_ids.data();
    for (std::size_t i = 0; hit && i < leaves.size(); ++i)
      hit = ids[i] == TensorAccess::layout_id(*leaves[i].tensor);
  }
  cache->stamp = cache->stamp_now;
  if (!hit) {
    cache->analysis = analyse_layout(leaves);
    cache->layout_ids.clear();
    cache->layout_ids.reserve(leaves.size());
    for (const auto& ref : leaves)
      cache->layout_ids.push_back(TensorAccess::layout_id(*ref.tensor));
    cache->generation = generation;
  }
  return cache->analysis;
}

// ---- agreement across ranks ---------------------------------------------------------------

// Everything a call's ranks must agree on besides the layout, as one line: the arguments and
// options that change which MPI calls run (async_op: nonblocking calls do not match blocking
// ones) and the settings read from each process's environment that do the same.
std::string call_header(const CollectiveCall& call, std::optional<std::size_t> cap, bool async_op,
                        int group_size) {
  std::string h = fmt::format("{}(", call.name);
  if (reduces(call.kind)) h += fmt::format("op={}, ", name(call.op));
  if (has_root(call.kind)) h += fmt::format("{}={}, ", root_name(call.kind), call.root);
  h += fmt::format("bucket_bytes={}, async_op={}) in a group of {}", cap_str(cap), async_op,
                   group_size);
  const Config& c = config();
  h += fmt::format(" with TD_CHECK_LAYOUT={} TD_SYNC_PIPELINE={}", int{c.check_layout},
                   int{c.sync_pipeline});
  return h;
}

std::vector<std::string> split_lines(const std::string& s) {
  std::vector<std::string> out;
  std::size_t start = 0, pos;
  while ((pos = s.find('\n', start)) != std::string::npos) {
    out.push_back(s.substr(start, pos - start));
    start = pos + 1;
  }
  if (start < s.size()) out.push_back(s.substr(start));
  return out;
}

// Lists which ranks hold which text: "rank 0, 2: float32[3]; rank 1: int64[3]".
std::string by_rank(const std::vector<std::string>& texts) {
  std::vector<std::pair<std::string, std::vector<int>>> groups;
  for (std::size_t r = 0; r < texts.size(); ++r) {
    auto it = std::find_if(groups.begin(), groups.end(),
                           [&](const auto& g) { return g.first == texts[r]; });
    if (it == groups.end()) {
      groups.push_back({texts[r], {static_cast<int>(r)}});
    } else {
      it->second.push_back(static_cast<int>(r));
    }
  }
  std::string out;
  for (const auto& [text, ranks] : groups) {
    if (!out.empty()) out += "; ";
    out += fmt::format("rank{} {}: {}", ranks.size() > 1 ? "s" : "", fmt::join(ranks, ", "), text);
  }
  return out;
}

// Slow path after a failed fingerprint check: every rank gathers every rank's description and
// throws the same error.
[[noreturn]] void explain_disagreement(GroupState& g, const CollectiveCall& call,
                                       const std::string& header, const std::string& arg_error,
                                       std::span<const LeafRef> leaves, const Analysis& a,
                                       Clock::time_point deadline) {
  std::string desc = header + "\n" + arg_error + "\n";
  for (std::size_t i = 0; i < leaves.size(); ++i)
    desc += leaves[i].key->str() + "\t" + leaf_str(a.layout[i], leaves) + "\n";
  auto lens = std::make_shared<std::vector<int>>(static_cast<std::size_t>(g.size));
  int my_len = static_cast<int>(desc.size());
  MPI_Request req = MPI_REQUEST_NULL;
  auto describe = [&] {
    return fmt::format(
        "{}: ranks disagree on the layout, and gathering the details did not complete", call.name);
  };
  TD_MPI_CHECK(MPI_Iallgather(&my_len, 1, MPI_INT, lens->data(), 1, MPI_INT, g.comm, &req));
  wait_until(req, deadline, describe, lens);
  std::vector<int> displs(lens->size(), 0);
  for (std::size_t r = 1; r < lens->size(); ++r) displs[r] = displs[r - 1] + (*lens)[r - 1];
  auto all =
      std::make_shared<std::string>(static_cast<std::size_t>(displs.back() + lens->back()), '\0');
  auto mine = std::make_shared<std::string>(desc);
  TD_MPI_CHECK(MPI_Iallgatherv(mine->data(), my_len, MPI_CHAR, all->data(), lens->data(),
                               displs.data(), MPI_CHAR, g.comm, &req));
  wait_until(req, deadline, describe,
             std::make_shared<std::pair<decltype(all), decltype(mine)>>(all, mine));

  std::vector<std::vector<std::string>> lines;
  for (std::size_t r = 0; r < lens->size(); ++r)
    lines.push_back(split_lines(
        all->substr(static_cast<std::size_t>(displs[r]), static_cast<std::size_t>((*lens)[r]))));
  const std::size_t ranks = lines.size();
  auto line_at = [&](std::size_t r, std::size_t i) {
    return i < lines[r].size() ? lines[r][i] : std::string();
  };

  // Bad arguments anywhere: every rank reports the first rank's error as std::invalid_argument.
  for (std::size_t r = 0; r < ranks; ++r) {
    const std::string err = line_at(r, 1);
    if (!err.empty())
      throw std::invalid_argument(
          fmt::format("{}: invalid argument on rank {}: {}", call.name, r, err));
  }
  std::vector<std::string> headers;
  for (std::size_t r = 0; r < ranks; ++r) headers.push_back(line_at(r, 0));
  if (std::adjacent_find(headers.begin(), headers.end(), std::not_equal_to<>()) != headers.end())
    throw LayoutMismatchError(fmt::format("{}: ranks called different collectives or arguments: {}",
                                          call.name, by_rank(headers)));

  std::size_t longest = 0;
  for (const auto& l : lines) longest = std::max(longest, l.size());
  for (std::size_t i = 2; i < longest; ++i) {
    std::vector<std::string> at;
    for (std::size_t r = 0; r < ranks; ++r) at.push_back(line_at(r, i));
    if (std::adjacent_find(at.begin(), at.end(), std::not_equal_to<>()) == at.end()) continue;
    // First differing position: name the smallest key present there, and what each rank holds for
    // it.
    std::string key;
    for (const auto& s : at) {
      if (s.empty()) continue;
      std::string k = s.substr(0, s.find('\t'));
      if (key.empty() || k < key) key = k;
    }
    std::vector<std::string> holds;
    for (std::size_t r = 0; r < ranks; ++r) {
      std::string found = "no such key";
      for (std::size_t j = 2; j < lines[r].size(); ++j) {
        const auto tab = lines[r][j].find('\t');
        if (lines[r][j].substr(0, tab) == key) found = lines[r][j].substr(tab + 1);
      }
      holds.push_back(found);
    }
    throw LayoutMismatchError(
        fmt::format("{}: the ranks' TensorDicts differ at key '{}': {} (no data was sent)",
                    call.name, key, by_rank(holds)));
  }
  throw LayoutMismatchError(
      fmt::format("{}: the ranks' layouts hash differently but print identically", call.name));
}

// One small collective: do all ranks hold the same fingerprint? (MAX of h and of ~h: both equal
// the local values on every rank exactly when all fingerprints are equal.) The same MAX says
// whether every rank's leaves are one span per dtype (returned; no extra message).
bool agree(GroupState& g, const CollectiveCall& call, std::optional<std::size_t> cap, bool async_op,
           const std::string& arg_error, std::span<const LeafRef> leaves, const Analysis& a,
           Clock::time_point deadline) {
  const std::string header = call_header(call, cap, async_op, g.size);
  // TD_CHECK_LAYOUT=0 leaves the layout out of the fingerprint (not the round itself: the
  // arguments, the settings and local errors are still agreed, and the message sequence of a
  // call is the same whatever the setting).
  std::uint64_t h = config().check_layout ? a.layout_hash : 0x6c61796f7574ull;
  for (unsigned char c : header) h = mix(h, c);
  for (unsigned char c : arg_error) h = mix(h, c);
  auto buf = std::make_shared<std::array<std::uint64_t, 3>>();
  (*buf)[0] = h;
  (*buf)[1] = ~h;
  (*buf)[2] = a.memory->one_span_per_dtype ? 0 : 1;
  MPI_Request req = MPI_REQUEST_NULL;
  TD_MPI_CHECK(MPI_Iallreduce(MPI_IN_PLACE, buf->data(), 3, MPI_UINT64_T, MPI_MAX, g.comm, &req));
  wait_until(
      req, deadline,
      [&] {
        return fmt::format(
            "{}: not every rank of the group of {} joined the collective (first key '{}')",
            call.name, g.size, leaves.empty() ? std::string("<none>") : leaves[0].key->str());
      },
      buf);
  if ((*buf)[0] != h || (*buf)[1] != ~h)
    explain_disagreement(g, call, header, arg_error, leaves, a, deadline);
  return (*buf)[2] == 0;
}

// ---- moving the data -----------------------------------------------------------------------

// Whether a bucket's leaves lie back to back in one storage, so it can run on them directly.
// Runs per bucket per call: unchecked field reads (every slot holds a dense, defined leaf).
// These LeafRef forms look at each leaf's own strides rather than trusting the plan's
// contiguity flags: the leaves they are given need not be the ones the plan was built from (a
// scatter's parts, a point-to-point peer's plan, a gather's fresh results), and only dtype and
// shape are agreed for those.
bool contiguous_in_memory(const BucketPlan::Bucket& b, std::span<const LeafRef> leaves) {
  const std::size_t isz = itemsize(b.dtype);
  const Tensor& head = *leaves[b.slots[0].leaf].tensor;
  if (!head.is_contiguous()) return false;
  const Storage* storage = TensorAccess::storage(head);
  const std::byte* first = TensorAccess::data(head, isz);
  for (std::size_t s = 1; s < b.slots.size(); ++s) {
    const Tensor& t = *leaves[b.slots[s].leaf].tensor;
    if (TensorAccess::storage(t) != storage || !t.is_contiguous() ||
        TensorAccess::data(t, isz) != first + b.slots[s].offset)
      return false;
  }
  return true;
}

void pack(const BucketPlan::Bucket& b, std::span<const LeafRef> leaves, std::byte* dst) {
  const std::size_t isz = itemsize(b.dtype);
  for (const auto& slot : b.slots) {
    const Tensor& t = *leaves[slot.leaf].tensor;
    if (!t.is_contiguous()) {
      strided_copy(dst + slot.offset, contiguous_strides(t.shape()), TensorAccess::data(t, isz),
                   t.strides(), t.shape(), isz);
    } else {
      std::memcpy(dst + slot.offset, TensorAccess::data(t, isz), slot.nbytes);
    }
  }
}

void unpack(const BucketPlan::Bucket& b, std::span<const LeafRef> leaves, const std::byte* src) {
  const std::size_t isz = itemsize(b.dtype);
  for (const auto& slot : b.slots) {
    const Tensor& t = *leaves[slot.leaf].tensor;
    if (!t.is_contiguous()) {
      strided_copy(TensorAccess::data(t, isz), t.strides(), src + slot.offset,
                   contiguous_strides(t.shape()), t.shape(), isz);
    } else {
      std::memcpy(TensorAccess::data(t, isz), src + slot.offset, slot.nbytes);
    }
  }
}

// The same three on the flat LeafMemory arrays (the sync path's hot loops). A bucket of one
// strided leaf takes the LeafRef versions above.
bool contiguous_in_memory(const BucketPlan::Bucket& b, const LeafMemory& m) {
  if (b.strided) return false;
  const Storage* storage = m.storage[b.slots[0].leaf];
  const std::byte* first = m.data[b.slots[0].leaf];
  for (std::size_t s = 1; s < b.slots.size(); ++s) {
    const std::size_t leaf = b.slots[s].leaf;
    if (m.storage[leaf] != storage || m.data[leaf] != first + b.slots[s].offset) return false;
  }
  return true;
}

// Copies a bucket's leaves, merging leaves that lie back to back into one copy, and copying
// small leaves (the common case of many tiny gradients) with inlined fixed-size moves.
template <bool kPack>
void copy_slots(const BucketPlan::Bucket& b, const LeafMemory& m, std::byte* buf) {
  auto copy = [buf](std::size_t offset, std::byte* leaf, std::size_t n) {
    std::byte* dst = kPack ? buf + offset : leaf;
    const std::byte* src = kPack ? leaf : buf + offset;
    if (n > 256) {
      std::memcpy(dst, src, n);
      return;
    }
    std::size_t i = 0;
    for (; i + 16 <= n; i += 16) std::memcpy(dst + i, src + i, 16);
    for (; i < n; ++i) dst[i] = src[i];
  };
  std::size_t run_offset = 0, run_bytes = 0;
  std::byte* run_start = nullptr;
  // Leaves are scattered over the heap: fetch 8 ahead. Measured (2 ranks, auto buckets, median
  // of 4 runs each, 2026-12-01): tiny 0.27 -> 0.21 ms, small 0.82 -> 0.75 ms, mixed 8.3 -> 6.9 ms.
  constexpr std::size_t kAhead = 8;
  const std::size_t n = b.slots.size();
  for (std::size_t k = 0; k < n; ++k) {
    const auto& slot = b.slots[k];
    if (k + kAhead < n) __builtin_prefetch(m.data[b.slots[k + kAhead].leaf], kPack ? 0 : 1);
    std::byte* p = m.data[slot.leaf];
    if (run_start != nullptr && p == run_start + run_bytes &&
        slot.offset == run_offset + run_bytes) {
      run_bytes += slot.nbytes;
      continue;
    }
    if (run_start != nullptr) copy(run_offset, run_start, run_bytes);
    run_start = p;
    run_offset = slot.offset;
    run_bytes = slot.nbytes;
  }
  if (run_start != nullptr) copy(run_offset, run_start, run_bytes);
}

struct Roles {
  bool sends;     // this rank's data is an input
  bool receives;  // this rank holds the result afterwards
};

// Whether this rank divides its result by the group size afterwards (AVG is a SUM, then a
// division on the ranks that hold the result).
bool divides_result(const CollectiveCall& call, Roles roles) {
  return roles.receives && call.op == ReduceOp::AVG && call.kind != CollectiveKind::Broadcast;
}

Roles roles_of(const CollectiveCall& call, int rank) {
  switch (call.kind) {
    case CollectiveKind::AllReduce:
      return {true, true};
    case CollectiveKind::Reduce:
      return {true, rank == call.root};
    case CollectiveKind::Broadcast:
      return {rank == call.root, rank != call.root};
    default:
      throw std::logic_error("roles_of: not an in-place collective");
  }
}

void start_or_run(const CollectiveCall& call, int rank, MPI_Comm comm, std::byte* p, int count,
                  DType dtype, MPI_Request* req) {
  const MPI_Datatype type = mpi_datatype(dtype);
  switch (call.kind) {
    case CollectiveKind::AllReduce: {
      const MPI_Op op = mpi_op(call.op, dtype);
      if (req) {
        TD_MPI_CHECK(MPI_Iallreduce(MPI_IN_PLACE, p, count, type, op, comm, req));
      } else {
        TD_MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, p, count, type, op, comm));
      }
      break;
    }
    case CollectiveKind::Reduce: {
      const MPI_Op op = mpi_op(call.op, dtype);
      const bool root = rank == call.root;
      void* send = root ? MPI_IN_PLACE : p;
      void* recv = root ? p : nullptr;
      if (req) {
        TD_MPI_CHECK(MPI_Ireduce(send, recv, count, type, op, call.root, comm, req));
      } else {
        TD_MPI_CHECK(MPI_Reduce(send, recv, count, type, op, call.root, comm));
      }
      break;
    }
    case CollectiveKind::Broadcast:
      if (req) {
        TD_MPI_CHECK(MPI_Ibcast(p, count, type, call.root, comm, req));
      } else {
        TD_MPI_CHECK(MPI_Bcast(p, count, type, call.root, comm));
      }
      break;
    default:
      throw std::logic_error("start_or_run: not an in-place collective");
  }
}

std::mutex g_stats_mu;
PackerStats g_stats;

void note_extra_bytes(std::size_t n) {
  std::lock_guard lock(g_stats_mu);
  g_stats.peak_extra_bytes = std::max(g_stats.peak_extra_bytes, n);
}

// Every rank holds each dtype's leaves as one span of one storage (a consolidated dict): one
// pass per span, in place, in the plan's messages (max(cap, 4 MiB)), whatever the buckets. The
// sequence of messages depends only on the agreed layout, so it is the same on every rank.
void run_spans(const BucketPlan& plan, const CollectiveCall& call, GroupState& g,
               const LeafMemory& mem) {
  const Roles roles = roles_of(call, g.rank);
  const bool avg = divides_result(call, roles);
  for (const auto& sp : mem.spans) {
    for_each_message(sp.nbytes, sp.dtype, plan.max_message_bytes, [&](std::size_t off, int count) {
      start_or_run(call, g.rank, g.comm, sp.data + off, count, sp.dtype, nullptr);
    });
    if (avg)
      divide_in_place(sp.data, static_cast<std::int64_t>(sp.nbytes / itemsize(sp.dtype)), sp.dtype,
                      g.size);
  }
}

// Which of the plan's buckets run in place on the leaves' memory (cached in `mem` per plan).
std::vector<char> direct_buckets(const std::shared_ptr<const BucketPlan>& plan,
                                 const LeafMemory& mem) {
  std::lock_guard lock(mem.direct_mu);
  if (mem.direct_plan != plan) {
    mem.direct.resize(plan->buckets.size());
    for (std::size_t b = 0; b < plan->buckets.size(); ++b)
      mem.direct[b] = static_cast<char>(contiguous_in_memory(plan->buckets[b], mem));
    mem.direct_plan = plan;
  }
  return mem.direct;
}

void run_sync(const std::shared_ptr<const BucketPlan>& plan_ptr, std::span<const LeafRef> leaves,
              const CollectiveCall& call, GroupState& g, const LeafMemory& mem) {
  const BucketPlan& plan = *plan_ptr;
  const Roles roles = roles_of(call, g.rank);
  std::size_t need = 0;
  const std::vector<char> direct = direct_buckets(plan_ptr, mem);
  for (std::size_t b = 0; b < plan.buckets.size(); ++b)
    if (!direct[b]) need = std::max(need, plan.buckets[b].nbytes);
  // TD_SYNC_PIPELINE=1: pack bucket k+1 while bucket k is in flight as a nonblocking collective
  // (two pack buffers). Off by default: measured here, Open MPI 4.1's nonblocking allreduce is so
  // much slower than the blocking one that the overlap loses (docs/bucketing.md, benchmarks.md).
  const bool pipeline = config().sync_pipeline;
  const std::size_t slots = pipeline ? 2 : 1;
  const std::size_t stride = (need + 63) / 64 * 64;  // each slot starts aligned for any dtype
  // The group keeps one pack buffer between calls; a call takes it out while it runs, so two
  // threads calling collectives at once never share it (the second allocates its own).
  std::shared_ptr<Storage> scratch;
  if (need > 0) {
    {
      std::lock_guard lock(g.mu);
      scratch = std::move(g.scratch);
    }
    if (!scratch || scratch->nbytes < stride * slots)
      scratch = std::make_shared<Storage>(stride * slots);
    note_extra_bytes(stride * slots);
  }
  struct ReturnScratch {
    GroupState& g;
    std::shared_ptr<Storage>& s;
    ~ReturnScratch() {
      if (!s) return;
      std::lock_guard lock(g.mu);
      if (!g.scratch || g.scratch->nbytes < s->nbytes) g.scratch = std::move(s);
    }
  } give_back{g, scratch};
  const bool avg = divides_result(call, roles);
  auto memory_of = [&](std::size_t b) {
    const auto& bk = plan.buckets[b];
    return direct[b] ? mem.data[bk.slots[0].leaf] : scratch->data + (b % slots) * stride;
  };
  auto finish = [&](std::size_t b) {
    const auto& bk = plan.buckets[b];
    std::byte* p = memory_of(b);
    if (avg)
      divide_in_place(p, static_cast<std::int64_t>(bk.nbytes / itemsize(bk.dtype)), bk.dtype,
                      g.size);
    if (direct[b] || !roles.receives) return;
    if (bk.strided) {
      unpack(bk, leaves, p);
    } else {
      copy_slots<false>(bk, mem, p);
    }
  };
  std::vector<MPI_Request> in_flight;
  for (std::size_t b = 0; b < plan.buckets.size(); ++b) {
    const auto& bk = plan.buckets[b];
    std::byte* p = memory_of(b);
    if (!direct[b] && roles.sends) {  // overlaps bucket b-1 when pipelining
      if (bk.strided) {
        pack(bk, leaves, p);
      } else {
        copy_slots<true>(bk, mem, p);
      }
    }
    if (!pipeline) {
      for_each_message(bk.nbytes, bk.dtype, plan.max_message_bytes,
                       [&](std::size_t off, int count) {
                         start_or_run(call, g.rank, g.comm, p + off, count, bk.dtype, nullptr);
                       });
      finish(b);
      continue;
    }
    std::vector<MPI_Request> started;
    for_each_message(bk.nbytes, bk.dtype, plan.max_message_bytes, [&](std::size_t off, int count) {
      started.push_back(MPI_REQUEST_NULL);
      start_or_run(call, g.rank, g.comm, p + off, count, bk.dtype, &started.back());
    });
    if (b > 0) {
      TD_MPI_CHECK(
          MPI_Waitall(static_cast<int>(in_flight.size()), in_flight.data(), MPI_STATUSES_IGNORE));
      finish(b - 1);
    }
    in_flight = std::move(started);
  }
  if (pipeline && !plan.buckets.empty()) {
    TD_MPI_CHECK(
        MPI_Waitall(static_cast<int>(in_flight.size()), in_flight.data(), MPI_STATUSES_IGNORE));
    finish(plan.buckets.size() - 1);
  }
}

// Sparse leaves: every rank's (index, value) entries are gathered and duplicates summed, so the
// result, densified, equals the dense reduction of the densified inputs. Never bucketed.
void run_sparse(Tensor& leaf, const CollectiveCall& call, GroupState& g) {
  const Shape shape = leaf.shape();
  const DType dtype = leaf.dtype();
  const auto ndim = static_cast<std::int64_t>(shape.size());
  const bool root = g.rank == call.root;
  std::int64_t nnz = 0;
  Tensor entries, values;  // entries: [nnz, ndim] int64, entry-major so ranks' parts concatenate
  if (call.kind != CollectiveKind::Broadcast || root) {
    nnz = leaf.nnz();
    entries = leaf.indices().transpose(0, 1).contiguous();
    values = leaf.values().contiguous();
  }
  const MPI_Datatype vtype = mpi_datatype(dtype);
  auto finish = [&](const Tensor& all_entries, const Tensor& all_values, std::int64_t total) {
    Tensor indices = all_entries.view({total, ndim}).transpose(0, 1).contiguous();
    Tensor result = Tensor::sparse_coo(indices, all_values, shape);
    if (call.kind != CollectiveKind::Broadcast) {
      result = result.coalesce();
      if (call.op == ReduceOp::AVG) {
        Tensor v = result.values();
        divide_in_place(v.raw_data(), v.numel(), dtype, g.size);
      }
    }
    leaf = result;
  };
  auto to_int = [&](std::int64_t n) {
    if (n > INT_MAX)
      throw Error(fmt::format("{}: a sparse leaf with {} entries is too large for one message",
                              call.name, n));
    return static_cast<int>(n);
  };
  if (call.kind == CollectiveKind::Broadcast) {
    TD_MPI_CHECK(MPI_Bcast(&nnz, 1, MPI_INT64_T, call.root, g.comm));
    if (!root) {
      entries = Tensor::empty({nnz, ndim}, DType::Int64);
      values = Tensor::empty({nnz}, dtype);
    }
    TD_MPI_CHECK(MPI_Bcast(entries.raw_data(), to_int(nnz * ndim), MPI_INT64_T, call.root, g.comm));
    TD_MPI_CHECK(MPI_Bcast(values.raw_data(), to_int(nnz), vtype, call.root, g.comm));
    if (!root) finish(entries, values, nnz);
    return;
  }
  const bool gathers = call.kind == CollectiveKind::AllReduce || root;
  std::vector<std::int64_t> counts(static_cast<std::size_t>(g.size));
  if (call.kind == CollectiveKind::AllReduce) {
    TD_MPI_CHECK(MPI_Allgather(&nnz, 1, MPI_INT64_T, counts.data(), 1, MPI_INT64_T, g.comm));
  } else {
    TD_MPI_CHECK(
        MPI_Gather(&nnz, 1, MPI_INT64_T, counts.data(), 1, MPI_INT64_T, call.root, g.comm));
  }
  std::vector<int> ecount(counts.size()), edispl(counts.size()), vcount(counts.size()),
      vdispl(counts.size());
  std::int64_t total = 0;
  if (gathers) {
    for (std::size_t r = 0; r < counts.size(); ++r) {
      vcount[r] = to_int(counts[r]);
      vdispl[r] = to_int(total);
      ecount[r] = to_int(counts[r] * ndim);
      edispl[r] = to_int(total * ndim);
      total += counts[r];
    }
    to_int(total * ndim);
  }
  Tensor all_entries = Tensor::empty({gathers ? total * ndim : 0}, DType::Int64);
  Tensor all_values = Tensor::empty({gathers ? total : 0}, dtype);
  if (call.kind == CollectiveKind::AllReduce) {
    TD_MPI_CHECK(MPI_Allgatherv(entries.raw_data(), to_int(nnz * ndim), MPI_INT64_T,
                                all_entries.raw_data(), ecount.data(), edispl.data(), MPI_INT64_T,
                                g.comm));
    TD_MPI_CHECK(MPI_Allgatherv(values.raw_data(), to_int(nnz), vtype, all_values.raw_data(),
                                vcount.data(), vdispl.data(), vtype, g.comm));
  } else {
    TD_MPI_CHECK(MPI_Gatherv(entries.raw_data(), to_int(nnz * ndim), MPI_INT64_T,
                             all_entries.raw_data(), ecount.data(), edispl.data(), MPI_INT64_T,
                             call.root, g.comm));
    TD_MPI_CHECK(MPI_Gatherv(values.raw_data(), to_int(nnz), vtype, all_values.raw_data(),
                             vcount.data(), vdispl.data(), vtype, call.root, g.comm));
  }
  if (gathers) finish(all_entries, all_values, total);
}

void run_sparse_leaves(const BucketPlan& plan, std::span<const LeafRef> leaves,
                       const CollectiveCall& call, GroupState& g) {
  for (std::size_t i : plan.sparse_leaves) run_sparse(*leaves[i].tensor, call, g);
}

// Async all_reduce / reduce / broadcast: one Work per bucket, in place or through a pack buffer
// the Work owns; the finish step divides (AVG) and copies back from the Work's own tensor
// handles, so it stays valid even if the dict was dropped meanwhile.
std::vector<Work> run_async(const BucketPlan& plan, std::span<const LeafRef> leaves,
                            const CollectiveCall& call, const std::shared_ptr<GroupState>& g,
                            Clock::time_point deadline) {
  const Roles roles = roles_of(call, g->rank);
  BucketRunner runner(deadline, /*async_op=*/true);
  std::size_t buffered = 0;  // every Work owns its pack buffer until it completes
  static const Key kLeaf("<leaf>");
  for (std::size_t b = 0; b < plan.buckets.size(); ++b) {
    const auto& bk = plan.buckets[b];
    auto st = runner.state(bucket_description(call.name, plan, b, leaves, g->size));
    for (const auto& slot : bk.slots) st->keep_alive.push_back(*leaves[slot.leaf].tensor);
    bool packed = false;
    std::byte* p = BucketRunner::place(bk, leaves, *st, roles.sends, &packed);
    if (packed) buffered += bk.nbytes;
    const bool avg = divides_result(call, roles);
    const int size = g->size;
    auto bucket = std::make_shared<BucketPlan::Bucket>(bk);
    WorkState* raw = st.get();
    st->finish = [raw, bucket, p, avg, packed, roles, size] {
      if (avg)
        divide_in_place(p, static_cast<std::int64_t>(bucket->nbytes / itemsize(bucket->dtype)),
                        bucket->dtype, size);
      if (!packed || !roles.receives) return;
      // The Work's own handles, in slot order: the bucket renumbered onto them.
      std::vector<LeafRef> refs;
      refs.reserve(bucket->slots.size());
      for (auto& t : raw->keep_alive) refs.push_back({&kLeaf, &t, 0});
      BucketPlan::Bucket local = *bucket;
      for (std::size_t s = 0; s < local.slots.size(); ++s) local.slots[s].leaf = s;
      unpack(local, refs, p);
    };
    const std::size_t max_message = plan.max_message_bytes;
    runner.run(st, [&](std::vector<MPI_Request>* reqs) {
      for_each_message(bk.nbytes, bk.dtype, max_message, [&](std::size_t off, int count) {
        reqs->push_back(MPI_REQUEST_NULL);
        start_or_run(call, g->rank, g->comm, p + off, count, bk.dtype, &reqs->back());
      });
    });
  }
  note_extra_bytes(buffered);
  return runner.works();
}

std::shared_ptr<const BucketPlan> plan_for(GroupState& g, const Analysis& a,
                                           std::optional<std::size_t> cap,
                                           std::size_t direct_bytes) {
  std::uint64_t key = mix(mix(a.layout_hash, cap ? *cap : 0x7fffffffffffffffull), direct_bytes);
  std::lock_guard lock(g.mu);
  auto it = g.plans.find(key);
  if (it != g.plans.end()) {
    std::lock_guard s(g_stats_mu);
    ++g_stats.plan_hits;
    return it->second;
  }
  auto plan = std::make_shared<const BucketPlan>(BucketPlan::build(a.layout, cap, 0, direct_bytes));
  if (g.plans.size() > 256) g.plans.clear();  // a program cycling through many layouts
  g.plans.emplace(key, plan);
  std::lock_guard s(g_stats_mu);
  ++g_stats.plan_misses;
  return plan;
}

}  // namespace

std::optional<std::size_t> requested_cap(const CollectiveOptions& opts, bool from_dict) {
  if (!from_dict) return std::nullopt;
  return opts.bucket_bytes ? opts.bucket_bytes : config().bucket_bytes;
}

PreparedCollective prepare_collective(std::span<const LeafRef> leaves, const CollectiveCall& call,
                                      const CollectiveOptions& opts, std::string extra_arg_error,
                                      LayoutCache* cache) {
  std::shared_ptr<GroupState> g = group_of(opts);
  g->checked_comm(call.name);
  const auto timeout = timeout_of(opts);
  std::string arg_error;
  if (timeout.count() <= 0)
    note_error(arg_error, fmt::format("timeout must be positive (got {} ms)", timeout.count()));
  // A bad timeout still needs a deadline for the agreement that reports it.
  const auto deadline = deadline_after(timeout.count() > 0 ? timeout : timeout_of({}));

  std::optional<std::size_t> cap = requested_cap(opts, call.from_dict);
  Analysis scratch;
  const Analysis& a = analyse_cached(leaves, cache, scratch);
  note_error(arg_error, a.arg_error);
  note_error(arg_error, check_ops(leaves, a, call));
  if (cap && *cap == 0)
    note_error(arg_error, "bucket_bytes must be positive (or td::kAutoBucketBytes)");
  if (has_root(call.kind) && (call.root < 0 || call.root >= g->size))
    note_error(arg_error, fmt::format("{} {} is out of range for a group of {} ranks",
                                      root_name(call.kind), call.root, g->size));
  if (!extra_arg_error.empty()) note_error(arg_error, std::move(extra_arg_error));
  // The agreement always runs in a group of several ranks: it is what makes a local error, a
  // differing argument or setting, the same error on every rank instead of a hang.
  bool spans_everywhere = a.memory->one_span_per_dtype;
  if (g->size > 1)
    spans_everywhere = agree(*g, call, cap, opts.async_op, arg_error, leaves, a, deadline);
  if (!arg_error.empty()) throw std::invalid_argument(fmt::format("{}: {}", call.name, arg_error));

  std::size_t direct_bytes = 0;
  if (cap && *cap == kAutoBucketBytes) {
    const TunedBuckets tuned = tuned_buckets(*g, deadline);
    cap = tuned.cap;
    direct_bytes = tuned.direct_bytes;
  }
  auto plan = plan_for(*g, a, cap, direct_bytes);
  log_debug([&] {
    return fmt::format("{}: {}", call_header(call, cap, opts.async_op, g->size), plan->describe());
  });
  return {std::move(g), std::move(plan), deadline, a.memory, spans_everywhere && cap.has_value()};
}

std::vector<Work> run_collective(std::span<const LeafRef> leaves, const CollectiveCall& call,
                                 const CollectiveOptions& opts, LayoutCache* cache,
                                 std::string extra_arg_error) {
  auto [g, plan, deadline, memory, spans] =
      prepare_collective(leaves, call, opts, std::move(extra_arg_error), cache);
  const std::function<std::string()> describe = [&, n = plan->buckets.size()] {
    return fmt::format("{} ({} buckets, {} sparse leaves, first key '{}') in a group of {} ranks",
                       call.name, n, plan->sparse_leaves.size(),
                       leaves.empty() ? std::string("<none>") : leaves[0].key->str(), g->size);
  };
  // Sparse leaves run first, blocking, before any dense bucket: their sizes are only known after
  // a first exchange, and a sparse leaf's values may be (a view of) a dense leaf of the same
  // dict, which must not be reduced before the sparse pass has read it.
  if (!plan->sparse_leaves.empty()) {
    const BlockingPhase watched(deadline, describe);
    run_sparse_leaves(*plan, leaves, call, *g);
  }
  if (opts.async_op) return run_async(*plan, leaves, call, g, deadline);
  const BlockingPhase watched(deadline, describe);
  if (spans) {
    const std::size_t n_spans = memory->spans.size();  // (a lambda may not capture a binding)
    log_debug([&call, n_spans] {
      return fmt::format("{}: every rank consolidated: {} spans of one dtype each, no buckets",
                         call.name, n_spans);
    });
    run_spans(*plan, call, *g, *memory);
  } else {
    run_sync(plan, leaves, call, *g, *memory);
  }
  return {};
}

BucketRunner::BucketRunner(Clock::time_point deadline, bool async_op)
    : deadline_(deadline), async_(async_op) {}

std::shared_ptr<WorkState> BucketRunner::state(std::string describe) const {
  auto st = std::make_shared<WorkState>();
  st->deadline = deadline_;
  st->describe = [d = std::move(describe)] { return d; };
  return st;
}

std::byte* BucketRunner::place(const BucketPlan::Bucket& bk, std::span<const LeafRef> leaves,
                               WorkState& st, bool pack_from_leaves, bool* packed,
                               std::size_t nbytes) {
  const bool direct = contiguous_in_memory(bk, leaves);
  if (packed) *packed = !direct;
  if (direct) return TensorAccess::data(*leaves[bk.slots[0].leaf].tensor, itemsize(bk.dtype));
  auto buf = std::make_shared<Storage>(nbytes != 0 ? nbytes : bk.nbytes);
  if (pack_from_leaves) pack(bk, leaves, buf->data);
  std::byte* p = buf->data;
  st.held.push_back(std::move(buf));
  return p;
}

void BucketRunner::run(const std::shared_ptr<WorkState>& st,
                       const std::function<void(std::vector<MPI_Request>*)>& start) {
  if (!async_) {
    {
      const BlockingPhase watched(st->deadline, st->describe);
      start(nullptr);
    }
    st->wait();  // no requests: runs the finish step now (and releases the buffers)
    return;
  }
  start(&st->requests);
  states_.push_back(st);
  works_.emplace_back(st);
}

void BucketRunner::run_one(const std::shared_ptr<WorkState>& st,
                           const std::function<void(MPI_Request*)>& start) {
  run(st, [&](std::vector<MPI_Request>* reqs) {
    if (reqs == nullptr) return start(nullptr);
    reqs->push_back(MPI_REQUEST_NULL);
    start(&reqs->back());
  });
}

std::vector<Work> BucketRunner::works() {
  // Only now does the progress thread see them: while this thread is still starting buckets,
  // a second thread inside MPI makes every MPI_I* call here wait on Open MPI's locks (measured:
  // starting 64 buckets took 20x longer with the thread polling than without it).
  progress_add(states_);
  states_.clear();
  return std::move(works_);
}

std::string bucket_description(std::string_view what, const BucketPlan& plan, std::size_t b,
                               std::span<const LeafRef> leaves, int group_size) {
  const auto& bk = plan.buckets[b];
  return fmt::format(
      "{} of bucket {} of {} ({}, {} B, {} leaves, first key '{}') in a group of {} ranks", what, b,
      plan.buckets.size(), name(bk.dtype), bk.nbytes, bk.slots.size(),
      leaves[bk.slots[0].leaf].key->str(), group_size);
}

int mpi_count(std::size_t count, std::string_view what) {
  if (count > static_cast<std::size_t>(INT_MAX))
    throw Error(fmt::format("{}: {} elements are too many for one message (at most {})", what,
                            count, INT_MAX));
  return static_cast<int>(count);
}

void pack_bucket(const BucketPlan::Bucket& bucket, std::span<const LeafRef> leaves,
                 std::byte* dst) {
  pack(bucket, leaves, dst);
}
void unpack_bucket(const BucketPlan::Bucket& bucket, std::span<const LeafRef> leaves,
                   const std::byte* src) {
  unpack(bucket, leaves, src);
}
bool bucket_is_contiguous_in_memory(const BucketPlan::Bucket& bucket,
                                    std::span<const LeafRef> leaves) {
  return contiguous_in_memory(bucket, leaves);
}

}  // namespace detail

PackerStats packer_stats() {
  std::lock_guard lock(detail::g_stats_mu);
  return detail::g_stats;
}

void reset_packer_stats() {
  std::lock_guard lock(detail::g_stats_mu);
  detail::g_stats = {};
}

// ---- the public entry points -----------------------------------------------------------------

namespace {
std::vector<Work> run_on_tensor(Tensor& t, const detail::CollectiveCall& call,
                                const CollectiveOptions& opts) {
  static const Key kKey("<tensor>");
  const detail::LeafRef ref{&kKey, &t, detail::hash_key(kKey)};
  return detail::run_collective(std::span<const detail::LeafRef>(&ref, 1), call, opts);
}

Work single(std::vector<Work> works) {
  if (works.empty()) return Work();
  return std::move(works.front());
}
}  // namespace

Work reduce(Tensor& t, int dst, ReduceOp op, const CollectiveOptions& opts) {
  return single(run_on_tensor(t, {detail::CollectiveKind::Reduce, op, dst, "reduce", false}, opts));
}
Work all_reduce(Tensor& t, ReduceOp op, const CollectiveOptions& opts) {
  return single(
      run_on_tensor(t, {detail::CollectiveKind::AllReduce, op, 0, "all_reduce", false}, opts));
}
Work broadcast(Tensor& t, int src, const CollectiveOptions& opts) {
  return single(run_on_tensor(
      t, {detail::CollectiveKind::Broadcast, ReduceOp::SUM, src, "broadcast", false}, opts));
}

namespace {
std::vector<Work> run_on_dict(TensorDict& d, const detail::CollectiveCall& call,
                              const CollectiveOptions& opts) {
  auto in = detail::dict_leaves(d);
  return detail::run_collective(in.leaves, call, opts, in.cache, std::move(in.error));
}
}  // namespace

std::vector<Work> TensorDict::all_reduce(ReduceOp op, const CollectiveOptions& opts) {
  return run_on_dict(
      *this, {detail::CollectiveKind::AllReduce, op, 0, "TensorDict.all_reduce", true}, opts);
}
std::vector<Work> TensorDict::reduce(int dst, ReduceOp op, const CollectiveOptions& opts) {
  return run_on_dict(*this, {detail::CollectiveKind::Reduce, op, dst, "TensorDict.reduce", true},
                     opts);
}
std::vector<Work> TensorDict::broadcast(int src, const CollectiveOptions& opts) {
  return run_on_dict(
      *this, {detail::CollectiveKind::Broadcast, ReduceOp::SUM, src, "TensorDict.broadcast", true},
      opts);
}

}  // namespace td
