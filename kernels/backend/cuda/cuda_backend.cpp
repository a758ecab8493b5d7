#include "kernels/backend/cuda/cuda_backend.h"

#include <cublas_v2.h>
#include <cuda_runtime_api.h>
#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cmath>

#include "kernels/backend/cuda/cuda_graphs.h"
#include "kernels/backend/cuda/cuda_staging.h"
#include "kernels/backend/cuda/device_memory.h"
#include "kernels/backend/cuda/device_sampler.h"
#include "kernels/backend/cuda/grouped_plan.h"
#include "kernels/backend/cuda/kernels.h"
#include "kernels/backend/cuda/split_plan.h"
#include "kernels/base/error.h"
#include "kernels/cuda/cuda_ops.h"

namespace tandem::backend {

namespace {

using cuda_detail::check;
using cuda_detail::device_bytes;
namespace k = tandem::cuda_backend;

void check_blas(cublasStatus_t st, const char* what) {
  if (st != CUBLAS_STATUS_SUCCESS)
    throw tandem::error(fmt::format("cuda backend: {}: cuBLAS status {}", what, int(st)));
}

class cuda_buffer final : public buffer {
 public:
  explicit cuda_buffer(cudaStream_t s) : stream_(s) {}
  ~cuda_buffer() override {
    if (p_ != nullptr) cudaFree(p_);  // synchronous: the backend's stream may be gone already
  }
  float* floats(size_t n) override {
    if (n <= cap_ && p_ != nullptr) return p_;
    cuda_detail::refuse_in_capture(stream_, "growing an activation buffer");
    if (p_ != nullptr) check(cudaFreeAsync(p_, stream_), "freeing an activation buffer");
    p_ = nullptr;
    cap_ = 0;
    const size_t want = std::max<size_t>(n, 64);
    check(cudaMallocAsync(reinterpret_cast<void**>(&p_), want * sizeof(float), stream_),
          fmt::format("allocating {} floats of activations", want).c_str());
    cap_ = want;
    return p_;
  }

 private:
  cudaStream_t stream_;
  float* p_ = nullptr;
  size_t cap_ = 0;
};

/// A weight on the device.
struct device_weight {
  ggml_type type = ggml_type::f32;
  int64_t rows = 0, cols = 0;
  void* data = nullptr;
};

class cuda_ops final : public ops {
 public:
  explicit cuda_ops(const cuda_options& opt) : device_(opt.device) {
    const int32_t n = cuda_device_count();
    if (opt.device < 0 || opt.device >= n)
      throw tandem::error(fmt::format("cuda device {} is not there: this machine shows {} CUDA device{}; set [model] "
                                      "device to one of them or use backend = \"cpu\"",
                                      opt.device, n, n == 1 ? "" : "s"));
    check(cudaSetDevice(device_), "selecting the device");
    check(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "creating a stream");
    check_blas(cublasCreate(&blas_), "creating a cuBLAS handle");
    check_blas(cublasSetStream(blas_, stream_), "setting the cuBLAS stream");
    // Tensor-core GEMMs; f32 weights stay in full f32 (the pedantic compute type below).
    check_blas(cublasSetMathMode(blas_, CUBLAS_DEFAULT_MATH), "setting the cuBLAS math mode");
    // A workspace of its own from the start: cuBLAS then never allocates inside a graph capture.
    check(cudaMalloc(&blas_workspace_, k_blas_workspace_bytes), "allocating the cuBLAS workspace");
    check_blas(cublasSetWorkspace(blas_, blas_workspace_, k_blas_workspace_bytes), "setting the cuBLAS workspace");
    cudaDeviceProp prop{};
    check(cudaGetDeviceProperties(&prop, device_), "reading the device properties");
    name_ = prop.name;
    staging_ = std::make_unique<cuda_detail::host_staging>(stream_, k_staging_bytes);
    scratch_.reserve(8);
    for (int i = 0; i < 8; ++i) scratch_.push_back(std::make_unique<device_bytes>(stream_, staging_.get()));
    vectors_ = std::make_unique<cuda_detail::host_vectors>(stream_);
    sampler_ = std::make_unique<cuda_detail::device_sampler>(stream_, staging_.get());
    partials_ = std::make_unique<device_bytes>(stream_, staging_.get());
    for (auto& g : grouped_) g = std::make_unique<device_bytes>(stream_, staging_.get());
    if (opt.max_graphs < 0 || opt.max_graphs > 4096)
      throw tandem::error(fmt::format("cuda backend: max_graphs {} is out of range; use 0 (off) to 4096", opt.max_graphs));
    graphs_ = std::make_unique<cuda_detail::step_graphs>(stream_, staging_.get(), size_t(opt.max_graphs));
  }
  ~cuda_ops() override {
    cudaStreamSynchronize(stream_);
    graphs_.reset();
    scratch_.clear();
    sampler_.reset();
    partials_.reset();
    for (auto& g : grouped_) g.reset();
    vectors_.reset();
    staging_.reset();
    for (device_weight& w : weights_) cudaFree(w.data);
    cublasDestroy(blas_);
    cudaFree(blas_workspace_);
    cudaStreamDestroy(stream_);
  }

  memory_domain domain() const override { return memory_domain::device; }
  std::string describe() const override { return fmt::format("cuda (device {}: {})", device_, name_); }
  std::unique_ptr<buffer> make_buffer() override { return std::make_unique<cuda_buffer>(stream_); }
  void download(const float* src, size_t n, float* host) override {
    check(cudaMemcpyAsync(host, src, n * sizeof(float), cudaMemcpyDeviceToHost, stream_), "copying to the host");
    check(cudaStreamSynchronize(stream_), "running the queued kernels");
  }

  std::vector<weight_id> prepare(std::span<const tensor_view> ws) override {
    std::vector<weight_id> ids;
    for (const tensor_view& v : ws) {
      const bool dense = v.type == ggml_type::f32 || v.type == ggml_type::f16 || v.type == ggml_type::bf16;
      if (!dense && !k::quant_supported(uint32_t(v.type)))
        throw tandem::error(error_kind::unimplemented,
                            fmt::format("cuda backend: no matmul for {} weights; use f32, f16, bf16, q8_0, q4_0, "
                                        "q4_K, q5_K or q6_K weights, or backend = \"cpu\"",
                                        to_string(v.type)));
      if (v.cols() % block_elems(v.type) != 0)
        throw tandem::error(fmt::format("cuda backend: a {} weight row of {} elements is not whole blocks",
                                        to_string(v.type), v.cols()));
      device_weight w{.type = v.type, .rows = v.rows(), .cols = v.cols()};
      const size_t bytes = row_bytes(v.type, v.cols()) * size_t(v.rows());
      const cudaError_t e = cudaMalloc(&w.data, std::max<size_t>(bytes, 16));
      if (e != cudaSuccess)
        throw tandem::error(fmt::format("cuda backend: the device lacks {} bytes for a {}x{} {} weight ({}); use a "
                                        "smaller or more quantized model, or a device with more memory",
                                        bytes, w.rows, w.cols, to_string(v.type), cudaGetErrorString(e)));
      check(cudaMemcpy(w.data, v.data, bytes, cudaMemcpyHostToDevice), "uploading a weight");
      ids.push_back(weight_id{int32_t(weights_.size())});
      weights_.push_back(w);
    }
    return ids;
  }

  void matmul(weight_id id, const float* x, int64_t rows, float* y) override {
    const device_weight& w = get(id);
    if (rows <= 0) return;
    if (w.type != ggml_type::f32 && w.type != ggml_type::f16 && w.type != ggml_type::bf16) {
      // The activations as the CPU quantizes them, then its recipe: the CPU's bits.
      const int group = k::quant_group(uint32_t(w.type));
      const int64_t kk = w.cols;
      auto* base = static_cast<uint8_t*>(scratch_[0]->get(size_t(rows * kk) + size_t(rows * (kk / 32)) * 6 + 64));
      auto* qs = reinterpret_cast<int8_t*>(base);
      auto* d = reinterpret_cast<float*>(base + ((size_t(rows * kk) + 15) / 16) * 16);
      auto* sums = reinterpret_cast<int16_t*>(d + rows * (kk / 32));
      check(k::quantize_acts(x, rows, kk, group, qs, d, sums, stream_), "quantizing a matmul input");
      check(k::matmul_quant(uint32_t(w.type), w.data, qs, d, sums, rows, y, w.rows, kk, stream_), "quantized matmul");
      return;
    }
    // Fixed chunks of k_matmul_rows rows: the same GEMM shape (so the same cuBLAS kernel and
    // reduction order) for every batch, so a row's bits do not depend on its batch.
    const int64_t R = k_matmul_rows, n = w.rows, kk = w.cols;
    const bool wide = w.type == ggml_type::f32;
    void* xs = scratch_[0]->get(size_t(R * kk) * (wide ? 4 : 2 * 2));
    float* t = static_cast<float*>(scratch_[1]->get(size_t((wide ? 1 : 2) * R * n) * sizeof(float)));
    const float one = 1.0f, zero = 0.0f;
    for (int64_t r0 = 0; r0 < rows; r0 += R) {
      const int64_t used = std::min(R, rows - r0);
      if (wide) {
        check(cudaMemcpyAsync(xs, x + r0 * kk, size_t(used * kk) * sizeof(float), cudaMemcpyDeviceToDevice, stream_),
              "staging a matmul input");
        check_blas(cublasGemmEx(blas_, CUBLAS_OP_T, CUBLAS_OP_N, int(n), int(R), int(kk), &one, w.data, CUDA_R_32F,
                                int(kk), xs, CUDA_R_32F, int(kk), &zero, t, CUDA_R_32F, int(n),
                                CUBLAS_COMPUTE_32F_PEDANTIC, CUBLAS_GEMM_DEFAULT),
                   "f32 matmul");
        check(cudaMemcpyAsync(y + r0 * n, t, size_t(used * n) * sizeof(float), cudaMemcpyDeviceToDevice, stream_),
              "copying a matmul output");
      } else {
        // x as hi + lo 16-bit parts: one GEMM of 2R columns carries x to ~2^-22 (f16).
        const bool bf16 = w.type == ggml_type::bf16;
        const cudaDataType dt = bf16 ? CUDA_R_16BF : CUDA_R_16F;
        check(k::split_hi_lo(x + r0 * kk, used, kk, bf16, xs, R, stream_), "splitting a matmul input");
        check_blas(cublasGemmEx(blas_, CUBLAS_OP_T, CUBLAS_OP_N, int(n), int(2 * R), int(kk), &one, w.data, dt,
                                int(kk), xs, dt, int(kk), &zero, t, CUDA_R_32F, int(n), CUBLAS_COMPUTE_32F,
                                CUBLAS_GEMM_DEFAULT),
                   "16-bit matmul");
        check(k::join_hi_lo(t, R, used, n, y + r0 * n, stream_), "joining a matmul output");
      }
    }
  }
  void matmul_many(std::span<const weight_id> ws, const float* x, int64_t rows, std::span<float* const> ys) override {
    for (size_t i = 0; i < ws.size(); ++i) matmul(ws[i], x, rows, ys[i]);
  }
  void matmul_batch(std::span<const matmul_task> tasks) override {
    // Quantized weights (a MoE step's experts): one quantize launch per activation group and
    // one matmul launch per weight type over all of them, each output with matmul's bits.
    // f32/f16/bf16 weights keep one cuBLAS call per 64-row chunk: a batched or grouped GEMM may
    // pick another kernel by its batch count, and a row's bits would then depend on its batch.
    jobs_.clear();
    job_tasks_.clear();
    for (const matmul_task& t : tasks) {
      const device_weight& w = get(t.w);
      const bool dense = w.type == ggml_type::f32 || w.type == ggml_type::f16 || w.type == ggml_type::bf16;
      if (dense) {
        matmul(t.w, t.x, t.rows, t.y);
      } else if (t.rows > 0) {
        jobs_.push_back(k::quant_job{.x = t.x, .rows = t.rows, .k = w.cols, .n = w.rows, .type = uint32_t(w.type),
                                     .group = k::quant_group(uint32_t(w.type))});
        job_tasks_.push_back(&t);
      }
    }
    if (jobs_.empty()) return;
    if (jobs_.size() == 1) return matmul(job_tasks_[0]->w, job_tasks_[0]->x, job_tasks_[0]->rows, job_tasks_[0]->y);
    const k::grouped_quant_plan plan = k::plan_grouped_quant(jobs_);
    auto* base = static_cast<uint8_t*>(scratch_[0]->get(plan.bytes + 64));
    for (int g = 0; g < 2; ++g) {
      if (plan.inputs[g].empty()) continue;
      quant_inputs_.clear();
      for (const k::planned_input& i : plan.inputs[g])
        quant_inputs_.push_back(k::quant_input{.x = i.x,
                                               .qs = reinterpret_cast<int8_t*>(base + i.qs_at),
                                               .d = reinterpret_cast<float*>(base + i.d_at),
                                               .sums = reinterpret_cast<int16_t*>(base + i.sums_at),
                                               .k = i.k,
                                               .batch = i.rows,
                                               .first = i.first});
      const auto* in = static_cast<const k::quant_input*>(
          grouped_[0]->upload(quant_inputs_.data(), quant_inputs_.size() * sizeof(k::quant_input)));
      check(k::quantize_acts_grouped(in, int(quant_inputs_.size()), plan.blocks[g], g == 0 ? 32 : 256, stream_),
            "quantizing grouped matmul inputs");
    }
    for (size_t ti = 0; ti < plan.types.size(); ++ti) {
      const k::planned_type& pt = plan.types[ti];
      quant_tasks_.clear();
      for (const k::planned_job& j : pt.jobs) {
        const k::quant_job& q = jobs_[j.job];
        const k::planned_input& i = plan.inputs[q.group == 256 ? 1 : 0][j.input];
        quant_tasks_.push_back(k::quant_task{.w = get(job_tasks_[j.job]->w).data,
                                             .qs = reinterpret_cast<const int8_t*>(base + i.qs_at),
                                             .d = reinterpret_cast<const float*>(base + i.d_at),
                                             .sums = reinterpret_cast<const int16_t*>(base + i.sums_at),
                                             .y = job_tasks_[j.job]->y,
                                             .n = q.n,
                                             .k = q.k,
                                             .first = j.first});
      }
      // The stream orders each table's upload after the launches that read the previous one.
      const auto* tt = static_cast<const k::quant_task*>(
          grouped_[1]->upload(quant_tasks_.data(), quant_tasks_.size() * sizeof(k::quant_task)));
      check(k::matmul_quant_grouped(pt.type, tt, int(quant_tasks_.size()), pt.items, stream_), "grouped quantized matmul");
    }
  }
  void get_rows(const tensor_view& table, std::span<const int32_t> ids, float* out) override {
    // The table stays in host memory (it is not a matmul weight unless tied, and then the
    // prepared copy has another layout); the few rows a step needs cross once.
    rows_host_.resize(ids.size() * size_t(table.cols()));
    cpu::get_rows(table, ids, rows_host_.data());
    staging_->copy(out, rows_host_.data(), rows_host_.size() * sizeof(float));
  }

  void rms_norm(const float* x, const float* w, float* y, int64_t rows, int64_t n, float eps) override {
    if (rows <= 0) return;
    tandem::cuda::rms_norm(x, vectors_->get(w, size_t(n)), y, int(rows), int(n), eps, stream_);
    check(cudaGetLastError(), "rms_norm");
  }
  void rope(float* x, const rope_table& angles, int n_heads) override {
    const auto* cs = static_cast<const float*>(
        scratch_[2]->upload(angles.cos_sin.data(), angles.cos_sin.size() * sizeof(float)));
    check(k::rope(x, cs, angles.rows, n_heads, angles.head_dim, angles.neox, stream_), "rope");
  }
  void swiglu(const float* gate, const float* up, float* out, size_t n) override {
    if (n == 0) return;
    tandem::cuda::swiglu(gate, up, out, n, stream_);
    check(cudaGetLastError(), "swiglu");
  }
  void geglu(const float* gate, const float* up, float* out, size_t n) override {
    check(k::geglu(gate, up, out, n, stream_), "geglu");
  }
  void softcap(float* x, size_t n, float cap) override { check(k::softcap(x, n, cap, stream_), "softcap"); }
  void add(float* y, const float* x, int64_t n) override { check(k::add(y, x, n, stream_), "add"); }
  void scale(float* x, int64_t n, float s) override { check(k::scale(x, n, s, stream_), "scale"); }
  void add_bias(float* y, const float* b, int64_t rows, int64_t n) override {
    check(k::add_bias(y, vectors_->get(b, size_t(n)), rows, n, stream_), "add_bias");
  }
  void copy_rows(const float* src, int64_t src_stride, float* dst, int64_t dst_stride, int64_t rows,
                 int64_t width) override {
    if (rows <= 0 || width <= 0) return;
    check(cudaMemcpy2DAsync(dst, size_t(dst_stride) * sizeof(float), src, size_t(src_stride) * sizeof(float),
                            size_t(width) * sizeof(float), size_t(rows), cudaMemcpyDeviceToDevice, stream_),
          "copy_rows");
  }
  void gather_rows(const float* src, std::span<const int32_t> rows, float* dst, int64_t width) override {
    if (rows.empty()) return;
    const auto* r = static_cast<const int32_t*>(scratch_[3]->upload(rows.data(), rows.size_bytes()));
    check(k::gather_rows(src, r, int64_t(rows.size()), dst, width, stream_), "gather_rows");
  }
  void scatter_rows(const float* src, std::span<const int32_t> rows, float* dst, int64_t width) override {
    if (rows.empty()) return;
    const auto* r = static_cast<const int32_t*>(scratch_[3]->upload(rows.data(), rows.size_bytes()));
    check(k::scatter_rows(src, r, int64_t(rows.size()), dst, width, stream_), "scatter_rows");
  }

  void kv_write(kv_pool& pool, int32_t layer, int32_t c, std::span<const kv_slot> slots, const float* rows,
                int64_t width) override {
    if (slots.empty()) return;
    const int32_t elem = pool.layout().effective_components()[size_t(c)].elem_bytes;
    static_assert(sizeof(kv_slot) == 2 * sizeof(int32_t));
    const auto* s = static_cast<const int32_t*>(scratch_[4]->upload(slots.data(), slots.size_bytes()));
    check(k::kv_write(pool.data(), page_stride(pool), component_offset(pool, layer, c), s, int64_t(slots.size()), rows,
                      width, elem, stream_),
          "kv_write");
  }
  void attention(std::span<const attention_seq> seqs, int n_heads, const kv_pool& pool, int32_t layer,
                 const attention_params& params) override {
    const kv_layout& L = pool.layout();
    if (!L.is_standard())
      throw tandem::error("cuda backend: attention() needs the standard K/V layout; an MLA pool goes to mla_attention");
    rows_.clear();
    tables_.clear();
    for (const attention_seq& s : seqs) {
      const int32_t table = int32_t(tables_.size());
      tables_.insert(tables_.end(), s.pages.begin(), s.pages.end());
      const int64_t stride = int64_t(n_heads) * L.head_dim;
      for (int64_t t = 0; t < s.n_tokens; ++t) {
        const int32_t pos = s.pos0 + int32_t(t);
        rows_.push_back(k::attn_row{.q = s.q + t * stride,
                                    .out = s.out + t * stride,
                                    .pos = pos,
                                    .lo = params.window > 0 ? std::max(0, pos + 1 - params.window) : 0,
                                    .table = table});
      }
    }
    k::attn_shape sh = shape(pool, layer);
    sh.n_kv = L.n_kv_heads;
    sh.dk = sh.dv = sh.q_split = L.head_dim;
    sh.n_heads = n_heads;
    sh.elem_bytes = int(L.elem_bytes());
    sh.v_offset = component_offset(pool, layer, 1);
    sh.scale = params.scale != 0.0f ? params.scale : 1.0f / std::sqrt(float(L.head_dim));
    sh.softcap = params.softcap;
    run_attention(sh, int64_t(seqs.size()));
  }
  void mla_attention(std::span<const mla_seq> calls, int32_t kv_lora_rank, int32_t rope_dims, float s,
                     const kv_pool& pool, int32_t layer) override {
    const std::vector<kv_component> comps = pool.layout().effective_components();
    if (comps.size() != 1 || comps[0].n_heads != 1 || comps[0].head_dim != kv_lora_rank + rope_dims ||
        comps[0].elem_bytes != 4)
      throw tandem::error(fmt::format("cuda backend: mla_attention needs one f32 latent component of {} + {} "
                                      "elements; the pool is {}",
                                      kv_lora_rank, rope_dims, pool.layout().describe()));
    rows_.clear();
    tables_.clear();
    for (const mla_seq& c : calls) {
      const int32_t table = int32_t(tables_.size());
      tables_.insert(tables_.end(), c.pages.begin(), c.pages.end());
      for (int64_t t = 0; t < c.n_tokens; ++t)
        rows_.push_back(k::attn_row{.q = c.q_lat + t * kv_lora_rank,
                                    .q_pe = c.q_pe + t * rope_dims,
                                    .out = c.out + t * kv_lora_rank,
                                    .pos = c.pos0 + int32_t(t),
                                    .lo = 0,
                                    .table = table});
    }
    k::attn_shape sh = shape(pool, layer);
    sh.n_kv = 1;
    sh.dk = kv_lora_rank + rope_dims;
    sh.dv = sh.q_split = kv_lora_rank;
    sh.n_heads = 1;
    sh.v_offset = sh.k_offset;
    sh.scale = s;
    run_attention(sh, int64_t(calls.size()));
  }

  void moe_route(const float* logits, int64_t rows, const moe_routing& r, int32_t* experts, float* weights) override {
    // Routing is a few floats per row and its result is wanted on the host: the logits cross
    // and the CPU's routing decides (the same choices as the CPU backend for the same logits).
    route_host_.resize(size_t(rows) * size_t(std::max(r.n_expert, 0)));
    download(logits, route_host_.size(), route_host_.data());
    cpu::moe_route(route_host_.data(), rows, r, experts, weights);
  }
  void moe_combine(const float* expert_out, const float* weights, int64_t rows, int64_t k_used, int64_t n,
                   const float* shared, float* y) override {
    if (rows <= 0) return;
    const float* w = weights;
    if (!cuda_detail::device_readable(weights))
      w = static_cast<const float*>(scratch_[5]->upload(weights, size_t(rows * k_used) * sizeof(float)));
    check(k::moe_combine(expert_out, w, rows, k_used, n, shared, y, stream_), "moe_combine");
  }
  void sample(const float* logits, int64_t n_vocab, std::span<const sample_row> rows,
              std::span<token_logprobs> out) override {
    sampler_->run(logits, n_vocab, rows, out);
  }
  bool begin_graph(const graph_key& k) override { return graphs_->begin(k); }
  bool end_graph() override { return graphs_->end(); }
  void abort_graph() override { graphs_->abort(); }
  graph_stats graph_counters() const override { return graphs_->stats(); }

 private:
  /// Pinned bytes host-to-device copies go through (a prefill's rope angles and descriptors).
  static constexpr size_t k_staging_bytes = size_t(16) << 20;
  /// GEMM rows per cuBLAS call (the fixed shape that keeps rows independent of the batch).
  static constexpr int64_t k_matmul_rows = 64;
  static constexpr size_t k_blas_workspace_bytes = size_t(32) << 20;
  /// Split-context attention partials per launch (64 MiB).
  static constexpr int64_t k_partial_floats = int64_t(16) << 20;

  const device_weight& get(weight_id w) const {
    if (w.index < 0 || size_t(w.index) >= weights_.size())
      throw tandem::error(fmt::format("cuda backend: weight id {} was not prepared here", w.index));
    return weights_[size_t(w.index)];
  }
  // Offsets within the pool: pointer arithmetic on device addresses, never dereferenced here.
  static size_t page_stride(const kv_pool& pool) {
    auto& p = const_cast<kv_pool&>(pool);
    return size_t(p.page_data(1) - p.page_data(0));
  }
  static size_t component_offset(const kv_pool& pool, int32_t layer, int32_t c) {
    auto& p = const_cast<kv_pool&>(pool);
    return size_t(p.component(0, layer, c) - p.data());
  }
  k::attn_shape shape(const kv_pool& pool, int32_t layer) const {
    k::attn_shape sh;
    sh.pool = const_cast<kv_pool&>(pool).data();
    sh.page_stride = page_stride(pool);
    sh.k_offset = component_offset(pool, layer, 0);
    sh.page_size = pool.layout().page_size;
    return sh;
  }
  void run_attention(const k::attn_shape& sh, int64_t n_tables) {
    if (rows_.empty()) return;
    // Split-context rows (more than k_split_positions positions) leave partials; pieces of the
    // call keep them under k_partial_floats.
    const int64_t per_partial = int64_t(sh.n_heads) * k::partial_floats(sh.dv);
    const std::vector<k::split_piece> pieces =
        k::plan_splits(std::span<k::attn_row>(rows_), std::max<int64_t>(1, k_partial_floats / per_partial));
    // Page tables (padded) and partials sized for the context bucket of the longest row: a
    // decode step's graph, captured after its key's first (eager) step, then never grows them
    // and copies tables of one size (its copy node keeps its shape).
    int32_t longest = 0;
    for (const k::attn_row& r : rows_) longest = std::max(longest, r.pos + 1);
    const int32_t bucket = context_bucket(longest);
    tables_.resize(std::max(tables_.size(), size_t(n_tables) * size_t(bucket / sh.page_size + 1)), 0);
    const int64_t partial_floor =
        std::min(k_partial_floats, int64_t(rows_.size()) * k::split_count(0, bucket - 1) * per_partial);
    const auto* rows = static_cast<const k::attn_row*>(
        scratch_[6]->upload(rows_.data(), rows_.size() * sizeof(k::attn_row)));
    const auto* tables = static_cast<const int32_t*>(
        scratch_[7]->upload(tables_.data(), std::max<size_t>(tables_.size(), 1) * sizeof(int32_t)));
    for (const k::split_piece& p : pieces) {
      float* partials = nullptr;
      if (p.max_splits > 1)
        partials = static_cast<float*>(
            partials_->get(size_t(std::max<int64_t>(p.n_partials * per_partial, partial_floor)) * sizeof(float)));
      check(k::paged_attention(rows + p.first_row, p.n_rows, tables, sh, p.max_splits, partials, stream_),
            "paged attention");
    }
  }

  int32_t device_;
  std::string name_;
  cudaStream_t stream_ = nullptr;
  cublasHandle_t blas_ = nullptr;
  std::vector<device_weight> weights_;
  std::unique_ptr<cuda_detail::host_staging> staging_;
  /// Scratch areas by use: 0 matmul input, 1 matmul output, 2 rope angles, 3 row indices,
  /// 4 KV slots, 5 expert weights, 6 attention rows, 7 page tables.
  std::vector<std::unique_ptr<device_bytes>> scratch_;
  std::unique_ptr<cuda_detail::host_vectors> vectors_;
  std::unique_ptr<cuda_detail::device_sampler> sampler_;
  std::unique_ptr<device_bytes> partials_;  ///< split-context attention partials
  std::unique_ptr<cuda_detail::step_graphs> graphs_;
  void* blas_workspace_ = nullptr;
  /// Grouped matmul tables: the quantize inputs, the matmul tasks.
  std::array<std::unique_ptr<device_bytes>, 2> grouped_;
  std::vector<k::quant_job> jobs_;
  std::vector<const matmul_task*> job_tasks_;
  std::vector<k::quant_input> quant_inputs_;
  std::vector<k::quant_task> quant_tasks_;
  std::vector<float> rows_host_, route_host_;
  std::vector<k::attn_row> rows_;
  std::vector<int32_t> tables_;
};

}  // namespace

int32_t cuda_device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return n;
}

std::unique_ptr<ops> make_cuda_backend(const cuda_options& opt) { return std::make_unique<cuda_ops>(opt); }

device_kv_pool::device_kv_pool(const kv_layout& layout, int32_t n_pages, int32_t device) {
  check(cudaSetDevice(device), "selecting the device for the KV pool");
  const size_t bytes = kv_pool::bytes_for(layout, n_pages);
  const cudaError_t e = cudaMalloc(&memory_, std::max<size_t>(bytes, 16));
  if (e != cudaSuccess)
    throw tandem::error(fmt::format("cuda backend: the device lacks {} bytes for a KV pool of {} pages of {} ({}); "
                                    "lower the page count",
                                    bytes, n_pages, layout.describe(), cudaGetErrorString(e)));
  // cudaMemset may still run when it returns, and the backend's stream does not wait for the
  // legacy stream: finish it here, or it could overwrite the first KV writes.
  check(cudaMemset(memory_, 0, bytes), "zeroing the KV pool");
  check(cudaDeviceSynchronize(), "zeroing the KV pool");
  pool_ = std::make_unique<kv_pool>(layout, n_pages, memory_, bytes);
}

device_kv_pool::~device_kv_pool() {
  pool_.reset();
  if (memory_ != nullptr) cudaFree(memory_);
}

device make_cuda_device(const cuda_options& opt) {
  const int32_t n = cuda_device_count();
  if (n == 0)
    throw tandem::error(error_kind::failed,
                        "cuda backend: this machine shows no CUDA device (no GPU, or no driver: libcuda.so.1 not "
                        "found); run on a machine with an NVIDIA GPU or use backend = \"cpu\"");
  if (opt.device < 0 || opt.device >= n)
    throw tandem::error(error_kind::failed,
                        fmt::format("cuda backend: no CUDA device {} here ({} found); set [model] device (--device) to "
                                    "one of 0..{} or use backend = \"cpu\"",
                                    opt.device, n, n - 1));
  device d;
  d.name = fmt::format("cuda:{}", opt.device);
  d.make_ops = [opt] { return make_cuda_backend(opt); };
  const int32_t dev = opt.device;
  d.make_pools = [dev](const kv_pools_layout& set, std::span<const int32_t> n_pages) -> std::shared_ptr<kv_pools> {
    auto owned = std::make_shared<std::vector<std::unique_ptr<device_kv_pool>>>();
    std::vector<kv_pool*> pools;
    for (size_t p = 0; p < set.pools.size(); ++p) {
      owned->push_back(std::make_unique<device_kv_pool>(set.pools[p].page, n_pages[p], dev));
      pools.push_back(&owned->back()->pool());
    }
    // The set borrows the device pools; the deleter frees them after it.
    return std::shared_ptr<kv_pools>(new kv_pools(set, std::move(pools)), [owned](kv_pools* k) { delete k; });
  };
  d.copy = [dev](void* dst, const void* src, size_t bytes) {
    check(cudaSetDevice(dev), "selecting the device for a KV page copy");
    // The compute stream does not wait for the legacy stream nor it for that one: finish the
    // queued KV writes first.
    check(cudaDeviceSynchronize(), "waiting for the queued kernels before a KV page copy");
    check(cudaMemcpy(dst, src, bytes, cudaMemcpyDefault), "copying a KV page between device and host");
  };
  // The host tier and UCX transfers: through pinned buffers on a copy stream of its own.
  d.staging = make_cuda_staging(dev);
  return d;
}

}  // namespace tandem::backend
