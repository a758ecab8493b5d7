#pragma once
/// Cap'n Proto admin front end: serves the `Admin` interface of schemas/admin.capnp (what
/// `tandem inspect` shows) on its own port, on the kj event loop of the creating thread.
#include <memory>

#include <kj/async-io.h>

#include "actors/common/limits.h"
#include "actors/runtime/serving_api.h"
#include "transport/auth/api_keys.h"

namespace tandem {

class admin_server {
 public:
  /// `api` must outlive the server. Connections are bounded by limits.max_rpc_connections.
  admin_server(serving_api& api, const limits& lim);
  ~admin_server();
  admin_server(const admin_server&) = delete;
  admin_server& operator=(const admin_server&) = delete;

  /// Accepts and serves connections; never resolves normally (drop it to stop listening).
  kj::Promise<void> listen(kj::ConnectionReceiver& listener);
  /// Keys a connection must present (schemas/auth.capnp Gate); null or empty = auth off.
  void set_api_keys(std::shared_ptr<const api_keys> keys);

  struct impl;

 private:
  std::unique_ptr<impl> impl_;
};

}  // namespace tandem
