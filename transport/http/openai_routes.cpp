#include <sys/socket.h>

#include <algorithm>
#include <cerrno>
#include <chrono>

#include <fmt/format.h>
#include <kj/debug.h>
#include <spdlog/spdlog.h>

#include "kernels/tokenizer/tokenizer.h"
#include "transport/http/fim_prompt.h"
#include "transport/http/json.h"
#include "transport/http/openai_choice.h"
#include "transport/http/openai_request.h"
#include "transport/http/openai_server_impl.h"
#include "transport/http/openai_stream.h"
#include "transport/http/request_params.h"
#include "transport/http/response_format.h"
#include "transport/http/tokenize_routes.h"
#include "transport/http/tool_choice.h"

namespace tandem {

using namespace openai;


kj::Promise<void> openai_server::impl::handle(kj::HttpMethod method, kj::StringPtr url, const kj::HttpHeaders& headers,
                                              kj::AsyncInputStream& body, kj::HttpService::Response& response,
                                              kj::AsyncIoStream& conn) {
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
    w.begin_object().key("status").str(!h.ok ? "unhealthy" : ready ? "ready" : !h.drain.empty() ? h.drain : "degraded");
    w.key("ready").boolean(ready);
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

std::optional<http_error> openai_server::impl::check_auth(const std::string& path, const kj::HttpHeaders& headers) {
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

kj::Promise<void> openai_server::impl::read_capped(kj::AsyncInputStream& in, std::string& out, uint64_t cap) {
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

kj::Promise<void> openai_server::impl::tokenize(route_id r, const std::string& text, kj::HttpService::Response& response) {
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

kj::Promise<void> openai_server::impl::watch_disconnect(kj::AsyncIoStream& conn) {
  return conn.whenWriteDisconnected().exclusiveJoin(poll_eof(conn));
}

kj::Promise<void> openai_server::impl::poll_eof(kj::AsyncIoStream& conn) {
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
  parse_output_options(body, pr, chat);
  if (auto fe = transport::parse_sampling_extras(body, pr.gen.sampling, api.tok().n_vocab()))
    throw http_error{fe->status, fe->message, "invalid_request_error", fe->param, fe->code, std::nullopt};
  if (auto fe = transport::parse_response_format(body, chat, pr.gen.sampling.grammar, lim))
    throw http_error{fe->status, fe->message, "invalid_request_error", fe->param, fe->code, std::nullopt};
  transport::tool_choice choice;  // a forced call constrains the output like response_format
  if (chat)
    if (auto fe = transport::parse_tool_choice(body, choice, pr.gen.sampling.grammar, lim))
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
  // n choices: one prefill, n sequences sharing the prompt's KV pages at decode.
  int32_t n_choices = 1;
  if (auto n = get_int(body, "n")) {
    const int32_t bound = std::min(lim.max_choices, lim.max_running_seqs);
    if (*n < 1 || *n > bound)
      throw invalid("n", fmt::format("n = {} is out of range; use 1 to {} (limits.max_choices = {}, at most "
                                     "limits.max_running_seqs = {})",
                                     *n, bound, lim.max_choices, lim.max_running_seqs));
    n_choices = static_cast<int32_t>(*n);
  }

  std::string echo;  // completions: the prompt's text, when echoed
  if (chat) {
    chat_request cr;
    try {
      cr = parse_chat_request(body);
    } catch (const chat_input_error& e) {
      throw bad_request(e.message, e.param, e.code);
    }
    // "none": the model is not shown the tools (vLLM's --exclude-tools-when-tool-choice-none).
    if (choice.mode == transport::tool_choice_mode::none) cr.tools = nullptr;
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
      if (pr.echo) echo = pv->s;
    } else if (pv->k == json::kind::array) {
      for (auto& e : pv->arr) {
        if (e.k != json::kind::number || !e.is_int) wrong_type("prompt", "a string or an array of token ids", e);
        if (e.i < 0 || e.i >= tok.n_vocab())
          throw invalid("prompt", fmt::format("prompt token id {} is out of range; ids are 0 to {}", e.i, tok.n_vocab() - 1));
        pr.prompt.push_back(static_cast<int32_t>(e.i));
      }
      if (pr.echo) echo = tok.decode(pr.prompt);
    } else {
      wrong_type("prompt", "a string or an array of token ids", *pv);
    }
    // Fill-in-the-middle: the prompt and the suffix around the model's FIM tokens.
    if (auto* sx = field(body, "suffix")) {
      if (sx->k != json::kind::string) wrong_type("suffix", "a string", *sx);
      if (!sx->s.empty()) {
        if (pr.echo)
          throw invalid("suffix", "suffix with echo is not supported (the prompt is not what the model continues); "
                                  "send one of them");
        std::vector<int32_t> middle_of = pv->k == json::kind::string ? tok.encode(pv->s, false) : pr.prompt;
        std::string why;
        auto fim = transport::fim_prompt(tok, middle_of, sx->s, why);
        if (!fim)
          throw http_error{422, why, "invalid_request_error", "suffix", "unsupported_parameter", std::nullopt};
        pr.prompt = std::move(*fim);
      }
    }
  }
  if (!pr.max_tokens_set) pr.gen.max_tokens = transport::default_max_tokens(pr.prompt.size(), api.max_context(), lim);
  if (auto pe = transport::check_params(pr.gen, pr.prompt.size(), api.max_context(), lim)) throw invalid(pe->param, pe->message);

  auto g = kj::heap<gen_state>(*this, tok, pr.gen.stop, n_choices);
  g->id = chat ? chat_ids.next() : ids.next();
  g->chat = chat;
  g->include_usage = pr.include_usage;
  g->model = api.model_id();
  g->created = unix_now_s();
  g->prompt_tokens = static_cast<int32_t>(pr.prompt.size());
  g->logprobs = pr.logprobs;
  g->echo = std::move(echo);
  for (auto& c : g->choices) c->text_offset = utf8_chars(g->echo);
  // A forced call is a bare {name, arguments} object (the grammar's), whatever the template's format.
  const tool_call_format calls_format = choice.forced() ? tool_call_format::llama3_json : tool_format;
  if (pr.parse_tools && calls_format != tool_call_format::none) {
    // Markers that are control tokens decode to nothing: render them for the parser alone.
    std::vector<std::string> hidden;
    std::vector<std::pair<int32_t, std::string>> render;
    if (!choice.forced() && !tool_markers.empty()) {
      for (const auto& m : tool_markers) {
        render.emplace_back(m.id, m.text);
        hidden.push_back(m.text);
      }
    }
    for (auto& c : g->choices) {
      if (!render.empty()) c->text.render_control(render);
      c->tools = std::make_unique<tool_call_parser>(calls_format, hidden);
    }
  }
  auto req = transport::make_request(g->id, std::move(pr.prompt), pr.gen, tok, lim);
  req.logprobs = pr.logprobs;
  req.n = n_choices;
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
      completion_tokens += gs.completion_tokens();
      return send_body(response, 200, "application/json", response_json(gs), r);
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

}  // namespace tandem
