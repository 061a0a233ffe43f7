// The bucket plan: which leaves travel together in which message. Pure data, no MPI, so it can be
// tested and fuzzed on its own; every rank builds the same plan from the same agreed layout.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "tensordict/dtype.hpp"
#include "tensordict/export.hpp"
#include "tensordict/tensor.hpp"

namespace td {

/// What the plan knows of one leaf: only what every rank must agree on.
struct TD_API LeafLayout {
  DType dtype = DType::Float32;  ///< element type
  Shape shape;                   ///< sizes (the dense shape for a sparse leaf)
  bool contiguous = true;        ///< dense row-major (only such leaves are packed together)
  bool sparse = false;           ///< a sparse COO leaf (never packed)
  /// Index (in canonical order) of an earlier leaf viewing exactly the same elements, or -1.
  std::int64_t alias_of = -1;

  /// Size of the leaf's elements in bytes.
  std::size_t nbytes() const;
  /// Equality of every field.
  bool operator==(const LeafLayout&) const = default;
};

/// Leaves grouped into buckets: one collective (split into messages) per bucket.
struct TD_API BucketPlan {
  /// One leaf's place in a bucket's buffer.
  struct Slot {
    std::size_t leaf = 0;    ///< index into the canonical leaf list
    std::size_t offset = 0;  ///< byte offset in the bucket's buffer
    std::size_t nbytes = 0;  ///< bytes of the leaf
  };
  /// Leaves of one dtype sent as one buffer.
  struct Bucket {
    DType dtype = DType::Float32;  ///< dtype of every slot
    std::size_t nbytes = 0;        ///< sum of the slots' bytes
    std::vector<Slot> slots;       ///< in the plan's order (build: canonical), back to back
    bool strided = false;          ///< a single non-contiguous leaf (copied through a strided pack)
  };

  /// The cap the plan was built with (nullopt: one bucket per leaf).
  std::optional<std::size_t> cap;
  /// Largest message in bytes: buckets larger than this are sent in several messages.
  std::size_t max_message_bytes = 0;
  /// Buckets in the plan's order of their first leaf.
  std::vector<Bucket> buckets;
  /// Sparse leaves, each reduced on its own (never packed).
  std::vector<std::size_t> sparse_leaves;
  /// Leaves skipped: empty (no elements) or aliases of an earlier leaf.
  std::vector<std::size_t> skipped_leaves;

  /// Builds the plan. `cap` nullopt: one bucket per leaf; otherwise buckets hold contiguous dense
  /// leaves of one dtype, in canonical order, totalling at most *cap bytes (a larger leaf is a
  /// bucket of its own). Leaves of at least `direct_bytes` bytes (0: no such rule) also go on
  /// their own, so they are reduced in place instead of being copied into a pack buffer.
  /// `max_message_bytes` 0 picks max(*cap, 4 MiB), or 4 MiB without a cap (latency is negligible
  /// at that size, and MPI's temporary buffer for it stays below the mmap threshold that
  /// init_process_group sets); a message never exceeds INT_MAX elements.
  static BucketPlan build(const std::vector<LeafLayout>& leaves, std::optional<std::size_t> cap,
                          std::size_t max_message_bytes = 0, std::size_t direct_bytes = 0);
  /// Builds the td::Reducer's plan: the leaves taken in `order` (a permutation of the leaf
  /// indices: the ready order), one open bucket per dtype, which closes when the next leaf of its
  /// dtype would pass `cap` bytes (so a leaf larger than the cap is a bucket of its own). Buckets
  /// are numbered by their first leaf in `order` (the order they launch in) and hold their slots
  /// back to back in `order`. Every dense leaf with elements is packed, contiguous or not: the
  /// Reducer copies it into its bucket's storage, whose view it then becomes. Empty leaves and
  /// aliases are skipped, sparse leaves listed (the Reducer rejects both kinds before).
  /// `max_message_bytes` as for build(). Throws std::invalid_argument for a cap of 0 or an
  /// `order` that is not a permutation.
  static BucketPlan build_in_order(const std::vector<LeafLayout>& leaves,
                                   const std::vector<std::size_t>& order, std::size_t cap,
                                   std::size_t max_message_bytes = 0);
  /// Checks the invariants (every byte of every packable leaf in exactly one bucket, the cap,
  /// canonical order, one dtype per bucket); returns an empty string or what is wrong.
  std::string check(const std::vector<LeafLayout>& leaves) const;
  /// check() for a plan of build_in_order(leaves, order, ...): the same invariants with `order`
  /// in place of canonical order (non-contiguous leaves packed like the others), and what makes
  /// the plan the one build_in_order builds: a dtype's buckets one after the other in `order`,
  /// each opened only when its first leaf would have passed the cap in the one before.
  std::string check_in_order(const std::vector<LeafLayout>& leaves,
                             const std::vector<std::size_t>& order) const;
  /// A human-readable summary: one line per bucket (dtype, bytes, leaves).
  std::string describe() const;
};

}  // namespace td
