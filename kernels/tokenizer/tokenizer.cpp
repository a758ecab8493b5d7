// Tokenizers from GGUF metadata.
//  - llama: SentencePiece BPE as llama.cpp's llm_tokenizer_spm: symbols are UTF-8 characters,
//    the adjacent pair whose concatenation is the highest-scoring vocabulary piece is merged
//    first (priority queue of bigrams), pieces that are not in the vocabulary fall back to
//    <0xNN> byte tokens.
//  - gpt2: byte-level BPE, bpe_tokenizer.cpp.
// Both first split the text at special tokens (vocab.cpp's partition).
#include "kernels/tokenizer/tokenizer.h"

#include <algorithm>
#include <array>
#include <cstdio>
#include <queue>
#include <unordered_map>

#include "kernels/tokenizer/utf8.h"
#include "kernels/tokenizer/vocab.h"

namespace tandem {

namespace {

using tok_detail::bad;
using tok_detail::fragment;
using tok_detail::vocab;

// ---------------------------------------------------------------------------------------------

const std::string k_space_marker = "\xE2\x96\x81";  // U+2581 "▁"

class llama_tokenizer final : public tokenizer {
 public:
  llama_tokenizer(vocab v, const gguf::file& f) : v_(std::move(v)) {
    if (const gguf::value* p = f.find("tokenizer.ggml.add_space_prefix")) add_space_prefix_ = p->as_bool();
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

  std::vector<int32_t> encode(std::string_view text, bool add_bos, bool parse_special) const override {
    std::vector<int32_t> out;
    if (add_bos && v_.add_bos && v_.bos >= 0) out.push_back(v_.bos);
    // As llama.cpp: the dummy-prefix space goes before the text's start and before text that
    // follows a special token.
    bool after_special = true;
    std::string s;
    for (const fragment& fr : tok_detail::partition(v_, text, parse_special)) {
      if (fr.id >= 0) {
        out.push_back(fr.id);
        after_special = true;
        continue;
      }
      s.clear();
      s.reserve(fr.text.size() * 3 + 3);
      if (add_space_prefix_ && after_special) s = k_space_marker;
      for (char c : fr.text) {
        if (c == ' ') s += k_space_marker;
        else s += c;
      }
      tokenize(s, out);
      after_special = false;
    }
    return out;
  }

  std::string token_bytes(int32_t id) const override {
    return v_.valid(id) ? bytes_[size_t(id)] : std::string();
  }
  std::string token_text(int32_t id) const override {
    if (!v_.valid(id)) return {};
    const token_type t = v_.tokens[size_t(id)].type;
    return t == token_type::control || t == token_type::unknown ? v_.tokens[size_t(id)].text : bytes_[size_t(id)];
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
    if (sym.empty()) return;
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
  bool add_space_prefix_ = true;
};

// ---------------------------------------------------------------------------------------------

}  // namespace

std::unique_ptr<tokenizer> tokenizer::from_gguf(const gguf::file& f) {
  const gguf::value* m = f.find("tokenizer.ggml.model");
  if (m == nullptr) bad(f, "has no tokenizer.ggml.model");
  const std::string& model = m->as_string();
  std::unique_ptr<tokenizer> t;
  if (model == "llama") t = std::make_unique<llama_tokenizer>(tok_detail::load_vocab(f, true), f);
  else if (model == "gpt2") t = tok_detail::make_bpe_tokenizer(tok_detail::load_vocab(f, false), f);
  if (t) {
    if (const gguf::value* ct = f.find("tokenizer.chat_template")) {
      if (ct->type != gguf::value_type::string) bad(f, "has a tokenizer.chat_template that is not a string");
      t->chat_template_ = ct->as_string();
    }
    // FIM token ids: llama.cpp's keys, the older names as a fallback; ids outside the
    // vocabulary are a malformed file.
    auto fim_id = [&](const char* key, const char* old_key) -> int32_t {
      const gguf::value* x = f.find(key);
      if (x == nullptr) x = f.find(old_key);
      if (x == nullptr) return -1;
      const int64_t id = x->as_i64();
      if (id < -1 || id >= t->n_vocab())
        bad(f, std::string(key) + " = " + std::to_string(id) + " is outside the vocabulary of " +
                   std::to_string(t->n_vocab()));
      return int32_t(id);
    };
    t->fim_.pre = fim_id("tokenizer.ggml.fim_pre_token_id", "tokenizer.ggml.prefix_token_id");
    t->fim_.suf = fim_id("tokenizer.ggml.fim_suf_token_id", "tokenizer.ggml.suffix_token_id");
    t->fim_.mid = fim_id("tokenizer.ggml.fim_mid_token_id", "tokenizer.ggml.middle_token_id");
    return t;
  }
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
