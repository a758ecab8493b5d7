#pragma once
/// `POST /tokenize` and `POST /detokenize`, as llama-server has them: the bodies in and out,
/// without the HTTP around them (openai_server.cpp routes here once the body is read).
#include <string>
#include <string_view>

namespace tandem {
class tokenizer;
}

namespace tandem::transport {

/// A body /tokenize or /detokenize cannot serve: a 400 naming the field.
struct tokenize_error {
  std::string message;
  std::string param;
  std::string code = "invalid_request";
};

/// `{"content": "...", "add_special": false, "parse_special": true, "with_pieces": false}`
/// -> `{"tokens": [ids]}`, or with `with_pieces` `{"tokens": [{"id": 1, "piece": "..."}]}`
/// (a piece that is not valid UTF-8 on its own is an array of its bytes). `add_special` adds
/// BOS where the vocabulary has one; `parse_special` (default true, as llama-server) takes
/// control tokens written in the content as single tokens. Throws tokenize_error.
std::string tokenize_response(const tokenizer& tok, std::string_view body);

/// `{"tokens": [ids]}` -> `{"content": "..."}`: each token's text (control tokens as their
/// text, like llama-server), joined; bytes that do not form UTF-8 become U+FFFD. Throws
/// tokenize_error for a missing or non-array `tokens` or an id outside the vocabulary.
std::string detokenize_response(const tokenizer& tok, std::string_view body);

}  // namespace tandem::transport
