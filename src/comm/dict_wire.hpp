// The metadata of transport without a prior layout (td::broadcast_dict, send_dict, the ragged
// gathers, scatter_dicts): a TensorDict's structure as bytes, and the validating decoder that
// turns bytes from a peer (possibly corrupted or hostile) back into it. Pure: no MPI, only the
// public core API, so the decoder is fuzzed on its own (test/fuzz/fuzz_dict_wire.cpp). The
// format is documented in docs/transport.md.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "tensordict/tensor_dict.hpp"

namespace td::detail {

/// First bytes of every encoded layout: "TDW" and the format version.
inline constexpr std::array<std::uint8_t, 4> kWireMagic = {'T', 'D', 'W', 1};
/// Limits the decoder enforces on a peer's claims (a hostile peer cannot make a receiver recurse
/// deeply, allocate without bound or overflow an offset).
inline constexpr std::size_t kWireMaxDepth = 64;
inline constexpr std::size_t kWireMaxDims = 64;
inline constexpr std::uint64_t kWireMaxStreamBytes = std::uint64_t{1} << 50;  // 1 PiB per dtype
/// Largest encoded layout a receiver accepts (bytes).
inline constexpr std::uint64_t kWireMaxMetadataBytes = std::uint64_t{1} << 30;

/// One leaf of a dict on the wire.
struct WireLeaf {
  DType dtype = DType::Float32;
  Shape shape;  // the dense shape (sparse leaves included)
  bool sparse = false;
  std::int64_t nnz = 0;  // sparse: values are [nnz], indices int64 [ndim, nnz]
  // Element offsets in the per-dtype streams (set by plan_streams): the dense data or the sparse
  // values in the `dtype` stream, the sparse indices in the int64 stream.
  std::uint64_t offset = 0;
  std::uint64_t indices_offset = 0;
};

/// One (sub-)dict: its batch size and its entries in insertion order.
struct WireDict {
  Shape batch;
  struct Entry {
    std::string name;
    bool is_dict = false;
    std::uint32_t index = 0;  // into DictLayout::dicts or DictLayout::leaves
  };
  std::vector<Entry> entries;
};

/// A TensorDict's structure and where each leaf's elements lie in the per-dtype streams: per
/// dtype, the dense leaves in canonical (sorted key) order, back to back, then the sparse leaves'
/// values; the sparse indices follow the dense int64 leaves in the int64 stream.
struct DictLayout {
  std::vector<WireDict> dicts;   // [0] is the root
  std::vector<WireLeaf> leaves;  // in insertion order (depth first)
  std::array<std::uint64_t, kNumDTypes> stream_elems{};
  /// Bytes of each dtype's stream.
  std::array<std::uint64_t, kNumDTypes> stream_bytes() const;
};

/// `d`'s layout, with its leaves (in DictLayout::leaves order) in `tensors`. Throws td::Error for a
/// dict that cannot be described (a moved-from dict, an undefined leaf).
DictLayout describe_dict(const TensorDict& d, std::vector<Tensor>& tensors);
/// The encoded layout (kWireMagic, then the tree; see docs/transport.md).
std::vector<std::byte> encode_layout(const DictLayout& layout);
/// Decodes and validates `bytes`; throws td::Error naming what is wrong (truncated, trailing
/// bytes, an unknown version or dtype, a bad name, an inconsistent or absurd size). Never reads
/// outside `bytes`; allocates at most a small multiple of bytes.size().
DictLayout decode_layout(std::span<const std::byte> bytes);

/// Where stream `k` of a sender can be sent from without a copy: the address of its first element
/// when the dtype's dense leaves lie back to back in canonical order in one storage (as after
/// TensorDict::consolidate()) and no sparse leaf contributes to the stream; else null.
const std::byte* stream_in_place(const DictLayout& layout, const std::vector<Tensor>& tensors,
                                 DType dtype);
/// One run of a stream's elements: [offset, offset + count) of stream `dtype`, which holds leaf
/// `leaf`'s dense elements (part 0), its sparse values (1) or its sparse indices (2).
struct StreamSegment {
  std::uint64_t offset = 0, count = 0;
  std::uint32_t leaf = 0;
  int part = 0;
};
/// The non-empty segments of stream `dtype`, in stream order (both sides derive the same list).
std::vector<StreamSegment> stream_segments(const DictLayout& layout, DType dtype);
/// Copies every leaf contributing to stream `dtype` into `dst` (a contiguous 1-D tensor of
/// layout.stream_elems[dtype] elements), at its offset.
void pack_stream(const DictLayout& layout, const std::vector<Tensor>& tensors, DType dtype,
                 Tensor& dst);
/// The dict `layout` describes, whose leaves are views into `streams` (1-D contiguous tensors of
/// layout.stream_elems[k] elements each; undefined where that is 0): a consolidated dict. Throws
/// td::Error when the data contradicts the layout (a sparse index out of range).
TensorDict materialize(const DictLayout& layout, const std::array<Tensor, kNumDTypes>& streams);

}  // namespace td::detail
