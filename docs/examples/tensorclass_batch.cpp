// tensorclass_batch: a typed batch of observations, actions and rewards, averaged across ranks.
//
// Each rank of a data-parallel learner collects its own batch of transitions. Declared as a
// tensorclass, the batch has named, typed fields (batch.obs.joints, batch.rewards) and every
// TensorDict collective on the whole struct: all_reduce(AVG) averages every field across ranks,
// nested ones included, in a few bucketed messages, with no per-field code.
// Run it with:  mpirun -np 3 --oversubscribe build/bin/tensorclass_batch
//
// RANKS: 2 3
// EXPECT: Batch(
// EXPECT:         obs: Observation(
// EXPECT:                 pixels: Tensor(shape=[4, 3, 8, 8], dtype=float32),
// EXPECT:     batch_size=[4])
// EXPECT: mean rewards: tensor([1.0000, 1.5000, 2.0000, 2.5000])
// EXPECT: mean actions of step 0: tensor([0.5000, -0.5000])
// EXPECT: every field averaged across ranks: ok
// EXPECT: mean of the gathered rewards matches: ok
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <vector>

#include <fmt/format.h>

#include <tensordict/tensordict.hpp>

namespace {

constexpr std::int64_t kSteps = 4;  // the batch size: transitions per rank

// The declaration is all the code a field needs: TD_TENSORCLASS_FIELDS lists the members that
// become keys ("obs", "pixels", ...). A nested tensorclass becomes a sub-dict.
struct Observation : td::TensorClass<Observation> {
  td::Tensor pixels;  // float32 [steps, 3, 8, 8]
  td::Tensor joints;  // float32 [steps, 7]
  TD_TENSORCLASS_FIELDS(Observation, pixels, joints)
};

struct Batch : td::TensorClass<Batch> {
  Observation obs;
  td::Tensor actions;  // float32 [steps, 2]: continuous controls
  td::Tensor rewards;  // float32 [steps]
  TD_TENSORCLASS_FIELDS(Batch, obs, actions, rewards)
};

// Stand-in for a rollout: rank r's values are spread symmetrically around the mean, by
// `offset`, so the average across ranks does not depend on the number of ranks.
Batch collect(float offset) {
  Batch batch;
  batch.set_batch_size({kSteps});
  batch.obs.pixels = td::Tensor::full<float>({kSteps, 3, 8, 8}, 0.5f + 0.125f * offset);
  batch.obs.joints = td::Tensor::full<float>({kSteps, 7}, 0.25f * offset);
  batch.actions = td::Tensor::from_vector<float>(
      {0.5f + offset, -0.5f - offset, 1.0f, offset, 0.f, 0.f, -offset, 2.f}, {kSteps, 2});
  batch.rewards = td::Tensor::from_vector<float>({1.0f, 1.5f, 2.0f, 2.5f});
  batch.rewards.array<float>() += 0.25f * offset;
  return batch;
}

// Every rank checked its own copy; a sum of the failures lets rank 0 speak for all of them.
bool all_ranks_ok(bool ok_here) {
  td::Tensor wrong = td::Tensor::full<std::int64_t>({1}, ok_here ? 0 : 1);
  td::all_reduce(wrong, td::ReduceOp::SUM);
  return wrong.to_vector<std::int64_t>()[0] == 0;
}

bool all_near(const td::Tensor& t, const std::vector<float>& expected) {
  const std::vector<float> v = t.to_vector<float>();
  if (v.size() != expected.size()) return false;
  for (std::size_t i = 0; i < v.size(); ++i)
    if (std::abs(v[i] - expected[i]) > 1e-6f) return false;
  return true;
}

}  // namespace

// An exception escaping main ends every rank: init_process_group's terminate handler calls
// MPI_Abort, so peers do not wait for this rank forever.
int main(int argc, char** argv) {  // NOLINT(bugprone-exception-escape)
  td::init_process_group(argc, argv);
  const int rank = td::get_rank();
  const int size = td::get_world_size();
  const float offset = static_cast<float>(2 * rank - (size - 1));

  Batch batch = collect(offset);
  if (rank == 0) fmt::print("{}\n", batch);  // the struct's layout: names, shapes, dtypes

  // Conversion both ways. The dict's leaves share the fields' storage: writing one writes the
  // other. from_tensordict() checks that the keys are exactly the fields (td::KeyError names a
  // missing one).
  td::TensorDict as_dict = batch.to_tensordict();
  const Batch back = Batch::from_tensordict(as_dict);
  bool ok = back == batch && as_dict.get({"obs", "joints"}).shares_storage_with(batch.obs.joints);

  // Keep this rank's batch, for gather() below.
  const Batch mine = batch.clone();

  // One call averages every field on every rank, in place. The semantics are TensorDict's:
  // leaves in sorted key order, a layout check across ranks first, same-dtype leaves packed
  // into buckets of the size tuned on this machine.
  batch.all_reduce(td::ReduceOp::AVG, {.bucket_bytes = td::kAutoBucketBytes});

  ok = ok && all_near(batch.rewards, {1.0f, 1.5f, 2.0f, 2.5f});
  ok = ok && all_near(batch.actions, {0.5f, -0.5f, 1.0f, 0.f, 0.f, 0.f, 0.f, 2.f});
  ok = ok && all_near(batch.obs.pixels, std::vector<float>(kSteps * 3 * 8 * 8, 0.5f));
  ok = ok && all_near(batch.obs.joints, std::vector<float>(kSteps * 7, 0.f));
  ok = ok && as_dict.get("rewards").shares_storage_with(batch.rewards);  // still shared
  const bool all_ok = all_ranks_ok(ok);

  // Collectives that return structs: gather() delivers every rank's batch to rank 0, typed
  // ([r] is rank r's; other ranks get an empty vector).
  const std::vector<Batch> gathered = mine.gather(/*dst=*/0);

  if (rank == 0) {
    fmt::print("mean rewards: {}\n", batch.rewards);
    fmt::print("mean actions of step 0: {}\n", batch.actions.slice(0, 0, 1).view({2}));
    fmt::print("every field averaged across ranks: {}\n", all_ok ? "ok" : "FAILED");
    std::vector<float> mean(kSteps, 0.f);
    for (const Batch& b : gathered) {
      const std::vector<float> r = b.rewards.to_vector<float>();
      for (std::size_t i = 0; i < mean.size(); ++i)
        mean[i] += r[i] / static_cast<float>(gathered.size());
    }
    fmt::print("mean of the gathered rewards matches: {}\n",
               all_near(batch.rewards, mean) ? "ok" : "FAILED");
    std::fflush(stdout);
  }

  td::destroy_process_group();
  return all_ok ? 0 : 1;
}
