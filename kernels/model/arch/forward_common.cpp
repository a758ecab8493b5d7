#include "kernels/model/arch/forward_common.h"

#include <fmt/format.h>

#include <algorithm>

#include "kernels/base/error.h"
#include "kernels/model/arch/checks.h"

namespace tandem::arch {

void plan_batch(std::span<const batch_seq> batch, const model_config& c, const kv_pools& pools, batch_plan& plan) {
  check_batch(batch, c, pools, plan.tokens, plan.positions);
  const int32_t ps = pools.set().page_size();
  plan.slots.resize(pools.size());
  for (auto& s : plan.slots) s.clear();
  plan.starts.clear();
  plan.last.clear();
  int64_t t0 = 0;
  for (const batch_seq& b : batch) {
    if (!b.tokens.empty()) plan.starts.emplace_back(t0, &b);
    for (size_t k = 0; k < pools.size(); ++k) {
      const std::span<const int32_t> table = b.pages_of(k);
      for (size_t i = 0; i < b.tokens.size(); ++i) {
        const int32_t p = b.pos + int32_t(i);
        plan.slots[k].push_back(backend::kv_slot{table[size_t(p / ps)], p % ps});
      }
    }
    t0 += int64_t(b.tokens.size());
    if (b.want_logits) plan.last.push_back(int32_t(t0 - 1));
  }
}

void output_logits(backend::ops& o, const batch_plan& plan, const float* x, float* xn, const float* norm, float eps,
                   int64_t n_embd, backend::weight_id output, float softcap, int64_t n_vocab, float* out) {
  if (plan.last.empty()) return;
  const int64_t r = int64_t(plan.last.size());
  o.gather_rows(x, plan.last, xn, n_embd);
  o.rms_norm(xn, norm, xn, r, n_embd, eps);
  o.matmul(output, xn, r, out);
  if (softcap > 0.0f) o.softcap(out, size_t(r * n_vocab), softcap);
}

void gated_ffn(backend::ops& o, backend::weight_id gate, backend::weight_id up, backend::weight_id down, const float* x,
               int64_t rows, int64_t width, ffn_kind act, backend::buffer& gate_buf, backend::buffer& up_buf,
               float* y) {
  float* g = gate_buf.floats(size_t(rows * width));
  float* u = up_buf.floats(size_t(rows * width));
  const backend::weight_id ws[] = {gate, up};
  float* const ys[] = {g, u};
  o.matmul_many(ws, x, rows, ys);
  if (act == ffn_kind::gelu)
    o.geglu(g, u, g, size_t(rows * width));
  else
    o.swiglu(g, u, g, size_t(rows * width));
  o.matmul(down, g, rows, y);
}

layered_model::layered_model(const model_config& c, kv_dtype kv, std::unique_ptr<backend::ops> ops)
    : config_(c), kv_(kv), ops_(std::move(ops)) {
  for (auto* buf : {&x_, &xn_, &tmp_, &logits_}) *buf = ops_->make_buffer();
}

float* layered_model::run(std::span<const batch_seq> batch, kv_pools& pools, std::vector<float>* host) {
  const model_config& c = config_;
  const kv_pools_layout& have = pools.set();
  const int32_t ps = have.page_size();
  if (!(have == pools_layout(ps)) && !(have == kv_pools_layout::single(layout(ps))))
    throw tandem::error(fmt::format("KV pool set {} does not match the model's {}", have.describe(),
                                    pools_layout(ps).describe()));
  layer_pool_.assign(size_t(c.n_layer), {0, 0});
  for (size_t p = 0; p < have.pools.size(); ++p)
    for (size_t i = 0; i < have.pools[p].layers.size(); ++i)
      layer_pool_[size_t(have.pools[p].layers[i])] = {p, int32_t(i)};
  plan_batch(batch, c, pools, plan_);
  const size_t n_logits = plan_.last.size() * size_t(c.n_vocab);
  if (host != nullptr) host->assign(n_logits, 0.0f);
  const int64_t T = plan_.n_tokens();
  if (T == 0) return nullptr;
  backend::ops& o = *ops_;
  const int64_t e = c.n_embd;
  float* x = x_->floats(size_t(T * e));
  float* xn = xn_->floats(size_t(T * e));
  // Host memory serves as the output directly; a device's logits stay in logits_.
  float* out = n_logits == 0 ? nullptr
               : host != nullptr && o.domain() == backend::memory_domain::host ? host->data()
                                                                              : logits_->floats(n_logits);
  auto step = [&] {
    o.get_rows(token_embd_, plan_.tokens, x);
    if (embed_scale_ > 0.0f) o.scale(x, T * e, embed_scale_);
    build_rope(T);  // the same angles for every layer
    for (int32_t l = 0; l < c.n_layer; ++l) {
      o.rms_norm(x, attn_norm(l), xn, T, e, c.rms_eps);
      const auto [p, pl] = layer_pool_[size_t(l)];
      attention(l, layer_kv{pools[p], p, pl}, T);
      o.add(x, tmp_->floats(0), T * e);
      o.rms_norm(x, ffn_norm(l), xn, T, e, c.rms_eps);
      ffn(l, T);
      o.add(x, tmp_->floats(0), T * e);
    }
    if (out != nullptr)
      output_logits(o, plan_, x, xn, output_norm_.data(), c.rms_eps, e, output_, final_softcap_, c.n_vocab, out);
  };
  // A decode step (one new token per sequence) may run as one recorded graph (CUDA graphs);
  // when the recording fails nothing ran, and the step runs again as plain calls.
  const bool decode = T == int64_t(plan_.starts.size());
  bool recorded = false;
  if (decode) {
    int32_t longest = 0;
    for (int32_t p : plan_.positions) longest = std::max(longest, p + 1);
    if (o.begin_graph(backend::graph_key{.batch = int32_t(T), .ctx_bucket = backend::context_bucket(longest)})) {
      try {
        step();
        recorded = o.end_graph();
      } catch (const std::exception&) {
        o.abort_graph();
      }
      if (recorded) return out;
    }
  }
  step();
  return out;
}

void layered_model::forward(std::span<const batch_seq> batch, kv_pools& pools, std::vector<float>& logits) {
  const float* out = run(batch, pools, &logits);
  if (out != nullptr && out != logits.data()) ops_->download(out, logits.size(), logits.data());
}

void layered_model::forward_sample(std::span<const batch_seq> batch, kv_pools& pools, std::span<const sample_row> rows,
                                   std::vector<token_logprobs>& out) {
  check_sample_rows(batch, rows);
  const float* logits = run(batch, pools, nullptr);
  out.assign(rows.size(), token_logprobs{});
  if (logits != nullptr) ops_->sample(logits, config_.n_vocab, rows, out);
}

}  // namespace tandem::arch
