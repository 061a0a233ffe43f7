// A process group's shared state (its communicator, its split by node, what is cached per
// group) and how the library makes and reads a td::ProcessGroup (not installed).
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include <mpi.h>

#include "core/tensor_internal.hpp"
#include "runtime/tags.hpp"
#include "tensordict/bucket_plan.hpp"
#include "tensordict/collectives.hpp"
#include "tensordict/process_group.hpp"

namespace td::detail {

/// kAutoBucketBytes resolved on a group: the cap, and the size from which leaves go alone.
struct TunedBuckets {
  std::size_t cap = 0;
  std::size_t direct_bytes = 0;
};

/// A group split by node (MPI_COMM_TYPE_SHARED, or TD_TEST_RANKS_PER_NODE's simulated nodes),
/// made once with the group: the communicators of the node-aware strategy of all_reduce / reduce
/// / broadcast (comm/runner.cpp) and the order its stages are posted in.
struct NodeSplit {
  MPI_Comm within = MPI_COMM_NULL;   // this rank's node: the first stage (reduce, or broadcast)
  MPI_Comm within2 = MPI_COMM_NULL;  // a duplicate of `within`: the last stage (broadcast)
  MPI_Comm leaders = MPI_COMM_NULL;  // rank 0 of every node (MPI_COMM_NULL elsewhere)
  MPI_Comm slices = MPI_COMM_NULL;   // the ranks of this local rank, one per node, by node
  bool equal = false;                // every node has `largest` ranks: the per-slice stages apply
  int local_rank = 0;                // in `within`: by group rank, so the node's lowest is 0
  int nodes = 1;
  int largest = 1;            // ranks on the fullest node
  std::vector<int> node_of;   // per group rank: its node (its leader's rank in `leaders`)
  std::vector<int> local_of;  // per group rank: its rank on its node
  // Stage s of every node-aware message is posted in the order the messages started (tickets
  // drawn when they start), whichever thread posts it: the ranks of a communicator must post
  // its collectives in one order, and a message's later stages are posted when its earlier ones
  // complete, which happens in different orders on different ranks.
  std::atomic<std::uint64_t> drawn[3] = {0, 0, 0};
  std::atomic<std::uint64_t> posted[3] = {0, 0, 0};
  // TD_HIERARCHICAL=auto (the default) on a group that spans several nodes with more than one of
  // its ranks on some node: whether all_reduce / reduce / broadcast go node-aware, as measured (or
  // read from the cache) by the group's first such call (choose_message_path); flat until then.
  // A duplicate of the group starts with its choice.
  std::atomic<bool> auto_node_aware{false};
  std::atomic<bool> path_chosen{false};
};

/// Shared state of one process group: its communicator and what is cached per group.
struct GroupState {
  MPI_Comm comm = MPI_COMM_NULL;  // our own duplicate; MPI_COMM_NULL on non-members
  int rank = -1;
  int size = 0;
  std::vector<int> world_ranks;
  bool destroyed = false;  // destroy_process_group ran; any use throws
  // The flight recorder's identity of the group, the same on every member
  // (runtime/flight_recorder.hpp), and its sequence numbers: the last drawn.
  std::uint64_t id = 0;
  std::string name;
  std::atomic<std::uint64_t> seq{0};      // collectives, transport, barrier, Reducer steps
  std::atomic<std::uint64_t> p2p_seq{0};  // point to point

  std::mutex mu;  // guards the caches below
  std::unordered_map<std::uint64_t, std::shared_ptr<const BucketPlan>> plans;  // by layout+cap
  std::uint64_t plan_hits = 0, plan_misses = 0;
  std::optional<TunedBuckets> tuned;  // kAutoBucketBytes resolved on this group
  std::shared_ptr<Storage> scratch;   // reused pack buffer of sync calls
  std::optional<TagSpace> tags;       // point to point and transport (members only)
  NodeSplit nodes;                    // members only

  GroupState() = default;
  GroupState(const GroupState&) = delete;
  GroupState& operator=(const GroupState&) = delete;
  ~GroupState();

  /// The communicator for a collective named `what`; throws if not a member or destroyed.
  MPI_Comm checked_comm(std::string_view what) const;
};

/// What the library reads of a ProcessGroup, and how it makes one (the public class hides both).
struct GroupAccess {
  static ProcessGroup wrap(std::shared_ptr<GroupState> state) {
    return ProcessGroup(std::move(state));
  }
  static const std::shared_ptr<GroupState>& state(const ProcessGroup& group) {
    return group.state_;
  }
};

/// How many ranks of `comm` share this rank's memory (its host). Collective over `comm`.
int ranks_on_this_host(MPI_Comm comm);

/// Whether all_reduce / reduce / broadcast on `g` run node-aware: TD_HIERARCHICAL=1 or leaders;
/// under auto (the default), whether the group spans several nodes with more than one of its ranks
/// on some node and its first such call measured node-aware faster (NodeSplit::auto_node_aware).
bool node_aware(const GroupState& g);
/// Whether `g` needs its path measured: TD_HIERARCHICAL=auto, a group spanning several nodes with
/// more than one of its ranks on some node, not chosen yet.
bool path_to_choose(const GroupState& g);

/// The group of a call's options (world() by default).
std::shared_ptr<GroupState> group_of(const CollectiveOptions& opts);
/// A new group of the same ranks over its own duplicate of g's communicator (collective over
/// g: every member calls it), released by destroy_process_group like every group.
std::shared_ptr<GroupState> duplicate_group(const GroupState& g, std::string_view what);

}  // namespace td::detail
