// Diagnostics for benchmarks, tuning and tests: the bucket plan, the packer's and the storage
// pool's counters. Opt-in: the umbrella header tensordict.hpp does not include this one.
#pragma once

#include <cstddef>
#include <cstdint>

#include "tensordict/bucket_plan.hpp"
#include "tensordict/export.hpp"

namespace td {

class ProcessGroup;  // tensordict/process_group.hpp

/// Diagnostics of the bucketing packer, for benchmarks and tuning.
struct PackerStats {
  std::size_t peak_extra_bytes = 0;  ///< largest pack buffer one call held at once
  std::uint64_t plan_hits = 0;       ///< collectives that reused a cached bucket plan
  std::uint64_t plan_misses = 0;     ///< collectives that built a plan
  /// messages of all_reduce / reduce / broadcast that ran node-aware (within each node, between
  /// the nodes' leaders, within each node again: docs/configuration.md, TD_HIERARCHICAL)
  std::uint64_t node_aware_messages = 0;
  /// of those, the sync all_reduce messages that ran per slice (a reduce-scatter within each
  /// node, each local rank's slice across the nodes, an allgather within each node)
  std::uint64_t node_aware_slice_messages = 0;
  /// sync all_reduce messages (or, per slice, slices) of 512 KiB or more that crossed the nodes
  /// as a reduce-scatter and an allgather rather than one allreduce: flat on a group of 3, 5, 6
  /// or 7 ranks across several nodes, or node-aware between 3, 5, 6 or 7 nodes (counted on the
  /// ranks that made those calls)
  std::uint64_t split_allreduce_messages = 0;
  /// nonblocking all_reduce messages under 32 KiB on 3 to 16 ranks (the library's own rounds, such
  /// as each collective's agreement, included) that ran as an allgather and a reduction in rank
  /// order, because libnbc runs its ring (a job of 3, 5, 6, 7, 9... 15 ranks across nodes, or
  /// OMPI_MCA_coll_libnbc_iallreduce_algorithm=1: docs/configuration.md)
  std::uint64_t gathered_allreduce_messages = 0;
};
/// Whether all_reduce / reduce / broadcast on `group` run node-aware now (the same answer on every
/// member): TD_HIERARCHICAL=1 or leaders; under auto (the default) on a group that spans several
/// nodes with more than one of its ranks on some node, what the group's first such call measured
/// faster (or found in the cache), flat before that call; false on a non-member
/// (docs/configuration.md, "Node-aware collectives").
TD_API bool runs_node_aware(const ProcessGroup& group);

/// The counters since the last reset_packer_stats() (this process only).
TD_API PackerStats packer_stats();
/// Zeroes the counters.
TD_API void reset_packer_stats();

/// A snapshot of the pool's counters (each read on its own, relaxed: exact when no other thread
/// allocates meanwhile).
struct StoragePoolStats {
  std::size_t pooled_storages = 0;   ///< live storages served by the pool
  std::size_t pooled_requested = 0;  ///< their requested bytes
  std::size_t pooled_blocks = 0;     ///< their size-class bytes (>= requested)
  std::size_t mapped = 0;            ///< bytes of every chunk mapped now, spare ones included
  /// Bytes of mapped chunks that were ever handed out, in whole 2 MiB pages: with transparent
  /// huge pages a first touch faults in a whole 2 MiB page, so this bounds what the pool holds
  /// resident (never-used ends of chunks cost address space only).
  std::size_t touched = 0;
  std::size_t spare = 0;              ///< bytes of empty chunks kept for reuse (part of mapped)
  std::size_t chunks = 0;             ///< chunks mapped now
  std::uint64_t chunks_mapped = 0;    ///< mmaps since the pool started
  std::uint64_t chunks_unmapped = 0;  ///< munmaps since the pool started
  std::size_t large_storages = 0;     ///< live storages above kPoolMaxBytes on their own pages
  std::size_t large_requested = 0;    ///< their requested bytes
  std::size_t heap_storages = 0;      ///< live storages from aligned_alloc (small, or pool off)
  std::size_t heap_requested = 0;     ///< their requested bytes
};

/// The storage pool's counters now (this process): "extra memory of the pool" is
/// touched - pooled_requested.
TD_API StoragePoolStats storage_pool_stats();

}  // namespace td
