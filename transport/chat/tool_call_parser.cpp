#include "transport/chat/tool_call_parser.h"

#include <charconv>

#include "kernels/base/json.h"

namespace tandem {
namespace {

constexpr std::string_view hermes_open = "<tool_call>", hermes_close = "</tool_call>";
constexpr std::string_view mistral_marker = "[TOOL_CALLS]";
constexpr std::string_view python_tag = "<|python_tag|>";

bool is_space(char c) { return c == ' ' || c == '\n' || c == '\t' || c == '\r'; }

size_t skip_space(std::string_view s, size_t i) {
  while (i < s.size() && is_space(s[i])) ++i;
  return i;
}

/// Length of the longest suffix of `s` that is a proper prefix of `marker`: text that may
/// still become the marker.
size_t marker_prefix_at_end(std::string_view s, std::string_view marker) {
  for (size_t k = std::min(s.size(), marker.size() - 1); k > 0; --k)
    if (s.substr(s.size() - k) == marker.substr(0, k)) return k;
  return 0;
}

/// One past the bracket that closes the JSON object or array starting at s[i]; npos while
/// it is incomplete (brackets inside strings do not count).
size_t json_value_end(std::string_view s, size_t i) {
  int depth = 0;
  bool in_str = false, esc = false;
  for (; i < s.size(); ++i) {
    const char c = s[i];
    if (in_str) {
      if (esc) esc = false;
      else if (c == '\\') esc = true;
      else if (c == '"') in_str = false;
      continue;
    }
    if (c == '"') in_str = true;
    else if (c == '{' || c == '[') ++depth;
    else if (c == '}' || c == ']') {
      if (--depth == 0) return i + 1;
    }
  }
  return std::string_view::npos;
}

/// Compact JSON text of a parsed value (json.dumps-like, without spaces).
void write_json(std::string& out, const json::value& v) {
  switch (v.k) {
    case json::kind::null: out += "null"; return;
    case json::kind::boolean: out += v.b ? "true" : "false"; return;
    case json::kind::number: {
      char buf[32];
      auto res = v.is_int ? std::to_chars(buf, buf + sizeof buf, v.i) : std::to_chars(buf, buf + sizeof buf, v.num);
      out.append(buf, res.ptr);
      return;
    }
    case json::kind::string: out += json::quote(v.s); return;
    case json::kind::array:
      out += '[';
      for (size_t i = 0; i < v.arr.size(); ++i) {
        if (i) out += ',';
        write_json(out, v.arr[i]);
      }
      out += ']';
      return;
    case json::kind::object:
      out += '{';
      for (size_t i = 0; i < v.obj.size(); ++i) {
        if (i) out += ',';
        out += json::quote(v.obj[i].first);
        out += ':';
        write_json(out, v.obj[i].second);
      }
      out += '}';
      return;
  }
}

/// {"name": N, "arguments"|"parameters": {...} or "..."} as a call; false if it is not one.
bool to_call(const json::value& v, parsed_tool_call& c) {
  if (v.k != json::kind::object) return false;
  auto* name = v.find("name");
  if (!name || name->k != json::kind::string || name->s.empty()) return false;
  const json::value* args = v.find("arguments");
  if (!args) args = v.find("parameters");
  c.name = name->s;
  c.arguments.clear();
  if (!args || args->k == json::kind::null) c.arguments = "{}";
  else if (args->k == json::kind::string) c.arguments = args->s;
  else if (args->k == json::kind::object) write_json(c.arguments, *args);
  else return false;
  return true;
}

}  // namespace

tool_call_format tool_call_format_for_template(std::string_view t) {
  if (t.find(hermes_open) != std::string_view::npos) return tool_call_format::hermes;
  if (t.find(mistral_marker) != std::string_view::npos) return tool_call_format::mistral;
  // Llama 3.x: header tokens and the {"name": ..., "parameters": ...} instruction.
  if (t.find("<|start_header_id|>") != std::string_view::npos && t.find("\"parameters\"") != std::string_view::npos)
    return tool_call_format::llama3_json;
  return tool_call_format::none;
}

std::string_view tool_call_format_name(tool_call_format f) {
  switch (f) {
    case tool_call_format::none: return "none";
    case tool_call_format::hermes: return "hermes";
    case tool_call_format::llama3_json: return "llama3_json";
    case tool_call_format::mistral: return "mistral";
  }
  return "none";
}

std::vector<std::string_view> tool_call_markers(tool_call_format f) {
  switch (f) {
    case tool_call_format::hermes: return {hermes_open, hermes_close};
    case tool_call_format::llama3_json: return {python_tag};
    case tool_call_format::mistral: return {mistral_marker};
    case tool_call_format::none: break;
  }
  return {};
}

void tool_call_parser::drop_hidden(result& r) const {
  // A hidden marker comes from one control token, so it arrives whole in one push and leaves
  // whole in one result (text mode holds back marker prefixes; every other path gives whole
  // buffers back). Only a stop string's held-back prefix could split one: its pieces stay.
  for (const auto& m : hidden_)
    for (size_t p = r.content.find(m); p != std::string::npos; p = r.content.find(m, p)) r.content.erase(p, m.size());
}

bool tool_call_parser::take_calls(std::string_view body, result& r) {
  json::value v;
  try {
    v = json::parse(body);
  } catch (const json::parse_error&) {
    return false;
  }
  std::vector<parsed_tool_call> calls;
  if (v.k == json::kind::array) {
    if (v.arr.empty()) return false;
    for (auto& e : v.arr) {
      parsed_tool_call c;
      if (!to_call(e, c)) return false;
      calls.push_back(std::move(c));
    }
  } else {
    parsed_tool_call c;
    if (!to_call(v, c)) return false;
    calls.push_back(std::move(c));
  }
  calls_found_ += calls.size();
  for (auto& c : calls) r.calls.push_back(std::move(c));
  return true;
}

void tool_call_parser::step(result& r, bool at_end) {
  auto give_up = [&] {  // everything held back is content after all
    r.content += buf_;
    buf_.clear();
  };
  for (;;) {
    switch (mode_) {
      case mode::plain:
        r.content += buf_;
        buf_.clear();
        return;

      case mode::start: {
        if (format_ != tool_call_format::llama3_json) {
          mode_ = mode::text;
          continue;
        }
        // Llama 3: a call is the whole reply; decide from its first non-space bytes.
        const size_t i = skip_space(buf_, 0);
        std::string_view rest = std::string_view(buf_).substr(i);
        if (rest.empty() || (rest.size() < python_tag.size() && python_tag.starts_with(rest))) {
          if (at_end) give_up();
          return;
        }
        mode_ = (rest.starts_with(python_tag) || rest[0] == '{') ? mode::call : mode::plain;
        continue;
      }

      case mode::text: {
        if (format_ == tool_call_format::none || format_ == tool_call_format::llama3_json) {
          mode_ = mode::plain;
          continue;
        }
        const std::string_view marker = format_ == tool_call_format::hermes ? hermes_open : mistral_marker;
        const size_t p = buf_.find(marker);
        if (p == std::string::npos) {
          const size_t hold = at_end ? 0 : marker_prefix_at_end(buf_, marker);
          r.content.append(buf_, 0, buf_.size() - hold);
          buf_.erase(0, buf_.size() - hold);
          return;
        }
        r.content.append(buf_, 0, p);
        buf_.erase(0, p);
        mode_ = mode::call;
        continue;
      }

      case mode::call: {
        std::string_view b = buf_;
        if (format_ == tool_call_format::hermes) {
          const size_t q = b.find(hermes_close, hermes_open.size());
          if (q == std::string_view::npos) {
            if (at_end) {
              // Models often end the reply without the closing tag.
              if (take_calls(b.substr(hermes_open.size()), r)) buf_.clear();
              else give_up();
              return;
            }
            if (buf_.size() > max_call_bytes) {
              give_up();
              mode_ = mode::plain;
            }
            return;
          }
          const size_t end = q + hermes_close.size();
          if (!take_calls(b.substr(hermes_open.size(), q - hermes_open.size()), r)) r.content.append(buf_, 0, end);
          buf_.erase(0, end);
          mode_ = mode::text;
          continue;
        }
        // mistral: one JSON array (or object) after the marker; llama3_json: objects separated
        // by ';', after an optional <|python_tag|>.
        size_t i = 0;
        if (format_ == tool_call_format::mistral) i = mistral_marker.size();
        i = skip_space(b, i);
        if (format_ == tool_call_format::llama3_json && calls_found_ > 0) {
          // After a call: `; {...}` continues with another one; anything else is content.
          if (i >= b.size()) {
            if (at_end) buf_.clear();  // trailing spaces after the last call
            return;
          }
          if (b[i] != ';') {
            mode_ = mode::plain;
            continue;
          }
          i = skip_space(b, i + 1);
        }
        if (format_ == tool_call_format::llama3_json) {
          const std::string_view rest = b.substr(i);
          if (!rest.empty() && rest.size() < python_tag.size() && python_tag.starts_with(rest)) {
            if (at_end) give_up();  // may still become the tag: wait for more text
            return;
          }
          if (rest.starts_with(python_tag)) i = skip_space(b, i + python_tag.size());
        }
        if (i >= b.size()) {
          if (at_end) give_up();
          return;
        }
        if (b[i] != '{' && b[i] != '[') {
          if (format_ == tool_call_format::mistral) {
            // Not a call after all: the marker is text, and what follows is scanned again.
            r.content.append(mistral_marker);
            buf_.erase(0, mistral_marker.size());
            mode_ = mode::text;
            continue;
          }
          give_up();
          mode_ = mode::plain;
          continue;
        }
        const size_t e = json_value_end(b, i);
        if (e == std::string_view::npos) {
          if (at_end || buf_.size() > max_call_bytes) {
            give_up();
            mode_ = mode::plain;
          }
          return;
        }
        if (!take_calls(b.substr(i, e - i), r)) {
          if (format_ == tool_call_format::mistral) {
            // Not calls: the text up to the end of that JSON is content, the rest scanned again.
            r.content.append(buf_, 0, e);
            buf_.erase(0, e);
            mode_ = mode::text;
            continue;
          }
          give_up();
          mode_ = mode::plain;
          continue;
        }
        buf_.erase(0, e);
        if (format_ == tool_call_format::mistral) mode_ = mode::text;
        continue;
      }
    }
  }
}

tool_call_parser::result tool_call_parser::push(std::string_view text) {
  result r;
  buf_.append(text);
  step(r, false);
  drop_hidden(r);
  return r;
}

tool_call_parser::result tool_call_parser::finish() {
  result r;
  step(r, true);
  r.content += buf_;
  buf_.clear();
  drop_hidden(r);
  return r;
}

}  // namespace tandem
