#include "kernels/backend/cpu_backend.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>

#include "kernels/base/error.h"
#include "kernels/cpu/aligned_vector.h"
#include "kernels/cpu/mla_attention.h"
#include "kernels/cpu/quant_packed.h"
#include "kernels/cpu/weight_copy.h"
#include "kernels/cpu/thread_pool.h"

namespace tandem::backend {

namespace {

class cpu_buffer final : public buffer {
 public:
  float* floats(size_t n) override {
    if (v_.size() < n) v_.resize(n);
    return v_.data();
  }

 private:
  // Activations start on a cache line: the matmuls read their rows 64 bytes at a time.
  cpu::aligned_vector<float> v_;
};

class cpu_ops final : public ops {
 public:
  explicit cpu_ops(const cpu_options& opt) : isa_(cpu::resolve_isa(opt.isa)), pool_(check_threads(opt.threads)) {}

  memory_domain domain() const override { return memory_domain::host; }
  std::string describe() const override {
    return fmt::format("cpu ({}, {} thread{})", cpu::to_string(isa_), pool_.size(), pool_.size() == 1 ? "" : "s");
  }
  std::unique_ptr<buffer> make_buffer() override { return std::make_unique<cpu_buffer>(); }
  void download(const float* src, size_t n, float* host) override {
    if (src != host) std::memcpy(host, src, n * sizeof(float));
  }

  std::vector<weight_id> prepare(std::span<const tensor_view> ws) override {
    std::vector<cpu::packed_weight> p = cpu::pack_weights(
        ws, isa_, &pool_, {.pack_low_bit = cpu::packing_enabled(), .copy_rest = cpu::weight_copy_enabled()});
    std::vector<weight_id> ids;
    for (auto& w : p) {
      ids.push_back(weight_id{int32_t(weights_.size())});
      weights_.push_back(std::move(w));
    }
    return ids;
  }

  void matmul(weight_id w, const float* x, int64_t rows, float* y) override {
    cpu::matmul(get(w), x, rows, y, scratch_, &pool_);
  }
  void matmul_many(std::span<const weight_id> ws, const float* x, int64_t rows, std::span<float* const> ys) override {
    many_.clear();
    for (weight_id w : ws) many_.push_back(&get(w));
    cpu::matmul_many(many_, x, rows, ys, scratch_, &pool_);
  }
  void matmul_batch(std::span<const matmul_task> tasks) override {
    int64_t work = 0, largest = 0;
    bool amx = false;
    for (const matmul_task& t : tasks) {
      const int64_t w = get(t.w).view.rows() * get(t.w).view.cols() * t.rows;
      work += w;
      largest = std::max(largest, w);
      amx = amx || get(t.w).amx != nullptr;
    }
    // On the vector paths: one fork-join over the row groups of every task, taken as threads
    // free up. Whole tasks side by side left a thread idle whenever the tasks did not share
    // out evenly (a decode step's 2 routed + 1 shared expert down-projections: 2 on one
    // thread, 1 on the other).
    if (!amx) {
      jobs_.clear();
      for (const matmul_task& t : tasks) jobs_.push_back(cpu::matmul_job{&get(t.w), t.x, t.rows, t.y});
      cpu::matmul_jobs(jobs_, scratch_, &pool_);
      return;
    }
    // Amx tiles: small tasks side by side, each whole on one thread (a matmul's bits do not
    // depend on its thread count); a task big enough to split runs alone on every thread.
    if (largest >= batch_split_work) {
      for (const matmul_task& t : tasks) cpu::matmul(get(t.w), t.x, t.rows, t.y, scratch_, &pool_);
      return;
    }
    cpu::parallel_for_if(&pool_, int64_t(tasks.size()), work, [&](int64_t i0, int64_t i1) {
      thread_local std::vector<float> scratch;
      for (int64_t i = i0; i < i1; ++i) {
        const matmul_task& t = tasks[size_t(i)];
        cpu::matmul(get(t.w), t.x, t.rows, t.y, scratch);
      }
    });
  }
  void get_rows(const tensor_view& table, std::span<const int32_t> ids, float* out) override {
    cpu::get_rows(table, ids, out);
  }

  void rms_norm(const float* x, const float* w, float* y, int64_t rows, int64_t n, float eps) override {
    cpu::rms_norm(x, w, y, rows, n, eps, &pool_);
  }
  void rope(float* x, const rope_table& angles, int n_heads) override { cpu::rope(x, angles, n_heads, &pool_); }
  void swiglu(const float* gate, const float* up, float* out, size_t n) override {
    cpu::swiglu(gate, up, out, n, &pool_, isa_);
  }
  void geglu(const float* gate, const float* up, float* out, size_t n) override { cpu::geglu(gate, up, out, n, &pool_); }
  void softcap(float* x, size_t n, float cap) override { cpu::softcap(x, n, cap); }
  void add(float* y, const float* x, int64_t n) override { cpu::add_inplace(y, x, n, &pool_); }
  void scale(float* x, int64_t n, float s) override {
    for (int64_t i = 0; i < n; ++i) x[i] *= s;
  }
  void add_bias(float* y, const float* b, int64_t rows, int64_t n) override {
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t i = 0; i < n; ++i) y[r * n + i] += b[i];
  }
  void copy_rows(const float* src, int64_t src_stride, float* dst, int64_t dst_stride, int64_t rows,
                 int64_t width) override {
    for (int64_t r = 0; r < rows; ++r)
      std::memcpy(dst + r * dst_stride, src + r * src_stride, size_t(width) * sizeof(float));
  }
  void gather_rows(const float* src, std::span<const int32_t> rows, float* dst, int64_t width) override {
    for (size_t j = 0; j < rows.size(); ++j)
      std::memcpy(dst + int64_t(j) * width, src + int64_t(rows[j]) * width, size_t(width) * sizeof(float));
  }
  void scatter_rows(const float* src, std::span<const int32_t> rows, float* dst, int64_t width) override {
    for (size_t j = 0; j < rows.size(); ++j)
      std::memcpy(dst + int64_t(rows[j]) * width, src + int64_t(j) * width, size_t(width) * sizeof(float));
  }

  void kv_write(kv_pool& pool, int32_t layer, int32_t c, std::span<const kv_slot> slots, const float* rows,
                int64_t width) override {
    const int32_t elem = pool.layout().effective_components()[size_t(c)].elem_bytes;
    // A prefill chunk's rows (3 MB per layer for 512 tokens of 768 floats) on every thread.
    cpu::parallel_for_if(&pool_, int64_t(slots.size()), int64_t(slots.size()) * width, [&](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; ++i) {
        uint8_t* base = pool.component(slots[size_t(i)].page, layer, c) + size_t(slots[size_t(i)].slot) * size_t(width) * size_t(elem);
        if (elem == 2)
          cpu::fp32_to_fp16_row(rows + i * width, reinterpret_cast<uint16_t*>(base), width);
        else
          std::memcpy(base, rows + i * width, size_t(width) * sizeof(float));
      }
    });
  }
  void attention(std::span<const attention_seq> seqs, int n_heads, const kv_pool& pool, int32_t layer,
                 const attention_params& params) override {
    cpu::paged_attention_batch(seqs, n_heads, pool, layer, &pool_, isa_, params);
  }
  void mla_attention(std::span<const mla_seq> calls, int32_t kv_lora_rank, int32_t rope_dims, float s,
                     const kv_pool& pool, int32_t layer) override {
    int64_t work = 0;
    for (const auto& c : calls) work += c.n_tokens * kv_lora_rank * 4;
    cpu::parallel_for_if(&pool_, int64_t(calls.size()), work, [&](int64_t u0, int64_t u1) {
      for (int64_t u = u0; u < u1; ++u) {
        const mla_seq& c = calls[size_t(u)];
        cpu::mla_attention(c.q_lat, c.q_pe, c.n_tokens, c.pos0, 1, kv_lora_rank, rope_dims, s, pool, layer, c.pages,
                           c.out, isa_);
      }
    });
  }

  void moe_route(const float* logits, int64_t rows, const moe_routing& r, int32_t* experts, float* weights) override {
    cpu::moe_route(logits, rows, r, experts, weights);
  }
  void moe_combine(const float* expert_out, const float* weights, int64_t rows, int64_t k, int64_t n,
                   const float* shared, float* y) override {
    for (int64_t t = 0; t < rows; ++t)
      for (int64_t i = 0; i < n; ++i) {
        float acc = 0.0f;
        for (int64_t j = 0; j < k; ++j) {
          const float v = expert_out[(t * k + j) * n + i] * weights[t * k + j];
          acc = j == 0 ? v : acc + v;
        }
        y[t * n + i] = shared != nullptr ? acc + shared[t * n + i] : acc;
      }
  }
  void sample(const float* logits, int64_t n_vocab, std::span<const sample_row> rows,
              std::span<token_logprobs> out) override {
    sample_on_host(logits, n_vocab, rows, out);
  }

 private:
  static int32_t check_threads(int32_t threads) {
    if (threads < 1 || threads > 1024)
      throw tandem::error(fmt::format("cpu threads {} is out of range; use 1 to 1024", threads));
    return threads;
  }
  const cpu::packed_weight& get(weight_id w) const {
    if (w.index < 0 || size_t(w.index) >= weights_.size())
      throw tandem::error(fmt::format("cpu backend: weight id {} was not prepared here", w.index));
    return weights_[size_t(w.index)];
  }

  /// A task of this much work (rows x columns x batch) splits across the threads by itself
  /// (a prefill's expert, 4 MFLOP and up); smaller ones run side by side.
  static constexpr int64_t batch_split_work = int64_t(1) << 21;

  cpu_isa isa_;
  cpu::thread_pool pool_;
  std::vector<cpu::packed_weight> weights_;
  std::vector<const cpu::packed_weight*> many_;
  std::vector<cpu::matmul_job> jobs_;
  std::vector<float> scratch_;
};

}  // namespace

std::unique_ptr<ops> make_cpu_backend(const cpu_options& opt) { return std::make_unique<cpu_ops>(opt); }

}  // namespace tandem::backend
