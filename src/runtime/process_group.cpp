#include "tensordict/process_group.hpp"

#include <algorithm>
#include <array>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "core/config.hpp"
#include "core/storage_pool.hpp"
#include "runtime/deadline.hpp"
#include "runtime/diagnosis.hpp"
#include "runtime/flight_recorder.hpp"
#include "runtime/group_state.hpp"
#include "runtime/log.hpp"
#include "runtime/mpi_error.hpp"
#include "runtime/mpi_types.hpp"
#include "runtime/nbc_tuning.hpp"
#include "runtime/progress.hpp"
#include "tensordict/diagnostics.hpp"
#include "tensordict/errors.hpp"

namespace td {

namespace detail {

void throw_mpi_error(const char* call, int code) {
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(code, text, &len) != MPI_SUCCESS) len = 0;
  std::string routine(call);
  routine = routine.substr(0, routine.find('('));
  throw MpiError(fmt::format("{} failed: {} (error code {})", routine,
                             std::string(text, static_cast<std::size_t>(len)), code));
}

namespace {
bool mpi_finalized() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  return finalized != 0;
}
}  // namespace

GroupState::~GroupState() {
  if (mpi_finalized()) return;
  for (MPI_Comm* c : {&nodes.within, &nodes.within2, &nodes.leaders, &nodes.slices, &comm})
    if (*c != MPI_COMM_NULL) MPI_Comm_free(c);
}

int ranks_on_this_host(MPI_Comm comm) {
  MPI_Comm local = MPI_COMM_NULL;
  TD_MPI_CHECK(MPI_Comm_split_type(comm, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &local));
  int local_ranks = 1;
  MPI_Comm_size(local, &local_ranks);
  MPI_Comm_free(&local);
  return local_ranks;
}

namespace {
// A group on which node-aware stages can differ from flat calls: several nodes, and more than one
// of its ranks on some node.
bool node_stages_apply(const GroupState& g) { return g.nodes.nodes > 1 && g.nodes.largest > 1; }
}  // namespace

bool node_aware(const GroupState& g) {
  // TD_HIERARCHICAL=auto (the default) measures: on the namespace cluster at 1 Gbit/s
  // (docs/cluster.md, 2026-12-06) node-aware won at 3 hosts x 2 ranks (a consolidated dict 306 vs
  // 663 ms flat) but lost at 3 x 4 (419 vs 363 ms), in the Reducer at 2 x 2 (256 vs 231 ms) and
  // for one tensor at 2 x 4 (294 vs 231 ms): no fixed rule wins everywhere.
  const int mode = config().hierarchical;
  if (mode != 2) return mode == 1 || mode == 3;
  return node_stages_apply(g) && g.nodes.auto_node_aware.load(std::memory_order_relaxed);
}

bool path_to_choose(const GroupState& g) {
  return config().hierarchical == 2 && node_stages_apply(g) &&
         !g.nodes.path_chosen.load(std::memory_order_acquire);
}

MPI_Comm GroupState::checked_comm(std::string_view what) const {
  if (destroyed)
    throw Error(
        fmt::format("{}: the process group was destroyed by destroy_process_group()", what));
  if (comm == MPI_COMM_NULL) {
    int world_rank = -1;
    MPI_Comm_rank(MPI_COMM_WORLD, &world_rank);
    throw std::invalid_argument(fmt::format(
        "{}: this process (world rank {}) is not a member of the group of world ranks [{}]", what,
        world_rank, fmt::join(world_ranks, ", ")));
  }
  return comm;
}

namespace {

// The simulated node of a world rank under TD_TEST_RANKS_PER_NODE (sizes, the last repeating).
int test_node_of(int world_rank, const std::vector<int>& sizes) {
  int node = 0;
  for (int first = 0;; ++node) {
    const int n = sizes[std::min(static_cast<std::size_t>(node), sizes.size() - 1)];
    if (world_rank < first + n) return node;
    first += n;
  }
}

// Splits the group's communicator by node, once, as it is made: collective over the group like
// the communicator itself, and done whatever TD_HIERARCHICAL says, so that ranks that disagree on
// it still make the same calls here and reach the agreement, which reports it.
void split_by_node(GroupState& g) {
  NodeSplit& n = g.nodes;
  const std::vector<int>& sizes = config().test_node_sizes;
  if (sizes.empty()) {
    TD_MPI_CHECK(
        MPI_Comm_split_type(g.comm, MPI_COMM_TYPE_SHARED, g.rank, MPI_INFO_NULL, &n.within));
  } else {
    const int world_rank = g.world_ranks[static_cast<std::size_t>(g.rank)];
    TD_MPI_CHECK(MPI_Comm_split(g.comm, test_node_of(world_rank, sizes), g.rank, &n.within));
  }
  TD_MPI_CHECK(MPI_Comm_set_errhandler(n.within, MPI_ERRORS_RETURN));
  TD_MPI_CHECK(MPI_Comm_dup(n.within, &n.within2));
  TD_MPI_CHECK(MPI_Comm_rank(n.within, &n.local_rank));
  TD_MPI_CHECK(MPI_Comm_split(g.comm, n.local_rank == 0 ? 0 : MPI_UNDEFINED, g.rank, &n.leaders));
  int node = 0;
  if (n.leaders != MPI_COMM_NULL) {
    TD_MPI_CHECK(MPI_Comm_set_errhandler(n.leaders, MPI_ERRORS_RETURN));
    TD_MPI_CHECK(MPI_Comm_rank(n.leaders, &node));
  }
  TD_MPI_CHECK(MPI_Comm_split(g.comm, n.local_rank, g.rank, &n.slices));
  TD_MPI_CHECK(MPI_Comm_set_errhandler(n.slices, MPI_ERRORS_RETURN));
  TD_MPI_CHECK(MPI_Bcast(&node, 1, MPI_INT, 0, n.within));
  std::vector<int> mine = {node, n.local_rank};
  std::vector<int> all(2 * static_cast<std::size_t>(g.size));
  TD_MPI_CHECK(MPI_Allgather(mine.data(), 2, MPI_INT, all.data(), 2, MPI_INT, g.comm));
  n.node_of.resize(static_cast<std::size_t>(g.size));
  n.local_of.resize(static_cast<std::size_t>(g.size));
  std::vector<int> per_node(static_cast<std::size_t>(g.size), 0);
  for (std::size_t r = 0; r < n.node_of.size(); ++r) {
    n.node_of[r] = all[2 * r];
    n.local_of[r] = all[2 * r + 1];
    ++per_node[static_cast<std::size_t>(n.node_of[r])];
  }
  n.nodes = static_cast<int>(
      std::count_if(per_node.begin(), per_node.end(), [](int c) { return c > 0; }));
  n.largest = *std::max_element(per_node.begin(), per_node.end());
  n.equal = n.largest * n.nodes == g.size;
}

// Whether `version` (MPI_Get_library_version's text) is Open MPI before version 5 (its TCP
// transport is what stalls below).
bool open_mpi_before_5(std::string_view v) {
  constexpr std::string_view kPrefix = "Open MPI v";
  if (!v.starts_with(kPrefix) || v.size() <= kPrefix.size()) return false;
  const char major = v[kPrefix.size()];
  return major >= '1' && major <= '4' &&
         (v.size() == kPrefix.size() + 1 || v[kPrefix.size() + 1] == '.');
}

std::string mpi_library_version() {
  std::array<char, MPI_MAX_LIBRARY_VERSION_STRING> text{};
  int len = 0;
  MPI_Get_library_version(text.data(), &len);
  return std::string(text.data(), static_cast<std::size_t>(len));
}

}  // namespace

// Whether the progress thread runs by default (a pure function, tested white-box in
// test/internal): TD_PROGRESS_THREAD (`setting`) decides when set; otherwise on, except when the
// job spans several hosts (fewer ranks on this host than in the world) under Open MPI before 5
// (`library_version`: MPI_Get_library_version's text).
// Its TCP transport stalls nonblocking collectives that two threads of a process drive at once,
// across hosts and under load: one rank's part of a collective never completes while the
// others' did (reproduced without this library by test/cluster/ompi_two_threads.cpp;
// docs/cluster.md). Within one host (shared memory) it was never seen.
bool progress_thread_on(int world_size, int ranks_on_host, std::string_view library_version,
                        std::optional<bool> setting) {
  if (setting) return *setting;
  const bool several_hosts = ranks_on_host < world_size;
  return !several_hosts || !open_mpi_before_5(library_version);
}

namespace {

// The progress thread's default when TD_PROGRESS_THREAD does not say (progress_thread_on). Said
// once per job.
void choose_progress_thread(int world_rank, int world_size) {
  if (world_size < 2) return;
  // Collective: every rank asks, whatever its own TD_PROGRESS_THREAD says.
  // The real hosts, whatever TD_TEST_RANKS_PER_NODE simulates.
  const int on_this_host = ranks_on_this_host(MPI_COMM_WORLD);
  if (config().progress_thread) return;  // the setting decides (async_progress_enabled reads it)
  if (progress_thread_on(world_size, on_this_host, mpi_library_version(), std::nullopt)) return;
  if (!progress_thread_default(false)) return;  // td::set_async_progress() said before init
  log_info_once(world_rank, [] {
    return std::string(
        "progress thread: off, since the job spans several hosts under Open MPI 4 (its TCP "
        "transport stalls collectives driven from two threads; docs/cluster.md): async "
        "operations advance inside the library's calls, wait() and is_completed(); "
        "TD_PROGRESS_THREAD=1 turns it on");
  });
}

struct Runtime {
  bool initialized = false;
  bool we_initialized_mpi = false;
  std::chrono::milliseconds timeout{std::chrono::minutes(30)};
  std::shared_ptr<GroupState> world;
  std::vector<std::weak_ptr<GroupState>> groups;  // every group we made, to release at destroy
};
Runtime& runtime() {
  static Runtime r;
  return r;
}

std::shared_ptr<GroupState> make_group(MPI_Comm parent, MPI_Group members,
                                       std::vector<int> world_ranks, const GroupState* from,
                                       std::string_view what) {
  auto g = std::make_shared<GroupState>();
  g->world_ranks = std::move(world_ranks);
  g->size = static_cast<int>(g->world_ranks.size());
  register_group(g, from, what);
  MPI_Comm comm = MPI_COMM_NULL;
  if (members == MPI_GROUP_NULL) {
    TD_MPI_CHECK(MPI_Comm_dup(parent, &comm));
  } else {
    TD_MPI_CHECK(MPI_Comm_create(parent, members, &comm));
  }
  if (comm != MPI_COMM_NULL) {
    TD_MPI_CHECK(MPI_Comm_set_errhandler(comm, MPI_ERRORS_RETURN));
    TD_MPI_CHECK(MPI_Comm_rank(comm, &g->rank));
    // MPI_TAG_UB is an attribute of MPI_COMM_WORLD (valid for every communicator); a
    // communicator made by MPI_Comm_create does not carry it.
    int* tag_ub = nullptr;
    int flag = 0;
    TD_MPI_CHECK(MPI_Comm_get_attr(MPI_COMM_WORLD, MPI_TAG_UB, static_cast<void*>(&tag_ub), &flag));
    g->tags.emplace(flag && tag_ub ? *tag_ub : 32767);
    g->comm = comm;
    split_by_node(*g);
    if (from && members == MPI_GROUP_NULL) {  // duplicate_group (the Reducer's): the same path
      g->nodes.auto_node_aware.store(from->nodes.auto_node_aware.load());
      g->nodes.path_chosen.store(from->nodes.path_chosen.load());
    }
  }
  g->comm = comm;
  auto& groups = runtime().groups;
  // Groups released since (a Reducer per training run, a subgroup per phase) leave expired
  // entries; dropping them keeps the list as long as the live groups.
  std::erase_if(groups, [](const std::weak_ptr<GroupState>& w) { return w.expired(); });
  groups.push_back(g);
  return g;
}

// An exception escaping main on one rank would leave the others blocked in their next
// collective until the batch system kills the job; abort the whole job instead.
[[noreturn]] void terminate_with_abort() {
  std::string what = "std::terminate called without an active exception";
  if (auto e = std::current_exception()) {
    try {
      std::rethrow_exception(e);
    } catch (const std::exception& ex) {
      what = fmt::format("uncaught exception: {}", ex.what());
    } catch (...) {
      what = "uncaught exception of a non-standard type";
    }
  }
  td::abort(what, 1);
}

void init_impl(int* argc, char*** argv, const InitOptions& options) {
  Runtime& rt = runtime();
  if (rt.initialized) return;
  const MallocTuning& malloc_tuning = apply_malloc_tuning();  // before MPI allocates anything
  int initialized = 0;
  MPI_Initialized(&initialized);
  std::string mpi_tuning;
  if (!initialized) {
    mpi_tuning = tune_libnbc_before_init();
    int provided = 0;
    // MULTIPLE: the progress thread tests requests while the caller may be in MPI too.
    const int rc = MPI_Init_thread(argc, argv, MPI_THREAD_MULTIPLE, &provided);
    if (rc != MPI_SUCCESS) throw_mpi_error("MPI_Init_thread", rc);
    rt.we_initialized_mpi = true;
  }
  rt.timeout = config().timeout.value_or(options.timeout);
  if (options.abort_on_uncaught_exception) std::set_terminate(&terminate_with_abort);
  create_mpi_types();
  int size = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  std::vector<int> all(static_cast<std::size_t>(size));
  for (int i = 0; i < size; ++i) all[static_cast<std::size_t>(i)] = i;
  rt.world = make_group(MPI_COMM_WORLD, MPI_GROUP_NULL, std::move(all), nullptr, {});
  choose_progress_thread(rt.world->rank, size);
  diagnosis_start();
  rt.initialized = true;
  // Once per job (rank 0): every rank of a job launched alike made the same choice.
  log_info_once(rt.world->rank, [&] {
    return malloc_tuning.mmap_threshold
               ? fmt::format("malloc: mmap threshold {} MiB, trim threshold {} MiB",
                             malloc_tuning.mmap_threshold >> 20, malloc_tuning.trim_threshold >> 20)
               : fmt::format("malloc: left alone ({})", malloc_tuning.reason);
  });
  if (!mpi_tuning.empty())
    log_info_once(rt.world->rank, [&] { return fmt::format("Open MPI: {}", mpi_tuning); });
  // Whether tensor storages get huge pages (a silent fallback otherwise: said here).
  log_info_once(rt.world->rank, [] {
    return fmt::format("tensor storage pool: {}", storage_pool().status().reason);
  });
}
}  // namespace

std::shared_ptr<GroupState> duplicate_group(const GroupState& g, std::string_view what) {
  return make_group(g.checked_comm(what), MPI_GROUP_NULL, g.world_ranks, &g, what);
}

std::shared_ptr<GroupState> group_of(const CollectiveOptions& opts) {
  if (opts.group) return GroupAccess::state(*opts.group);
  if (!runtime().initialized)
    throw Error("td: call td::init_process_group() before any collective");
  return runtime().world;
}

std::chrono::milliseconds timeout_of(const CollectiveOptions& opts) {
  return opts.timeout.value_or(runtime().timeout);
}

}  // namespace detail

using detail::runtime;

bool runs_node_aware(const ProcessGroup& group) {
  const auto& g = detail::GroupAccess::state(group);
  return g->comm != MPI_COMM_NULL && !g->destroyed && detail::node_aware(*g);
}

ProcessGroup::ProcessGroup(std::shared_ptr<detail::GroupState> state) : state_(std::move(state)) {}
int ProcessGroup::rank() const { return state_->rank; }
int ProcessGroup::size() const { return state_->size; }
MPI_Comm ProcessGroup::comm() const { return state_->destroyed ? MPI_COMM_NULL : state_->comm; }
bool ProcessGroup::is_member() const { return state_->comm != MPI_COMM_NULL; }
const std::vector<int>& ProcessGroup::world_ranks() const { return state_->world_ranks; }

void init_process_group(const InitOptions& options) {
  detail::init_impl(nullptr, nullptr, options);
}
void init_process_group(int& argc, char**& argv, const InitOptions& options) {
  detail::init_impl(&argc, &argv, options);
}

bool is_initialized() { return runtime().initialized; }

void destroy_process_group() {
  auto& rt = runtime();
  if (!rt.initialized) return;
  // Pending operations first, while the progress thread still drives them: each completes
  // (every rank that destroys its group with the same operations pending lets them finish) or
  // fails at its own deadline; their Works' destructors then return at once, and nothing calls
  // MPI after MPI_Finalize.
  detail::progress_settle_all(
      "destroy_process_group() ran while this operation was pending and it did not complete");
  detail::progress_stop();
  detail::diagnosis_stop();
  // The flight recorder's own cost, by its own timer (docs/reliability.md).
  detail::log_info([] {
    const detail::RecorderCost c = detail::recorder_cost();
    return fmt::format("flight recorder: {} calls recorded, {:.0f} ns per call in the recorder",
                       c.calls,
                       c.calls ? static_cast<double>(c.ns) / static_cast<double>(c.calls) : 0.0);
  });
  int finalized = 0;
  MPI_Finalized(&finalized);
  for (auto& weak : rt.groups) {
    if (auto g = weak.lock()) {
      if (g->comm != MPI_COMM_NULL && !finalized) MPI_Comm_free(&g->comm);
      g->comm = MPI_COMM_NULL;
      g->destroyed = true;
      std::lock_guard lock(g->mu);
      g->plans.clear();
      g->scratch.reset();
    }
  }
  rt.groups.clear();
  rt.world.reset();
  if (!finalized) detail::free_mpi_types();
  const bool finalize = rt.we_initialized_mpi && !finalized;
  rt.we_initialized_mpi = false;
  rt.initialized = false;
  if (!finalize) return;
  // Open MPI tells mpiexec about the finalize last, so a failed MPI_Finalize may not have: the
  // process would then exit with status 0 and mpiexec report only that it "exited improperly"
  // (issue 32). MPI_Error_string may no longer be called: the code only.
  const int rc = MPI_Finalize();
  if (rc != MPI_SUCCESS) throw MpiError(fmt::format("MPI_Finalize failed (error code {})", rc));
}

ProcessGroup world() {
  if (!runtime().initialized) throw Error("td::world(): call td::init_process_group() first");
  return detail::GroupAccess::wrap(runtime().world);
}

ProcessGroup new_group(const std::vector<int>& world_ranks) {
  if (!runtime().initialized) throw Error("td::new_group(): call td::init_process_group() first");
  const int size = get_world_size();
  std::vector<int> sorted = world_ranks;
  std::sort(sorted.begin(), sorted.end());
  if (world_ranks.empty())
    throw std::invalid_argument("new_group: the group needs at least one rank");
  if (std::adjacent_find(sorted.begin(), sorted.end()) != sorted.end())
    throw std::invalid_argument(
        fmt::format("new_group: rank listed twice in [{}]", fmt::join(world_ranks, ", ")));
  for (int r : world_ranks)
    if (r < 0 || r >= size)
      throw std::invalid_argument(
          fmt::format("new_group: rank {} is out of range for a world of {} ranks", r, size));
  MPI_Group world_group = MPI_GROUP_NULL, members = MPI_GROUP_NULL;
  TD_MPI_CHECK(MPI_Comm_group(runtime().world->comm, &world_group));
  TD_MPI_CHECK(MPI_Group_incl(world_group, static_cast<int>(world_ranks.size()), world_ranks.data(),
                              &members));
  std::shared_ptr<detail::GroupState> g;
  try {
    g = detail::make_group(runtime().world->comm, members, world_ranks, runtime().world.get(), {});
  } catch (...) {
    MPI_Group_free(&members);
    MPI_Group_free(&world_group);
    throw;
  }
  MPI_Group_free(&members);
  MPI_Group_free(&world_group);
  return detail::GroupAccess::wrap(std::move(g));
}

int get_rank() { return world().rank(); }
int get_world_size() { return world().size(); }
std::chrono::milliseconds default_timeout() { return runtime().timeout; }

void abort(const std::string& message, int exit_code) {
  int rank = -1, initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (initialized && !finalized) MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  std::fprintf(stderr, "[td rank %d] aborting the job: %s\n", rank, message.c_str());
  std::fflush(stderr);
  detail::dump_to_dir(fmt::format("td::abort: {}", message));
  if (initialized && !finalized) MPI_Abort(MPI_COMM_WORLD, exit_code);
  std::_Exit(exit_code);
}

}  // namespace td
