#pragma once
/// A chat request's messages to prompt token ids, for /v1/chat/completions.
///
/// Template, first found: `tandem serve --chat-template-file F`; the model's own
/// `tokenizer.chat_template` (GGUF); else the Llama-2 fallback below. A template's text is
/// tokenized with special tokens parsed as special (`<|im_start|>`, `<s>`); when the
/// template writes the BOS text itself and the vocabulary also adds BOS, one BOS is kept.
///
/// The Llama-2 fallback (models without a template, like `tandem make-model`'s), one
/// BOS-prefixed segment per turn:
///   <s>[INST] <<SYS>>\n{system}\n<</SYS>>\n\n{user} [/INST] {assistant} </s>
///   <s>[INST] {user} [/INST]
/// (system/developer messages are joined and go into the first turn; consecutive messages of
/// one role are joined with "\n\n"; the prompt ends with an open [INST] turn for the model
/// to answer). It has no tool role: tool messages, tool calls and `tools` need a template.
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "transport/chat/chat_template.h"

namespace tandem {

class tokenizer;

/// The chat part of a request: its messages and, if sent, its `tools` array.
struct chat_request {
  std::vector<chat_message> messages;
  const json::value* tools = nullptr;  ///< points into the request body
};

/// A malformed `messages` array (a 400 naming `param`).
struct chat_input_error {
  std::string message;
  std::string param;
  std::string code;  ///< "missing_field" or "invalid_type"
};

/// Reads `messages` and `tools` of a chat request body. Roles must be system, developer,
/// user, assistant or tool; content a string, null, or an array of text parts (joined);
/// assistant `tool_calls` of type function with a name and string (or object) arguments.
/// Throws chat_input_error.
chat_request parse_chat_request(const json::value& body);

/// Renders messages with the Llama-2 fallback above into token ids. Throws tandem::error
/// (failed) naming a role it cannot render or an empty conversation.
std::vector<int32_t> render_chat_llama2(const tokenizer& tok, const std::vector<chat_message>& messages);

/// Chooses the template (override, model's, fallback) once and renders requests with it.
class chat_prompter {
 public:
  /// `override_source`: a template that replaces the model's ("" = none); throws
  /// tandem::error naming the line and column if it does not parse. A model template that
  /// does not parse is logged and the fallback is used.
  chat_prompter(const tokenizer& tok, const std::string& override_source, jinja::environment env = {});

  /// Prompt ids for `req`. Throws tandem::error (failed) with the template's refusal or a
  /// render error (the HTTP front end answers 422).
  std::vector<int32_t> prompt(const chat_request& req) const;
  /// The prompt text (no fallback: "" when there is no template), for tests and tools.
  std::string text(const chat_request& req) const;
  /// "override", "model" or "llama2-fallback".
  const std::string& source() const { return source_; }

 private:
  const tokenizer& tok_;
  std::unique_ptr<chat_template> tmpl_;
  jinja::environment env_;
  std::string source_;
};

}  // namespace tandem
