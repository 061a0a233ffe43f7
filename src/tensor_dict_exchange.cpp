// Point-to-point and gather/scatter collectives of TensorDict (issue 9: not implemented yet).
#include <fmt/format.h>

#include "tensordict/tensor_dict.hpp"

namespace td {

namespace {
[[noreturn]] void not_yet(const char* what) {
  throw Error(
      fmt::format("TensorDict::{} is not implemented yet in this version of tensordict-mpi", what));
}
}  // namespace

std::vector<Work> TensorDict::send(int, const CollectiveOptions&) { not_yet("send"); }
std::vector<Work> TensorDict::recv(int, const CollectiveOptions&) { not_yet("recv"); }
std::vector<TensorDict> TensorDict::all_gather(const CollectiveOptions&) const {
  not_yet("all_gather");
}
std::vector<TensorDict> TensorDict::gather(int, const CollectiveOptions&) const {
  not_yet("gather");
}
std::vector<Work> TensorDict::scatter(int, const std::vector<TensorDict>&,
                                      const CollectiveOptions&) {
  not_yet("scatter");
}
TensorDict TensorDict::reduce_scatter(ReduceOp, const CollectiveOptions&) const {
  not_yet("reduce_scatter");
}

}  // namespace td
