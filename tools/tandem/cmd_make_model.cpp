// tandem make-model: writes a random-weight GGUF of any architecture Tandem loads (for tests, benchmarks and demos).
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "kernels/base/error.h"
#include "kernels/gguf/gguf.h"
#include "kernels/model/make_model.h"
#include "tools/tandem/commands.h"
#include "tools/tandem/flags.h"

namespace tandem::cli {

int make_model(args a) {
  flags f;
  f.opt("preset", "model size: tiny-15m | small-110m | micro | llama-1b (Llama-3.2-1B shapes, ~1B parameters)", "tiny-15m")
      .opt("dtype", "type of the weight matrices: f32 | f16 | bf16 | q8_0 | q4_0 | q4_k | q5_k | q6_k | q4_k_m (llama.cpp's "
           "Q4_K_M mix); norms stay f32, k-quants fall back to q8_0 where 256 does not divide a row", "f16")
      .opt("arch", "general.architecture: llama | qwen2 | qwen3 | gemma2 | deepseek2", "llama")
      .opt("sliding-window", "gemma2 only: tokens the sliding-window layers see", "32")
      .opt("rope-scaling",
           "none | llama3 (llama only: writes rope_freqs.weight, Llama 3.1 factors) | yarn (factor 4 over a quarter "
           "of the context; deepseek2 also DeepSeek-V2's log multiplier)",
           "none")
      .opt("seed", "random seed of the weights", "1")
      .opt("chat-template", "a Jinja chat template file to write as tokenizer.chat_template (e.g. one of shared/chat-templates)")
      .opt("fim-tokens",
           "PRE,SUF,MID: token ids to write as tokenizer.ggml.fim_pre/suf/mid_token_id (fill-in-the-middle, "
           "for completions `suffix`; any ids of the vocabulary)")
      .opt("out", "output .gguf path (required)")
      .sw("untied", "write a separate output.weight instead of reusing token_embd.weight");
  if (!f.parse(a)) {
    std::printf("usage: tandem make-model --out FILE [options]\n\n%s", f.help().c_str());
    return 0;
  }
  if (!f.positional().empty())
    throw tandem::error("unexpected argument '" + f.positional().front() + "': pass the output path as --out FILE");
  const std::string out = f.str("out");
  if (out.empty()) throw tandem::error("missing --out FILE: say where to write the model");

  make_model_options opt;
  opt.preset = f.str("preset");
  opt.arch = f.str("arch");
  const int64_t window = f.num("sliding-window");
  if (window < 1 || window > (int64_t(1) << 30))
    throw tandem::error("--sliding-window must be a positive number of tokens, got " + std::to_string(window));
  opt.sliding_window = int32_t(window);
  const std::string rs = f.str("rope-scaling");
  if (rs != "none" && rs != "llama3" && rs != "yarn")
    throw tandem::error("unknown --rope-scaling '" + rs + "': use none, llama3 or yarn");
  opt.llama3_rope = rs == "llama3";
  opt.yarn_rope = rs == "yarn";
  const std::string dt = f.str("dtype");
  if (dt == "f32") opt.dtype = ggml_type::f32;
  else if (dt == "f16") opt.dtype = ggml_type::f16;
  else if (dt == "bf16") opt.dtype = ggml_type::bf16;
  else if (dt == "q8_0") opt.dtype = ggml_type::q8_0;
  else if (dt == "q4_0") opt.dtype = ggml_type::q4_0;
  else if (dt == "q4_k") opt.dtype = ggml_type::q4_K;
  else if (dt == "q5_k") opt.dtype = ggml_type::q5_K;
  else if (dt == "q6_k") opt.dtype = ggml_type::q6_K;
  else if (dt == "q4_k_m") opt.q4_k_m = true;
  else throw tandem::error("unknown --dtype '" + dt + "': use f32, f16, bf16, q8_0, q4_0, q4_k, q5_k, q6_k or q4_k_m");
  const int64_t seed = f.num("seed");
  if (seed < 0) throw tandem::error("--seed must be >= 0, got " + std::to_string(seed));
  opt.seed = uint64_t(seed);
  opt.tied_output = !f.on("untied");
  if (const std::string ct = f.str("chat-template"); !ct.empty()) {
    std::ifstream in(ct, std::ios::binary);
    if (!in) throw tandem::error("--chat-template: cannot read '" + ct + "'; pass a readable Jinja template file");
    std::stringstream ss;
    ss << in.rdbuf();
    opt.chat_template = ss.str();
    if (opt.chat_template.empty()) throw tandem::error("--chat-template: '" + ct + "' is empty");
  }

  if (const std::string fim = f.str("fim-tokens"); !fim.empty()) {
    int32_t ids[3] = {-1, -1, -1};
    size_t at = 0;
    for (int k = 0; k < 3; ++k) {
      const size_t end = k < 2 ? fim.find(',', at) : fim.size();
      if (end == std::string::npos) throw tandem::error("--fim-tokens '" + fim + "': give three ids, PRE,SUF,MID");
      try {
        ids[k] = std::stoi(fim.substr(at, end - at));
      } catch (const std::exception&) {
        throw tandem::error("--fim-tokens '" + fim + "': '" + fim.substr(at, end - at) + "' is not a token id");
      }
      if (ids[k] < 0) throw tandem::error("--fim-tokens '" + fim + "': ids must be >= 0");
      at = end + 1;
    }
    opt.fim_pre = ids[0], opt.fim_suf = ids[1], opt.fim_mid = ids[2];
  }

  const auto t0 = std::chrono::steady_clock::now();
  write_random_llama(opt, out);
  const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();

  // Read it back: a summary the user can check, and proof the file parses.
  const auto g = gguf::file::open(out);
  int64_t params = 0;
  for (auto& t : g.tensors()) {
    int64_t n = 1;
    for (int64_t d : t.dims) n *= d;
    params += n;
  }
  std::printf("wrote %s: %s preset %s, %s, %zu tensors, %.1fM parameters, vocab %u, %.1f MiB in %.0f ms\n",
              out.c_str(), opt.arch.c_str(), opt.preset.c_str(), dt.c_str(), g.tensors().size(), double(params) / 1e6,
              g.get_u32(opt.arch + ".vocab_size"), double(std::filesystem::file_size(out)) / (1024.0 * 1024.0), ms);
  return 0;
}

}  // namespace tandem::cli
