#include "tests/gpu/cpu_reference.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "kernels/cpu/ops.h"
#include "kernels/model/kv_pool.h"
#include "kernels/tensor.h"

namespace tandem::gpu_test {

void rms_norm(const float* x, const float* w, float* y, int rows, int n, float eps) {
  cpu::rms_norm(x, w, y, rows, n, eps);
}

void rope(float* x, const int32_t* pos, int rows, int n_heads, int head_dim, float freq_base) {
  cpu::rope(x, pos, rows, n_heads, head_dim, freq_base);
}

void swiglu(const float* gate, const float* up, float* out, size_t n) { cpu::swiglu(gate, up, out, n); }

std::vector<uint16_t> to_f16(const std::vector<float>& w) {
  std::vector<uint16_t> out(w.size());
  for (size_t i = 0; i < w.size(); ++i) out[i] = cpu::fp32_to_fp16(w[i]);
  return out;
}

std::vector<uint8_t> to_q8_0(const std::vector<float>& w, int n, int k) {
  const size_t nb = size_t(n) * size_t(k) / q8_0_block;
  std::vector<uint8_t> out(nb * sizeof(block_q8_0));
  for (size_t b = 0; b < nb; ++b) {
    const float* v = w.data() + b * q8_0_block;
    float amax = 0.0f;
    for (int j = 0; j < q8_0_block; ++j) amax = std::max(amax, std::fabs(v[j]));
    const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
    block_q8_0 blk;
    blk.d = cpu::fp32_to_fp16(d);
    for (int j = 0; j < q8_0_block; ++j) blk.qs[j] = int8_t(std::roundf(v[j] * id));
    std::memcpy(out.data() + b * sizeof blk, &blk, sizeof blk);
  }
  return out;
}

void matmul(bool q8, const void* w, size_t nbytes, int n, int k, const float* x, int batch, float* y) {
  tensor_view v;
  v.type = q8 ? ggml_type::q8_0 : ggml_type::f16;
  v.ne[0] = k;
  v.ne[1] = n;
  v.n_dims = 2;
  v.data = w;
  v.nbytes = nbytes;
  std::vector<float> scratch;
  cpu::matmul(v, x, batch, y, scratch);
}

namespace {
void attention_decode_bytes(const void* pool, size_t pool_bytes, kv_dtype t, int n_pages, int n_layers, int n_kv,
                            int head_dim, int page_size, int layer, const float* q, int n_heads,
                            const std::vector<std::vector<int32_t>>& tables, const std::vector<int32_t>& lens,
                            float* out) {
  const kv_layout L{.n_layers = n_layers, .n_kv_heads = n_kv, .head_dim = head_dim, .page_size = page_size, .dtype = t};
  kv_pool kv(L, n_pages);
  std::memcpy(kv.page_data(0), pool, std::min(kv.bytes(), pool_bytes));
  std::vector<float> scratch;
  const size_t row = size_t(n_heads) * size_t(head_dim);
  for (size_t s = 0; s < lens.size(); ++s)
    cpu::paged_attention(q + s * row, 1, lens[s] - 1, n_heads, kv, layer, tables[s], out + s * row, scratch);
}
}  // namespace

void attention_decode_f16(const std::vector<uint16_t>& pool, int n_pages, int n_layers, int n_kv, int head_dim,
                          int page_size, int layer, const float* q, int n_heads,
                          const std::vector<std::vector<int32_t>>& tables, const std::vector<int32_t>& lens,
                          float* out) {
  attention_decode_bytes(pool.data(), pool.size() * 2, kv_dtype::f16, n_pages, n_layers, n_kv, head_dim, page_size,
                         layer, q, n_heads, tables, lens, out);
}

void attention_decode(const std::vector<float>& pool, int n_pages, int n_layers, int n_kv, int head_dim,
                      int page_size, int layer, const float* q, int n_heads,
                      const std::vector<std::vector<int32_t>>& tables, const std::vector<int32_t>& lens, float* out) {
  attention_decode_bytes(pool.data(), pool.size() * 4, kv_dtype::f32, n_pages, n_layers, n_kv, head_dim, page_size,
                         layer, q, n_heads, tables, lens, out);
}

}  // namespace tandem::gpu_test
