#pragma once
/// The OpenAI error shape of the HTTP front end: the error a handler throws or returns, how
/// engine errors map to statuses, and its JSON body.
#include <cstdint>
#include <optional>
#include <string>

#include <kj/string.h>

#include "kernels/base/error.h"

namespace tandem::openai {

/// An error that becomes a JSON error response.
struct http_error {
  unsigned status;
  std::string message;
  std::string type;
  std::string param;  ///< "" = null
  std::string code;   ///< "" = null
  std::optional<int> retry_after_s;
};

/// A 400 invalid_request_error.
http_error bad_request(std::string msg, std::string param = "", std::string code = "invalid_request");

/// Retry-After seconds from the router's estimate (ms; 0 = unknown -> 1 s).
int retry_after_s(int64_t ms);

/// The status of a refused request. A queue timeout (still queued past its queue deadline)
/// or a deadline that passed before anything streamed (e.g. a prefill that started on a node
/// that then stopped) is 504: the server, not the client, ran out of time. 408 is not used:
/// the OpenAI API carries no client deadline for the server to miss.
http_error from_engine(const error& e, const std::string& reason = "", int64_t retry_after_ms = 0);

/// {"error": {message, type, param, code}}.
std::string error_json(const http_error& e);

/// The reason phrase of status `s`.
kj::StringPtr status_text(unsigned s);

}  // namespace tandem::openai
