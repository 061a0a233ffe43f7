// libFuzzer target: the checkpoint parsers (src/comm/checkpoint_format.cpp) on arbitrary bytes, as
// a corrupted or hostile file would hold them. Byte 0 picks the parser: a safetensors header
// (bytes 1-4: the data buffer's claimed length, then the JSON) with its __metadata__ structure
// record, or a memmap meta.json. Each must reject with td::Error or accept something consistent:
// the tensors cover the data buffer exactly, and what is accepted re-encodes and decodes to the
// same entries. Anything else (a crash, a sanitizer report, another exception) is a bug. The
// library keeps the parsers internal: this target links their objects (td_formats).
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <span>

#include "comm/checkpoint_format.hpp"

namespace {

void check_safetensors(std::span<const std::byte> json, std::uint64_t data_bytes) {
  td::detail::SafetensorsHeader h;
  try {
    h = td::detail::decode_safetensors_header(json, 8 + json.size() + data_bytes, "fuzz");
  } catch (const td::Error&) {
    return;
  }
  std::uint64_t at = 0;
  for (const auto& e : h.entries) {
    if (e.begin != at || e.end < e.begin || e.end > h.data_bytes) std::abort();
    at = e.end;
  }
  if (at != h.data_bytes || h.data_bytes != data_bytes) std::abort();
  if (const auto it = h.metadata.find(std::string(td::detail::kStructureMetadataKey));
      it != h.metadata.end()) {
    try {
      const auto s = td::detail::decode_structure(it->second, "fuzz");
      const auto again = td::detail::decode_structure(td::detail::encode_structure(s), "fuzz");
      if (again.keys != s.keys || again.dicts != s.dicts) std::abort();
    } catch (const td::Error&) {
    }
  }
  // Re-encode what the library can hold, in data order: the same offsets and shapes.
  std::vector<td::detail::PlannedTensor> planned;
  for (const auto& e : h.entries) {
    if (!e.dtype) return;
    planned.push_back({e.name, *e.dtype, e.shape});
  }
  td::detail::EncodedHeader enc;
  try {
    enc = td::detail::encode_safetensors_header(planned, h.metadata);
  } catch (const td::Error&) {
    return;  // e.g. a longer header than the limit after re-encoding
  }
  const std::span<const std::byte> text(enc.bytes.data() + 8, enc.bytes.size() - 8);
  const auto back =
      td::detail::decode_safetensors_header(text, enc.bytes.size() + data_bytes, "re");
  if (back.entries.size() != h.entries.size() || back.metadata != h.metadata) std::abort();
  for (std::size_t i = 0; i < h.entries.size(); ++i)
    if (back.entries[i].name != h.entries[i].name || back.entries[i].shape != h.entries[i].shape ||
        back.entries[i].begin != h.entries[i].begin || back.entries[i].end != h.entries[i].end)
      std::abort();
}

void check_memmap(std::string_view json) {
  td::detail::MemmapMeta m;
  try {
    m = td::detail::decode_memmap_meta(json, "fuzz");
  } catch (const td::Error&) {
    return;
  }
  const auto back = td::detail::decode_memmap_meta(td::detail::encode_memmap_meta(m), "re");
  if (back.batch != m.batch || back.entries.size() != m.entries.size()) std::abort();
  for (std::size_t i = 0; i < m.entries.size(); ++i)
    if (back.entries[i].key != m.entries[i].key || back.entries[i].shape != m.entries[i].shape ||
        back.entries[i].is_dict != m.entries[i].is_dict)
      std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size < 1) return 0;
  const auto* bytes = reinterpret_cast<const std::byte*>(data);
  if (data[0] % 2 == 0) {
    if (size < 5) return 0;
    std::uint32_t data_bytes = 0;
    std::memcpy(&data_bytes, data + 1, 4);
    const std::span<const std::byte> json(bytes + 5, size - 5);
    check_safetensors(json, data_bytes);
    try {  // the length prefix on its own
      (void)td::detail::safetensors_header_length(json, size - 5 + data_bytes, "fuzz");
    } catch (const td::Error&) {
    }
  } else {
    check_memmap(std::string_view(reinterpret_cast<const char*>(data + 1), size - 1));
  }
  return 0;
}
