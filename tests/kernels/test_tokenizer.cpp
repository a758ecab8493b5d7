// Tokenizer tests: small vocabularies built with gguf::writer, and the real 32000-token
// Llama SentencePiece vocabulary of the r15m fixture.
#include <doctest/doctest.h>

#include <string>
#include <vector>

#include "kernels/gguf/gguf.h"
#include "kernels/tokenizer/tokenizer.h"

using tandem::stream_decoder;
using tandem::tokenizer;

namespace {

const std::string k_fixture = std::string(TANDEM_SHARED_MODELS) + "/r15m-f16.gguf";

std::string byte_piece(int b) {
  static const char* hex = "0123456789ABCDEF";
  return std::string("<0x") + hex[b >> 4] + hex[b & 15] + ">";
}

/// A tiny llama vocabulary: <unk> <s> </s>, 256 byte tokens, then `extra` with scores.
std::vector<uint8_t> toy_llama_bytes(const std::vector<std::pair<std::string, float>>& extra) {
  std::vector<std::string> toks = {"<unk>", "<s>", "</s>"};
  std::vector<float> scores = {0, 0, 0};
  std::vector<int32_t> types = {2, 3, 3};
  for (int b = 0; b < 256; ++b) {
    toks.push_back(byte_piece(b));
    scores.push_back(0);
    types.push_back(6);
  }
  for (const auto& [p, s] : extra) {
    toks.push_back(p);
    scores.push_back(s);
    types.push_back(1);
  }
  tandem::gguf::writer w;
  w.set_string("tokenizer.ggml.model", "llama");
  w.set_array_string("tokenizer.ggml.tokens", toks);
  w.set_array_f32("tokenizer.ggml.scores", scores);
  w.set_array_i32("tokenizer.ggml.token_type", types);
  w.set_u32("tokenizer.ggml.bos_token_id", 1);
  w.set_u32("tokenizer.ggml.eos_token_id", 2);
  return w.bytes();
}

constexpr int32_t k_first_extra = 3 + 256;

/// True if `s` is well-formed UTF-8.
bool valid_utf8(const std::string& s) {
  size_t i = 0;
  while (i < s.size()) {
    const auto c = static_cast<unsigned char>(s[i]);
    size_t n = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 0;
    if (n == 0 || i + n > s.size()) return false;
    for (size_t k = 1; k < n; ++k) {
      if ((static_cast<unsigned char>(s[i + k]) & 0xC0) != 0x80) return false;
    }
    i += n;
  }
  return true;
}

int32_t find_piece(const tokenizer& t, const std::string& p) {
  for (int32_t i = 0; i < t.n_vocab(); ++i) {
    if (t.piece(i) == p) return i;
  }
  return -1;
}

}  // namespace

TEST_CASE("tokenizer llama: highest-scoring merge wins, unknown chars fall back to bytes") {
  {
    const auto bytes = toy_llama_bytes({{"\xE2\x96\x81", -5}, {"h", -6}, {"i", -7}, {"hi", -1}, {"\xE2\x96\x81h", -2}});
    const auto f = tandem::gguf::file::parse(bytes);
    const auto tok = tokenizer::from_gguf(f);
    CHECK(tok->model_name() == "llama");
    CHECK(tok->bos_id() == 1);
    CHECK(tok->eos_id() == 2);
    // "▁hi": "hi" (-1) beats "▁h" (-2).
    CHECK(tok->encode("hi", true) == std::vector<int32_t>{1, k_first_extra + 0, k_first_extra + 3});
    CHECK(tok->encode("hi", false) == std::vector<int32_t>{k_first_extra + 0, k_first_extra + 3});
    CHECK(tok->encode("", true) == std::vector<int32_t>{1});
    // "é" is not in the vocabulary: its two bytes.
    CHECK(tok->encode("\xC3\xA9", false) ==
          std::vector<int32_t>{k_first_extra + 0, 3 + 0xC3, 3 + 0xA9});
    CHECK(tok->decode(tok->encode(" hi \xC3\xA9 ih", true)) == " hi \xC3\xA9 ih");
    CHECK(tok->token_bytes(1).empty());
    CHECK(tok->token_bytes(3 + 0x41) == "A");
    CHECK(tok->token_bytes(k_first_extra + 4) == " h");
    CHECK(tok->piece(k_first_extra + 4) == "\xE2\x96\x81h");
  }
  {
    const auto bytes = toy_llama_bytes({{"\xE2\x96\x81", -5}, {"h", -6}, {"i", -7}, {"hi", -2}, {"\xE2\x96\x81h", -1}});
    const auto f = tandem::gguf::file::parse(bytes);
    const auto tok = tokenizer::from_gguf(f);
    CHECK(tok->encode("hi", false) == std::vector<int32_t>{k_first_extra + 4, k_first_extra + 2});
  }
}

TEST_CASE("tokenizer: missing or unsupported model is an error naming the key") {
  tandem::gguf::writer w;
  w.set_array_string("tokenizer.ggml.tokens", {"a"});
  const auto b1 = w.bytes();
  const auto f1 = tandem::gguf::file::parse(b1);
  try {
    (void)tokenizer::from_gguf(f1);
    FAIL("expected an error");
  } catch (const tandem::error& e) {
    CHECK(std::string(e.what()).find("tokenizer.ggml.model") != std::string::npos);
  }
  w.set_string("tokenizer.ggml.model", "bert");
  const auto b2 = w.bytes();
  const auto f2 = tandem::gguf::file::parse(b2);
  try {
    (void)tokenizer::from_gguf(f2);
    FAIL("expected an error");
  } catch (const tandem::error& e) {
    CHECK(e.kind() == tandem::error_kind::unimplemented);
    CHECK(std::string(e.what()).find("bert") != std::string::npos);
  }
}

TEST_CASE("tokenizer gpt2: byte-level BPE by merge rank") {
  tandem::gguf::writer w;
  // "Ġ" (U+0120) is the byte-level image of ' ', "Ċ" (U+010A) of '\n'.
  const std::vector<std::string> toks = {"a", "b", "\xC4\xA0", "ab", "\xC4\xA0" "ab", "\xC4\x8A", "!", "<|endoftext|>"};
  w.set_string("tokenizer.ggml.model", "gpt2");
  w.set_array_string("tokenizer.ggml.tokens", toks);
  w.set_array_i32("tokenizer.ggml.token_type", {1, 1, 1, 1, 1, 1, 1, 3});
  w.set_array_string("tokenizer.ggml.merges", {"a b", "\xC4\xA0 ab"});
  w.set_u32("tokenizer.ggml.eos_token_id", 7);
  const auto bytes = w.bytes();
  const auto f = tandem::gguf::file::parse(bytes);
  const auto tok = tokenizer::from_gguf(f);
  CHECK(tok->model_name() == "gpt2");
  // no tokenizer.ggml.pre: llama.cpp's 'default' pre-tokenizer, and a warning saying so
  CHECK(tok->pre_name() == "default");
  REQUIRE(tok->warnings().size() == 1);
  CHECK(tok->warnings()[0].find("tokenizer.ggml.pre") != std::string::npos);
  CHECK(tok->bos_id() == -1);
  CHECK(tok->eos_id() == 7);
  CHECK(tok->encode("ab ab", true) == std::vector<int32_t>{3, 4});
  CHECK(tok->encode("ab\nb!", false) == std::vector<int32_t>{3, 5, 1, 6});
  CHECK(tok->encode("ba", false) == std::vector<int32_t>{1, 0});
  CHECK(tok->decode({3, 4, 5, 7}) == "ab ab\n");
  CHECK(tok->token_bytes(2) == " ");
}

TEST_CASE("tokenizer llama fixture: known ids and byte fallback") {
  const auto f = tandem::gguf::file::open(k_fixture);
  const auto tok = tokenizer::from_gguf(f);
  REQUIRE(tok->model_name() == "llama");
  CHECK(tok->n_vocab() == 32000);
  CHECK(tok->bos_id() == 1);
  CHECK(tok->eos_id() == 2);
  CHECK(tok->piece(15043) == "\xE2\x96\x81Hello");
  CHECK(tok->encode("Hello world", true) == std::vector<int32_t>{1, 15043, 3186});
  CHECK(tok->encode("Hello world", false) == std::vector<int32_t>{15043, 3186});
  CHECK(tok->decode({1, 15043, 3186, 2}) == "Hello world");
  // Reference ids from llama.cpp with the Llama vocabulary.
  CHECK(tok->encode("The quick brown fox", true) ==
        std::vector<int32_t>{1, 450, 4996, 17354, 1701, 29916});
  CHECK(tok->encode("I believe the meaning of life is", true) ==
        std::vector<int32_t>{1, 306, 4658, 278, 6593, 310, 2834, 338});
  CHECK(tok->encode(" Hello", false) == std::vector<int32_t>{29871, 15043});
  CHECK(tok->decode({1, 29871, 15043}) == " Hello");
  // "▁\n" is not a token: the dummy-prefix "▁" (29871), then <0x0A> (13).
  CHECK(tok->piece(13) == "<0x0A>");
  CHECK(tok->encode("\n", false) == std::vector<int32_t>{29871, 13});
  CHECK(tok->token_bytes(13) == "\n");
  CHECK(tok->token_bytes(29871) == " ");
  CHECK(tok->token_bytes(1).empty());
}

TEST_CASE("tokenizer llama fixture: round-trips arbitrary UTF-8") {
  const auto f = tandem::gguf::file::open(k_fixture);
  const auto tok = tokenizer::from_gguf(f);
  const std::vector<std::string> texts = {
      "Hello world",
      "  leading spaces and trailing  ",
      "line one\nline two\n\n\ttabbed",
      "emoji \xF0\x9F\x98\x80\xF0\x9F\x91\x8D\xF0\x9F\x8F\xBD done",
      "\xE4\xBD\xA0\xE5\xA5\xBD\xEF\xBC\x8C\xE4\xB8\x96\xE7\x95\x8C",  // 你好，世界
      "caf\xC3\xA9 na\xC3\xAFve \xD0\x9F\xD1\x80\xD0\xB8\xD0\xB2\xD0\xB5\xD1\x82 \xCE\xB1\xCE\xB2\xCE\xB3",
      "x=1+2*3; // <s> is just text here",
  };
  for (const auto& t : texts) {
    CAPTURE(t);
    const auto ids = tok->encode(t, true);
    REQUIRE(!ids.empty());
    CHECK(ids.front() == 1);
    for (const int32_t id : ids) CHECK((id >= 0 && id < tok->n_vocab()));
    CHECK(tok->decode(ids) == t);
    // Streaming gives the same text, every chunk valid UTF-8.
    stream_decoder sd(*tok, /*at_sequence_start=*/true);
    std::string streamed;
    for (const int32_t id : ids) {
      const std::string chunk = sd.push(id);
      CHECK(valid_utf8(chunk));
      streamed += chunk;
    }
    streamed += sd.flush();
    CHECK(streamed == t);
  }
}

TEST_CASE("tokenizer stream_decoder: holds back a split emoji, replaces invalid bytes") {
  const auto f = tandem::gguf::file::open(k_fixture);
  const auto tok = tokenizer::from_gguf(f);
  std::vector<int32_t> emoji;
  for (const int b : {0xF0, 0x9F, 0x98, 0x80}) {
    const int32_t id = find_piece(*tok, byte_piece(b));
    REQUIRE(id >= 0);
    emoji.push_back(id);
  }
  const int32_t hello = 15043;
  {
    stream_decoder sd(*tok, /*at_sequence_start=*/true);
    CHECK(sd.push(1).empty());
    CHECK(sd.push(hello) == "Hello");  // the dummy-prefix space is dropped once
    CHECK(sd.push(29871) == " ");
    CHECK(sd.push(emoji[0]).empty());
    CHECK(sd.push(emoji[1]).empty());
    CHECK(sd.push(emoji[2]).empty());
    CHECK(sd.push(emoji[3]) == "\xF0\x9F\x98\x80");
    CHECK(sd.push(hello) == " Hello");
    CHECK(sd.flush().empty());
  }
  {
    // A truncated emoji followed by text: U+FFFD, then the text.
    stream_decoder sd(*tok);
    CHECK(sd.push(emoji[0]).empty());
    CHECK(sd.push(emoji[1]).empty());
    CHECK(sd.push(hello) == "\xEF\xBF\xBD Hello");
  }
  {
    // A stray continuation byte and a dangling lead byte at the end.
    stream_decoder sd(*tok);
    CHECK(sd.push(emoji[3]) == "\xEF\xBF\xBD");
    CHECK(sd.push(emoji[0]).empty());
    CHECK(sd.flush() == "\xEF\xBF\xBD");
    CHECK(sd.flush().empty());
  }
  CHECK(tok->decode({emoji[0], emoji[1]}) == "\xEF\xBF\xBD");
  {
    // A generated continuation keeps its leading space.
    stream_decoder sd(*tok, /*at_sequence_start=*/false);
    CHECK(sd.push(hello) == " Hello");
  }
}

namespace {

/// GPT-2's bytes_to_unicode image of one byte, as UTF-8.
std::string gpt2_byte(int b) {
  static std::vector<std::string> map = [] {
    std::vector<std::string> m(256);
    int n = 0;
    for (int c = 0; c < 256; ++c) {
      const bool printable = (c >= 33 && c <= 126) || (c >= 161 && c <= 172) || (c >= 174 && c <= 255);
      const int cp = printable ? c : 256 + n++;
      std::string s;
      if (cp < 0x80) {
        s += char(cp);
      } else {
        s += char(0xC0 | (cp >> 6));
        s += char(0x80 | (cp & 0x3F));
      }
      m[size_t(c)] = s;
    }
    return m;
  }();
  return map[size_t(b)];
}

}  // namespace

TEST_CASE("tokenizer gpt2: full byte vocabulary, pre-tokenizer boundaries, round trips") {
  // 256 byte tokens, then merged pieces; "dĠ" would only form across a word boundary.
  std::vector<std::string> toks;
  for (int b = 0; b < 256; ++b) toks.push_back(gpt2_byte(b));
  const std::string G = gpt2_byte(' ');
  const std::vector<std::string> merges = {"h e", "l l", G + " w", "' s", "1 2", "12 3", "d " + G, "o " + G, G + " " + G};
  for (const auto& m : merges) toks.push_back(m.substr(0, m.find(' ')) + m.substr(m.find(' ') + 1));
  toks.push_back("<|endoftext|>");
  std::vector<int32_t> types(toks.size(), 1);
  types.back() = 3;
  tandem::gguf::writer w;
  w.set_string("tokenizer.ggml.model", "gpt2");
  w.set_string("tokenizer.ggml.pre", "gpt-2");
  w.set_array_string("tokenizer.ggml.tokens", toks);
  w.set_array_i32("tokenizer.ggml.token_type", types);
  w.set_array_string("tokenizer.ggml.merges", merges);
  w.set_u32("tokenizer.ggml.bos_token_id", uint32_t(toks.size() - 1));
  w.set_bool("tokenizer.ggml.add_bos_token", false);
  const auto bytes = w.bytes();
  const auto f = tandem::gguf::file::parse(bytes);
  const auto tok = tokenizer::from_gguf(f);
  auto id = [&](const std::string& p) { return find_piece(*tok, p); };
  auto pieces = [&](const std::string& text) {
    std::vector<std::string> out;
    for (int32_t t : tok->encode(text, false)) out.push_back(tok->piece(t));
    return out;
  };
  // "'s" is a contraction word; " 123" one digit word; "d" and " " never merge across words.
  CHECK(pieces("he world's 123") ==
        std::vector<std::string>{"he", G + "w", "o", "r", "l", "d", "'s", G, "123"});
  // whitespace runs: all but the last space form a word of their own
  CHECK(pieces("o   x") == std::vector<std::string>{"o", G + G, G, "x"});
  CHECK(pieces("\n\ny") == std::vector<std::string>{gpt2_byte('\n'), gpt2_byte('\n'), "y"});
  // add_bos_token = false: no BOS even when the caller allows one (as llama.cpp reads the key).
  CHECK(tok->encode("he", true) == std::vector<int32_t>{id("he")});
  // non-ASCII bytes go through the byte map and come back
  for (const std::string t : {"caf\xC3\xA9 \xF0\x9F\x98\x80!", "tabs\tand\r\nCRLF", "\xE4\xBD\xA0\xE5\xA5\xBD 12345"}) {
    CAPTURE(t);
    CHECK(tok->decode(tok->encode(t, false)) == t);
    stream_decoder sd(*tok, true);
    std::string s;
    for (int32_t x : tok->encode(t, false)) {
      const std::string chunk = sd.push(x);
      CHECK(valid_utf8(chunk));
      s += chunk;
    }
    CHECK(s + sd.flush() == t);
  }
  CHECK(tok->token_bytes(id(gpt2_byte(0xC3))) == "\xC3");
  CHECK(tok->decode({int32_t(toks.size() - 1)}).empty());
}

TEST_CASE("tokenizer llama fixture: stream matches decode for a prompt and a continuation") {
  const auto f = tandem::gguf::file::open(k_fixture);
  const auto tok = tokenizer::from_gguf(f);
  const std::string prompt = "Once upon a time \xF0\x9F\x90\x89 there was a dragon.";
  const auto ids = tok->encode(prompt, true);
  stream_decoder start(*tok, true);
  std::string s;
  for (int32_t t : ids) s += start.push(t);
  CHECK(s + start.flush() == prompt);
  // a continuation keeps the space of its first word
  const auto more = tok->encode(" and it flew", false);
  stream_decoder cont(*tok);
  std::string c;
  for (size_t i = 1; i < more.size(); ++i) c += cont.push(more[i]);  // skip the dummy-prefix "▁"
  CHECK(c + cont.flush() == " and it flew");
}
