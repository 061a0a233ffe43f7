// Bytes that the reference implementation of safetensors writes (huggingface/safetensors,
// safetensors/src/tensor.rs at 24b0b2857fef49be734b9ab72ce97c09bb25f5b9: the expected outputs of
// its tests, i.e. what its serialize() writes; no code copied), for the tests of the loader
// (test_serial_checkpoint) and of the header codec (test/internal/test_internal_checkpoint_format).
#pragma once

#include <cstdint>
#include <vector>

namespace tdtest {

// What safetensors' serialize() writes for {"attn.0": F32 [1, 2, 3] = 0..5} (tensor.rs,
// test_serialization).
inline const std::vector<std::uint8_t> kReferenceAttn = {
    64,  0,   0,   0,   0,   0,  0,  0,  123, 34, 97,  116, 116, 110, 46,  48,  34,  58,  123, 34,
    100, 116, 121, 112, 101, 34, 58, 34, 70,  51, 50,  34,  44,  34,  115, 104, 97,  112, 101, 34,
    58,  91,  49,  44,  50,  44, 51, 93, 44,  34, 100, 97,  116, 97,  95,  111, 102, 102, 115, 101,
    116, 115, 34,  58,  91,  48, 44, 50, 52,  93, 125, 125, 0,   0,   0,   0,   0,   0,   128, 63,
    0,   0,   0,   64,  0,   0,  64, 64, 0,   0,  128, 64,  0,   0,   160, 64};
// serialize() of no tensors with metadata {"framework": "pt"} (tensor.rs, test_empty).
inline const std::vector<std::uint8_t> kReferenceEmptyWithMetadata = {
    40,  0,   0,   0,  0,  0,  0,   0,   123, 34,  95,  95,  109, 101, 116, 97,
    100, 97,  116, 97, 95, 95, 34,  58,  123, 34,  102, 114, 97,  109, 101, 119,
    111, 114, 107, 34, 58, 34, 112, 116, 34,  125, 125, 32,  32,  32,  32,  32};
// serialize() of {"attn.0": F4 [1, 2]} (tensor.rs, test_serialization_fp4): a dtype the library
// lacks.
inline const std::vector<std::uint8_t> kReferenceFp4 = {
    64,  0,   0,   0,   0,   0,   0,  0,  123, 34,  97,  116, 116, 110, 46,  48,  34,  58,  123,
    34,  100, 116, 121, 112, 101, 34, 58, 34,  70,  52,  34,  44,  34,  115, 104, 97,  112, 101,
    34,  58,  91,  49,  44,  50,  93, 44, 34,  100, 97,  116, 97,  95,  111, 102, 102, 115, 101,
    116, 115, 34,  58,  91,  48,  44, 49, 93,  125, 125, 32,  32,  32,  32,  0};

}  // namespace tdtest
