#pragma once
/// The parts of a choice beyond its text: `logprobs` in the chat and the completions shapes,
/// and `tool_calls` (whole, in a message, or as stream deltas).
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "kernels/model/logprobs.h"
#include "kernels/tokenizer/tokenizer.h"
#include "transport/chat/tool_call_parser.h"
#include "transport/http/json.h"

namespace tandem::openai {

/// A token as the logprobs fields show it: its text when that is valid UTF-8, else vLLM's
/// "bytes:\xNN..." spelling (a token that ends inside a multi-byte character).
std::string logprob_token_text(const tokenizer& tok, int32_t id);

/// Chat shape, the value of "logprobs": {"content": [{token, logprob, bytes, top_logprobs}]}.
void write_chat_logprobs(json::writer& w, const tokenizer& tok, std::span<const token_logprobs> lps);

/// Completions shape, the value of "logprobs": {tokens, token_logprobs, top_logprobs,
/// text_offset}. `text_offset`: characters of the choice's text before the first token (the
/// echoed prompt included); advanced past these tokens.
void write_completion_logprobs(json::writer& w, const tokenizer& tok, std::span<const token_logprobs> lps,
                               int64_t& text_offset);

/// A tool call's id: unique per response ("call_<response id>_<index>").
std::string tool_call_id(const std::string& response_id, size_t index);

/// The value of message.tool_calls: [{id, type: "function", function: {name, arguments}}];
/// `stream`: delta.tool_calls, each entry with its `index` (the call's position in the reply).
void write_tool_calls(json::writer& w, const std::string& response_id, std::span<const parsed_tool_call> calls,
                      size_t first_index, bool stream);

/// Characters (code points) of UTF-8 text; bytes of an incomplete sequence count as one each.
int64_t utf8_chars(std::string_view s);

}  // namespace tandem::openai
