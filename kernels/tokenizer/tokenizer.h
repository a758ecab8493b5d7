#pragma once
/// Tokenizers built from GGUF metadata: `llama` (SentencePiece BPE with byte fallback)
/// and `gpt2` (byte-level BPE with merges, pre-split by the regexes `tokenizer.ggml.pre`
/// names, as llama.cpp).
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "kernels/gguf/gguf.h"

namespace tandem {

/// Token types as in GGUF `tokenizer.ggml.token_type`.
enum class token_type : int32_t { normal = 1, unknown = 2, control = 3, user_defined = 4, unused = 5, byte = 6 };

class tokenizer {
 public:
  virtual ~tokenizer() = default;
  /// Reads `tokenizer.ggml.model` ("llama" or "gpt2") and the vocabulary.
  /// Throws tandem::error naming the missing key or unsupported model.
  static std::unique_ptr<tokenizer> from_gguf(const gguf::file& f);

  /// Text to ids. `add_bos` prepends BOS when the vocabulary has one and wants it
  /// (`tokenizer.ggml.add_bos_token`; absent: SentencePiece vocabularies do, byte-level BPE
  /// ones do not, as llama.cpp reads it), so Qwen-style files get none. User-defined tokens
  /// in the text (e.g. MPT's runs of spaces) are always taken whole, as llama.cpp and Hugging
  /// Face do; control tokens (`<|im_start|>`, `<s>`) only with `parse_special` (chat templates),
  /// otherwise their text is tokenized like any other.
  virtual std::vector<int32_t> encode(std::string_view text, bool add_bos, bool parse_special = false) const = 0;
  /// The raw bytes a token stands for (byte tokens give their byte, control tokens "").
  /// May be an incomplete UTF-8 sequence: use stream_decoder for display.
  virtual std::string token_bytes(int32_t id) const = 0;
  /// A token as llama-server shows it: its bytes, or for control tokens their text
  /// ("<|im_start|>"), which token_bytes leaves empty.
  virtual std::string token_text(int32_t id) const { return token_bytes(id); }
  /// Whole sequence to valid UTF-8 text (drops the leading space SentencePiece adds after
  /// BOS; invalid byte sequences become U+FFFD).
  virtual std::string decode(const std::vector<int32_t>& ids) const = 0;
  /// The vocabulary string of a token (e.g. "▁Hello", "<0x0A>"); "" if `id` is outside the
  /// vocabulary.
  virtual const std::string& piece(int32_t id) const = 0;

  virtual int32_t n_vocab() const = 0;
  virtual int32_t bos_id() const = 0;  ///< -1 if none
  virtual int32_t eos_id() const = 0;  ///< -1 if none
  virtual std::string_view model_name() const = 0;  ///< "llama" or "gpt2"
  /// The pre-tokenizer in use ("llama3", "default", ...); "" for SentencePiece.
  virtual std::string_view pre_name() const { return {}; }

  /// Problems found while loading that did not stop it (an unknown `tokenizer.ggml.pre` and
  /// the fallback used): for `serve` and the CLI to log.
  const std::vector<std::string>& warnings() const { return warnings_; }
  /// The model's chat template (GGUF `tokenizer.chat_template`, Jinja); "" if it has none.
  const std::string& chat_template() const { return chat_template_; }
  /// Replaces it (tests, and files whose template lives elsewhere).
  void set_chat_template(std::string t) { chat_template_ = std::move(t); }
  /// Fill-in-the-middle tokens (GGUF `tokenizer.ggml.fim_pre_token_id` / `fim_suf_token_id` /
  /// `fim_mid_token_id`, or the older `prefix_token_id` / `suffix_token_id` /
  /// `middle_token_id`); -1 where the model has none.
  struct fim_ids {
    int32_t pre = -1, suf = -1, mid = -1;
  };
  const fim_ids& fim() const { return fim_; }

 protected:
  std::vector<std::string> warnings_;
  std::string chat_template_;
  fim_ids fim_;
};

/// Turns a stream of token ids into valid UTF-8 text chunks: bytes of a character split
/// across tokens are held back until the character is complete. Invalid sequences become
/// U+FFFD rather than being passed through.
class stream_decoder {
 public:
  /// `at_sequence_start`: the ids start a sequence (a prompt), so the space SentencePiece
  /// puts before the first word is dropped once, as tokenizer::decode does. Leave it false
  /// (default) for a continuation (generated tokens), whose leading space is real text.
  explicit stream_decoder(const tokenizer& tok, bool at_sequence_start = false)
      : tok_(&tok), strip_leading_space_(at_sequence_start && tok.model_name() == "llama") {}
  /// Text that became complete with this token (may be empty).
  std::string push(int32_t id);
  /// Whatever is held back at the end of the stream (invalid bytes become U+FFFD).
  std::string flush();

 private:
  const tokenizer* tok_;
  std::string pending_;
  bool first_ = true;
  bool strip_leading_space_ = false;
};

}  // namespace tandem
