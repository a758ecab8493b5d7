#pragma once
/// An embedded cluster behind its own HTTP front end on a free port, for the benchmarks that
/// load a real server (`tandem bench soak` runs one in a child process).
#include <cstdlib>
#include <future>
#include <sstream>
#include <memory>
#include <string>
#include <thread>

#include "actors/runtime/embedded_cluster.h"
#include "tools/bench/modes.h"
#include "transport/rpc/front_end.h"

namespace tandem::cli {

class bench_cluster {
 public:
  explicit bench_cluster(const cluster_options& co) : cluster_(embedded_cluster::start(co)) {
    front_end_options fo;
    fo.http_port = 0;
    fo.rpc_port = -1;
    fo.lim = co.lim;
    fe_ = std::make_unique<front_end>(*cluster_, fo);
    std::promise<uint16_t> ready;
    auto port = ready.get_future();
    thread_ = std::thread([this, &ready] {
      bool reported = false;
      try {
        fe_->run([&](const listener_info& l) {
          if (l.what == "http") ready.set_value(l.port), reported = true;
        });
      } catch (...) {
        if (!reported) ready.set_exception(std::current_exception());
      }
    });
    try {
      port_ = port.get();
    } catch (...) {
      thread_.join();
      throw;
    }
  }
  ~bench_cluster() {
    fe_->stop();
    thread_.join();
    fe_.reset();
    cluster_.reset();
  }
  bench_cluster(const bench_cluster&) = delete;
  bench_cluster& operator=(const bench_cluster&) = delete;

  uint16_t port() const { return port_; }
  std::string metrics_text() const { return cluster_->metrics_text(); }
  embedded_cluster& cluster() { return *cluster_; }
  /// The non-zero series of `name` ("labels value" lines) in the node's /metrics text.
  std::string nonzero(const std::string& name) const {
    std::istringstream in(cluster_->metrics_text());
    std::string line, out;
    while (std::getline(in, line))
      if (line.rfind(name + "{", 0) == 0 && line.substr(line.rfind(' ') + 1) != "0")
        out += (out.empty() ? "" : ", ") + line.substr(name.size());
    return out;
  }
  /// A histogram's cumulative buckets (upper bound, count; the last is +Inf), its sum and count.
  struct hist {
    std::vector<std::pair<double, double>> buckets;
    double sum = 0, count = 0;
    /// The observations since `before` (same buckets): the upper bound of the bucket holding
    /// quantile `q` (a bucket's resolution; +Inf as -1), and their mean.
    double quantile_since(const hist& before, double q) const {
      const double n = count - before.count;
      if (n <= 0) return 0;
      for (size_t i = 0; i < buckets.size(); ++i) {
        const double c = buckets[i].second - (i < before.buckets.size() ? before.buckets[i].second : 0);
        if (c >= q * n) return buckets[i].first;
      }
      return -1;
    }
    double mean_since(const hist& before) const {
      const double n = count - before.count;
      return n > 0 ? (sum - before.sum) / n : 0;
    }
  };
  hist histogram(const std::string& name) const {
    std::istringstream in(cluster_->metrics_text());
    std::string line;
    hist h;
    const std::string b = name + "_bucket{le=\"";
    while (std::getline(in, line)) {
      const double v = std::strtod(line.c_str() + line.rfind(' ') + 1, nullptr);
      if (line.rfind(b, 0) == 0) {
        const std::string le = line.substr(b.size(), line.find('"', b.size()) - b.size());
        h.buckets.emplace_back(le == "+Inf" ? -1.0 : std::strtod(le.c_str(), nullptr), v);
      } else if (line.rfind(name + "_sum ", 0) == 0) {
        h.sum = v;
      } else if (line.rfind(name + "_count ", 0) == 0) {
        h.count = v;
      }
    }
    return h;
  }
  /// A metric's value summed over its series in the node's /metrics text (0 if absent).
  double metric(const std::string& name) const { return metric_sum(cluster_->metrics_text(), name); }

 private:
  std::unique_ptr<embedded_cluster> cluster_;
  std::unique_ptr<front_end> fe_;
  std::thread thread_;
  uint16_t port_ = 0;
};

}  // namespace tandem::cli
