#pragma once
/// llama.cpp's speed on the same GGUF file, for `tandem bench model --compare-llama-cpp`: runs
/// tests/reference/llama_cpp/greedy.mjs (node-llama-cpp's prebuilt CPU llama.cpp) in a child
/// process with the same thread count and the same prefill and decode shapes.
#include <cstdint>
#include <string>

namespace tandem::cli {

struct llama_cpp_speed {
  double prefill_tokens_per_s = 0;  ///< one sequence of `prompt` random tokens, the best of 5 runs
  double decode_tokens_per_s = 0;   ///< batch 1 after `context` tokens, the best of 3 x `steps` steps
};

/// Where greedy.mjs and its node_modules are unless --llama-cpp-dir says otherwise.
std::string default_llama_cpp_dir();

/// Throws tandem::error saying what to run (npm ci in `dir`) unless greedy.mjs and its npm
/// packages are in `dir`.
void require_llama_cpp(const std::string& dir);

/// Runs the reference's bench mode once, with a KV cache of `kv_cache_dtype` (f32 or f16);
/// throws tandem::error with node's exit status and what to do (npm ci in `dir`) when it fails
/// or prints no speeds.
llama_cpp_speed run_llama_cpp_bench(const std::string& dir, const std::string& model, int32_t threads, int64_t prompt,
                                    int64_t context, int64_t steps, const std::string& kv_cache_dtype);

}  // namespace tandem::cli
