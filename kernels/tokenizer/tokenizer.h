#pragma once
/// Tokenizers built from GGUF metadata: `llama` (SentencePiece BPE with byte fallback)
/// and `gpt2` (byte-level BPE with merges).
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

  /// Text to ids. `add_bos` prepends BOS when the vocabulary has one.
  virtual std::vector<int32_t> encode(std::string_view text, bool add_bos) const = 0;
  /// The raw bytes a token stands for (byte tokens give their byte, control tokens "").
  /// May be an incomplete UTF-8 sequence: use stream_decoder for display.
  virtual std::string token_bytes(int32_t id) const = 0;
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
