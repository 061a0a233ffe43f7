// White-box tests of the tensor storage allocator (src/core/storage_pool.*): size classes,
// alignment, reuse, no overlap of live blocks, memory given back, several threads at once, the
// paths without huge pages, and the edge sizes. Each test builds its own StoragePool, so the
// figures are its own; the process-wide pool is checked through Tensor. No MPI.
#include <catch2/catch.hpp>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <limits>
#include <mutex>
#include <new>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "../support/smaps.hpp"
#include "core/storage_pool.hpp"
#include "core/tensor_internal.hpp"

using td::detail::kHugePageBytes;
using td::detail::kPoolClasses;
using td::detail::kPoolMaxBytes;
using td::detail::kPoolMinBytes;
using td::detail::kSpareBudgetBytes;
using td::detail::StorageBlock;
using td::detail::StoragePool;

namespace {

constexpr std::size_t KiB = 1024, MiB = 1024 * 1024;

// A sanitizer's allocator aborts on a request past its limit instead of failing it (unless
// allocator_may_return_null=1): the PTRDIFF_MAX and 1 PiB requests are skipped there.
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
constexpr bool kSanitized = true;
#else
constexpr bool kSanitized = false;
#endif

StoragePool::Options on() { return StoragePool::Options{}; }

std::uintptr_t addr(const void* p) { return reinterpret_cast<std::uintptr_t>(p); }

// One live block and the pattern it was filled with.
struct Live {
  StorageBlock b;
  std::size_t n = 0;
  std::uint8_t tag = 0;
};

void fill(const Live& l) { std::memset(l.b.data, l.tag, l.n); }

bool intact(const Live& l) {
  for (std::size_t i = 0; i < l.n; i += 997)
    if (static_cast<std::uint8_t>(l.b.data[i]) != l.tag) return false;
  return l.n == 0 || static_cast<std::uint8_t>(l.b.data[l.n - 1]) == l.tag;
}

using tdtest::vm_flags_of;

}  // namespace

TEST_CASE("size classes cover 16 KiB-1.75 MiB with at most 1/5 rounding", "[storage_pool]") {
  CHECK(StoragePool::class_of(kPoolMinBytes - 1) == std::numeric_limits<std::size_t>::max());
  CHECK(StoragePool::class_of(kPoolMaxBytes + 1) == std::numeric_limits<std::size_t>::max());
  CHECK(StoragePool::class_of(kPoolMinBytes) == 0);
  CHECK(StoragePool::class_of(kPoolMaxBytes) == kPoolClasses - 1);
  CHECK(StoragePool::class_bytes(kPoolClasses - 1) == kPoolMaxBytes);
  std::size_t prev = 0;
  for (std::size_t c = 0; c < kPoolClasses; ++c) {
    const std::size_t b = StoragePool::class_bytes(c);
    INFO("class " << c << ": " << b);
    CHECK(b > prev);
    CHECK(b % 4096 == 0);
    CHECK(StoragePool::class_of(b) == c);                    // a class's own size is in it
    if (c > 0) CHECK(StoragePool::class_of(prev + 1) == c);  // and all down to the previous one
    const std::size_t chunk = StoragePool::first_chunk_bytes(c);
    CHECK(chunk % kHugePageBytes == 0);
    CHECK(chunk >= b);
    CHECK((chunk % b) * 16 <= chunk);  // at most 1/16 of a chunk left over
    if (c > 0) CHECK(static_cast<double>(b) / static_cast<double>(prev + 1) <= 1.25);
    prev = b;
  }
  // The transformer's leaves fit their classes exactly.
  for (std::size_t n : {256 * KiB, 768 * KiB, 1 * MiB})
    CHECK(StoragePool::class_bytes(StoragePool::class_of(n)) == n);
}

TEST_CASE("every path is 64-byte aligned; pooled blocks 4 KiB, large ones 2 MiB",
          "[storage_pool]") {
  StoragePool pool(on());
  const bool pooled = pool.status().pooled;
  std::vector<Live> live;
  for (std::size_t n :
       {std::size_t{0}, std::size_t{1}, std::size_t{63}, std::size_t{65}, kPoolMinBytes - 1,
        kPoolMinBytes, kPoolMinBytes + 1, 100 * KiB, kPoolMaxBytes - 1, kPoolMaxBytes,
        kPoolMaxBytes + 1, 2 * MiB, 2 * MiB + 1, 5 * MiB + 3}) {
    INFO("n = " << n);
    const StorageBlock b = pool.allocate(n);
    REQUIRE(b.data != nullptr);
    CHECK(addr(b.data) % 64 == 0);
    if (pooled && n >= kPoolMinBytes && n <= kPoolMaxBytes) CHECK(addr(b.data) % 4096 == 0);
    if (n > kPoolMaxBytes) CHECK(addr(b.data) % kHugePageBytes == 0);
    live.push_back({b, n, static_cast<std::uint8_t>(live.size() + 1)});
    fill(live.back());
  }
  for (const Live& l : live) CHECK(intact(l));
  const auto s = pool.stats();
  if (pooled) {
    CHECK(s.pooled_storages == 5);  // 16 KiB, 16 KiB + 1, 100 KiB, 1.75 MiB - 1, 1.75 MiB
    CHECK(s.pooled_requested == 2 * kPoolMinBytes + 1 + 100 * KiB + 2 * kPoolMaxBytes - 1);
  }
  CHECK(s.large_storages == 4);
  CHECK(s.heap_storages + s.pooled_storages == 10);
  for (const Live& l : live) pool.release(l.b.data, l.n, l.b.owner);
  const auto e = pool.stats();
  CHECK(e.pooled_storages == 0);
  CHECK(e.pooled_requested == 0);
  CHECK(e.large_storages == 0);
  CHECK(e.heap_storages == 0);
  CHECK(e.heap_requested == 0);
}

TEST_CASE("chunks are 2 MiB aligned and advised for huge pages", "[storage_pool]") {
  StoragePool pool(on());
  if (!pool.status().pooled) {
    WARN("pool off here: " << pool.status().reason);
    return;
  }
  const StorageBlock b = pool.allocate(256 * KiB);
  CHECK(addr(b.data) % kHugePageBytes == 0);  // the first block of a fresh chunk
  const std::string flags = vm_flags_of(b.data);
  INFO(flags);
  CHECK(flags.find(" hg") != std::string::npos);
  CHECK(pool.stats().mapped == StoragePool::first_chunk_bytes(StoragePool::class_of(256 * KiB)));
  pool.release(b.data, 256 * KiB, b.owner);
}

TEST_CASE("a freed block is reused before any new chunk", "[storage_pool]") {
  StoragePool pool(on());
  if (!pool.status().pooled) return;
  const std::size_t n = 300 * KiB;
  const StorageBlock a = pool.allocate(n);
  const StorageBlock b = pool.allocate(n);
  CHECK(a.data != b.data);
  CHECK(a.owner == b.owner);  // same chunk
  pool.release(a.data, n, a.owner);
  const StorageBlock c = pool.allocate(n + 1);  // same class
  CHECK(c.data == a.data);
  // Allocate and free many times: one chunk all along.
  for (int i = 0; i < 1000; ++i) {
    const StorageBlock d = pool.allocate(n);
    pool.release(d.data, n, d.owner);
  }
  CHECK(pool.stats().chunks_mapped == 1);
  CHECK(pool.stats().chunks == 1);
  pool.release(b.data, n, b.owner);
  pool.release(c.data, n + 1, c.owner);
  // The empty chunk stays as the class's spare, and is what the next allocation uses.
  CHECK(pool.stats().spare == pool.stats().mapped);
  const StorageBlock d = pool.allocate(n);
  CHECK(pool.stats().chunks_mapped == 1);
  CHECK(pool.stats().spare == 0);
  pool.release(d.data, n, d.owner);
}

TEST_CASE("live blocks never overlap (patterns survive churn across classes)", "[storage_pool]") {
  StoragePool pool(on());
  std::mt19937_64 rng(42);
  std::uniform_int_distribution<std::size_t> size(1, 2 * MiB + 4096);
  std::vector<Live> live;
  std::uint8_t tag = 0;
  for (int round = 0; round < 6; ++round) {
    for (int i = 0; i < 150; ++i) {
      std::size_t n = size(rng);
      if (i % 3 == 0) n = kPoolMinBytes + n % (256 * KiB);  // many in the smaller classes
      live.push_back({pool.allocate(n), n, ++tag == 0 ? ++tag : tag});
      fill(live.back());
    }
    for (const Live& l : live) REQUIRE(intact(l));
    // Intervals of live blocks are disjoint.
    std::vector<std::pair<std::uintptr_t, std::uintptr_t>> iv;
    for (const Live& l : live) iv.emplace_back(addr(l.b.data), addr(l.b.data) + l.n);
    std::sort(iv.begin(), iv.end());
    for (std::size_t i = 1; i < iv.size(); ++i) REQUIRE(iv[i - 1].second <= iv[i].first);
    // Free a random half.
    std::shuffle(live.begin(), live.end(), rng);
    for (std::size_t i = live.size() / 2; i < live.size(); ++i)
      pool.release(live[i].b.data, live[i].n, live[i].b.owner);
    live.resize(live.size() / 2);
  }
  for (const Live& l : live) CHECK(intact(l));
  for (const Live& l : live) pool.release(l.b.data, l.n, l.b.owner);
  CHECK(pool.stats().pooled_storages == 0);
}

TEST_CASE("memory goes back when the storages die: one spare chunk per class at most",
          "[storage_pool]") {
  StoragePool pool(on());
  if (!pool.status().pooled) return;
  // 200 storages of 256 KiB (50 MiB) and 100 of 40 KiB: several chunks per class.
  std::vector<Live> live;
  for (int i = 0; i < 200; ++i) live.push_back({pool.allocate(256 * KiB), 256 * KiB, 1});
  for (int i = 0; i < 100; ++i) live.push_back({pool.allocate(40 * KiB), 40 * KiB, 2});
  for (const Live& l : live) fill(l);
  const auto full = pool.stats();
  CHECK(full.pooled_requested == 200 * 256 * KiB + 100 * 40 * KiB);
  CHECK(full.touched >= full.pooled_requested);
  CHECK(full.mapped >= full.touched);
  // Every chunk but the last of each class is full: touched exceeds what was asked by less than
  // one chunk per class.
  CHECK(full.touched - full.pooled_requested < 2 * kHugePageBytes);
  CHECK(full.chunks >= 3);
  for (const Live& l : live) pool.release(l.b.data, l.n, l.b.owner);
  const auto empty = pool.stats();
  CHECK(empty.pooled_storages == 0);
  CHECK(empty.chunks <= 2);  // the two classes' spares
  CHECK(empty.mapped == empty.spare);
  CHECK(empty.spare <= kSpareBudgetBytes);
  CHECK(empty.chunks_unmapped == full.chunks - empty.chunks);
  CHECK(empty.touched <= empty.mapped);
  // Churn does not grow the pool: the same dict made and freed again maps no more than the first.
  for (int round = 0; round < 5; ++round) {
    live.clear();
    for (int i = 0; i < 200; ++i) live.push_back({pool.allocate(256 * KiB), 256 * KiB, 1});
    CHECK(pool.stats().mapped <= full.mapped);
    for (const Live& l : live) pool.release(l.b.data, l.n, l.b.owner);
  }
  CHECK(pool.stats().chunks <= 2);
}

TEST_CASE("spare chunks of all classes together stay within the budget", "[storage_pool]") {
  StoragePool pool(on());
  if (!pool.status().pooled) return;
  for (std::size_t c = 0; c < kPoolClasses; ++c) {
    const std::size_t n = StoragePool::class_bytes(c);
    const StorageBlock b = pool.allocate(n);
    pool.release(b.data, n, b.owner);
  }
  const auto s = pool.stats();
  CHECK(s.spare <= kSpareBudgetBytes);
  CHECK(s.mapped == s.spare);
  CHECK(s.chunks_unmapped + s.chunks == kPoolClasses);
}

TEST_CASE("several threads allocate and free at once, also each other's blocks",
          "[storage_pool][threads]") {
  StoragePool pool(on());
  constexpr int kThreads = 4, kIters = 3000;
  std::mutex handoff_mu;
  std::vector<Live> handoff;  // blocks one thread made and another frees
  std::atomic<int> bad{0};
  auto work = [&](int id) {
    std::mt19937_64 rng(static_cast<std::uint64_t>(id) + 1);
    std::vector<std::size_t> sizes{kPoolMinBytes, 20 * KiB,      64 * KiB, 256 * KiB,
                                   1 * MiB,       kPoolMaxBytes, 1000,     3 * MiB};
    std::vector<Live> mine;
    for (int i = 0; i < kIters; ++i) {
      const std::size_t n = sizes[rng() % sizes.size()] - rng() % 64;
      Live l{pool.allocate(n), n, static_cast<std::uint8_t>(id * 50 + i % 50 + 1)};
      l.b.data[0] = static_cast<std::byte>(l.tag);
      l.b.data[n - 1] = static_cast<std::byte>(l.tag);
      mine.push_back(l);
      if (rng() % 2 == 0) {
        std::lock_guard<std::mutex> lock(handoff_mu);
        handoff.push_back(mine.back());
        mine.pop_back();
      }
      while (mine.size() > 8 || (!mine.empty() && rng() % 3 == 0)) {
        const Live& v = mine.front();
        if (static_cast<std::uint8_t>(v.b.data[0]) != v.tag ||
            static_cast<std::uint8_t>(v.b.data[v.n - 1]) != v.tag)
          ++bad;
        pool.release(v.b.data, v.n, v.b.owner);
        mine.erase(mine.begin());
      }
      std::vector<Live> take;
      {
        std::lock_guard<std::mutex> lock(handoff_mu);
        if (handoff.size() > 16) take.swap(handoff);
      }
      for (const Live& v : take) {
        if (static_cast<std::uint8_t>(v.b.data[0]) != v.tag) ++bad;
        pool.release(v.b.data, v.n, v.b.owner);
      }
    }
    for (const Live& v : mine) pool.release(v.b.data, v.n, v.b.owner);
  };
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) threads.emplace_back(work, t);
  for (auto& t : threads) t.join();
  for (const Live& v : handoff) pool.release(v.b.data, v.n, v.b.owner);
  CHECK(bad == 0);
  const auto s = pool.stats();
  CHECK(s.pooled_storages == 0);
  CHECK(s.pooled_requested == 0);
  CHECK(s.heap_storages == 0);
  CHECK(s.large_storages == 0);
  CHECK(s.mapped == s.spare);
}

TEST_CASE("TD_HUGEPAGES=0: every storage from aligned_alloc", "[storage_pool][off]") {
  StoragePool::Options o;
  o.hugepages = false;
  StoragePool pool(o);
  CHECK_FALSE(pool.status().pooled);
  CHECK_FALSE(pool.status().large_huge);
  CHECK(pool.status().reason.find("TD_HUGEPAGES=0") != std::string::npos);
  std::vector<Live> live;
  for (std::size_t n : {std::size_t{0}, kPoolMinBytes, 256 * KiB, kPoolMaxBytes, 4 * MiB}) {
    live.push_back({pool.allocate(n), n, 7});
    CHECK(addr(live.back().b.data) % 64 == 0);
    fill(live.back());
  }
  const auto s = pool.stats();
  CHECK(s.heap_storages == 5);
  CHECK(s.pooled_storages == 0);
  CHECK(s.large_storages == 0);
  CHECK(s.mapped == 0);
  for (const Live& l : live) pool.release(l.b.data, l.n, l.b.owner);
  CHECK(pool.stats().heap_storages == 0);
}

TEST_CASE("THP set to never: the pool is off, and says why", "[storage_pool][off]") {
  const std::string path = "test_storage_pool_thp_never.txt";
  {
    std::ofstream f(path);
    f << "always madvise [never]\n";
  }
  StoragePool::Options o;
  o.thp_enabled_path = path;
  StoragePool pool(o);
  std::remove(path.c_str());
  CHECK_FALSE(pool.status().pooled);
  CHECK(pool.status().reason.find("never") != std::string::npos);
  const StorageBlock b = pool.allocate(256 * KiB);
  CHECK(addr(b.data) % 64 == 0);
  CHECK(pool.stats().heap_storages == 1);
  CHECK(pool.stats().mapped == 0);
  pool.release(b.data, 256 * KiB, b.owner);
}

TEST_CASE("sizes no memory can hold throw std::bad_alloc", "[storage_pool]") {
  StoragePool pool(on());
  CHECK_THROWS_AS(pool.allocate(std::numeric_limits<std::size_t>::max()), std::bad_alloc);
  CHECK_THROWS_AS(pool.allocate(std::numeric_limits<std::size_t>::max() - 63), std::bad_alloc);
  if (!kSanitized)
    CHECK_THROWS_AS(pool.allocate(static_cast<std::size_t>(PTRDIFF_MAX)), std::bad_alloc);
  if (!kSanitized) CHECK_THROWS_AS(pool.allocate(std::size_t{1} << 50), std::bad_alloc);  // 1 PiB
  StoragePool::Options o;
  o.hugepages = false;
  StoragePool off(o);
  CHECK_THROWS_AS(off.allocate(std::numeric_limits<std::size_t>::max()), std::bad_alloc);
  if (!kSanitized) CHECK_THROWS_AS(off.allocate(std::size_t{1} << 50), std::bad_alloc);
  CHECK(pool.stats().heap_storages + pool.stats().large_storages == 0);
  // Through Storage, as the collectives allocate their buffers.
  CHECK_THROWS_AS(td::detail::Storage(std::numeric_limits<std::size_t>::max()), std::bad_alloc);
}

TEST_CASE("tensors use the process's pool", "[storage_pool][tensor]") {
  const auto before = td::storage_pool_stats();
  const bool pooled = td::detail::storage_pool().status().pooled;
  {
    td::Tensor t = td::Tensor::zeros({64 * 1024}, td::DType::Float32);  // 256 KiB
    td::Tensor s = td::Tensor::zeros({16}, td::DType::Float32);
    CHECK(addr(t.raw_data()) % 64 == 0);
    CHECK(addr(s.raw_data()) % 64 == 0);
    const auto during = td::storage_pool_stats();
    if (pooled) {
      CHECK(addr(t.raw_data()) % 4096 == 0);
      CHECK(during.pooled_storages == before.pooled_storages + 1);
      CHECK(during.pooled_requested == before.pooled_requested + 256 * KiB);
      CHECK(vm_flags_of(t.raw_data()).find(" hg") != std::string::npos);
    }
    CHECK(during.heap_storages == before.heap_storages + (pooled ? 1 : 2));
  }
  const auto after = td::storage_pool_stats();
  CHECK(after.pooled_storages == before.pooled_storages);
  CHECK(after.heap_storages == before.heap_storages);
}

// The memory overhead of the issue-21 workloads, printed (run: test_storage_pool "[.overhead]").
TEST_CASE("memory overhead of the benchmark workloads", "[.overhead]") {
  struct W {
    const char* name;
    std::vector<std::size_t> sizes;
  };
  std::vector<W> ws;
  {
    W t{"transformer (73 leaves, 26 MiB)", {8192 * 256 * 4}};
    for (int l = 0; l < 6; ++l)
      for (std::size_t n : {768 * 256 * 4, 768 * 4, 256 * 256 * 4, 256 * 4, 256 * 4, 256 * 4,
                            1024 * 256 * 4, 1024 * 4, 256 * 1024 * 4, 256 * 4, 256 * 4, 256 * 4})
        t.sizes.push_back(n);
    ws.push_back(t);
  }
  ws.push_back({"small (4096 x 1 KiB)", std::vector<std::size_t>(4096, 1 * KiB)});
  ws.push_back({"tiny (16384 x 64 B)", std::vector<std::size_t>(16384, 64)});
  ws.push_back({"large (8 x 4 MiB)", std::vector<std::size_t>(8, 4 * MiB)});
  ws.push_back({"16 KiB x 4096", std::vector<std::size_t>(4096, 16 * KiB)});
  ws.push_back({"one 16 KiB", std::vector<std::size_t>(1, 16 * KiB)});
  {
    W one{"one of each class", {}};
    for (std::size_t c = 0; c < kPoolClasses; ++c) one.sizes.push_back(StoragePool::class_bytes(c));
    ws.push_back(one);
  }
  {
    W r{"3000 random 16 KiB-1.75 MiB", {}};
    std::mt19937_64 rng(7);
    for (int i = 0; i < 3000; ++i)
      r.sizes.push_back(kPoolMinBytes + rng() % (kPoolMaxBytes - kPoolMinBytes));
    ws.push_back(r);
  }
  {
    W r{"mixed (3000 x 64-4096 el., 4 dtypes)", {}};
    const std::size_t isz[] = {4, 8, 8, 2};
    for (std::uint64_t i = 0; i < 3000; ++i) {
      std::uint64_t z = i + 0x9e3779b97f4a7c15ULL;  // splitmix64, as bench_common.hpp
      z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
      z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
      z = z ^ (z >> 31);
      r.sizes.push_back((64 + z % 4033) * isz[i % 4]);
    }
    ws.push_back(r);
  }
  for (const W& w : ws) {
    StoragePool pool(on());
    std::vector<Live> live;
    std::size_t total = 0;
    for (std::size_t n : w.sizes) {
      live.push_back({pool.allocate(n), n, 1});
      total += n;
    }
    const auto s = pool.stats();
    std::printf(
        "%-38s total %8.2f MiB; pooled %8.2f MiB in %4zu storages; touched %8.2f MiB "
        "(extra %6.2f MiB = %5.1f%% of total); mapped %8.2f MiB; chunks %zu\n",
        w.name, static_cast<double>(total) / MiB, static_cast<double>(s.pooled_requested) / MiB,
        s.pooled_storages, static_cast<double>(s.touched) / MiB,
        static_cast<double>(s.touched - s.pooled_requested) / MiB,
        100.0 * static_cast<double>(s.touched - s.pooled_requested) / static_cast<double>(total),
        static_cast<double>(s.mapped) / MiB, s.chunks);
    for (const Live& l : live) pool.release(l.b.data, l.n, l.b.owner);
  }
}
