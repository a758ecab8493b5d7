#pragma once
/// The sub-modes of `tandem bench`; each takes the arguments after its name. One file per
/// mode (cmd_bench_<mode>.cpp); cmd_bench.cpp dispatches by name.
#include <cstdint>
#include <string>

#include <algorithm>
#include <cstdlib>
#include <sstream>
#include <vector>

#include "tools/tandem/commands.h"

namespace tandem::cli {

int bench_model(args a);          ///< kernel throughput vs the measured roofline
int bench_control_plane(args a);  ///< CPU per generated token of the actors, null model
int bench_cache(args a);          ///< prefix reuse across tiers (bench_cache.cpp)
int bench_transfer(args a);       ///< KV page transfer over UCX (bench_transfer.cpp)
int bench_serve(args a);          ///< HTTP load generator: TTFT/ITL/goodput (cmd_bench_serve.cpp)
int bench_burst(args a);          ///< the overload incident: unbounded vs bounded under a 3x burst (cmd_bench_burst.cpp)
int bench_grammar(args a);        ///< grammar mask per step vs the forward step (grammar.cpp)
int bench_soak(args a);           ///< sustained overload: bounded RSS, mailboxes and answers (cmd_bench_soak.cpp)
/// The model settings a benchmark runs with: [model] kernels and kv_cache_dtype names.
struct bench_model_setup {
  int32_t threads = 1;
  std::string kernels = "best";
  std::string kv_cache_dtype = "f32";
};
/// Batched decode tokens/s of `model` at `batch` with `context` tokens cached (bench model's loop).
double bench_model_decode_tokens_per_s(const std::string& model, const bench_model_setup& setup, int64_t batch,
                                       int64_t context);
/// Seconds to prefill `seqs` prompts of `prompt` tokens in forward passes of at most
/// `chunk_tokens` tokens, packed and split across passes as the prefill scheduler does
/// (the fastest of 3 runs).
double bench_model_prefill_s(const std::string& model, const bench_model_setup& setup, int64_t seqs, int64_t prompt,
                             int64_t chunk_tokens);

/// The `p`-th percentile (0..100) of `v`, interpolated between the two nearest ranks; 0 if
/// `v` is empty. Every benchmark reports latencies with this one definition.
inline double percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const double idx = p / 100.0 * double(v.size() - 1);
  const size_t lo = size_t(idx), hi = std::min(lo + 1, v.size() - 1);
  return v[lo] + (v[hi] - v[lo]) * (idx - double(lo));
}

/// A metric's value summed over its series in a node's /metrics text (0 if absent); `name`
/// matches whole (`x` is not `x_total`), so a histogram's `_sum` or `_count` is asked by name.
inline double metric_sum(const std::string& text, const std::string& name) {
  std::istringstream in(text);
  std::string line;
  double v = 0;
  while (std::getline(in, line)) {
    if (line.rfind(name, 0) != 0) continue;
    const char next = line.size() > name.size() ? line[name.size()] : '\0';
    if (next != ' ' && next != '{') continue;
    v += std::strtod(line.c_str() + line.rfind(' ') + 1, nullptr);
  }
  return v;
}

}  // namespace tandem::cli
