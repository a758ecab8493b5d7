#include "kernels/model/arch/forward_common.h"

#include <fmt/format.h>

#include "kernels/base/error.h"
#include "kernels/model/arch/checks.h"

namespace tandem::arch {

void plan_batch(std::span<const batch_seq> batch, const model_config& c, const kv_pool& pool, const kv_layout& want,
                batch_plan& plan) {
  const kv_layout& have = pool.layout();
  if (!(have == want))
    throw tandem::error(
        fmt::format("KV pool layout {} does not match the model's {}", have.describe(), want.describe()));
  check_batch(batch, c, pool, plan.tokens, plan.positions);
  const int32_t ps = have.page_size;
  plan.slots.clear();
  plan.starts.clear();
  plan.last.clear();
  int64_t t0 = 0;
  for (const batch_seq& b : batch) {
    if (!b.tokens.empty()) plan.starts.emplace_back(t0, &b);
    for (size_t i = 0; i < b.tokens.size(); ++i) {
      const int32_t p = b.pos + int32_t(i);
      plan.slots.push_back(backend::kv_slot{b.pages[size_t(p / ps)], p % ps});
    }
    t0 += int64_t(b.tokens.size());
    if (b.want_logits) plan.last.push_back(int32_t(t0 - 1));
  }
}

void output_logits(backend::ops& o, const batch_plan& plan, const float* x, float* xn, const float* norm, float eps,
                   int64_t n_embd, backend::weight_id output, float softcap, backend::buffer& staging,
                   std::vector<float>& logits) {
  if (plan.last.empty()) return;
  const int64_t r = int64_t(plan.last.size());
  o.gather_rows(x, plan.last, xn, n_embd);
  o.rms_norm(xn, norm, xn, r, n_embd, eps);
  // Host memory serves as the output directly; a device's logits come back in one copy.
  const bool host = o.domain() == backend::memory_domain::host;
  float* out = host ? logits.data() : staging.floats(logits.size());
  o.matmul(output, xn, r, out);
  if (softcap > 0.0f) o.softcap(out, logits.size(), softcap);
  if (!host) o.download(out, logits.size(), logits.data());
}

}  // namespace tandem::arch
