// The metadata encoder and its validating decoder (see dict_wire.hpp and docs/transport.md).
#include "comm/dict_wire.hpp"

#include <algorithm>
#include <bit>
#include <cstring>
#include <numeric>
#include <stdexcept>
#include <string_view>
#include <utility>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "core/canonical_order.hpp"
#include "tensordict/errors.hpp"

namespace td::detail {

static_assert(std::endian::native == std::endian::little,
              "the metadata format stores integers little-endian, in native byte order");

namespace {

constexpr std::uint8_t kEntryDict = 0;
constexpr std::uint8_t kEntryDense = 1;
constexpr std::uint8_t kEntrySparse = 2;

// ---- encoding ------------------------------------------------------------------------------

class Writer {
 public:
  template <class T>
  void put(T v) {
    append(&v, sizeof(T));
  }
  void put_bytes(std::string_view s) { append(s.data(), s.size()); }
  void put_shape(const Shape& s) {
    put(static_cast<std::uint8_t>(s.size()));
    for (const std::int64_t d : s) put(d);
  }
  std::vector<std::byte> take() {
    out_.resize(used_);
    return std::move(out_);
  }

 private:
  void append(const void* p, std::size_t n) {
    if (used_ + n > out_.size())
      out_.resize(std::max<std::size_t>(2 * out_.size(), used_ + n + 64));
    std::memcpy(out_.data() + used_, p, n);
    used_ += n;
  }
  std::vector<std::byte> out_;
  std::size_t used_ = 0;
};

void encode_dict(const DictLayout& layout, std::uint32_t index, Writer& w) {
  const WireDict& d = layout.dicts[index];
  w.put_shape(d.batch);
  w.put(static_cast<std::uint32_t>(d.entries.size()));
  for (const auto& e : d.entries) {
    w.put(static_cast<std::uint16_t>(e.name.size()));
    w.put_bytes(e.name);
    if (e.is_dict) {
      w.put(kEntryDict);
      encode_dict(layout, e.index, w);
      continue;
    }
    const WireLeaf& l = layout.leaves[e.index];
    w.put(l.sparse ? kEntrySparse : kEntryDense);
    w.put(static_cast<std::uint8_t>(l.dtype));
    w.put_shape(l.shape);
    if (l.sparse) w.put(l.nnz);
  }
}

// ---- decoding ------------------------------------------------------------------------------

[[noreturn]] void reject(std::size_t at, std::string_view why) {
  throw Error(fmt::format("invalid transport metadata at byte {}: {}", at, why));
}

class Reader {
 public:
  explicit Reader(std::span<const std::byte> in) : in_(in) {}
  template <class T>
  T get(std::string_view what) {
    need(sizeof(T), what);
    T v;
    std::memcpy(&v, in_.data() + pos_, sizeof(T));
    pos_ += sizeof(T);
    return v;
  }
  std::string get_bytes(std::size_t n, std::string_view what) {
    need(n, what);
    std::string s(reinterpret_cast<const char*>(in_.data() + pos_), n);
    pos_ += n;
    return s;
  }
  std::size_t pos() const { return pos_; }
  std::size_t left() const { return in_.size() - pos_; }

 private:
  void need(std::size_t n, std::string_view what) const {
    if (n > left())
      reject(pos_, fmt::format("truncated: {} needs {} bytes, {} left", what, n, left()));
  }
  std::span<const std::byte> in_;
  std::size_t pos_ = 0;
};

// Elements of a shape, checked: every dimension non-negative and the bytes within the stream
// limit (so no offset computed from it can overflow).
std::uint64_t checked_numel(const Shape& s, DType dtype, std::size_t at) {
  std::uint64_t n = 1;
  for (const std::int64_t d : s) {
    if (d < 0)
      reject(at, fmt::format("negative dimension {} in shape [{}]", d, fmt::join(s, ", ")));
    if (d != 0 && n > kWireMaxStreamBytes / static_cast<std::uint64_t>(d))
      reject(at, fmt::format("shape [{}] has too many elements", fmt::join(s, ", ")));
    n *= static_cast<std::uint64_t>(d);
  }
  if (n > kWireMaxStreamBytes / itemsize(dtype))
    reject(at, fmt::format("shape [{}] has too many elements", fmt::join(s, ", ")));
  return n;
}

class Decoder {
 public:
  explicit Decoder(std::span<const std::byte> in) : r_(in) {}

  DictLayout run() {
    for (const std::uint8_t m : kWireMagic) {
      const std::size_t at = r_.pos();
      const auto b = r_.get<std::uint8_t>("the header");
      if (at == kWireMagic.size() - 1 && b != m)
        reject(at, fmt::format("format version {} (this build reads version {})", b, m));
      if (b != m) reject(at, "not transport metadata (bad magic bytes)");
    }
    dict(Shape{}, 0);
    if (r_.left() != 0) reject(r_.pos(), fmt::format("{} trailing bytes", r_.left()));
    return std::move(out_);
  }

 private:
  Shape shape(std::string_view what) {
    const std::size_t at = r_.pos();
    const auto ndim = r_.get<std::uint8_t>(what);
    if (ndim > kWireMaxDims)
      reject(at, fmt::format("{} has {} dimensions (at most {})", what, ndim, kWireMaxDims));
    Shape s(ndim);
    for (auto& d : s) d = r_.get<std::int64_t>(what);
    return s;
  }

  static bool starts_with(const Shape& s, const Shape& prefix) {
    return s.size() >= prefix.size() && std::equal(prefix.begin(), prefix.end(), s.begin());
  }

  std::uint32_t dict(const Shape& parent_batch, std::size_t depth) {
    if (depth > kWireMaxDepth)
      reject(r_.pos(), fmt::format("dicts nested more than {} deep", kWireMaxDepth));
    const auto index = static_cast<std::uint32_t>(out_.dicts.size());
    out_.dicts.emplace_back();
    const std::size_t batch_at = r_.pos();
    Shape batch = shape("a batch size");
    checked_numel(batch, DType::Bool, batch_at);
    if (!starts_with(batch, parent_batch))
      reject(batch_at, fmt::format("batch size [{}] does not start with the enclosing [{}]",
                                   fmt::join(batch, ", "), fmt::join(parent_batch, ", ")));
    const std::size_t count_at = r_.pos();
    const auto count = r_.get<std::uint32_t>("an entry count");
    // Every entry takes at least 6 bytes: a claim beyond what is left is a lie, not an allocation.
    if (count > r_.left() / 6)
      reject(count_at, fmt::format("{} entries claimed, {} bytes left", count, r_.left()));
    std::vector<WireDict::Entry> entries;
    entries.reserve(count);
    for (std::uint32_t i = 0; i < count; ++i) {
      const std::size_t at = r_.pos();
      const auto len = r_.get<std::uint16_t>("a name length");
      if (len == 0) reject(at, "an empty key name");
      std::string name = r_.get_bytes(len, "a name");  // duplicates: plan_streams
      const std::size_t kind_at = r_.pos();
      const auto kind = r_.get<std::uint8_t>("an entry kind");
      WireDict::Entry e{std::move(name), kind == kEntryDict, 0};
      if (kind == kEntryDict) {
        e.index = dict(batch, depth + 1);
      } else if (kind == kEntryDense || kind == kEntrySparse) {
        e.index = leaf(batch, kind == kEntrySparse);
      } else {
        reject(kind_at, fmt::format("unknown entry kind {}", kind));
      }
      entries.push_back(std::move(e));
    }
    out_.dicts[index].batch = std::move(batch);
    out_.dicts[index].entries = std::move(entries);
    return index;
  }

  std::uint32_t leaf(const Shape& batch, bool sparse) {
    const std::size_t at = r_.pos();
    const auto dt = r_.get<std::uint8_t>("a dtype");
    if (dt >= kNumDTypes) reject(at, fmt::format("unknown dtype {}", dt));
    WireLeaf l;
    l.dtype = static_cast<DType>(dt);
    l.sparse = sparse;
    const std::size_t shape_at = r_.pos();
    l.shape = shape("a shape");
    checked_numel(l.shape, l.dtype, shape_at);
    if (!starts_with(l.shape, batch))
      reject(shape_at, fmt::format("shape [{}] does not start with the batch size [{}]",
                                   fmt::join(l.shape, ", "), fmt::join(batch, ", ")));
    if (sparse) {
      const std::size_t nnz_at = r_.pos();
      l.nnz = r_.get<std::int64_t>("a nonzero count");
      if (l.nnz < 0) reject(nnz_at, fmt::format("negative nonzero count {}", l.nnz));
      const auto nnz = static_cast<std::uint64_t>(l.nnz);
      if (nnz > kWireMaxStreamBytes / 8 / std::max<std::uint64_t>(1, l.shape.size()))
        reject(nnz_at, fmt::format("nonzero count {} is too large", l.nnz));
    }
    out_.leaves.push_back(std::move(l));
    return static_cast<std::uint32_t>(out_.leaves.size() - 1);
  }

  Reader r_;
  DictLayout out_;
};

std::uint64_t numel_of(const Shape& s) {
  return std::accumulate(s.begin(), s.end(), std::uint64_t{1}, [](std::uint64_t a, std::int64_t d) {
    return a * static_cast<std::uint64_t>(d);
  });
}

// Calls f(leaf index) for every leaf of dict `index` in canonical order (core/canonical_order.hpp).
// Throws td::Error for a name that appears twice in one dict (only a peer's metadata can hold
// one).
template <class F>
void for_each_canonical(const DictLayout& layout, std::uint32_t index, F&& f) {
  const auto& entries = layout.dicts[index].entries;
  std::size_t duplicate = 0;
  const std::vector<std::uint32_t> order = canonical_entries(
      entries.size(), [&](std::uint32_t i) -> const std::string& { return entries[i].name; },
      &duplicate);
  if (duplicate < entries.size())
    throw Error(fmt::format("invalid transport metadata: key name '{}' appears twice in one dict",
                            entries[duplicate].name));
  for (const std::uint32_t i : order) {
    const auto& e = entries[i];
    if (e.is_dict) {
      for_each_canonical(layout, e.index, f);
    } else {
      f(e.index);
    }
  }
}

// Assigns every leaf its offsets in the streams (see DictLayout) and sums the streams' sizes;
// throws td::Error when a stream would exceed kWireMaxStreamBytes.
void plan_streams(DictLayout& layout) {
  std::vector<std::uint32_t> order;
  order.reserve(layout.leaves.size());
  for_each_canonical(layout, 0, [&](std::uint32_t i) { order.push_back(i); });
  auto& elems = layout.stream_elems;
  elems.fill(0);
  auto take = [&](DType dtype, std::uint64_t n) {
    std::uint64_t& total = elems[static_cast<std::size_t>(dtype)];
    const std::uint64_t at = total;
    if (n > kWireMaxStreamBytes / itemsize(dtype) - total)
      throw Error(fmt::format("invalid transport metadata: the {} data exceeds {} bytes",
                              name(dtype), kWireMaxStreamBytes));
    total += n;
    return at;
  };
  for (const std::uint32_t i : order) {
    WireLeaf& l = layout.leaves[i];
    if (!l.sparse) l.offset = take(l.dtype, numel_of(l.shape));
  }
  for (const std::uint32_t i : order) {
    WireLeaf& l = layout.leaves[i];
    if (!l.sparse) continue;
    const auto nnz = static_cast<std::uint64_t>(l.nnz);
    l.indices_offset = take(DType::Int64, nnz * l.shape.size());
    l.offset = take(l.dtype, nnz);
  }
}

void describe_into(const TensorDict& d, DictLayout& layout, std::uint32_t index,
                   std::vector<std::string>& path, std::vector<Tensor>& tensors) {
  layout.dicts[index].batch = d.batch_size();
  for (const Key& k : d.keys()) {
    const std::string& name = k.parts().back();
    if (name.size() > 0xffff)
      throw Error(fmt::format("key name of {} bytes is too long for transport (at most 65535)",
                              name.size()));
    path.push_back(name);
    WireDict::Entry e{name, d.is_dict(k), 0};
    if (e.is_dict) {
      e.index = static_cast<std::uint32_t>(layout.dicts.size());
      layout.dicts.emplace_back();
      describe_into(d.get_dict(k), layout, e.index, path, tensors);
    } else {
      const Tensor& t = d.get(k);
      if (!t.defined())
        throw Error(fmt::format("key '{}' holds an undefined tensor", Key(path).str()));
      WireLeaf l;
      l.dtype = t.dtype();
      l.shape = t.shape();
      l.sparse = t.is_sparse();
      if (l.sparse) l.nnz = t.nnz();
      if (l.shape.size() > kWireMaxDims)
        throw Error(
            fmt::format("key '{}' has more than {} dimensions", Key(path).str(), kWireMaxDims));
      e.index = static_cast<std::uint32_t>(layout.leaves.size());
      layout.leaves.push_back(std::move(l));
      tensors.push_back(t);
    }
    path.pop_back();
    layout.dicts[index].entries.push_back(std::move(e));
  }
}

// A 1-D view of `n` elements of `stream` from element `offset`, shaped `shape`.
Tensor view_in(const Tensor& stream, std::uint64_t offset, std::uint64_t n, const Shape& shape) {
  return stream.slice(0, static_cast<std::int64_t>(offset), static_cast<std::int64_t>(offset + n))
      .view(shape);
}

TensorDict build(const DictLayout& layout, std::uint32_t index,
                 const std::array<Tensor, kNumDTypes>& streams) {
  const WireDict& d = layout.dicts[index];
  TensorDict out(d.batch);
  for (const auto& e : d.entries) {
    if (e.is_dict) {
      out.set(Key(e.name), build(layout, e.index, streams));
      continue;
    }
    const WireLeaf& l = layout.leaves[e.index];
    const Tensor& stream = streams[static_cast<std::size_t>(l.dtype)];
    if (!l.sparse) {
      out.set(Key(e.name), view_in(stream, l.offset, numel_of(l.shape), l.shape));
      continue;
    }
    const auto ndim = static_cast<std::int64_t>(l.shape.size());
    const auto nnz = static_cast<std::uint64_t>(l.nnz);
    Tensor indices = view_in(streams[static_cast<std::size_t>(DType::Int64)], l.indices_offset,
                             nnz * l.shape.size(), {ndim, l.nnz});
    Tensor values = view_in(stream, l.offset, nnz, {l.nnz});
    try {
      out.set(Key(e.name), Tensor::sparse_coo(std::move(indices), std::move(values), l.shape));
    } catch (const std::invalid_argument& err) {
      throw Error(fmt::format("received sparse leaf '{}' is invalid: {}", e.name, err.what()));
    }
  }
  return out;
}

}  // namespace

std::array<std::uint64_t, kNumDTypes> DictLayout::stream_bytes() const {
  std::array<std::uint64_t, kNumDTypes> out{};
  for (std::size_t k = 0; k < kNumDTypes; ++k)
    out[k] = stream_elems[k] * itemsize(static_cast<DType>(k));
  return out;
}

DictLayout describe_dict(const TensorDict& d, std::vector<Tensor>& tensors) {
  DictLayout layout;
  layout.dicts.emplace_back();
  std::vector<std::string> path;
  tensors.clear();
  describe_into(d, layout, 0, path, tensors);
  plan_streams(layout);
  return layout;
}

std::vector<std::byte> encode_layout(const DictLayout& layout) {
  Writer w;
  for (const std::uint8_t m : kWireMagic) w.put(m);
  encode_dict(layout, 0, w);
  return w.take();
}

DictLayout decode_layout(std::span<const std::byte> bytes) {
  DictLayout layout = Decoder(bytes).run();
  plan_streams(layout);
  return layout;
}

const std::byte* stream_in_place(const DictLayout& layout, const std::vector<Tensor>& tensors,
                                 DType dtype) {
  const Tensor* anchor = nullptr;
  for (std::size_t i = 0; i < layout.leaves.size(); ++i) {
    const WireLeaf& l = layout.leaves[i];
    const bool in_stream = l.sparse ? (l.dtype == dtype || dtype == DType::Int64) && l.nnz > 0
                                    : l.dtype == dtype && numel_of(l.shape) > 0;
    if (!in_stream) continue;
    if (l.sparse) return nullptr;
    if (l.offset == 0) anchor = &tensors[i];
  }
  if (anchor == nullptr || !anchor->is_contiguous()) return nullptr;
  for (std::size_t i = 0; i < layout.leaves.size(); ++i) {
    const WireLeaf& l = layout.leaves[i];
    const Tensor& t = tensors[i];
    if (l.sparse || l.dtype != dtype || t.numel() == 0) continue;
    if (!t.is_contiguous() || !t.shares_storage_with(*anchor) ||
        t.storage_offset() - anchor->storage_offset() != static_cast<std::int64_t>(l.offset))
      return nullptr;
  }
  return static_cast<const std::byte*>(anchor->raw_data());
}

std::vector<StreamSegment> stream_segments(const DictLayout& layout, DType dtype) {
  std::vector<StreamSegment> out;
  for (std::size_t i = 0; i < layout.leaves.size(); ++i) {
    const WireLeaf& l = layout.leaves[i];
    const auto leaf = static_cast<std::uint32_t>(i);
    if (!l.sparse) {
      const std::uint64_t n = numel_of(l.shape);
      if (l.dtype == dtype && n > 0) out.push_back({l.offset, n, leaf, 0});
      continue;
    }
    const auto nnz = static_cast<std::uint64_t>(l.nnz);
    if (nnz == 0) continue;
    if (l.dtype == dtype) out.push_back({l.offset, nnz, leaf, 1});
    if (dtype == DType::Int64 && !l.shape.empty())
      out.push_back({l.indices_offset, nnz * l.shape.size(), leaf, 2});
  }
  std::sort(out.begin(), out.end(),
            [](const StreamSegment& a, const StreamSegment& b) { return a.offset < b.offset; });
  return out;
}

void pack_stream(const DictLayout& layout, const std::vector<Tensor>& tensors, DType dtype,
                 Tensor& dst) {
  for (std::size_t i = 0; i < layout.leaves.size(); ++i) {
    const WireLeaf& l = layout.leaves[i];
    const Tensor& t = tensors[i];
    if (!l.sparse) {
      const std::uint64_t n = numel_of(l.shape);
      if (l.dtype == dtype && n > 0) view_in(dst, l.offset, n, l.shape).copy_(t);
      continue;
    }
    const auto nnz = static_cast<std::uint64_t>(l.nnz);
    if (nnz == 0) continue;
    if (l.dtype == dtype) view_in(dst, l.offset, nnz, {l.nnz}).copy_(t.values());
    if (dtype == DType::Int64 && !l.shape.empty())
      view_in(dst, l.indices_offset, nnz * l.shape.size(),
              {static_cast<std::int64_t>(l.shape.size()), l.nnz})
          .copy_(t.indices());
  }
}

TensorDict materialize(const DictLayout& layout, const std::array<Tensor, kNumDTypes>& streams) {
  for (std::size_t k = 0; k < kNumDTypes; ++k) {
    const std::uint64_t have =
        streams[k].defined() ? static_cast<std::uint64_t>(streams[k].numel()) : 0;
    if (have != layout.stream_elems[k])
      throw Error(fmt::format("transport: {} {} elements received where the metadata says {}", have,
                              name(static_cast<DType>(k)), layout.stream_elems[k]));
  }
  // Leaves without elements are views too (of an empty stream where the dtype has no data), so
  // that the result is consolidated.
  std::array<Tensor, kNumDTypes> all = streams;
  for (std::size_t k = 0; k < kNumDTypes; ++k)
    if (!all[k].defined()) all[k] = Tensor::empty({0}, static_cast<DType>(k));
  try {
    return build(layout, 0, all);
  } catch (const std::invalid_argument& err) {
    throw Error(fmt::format("transport: the received layout is invalid: {}", err.what()));
  }
}

}  // namespace td::detail
