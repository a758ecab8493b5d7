// Tokenizers from GGUF metadata.
//  - llama: SentencePiece BPE as llama.cpp's llm_tokenizer_spm: symbols are UTF-8 characters,
//    the adjacent pair whose concatenation is the highest-scoring vocabulary piece is merged
//    first (priority queue of bigrams), pieces that are not in the vocabulary fall back to
//    <0xNN> byte tokens.
//  - gpt2: byte-level BPE: bytes are mapped to printable code points, text is pre-split by
//    a hand-written equivalent of the GPT-2 regex and each word is merged by merge rank.
#include "kernels/tokenizer/tokenizer.h"

#include <algorithm>
#include <array>
#include <cstdio>
#include <queue>
#include <unordered_map>

#include "kernels/tokenizer/utf8.h"

namespace tandem {

namespace {

struct vocab_entry {
  std::string text;
  float score = 0.0f;
  token_type type = token_type::normal;
};

/// Vocabulary common to both models.
struct vocab {
  std::vector<vocab_entry> tokens;
  std::unordered_map<std::string, int32_t> index;
  int32_t bos = -1, eos = -1, unk = -1;
  bool add_bos = false;

  int32_t find(std::string_view s) const {
    auto it = index.find(std::string(s));
    return it == index.end() ? -1 : it->second;
  }
  bool valid(int32_t id) const { return id >= 0 && size_t(id) < tokens.size(); }
  const std::string& piece(int32_t id) const { return valid(id) ? tokens[size_t(id)].text : empty; }
  std::string empty;
};

[[noreturn]] void bad(const gguf::file& f, const std::string& what) {
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
  return v;
}

// ---------------------------------------------------------------------------------------------

const std::string k_space_marker = "\xE2\x96\x81";  // U+2581 "▁"

class llama_tokenizer final : public tokenizer {
 public:
  explicit llama_tokenizer(vocab v) : v_(std::move(v)) {
    bytes_.resize(v_.tokens.size());
    for (int b = 0; b < 256; ++b) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "<0x%02X>", b);
      int32_t id = v_.find(buf);
      if (id < 0) id = v_.find(std::string(1, char(b)));  // llama.cpp's fallback
      byte_token_[b] = id >= 0 ? id : v_.unk;
    }
    for (size_t i = 0; i < v_.tokens.size(); ++i) {
      const auto& e = v_.tokens[i];
      switch (e.type) {
        case token_type::control:
        case token_type::unknown:
        case token_type::unused: break;  // not text
        case token_type::byte: {
          unsigned b = 0;
          if (e.text.size() == 6 && std::sscanf(e.text.c_str(), "<0x%2X>", &b) == 1) bytes_[i] = std::string(1, char(b));
          else bytes_[i] = e.text;
          break;
        }
        default: {
          std::string s;
          for (size_t p = 0; p < e.text.size();) {
            if (e.text.compare(p, 3, k_space_marker) == 0) {
              s += ' ';
              p += 3;
            } else {
              s += e.text[p++];
            }
          }
          bytes_[i] = std::move(s);
        }
      }
    }
  }

  std::vector<int32_t> encode(std::string_view text, bool add_bos) const override {
    std::vector<int32_t> out;
    if (add_bos && v_.bos >= 0) out.push_back(v_.bos);
    if (text.empty()) return out;
    // add_dummy_prefix, then escape spaces
    std::string s = k_space_marker;
    s.reserve(text.size() * 3 + 3);
    for (char c : text) {
      if (c == ' ') s += k_space_marker;
      else s += c;
    }
    tokenize(s, out);
    return out;
  }

  std::string token_bytes(int32_t id) const override {
    return v_.valid(id) ? bytes_[size_t(id)] : std::string();
  }

  std::string decode(const std::vector<int32_t>& ids) const override {
    std::string out;
    bool first = true;
    for (int32_t id : ids) {
      const std::string& b = v_.valid(id) ? bytes_[size_t(id)] : empty_;
      if (b.empty()) continue;
      // SentencePiece adds a space before the first word; drop it again.
      if (first && b[0] == ' ') out.append(b, 1);
      else out += b;
      first = false;
    }
    // Byte tokens may leave an incomplete or invalid sequence: callers get valid UTF-8.
    std::string text;
    utf8::sanitize(out, text, true);
    return text;
  }

  const std::string& piece(int32_t id) const override { return v_.piece(id); }
  int32_t n_vocab() const override { return int32_t(v_.tokens.size()); }
  int32_t bos_id() const override { return v_.bos; }
  int32_t eos_id() const override { return v_.eos; }
  std::string_view model_name() const override { return "llama"; }

 private:
  struct symbol {
    int32_t prev, next;
    size_t start, n;
  };
  struct bigram {
    int32_t left, right;
    float score;
    size_t size;
  };
  struct bigram_less {
    bool operator()(const bigram& l, const bigram& r) const {
      return l.score < r.score || (l.score == r.score && l.left > r.left);
    }
  };

  void tokenize(const std::string& text, std::vector<int32_t>& out) const {
    std::vector<symbol> sym;
    sym.reserve(text.size());
    for (size_t off = 0; off < text.size();) {
      const size_t n = std::min(utf8::seq_len(uint8_t(text[off])), text.size() - off);
      sym.push_back({int32_t(sym.size()) - 1, int32_t(sym.size()) + 1, off, n});
      off += n;
    }
    sym.back().next = -1;
    std::priority_queue<bigram, std::vector<bigram>, bigram_less> queue;
    std::unordered_map<std::string, std::pair<int32_t, int32_t>> rev_merge;
    auto try_add = [&](int32_t l, int32_t r) {
      if (l < 0 || r < 0) return;
      std::string_view piece(text.data() + sym[l].start, sym[l].n + sym[r].n);
      const int32_t id = v_.find(piece);
      if (id < 0) return;
      queue.push({l, r, v_.tokens[size_t(id)].score, piece.size()});
      rev_merge[std::string(piece)] = {l, r};
    };
    for (size_t i = 1; i < sym.size(); ++i) try_add(int32_t(i) - 1, int32_t(i));
    while (!queue.empty()) {
      const bigram b = queue.top();
      queue.pop();
      symbol& l = sym[size_t(b.left)];
      symbol& r = sym[size_t(b.right)];
      if (l.n == 0 || r.n == 0 || l.n + r.n != b.size) continue;  // stale
      l.n += r.n;
      r.n = 0;
      l.next = r.next;
      if (r.next >= 0) sym[size_t(r.next)].prev = b.left;
      try_add(l.prev, b.left);
      try_add(b.left, l.next);
    }
    for (int32_t i = 0; i != -1; i = sym[size_t(i)].next) resegment(text, sym, sym[size_t(i)], rev_merge, out);
  }

  void resegment(const std::string& text, const std::vector<symbol>& sym, const symbol& s,
                 const std::unordered_map<std::string, std::pair<int32_t, int32_t>>& rev_merge,
                 std::vector<int32_t>& out) const {
    std::string piece = text.substr(s.start, s.n);
    const int32_t id = v_.find(piece);
    if (id >= 0) {
      out.push_back(id);
      return;
    }
    auto p = rev_merge.find(piece);
    if (p == rev_merge.end()) {
      for (char c : piece) {
        const int32_t t = byte_token_[uint8_t(c)];
        if (t >= 0) out.push_back(t);
      }
      return;
    }
    // The stored halves may have grown since; only their original extent matters.
    const symbol& l = sym[size_t(p->second.first)];
    const symbol& r = sym[size_t(p->second.second)];
    const size_t split = r.start - l.start;
    resegment(text, sym, symbol{-1, -1, s.start, split}, rev_merge, out);
    resegment(text, sym, symbol{-1, -1, s.start + split, s.n - split}, rev_merge, out);
  }

  vocab v_;
  std::vector<std::string> bytes_;
  std::array<int32_t, 256> byte_token_{};
  std::string empty_;
};

// ---------------------------------------------------------------------------------------------

/// GPT-2's bytes_to_unicode: printable bytes map to themselves, the rest to U+0100 onwards.
struct byte_map {
  std::array<std::string, 256> to_unicode;
  std::unordered_map<uint32_t, uint8_t> from_unicode;
  byte_map() {
    uint32_t n = 0;
    for (uint32_t b = 0; b < 256; ++b) {
      const bool printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174 && b <= 255);
      const uint32_t cp = printable ? b : 256 + n++;
      to_unicode[b] = utf8::encode(cp);
      from_unicode[cp] = uint8_t(b);
    }
  }
};

class gpt2_tokenizer final : public tokenizer {
 public:
  gpt2_tokenizer(vocab v, const gguf::file& f) : v_(std::move(v)) {
    if (const gguf::value* m = f.find("tokenizer.ggml.merges")) {
      const auto& a = m->as_array();
      ranks_.reserve(a.items.size() * 2);
      for (size_t i = 0; i < a.items.size(); ++i) {
        const std::string& s = a.items[i].as_string();
        const size_t sp = s.find(' ', 1);
        if (sp == std::string::npos)
          bad(f, "tokenizer.ggml.merges entry " + std::to_string(i) + " ('" + s + "') is not 'left right'");
        ranks_.emplace(s, int32_t(i));
      }
    } else {
      bad(f, "has tokenizer.ggml.model gpt2 but no tokenizer.ggml.merges");
    }
    bytes_.resize(v_.tokens.size());
    for (size_t i = 0; i < v_.tokens.size(); ++i) {
      const auto& e = v_.tokens[i];
      if (e.type == token_type::control || e.type == token_type::unused || e.type == token_type::unknown) continue;
      if (e.type == token_type::user_defined) {
        bytes_[i] = e.text;
        continue;
      }
      std::string s;
      for (size_t p = 0; p < e.text.size();) {
        uint32_t cp = 0;
        const size_t n = utf8::decode(e.text, p, cp);
        auto it = map_.from_unicode.find(cp);
        if (n == 0 || it == map_.from_unicode.end()) {
          // Not from the byte map (a hand-made vocabulary): keep the raw bytes.
          const size_t k = n == 0 ? 1 : n;
          s.append(e.text, p, k);
          p += k;
        } else {
          s += char(it->second);
          p += n;
        }
      }
      bytes_[i] = std::move(s);
    }
  }

  std::vector<int32_t> encode(std::string_view text, bool add_bos) const override {
    std::vector<int32_t> out;
    if (add_bos && v_.bos >= 0) out.push_back(v_.bos);
    for (std::string_view word : pretokenize(text)) bpe(word, out);
    return out;
  }

  std::string token_bytes(int32_t id) const override { return v_.valid(id) ? bytes_[size_t(id)] : std::string(); }
  std::string decode(const std::vector<int32_t>& ids) const override {
    std::string out;
    for (int32_t id : ids)
      if (v_.valid(id)) out += bytes_[size_t(id)];
    std::string text;
    utf8::sanitize(out, text, true);
    return text;
  }
  const std::string& piece(int32_t id) const override { return v_.piece(id); }
  int32_t n_vocab() const override { return int32_t(v_.tokens.size()); }
  int32_t bos_id() const override { return v_.bos; }
  int32_t eos_id() const override { return v_.eos; }
  std::string_view model_name() const override { return "gpt2"; }

  /// The GPT-2 pre-tokenizer regex, by hand:
  /// 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
  static std::vector<std::string_view> pretokenize(std::string_view t) {
    std::vector<std::string_view> words;
    std::vector<uint32_t> cps;
    std::vector<size_t> at;  // byte offset of each code point, plus the end
    for (size_t p = 0; p < t.size();) {
      uint32_t cp = 0;
      size_t n = utf8::decode(t, p, cp);
      if (n == 0) {
        cp = 0xFFFD;  // invalid byte: a symbol of its own class, bytes kept as they are
        n = 1;
      }
      cps.push_back(cp);
      at.push_back(p);
      p += n;
    }
    at.push_back(t.size());
    const size_t n = cps.size();
    auto cls = [&](size_t i) { return utf8::classify(cps[i]); };
    size_t i = 0;
    while (i < n) {
      const size_t start = i;
      // contractions (the regex is case-sensitive)
      if (cps[i] == '\'' && i + 1 < n) {
        const uint32_t a = cps[i + 1], b = i + 2 < n ? cps[i + 2] : 0;
        size_t len = 0;
        if (a == 's' || a == 't' || a == 'm' || a == 'd') len = 2;
        else if ((a == 'r' && b == 'e') || (a == 'v' && b == 'e') || (a == 'l' && b == 'l')) len = 3;
        if (len) {
          i += len;
          words.push_back(t.substr(at[start], at[i] - at[start]));
          continue;
        }
      }
      size_t j = i;
      if (cps[j] == ' ' && j + 1 < n && cls(j + 1) != utf8::char_class::space) ++j;
      const utf8::char_class c = cls(j);
      if (c != utf8::char_class::space) {
        while (j < n && cls(j) == c) ++j;
        i = j;
        words.push_back(t.substr(at[start], at[i] - at[start]));
        continue;
      }
      // whitespace run: \s+(?!\S) leaves the last space for the next word if one follows
      while (j < n && cls(j) == utf8::char_class::space) ++j;
      if (j < n && j - i > 1) --j;
      i = j;
      words.push_back(t.substr(at[start], at[i] - at[start]));
    }
    return words;
  }

 private:
  void bpe(std::string_view word, std::vector<int32_t>& out) const {
    // symbols = mapped code points of the word's bytes
    std::vector<std::string> sym;
    sym.reserve(word.size());
    for (char c : word) sym.push_back(map_.to_unicode[uint8_t(c)]);
    std::string key;
    while (sym.size() > 1) {
      int32_t best = INT32_MAX;
      size_t best_i = 0;
      for (size_t i = 0; i + 1 < sym.size(); ++i) {
        key.assign(sym[i]).append(" ").append(sym[i + 1]);
        auto it = ranks_.find(key);
        if (it != ranks_.end() && it->second < best) {
          best = it->second;
          best_i = i;
        }
      }
      if (best == INT32_MAX) break;
      // merge every occurrence of the best pair, left to right
      const std::string a = sym[best_i], b = sym[best_i + 1];
      std::vector<std::string> next;
      next.reserve(sym.size());
      for (size_t i = 0; i < sym.size();) {
        if (i + 1 < sym.size() && sym[i] == a && sym[i + 1] == b) {
          next.push_back(a + b);
          i += 2;
        } else {
          next.push_back(std::move(sym[i]));
          ++i;
        }
      }
      sym = std::move(next);
    }
    for (const auto& s : sym) {
      const int32_t id = v_.find(s);
      if (id >= 0) {
        out.push_back(id);
        continue;
      }
      // Not in the vocabulary: one token per mapped byte, or <unk>.
      for (size_t p = 0; p < s.size();) {
        uint32_t cp = 0;
        size_t n = utf8::decode(s, p, cp);
        if (n == 0) n = 1;
        const int32_t t = v_.find(std::string_view(s).substr(p, n));
        if (t >= 0) out.push_back(t);
        else if (v_.unk >= 0) out.push_back(v_.unk);
        p += n;
      }
    }
  }

  vocab v_;
  byte_map map_;
  std::unordered_map<std::string, int32_t> ranks_;
  std::vector<std::string> bytes_;
};

}  // namespace

std::unique_ptr<tokenizer> tokenizer::from_gguf(const gguf::file& f) {
  const gguf::value* m = f.find("tokenizer.ggml.model");
  if (m == nullptr) bad(f, "has no tokenizer.ggml.model");
  const std::string& model = m->as_string();
  if (model == "llama") return std::make_unique<llama_tokenizer>(load_vocab(f, true));
  if (model == "gpt2") return std::make_unique<gpt2_tokenizer>(load_vocab(f, false), f);
  throw tandem::error(error_kind::unimplemented,
                      "GGUF file " + f.name() + " uses tokenizer model '" + model +
                          "', which Tandem does not support (supported: llama, gpt2): use a Llama/SentencePiece "
                          "or GPT-2 BPE model");
}

// ---------------------------------------------------------------------------------------------

std::string stream_decoder::push(int32_t id) {
  std::string b = tok_->token_bytes(id);
  if (b.empty()) return {};
  if (first_) {
    first_ = false;
    if (strip_leading_space_ && b[0] == ' ') b.erase(0, 1);
  }
  pending_ += b;
  std::string out;
  const size_t used = utf8::sanitize(pending_, out, false);
  pending_.erase(0, used);
  return out;
}

std::string stream_decoder::flush() {
  std::string out;
  utf8::sanitize(pending_, out, true);
  pending_.clear();
  return out;
}

}  // namespace tandem
