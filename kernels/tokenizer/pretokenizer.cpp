// Pre-tokenizer regexes per GGUF `tokenizer.ggml.pre`, as llama.cpp's llm_tokenizer_bpe lists
// them, and the PCRE2 splitter that runs them.
//
// Where llama.cpp rewrote a Hugging Face regex for std::regex (which lacks `(?i:...)`, Unicode
// properties beyond L/N/P and possessive quantifiers), PCRE2 can run the original; we keep
// llama.cpp's ASCII-only contraction form `'[sS]|'[tT]...` because `(?i)` under Unicode case
// folding would also take e.g. "'ſ" (long s) for "'s".
#include "kernels/tokenizer/pretokenizer.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <algorithm>
#include <array>
#include <string>

#include "kernels/base/error.h"
#include "kernels/tokenizer/utf8.h"

namespace tandem {

namespace {

// The GPT-2 regex (llama.cpp drops HF's trailing `|\s+`: text between matches is kept anyway).
const std::string k_gpt2 = R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S))";
const std::string k_contractions = R"((?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD]))";
const std::string k_llama3 =
    k_contractions + R"(|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
const std::string k_qwen2 =
    k_contractions + R"(|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
// DeepSeek's letter class: the cased letters (Lu, Ll, Lt) of its Unicode version.
const std::string k_deepseek_letters =
    R"([A-Za-z\x{B5}\x{C0}-\x{D6}\x{D8}-\x{F6}\x{F8}-\x{1BA}\x{1BC}-\x{1BF}\x{1C4}-\x{293}\x{295}-\x{2AF})"
    R"(\x{370}-\x{373}\x{376}\x{377}\x{37B}-\x{37D}\x{37F}\x{386}\x{388}-\x{38A}\x{38C}\x{38E}-\x{3A1})"
    R"(\x{3A3}-\x{3F5}\x{3F7}-\x{481}\x{48A}-\x{52F}\x{531}-\x{556}\x{10A0}-\x{10C5}\x{13A0}-\x{13F5})"
    R"(\x{13F8}-\x{13FD}\x{1C90}-\x{1CBA}\x{1CBD}-\x{1CBF}\x{1D00}-\x{1D2B}\x{1D6B}-\x{1D77})"
    R"(\x{1D79}-\x{1D9A}\x{1E00}-\x{1F15}\x{1F18}-\x{1F1D}\x{1F20}-\x{1F45}\x{1F48}-\x{1F4D})"
    R"(\x{1F50}-\x{1F57}\x{1F59}\x{1F5B}\x{1F5D}\x{1F5F}-\x{1F7D}\x{1F80}-\x{1FB4}\x{1FB6}-\x{1FBC})"
    R"(\x{1FBE}\x{1FC2}-\x{1FC4}\x{1FC6}-\x{1FCC}\x{1FD0}-\x{1FD3}\x{1FD6}-\x{1FDB}\x{1FE0}-\x{1FEC})"
    R"(\x{1FF2}-\x{1FF4}\x{1FF6}-\x{1FFC}\x{2102}\x{2107}\x{210A}-\x{2113}\x{2115}\x{2119}-\x{211D})"
    R"(\x{2124}\x{2126}\x{2128}\x{212A}-\x{212D}\x{212F}-\x{2134}\x{2139}\x{213C}-\x{213F})"
    R"(\x{2145}-\x{2149}\x{214E}\x{2183}\x{2184}\x{2C00}-\x{2C7B}\x{2C7E}-\x{2CE4}\x{2CEB}-\x{2CEE})"
    R"(\x{2CF2}\x{2CF3}\x{A640}-\x{A66D}\x{A680}-\x{A69B}\x{A722}-\x{A76F}\x{A771}-\x{A787})"
    R"(\x{A78B}-\x{A78E}\x{AB70}-\x{ABBF}\x{FB00}-\x{FB06}\x{FB13}-\x{FB17}\x{FF21}-\x{FF3A})"
    R"(\x{FF41}-\x{FF5A}\x{10400}-\x{1044F}\x{104B0}-\x{104D3}\x{104D8}-\x{104FB}\x{10C80}-\x{10CB2})"
    R"(\x{10CC0}-\x{10CF2}\x{118A0}-\x{118DF}\x{1E900}-\x{1E943}])";
const std::string k_deepseek_cjk = R"([\x{4E00}-\x{9FA5}\x{800}-\x{4E00}\x{AC00}-\x{D7FF}]+)";
const std::string k_deepseek3_main =
    R"([!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+)"
    R"(| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
const std::string k_bloom = R"( ?[^(\s|.,!?\x{2026}\x{3002}\x{FF0C}\x{3001}\x{964}\x{6D4}\x{60C})]+)";
// Hugging Face's originals for the case-aware patterns (llama.cpp approximates the Lu/Ll
// classes with lookaheads; PCRE2 has the properties).
const std::string k_upper = R"([\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}])";
const std::string k_lower = R"([\p{Ll}\p{Lm}\p{Lo}\p{M}])";
const std::string k_word_start = R"([^\r\n\p{L}\p{N}]?)";
const std::string k_tekken = k_word_start + k_upper + "*" + k_lower + "+|" + k_word_start + k_upper + "+" + k_lower +
                             R"(*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
const std::string k_gpt4o = k_word_start + k_upper + "*" + k_lower + "+" + k_contractions + "?|" + k_word_start +
                            k_upper + "+" + k_lower + "*" + k_contractions +
                            R"(?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

struct named_spec {
  std::vector<std::string_view> names;  ///< GGUF names; the first is the canonical one
  std::vector<std::string> regexes;
  bool ignore_merges = false;
};

const std::vector<named_spec>& table() {
  static const std::vector<named_spec> t = {
      {{"default"},
       {R"([\p{P}\$\+<=>\^~\|]+)", k_gpt2, R"(\p{N}+)", "[0-9][0-9][0-9]"}},
      {{"llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2"}, {k_llama3}, true},
      {{"dbrx", "smaug-bpe", "glm4", "chatglm-bpe"}, {k_llama3}},
      {{"deepseek-llm"},
       {"[\\r\\n]", R"(\s?)" + k_deepseek_letters + "+",
        R"(\s?[!-/:-~\x{FF01}-\x{FF0F}\x{FF1A}-\x{FF5E}\x{2018}-\x{201F}\x{3000}-\x{3002}]+)", R"(\s+$)",
        k_deepseek_cjk, R"(\p{N}+)"}},
      {{"deepseek-coder"}, {"[\\r\\n]", R"(\s?\p{L}+)", R"(\s?\p{P}+)", k_deepseek_cjk, R"(\p{N})"}},
      {{"deepseek-v3", "hunyuan-dense"},
       {R"(\p{N}{1,3})", R"([\x{4E00}-\x{9FA5}\x{3040}-\x{309F}\x{30A0}-\x{30FF}]+)", k_deepseek3_main}},
      {{"falcon"}, {R"([\p{P}\$\+<=>\^~\|`]+)", k_gpt2, "[0-9][0-9][0-9]"}},
      {{"starcoder", "refact", "command-r", "smollm", "codeshell", "exaone", "minerva-7b"}, {R"(\p{N})", k_gpt2}},
      {{"gpt-2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v2-es", "jina-v2-de", "a.x-4.0", "mellum",
        "jina-v1-en", "jina-v2-code", "roberta-bpe", "mpt", "olmo", "jais", "trillion", "granite-docling", "exaone4"},
       {k_gpt2}},
      {{"qwen2", "deepseek-r1-qwen", "kormo", "stablelm2", "megrez", "hunyuan"}, {k_qwen2}},
      {{"poro-chat", "bloom", "gpt3-finnish"}, {k_bloom}},
      {{"viking"}, {k_bloom, R"(\p{N})"}},
      {{"tekken"}, {k_tekken}, true},
      {{"chameleon"},
       {"<sentinel:[0-9]+>", "(IMGIMG)((A|B|C|D|E|F|G|H|I){1,4})Z", "([\\t\\n]|    |  )", R"(\p{N})",
        R"([\p{P}!-/:-@\[-`{-~])", k_gpt2}},
      {{"gpt-4o", "llama4", "minimax-m2"}, {k_gpt4o}},
      {{"superbpe"}, {R"(\p{N}+)", R"((?=(\d{3})+(?!\d)))"}},
      {{"bailingmoe", "bailingmoe2", "llada-moe"},
       {R"('(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]++[\r\n]*)"
        R"(|\s*[\r\n]|\s+(?!\S)|\s+)"}},
      {{"seed-coder"},
       {k_contractions + R"(|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+|\s+(?!\S)|\s+)"}},
      {{"grok-2"}, {k_qwen2}},
  };
  return t;
}

std::vector<pre_spec> build_specs() {
  std::vector<pre_spec> out;
  for (const auto& n : table()) out.push_back({std::string(n.names.front()), n.regexes, n.ignore_merges});
  return out;
}

const std::vector<pre_spec>& specs() {
  static const std::vector<pre_spec> s = build_specs();
  return s;
}

std::string pcre2_message(int code) {
  std::array<PCRE2_UCHAR, 256> buf{};
  pcre2_get_error_message(code, buf.data(), buf.size());
  return reinterpret_cast<const char*>(buf.data());
}

}  // namespace

const pre_spec* find_pre_spec(std::string_view name) {
  const auto& t = table();
  for (size_t i = 0; i < t.size(); ++i)
    for (std::string_view n : t[i].names)
      if (n == name) return &specs()[i];
  return nullptr;
}

const pre_spec& default_pre_spec() { return specs().front(); }

const std::vector<pre_spec>& all_pre_specs() { return specs(); }

// ---------------------------------------------------------------------------------------------

struct regex_splitter::compiled {
  pcre2_code* code = nullptr;
  bool jit = false;
  ~compiled() { pcre2_code_free(code); }
};

regex_splitter::regex_splitter(const std::vector<std::string>& regexes) {
  for (const auto& re : regexes) {
    int err = 0;
    PCRE2_SIZE at = 0;
    // UTF + UCP: \s, \p{..}, \d follow Unicode; invalid UTF-8 in the subject never matches
    // instead of failing the call; `$` means the end of the piece only, as in std::regex.
    const uint32_t opts = PCRE2_UTF | PCRE2_UCP | PCRE2_MATCH_INVALID_UTF | PCRE2_DOLLAR_ENDONLY;
    pcre2_code* code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(re.data()), re.size(), opts, &err, &at, nullptr);
    if (code == nullptr)
      throw tandem::error(error_kind::failed, "pre-tokenizer regex '" + re + "' does not compile at offset " +
                                                  std::to_string(at) + ": " + pcre2_message(err) +
                                                  " (a Tandem bug: report it with the model's tokenizer.ggml.pre)");
    auto c = std::make_unique<compiled>();
    c->code = code;
    // JIT is an optimisation: where the library was built without it, the interpreter runs.
    c->jit = pcre2_jit_compile(code, PCRE2_JIT_COMPLETE) == 0;
    res_.push_back(std::move(c));
  }
}

regex_splitter::~regex_splitter() = default;

namespace {

/// One match of `code` in s[from..], into `md`; false when there is none.
bool next_match(const pcre2_code* code, pcre2_match_data* md, std::string_view s, size_t from, uint32_t opts,
                size_t& start, size_t& end) {
  auto subject = reinterpret_cast<PCRE2_SPTR>(s.data());
  int rc = pcre2_match(code, subject, s.size(), from, opts, md, nullptr);
  if (rc == PCRE2_ERROR_JIT_STACKLIMIT) {
    // Deep backtracking on a long piece: the interpreter keeps its frames on the heap.
    rc = pcre2_match(code, subject, s.size(), from, opts | PCRE2_NO_JIT, md, nullptr);
  }
  if (rc == PCRE2_ERROR_NOMATCH) return false;
  if (rc < 0)
    throw tandem::error(error_kind::failed, "pre-tokenizer regex match failed on a " + std::to_string(s.size()) +
                                                "-byte piece: " + pcre2_message(rc));
  const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(md);
  start = ov[0];
  end = ov[1];
  return true;
}

/// Splits `s` at the matches of `code`, as llama.cpp's unicode_regex_split: each match is a
/// piece, so is the text before it; an empty match only marks a split point.
void split_one(const pcre2_code* code, pcre2_match_data* md, std::string_view s, std::vector<std::string_view>& out) {
  size_t last = 0;  // end of what has been emitted
  size_t pos = 0;   // where the next search starts
  bool after_empty = false;
  while (pos <= s.size()) {
    size_t b = 0, e = 0;
    // After an empty match, first try a non-empty one at the same place, then move on by one
    // character (the std::regex_iterator rule), so the search always advances.
    const uint32_t opts = after_empty ? (PCRE2_NOTEMPTY_ATSTART | PCRE2_ANCHORED) : 0;
    if (!next_match(code, md, s, pos, opts, b, e)) {
      if (!after_empty) break;
      after_empty = false;
      if (pos >= s.size()) break;
      const utf8::check_result c = utf8::check(s, pos);
      pos += c.ok ? c.len : 1;
      continue;
    }
    if (b > last) out.push_back(s.substr(last, b - last));
    if (e > b) out.push_back(s.substr(b, e - b));
    last = std::max(last, e);
    after_empty = e == b;
    pos = e;
  }
  if (last < s.size()) out.push_back(s.substr(last));
}

}  // namespace

std::vector<std::string_view> regex_splitter::split(std::string_view text) const {
  std::vector<std::string_view> cur;
  if (text.empty()) return cur;
  cur.push_back(text);
  std::vector<std::string_view> next;
  for (const auto& re : res_) {
    // Match data per call keeps one splitter usable from many threads at once.
    pcre2_match_data* md = pcre2_match_data_create_from_pattern(re->code, nullptr);
    if (md == nullptr) throw tandem::error(error_kind::failed, "pre-tokenizer: out of memory for PCRE2 match data");
    try {
      next.clear();
      for (std::string_view piece : cur) split_one(re->code, md, piece, next);
    } catch (...) {
      pcre2_match_data_free(md);
      throw;
    }
    pcre2_match_data_free(md);
    cur.swap(next);
  }
  return cur;
}

}  // namespace tandem
