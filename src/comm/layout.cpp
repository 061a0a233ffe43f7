// The local analysis of a call's leaves (layouts, aliases, consolidated spans, the layout
// hash) and the per-dict cache of it.
#include <algorithm>
#include <climits>
#include <cstring>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "comm/engine_internal.hpp"
#include "core/config.hpp"
#include "runtime/log.hpp"

namespace td::detail {

namespace {

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
    a.total_bytes += static_cast<std::uint64_t>(t.numel()) * itemsize(l.dtype);
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
  a.layout_hash = layout_hash(leaves, a.layout);
  return a;
}

}  // namespace

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

LayoutCache& layout_cache_for_call(const TensorDict& d) {
  auto* cache = static_cast<LayoutCache*>(DictAccess::attachment(
      d, [] { return std::shared_ptr<void>(std::make_shared<LayoutCache>()); }));
  cache->generation_now = DictAccess::canonical_generation(d);
  return *cache;
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

const Analysis& analyse_cached(std::span<const LeafRef> leaves, LayoutCache* cache,
                               Analysis& scratch) {
  const std::uint64_t generation = cache ? cache->generation_now : 0;
  if (!cache) {
    scratch = analyse_layout(leaves);
    return scratch;
  }
  // Same order, and no leaf object assigned, moved from or re-laid out since the analysis (the
  // leaves' storage versions, or else their layout ids, say so): the analysis still holds.
  const bool hit = cache->generation == generation && cache->versions.same_layouts(leaves);
  if (!hit) {
    cache->analysis = analyse_layout(leaves);
    cache->versions.record(leaves);
    cache->generation = generation;
  }
  return cache->analysis;
}

std::string describe_tensor(const Tensor& t) {
  if (!t.defined()) return "undefined";
  std::string s = fmt::format("{}{}", name(t.dtype()), shape_str(t.shape()));
  if (t.is_sparse()) s += " sparse";
  return s;
}

std::string describe_leaf(const LeafLayout& l, std::span<const LeafRef> leaves) {
  std::string s = fmt::format("{}{}", name(l.dtype), shape_str(l.shape));
  if (l.sparse) s += " sparse";
  if (!l.contiguous && !l.sparse) s += " non-contiguous";
  if (l.alias_of >= 0)
    s += fmt::format(" alias of '{}'", leaves[static_cast<std::size_t>(l.alias_of)].key->str());
  return s;
}

std::vector<std::string> describe_leaves(std::span<const LeafRef> leaves,
                                         const std::vector<LeafLayout>* layout) {
  std::vector<std::string> out;
  out.reserve(leaves.size());
  for (std::size_t i = 0; i < leaves.size(); ++i)
    out.push_back(
        leaves[i].key->str() + "\t" +
        (layout ? describe_leaf((*layout)[i], leaves) : describe_tensor(*leaves[i].tensor)));
  return out;
}

std::optional<LayoutDifference> first_difference(
    const std::vector<std::vector<std::string>>& sides) {
  auto key_of = [](const std::string& line) { return line.substr(0, line.find('\t')); };
  std::size_t longest = 0;
  for (const auto& s : sides) longest = std::max(longest, s.size());
  for (std::size_t i = 0; i < longest; ++i) {
    bool same = true;
    for (const auto& s : sides) {
      const std::string& a = i < sides[0].size() ? sides[0][i] : std::string();
      same = same && (i < s.size() ? s[i] : std::string()) == a;
    }
    if (same) continue;
    // The smallest key present at the first differing position, and what each side holds.
    LayoutDifference d;
    for (const auto& s : sides)
      if (i < s.size() && (d.key.empty() || key_of(s[i]) < d.key)) d.key = key_of(s[i]);
    for (const auto& s : sides) {
      std::string found;
      for (const auto& line : s)
        if (key_of(line) == d.key) found = line.substr(line.find('\t') + 1);
      d.holds.push_back(std::move(found));
    }
    return d;
  }
  return std::nullopt;
}

std::uint64_t layout_hash(std::span<const LeafRef> leaves, std::span<const LeafLayout> layout) {
  std::uint64_t h = 0x51ed270b27ull;
  for (std::size_t i = 0; i < leaves.size(); ++i) {
    const LeafLayout& l = layout[i];
    h = mix(h, leaves[i].key_hash);
    h = mix(h, static_cast<std::uint64_t>(l.dtype) | (std::uint64_t{l.contiguous} << 8) |
                   (std::uint64_t{l.sparse} << 9) |
                   (static_cast<std::uint64_t>(l.alias_of + 1) << 10));
    h = mix(h, l.shape.size());
    for (auto s : l.shape) h = mix(h, static_cast<std::uint64_t>(s));
  }
  h = mix(h, leaves.size());
  return h == 0 ? 1 : h;
}

std::vector<LeafLayout> plain_layout(std::span<const LeafRef> leaves) {
  std::vector<LeafLayout> out;
  out.reserve(leaves.size());
  for (const auto& ref : leaves) {
    const Tensor& t = *ref.tensor;
    out.push_back(t.defined() ? LeafLayout{t.dtype(), t.shape(), true} : LeafLayout{});
  }
  return out;
}

}  // namespace td::detail
