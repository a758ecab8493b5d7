#pragma once
/// Chat messages to prompt text through the model's own Jinja chat template
/// (`tokenizer.chat_template`, or `tandem serve --chat-template-file`), rendered as Hugging
/// Face's tokenizers render it: variables `messages`, `tools` (None without tools),
/// `documents` (None), `add_generation_prompt`, `bos_token`, `eos_token`, plus
/// raise_exception() and strftime_now(). The server then tokenizes the text with special
/// tokens parsed as special (transport/http/openai_server.cpp).
#include <string>
#include <string_view>
#include <vector>

#include "transport/chat/jinja.h"

namespace tandem {

namespace json {
struct value;
}

/// One tool call of an assistant message (OpenAI's `tool_calls[]`, type "function").
struct chat_tool_call {
  std::string id;
  std::string name;
  std::string arguments;  ///< JSON text, as the API carries it
};

/// One chat message as the OpenAI API sends it (roles system, developer, user, assistant,
/// tool; content parts already joined into `content`).
struct chat_message {
  chat_message() = default;
  chat_message(std::string r, std::string c) : role(std::move(r)), content(std::move(c)) {}

  std::string role;
  std::string content;
  bool content_null = false;  ///< "content": null or absent (an assistant message with tool calls)
  std::vector<chat_tool_call> tool_calls;
  std::string tool_call_id;  ///< role tool: the call it answers
  std::string name;          ///< role tool: the function's name (optional)
};

/// A parsed chat template with the vocabulary's BOS/EOS texts.
class chat_template {
 public:
  /// Parses `source`; throws jinja::error (syntax or limit) naming the line and column.
  chat_template(std::string_view source, std::string bos_token, std::string eos_token, jinja::limits lim = {});

  /// The prompt text. `tools`: the request's `tools` array, or null. Tool-call arguments
  /// are handed to the template as objects (what most templates `tojson`), or as the JSON
  /// text when the template needs a string (e.g. it concatenates them) and fails on objects.
  /// Throws jinja::error: kind raised when the template refuses the conversation (e.g.
  /// "System role not supported"), render or limit otherwise.
  std::string render(const std::vector<chat_message>& messages, const json::value* tools, bool add_generation_prompt,
                     const jinja::environment& env = {}) const;

 private:
  std::string render_with(const std::vector<chat_message>& messages, const json::value* tools,
                          bool add_generation_prompt, bool object_arguments, const jinja::environment& env) const;

  jinja::template_ tmpl_;
  std::string bos_;
  std::string eos_;
};

}  // namespace tandem
