#pragma once
/// Tool calls parsed out of a chat model's generated text, incrementally (for streaming).
///
/// Formats, picked from the chat template (tool_call_format_for_template):
/// - hermes (Hermes 2 Pro / Hermes 3, Qwen 2.5): `<tool_call>{"name": N, "arguments": {...}}</tool_call>`,
///   any number, text between them is content.
/// - llama3_json (Llama 3.1 / 3.2 / 3.3): the whole reply is `{"name": N, "parameters": {...}}`
///   (optionally after `<|python_tag|>`, several separated by `;`); a reply that does not start
///   with `{` or the tag is plain content.
/// - mistral (Mistral Nemo and the v3 tokenizer family): `[TOOL_CALLS] [{"name": N, "arguments": {...}}, ...]`.
/// Text that looks like a call but does not parse as one (bad JSON, no name) stays content,
/// byte for byte, except for markers the parser was told are hidden (below). `arguments` is always a JSON text (an object serialized compactly, or the
/// string the model wrote).
#include <cstddef>
#include <string>
#include <string_view>
#include <vector>

namespace tandem {

enum class tool_call_format { none, hermes, llama3_json, mistral };

/// The format the template's model writes calls in; none when it is not one of the above
/// (its tool calls then come back as content).
tool_call_format tool_call_format_for_template(std::string_view chat_template);
/// "none", "hermes", "llama3_json", "mistral".
std::string_view tool_call_format_name(tool_call_format f);
/// The marker texts of format `f`: "<tool_call>" and "</tool_call>" (hermes), "<|python_tag|>"
/// (llama3_json), "[TOOL_CALLS]" (mistral). Real vocabularies may have them as single control
/// tokens, which decode to no text (transport/chat/tool_call_markers.h).
std::vector<std::string_view> tool_call_markers(tool_call_format f);

struct parsed_tool_call {
  std::string name;
  std::string arguments;  ///< JSON text
};

/// Feed the generated text in pieces; each call returns the content that is safe to show now
/// (text that may still turn out to be part of a call is held back) and the calls completed.
/// The result does not depend on how the text was split.
class tool_call_parser {
 public:
  /// Held-back text is bounded by the generation itself (max_tokens); a call body longer than
  /// this many bytes is given up as content.
  static constexpr size_t max_call_bytes = 1 << 20;

  /// `hidden_markers`: markers that reach the parser only because the front end rendered their
  /// control tokens for it (the model's vocabulary has them as control tokens, whose text is
  /// not content); they are never given back as content, even around text that is not a call.
  explicit tool_call_parser(tool_call_format f, std::vector<std::string> hidden_markers = {})
      : format_(f), hidden_(std::move(hidden_markers)) {}

  struct result {
    std::string content;
    std::vector<parsed_tool_call> calls;
  };
  result push(std::string_view text);
  /// End of the generation: everything still held back (an unterminated call is parsed if
  /// it is complete JSON, else given back as content).
  result finish();
  /// Calls found so far.
  size_t calls_found() const { return calls_found_; }

 private:
  enum class mode { start, text, call, plain };
  void step(result& r, bool at_end);
  bool take_calls(std::string_view body, result& r);
  void drop_hidden(result& r) const;

  tool_call_format format_;
  std::vector<std::string> hidden_;
  mode mode_ = mode::start;
  std::string buf_;  ///< text not yet decided
  size_t calls_found_ = 0;
};

}  // namespace tandem
