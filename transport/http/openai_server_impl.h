#pragma once
/// openai_server's state, shared by its translation units: openai_server.cpp (construction,
/// metrics, sending responses), openai_routes.cpp (routing, auth, body reading, the POST
/// routes) and openai_stream.cpp (one generation's events to JSON and SSE).
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <kj/async-io.h>
#include <kj/compat/http.h>
#include <kj/timer.h>

#include "transport/chat/tool_call_markers.h"
#include "transport/chat/tool_call_parser.h"
#include "transport/http/framed_http_server.h"
#include "transport/http/generation.h"
#include "transport/http/openai_errors.h"
#include "transport/http/openai_server.h"
#include "transport/http/rate_limiter.h"

namespace tandem {

namespace openai {

/// Fixed route labels keep the metric table bounded whatever URLs clients send.
inline constexpr std::string_view route_labels[] = {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health",
                                                    "/metrics", "/tokenize", "/detokenize", "other", "/health/ready"};
enum route_id { r_completions, r_chat, r_models, r_health, r_metrics, r_tokenize, r_detokenize, r_other, r_ready };

}  // namespace openai

/// The server's state and handlers; kj event-loop thread only.
struct openai_server::impl {
  impl(serving_api& a, const limits& l, kj::Timer& t);

  kj::Own<kj::HttpHeaderTable> make_table();

  /// Forwards to impl::handle with the connection, so requests can watch for disconnects.
  struct connection_service final : kj::HttpService {
    connection_service(impl& s, kj::AsyncIoStream& c) : srv(s), conn(c) {}
    kj::Promise<void> request(kj::HttpMethod method, kj::StringPtr url, const kj::HttpHeaders& headers,
                              kj::AsyncInputStream& body, Response& response) override {
      return srv.handle(method, url, headers, body, response, conn);
    }
    impl& srv;
    kj::AsyncIoStream& conn;
  };

  // ---- metrics (kj thread only)
  void count(openai::route_id r, unsigned status) { ++requests[{r, status}]; }

  std::string metrics() const;

  // ---- responses
  kj::Promise<void> send_body(kj::HttpService::Response& response, unsigned status, kj::StringPtr content_type,
                              std::string body, openai::route_id r, std::optional<int> retry_after = std::nullopt,
                              kj::StringPtr allow = nullptr);
  kj::Promise<void> send_error(kj::HttpService::Response& response, const openai::http_error& e, openai::route_id r,
                               kj::StringPtr allow = nullptr);

  kj::Promise<void> handle(kj::HttpMethod method, kj::StringPtr url, const kj::HttpHeaders& headers,
                           kj::AsyncInputStream& body, kj::HttpService::Response& response, kj::AsyncIoStream& conn);

  /// A 401 unless the request carries a valid key or its path is allowlisted (or auth is off).
  std::optional<openai::http_error> check_auth(const std::string& path, const kj::HttpHeaders& headers);

  /// Reads the body into `out` until EOF or until it holds `cap` bytes (chunked bodies have
  /// no length to check up front).
  static kj::Promise<void> read_capped(kj::AsyncInputStream& in, std::string& out, uint64_t cap);

  kj::Promise<void> generate(openai::route_id r, const std::string& text, kj::HttpService::Response& response,
                             kj::AsyncIoStream& conn);

  /// /tokenize and /detokenize: the tokenizer the completions route uses, no engine involved.
  kj::Promise<void> tokenize(openai::route_id r, const std::string& text, kj::HttpService::Response& response);

  /// Resolves if the client closes the connection (write side gone, or EOF on read).
  kj::Promise<void> watch_disconnect(kj::AsyncIoStream& conn);
  /// kj-http does not read the socket while a request is being served, so a client that
  /// closes before the response starts is only visible by peeking (does not consume bytes).
  kj::Promise<void> poll_eof(kj::AsyncIoStream& conn);

  serving_api& api;
  limits lim;
  kj::Timer& timer;
  kj::HttpHeaderId h_content_type = kj::HttpHeaderId::HOST, h_retry_after = kj::HttpHeaderId::HOST,
                   h_cache_control = kj::HttpHeaderId::HOST, h_allow = kj::HttpHeaderId::HOST,
                   h_authorization = kj::HttpHeaderId::HOST, h_www_authenticate = kj::HttpHeaderId::HOST;
  std::shared_ptr<const api_keys> keys;
  std::vector<std::string> allowlist;
  kj::Own<kj::HttpHeaderTable> header_table;
  transport::request_ids ids, chat_ids;
  transport::rate_limiter limiter;  ///< kj thread only
  /// Chat messages to prompt ids (the model's template, an override, or the Llama-2 fallback).
  std::unique_ptr<chat_prompter> chat_prompt;
  /// How the template's model writes tool calls (from the template in use): parsed from replies.
  tool_call_format tool_format = tool_call_format::none;
  /// Its markers that are control tokens of the vocabulary: rendered for the parser only.
  std::vector<control_marker> tool_markers;

  std::map<std::pair<int, unsigned>, int64_t> requests;
  int64_t in_flight = 0, client_disconnects = 0, timeouts = 0, stream_events = 0, completion_tokens = 0,
          stream_errors = 0, stream_backlog_aborts = 0, tool_calls = 0;
  /// More Prometheus text for /metrics (the RPC front end's), on this kj thread.
  std::function<std::string()> extra_metrics;
  int64_t auth_failures = 0;
  kj::Own<transport::framed_http_server> front;  ///< last: its connections use everything above
};

}  // namespace tandem
