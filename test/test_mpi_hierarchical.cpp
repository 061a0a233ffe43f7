// Node-aware all_reduce / reduce / broadcast (TD_HIERARCHICAL; on one machine,
// TD_TEST_RANKS_PER_NODE simulates the nodes: CMakeLists.txt runs this file at 3+1, 2+2, 2+1 and
// one node): every op and dtype, sync and async, compressed, the Reducer's buckets, every root,
// subgroups. Integer results are exact (so equal to the flat path's), and every rank holds the
// same bits. Each case also checks that the strategy ran where it should (packer_stats).
#include <catch2/catch.hpp>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include <mpi.h>

#include <tensordict/diagnostics.hpp>
#include <tensordict/tensordict.hpp>

#include "support/reference.hpp"
#include "support/same_bits.hpp"

using td::Compression;
using td::DType;
using td::ReduceOp;
using td::Tensor;
using td::TensorDict;
using namespace tdtest;

namespace {

std::optional<std::string> env(const char* name) {
  const char* v = std::getenv(name);
  if (!v || !*v) return std::nullopt;
  return std::string(v);
}

// The node of every world rank by its processor name (the cluster's hosts have names of their
// own: make test-cluster runs this file across them).
std::vector<std::string> real_nodes() {
  char name[MPI_MAX_PROCESSOR_NAME] = {};
  int len = 0;
  MPI_Get_processor_name(name, &len);
  std::vector<char> all(static_cast<std::size_t>(td::get_world_size()) * MPI_MAX_PROCESSOR_NAME);
  MPI_Allgather(name, MPI_MAX_PROCESSOR_NAME, MPI_CHAR, all.data(), MPI_MAX_PROCESSOR_NAME,
                MPI_CHAR, MPI_COMM_WORLD);
  std::vector<std::string> out;
  for (int r = 0; r < td::get_world_size(); ++r)
    out.emplace_back(&all[static_cast<std::size_t>(r) * MPI_MAX_PROCESSOR_NAME]);
  return out;
}

// How many of these world ranks each node holds (collective over world): TD_TEST_RANKS_PER_NODE's
// simulated nodes (the last size repeating), or the real ones.
std::vector<int> ranks_per_node(const std::vector<int>& world_ranks) {
  const std::vector<std::string> hosts = real_nodes();
  const auto spec = env("TD_TEST_RANKS_PER_NODE");
  std::map<std::string, int> per_node;
  if (!spec) {
    for (const int w : world_ranks) ++per_node[hosts[static_cast<std::size_t>(w)]];
  } else {
    std::vector<int> sizes;
    for (std::size_t start = 0;;) {
      const std::size_t comma = spec->find(',', start);
      sizes.push_back(std::stoi(spec->substr(start, comma - start)));
      if (comma == std::string::npos) break;
      start = comma + 1;
    }
    for (const int w : world_ranks) {
      int node = 0, first = 0;
      for (;; ++node) {
        const int n = sizes[std::min(static_cast<std::size_t>(node), sizes.size() - 1)];
        if (w < first + n) break;
        first += n;
      }
      ++per_node[std::to_string(node)];
    }
  }
  std::vector<int> out;
  for (const auto& [node, n] : per_node) out.push_back(n);
  return out;
}

// Whether the library must run node-aware on `group`, whose ranks sit `per_node` per node
// (ranks_per_node): TD_HIERARCHICAL=1 or leaders yes, 0 no; auto (the default) what the group's
// first all_reduce / reduce / broadcast measured (td::runs_node_aware), which must be flat unless
// the group spans several nodes with more than one rank on some node. Call it after that call.
bool expect_node_aware(const std::vector<int>& per_node, const td::ProcessGroup& group) {
  const auto h = env("TD_HIERARCHICAL");
  if (h && *h != "auto") return *h == "1" || *h == "leaders";
  const bool eligible =
      per_node.size() > 1 && *std::max_element(per_node.begin(), per_node.end()) > 1;
  const bool chosen = td::runs_node_aware(group);
  if (!eligible) CHECK_FALSE(chosen);
  return eligible && chosen;
}

std::vector<int> every_rank() {
  std::vector<int> all;
  for (int r = 0; r < td::get_world_size(); ++r) all.push_back(r);
  return all;
}

// expect_node_aware on the world group (collective over world).
bool world_node_aware() { return expect_node_aware(ranks_per_node(every_rank()), td::world()); }

// Whether a node-aware sync all_reduce of a large message runs per slice on the world group:
// every node holds the same number of ranks, more than one, on several nodes, and TD_HIERARCHICAL
// is not leaders. Collective over world.
bool expect_per_slice() {
  const std::vector<int> per_node = ranks_per_node(every_rank());
  const bool node_aware = expect_node_aware(per_node, td::world());
  const auto h = env("TD_HIERARCHICAL");
  return node_aware && !(h && *h == "leaders") && per_node.size() > 1 && per_node[0] > 1 &&
         std::all_of(per_node.begin(), per_node.end(), [&](int n) { return n == per_node[0]; });
}

// How far a compressed result may lie from the oracle's reduction (relative, at least 1
// absolute): this file's own bound for 16-bit wire formats, whose rounding the oracle's tolerance
// (for uncompressed results) does not cover.
constexpr double kCompressedTolerance = 0.02;

// Waits for an async call's Works (a sync call returns none).
void wait_for(std::vector<td::Work> works) { td::wait_all(works); }

// The leaves of a test dict of dtype T: a vector, a matrix (a bucket of several leaves) and one
// element; leaf k holds tdtest's leaf pattern k.
template <class T>
TensorDict make_dict(ReduceOp op, int rank) {
  TensorDict d;
  d.set("a", make_input<T>(op, rank, {13}, 0));
  d.set({"b", "m"}, make_input<T>(op, rank, {4, 5}, 1));
  d.set({"b", "s"}, make_input<T>(op, rank, {1}, 2));
  return d;
}

const char* kKeys[] = {"a", "b.m", "b.s"};
td::Key key_of(int k) {
  if (k == 0) return "a";
  return {"b", k == 1 ? "m" : "s"};
}

// Checks the strategy ran (or not) since the last reset.
void check_strategy(bool node_aware) {
  const auto messages = td::packer_stats().node_aware_messages;
  if (node_aware) {
    CHECK(messages > 0);
  } else {
    CHECK(messages == 0);
  }
  td::reset_packer_stats();
}

}  // namespace

TEST_CASE("node-aware all_reduce: every op on every dtype, sync and async, one bit pattern",
          "[hierarchical]") {
  const int rank = td::get_rank(), size = td::get_world_size();
  td::reset_packer_stats();
  for (std::size_t dt = 0; dt < td::kNumDTypes; ++dt) {
    const auto dtype = static_cast<DType>(dt);
    td::visit(dtype, [&](auto tag) {
      using T = typename decltype(tag)::type;
      for (const ReduceOp op :
           {ReduceOp::SUM, ReduceOp::PRODUCT, ReduceOp::MIN, ReduceOp::MAX, ReduceOp::AVG}) {
        if (!td::supports(op, dtype)) continue;
        for (const bool async : {false, true}) {
          for (const std::optional<std::size_t> cap :
               {std::optional<std::size_t>{}, std::optional<std::size_t>{64},
                std::optional<std::size_t>{td::kAutoBucketBytes}}) {
            INFO(td::name(dtype) << " " << td::name(op) << (async ? " async" : " sync") << " cap "
                                 << (cap ? std::to_string(*cap) : "none"));
            TensorDict d = make_dict<T>(op, rank);
            auto works = d.all_reduce(op, {.async_op = async, .bucket_bytes = cap});
            td::wait_all(works);
            for (int k = 0; k < 3; ++k) {
              INFO(kKeys[k]);
              CHECK(reduction_error(d.get(key_of(k)), op, size, k).empty());
              CHECK(same_bits_everywhere(d.get(key_of(k)), MPI_COMM_WORLD));
            }
          }
          // One tensor, large enough for several messages at a small cap.
          Tensor t = make_input<T>(op, rank, {3000});
          td::Work w = td::all_reduce(t, op, {.async_op = async});
          w.wait();
          CHECK(reduction_error(t, op, size).empty());
          CHECK(same_bits_everywhere(t, MPI_COMM_WORLD));
        }
      }
    });
  }
  check_strategy(world_node_aware());
}

TEST_CASE("node-aware all_reduce of a large tensor: several messages pipelined, exact",
          "[hierarchical]") {
  const int rank = td::get_rank(), size = td::get_world_size();
  td::reset_packer_stats();
  // 24 MiB of int32: six 4 MiB messages; float32 of small integers is exact too.
  for (const bool async : {false, true}) {
    td::reset_packer_stats();
    Tensor i = make_input<std::int32_t>(ReduceOp::SUM, rank, {6 << 20});
    Tensor f = make_input<float>(ReduceOp::SUM, rank, {6 << 20});
    auto wi = td::all_reduce(i, ReduceOp::SUM, {.async_op = async});
    auto wf = td::all_reduce(f, ReduceOp::SUM, {.async_op = async});
    wi.wait();
    wf.wait();
    CHECK(reduction_error(i, ReduceOp::SUM, size).empty());
    CHECK(reduction_error(f, ReduceOp::SUM, size).empty());
    CHECK(same_bits_everywhere(f, MPI_COMM_WORLD));
    // Sync on nodes of equal size: per slice (a reduce-scatter, the slices across nodes, an
    // allgather), message by message; async: the leaders' stages.
    const bool slices = !async && expect_per_slice();
    CHECK((td::packer_stats().node_aware_messages > 0) == world_node_aware());
    CHECK((td::packer_stats().node_aware_slice_messages > 0) == slices);
    if (slices) CHECK(td::packer_stats().node_aware_slice_messages == 12);
    // Sync messages of 4 MiB on 3, 5, 6 or 7 ranks that sit on several nodes cross as a
    // reduce-scatter and an allgather: flat on such a group; per slice between such a number of
    // nodes (slices of 512 KiB or more: up to 8 ranks per node); through the nodes' first ranks
    // likewise (counted by those ranks only: rank 0 is one). Everything else as one allreduce.
    const std::vector<int> per_node = ranks_per_node(every_rank());
    const std::size_t nodes = per_node.size();
    auto splits = [](std::size_t k) { return k >= 3 && k <= 7 && (k & (k - 1)) != 0; };
    const bool node_aware = world_node_aware();
    const std::uint64_t split = td::packer_stats().split_allreduce_messages;
    INFO(nodes << " nodes, node-aware " << node_aware << ", per slice " << slices);
    if (async)
      CHECK(split == 0);
    else if (slices)
      CHECK(split == (splits(nodes) && per_node[0] <= 8 ? 12u : 0u));
    else if (node_aware && !splits(nodes))
      CHECK(split == 0);
    else if (node_aware)
      CHECK((rank == 0 ? split == 12 : (split == 0 || split == 12)));
    else
      CHECK(split == (nodes > 1 && splits(static_cast<std::size_t>(size)) ? 12u : 0u));
    td::reset_packer_stats();
    if (async) break;
    // A float sum whose order matters (values of every magnitude): the same bits on every rank.
    Tensor g = Tensor::zeros({(1 << 20) + 3}, DType::Float32);
    for (std::int64_t k = 0; k < g.numel(); ++k)
      g.data<float>()[k] = static_cast<float>((k * 7919 + rank * 104729) % 1000003) * 1e-3f *
                           static_cast<float>(1 << (k % 20));
    td::all_reduce(g, ReduceOp::SUM);
    CHECK(same_bits_everywhere(g, MPI_COMM_WORLD));
    CHECK(td::packer_stats().node_aware_messages == (world_node_aware() ? 2u : 0u));
    td::reset_packer_stats();
  }
}

// A sync call runs its stages as blocking collectives, an async one as nonblocking ones posted in
// waves; MPI wants every rank to issue a communicator's collectives in one order, so a sync call
// made while an earlier async call's later stages are still to be posted waits for them first.
// (Open MPI 4.1 keeps blocking and nonblocking collectives apart, so this test passes without
// that wait too: it checks that mixing them gives exact results, not the order itself.)
TEST_CASE("node-aware sync calls while async ones are in flight: every result exact",
          "[hierarchical]") {
  const int rank = td::get_rank(), size = td::get_world_size();
  td::reset_packer_stats();
  // Sync only: the blocking stages ran (counted per message).
  Tensor s = make_input<std::int32_t>(ReduceOp::SUM, rank, {3 << 20});
  td::all_reduce(s, ReduceOp::SUM).wait();
  CHECK(reduction_error(s, ReduceOp::SUM, size).empty());
  check_strategy(world_node_aware());
  for (int round = 0; round < 3; ++round) {
    INFO("round " << round);
    // 12 MiB: three 4 MiB messages, whose later stages wait for the earlier ones.
    Tensor a = make_input<std::int32_t>(ReduceOp::SUM, rank, {3 << 20});
    Tensor b = make_input<std::int32_t>(ReduceOp::MAX, rank, {1 << 20});
    Tensor c = make_input<float>(ReduceOp::SUM, rank, {(1 << 20) + 7});
    TensorDict d = make_dict<std::int64_t>(ReduceOp::SUM, rank);
    td::Work wa = td::all_reduce(a, ReduceOp::SUM, {.async_op = true});
    td::all_reduce(b, ReduceOp::MAX).wait();  // sync, right behind the async one
    d.all_reduce(ReduceOp::SUM, {.bucket_bytes = 64});
    const int root = round % size;
    Tensor bc = make_input<float>(ReduceOp::SUM, root, {1 << 19});
    if (rank != root) bc.zero_();
    td::Work wc = td::all_reduce(c, ReduceOp::SUM, {.async_op = true});
    td::broadcast(bc, root).wait();
    wa.wait();
    wc.wait();
    CHECK(reduction_error(a, ReduceOp::SUM, size).empty());
    CHECK(reduction_error(b, ReduceOp::MAX, size).empty());
    CHECK(reduction_error(c, ReduceOp::SUM, size).empty());
    for (int k = 0; k < 3; ++k)
      CHECK(reduction_error(d.get(key_of(k)), ReduceOp::SUM, size, k).empty());
    CHECK(bc.equal(make_input<float>(ReduceOp::SUM, root, {1 << 19})));
    CHECK(same_bits_everywhere(c, MPI_COMM_WORLD));
  }
}

// Where libnbc runs its ring (a job of 3-15 ranks across nodes; the .ring runs set it), the
// stage between the nodes' first ranks of an async node-aware all_reduce goes, when small, as an
// allgather and a reduction in rank order (GatheredAllreduce), as flat small async calls do: once
// per message on each first rank, when there are 3 to 16 nodes. Counted by the difference between
// a small call and a large one (64 KiB: the ring), which run the same control rounds.
TEST_CASE("node-aware async: the small stage between the nodes is gathered under the ring",
          "[hierarchical][ring]") {
  const int rank = td::get_rank(), size = td::get_world_size();
  const auto alg = env("OMPI_MCA_coll_libnbc_iallreduce_algorithm");
  const std::vector<int> per_node = ranks_per_node(every_rank());
  auto run = [&](std::int64_t n) {
    Tensor i = make_input<std::int32_t>(ReduceOp::SUM, rank, {n});
    Tensor f = Tensor::zeros({n}, DType::Float32);
    for (std::int64_t k = 0; k < n; ++k) f.data<float>()[k] = order_sensitive(rank, k);
    const std::uint64_t before = td::packer_stats().gathered_allreduce_messages;
    td::Work wi = td::all_reduce(i, ReduceOp::SUM, {.async_op = true});
    td::Work wf = td::all_reduce(f, ReduceOp::SUM, {.async_op = true});
    wi.wait();
    wf.wait();
    CHECK(reduction_error(i, ReduceOp::SUM, size).empty());
    CHECK(same_bits_everywhere(f, MPI_COMM_WORLD));
    return td::packer_stats().gathered_allreduce_messages - before;
  };
  const std::uint64_t small = run(64);       // 256 B
  const std::uint64_t large = run(1 << 14);  // 64 KiB
  const bool aware = world_node_aware();
  const auto nodes = static_cast<int>(per_node.size());
  const bool gathered = alg && *alg == "1" && aware && nodes >= 3 && nodes <= 16;
  const auto mine = static_cast<int>(small - large);
  int total = 0;
  MPI_Allreduce(&mine, &total, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
  INFO(nodes << " nodes, node-aware " << aware << ", ring " << (alg && *alg == "1"));
  CHECK((mine == 0 || mine == 2));  // two calls of one message each, on a first rank
  CHECK(total == (gathered ? 2 * nodes : 0));
}

TEST_CASE("node-aware compressed all_reduce (BF16, FP16): one bit pattern, close to the sum",
          "[hierarchical]") {
  const int rank = td::get_rank(), size = td::get_world_size();
  td::reset_packer_stats();
  for (const Compression c : {Compression::BF16, Compression::FP16}) {
    for (const ReduceOp op : {ReduceOp::SUM, ReduceOp::AVG}) {
      for (const bool async : {false, true}) {
        INFO((c == Compression::BF16 ? "bf16" : "fp16") << " " << td::name(op) << " " << async);
        TensorDict d;
        d.set("f", make_input<float>(op, rank, {257}, 0));
        d.set("g", make_input<double>(op, rank, {31}, 1));
        auto works = d.all_reduce(
            op, {.async_op = async, .bucket_bytes = std::size_t{512}, .compression = c});
        td::wait_all(works);
        CHECK(reduction_error(d.get("f"), op, size, 0, kCompressedTolerance) == "");
        CHECK(reduction_error(d.get("g"), op, size, 1, kCompressedTolerance) == "");
        CHECK(same_bits_everywhere(d.get("f"), MPI_COMM_WORLD));
        CHECK(same_bits_everywhere(d.get("g"), MPI_COMM_WORLD));
      }
    }
  }
  check_strategy(world_node_aware());
}

TEST_CASE("node-aware Reducer: buckets reduced across nodes, uncompressed and BF16",
          "[hierarchical]") {
  const int rank = td::get_rank(), size = td::get_world_size();
  td::reset_packer_stats();
  for (const Compression c : {Compression::None, Compression::BF16}) {
    INFO((c == Compression::None ? "uncompressed" : "bf16"));
    TensorDict grads;
    grads.set({"l0", "w"}, Tensor::zeros({16, 8}, DType::Float32));
    grads.set({"l0", "b"}, Tensor::zeros({8}, DType::Float32));
    grads.set({"l1", "w"}, Tensor::zeros({300}, DType::Float32));
    td::ReducerOptions o;
    o.op = ReduceOp::SUM;
    o.bucket_bytes = 512;
    o.compression = c;
    td::Reducer reducer(grads, o);
    for (int step = 0; step < 3; ++step) {
      int k = 0;
      for (const td::Key& key : grads.keys(true, true))
        fill_input(grads.get(key), ReduceOp::SUM, rank, k++);
      for (const td::Key& key : grads.keys(true, true)) reducer.mark_ready(key);
      reducer.finish();
      k = 0;
      for (const td::Key& key : grads.keys(true, true)) {
        INFO(key.str() << " step " << step);
        const std::optional<double> tol =
            c == Compression::None ? std::nullopt : std::optional<double>(kCompressedTolerance);
        CHECK(reduction_error(grads.get(key), ReduceOp::SUM, size, k, tol) == "");
        CHECK(same_bits_everywhere(grads.get(key), MPI_COMM_WORLD));
        ++k;
      }
    }
  }
  check_strategy(world_node_aware());
}

TEST_CASE("node-aware reduce to every root and broadcast from every root", "[hierarchical]") {
  const int rank = td::get_rank(), size = td::get_world_size();
  td::reset_packer_stats();
  for (int root = 0; root < size; ++root) {
    for (const bool async : {false, true}) {
      INFO("root " << root << (async ? " async" : " sync"));
      TensorDict d = make_dict<std::int64_t>(ReduceOp::SUM, rank);
      d.set("f", make_input<float>(ReduceOp::MAX, rank, {100}, 3));
      wait_for(d.reduce(root, ReduceOp::SUM, {.async_op = async, .bucket_bytes = 128}));
      Tensor t = make_input<double>(ReduceOp::PRODUCT, rank, {5000});
      td::reduce(t, root, ReduceOp::PRODUCT, {.async_op = async}).wait();
      if (rank == root) {
        for (int k = 0; k < 3; ++k)
          CHECK(reduction_error(d.get(key_of(k)), ReduceOp::SUM, size, k).empty());
        // "f" was reduced with SUM too: its oracle is SUM of the MAX pattern.
        const auto f = d.get("f").to_vector<float>();
        bool ok = true;
        for (std::size_t i = 0; i < f.size(); ++i) {
          const auto at = static_cast<std::int64_t>(i);
          ok = ok && f[i] == reduce_over<float>(ReduceOp::SUM, size, [&](int r) {
                       return value<float>(ReduceOp::MAX, r, at, 3);
                     });
        }
        CHECK(ok);
        CHECK(reduction_error(t, ReduceOp::PRODUCT, size).empty());
      }
      CHECK(t.numel() == 5000);

      TensorDict b = make_dict<std::int32_t>(ReduceOp::SUM, rank);
      Tensor bt = make_input<float>(ReduceOp::SUM, rank, {4000});
      wait_for(b.broadcast(root, {.async_op = async, .bucket_bytes = 64}));
      td::broadcast(bt, root, {.async_op = async}).wait();
      for (int k = 0; k < 3; ++k) {
        const Tensor want =
            make_input<std::int32_t>(ReduceOp::SUM, root, b.get(key_of(k)).shape(), k);
        CHECK(b.get(key_of(k)).to_vector<std::int32_t>() == want.to_vector<std::int32_t>());
      }
      CHECK(bt.to_vector<float>() ==
            make_input<float>(ReduceOp::SUM, root, {4000}).to_vector<float>());
    }
  }
  check_strategy(world_node_aware());
}

TEST_CASE("node-aware collectives on subgroups that span some of the nodes", "[hierarchical]") {
  const int size = td::get_world_size();
  std::vector<std::vector<int>> subsets = {{0, size - 1}};
  if (size > 2) {
    std::vector<int> tail;
    for (int r = 1; r < size; ++r) tail.push_back(r);
    subsets.push_back(tail);
  }
  for (const auto& members : subsets) {
    if (members.size() == 2 && members[0] == members[1]) continue;  // one rank
    td::ProcessGroup g = td::new_group(members);
    const std::vector<int> per_node = ranks_per_node(members);  // collective over world
    if (!g.is_member()) continue;
    td::reset_packer_stats();
    INFO("group of " << g.size() << " ranks");
    for (const bool async : {false, true}) {
      TensorDict d = make_dict<std::int64_t>(ReduceOp::SUM, g.rank());
      wait_for(d.all_reduce(ReduceOp::SUM, {.group = g, .async_op = async, .bucket_bytes = 64}));
      for (int k = 0; k < 3; ++k)
        CHECK(reduction_error(d.get(key_of(k)), ReduceOp::SUM, g.size(), k).empty());
      TensorDict f = make_dict<float>(ReduceOp::AVG, g.rank());
      wait_for(f.all_reduce(ReduceOp::AVG, {.group = g, .async_op = async}));
      for (int k = 0; k < 3; ++k) {
        CHECK(reduction_error(f.get(key_of(k)), ReduceOp::AVG, g.size(), k).empty());
        CHECK(same_bits_everywhere(f.get(key_of(k)), g.comm()));
      }
      const int root = g.size() - 1;
      Tensor t = make_input<std::int32_t>(ReduceOp::MAX, g.rank(), {999});
      td::reduce(t, root, ReduceOp::MAX, {.group = g, .async_op = async}).wait();
      if (g.rank() == root) CHECK(reduction_error(t, ReduceOp::MAX, g.size()).empty());
      Tensor b = make_input<std::int32_t>(ReduceOp::SUM, g.rank(), {77});
      td::broadcast(b, 0, {.group = g, .async_op = async}).wait();
      CHECK(b.to_vector<std::int32_t>() ==
            make_input<std::int32_t>(ReduceOp::SUM, 0, {77}).to_vector<std::int32_t>());
    }
    check_strategy(expect_node_aware(per_node, g));
  }
}

// TD_HIERARCHICAL=auto (the default) chooses a group's path by measuring it in the group's first
// all_reduce / reduce / broadcast: flat before it; after it the same choice on every member, flat
// wherever node-aware cannot differ, and the calls follow it. Forced settings need no call.
TEST_CASE("the messages' path: measured by a group's first call, the same everywhere, followed",
          "[hierarchical][path]") {
  const int size = td::get_world_size();
  const auto h = env("TD_HIERARCHICAL");
  const bool forced = h && *h != "auto";
  const std::vector<int> per_node = ranks_per_node(every_rank());
  td::ProcessGroup g = td::new_group(every_rank());
  CHECK(td::runs_node_aware(g) == (forced && (*h == "1" || *h == "leaders")));
  // A gather is not a call that measures.
  TensorDict x;
  x.set("x", make_input<std::int32_t>(ReduceOp::SUM, g.rank(), {5}));
  CHECK(x.all_gather({.group = g}).size() == static_cast<std::size_t>(size));
  if (!forced) CHECK_FALSE(td::runs_node_aware(g));
  for (const int round : {0, 1}) {
    INFO("round " << round);
    td::reset_packer_stats();
    Tensor t = make_input<std::int64_t>(ReduceOp::SUM, g.rank(), {(1 << 17) + 5});  // 1 MiB
    td::all_reduce(t, ReduceOp::SUM, {.group = g});
    CHECK(reduction_error(t, ReduceOp::SUM, size).empty());
    const bool aware = td::runs_node_aware(g);
    int mine = aware ? 1 : 0, lo = 0, hi = 0;
    MPI_Allreduce(&mine, &lo, 1, MPI_INT, MPI_MIN, g.comm());
    MPI_Allreduce(&mine, &hi, 1, MPI_INT, MPI_MAX, g.comm());
    CHECK(lo == hi);
    CHECK(aware == expect_node_aware(per_node, g));
    CHECK((td::packer_stats().node_aware_messages > 0) == aware);
  }
}
