// Transport without a prior layout (broadcast_dict, send_dict / recv_dict, all_gather_dicts,
// gather_dicts, scatter_dicts) and the uneven TensorDict::reduce_scatter, against dicts every
// rank can build for any other rank: every dtype, nested keys, a sub-dict with a longer batch
// size, an empty sub-dict, sparse, empty, 0-d, strided and aliased leaves, a ragged number of
// rows and keys that only some ranks hold.
#include <catch2/catch.hpp>

#include <chrono>
#include <complex>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <limits>
#include <stdexcept>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include <mpi.h>

#include <tensordict/tensordict.hpp>

#include "support/agreement_peer.hpp"
#include "support/names.hpp"

namespace {

// Element i of a leaf is (base + i) in the dtype (modulo what small types hold; exact in all).
Tensor filled(DType dtype, const td::Shape& shape, int base) {
  Tensor t = Tensor::empty(shape, dtype);
  td::visit(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    T* p = t.data<T>();
    for (std::int64_t i = 0; i < t.numel(); ++i) {
      const int v = (base + static_cast<int>(i)) % 100;
      if constexpr (std::is_same_v<T, bool>) {
        p[i] = v % 2 == 1;
      } else {
        p[i] = static_cast<T>(static_cast<float>(v));
      }
    }
  });
  return t;
}

constexpr DType kDTypes[] = {DType::Bool,    DType::UInt8,   DType::Int8,      DType::Int16,
                             DType::Int32,   DType::Int64,   DType::Float16,   DType::BFloat16,
                             DType::Float32, DType::Float64, DType::Complex64, DType::Complex128};

// Rank `who`'s dict: who + 1 rows, and keys that depend on who.
TensorDict rich(int who) {
  const std::int64_t rows = who + 1;
  TensorDict d;
  d.set("scalar", Tensor::full<double>({}, 0.5 + who));  // 0-d
  TensorDict batched(td::Shape{rows});
  for (const DType dt : kDTypes)
    batched.set({"dtypes", std::string(td::name(dt))}, filled(dt, {rows, 2}, who * 7 + 3));
  batched.set({"nested", "deep", "strided"},
              filled(DType::Float32, {3, rows}, who).transpose(0, 1));
  batched.set({"nested", "empty"}, Tensor::empty({rows, 0}, DType::Float64));
  batched.set("alias", batched.get({"dtypes", "float32"}));
  TensorDict longer(td::Shape{rows, 2});
  longer.set("x", filled(DType::Int32, {rows, 2, 5}, who + 11));
  batched.set("longer", std::move(longer));
  batched.set("empty_dict", TensorDict(td::Shape{rows}));
  const Tensor idx = Tensor::from_vector<std::int64_t>({0, rows - 1, 1, 3}, {2, 2});
  batched.set("sparse", Tensor::sparse_coo(idx, filled(DType::Float64, {2}, who + 5), {rows, 4}));
  if (who % 2 == 1) batched.set("only_odd", filled(DType::Int16, {rows, 7}, who));
  d.set("batched", std::move(batched));
  return d;
}

// Same keys (nested, empty sub-dicts included), batch sizes and leaf values.
bool same(const TensorDict& a, const TensorDict& b) {
  if (!a.equal(b)) return false;
  const auto ka = a.keys(true), kb = b.keys(true);
  if (ka.size() != kb.size()) return false;
  for (const Key& k : ka) {
    if (!b.contains(k) || a.is_dict(k) != b.is_dict(k)) return false;
    if (a.is_dict(k) && a.get_dict(k).batch_size() != b.get_dict(k).batch_size()) return false;
  }
  return true;
}

// The MPI tag of a send_dict / recv_dict transfer from `sender` to `receiver` with
// CollectiveOptions::tag `user_tag` (docs/internals.md, "Tags": one tag per user tag and
// direction), for tests that speak the wire protocol.
int wire_tag(int sender, int receiver, int user_tag) {
  return 2 * user_tag + (sender < receiver ? 1 : 0);
}

// The wire records of docs/transport.md: a size record (metadata bytes, bytes per dtype, the
// tail guard) and send_dict's header (status, error length, segment mask, then the record).
constexpr std::size_t kSizeWords = 2 + td::kNumDTypes;
constexpr std::size_t kGuardWord = 1 + td::kNumDTypes;
constexpr std::size_t kHeaderWords = 3 + kSizeWords;

// Rank 0 playing a transport peer with raw MPI on the world's communicator: the agreement (a MAX
// of three words, to which zeros contribute nothing), the status rounds, and
// genuine metadata learnt from a library sender.
struct RawPeer {
  MPI_Comm comm = td::world().comm();

  void agreement() const { tdtest::agree_with_everything(comm); }
  void ibcast(void* p, int n, MPI_Datatype t, int root) const {
    MPI_Request req = MPI_REQUEST_NULL;
    MPI_Ibcast(p, n, t, root, comm, &req);
    MPI_Wait(&req, MPI_STATUS_IGNORE);
  }
  // A status round where this rank saw nothing wrong: the rejecting rank's text, or "".
  std::string status_round() const {
    std::uint64_t w = 0;
    tdtest::raw_max_round(&w, 1, comm);
    if (w == 0) return {};
    const int rejecting = static_cast<int>(w - 1);
    std::uint64_t len = 0;
    ibcast(&len, 1, MPI_UINT64_T, rejecting);
    std::string text(len, '\0');
    ibcast(text.data(), static_cast<int>(len), MPI_BYTE, rejecting);
    return text;
  }
  // Rank 1's send_dict of `d` read with raw MPI and refused: its header and metadata. Rank 1
  // calls learn_from() too (it sends).
  static std::pair<std::vector<std::uint64_t>, std::vector<char>> learn(const TensorDict& d,
                                                                        int user_tag) {
    const int rank = td::get_rank();
    std::vector<std::uint64_t> header(kHeaderWords);
    std::vector<char> meta;
    if (rank == 1) {
      CHECK_THROWS_WITH(td::send_dict(d, 0, {.tag = user_tag}), Catch::Contains("not now"));
    } else if (rank == 0) {
      const MPI_Comm comm = td::world().comm();
      const int tag = wire_tag(1, 0, user_tag);
      MPI_Recv(header.data(), static_cast<int>(header.size()), MPI_UINT64_T, 1, tag, comm,
               MPI_STATUS_IGNORE);
      meta.resize(header[3]);
      MPI_Recv(meta.data(), static_cast<int>(meta.size()), MPI_BYTE, 1, tag, comm,
               MPI_STATUS_IGNORE);
      std::vector<char> no(512, 0);
      no[0] = 2;  // failed
      std::snprintf(no.data() + 1, 500, "%s", "not now");
      MPI_Send(no.data(), 512, MPI_BYTE, 1, tag, comm);
    }
    return {header, meta};
  }
};

// A dict of two dtypes, small leaves (one packed message per dtype): int64 (dtype 5, 80 bytes)
// goes before float32 (dtype 8, 4000 bytes).
TensorDict two_streams() {
  TensorDict d;
  d.set("x", filled(DType::Float32, {1000}, 1));
  d.set({"y", "z"}, filled(DType::Int64, {10}, 2));
  return d;
}
// Runs `call`, which must throw the td::Error of a short message whose text contains `what`.
template <class F>
void expect_short(F&& call, const std::string& what) {
  try {
    call();
    FAIL("expected a td::Error");
  } catch (const td::Error& e) {
    INFO(e.what());
    CHECK_THAT(e.what(), Catch::Contains(what) && Catch::Contains("short message"));
  }
}

constexpr auto kInt64 = static_cast<std::size_t>(DType::Int64);
constexpr auto kFloat32 = static_cast<std::size_t>(DType::Float32);

}  // namespace

TEST_CASE("broadcast_dict delivers the source's dict to ranks that hold nothing", "[transport]") {
  const int rank = td::get_rank(), size = td::get_world_size();
  for (int src = 0; src < size; ++src) {
    const TensorDict got = td::broadcast_dict(rank == src ? rich(src) : TensorDict(), src);
    CHECK(same(got, rich(src)));
    if (rank != src) CHECK(got.is_consolidated());
  }
  // A consolidated source is sent in place; the result is the same.
  TensorDict source = rich(size - 1).clone();
  source.consolidate();
  const TensorDict got = td::broadcast_dict(source, size - 1, {.bucket_bytes = 4096});
  CHECK(same(got, rich(size - 1)));
  // An empty dict travels too.
  CHECK(td::broadcast_dict(TensorDict(), 0).keys().empty());
  // Large leaves of a source that is not consolidated travel one message per leaf from each
  // leaf's own memory (a strided one made contiguous first), small ones packed together: the
  // receivers post the messages the source announced.
  TensorDict large;
  for (int i = 0; i < 4; ++i)
    large.set({"large", std::to_string(i)}, filled(DType::Float32, {128, 256 + i}, i));
  large.set({"large", "strided"}, filled(DType::Float32, {300, 200}, 9).transpose(0, 1));
  large.set("small", filled(DType::Int64, {3}, 1));
  for (int src = 0; src < size; ++src) {
    const TensorDict got = td::broadcast_dict(rank == src ? large : TensorDict(), src);
    CHECK(same(got, large));
  }
}

TEST_CASE("send_dict and recv_dict move a dict to a rank that holds nothing", "[transport]") {
  const int rank = td::get_rank(), size = td::get_world_size();
  if (size < 2) return;
  const int peer = rank % 2 == 0 ? rank + 1 : rank - 1;
  if (peer >= size) return;
  const td::CollectiveOptions tagged{.tag = 3};
  if (rank % 2 == 0) {
    td::send_dict(rich(rank), peer);
    td::send_dict(rich(rank + 20), peer, tagged);
    CHECK(same(td::recv_dict(peer), rich(peer)));
  } else {
    const TensorDict first = td::recv_dict(peer);
    CHECK(same(first, rich(peer)));
    CHECK(first.is_consolidated());
    CHECK(same(td::recv_dict(peer, tagged), rich(peer + 20)));
    TensorDict consolidated = rich(rank).clone();
    consolidated.consolidate();
    td::send_dict(consolidated, peer);
  }
  // Large leaves that are not consolidated go one message per leaf, from the leaves' own memory
  // (a strided one made contiguous first).
  TensorDict big;
  big.set("a", filled(DType::Float32, {300, 300}, rank));
  big.set({"b", "t"}, filled(DType::Float32, {200, 400}, rank + 1).transpose(0, 1));
  big.set("c", filled(DType::Float64, {100000}, rank + 2));
  big.set("small", filled(DType::Float64, {3}, rank + 3));
  if (rank % 2 == 0) {
    td::send_dict(big, peer);
  } else {
    TensorDict want;
    want.set("a", filled(DType::Float32, {300, 300}, peer));
    want.set({"b", "t"}, filled(DType::Float32, {200, 400}, peer + 1).transpose(0, 1));
    want.set("c", filled(DType::Float64, {100000}, peer + 2));
    want.set("small", filled(DType::Float64, {3}, peer + 3));
    const TensorDict got = td::recv_dict(peer);
    CHECK(same(got, want));
    CHECK(got.is_consolidated());
  }
}

// The defect this guards against: transport used the user tag as the MPI tag in both
// directions, so two ranks each sending to the other on a thread of its own while receiving on
// the main thread could take each other's messages (a 512-byte verdict matched a 512-byte data
// message: zeros received and no error, or a misleading short-message error).
TEST_CASE("send_dict and recv_dict both ways at once, from two threads, with one tag",
          "[transport][tags]") {
  const int rank = td::get_rank(), size = td::get_world_size();
  if (size < 2) return;
  const int peer = rank % 2 == 0 ? rank + 1 : rank - 1;
  if (peer >= size) return;
  // 128 float32 = 512 bytes, the size of a verdict; the first byte of 1.0f + r is 0, the
  // verdict's "accepted".
  auto dict_of = [](int r, int round) {
    TensorDict d;
    d.set("w", td::Tensor::full<float>({128}, static_cast<float>(r + 1 + 100 * round)));
    return d;
  };
  for (int round = 0; round < 30; ++round) {
    INFO("round " << round);
    std::exception_ptr sent_error;
    std::thread sender([&] {
      try {
        td::send_dict(dict_of(rank, round), peer);
      } catch (...) {
        sent_error = std::current_exception();
      }
    });
    const TensorDict got = td::recv_dict(peer);
    sender.join();
    if (sent_error) std::rethrow_exception(sent_error);
    REQUIRE(same(got, dict_of(peer, round)));
  }
}

TEST_CASE("all_gather_dicts and gather_dicts take dicts that differ per rank", "[transport]") {
  const int rank = td::get_rank(), size = td::get_world_size();
  const auto all = td::all_gather_dicts(rich(rank));
  REQUIRE(all.size() == static_cast<std::size_t>(size));
  for (int r = 0; r < size; ++r) {
    CHECK(same(all[static_cast<std::size_t>(r)], rich(r)));
    CHECK(all[static_cast<std::size_t>(r)].is_consolidated());
  }
  for (int dst = 0; dst < size; ++dst) {
    const auto at = td::gather_dicts(rich(rank), dst);
    REQUIRE(at.size() == (rank == dst ? static_cast<std::size_t>(size) : 0U));
    for (std::size_t r = 0; r < at.size(); ++r) CHECK(same(at[r], rich(static_cast<int>(r))));
  }
  // Ranks whose dicts are empty, or hold different dtypes only.
  TensorDict mine;
  if (rank % 2 == 0) mine.set("only_even", filled(DType::Complex64, {3}, rank));
  const auto mixed = td::all_gather_dicts(mine);
  for (int r = 0; r < size; ++r)
    CHECK(mixed[static_cast<std::size_t>(r)].keys().size() == (r % 2 == 0 ? 1U : 0U));
}

TEST_CASE("scatter_dicts hands each rank its own part", "[transport]") {
  const int rank = td::get_rank(), size = td::get_world_size();
  for (int src = 0; src < size; ++src) {
    std::vector<TensorDict> parts;
    if (rank == src)
      for (int r = 0; r < size; ++r) parts.push_back(rich(r + 10));
    const TensorDict mine = td::scatter_dicts(parts, src);
    CHECK(same(mine, rich(rank + 10)));
    CHECK(mine.is_consolidated());
  }
}

TEST_CASE("transport in a group that leaves ranks out", "[transport]") {
  const int rank = td::get_rank(), size = td::get_world_size();
  std::vector<int> evens;
  for (int r = 0; r < size; r += 2) evens.push_back(r);
  const td::ProcessGroup group = td::new_group(evens);
  if (rank % 2 != 0) return;
  const td::CollectiveOptions opts{.group = group};
  const int me = group.rank(), n = group.size();
  CHECK(same(td::broadcast_dict(me == n - 1 ? rich(7) : TensorDict(), n - 1, opts), rich(7)));
  const auto all = td::all_gather_dicts(rich(me), opts);
  for (int r = 0; r < n; ++r) CHECK(same(all[static_cast<std::size_t>(r)], rich(r)));
  std::vector<TensorDict> parts;
  if (me == 0)
    for (int r = 0; r < n; ++r) parts.push_back(rich(r + 1));
  CHECK(same(td::scatter_dicts(parts, 0, opts), rich(me + 1)));
  if (n >= 2) {
    if (me == 0) td::send_dict(rich(4), 1, opts);
    if (me == 1) CHECK(same(td::recv_dict(0, opts), rich(4)));
  }
}

namespace {
struct Policy : td::TensorClass<Policy> {
  Tensor weight;  // float32 [4, 3]
  Tensor bias;    // float64 [3]
  TD_TENSORCLASS_FIELDS(Policy, weight, bias)
};
}  // namespace

TEST_CASE("a tensorclass round trip through broadcast_dict and all_gather_dicts", "[transport]") {
  const int rank = td::get_rank();
  Policy p;
  if (rank == 0) {
    p.weight = filled(DType::Float32, {4, 3}, 1);
    p.bias = filled(DType::Float64, {3}, 2);
  }
  const Policy got =
      Policy::from_tensordict(td::broadcast_dict(rank == 0 ? p.to_tensordict() : TensorDict(), 0));
  CHECK(got.weight.equal(filled(DType::Float32, {4, 3}, 1)));
  CHECK(got.bias.equal(filled(DType::Float64, {3}, 2)));
  Policy mine;
  mine.weight = filled(DType::Float32, {4, 3}, rank);
  mine.bias = filled(DType::Float64, {3}, rank);
  const auto all = td::all_gather_dicts(mine.to_tensordict());
  for (std::size_t r = 0; r < all.size(); ++r)
    CHECK(Policy::from_tensordict(all[r]).weight.equal(
        filled(DType::Float32, {4, 3}, static_cast<int>(r))));
}

TEST_CASE("reduce_scatter with rows per rank", "[transport][reduce_scatter]") {
  const int rank = td::get_rank(), size = td::get_world_size();
  // mpi4py's test_cco_buf: rank r gets r + 1 rows (6 rows at 3 ranks: 1/2/3); a rank may get 0.
  for (const bool with_zero : {false, true}) {
    std::vector<std::int64_t> rows_per_rank;
    for (int r = 0; r < size; ++r) rows_per_rank.push_back(with_zero && r == 0 ? 0 : r + 1);
    std::int64_t rows = 0, first = 0;
    for (int r = 0; r < size; ++r) {
      if (r < rank) first += rows_per_rank[static_cast<std::size_t>(r)];
      rows += rows_per_rank[static_cast<std::size_t>(r)];
    }
    const std::int64_t mine = rows_per_rank[static_cast<std::size_t>(rank)];
    auto dict_of = [&](int who) {
      TensorDict d(td::Shape{rows});
      d.set("a", filled(DType::Float32, {rows, 3}, who));
      d.set({"n", "b"}, filled(DType::Int64, {rows}, who + 1));
      d.set({"n", "c"}, filled(DType::Float64, {3, rows}, who + 2).transpose(0, 1));
      return d;
    };
    for (const std::optional<std::size_t> cap :
         {std::optional<std::size_t>{}, std::optional<std::size_t>{64}}) {
      const TensorDict shard =
          dict_of(rank).reduce_scatter(rows_per_rank, ReduceOp::SUM, {.bucket_bytes = cap});
      CHECK(shard.batch_size() == td::Shape{mine});
      for (const Key& k : {Key("a"), Key({"n", "b"}), Key({"n", "c"})}) {
        Tensor want;
        for (int who = 0; who < size; ++who) {
          const Tensor rows_of = dict_of(who).get(k).slice(0, first, first + mine).contiguous();
          if (!want.defined()) {
            want = rows_of.clone();
            continue;
          }
          td::visit(want.dtype(), [&](auto tag) {
            using T = typename decltype(tag)::type;
            if constexpr (std::is_arithmetic_v<T> && !std::is_same_v<T, bool>) {
              T* w = want.data<T>();
              const T* x = rows_of.data<T>();
              for (std::int64_t i = 0; i < want.numel(); ++i) w[i] += x[i];
            }
          });
        }
        CHECK(shard.get(k).equal(want));
      }
    }
  }
  // 6 rows at 3 ranks split 1/2/3: the even overload cannot, this one does.
  if (size == 3) {
    TensorDict d(td::Shape{6});
    d.set("x", Tensor::from_vector<float>({0, 1, 2, 3, 4, 5}));
    const TensorDict shard = d.reduce_scatter({1, 2, 3}, ReduceOp::AVG);
    const std::vector<std::vector<float>> want = {{0}, {1, 2}, {3, 4, 5}};
    CHECK(shard.get("x").to_vector<float>() == want[static_cast<std::size_t>(rank)]);
  }
}

TEST_CASE("rows_per_rank that overflow when summed are the same error on every rank",
          "[transport][reduce_scatter][errors]") {
  // {INT64_MAX, INT64_MAX, 2, ...} on a dict of 0 rows: the sum wraps to 0 unless checked.
  const int size = td::get_world_size();
  const std::int64_t big = std::numeric_limits<std::int64_t>::max();
  std::vector<std::int64_t> rows_per_rank(static_cast<std::size_t>(size), 0);
  rows_per_rank[0] = big;
  if (size > 1) rows_per_rank[1] = big;
  if (size > 2) rows_per_rank[2] = 2;
  TensorDict d(td::Shape{0});
  d.set("x", Tensor::zeros({0, 3}, DType::Float32));
  for (int round = 0; round < 2; ++round) {
    try {
      const TensorDict shard = d.reduce_scatter(rows_per_rank, ReduceOp::SUM);
      // One rank of MAX rows sums to MAX, not 0: only a world of one with rows {MAX} gets here
      // with a mismatch against the 0 rows of the leaf.
      FAIL("expected std::invalid_argument, got a shard of " << shard.batch_size()[0] << " rows");
    } catch (const std::invalid_argument& e) {
      INFO(e.what());
      CHECK_THAT(e.what(), Catch::Contains("rows_per_rank"));
    }
  }
  // The group still works.
  CHECK(td::all_gather_dicts(rich(0)).size() == static_cast<std::size_t>(size));
}

TEST_CASE("transport errors are raised on every rank before data moves", "[transport][errors]") {
  const int rank = td::get_rank(), size = td::get_world_size();
  CHECK_THROWS_AS(td::broadcast_dict(rich(0), size), std::invalid_argument);
  CHECK_THROWS_AS(td::gather_dicts(rich(0), -1), std::invalid_argument);
  CHECK_THROWS_AS(td::all_gather_dicts(rich(0), {.async_op = true}), std::invalid_argument);
  // async_op or a bad bucket size on one rank only: every rank raises.
  CHECK_THROWS_AS(td::all_gather_dicts(rich(0), {.async_op = rank == size - 1}),
                  std::invalid_argument);
  CHECK_THROWS_AS(
      td::broadcast_dict(
          rich(0), 0,
          {.bucket_bytes = rank == size - 1 ? std::optional<std::size_t>(0) : std::nullopt}),
      std::invalid_argument);
  // The source passes no parts, or too few.
  CHECK_THROWS_WITH(td::scatter_dicts({}, 0), Catch::Contains("0 parts for a group"));
  // A moved-from dict on the source.
  TensorDict gone = rich(0);
  TensorDict taken = std::move(gone);
  CHECK_THROWS_AS(td::broadcast_dict(gone, 0),
                  std::invalid_argument);  // NOLINT(bugprone-use-after-move)
  // Uneven reduce_scatter: sizes that do not sum to the rows, that differ per rank, negative.
  TensorDict d(td::Shape{4});
  d.set("x", filled(DType::Float32, {4}, 0));
  CHECK_THROWS_AS(d.reduce_scatter(std::vector<std::int64_t>(static_cast<std::size_t>(size), 5)),
                  std::invalid_argument);
  if (size > 1) {
    std::vector<std::int64_t> rows(static_cast<std::size_t>(size), 0);
    rows[static_cast<std::size_t>(rank == 0 ? 0 : size - 1)] = 4;
    CHECK_THROWS_AS(d.reduce_scatter(rows), td::LayoutMismatchError);
    CHECK_THROWS_AS(d.reduce_scatter(std::vector<std::int64_t>(1, 4)), std::invalid_argument);
  }
  std::vector<std::int64_t> negative(static_cast<std::size_t>(size), 0);
  negative[0] = 5;
  if (size > 1) negative[1] = -1;
  CHECK_THROWS_AS(d.reduce_scatter(negative), std::invalid_argument);
  // Point to point: a bad peer is a local error; a sender's bad option reaches the receiver.
  CHECK_THROWS_AS(td::send_dict(rich(0), rank), std::invalid_argument);
  CHECK_THROWS_AS(td::recv_dict(size), std::invalid_argument);
  if (size >= 2 && rank < 2) {
    if (rank == 0) {
      CHECK_THROWS_AS(td::send_dict(rich(0), 1, {.async_op = true}), std::invalid_argument);
      CHECK_THROWS_WITH(td::send_dict(rich(0), 1), Catch::Contains("did not accept"));
    } else {
      CHECK_THROWS_WITH(td::recv_dict(0), Catch::Contains("async_op"));
      CHECK_THROWS_AS(td::recv_dict(0, {.async_op = true}), std::invalid_argument);
    }
  }
  // The group is still usable.
  CHECK(same(td::broadcast_dict(rank == 0 ? rich(2) : TensorDict(), 0), rich(2)));
}

TEST_CASE("recv_dict rejects a hostile sender's metadata", "[transport][errors]") {
  // Rank 0 plays a corrupted peer with raw MPI on the group's communicator, speaking the wire
  // protocol of docs/transport.md (header, metadata, then waiting for the verdict).
  const int rank = td::get_rank(), size = td::get_world_size();
  if (size < 2 || rank > 1) return;
  const MPI_Comm comm = td::world().comm();
  const int tag = wire_tag(0, 1, 41);
  const td::CollectiveOptions opts{.tag = 41};
  // Valid magic and version, then a root claiming 1000 entries in 4 bytes.
  const std::vector<unsigned char> meta = {'T', 'D', 'W', 1, 0, 0xe8, 0x03, 0, 0, 1, 0, 'k', 1};
  auto run = [&](std::vector<std::uint64_t> header, std::string_view expect) {
    if (rank == 0) {
      MPI_Send(header.data(), static_cast<int>(header.size()), MPI_UINT64_T, 1, tag, comm);
      MPI_Send(meta.data(), static_cast<int>(meta.size()), MPI_BYTE, 1, tag, comm);
      std::vector<char> verdict(512);
      MPI_Recv(verdict.data(), 512, MPI_BYTE, 1, tag, comm, MPI_STATUS_IGNORE);
      CHECK(verdict[0] != 0);  // rejected: no data follows
      CHECK(std::string(verdict.data() + 1).find(expect) != std::string::npos);
    } else {
      CHECK_THROWS_WITH(td::recv_dict(0, opts), Catch::Contains(std::string(expect)));
    }
  };
  std::vector<std::uint64_t> header(kHeaderWords, 0);
  header[3] = meta.size();
  run(header, "entries claimed");
  header[3] = std::uint64_t{1} << 40;  // metadata of a terabyte: refused before any allocation
  if (rank == 0) {
    MPI_Send(header.data(), static_cast<int>(header.size()), MPI_UINT64_T, 1, tag, comm);
  } else {
    CHECK_THROWS_WITH(td::recv_dict(0, opts), Catch::Contains("bytes of metadata"));
  }
  // The group still works for both ranks.
  if (rank == 0) td::send_dict(rich(1), 1);
  if (rank == 1) CHECK(same(td::recv_dict(0), rich(1)));
}

TEST_CASE("recv_dict whose sender stops after the handshake times out", "[transport][errors]") {
  // Rank 0 learns a genuine header and metadata by reading rank 1's send_dict with raw MPI (and
  // rejecting it), then replays them to rank 1's recv_dict, takes the verdict (accepted) and
  // never sends the data: the receive must end with a td::TimeoutError at its deadline, not hang,
  // and the group must still work afterwards.
  const int rank = td::get_rank(), size = td::get_world_size();
  if (size < 2 || rank > 1) return;
  const MPI_Comm comm = td::world().comm();
  const int user_tag = 57;  // used by no other test: nothing later matches the abandoned receives
  const int learn = wire_tag(1, 0, user_tag);  // rank 1's send_dict, read by rank 0
  const int tag = wire_tag(0, 1, user_tag);    // rank 0's replay to rank 1's recv_dict
  const td::CollectiveOptions opts{.timeout = std::chrono::milliseconds(300), .tag = user_tag};
  TensorDict d;
  d.set("x", filled(DType::Float32, {1000}, 1));
  d.set({"y", "z"}, filled(DType::Int64, {10}, 2));
  if (rank == 0) {
    std::vector<std::uint64_t> header(kHeaderWords);
    MPI_Recv(header.data(), static_cast<int>(header.size()), MPI_UINT64_T, 1, learn, comm,
             MPI_STATUS_IGNORE);
    REQUIRE(header[0] == 0);  // ok: the metadata follows
    std::vector<char> meta(header[3]);
    MPI_Recv(meta.data(), static_cast<int>(meta.size()), MPI_BYTE, 1, learn, comm,
             MPI_STATUS_IGNORE);
    std::vector<char> no(512, 0);
    no[0] = 2;  // failed
    std::snprintf(no.data() + 1, 500, "%s", "not now");
    MPI_Send(no.data(), 512, MPI_BYTE, 1, learn, comm);
    // Now the sender that stops.
    MPI_Send(header.data(), static_cast<int>(header.size()), MPI_UINT64_T, 1, tag, comm);
    MPI_Send(meta.data(), static_cast<int>(meta.size()), MPI_BYTE, 1, tag, comm);
    std::vector<char> verdict(512);
    MPI_Recv(verdict.data(), 512, MPI_BYTE, 1, tag, comm, MPI_STATUS_IGNORE);
    CHECK(verdict[0] == 0);  // accepted: the receiver now waits for the data
  } else {
    CHECK_THROWS_WITH(td::send_dict(d, 0, opts), Catch::Contains("not now"));
    const auto start = std::chrono::steady_clock::now();
    CHECK_THROWS_AS(td::recv_dict(0, opts), td::TimeoutError);
    CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds(5));
  }
  // The group still works (other tags).
  if (rank == 0) td::send_dict(d, 1);
  if (rank == 1) CHECK(same(td::recv_dict(0), d));
}

TEST_CASE("recv_dict from a rank that never sends times out", "[transport][errors]") {
  const int rank = td::get_rank(), size = td::get_world_size();
  if (size < 2 || rank != 1) return;
  const auto start = std::chrono::steady_clock::now();
  // A tag no other test uses: the abandoned receive must not take a later message.
  // The message says what happened and the likely cause (issue 31).
  try {
    (void)td::recv_dict(0, {.timeout = std::chrono::milliseconds(200), .tag = 999});
    FAIL("recv_dict must time out");
  } catch (const td::TimeoutError& e) {
    CHECK_THAT(e.what(), Catch::Contains("timed out") &&
                             Catch::Contains("rank 0 did not call send_dict to rank 1"));
  }
  CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds(5));
}

TEST_CASE("calls on the boundary tags at once never take each other's messages",
          "[transport][tags]") {
  // Tags 0, 1023, 1024 and the largest, in flight at once: four send_dict threads against
  // recv_dicts taken in another order, beside async TensorDict::send / recv on the same tags. A
  // receive must get the dict of its own tag (whose value is the tag), never another's.
  const int rank = td::get_rank(), size = td::get_world_size();
  if (size < 2 || rank > 1) return;
  const std::vector<int> tags = {1024, 0, td::kMaxUserTag - 1, 1023};
  const std::vector<int> recv_order = {0, 1024, 1023, td::kMaxUserTag - 1};
  auto dict_of = [](int tag, bool p2p) {
    TensorDict d;
    d.set(p2p ? "p2p" : "transport", Tensor::full<std::int32_t>({3}, tag));
    return d;
  };
  const td::CollectiveOptions base{.timeout = std::chrono::milliseconds(20000)};
  for (int round = 0; round < 3; ++round) {
    if (rank == 0) {
      std::vector<TensorDict> outs;
      for (int tag : tags) outs.push_back(dict_of(tag, true));
      std::vector<td::Work> works;
      for (std::size_t i = 0; i < tags.size(); ++i) {
        td::CollectiveOptions o = base;
        o.tag = tags[i];
        o.async_op = true;
        for (auto& w : outs[i].send(1, o)) works.push_back(std::move(w));
      }
      std::vector<std::thread> senders;
      for (int tag : tags) {
        senders.emplace_back([&, tag] {
          td::CollectiveOptions o = base;
          o.tag = tag;
          td::send_dict(dict_of(tag, false), 1, o);
        });
      }
      for (auto& t : senders) t.join();
      td::wait_all(works);
    } else {
      std::vector<TensorDict> ins;
      for (std::size_t i = 0; i < recv_order.size(); ++i) {
        TensorDict d;
        d.set("p2p", Tensor::zeros({3}, DType::Int32));
        ins.push_back(std::move(d));
      }
      std::vector<td::Work> works;
      for (std::size_t i = 0; i < recv_order.size(); ++i) {
        td::CollectiveOptions o = base;
        o.tag = recv_order[i];
        o.async_op = true;
        for (auto& w : ins[i].recv(0, o)) works.push_back(std::move(w));
      }
      for (int tag : recv_order) {
        td::CollectiveOptions o = base;
        o.tag = tag;
        const TensorDict got = td::recv_dict(0, o);
        INFO("transport tag " << tag << ", round " << round);
        REQUIRE(got.contains("transport"));
        CHECK(got.get("transport").to_vector<std::int32_t>() == std::vector<std::int32_t>(3, tag));
      }
      td::wait_all(works);
      for (std::size_t i = 0; i < recv_order.size(); ++i) {
        INFO("point-to-point tag " << recv_order[i] << ", round " << round);
        CHECK(ins[i].get("p2p").to_vector<std::int32_t>() ==
              std::vector<std::int32_t>(3, recv_order[i]));
      }
    }
  }
}

TEST_CASE("recv_dict rejects a sender whose metadata or data is shorter than announced",
          "[transport][errors][short]") {
  const int rank = td::get_rank(), size = td::get_world_size();
  if (size < 2 || rank > 1) return;
  const MPI_Comm comm = td::world().comm();
  const int user_tag = 61;
  const td::CollectiveOptions opts{.tag = user_tag};
  const TensorDict d = two_streams();
  const auto [header, meta] = RawPeer::learn(d, user_tag);
  const int tag = wire_tag(0, 1, user_tag);
  // Metadata: the header announces all of it, 4 bytes come.
  if (rank == 0) {
    MPI_Send(header.data(), static_cast<int>(header.size()), MPI_UINT64_T, 1, tag, comm);
    MPI_Send(meta.data(), 4, MPI_BYTE, 1, tag, comm);
  } else {
    try {
      (void)td::recv_dict(0, opts);
      FAIL("expected a td::Error");
    } catch (const td::Error& e) {
      INFO(e.what());
      CHECK_THAT(e.what(), Catch::Contains("rank 0 sent 4 of the") &&
                               Catch::Contains("bytes of its metadata") &&
                               Catch::Contains("short message"));
    }
  }
  // Data: header and metadata in full, the verdict taken, then the int64 stream in full and 100
  // of the 1000 float32 elements.
  if (rank == 0) {
    MPI_Send(header.data(), static_cast<int>(header.size()), MPI_UINT64_T, 1, tag, comm);
    MPI_Send(meta.data(), static_cast<int>(meta.size()), MPI_BYTE, 1, tag, comm);
    std::vector<char> verdict(512);
    MPI_Recv(verdict.data(), 512, MPI_BYTE, 1, tag, comm, MPI_STATUS_IGNORE);
    REQUIRE(verdict[0] == 0);
    MPI_Send(d.get({"y", "z"}).raw_data(), 10, MPI_INT64_T, 1, tag, comm);
    MPI_Send(d.get("x").raw_data(), 100, MPI_FLOAT, 1, tag, comm);
  } else {
    try {
      (void)td::recv_dict(0, opts);
      FAIL("expected a td::Error");
    } catch (const td::Error& e) {
      INFO(e.what());
      CHECK_THAT(e.what(), Catch::Contains("rank 0 sent 100 of the 1000 elements") &&
                               Catch::Contains("float32 data"));
    }
  }
  // The pair still talks.
  if (rank == 0) td::send_dict(d, 1);
  if (rank == 1) CHECK(same(td::recv_dict(0), d));
}

TEST_CASE("broadcast_dict rejects a source whose metadata or data is shorter than announced",
          "[transport][errors][short]") {
  // Rank 0 is a raw-MPI source; every other rank calls broadcast_dict and must raise the same
  // td::Error, however the broadcast tree forwards the short message.
  const int rank = td::get_rank(), size = td::get_world_size();
  if (size < 2) return;
  const RawPeer raw;
  const TensorDict d = two_streams();
  const auto [header, meta] = RawPeer::learn(d, 62);
  auto expect_error = [&](const std::string& phase) {
    expect_short([] { (void)td::broadcast_dict(TensorDict(), 0); },
                 "td.broadcast_dict: rank 0 sent less " + phase);
  };
  std::vector<std::uint64_t> record(kSizeWords + 1, 0);  // the record, then the segment mask
  if (rank == 0) std::copy(header.begin() + 3, header.end(), record.begin());
  record[kGuardWord] = 1;  // any guard but "none"
  // Metadata: 4 of its bytes.
  if (rank == 0) {
    raw.agreement();
    raw.ibcast(record.data(), static_cast<int>(record.size()), MPI_UINT64_T, 0);
    raw.ibcast(const_cast<char*>(meta.data()), 4, MPI_BYTE, 0);
    CHECK_THAT(raw.status_round(), Catch::Contains("short message"));
  } else {
    expect_error("metadata");
  }
  // Data: the metadata in full, the int64 stream in full, 100 of the 1000 float32 elements.
  if (rank == 0) {
    raw.agreement();
    raw.ibcast(record.data(), static_cast<int>(record.size()), MPI_UINT64_T, 0);
    raw.ibcast(const_cast<char*>(meta.data()), static_cast<int>(meta.size()), MPI_BYTE, 0);
    CHECK(raw.status_round().empty());  // the metadata is genuine
    REQUIRE(record[1 + kInt64] == 80);
    REQUIRE(record[1 + kFloat32] == 4000);
    raw.ibcast(const_cast<void*>(d.get({"y", "z"}).raw_data()), 10, MPI_INT64_T, 0);
    raw.ibcast(const_cast<void*>(d.get("x").raw_data()), 100, MPI_FLOAT, 0);
    CHECK_THAT(raw.status_round(), Catch::Contains("float32 data"));
  } else {
    expect_error("float32 data");
  }
  // Everyone still works.
  CHECK(same(td::broadcast_dict(rank == 0 ? d : TensorDict(), 0), d));
}

TEST_CASE("gather_dicts rejects a rank whose metadata or data is shorter than announced",
          "[transport][errors][short]") {
  // Rank 0 is a raw-MPI member of a gather to rank 1: its size record announces its metadata
  // (and data), its Igatherv contributions are short. Every library rank raises the same error.
  const int rank = td::get_rank(), size = td::get_world_size();
  if (size < 2) return;
  const RawPeer raw;
  const TensorDict d = two_streams();
  const auto [header, meta] = RawPeer::learn(d, 63);
  auto expect_error = [&](const std::string& phase) {
    expect_short([] { (void)td::gather_dicts(TensorDict(), 1); },
                 "td.gather_dicts: rank 0 sent less " + phase);
  };
  std::vector<std::uint64_t> record(kSizeWords, 0);
  if (rank == 0) std::copy(header.begin() + 3, header.end(), record.begin());
  record[kGuardWord] = 1;
  auto raw_gather = [&](const std::vector<std::uint64_t>& mine, int meta_bytes) {
    raw.agreement();
    std::vector<std::uint64_t> table(kSizeWords * static_cast<std::size_t>(size));
    MPI_Request req = MPI_REQUEST_NULL;
    MPI_Iallgather(mine.data(), static_cast<int>(kSizeWords), MPI_UINT64_T, table.data(),
                   static_cast<int>(kSizeWords), MPI_UINT64_T, raw.comm, &req);
    MPI_Wait(&req, MPI_STATUS_IGNORE);
    MPI_Igatherv(meta.data(), meta_bytes, MPI_BYTE, nullptr, nullptr, nullptr, MPI_BYTE, 1,
                 raw.comm, &req);
    MPI_Wait(&req, MPI_STATUS_IGNORE);
  };
  if (rank == 0) {
    raw_gather(record, 4);
    CHECK_THAT(raw.status_round(), Catch::Contains("short message"));
  } else {
    expect_error("metadata");
  }
  // Data: the other ranks send empty dicts, so the data calls are rank 0's dtypes: int64 in
  // full, then 100 of its 1000 float32 elements.
  if (rank == 0) {
    raw_gather(record, static_cast<int>(meta.size()));
    CHECK(raw.status_round().empty());
    MPI_Request req = MPI_REQUEST_NULL;
    MPI_Igatherv(d.get({"y", "z"}).raw_data(), 10, MPI_INT64_T, nullptr, nullptr, nullptr,
                 MPI_INT64_T, 1, raw.comm, &req);
    MPI_Wait(&req, MPI_STATUS_IGNORE);
    MPI_Igatherv(d.get("x").raw_data(), 100, MPI_FLOAT, nullptr, nullptr, nullptr, MPI_FLOAT, 1,
                 raw.comm, &req);
    MPI_Wait(&req, MPI_STATUS_IGNORE);
    CHECK_THAT(raw.status_round(), Catch::Contains("float32 data"));
  } else {
    expect_error("float32 data");
  }
  // Everyone still works.
  const auto all = td::gather_dicts(d, 1);
  if (rank == 1) {
    REQUIRE(all.size() == static_cast<std::size_t>(size));
    CHECK(same(all[0], d));
  }
}
