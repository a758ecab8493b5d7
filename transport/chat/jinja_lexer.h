#pragma once
/// Jinja lexer: splits a template into text and tag tokens the way jinja2's lexer does with
/// trim_blocks=True and lstrip_blocks=True (what Hugging Face renders chat templates with):
/// newlines normalized to "\n", one trailing newline dropped, `-` strips whitespace beside a
/// tag, a block/comment tag alone on its line takes its indentation and newline with it.
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace tandem::jinja {

enum class tok : uint8_t { text, var_begin, var_end, block_begin, block_end, name, string, integer, real, op, eof };

struct token {
  tok t = tok::eof;
  std::string s;  ///< text, name, decoded string literal or operator
  int64_t i = 0;
  double d = 0;
  int line = 1;
  int col = 1;
};

/// Tokenizes `source`; throws error(syntax) naming the line and column of a bad token.
/// `max_tokens` bounds the output (error(limit) beyond it).
std::vector<token> lex(std::string_view source, size_t max_tokens);

}  // namespace tandem::jinja
