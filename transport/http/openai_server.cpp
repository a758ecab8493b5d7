#include "transport/http/openai_server.h"

#include <sys/socket.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <climits>
#include <ctime>
#include <map>
#include <optional>

#include <fmt/format.h>
#include <kj/debug.h>
#include <spdlog/spdlog.h>

#include "kernels/tokenizer/tokenizer.h"
#include "transport/http/generation.h"
#include "transport/http/framed_http_server.h"
#include "transport/http/json.h"
#include "transport/http/rate_limiter.h"
#include "transport/http/request_params.h"
#include "transport/http/response_format.h"
#include "transport/http/tokenize_routes.h"

namespace tandem {

using transport::event_channel;
using transport::generation_params;
using transport::text_assembler;

namespace {

/// Fixed route labels keep the metric table bounded whatever URLs clients send.
constexpr std::string_view route_labels[] = {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health",
                                             "/metrics", "/tokenize", "/detokenize", "other", "/health/ready"};
enum route_id { r_completions, r_chat, r_models, r_health, r_metrics, r_tokenize, r_detokenize, r_other, r_ready };

/// An error that becomes a JSON error response.
struct http_error {
  unsigned status;
  std::string message;
  std::string type;
  std::string param;  ///< "" = null
  std::string code;   ///< "" = null
  std::optional<int> retry_after_s;
};

http_error bad_request(std::string msg, std::string param = "", std::string code = "invalid_request") {
  return {400, std::move(msg), "invalid_request_error", std::move(param), std::move(code), std::nullopt};
}

/// Retry-After seconds from the router's estimate (ms; 0 = unknown -> 1 s).
int retry_after_s(int64_t ms) { return ms <= 0 ? 1 : static_cast<int>(std::min<int64_t>((ms + 999) / 1000, 86400)); }

/// The status of a refused request. A queue timeout (still queued past its queue deadline)
/// or a deadline that passed before anything streamed (e.g. a prefill that started on a node
/// that then stopped) is 504: the server, not the client, ran out of time. 408 is not used:
/// the OpenAI API carries no client deadline for the server to miss.
http_error from_engine(const error& e, const std::string& reason = "", int64_t retry_after_ms = 0) {
  if (e.kind() == error_kind::overloaded && (reason == "queue_timeout" || reason == "deadline"))
    return {504, e.what(), "timeout_error", "", reason == "deadline" ? "deadline_exceeded" : "queue_timeout",
            retry_after_s(retry_after_ms)};
  switch (e.kind()) {
    case error_kind::overloaded: return {503, e.what(), "overloaded_error", "", "overloaded", retry_after_s(retry_after_ms)};
    case error_kind::disconnected: return {502, e.what(), "server_error", "", "disconnected", std::nullopt};
    case error_kind::unimplemented: return {501, e.what(), "server_error", "", "unimplemented", std::nullopt};
    case error_kind::failed: break;
  }
  return {500, e.what(), "server_error", "", "failed", std::nullopt};
}

std::string error_json(const http_error& e) {
  json::writer w;
  w.begin_object().key("error").begin_object();
  w.key("message").str(e.message).key("type").str(e.type);
  w.key("param");
  if (e.param.empty()) w.null();
  else w.str(e.param);
  w.key("code");
  if (e.code.empty()) w.null();
  else w.str(e.code);
  w.end_object().end_object();
  return w.take();
}

kj::StringPtr status_text(unsigned s) {
  auto r = transport::status_reason(s);  // literals: NUL-terminated
  return kj::StringPtr(r.data(), r.size());
}

// ---- typed access to request fields: wrong types are 400s naming the field.

const json::value* field(const json::value& o, std::string_view k) {
  auto* v = o.find(k);
  return (v && v->k == json::kind::null) ? nullptr : v;
}

[[noreturn]] void wrong_type(std::string_view name, std::string_view want, const json::value& v) {
  throw bad_request(fmt::format("'{}' must be {}, got {}", name, want, json::kind_name(v.k)), std::string(name),
                    "invalid_type");
}

std::optional<double> get_number(const json::value& o, std::string_view k) {
  auto* v = field(o, k);
  if (!v) return std::nullopt;
  if (v->k != json::kind::number) wrong_type(k, "a number", *v);
  return v->num;
}

std::optional<int64_t> get_int(const json::value& o, std::string_view k) {
  auto* v = field(o, k);
  if (!v) return std::nullopt;
  if (v->k == json::kind::number && !v->is_int)
    throw bad_request(fmt::format("'{}' must be an integer, got {}", k, v->num), std::string(k), "invalid_type");
  if (v->k != json::kind::number) wrong_type(k, "an integer", *v);
  return v->i;
}

std::optional<bool> get_bool(const json::value& o, std::string_view k) {
  auto* v = field(o, k);
  if (!v) return std::nullopt;
  if (v->k != json::kind::boolean) wrong_type(k, "a boolean", *v);
  return v->b;
}

int32_t clamp_i32(int64_t v) { return static_cast<int32_t>(std::clamp<int64_t>(v, INT32_MIN, INT32_MAX)); }

/// What both POST routes accept.
struct parsed_request {
  generation_params gen;
  bool stream = false;
  bool include_usage = false;
  bool max_tokens_set = false;  ///< else the default is what is left of the context
  std::vector<int32_t> prompt;
};

void parse_common(const json::value& body, parsed_request& r, bool chat) {
  if (auto t = get_number(body, "temperature")) r.gen.sampling.temperature = static_cast<float>(*t);
  if (auto t = get_number(body, "top_p")) r.gen.sampling.top_p = static_cast<float>(*t);
  if (auto t = get_int(body, "top_k")) {
    // OpenAI-style clients send -1 for "off".
    r.gen.sampling.top_k = *t == -1 ? 0 : clamp_i32(*t);
  }
  if (auto t = get_int(body, "seed")) r.gen.sampling.seed = static_cast<uint64_t>(*t);
  // max_completion_tokens is OpenAI's newer name for max_tokens; both routes take either.
  std::optional<int64_t> mt = get_int(body, "max_tokens");
  if (auto mct = get_int(body, "max_completion_tokens")) {
    if (mt && *mt != *mct)
      throw http_error{422, fmt::format("max_tokens = {} and max_completion_tokens = {} disagree; send one of them", *mt, *mct),
                       "invalid_request_error", "max_completion_tokens", "invalid_value", std::nullopt};
    mt = mct;
  }
  if (mt) r.gen.max_tokens = clamp_i32(*mt), r.max_tokens_set = true;
  if (auto* s = field(body, "stop")) {
    if (s->k == json::kind::string) {
      r.gen.stop.push_back(s->s);
    } else if (s->k == json::kind::array) {
      for (auto& e : s->arr) {
        if (e.k != json::kind::string) wrong_type("stop", "a string or a list of strings", e);
        r.gen.stop.push_back(e.s);
      }
    } else {
      wrong_type("stop", "a string or a list of strings", *s);
    }
  }
  if (auto b = get_bool(body, "stream")) r.stream = *b;
  if (auto* so = field(body, "stream_options")) {
    if (so->k != json::kind::object) wrong_type("stream_options", "an object", *so);
    if (auto b = get_bool(*so, "include_usage")) r.include_usage = *b;
  }
  if (auto b = get_bool(body, "ignore_eos")) r.gen.ignore_eos = *b;
  if (auto* m = field(body, "model"); m && m->k != json::kind::string) wrong_type("model", "a string", *m);
}

std::string unix_now_s() { return std::to_string(static_cast<int64_t>(std::time(nullptr))); }

struct gen_state;

}  // namespace

// ============================================================================================

struct openai_server::impl {
  impl(serving_api& a, const limits& l, kj::Timer& t)
      : api(a), lim(l), timer(t), header_table(make_table()), ids("cmpl"), chat_ids("chatcmpl"),
        limiter(l.rate_limit_rps, l.rate_limit_burst, l.rate_limit_max_clients),
        chat_prompt(std::make_unique<chat_prompter>(a.tok(), "")) {
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

  kj::Own<kj::HttpHeaderTable> make_table() {
    kj::HttpHeaderTable::Builder b;
    h_content_type = b.add("Content-Type");
    h_retry_after = b.add("Retry-After");
    h_cache_control = b.add("Cache-Control");
    h_allow = b.add("Allow");
    h_authorization = b.add("Authorization");
    h_www_authenticate = b.add("WWW-Authenticate");
    return b.build();
  }

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
  void count(route_id r, unsigned status) { ++requests[{r, status}]; }

  std::string metrics() const {
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
    head("tandem_http_stream_backlog_aborts_total", "counter",
         "Streams aborted because their client stopped reading (limits.http_stream_backlog_tokens, or the deadline).");
    out += fmt::format("tandem_http_stream_backlog_aborts_total {}\n", stream_backlog_aborts);
    return out;
  }

  // ---- responses
  kj::Promise<void> send_body(kj::HttpService::Response& response, unsigned status, kj::StringPtr content_type,
                              std::string body, route_id r, std::optional<int> retry_after = std::nullopt,
                              kj::StringPtr allow = nullptr) {
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

  kj::Promise<void> send_error(kj::HttpService::Response& response, const http_error& e, route_id r,
                               kj::StringPtr allow = nullptr) {
    return send_body(response, e.status, "application/json", error_json(e), r, e.retry_after_s, allow);
  }

  kj::Promise<void> handle(kj::HttpMethod method, kj::StringPtr url, const kj::HttpHeaders& headers,
                           kj::AsyncInputStream& body, kj::HttpService::Response& response, kj::AsyncIoStream& conn) {
    std::string path(url.cStr());
    if (auto q = path.find('?'); q != std::string::npos) path.resize(q);
    if (auto e = check_auth(path, headers)) return send_error(response, *e, r_other);
    route_id r = r_other;
    bool post = false;
    if (path == "/v1/completions") r = r_completions, post = true;
    else if (path == "/v1/chat/completions") r = r_chat, post = true;
    else if (path == "/v1/models" || path.starts_with("/v1/models/")) r = r_models;
    else if (path == "/health") r = r_health;
    else if (path == "/health/ready") r = r_ready;
    else if (path == "/metrics") r = r_metrics;
    else if (path == "/tokenize") r = r_tokenize, post = true;
    else if (path == "/detokenize") r = r_detokenize, post = true;
    if (r == r_other)
      return send_error(response,
                        {404, fmt::format("no route for {}; see /v1/completions, /v1/chat/completions, /v1/models, /health, "
                                          "/health/ready, /metrics, /tokenize, /detokenize", path),
                         "invalid_request_error", "", "not_found", std::nullopt},
                        r);
    kj::HttpMethod want = post ? kj::HttpMethod::POST : kj::HttpMethod::GET;
    if (method != want)
      return send_error(response,
                        {405, fmt::format("method {} is not allowed on {}; use {}", kj::str(method).cStr(), path, post ? "POST" : "GET"),
                         "invalid_request_error", "", "method_not_allowed", std::nullopt},
                        r, post ? "POST" : "GET");

    if (r == r_models && path != "/v1/models") {
      // GET /v1/models/{id}: the served model, or 404 model_not_found.
      std::string id = path.substr(std::string_view("/v1/models/").size());
      if (id != api.model_id())
        return send_error(response,
                          {404, fmt::format("model '{}' is not served here; this server serves '{}'", id, api.model_id()),
                           "invalid_request_error", "model", "model_not_found", std::nullopt},
                          r);
      json::writer w;
      w.begin_object().key("id").str(api.model_id()).key("object").str("model").key("created").raw(unix_now_s());
      w.key("owned_by").str("tandem").key("max_model_len").num(api.max_context()).end_object();
      return send_body(response, 200, "application/json", w.take(), r);
    }
    if (r == r_models) {
      json::writer w;
      w.begin_object().key("object").str("list").key("data").begin_array();
      w.begin_object().key("id").str(api.model_id()).key("object").str("model").key("created").raw(unix_now_s());
      w.key("owned_by").str("tandem").key("max_model_len").num(api.max_context()).end_object();
      w.end_array().end_object();
      return send_body(response, 200, "application/json", w.take(), r);
    }
    if (r == r_health) {
      auto h = api.health();
      json::writer w;
      w.begin_object().key("status").str(h.status).key("ok").boolean(h.ok).key("uptime_ms").num(h.uptime_ms);
      w.key("model").str(api.model_id()).end_object();
      return send_body(response, h.ok ? 200 : 503, "application/json", w.take(), r);
    }
    if (r == r_ready) {
      // Readiness for load balancers: 503 (with the reason) while the node cannot serve.
      auto h = api.health();
      const bool ready = h.ok && h.ready;
      json::writer w;
      w.begin_object().key("status").str(!h.ok ? "unhealthy" : ready ? "ready" : "degraded").key("ready").boolean(ready);
      w.key("reason").str(!h.ok ? h.status : h.ready_status).key("uptime_ms").num(h.uptime_ms);
      w.key("model").str(api.model_id()).end_object();
      return send_body(response, ready ? 200 : 503, "application/json", w.take(), r);
    }
    if (r == r_metrics) {
      std::string text = api.metrics_text();
      if (!text.empty() && text.back() != '\n') text += '\n';
      text += metrics();
      if (extra_metrics) text += extra_metrics();
      return send_body(response, 200, "text/plain; version=0.0.4; charset=utf-8", std::move(text), r);
    }

    KJ_IF_MAYBE(ct, headers.get(h_content_type)) {
      std::string_view v(ct->cStr());
      std::string type(v.substr(0, v.find(';')));
      while (!type.empty() && type.back() == ' ') type.pop_back();
      for (auto& c : type) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
      if (type != "application/json")
        return send_error(response,
                          {415, fmt::format("Content-Type {} is not supported; send the body as application/json (curl: -H 'Content-Type: application/json')", ct->cStr()),
                           "invalid_request_error", "", "unsupported_media_type", std::nullopt},
                          r);
    }
    // Per-client rate limit, before anything is read or computed for the request.
    if (limiter.enabled()) {
      std::string auth;
      KJ_IF_MAYBE(a, headers.get(h_authorization)) { auth = a->cStr(); }
      auto v = limiter.take(transport::rate_limit_key(auth, transport::peer_address(conn)),
                            std::chrono::duration_cast<std::chrono::milliseconds>(
                                std::chrono::steady_clock::now().time_since_epoch())
                                .count());
      if (!v.allowed)
        return send_error(response,
                          {429,
                           fmt::format("rate limit of {} requests/s (burst {}) per client exceeded "
                                       "(limits.rate_limit_rps / rate_limit_burst); retry after {} ms",
                                       lim.rate_limit_rps, lim.rate_limit_burst > 0 ? lim.rate_limit_burst : std::max(1, lim.rate_limit_rps),
                                       v.retry_after_ms),
                           "rate_limit_error", "", "rate_limited", retry_after_s(v.retry_after_ms)},
                          r);
    }

    // POST: check the declared size before reading, then cap the read.
    uint64_t max = static_cast<uint64_t>(lim.max_body_bytes);
    auto too_large = [this, &response, r, max](std::string got) {
      return send_error(response,
                        {413, fmt::format("request body is {} bytes; the limit is {} bytes (limits.max_body_bytes)", got, max),
                         "invalid_request_error", "", "body_too_large", std::nullopt},
                        r);
    };
    KJ_IF_MAYBE(cl, headers.get(kj::HttpHeaderId::CONTENT_LENGTH)) {
      char* end = nullptr;
      unsigned long long n = std::strtoull(cl->cStr(), &end, 10);
      if (end && *end == '\0' && n > max) return too_large(std::to_string(n));
    }
    auto buf = kj::heap<std::string>();
    auto& bref = *buf;
    // A body dribbled slowly holds a connection as long as a slow head would: bound it too.
    auto body_timed_out = kj::heap<bool>(false);
    auto& tref = *body_timed_out;
    auto timeout = timer.afterDelay(lim.http_body_timeout_ms * kj::MILLISECONDS).then([&tref] { tref = true; });
    return read_capped(body, bref, max + 1)
        .exclusiveJoin(kj::mv(timeout))
        .then([this, &response, r, &conn, too_large, max, &bref, &tref]() -> kj::Promise<void> {
          if (tref)
            return send_error(response,
                              {408, fmt::format("the request body did not arrive within {} ms (limits.http_body_timeout_ms); send it at once",
                                                lim.http_body_timeout_ms),
                               "invalid_request_error", "", "body_timeout", std::nullopt},
                              r);
          if (bref.size() > max) return too_large("more than " + std::to_string(max));
          // read_capped grows the buffer in 64 KiB reads (about 128 KiB of capacity for a
          // small body) and the body lives as long as the request streams: keep only its bytes
          // (found by `tandem bench soak`: ~130 KiB of heap per request in flight).
          bref.shrink_to_fit();
          if (r == r_tokenize || r == r_detokenize) return tokenize(r, bref, response);
          try {
            return generate(r, bref, response, conn);
          } catch (const http_error& e) {
            return send_error(response, e, r);
          }
        })
        .attach(kj::mv(buf), kj::mv(body_timed_out));
  }

  /// A 401 unless the request carries a valid key or its path is allowlisted (or auth is off).
  std::optional<http_error> check_auth(const std::string& path, const kj::HttpHeaders& headers) {
    if (!keys || keys->empty()) return std::nullopt;
    if (std::find(allowlist.begin(), allowlist.end(), path) != allowlist.end()) return std::nullopt;
    std::optional<std::string_view> token;
    KJ_IF_MAYBE(a, headers.get(h_authorization)) { token = bearer_token(std::string_view(a->cStr())); }
    if (token && keys->check(*token)) return std::nullopt;
    ++auth_failures;
    return http_error{401,
                      token ? "the API key is not valid; send one of the server's keys as Authorization: Bearer KEY"
                            : "an API key is required; send Authorization: Bearer KEY (the server's --api-key-file)",
                      "invalid_request_error", "", token ? "invalid_api_key" : "missing_api_key", std::nullopt};
  }

  /// Reads the body into `out` until EOF or until it holds `cap` bytes (chunked bodies have
  /// no length to check up front).
  static kj::Promise<void> read_capped(kj::AsyncInputStream& in, std::string& out, uint64_t cap) {
    if (out.size() >= cap) return kj::READY_NOW;
    size_t old = out.size();
    size_t want = static_cast<size_t>(std::min<uint64_t>(cap - old, 65536));
    out.resize(old + want);
    return in.tryRead(out.data() + old, 1, want).then([&in, &out, cap, old](size_t n) -> kj::Promise<void> {
      out.resize(old + n);
      if (n == 0) return kj::READY_NOW;
      return read_capped(in, out, cap);
    });
  }

  kj::Promise<void> generate(route_id r, const std::string& text, kj::HttpService::Response& response,
                             kj::AsyncIoStream& conn);

  /// /tokenize and /detokenize: the tokenizer the completions route uses, no engine involved.
  kj::Promise<void> tokenize(route_id r, const std::string& text, kj::HttpService::Response& response) {
    std::string out;
    try {
      out = r == r_tokenize ? transport::tokenize_response(api.tok(), text)
                            : transport::detokenize_response(api.tok(), text);
    } catch (const transport::tokenize_error& e) {
      return send_error(response, bad_request(e.message, e.param, e.code), r);
    } catch (const error& e) {
      return send_error(response, from_engine(e), r);
    }
    return send_body(response, 200, "application/json", std::move(out), r);
  }

  /// Resolves if the client closes the connection (write side gone, or EOF on read).
  kj::Promise<void> watch_disconnect(kj::AsyncIoStream& conn) {
    return conn.whenWriteDisconnected().exclusiveJoin(poll_eof(conn));
  }
  /// kj-http does not read the socket while a request is being served, so a client that
  /// closes before the response starts is only visible by peeking (does not consume bytes).
  kj::Promise<void> poll_eof(kj::AsyncIoStream& conn) {
    KJ_IF_MAYBE(fd, conn.getFd()) {
      int f = *fd;
      return timer.afterDelay(50 * kj::MILLISECONDS).then([this, f, &conn]() -> kj::Promise<void> {
        char c;
        ssize_t n = ::recv(f, &c, 1, MSG_PEEK | MSG_DONTWAIT);
        if (n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) return kj::READY_NOW;
        if (n > 0) return kj::NEVER_DONE;  // pipelined bytes: the client is still there
        return poll_eof(conn);
      });
    }
    return kj::NEVER_DONE;
  }

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

  std::map<std::pair<int, unsigned>, int64_t> requests;
  int64_t in_flight = 0, client_disconnects = 0, timeouts = 0, stream_events = 0, completion_tokens = 0,
          stream_errors = 0, stream_backlog_aborts = 0;
  /// More Prometheus text for /metrics (the RPC front end's), on this kj thread.
  std::function<std::string()> extra_metrics;
  int64_t auth_failures = 0;
  kj::Own<transport::framed_http_server> front;  ///< last: its connections use everything above
};

namespace {

/// One generation request from submit to the last byte. Aborts the engine request if it is
/// destroyed before the engine finished it (client gone, stop string, server shutdown).
struct gen_state {
  gen_state(openai_server::impl& s, const tokenizer& tok, std::vector<std::string> stop)
      : srv(s), text(tok, std::move(stop)) {
    ++srv.in_flight;
  }
  ~gen_state() {
    ch.close();
    if (submitted && !engine_done) {
      if (text.stopped())
        srv.api.stop_at_stop_string(id);  // finished as `stop`, not counted as an abort
      else
        srv.api.abort(id);
    }
    --srv.in_flight;
  }

  /// Consumes one event; returns its new text. Sets `done` when the response is complete.
  std::string consume_one(token_event& ev) {
    if (done) return "";
    if (ev.prompt_tokens > 0) prompt_tokens = ev.prompt_tokens;
    cached_tokens = ev.cached_tokens;
    std::string delta = text.push(ev.tokens);
    if (text.stopped()) {
      done = true;
      reason = finish_reason::stop;
      completion_tokens = text.tokens_consumed();
      engine_done = engine_done || (ev.finished && !timed_out);
      return delta;
    }
    if (ev.finished) {
      engine_done = !timed_out;  // our own timeout event: the engine still runs it
      done = true;
      reason = ev.reason;
      err = ev.err;
      reject_reason = ev.reject_reason;
      retry_after_ms = ev.retry_after_ms;
      completion_tokens = ev.completion_tokens;
      if (!err) {
        delta += text.finish();
        if (text.stopped()) reason = finish_reason::stop;
      } else {
        reason = finish_reason::error;
      }
    }
    return delta;
  }
  std::string consume(std::vector<token_event>& evs) {
    std::string delta;
    for (auto& ev : evs) delta += consume_one(ev);
    return delta;
  }

  /// Next events, or a synthetic timeout event once the deadline (plus a grace period in
  /// which the engine may report its own deadline error) has passed.
  kj::Promise<std::vector<token_event>> next() {
    auto now = std::chrono::steady_clock::now();
    int64_t left = deadline > now ? std::chrono::duration_cast<std::chrono::milliseconds>(deadline - now).count() : 0;
    auto timeout = srv.timer.afterDelay(left * kj::MILLISECONDS).then([this] {
      ++srv.timeouts;
      timed_out = true;
      token_event ev;
      ev.finished = true;
      ev.reason = finish_reason::error;
      ev.err = error(error_kind::overloaded,
                     fmt::format("request {} ran past its deadline of {} ms (limits.request_timeout_ms); "
                                 "retry with fewer max_tokens or when the server is less busy",
                                 id, srv.lim.request_timeout_ms));
      ev.prompt_tokens = prompt_tokens;
      ev.completion_tokens = text.tokens_consumed();
      std::vector<token_event> v;
      v.push_back(std::move(ev));
      return v;
    });
    return ch.next().exclusiveJoin(kj::mv(timeout));
  }

  openai_server::impl& srv;
  event_channel ch;
  text_assembler text;
  std::string id, model, created;
  bool chat = false, include_usage = false;
  bool submitted = false, engine_done = false, done = false, timed_out = false;
  std::chrono::steady_clock::time_point deadline;
  finish_reason reason = finish_reason::none;
  std::optional<error> err;
  std::string reject_reason;
  int64_t retry_after_ms = 0;
  int32_t prompt_tokens = 0, completion_tokens = 0, cached_tokens = 0;
  std::string full;
  bool first_chunk = true;
  kj::Own<kj::AsyncOutputStream> out;
};

void write_usage(json::writer& w, const gen_state& g) {
  w.key("usage").begin_object();
  w.key("prompt_tokens").num(g.prompt_tokens).key("completion_tokens").num(g.completion_tokens);
  w.key("total_tokens").num(g.prompt_tokens + g.completion_tokens);
  if (g.cached_tokens > 0) w.key("prompt_tokens_details").begin_object().key("cached_tokens").num(g.cached_tokens).end_object();
  w.end_object();
}

void write_head(json::writer& w, const gen_state& g, bool chunk) {
  w.key("id").str(g.id);
  w.key("object").str(g.chat ? (chunk ? "chat.completion.chunk" : "chat.completion") : "text_completion");
  w.key("created").raw(g.created).key("model").str(g.model);
}

/// One SSE chunk carrying `delta` (and the finish reason when `final`).
std::string chunk_json(gen_state& g, const std::string& delta, bool final) {
  json::writer w;
  w.begin_object();
  write_head(w, g, true);
  w.key("choices").begin_array().begin_object().key("index").num(0);
  if (g.chat) {
    w.key("delta").begin_object();
    if (g.first_chunk) w.key("role").str("assistant");
    if (!final || !delta.empty() || g.first_chunk) w.key("content").str(delta);
    w.end_object();
  } else {
    w.key("text").str(delta);
  }
  g.first_chunk = false;
  w.key("logprobs").null().key("finish_reason");
  if (final) w.str(transport::finish_reason_name(g.reason));
  else w.null();
  w.end_object().end_array();
  if (g.include_usage) w.key("usage").null();
  w.end_object();
  return w.take();
}

std::string sse(const std::string& json) { return "data: " + json + "\n\n"; }

kj::Promise<void> collect(gen_state& g) {
  if (g.done) return kj::READY_NOW;
  return g.next().then([&g](std::vector<token_event> evs) {
    g.full += g.consume(evs);
    return collect(g);
  });
}

/// The SSE events for one engine event's text (and the end of the stream once done). An event
/// that carried tokens gets its chunk even when their text is held back (the first bytes of a
/// UTF-8 sequence, a possible stop string), as vLLM does: the client sees each token when it
/// is generated, so its TTFT and inter-token gaps are the engine's, not the tokenizer's.
std::string render_events(gen_state& g, const std::string& delta, bool had_tokens) {
  std::string data;
  if (!g.done) {
    if (!delta.empty() || had_tokens || (g.chat && g.first_chunk)) data = sse(chunk_json(g, delta, false));
  } else if (g.err) {
    if (!delta.empty()) data = sse(chunk_json(g, delta, false));
    // The status line went out with the first token: the error travels in-band, then [DONE].
    ++g.srv.stream_errors;
    data += sse(error_json(from_engine(*g.err, g.reject_reason, g.retry_after_ms))) + "data: [DONE]\n\n";
  } else {
    g.srv.completion_tokens += g.completion_tokens;
    data = sse(chunk_json(g, delta, true));
    if (g.include_usage) {
      json::writer w;
      w.begin_object();
      write_head(w, g, true);
      w.key("choices").begin_array().end_array();
      write_usage(w, g);
      w.end_object();
      data += sse(w.take());
    }
    data += "data: [DONE]\n\n";
  }
  if (!data.empty()) ++g.srv.stream_events;
  return data;
}

/// Writes one SSE chunk per engine event (events that arrived together go out in one
/// write), then waits for more.
kj::Promise<void> stream_step(gen_state& g, std::vector<token_event> evs) {
  std::string data;
  for (auto& ev : evs) {
    if (g.done) break;
    const bool had_tokens = !ev.tokens.empty();
    std::string d = g.consume_one(ev);
    data += render_events(g, d, had_tokens);
  }
  kj::Promise<void> wrote = kj::READY_NOW;
  if (!data.empty()) {
    auto s = kj::heapString(data.data(), data.size());
    auto p = g.out->write(s.begin(), s.size());
    wrote = p.attach(kj::mv(s));
    // A client that stops reading fills the socket and this write waits; the engine's events
    // queue up meanwhile. Beyond the bound, or past the deadline (at least 2 s per write, so
    // the deadline's own error still goes out), the request is aborted (gen_state's destructor
    // frees its pages) and the stream is closed: the error cannot reach a client that does not
    // read, so the missing [DONE] is the explicit end.
    auto now = std::chrono::steady_clock::now();
    const int64_t left = std::max<int64_t>(
        2000, g.deadline > now ? std::chrono::duration_cast<std::chrono::milliseconds>(g.deadline - now).count() : 0);
    auto late = g.srv.timer.afterDelay(left * kj::MILLISECONDS).then([&g]() {
      ++g.srv.stream_backlog_aborts;
      spdlog::warn("http: request {}: the client did not read the stream before the request's deadline "
                   "(limits.request_timeout_ms = {}); aborting the request and closing the stream",
                   g.id, g.srv.lim.request_timeout_ms);
      kj::throwFatalException(KJ_EXCEPTION(OVERLOADED, "SSE client too slow: stream not read by the deadline"));
    });
    wrote = wrote.exclusiveJoin(kj::mv(late));
    if (!g.done) {
      const size_t bound = static_cast<size_t>(std::max(1, g.srv.lim.http_stream_backlog_tokens));
      auto over = g.ch.overflow(bound).then([&g, bound]() {
        ++g.srv.stream_backlog_aborts;
        spdlog::warn("http: request {}: the client stopped reading and more than {} tokens wait for it "
                     "(limits.http_stream_backlog_tokens); aborting the request and closing the stream",
                     g.id, bound);
        kj::throwFatalException(KJ_EXCEPTION(OVERLOADED, "SSE client too slow: stream backlog over its bound"));
      });
      wrote = wrote.exclusiveJoin(kj::mv(over));
    }
  }
  if (g.done) return wrote;
  return wrote.then([&g] { return g.next(); }).then([&g](std::vector<token_event> evs) { return stream_step(g, kj::mv(evs)); });
}

}  // namespace

kj::Promise<void> openai_server::impl::generate(route_id r, const std::string& text, kj::HttpService::Response& response,
                                                kj::AsyncIoStream& conn) {
  json::value body;
  try {
    body = json::parse(text);
  } catch (const json::parse_error& e) {
    throw bad_request(fmt::format("malformed JSON: {}", e.what()), "", "invalid_json");
  }
  if (body.k != json::kind::object)
    throw bad_request(fmt::format("the request body must be a JSON object, got {}", json::kind_name(body.k)), "", "invalid_type");
  const bool chat = r == r_chat;
  if (auto pe = transport::check_fields(body, chat)) {
    const bool unknown = transport::classify_field(pe->param, chat) == transport::field_policy::unknown;
    throw http_error{422, pe->message, "invalid_request_error", pe->param,
                     unknown ? "unknown_parameter" : "unsupported_parameter", std::nullopt};
  }
  parsed_request pr;
  parse_common(body, pr, chat);
  if (auto fe = transport::parse_sampling_extras(body, pr.gen.sampling, api.tok().n_vocab()))
    throw http_error{fe->status, fe->message, "invalid_request_error", fe->param, fe->code, std::nullopt};
  if (auto fe = transport::parse_response_format(body, chat, pr.gen.sampling.grammar, lim))
    throw http_error{fe->status, fe->message, "invalid_request_error", fe->param, fe->code, std::nullopt};
  // A request without `model` uses the served one; another name is 404 unless the operator
  // accepts any (clients that hard-code a model name).
  if (auto* m = field(body, "model"); m && m->s != api.model_id() && !lim.accept_any_model_name)
    throw http_error{404, fmt::format("model '{}' is not served here; this server serves '{}' (GET /v1/models)", m->s, api.model_id()),
                     "invalid_request_error", "model", "model_not_found", std::nullopt};
  const tokenizer& tok = api.tok();
  auto invalid = [](std::string param, std::string msg) {
    return http_error{422, std::move(msg), "invalid_request_error", std::move(param), "invalid_value", std::nullopt};
  };
  if (auto n = get_int(body, "n"); n && *n != 1) throw invalid("n", fmt::format("n = {} is not supported; only n = 1 is allowed", *n));

  if (chat) {
    chat_request cr;
    try {
      cr = parse_chat_request(body);
    } catch (const chat_input_error& e) {
      throw bad_request(e.message, e.param, e.code);
    }
    try {
      pr.prompt = chat_prompt->prompt(cr);
    } catch (const error& e) {
      throw invalid("messages", e.what());
    }
  } else {
    auto* p = field(body, "prompt");
    if (!p) throw bad_request("'prompt' is required", "prompt", "missing_field");
    const json::value* pv = p;
    if (p->k == json::kind::array && p->arr.size() == 1 && p->arr[0].k == json::kind::string) pv = &p->arr[0];
    if (pv->k == json::kind::string) {
      pr.prompt = tok.encode(pv->s, true);
    } else if (pv->k == json::kind::array) {
      for (auto& e : pv->arr) {
        if (e.k != json::kind::number || !e.is_int) wrong_type("prompt", "a string or an array of token ids", e);
        if (e.i < 0 || e.i >= tok.n_vocab())
          throw invalid("prompt", fmt::format("prompt token id {} is out of range; ids are 0 to {}", e.i, tok.n_vocab() - 1));
        pr.prompt.push_back(static_cast<int32_t>(e.i));
      }
    } else {
      wrong_type("prompt", "a string or an array of token ids", *pv);
    }
  }
  if (!pr.max_tokens_set) pr.gen.max_tokens = transport::default_max_tokens(pr.prompt.size(), api.max_context(), lim);
  if (auto pe = transport::check_params(pr.gen, pr.prompt.size(), api.max_context(), lim)) throw invalid(pe->param, pe->message);

  auto g = kj::heap<gen_state>(*this, tok, pr.gen.stop);
  g->id = chat ? chat_ids.next() : ids.next();
  g->chat = chat;
  g->include_usage = pr.include_usage;
  g->model = api.model_id();
  g->created = unix_now_s();
  g->prompt_tokens = static_cast<int32_t>(pr.prompt.size());
  auto req = transport::make_request(g->id, std::move(pr.prompt), pr.gen, tok, lim);
  g->deadline = req.deadline + std::chrono::milliseconds(std::min(2000, lim.request_timeout_ms));
  g->submitted = true;
  api.submit(std::move(req), g->ch.callback());
  auto& gs = *g;

  auto disconnected = watch_disconnect(conn).then([this, &gs]() {
    ++client_disconnects;
    spdlog::info("http: client went away; aborting {}", gs.id);
    kj::throwFatalException(KJ_EXCEPTION(DISCONNECTED, "client disconnected"));
  });

  if (!pr.stream) {
    auto work = collect(gs).then([this, &gs, &response, r]() -> kj::Promise<void> {
      if (gs.err) return send_error(response, from_engine(*gs.err, gs.reject_reason, gs.retry_after_ms), r);
      completion_tokens += gs.completion_tokens;
      json::writer w;
      w.begin_object();
      write_head(w, gs, false);
      w.key("choices").begin_array().begin_object().key("index").num(0);
      if (gs.chat) w.key("message").begin_object().key("role").str("assistant").key("content").str(gs.full).end_object();
      else w.key("text").str(gs.full);
      w.key("logprobs").null().key("finish_reason").str(transport::finish_reason_name(gs.reason));
      w.end_object().end_array();
      write_usage(w, gs);
      w.end_object();
      return send_body(response, 200, "application/json", w.take(), r);
    });
    return work.exclusiveJoin(kj::mv(disconnected)).attach(kj::mv(g));
  }

  // Streaming: wait for the first event so an immediate engine error still gets its status.
  auto work = gs.next().then([this, &gs, &response, &conn, r](std::vector<token_event> evs) -> kj::Promise<void> {
    if (!evs.empty() && evs[0].finished && evs[0].err) {
      gs.consume_one(evs[0]);
      return send_error(response, from_engine(*gs.err, gs.reject_reason, gs.retry_after_ms), r);
    }
    count(r, 200);
    KJ_IF_MAYBE(fd, conn.getFd()) {
      // Bounds the kernel's share of a slow client's backlog; ours is http_stream_backlog_tokens.
      int bytes = lim.http_stream_socket_bytes;
      ::setsockopt(*fd, SOL_SOCKET, SO_SNDBUF, &bytes, sizeof bytes);
    }
    kj::HttpHeaders h(*header_table);
    h.set(h_content_type, "text/event-stream");
    h.set(h_cache_control, "no-cache");
    gs.out = response.send(200, "OK", h);
    return stream_step(gs, kj::mv(evs));
  });
  return work.exclusiveJoin(kj::mv(disconnected)).attach(kj::mv(g));
}

openai_server::openai_server(serving_api& api, const limits& lim, kj::Timer& timer)
    : impl_(std::make_unique<impl>(api, lim, timer)) {}

openai_server::~openai_server() = default;

kj::Promise<void> openai_server::listen(kj::ConnectionReceiver& listener) { return impl_->front->listen(listener); }

void openai_server::set_chat_template(const std::string& source) {
  impl_->chat_prompt = std::make_unique<chat_prompter>(impl_->api.tok(), source);
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
