// tandem tokenize: text on stdin to token ids with a model's tokenizer (no weights are read),
// for checking a vocabulary against llama.cpp or Hugging Face.
#include <cstdio>
#include <iostream>
#include <iterator>
#include <string>

#include "kernels/base/error.h"
#include "kernels/gguf/gguf.h"
#include "kernels/tokenizer/tokenizer.h"
#include "tools/tandem/commands.h"
#include "tools/tandem/flags.h"

namespace tandem::cli {

namespace {

/// A piece for a line of output: printable as is, control and invalid bytes as \xNN escapes,
/// so a token holding half a character or a newline stays on its line.
std::string escape(const std::string& s) {
  std::string out;
  for (unsigned char c : s) {
    if (c == '\\') {
      out += "\\\\";
    } else if (c < 0x20 || c == 0x7F) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\x%02X", c);
      out += buf;
    } else {
      out += char(c);
    }
  }
  return out;
}

}  // namespace

int tokenize(args a) {
  flags f;
  f.opt("model", "GGUF file whose tokenizer to use (required; only its metadata is read)")
      .sw("no-bos", "do not prepend the BOS token (default: prepend it where the vocabulary has one)")
      .sw("pieces", "print one token per line: id, a tab, and its text (\\xNN for control bytes)")
      .sw("special", "match control tokens written in the text (<|im_start|>, <s>) as single tokens");
  if (!f.parse(a)) {
    std::printf(
        "usage: tandem tokenize --model FILE [--no-bos] [--pieces] [--special] < text\n\n"
        "Reads text on stdin (all of it, newlines included) and prints its token ids,\n"
        "space-separated.\n\n%s",
        f.help().c_str());
    return 0;
  }
  if (!f.positional().empty())
    throw tandem::error("unexpected argument '" + f.positional().front() + "': the text is read from stdin");
  const std::string model = f.str("model");
  if (model.empty()) throw tandem::error("missing --model FILE: say which model's tokenizer to use");
  const auto file = gguf::file::open(model);
  const auto tok = tokenizer::from_gguf(file);
  for (const auto& w : tok->warnings()) std::fprintf(stderr, "tandem tokenize: warning: %s\n", w.c_str());

  const std::string text((std::istreambuf_iterator<char>(std::cin)), std::istreambuf_iterator<char>());
  const auto ids = tok->encode(text, !f.on("no-bos"), f.on("special"));
  if (f.on("pieces")) {
    for (int32_t id : ids) std::printf("%d\t%s\n", id, escape(tok->token_text(id)).c_str());
    return 0;
  }
  std::string line;
  for (size_t i = 0; i < ids.size(); ++i) {
    if (i) line += ' ';
    line += std::to_string(ids[i]);
  }
  std::printf("%s\n", line.c_str());
  return 0;
}

}  // namespace tandem::cli
