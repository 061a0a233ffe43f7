// White-box test of how a checkpoint's collective MPI-IO transfer is cut into calls
// (comm/file_io's split_rounds): every byte once, in order, at the same file offset and memory
// address; no round and no block above the round size (so no count reaches INT_MAX at the real
// 512 MiB); blocks adjacent in the file and in memory merged. Pure: no MPI_Init.
#include <catch2/catch.hpp>

#include <cstddef>
#include <cstdint>
#include <random>
#include <vector>

#include "comm/file_io.hpp"

using td::detail::FileRange;
using td::detail::split_rounds;

namespace {

// Every byte of `blocks`, as (file offset, memory address) pairs, in order.
std::vector<std::pair<std::uint64_t, const std::byte*>> bytes_of(
    const std::vector<FileRange>& blocks) {
  std::vector<std::pair<std::uint64_t, const std::byte*>> out;
  for (const FileRange& b : blocks)
    for (std::uint64_t i = 0; i < b.size; ++i) out.emplace_back(b.offset + i, b.data + i);
  return out;
}

void check_rounds(const std::vector<FileRange>& blocks, std::uint64_t round_bytes) {
  const auto rounds = split_rounds(blocks, round_bytes);
  std::vector<FileRange> flat;
  for (std::size_t k = 0; k < rounds.size(); ++k) {
    const auto& round = rounds[k];
    INFO("round " << k << " of " << rounds.size());
    REQUIRE(!round.empty());
    std::uint64_t total = 0;
    for (std::size_t i = 0; i < round.size(); ++i) {
      CHECK(round[i].size > 0);
      total += round[i].size;
      if (i > 0) {  // merged wherever both file and memory continue
        const FileRange& a = round[i - 1];
        CHECK_FALSE((a.offset + a.size == round[i].offset && a.data + a.size == round[i].data));
      }
    }
    CHECK(total <= round_bytes);
    if (k + 1 < rounds.size()) CHECK(total == round_bytes);  // only the last round is short
    flat.insert(flat.end(), round.begin(), round.end());
  }
  CHECK(bytes_of(flat) == bytes_of(blocks));
}

}  // namespace

TEST_CASE("split_rounds: fixed cases", "[file_io]") {
  std::vector<std::byte> mem(1000);
  std::byte* m = mem.data();
  SECTION("nothing") { CHECK(split_rounds({}, 64).empty()); }
  SECTION("one block larger than several rounds") {
    const std::vector<FileRange> blocks{{100, m, 300}};
    const auto rounds = split_rounds(blocks, 64);
    REQUIRE(rounds.size() == 5);  // 64 x 4 + 44
    CHECK(rounds[4].size() == 1);
    CHECK(rounds[4][0].offset == 100 + 256);
    CHECK(rounds[4][0].data == m + 256);
    CHECK(rounds[4][0].size == 44);
    check_rounds(blocks, 64);
  }
  SECTION("adjacent in the file and in memory: one block") {
    const std::vector<FileRange> blocks{{0, m, 10}, {10, m + 10, 10}};
    const auto rounds = split_rounds(blocks, 64);
    REQUIRE(rounds.size() == 1);
    REQUIRE(rounds[0].size() == 1);
    CHECK(rounds[0][0].size == 20);
  }
  SECTION("adjacent in the file only: two blocks") {
    const std::vector<FileRange> blocks{{0, m, 10}, {10, m + 500, 10}};
    CHECK(split_rounds(blocks, 64)[0].size() == 2);
    check_rounds(blocks, 64);
  }
  SECTION("a round ends exactly at a block's end") {
    const std::vector<FileRange> blocks{{0, m, 64}, {200, m + 200, 64}};
    const auto rounds = split_rounds(blocks, 64);
    REQUIRE(rounds.size() == 2);
    CHECK(rounds[1][0].offset == 200);
  }
}

TEST_CASE("split_rounds: random blocks keep every byte once, in order", "[file_io]") {
  std::mt19937_64 rng(12345);
  std::vector<std::byte> mem(1 << 16);
  for (int trial = 0; trial < 300; ++trial) {
    const std::uint64_t round_bytes = 1 + rng() % 200;
    std::vector<FileRange> blocks;
    std::uint64_t offset = rng() % 50, at = rng() % 50;
    const int n = static_cast<int>(rng() % 12);
    for (int i = 0; i < n; ++i) {
      const std::uint64_t size = 1 + rng() % 400;
      if (at + size > mem.size()) break;
      blocks.push_back({offset, mem.data() + at, size});
      // The next block: adjacent in the file and/or in memory, or not.
      offset += size + (rng() % 2 ? 0 : rng() % 30);
      at += size + (rng() % 2 ? 0 : rng() % 30);
    }
    INFO("trial " << trial << ", round_bytes " << round_bytes << ", " << blocks.size()
                  << " blocks");
    check_rounds(blocks, round_bytes);
  }
}
