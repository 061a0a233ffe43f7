// Transport without a prior layout: the receivers need not know the keys, dtypes or shapes they
// are sent (Python tensordict's broadcast / init_remote / all_gather / scatter of dicts that
// differ per rank). One small metadata message, then the data in one message per dtype; the
// received dicts are consolidated (one storage per dtype, leaves are views into it). See
// docs/transport.md. None of these supports async_op: it is std::invalid_argument on every rank.
#pragma once

#include <vector>

#include "tensordict/collectives.hpp"
#include "tensordict/export.hpp"
#include "tensordict/tensor_dict.hpp"

namespace td {

/// Rank `src`'s `value` on every rank of the group (`value` is read on src only; other ranks may
/// pass an empty dict). On src the result is `value` itself (a structure copy sharing storage).
TD_API TensorDict broadcast_dict(const TensorDict& value, int src,
                                 const CollectiveOptions& opts = {});
/// Sends `value` to rank `dst`, whose recv_dict() needs no layout. Returns once sent.
TD_API void send_dict(const TensorDict& value, int dst, const CollectiveOptions& opts = {});
/// Receives the dict rank `src` passes to send_dict(), whatever its layout.
TD_API TensorDict recv_dict(int src, const CollectiveOptions& opts = {});
/// Every rank's `value` on every rank ([r] is rank r's); the dicts may differ per rank in keys,
/// dtypes, shapes and batch size. Moves exactly each rank's bytes (MPI_Allgatherv, no padding).
TD_API std::vector<TensorDict> all_gather_dicts(const TensorDict& value,
                                                const CollectiveOptions& opts = {});
/// Every rank's `value` on rank `dst` ([r] is rank r's); an empty vector on other ranks.
TD_API std::vector<TensorDict> gather_dicts(const TensorDict& value, int dst,
                                            const CollectiveOptions& opts = {});
/// On `src`, parts[r] goes to rank r (one part per rank; parts may differ from each other);
/// `parts` is read on src only. Returns this rank's part.
TD_API TensorDict scatter_dicts(const std::vector<TensorDict>& parts, int src,
                                const CollectiveOptions& opts = {});

}  // namespace td
