#pragma once
/// The vocabulary both tokenizer models share, and the split of text around special tokens.
/// Private to kernels/tokenizer.
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "kernels/gguf/gguf.h"
#include "kernels/tokenizer/tokenizer.h"

namespace tandem::tok_detail {

/// Hash for maps keyed by std::string that are looked up with string_views (no allocation).
struct string_hash {
  using is_transparent = void;
  size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
};
template <class V>
using string_map = std::unordered_map<std::string, V, string_hash, std::equal_to<>>;

struct vocab_entry {
  std::string text;
  float score = 0.0f;
  token_type type = token_type::normal;
};

struct vocab {
  std::vector<vocab_entry> tokens;
  string_map<int32_t> index;
  int32_t bos = -1, eos = -1, unk = -1;
  bool add_bos = false;
  /// Control, user-defined and unknown tokens, longest text first (the order llama.cpp
  /// matches them in, so a longer token wins over one it contains).
  std::vector<int32_t> special;

  int32_t find(std::string_view s) const {
    auto it = index.find(s);
    return it == index.end() ? -1 : it->second;
  }
  bool valid(int32_t id) const { return id >= 0 && size_t(id) < tokens.size(); }
  const std::string& piece(int32_t id) const { return valid(id) ? tokens[size_t(id)].text : empty; }
  std::string empty;
};

/// Throws tandem::error naming the GGUF file and what is wrong with its tokenizer metadata.
[[noreturn]] void bad(const gguf::file& f, const std::string& what);

/// Reads tokens, scores, types and the BOS/EOS/UNK ids (`spm`: SentencePiece defaults).
vocab load_vocab(const gguf::file& f, bool spm);

/// A piece of the input: raw text (`id` < 0) or one special token.
struct fragment {
  std::string_view text;
  int32_t id = -1;
};

/// Splits text at the special tokens it contains, as llama.cpp's tokenizer_st_partition:
/// user-defined tokens always (Hugging Face's added tokens are matched before the model runs),
/// control and unknown tokens only when `parse_special`.
std::vector<fragment> partition(const vocab& v, std::string_view text, bool parse_special);

/// The byte-level BPE (`gpt2`) tokenizer; bpe_tokenizer.cpp.
std::unique_ptr<tokenizer> make_bpe_tokenizer(vocab v, const gguf::file& f);

}  // namespace tandem::tok_detail
