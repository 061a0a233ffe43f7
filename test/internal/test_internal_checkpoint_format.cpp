// The checkpoint formats' codec (src/comm/checkpoint_format.*) white-box, without files or MPI:
// the safetensors header encoded byte for byte as the reference implementation encodes it
// (test/support/safetensors_reference.hpp), and tensordict's encoding of a key into a memmap file
// name. test_serial_checkpoint tests the files through the public API.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cstddef>
#include <string>
#include <vector>

#include "../support/safetensors_reference.hpp"
#include "comm/checkpoint_format.hpp"

using td::DType;
using tdtest::kReferenceAttn;
using tdtest::kReferenceEmptyWithMetadata;

TEST_CASE("safetensors: the header is encoded as the reference encodes it", "[safetensors]") {
  const std::vector<td::detail::PlannedTensor> t = {{"attn.0", DType::Float32, {1, 2, 3}}};
  const auto h = td::detail::encode_safetensors_header(t, {});
  REQUIRE(h.bytes.size() == 72);
  CHECK(std::equal(h.bytes.begin(), h.bytes.end(),
                   reinterpret_cast<const std::byte*>(kReferenceAttn.data())));
  CHECK(h.data_bytes == 24);
  // Padded with spaces to a multiple of 8, as the reference pads.
  const auto e = td::detail::encode_safetensors_header({}, {{"framework", "pt"}});
  CHECK(std::equal(e.bytes.begin(), e.bytes.end(),
                   reinterpret_cast<const std::byte*>(kReferenceEmptyWithMetadata.data())));
  CHECK(e.bytes.size() == kReferenceEmptyWithMetadata.size());
}

TEST_CASE("memmap: key encoding is tensordict's", "[memmap]") {
  CHECK(td::detail::memmap_file_name("obs") == "obs");
  CHECK(td::detail::memmap_file_name("a/b") == "a%2Fb");
  CHECK(td::detail::memmap_file_name("50%") == "50%25");
  CHECK(td::detail::memmap_file_name("") == "%");
  CHECK(td::detail::memmap_file_name("..") == "%2E%2E");
  CHECK(td::detail::memmap_file_name("x.y") == "x.y");
  CHECK(td::detail::memmap_file_name(std::string("n\0l", 3)) == "n%00l");
}
