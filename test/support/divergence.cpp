#include "divergence.hpp"

#include <mpi.h>

#include <cctype>
#include <cstdio>
#include <numeric>
#include <sstream>

namespace tdtest::divergence {

std::string lower(std::string s) {
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

void Watchdog::run() {
  std::unique_lock lock(mu_);
  while (!stop_) {
    cv_.wait_for(lock, 200ms);
    if (stop_ || !armed_ || Clock::now() - since_ < limit_) continue;
    const auto seconds = std::chrono::duration_cast<std::chrono::seconds>(limit_).count();
    std::fprintf(stderr,
                 "[rank %d] divergence test: stuck for %lld s %s (a hang: no timeout caught it)\n"
                 "[rank %d]   %s%s\n[rank %d] ending the job\n",
                 rank_, static_cast<long long>(seconds), phase_.c_str(), rank_, round_.c_str(),
                 note_.c_str(), rank_);
    std::fflush(stderr);
    MPI_Abort(MPI_COMM_WORLD, 3);
  }
}

const char* exc_name(Exc e) {
  switch (e) {
    case Exc::None:
      return "no exception";
    case Exc::LayoutMismatch:
      return "td::LayoutMismatchError";
    case Exc::InvalidArgument:
      return "std::invalid_argument";
    case Exc::Timeout:
      return "td::TimeoutError";
    case Exc::Mpi:
      return "td::MpiError";
    case Exc::Key:
      return "td::KeyError";
    case Exc::OtherTd:
      return "td::Error";
    case Exc::Other:
      return "another std::exception";
  }
  return "?";
}

std::string expectation_str(const Expectation& e) {
  std::string out = e.expect == Expect::Correct ? "the correct result on every rank"
                    : e.expect == Expect::Error ? "an error on every rank"
                                                : "the correct result, or an error on every rank";
  if (e.expect != Expect::Correct) {
    out += " (";
    for (std::size_t i = 0; i < e.allowed.size(); ++i)
      out += (i ? " or " : "") + std::string(exc_name(e.allowed[i]));
    out += e.same_class ? ", the same on every rank" : "";
    if (!e.keywords.empty()) {
      out += ", naming ";
      for (std::size_t i = 0; i < e.keywords.size(); ++i)
        if (std::find(e.keywords.begin(), e.keywords.begin() + static_cast<std::ptrdiff_t>(i),
                      e.keywords[i]) == e.keywords.begin() + static_cast<std::ptrdiff_t>(i))
          out += (i ? " or " : "") + std::string("'") + e.keywords[i] + "'";
      if (e.keyword_rank >= 0) out += " on rank " + std::to_string(e.keyword_rank);
    }
    out += ", within " + std::to_string(static_cast<int>(kPromptSeconds)) + " s)";
  }
  return out;
}

std::vector<Outcome> exchange(const Outcome& mine, int size) {
  std::vector<Outcome> all(static_cast<std::size_t>(size));
  MPI_Allgather(&mine, static_cast<int>(sizeof(Outcome)), MPI_BYTE, all.data(),
                static_cast<int>(sizeof(Outcome)), MPI_BYTE, MPI_COMM_WORLD);
  return all;
}

bool broke_group(const std::vector<Outcome>& all) {
  for (const Outcome& o : all) {
    const auto e = static_cast<Exc>(o.exc), f = static_cast<Exc>(o.followup_exc);
    if (e == Exc::Timeout || e == Exc::Mpi || f == Exc::Timeout || f == Exc::Mpi) return true;
    if (o.followup == 2) return true;  // wrong values: do not trust this group any more
  }
  return false;
}

std::string ranks_str(const std::vector<int>& ranks) {
  std::string out;
  for (int q : ranks) out += (out.empty() ? "" : ", ") + std::to_string(q);
  return out;
}

std::string judge(const Expectation& e, const std::vector<Outcome>& all, bool followed_up,
                  bool followup_may_fail_alike) {
  std::vector<int> threw, returned, timed_out, wrong;
  double slowest = 0;
  const int size = static_cast<int>(all.size());
  for (int q = 0; q < size; ++q) {
    const Outcome& o = all[static_cast<std::size_t>(q)];
    if (!o.participated) continue;
    const auto x = static_cast<Exc>(o.exc);
    (x == Exc::None ? returned : threw).push_back(q);
    if (x == Exc::Timeout) timed_out.push_back(q);
    if (x == Exc::None && !o.correct) wrong.push_back(q);
    if (x != Exc::None) slowest = std::max(slowest, o.seconds);
  }
  if (!timed_out.empty())
    return "rank(s) " + ranks_str(timed_out) +
           " raised td::TimeoutError: the promise is the result or a prompt error, never a wait "
           "for the timeout";
  if (!threw.empty() && !returned.empty())
    return "not every rank raised: rank(s) " + ranks_str(threw) + " raised, rank(s) " +
           ranks_str(returned) + " returned" + (wrong.empty() ? "" : " (with a wrong result)");
  if (threw.empty()) {
    if (!wrong.empty()) return "silently wrong result on rank(s) " + ranks_str(wrong);
    if (e.expect == Expect::Error) return "every rank returned, but this input must be an error";
  } else {
    if (e.expect == Expect::Correct)
      return "every rank raised, but this input must give the correct result";
    const auto first = static_cast<Exc>(all[static_cast<std::size_t>(threw[0])].exc);
    for (int q : threw) {
      const Outcome& o = all[static_cast<std::size_t>(q)];
      const auto x = static_cast<Exc>(o.exc);
      if (std::find(e.allowed.begin(), e.allowed.end(), x) == e.allowed.end())
        return "rank " + std::to_string(q) + " raised " + exc_name(x) + ", not an error class " +
               "promised for this input";
      if (e.same_class && x != first)
        return "ranks raised different classes: rank " + std::to_string(threw[0]) + " " +
               exc_name(first) + ", rank " + std::to_string(q) + " " + exc_name(x);
      if (!e.keywords.empty() && (e.keyword_rank < 0 || e.keyword_rank == q)) {
        const std::string msg = lower(o.what);
        const bool named = std::any_of(
            e.keywords.begin(), e.keywords.end(),
            [&](const std::string& k) { return msg.find(lower(k)) != std::string::npos; });
        if (!named) return "rank " + std::to_string(q) + "'s message does not name what differs";
      }
    }
    if (slowest > kPromptSeconds)
      return "an error took " + fmt::format("{:.1f}", slowest) + " s (promised promptly)";
  }
  if (followed_up) {
    // With a setting that differs for good (the environment), the next call differs too: the
    // same prompt error on every rank is then as good as a result.
    const Outcome& zero = all[0];
    bool alike = followup_may_fail_alike && zero.followup == 3;
    for (const Outcome& o : all)
      alike = alike && o.followup == 3 && o.followup_exc == zero.followup_exc &&
              o.followup_seconds < kPromptSeconds;
    for (int q = 0; q < size && !alike; ++q)
      if (all[static_cast<std::size_t>(q)].followup != 1)
        return "the group did not keep working afterwards (rank " + std::to_string(q) + ")";
  }
  return {};
}

std::string outcome_str(const Outcome& o) {
  std::ostringstream s;
  s << " ";
  if (!o.participated) {
    s << "idle";
  } else if (static_cast<Exc>(o.exc) == Exc::None) {
    s << (o.correct ? "correct result" : "WRONG result") << " after "
      << fmt::format("{:.2f}", o.seconds) << " s";
  } else {
    s << exc_name(static_cast<Exc>(o.exc)) << " after " << fmt::format("{:.2f}", o.seconds)
      << " s: " << o.what;
  }
  if (o.first_exc != 0)
    s << " (after a first attempt that raised " << exc_name(static_cast<Exc>(o.first_exc))
      << " after " << fmt::format("{:.2f}", o.first_seconds) << " s: " << o.first_what << ")";
  if (o.detail[0] != '\0') s << " [" << o.detail << "]";
  if (o.followup == 1) s << "; next calls ok";
  if (o.followup == 2) s << "; next calls gave WRONG values";
  if (o.followup == 3) s << "; next calls raised";
  return s.str();
}

std::string outcomes_str(const std::vector<Outcome>& all) {
  std::string out;
  for (int q = 0; q < static_cast<int>(all.size()); ++q)
    out += "\n  rank " + std::to_string(q) + ":" + outcome_str(all[static_cast<std::size_t>(q)]);
  return out;
}

std::string outcome_class(const std::vector<Outcome>& all) {
  for (const Outcome& o : all)
    if (o.participated && static_cast<Exc>(o.exc) != Exc::None)
      return std::string("error ") + exc_name(static_cast<Exc>(o.exc));
  return "correct";
}

namespace {
std::vector<int> all_ranks(int size) {
  std::vector<int> ranks(static_cast<std::size_t>(size));
  std::iota(ranks.begin(), ranks.end(), 0);
  return ranks;
}
}  // namespace

td::ProcessGroup fresh_group(int size, Watchdog& dog, const std::string& context) {
  td::ProcessGroup g = td::new_group(all_ranks(size));
  dog.arm("measuring kAutoBucketBytes for a new group" + context);
  dog.phase("in the measurement", kStuckWarmUp);
  td::TensorDict d;
  d.set("w", td::Tensor::zeros({4}, td::DType::Float32));
  // A TD_* setting that differs (the environment test) may make this call raise: fine here.
  (void)caught([&] {
    d.all_reduce(td::ReduceOp::SUM,
                 {.group = g, .bucket_bytes = td::kAutoBucketBytes, .timeout = kStuckWarmUp});
  });
  dog.disarm();
  return g;
}

}  // namespace tdtest::divergence
