// Byte-level BPE (`tokenizer.ggml.model = gpt2`): text is split at special tokens, each raw
// fragment is pre-split into words by the regexes `tokenizer.ggml.pre` names, each word's bytes
// are mapped to printable code points (GPT-2's bytes_to_unicode) and merged by merge rank,
// lowest first, leftmost among equals, as llama.cpp's llm_tokenizer_bpe_session.
#include <array>
#include <queue>
#include <unordered_map>

#include "kernels/tokenizer/pretokenizer.h"
#include "kernels/tokenizer/utf8.h"
#include "kernels/tokenizer/vocab.h"

namespace tandem::tok_detail {

namespace {

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

const pre_spec& choose_pre(const gguf::file& f, std::vector<std::string>& warnings) {
  const gguf::value* p = f.find("tokenizer.ggml.pre");
  const pre_spec& fallback = default_pre_spec();
  if (p == nullptr || p->type != gguf::value_type::string) {
    warnings.push_back("GGUF file " + f.name() + " has no tokenizer.ggml.pre: using the '" + fallback.name +
                       "' pre-tokenizer (as llama.cpp does); tokens may differ from the model's own tokenizer, "
                       "re-convert the model with a current llama.cpp to record it");
    return fallback;
  }
  if (const pre_spec* s = find_pre_spec(p->as_string())) return *s;
  warnings.push_back("GGUF file " + f.name() + " names pre-tokenizer '" + p->as_string() +
                     "', which Tandem does not know: using the '" + fallback.name +
                     "' pre-tokenizer (as llama.cpp does); tokens may differ from the model's own tokenizer");
  return fallback;
}

class bpe_tokenizer final : public tokenizer {
 public:
  bpe_tokenizer(vocab v, const gguf::file& f, const pre_spec& pre)
      : v_(std::move(v)), splitter_(pre.regexes), ignore_merges_(pre.ignore_merges), pre_name_(pre.name) {
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
        bytes_[i] = e.text;  // added tokens are stored as plain text, not byte-mapped
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

  std::vector<int32_t> encode(std::string_view text, bool add_bos, bool parse_special) const override {
    std::vector<int32_t> out;
    if (add_bos && v_.add_bos && v_.bos >= 0) out.push_back(v_.bos);
    std::string mapped;
    scratch sc;
    for (const fragment& fr : partition(v_, text, parse_special)) {
      if (fr.id >= 0) {
        out.push_back(fr.id);
        continue;
      }
      for (std::string_view word : splitter_.split(fr.text)) {
        mapped.clear();
        for (char c : word) mapped += map_.to_unicode[uint8_t(c)];
        bpe(mapped, sc, out);
      }
    }
    return out;
  }

  std::string token_bytes(int32_t id) const override { return v_.valid(id) ? bytes_[size_t(id)] : std::string(); }
  std::string token_text(int32_t id) const override {
    if (!v_.valid(id)) return {};
    const token_type t = v_.tokens[size_t(id)].type;
    return t == token_type::control || t == token_type::unknown ? v_.tokens[size_t(id)].text : bytes_[size_t(id)];
  }
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
  std::string_view pre_name() const override { return pre_name_; }

  void add_warnings(std::vector<std::string> w) {
    for (auto& s : w) warnings_.push_back(std::move(s));
  }

 private:
  struct symbol {
    int32_t prev, next;
    size_t start, n;
  };
  struct bigram {
    int32_t left, right;
    int32_t rank;
    size_t size;
  };
  struct bigram_after {
    bool operator()(const bigram& l, const bigram& r) const {
      return l.rank > r.rank || (l.rank == r.rank && l.left > r.left);
    }
  };
  /// Buffers reused across the words of one encode call.
  struct scratch {
    std::vector<symbol> sym;
    std::priority_queue<bigram, std::vector<bigram>, bigram_after> queue;  // drained by each word
    std::string key;
  };

  /// Merges one byte-mapped word and appends its tokens.
  void bpe(const std::string& word, scratch& sc, std::vector<int32_t>& out) const {
    if (word.empty()) return;
    // llama3-style vocabularies: a word that is already a token is taken whole.
    if (ignore_merges_) {
      if (const int32_t id = v_.find(word); id >= 0) {
        out.push_back(id);
        return;
      }
    }
    std::vector<symbol>& sym = sc.sym;
    sym.clear();
    for (size_t off = 0; off < word.size();) {
      const size_t n = std::min(utf8::seq_len(uint8_t(word[off])), word.size() - off);
      sym.push_back({int32_t(sym.size()) - 1, int32_t(sym.size()) + 1, off, n});
      off += n;
    }
    sym.back().next = -1;
    auto& queue = sc.queue;
    std::string& key = sc.key;
    auto try_add = [&](int32_t l, int32_t r) {
      if (l < 0 || r < 0) return;
      const symbol& a = sym[size_t(l)];
      const symbol& b = sym[size_t(r)];
      key.assign(word, a.start, a.n).append(" ").append(word, b.start, b.n);
      auto it = ranks_.find(key);
      if (it == ranks_.end()) return;
      queue.push({l, r, it->second, a.n + b.n});
    };
    for (size_t i = 1; i < sym.size(); ++i) try_add(int32_t(i) - 1, int32_t(i));
    while (!queue.empty()) {
      const bigram b = queue.top();
      queue.pop();
      symbol& l = sym[size_t(b.left)];
      symbol& r = sym[size_t(b.right)];
      // Stale: one side was merged away or grew since the pair was queued.
      if (l.n == 0 || r.n == 0 || l.next != b.right || l.n + r.n != b.size) continue;
      l.n += r.n;
      r.n = 0;
      l.next = r.next;
      if (r.next >= 0) sym[size_t(r.next)].prev = b.left;
      try_add(l.prev, b.left);
      try_add(b.left, l.next);
    }
    for (int32_t i = 0; i != -1; i = sym[size_t(i)].next) {
      const std::string_view s = std::string_view(word).substr(sym[size_t(i)].start, sym[size_t(i)].n);
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
        const int32_t t = v_.find(s.substr(p, n));
        if (t >= 0) out.push_back(t);
        else if (v_.unk >= 0) out.push_back(v_.unk);
        p += n;
      }
    }
  }

  vocab v_;
  byte_map map_;
  string_map<int32_t> ranks_;
  std::vector<std::string> bytes_;
  regex_splitter splitter_;
  bool ignore_merges_ = false;
  std::string pre_name_;
};

}  // namespace

std::unique_ptr<tokenizer> make_bpe_tokenizer(vocab v, const gguf::file& f) {
  std::vector<std::string> warnings;
  const pre_spec& pre = choose_pre(f, warnings);
  auto t = std::make_unique<bpe_tokenizer>(std::move(v), f, pre);
  t->add_warnings(std::move(warnings));
  return t;
}

}  // namespace tandem::tok_detail
