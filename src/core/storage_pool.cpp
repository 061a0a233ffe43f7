#include "core/storage_pool.hpp"

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <limits>
#include <new>
#include <string>
#include <utility>

#include <fmt/format.h>

#if defined(__linux__)
#include <sys/mman.h>
#endif

#include "core/config.hpp"

namespace td::detail {

namespace {

// Tags of StorageBlock::owner for the two paths that are not a chunk.
char heap_tag;   // aligned_alloc
char large_tag;  // posix_memalign on 2 MiB

constexpr std::size_t kClassesPerDoubling = 4;
constexpr unsigned kMinShift = 14;  // log2(kPoolMinBytes)
static_assert(kPoolMinBytes == std::size_t{1} << kMinShift);
static_assert(kHugePageBytes % kStorageAlign == 0);

std::size_t round_up(std::size_t n, std::size_t to) { return (n + to - 1) / to * to; }

// A free block's first bytes: the next free block of its chunk.
struct FreeBlock {
  FreeBlock* next;
};

}  // namespace

struct StoragePool::Chunk {
  std::byte* base = nullptr;
  std::size_t bytes = 0;
  std::size_t block = 0;      // the class's block bytes
  std::size_t capacity = 0;   // blocks that fit
  std::size_t carved = 0;     // blocks handed out at least once since the chunk was (re)started
  std::size_t live = 0;       // blocks handed out and not released
  std::size_t touched = 0;    // bytes counted in touched_ (whole 2 MiB pages)
  FreeBlock* free = nullptr;  // released blocks, most recent first
  SizeClass* cls = nullptr;
  Chunk* prev = nullptr;  // in the class's list of chunks with room
  Chunk* next = nullptr;
  bool in_list = false;
};

struct StoragePool::SizeClass {
  std::mutex mu;
  std::size_t index = 0;
  std::size_t block = 0;
  Chunk* head = nullptr;  // chunks with room, preferred first
  Chunk* tail = nullptr;
  Chunk* spare = nullptr;  // an empty chunk kept for reuse
  std::size_t chunks = 0;  // mapped, spare included

  void push_front(Chunk* c) {
    c->prev = nullptr;
    c->next = head;
    if (head) head->prev = c;
    head = c;
    if (!tail) tail = c;
    c->in_list = true;
  }
  void push_back(Chunk* c) {
    c->next = nullptr;
    c->prev = tail;
    if (tail) tail->next = c;
    tail = c;
    if (!head) head = c;
    c->in_list = true;
  }
  void unlink(Chunk* c) {
    if (c->prev) c->prev->next = c->next;
    if (c->next) c->next->prev = c->prev;
    if (head == c) head = c->next;
    if (tail == c) tail = c->prev;
    c->prev = c->next = nullptr;
    c->in_list = false;
  }
};

std::size_t StoragePool::class_of(std::size_t n) {
  if (n > kPoolMaxBytes || n < kPoolMinBytes) return std::numeric_limits<std::size_t>::max();
  if (n == kPoolMinBytes) return 0;
  // 2^e < n <= 2^(e+1); the classes between are 2^e + j * 2^(e-2), j = 1..4.
  const auto e = static_cast<unsigned>(std::bit_width(n - 1) - 1);
  const std::size_t step = std::size_t{1} << (e - 2);
  const std::size_t j = (n - (std::size_t{1} << e) + step - 1) / step;
  return (e - kMinShift) * kClassesPerDoubling + j;
}

std::size_t StoragePool::class_bytes(std::size_t cls) {
  if (cls >= kPoolClasses) return 0;
  const std::size_t e = kMinShift + cls / kClassesPerDoubling;
  const std::size_t j = cls % kClassesPerDoubling;
  return (std::size_t{1} << e) + j * (std::size_t{1} << (e - 2));
}

std::size_t StoragePool::first_chunk_bytes(std::size_t cls) {
  const std::size_t b = class_bytes(cls);
  for (std::size_t m = 1;; ++m) {
    const std::size_t bytes = m * kHugePageBytes;
    if (bytes >= b && (bytes % b) * 16 <= bytes) return bytes;
  }
}

StoragePool::StoragePool(const Options& options)
    : classes_(std::make_unique<std::array<SizeClass, kPoolClasses>>()) {
  for (std::size_t i = 0; i < kPoolClasses; ++i) {
    (*classes_)[i].index = i;
    (*classes_)[i].block = class_bytes(i);
  }
  status_.large_huge = options.hugepages;
  if (!options.hugepages) {
    status_.reason = "off: TD_HUGEPAGES=0 (every storage from aligned_alloc)";
    return;
  }
  // Linux's THP mode: "always [madvise] never", the bracket marks the current one.
  std::ifstream thp(options.thp_enabled_path);
  std::string mode;
  if (thp && std::getline(thp, mode) && mode.find("[never]") != std::string::npos) {
    status_.reason = fmt::format(
        "off: transparent huge pages disabled ({} = never); tensors of {}-{} KiB on aligned_alloc",
        options.thp_enabled_path, kPoolMinBytes >> 10, kPoolMaxBytes >> 10);
    return;
  }
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  // The kernel may lack THP altogether (no sysfs file): madvise then fails with EINVAL.
  void* probe =
      mmap(nullptr, kHugePageBytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (probe == MAP_FAILED) {  // NOLINT(performance-no-int-to-ptr): MAP_FAILED is ((void*)-1)
    status_.reason = fmt::format("off: mmap failed ({})", std::strerror(errno));
    return;
  }
  const int rc = madvise(probe, kHugePageBytes, MADV_HUGEPAGE);
  const int err = errno;
  munmap(probe, kHugePageBytes);
  if (rc != 0) {
    status_.reason = fmt::format("off: madvise(MADV_HUGEPAGE) failed ({})", std::strerror(err));
    return;
  }
  pool_on_.store(true, std::memory_order_relaxed);
  status_.pooled = true;
  status_.reason = fmt::format(
      "on: tensors of {} KiB-{} KiB carved from 2 MiB-aligned MADV_HUGEPAGE chunks, {} size "
      "classes; larger ones on their own huge pages; THP mode: {}",
      kPoolMinBytes >> 10, kPoolMaxBytes >> 10, kPoolClasses, mode.empty() ? "unknown" : mode);
#else
  status_.reason = "off: no madvise(MADV_HUGEPAGE) on this platform";
#endif
}

StoragePool::~StoragePool() {
  for (SizeClass& c : *classes_) {
    while (c.head) {
      Chunk* k = c.head;
      c.unlink(k);
      unmap_chunk(k);
    }
    if (c.spare) unmap_chunk(std::exchange(c.spare, nullptr));
  }
  // Full chunks (blocks never released) are not listed anywhere: they leak with their blocks.
}

StoragePool::Chunk* StoragePool::map_chunk(SizeClass& c) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  // Each chunk the class already holds doubles the next one, up to kMaxChunkBytes.
  const std::size_t first = first_chunk_bytes(c.index);
  std::size_t bytes = first;
  for (std::size_t i = 0; i < c.chunks && bytes * 2 <= kMaxChunkBytes; ++i) bytes *= 2;
  // Map one huge page more and trim both ends to a 2 MiB boundary.
  void* raw = mmap(nullptr, bytes + kHugePageBytes, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (raw == MAP_FAILED) return nullptr;  // NOLINT(performance-no-int-to-ptr)
  const auto start = reinterpret_cast<std::uintptr_t>(raw);
  const std::uintptr_t aligned = round_up(start, kHugePageBytes);
  if (aligned > start) munmap(raw, aligned - start);
  const std::size_t tail = kHugePageBytes - (aligned - start);
  if (tail > 0) munmap(reinterpret_cast<void*>(aligned + bytes), tail);  // NOLINT
  auto* base = reinterpret_cast<std::byte*>(aligned);                    // NOLINT
  if (madvise(base, bytes, MADV_HUGEPAGE) != 0) {
    munmap(base, bytes);
    pool_on_.store(false, std::memory_order_relaxed);  // fall back for good, silently
    return nullptr;
  }
  auto* k = new (std::nothrow) Chunk;
  if (!k) {
    munmap(base, bytes);
    return nullptr;
  }
  k->base = base;
  k->bytes = bytes;
  k->block = c.block;
  k->capacity = bytes / c.block;
  k->cls = &c;
  ++c.chunks;
  mapped_.fetch_add(bytes, std::memory_order_relaxed);
  chunks_.fetch_add(1, std::memory_order_relaxed);
  chunks_mapped_.fetch_add(1, std::memory_order_relaxed);
  return k;
#else
  (void)c;
  return nullptr;
#endif
}

void StoragePool::unmap_chunk(Chunk* k) noexcept {
#if defined(__linux__)
  munmap(k->base, k->bytes);
#endif
  --k->cls->chunks;
  mapped_.fetch_sub(k->bytes, std::memory_order_relaxed);
  touched_.fetch_sub(k->touched, std::memory_order_relaxed);
  chunks_.fetch_sub(1, std::memory_order_relaxed);
  chunks_unmapped_.fetch_add(1, std::memory_order_relaxed);
  delete k;
}

StorageBlock StoragePool::allocate(std::size_t n) {
  // Past PTRDIFF_MAX no object can exist (and the rounding below would wrap).
  if (n > static_cast<std::size_t>(PTRDIFF_MAX)) throw std::bad_alloc();
  if (n >= kPoolMinBytes && n <= kPoolMaxBytes && pool_on_.load(std::memory_order_relaxed)) {
    StorageBlock b = allocate_pooled(class_of(n), n);
    if (b.data) return b;  // else the pool just turned itself off: the heap below
  }
  void* p = nullptr;
  if (n > kPoolMaxBytes && status_.large_huge) {
    // 2 MiB aligned; the whole 2 MiB pages inside are marked (a storage under 2 MiB gets one
    // page of its own: at most 1/8 more than asked for). The tail past the last whole page may
    // share its small page with the heap's next allocation: not marked.
    const std::size_t rounded = std::max(round_up(n, kStorageAlign), kHugePageBytes);
    if (posix_memalign(&p, kHugePageBytes, rounded) != 0 || p == nullptr) throw std::bad_alloc();
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    madvise(p, rounded / kHugePageBytes * kHugePageBytes, MADV_HUGEPAGE);
#endif
    large_storages_.fetch_add(1, std::memory_order_relaxed);
    large_requested_.fetch_add(n, std::memory_order_relaxed);
    return {static_cast<std::byte*>(p), &large_tag};
  }
  p = std::aligned_alloc(kStorageAlign, std::max(kStorageAlign, round_up(n, kStorageAlign)));
  if (p == nullptr) throw std::bad_alloc();
  heap_storages_.fetch_add(1, std::memory_order_relaxed);
  heap_requested_.fetch_add(n, std::memory_order_relaxed);
  return {static_cast<std::byte*>(p), &heap_tag};
}

StorageBlock StoragePool::allocate_pooled(std::size_t cls, std::size_t n) {
  SizeClass& c = (*classes_)[cls];
  std::byte* p = nullptr;
  Chunk* k = nullptr;
  {
    std::lock_guard<std::mutex> lock(c.mu);
    k = c.head;
    if (!k) {
      if (c.spare) {
        k = std::exchange(c.spare, nullptr);
        spare_bytes_.fetch_sub(k->bytes, std::memory_order_relaxed);
      } else {
        k = map_chunk(c);
        if (!k) {
          if (pool_on_.load(std::memory_order_relaxed)) throw std::bad_alloc();  // out of memory
          return {};
        }
      }
      c.push_front(k);
    }
    if (k->free) {
      p = reinterpret_cast<std::byte*>(k->free);
      k->free = k->free->next;
    } else {
      p = k->base + k->carved * k->block;
      ++k->carved;
      const std::size_t touched = round_up(k->carved * k->block, kHugePageBytes);
      if (touched > k->touched) {
        touched_.fetch_add(touched - k->touched, std::memory_order_relaxed);
        k->touched = touched;
      }
    }
    ++k->live;
    if (k->live == k->capacity) c.unlink(k);  // full: out of the list until a block comes back
  }
  pooled_storages_.fetch_add(1, std::memory_order_relaxed);
  pooled_requested_.fetch_add(n, std::memory_order_relaxed);
  pooled_blocks_.fetch_add(c.block, std::memory_order_relaxed);
  return {p, k};
}

void StoragePool::release(std::byte* data, std::size_t n, void* owner) noexcept {
  if (owner == &heap_tag) {
    std::free(data);
    heap_storages_.fetch_sub(1, std::memory_order_relaxed);
    heap_requested_.fetch_sub(n, std::memory_order_relaxed);
    return;
  }
  if (owner == &large_tag) {
    std::free(data);
    large_storages_.fetch_sub(1, std::memory_order_relaxed);
    large_requested_.fetch_sub(n, std::memory_order_relaxed);
    return;
  }
  auto* k = static_cast<Chunk*>(owner);
  SizeClass& c = *k->cls;
  pooled_storages_.fetch_sub(1, std::memory_order_relaxed);
  pooled_requested_.fetch_sub(n, std::memory_order_relaxed);
  pooled_blocks_.fetch_sub(c.block, std::memory_order_relaxed);
  Chunk* unmap = nullptr;
  {
    std::lock_guard<std::mutex> lock(c.mu);
    auto* f = reinterpret_cast<FreeBlock*>(data);
    f->next = k->free;
    k->free = f;
    if (!k->in_list) c.push_back(k);  // was full: used after the chunks that had room already
    if (--k->live == 0) {
      c.unlink(k);
      // Empty: keep it as the class's spare if it has none and the budget allows, else unmap.
      bool keep = false;
      if (c.spare == nullptr) {
        std::size_t spare = spare_bytes_.load(std::memory_order_relaxed);
        while (spare + k->bytes <= kSpareBudgetBytes &&
               !spare_bytes_.compare_exchange_weak(spare, spare + k->bytes,
                                                   std::memory_order_relaxed)) {
        }
        keep = spare + k->bytes <= kSpareBudgetBytes;
      }
      if (keep) {
        k->free = nullptr;  // carve it again from the start (its touched pages first)
        k->carved = 0;
        c.spare = k;
      } else {
        unmap = k;
      }
    }
    if (unmap) unmap_chunk(unmap);  // under the lock: c.chunks is the class's
  }
}

StoragePoolStats StoragePool::stats() const {
  StoragePoolStats s;
  constexpr auto r = std::memory_order_relaxed;
  s.pooled_storages = pooled_storages_.load(r);
  s.pooled_requested = pooled_requested_.load(r);
  s.pooled_blocks = pooled_blocks_.load(r);
  s.mapped = mapped_.load(r);
  s.touched = touched_.load(r);
  s.spare = spare_bytes_.load(r);
  s.chunks = chunks_.load(r);
  s.chunks_mapped = chunks_mapped_.load(r);
  s.chunks_unmapped = chunks_unmapped_.load(r);
  s.large_storages = large_storages_.load(r);
  s.large_requested = large_requested_.load(r);
  s.heap_storages = heap_storages_.load(r);
  s.heap_requested = heap_requested_.load(r);
  return s;
}

StoragePool& storage_pool() {
  // Never destroyed: a tensor held by a static may be released after this would have been.
  static StoragePool* const pool = [] {
    StoragePool::Options o;
    o.hugepages = config().hugepages;
    return new StoragePool(o);  // NOLINT(cppcoreguidelines-owning-memory)
  }();
  return *pool;
}

}  // namespace td::detail

namespace td {
StoragePoolStats storage_pool_stats() { return detail::storage_pool().stats(); }
}  // namespace td
