#include "kernels/tokenizer/vocab.h"

#include <algorithm>

namespace tandem::tok_detail {

void bad(const gguf::file& f, const std::string& what) {
  throw tandem::error(error_kind::failed, "GGUF file " + f.name() + ": " + what +
                                              ": re-convert the model with its tokenizer metadata");
}

vocab load_vocab(const gguf::file& f, bool spm) {
  vocab v;
  const gguf::value* tv = f.find("tokenizer.ggml.tokens");
  if (tv == nullptr) bad(f, "has no tokenizer.ggml.tokens");
  if (tv->type != gguf::value_type::array || tv->as_array().elem_type != gguf::value_type::string)
    bad(f, "tokenizer.ggml.tokens is not an array of strings");
  const auto& toks = tv->as_array().items;
  if (toks.empty()) bad(f, "tokenizer.ggml.tokens is empty");
  if (toks.size() > size_t(INT32_MAX)) bad(f, "tokenizer.ggml.tokens is too large");
  v.tokens.resize(toks.size());
  v.index.reserve(toks.size() * 2);
  for (size_t i = 0; i < toks.size(); ++i) {
    v.tokens[i].text = toks[i].as_string();
    // First occurrence wins, as in llama.cpp (duplicates happen in some converted vocabs).
    v.index.emplace(v.tokens[i].text, int32_t(i));
  }
  if (const gguf::value* s = f.find("tokenizer.ggml.scores")) {
    const auto& a = s->as_array();
    if (a.items.size() != toks.size())
      bad(f, "tokenizer.ggml.scores has " + std::to_string(a.items.size()) + " entries for " +
                 std::to_string(toks.size()) + " tokens");
    for (size_t i = 0; i < toks.size(); ++i) v.tokens[i].score = float(a.items[i].as_f64());
  }
  if (const gguf::value* t = f.find("tokenizer.ggml.token_type")) {
    const auto& a = t->as_array();
    if (a.items.size() != toks.size())
      bad(f, "tokenizer.ggml.token_type has " + std::to_string(a.items.size()) + " entries for " +
                 std::to_string(toks.size()) + " tokens");
    for (size_t i = 0; i < toks.size(); ++i) {
      const int64_t ty = a.items[i].as_i64();
      v.tokens[i].type = (ty >= 1 && ty <= 6) ? token_type(ty) : token_type::normal;
    }
  }
  auto id_or = [&](const char* key, int32_t def) -> int32_t {
    const gguf::value* x = f.find(key);
    if (x == nullptr) return def;
    const int64_t id = x->as_i64();
    if (id < -1 || id >= int64_t(toks.size()))
      bad(f, std::string(key) + " = " + std::to_string(id) + " is outside the vocabulary of " +
                 std::to_string(toks.size()));
    return int32_t(id);
  };
  // llama.cpp's defaults for SentencePiece vocabularies.
  v.bos = id_or("tokenizer.ggml.bos_token_id", spm ? 1 : -1);
  v.eos = id_or("tokenizer.ggml.eos_token_id", spm ? 2 : -1);
  v.unk = id_or("tokenizer.ggml.unknown_token_id", spm ? 0 : -1);
  if (!v.valid(v.bos)) v.bos = -1;
  if (!v.valid(v.eos)) v.eos = -1;
  if (!v.valid(v.unk)) v.unk = -1;
  const gguf::value* ab = f.find("tokenizer.ggml.add_bos_token");
  v.add_bos = ab ? ab->as_bool() : spm;

  for (size_t i = 0; i < v.tokens.size(); ++i) {
    const token_type t = v.tokens[i].type;
    if ((t == token_type::control || t == token_type::user_defined || t == token_type::unknown) &&
        !v.tokens[i].text.empty())
      v.special.push_back(int32_t(i));
  }
  std::stable_sort(v.special.begin(), v.special.end(), [&](int32_t a, int32_t b) {
    return v.tokens[size_t(a)].text.size() > v.tokens[size_t(b)].text.size();
  });
  return v;
}

std::vector<fragment> partition(const vocab& v, std::string_view text, bool parse_special) {
  std::vector<fragment> frags;
  if (text.empty()) return frags;
  frags.push_back({text, -1});
  std::vector<fragment> next;
  for (int32_t id : v.special) {
    const vocab_entry& e = v.tokens[size_t(id)];
    if (!parse_special && e.type != token_type::user_defined) continue;
    const std::string_view t = e.text;
    // Most special tokens never occur: one search of the whole text rules them out.
    if (text.find(t) == std::string_view::npos) continue;
    next.clear();
    for (const fragment& fr : frags) {
      if (fr.id >= 0) {
        next.push_back(fr);
        continue;
      }
      size_t from = 0;
      for (size_t at; (at = fr.text.find(t, from)) != std::string_view::npos; from = at + t.size()) {
        if (at > from) next.push_back({fr.text.substr(from, at - from), -1});
        next.push_back({fr.text.substr(at, t.size()), id});
      }
      if (from < fr.text.size()) next.push_back({fr.text.substr(from), -1});
    }
    frags.swap(next);
  }
  return frags;
}

}  // namespace tandem::tok_detail
