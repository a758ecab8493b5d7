#include "actors/common/metrics.h"

#include <sys/resource.h>

#include <fmt/format.h>

#include <algorithm>
#include <map>
#include <set>

namespace tandem {

histogram::histogram(std::string name, std::string help, std::vector<double> bounds)
    : name_(std::move(name)),
      help_(std::move(help)),
      bounds_(std::move(bounds)),
      counts_(bounds_.size() + 1, 0) {}

void histogram::observe(double v) {
  size_t i = static_cast<size_t>(std::lower_bound(bounds_.begin(), bounds_.end(), v) - bounds_.begin());
  counts_[i] += 1;
  sum_ += v;
  count_ += 1;
}

std::vector<double> histogram::latency_ms_buckets() {
  return {1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 30000, 60000};
}

double stats_snapshot::value(const std::string& name) const {
  double s = 0;
  for (const auto& m : metrics)
    if (m.name == name) s += m.value;
  return s;
}

double stats_snapshot::value(const std::string& name, const std::string& labels) const {
  for (const auto& m : metrics)
    if (m.name == name && m.labels == labels) return m.value;
  return 0;
}

wire make_stats_wire(const std::string& actor, const std::vector<metric_sample>& metrics,
                     const std::vector<const histogram*>& histograms) {
  return make_reply([&](schema::Reply::Builder env) {
    auto r = env.initStatsReply();
    r.setActor(actor);
    auto ms = r.initMetrics(static_cast<unsigned>(metrics.size()));
    for (unsigned i = 0; i < metrics.size(); ++i) {
      ms[i].setName(metrics[i].name);
      ms[i].setLabels(metrics[i].labels);
      ms[i].setValue(metrics[i].value);
      ms[i].setKind(metrics[i].kind);
      ms[i].setHelp(metrics[i].help);
    }
    auto hs = r.initHistograms(static_cast<unsigned>(histograms.size()));
    for (unsigned i = 0; i < histograms.size(); ++i) {
      const auto& h = *histograms[i];
      hs[i].setName(h.name());
      hs[i].setHelp(h.help());
      auto b = hs[i].initBounds(static_cast<unsigned>(h.bounds().size()));
      for (unsigned j = 0; j < h.bounds().size(); ++j) b.set(j, h.bounds()[j]);
      auto c = hs[i].initCounts(static_cast<unsigned>(h.counts().size()));
      for (unsigned j = 0; j < h.counts().size(); ++j) c.set(j, h.counts()[j]);
      hs[i].setSum(h.sum());
      hs[i].setCount(h.count());
    }
  });
}

stats_snapshot read_stats(const wire& w) {
  wire_reader rd(w);
  auto env = rd.reply();
  if (!env.isStatsReply()) throw tandem::error(error_kind::failed, "expected a stats reply from the actor");
  auto r = env.getStatsReply();
  stats_snapshot s;
  s.actor = r.getActor().cStr();
  for (auto m : r.getMetrics())
    s.metrics.push_back(
        {m.getName().cStr(), m.getLabels().cStr(), m.getValue(), m.getKind().cStr(), m.getHelp().cStr()});
  for (auto h : r.getHistograms()) {
    histogram_sample hs;
    hs.name = h.getName().cStr();
    hs.help = h.getHelp().cStr();
    for (auto b : h.getBounds()) hs.bounds.push_back(b);
    for (auto c : h.getCounts()) hs.counts.push_back(c);
    hs.sum = h.getSum();
    hs.count = h.getCount();
    s.histograms.push_back(std::move(hs));
  }
  return s;
}

namespace {
std::string fmt_value(double v) {
  if (v == static_cast<double>(static_cast<int64_t>(v))) return fmt::format("{}", static_cast<int64_t>(v));
  return fmt::format("{}", v);
}
}  // namespace

std::string render_prometheus(const std::vector<stats_snapshot>& snapshots) {
  // Group samples by metric name so HELP/TYPE appear once per name.
  struct group {
    std::string kind, help;
    std::vector<std::string> lines;
  };
  std::map<std::string, group> groups;
  for (const auto& s : snapshots) {
    for (const auto& m : s.metrics) {
      auto full = "tandem_" + m.name;
      auto& g = groups[full];
      g.kind = m.kind;
      if (g.help.empty()) g.help = m.help;
      g.lines.push_back(m.labels.empty() ? fmt::format("{} {}", full, fmt_value(m.value))
                                         : fmt::format("{}{{{}}} {}", full, m.labels, fmt_value(m.value)));
    }
    for (const auto& h : s.histograms) {
      auto full = "tandem_" + h.name;
      auto& g = groups[full];
      g.kind = "histogram";
      g.help = h.help;
      uint64_t cum = 0;
      for (size_t i = 0; i < h.counts.size(); ++i) {
        cum += h.counts[i];
        auto le = i < h.bounds.size() ? fmt_value(h.bounds[i]) : std::string("+Inf");
        g.lines.push_back(fmt::format("{}_bucket{{le=\"{}\"}} {}", full, le, cum));
      }
      g.lines.push_back(fmt::format("{}_sum {}", full, fmt_value(h.sum)));
      g.lines.push_back(fmt::format("{}_count {}", full, h.count));
    }
  }
  std::string out;
  for (const auto& [name, g] : groups) {
    out += fmt::format("# HELP {} {}\n# TYPE {} {}\n", name, g.help.empty() ? name : g.help, name, g.kind);
    for (const auto& l : g.lines) out += l + "\n";
  }
  return out;
}

double process_cpu_seconds() {
  rusage u{};
  if (::getrusage(RUSAGE_SELF, &u) != 0) return 0;
  auto sec = [](const timeval& t) { return double(t.tv_sec) + double(t.tv_usec) / 1e6; };
  return sec(u.ru_utime) + sec(u.ru_stime);
}

}  // namespace tandem
