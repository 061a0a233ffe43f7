#include "tensordict/process_group.hpp"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <memory>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "core/config.hpp"
#include "core/storage_pool.hpp"
#include "runtime/log.hpp"
#include "runtime/runtime.hpp"
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
  if (comm != MPI_COMM_NULL && !mpi_finalized()) MPI_Comm_free(&comm);
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
                                       std::vector<int> world_ranks) {
  auto g = std::make_shared<GroupState>();
  g->world_ranks = std::move(world_ranks);
  g->size = static_cast<int>(g->world_ranks.size());
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
    mpi_tuning = tune_open_mpi_before_init();
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
  rt.world = make_group(MPI_COMM_WORLD, MPI_GROUP_NULL, std::move(all));
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
  return make_group(g.checked_comm(what), MPI_GROUP_NULL, g.world_ranks);
}

std::shared_ptr<GroupState> group_of(const CollectiveOptions& opts) {
  if (opts.group) return opts.group->state();
  if (!runtime().initialized)
    throw Error("td: call td::init_process_group() before any collective");
  return runtime().world;
}

std::chrono::milliseconds timeout_of(const CollectiveOptions& opts) {
  return opts.timeout.value_or(runtime().timeout);
}

}  // namespace detail

using detail::runtime;

ProcessGroup::ProcessGroup(std::shared_ptr<detail::GroupState> state) : state_(std::move(state)) {}
int ProcessGroup::rank() const { return state_->rank; }
int ProcessGroup::size() const { return state_->size; }
MPI_Comm ProcessGroup::comm() const { return state_->destroyed ? MPI_COMM_NULL : state_->comm; }
bool ProcessGroup::is_member() const { return state_->comm != MPI_COMM_NULL; }
const std::vector<int>& ProcessGroup::world_ranks() const { return state_->world_ranks; }
const std::shared_ptr<detail::GroupState>& ProcessGroup::state() const { return state_; }

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
  return ProcessGroup(runtime().world);
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
    g = detail::make_group(runtime().world->comm, members, world_ranks);
  } catch (...) {
    MPI_Group_free(&members);
    MPI_Group_free(&world_group);
    throw;
  }
  MPI_Group_free(&members);
  MPI_Group_free(&world_group);
  return ProcessGroup(std::move(g));
}

int get_rank() { return world().rank(); }
int get_world_size() { return world().size(); }
std::chrono::milliseconds default_timeout() { return runtime().timeout; }

void barrier(const std::optional<ProcessGroup>& group) {
  CollectiveOptions opts;
  opts.group = group;
  auto g = detail::group_of(opts);
  MPI_Comm comm = g->checked_comm("barrier");
  MPI_Request req = MPI_REQUEST_NULL;
  TD_MPI_CHECK(MPI_Ibarrier(comm, &req));
  const auto timeout = detail::timeout_of(opts);
  detail::wait_until(req, detail::deadline_after(timeout), [&] {
    return fmt::format("barrier of a group of {} ranks did not complete within {} ms", g->size,
                       timeout.count());
  });
}

void abort(const std::string& message, int exit_code) {
  int rank = -1, initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (initialized && !finalized) MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  std::fprintf(stderr, "[td rank %d] aborting the job: %s\n", rank, message.c_str());
  std::fflush(stderr);
  if (initialized && !finalized) MPI_Abort(MPI_COMM_WORLD, exit_code);
  std::_Exit(exit_code);
}

}  // namespace td
