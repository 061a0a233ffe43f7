// The flight recorder (issue 29): every call on a group takes the group's next sequence number
// on every rank (collectives, transport, barrier, the Reducer's steps; point to point its own),
// and td::dump_flight_recorder writes the ring as the documented JSON. Each case works on a new
// group, so its numbers start at 1 whatever ran before. A second run of the binary has
// TD_FLIGHT_RECORDER=0 ([off]: no entries, sequence numbers still drawn).
#include <catch2/catch.hpp>

#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <unistd.h>

#include <nlohmann/json.hpp>
#include <tensordict/tensordict.hpp>

#include "support/groups.hpp"

using nlohmann::json;
using td::ReduceOp;
using td::Tensor;
using td::TensorDict;

namespace {

json dump() {
  const auto file =
      std::filesystem::temp_directory_path() / ("td-flight-test-" + std::to_string(td::get_rank()) +
                                                "-" + std::to_string(::getpid()) + ".json");
  td::dump_flight_recorder(file);
  std::ifstream in(file);
  json doc = json::parse(in);
  std::filesystem::remove(file);
  return doc;
}

// The id of the newest td::new_group ("group <k>" with the largest k): the case's own group.
std::uint64_t newest_group(const json& doc) {
  std::uint64_t id = 0;
  int best = -1;
  for (const json& g : doc.at("groups")) {
    const std::string name = g.at("name").get<std::string>();
    if (name.rfind("group ", 0) != 0) continue;
    const int k = std::stoi(name.substr(6));
    if (k > best) {
      best = k;
      id = g.at("id").get<std::uint64_t>();
    }
  }
  REQUIRE(best > 0);
  return id;
}

// The entries of one group, oldest first.
std::vector<json> entries_of(const json& doc, std::uint64_t group) {
  std::vector<json> out;
  for (const json& e : doc.at("entries"))
    if (e.at("group").get<std::uint64_t>() == group) out.push_back(e);
  return out;
}

// A digest of "op#seq" of every entry, the same on every rank exactly when the sequences are.
std::uint64_t digest(const std::vector<json>& entries) {
  std::uint64_t h = 1469598103934665603ull;
  for (const json& e : entries) {
    const std::string s = e.at("op").get<std::string>() + "#" +
                          std::to_string(e.at("seq").get<std::uint64_t>()) +
                          e.at("kind").get<std::string>();
    for (unsigned char c : s) h = (h ^ c) * 1099511628211ull;
  }
  return h;
}

bool same_on_every_rank(std::uint64_t v) {
  Tensor lo = Tensor::full<std::int64_t>({1}, static_cast<std::int64_t>(v >> 1));
  Tensor hi = lo.clone();
  td::all_reduce(lo, ReduceOp::MIN);
  td::all_reduce(hi, ReduceOp::MAX);
  return lo.to_vector<std::int64_t>()[0] == hi.to_vector<std::int64_t>()[0];
}

bool recorder_off() {
  const char* v = std::getenv("TD_FLIGHT_RECORDER");
  return v && std::string(v) == "0";
}

}  // namespace

TEST_CASE("every call on a group takes the next sequence number, alike on every rank", "[flight]") {
  if (recorder_off()) return;
  td::ProcessGroup g = fresh_group();
  const int rank = g.rank(), size = g.size();
  TensorDict d;
  d.set({"grads", "w"}, Tensor::full<float>({32}, 1.f));
  d.set({"grads", "b"}, Tensor::full<float>({4}, 1.f));
  d.all_reduce(ReduceOp::SUM, {.group = g});  // #1
  Tensor t = Tensor::full<double>({8}, 2.0);
  td::broadcast(t, 0, {.group = g});                                         // #2
  td::barrier(g);                                                            // #3
  auto all = td::all_gather_dicts(d, {.group = g});                          // #4
  auto works = d.all_reduce(ReduceOp::AVG, {.group = g, .async_op = true});  // #5
  for (auto& w : works) w.wait();
  if (size > 1) {  // point to point: its own numbers, not in the group's sequence
    const int next = (rank + 1) % size, prev = (rank + size - 1) % size;
    TensorDict in = d.clone();
    auto s = d.isend(next, {.group = g});
    in.recv(prev, {.group = g});
    for (auto& w : s) w.wait();
  }
  d.reduce(0, ReduceOp::SUM, {.group = g});  // #6

  const json doc = dump();
  CHECK(doc.at("format") == "tensordict-mpi flight recorder");
  CHECK(doc.at("version") == 1);
  CHECK(doc.at("rank") == td::get_rank());
  CHECK(doc.at("time_unit") == "ns since the Unix epoch");
  const std::vector<json> es = entries_of(doc, newest_group(doc));
  std::vector<std::string> ops;
  std::uint64_t expect_seq = 1;
  for (const json& e : es) {
    if (e.at("kind") == "point_to_point") {
      CHECK(e.at("seq").get<std::uint64_t>() <= 2);  // its own counter: send #1, recv #2
      continue;
    }
    CHECK(e.at("seq").get<std::uint64_t>() == expect_seq);
    ++expect_seq;
    ops.push_back(e.at("op").get<std::string>());
    CHECK(e.at("state") == "completed");
    CHECK(e.at("t_entered").get<std::int64_t>() > 0);
    CHECK(e.at("t_finished").get<std::int64_t>() >= e.at("t_entered").get<std::int64_t>());
  }
  const std::vector<std::string> expected{
      "TensorDict.all_reduce", "broadcast",        "barrier", "td.all_gather_dicts",
      "TensorDict.all_reduce", "TensorDict.reduce"};
  CHECK(ops == expected);
  // The summary of the first call: first key in canonical order, leaves, bytes, dtype.
  REQUIRE(!es.empty());
  CHECK(es[0].at("first_key") == "grads.b");
  CHECK(es[0].at("leaves") == 2);
  CHECK(es[0].at("bytes") == 36 * 4);
  CHECK(es[0].at("dtypes") == json::array({"float32"}));
  CHECK(es[0].at("reduce_op") == "SUM");
  CHECK(es[4].at("async") == true);
  CHECK(es[1].at("root") == 0);
  CHECK(same_on_every_rank(digest(es)));
}

TEST_CASE("a Reducer step is one call on the Reducer's group", "[flight]") {
  if (recorder_off()) return;
  td::ProcessGroup g = fresh_group();
  TensorDict grads;
  grads.set("w", Tensor::full<float>({64}, 1.f));
  grads.set("b", Tensor::full<float>({8}, 1.f));
  td::Reducer reducer(grads, {.bucket_bytes = 128, .group = g});
  for (int step = 0; step < 3; ++step) {
    reducer.mark_ready("w");
    reducer.mark_ready("b");
    reducer.finish();
  }
  const json doc = dump();
  std::uint64_t lane = 0;
  for (const json& gr : doc.at("groups"))
    if (gr.at("name").get<std::string>().rfind("Reducer (copy 1 of group ", 0) == 0)
      lane = std::max(lane, gr.at("id").get<std::uint64_t>());
  REQUIRE(lane != 0);
  const std::vector<json> steps = entries_of(doc, lane);
  REQUIRE(steps.size() >= 3);
  const std::size_t n = steps.size();
  for (std::size_t i = n - 3; i < n; ++i) {
    CHECK(steps[i].at("op") == "Reducer step");
    CHECK(steps[i].at("kind") == "reducer_step");
    CHECK(steps[i].at("state") == "completed");
    CHECK(steps[i].at("pending_operations") == 0);
    CHECK(steps[i].at("leaves") == 2);
  }
  CHECK(steps[n - 1].at("seq").get<std::uint64_t>() ==
        steps[n - 3].at("seq").get<std::uint64_t>() + 2);
  CHECK(same_on_every_rank(digest(steps)));
}

TEST_CASE("TD_FLIGHT_RECORDER=0 keeps no entries", "[flight][off]") {
  if (!recorder_off()) return;
  td::ProcessGroup g = fresh_group();
  TensorDict d;
  d.set("x", Tensor::full<float>({4}, 1.f));
  d.all_reduce(ReduceOp::SUM, {.group = g});
  const json doc = dump();
  CHECK(doc.at("capacity") == 0);
  CHECK(doc.at("entries").empty());
  // The groups and their sequence numbers are still kept (the diagnosis uses them).
  bool found = false;
  for (const json& gr : doc.at("groups"))
    if (gr.at("id").get<std::uint64_t>() == newest_group(doc)) {
      found = true;
      CHECK(gr.at("next_seq") == 2);
    }
  CHECK(found);
}

TEST_CASE("a TimeoutError made by the caller has no diagnosis", "[flight]") {
  const td::TimeoutError plain("x");
  CHECK(plain.diagnosis().empty());
  td::RankStatus s;
  s.rank = 1;
  s.state = td::RankStatus::State::Outside;
  const td::TimeoutError with("y", {s});
  REQUIRE(with.diagnosis().size() == 1);
  CHECK(with.diagnosis()[0].state == td::RankStatus::State::Outside);
  const td::TimeoutError copy = with;  // copies share the entries
  CHECK(&copy.diagnosis() == &with.diagnosis());
}
