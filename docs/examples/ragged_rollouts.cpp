// ragged_rollouts: reinforcement-learning rollouts of different lengths gathered on a learner
// with td::gather_dicts (Python tensordict's all_gather / gather of dicts that differ per rank).
//
// Each actor rank collects an episode whose length depends on the rank (its batch size is the
// number of steps), and only some actors record an extra "info" entry. gather_dicts sends every
// rank's layout first, then the values with MPI_Gatherv at exact sizes: nothing is padded to
// the longest episode. The learner (rank 0) receives one dict per rank, as each rank built it.
// Run it with:  mpirun -np 3 --oversubscribe build/bin/ragged_rollouts
//
// RANKS: 2 3
// EXPECT: learner: rank 0 sent 5 steps, return 5.0
// EXPECT: learner: rank 1 sent 9 steps, return 18.0, with info
#include <cstdint>
#include <cstdio>
#include <vector>

#include <fmt/format.h>

#include <tensordict/tensordict.hpp>

namespace {

// Actor `rank`'s episode: 5 + 4 * rank steps of observations [steps, 4], actions [steps] (int64)
// and rewards [steps] (float32, rank + 1 each); odd ranks add a nested info entry.
td::TensorDict rollout(int rank) {
  const std::int64_t steps = 5 + 4 * rank;
  td::TensorDict episode(td::Shape{steps});
  episode.set("observation", td::Tensor::full<float>({steps, 4}, 0.1f * static_cast<float>(rank)));
  episode.set("action", td::Tensor::full<std::int64_t>({steps}, rank % 2));
  episode.set({"next", "reward"}, td::Tensor::full<float>({steps}, static_cast<float>(rank + 1)));
  if (rank % 2 == 1) episode.set({"info", "lives"}, td::Tensor::full<std::int32_t>({steps}, 3));
  return episode;
}

}  // namespace

int main(int argc, char** argv) {
  td::init_process_group(argc, argv);
  const int rank = td::get_rank();

  const std::vector<td::TensorDict> episodes = td::gather_dicts(rollout(rank), /*dst=*/0);

  // Only the learner receives (an empty vector elsewhere).
  for (std::size_t r = 0; r < episodes.size(); ++r) {
    const td::TensorDict& e = episodes[r];
    double ret = 0;
    for (const float v : e.get({"next", "reward"}).to_vector<float>()) ret += v;
    fmt::print("learner: rank {} sent {} steps, return {:.1f}{}\n", r, e.batch_size()[0], ret,
               e.contains("info") ? ", with info" : "");
  }
  td::destroy_process_group();
}
