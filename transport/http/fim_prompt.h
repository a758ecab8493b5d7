#pragma once
/// Completions `suffix` (fill-in-the-middle): the prompt and the suffix around the model's FIM
/// tokens, in llama.cpp's order: [BOS] FIM_PRE prompt FIM_SUF suffix FIM_MID; the completion is
/// the middle.
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "kernels/tokenizer/tokenizer.h"

namespace tandem::transport {

/// The FIM prompt for `prompt` (already tokenized, without BOS) and `suffix`; nullopt with
/// `why` set when the model has no FIM tokens (GGUF tokenizer.ggml.fim_pre/suf/mid_token_id,
/// or the older prefix/suffix/middle_token_id).
std::optional<std::vector<int32_t>> fim_prompt(const tokenizer& tok, std::span<const int32_t> prompt,
                                               std::string_view suffix, std::string& why);

}  // namespace tandem::transport
