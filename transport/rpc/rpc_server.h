#pragma once
/// Cap'n Proto RPC front end: serves the `Node` interface of schemas/api.capnp over
/// serving_api, on the kj event loop of the thread that creates it (the same loop as HTTP).
#include <memory>

#include <kj/async-io.h>
#include <kj/timer.h>

#include "actors/common/limits.h"
#include "actors/runtime/serving_api.h"
#include "transport/auth/api_keys.h"

namespace tandem {

class rpc_server {
 public:
  /// `api` and `timer` must outlive the server. Incoming messages are bounded by
  /// limits.max_body_bytes (capnp ReaderOptions traversal limit).
  rpc_server(serving_api& api, const limits& lim, kj::Timer& timer);
  ~rpc_server();
  rpc_server(const rpc_server&) = delete;
  rpc_server& operator=(const rpc_server&) = delete;

  /// Accepts and serves connections; never resolves normally (drop it to stop listening).
  kj::Promise<void> listen(kj::ConnectionReceiver& listener);
  /// Keys a connection must present (schemas/auth.capnp Gate); null or empty = auth off.
  void set_api_keys(std::shared_ptr<const api_keys> keys);
  /// Open RPC connections (for tests and metrics).
  int connections() const;
  /// Prometheus text of the RPC metrics (tandem_rpc_*).
  std::string metrics_text() const;

  struct impl;

 private:
  std::unique_ptr<impl> impl_;
};

}  // namespace tandem
