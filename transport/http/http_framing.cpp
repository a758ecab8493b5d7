#include "transport/http/http_framing.h"

#include <algorithm>
#include <cctype>

#include <fmt/format.h>

namespace tandem::transport {

namespace {

std::string_view trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t')) s.remove_suffix(1);
  return s;
}

bool iequals(std::string_view a, std::string_view b) {
  return a.size() == b.size() && std::equal(a.begin(), a.end(), b.begin(), [](char x, char y) {
           return std::tolower(static_cast<unsigned char>(x)) == std::tolower(static_cast<unsigned char>(y));
         });
}

/// RFC 9110 token characters (header names, methods).
bool token_char(char c) {
  if (std::isalnum(static_cast<unsigned char>(c))) return true;
  return std::string_view("!#$%&'*+-.^_`|~").find(c) != std::string_view::npos;
}

framing_error bad(std::string message) { return {400, "bad_http", std::move(message)}; }

/// Strips a line's "\r" ending ("\n" was already cut off).
std::string_view chomp(std::string_view line) {
  if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
  return line;
}

}  // namespace

std::variant<head_info, framing_error> check_request_head(std::string_view head) {
  head_info info;
  size_t pos = head.find('\n');
  if (pos == std::string_view::npos) return bad("the request head does not end with an empty line");
  std::string_view request_line = chomp(head.substr(0, pos));
  // METHOD SP request-target SP HTTP-version, nothing else on the line.
  size_t sp1 = request_line.find(' '), sp2 = request_line.rfind(' ');
  if (sp1 == std::string_view::npos || sp1 == sp2 || sp1 == 0 ||
      request_line.substr(sp1 + 1, sp2 - sp1 - 1).find(' ') != std::string_view::npos)
    return bad("the request line must be METHOD PATH HTTP/1.1");
  for (char c : request_line.substr(0, sp1))
    if (!token_char(c)) return bad("the request method is not a token; send e.g. GET or POST");
  std::string_view version = request_line.substr(sp2 + 1);
  if (version.size() != 8 || version.substr(0, 5) != "HTTP/" || !std::isdigit(static_cast<unsigned char>(version[5])) ||
      version[6] != '.' || !std::isdigit(static_cast<unsigned char>(version[7])))
    return bad("the request line must end with the HTTP version, e.g. HTTP/1.1");
  if (version == "HTTP/1.0") info.keep_alive = false;
  else if (version != "HTTP/1.1")
    return framing_error{505, "http_version_not_supported",
                         fmt::format("{} is not supported; send HTTP/1.1 (or HTTP/1.0)", version)};

  int lengths = 0, encodings = 0;
  for (size_t at = pos + 1; at < head.size();) {
    size_t nl = head.find('\n', at);
    if (nl == std::string_view::npos) nl = head.size();
    std::string_view line = chomp(head.substr(at, nl - at));
    at = nl + 1;
    if (line.empty()) break;  // the end of the head
    if (line.front() == ' ' || line.front() == '\t')
      return bad("a header line starts with whitespace (obsolete line folding); send each header on one line");
    size_t colon = line.find(':');
    if (colon == std::string_view::npos || colon == 0) return bad("a header line is not 'Name: value'");
    std::string_view name = line.substr(0, colon), value = trim(line.substr(colon + 1));
    for (char c : name)
      if (!token_char(c)) return bad("a header name holds a character that is not allowed (whitespace before ':'?)");
    if (iequals(name, "Content-Length")) {
      if (++lengths > 1) return bad("more than one Content-Length header; send exactly one");
      if (value.empty() || !std::all_of(value.begin(), value.end(), [](char c) { return c >= '0' && c <= '9'; }))
        return bad("Content-Length must be a non-negative decimal number of bytes");
      uint64_t n = 0;
      for (char c : value) {
        const uint64_t d = static_cast<uint64_t>(c - '0');
        n = n > (UINT64_MAX - d) / 10 ? UINT64_MAX : n * 10 + d;  // saturate: 413 says it is too large
      }
      info.body = head_info::body_kind::length;
      info.length = n;
    } else if (iequals(name, "Transfer-Encoding")) {
      if (++encodings > 1) return bad("more than one Transfer-Encoding header; send one: 'Transfer-Encoding: chunked'");
      if (!iequals(value, "chunked"))
        return bad("only 'Transfer-Encoding: chunked' is supported; send the body plain with a Content-Length");
      info.body = head_info::body_kind::chunked;
    } else if (iequals(name, "Connection")) {
      // A comma-separated list of options; only "close" matters to us.
      std::string_view rest = value;
      while (!rest.empty()) {
        size_t comma = rest.find(',');
        if (iequals(trim(rest.substr(0, comma)), "close")) info.keep_alive = false;
        if (comma == std::string_view::npos) break;
        rest.remove_prefix(comma + 1);
      }
    }
  }
  if (lengths > 0 && encodings > 0)
    return bad("the request has both Content-Length and Transfer-Encoding (RFC 9112 6.1); send only one of them");
  return info;
}

request_framer::request_framer(size_t max_head_bytes) : max_head_bytes_(max_head_bytes) {}

void request_framer::fail(unsigned status, std::string code, std::string message) {
  error_in_body_ = state_ != state::head;
  error_ = framing_error{status, std::move(code), std::move(message)};
  state_ = state::done;
}

std::optional<head_info> request_framer::take_head() {
  if (pending_.empty()) return std::nullopt;
  head_info h = pending_.front();
  pending_.pop_front();
  return h;
}

void request_framer::end_of_body() {
  if (keep_alive_) {
    state_ = state::head;
  } else {
    state_ = state::done;
    finished_ = true;
  }
}

void request_framer::on_head_complete(size_t end, std::string& out) {
  auto checked = check_request_head(std::string_view(head_).substr(0, end));
  if (auto* e = std::get_if<framing_error>(&checked)) {
    fail(e->status, std::move(e->code), std::move(e->message));
    return;
  }
  const head_info info = std::get<head_info>(checked);
  out.append(head_, 0, end);
  head_.clear();
  ++heads_;
  pending_.push_back(info);
  keep_alive_ = info.keep_alive;
  if (info.body == head_info::body_kind::chunked) {
    state_ = state::chunk_size;
    line_.clear();
  } else if (info.body == head_info::body_kind::length && info.length > 0) {
    state_ = state::length_body;
    left_ = info.length;
  } else {
    end_of_body();
  }
}

bool request_framer::take_line(std::string_view in, size_t& i, size_t max) {
  size_t nl = in.find('\n', i);
  size_t end = nl == std::string_view::npos ? in.size() : nl + 1;
  line_.append(in.substr(i, end - i));  // handed on by the caller once checked
  i = end;
  if (nl == std::string_view::npos) {
    if (line_.size() > max) fail(400, "bad_http", "a line of the chunked body is too long; send 'HEX-SIZE\\r\\n'");
    return false;
  }
  return true;
}

void request_framer::feed(std::string_view in, std::string& out) {
  size_t i = 0;
  while (i < in.size()) {
    switch (state_) {
      case state::done: return;
      case state::head: {
        // Empty lines before a request line are allowed (RFC 9112 2.2) and dropped.
        if (head_.empty()) {
          while (i < in.size() && (in[i] == '\r' || in[i] == '\n')) ++i;
          if (i == in.size()) return;
        }
        const size_t old = head_.size();
        const size_t take = std::min(in.size() - i, max_head_bytes_ + 2 - std::min(old, max_head_bytes_ + 2));
        head_.append(in.substr(i, take));
        i += take;
        // The head ends at an empty line: "\n\r\n" or "\n\n".
        size_t from = old >= 3 ? old - 3 : 0, end = std::string::npos;
        for (size_t p = head_.find('\n', from); p != std::string::npos; p = head_.find('\n', p + 1)) {
          if (p + 1 < head_.size() && head_[p + 1] == '\n') {
            end = p + 2;
            break;
          }
          if (p + 2 < head_.size() && head_[p + 1] == '\r' && head_[p + 2] == '\n') {
            end = p + 3;
            break;
          }
        }
        if (end == std::string::npos || end > max_head_bytes_) {
          if (head_.size() > max_head_bytes_)
            fail(431, "head_too_large",
                 fmt::format("the request head is over {} bytes (limits.http_max_head_bytes); send fewer or shorter headers",
                             max_head_bytes_));
          continue;
        }
        // Bytes past the head's end belong to its body: hand them back to the loop.
        const size_t extra = head_.size() - end;
        i -= extra;
        on_head_complete(end, out);
        break;
      }
      case state::length_body: {
        const size_t n = static_cast<size_t>(std::min<uint64_t>(left_, in.size() - i));
        out.append(in.substr(i, n));
        i += n;
        left_ -= n;
        if (left_ == 0) end_of_body();
        break;
      }
      case state::chunk_size: {
        if (!take_line(in, i, 1024)) break;
        std::string_view size = chomp(std::string_view(line_).substr(0, line_.size() - 1));
        size = trim(size.substr(0, size.find(';')));  // chunk extensions are ignored (RFC 9112 7.1.1)
        if (size.empty() || size.size() > 15 || !std::all_of(size.begin(), size.end(), [](char c) {
              return std::isxdigit(static_cast<unsigned char>(c)) != 0;
            })) {
          fail(400, "bad_http", "a chunk size is not a hexadecimal number; send 'HEX-SIZE\\r\\n' before each chunk");
          break;
        }
        left_ = std::stoull(std::string(size), nullptr, 16);
        out += line_;
        line_.clear();
        state_ = left_ == 0 ? state::trailers : state::chunk_data;
        trailer_bytes_ = 0;
        break;
      }
      case state::chunk_data: {
        const size_t n = static_cast<size_t>(std::min<uint64_t>(left_, in.size() - i));
        out.append(in.substr(i, n));
        i += n;
        left_ -= n;
        if (left_ == 0) state_ = state::chunk_data_end;
        break;
      }
      case state::chunk_data_end: {
        if (!take_line(in, i, 2)) break;
        if (chomp(std::string_view(line_).substr(0, line_.size() - 1)).size() != 0) {
          fail(400, "bad_http", "a chunk is longer than its size; end each chunk with '\\r\\n' after exactly SIZE bytes");
          break;
        }
        out += line_;
        line_.clear();
        state_ = state::chunk_size;
        break;
      }
      case state::trailers: {
        const size_t before = line_.size();
        if (!take_line(in, i, max_head_bytes_)) break;
        trailer_bytes_ += line_.size() - before;
        if (trailer_bytes_ > max_head_bytes_) {
          fail(431, "head_too_large", "the chunked body's trailer section is too large (limits.http_max_head_bytes)");
          break;
        }
        const bool empty = chomp(std::string_view(line_).substr(0, line_.size() - 1)).empty();
        out += line_;
        line_.clear();
        if (empty) end_of_body();
        break;
      }
    }
  }
}

bool head_reader_bound::acquire(const std::string& client) {
  int& n = by_client_[client];
  if (n >= per_client_) {
    if (n == 0) by_client_.erase(client);
    ++refused_;
    return false;
  }
  ++n;
  ++readers_;
  return true;
}

void head_reader_bound::release(const std::string& client) {
  auto it = by_client_.find(client);
  if (it == by_client_.end()) return;
  --readers_;
  if (--it->second <= 0) by_client_.erase(it);
}

std::optional<int64_t> log_gate::allow(int64_t now_ms) {
  if (last_ms_ != INT64_MIN && now_ms - last_ms_ < interval_ms_) {
    ++suppressed_;
    return std::nullopt;
  }
  last_ms_ = now_ms;
  const int64_t s = suppressed_;
  suppressed_ = 0;
  return s;
}

std::string_view status_reason(unsigned s) {
  switch (s) {
    case 200: return "OK";
    case 400: return "Bad Request";
    case 401: return "Unauthorized";
    case 404: return "Not Found";
    case 405: return "Method Not Allowed";
    case 408: return "Request Timeout";
    case 413: return "Payload Too Large";
    case 415: return "Unsupported Media Type";
    case 422: return "Unprocessable Entity";
    case 429: return "Too Many Requests";
    case 431: return "Request Header Fields Too Large";
    case 500: return "Internal Server Error";
    case 501: return "Not Implemented";
    case 502: return "Bad Gateway";
    case 503: return "Service Unavailable";
    case 504: return "Gateway Timeout";
    case 505: return "HTTP Version Not Supported";
  }
  return "Error";
}

std::string raw_error_response(unsigned status, std::string_view json) {
  return fmt::format("HTTP/1.1 {} {}\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{}",
                     status, status_reason(status), json.size(), json);
}

}  // namespace tandem::transport
