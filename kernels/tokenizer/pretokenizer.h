#pragma once
/// Byte-level BPE pre-tokenizers: the regex lists llama.cpp uses for each GGUF
/// `tokenizer.ggml.pre` name, run by PCRE2 (UTF + UCP, JIT where available). Private to
/// kernels/tokenizer.
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace tandem {

/// What a `tokenizer.ggml.pre` name selects.
struct pre_spec {
  std::string name;                  ///< the canonical name ("gpt-2", "llama3", ...)
  std::vector<std::string> regexes;  ///< applied in order, each splitting the previous pieces
  bool ignore_merges = false;        ///< a word that is a whole vocabulary token skips BPE (llama3)
};

/// The spec for a GGUF pre-tokenizer name, or nullptr when Tandem does not know it.
const pre_spec* find_pre_spec(std::string_view name);
/// llama.cpp's fallback for a missing or unknown name ("default").
const pre_spec& default_pre_spec();
/// Every pre-tokenizer Tandem knows, one entry per regex list (for tests and diagnostics).
const std::vector<pre_spec>& all_pre_specs();

/// Splits text into words with a list of compiled regexes. Each regex splits every piece the
/// previous one produced: its matches become pieces and so does the text between them, so no
/// byte is ever dropped. Thread-safe: compiled once, match data per call.
class regex_splitter {
 public:
  /// Compiles every regex; throws tandem::error naming the regex and PCRE2's message.
  explicit regex_splitter(const std::vector<std::string>& regexes);
  ~regex_splitter();
  regex_splitter(const regex_splitter&) = delete;
  regex_splitter& operator=(const regex_splitter&) = delete;

  /// Pieces of `text` in order; they concatenate back to `text`. Invalid UTF-8 never matches
  /// a regex, so such bytes end up in the pieces between matches.
  std::vector<std::string_view> split(std::string_view text) const;

 private:
  struct compiled;
  std::vector<std::unique_ptr<compiled>> res_;
};

}  // namespace tandem
