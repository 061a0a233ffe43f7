// The allocator behind every tensor storage (detail::Storage): medium storages carved from
// 2 MiB-aligned chunks marked for transparent huge pages, by size class. No MPI. Not installed.
//
// Why: shared-memory MPI copies between processes with process_vm_readv (CMA), which pins every
// page of both buffers on every call. A dict of separately created leaves of 256 KiB-1 MiB on
// 4 KiB pages all_reduced 2x slower than the same bytes in one huge-page buffer; the pool puts
// such leaves on huge pages without any launch flag (docs/configuration.md#huge-pages).
//
// Three paths, chosen by the requested size n:
//   n <  kPoolMinBytes (16 KiB)       aligned_alloc(64): below the 4 KiB eager limit MPI never pins
//                                     pages, and a class this small would need 128+ live storages
//                                     to fill even one 2 MiB page of its own.
//   n <= kPoolMaxBytes (1.75 MiB)     the pool: 28 size classes, 4 per doubling (16, 20, 24, 28,
//                                     32, 40, ... KiB, 1, 1.25, 1.5, 1.75 MiB; every one a multiple
//                                     of 4 KiB, so blocks are 4 KiB aligned). A class owns chunks
//                                     of m x 2 MiB (m chosen so that at most 1/16 of a chunk is
//                                     left over at its end), doubling with each chunk the class
//                                     already holds, up to kMaxChunkBytes.
//   larger                            its own allocation, 2 MiB aligned, marked MADV_HUGEPAGE over
//                                     its whole 2 MiB pages (storages under 2 MiB: one 2 MiB page).
// With the pool off (TD_HUGEPAGES=0, or transparent huge pages unavailable) the pool path is
// aligned_alloc too; the large path stays as it was (it is gated by TD_HUGEPAGES alone).
//
// Locking: one mutex per size class (the only shared state of a class: its chunk lists), and
// relaxed atomic counters for the statistics. Return policy: a chunk whose last block is freed is
// unmapped, except one empty chunk per class kept for reuse (pack buffers come and go once per
// collective) while all such spare chunks together stay under kSpareBudgetBytes.
#pragma once

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>

#include "tensordict/diagnostics.hpp"
#include "tensordict/export.hpp"

namespace td::detail {

/// Storages of at least this many bytes come from the pool (see above for why).
inline constexpr std::size_t kPoolMinBytes = std::size_t{16} << 10;
/// The largest pooled request (the largest size class).
inline constexpr std::size_t kPoolMaxBytes = std::size_t{7} << 18;  // 1.75 MiB
/// A transparent huge page; every chunk is a multiple of it and aligned to it.
inline constexpr std::size_t kHugePageBytes = std::size_t{2} << 20;
/// No chunk grows past this (a first chunk may, when its geometry needs it: 14 MiB at most).
inline constexpr std::size_t kMaxChunkBytes = std::size_t{16} << 20;
/// Empty chunks kept for reuse, all classes together, are at most this many bytes.
inline constexpr std::size_t kSpareBudgetBytes = std::size_t{32} << 20;
/// Number of size classes.
inline constexpr std::size_t kPoolClasses = 28;
/// Alignment of every storage, whatever its path.
inline constexpr std::size_t kStorageAlign = 64;

/// Where one storage's bytes came from; `owner` must be handed back to release() unchanged.
struct StorageBlock {
  std::byte* data = nullptr;
  void* owner = nullptr;
};

/// A snapshot of the pool's counters (tensordict/diagnostics.hpp).
using StoragePoolStats = td::StoragePoolStats;

/// What the pool does in this process, and why (for the log: runtime prints it at init).
struct StoragePoolStatus {
  bool pooled = false;      ///< medium storages come from huge-page chunks
  bool large_huge = false;  ///< large storages are 2 MiB aligned and marked MADV_HUGEPAGE
  std::string reason;       ///< one line: "on: ...", or "off: <why>"
};

/// The allocator. The process has one (storage_pool()); the white-box tests build their own.
class StoragePool {
 public:
  struct Options {
    bool hugepages = true;  ///< TD_HUGEPAGES
    /// Where the kernel's THP mode is read ("[never]" turns the pool off); a missing file is
    /// decided by whether madvise(MADV_HUGEPAGE) works.
    std::string thp_enabled_path = "/sys/kernel/mm/transparent_hugepage/enabled";
  };
  explicit StoragePool(const Options& options);
  /// Unmaps every chunk: every block must have been released.
  ~StoragePool();
  StoragePool(const StoragePool&) = delete;
  StoragePool& operator=(const StoragePool&) = delete;

  /// At least `nbytes` bytes (0 allowed), kStorageAlign aligned; throws std::bad_alloc.
  StorageBlock allocate(std::size_t nbytes);
  /// Gives back a block from allocate(nbytes) (same nbytes).
  void release(std::byte* data, std::size_t nbytes, void* owner) noexcept;

  StoragePoolStats stats() const;
  const StoragePoolStatus& status() const { return status_; }

  /// The size class of a pooled request: its index and block bytes (npos/0 if not pooled).
  static std::size_t class_of(std::size_t nbytes);
  static std::size_t class_bytes(std::size_t cls);
  /// Bytes of the first chunk of a class (the class's block bytes times a whole number, at most
  /// 1/16 of it left over).
  static std::size_t first_chunk_bytes(std::size_t cls);

 private:
  struct Chunk;
  struct SizeClass;

  StorageBlock allocate_pooled(std::size_t cls, std::size_t nbytes);
  Chunk* map_chunk(SizeClass& c);
  void unmap_chunk(Chunk* chunk) noexcept;

  StoragePoolStatus status_;
  std::unique_ptr<std::array<SizeClass, kPoolClasses>> classes_;
  std::atomic<bool> pool_on_{false};  // cleared for good if a chunk cannot be advised
  std::atomic<std::size_t> spare_bytes_{0};
  std::atomic<std::size_t> pooled_storages_{0}, pooled_requested_{0}, pooled_blocks_{0};
  std::atomic<std::size_t> mapped_{0}, touched_{0}, chunks_{0};
  std::atomic<std::uint64_t> chunks_mapped_{0}, chunks_unmapped_{0};
  std::atomic<std::size_t> large_storages_{0}, large_requested_{0};
  std::atomic<std::size_t> heap_storages_{0}, heap_requested_{0};
};

/// The process's pool (TD_HUGEPAGES from config()); created at first use, never destroyed, so
/// storages that outlive static destruction can still be released.
StoragePool& storage_pool();

}  // namespace td::detail
