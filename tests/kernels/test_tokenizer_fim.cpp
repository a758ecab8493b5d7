// Fill-in-the-middle token ids from GGUF metadata: llama.cpp's keys, the older names, none, and
// ids outside the vocabulary (a malformed file).
#include <doctest/doctest.h>

#include <string>
#include <vector>

#include "kernels/gguf/gguf.h"
#include "kernels/tokenizer/tokenizer.h"

using namespace tandem;

namespace {

/// <unk> <s> </s> and 256 byte tokens, plus the given u32 keys.
std::vector<uint8_t> vocab_with(const std::vector<std::pair<std::string, uint32_t>>& keys) {
  std::vector<std::string> toks = {"<unk>", "<s>", "</s>"};
  std::vector<int32_t> types = {2, 3, 3};
  static const char* hex = "0123456789ABCDEF";
  for (int b = 0; b < 256; ++b) {
    toks.push_back(std::string("<0x") + hex[b >> 4] + hex[b & 15] + ">");
    types.push_back(6);
  }
  gguf::writer w;
  w.set_string("tokenizer.ggml.model", "llama");
  w.set_array_string("tokenizer.ggml.tokens", toks);
  w.set_array_f32("tokenizer.ggml.scores", std::vector<float>(toks.size(), 0.0f));
  w.set_array_i32("tokenizer.ggml.token_type", types);
  for (const auto& [k, v] : keys) w.set_u32(k, v);
  return w.bytes();
}

}  // namespace

TEST_CASE("tokenizer: FIM token ids from llama.cpp's keys or the older ones, -1 without") {
  {
    const auto b = vocab_with({});
    const auto tok = tokenizer::from_gguf(gguf::file::parse(b));
    CHECK(tok->fim().pre == -1);
    CHECK(tok->fim().suf == -1);
    CHECK(tok->fim().mid == -1);
  }
  {
    const auto b = vocab_with({{"tokenizer.ggml.fim_pre_token_id", 10},
                               {"tokenizer.ggml.fim_suf_token_id", 11},
                               {"tokenizer.ggml.fim_mid_token_id", 12},
                               {"tokenizer.ggml.prefix_token_id", 20}});
    const auto tok = tokenizer::from_gguf(gguf::file::parse(b));
    CHECK(tok->fim().pre == 10);  // the newer key wins
    CHECK(tok->fim().suf == 11);
    CHECK(tok->fim().mid == 12);
  }
  {
    const auto b = vocab_with({{"tokenizer.ggml.prefix_token_id", 20},
                               {"tokenizer.ggml.suffix_token_id", 21},
                               {"tokenizer.ggml.middle_token_id", 22}});
    const auto tok = tokenizer::from_gguf(gguf::file::parse(b));
    CHECK(tok->fim().pre == 20);
    CHECK(tok->fim().suf == 21);
    CHECK(tok->fim().mid == 22);
  }
  {
    const auto b = vocab_with({{"tokenizer.ggml.fim_mid_token_id", 5000}});
    try {
      (void)tokenizer::from_gguf(gguf::file::parse(b));
      FAIL("expected an error");
    } catch (const tandem::error& e) {
      CHECK(std::string(e.what()).find("fim_mid_token_id = 5000") != std::string::npos);
    }
  }
}
