// td-flight: reads the flight-recorder dumps of a job (TD_FLIGHT_RECORDER_DIR: rank-<r>.json,
// or files given one by one) and prints, per group, the first sequence number where the ranks
// differ: the ranks missing from it, and calls that differ in operation or layout at the same
// number. docs/reliability.md, "The dump and td-flight".
#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include "runtime/rank_list.hpp"

namespace fs = std::filesystem;
using nlohmann::json;
using td::detail::ranks_text;

namespace {

struct Entry {
  std::uint64_t seq = 0;
  std::string kind, op, first_key, state;
  std::uint64_t leaves = 0, bytes = 0;
  std::vector<std::string> dtypes;

  // What must be equal on every rank for the same call.
  std::string layout() const {
    return fmt::format("{} ('{}', {} leaves, {} bytes, {})", op, first_key, leaves, bytes,
                       fmt::join(dtypes, "/"));
  }
};

struct Dump {
  fs::path file;
  int rank = -1;
  std::string host, reason;
  std::int64_t dumped_at = 0;
  std::map<std::uint64_t, std::vector<Entry>> by_group;  // collective entries, in seq order
};

struct Group {
  std::string name;
  std::vector<int> world_ranks;
};

Dump read_dump(const fs::path& file, std::map<std::uint64_t, Group>& groups) {
  std::ifstream in(file);
  if (!in) throw std::runtime_error(fmt::format("cannot open '{}'", file.string()));
  const json doc = json::parse(in);
  if (doc.value("format", "") != "tensordict-mpi flight recorder")
    throw std::runtime_error(fmt::format("'{}' is not a flight-recorder dump", file.string()));
  if (doc.value("version", 0) != 1)
    throw std::runtime_error(
        fmt::format("'{}': unknown version {}", file.string(), doc.value("version", 0)));
  Dump d;
  d.file = file;
  d.rank = doc.at("rank").get<int>();
  d.host = doc.value("host", "");
  d.reason = doc.value("reason", "");
  d.dumped_at = doc.value("dumped_at", std::int64_t{0});
  for (const json& g : doc.at("groups")) {
    Group& group = groups[g.at("id").get<std::uint64_t>()];
    group.name = g.at("name").get<std::string>();
    group.world_ranks = g.at("world_ranks").get<std::vector<int>>();
  }
  for (const json& e : doc.at("entries")) {
    Entry x;
    x.kind = e.at("kind").get<std::string>();
    if (x.kind == "point_to_point") continue;  // two ranks only: not compared across the group
    x.seq = e.at("seq").get<std::uint64_t>();
    x.op = e.at("op").get<std::string>();
    x.first_key = e.value("first_key", "");
    x.state = e.value("state", "");
    x.leaves = e.value("leaves", std::uint64_t{0});
    x.bytes = e.value("bytes", std::uint64_t{0});
    x.dtypes = e.value("dtypes", std::vector<std::string>{});
    d.by_group[e.at("group").get<std::uint64_t>()].push_back(std::move(x));
  }
  for (auto& [id, entries] : d.by_group)
    std::sort(entries.begin(), entries.end(),
              [](const Entry& a, const Entry& b) { return a.seq < b.seq; });
  return d;
}

const Entry* find(const std::vector<Entry>& entries, std::uint64_t seq) {
  auto it = std::lower_bound(entries.begin(), entries.end(), seq,
                             [](const Entry& e, std::uint64_t s) { return e.seq < s; });
  return it != entries.end() && it->seq == seq ? &*it : nullptr;
}

std::string last_of(const std::vector<Entry>& entries) {
  if (entries.empty()) return "no call recorded on this group";
  const Entry& e = entries.back();
  return fmt::format("its last: #{} {}, {}", e.seq, e.layout(), e.state);
}

// Returns the number of groups where the ranks differ.
int analyse(const std::map<int, Dump>& dumps, const std::map<std::uint64_t, Group>& groups) {
  int differing = 0;
  for (const auto& [id, group] : groups) {
    std::vector<int> members = group.world_ranks, without_dump;
    for (int r : members)
      if (!dumps.count(r)) without_dump.push_back(r);
    std::printf("group %s (id %llu, world %s):\n", group.name.c_str(),
                static_cast<unsigned long long>(id), ranks_text(members).c_str());
    if (!without_dump.empty())
      std::printf(
          "  no dump from %s (dead, killed before it could write, or no "
          "TD_FLIGHT_RECORDER_DIR there)\n",
          ranks_text(without_dump).c_str());
    // The numbers every present rank's ring still covers, from the oldest kept by all.
    static const std::vector<Entry> kNone;
    std::uint64_t lo = 1, hi = 0;
    std::vector<int> present;
    for (int r : members) {
      auto it = dumps.find(r);
      if (it == dumps.end()) continue;
      present.push_back(r);
      auto g = it->second.by_group.find(id);
      const std::vector<Entry>& es = g != it->second.by_group.end() ? g->second : kNone;
      if (!es.empty()) {
        lo = std::max(lo, es.front().seq);
        hi = std::max(hi, es.back().seq);
      }
    }
    if (present.empty() || hi == 0) {
      std::printf("  no calls recorded\n");
      continue;
    }
    auto entries_of = [&](int r) -> const std::vector<Entry>& {
      auto g = dumps.at(r).by_group.find(id);
      return g != dumps.at(r).by_group.end() ? g->second : kNone;
    };
    bool found = false;
    for (std::uint64_t s = lo; s <= hi && !found; ++s) {
      std::map<std::string, std::vector<int>> by_layout;
      std::vector<int> missing;
      for (int r : present) {
        const Entry* e = find(entries_of(r), s);
        if (e) {
          by_layout[e->layout()].push_back(r);
        } else {
          missing.push_back(r);
        }
      }
      if (missing.empty() && by_layout.size() == 1) continue;
      found = true;
      ++differing;
      std::printf("  ranks agree on calls #%llu-#%llu; first difference at #%llu:\n",
                  static_cast<unsigned long long>(lo), static_cast<unsigned long long>(s - 1),
                  static_cast<unsigned long long>(s));
      for (const auto& [layout, ranks] : by_layout) {
        const Entry* e = find(entries_of(ranks.front()), s);
        std::printf("    %s: %s, %s\n", ranks_text(ranks).c_str(), layout.c_str(),
                    e->state.c_str());
      }
      for (int r : missing)
        std::printf("    rank %d: missing (%s)\n", r, last_of(entries_of(r)).c_str());
      if (by_layout.size() > 1)
        std::printf("  verdict: the ranks called different collectives (or layouts) at #%llu\n",
                    static_cast<unsigned long long>(s));
      else
        std::printf("  verdict: %s did not call #%llu (%s)\n", ranks_text(missing).c_str(),
                    static_cast<unsigned long long>(s), by_layout.begin()->first.c_str());
    }
    if (found) continue;
    // Same calls everywhere: any not finished?
    std::vector<int> stuck;
    for (int r : present) {
      const Entry* e = find(entries_of(r), hi);
      if (e && e->state != "completed") stuck.push_back(r);
    }
    if (!stuck.empty()) {
      ++differing;
      std::printf(
          "  every rank entered calls #%llu-#%llu alike; #%llu (%s) did not complete on "
          "%s: it stalled inside it (its data phase: a slow or lost link, or a rank "
          "stopped inside MPI)\n",
          static_cast<unsigned long long>(lo), static_cast<unsigned long long>(hi),
          static_cast<unsigned long long>(hi),
          find(entries_of(stuck.front()), hi)->layout().c_str(), ranks_text(stuck).c_str());
    } else {
      std::printf("  no difference: every rank completed calls #%llu-#%llu\n",
                  static_cast<unsigned long long>(lo), static_cast<unsigned long long>(hi));
    }
  }
  return differing;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::string> inputs(argv + 1, argv + argc);
  if (inputs.empty() || inputs[0] == "-h" || inputs[0] == "--help") {
    std::printf(
        "usage: td-flight DIR | FILE...\n"
        "Reads tensordict-mpi flight-recorder dumps (TD_FLIGHT_RECORDER_DIR: rank-<r>.json) and\n"
        "prints, per group, the first call where the ranks differ: the ranks missing from it and\n"
        "calls that differ in operation or layout. Exit status: 0 no difference, 1 some group\n"
        "differs or stalled, 2 unreadable input.\n");
    return inputs.empty() ? 2 : 0;
  }
  std::vector<fs::path> files;
  for (const std::string& in : inputs) {
    if (fs::is_directory(in)) {
      for (const auto& e : fs::directory_iterator(in)) {
        const std::string name = e.path().filename().string();
        if (name.rfind("rank-", 0) == 0 && e.path().extension() == ".json")
          files.push_back(e.path());
      }
    } else {
      files.emplace_back(in);
    }
  }
  std::sort(files.begin(), files.end());
  if (files.empty()) {
    std::fprintf(stderr, "td-flight: no rank-<r>.json dumps in %s\n",
                 fmt::format("{}", fmt::join(inputs, ", ")).c_str());
    return 2;
  }
  std::map<std::uint64_t, Group> groups;
  std::map<int, Dump> dumps;
  try {
    for (const fs::path& f : files) {
      Dump d = read_dump(f, groups);
      std::printf("%s: world rank %d on %s, written %s\n", f.filename().c_str(), d.rank,
                  d.host.c_str(), d.reason.c_str());
      dumps[d.rank] = std::move(d);
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "td-flight: %s\n", e.what());
    return 2;
  }
  const int differing = analyse(dumps, groups);
  return differing > 0 ? 1 : 0;
}
