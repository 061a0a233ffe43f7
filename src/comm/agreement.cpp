// The agreement across ranks (one fingerprint collective before any data moves; the same
// exception on every rank after a mismatch), plan lookup and prepare_collective.
#include <algorithm>
#include <climits>
#include <cstring>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "comm/engine_internal.hpp"
#include "comm/executor.hpp"
#include "core/config.hpp"
#include "runtime/deadline.hpp"
#include "runtime/log.hpp"
#include "runtime/nbc_tuning.hpp"

namespace td::detail {

namespace {

std::string cap_str(std::optional<std::size_t> cap) {
  if (!cap) return "none";
  if (*cap == kAutoBucketBytes) return "auto";
  return std::to_string(*cap);
}

}  // namespace

// Everything a call's ranks must agree on besides the layout, as one line: the arguments and
// options that change which MPI calls run (async_op: nonblocking calls do not match blocking
// ones) and the settings read from each process's environment that do the same.
std::string call_header(const CollectiveCall& call, std::optional<std::size_t> cap, bool async_op,
                        Compression compression, int group_size) {
  std::string h = fmt::format("{}(", call.name);
  if (reduces(call.kind)) h += fmt::format("op={}, ", name(call.op));
  if (has_root(call.kind)) h += fmt::format("{}={}, ", root_name(call.kind), call.root);
  h += fmt::format("bucket_bytes={}, async_op={}", cap_str(cap), async_op);
  if (compression != Compression::None) h += fmt::format(", compression={}", name(compression));
  h += fmt::format(") in a group of {}", group_size);
  const Config& c = config();
  h += fmt::format(" with TD_CHECK_LAYOUT={} TD_SYNC_PIPELINE={} TD_HIERARCHICAL={}",
                   int{c.check_layout}, int{c.sync_pipeline},
                   c.hierarchical == 2   ? std::string("auto")
                   : c.hierarchical == 3 ? std::string("leaders")
                                         : std::to_string(c.hierarchical));
  return h;
}

std::vector<std::string> split_lines(const std::string& s) {
  std::vector<std::string> out;
  std::size_t start = 0, pos;
  while ((pos = s.find('\n', start)) != std::string::npos) {
    out.push_back(s.substr(start, pos - start));
    start = pos + 1;
  }
  if (start < s.size()) out.push_back(s.substr(start));
  return out;
}

// Lists which ranks hold which text: "rank 0, 2: float32[3]; rank 1: int64[3]".
std::string by_rank(const std::vector<std::string>& texts) {
  std::vector<std::pair<std::string, std::vector<int>>> groups;
  for (std::size_t r = 0; r < texts.size(); ++r) {
    auto it = std::find_if(groups.begin(), groups.end(),
                           [&](const auto& g) { return g.first == texts[r]; });
    if (it == groups.end()) {
      groups.push_back({texts[r], {static_cast<int>(r)}});
    } else {
      it->second.push_back(static_cast<int>(r));
    }
  }
  std::string out;
  for (const auto& [text, ranks] : groups) {
    if (!out.empty()) out += "; ";
    out += fmt::format("rank{} {}: {}", ranks.size() > 1 ? "s" : "", fmt::join(ranks, ", "), text);
  }
  return out;
}

// Slow path after a failed fingerprint check: every rank gathers every rank's description and
// throws the same error.
[[noreturn]] void explain_disagreement(GroupState& g, const CollectiveCall& call,
                                       const std::string& header, const std::string& arg_error,
                                       std::span<const LeafRef> leaves, const Analysis& a,
                                       Clock::time_point deadline) {
  std::string desc = header + "\n" + arg_error + "\n";
  for (const std::string& line : describe_leaves(leaves, &a.layout)) desc += line + "\n";
  // Everything the two gathers touch, in one hold (leaked, not freed, if they time out).
  struct Gathered {
    int my_len = 0;
    std::vector<int> lens, displs;
    std::string mine, all;
  };
  auto gathered = std::make_shared<Gathered>();
  Gathered& x = *gathered;
  x.mine = desc;
  x.my_len = static_cast<int>(desc.size());
  x.lens.resize(static_cast<std::size_t>(g.size));
  const std::function<std::string()> describe = [&] {
    return fmt::format(
        "{}: ranks disagree on the layout, and gathering the details did not complete", call.name);
  };
  post_and_wait(control(allgather_call(&x.my_len, 1, MPI_INT, x.lens.data(), 1, MPI_INT, g.comm)),
                deadline, describe, gathered);
  x.displs.assign(x.lens.size(), 0);
  for (std::size_t r = 1; r < x.lens.size(); ++r) x.displs[r] = x.displs[r - 1] + x.lens[r - 1];
  x.all.assign(static_cast<std::size_t>(x.displs.back()) + static_cast<std::size_t>(x.lens.back()),
               '\0');
  post_and_wait(control(allgatherv_call(x.mine.data(), x.my_len, MPI_CHAR, x.all.data(),
                                        x.lens.data(), x.displs.data(), MPI_CHAR, g.comm)),
                deadline, describe, gathered);
  const std::vector<int>& lens = x.lens;
  const std::vector<int>& displs = x.displs;
  const std::string& all = x.all;

  std::vector<std::vector<std::string>> lines;
  for (std::size_t r = 0; r < lens.size(); ++r)
    lines.push_back(split_lines(
        all.substr(static_cast<std::size_t>(displs[r]), static_cast<std::size_t>(lens[r]))));
  const std::size_t ranks = lines.size();
  auto line_at = [&](std::size_t r, std::size_t i) {
    return i < lines[r].size() ? lines[r][i] : std::string();
  };

  // Bad arguments anywhere: every rank reports the first rank's error as std::invalid_argument.
  for (std::size_t r = 0; r < ranks; ++r) {
    const std::string err = line_at(r, 1);
    if (!err.empty())
      throw std::invalid_argument(
          fmt::format("{}: invalid argument on rank {}: {}", call.name, r, err));
  }
  std::vector<std::string> headers;
  for (std::size_t r = 0; r < ranks; ++r) headers.push_back(line_at(r, 0));
  if (std::adjacent_find(headers.begin(), headers.end(), std::not_equal_to<>()) != headers.end())
    throw LayoutMismatchError(fmt::format("{}: ranks called different collectives or arguments: {}",
                                          call.name, by_rank(headers)));

  // The leaf lines only (after the header and the error line).
  for (auto& l : lines)
    l.erase(l.begin(), l.begin() + static_cast<std::ptrdiff_t>(std::min<std::size_t>(2, l.size())));
  if (const auto diff = first_difference(lines)) {
    std::vector<std::string> holds = diff->holds;
    for (auto& h : holds)
      if (h.empty()) h = "no such key";
    // The gathers' usual cause: data of a different size on every rank (ragged rollouts).
    const bool gathers =
        call.kind == CollectiveKind::AllGather || call.kind == CollectiveKind::Gather;
    throw LayoutMismatchError(fmt::format(
        "{}: the ranks' TensorDicts differ at key '{}': {} (no data was sent){}", call.name,
        diff->key, by_rank(holds),
        gathers ? "; dicts whose keys or shapes differ per rank (e.g. rollouts of different "
                  "lengths) are gathered by td::gather_dicts / td::all_gather_dicts, which need "
                  "no common layout"
                : ""));
  }
  throw LayoutMismatchError(
      fmt::format("{}: the ranks' layouts hash differently but print identically", call.name));
}

// One small collective: do all ranks hold the same fingerprint? (MAX of h and of ~h: both equal
// the local values on every rank exactly when all fingerprints are equal.) The same MAX says
// whether every rank's leaves are one span per dtype (returned; no extra message).
bool agree(GroupState& g, const CollectiveCall& call, std::optional<std::size_t> cap,
           const CollectiveOptions& opts, const std::string& arg_error,
           std::span<const LeafRef> leaves, const Analysis& a, Clock::time_point deadline) {
  const std::string header = call_header(call, cap, opts.async_op, opts.compression, g.size);
  // TD_CHECK_LAYOUT=0 leaves the layout out of the fingerprint (not the round itself: the
  // arguments, the settings and local errors are still agreed, and the message sequence of a
  // call is the same whatever the setting).
  std::uint64_t h = config().check_layout ? a.layout_hash : 0x6c61796f7574ull;
  for (unsigned char c : header) h = mix(h, c);
  for (unsigned char c : arg_error) h = mix(h, c);
  // Three words, padded with zeros (MAX's identity) so that libnbc keeps its tree on 4, 8...
  // ranks (runtime/nbc_tuning.hpp).
  const int words = padded_count(3, g.size);
  auto buf = std::make_shared<std::vector<std::uint64_t>>(static_cast<std::size_t>(words), 0);
  (*buf)[0] = h;
  (*buf)[1] = ~h;
  (*buf)[2] = a.memory->one_span_per_dtype ? 0 : 1;
  post_and_wait(
      control(allreduce_call(MPI_IN_PLACE, buf->data(), words, MPI_UINT64_T, MPI_MAX, g.comm)),
      deadline,
      [&] {
        return fmt::format(
            "{}: not every rank of the group of {} joined the collective (first key '{}')",
            call.name, g.size, leaves.empty() ? std::string("<none>") : leaves[0].key->str());
      },
      buf);
  if ((*buf)[0] != h || (*buf)[1] != ~h)
    explain_disagreement(g, call, header, arg_error, leaves, a, deadline);
  return (*buf)[2] == 0;
}

std::shared_ptr<const BucketPlan> plan_for(GroupState& g, const Analysis& a,
                                           std::optional<std::size_t> cap,
                                           std::size_t direct_bytes) {
  std::uint64_t key = mix(mix(a.layout_hash, cap ? *cap : 0x7fffffffffffffffull), direct_bytes);
  std::lock_guard lock(g.mu);
  auto it = g.plans.find(key);
  if (it != g.plans.end()) {
    note_plan(true);
    return it->second;
  }
  auto plan = std::make_shared<const BucketPlan>(BucketPlan::build(a.layout, cap, 0, direct_bytes));
  if (g.plans.size() > 256) g.plans.clear();  // a program cycling through many layouts
  g.plans.emplace(key, plan);
  note_plan(false);
  return plan;
}

namespace {
// Whether the group already resolved kAutoBucketBytes (then nothing is left to measure).
bool tuned_already(GroupState& g) {
  std::lock_guard lock(g.mu);
  return g.tuned.has_value();
}
}  // namespace

std::optional<std::size_t> requested_cap(const CollectiveOptions& opts, bool from_dict) {
  if (!from_dict) return std::nullopt;
  return opts.bucket_bytes ? opts.bucket_bytes : config().bucket_bytes;
}

PreparedCollective prepare_collective(std::span<const LeafRef> leaves, const CollectiveCall& call,
                                      const CollectiveOptions& opts, std::string extra_arg_error,
                                      LayoutCache* cache) {
  std::shared_ptr<GroupState> g = group_of(opts);
  g->checked_comm(call.name);
  const auto timeout = timeout_of(opts);
  std::string arg_error;
  note_error(arg_error, timeout_problem(timeout));
  // A bad timeout still needs a deadline for the agreement that reports it.
  const auto deadline = deadline_after(timeout.count() > 0 ? timeout : timeout_of({}));

  std::optional<std::size_t> cap = requested_cap(opts, call.from_dict);
  Analysis scratch;
  const Analysis& a = analyse_cached(leaves, cache, scratch);
  // The call takes its sequence number before the agreement: a rank stuck in it is in the call.
  const std::string first_key = leaves.empty() ? std::string() : leaves[0].key->str();
  CallSummary summary;
  summary.first_key = first_key;
  summary.leaves = leaves.size();
  summary.bytes = a.total_bytes;
  summary.dtype_mask = a.dtype_mask;
  summary.root = has_root(call.kind) ? call.root : -1;
  summary.reduce_op = reduces(call.kind) ? static_cast<int>(call.op) : -1;
  summary.bucket_bytes = cap.value_or(0);
  summary.async = opts.async_op;
  CallScope scope(*g, call.name, CallKind::Collective, summary);
  note_error(arg_error, a.arg_error);
  note_error(arg_error, check_ops(leaves, a, call));
  note_error(arg_error, bucket_bytes_problem(cap));
  if (has_root(call.kind))
    note_error(arg_error, rank_problem(root_name(call.kind), call.root, g->size));
  if (opts.compression != Compression::None) {
    if (call.kind != CollectiveKind::AllReduce && call.kind != CollectiveKind::Reduce)
      note_error(arg_error, fmt::format("compression {} applies to all_reduce and reduce only",
                                        name(opts.compression)));
    else if (call.op != ReduceOp::SUM && call.op != ReduceOp::AVG)
      note_error(arg_error, fmt::format("compression {} supports SUM and AVG, not {}",
                                        name(opts.compression), name(call.op)));
  }
  if (!extra_arg_error.empty()) note_error(arg_error, std::move(extra_arg_error));
  // The agreement always runs in a group of several ranks: it is what makes a local error, a
  // differing argument or setting, the same error on every rank instead of a hang.
  bool spans_everywhere = a.memory->one_span_per_dtype;
  if (g->size > 1) spans_everywhere = agree(*g, call, cap, opts, arg_error, leaves, a, deadline);
  scope.agreed();
  if (!arg_error.empty()) throw std::invalid_argument(fmt::format("{}: {}", call.name, arg_error));

  std::size_t direct_bytes = 0;
  auto data_deadline = deadline;
  // The path first: the bucket size is tuned on the path the messages take. Every rank agreed on
  // TD_HIERARCHICAL, so every rank measures or none does.
  if ((call.kind == CollectiveKind::AllReduce || call.kind == CollectiveKind::Reduce ||
       call.kind == CollectiveKind::Broadcast) &&
      choose_message_path(*g, deadline, timeout))
    data_deadline = deadline_after(timeout.count() > 0 ? timeout : timeout_of({}));
  if (cap && *cap == kAutoBucketBytes) {
    // Checked only until the group has measured: a tuned group pays nothing per call.
    // (The analysis's byte count, cached with the dict: a walk of the leaves here cost a dict of
    // 16384 empty leaves 30 us per call.)
    if (!tuned_already(*g) && a.total_bytes <= smallest_candidate_cap()) {
      // Every candidate cap packs this dict the same way (one bucket per dtype): nothing to
      // measure. The layout is agreed, so every rank takes this branch or none does.
      cap = smallest_candidate_cap();
    } else {
      const TunedBuckets tuned = tuned_buckets(*g, deadline, timeout);
      cap = tuned.cap;
      direct_bytes = tuned.direct_bytes;
      // The timeout measures how long the ranks wait for each other, not the library's own
      // measurement of the machine (which only the first auto-tuned call of a group pays).
      data_deadline = deadline_after(timeout.count() > 0 ? timeout : timeout_of({}));
    }
  }
  auto plan = plan_for(*g, a, cap, direct_bytes);
  log_debug([&] {
    return fmt::format("{}: {}", call_header(call, cap, opts.async_op, opts.compression, g->size),
                       plan->describe());
  });
  return {std::move(g),
          std::move(plan),
          data_deadline,
          a.memory,
          spans_everywhere && cap.has_value(),
          std::move(scope)};
}

}  // namespace td::detail
