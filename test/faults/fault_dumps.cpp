// The flight recorder's dumps (issue 29), one way of writing them per run, at 2 ranks with
// TD_FLIGHT_RECORDER_DIR set; then the same program, without MPI, checks what the run left
// (test/faults/flight_dumps.sh):
//
//   fault_dumps run HOW                 under mpiexec: three calls on world, then HOW
//   fault_dumps check HOW DIR LOG       the files in DIR and the run's output LOG
//
//   sigusr1       each rank signals itself: SIGUSR1 writes its dump, the job goes on and ends
//   abort         rank 1 calls td::abort
//   uncaught      rank 1 lets an exception escape main (the terminate handler's td::abort)
//   watchdog      rank 1 agrees to a fourth call by hand and stalls: rank 0's watchdog aborts
//   explicit      rank 1 calls td::dump_flight_recorder(DIR/explicit-rank-1.json), one more
//                 call, then td::abort: the abort's dump is written once, the explicit file stays
//                 as it was
//   explicit_own  the same to DIR/rank-1.json, the automatic dump's own file: the abort leaves
//                 it as the program wrote it
//
// Every dump must parse and hold the calls made before it, in order, with their numbers.
#include <mpi.h>

#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>
#include <tensordict/tensordict.hpp>

#include "../support/agreement_peer.hpp"

namespace fs = std::filesystem;
using namespace std::chrono;

namespace {

// ---- the run ----

td::CollectiveOptions sync_options() {
  td::CollectiveOptions o;
  o.bucket_bytes = 1 << 20;  // not kAutoBucketBytes: tuning it is a collective of its own
  o.timeout = milliseconds(2000);
  return o;
}

td::TensorDict grads() {
  td::TensorDict d;
  d.set({"grad", "w"}, td::Tensor::full<float>({1000}, 1.f));
  d.set({"grad", "b"}, td::Tensor::full<float>({10}, 1.f));
  return d;
}

// World calls #1-#3, on every rank.
void three_calls(td::TensorDict& d) {
  d.all_reduce(td::ReduceOp::SUM, sync_options());
  td::barrier();
  td::Tensor t = td::Tensor::full<double>({4}, 1.0);
  td::broadcast(t, 0);
}

fs::path dir() { return std::getenv("TD_FLIGHT_RECORDER_DIR"); }

void wait_for(const fs::path& file) {
  const auto until = steady_clock::now() + seconds(20);
  while (!fs::exists(file) && steady_clock::now() < until)
    std::this_thread::sleep_for(milliseconds(10));
}

[[noreturn]] void killed_by_the_abort() {
  std::this_thread::sleep_for(seconds(30));
  std::_Exit(0);
}

int run(const std::string& how) {
  td::init_process_group();
  const int rank = td::get_rank();
  td::TensorDict d = grads();
  three_calls(d);
  if (how == "sigusr1") {
    std::raise(SIGUSR1);  // written by the library's thread, soon after
    wait_for(dir() / ("rank-" + std::to_string(rank) + ".json"));
    td::barrier();  // #4: after the dump
    td::destroy_process_group();
    return 0;
  }
  if (how == "watchdog") {
    if (rank == 1) {
      tdtest::agree_with_everything(td::world().comm());
      killed_by_the_abort();
    }
    d.all_reduce(td::ReduceOp::SUM, sync_options());  // #4: agreed, its data never comes
    return 1;
  }
  if (rank == 0) {  // outside the library until rank 1's abort ends the job
    if (how == "explicit" || how == "explicit_own") td::barrier();
    killed_by_the_abort();
  }
  if (how == "uncaught") throw std::runtime_error("boom after three calls");
  if (how == "explicit" || how == "explicit_own") {
    td::dump_flight_recorder(dir() / (how == "explicit" ? "explicit-rank-1.json" : "rank-1.json"));
    td::barrier();  // #4: after the explicit dump
  }
  td::abort("planned, after " + how, 3);
}

// ---- the check ----

int g_failures = 0;

void check(bool ok, const std::string& what) {
  if (!ok) {
    ++g_failures;
    std::printf("CHECK FAILED: %s\n", what.c_str());
  }
}

struct Expected {
  std::string reason;              // a part of its "reason"
  std::vector<std::string> calls;  // world's calls #1, #2, ..., in order
  std::string last_state = "completed";
  int written_lines = 1;  // "flight recorder written to <file>" lines in the log
};

const std::vector<std::string> kThree{"TensorDict.all_reduce", "barrier", "broadcast"};

std::map<std::string, Expected> expected_files(const std::string& how) {
  const std::vector<std::string> four_barrier{"TensorDict.all_reduce", "barrier", "broadcast",
                                              "barrier"};
  if (how == "sigusr1")
    return {{"rank-0.json", {"SIGUSR1", kThree}}, {"rank-1.json", {"SIGUSR1", kThree}}};
  if (how == "abort") return {{"rank-1.json", {"td::abort: planned, after abort", kThree}}};
  if (how == "uncaught")
    return {{"rank-1.json", {"td::abort: uncaught exception: boom after three calls", kThree}}};
  if (how == "watchdog")
    return {{"rank-0.json",
             {"the watchdog ends the job",
              {"TensorDict.all_reduce", "barrier", "broadcast", "TensorDict.all_reduce"},
              "moving data"}},
            {"rank-1.json", {"asked by world rank 0 after its timeout", kThree}}};
  if (how == "explicit")
    return {{"explicit-rank-1.json", {"td::dump_flight_recorder", kThree, "completed", 0}},
            {"rank-1.json", {"td::abort: planned, after explicit", four_barrier}}};
  if (how == "explicit_own")
    return {{"rank-1.json", {"td::dump_flight_recorder", kThree, "completed", 0}}};
  return {};
}

int count_lines(const std::string& log, const std::string& part) {
  std::ifstream in(log);
  int n = 0;
  for (std::string line; std::getline(in, line);)
    if (line.find(part) != std::string::npos) ++n;
  return n;
}

void check_file(const fs::path& file, const Expected& e, const std::string& log) {
  const std::string name = file.filename().string();
  nlohmann::json doc;
  try {
    std::ifstream in(file);
    doc = nlohmann::json::parse(in);
  } catch (const std::exception& ex) {
    check(false, name + " parses: " + ex.what());
    return;
  }
  check(doc.value("format", "") == "tensordict-mpi flight recorder", name + ": format");
  check(doc.value("version", 0) == 1, name + ": version");
  const std::string reason = doc.value("reason", "");
  check(reason.find(e.reason) != std::string::npos,
        name + ": reason '" + reason + "' has '" + e.reason + "'");
  std::vector<nlohmann::json> calls;
  for (const nlohmann::json& x : doc.at("entries"))
    if (x.at("group") == 0 && x.at("kind") != "point_to_point") calls.push_back(x);
  check(calls.size() == e.calls.size(), name + ": " + std::to_string(calls.size()) +
                                            " calls on world, expected " +
                                            std::to_string(e.calls.size()));
  for (std::size_t i = 0; i < calls.size() && i < e.calls.size(); ++i) {
    const std::string at = name + " call " + std::to_string(i + 1);
    check(calls[i].at("seq") == i + 1, at + ": its number");
    check(calls[i].at("op") == e.calls[i], at + ": " + calls[i].at("op").get<std::string>());
    const std::string state = i + 1 == e.calls.size() ? e.last_state : "completed";
    check(calls[i].at("state") == state, at + ": state " + calls[i].at("state").get<std::string>());
  }
  const int lines = count_lines(log, "flight recorder written to " + file.string());
  check(lines == e.written_lines, name + ": written " + std::to_string(lines) +
                                      " times, expected " + std::to_string(e.written_lines));
}

int check_run(const std::string& how, const fs::path& where, const std::string& log) {
  const auto expected = expected_files(how);
  check(!expected.empty(), "a known way: " + how);
  std::set<std::string> found, wanted;
  for (const auto& f : fs::directory_iterator(where)) found.insert(f.path().filename().string());
  for (const auto& [name, e] : expected) wanted.insert(name);
  std::string listing;
  for (const std::string& f : found) listing += " " + f;
  check(found == wanted, "the files in the directory:" + listing);
  for (const auto& [name, e] : expected)
    if (found.count(name)) check_file(where / name, e, log);
  std::printf("dumps %s: %s\n", how.c_str(), g_failures == 0 ? "ok" : "FAILED");
  return g_failures == 0 ? 0 : 1;
}

}  // namespace

// NOLINTNEXTLINE(bugprone-exception-escape): "run uncaught" lets one escape main on purpose
int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "";
  if (mode == "run" && argc == 3) return run(argv[2]);
  if (mode == "check" && argc == 5) return check_run(argv[2], argv[3], argv[4]);
  std::printf("usage: fault_dumps run HOW | check HOW DIR LOG\n");
  return 2;
}
