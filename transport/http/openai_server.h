#pragma once
/// OpenAI-compatible HTTP front end on kj-http.
///
/// Routes: POST /v1/completions, POST /v1/chat/completions (both with `stream`), GET /v1/models,
/// GET /health (liveness), GET /health/ready (readiness: 503 with the reason while the node
/// cannot serve), GET /metrics, POST /tokenize, POST /detokenize. Connections and HTTP framing
/// are transport::framed_http_server's (framed_http_server.h): bad framing is refused before
/// kj-http parses it, in this server's JSON error shape. Runs on the kj event loop of the thread that creates it; engine
/// events arrive from actor threads through transport::event_channel.
///
/// Chat requests are rendered with the model's own chat template (`tokenizer.chat_template`,
/// or the one set_chat_template() gives), else a Llama-2 fallback: transport/chat/chat_prompt.h.
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <kj/async-io.h>
#include <kj/compat/http.h>
#include <kj/timer.h>

#include "actors/common/limits.h"
#include "actors/runtime/serving_api.h"
#include "transport/auth/api_keys.h"
#include "transport/chat/chat_prompt.h"

namespace tandem {

class openai_server {
 public:
  /// `api` and `timer` must outlive the server. `lim` supplies max_body_bytes,
  /// max_new_tokens and request_timeout_ms.
  openai_server(serving_api& api, const limits& lim, kj::Timer& timer);
  ~openai_server();
  openai_server(const openai_server&) = delete;
  openai_server& operator=(const openai_server&) = delete;

  /// Accepts and serves connections; never resolves normally (drop it to stop listening).
  kj::Promise<void> listen(kj::ConnectionReceiver& listener);
  /// Serves one already-accepted connection until it closes (fuzzers feed in-memory pipes).
  kj::Promise<void> serve_connection(kj::Own<kj::AsyncIoStream> conn);
  /// Requires `Authorization: Bearer KEY` with one of `keys` on every path but `allowlist`
  /// (exact paths, query ignored); null or empty keys = auth off. Call before listen().
  void set_auth(std::shared_ptr<const api_keys> keys, std::vector<std::string> allowlist);
  /// Stops accepting requests and resolves when running ones have finished.
  kj::Promise<void> drain();
  /// Renders chat with `source` (a Jinja chat template) instead of the model's template.
  /// Throws tandem::error naming the line and column if it does not parse.
  void set_chat_template(const std::string& source);
  /// Appends `f()` to every /metrics answer (the RPC front end's metrics); null = none.
  void set_extra_metrics(std::function<std::string()> f);
  /// Prometheus text of the HTTP metrics alone (tandem_http_*).
  std::string http_metrics_text() const;

  struct impl;

 private:
  std::unique_ptr<impl> impl_;
};

}  // namespace tandem
