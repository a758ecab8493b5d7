#pragma once
/// Metrics each actor keeps in its own state and reports on a stats query; the runtime
/// renders them in the Prometheus text format (names prefixed `tandem_`).
#include <cstdint>
#include <string>
#include <vector>

#include "actors/common/wire.h"

namespace tandem {

/// Fixed-bucket histogram (milliseconds in practice).
class histogram {
 public:
  histogram(std::string name, std::string help, std::vector<double> bounds);
  void observe(double v);
  const std::string& name() const { return name_; }
  const std::string& help() const { return help_; }
  const std::vector<double>& bounds() const { return bounds_; }
  const std::vector<uint64_t>& counts() const { return counts_; }  ///< per bucket, |bounds| + 1
  double sum() const { return sum_; }
  uint64_t count() const { return count_; }
  /// Default latency buckets in ms (1 ms .. 60 s).
  static std::vector<double> latency_ms_buckets();

 private:
  std::string name_, help_;
  std::vector<double> bounds_;
  std::vector<uint64_t> counts_;
  double sum_ = 0;
  uint64_t count_ = 0;
};

struct metric_sample {
  std::string name;    ///< without the tandem_ prefix
  std::string labels;  ///< e.g. `reason="queue_full"`, or empty
  double value = 0;
  std::string kind = "gauge";  ///< "counter" or "gauge"
  std::string help;
};

struct histogram_sample {
  std::string name, help;
  std::vector<double> bounds;
  std::vector<uint64_t> counts;
  double sum = 0;
  uint64_t count = 0;
};

/// One actor's answer to a stats query.
struct stats_snapshot {
  std::string actor;
  std::vector<metric_sample> metrics;
  std::vector<histogram_sample> histograms;
  /// Sum of the values of `name` (any labels); 0 if absent.
  double value(const std::string& name) const;
  /// Value of `name` with exactly `labels`; 0 if absent.
  double value(const std::string& name, const std::string& labels) const;
};

/// Serializes a stats reply.
wire make_stats_wire(const std::string& actor, const std::vector<metric_sample>& metrics,
                     const std::vector<const histogram*>& histograms);
/// Reads one (throws tandem::error if the message is not a stats reply).
stats_snapshot read_stats(const wire& w);

/// Prometheus text exposition: one `# HELP`/`# TYPE` per metric name.
std::string render_prometheus(const std::vector<stats_snapshot>& snapshots);

/// User + system CPU time of this process in seconds (0 if the kernel does not say).
double process_cpu_seconds();

}  // namespace tandem
