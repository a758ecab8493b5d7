#include "transport/http/openai_choice.h"

#include <algorithm>
#include <cmath>

#include <fmt/format.h>

namespace tandem::openai {
namespace {

/// OpenAI reports -9999.0 for a probability that underflows; JSON has no -inf.
double finite_logprob(float lp) { return std::isfinite(lp) ? double(lp) : -9999.0; }

std::string token_raw(const tokenizer& tok, int32_t id) {
  std::string b = tok.token_bytes(id);
  return b.empty() ? tok.token_text(id) : b;  // control tokens: their text
}

void write_bytes(json::writer& w, const std::string& raw) {
  w.begin_array();
  for (unsigned char c : raw) w.num(c);
  w.end_array();
}

}  // namespace

std::string logprob_token_text(const tokenizer& tok, int32_t id) {
  std::string raw = token_raw(tok, id);
  if (json::valid_utf8(raw)) return raw;
  std::string out = "bytes:";
  for (unsigned char c : raw) out += fmt::format("\\x{:02x}", c);
  return out;
}

int64_t utf8_chars(std::string_view s) {
  int64_t n = 0;
  for (unsigned char c : s)
    if ((c & 0xC0) != 0x80) ++n;
  return n;
}

void write_chat_logprobs(json::writer& w, const tokenizer& tok, std::span<const token_logprobs> lps) {
  w.begin_object().key("content").begin_array();
  for (const auto& t : lps) {
    w.begin_object();
    w.key("token").str(logprob_token_text(tok, t.token)).key("logprob").real(finite_logprob(t.logprob));
    w.key("bytes");
    write_bytes(w, token_raw(tok, t.token));
    w.key("top_logprobs").begin_array();
    for (const auto& e : t.top) {
      w.begin_object().key("token").str(logprob_token_text(tok, e.token)).key("logprob").real(finite_logprob(e.logprob));
      w.key("bytes");
      write_bytes(w, token_raw(tok, e.token));
      w.end_object();
    }
    w.end_array().end_object();
  }
  w.end_array().end_object();
}

void write_completion_logprobs(json::writer& w, const tokenizer& tok, std::span<const token_logprobs> lps,
                               int64_t& text_offset) {
  w.begin_object();
  w.key("tokens").begin_array();
  for (const auto& t : lps) w.str(logprob_token_text(tok, t.token));
  w.end_array().key("token_logprobs").begin_array();
  for (const auto& t : lps) w.real(finite_logprob(t.logprob));
  w.end_array().key("top_logprobs").begin_array();
  for (const auto& t : lps) {
    // A map from token text to logprob: two ids with the same text keep the first (likelier).
    w.begin_object();
    std::vector<std::string> seen;
    for (const auto& e : t.top) {
      std::string k = logprob_token_text(tok, e.token);
      if (std::find(seen.begin(), seen.end(), k) != seen.end()) continue;
      w.key(k).real(finite_logprob(e.logprob));
      seen.push_back(std::move(k));
    }
    w.end_object();
  }
  w.end_array().key("text_offset").begin_array();
  for (const auto& t : lps) {
    w.num(text_offset);
    text_offset += utf8_chars(token_raw(tok, t.token));
  }
  w.end_array().end_object();
}

std::string tool_call_id(const std::string& response_id, size_t index) {
  const auto dash = response_id.find('-');
  return fmt::format("call_{}_{}", dash == std::string::npos ? response_id : response_id.substr(dash + 1), index);
}

void write_tool_calls(json::writer& w, const std::string& response_id, std::span<const parsed_tool_call> calls,
                      size_t first_index, bool stream) {
  w.begin_array();
  for (size_t i = 0; i < calls.size(); ++i) {
    w.begin_object();
    if (stream) w.key("index").num(int64_t(first_index + i));
    w.key("id").str(tool_call_id(response_id, first_index + i)).key("type").str("function");
    w.key("function").begin_object().key("name").str(calls[i].name).key("arguments").str(calls[i].arguments);
    w.end_object().end_object();
  }
  w.end_array();
}

}  // namespace tandem::openai
