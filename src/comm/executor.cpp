#include "comm/executor.hpp"

#include <cstring>
#include <utility>

#include "comm/engine_internal.hpp"
#include "runtime/mpi_error.hpp"
#include "runtime/nbc_tuning.hpp"
#include "runtime/work_state.hpp"

namespace td::detail {

void post(const DataCall& c, MPI_Request* req) {
  using Op = DataCall::Op;
  if (!c.control) note_data_started();  // the flight recorder: the call's data starts moving
  // Each routine in its nonblocking form when a request is given, else its blocking form.
  switch (c.op) {
    case Op::Send:
      TD_MPI_CHECK(req ? MPI_Isend(c.send, c.count, c.type, c.root, c.tag, c.comm, req)
                       : MPI_Send(c.send, c.count, c.type, c.root, c.tag, c.comm));
      return;
    case Op::Recv:
      TD_MPI_CHECK(
          req ? MPI_Irecv(c.recv, c.count, c.type, c.root, c.tag, c.comm, req)
              : MPI_Recv(c.recv, c.count, c.type, c.root, c.tag, c.comm, MPI_STATUS_IGNORE));
      return;
    case Op::Bcast:
      TD_MPI_CHECK(req ? MPI_Ibcast(c.recv, c.count, c.type, c.root, c.comm, req)
                       : MPI_Bcast(c.recv, c.count, c.type, c.root, c.comm));
      return;
    case Op::Allreduce:
      TD_MPI_CHECK(req ? MPI_Iallreduce(c.send, c.recv, c.count, c.type, c.reduce_op, c.comm, req)
                       : MPI_Allreduce(c.send, c.recv, c.count, c.type, c.reduce_op, c.comm));
      return;
    case Op::Reduce:
      TD_MPI_CHECK(
          req ? MPI_Ireduce(c.send, c.recv, c.count, c.type, c.reduce_op, c.root, c.comm, req)
              : MPI_Reduce(c.send, c.recv, c.count, c.type, c.reduce_op, c.root, c.comm));
      return;
    case Op::Allgather:
      TD_MPI_CHECK(
          req ? MPI_Iallgather(c.send, c.count, c.type, c.recv, c.recv_count, c.recv_type, c.comm,
                               req)
              : MPI_Allgather(c.send, c.count, c.type, c.recv, c.recv_count, c.recv_type, c.comm));
      return;
    case Op::Gather:
      TD_MPI_CHECK(req ? MPI_Igather(c.send, c.count, c.type, c.recv, c.recv_count, c.recv_type,
                                     c.root, c.comm, req)
                       : MPI_Gather(c.send, c.count, c.type, c.recv, c.recv_count, c.recv_type,
                                    c.root, c.comm));
      return;
    case Op::Allgatherv:
      TD_MPI_CHECK(req ? MPI_Iallgatherv(c.send, c.count, c.type, c.recv, c.counts, c.displs,
                                         c.recv_type, c.comm, req)
                       : MPI_Allgatherv(c.send, c.count, c.type, c.recv, c.counts, c.displs,
                                        c.recv_type, c.comm));
      return;
    case Op::Gatherv:
      TD_MPI_CHECK(req ? MPI_Igatherv(c.send, c.count, c.type, c.recv, c.counts, c.displs,
                                      c.recv_type, c.root, c.comm, req)
                       : MPI_Gatherv(c.send, c.count, c.type, c.recv, c.counts, c.displs,
                                     c.recv_type, c.root, c.comm));
      return;
    case Op::Scatter:
      TD_MPI_CHECK(req ? MPI_Iscatter(c.send, c.count, c.type, c.recv, c.recv_count, c.recv_type,
                                      c.root, c.comm, req)
                       : MPI_Scatter(c.send, c.count, c.type, c.recv, c.recv_count, c.recv_type,
                                     c.root, c.comm));
      return;
    case Op::Scatterv:
      TD_MPI_CHECK(req ? MPI_Iscatterv(c.send, c.counts, c.displs, c.type, c.recv, c.recv_count,
                                       c.recv_type, c.root, c.comm, req)
                       : MPI_Scatterv(c.send, c.counts, c.displs, c.type, c.recv, c.recv_count,
                                      c.recv_type, c.root, c.comm));
      return;
    case Op::ReduceScatterBlock:
      TD_MPI_CHECK(
          req ? MPI_Ireduce_scatter_block(c.send, c.recv, c.count, c.type, c.reduce_op, c.comm, req)
              : MPI_Reduce_scatter_block(c.send, c.recv, c.count, c.type, c.reduce_op, c.comm));
      return;
    case Op::ReduceScatter:
      TD_MPI_CHECK(
          req ? MPI_Ireduce_scatter(c.send, c.recv, c.counts, c.type, c.reduce_op, c.comm, req)
              : MPI_Reduce_scatter(c.send, c.recv, c.counts, c.type, c.reduce_op, c.comm));
      return;
    case Op::Barrier:
      TD_MPI_CHECK(req ? MPI_Ibarrier(c.comm, req) : MPI_Barrier(c.comm));
      return;
  }
}

namespace {
DataCall base(DataCall::Op op, MPI_Comm comm, MPI_Datatype type) {
  DataCall c;
  c.op = op;
  c.comm = comm;
  c.type = type;
  return c;
}
}  // namespace

DataCall send_call(const void* buf, int count, MPI_Datatype type, int peer, int tag,
                   MPI_Comm comm) {
  DataCall c = base(DataCall::Op::Send, comm, type);
  c.send = buf;
  c.count = count;
  c.root = peer;
  c.tag = tag;
  return c;
}

DataCall recv_call(void* buf, int count, MPI_Datatype type, int peer, int tag, MPI_Comm comm) {
  DataCall c = base(DataCall::Op::Recv, comm, type);
  c.recv = buf;
  c.count = count;
  c.root = peer;
  c.tag = tag;
  return c;
}

DataCall bcast_call(void* buf, int count, MPI_Datatype type, int root, MPI_Comm comm) {
  DataCall c = base(DataCall::Op::Bcast, comm, type);
  c.recv = buf;
  c.count = count;
  c.root = root;
  return c;
}

DataCall allreduce_call(const void* send, void* recv, int count, MPI_Datatype type, MPI_Op op,
                        MPI_Comm comm) {
  DataCall c = base(DataCall::Op::Allreduce, comm, type);
  c.send = send;
  c.recv = recv;
  c.count = count;
  c.reduce_op = op;
  return c;
}

DataCall reduce_call(const void* send, void* recv, int count, MPI_Datatype type, MPI_Op op,
                     int root, MPI_Comm comm) {
  DataCall c = allreduce_call(send, recv, count, type, op, comm);
  c.op = DataCall::Op::Reduce;
  c.root = root;
  return c;
}

DataCall allgather_call(const void* send, int count, MPI_Datatype type, void* recv, int recv_count,
                        MPI_Datatype recv_type, MPI_Comm comm) {
  DataCall c = base(DataCall::Op::Allgather, comm, type);
  c.send = send;
  c.count = count;
  c.recv = recv;
  c.recv_count = recv_count;
  c.recv_type = recv_type;
  return c;
}

DataCall gather_call(const void* send, int count, MPI_Datatype type, void* recv, int recv_count,
                     MPI_Datatype recv_type, int root, MPI_Comm comm) {
  DataCall c = allgather_call(send, count, type, recv, recv_count, recv_type, comm);
  c.op = DataCall::Op::Gather;
  c.root = root;
  return c;
}

DataCall allgatherv_call(const void* send, int count, MPI_Datatype type, void* recv,
                         const int* counts, const int* displs, MPI_Datatype recv_type,
                         MPI_Comm comm) {
  DataCall c = base(DataCall::Op::Allgatherv, comm, type);
  c.send = send;
  c.count = count;
  c.recv = recv;
  c.counts = counts;
  c.displs = displs;
  c.recv_type = recv_type;
  return c;
}

DataCall gatherv_call(const void* send, int count, MPI_Datatype type, void* recv, const int* counts,
                      const int* displs, MPI_Datatype recv_type, int root, MPI_Comm comm) {
  DataCall c = allgatherv_call(send, count, type, recv, counts, displs, recv_type, comm);
  c.op = DataCall::Op::Gatherv;
  c.root = root;
  return c;
}

DataCall gather_to(std::optional<int> root, const void* send, int count, MPI_Datatype type,
                   void* recv, int recv_count, MPI_Datatype recv_type, MPI_Comm comm) {
  if (!root) return allgather_call(send, count, type, recv, recv_count, recv_type, comm);
  return gather_call(send, count, type, recv, recv_count, recv_type, *root, comm);
}

DataCall gatherv_to(std::optional<int> root, const void* send, int count, MPI_Datatype type,
                    void* recv, const int* counts, const int* displs, MPI_Datatype recv_type,
                    MPI_Comm comm) {
  if (!root) return allgatherv_call(send, count, type, recv, counts, displs, recv_type, comm);
  return gatherv_call(send, count, type, recv, counts, displs, recv_type, *root, comm);
}

DataCall scatter_call(const void* send, int count, MPI_Datatype type, void* recv, int recv_count,
                      MPI_Datatype recv_type, int root, MPI_Comm comm) {
  DataCall c = gather_call(send, count, type, recv, recv_count, recv_type, root, comm);
  c.op = DataCall::Op::Scatter;
  return c;
}

DataCall scatterv_call(const void* send, const int* counts, const int* displs, MPI_Datatype type,
                       void* recv, int recv_count, MPI_Datatype recv_type, int root,
                       MPI_Comm comm) {
  DataCall c = base(DataCall::Op::Scatterv, comm, type);
  c.send = send;
  c.counts = counts;
  c.displs = displs;
  c.recv = recv;
  c.recv_count = recv_count;
  c.recv_type = recv_type;
  c.root = root;
  return c;
}

DataCall reduce_scatter_block_call(const void* send, void* recv, int count, MPI_Datatype type,
                                   MPI_Op op, MPI_Comm comm) {
  DataCall c = allreduce_call(send, recv, count, type, op, comm);
  c.op = DataCall::Op::ReduceScatterBlock;
  return c;
}

DataCall reduce_scatter_call(const void* send, void* recv, const int* counts, MPI_Datatype type,
                             MPI_Op op, MPI_Comm comm) {
  DataCall c = base(DataCall::Op::ReduceScatter, comm, type);
  c.send = send;
  c.recv = recv;
  c.counts = counts;
  c.reduce_op = op;
  return c;
}

void post_into(WorkState& w, const DataCall& call, const char* phase) {
  w.requests.push_back(MPI_REQUEST_NULL);
  post(call, &w.requests.back());
  if (call.op == DataCall::Op::Recv)
    w.receive_checks.push_back({w.requests.size() - 1, call.type, call.count, call.root, phase});
}

std::shared_ptr<GatheredAllreduce> post_gathered_into(WorkState& w, const DataCall& call,
                                                      const char* phase) {
  auto gathered = GatheredAllreduce::for_call(call);
  if (!gathered) return nullptr;
  post_into(w, gathered->gather(), phase);
  w.held.push_back(gathered);
  return gathered;
}

std::shared_ptr<GatheredAllreduce> GatheredAllreduce::for_call(const DataCall& call) {
  if (call.op != DataCall::Op::Allreduce || call.send != MPI_IN_PLACE || !libnbc_runs_ring())
    return nullptr;
  int ranks = 0;
  TD_MPI_CHECK(MPI_Comm_size(call.comm, &ranks));
  if (ranks < 3 || ranks > kMaxRanks) return nullptr;
  int item = 0;
  TD_MPI_CHECK(MPI_Type_size(call.type, &item));
  const std::size_t bytes = static_cast<std::size_t>(call.count) * static_cast<std::size_t>(item);
  if (bytes >= kMaxBytes) return nullptr;
  note_gathered_allreduce();
  return std::make_shared<GatheredAllreduce>(call, ranks, bytes);
}

GatheredAllreduce::GatheredAllreduce(const DataCall& call, int ranks, std::size_t bytes)
    : call_(call),
      ranks_(ranks),
      bytes_(bytes),
      all_(std::make_unique<std::byte[]>(bytes * static_cast<std::size_t>(ranks))) {}

DataCall GatheredAllreduce::gather() const {
  DataCall c = allgather_call(call_.recv, call_.count, call_.type, all_.get(), call_.count,
                              call_.type, call_.comm);
  c.control = call_.control;
  return c;
}

void GatheredAllreduce::reduce() const {
  auto* out = static_cast<std::byte*>(call_.recv);
  if (bytes_ > 0) std::memcpy(out, all_.get(), bytes_);
  // In rank order on every rank: each rank computes the same sequence of operations.
  for (int r = 1; r < ranks_; ++r)
    TD_MPI_CHECK(MPI_Reduce_local(all_.get() + static_cast<std::size_t>(r) * bytes_, out,
                                  call_.count, call_.type, call_.reduce_op));
}

void post_and_wait(const DataCall& call, std::chrono::steady_clock::time_point deadline,
                   const std::function<std::string()>& describe, std::shared_ptr<void> hold) {
  MPI_Request req = MPI_REQUEST_NULL;
  if (auto gathered = GatheredAllreduce::for_call(call)) {
    post(gathered->gather(), &req);
    // Both leaked if the wait gives up: MPI may still write into the gather's buffer.
    wait_until(req, deadline, describe,
               std::make_shared<std::pair<std::shared_ptr<void>, std::shared_ptr<void>>>(
                   std::move(hold), gathered));
    gathered->reduce();
    return;
  }
  post(call, &req);
  wait_until(req, deadline, describe, std::move(hold));
}

void wait_blocking(std::span<MPI_Request> requests) {
  TD_MPI_CHECK(
      MPI_Waitall(static_cast<int>(requests.size()), requests.data(), MPI_STATUSES_IGNORE));
}

Step::Step(std::chrono::steady_clock::time_point deadline, std::function<std::string()> describe,
           std::shared_ptr<void> hold, std::string_view what)
    : deadline_(deadline), describe_(std::move(describe)), hold_(std::move(hold)), what_(what) {}

Step::~Step() {
  if (requests_.empty()) return;
  leak(std::move(hold_));
  for (auto& g : gathered_) leak(std::move(g));
}

void Step::post(const DataCall& call, std::string phase) {
  requests_.push_back(MPI_REQUEST_NULL);
  if (auto gathered = GatheredAllreduce::for_call(call)) {
    detail::post(gathered->gather(), &requests_.back());
    gathered_.push_back(std::move(gathered));
    return;
  }
  detail::post(call, &requests_.back());
  if (call.op == DataCall::Op::Recv)
    checks_.push_back({requests_.size() - 1, call, std::move(phase)});
}

void Step::wait() {
  // Every request is waited for before any count is judged: none may stay pending.
  std::vector<MPI_Status> statuses(requests_.size());
  for (std::size_t i = 0; i < requests_.size(); ++i)
    wait_until(requests_[i], deadline_, describe_, hold_, &statuses[i]);
  requests_.clear();
  const auto gathered = std::move(gathered_);
  gathered_.clear();
  for (const auto& g : gathered) g->reduce();
  const auto checks = std::move(checks_);
  checks_.clear();
  for (const Check& c : checks)
    check_received(statuses[c.request], c.call.type, c.call.count, c.call.root, what_, c.phase);
}

DataCall barrier_call(MPI_Comm comm) {
  return base(DataCall::Op::Barrier, comm, MPI_DATATYPE_NULL);
}

}  // namespace td::detail
