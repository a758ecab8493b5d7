#pragma once
/// An embedded cluster behind its own HTTP front end on a free port, for the benchmarks that
/// load a real server (`tandem bench soak` runs one in a child process).
#include <future>
#include <memory>
#include <string>
#include <thread>

#include "actors/runtime/embedded_cluster.h"
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


 private:
  std::unique_ptr<embedded_cluster> cluster_;
  std::unique_ptr<front_end> fe_;
  std::thread thread_;
  uint16_t port_ = 0;
};

}  // namespace tandem::cli
