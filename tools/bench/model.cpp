// tandem bench model: prefill and decode throughput of a GGUF model on the CPU kernels,
// each printed next to the ceiling measured in the same run (streaming read bandwidth for
// decode, peak FMA rate for prefill), so the ratios stay meaningful on a loaded machine.
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <cstdio>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "kernels/base/error.h"
#include "kernels/cpu/ops.h"
#include "kernels/cpu/roofline.h"
#include "kernels/cpu/thread_pool.h"
#include "kernels/gguf/gguf.h"
#include "kernels/model/kv_pool.h"
#include "kernels/model/llama.h"
#include "tools/bench/llama_cpp.h"
#include "tools/bench/bench_flags.h"
#include "tools/bench/modes.h"
#include "tools/tandem/flags.h"

namespace tandem::cli {

namespace {

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

std::vector<int64_t> parse_list(const std::string& s, const char* flag) {
  std::vector<int64_t> out;
  std::stringstream ss(s);
  std::string part;
  while (std::getline(ss, part, ',')) {
    try {
      size_t used = 0;
      const int64_t v = std::stoll(part, &used);
      if (used != part.size() || v < 1 || v > 1024) throw 0;
      out.push_back(v);
    } catch (...) {
      throw tandem::error(fmt::format("--{} expects comma-separated integers in [1, 1024], got '{}'", flag, s));
    }
  }
  if (out.empty()) throw tandem::error(fmt::format("--{} is empty; give e.g. 1,8,32", flag));
  return out;
}

/// What one decode step or prefill has to read and compute, from the tensor list.
struct model_cost {
  /// Weights one token's forward reads: every matrix and the output head, but of a MoE
  /// layer's stacked experts only the n_expert_used a token is routed to.
  size_t step_bytes = 0;
  double layer_params = 0;     ///< matrix elements of all layers one token multiplies by
  double output_params = 0;    ///< elements of the output head
  std::string weight_type;     ///< type of blk.0.attn_q.weight
};

model_cost cost_of(const gguf::file& f, const model_config& c) {
  model_cost m;
  const gguf::tensor_info* embd = f.find_tensor("token_embd.weight");
  const gguf::tensor_info* out = f.find_tensor("output.weight");
  for (const auto& t : f.tensors()) {
    if (&t == embd && out != nullptr) continue;  // only a few embedding rows are read
    // Stacked experts (ffn_*_exps): a token reads the n_expert_used it is routed to.
    const bool experts = t.name.find("_exps.") != std::string::npos && c.n_expert > 0;
    const double share = experts ? double(c.n_expert_used) / double(c.n_expert) : 1.0;
    m.step_bytes += size_t(double(t.nbytes) * share);
    double n = 1;
    for (int64_t d : t.dims) n *= double(d);
    if (t.name.rfind("blk.", 0) == 0 && t.dims.size() >= 2 && t.dims[1] > 1) m.layer_params += n * share;
  }
  m.output_params = double(c.n_vocab) * c.n_embd;
  const auto* q = f.find_tensor("blk.0.attn_q.weight");
  if (q == nullptr) q = f.find_tensor("blk.0.attn_q_a.weight");  // deepseek2's q LoRA
  if (q != nullptr) m.weight_type = std::string(to_string(q->type));
  return m;
}

/// FLOP of causal attention for `n` new tokens after `pos0` cached ones (QK and AV); with
/// latent attention, scores over the latent + rope part and values in the latent.
double attention_flops(const model_config& c, int64_t pos0, int64_t n) {
  double ctx = 0;
  for (int64_t t = 0; t < n; ++t) ctx += double(pos0 + t + 1);
  if (c.kv_lora_rank > 0) return 2.0 * ctx * (2.0 * c.kv_lora_rank + c.rope_dims) * c.n_head * c.n_layer;
  return 4.0 * ctx * c.head_dim * c.n_head * c.n_layer;
}

struct seq_state {
  std::vector<int32_t> pages;
  int32_t pos = 0;
  std::vector<int32_t> next;  // the token fed at the next step
};

struct decode_result {
  int64_t batch = 0;
  double tokens_per_s = 0, ms_per_step = 0, roofline = 0, of_peak = 0;
  double attn_flops = 0;  ///< attention FLOP of the fastest repetition
  /// Read bandwidth (bytes/s) probed right before and after the fastest repetition, the higher
  /// of the two (0: not probed); its roofline.
  double bandwidth = 0;
};

/// Batched decode on one model: `batch` sequences with `context` random tokens cached; each
/// repetition times `steps` greedy steps of all of them. Positions keep growing from one
/// repetition to the next, as in a serving run.
class decode_runner {
 public:
  decode_runner(llama_model& model, int64_t batch, int64_t context, int64_t prompt, int64_t decode_ctx,
                std::mt19937 rng)
      : model_(model),
        pool_(model.layout(ps), int32_t((decode_ctx + ps - 1) / ps * batch)),
        seqs_(static_cast<size_t>(batch)) {
    const model_config& c = model.config();
    std::uniform_int_distribution<int32_t> tok(1, c.n_vocab - 1);
    const int64_t pages_per_seq = (decode_ctx + ps - 1) / ps;
    for (int64_t s = 0; s < batch; ++s) {
      for (int64_t p = 0; p < pages_per_seq; ++p) seqs_[size_t(s)].pages.push_back(int32_t(s * pages_per_seq + p));
      seqs_[size_t(s)].next = {tok(rng)};
    }
    if (context > 0) {
      std::vector<std::vector<int32_t>> ctx_toks(static_cast<size_t>(batch));
      std::vector<batch_seq> b;
      for (int64_t s = 0; s < batch; ++s) {
        for (int64_t i = 0; i < context; ++i) ctx_toks[size_t(s)].push_back(tok(rng));
        b.push_back(batch_seq{.tokens = ctx_toks[size_t(s)], .pos = 0, .pages = seqs_[size_t(s)].pages,
                              .want_logits = false});
      }
      // In prompt-sized chunks of sequences, as a scheduler would.
      const size_t per = size_t(std::max<int64_t>(1, prompt / std::max<int64_t>(1, context)));
      for (size_t i = 0; i < b.size(); i += per)
        model.forward(std::span<const batch_seq>(b.data() + i, std::min(per, b.size() - i)), pool_, logits_);
      for (auto& s : seqs_) s.pos = int32_t(context);
    }
  }

  /// `warm` untimed steps, then `steps` timed ones: seconds of the timed ones; `attn` gets
  /// their attention FLOP.
  double rep(int64_t steps, int64_t warm, double& attn) {
    const model_config& c = model_.config();
    double t0 = 0;
    attn = 0;
    for (int64_t step = -warm; step < steps; ++step) {
      if (step == 0) t0 = now_s();
      std::vector<batch_seq> b;
      for (seq_state& q : seqs_) {
        b.push_back(batch_seq{.tokens = q.next, .pos = q.pos, .pages = q.pages, .want_logits = true});
        if (step >= 0) attn += attention_flops(c, q.pos, 1);
      }
      model_.forward(b, pool_, logits_);
      for (size_t s = 0; s < seqs_.size(); ++s) {
        seq_state& q = seqs_[s];
        ++q.pos;
        // Greedy next token, so the inputs look like a real decode.
        const float* l = logits_.data() + size_t(s) * size_t(c.n_vocab);
        q.next = {int32_t(cpu::argmax(l, c.n_vocab))};
      }
    }
    return now_s() - t0;
  }

 private:
  static constexpr int32_t ps = 16;
  llama_model& model_;
  kv_pool pool_;
  std::vector<seq_state> seqs_;
  std::vector<float> logits_;
};

constexpr int64_t decode_warm = 2, decode_reps = 3;  // reps: timed repetitions per batch size; the fastest counts

decode_result to_result(int64_t bsz, int64_t steps, double sec, double attn) {
  decode_result r;
  r.batch = bsz;
  r.ms_per_step = sec / double(steps) * 1e3;
  r.tokens_per_s = double(bsz * steps) / sec;
  r.attn_flops = attn;
  return r;
}

/// Decode tokens/s for each batch size (after 2 warm-up steps; 3 repetitions, the fastest
/// counts). Each batch size decodes its own sequences, all starting at `context`, so every
/// batch size sees the same contexts; the repetitions go round the batch sizes in turn (and,
/// with `other`, round the two models, which start from the same tokens), so that all of them
/// see the same machine: on a shared machine the speed drifts over seconds, and ratios of
/// runs seconds apart carried that drift.
std::vector<decode_result> run_decode(llama_model& model, const std::vector<int64_t>& batches, int64_t steps,
                                      int64_t context, int64_t prompt, int64_t decode_ctx, std::mt19937& rng,
                                      llama_model* other = nullptr, std::vector<decode_result>* other_out = nullptr,
                                      const std::function<double()>& probe = nullptr) {
  const int models = other ? 2 : 1;
  std::vector<std::unique_ptr<decode_runner>> runners;  // [batch index][model]
  for (int64_t bsz : batches)
    for (int m = 0; m < models; ++m)
      runners.push_back(std::make_unique<decode_runner>(m == 0 ? model : *other, bsz, context, prompt, decode_ctx, rng));
  std::vector<double> best(runners.size(), 1e30), attn(runners.size(), 0.0), bw(runners.size(), 0.0);
  double last_probe = 0;
  for (int64_t rep = 0; rep < decode_reps; ++rep)
    for (size_t r = 0; r < runners.size(); ++r) {
      // The first model's repetitions sit between two bandwidth probes (one probe serves the
      // repetitions on either side of it), so that each speed meets the bandwidth of its own
      // seconds: on a shared machine the bandwidth moved by a third from one minute to the next.
      const bool probed = probe && r % size_t(models) == 0;
      const double before = probed ? (last_probe > 0 ? last_probe : probe()) : 0.0;
      double at = 0;
      const double sec = runners[r]->rep(steps, rep == 0 ? decode_warm : 0, at);
      last_probe = probed ? probe() : 0.0;  // only a probe right after a repetition serves the next
      if (sec < best[r]) best[r] = sec, attn[r] = at, bw[r] = std::max(before, last_probe);
    }
  std::vector<decode_result> dec;
  for (size_t i = 0; i < batches.size(); ++i) {
    dec.push_back(to_result(batches[i], steps, best[i * size_t(models)], attn[i * size_t(models)]));
    dec.back().bandwidth = bw[i * size_t(models)];
    if (other) other_out->push_back(to_result(batches[i], steps, best[i * 2 + 1], attn[i * 2 + 1]));
  }
  return dec;
}

/// A model loaded for a benchmark, with the file whose mapping holds its weights.
struct bench_model_file {
  gguf::file file;
  std::unique_ptr<llama_model> model;
  cpu_isa isa = cpu_isa::best;  ///< the kernel path it runs (resolved)
};

bench_model_file load_bench_model(const std::string& path, int32_t threads, cpu_isa isa,
                                  kv_dtype kv = kv_dtype::f32) {
  bench_model_file m{gguf::file::open(path), nullptr, cpu::resolve_isa(isa)};
  cpu_options co;
  co.threads = threads;
  co.isa = m.isa;
  co.kv = kv;
  m.model = llama_model::load(m.file, co);
  return m;
}

/// The setup's kernel path and KV cache type, or an error naming the choices.
bench_model_file load_bench_model(const std::string& path, const bench_model_setup& setup) {
  const kv_dtype kv = require_kv_dtype(setup.kv_cache_dtype, "kv cache dtype '" + setup.kv_cache_dtype + "'");
  return load_bench_model(path, setup.threads, cpu::parse_isa(setup.kernels), kv);
}

}  // namespace

double bench_model_decode_tokens_per_s(const std::string& path, const bench_model_setup& setup, int64_t batch,
                                       int64_t context) {
  const bench_model_file m = load_bench_model(path, setup);
  const auto& model = m.model;
  const int64_t steps = 16, decode_ctx = context + decode_warm + decode_reps * steps + 1;
  if (model->config().n_ctx > 0 && decode_ctx > model->config().n_ctx)
    throw tandem::error(fmt::format("decode context {} exceeds the model's context {}; use shorter prompts or outputs",
                                    decode_ctx, model->config().n_ctx));
  std::mt19937 rng(1);
  return run_decode(*model, {batch}, steps, context, 512, decode_ctx, rng).front().tokens_per_s;
}

double bench_model_prefill_s(const std::string& path, const bench_model_setup& setup, int64_t seqs, int64_t prompt,
                             int64_t chunk_tokens) {
  if (seqs < 1 || prompt < 1 || chunk_tokens < 1)
    throw tandem::error("prefill benchmark needs at least one sequence, one prompt token and one token per pass");
  const bench_model_file m = load_bench_model(path, setup);
  const auto& model = m.model;
  const model_config& c = model->config();
  if (c.n_ctx > 0 && prompt > c.n_ctx)
    throw tandem::error(fmt::format("prompt of {} tokens exceeds the model's context {}", prompt, c.n_ctx));
  const int32_t ps = 16;
  const int64_t pages_per_seq = (prompt + ps - 1) / ps;
  kv_pool pool(model->layout(ps), int32_t(pages_per_seq * seqs));
  std::mt19937 rng(1);
  std::uniform_int_distribution<int32_t> tok(1, c.n_vocab - 1);
  std::vector<std::vector<int32_t>> toks(static_cast<size_t>(seqs)), pages(static_cast<size_t>(seqs));
  for (int64_t s = 0; s < seqs; ++s) {
    for (int64_t i = 0; i < prompt; ++i) toks[size_t(s)].push_back(tok(rng));
    for (int64_t p = 0; p < pages_per_seq; ++p) pages[size_t(s)].push_back(int32_t(s * pages_per_seq + p));
  }
  std::vector<float> logits;
  double best = 1e30;
  for (int r = 0; r < 3; ++r) {
    const double t0 = now_s();
    int64_t s = 0, done = 0;  // next sequence and how many of its tokens are already in
    while (s < seqs) {
      std::vector<batch_seq> pass;
      int64_t room = chunk_tokens;
      while (s < seqs && room > 0) {
        const int64_t n = std::min(room, prompt - done);
        pass.push_back(batch_seq{.tokens = std::span<const int32_t>(toks[size_t(s)].data() + done, size_t(n)),
                                 .pos = int32_t(done), .pages = pages[size_t(s)], .want_logits = done + n == prompt});
        room -= n;
        done += n;
        if (done == prompt) {
          ++s;
          done = 0;
        }
      }
      model->forward(pass, pool, logits);
    }
    best = std::min(best, now_s() - t0);
  }
  return best;
}

int bench_model(args a) {
  for (const std::string& s : a)
    if (s == "--null") {
      std::vector<std::string> rest;
      for (const std::string& r : a)
        if (r != "--null") rest.push_back(r);
      return bench_control_plane(rest);
    }
  flags f;
  f.opt("model", "GGUF model file (required), e.g. from tandem make-model --preset small-110m")
      .opt("threads", "kernel threads", "2")
      .opt("isa", "kernel path: best | amx | avx512 | avx2 | scalar", "best")
      .opt("compare-isa",
           "also run prefill and decode on this kernel path in the same run and print each ratio to it "
           "(e.g. --isa amx --compare-isa avx512)",
           "")
      .opt("kv-cache-dtype", "element type of the KV cache: f32 | f16", "f32")
      .opt("compare-kv-cache-dtype",
           "also run prefill and decode with this KV cache type in the same run and print each ratio to it "
           "(e.g. --kv-cache-dtype f16 --compare-kv-cache-dtype f32; with --compare-isa, both change)",
           "")
      .sw("compare-llama-cpp",
          "also time llama.cpp on the same file with the same threads (node-llama-cpp, tests/reference/llama_cpp) "
          "and print Tandem / llama.cpp for prefill and batch-1 decode")
      .opt("llama-cpp-dir", "folder of greedy.mjs with its node_modules (after npm ci there)", default_llama_cpp_dir())
      .opt("prompt", "prefill prompt length in tokens", "512")
      .opt("batches", "decode batch sizes", "1,8,32")
      .opt("steps", "timed decode steps per batch size and repetition (3 repetitions, the fastest counts)", "16")
      .opt("context", "tokens already in each sequence's KV when decode starts", "32")
      .opt("bandwidth-mb", "buffer of the bandwidth probe (well above the last-level cache)", "512")
      .sw("json", "print one JSON object instead of the table")
      .sw("null", "run the control-plane benchmark with a null model instead (see bench control-plane)");
  if (!parse_bench_flags(f, a, "model --model FILE [options]")) return 0;
  const std::string path = bench_model_path(f);
  const int64_t threads = f.num("threads"), prompt = f.num("prompt"), steps = f.num("steps"),
                context = f.num("context"), bw_mb = f.num("bandwidth-mb");
  if (threads < 1 || threads > 1024) throw tandem::error("--threads must be in [1, 1024]");
  if (prompt < 1 || steps < 1 || context < 0 || bw_mb < 1)
    throw tandem::error("--prompt, --steps and --bandwidth-mb must be >= 1, --context >= 0");
  const std::vector<int64_t> batches = parse_list(f.str("batches"), "batches");
  const bool json = f.on("json");
  // Checked before anything is measured (a misspelt path should not cost a whole run).
  auto kv_flag = [&](const std::string& name) {
    const std::string v = f.str(name);
    return require_kv_dtype(v, "--" + name + " " + v);
  };
  const kv_dtype kv = kv_flag("kv-cache-dtype");
  const kv_dtype cmp_kv = f.str("compare-kv-cache-dtype").empty() ? kv : kv_flag("compare-kv-cache-dtype");
  const bool compare = !f.str("compare-isa").empty() || !f.str("compare-kv-cache-dtype").empty();
  if (f.on("compare-llama-cpp")) require_llama_cpp(f.str("llama-cpp-dir"));
  const bench_model_file m = load_bench_model(path, int32_t(threads), cpu::parse_isa(f.str("isa")), kv);
  const cpu_isa cmp_isa =
      !f.str("compare-isa").empty() ? cpu::resolve_isa(cpu::parse_isa(f.str("compare-isa"))) : m.isa;

  const auto& model = m.model;
  const model_config& c = model->config();
  const model_cost cost = cost_of(m.file, c);
  const int32_t ps = 16;
  const int64_t decode_ctx = context + decode_warm + decode_reps * steps + 1;
  if (c.n_ctx > 0 && (prompt > c.n_ctx || decode_ctx > c.n_ctx))
    throw tandem::error(fmt::format("--prompt {} or --context + steps ({}) exceed the model's context {}", prompt,
                                    decode_ctx, c.n_ctx));

  // Ceilings, measured now with the same thread count.
  cpu::thread_pool probe_pool(static_cast<int32_t>(threads));
  double bw = cpu::measure_read_bandwidth(probe_pool, size_t(bw_mb) << 20, 3);
  double peak = cpu::measure_peak_fma(probe_pool, m.isa, 3);
  double roofline_step_s = double(cost.step_bytes) / bw;

  std::mt19937 rng(1);
  std::uniform_int_distribution<int32_t> tok(1, c.n_vocab - 1);
  std::vector<float> logits;

  // Prefill: one sequence of `prompt` tokens (5 runs; the fastest counts, the first also warms).
  // With a comparison, its model's runs alternate with the first's (see run_decode).
  auto run_prefill = [&](llama_model& lm, llama_model* other, double* other_s) {
    double best[2] = {1e30, 1e30};
    std::vector<int32_t> toks(static_cast<size_t>(prompt));
    for (auto& t : toks) t = tok(rng);
    kv_pool pool_a(lm.layout(ps), int32_t((prompt + ps - 1) / ps));
    std::unique_ptr<kv_pool> pool_b;
    if (other) pool_b = std::make_unique<kv_pool>(other->layout(ps), pool_a.n_pages());
    std::vector<int32_t> pages(static_cast<size_t>(pool_a.n_pages()));
    for (size_t i = 0; i < pages.size(); ++i) pages[i] = int32_t(i);
    for (int r = 0; r < 5; ++r)
      for (int m = 0; m < (other ? 2 : 1); ++m) {
        const batch_seq s{.tokens = toks, .pos = 0, .pages = pages, .want_logits = true};
        const double t0 = now_s();
        (m == 0 ? lm : *other).forward(std::span<const batch_seq>(&s, 1), m == 0 ? pool_a : *pool_b, logits);
        best[m] = std::min(best[m], now_s() - t0);
      }
    if (other_s) *other_s = best[1];
    return best[0];
  };
  // The comparison's model, loaded now so that its runs alternate with the first's.
  std::string cmp_name;
  double cmp_prefill_s = 0;
  std::vector<decode_result> cmp_dec;
  std::optional<bench_model_file> other;
  if (compare) {
    cmp_name = cpu::to_string(cmp_isa);
    if (cmp_kv != kv) cmp_name += fmt::format(" kv {}", to_string(cmp_kv));
    other.emplace(load_bench_model(path, int32_t(threads), cmp_isa, cmp_kv));
  }
  llama_model* other_model = other ? other->model.get() : nullptr;
  // llama.cpp runs in a child process, so its runs cannot alternate with ours: one before and
  // one after them, the better of the two counting for each number.
  const bool vs_llama_cpp = f.on("compare-llama-cpp");
  llama_cpp_speed lc;
  auto run_llama_cpp = [&] {
    const llama_cpp_speed r =
        run_llama_cpp_bench(f.str("llama-cpp-dir"), path, int32_t(threads), prompt, context, steps, to_string(kv));
    lc.prefill_tokens_per_s = std::max(lc.prefill_tokens_per_s, r.prefill_tokens_per_s);
    lc.decode_tokens_per_s = std::max(lc.decode_tokens_per_s, r.decode_tokens_per_s);
  };
  if (vs_llama_cpp) run_llama_cpp();
  const double prefill_s = run_prefill(*model, other_model, &cmp_prefill_s);
  const double prefill_flops =
      2.0 * cost.layer_params * double(prompt) + 2.0 * cost.output_params + attention_flops(c, 0, prompt);
  const double prefill_tps = double(prompt) / prefill_s;
  double prefill_of_peak = prefill_flops / prefill_s / peak;

  // Decode: each batch size b runs b sequences of its own, from `context` tokens each.
  auto probe = [&] { return cpu::measure_read_bandwidth(probe_pool, size_t(bw_mb) << 20, 1); };
  std::vector<decode_result> dec =
      run_decode(*model, batches, steps, context, prompt, decode_ctx, rng, other_model, &cmp_dec, probe);
  for (auto& r : dec) r.of_peak = (2.0 * (cost.layer_params + cost.output_params) * double(r.batch * steps) + r.attn_flops) /
                                  (r.ms_per_step * double(steps) / 1e3) / peak;
  if (vs_llama_cpp) run_llama_cpp();
  // Ceilings again after the runs; the higher of the two counts, so load from other
  // processes during one probe cannot flatter the ratios.
  bw = std::max(bw, cpu::measure_read_bandwidth(probe_pool, size_t(bw_mb) << 20, 3));
  const double peak2 = cpu::measure_peak_fma(probe_pool, m.isa, 3);
  if (peak2 > peak) {
    for (auto& r : dec) r.of_peak *= peak / peak2;
    prefill_of_peak *= peak / peak2;
    peak = peak2;
  }
  // On the amx path the matmuls run on the tile unit, whose rate the FMA peak does not
  // bound: its own peak, and the share of it prefill uses, counting the tile products each
  // f32 multiply-add takes there (kernels/cpu/amx.h: 5 for f16 weights, 3 for bf16).
  const double peak_amx = m.isa == cpu_isa::amx ? cpu::measure_peak_amx(probe_pool, 3) : 0.0;
  const int tile_products = cost.weight_type == "f16" ? 5 : cost.weight_type == "bf16" ? 3 : 0;
  const double prefill_of_amx =
      peak_amx > 0 && tile_products > 0 ? prefill_flops * tile_products / prefill_s / peak_amx : 0.0;
  // Each row against the bandwidth probed next to its fastest repetition (run_decode); the
  // run's highest probe stands for the machine in the header.
  for (auto& r : dec) {
    if (r.bandwidth <= 0) r.bandwidth = bw;  // not probed: the run's
    bw = std::max(bw, r.bandwidth);
    r.roofline = double(cost.step_bytes) / r.bandwidth / (r.ms_per_step / 1e3);
  }
  roofline_step_s = double(cost.step_bytes) / bw;
  const decode_result* b1 = nullptr;
  const decode_result* b32 = nullptr;
  for (const auto& r : dec) {
    if (r.batch == 1) b1 = &r;
    if (r.batch == 32) b32 = &r;
  }

  const std::string isa_name(cpu::to_string(m.isa));
  std::string cmp_json;
  if (!cmp_name.empty()) {
    std::string d;
    for (size_t i = 0; i < cmp_dec.size(); ++i)
      d += fmt::format("{}{{\"batch\":{},\"tokens_per_s\":{:.2f},\"ratio\":{:.4f}}}", d.empty() ? "" : ",",
                       cmp_dec[i].batch, cmp_dec[i].tokens_per_s, dec[i].tokens_per_s / cmp_dec[i].tokens_per_s);
    cmp_json = fmt::format(",\"compare\":{{\"isa\":\"{}\",\"kv_cache_dtype\":\"{}\",\"prefill_tokens_per_s\":{:.2f},"
                           "\"prefill_ratio\":{:.4f},\"decode\":[{}]}}",
                           cpu::to_string(cmp_isa), to_string(cmp_kv), double(prompt) / cmp_prefill_s,
                           cmp_prefill_s / prefill_s, d);
  }
  const double b1_tps = b1 ? b1->tokens_per_s : 0.0;
  if (vs_llama_cpp)
    cmp_json += fmt::format(",\"llama_cpp\":{{\"prefill_tokens_per_s\":{:.2f},\"prefill_ratio\":{:.4f},"
                            "\"decode_batch1_tokens_per_s\":{:.2f},\"decode_batch1_ratio\":{:.4f}}}",
                            lc.prefill_tokens_per_s, prefill_tps / lc.prefill_tokens_per_s, lc.decode_tokens_per_s,
                            b1_tps / lc.decode_tokens_per_s);
  // What one cached token costs in this architecture's KV layout (MLA would be its latent
  // size, not heads x dims): what a KV pool, host tier and transfer hold per token.
  const kv_layout kv_per_page = model->layout(16);
  const size_t kv_bytes_per_token = kv_per_page.page_bytes() / size_t(kv_per_page.page_size);
  cmp_json += fmt::format(",\"arch\":\"{}\",\"kv_bytes_per_token\":{}", c.arch, kv_bytes_per_token);
  // Per pool: a window pool's bytes per token stop growing at its window (a sequence holds
  // at most ceil(W / page_size) + 1 of its pages).
  const kv_pools_layout pools = model->pools_layout(16);
  std::string pools_json, pools_text;
  for (const kv_pool_spec& p : pools.pools) {
    const size_t per_token = p.page.page_bytes() / size_t(p.page.page_size);
    pools_json += fmt::format("{}{{\"name\":\"{}\",\"layers\":{},\"bytes_per_token\":{},\"window_tokens\":{}}}",
                              pools_json.empty() ? "" : ",", p.name, p.layers.size(), per_token, p.window_tokens);
    pools_text += fmt::format("{}{} {} B/token ({} layers{})", pools_text.empty() ? "" : ", ", p.name, per_token,
                              p.layers.size(),
                              p.window_tokens > 0 ? fmt::format(", at most {} pages a sequence",
                                                                p.max_pages(int64_t(1) << 30, 1))
                                                  : "");
  }
  cmp_json += fmt::format(",\"kv_pools\":[{}]", pools_json);
  if (json) {
    std::string d;
    for (const auto& r : dec)
      d += fmt::format("{}{{\"batch\":{},\"tokens_per_s\":{:.2f},\"ms_per_step\":{:.3f},\"roofline_fraction\":{:.4f},"
                       "\"peak_fma_fraction\":{:.4f},\"read_bandwidth_gbs\":{:.3f}}}",
                       d.empty() ? "" : ",", r.batch, r.tokens_per_s, r.ms_per_step, r.roofline, r.of_peak,
                       r.bandwidth / 1e9);
    std::printf(
        "{\"model\":\"%s\",\"weight_type\":\"%s\",\"threads\":%lld,\"isa\":\"%s\",\"kv_cache_dtype\":\"%s\","
        "\"step_bytes\":%zu,"
        "\"read_bandwidth_gbs\":%.3f,\"peak_fma_gflops\":%.2f,\"roofline_step_ms\":%.3f,"
        "\"prefill\":{\"tokens\":%lld,\"tokens_per_s\":%.2f,\"seconds\":%.4f,\"peak_fma_fraction\":%.4f},"
        "\"decode_context\":%lld,\"decode\":[%s],\"batch32_over_batch1\":%.3f,\"peak_amx_gflops\":%.2f,"
        "\"prefill_amx_fraction\":%.4f%s}\n",
        c.name.c_str(), cost.weight_type.c_str(), (long long)threads, isa_name.c_str(), to_string(kv), cost.step_bytes,
        bw / 1e9,
        peak / 1e9, roofline_step_s * 1e3, (long long)prompt, prefill_tps, prefill_s, prefill_of_peak,
        (long long)context, d.c_str(), b1 && b32 ? b32->tokens_per_s / b1->tokens_per_s : 0.0, peak_amx / 1e9,
        prefill_of_amx, cmp_json.c_str());
    return 0;
  }
  std::printf("model %s (%s weights): %d layers, %.1f MB of weights read per forward\n", c.name.c_str(),
              cost.weight_type.c_str(), c.n_layer, double(cost.step_bytes) / 1e6);
  std::printf("architecture %s: KV cache %zu bytes per token (%s); pools: %s\n", c.arch.c_str(), kv_bytes_per_token,
              kv_per_page.describe().c_str(), pools_text.c_str());
  if (c.n_expert > 0)
    std::printf("experts: %d routed of %d (+%d shared) per MoE layer after %d dense; a step's weight bytes count the "
                "routed ones\n",
                c.n_expert_used, c.n_expert, c.n_expert_shared, c.n_dense_lead);
  std::printf("threads %lld, kernels %s, kv cache %s; measured in this run (the highest probe): read bandwidth "
              "%.2f GB/s, peak FMA %.1f GFLOP/s\n",
              (long long)threads, isa_name.c_str(), to_string(kv), bw / 1e9, peak / 1e9);
  std::printf("roofline of one decode step (weight bytes / bandwidth): %.2f ms\n\n", roofline_step_s * 1e3);
  // A decode row's roofline is its own: the bandwidth probed right before and after its
  // fastest repetition ("GB/s then").
  std::printf("%-22s %12s %10s %12s %12s %10s\n", "", "tokens/s", "ms/step", "of roofline", "of peak FMA", "GB/s then");
  std::printf("%-22s %12.1f %10.2f %12s %12.3f\n", fmt::format("prefill {} tokens", prompt).c_str(), prefill_tps,
              prefill_s * 1e3, "-", prefill_of_peak);
  for (const auto& r : dec)
    std::printf("%-22s %12.1f %10.2f %12.3f %12.3f %10.2f\n",
                fmt::format("decode batch {} (ctx {})", r.batch, context).c_str(), r.tokens_per_s, r.ms_per_step,
                r.roofline, r.of_peak, r.bandwidth / 1e9);
  std::printf("\ngoals: decode batch 1 >= 0.80 of roofline: %s",
              b1 ? fmt::format("{:.3f}", b1->roofline).c_str() : "n/a");
  std::printf("; batch 32 >= 10x batch 1: %s",
              b1 && b32 ? fmt::format("{:.2f}x", b32->tokens_per_s / b1->tokens_per_s).c_str() : "n/a");
  std::printf("; prefill >= 0.50 of peak FMA: %.3f\n", prefill_of_peak);
  if (!cmp_name.empty()) {
    std::printf("\nthe same run on kernels %s, and %s / %s:\n", cmp_name.c_str(), isa_name.c_str(), cmp_name.c_str());
    std::printf("%-22s %12.1f %10.2fx\n", fmt::format("prefill {} tokens", prompt).c_str(),
                double(prompt) / cmp_prefill_s, cmp_prefill_s / prefill_s);
    for (size_t i = 0; i < cmp_dec.size(); ++i)
      std::printf("%-22s %12.1f %10.2fx\n", fmt::format("decode batch {} (ctx {})", cmp_dec[i].batch, context).c_str(),
                  cmp_dec[i].tokens_per_s, dec[i].tokens_per_s / cmp_dec[i].tokens_per_s);
  }
  if (vs_llama_cpp) {
    std::printf("\nllama.cpp on the same file, %lld threads, kv cache %s (the better of a run before and one after "
                "the above), and Tandem / llama.cpp:\n",
                (long long)threads, to_string(kv));
    std::printf("%-22s %12.1f %10.2fx\n", fmt::format("prefill {} tokens", prompt).c_str(), lc.prefill_tokens_per_s,
                prefill_tps / lc.prefill_tokens_per_s);
    std::printf("%-22s %12.1f %10s\n", fmt::format("decode batch 1 (ctx {})", context).c_str(), lc.decode_tokens_per_s,
                b1 ? fmt::format("{:.2f}x", b1_tps / lc.decode_tokens_per_s).c_str() : "n/a (no batch 1)");
  }
  if (m.isa == cpu_isa::amx)
    std::printf("amx tiles: peak %.1f GFLOP/s (bf16 tile products); prefill uses %.3f of it (%d tile products per "
                "multiply-add of %s weights; other types run the avx512 kernels)\n",
                peak_amx / 1e9, prefill_of_amx, tile_products, cost.weight_type.c_str());
  return 0;
}

}  // namespace tandem::cli
