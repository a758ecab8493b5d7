#include "transport/http/openai_errors.h"

#include <algorithm>

#include "transport/http/http_framing.h"
#include "transport/http/json.h"

namespace tandem::openai {

http_error bad_request(std::string msg, std::string param, std::string code) {
  return {400, std::move(msg), "invalid_request_error", std::move(param), std::move(code), std::nullopt};
}

int retry_after_s(int64_t ms) { return ms <= 0 ? 1 : static_cast<int>(std::min<int64_t>((ms + 999) / 1000, 86400)); }

http_error from_engine(const error& e, const std::string& reason, int64_t retry_after_ms) {
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

}  // namespace tandem::openai
