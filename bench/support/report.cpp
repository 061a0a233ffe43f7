// What the benchmarks report (report.hpp).
#include "report.hpp"

#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <set>
#include <stdexcept>
#include <string_view>
#include <utility>

#include <fmt/format.h>

namespace td_bench {

namespace {

std::string ratio_str(double r) { return r > 0 ? fmt::format("{:.2f}x", r) : std::string("-"); }

/// `set <axis>tics (...)` with labels "<value><suffix>" ("%g" of the value).
std::string tics_command(const std::string& axis, const std::vector<double>& ticks,
                         const std::string& suffix) {
  std::string list;
  for (double v : ticks)
    list += fmt::format("{}'{:g}{}' {:.6g}", list.empty() ? "" : ", ", v, suffix, v);
  return fmt::format("set {}tics ({})\n", axis, list);
}

/// The y range of a panel whose values span [lo, hi]: the top part left free for the key.
std::pair<double, double> panel_yrange(double lo, double hi, std::size_t key_lines) {
  const double bottom = lo / 1.4;
  const double span = std::max(hi / bottom, 1.5);
  // On a log axis the key takes a fixed fraction of the height: raise the top by that fraction.
  const double key_fraction = std::min(0.6, 0.07 * static_cast<double>(key_lines) + 0.05);
  const double top = bottom * std::pow(span * 1.15, 1.0 / (1.0 - key_fraction));
  return {bottom, top};
}

/// `s` for the inside of a gnuplot double-quoted string, where backslash escapes apply.
std::string gp_escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (c == '\\' || c == '"') out += '\\';
    out += c;
  }
  return out;
}

std::string gp_quote(const std::string& s) {
  std::string out = "'";
  for (char c : s) out += c == '\'' ? std::string("''") : std::string(1, c);
  return out + "'";
}

}  // namespace

std::string speed_phrase(double seconds, double baseline_seconds, const std::string& than) {
  if (!(seconds > 0) || !(baseline_seconds > 0)) return "not comparable with " + than;
  const double faster = baseline_seconds / seconds;
  if (faster >= 0.995 && faster < 1.005) return fmt::format("as fast as {} (1.00x)", than);
  if (faster >= 1) return fmt::format("{:.2f}x faster than {}", faster, than);
  return fmt::format("{:.2f}x slower than {}", 1 / faster, than);
}

void print_workload(const WorkloadResult& res, int ranks) {
  const Row* per_leaf = res.find(Role::PerLeaf);
  const Row* autob = res.find(Role::Auto);
  const double ideal = res.best_ideal();
  fmt::print("\n== {}: {} ({}), {} leaves, {} ({:.1f} MB), {} ranks\n", res.name, res.what,
             res.dtypes, res.leaves, human_bytes(static_cast<double>(res.bytes)),
             static_cast<double>(res.bytes) / 1e6, ranks);
  fmt::print("{:<36} {:>6} {:>11} {:>10} {:>8} {:>11} {:>9} {:>10}\n", "variant", "rounds",
             "median ms", "min ms", "GB/s", "speedup", "x ideal", "extra MiB");
  fmt::print("{}\n", std::string(36 + 7 + 12 + 11 + 9 + 12 + 10 + 11, '-'));
  for (const auto& r : res.rows) {
    const bool moves_data = r.role != Role::CheckPlan;
    const std::string gbps =
        moves_data && r.median > 0
            ? fmt::format("{:.3f}", static_cast<double>(res.bytes) / r.median / 1e9)
            : "-";
    const std::string speedup =
        moves_data && per_leaf && r.median > 0 ? ratio_str(per_leaf->median / r.median) : "-";
    const std::string vs_ideal = moves_data && ideal > 0 ? ratio_str(r.median / ideal) : "-";
    const std::string extra =
        r.packer ? fmt::format("{:.2f}", static_cast<double>(r.peak_extra) / 1048576.0) : "-";
    std::string note;
    if (r.role == Role::CheckPlan && autob && autob->median > 0)
      note = fmt::format("  = {:.1f}% of bucket auto", 100.0 * r.median / autob->median);
    if (r.plan_misses > 0) note += fmt::format("  ({} plan rebuilds while timed)", r.plan_misses);
    fmt::print("{:<36} {:>6} {:>11.3f} {:>10.3f} {:>8} {:>11} {:>9} {:>10}{}\n", r.label, r.rounds,
               r.median * 1e3, r.min * 1e3, gbps, speedup, vs_ideal, extra, note);
  }
  // Summary: best fixed bucket size, and auto against the ideal and per-leaf.
  const Row* best = nullptr;
  for (const auto& r : res.rows)
    if (r.role == Role::Bucket && (!best || r.median < best->median)) best = &r;
  std::string s = fmt::format("summary {}:", res.name);
  if (best)
    s += fmt::format(" best bucket {} ({:.3f} ms, {} ideal);", size_label(best->bucket),
                     best->median * 1e3, ratio_str(ideal > 0 ? best->median / ideal : 0));
  if (autob) {
    s += fmt::format(" auto {} ideal", ratio_str(ideal > 0 ? autob->median / ideal : 0));
    if (per_leaf) s += ", " + speed_phrase(autob->median, per_leaf->median, "per-leaf");
    s += ";";
  }
  if (const Row* floor = res.find(Role::CopyFloor); floor && autob && floor->median > 0)
    s += fmt::format(" auto {} copy floor;", ratio_str(autob->median / floor->median));
  if (const Row* c = res.find(Role::Consolidated))
    s += fmt::format(" consolidated {} ideal;", ratio_str(ideal > 0 ? c->median / ideal : 0));
  if (const Row* cp = res.find(Role::CheckPlan); cp && autob && autob->median > 0)
    s += fmt::format(" check+plan {:.3f} ms = {:.1f}% of auto", cp->median * 1e3,
                     100.0 * cp->median / autob->median);
  fmt::print("{}\n", s);
  if (res.storage_bytes > 0)
    fmt::print(
        "memory {}: {} in live tensor storages (every variant's copy); the storage pool "
        "holds {} beyond them ({:.1f}%), and {} of empty chunks kept for reuse\n",
        res.name, human_bytes(static_cast<double>(res.storage_bytes)),
        human_bytes(static_cast<double>(res.pool_extra_bytes)),
        100.0 * static_cast<double>(res.pool_extra_bytes) / static_cast<double>(res.storage_bytes),
        human_bytes(static_cast<double>(res.pool_spare_bytes)));
  std::fflush(stdout);
}

MachineInfo machine_info() {
  MachineInfo m;
  char host[256] = {};
  gethostname(host, sizeof host - 1);
  m.host = host;
  m.online_cpus = sysconf(_SC_NPROCESSORS_ONLN);
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof set, &set) == 0) m.bound_cpus = CPU_COUNT(&set);
  std::ifstream cpuinfo("/proc/cpuinfo");
  for (std::string line; std::getline(cpuinfo, line);) {
    if (line.rfind("model name", 0) == 0) {
      const auto colon = line.find(':');
      m.cpu = colon == std::string::npos ? line : line.substr(colon + 2);
      break;
    }
  }
  if (m.cpu.empty()) m.cpu = "unknown";
  char version[MPI_MAX_LIBRARY_VERSION_STRING] = {};
  int len = 0;
  MPI_Get_library_version(version, &len);
  m.mpi_version = std::string(version, static_cast<std::size_t>(std::max(len, 0)));
  m.mpi_version = m.mpi_version.substr(0, m.mpi_version.find('\n'));
  while (!m.mpi_version.empty() && (m.mpi_version.back() == '\0' || m.mpi_version.back() == ' '))
    m.mpi_version.pop_back();
  m.mpi_short = m.mpi_version.substr(0, m.mpi_version.find(','));
  std::ifstream thp("/sys/kernel/mm/transparent_hugepage/enabled");
  std::string thp_mode = "unknown";
  if (std::getline(thp, thp_mode)) {
    const auto lo = thp_mode.find('['), hi = thp_mode.find(']');
    if (lo != std::string::npos && hi != std::string::npos)
      thp_mode = thp_mode.substr(lo + 1, hi - lo - 1);
  }
  auto env_or = [](const char* name, const char* dflt) {
    const char* v = std::getenv(name);
    return std::string(v && *v ? v : dflt);
  };
  m.memory = fmt::format("THP {}; GLIBC_TUNABLES={}; TD_HUGEPAGES={}; TD_MALLOC_MMAP_THRESHOLD={}",
                         thp_mode, env_or("GLIBC_TUNABLES", "(unset)"), env_or("TD_HUGEPAGES", "1"),
                         env_or("TD_MALLOC_MMAP_THRESHOLD", "64 MiB"));
  return m;
}

void print_header(const MachineInfo& m, const Context& ctx, const Options& opt,
                  const std::string& dtype, const std::vector<BucketChoice>& buckets,
                  const AutoProbe& probe) {
  const std::string call = ctx.kind == Collective::AllReduce
                               ? "TensorDict::all_reduce"
                               : fmt::format("TensorDict::reduce(dst={})", kRoot);
  fmt::print("# bench: {} vs per-leaf and a pre-packed {}\n", call, ctx.mpi_call());
  fmt::print("# machine: {}, {} CPUs online (rank 0 may use {}), {}\n", m.host, m.online_cpus,
             m.bound_cpus, m.cpu);
  fmt::print("# MPI: {}\n", m.mpi_version);
  fmt::print("# memory: {}\n", m.memory);
  fmt::print("# tensordict-mpi {}, compiler {}\n", td::kVersion, __VERSION__);
  fmt::print("# ranks: {}; op: {}; dtype: {} (mixed: its own dtypes)\n", ctx.ranks,
             td::name(ctx.op), dtype);
  std::string bl;
  for (const auto& b : buckets)
    bl += (bl.empty() ? "" : ",") + (!b.bytes                           ? std::string("none")
                                     : *b.bytes == td::kAutoBucketBytes ? std::string("auto")
                                                                        : size_label(*b.bytes));
  fmt::print("# buckets: {}\n", bl);
  fmt::print("# bucket auto (td::kAutoBucketBytes) resolves to {} here (largest pack buffer of a\n",
             auto_label(probe));
  fmt::print(
      "#   probe with 4 KiB leaves); its first call took {:.1f} ms incl. any one-time tuning\n",
      probe.first_call * 1e3);
  if (opt.iters > 0) {
    fmt::print("# iterations: {} timed rounds per variant, {} warm-up\n", opt.iters, opt.warmup);
  } else {
    fmt::print("# iterations: per variant clamp(ceil({} s / fastest warm-up call), {}, {}) timed\n",
               opt.min_time, opt.min_rounds, opt.max_rounds);
    fmt::print("#   rounds (column 'rounds'), after {} warm-up rounds\n", std::max(opt.warmup, 1));
  }
  fmt::print(
      "{}",
      "# timings: median over rounds of the MAX over ranks of one call (MPI_Wtime, barrier\n"
      "#   before each call). Each round runs every variant once, in a freshly shuffled\n"
      "#   order (same on all ranks); each variant works on its own copy of the data.\n"
      "#   GB/s = payload bytes / median (algorithm bandwidth); 'speedup' = per-leaf median /\n"
      "#   median (below 1.00x: slower than per-leaf); 'x ideal' = median / the faster of the\n"
      "#   two 'ideal' rows (raw MPI on buffers packed in advance; lower is better, below\n"
      "#   1.00x: faster than both); 'extra MiB' = packer_stats().peak_extra_bytes (max over\n"
      "#   calls and ranks).\n"
      "#   Every variant was first checked against known values before being timed.\n");
  for (char** e = environ; e && *e; ++e)
    if (std::string_view(*e).substr(0, 3) == "TD_")
      fmt::print("# NOTE: environment {} (may change what is measured)\n", *e);
  std::fflush(stdout);
}

void write_csv(const std::string& path, const std::vector<WorkloadResult>& results, int ranks) {
  const std::filesystem::path p(path);
  if (p.has_parent_path()) std::filesystem::create_directories(p.parent_path());
  std::ofstream out(p);
  if (!out) throw std::runtime_error("cannot write " + path);
  out << "workload,variant,bucket_bytes,ranks,iters,median_ms,min_ms,gbps,speedup_vs_per_leaf,"
         "ratio_to_ideal,"
         "peak_extra_bytes\n";
  for (const auto& res : results) {
    const Row* per_leaf = res.find(Role::PerLeaf);
    const double ideal = res.best_ideal();
    for (const auto& r : res.rows) {
      const bool moves = r.role != Role::CheckPlan;
      out << fmt::format(
          "{},{},{},{},{},{:.6f},{:.6f},{},{},{},{}\n", res.name, r.id, r.csv_bucket, ranks,
          r.rounds, r.median * 1e3, r.min * 1e3,
          moves && r.median > 0
              ? fmt::format("{:.4f}", static_cast<double>(res.bytes) / r.median / 1e9)
              : "",
          moves && per_leaf && r.median > 0 ? fmt::format("{:.4f}", per_leaf->median / r.median)
                                            : "",
          moves && ideal > 0 ? fmt::format("{:.4f}", r.median / ideal) : "",
          r.packer ? std::to_string(r.peak_extra) : "");
    }
  }
}

std::vector<double> log_ticks(double lo, double hi) {
  static const std::vector<std::vector<double>> kSeries = {
      {1}, {1, 2, 5}, {1, 1.5, 2, 3, 5, 7}, {1, 1.2, 1.5, 2, 2.5, 3, 4, 5, 6, 8}};
  std::vector<double> out;
  if (!(lo > 0) || !(hi > lo)) return out;
  const int first = static_cast<int>(std::floor(std::log10(lo)));
  const int last = static_cast<int>(std::ceil(std::log10(hi)));
  for (const auto& series : kSeries) {
    out.clear();
    for (int e = first; e <= last; ++e)
      for (double m : series) {
        const double v = m * std::pow(10.0, e);
        if (v >= lo && v <= hi) out.push_back(v);
      }
    if (out.size() >= 4) break;
  }
  return out;
}

void write_samples(const std::string& path, const std::vector<WorkloadResult>& results) {
  const std::filesystem::path p(path);
  if (p.has_parent_path()) std::filesystem::create_directories(p.parent_path());
  std::ofstream out(p);
  if (!out) throw std::runtime_error("cannot write " + path);
  out << "workload,variant,round,ms\n";
  for (const auto& res : results)
    for (const auto& r : res.rows)
      for (std::size_t k = 0; k < r.samples.size(); ++k)
        out << fmt::format("{},{},{},{:.6f}\n", res.name, r.id, k, r.samples[k] * 1e3);
}

std::string write_plot(const std::string& dir, const std::string& stem, const PlotText& text,
                       const std::vector<WorkloadResult>& results,
                       const std::vector<BucketChoice>& buckets) {
  namespace fs = std::filesystem;
  fs::create_directories(dir);
  const fs::path dat = fs::absolute(fs::path(dir) / (stem + ".dat"));
  const fs::path gp = fs::absolute(fs::path(dir) / (stem + ".gp"));
  const fs::path png = fs::absolute(fs::path(dir) / (stem + ".png"));

  std::set<std::size_t> xs;
  for (const auto& b : buckets)
    if (b.bytes && *b.bytes != td::kAutoBucketBytes) xs.insert(*b.bytes);
  if (xs.empty()) xs.insert(kIdealChunkBytes);
  const double xmin = static_cast<double>(*xs.begin()) / 2,
               xmax = static_cast<double>(*xs.rbegin()) * 2;

  std::ofstream d(dat);
  d << "# median time / reference (the faster raw-MPI variant) per bucket size; one block per "
       "workload (gnuplot index)\n";
  std::vector<bool> has_points;
  for (const auto& res : results) {
    const double ref = res.best_ideal();
    d << "# " << res.name << ": bucket_bytes ratio_to_reference median_ms\n";
    bool any = false;
    for (const auto& r : res.rows) {
      if (r.role != Role::Bucket || ref <= 0) continue;
      d << fmt::format("{} {:.6g} {:.6g}\n", r.bucket, r.median / ref, r.median * 1e3);
      any = true;
    }
    if (!any) d << fmt::format("{} nan nan\n", *xs.begin());
    has_points.push_back(any);
    d << "\n\n";
  }
  d.close();

  const std::size_t panels = results.size() + (results.size() > 1 ? 1 : 0);
  const std::size_t cols = std::min<std::size_t>(3, panels), rows = (panels + cols - 1) / cols;
  constexpr int kSidePx = 90, kGapPx = 170, kPanelWidthPx = 430;
  const int width =
      2 * kSidePx + kPanelWidthPx * static_cast<int>(cols) + kGapPx * (static_cast<int>(cols) - 1);

  // The footnote: what the axes, the reference and each line are, wrapped to the figure's width.
  const std::string chunks = size_label(kIdealChunkBytes);
  const std::vector<std::string> paragraphs = {
      "Lower is better. Each panel is one workload (its leaves and dtypes in the panel title). "
      "Left axis: median time of one call divided by the panel's reference (log scale); right "
      "axis: the same time in ms.",
      fmt::format("Reference (1x): the faster of two raw-MPI baselines on buffers packed in "
                  "advance, one per dtype: one {0} per dtype, or the same buffers in {1} calls "
                  "('{1} chunks'). They copy and check nothing; a call can still land a little "
                  "below 1x, within run-to-run noise or where its message sizes suit MPI better.",
                  text.mpi_call, chunks),
      fmt::format("x axis: bucket_bytes, the largest packed message. per-leaf: one collective per "
                  "leaf (no bucket_bytes). auto: bucket_bytes = td::kAutoBucketBytes, tuned on "
                  "this machine ({}). consolidated: auto on a consolidate()d dict (one buffer "
                  "per dtype, nothing to pack).",
                  text.auto_size)};
  const auto line_chars = static_cast<std::size_t>((width - 30) / 7);
  std::vector<std::string> footnote;
  for (const auto& para : paragraphs) {
    std::string line;
    std::size_t start = 0;
    while (start < para.size()) {
      std::size_t end = para.find(' ', start);
      if (end == std::string::npos) end = para.size();
      const std::string word = para.substr(start, end - start);
      if (!line.empty() && line.size() + 1 + word.size() > line_chars) {
        footnote.push_back(line);
        line.clear();
      }
      line += (line.empty() ? "" : " ") + word;
      start = end + 1;
    }
    if (!line.empty()) footnote.push_back(line);
  }
  constexpr int kLinePx = 16, kAxisPx = 62, kHeaderPx = 80, kPanelPx = 420;
  const int footer_px = kAxisPx + kLinePx * static_cast<int>(footnote.size()) + 12;
  const int height = kHeaderPx + kPanelPx * static_cast<int>(rows) + footer_px;
  const double bottom_margin = static_cast<double>(footer_px) / height;
  const double top_margin = 1.0 - static_cast<double>(kHeaderPx) / height;

  std::ofstream s(gp);
  s << "# generated by bench_" << stem << ": gnuplot " << gp.string() << "\n";
  s << fmt::format(
      "if (strstrt(GPVAL_TERMINALS, 'pngcairo') > 0) {{\n"
      "  set terminal pngcairo size {0},{1} noenhanced font 'Sans,10'\n"
      "}} else {{\n"
      "  set terminal png size {0},{1} noenhanced\n"
      "}}\n",
      width, height);
  s << "set output " << gp_quote(png.string()) << "\n";
  s << "data = " << gp_quote(dat.string()) << "\n";
  for (std::size_t k = 0; k < footnote.size(); ++k) {
    const int y_px = 8 + kLinePx * static_cast<int>(footnote.size() - 1 - k);
    s << fmt::format("set label {} {} at screen 0.012, screen {:.4f} left font ',9.5'\n", k + 1,
                     gp_quote(footnote[k]), static_cast<double>(y_px) / height);
  }
  s << fmt::format(
      "set multiplot layout {},{} title \"{}\" font ',13' margins {:.4f}, {:.4f}, {:.4f}, {:.4f} "
      "spacing {:.4f}, {:.4f}\n",
      rows, cols, gp_escape(text.title) + "\\n" + gp_escape(text.subtitle),
      static_cast<double>(kSidePx) / width, 1.0 - static_cast<double>(kSidePx) / width,
      bottom_margin, top_margin, static_cast<double>(kGapPx) / width,
      static_cast<double>(kAxisPx + 40) / height);
  s << "set logscale x 2\nset logscale y 10\n";
  s << fmt::format("set xrange [{}:{}]\n", xmin, xmax);
  std::string tics;
  for (auto x : xs)
    tics += (tics.empty() ? "" : ", ") + gp_quote(size_label(x)) + " " + std::to_string(x);
  s << "set xtics (" << tics << ")\n";
  s << "set grid xtics ytics\nset key top right font ',9' opaque box samplen 3\n";
  s << "set xlabel 'bucket_bytes (largest packed message)'\n";
  s << "set ylabel 'time / reference (lower is better)'\n";
  const char* colors[] = {"#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd",
                          "#8c564b", "#e377c2", "#7f7f7f"};
  for (std::size_t i = 0; i < results.size(); ++i) {
    const auto& res = results[i];
    const double ref = res.best_ideal();
    s << fmt::format(
        "set title {}\n",
        gp_quote(fmt::format("{}: {} leaves, {} ({}); reference {:.3f} ms", res.name, res.leaves,
                             human_bytes(static_cast<double>(res.bytes)), res.dtypes, ref * 1e3)));
    std::vector<std::string> parts;
    if (has_points[i])
      parts.push_back(
          fmt::format("data index {} using 1:2 with linespoints lw 2 pt 7 ps 1.3 lc rgb '#1f77b4' "
                      "title 'bucket_bytes = x'",
                      i));
    double lo = 1, hi = 1;
    for (const auto& r : res.rows)
      if (r.role == Role::Bucket && ref > 0 && r.median > 0) {
        lo = std::min(lo, r.median / ref);
        hi = std::max(hi, r.median / ref);
      }
    auto hline = [&](Role role, const std::string& name, const char* color, int dash) {
      const Row* r = res.find(role);
      if (!r || ref <= 0 || r->median <= 0) return;
      const double ratio = r->median / ref;
      lo = std::min(lo, ratio);
      hi = std::max(hi, ratio);
      parts.push_back(fmt::format("{:.6g} with lines lw 2 dt {} lc rgb '{}' title {}", ratio, dash,
                                  color, gp_quote(fmt::format("{} ({:.2f}x)", name, ratio))));
    };
    hline(Role::PerLeaf, "per-leaf", "#d62728", 2);
    hline(Role::Auto, "auto (" + text.auto_size + ")", "#17becf", 4);
    hline(Role::Consolidated, "consolidated, auto", "#2ca02c", 3);
    hline(Role::Ideal, fmt::format("{} per dtype", text.mpi_call), "black", 1);
    hline(Role::IdealChunks, fmt::format("{} in {} chunks", text.mpi_call, chunks), "#7f7f7f", 5);
    const auto [bottom, top] = panel_yrange(lo, hi, parts.size());
    s << fmt::format("set yrange [{:.6g}:{:.6g}]\n", bottom, top);
    s << tics_command("y", log_ticks(bottom, top), "x");
    if (ref > 0) {
      // The right axis: the same range in ms.
      const double ms = ref * 1e3;
      s << fmt::format("set logscale y2 10\nset y2range [{:.6g}:{:.6g}]\n", bottom * ms, top * ms);
      s << tics_command("y2", log_ticks(bottom * ms, top * ms), "");
      s << "set y2label 'median time per call (ms)'\n";
    }
    s << "plot ";
    for (std::size_t k = 0; k < parts.size(); ++k) s << (k ? ", \\\n     " : "") << parts[k];
    s << "\n";
    if (i == 0)
      for (std::size_t k = 0; k < footnote.size(); ++k) s << "unset label " << k + 1 << "\n";
  }
  s << "unset y2tics\nunset y2label\nunset logscale y2\n";
  if (results.size() > 1) {
    double lo = 1, hi = 1;
    for (const auto& res : results)
      for (const auto& r : res.rows)
        if (r.role == Role::Bucket && res.best_ideal() > 0) {
          lo = std::min(lo, r.median / res.best_ideal());
          hi = std::max(hi, r.median / res.best_ideal());
        }
    s << "set title 'all workloads: bucketed time / each workload''s reference'\n";
    const auto [bottom, top] = panel_yrange(lo, hi, results.size() + 1);
    s << fmt::format("set yrange [{:.6g}:{:.6g}]\n", bottom, top);
    s << tics_command("y", log_ticks(bottom, top), "x");
    s << "plot ";
    bool first = true;
    for (std::size_t i = 0; i < results.size(); ++i) {
      if (!has_points[i]) continue;
      s << (first ? "" : ", \\\n     ")
        << fmt::format("data index {} using 1:2 with linespoints lw 2 pt 7 lc rgb '{}' title {}", i,
                       colors[i % std::size(colors)], gp_quote(results[i].name));
      first = false;
    }
    s << (first ? "" : ", \\\n     ") << "1 with lines lw 2 lc rgb 'black' title 'reference'\n";
  }
  s << "unset multiplot\n";
  s.close();

  if (std::system("command -v gnuplot >/dev/null 2>&1") != 0)
    return fmt::format("plot: gnuplot not found; skipped (script {}, data {})", gp.string(),
                       dat.string());
  const std::string cmd = "gnuplot \"" + gp.string() + "\"";
  if (std::system(cmd.c_str()) != 0) return fmt::format("plot: gnuplot failed on {}", gp.string());
  return fmt::format("plot: {} (script {})", png.string(), gp.string());
}

}  // namespace td_bench
