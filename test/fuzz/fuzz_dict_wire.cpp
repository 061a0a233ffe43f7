// libFuzzer target: the transport metadata decoder (src/comm/dict_wire.cpp) on arbitrary bytes,
// as a corrupted or hostile peer would send them. It must either reject them with td::Error or
// accept a layout that re-encodes to the very same bytes and whose dict can be built from
// streams of the announced sizes (td::Error allowed there too, for sparse indices out of range).
// Anything else (a crash, a sanitizer report, another exception, a huge allocation) is a bug.
// The library keeps the decoder internal: this target links its objects (td_formats).
#include <cstdint>
#include <cstdlib>
#include <span>

#include "comm/dict_wire.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::span<const std::byte> in(reinterpret_cast<const std::byte*>(data), size);
  td::detail::DictLayout layout;
  try {
    layout = td::detail::decode_layout(in);
  } catch (const td::Error&) {
    return 0;
  }
  const std::vector<std::byte> again = td::detail::encode_layout(layout);
  if (again.size() != size || !std::equal(again.begin(), again.end(), in.begin())) std::abort();
  std::uint64_t total = 0;
  for (std::size_t k = 0; k < td::kNumDTypes; ++k)
    total += layout.stream_elems[k] * td::itemsize(static_cast<td::DType>(k));
  if (total > (std::uint64_t{1} << 24)) return 0;  // valid, but too large to build here
  std::array<td::Tensor, td::kNumDTypes> streams;
  for (std::size_t k = 0; k < td::kNumDTypes; ++k)
    if (layout.stream_elems[k] > 0)
      streams[k] = td::Tensor::zeros({static_cast<std::int64_t>(layout.stream_elems[k])},
                                     static_cast<td::DType>(k));
  try {
    const td::TensorDict d = td::detail::materialize(layout, streams);
    if (!d.is_consolidated()) std::abort();
  } catch (const td::Error&) {
  }
  return 0;
}
