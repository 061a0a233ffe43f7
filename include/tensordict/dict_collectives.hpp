/// @file
/// The collective members of td::TensorDict, listed once. tensor_dict.hpp declares TensorDict's
/// members from this list and tensorclass.hpp gives every tensorclass the same members from it,
/// so a collective added here exists on both, with the same parameters and defaults (the member
/// itself is defined once, in the library's src/ops/). The members' documentation follows the
/// list.
#pragma once

/// The `opts` parameter every collective member ends with (CollectiveOptions{} by default).
#define TD_DETAIL_OPTS const CollectiveOptions& opts = detail::default_collective_options()

/// Applies X(access, attr, ret, name, params, args, cv) to every collective member of a dict type
/// `Self`. access: `in_place` (writes the dict's leaves) or `reads` (leaves the dict alone; a
/// tensorclass member is const); attr: an attribute of the declaration; ret and params: the
/// member's return type and parenthesised parameters, naming `Self`; args: the parameters
/// forwarded to TensorDict's member by a tensorclass; cv: TensorDict's qualifier.
// Self, ret and params are a type and parameter lists, not expressions to parenthesise:
// NOLINTBEGIN(bugprone-macro-parentheses)
// clang-format off
#define TD_DETAIL_DICT_COLLECTIVES(X, Self)                                                        \
  X(in_place, , std::vector<Work>, all_reduce,                                                     \
    (ReduceOp op = ReduceOp::SUM, TD_DETAIL_OPTS), (op, opts), )                                   \
  X(in_place, , std::vector<Work>, reduce,                                                         \
    (int dst, ReduceOp op = ReduceOp::SUM, TD_DETAIL_OPTS), (dst, op, opts), )                     \
  X(in_place, , std::vector<Work>, broadcast, (int src, TD_DETAIL_OPTS), (src, opts), )            \
  X(reads, , std::vector<Work>, send, (int dst, TD_DETAIL_OPTS), (dst, opts), )                    \
  X(in_place, , std::vector<Work>, recv, (int src, TD_DETAIL_OPTS), (src, opts), )                 \
  X(reads, [[nodiscard]], std::vector<Work>, isend, (int dst, TD_DETAIL_OPTS), (dst, opts), )      \
  X(in_place, [[nodiscard]], std::vector<Work>, irecv, (int src, TD_DETAIL_OPTS), (src, opts), )   \
  X(reads, , std::vector<Self>, all_gather, (TD_DETAIL_OPTS), (opts), const)                       \
  X(reads, , std::vector<Work>, all_gather,                                                        \
    (std::vector<Self>& out, TD_DETAIL_OPTS), (out, opts), const)                                  \
  X(reads, , Self, all_gather_stacked, (TD_DETAIL_OPTS), (opts), const)                            \
  X(reads, , std::vector<Work>, all_gather_stacked, (Self& out, TD_DETAIL_OPTS), (out, opts),      \
    const)                                                                                         \
  X(reads, , std::vector<Self>, gather, (int dst, TD_DETAIL_OPTS), (dst, opts), const)             \
  X(reads, , std::vector<Work>, gather,                                                            \
    (int dst, std::vector<Self>& out, TD_DETAIL_OPTS), (dst, out, opts), const)                    \
  X(in_place, , std::vector<Work>, scatter,                                                        \
    (int src, const std::vector<Self>& parts, TD_DETAIL_OPTS),                                     \
    (src, ::td::detail::read_on(src, opts, parts), opts), )                                        \
  X(reads, , Self, reduce_scatter, (ReduceOp op = ReduceOp::SUM, TD_DETAIL_OPTS), (op, opts),      \
    const)                                                                                         \
  X(reads, , std::vector<Work>, reduce_scatter,                                                    \
    (Self& out, ReduceOp op = ReduceOp::SUM, TD_DETAIL_OPTS), (out, op, opts), const)              \
  X(reads, , Self, reduce_scatter,                                                                 \
    (const std::vector<std::int64_t>& rows_per_rank, ReduceOp op = ReduceOp::SUM, TD_DETAIL_OPTS), \
    (rows_per_rank, op, opts), const)
// clang-format on

/// TensorDict's declaration of one entry of TD_DETAIL_DICT_COLLECTIVES.
#define TD_DETAIL_DICT_DECLARE(access, attr, ret, name, params, args, cv) attr ret name params cv;
// NOLINTEND(bugprone-macro-parentheses)

namespace td {

// One line per signature, as Doxygen needs it:
// clang-format off
/// \fn std::vector<Work> TensorDict::all_reduce(ReduceOp op, const CollectiveOptions& opts)
/// Reduces every leaf across the group into every rank. Returns the pending Works when
/// opts.async_op, else an empty vector (everything done).
///
/// \fn std::vector<Work> TensorDict::reduce(int dst, ReduceOp op, const CollectiveOptions& opts)
/// Reduces every leaf into rank `dst`; other ranks' leaves are left unspecified.
///
/// \fn std::vector<Work> TensorDict::broadcast(int src, const CollectiveOptions& opts)
/// Copies every leaf of rank `src` into every rank's dict (same layout on every rank).
///
/// \fn std::vector<Work> TensorDict::send(int dst, const CollectiveOptions& opts)
/// Sends every leaf to rank `dst`, whose matching recv() holds the same layout (checked first:
/// a mismatch is a td::LayoutMismatchError on both sides naming the key, and moves no data).
/// Leaves go in canonical order, one message per leaf; with opts.bucket_bytes one per bucket,
/// and with kAutoBucketBytes one per dtype (consolidated). With opts.async_op the one returned
/// Work is pending and the leaves must not change until it completes.
///
/// \fn std::vector<Work> TensorDict::recv(int src, const CollectiveOptions& opts)
/// Receives every leaf from rank `src` into this dict, which holds the sender's layout (the
/// bucketing is the sender's choice). With opts.async_op the leaves are valid after wait().
///
/// \fn std::vector<Work> TensorDict::isend(int dst, const CollectiveOptions& opts)
/// send() with async_op set (torch.distributed.isend).
///
/// \fn std::vector<Work> TensorDict::irecv(int src, const CollectiveOptions& opts)
/// recv() with async_op set (torch.distributed.irecv).
///
/// \fn std::vector<TensorDict> TensorDict::all_gather(const CollectiveOptions& opts) const
/// Every rank's dict: [r] is rank r's (with fresh storage). Runs to completion even with
/// opts.async_op; the overload that fills `out` can return pending Works.
///
/// \fn std::vector<Work> TensorDict::all_gather(std::vector<TensorDict>& out, const CollectiveOptions& opts) const
/// all_gather into `out` (torch.distributed.all_gather's tensor_list): `out` is replaced by one
/// dict per rank right away; with opts.async_op their leaves are valid after every returned
/// Work's wait().
///
/// \fn TensorDict TensorDict::all_gather_stacked(const CollectiveOptions& opts) const
/// Every rank's dict stacked along a new leading dimension: each leaf becomes [size, *shape]
/// (row r is rank r's) and the batch size [size, *batch_size]. One leaf per bucket is received
/// straight into the stacked tensor.
///
/// \fn std::vector<Work> TensorDict::all_gather_stacked(TensorDict& out, const CollectiveOptions& opts) const
/// all_gather_stacked into `out` (replaced right away; with opts.async_op valid after wait()).
///
/// \fn std::vector<TensorDict> TensorDict::gather(int dst, const CollectiveOptions& opts) const
/// Every rank's dict on `dst` ([r] is rank r's); an empty vector on other ranks.
///
/// \fn std::vector<Work> TensorDict::gather(int dst, std::vector<TensorDict>& out, const CollectiveOptions& opts) const
/// gather into `out` on `dst` (emptied on other ranks); with opts.async_op valid after wait().
///
/// \fn std::vector<Work> TensorDict::scatter(int src, const std::vector<TensorDict>& parts, const CollectiveOptions& opts)
/// On src, parts[r] goes to rank r; every rank's *this already holds the layout of one part.
/// `parts` is read on src only.
///
/// \fn TensorDict TensorDict::reduce_scatter(ReduceOp op, const CollectiveOptions& opts) const
/// Every leaf's first dimension split evenly across the group; returns this rank's reduced shard
/// (rows [rank * n / size, (rank + 1) * n / size) of the reduced leaf). Bucketed like
/// all_reduce: one MPI_Reduce_scatter_block per bucket.
///
/// \fn std::vector<Work> TensorDict::reduce_scatter(TensorDict& out, ReduceOp op, const CollectiveOptions& opts) const
/// reduce_scatter into `out` (replaced right away by the shard dict; with opts.async_op its
/// leaves are valid after every returned Work's wait()).
///
/// \fn TensorDict TensorDict::reduce_scatter(const std::vector<std::int64_t>& rows_per_rank, ReduceOp op, const CollectiveOptions& opts) const
/// Uneven reduce_scatter: rows_per_rank[r] rows of every leaf's first dimension go to rank r
/// (the sizes must sum to every leaf's first dimension and agree on every rank). Returns this
/// rank's reduced rows; one MPI_Reduce_scatter with per-rank counts per bucket. Runs to
/// completion even with opts.async_op.
// clang-format on

}  // namespace td
