#include "kernels/grammar/vocab.h"

namespace tandem::grammar {

std::shared_ptr<const token_trie> make_grammar_vocab(const tokenizer& tok) {
  std::vector<std::string> bytes(size_t(tok.n_vocab()));
  for (int32_t i = 0; i < tok.n_vocab(); ++i) bytes[size_t(i)] = tok.token_bytes(i);
  return std::make_shared<token_trie>(std::move(bytes), tok.eos_id());
}

}  // namespace tandem::grammar
