// The two checkpoint formats Python opens, as bytes: safetensors (huggingface/safetensors: an
// 8-byte little-endian header length, a JSON header padded with spaces to a multiple of 8, then
// the data buffer) and tensordict's memmap directory (one meta.json per dict, one raw <key>.memmap
// per leaf). Pure: no MPI and no file access, only the public core API and nlohmann::json (a
// private dependency: no public header includes it), so the validating parsers are fuzzed on
// their own (test/fuzz/fuzz_checkpoint_format.cpp). docs/checkpoint.md describes the formats.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "tensordict/dtype.hpp"
#include "tensordict/key.hpp"
#include "tensordict/tensor.hpp"

namespace td::detail {

/// The largest header the reference implementation accepts (safetensors/src/tensor.rs,
/// MAX_HEADER_SIZE), and so the largest this library writes or reads.
inline constexpr std::uint64_t kSafetensorsMaxHeaderBytes = 100'000'000;
/// Most dimensions a tensor of a file may have (the library's own limit, dict_wire.hpp's too).
inline constexpr std::size_t kCheckpointMaxDims = 64;
/// The __metadata__ entry that records what the flat names cannot (key parts containing '.',
/// nested dicts' batch sizes, the library version).
inline constexpr std::string_view kStructureMetadataKey = "tensordict_mpi";

/// The safetensors name of a dtype ("F32", "BF16", ...); nullopt for Complex128, which the
/// format does not have.
std::optional<std::string_view> safetensors_dtype_name(DType dtype);

/// One tensor of a safetensors header.
struct SafetensorsEntry {
  std::string name;
  std::string dtype_name;      // as the file spells it ("F32", "U16", ...)
  std::optional<DType> dtype;  // nullopt: a dtype of the format the library lacks (U16, F8_...)
  Shape shape;
  std::uint64_t begin = 0, end = 0;  // byte offsets in the data buffer
};

/// A validated header: the tensors cover the data buffer exactly, in data order.
struct SafetensorsHeader {
  std::uint64_t data_start = 0;  // 8 + header length: where the data buffer starts in the file
  std::uint64_t data_bytes = 0;  // the data buffer's length (file size - data_start)
  std::vector<SafetensorsEntry> entries;  // sorted by offset
  std::map<std::string, std::string> metadata;
};

/// The header length stored in a file's first 8 bytes, checked against the limit and against
/// `file_size`; throws td::Error naming `file` for a truncated file or an absurd length.
std::uint64_t safetensors_header_length(std::span<const std::byte> first_bytes,
                                        std::uint64_t file_size, std::string_view file);
/// Parses and validates a file's JSON header (the `length` bytes after the first 8). Throws
/// td::Error naming `file`, the tensor and the problem: invalid UTF-8 or JSON, a header that is
/// not an object or does not begin with '{', a bad field, an unknown dtype, a shape whose byte
/// count overflows, offsets that overlap, leave a hole, disagree with dtype x shape or with the
/// file's size, a duplicate name. Never allocates more than a small multiple of the header.
SafetensorsHeader decode_safetensors_header(std::span<const std::byte> json,
                                            std::uint64_t file_size, std::string_view file);

/// One tensor to be written.
struct PlannedTensor {
  std::string name;
  DType dtype = DType::Float32;
  Shape shape;
};
/// The first bytes of a file: the 8-byte length and the JSON header (padded with spaces to a
/// multiple of 8), with the tensors back to back in the given order, and where each one starts.
struct EncodedHeader {
  std::vector<std::byte> bytes;
  std::vector<std::uint64_t> begin;  // per tensor, in the data buffer
  std::uint64_t data_bytes = 0;
};
/// Encodes a header; throws td::Error for a name that is not valid UTF-8, a dtype the format
/// lacks, or a header above kSafetensorsMaxHeaderBytes.
EncodedHeader encode_safetensors_header(std::span<const PlannedTensor> tensors,
                                        const std::map<std::string, std::string>& metadata);

/// A key as its names, outermost first; empty for the root dict (which td::Key cannot name).
using KeyPath = std::vector<std::string>;

/// What a dict's flat names cannot say: the key of each flat name whose parts contain '.', and
/// the batch size of every dict (the root's key is empty), so empty sub-dicts survive too.
struct DictStructure {
  std::map<std::string, KeyPath> keys;           // flat name -> key, where not the '.'-split
  std::vector<std::pair<KeyPath, Shape>> dicts;  // every dict (the root too), parents first
  std::string version;                           // of the library that wrote the file
};
/// The JSON string stored under __metadata__[kStructureMetadataKey].
std::string encode_structure(const DictStructure& s);
/// Parses and validates it; throws td::Error naming `file`.
DictStructure decode_structure(std::string_view json, std::string_view file);
/// The names of `key` joined by '.' (the flat name of a safetensors tensor).
std::string flat_name(const KeyPath& key);

// ---- tensordict's memmap layout --------------------------------------------------------------

/// torch's name of a dtype: "torch.float32".
std::string torch_dtype_name(DType dtype);

/// One entry of a meta.json: a leaf (its dtype and shape) or a sub-dict.
struct MemmapEntry {
  std::string key;
  bool is_dict = false;
  DType dtype = DType::Float32;
  Shape shape;
};
/// One dict's meta.json: its batch size and entries, in insertion order.
struct MemmapMeta {
  Shape batch;
  std::vector<MemmapEntry> entries;
};
/// A meta.json as tensordict writes it (Python's json.dumps formatting, the same fields).
std::string encode_memmap_meta(const MemmapMeta& meta);
/// Parses and validates a meta.json; throws td::Error naming `file` and the key. Entries of
/// non-tensor data (NonTensorData, NonTensorStack) are skipped.
MemmapMeta decode_memmap_meta(std::string_view json, std::string_view file);
/// The file-system name of a key: tensordict's _encode_key_for_filesystem (robust keys):
/// '/', '<', '>', ':', '"', '|', '?', '*', '\', ' ', '%', NUL, control characters and DEL become
/// %XX; "" becomes "%", "." and ".." become %2E per character.
std::string memmap_file_name(std::string_view key);
/// Keys a dict cannot have in meta.json (they are its own fields: "shape", "device", "_type").
bool is_memmap_reserved_key(std::string_view key);

}  // namespace td::detail
