// Whole models on the CUDA backend against the CPU backend: greedy decoding of make-model
// presets of every architecture for 16 tokens must give the same tokens, a sequence must
// decode the same bits alone and beside another, and decode tokens/s of small-110m at batch 1
// and 32. Also the bandwidth report (paged decode attention, page copies).
#include <cuda_runtime_api.h>
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <numeric>

#include "kernels/backend/cuda/cuda_backend.h"
#include "kernels/cuda/cuda_ops.h"
#include "kernels/gguf/gguf.h"
#include "kernels/model/llama.h"
#include "kernels/model/make_model.h"
#include "tests/gpu/backend_check.h"

namespace tandem::gpu_test {

namespace {

cpu_options gpu_options(int32_t max_graphs = 16) {
  cpu_options o;
  o.make_backend = [max_graphs] {
    return backend::make_cuda_backend(backend::cuda_options{.max_graphs = max_graphs});
  };
  return o;
}

int32_t argmax(const float* x, int64_t n) { return int32_t(std::max_element(x, x + n) - x); }

/// Greedy decoding of the prompts side by side (sequence i on pages [8 i, 8 i + 8)): 16 new
/// tokens each; the first step's logits into `first`.
std::vector<std::vector<int32_t>> greedy(llama_model& m, kv_pool& pool, const std::vector<std::vector<int32_t>>& prompts,
                                         std::vector<float>& first) {
  const size_t n = prompts.size();
  const int64_t V = m.config().n_vocab;
  std::vector<std::vector<int32_t>> pages(n), out(n), feed = prompts;
  for (size_t i = 0; i < n; ++i) {
    pages[i].resize(8);
    std::iota(pages[i].begin(), pages[i].end(), int32_t(8 * i));
  }
  std::vector<int32_t> pos(n, 0);
  std::vector<float> logits;
  for (int step = 0; step < 16; ++step) {
    std::vector<batch_seq> batch;
    for (size_t i = 0; i < n; ++i) batch.push_back(batch_seq{.tokens = feed[i], .pos = pos[i], .pages = pages[i]});
    m.forward(batch, pool, logits);
    if (step == 0) first = logits;
    for (size_t i = 0; i < n; ++i) {
      pos[i] += int32_t(feed[i].size());
      const int32_t t = argmax(logits.data() + int64_t(i) * V, V);
      out[i].push_back(t);
      feed[i] = {t};
    }
  }
  return out;
}

void greedy_case(const std::string& dir, const char* preset, const char* arch, ggml_type dtype) {
  const std::string name = fmt::format("{} {} {}", preset, arch, to_string(dtype));
  const std::string path = fmt::format("{}/tandem-gpu-{}-{}-{}.gguf", dir, preset, arch, to_string(dtype));
  write_random_llama(make_model_options{.preset = preset, .arch = arch, .dtype = dtype}, path);
  const gguf::file f = gguf::file::open(path);
  auto cpu = llama_model::load(f, cpu_options{.threads = 4});
  auto gpu = llama_model::load(f, gpu_options());
  const kv_layout L = cpu->layout(16);
  kv_pool cp(L, 16);
  backend::device_kv_pool gp(L, 16);
  const std::vector<int32_t> a = {1, 17, 42, 99, 7, 3, 250, 11}, b = {5, 6, 300, 2};
  std::vector<float> cl, gl, gl2;
  const auto ct = greedy(*cpu, cp, {a}, cl);
  const auto gt = greedy(*gpu, gp.pool(), {a}, gl);
  expect_close("greedy " + name + " first logits", gl, cl, 5e-3f);
  std::string ts;
  for (int32_t t : gt[0]) ts += fmt::format(" {}", t);
  expect_true(fmt::format("greedy {} 16 tokens equal the cpu's:{}", name, ts), ct[0] == gt[0]);
  // Beside another sequence: the same tokens and the same first logits, bit for bit.
  const auto g2 = greedy(*gpu, gp.pool(), {a, b}, gl2);
  expect_true("greedy " + name + " alone = in a batch of 2",
              g2[0] == gt[0] && std::memcmp(gl2.data(), gl.data(), gl.size() * 4) == 0);
}

/// Decode steps through graphs give the eager steps' logits bit for bit: 3 sequences of a
/// 240-token prompt, 40 steps across the 256-position bucket edge (two keys), tokens fed from
/// the eager model; then the counters say graphs ran (captures and replays, no failures).
void check_graphs(const std::string& dir) {
  const std::string path = dir + "/tandem-gpu-graphs.gguf";
  write_random_llama(make_model_options{.preset = "tiny-15m", .dtype = ggml_type::f16}, path);
  const gguf::file f = gguf::file::open(path);
  auto eager = llama_model::load(f, gpu_options(0));
  auto graphs = llama_model::load(f, gpu_options(16));
  const kv_layout L = eager->layout(16);
  backend::device_kv_pool pe(L, 60), pg(L, 60);
  const int n = 3, prompt = 240, steps = 40;
  const int64_t V = eager->config().n_vocab;
  std::vector<std::vector<int32_t>> pages(n, std::vector<int32_t>(20)), feed(n);
  for (int i = 0; i < n; ++i) {
    std::iota(pages[size_t(i)].begin(), pages[size_t(i)].end(), 20 * i);
    for (int t = 0; t < prompt; ++t) feed[size_t(i)].push_back((t * 31 + i * 7) % int32_t(V));
  }
  std::vector<float> le, lg;
  bool same = true;
  int32_t pos = 0;
  for (int s = 0; s <= steps; ++s) {
    std::vector<batch_seq> batch;
    for (int i = 0; i < n; ++i) batch.push_back(batch_seq{.tokens = feed[size_t(i)], .pos = pos, .pages = pages[size_t(i)]});
    eager->forward(batch, pe.pool(), le);
    graphs->forward(batch, pg.pool(), lg);
    same = same && le.size() == lg.size() && std::memcmp(le.data(), lg.data(), le.size() * 4) == 0;
    pos += int32_t(feed[0].size());
    for (int i = 0; i < n; ++i) feed[size_t(i)] = {argmax(le.data() + i * V, V)};
  }
  const backend::graph_stats g = graphs->graph_counters();
  std::printf("graphs: %llu eager steps, %llu captures, %llu replays, %llu failures, %llu kept\n",
              (unsigned long long)g.eager, (unsigned long long)g.captures, (unsigned long long)g.replays,
              (unsigned long long)g.failures, (unsigned long long)g.graphs);
  expect_true("decode steps through graphs = eager, 40 steps, bit for bit", same);
  expect_true("graphs captured and replayed, none failed",
              g.captures >= 2 && g.replays >= 30 && g.failures == 0 && eager->graph_counters().captures == 0);
}

}  // namespace

void check_greedy(const std::string& dir) {
  greedy_case(dir, "tiny-15m", "llama", ggml_type::f32);
  greedy_case(dir, "tiny-15m", "llama", ggml_type::f16);
  greedy_case(dir, "tiny-15m", "llama", ggml_type::q8_0);
  greedy_case(dir, "micro", "llama", ggml_type::bf16);
  greedy_case(dir, "micro", "qwen2", ggml_type::f16);
  greedy_case(dir, "micro", "qwen3", ggml_type::q4_0);
  greedy_case(dir, "micro", "gemma2", ggml_type::f16);
  greedy_case(dir, "micro", "deepseek2", ggml_type::f32);

  check_graphs(dir);

  // Decode tokens/s of small-110m (f16) at batch 1 and 32: 32-token prompts, then 32 steps;
  // with decode-step graphs (the default) and without.
  const std::string path = dir + "/tandem-gpu-small-110m.gguf";
  write_random_llama(make_model_options{.preset = "small-110m", .dtype = ggml_type::f16}, path);
  const gguf::file f = gguf::file::open(path);
  for (int32_t graphs : {16, 0}) {
    auto m = llama_model::load(f, gpu_options(graphs));
    backend::device_kv_pool gp(m->layout(16), 32 * 8);
    for (int n : {1, 32}) {
      std::vector<std::vector<int32_t>> pages(static_cast<size_t>(n), std::vector<int32_t>(8)), feed(static_cast<size_t>(n));
      for (int i = 0; i < n; ++i) {
        std::iota(pages[size_t(i)].begin(), pages[size_t(i)].end(), 8 * i);
        feed[size_t(i)].assign(32, 7 + i);
      }
      std::vector<float> logits;
      auto step = [&](int32_t pos) {
        std::vector<batch_seq> batch;
        for (int i = 0; i < n; ++i) batch.push_back(batch_seq{.tokens = feed[size_t(i)], .pos = pos, .pages = pages[size_t(i)]});
        m->forward(batch, gp.pool(), logits);
        for (int i = 0; i < n; ++i) feed[size_t(i)] = {argmax(logits.data() + int64_t(i) * m->config().n_vocab, m->config().n_vocab)};
      };
      step(0);
      const auto t0 = std::chrono::steady_clock::now();
      for (int s = 0; s < 32; ++s) step(32 + s);
      const double sec = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      std::printf("decode small-110m f16 batch %2d, %s: %.1f tokens/s (%.2f ms/step)\n", n,
                  graphs > 0 ? "graphs" : "eager ", 32.0 * n / sec, sec / 32 * 1e3);
    }
  }
}

void report_bandwidth() {
  // Device-to-device copy bandwidth: the yardstick (bytes read + written per second).
  const size_t big = size_t(1) << 30;
  void *s = nullptr, *d = nullptr;
  cudaMalloc(&s, big);
  cudaMalloc(&d, big);
  auto time = [](int iters, auto f) {
    f();
    cudaDeviceSynchronize();
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < iters; ++i) f();
    cudaDeviceSynchronize();
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / iters;
  };
  const double copy_gbs = 2.0 * double(big) / time(10, [&] { cudaMemcpyAsync(d, s, big, cudaMemcpyDeviceToDevice); }) / 1e9;
  cudaFree(s);
  cudaFree(d);
  std::printf("bandwidth cudaMemcpy device->device (r+w)            %8.1f GB/s (the yardstick)\n", copy_gbs);

  // Paged decode attention: 32, 4 and 1 sequences x 4096 positions, 32 heads over 8 KV heads
  // of 128 (a row of 4096 positions runs as 16 split-context blocks per head).
  auto ops = backend::make_cuda_backend(backend::cuda_options{});
  const int ctx = 4096, n_heads = 32, n_kv = 8, hd = 128, ps = 16;
  for (int n_seqs : {32, 4, 1}) {
    for (kv_dtype dt : {kv_dtype::f32, kv_dtype::f16}) {
      const kv_layout L{.n_layers = 1, .n_kv_heads = n_kv, .head_dim = hd, .page_size = ps, .dtype = dt};
      const int32_t per_seq = ctx / ps;
      backend::device_kv_pool P(L, n_seqs * per_seq);
      std::vector<std::vector<int32_t>> pages(static_cast<size_t>(n_seqs), std::vector<int32_t>(static_cast<size_t>(per_seq)));
      for (int i = 0; i < n_seqs; ++i)
        for (int j = 0; j < per_seq; ++j) pages[size_t(i)][size_t(j)] = (j * n_seqs + i * 7) % (n_seqs * per_seq);
      float* q = to_device(random_floats(size_t(n_seqs * n_heads * hd), 30));
      float* out = to_device(std::vector<float>(size_t(n_seqs * n_heads * hd)));
      std::vector<backend::attention_seq> seqs;
      for (int i = 0; i < n_seqs; ++i)
        seqs.push_back({.q = q + i * n_heads * hd, .n_tokens = 1, .pos0 = ctx - 1, .pages = pages[size_t(i)],
                        .out = out + i * n_heads * hd});
      const double sec = time(10, [&] { ops->attention(seqs, n_heads, P.pool(), 0, {}); });
      const double bytes = double(n_seqs) * ctx * n_kv * hd * 2 * double(L.elem_bytes());
      std::printf("bandwidth paged decode attention %s %2dx4096 (split) %8.1f GB/s  %.3f of copy  (%.3f ms)\n",
                  to_string(dt), n_seqs, bytes / sec / 1e9, bytes / sec / 1e9 / copy_gbs, sec * 1e3);
    }
  }
  // Page copies inside a device pool (the prefix-cache and tier moves): 4096 pages of 64 KiB.
  const size_t page = size_t(64) << 10;
  const int n = 4096;
  void* pool = nullptr;
  cudaMalloc(&pool, page * 2 * n);
  std::vector<int32_t> src(n), dst(n);
  for (int i = 0; i < n; ++i) src[size_t(i)] = (i * 37) % n, dst[size_t(i)] = n + (i * 53) % n;
  auto* ds = static_cast<int32_t*>(to_device_bytes(src.data(), src.size() * 4));
  auto* dd = static_cast<int32_t*>(to_device_bytes(dst.data(), dst.size() * 4));
  const double sec = time(10, [&] {
    tandem::cuda::copy_pages(static_cast<uint8_t*>(pool), ds, static_cast<uint8_t*>(pool), dd, n, page, nullptr);
  });
  const double gbs = 2.0 * double(page) * n / sec / 1e9;
  std::printf("bandwidth copy_pages device->device (r+w) 4096x64K  %8.1f GB/s  %.3f of copy\n", gbs, gbs / copy_gbs);
  cudaFree(pool);
}

}  // namespace tandem::gpu_test
