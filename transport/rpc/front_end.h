#pragma once
/// Runs the HTTP and RPC front ends of one node on a single kj event loop (the calling
/// thread's), until stop() or, if asked, SIGINT/SIGTERM.
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "actors/common/limits.h"
#include "actors/runtime/serving_api.h"
#include "transport/auth/api_keys.h"

namespace tandem {

struct front_end_options {
  std::string host = "127.0.0.1";  ///< never 0.0.0.0 unless asked
  int http_port = 8080;            ///< 0 picks a free port; -1 disables HTTP
  int rpc_port = 8081;             ///< 0 picks a free port; -1 disables RPC
  int admin_port = -1;             ///< admin interface (`tandem inspect`); 0 picks a free port; -1 disables it
  limits lim;
  /// API keys of the HTTP, RPC and admin listeners; null or empty = auth off (docs/security.md).
  std::shared_ptr<const api_keys> keys;
  /// HTTP paths served without a key when keys are set.
  std::vector<std::string> auth_allowlist = {"/health", "/health/ready"};
  /// A Jinja chat template that replaces the model's `tokenizer.chat_template` ("" = none;
  /// `tandem serve --chat-template-file`).
  std::string chat_template;
  /// Stop on SIGINT/SIGTERM. The caller must have called kj::UnixEventPort::captureSignal()
  /// for both before starting any thread.
  bool handle_signals = false;
};

/// A bound listener, reported once it accepts connections.
struct listener_info {
  std::string what;  ///< "http", "rpc" or "admin"
  std::string host;  ///< the address the kernel bound (getsockname), e.g. 127.0.0.1
  uint16_t port = 0;
};

class front_end {
 public:
  front_end(serving_api& api, front_end_options opt);
  ~front_end();

  /// Binds, reports each listener through `on_listening`, then serves until stop().
  /// Must be called on a thread without a kj event loop. Throws tandem::error if binding fails.
  void run(const std::function<void(const listener_info&)>& on_listening);
  /// Thread-safe; also fine before run() (which then returns right after binding).
  void stop();

 private:
  struct stopper;
  serving_api& api_;
  front_end_options opt_;
  std::shared_ptr<stopper> stop_;
};

}  // namespace tandem
