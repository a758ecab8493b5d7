#pragma once
/// The token trie of a model's tokenizer, for the grammar mask.
#include <memory>

#include "kernels/grammar/matcher.h"
#include "kernels/tokenizer/tokenizer.h"

namespace tandem::grammar {

/// Every token's raw bytes (tokenizer::token_bytes: control and unknown tokens are empty and
/// never allowed by a mask) and the tokenizer's EOS, which a mask allows once the output is complete.
std::shared_ptr<const token_trie> make_grammar_vocab(const tokenizer& tok);

}  // namespace tandem::grammar
