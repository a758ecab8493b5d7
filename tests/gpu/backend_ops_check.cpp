// Every op of the CUDA backend against the CPU backend on random inputs. Tolerances are
// relative to max(1, max |cpu|) and say where the two differ in rounding:
// - exact (same bits): get_rows (the CPU's decode, then a copy), copy/gather/scatter_rows,
//   kv_write (f16 rounds to nearest even on both), moe_route (the CPU's routing of the same
//   logits);
// - 1e-5: elementwise and row-wise ops (expf/tanhf/rsqrtf against the CPU's polynomials);
// - 1e-4: attention (another summation order and exp);
// - 2e-4: f32 / f16 / bf16 matmuls (cuBLAS on hi + lo 16-bit parts of x for 16-bit weights);
// - quantized matmuls (q4_0, q8_0, q4_K, q5_K, q6_K): the same bits (the GPU follows
//   kernels/cpu/quant_matmul.h's recipe step for step), checked as 1e-6 and as bits.
// Batch invariance is checked bit for bit: a row alone and inside a larger batch.
#include <cuda_runtime_api.h>

#include <cmath>
#include <cstring>
#include <fmt/format.h>

#include "kernels/backend/cpu_backend.h"
#include "kernels/backend/cuda/cuda_backend.h"
#include "kernels/cpu/mla_attention.h"
#include "kernels/cpu/quant_ref.h"
#include "tests/gpu/backend_check.h"

namespace tandem::gpu_test {

namespace {

using backend::ops;

struct pair {
  std::unique_ptr<ops> cpu = backend::make_cpu_backend(cpu_options{.threads = 4});
  std::unique_ptr<ops> gpu = backend::make_cuda_backend(backend::cuda_options{});
};

/// Weight bytes of type t for a [rows][cols] f32 matrix.
std::vector<uint8_t> encode(ggml_type t, const std::vector<float>& w, int64_t rows, int64_t cols) {
  if (t == ggml_type::f32) {
    std::vector<uint8_t> b(w.size() * 4);
    std::memcpy(b.data(), w.data(), b.size());
    return b;
  }
  if (t == ggml_type::f16 || t == ggml_type::bf16) {
    std::vector<uint8_t> b(w.size() * 2);
    auto* h = reinterpret_cast<uint16_t*>(b.data());
    for (size_t i = 0; i < w.size(); ++i) h[i] = t == ggml_type::f16 ? cpu::fp32_to_fp16(w[i]) : cpu::fp32_to_bf16(w[i]);
    return b;
  }
  return cpu::quantize_rows(t, w.data(), rows, cols);
}

tensor_view view(ggml_type t, const std::vector<uint8_t>& b, int64_t rows, int64_t cols) {
  tensor_view v;
  v.type = t;
  v.ne[0] = cols;
  v.ne[1] = rows;
  v.n_dims = 2;
  v.data = b.data();
  v.nbytes = b.size();
  return v;
}

/// matmul_batch as a MoE step uses it: 8 "experts" of mixed quantized types (grouped: one
/// quantize launch per activation group, one matmul launch per type) and an f16 one, two
/// pairs sharing an input (gate and up), rows 1 to 9: every output has matmul's bits, and
/// the CPU's bits for the quantized ones.
void check_grouped(pair& p, const float* dx, int64_t k) {
  const ggml_type types[] = {ggml_type::q4_K, ggml_type::q4_K, ggml_type::q8_0, ggml_type::q6_K,
                             ggml_type::q5_K, ggml_type::q4_0, ggml_type::q4_K, ggml_type::f16};
  const int64_t ns[] = {64, 64, 32, 96, 64, 32, 128, 64};
  const int64_t rows[] = {1, 1, 3, 9, 2, 5, 1, 4};
  const int64_t x_row[] = {0, 0, 4, 10, 20, 30, 0, 40};  // tasks 0, 1 and 6 share x row 0 (1 row)
  std::vector<std::vector<uint8_t>> bytes;
  std::vector<backend::matmul_task> gt;
  std::vector<std::vector<float>> ref;
  std::vector<float*> outs;
  const std::vector<float> x = to_host(dx, size_t(70 * k));
  for (int i = 0; i < 8; ++i) {
    const std::vector<float> w = random_floats(size_t(ns[i] * k), 100 + uint32_t(i), 0.1f);
    bytes.push_back(encode(types[i], w, ns[i], k));
    const tensor_view v = view(types[i], bytes.back(), ns[i], k);
    const backend::weight_id cw = p.cpu->prepare({&v, 1})[0], gw = p.gpu->prepare({&v, 1})[0];
    ref.emplace_back(size_t(rows[i] * ns[i]));
    p.cpu->matmul(cw, x.data() + x_row[i] * k, rows[i], ref.back().data());
    outs.push_back(to_device(std::vector<float>(size_t(rows[i] * ns[i]))));
    gt.push_back({gw, dx + x_row[i] * k, rows[i], outs.back()});
  }
  p.gpu->matmul_batch(gt);
  bool cpu_bits = true, single_bits = true;
  for (int i = 0; i < 8; ++i) {
    const std::vector<float> got = to_host(outs[size_t(i)], size_t(rows[i] * ns[i]));
    float* one = to_device(std::vector<float>(got.size()));
    p.gpu->matmul(gt[size_t(i)].w, gt[size_t(i)].x, rows[i], one);
    single_bits = single_bits && std::memcmp(to_host(one, got.size()).data(), got.data(), got.size() * 4) == 0;
    if (types[i] != ggml_type::f16)
      cpu_bits = cpu_bits && std::memcmp(ref[size_t(i)].data(), got.data(), got.size() * 4) == 0;
  }
  expect_true("matmul_batch grouped quant x7 + f16: matmul's bits", single_bits);
  expect_true("matmul_batch grouped quant: the cpu's bits", cpu_bits);
}

void check_matmuls(pair& p) {
  const int64_t n = 96, k = 512, rows = 70;  // 70 rows: a full chunk of 64 and a partial one
  const std::vector<float> w = random_floats(size_t(n * k), 1, 0.1f);
  const std::vector<float> x = random_floats(size_t(rows * k), 2);
  float* dx = to_device(x);
  const ggml_type types[] = {ggml_type::f32,  ggml_type::f16,  ggml_type::bf16, ggml_type::q8_0,
                             ggml_type::q4_0, ggml_type::q4_K, ggml_type::q5_K, ggml_type::q6_K};
  for (ggml_type t : types) {
    const std::vector<uint8_t> b = encode(t, w, n, k);
    const tensor_view v = view(t, b, n, k);
    const backend::weight_id cw = p.cpu->prepare({&v, 1})[0], gw = p.gpu->prepare({&v, 1})[0];
    std::vector<float> ref(size_t(rows * n));
    p.cpu->matmul(cw, x.data(), rows, ref.data());
    float* dy = to_device(std::vector<float>(size_t(rows * n)));
    p.gpu->matmul(gw, dx, rows, dy);
    const std::vector<float> got = to_host(dy, ref.size());
    const bool quant = t != ggml_type::f32 && t != ggml_type::f16 && t != ggml_type::bf16;
    expect_close(fmt::format("matmul {} {}x{} batch {}", to_string(t), n, k, rows), got, ref, quant ? 1e-6f : 2e-4f);
    if (quant) expect_same(fmt::format("matmul {} as the cpu", to_string(t)), got.data(), ref.data(), ref.size() * 4);
    // Rows 0 and 65 alone: the bits they had in the batch of 70.
    for (int64_t r : {int64_t(0), int64_t(65)}) {
      p.gpu->matmul(gw, dx + r * k, 1, dy);
      const std::vector<float> one = to_host(dy, size_t(n));
      expect_same(fmt::format("matmul {} row {} alone", to_string(t), r), one.data(), got.data() + r * n,
                  size_t(n) * 4);
    }
    // get_rows of the same matrix as a table.
    const int32_t ids[] = {3, 0, 95, 3};
    std::vector<float> rref(size_t(4 * k));
    p.cpu->get_rows(v, ids, rref.data());
    float* drows = to_device(std::vector<float>(rref.size()));
    p.gpu->get_rows(v, ids, drows);
    const std::vector<float> rgot = to_host(drows, rref.size());
    expect_same(fmt::format("get_rows {}", to_string(t)), rgot.data(), rref.data(), rref.size() * 4);
  }
  // matmul_many and matmul_batch give each output matmul's bits.
  const std::vector<uint8_t> b = encode(ggml_type::f16, w, n, k);
  const tensor_view v = view(ggml_type::f16, b, n, k);
  const backend::weight_id gw = p.gpu->prepare({&v, 1})[0];
  float* y1 = to_device(std::vector<float>(size_t(rows * n)));
  float* y2 = to_device(std::vector<float>(size_t(rows * n)));
  p.gpu->matmul(gw, dx, rows, y1);
  const backend::weight_id ws[] = {gw, gw};
  float* const ys[] = {y2, y2};
  p.gpu->matmul_many(ws, dx, rows, ys);
  expect_same("matmul_many", to_host(y1, size_t(rows * n)).data(), to_host(y2, size_t(rows * n)).data(),
              size_t(rows * n) * 4);
  const backend::matmul_task tasks[] = {{gw, dx + 5 * k, 3, y2}, {gw, dx, 1, y2 + 3 * n}};
  p.gpu->matmul_batch(tasks);
  const std::vector<float> a = to_host(y1, size_t(rows * n)), c = to_host(y2, size_t(4 * n));
  expect_true("matmul_batch (same bits)", std::memcmp(a.data() + 5 * n, c.data(), size_t(3 * n) * 4) == 0 &&
                                              std::memcmp(a.data(), c.data() + 3 * n, size_t(n) * 4) == 0);
  check_grouped(p, dx, k);
}

/// A device-to-device copy finished before the backend's own stream (which does not wait for
/// the legacy stream) reads it.
void copy_d2d(void* dst, const void* src, size_t bytes) {
  cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToDevice);
  cudaDeviceSynchronize();
}

/// Runs `cpu_op` on host copies and `gpu_op` on device copies of `ins`, then compares output 0.
template <class F, class G>
void compare(const std::string& what, std::vector<std::vector<float>> ins, size_t out_n, float tol, F cpu_op,
             G gpu_op) {
  std::vector<float> out(out_n);
  std::vector<float*> d;
  for (auto& v : ins) d.push_back(to_device(v));
  float* dout = to_device(out);
  cpu_op(ins, out.data());
  gpu_op(d, dout);
  const std::vector<float> got = to_host(dout, out_n);
  if (tol == 0.0f)
    expect_same(what, got.data(), out.data(), out_n * 4);
  else
    expect_close(what, got, out, tol);
}

void check_elementwise(pair& p) {
  ops& c = *p.cpu;
  ops& g = *p.gpu;
  const int64_t rows = 37, n = 384;
  const size_t N = size_t(rows * n);
  auto x = random_floats(N, 3, 3.0f), y = random_floats(N, 4, 3.0f), w = random_floats(size_t(n), 5);
  compare("rms_norm", {x}, N, 1e-5f, [&](auto& i, float* o) { c.rms_norm(i[0].data(), w.data(), o, rows, n, 1e-5f); },
          [&](auto& d, float* o) { g.rms_norm(d[0], w.data(), o, rows, n, 1e-5f); });
  compare("swiglu", {x, y}, N, 1e-5f, [&](auto& i, float* o) { c.swiglu(i[0].data(), i[1].data(), o, N); },
          [&](auto& d, float* o) { g.swiglu(d[0], d[1], o, N); });
  compare("geglu", {x, y}, N, 1e-5f, [&](auto& i, float* o) { c.geglu(i[0].data(), i[1].data(), o, N); },
          [&](auto& d, float* o) { g.geglu(d[0], d[1], o, N); });
  auto copy_then = [](auto op) {
    return [op](auto& i, float* o) {
      std::memcpy(o, i[0].data(), i[0].size() * 4);
      op(i, o);
    };
  };
  compare("softcap 2.5", {x}, N, 1e-5f, copy_then([&](auto&, float* o) { c.softcap(o, N, 2.5f); }),
          [&](auto& d, float* o) {
            copy_d2d(o, d[0], N * 4);
            g.softcap(o, N, 2.5f);
          });
  compare("add", {x, y}, N, 0.0f, copy_then([&](auto& i, float* o) { c.add(o, i[1].data(), int64_t(N)); }),
          [&](auto& d, float* o) {
            copy_d2d(o, d[0], N * 4);
            g.add(o, d[1], int64_t(N));
          });
  compare("scale", {x}, N, 0.0f, copy_then([&](auto&, float* o) { c.scale(o, int64_t(N), 0.37f); }),
          [&](auto& d, float* o) {
            copy_d2d(o, d[0], N * 4);
            g.scale(o, int64_t(N), 0.37f);
          });
  compare("add_bias", {x}, N, 0.0f, copy_then([&](auto&, float* o) { c.add_bias(o, w.data(), rows, n); }),
          [&](auto& d, float* o) {
            copy_d2d(o, d[0], N * 4);
            g.add_bias(o, w.data(), rows, n);
          });
  compare("copy_rows", {x}, N, 0.0f, [&](auto& i, float* o) { c.copy_rows(i[0].data() + 7, n, o, n / 2, rows, 100); },
          [&](auto& d, float* o) { g.copy_rows(d[0] + 7, n, o, n / 2, rows, 100); });
  const int32_t idx[] = {5, 0, 36, 12, 5};
  compare("gather_rows", {x}, size_t(5 * n), 0.0f, [&](auto& i, float* o) { c.gather_rows(i[0].data(), idx, o, n); },
          [&](auto& d, float* o) { g.gather_rows(d[0], idx, o, n); });
  const int32_t sidx[] = {5, 0, 36, 12};
  compare("scatter_rows", {x}, N, 0.0f, [&](auto& i, float* o) { c.scatter_rows(i[0].data(), sidx, o, n); },
          [&](auto& d, float* o) { g.scatter_rows(d[0], sidx, o, n); });
  // RoPE, normal and neox, over positions with gaps, 6 heads of 64.
  for (bool neox : {false, true}) {
    std::vector<int32_t> pos(static_cast<size_t>(rows));
    for (int64_t r = 0; r < rows; ++r) pos[size_t(r)] = int32_t(r * 13 % 300);
    backend::rope_table t;
    t.build(pos.data(), rows, 64, 10000.0f, neox);
    compare(neox ? "rope neox" : "rope normal", {x}, size_t(rows * 6 * 64), 1e-5f,
            copy_then([&](auto&, float* o) { c.rope(o, t, 6); }), [&](auto& d, float* o) {
              copy_d2d(o, d[0], size_t(rows * 6 * 64) * 4);
              g.rope(o, t, 6);
            });
  }
  // MoE: route 9 rows of 8 experts (softmax and sigmoid), combine k = 2 with a shared part.
  const int64_t mr = 9, ne = 8;
  const std::vector<float> logits = random_floats(size_t(mr * ne), 6, 2.0f);
  for (auto gating : {cpu::moe_gating::softmax, cpu::moe_gating::sigmoid}) {
    const backend::moe_routing r{.n_expert = int32_t(ne), .n_used = 2, .gating = gating, .norm_weights = true};
    std::vector<int32_t> ce(size_t(mr * 2)), ge(ce.size());
    std::vector<float> cw(ce.size()), gw(ce.size());
    c.moe_route(logits.data(), mr, r, ce.data(), cw.data());
    g.moe_route(to_device(logits), mr, r, ge.data(), gw.data());
    expect_true(gating == cpu::moe_gating::softmax ? "moe_route softmax (same choice and weights)"
                                                   : "moe_route sigmoid (same choice and weights)",
                ce == ge && std::memcmp(cw.data(), gw.data(), cw.size() * 4) == 0);
  }
  const auto eo = random_floats(size_t(mr * 2 * n), 7), sh = random_floats(size_t(mr * n), 8),
             mw = random_floats(size_t(mr * 2), 9);
  compare("moe_combine", {eo, sh}, size_t(mr * n), 1e-6f,
          [&](auto& i, float* o) { c.moe_combine(i[0].data(), mw.data(), mr, 2, n, i[1].data(), o); },
          [&](auto& d, float* o) { g.moe_combine(d[0], mw.data(), mr, 2, n, d[1], o); });
}

/// A CPU pool and a device pool of `layout` with the same random contents.
struct pools {
  kv_pool cpu;
  backend::device_kv_pool gpu;
  pools(const kv_layout& l, int32_t n_pages, uint32_t seed) : cpu(l, n_pages), gpu(l, n_pages) {
    const size_t floats = cpu.bytes() / 4;
    std::vector<float> v = random_floats(floats, seed);
    if (l.dtype == kv_dtype::f16) {  // halves: two per float slot
      auto* h = reinterpret_cast<uint16_t*>(v.data());
      for (size_t i = 0; i < floats * 2; ++i) h[i] = cpu::fp32_to_fp16(float(int(i * 2654435761u % 2001) - 1000) / 1000.0f);
    }
    std::memcpy(cpu.data(), v.data(), cpu.bytes());
    cudaMemcpy(gpu.pool().data(), v.data(), cpu.bytes(), cudaMemcpyHostToDevice);
  }
};

void check_attention(pair& p) {
  for (kv_dtype dt : {kv_dtype::f32, kv_dtype::f16})
    for (int hd : {64, 128}) {
      const int n_heads = 8, n_kv = 2, n_layers = 2, layer = 1;
      const kv_layout L{.n_layers = n_layers, .n_kv_heads = n_kv, .head_dim = hd, .page_size = 16, .dtype = dt};
      pools P(L, 12, 10 + uint32_t(hd));
      // kv_write of 5 rows into both pools, then the pools must agree byte for byte.
      const int64_t kd = int64_t(n_kv) * hd;
      const std::vector<float> rows = random_floats(size_t(5 * kd), 11, 2.0f);
      const backend::kv_slot slots[] = {{3, 0}, {3, 15}, {7, 4}, {0, 1}, {11, 9}};
      for (int c = 0; c < 2; ++c) {
        p.cpu->kv_write(P.cpu, layer, c, slots, rows.data(), kd);
        p.gpu->kv_write(P.gpu.pool(), layer, c, slots, to_device(rows), kd);
      }
      const std::vector<uint8_t> gp = to_host_bytes(P.gpu.pool().data(), P.cpu.bytes());
      expect_same(fmt::format("kv_write {} hd {}", to_string(dt), hd), gp.data(), P.cpu.data(), P.cpu.bytes());
      // A prefill chunk of 20 tokens at 5, a decode at 40, a decode at 0.
      const std::vector<int32_t> pa = {4, 9, 2}, pb = {1, 5, 8}, pc = {10};
      const int64_t qd = int64_t(n_heads) * hd;
      const std::vector<float> q = random_floats(size_t(22 * qd), 12);
      float* dq = to_device(q);
      for (int variant = 0; variant < 3; ++variant) {
        const backend::attention_params ap =
            variant == 0 ? backend::attention_params{}
            : variant == 1 ? backend::attention_params{.scale = 0.05f, .softcap = 20.0f}
                           : backend::attention_params{.window = 7};
        std::vector<float> out(q.size());
        float* dout = to_device(out);
        auto seqs = [&](const float* qq, float* oo) {
          return std::vector<backend::attention_seq>{
              {.q = qq, .n_tokens = 20, .pos0 = 5, .pages = pa, .out = oo},
              {.q = qq + 20 * qd, .n_tokens = 1, .pos0 = 40, .pages = pb, .out = oo + 20 * qd},
              {.q = qq + 21 * qd, .n_tokens = 1, .pos0 = 0, .pages = pc, .out = oo + 21 * qd}};
        };
        p.cpu->attention(seqs(q.data(), out.data()), n_heads, P.cpu, layer, ap);
        p.gpu->attention(seqs(dq, dout), n_heads, P.gpu.pool(), layer, ap);
        const std::vector<float> got = to_host(dout, out.size());
        const char* vn = variant == 0 ? "" : variant == 1 ? " scale+softcap" : " window 7";
        expect_close(fmt::format("attention {} hd {}{}", to_string(dt), hd, vn), got, out, 1e-4f);
        // The decode row alone: the bits it had in the batch.
        const backend::attention_seq alone[] = {{.q = dq + 20 * qd, .n_tokens = 1, .pos0 = 40, .pages = pb, .out = dout}};
        p.gpu->attention(alone, n_heads, P.gpu.pool(), layer, ap);
        const std::vector<float> one = to_host(dout, size_t(qd));
        expect_same(fmt::format("attention {} hd {}{} row alone", to_string(dt), hd, vn), one.data(),
                    got.data() + 20 * qd, size_t(qd) * 4);
      }
    }
  // MLA: latent 64 + rope 16, page size 16, two calls (one per head of one sequence).
  const int32_t kvr = 64, rd = 16;
  pools P(cpu::mla_layout(2, kvr, rd, 16), 6, 20);
  const std::vector<int32_t> pages = {5, 1, 3};
  const int64_t T = 9;
  const auto ql = random_floats(size_t(2 * T * kvr), 21), qp = random_floats(size_t(2 * T * rd), 22);
  float* dql = to_device(ql);
  float* dqp = to_device(qp);
  std::vector<float> out(size_t(2 * T * kvr));
  float* dout = to_device(out);
  auto calls = [&](const float* a, const float* b, float* o) {
    return std::vector<backend::mla_seq>{
        {.q_lat = a, .q_pe = b, .n_tokens = T, .pos0 = 30, .pages = pages, .out = o},
        {.q_lat = a + T * kvr, .q_pe = b + T * rd, .n_tokens = T, .pos0 = 30, .pages = pages, .out = o + T * kvr}};
  };
  p.cpu->mla_attention(calls(ql.data(), qp.data(), out.data()), kvr, rd, 0.11f, P.cpu, 1);
  p.gpu->mla_attention(calls(dql, dqp, dout), kvr, rd, 0.11f, P.gpu.pool(), 1);
  expect_close("mla_attention 64+16", to_host(dout, out.size()), out, 1e-4f);
}

/// Split-context attention (rows past k_split_positions positions): against the CPU at 1e-4
/// like any attention row, and a split row alone has the bits it has beside others.
void check_split_attention(pair& p) {
  for (kv_dtype dt : {kv_dtype::f32, kv_dtype::f16}) {
    const int n_heads = 8, n_kv = 2, hd = 128, ps = 16, ctx = 1800;
    const kv_layout L{.n_layers = 1, .n_kv_heads = n_kv, .head_dim = hd, .page_size = ps, .dtype = dt};
    const int32_t n_pages = ctx / ps + 1;
    pools P(L, n_pages, 40);
    std::vector<int32_t> pages(static_cast<size_t>(n_pages));
    for (int32_t i = 0; i < n_pages; ++i) pages[size_t(i)] = (i * 7) % n_pages;
    const int64_t qd = int64_t(n_heads) * hd;
    const std::vector<float> q = random_floats(size_t(6 * qd), 41);
    float* dq = to_device(q);
    std::vector<float> out(q.size());
    float* dout = to_device(out);
    // Decode rows at 1799 (8 splits), 256 and 257 (the edge), a 3-row prefill chunk at 900.
    auto seqs = [&](const float* qq, float* oo) {
      return std::vector<backend::attention_seq>{
          {.q = qq, .n_tokens = 1, .pos0 = ctx - 1, .pages = pages, .out = oo},
          {.q = qq + qd, .n_tokens = 1, .pos0 = 255, .pages = pages, .out = oo + qd},
          {.q = qq + 2 * qd, .n_tokens = 1, .pos0 = 256, .pages = pages, .out = oo + 2 * qd},
          {.q = qq + 3 * qd, .n_tokens = 3, .pos0 = 900, .pages = pages, .out = oo + 3 * qd}};
    };
    for (int variant = 0; variant < 2; ++variant) {
      const backend::attention_params ap =
          variant == 0 ? backend::attention_params{} : backend::attention_params{.scale = 0.05f, .softcap = 20.0f};
      p.cpu->attention(seqs(q.data(), out.data()), n_heads, P.cpu, 0, ap);
      p.gpu->attention(seqs(dq, dout), n_heads, P.gpu.pool(), 0, ap);
      const std::vector<float> got = to_host(dout, out.size());
      const char* vn = variant == 0 ? "" : " scale+softcap";
      expect_close(fmt::format("split attention {} ctx {}{}", to_string(dt), ctx, vn), got, out, 1e-4f);
      const backend::attention_seq alone[] = {{.q = dq, .n_tokens = 1, .pos0 = ctx - 1, .pages = pages, .out = dout}};
      p.gpu->attention(alone, n_heads, P.gpu.pool(), 0, ap);
      expect_same(fmt::format("split attention {}{} row alone", to_string(dt), vn), to_host(dout, size_t(qd)).data(),
                  got.data(), size_t(qd) * 4);
    }
  }
  // MLA latent rows split the same way: one call of 2 decode rows at 700 (3 splits).
  const int32_t kvr = 64, rd = 16, ps = 16;
  const int32_t n_pages = 48;
  pools P(cpu::mla_layout(1, kvr, rd, ps), n_pages, 42);
  std::vector<int32_t> pages(static_cast<size_t>(n_pages));
  for (int32_t i = 0; i < n_pages; ++i) pages[size_t(i)] = n_pages - 1 - i;
  const auto ql = random_floats(size_t(2 * kvr), 43), qp = random_floats(size_t(2 * rd), 44);
  std::vector<float> out(size_t(2 * kvr));
  float* dout = to_device(out);
  auto calls = [&](const float* a, const float* b, float* o) {
    return std::vector<backend::mla_seq>{{.q_lat = a, .q_pe = b, .n_tokens = 1, .pos0 = 700, .pages = pages, .out = o},
                                         {.q_lat = a + kvr, .q_pe = b + rd, .n_tokens = 1, .pos0 = 700, .pages = pages,
                                          .out = o + kvr}};
  };
  p.cpu->mla_attention(calls(ql.data(), qp.data(), out.data()), kvr, rd, 0.11f, P.cpu, 0);
  p.gpu->mla_attention(calls(to_device(ql), to_device(qp), dout), kvr, rd, 0.11f, P.gpu.pool(), 0);
  expect_close("split mla_attention 64+16 at 700", to_host(dout, out.size()), out, 1e-4f);
}

}  // namespace

void check_backend_ops() {
  pair p;
  std::printf("cpu: %s, gpu: %s\n", p.cpu->describe().c_str(), p.gpu->describe().c_str());
  check_matmuls(p);
  check_elementwise(p);
  check_attention(p);
  check_split_attention(p);
}

}  // namespace tandem::gpu_test
