#include "transport/http/fim_prompt.h"

#include <fmt/format.h>

namespace tandem::transport {

std::optional<std::vector<int32_t>> fim_prompt(const tokenizer& tok, std::span<const int32_t> prompt,
                                               std::string_view suffix, std::string& why) {
  const auto& f = tok.fim();
  if (f.pre < 0 || f.suf < 0 || f.mid < 0) {
    why = fmt::format("suffix needs a model with fill-in-the-middle tokens (GGUF tokenizer.ggml.fim_pre_token_id, "
                      "fim_suf_token_id and fim_mid_token_id); this model has {}; send the request without suffix",
                      f.pre < 0 && f.suf < 0 && f.mid < 0 ? std::string("none")
                                                          : fmt::format("only some (pre {}, suf {}, mid {})", f.pre,
                                                                        f.suf, f.mid));
    return std::nullopt;
  }
  std::vector<int32_t> out = tok.encode("", true);  // BOS when the vocabulary wants one
  out.push_back(f.pre);
  out.insert(out.end(), prompt.begin(), prompt.end());
  out.push_back(f.suf);
  for (auto id : tok.encode(suffix, false)) out.push_back(id);
  out.push_back(f.mid);
  return out;
}

}  // namespace tandem::transport
