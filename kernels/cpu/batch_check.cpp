#include "kernels/cpu/batch_check.h"

#include <fmt/format.h>

#include "kernels/base/error.h"

namespace tandem::cpu {

size_t check_batch(std::span<const batch_seq> batch, const model_config& c, const kv_pool& pool,
                   std::vector<int32_t>& tokens, std::vector<int32_t>& positions) {
  const int32_t ps = pool.layout().page_size;
  tokens.clear();
  positions.clear();
  size_t n_logits = 0;
  for (size_t s = 0; s < batch.size(); ++s) {
    const batch_seq& b = batch[s];
    const int64_t end = int64_t(b.pos) + int64_t(b.tokens.size());
    if (b.pos < 0) throw tandem::error(fmt::format("batch sequence {}: negative position {}", s, b.pos));
    if (b.want_logits && b.tokens.empty())
      throw tandem::error(fmt::format("batch sequence {} wants logits but has no new tokens", s));
    if (c.n_ctx > 0 && end > c.n_ctx)
      throw tandem::error(fmt::format("batch sequence {}: positions up to {} exceed the context length {}", s, end,
                                      c.n_ctx));
    if (int64_t(b.pages.size()) * ps < end)
      throw tandem::error(fmt::format("batch sequence {}: {} pages of {} tokens cannot hold {} positions; "
                                      "allocate more pages",
                                      s, b.pages.size(), ps, end));
    // Every page attention reads ([0, end)), not only the ones written now.
    for (int64_t i = 0; i < (end + ps - 1) / ps; ++i) {
      const int32_t page = b.pages[size_t(i)];
      if (page < 0 || page >= pool.n_pages())
        throw tandem::error(fmt::format("batch sequence {}: page id {} is outside the pool of {} pages", s, page,
                                        pool.n_pages()));
    }
    for (size_t i = 0; i < b.tokens.size(); ++i) {
      if (b.tokens[i] < 0 || b.tokens[i] >= c.n_vocab)
        throw tandem::error(fmt::format("batch sequence {}: token id {} is out of range [0, {})", s, b.tokens[i],
                                        c.n_vocab));
      tokens.push_back(b.tokens[i]);
      positions.push_back(b.pos + int32_t(i));
    }
    n_logits += b.want_logits ? 1 : 0;
  }
  return n_logits;
}

}  // namespace tandem::cpu
