#include "transport/http/openai_server.h"

#include <fmt/format.h>

#include "transport/http/openai_server_impl.h"

namespace tandem {

using namespace openai;


openai_server::impl::impl(serving_api& a, const limits& l, kj::Timer& t)
    : api(a), lim(l), timer(t), header_table(make_table()), ids("cmpl"), chat_ids("chatcmpl"),
      limiter(l.rate_limit_rps, l.rate_limit_burst, l.rate_limit_max_clients),
      chat_prompt(std::make_unique<chat_prompter>(a.tok(), "")),
      tool_format(tool_call_format_for_template(a.tok().chat_template())),
      tool_markers(control_markers(a.tok(), tool_format)) {
  // Connections and HTTP framing are framed_http_server's; errors it answers get our JSON shape.
  transport::front_callbacks cb;
  cb.send_error = [this](kj::HttpService::Response& response, const transport::owner_error& e) {
    return send_error(response, {e.status, e.message, e.type, "", e.code, e.retry_after_s}, r_other);
  };
  cb.error_body = [this](const transport::owner_error& e) {
    count(r_other, e.status);
    return error_json({e.status, e.message, e.type, "", e.code, e.retry_after_s});
  };
  front = kj::heap<transport::framed_http_server>(
      timer, *header_table, lim,
      [this](kj::AsyncIoStream& conn) -> kj::Own<kj::HttpService> { return kj::heap<connection_service>(*this, conn); },
      std::move(cb));
}

kj::Own<kj::HttpHeaderTable> openai_server::impl::make_table() {
  kj::HttpHeaderTable::Builder b;
  h_content_type = b.add("Content-Type");
  h_retry_after = b.add("Retry-After");
  h_cache_control = b.add("Cache-Control");
  h_allow = b.add("Allow");
  h_authorization = b.add("Authorization");
  h_www_authenticate = b.add("WWW-Authenticate");
  return b.build();
}

std::string openai_server::impl::metrics() const {
  std::string out;
  auto head = [&](const char* name, const char* type, const char* help) {
    out += fmt::format("# HELP {} {}\n# TYPE {} {}\n", name, help, name, type);
  };
  head("tandem_http_requests_total", "counter", "HTTP requests by route and status.");
  for (auto& [k, n] : requests)
    out += fmt::format("tandem_http_requests_total{{route=\"{}\",status=\"{}\"}} {}\n", route_labels[k.first], k.second, n);
  head("tandem_http_requests_in_flight", "gauge", "Generation requests being served.");
  out += fmt::format("tandem_http_requests_in_flight {}\n", in_flight);
  head("tandem_http_client_disconnects_total", "counter", "Requests aborted because the client went away.");
  out += fmt::format("tandem_http_client_disconnects_total {}\n", client_disconnects);
  head("tandem_http_timeouts_total", "counter", "Requests that ran past limits.request_timeout_ms.");
  out += fmt::format("tandem_http_timeouts_total {}\n", timeouts);
  head("tandem_http_stream_events_total", "counter", "SSE data events sent.");
  out += fmt::format("tandem_http_stream_events_total {}\n", stream_events);
  head("tandem_http_completion_tokens_total", "counter", "Completion tokens returned over HTTP.");
  out += fmt::format("tandem_http_completion_tokens_total {}\n", completion_tokens);
  head("tandem_http_auth_failures_total", "counter", "Requests refused with 401 for a missing or wrong API key.");
  out += fmt::format("tandem_http_auth_failures_total {}\n", auth_failures);
  head("tandem_http_protocol_errors_total", "counter",
       "Requests that were not valid HTTP (framing, version, head size), answered 400, 431 or 505.");
  out += fmt::format("tandem_http_protocol_errors_total {}\n", front->protocol_errors());
  head("tandem_http_header_timeouts_total", "counter",
       "Connections answered 408 and closed: no complete request head within limits.http_header_timeout_ms.");
  out += fmt::format("tandem_http_header_timeouts_total {}\n", front->header_timeouts());
  head("tandem_http_head_readers", "gauge", "Connections reading a request head now.");
  out += fmt::format("tandem_http_head_readers {}\n", front->head_readers().readers());
  head("tandem_http_head_readers_refused_total", "counter",
       "Connections answered 429 and closed: their client had limits.http_max_head_readers_per_client heads in progress.");
  out += fmt::format("tandem_http_head_readers_refused_total {}\n", front->head_readers().refused());
  head("tandem_http_rate_limited_total", "counter", "Requests refused with 429 by the per-client rate limit.");
  out += fmt::format("tandem_http_rate_limited_total {}\n", limiter.refused());
  head("tandem_http_rate_limit_clients", "gauge", "Clients with a rate-limit bucket (bound: limits.rate_limit_max_clients).");
  out += fmt::format("tandem_http_rate_limit_clients {}\n", limiter.clients());
  head("tandem_http_stream_errors_total", "counter", "Streams that had started and ended with an in-band error event.");
  out += fmt::format("tandem_http_stream_errors_total {}\n", stream_errors);
  head("tandem_http_tool_calls_total", "counter", "Tool calls parsed out of chat replies.");
  out += fmt::format("tandem_http_tool_calls_total {}\n", tool_calls);
  head("tandem_http_stream_backlog_aborts_total", "counter",
       "Streams aborted because their client stopped reading (limits.http_stream_backlog_tokens, or the deadline).");
  out += fmt::format("tandem_http_stream_backlog_aborts_total {}\n", stream_backlog_aborts);
  return out;
}

kj::Promise<void> openai_server::impl::send_body(kj::HttpService::Response& response, unsigned status,
                                                 kj::StringPtr content_type, std::string body, route_id r,
                                                 std::optional<int> retry_after, kj::StringPtr allow) {
  count(r, status);
  kj::HttpHeaders h(*header_table);
  h.set(h_content_type, content_type);
  kj::String ra;
  if (retry_after) {
    ra = kj::str(*retry_after);
    h.set(h_retry_after, ra);
  }
  if (allow != nullptr) h.set(h_allow, allow);
  if (status == 401) h.set(h_www_authenticate, "Bearer");
  auto out = response.send(status, status_text(status), h, static_cast<uint64_t>(body.size()));
  auto owned = kj::heapString(body.data(), body.size());
  auto p = out->write(owned.begin(), owned.size());
  return p.attach(kj::mv(out), kj::mv(owned));
}

kj::Promise<void> openai_server::impl::send_error(kj::HttpService::Response& response, const http_error& e,
                                                  route_id r, kj::StringPtr allow) {
  return send_body(response, e.status, "application/json", error_json(e), r, e.retry_after_s, allow);
}

openai_server::openai_server(serving_api& api, const limits& lim, kj::Timer& timer)
    : impl_(std::make_unique<impl>(api, lim, timer)) {}

openai_server::~openai_server() = default;

kj::Promise<void> openai_server::listen(kj::ConnectionReceiver& listener) { return impl_->front->listen(listener); }

void openai_server::set_chat_template(const std::string& source) {
  impl_->chat_prompt = std::make_unique<chat_prompter>(impl_->api.tok(), source);
  impl_->tool_format = tool_call_format_for_template(source.empty() ? impl_->api.tok().chat_template() : source);
  impl_->tool_markers = control_markers(impl_->api.tok(), impl_->tool_format);
}

void openai_server::set_extra_metrics(std::function<std::string()> f) { impl_->extra_metrics = std::move(f); }

void openai_server::set_auth(std::shared_ptr<const api_keys> keys, std::vector<std::string> allowlist) {
  impl_->keys = std::move(keys);
  impl_->allowlist = std::move(allowlist);
}

kj::Promise<void> openai_server::serve_connection(kj::Own<kj::AsyncIoStream> conn) {
  return impl_->front->serve(kj::mv(conn));
}

kj::Promise<void> openai_server::drain() { return impl_->front->drain(); }

std::string openai_server::http_metrics_text() const { return impl_->metrics(); }

}  // namespace tandem
