// Random-weight Llama GGUF writer with a SentencePiece-style vocabulary learned by BPE over a
// built-in corpus (so it works on machines without any model files).
#include "kernels/model/make_model.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstring>
#include <map>
#include <unordered_map>

#include "kernels/base/error.h"
#include "kernels/gguf/gguf.h"
#include "kernels/gguf/half.h"
#include "kernels/cpu/quant_ref.h"
#include "kernels/model/make_model_corpus.h"
#include "kernels/model/quant_mix.h"

namespace tandem {

namespace {

struct preset {
  const char* name;
  int32_t n_embd, n_layer, n_head, n_head_kv, n_ff, n_ctx, n_vocab_target;
};

constexpr preset k_presets[] = {
    {"tiny-15m", 288, 6, 6, 6, 768, 2048, 8000},
    {"small-110m", 768, 12, 12, 12, 2048, 2048, 8000},
    {"micro", 64, 2, 4, 2, 128, 512, 1000},
    // Llama-3.2-1B's shapes (with this vocabulary): for benchmarks, e.g. against llama.cpp.
    {"llama-1b", 2048, 16, 32, 8, 8192, 2048, 8000},
};

const std::string k_space = "\xE2\x96\x81";  // U+2581

struct vocab_out {
  std::vector<std::string> tokens;
  std::vector<float> scores;
  std::vector<int32_t> types;
};

bool is_alpha(char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '\''; }

/// Splits the corpus like SentencePiece would see it: "▁" marks a preceding space, letter runs
/// stay together, digits and punctuation are pieces of their own.
std::map<std::string, int64_t> corpus_words() {
  std::map<std::string, int64_t> words;
  const std::string text = make_model_detail::k_corpus;
  bool space = true;
  for (size_t i = 0; i < text.size();) {
    const char c = text[i];
    if (c == ' ' || c == '\n' || c == '\t') {
      space = true;
      ++i;
      continue;
    }
    std::string w = space ? k_space : "";
    space = false;
    if (is_alpha(c)) {
      while (i < text.size() && is_alpha(text[i])) w += text[i++];
    } else {
      w += text[i++];
    }
    ++words[w];
  }
  // The corpus is small, so widen it with the spellings real text has: Capitalized and
  // UPPER-case forms, and words without the space marker (after punctuation). Variants
  // count once so the corpus' own frequencies still decide the first merges.
  std::map<std::string, int64_t> variants;
  for (auto& [w, n] : words) {
    const bool spaced = w.compare(0, k_space.size(), k_space) == 0;
    const std::string body = spaced ? w.substr(k_space.size()) : w;
    if (body.size() < 2 || !is_alpha(body[0])) continue;
    std::string cap = body, upper = body;
    cap[0] = char(std::toupper(uint8_t(cap[0])));
    for (auto& c : upper) c = char(std::toupper(uint8_t(c)));
    for (const std::string& v : {k_space + cap, k_space + upper, body, cap, k_space + body}) variants[v] += 0;
  }
  for (auto& [v, n] : variants) {
    auto& c = words[v];
    if (c == 0) c = 1;
  }
  return words;
}

/// BPE over the corpus words; returns pieces in merge order plus the initial characters.
vocab_out learn_vocab(int32_t target) {
  vocab_out v;
  v.tokens = {"<unk>", "<s>", "</s>"};
  v.scores = {0, 0, 0};
  v.types = {2, 3, 3};
  for (int b = 0; b < 256; ++b) {
    char buf[8];
    std::snprintf(buf, sizeof buf, "<0x%02X>", b);
    v.tokens.push_back(buf);
    v.scores.push_back(0);
    v.types.push_back(6);
  }
  // symbol table: id -> string
  std::vector<std::string> sym;
  std::unordered_map<std::string, int32_t> sym_id;
  auto intern = [&](const std::string& s) {
    auto [it, fresh] = sym_id.emplace(s, int32_t(sym.size()));
    if (fresh) sym.push_back(s);
    return it->second;
  };
  struct word {
    std::vector<int32_t> s;
    int64_t count;
  };
  std::vector<word> words;
  for (auto& [w, n] : corpus_words()) {
    word x{{}, n};
    for (size_t i = 0; i < w.size();) {
      const size_t len = (uint8_t(w[i]) & 0xE0) == 0xE0 ? 3 : 1;  // "▁" or ASCII
      x.s.push_back(intern(w.substr(i, len)));
      i += len;
    }
    words.push_back(std::move(x));
  }
  std::vector<std::string> chars(sym.begin(), sym.end());
  std::sort(chars.begin(), chars.end());

  std::unordered_map<std::string, bool> in_vocab;
  for (auto& t : v.tokens) in_vocab[t] = true;
  const int32_t budget = target - int32_t(v.tokens.size()) - int32_t(chars.size());
  std::vector<std::string> merged;
  auto key = [](int32_t a, int32_t b) { return (uint64_t(uint32_t(a)) << 32) | uint32_t(b); };
  std::unordered_map<uint64_t, int64_t> counts;
  for (auto& w : words)
    for (size_t i = 0; i + 1 < w.s.size(); ++i) counts[key(w.s[i], w.s[i + 1])] += w.count;
  while (int32_t(merged.size()) < budget) {
    // most frequent pair; ties by the strings so the result does not depend on hashing
    uint64_t best = 0;
    int64_t best_n = 0;
    for (auto& [k, n] : counts) {
      if (n <= 0) continue;
      if (n > best_n) {
        best = k;
        best_n = n;
      } else if (n == best_n) {
        const auto& a = sym[k >> 32], &b = sym[uint32_t(k)];
        const auto& ba = sym[best >> 32], &bb = sym[uint32_t(best)];
        if (std::tie(a, b) < std::tie(ba, bb)) best = k;
      }
    }
    if (best_n == 0) break;  // every word is a single piece
    const int32_t a = int32_t(best >> 32), b = int32_t(uint32_t(best));
    const std::string joined = sym[a] + sym[b];
    const int32_t m = intern(joined);
    if (!in_vocab[joined]) {
      in_vocab[joined] = true;
      merged.push_back(joined);
    }
    for (auto& w : words) {
      bool has = false;
      for (size_t i = 0; i + 1 < w.s.size(); ++i)
        if (w.s[i] == a && w.s[i + 1] == b) {
          has = true;
          break;
        }
      if (!has) continue;
      for (size_t i = 0; i + 1 < w.s.size(); ++i) counts[key(w.s[i], w.s[i + 1])] -= w.count;
      std::vector<int32_t> out;
      out.reserve(w.s.size());
      for (size_t i = 0; i < w.s.size();) {
        if (i + 1 < w.s.size() && w.s[i] == a && w.s[i + 1] == b) {
          out.push_back(m);
          i += 2;
        } else {
          out.push_back(w.s[i++]);
        }
      }
      w.s = std::move(out);
      for (size_t i = 0; i + 1 < w.s.size(); ++i) counts[key(w.s[i], w.s[i + 1])] += w.count;
    }
    counts.erase(best);
  }
  // Merged pieces score -rank so SentencePiece's highest-score-first replays the merges.
  for (size_t r = 0; r < merged.size(); ++r) {
    v.tokens.push_back(merged[r]);
    v.scores.push_back(-float(r));
    v.types.push_back(1);
  }
  for (size_t i = 0; i < chars.size(); ++i) {
    if (in_vocab[chars[i]]) continue;
    in_vocab[chars[i]] = true;
    v.tokens.push_back(chars[i]);
    v.scores.push_back(-float(merged.size() + i));
    v.types.push_back(1);
  }
  return v;
}

/// splitmix64: a small, fast, well-mixed generator whose output is the same everywhere
/// (std::normal_distribution is implementation-defined).
struct rng {
  uint64_t s;
  uint64_t next() {
    uint64_t z = (s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  double uniform() { return double((next() >> 11) + 1) * (1.0 / 9007199254740993.0); }  // (0, 1]
};

uint64_t hash_name(const std::string& s, uint64_t seed) {
  uint64_t h = 1469598103934665603ull ^ seed;
  for (char c : s) h = (h ^ uint8_t(c)) * 1099511628211ull;
  return h;
}

std::vector<float> normal(size_t n, float std_dev, uint64_t seed) {
  std::vector<float> x(n);
  rng r{seed};
  for (size_t i = 0; i < n; i += 2) {
    // Box-Muller: two normals per pair of uniforms
    const double u1 = r.uniform(), u2 = r.uniform();
    const double rad = std::sqrt(-2.0 * std::log(u1));
    x[i] = float(rad * std::cos(6.283185307179586 * u2)) * std_dev;
    if (i + 1 < n) x[i + 1] = float(rad * std::sin(6.283185307179586 * u2)) * std_dev;
  }
  return x;
}

std::vector<uint8_t> encode(const std::vector<float>& x, ggml_type t) {
  std::vector<uint8_t> out(row_bytes(t, int64_t(x.size())));
  switch (t) {
    case ggml_type::f32: std::memcpy(out.data(), x.data(), out.size()); break;
    case ggml_type::f16:
      for (size_t i = 0; i < x.size(); ++i) {
        const uint16_t h = gguf::fp32_to_fp16(x[i]);
        std::memcpy(out.data() + 2 * i, &h, 2);
      }
      break;
    case ggml_type::bf16:
      for (size_t i = 0; i < x.size(); ++i) {
        const uint16_t h = gguf::fp32_to_bf16(x[i]);
        std::memcpy(out.data() + 2 * i, &h, 2);
      }
      break;
    default: out = cpu::quantize_rows(t, x.data(), 1, int64_t(x.size())); break;  // q8_0, q4_0, k-quants
  }
  return out;
}

/// Llama 3.1's per-pair RoPE divisors (scale factor 8, low/high frequency factors 1 and 4,
/// original context 8192): long wavelengths are stretched by the factor, short ones kept, the
/// band between blended smoothly.
std::vector<float> llama3_rope_factors(int head_dim, double base) {
  const double factor = 8.0, low = 1.0, high = 4.0, old_ctx = 8192.0;
  const double low_wavelen = old_ctx / low, high_wavelen = old_ctx / high;
  std::vector<float> out;
  for (int i = 0; i < head_dim; i += 2) {
    const double freq = 1.0 / std::pow(base, double(i) / head_dim);
    const double wavelen = 2.0 * 3.141592653589793 / freq;
    double f = 1.0;
    if (wavelen > low_wavelen) {
      f = factor;
    } else if (wavelen >= high_wavelen) {
      const double smooth = (old_ctx / wavelen - low) / (high - low);
      f = 1.0 / ((1.0 - smooth) / factor + smooth);
    }
    out.push_back(float(f));
  }
  return out;
}

/// DeepSeek-V2's proportions at a preset's width: head parts of at least 32 (the q8_0 block),
/// the latent a quarter of the width, 8 experts of which 2 are used plus 1 shared, each a
/// quarter of the dense FFN, and one leading dense layer.
struct mla_shape {
  int32_t q_lora_rank, kv_lora_rank, nope, rope, v, n_expert, n_used, n_shared, n_ff_exp, n_dense_lead;
};

mla_shape mla_shape_of(const preset& p) {
  auto round32 = [](int32_t n) { return (n + 31) / 32 * 32; };
  const int32_t nope = std::max(32, p.n_embd / p.n_head);
  return mla_shape{.q_lora_rank = round32(p.n_embd / 2),
                   .kv_lora_rank = std::max(64, round32(p.n_embd / 4)),
                   .nope = nope,
                   .rope = nope / 2,
                   .v = nope,
                   .n_expert = 8,
                   .n_used = 2,
                   .n_shared = 1,
                   .n_ff_exp = std::max(32, p.n_ff / 4),
                   .n_dense_lead = std::min(1, p.n_layer - 1)};
}

/// The deepseek2 keys beyond the shared ones (the layout llama.cpp's MLA path reads).
void write_deepseek2_keys(gguf::writer& w, const mla_shape& m) {
  w.set_u32("deepseek2.attention.q_lora_rank", uint32_t(m.q_lora_rank));
  w.set_u32("deepseek2.attention.kv_lora_rank", uint32_t(m.kv_lora_rank));
  w.set_u32("deepseek2.attention.key_length", uint32_t(m.kv_lora_rank + m.rope));
  w.set_u32("deepseek2.attention.value_length", uint32_t(m.kv_lora_rank));
  w.set_u32("deepseek2.attention.key_length_mla", uint32_t(m.nope + m.rope));
  w.set_u32("deepseek2.attention.value_length_mla", uint32_t(m.v));
  w.set_u32("deepseek2.leading_dense_block_count", uint32_t(m.n_dense_lead));
  w.set_u32("deepseek2.expert_count", uint32_t(m.n_expert));
  w.set_u32("deepseek2.expert_used_count", uint32_t(m.n_used));
  w.set_u32("deepseek2.expert_shared_count", uint32_t(m.n_shared));
  w.set_u32("deepseek2.expert_feed_forward_length", uint32_t(m.n_ff_exp));
  w.set_f32("deepseek2.expert_weights_scale", 1.0f);
  w.set_bool("deepseek2.expert_weights_norm", true);
  w.set_u32("deepseek2.expert_gating_func", 1);  // softmax, as DeepSeek-V2
}

}  // namespace

void write_random_llama(const make_model_options& opt, const std::string& path) {
  const preset* p = nullptr;
  for (auto& x : k_presets)
    if (opt.preset == x.name) p = &x;
  if (p == nullptr)
    throw tandem::error(error_kind::failed,
                        "unknown model preset '" + opt.preset + "': use tiny-15m, small-110m, micro or llama-1b");
  if (!is_supported(opt.dtype))
    throw tandem::error(error_kind::failed, "unsupported weight type '" + std::string(to_string(opt.dtype)) +
                                                "' for make-model: use " + std::string(supported_types_list));

  const std::string& arch = opt.arch;
  if (arch != "llama" && arch != "qwen2" && arch != "qwen3" && arch != "gemma2" && arch != "deepseek2")
    throw tandem::error(error_kind::failed, "unknown architecture '" + arch +
                                                "' for make-model: use llama, qwen2, qwen3, gemma2 or deepseek2");
  if (arch == "gemma2" && opt.sliding_window < 1)
    throw tandem::error(error_kind::failed, "the sliding window must be at least 1 token");

  const vocab_out voc = learn_vocab(p->n_vocab_target);
  const int32_t n_vocab = int32_t(voc.tokens.size());
  // Qwen3 decouples the head size from the width (Qwen3-0.6B: 1024 wide, 16 heads of 128):
  // twice the usual size, so a reader that derives it from the width instead of
  // attention.key_length fails.
  const int32_t head_dim = (arch == "qwen3" ? 2 : 1) * p->n_embd / p->n_head;

  gguf::writer w;
  w.set_string("general.architecture", arch);
  w.set_string("general.name", "tandem-random-" + opt.preset);
  w.set_u32("general.alignment", 32);
  w.set_u32("general.file_type", llama_file_type(opt.dtype, opt.q4_k_m));
  w.set_u32(arch + ".context_length", uint32_t(p->n_ctx));
  w.set_u32(arch + ".embedding_length", uint32_t(p->n_embd));
  w.set_u32(arch + ".block_count", uint32_t(p->n_layer));
  w.set_u32(arch + ".feed_forward_length", uint32_t(p->n_ff));
  w.set_u32(arch + ".attention.head_count", uint32_t(p->n_head));
  w.set_u32(arch + ".attention.head_count_kv", uint32_t(arch == "deepseek2" ? 1 : p->n_head_kv));
  w.set_f32(arch + ".attention.layer_norm_rms_epsilon", 1e-5f);
  w.set_f32(arch + ".rope.freq_base", 10000.0f);
  const mla_shape mla = mla_shape_of(*p);
  w.set_u32(arch + ".rope.dimension_count", uint32_t(arch == "deepseek2" ? mla.rope : head_dim));
  w.set_u32(arch + ".vocab_size", uint32_t(n_vocab));
  w.set_string("tokenizer.ggml.model", "llama");
  w.set_array_string("tokenizer.ggml.tokens", voc.tokens);
  w.set_array_f32("tokenizer.ggml.scores", voc.scores);
  w.set_array_i32("tokenizer.ggml.token_type", voc.types);
  if (arch == "qwen3" || arch == "gemma2") {
    w.set_u32(arch + ".attention.key_length", uint32_t(head_dim));
    w.set_u32(arch + ".attention.value_length", uint32_t(head_dim));
  }
  if (arch == "deepseek2") write_deepseek2_keys(w, mla);
  if (opt.yarn_rope) {
    w.set_string(arch + ".rope.scaling.type", "yarn");
    w.set_f32(arch + ".rope.scaling.factor", 4.0f);
    w.set_u32(arch + ".rope.scaling.original_context_length", uint32_t(p->n_ctx / 4));
    if (arch == "deepseek2") w.set_f32(arch + ".rope.scaling.yarn_log_multiplier", 0.0707f);
  }
  if (arch == "gemma2") {  // Gemma 2's values, but a small window
    w.set_u32("gemma2.attention.sliding_window", uint32_t(opt.sliding_window));
    w.set_f32("gemma2.attn_logit_softcapping", 50.0f);
    w.set_f32("gemma2.final_logit_softcapping", 30.0f);
  }
  w.set_u32("tokenizer.ggml.bos_token_id", 1);
  w.set_u32("tokenizer.ggml.eos_token_id", 2);
  w.set_u32("tokenizer.ggml.unknown_token_id", 0);
  w.set_bool("tokenizer.ggml.add_bos_token", true);
  w.set_bool("tokenizer.ggml.add_eos_token", false);
  if (!opt.chat_template.empty()) w.set_string("tokenizer.chat_template", opt.chat_template);
  if (opt.fim_pre >= 0) w.set_u32("tokenizer.ggml.fim_pre_token_id", uint32_t(opt.fim_pre));
  if (opt.fim_suf >= 0) w.set_u32("tokenizer.ggml.fim_suf_token_id", uint32_t(opt.fim_suf));
  if (opt.fim_mid >= 0) w.set_u32("tokenizer.ggml.fim_mid_token_id", uint32_t(opt.fim_mid));

  const float std_dev = 0.02f;
  auto matrix = [&](const std::string& name, int64_t ne0, int64_t ne1, int64_t ne2 = 1) {
    const auto x = normal(size_t(ne0 * ne1 * ne2), std_dev, hash_name(name, opt.seed));
    const ggml_type t = weight_type(opt.dtype, opt.q4_k_m, name, ne0, p->n_layer, !opt.tied_output);
    if (ne2 == 1)
      w.add_tensor(name, t, {ne0, ne1}, encode(x, t));
    else
      w.add_tensor(name, t, {ne0, ne1, ne2}, encode(x, t));
  };
  // Kept f32 as llama.cpp's quantizer keeps it: the expert choice is a comparison of its outputs.
  auto router = [&](const std::string& name, int64_t ne0, int64_t ne1) {
    w.add_tensor(name, ggml_type::f32, {ne0, ne1}, encode(normal(size_t(ne0 * ne1), 0.5f, hash_name(name, opt.seed)),
                                                          ggml_type::f32));
  };
  auto norm = [&](const std::string& name, int64_t n) {
    w.add_tensor(name, ggml_type::f32, {n}, encode(std::vector<float>(size_t(n), 1.0f), ggml_type::f32));
  };
  auto vector = [&](const std::string& name, int64_t n) {
    const auto x = normal(size_t(n), 0.5f, hash_name(name, opt.seed));
    w.add_tensor(name, ggml_type::f32, {n}, encode(x, ggml_type::f32));
  };
  auto scale = [&](const std::string& name, int64_t n) {
    auto x = normal(size_t(n), 0.2f, hash_name(name, opt.seed));
    for (float& v : x) v += 1.0f;
    w.add_tensor(name, ggml_type::f32, {n}, encode(x, ggml_type::f32));
  };
  const int64_t e = p->n_embd, qd = int64_t(head_dim) * p->n_head, kv = int64_t(head_dim) * p->n_head_kv,
                ff = p->n_ff;
  matrix("token_embd.weight", e, n_vocab);
  for (int32_t l = 0; l < p->n_layer && arch == "deepseek2"; ++l) {
    const std::string b = "blk." + std::to_string(l) + ".";
    norm(b + "attn_norm.weight", e);
    matrix(b + "attn_q_a.weight", e, mla.q_lora_rank);
    scale(b + "attn_q_a_norm.weight", mla.q_lora_rank);
    matrix(b + "attn_q_b.weight", mla.q_lora_rank, int64_t(p->n_head) * (mla.nope + mla.rope));
    matrix(b + "attn_kv_a_mqa.weight", e, mla.kv_lora_rank + mla.rope);
    scale(b + "attn_kv_a_norm.weight", mla.kv_lora_rank);
    matrix(b + "attn_k_b.weight", mla.nope, mla.kv_lora_rank, p->n_head);
    matrix(b + "attn_v_b.weight", mla.kv_lora_rank, mla.v, p->n_head);
    matrix(b + "attn_output.weight", int64_t(p->n_head) * mla.v, e);
    norm(b + "ffn_norm.weight", e);
    if (l < mla.n_dense_lead) {
      matrix(b + "ffn_gate.weight", e, ff);
      matrix(b + "ffn_up.weight", e, ff);
      matrix(b + "ffn_down.weight", ff, e);
      continue;
    }
    router(b + "ffn_gate_inp.weight", e, mla.n_expert);
    matrix(b + "ffn_gate_exps.weight", e, mla.n_ff_exp, mla.n_expert);
    matrix(b + "ffn_up_exps.weight", e, mla.n_ff_exp, mla.n_expert);
    matrix(b + "ffn_down_exps.weight", mla.n_ff_exp, e, mla.n_expert);
    matrix(b + "ffn_gate_shexp.weight", e, int64_t(mla.n_ff_exp) * mla.n_shared);
    matrix(b + "ffn_up_shexp.weight", e, int64_t(mla.n_ff_exp) * mla.n_shared);
    matrix(b + "ffn_down_shexp.weight", int64_t(mla.n_ff_exp) * mla.n_shared, e);
  }
  for (int32_t l = 0; l < p->n_layer && arch != "deepseek2"; ++l) {
    const std::string b = "blk." + std::to_string(l) + ".";
    norm(b + "attn_norm.weight", e);
    matrix(b + "attn_q.weight", e, qd);
    matrix(b + "attn_k.weight", e, kv);
    matrix(b + "attn_v.weight", e, kv);
    if (arch == "qwen2") {  // small random biases, so a loader that drops them shows
      vector(b + "attn_q.bias", qd);
      vector(b + "attn_k.bias", kv);
      vector(b + "attn_v.bias", kv);
    }
    if (arch == "qwen3") {  // norm weights around 1, different per element
      scale(b + "attn_q_norm.weight", head_dim);
      scale(b + "attn_k_norm.weight", head_dim);
    }
    matrix(b + "attn_output.weight", qd, e);
    if (arch == "gemma2") scale(b + "post_attention_norm.weight", e);
    norm(b + "ffn_norm.weight", e);
    matrix(b + "ffn_gate.weight", e, ff);
    matrix(b + "ffn_up.weight", e, ff);
    matrix(b + "ffn_down.weight", ff, e);
    if (arch == "gemma2") scale(b + "post_ffw_norm.weight", e);
  }
  if (opt.llama3_rope) {
    if (arch != "llama") throw tandem::error(error_kind::failed, "Llama 3 rope scaling is for --arch llama only");
    w.add_tensor("rope_freqs.weight", ggml_type::f32, {head_dim / 2},
                 encode(llama3_rope_factors(head_dim, 10000.0), ggml_type::f32));
  }
  norm("output_norm.weight", e);
  if (!opt.tied_output) matrix("output.weight", e, n_vocab);
  w.write(path);
}

}  // namespace tandem
