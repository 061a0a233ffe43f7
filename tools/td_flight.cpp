// td-flight: reads the flight-recorder dumps of a job (TD_FLIGHT_RECORDER_DIR: rank-<r>.json,
// or files given one by one) and prints, per group, the first sequence number where the ranks
// differ: the ranks missing from it, and calls that differ in operation or layout at the same
// number. docs/reliability.md, "The dump and td-flight".
//
// What one rank's dump says about call #s of a group is one of three things: the call (its
// entry); unknown, when the rank made it (s is below the group's next_seq in its dump) but its
// ring no longer holds it (older than the ring); or not called, when s is beyond the calls the
// rank made. A rank without a dump says nothing: its part is unknown, never "did not call".
#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
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
    return fmt::format("{} ({}, {} leaves, {} bytes, {})", op,
                       first_key.empty() ? "no key" : fmt::format("'{}'", first_key), leaves, bytes,
                       dtypes.empty() ? "no dtype" : fmt::format("{}", fmt::join(dtypes, "/")));
  }
};

// A call one of the dumping process's threads was inside.
struct Inside {
  std::uint64_t group = 0, seq = 0;
  std::string kind, op;
  std::int64_t entered = 0;
};

struct Dump {
  fs::path file;
  int rank = -1;
  std::string host, reason;
  std::int64_t dumped_at = 0, last_left = 0;  // ns; last_left 0: it never left the library
  std::map<std::uint64_t, std::vector<Entry>> by_group;  // collective entries, in seq order
  std::map<std::uint64_t, std::uint64_t> next_seq;       // per group (0: unknown)
  std::vector<Inside> inside;
};

struct Group {
  std::string name;
  std::vector<int> world_ranks;
};
using Groups = std::map<std::uint64_t, Group>;

std::string group_name(const Groups& groups, std::uint64_t id) {
  auto g = groups.find(id);
  return g != groups.end() ? g->second.name : fmt::format("group {}", id);
}

// "#3", "#1-#4", "#1, #3-#5".
std::string numbers_text(const std::vector<std::uint64_t>& seqs) {
  std::string out;
  for (std::size_t i = 0; i < seqs.size();) {
    std::size_t j = i;
    while (j + 1 < seqs.size() && seqs[j + 1] == seqs[j] + 1) ++j;
    if (!out.empty()) out += ", ";
    out += j == i ? fmt::format("#{}", seqs[i]) : fmt::format("#{}-#{}", seqs[i], seqs[j]);
    i = j + 1;
  }
  return out;
}

// ---- reading a dump ----

json parse_dump(const fs::path& file) {
  std::ifstream in(file);
  if (!in) throw std::runtime_error(fmt::format("cannot open '{}'", file.string()));
  json doc = json::parse(in);
  if (doc.value("format", "") != "tensordict-mpi flight recorder")
    throw std::runtime_error(fmt::format("'{}' is not a flight-recorder dump", file.string()));
  if (doc.value("version", 0) != 1)
    throw std::runtime_error(
        fmt::format("'{}': unknown version {}", file.string(), doc.value("version", 0)));
  return doc;
}

void read_groups(const json& doc, Dump& d, Groups& groups) {
  for (const json& g : doc.at("groups")) {
    const auto id = g.at("id").get<std::uint64_t>();
    Group& group = groups[id];
    group.name = g.at("name").get<std::string>();
    group.world_ranks = g.at("world_ranks").get<std::vector<int>>();
    d.next_seq[id] = g.value("next_seq", std::uint64_t{0});
  }
}

void read_entries(const json& doc, Dump& d) {
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
}

void read_inside(const json& doc, Dump& d) {
  for (const json& a : doc.value("in_library", json::array())) {
    Inside in;
    in.group = a.value("group", std::uint64_t{0});
    in.seq = a.value("seq", std::uint64_t{0});
    in.kind = a.value("kind", "");
    in.op = a.value("op", "");
    in.entered = a.value("t_entered", std::int64_t{0});
    d.inside.push_back(std::move(in));
  }
}

Dump read_dump(const fs::path& file, Groups& groups) {
  const json doc = parse_dump(file);
  Dump d;
  d.file = file;
  d.rank = doc.at("rank").get<int>();
  d.host = doc.value("host", "");
  d.reason = doc.value("reason", "");
  d.dumped_at = doc.value("dumped_at", std::int64_t{0});
  d.last_left = doc.value("t_last_left_library", std::int64_t{0});
  read_groups(doc, d, groups);
  read_entries(doc, d);
  read_inside(doc, d);
  return d;
}

// ---- one rank's record of one group ----

enum class Seen { Called, Unknown, NotCalled };

const Entry* find(const std::vector<Entry>& entries, std::uint64_t seq) {
  auto it = std::lower_bound(entries.begin(), entries.end(), seq,
                             [](const Entry& e, std::uint64_t s) { return e.seq < s; });
  return it != entries.end() && it->seq == seq ? &*it : nullptr;
}

struct Lane {
  int rank = -1;
  const Dump* dump = nullptr;
  const std::vector<Entry>* entries = nullptr;
  std::uint64_t made = 0;  // the calls it made on the group: #1 to #made

  const Entry* at(std::uint64_t seq) const { return find(*entries, seq); }
  Seen seen(std::uint64_t seq) const {
    if (at(seq)) return Seen::Called;
    return seq <= made ? Seen::Unknown : Seen::NotCalled;
  }
};

Lane lane_of(const Dump& d, std::uint64_t group) {
  static const std::vector<Entry> kNone;
  Lane l;
  l.rank = d.rank;
  l.dump = &d;
  auto g = d.by_group.find(group);
  l.entries = g != d.by_group.end() ? &g->second : &kNone;
  auto n = d.next_seq.find(group);
  const std::uint64_t next = n != d.next_seq.end() ? n->second : 0;
  l.made = std::max(l.entries->empty() ? 0 : l.entries->back().seq, next > 0 ? next - 1 : 0);
  return l;
}

// The calls it made that its ring no longer holds.
std::vector<std::uint64_t> unknown_numbers(const Lane& l) {
  std::vector<std::uint64_t> out;
  for (std::uint64_t s = 1; s <= l.made; ++s)
    if (!l.at(s)) out.push_back(s);
  return out;
}

std::string last_of(const Lane& l) {
  if (l.entries->empty())
    return l.made > 0 ? fmt::format("its last: #{}, older than its ring", l.made)
                      : std::string("no call on this group");
  const Entry& e = l.entries->back();
  return fmt::format("its last: #{} {}, {}", e.seq, e.layout(), e.state);
}

// Where the rank was when it wrote its dump.
std::string where_at_dump(const Dump& d, const Groups& groups) {
  if (!d.inside.empty()) {
    const Inside& in =
        *std::min_element(d.inside.begin(), d.inside.end(),
                          [](const Inside& a, const Inside& b) { return a.entered < b.entered; });
    return fmt::format("at its dump: in {} #{}{} on {}", in.op, in.seq,
                       in.kind == "point_to_point" ? " (point to point)" : "",
                       group_name(groups, in.group));
  }
  if (d.last_left == 0) return "at its dump: outside the library, no call made yet";
  return fmt::format("at its dump: outside the library for {:.1f} s",
                     static_cast<double>(d.dumped_at - d.last_left) / 1e9);
}

// ---- the ranks at one number ----

struct Called {
  std::string op;
  std::vector<int> ranks;
  std::map<std::string, std::vector<int>> states;
};

struct Step {
  std::map<std::string, Called> by_layout;
  std::vector<int> unknown, not_called;
  bool differs() const { return !not_called.empty() || by_layout.size() > 1; }
  bool all_called() const { return unknown.empty() && not_called.empty() && !by_layout.empty(); }
};

Step step_at(const std::vector<Lane>& lanes, std::uint64_t seq) {
  Step st;
  for (const Lane& l : lanes) {
    switch (l.seen(seq)) {
      case Seen::Called: {
        const Entry* e = l.at(seq);
        Called& c = st.by_layout[e->layout()];
        c.op = e->op;
        c.ranks.push_back(l.rank);
        c.states[e->state].push_back(l.rank);
        break;
      }
      case Seen::Unknown:
        st.unknown.push_back(l.rank);
        break;
      case Seen::NotCalled:
        st.not_called.push_back(l.rank);
        break;
    }
  }
  return st;
}

std::string states_text(const Called& c) {
  if (c.states.size() == 1) return c.states.begin()->first;
  std::vector<std::string> parts;
  for (const auto& [state, ranks] : c.states)
    parts.push_back(fmt::format("{} on {}", state, ranks_text(ranks)));
  return fmt::format("{}", fmt::join(parts, ", "));
}

std::string calls_text(std::uint64_t from, std::uint64_t to) {
  return from == to ? fmt::format("call #{}", from) : fmt::format("calls #{}-#{}", from, to);
}

std::string no_dump_note(const std::vector<int>& absent, const char* what) {
  if (absent.empty()) return {};
  return fmt::format("; {} left no dump: unknown whether {} {}", ranks_text(absent),
                     absent.size() == 1 ? "it" : "they", what);
}

std::string difference_verdict(const Step& st, std::uint64_t seq, const std::vector<int>& absent) {
  if (st.by_layout.size() > 1) {
    std::map<std::string, std::vector<int>> by_op;
    for (const auto& [layout, c] : st.by_layout)
      by_op[c.op].insert(by_op[c.op].end(), c.ranks.begin(), c.ranks.end());
    if (by_op.size() == 1)
      return fmt::format(
          "the ranks called {} at #{} with different layouts (keys, sizes or dtypes)",
          by_op.begin()->first, seq);
    std::vector<std::string> parts;
    for (auto& [op, ranks] : by_op) {
      std::sort(ranks.begin(), ranks.end());
      parts.push_back(fmt::format("{} {}", ranks_text(ranks), op));
    }
    return fmt::format("the ranks called different collectives at #{}: {}", seq,
                       fmt::join(parts, "; "));
  }
  const std::string missing = ranks_text(st.not_called);
  if (st.by_layout.empty())
    return fmt::format("{} did not call #{} (older than the other ranks' rings)", missing, seq);
  const Called& c = st.by_layout.begin()->second;
  std::string out =
      fmt::format("{} did not call #{} ({})", missing, seq, st.by_layout.begin()->first);
  if (c.op == "Reducer step")
    out += fmt::format(
        ": {} ran more Reducer steps than {} (ranks with uneven data need "
        "ReducerOptions::uneven_inputs and Reducer::join())",
        ranks_text(c.ranks), missing);
  return out + no_dump_note(absent, "called it");
}

void print_difference(const std::vector<Lane>& lanes, std::uint64_t seq, const Step& st,
                      std::uint64_t run, const std::vector<int>& absent, const Groups& groups) {
  if (run != 0)
    fmt::print("  ranks agree on {}; first difference at #{}:\n", calls_text(run, seq - 1), seq);
  else
    fmt::print("  first difference at #{} (no call in common before it):\n", seq);
  std::vector<std::pair<const std::string*, const Called*>> called;  // by their first rank
  for (const auto& [layout, c] : st.by_layout) called.emplace_back(&layout, &c);
  std::sort(called.begin(), called.end(),
            [](const auto& a, const auto& b) { return a.second->ranks < b.second->ranks; });
  for (const auto& [layout, c] : called)
    fmt::print("    {}: {}, {}\n", ranks_text(c->ranks), *layout, states_text(*c));
  for (const Lane& l : lanes) {
    if (l.seen(seq) == Seen::NotCalled)
      fmt::print("    rank {}: missing ({}; {})\n", l.rank, last_of(l),
                 where_at_dump(*l.dump, groups));
    else if (l.seen(seq) == Seen::Unknown)
      fmt::print("    rank {}: unknown (#{} is older than its ring)\n", l.rank, seq);
  }
  for (int r : absent) fmt::print("    rank {}: no dump\n", r);
  fmt::print("  verdict: {}\n", difference_verdict(st, seq, absent));
}

// No difference up to `hi`: did the last call complete everywhere? Returns whether it stalled.
bool print_end(const std::vector<Lane>& lanes, std::uint64_t hi, std::uint64_t run,
               const std::vector<int>& absent) {
  std::vector<int> stuck;
  const Entry* last = nullptr;
  for (const Lane& l : lanes) {
    const Entry* e = l.at(hi);
    if (e && e->state != "completed") {
      stuck.push_back(l.rank);
      last = e;
    }
  }
  const std::string with_dump = absent.empty() ? "" : " with a dump";
  if (stuck.empty()) {
    if (run != 0)
      fmt::print("  no difference: every rank{} completed {}\n", with_dump, calls_text(run, hi));
    else
      fmt::print(
          "  no difference where the rings overlap (up to #{}): every call they hold completed\n",
          hi);
    return false;
  }
  if (run != 0) fmt::print("  every rank{} made {} alike\n", with_dump, calls_text(run, hi));
  if (absent.empty())
    fmt::print(
        "  verdict: #{} ({}) did not complete on {}: it stalled inside it (its data phase: a slow "
        "or lost link, or a rank stopped inside MPI)\n",
        hi, last->layout(), ranks_text(stuck));
  else
    fmt::print(
        "  verdict: #{} ({}) did not complete on {}{} (dead, exited, or killed before it "
        "could write)\n",
        hi, last->layout(), ranks_text(stuck), no_dump_note(absent, "called it"));
  return true;
}

// Prints one group's comparison; returns whether its ranks differ or it stalled.
bool analyse_group(std::uint64_t id, const Group& group, const std::map<int, Dump>& dumps,
                   const Groups& groups) {
  fmt::print("group {} (id {}, world {}):\n", group.name, id, ranks_text(group.world_ranks));
  std::vector<Lane> lanes;
  std::vector<int> absent;
  for (int r : group.world_ranks) {
    auto it = dumps.find(r);
    if (it == dumps.end()) {
      absent.push_back(r);
    } else {
      lanes.push_back(lane_of(it->second, id));
    }
  }
  if (!absent.empty())
    fmt::print(
        "  no dump from {} (dead, killed before it could write, or no TD_FLIGHT_RECORDER_DIR "
        "there)\n",
        ranks_text(absent));
  std::uint64_t hi = 0;
  for (const Lane& l : lanes) hi = std::max(hi, l.made);
  if (hi == 0) {
    fmt::print("  no calls recorded\n");
    return false;
  }
  for (const Lane& l : lanes)
    if (const auto old = unknown_numbers(l); !old.empty())
      fmt::print("  rank {}'s ring no longer holds {} (older calls: unknown, not missing)\n",
                 l.rank, numbers_text(old));
  std::uint64_t run = 0;  // the first number of the run every rank called alike up to here
  for (std::uint64_t s = 1; s <= hi; ++s) {
    const Step st = step_at(lanes, s);
    if (st.differs()) {
      print_difference(lanes, s, st, run, absent, groups);
      return true;
    }
    if (!st.all_called()) {
      run = 0;
    } else if (run == 0) {
      run = s;
    }
  }
  return print_end(lanes, hi, run, absent);
}

std::vector<fs::path> dump_files(const std::vector<std::string>& inputs) {
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
  return files;
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
  const std::vector<fs::path> files = dump_files(inputs);
  if (files.empty()) {
    std::fprintf(stderr, "td-flight: no rank-<r>.json dumps in %s\n",
                 fmt::format("{}", fmt::join(inputs, ", ")).c_str());
    return 2;
  }
  Groups groups;
  std::map<int, Dump> dumps;
  try {
    for (const fs::path& f : files) {
      Dump d = read_dump(f, groups);
      fmt::print("{}: world rank {} on {}, written {}\n", f.filename().string(), d.rank, d.host,
                 d.reason);
      dumps[d.rank] = std::move(d);
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "td-flight: %s\n", e.what());
    return 2;
  }
  int differing = 0;
  for (const auto& [id, group] : groups)
    if (analyse_group(id, group, dumps, groups)) ++differing;
  return differing > 0 ? 1 : 0;
}
