#include <fmt/format.h>

#include "kernels/backend/backend.h"
#include "kernels/base/error.h"

namespace tandem::backend {

void sample_on_host(const float* logits, int64_t n_vocab, std::span<const sample_row> rows,
                    std::span<token_logprobs> out) {
  if (out.size() != rows.size())
    throw tandem::error(fmt::format("sample: {} output slots for {} rows; give one per row", out.size(), rows.size()));
  for (size_t i = 0; i < rows.size(); ++i) {
    const sample_row& r = rows[i];
    const std::span<const float> row(logits + int64_t(i) * n_vocab, size_t(n_vocab));
    const int32_t token = draw_with_uniform(r, row);
    if (r.top_logprobs < 0) {
      out[i] = token_logprobs{.token = token};
      continue;
    }
    // The distribution compute_logprobs gives the worker's host path (no processing: samples_raw).
    out[i] = compute_logprobs(row, params_of(r), {}, token, r.top_logprobs);
  }
}

}  // namespace tandem::backend
