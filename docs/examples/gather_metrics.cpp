// gather_metrics: collecting every rank's evaluation metrics on rank 0 with TensorDict::gather.
//
// Each rank evaluates its shard of a validation set and holds its metrics in a TensorDict of
// scalars: a float loss and accuracy, and an int64 sample count. gather(0) delivers every rank's
// dict to rank 0 ([r] is rank r's dict), which reports them and their mean.
// Run it with:  mpirun -np 3 --oversubscribe build/bin/gather_metrics
//
// RANKS: 2 3
// EXPECT: mean loss: 0.5000
// EXPECT: mean accuracy: 0.9000
#include <cstdint>
#include <cstdio>
#include <vector>

#include <fmt/format.h>

#include <tensordict/tensordict.hpp>

namespace {

// A 0-d tensor's one value.
template <class T>
T scalar(const td::TensorDict& d, const td::Key& key) {
  return d.get(key).to_vector<T>()[0];
}

}  // namespace

int main(int argc, char** argv) {
  td::init_process_group(argc, argv);
  const int rank = td::get_rank();
  const int size = td::get_world_size();

  // Stand-in for an evaluation loop: metrics spread symmetrically around a loss of 0.5 and an
  // accuracy of 0.9, so their mean does not depend on the number of ranks.
  const float offset = static_cast<float>(2 * rank - (size - 1));
  td::TensorDict metrics;
  metrics.set("loss", td::Tensor::full<float>({}, 0.5f + 0.05f * offset));
  metrics.set("accuracy", td::Tensor::full<float>({}, 0.9f + 0.01f * offset));
  metrics.set("samples", td::Tensor::full<std::int64_t>({}, 1000 + 10 * rank));

  // Every rank takes part; only the destination gets the dicts (other ranks get an empty vector).
  // Ranks must hold the same keys, dtypes and shapes: otherwise every rank raises
  // td::LayoutMismatchError instead of pairing the wrong values.
  const std::vector<td::TensorDict> all = metrics.gather(/*dst=*/0);

  if (rank == 0) {
    double loss = 0, accuracy = 0;
    std::int64_t samples = 0;
    for (std::size_t r = 0; r < all.size(); ++r) {
      const float l = scalar<float>(all[r], "loss");
      const float a = scalar<float>(all[r], "accuracy");
      const auto n = scalar<std::int64_t>(all[r], "samples");
      fmt::print("rank {}: loss {:.4f}, accuracy {:.4f}, {} samples\n", r, l, a, n);
      loss += l;
      accuracy += a;
      samples += n;
    }
    fmt::print("gathered metrics from {} ranks ({} samples)\n", all.size(), samples);
    fmt::print("mean loss: {:.4f}\n", loss / static_cast<double>(all.size()));
    fmt::print("mean accuracy: {:.4f}\n", accuracy / static_cast<double>(all.size()));
    std::fflush(stdout);
  }

  td::destroy_process_group();
  return 0;
}
