#pragma once
/// The accept side shared by every Cap'n Proto interface of a node (the `Node` API and the
/// admin interface): a bound on open connections, explicit ReaderOptions on every incoming
/// message, and connection lifetimes tied to their disconnect.
#include <cstdint>
#include <memory>
#include <string>

#include <capnp/capability.h>
#include <capnp/message.h>
#include <kj/async-io.h>

#include "actors/common/limits.h"
#include "transport/auth/api_keys.h"

namespace tandem {

class rpc_listener {
 public:
  /// `name` prefixes log lines ("rpc", "admin"). Incoming messages are bounded by
  /// limits.max_body_bytes; open connections by limits.max_rpc_connections.
  rpc_listener(std::string name, const limits& lim);
  ~rpc_listener();
  rpc_listener(const rpc_listener&) = delete;
  rpc_listener& operator=(const rpc_listener&) = delete;

  /// The capability each new connection gets once it authenticated (schemas/auth.capnp: the
  /// connection's bootstrap is a Gate that hands it out); set before listen().
  void set_bootstrap(capnp::Capability::Client bootstrap) { bootstrap_ = kj::mv(bootstrap); }
  /// Keys the Gate accepts; null or empty = auth off (any key, also none, is accepted).
  void set_api_keys(std::shared_ptr<const api_keys> keys) { keys_ = std::move(keys); }
  /// Gate.authenticate calls refused for a wrong or missing key.
  int64_t auth_failures() const { return auth_failures_; }
  /// Accepts and serves connections; never resolves normally (drop it to stop listening).
  kj::Promise<void> listen(kj::ConnectionReceiver& listener);
  /// Serves one already-accepted connection (what listen() does per accept; fuzzers and tests
  /// feed in-memory pipes). Resolves when the peer disconnects.
  kj::Promise<void> serve(kj::Own<kj::AsyncIoStream> stream);
  /// The ReaderOptions every incoming message is read with (limits.max_body_bytes).
  static capnp::ReaderOptions reader_options(const limits& lim);
  int open() const { return open_; }
  /// Connections closed at accept because `open()` was at the bound.
  int64_t rejected() const { return rejected_; }

 private:
  struct connection;
  class gate;
  struct log_errors final : kj::TaskSet::ErrorHandler {
    explicit log_errors(const std::string& n) : name(n) {}
    void taskFailed(kj::Exception&& e) override;
    const std::string& name;
  };

  std::string name_;
  limits lim_;
  int open_ = 0;
  int64_t rejected_ = 0;
  int64_t auth_failures_ = 0;
  std::shared_ptr<const api_keys> keys_;
  capnp::Capability::Client bootstrap_ = nullptr;
  log_errors error_handler_{name_};
  kj::TaskSet tasks_;  // last: its tasks reference the members above
};

}  // namespace tandem
