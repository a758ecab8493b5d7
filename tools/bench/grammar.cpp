// tandem bench grammar: the cost of a grammar-constrained step (response_format) next to the
// forward step it rides on. A batch of sequences walks a JSON schema on the model's own
// vocabulary: each step masks every sequence (kernels/grammar: trie walk, cached per state),
// draws a token from random logits under the mask and advances; a sequence that completes
// starts over as a new request on the same (cached) grammar, as a server would see them. The
// batched decode step of the same model is timed in the same run, and the ratio printed.
#include <fmt/format.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "kernels/base/error.h"
#include "kernels/gguf/gguf.h"
#include "kernels/grammar/sessions.h"
#include "kernels/grammar/vocab.h"
#include "kernels/model/sampler.h"
#include "kernels/tokenizer/tokenizer.h"
#include "tools/bench/bench_flags.h"
#include "tools/bench/modes.h"
#include "tools/tandem/flags.h"

namespace tandem::cli {

namespace {

/// Nested object, enum, array of integers, bounded strings, a number and a boolean: what a
/// structured-output client typically asks for.
constexpr const char* default_schema = R"({
  "type": "object",
  "properties": {
    "name": {"type": "string", "maxLength": 24},
    "kind": {"enum": ["person", "place", "thing"]},
    "age": {"type": "integer"},
    "scores": {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 4},
    "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                "zip": {"type": "integer"}}, "required": ["city", "zip"], "additionalProperties": false},
    "weight": {"type": "number"},
    "active": {"type": "boolean"}
  },
  "required": ["name", "kind", "age", "scores", "address", "weight", "active"],
  "additionalProperties": false
})";

double ms_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

int bench_grammar(args a) {
  flags f;
  f.opt("model", "GGUF model file (required): its tokenizer gives the vocabulary, its forward pass the comparison")
      .opt("schema", "JSON schema file (default: a nested object with enum, array, integer, string fields)", "")
      .opt("json-object", "use response_format json_object instead of a schema: on|off", "off")
      .opt("batch", "sequences masked per step", "16")
      .opt("steps", "timed steps", "200")
      .opt("threads", "kernel threads of the forward pass", "2")
      .opt("context", "tokens in each sequence's KV for the forward step", "64")
      .opt("seed", "random logits and draws", "1");
  if (!parse_bench_flags(f, a, "grammar --model FILE [options]")) return 0;
  const std::string path = bench_model_path(f);
  const int64_t batch = f.num("batch"), steps = f.num("steps"), threads = f.num("threads"), context = f.num("context");
  if (batch < 1 || batch > 1024 || steps < 1) throw tandem::error("--batch must be in [1, 1024] and --steps positive");
  grammar_spec spec;
  if (f.str("json-object") == "on") {
    spec.kind = grammar_kind::json_object;
  } else {
    spec.kind = grammar_kind::json_schema;
    spec.source = default_schema;
    if (!f.str("schema").empty()) {
      std::ifstream in(f.str("schema"));
      if (!in) throw tandem::error("cannot read --schema " + f.str("schema"));
      std::stringstream ss;
      ss << in.rdbuf();
      spec.source = ss.str();
    }
  }

  const gguf::file file = gguf::file::open(path);
  const auto tok = tokenizer::from_gguf(file);
  auto t0 = std::chrono::steady_clock::now();
  auto vocab = grammar::make_grammar_vocab(*tok);
  const double trie_ms = ms_since(t0);
  grammar::grammar_sessions gs(vocab);
  t0 = std::chrono::steady_clock::now();
  gs.automaton_for(spec);
  const double compile_ms = ms_since(t0);

  const int32_t n_vocab = tok->n_vocab();
  std::mt19937_64 rng(uint64_t(f.num("seed")));
  std::normal_distribution<float> normal(0.0f, 2.0f);
  std::vector<float> noise(size_t(n_vocab) * 8);
  for (auto& x : noise) x = normal(rng);
  std::vector<std::string> ids(static_cast<size_t>(batch));
  std::vector<std::vector<int32_t>> gen(static_cast<size_t>(batch));
  int64_t next_id = 0, completed = 0, tokens = 0;
  for (auto& id : ids) id = fmt::format("seq{}", next_id++);
  std::vector<float> row(static_cast<size_t>(n_vocab));
  std::vector<double> step_ms;
  for (int64_t s = 0; s < steps; ++s) {
    double masked = 0;
    for (int64_t b = 0; b < batch; ++b) {
      // Random logits (a window of the noise buffer), the time of the mask only.
      const size_t off = size_t(rng() % 8) * size_t(n_vocab);
      std::copy(noise.begin() + off, noise.begin() + off + n_vocab, row.begin());
      auto m0 = std::chrono::steady_clock::now();
      gs.constrain(ids[size_t(b)], spec, gen[size_t(b)], row);
      masked += ms_since(m0);
      sampling_params p;
      p.seed = rng();
      const int32_t t = sampler(p).sample(row);
      auto m1 = std::chrono::steady_clock::now();
      gs.accepted(ids[size_t(b)], t);
      masked += ms_since(m1);
      ++tokens;
      if (t == vocab->eos_id() || gen[size_t(b)].size() > 512) {
        ++completed;
        ids[size_t(b)] = fmt::format("seq{}", next_id++);
        gen[size_t(b)].clear();
      } else {
        gen[size_t(b)].push_back(t);
      }
    }
    step_ms.push_back(masked);
  }
  double total = 0;
  for (double x : step_ms) total += x;
  const double mean_ms = total / double(step_ms.size());

  bench_model_setup setup;
  setup.threads = int32_t(threads);
  const double tps = bench_model_decode_tokens_per_s(path, setup, batch, context);
  const double fwd_ms = 1000.0 * double(batch) / tps;
  const auto& as = gs.automaton_for(spec)->stats();
  std::printf("grammar bench: %s, vocabulary %d tokens, %s, batch %lld, %lld steps\n", path.c_str(), n_vocab,
              spec.kind == grammar_kind::json_object ? "json_object" : "json_schema", (long long)batch,
              (long long)steps);
  std::printf("  vocabulary trie %.1f ms, grammar compile %.2f ms (once per worker and grammar)\n", trie_ms, compile_ms);
  std::printf("  mask per step (batch %lld): mean %.3f ms, p50 %.3f ms, p99 %.3f ms, first step %.3f ms\n",
              (long long)batch, mean_ms, percentile(step_ms, 50), percentile(step_ms, 99), step_ms.front());
  // The second half: the masks of the states a schema keeps reaching are cached by then.
  const std::vector<double> warm(step_ms.begin() + ptrdiff_t(step_ms.size() / 2), step_ms.end());
  double warm_total = 0;
  for (double x : warm) warm_total += x;
  std::printf("  second half of the steps: mean %.3f ms, p99 %.3f ms\n", warm_total / double(warm.size()),
              percentile(warm, 99));
  std::printf("  masks: %lld cached hits, %lld computed (trie nodes walked %lld); %lld documents completed, %lld tokens\n",
              (long long)as.mask_hits, (long long)as.mask_misses, (long long)as.trie_nodes_walked, (long long)completed,
              (long long)tokens);
  std::printf("  forward decode step (batch %lld, context %lld, %lld threads): %.3f ms\n", (long long)batch,
              (long long)context, (long long)threads, fwd_ms);
  std::printf("  mask / forward: mean %.4f, p99 %.4f (second half: mean %.4f, p99 %.4f)\n", mean_ms / fwd_ms,
              percentile(step_ms, 99) / fwd_ms, warm_total / double(warm.size()) / fwd_ms, percentile(warm, 99) / fwd_ms);
  return 0;
}

}  // namespace tandem::cli
