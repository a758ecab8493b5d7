// Tandem against an independent implementation: llama.cpp, through node-llama-cpp 3.22.1's
// prebuilt CPU binary (tests/reference/llama_cpp, installed by tests/run.sh). The same GGUF
// files and prompts must give the same prompt token ids and the same greedy tokens, with
// logits that agree within the rounding the two sides' different arithmetic explains.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include "kernels/gguf/gguf.h"
#include "kernels/model/llama.h"
#include "kernels/tokenizer/tokenizer.h"
#include "tests/e2e/process.h"

using namespace tandem;
using namespace tandem::e2e;
namespace fs = std::filesystem;

namespace {

constexpr int32_t n_greedy = 16;

const std::vector<std::string> k_prompts = {
    "Once upon a time",
    "The quick brown fox jumps over the lazy dog.",
    "Hello, world! 123 + 456 = 579",
    "  two leading spaces,\ta tab and a\nnewline",
};

/// Files `tandem make-model` writes for the comparison: its flags after --out. A dtype joins
/// this list when make-model writes it (and Tandem loads it).
const std::vector<std::vector<std::string>> k_made_models = {
    {"--preset", "tiny-15m", "--dtype", "f32"},
    {"--preset", "tiny-15m", "--dtype", "f16"},
    {"--preset", "tiny-15m", "--dtype", "bf16"},
    {"--preset", "tiny-15m", "--dtype", "q8_0"},
    // Low-bit types: tiny-15m's 288-wide rows are q4_0 or (k-quants) q8_0, its 768-wide
    // ffn_down the k-quant, so blk.0.attn_q decides the tolerance.
    {"--preset", "tiny-15m", "--dtype", "q4_0"},
    {"--preset", "tiny-15m", "--dtype", "q4_k"},
    {"--preset", "tiny-15m", "--dtype", "q5_k"},
    {"--preset", "tiny-15m", "--dtype", "q6_k"},
    {"--preset", "tiny-15m", "--dtype", "q4_k_m"},
    {"--preset", "tiny-15m", "--arch", "qwen2", "--dtype", "f32"},
    {"--preset", "tiny-15m", "--arch", "qwen3", "--dtype", "f32"},
    {"--preset", "tiny-15m", "--arch", "llama", "--rope-scaling", "llama3", "--dtype", "f32"},
    {"--preset", "tiny-15m", "--arch", "qwen3", "--dtype", "f16"},
    {"--preset", "tiny-15m", "--arch", "gemma2", "--sliding-window", "8", "--dtype", "f32"},
    {"--preset", "tiny-15m", "--arch", "deepseek2", "--dtype", "f32"},
    {"--preset", "tiny-15m", "--arch", "deepseek2", "--dtype", "q8_0"},
    {"--preset", "tiny-15m", "--arch", "deepseek2", "--rope-scaling", "yarn", "--dtype", "f32"},
    {"--preset", "tiny-15m", "--arch", "qwen2", "--rope-scaling", "yarn", "--dtype", "f32"},
};

/// How far Tandem's logits may be from llama.cpp's, by weight type. The two sides round
/// differently: before an f16, bf16 or q8_0 matmul llama.cpp converts the activations to
/// f16, bf16 or 8-bit blocks (ggml's vec_dot_type), where Tandem keeps them in f32; and each
/// sums in its own order. Largest differences measured on these models and prompts (logits
/// around 1-2): f32 7e-7, f16 5e-4, bf16 3.5e-3, q8_0 1.2e-2; the bounds are 4-7x those. A
/// wrong rope, norm, scale or dequantization moves logits by 0.1 and more.
float logit_tolerance(const std::string& weight_type) {
  if (weight_type == "f32") return 5e-6f;
  if (weight_type == "f16") return 2.5e-3f;
  if (weight_type == "bf16") return 1.5e-2f;
  return 5e-2f;  // q8_0 and the k-quants: llama.cpp quantizes the activations to 8 bits
}

fs::path reference_dir() { return fs::path(TANDEM_SOURCE_DIR) / "tests/reference/llama_cpp"; }

std::string slurp(const fs::path& p) {
  std::ifstream in(p);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> out;
  std::istringstream in(s);
  for (std::string w; in >> w;) out.push_back(w);
  return out;
}

/// Runs `node greedy.mjs ARGS...`; returns its stdout, failing the test (with its stderr)
/// when it does not exit 0.
std::string run_reference(const std::vector<std::string>& args, const fs::path& tmp) {
  const bool installed = fs::exists(reference_dir() / "node_modules/node-llama-cpp") &&
                         fs::exists(reference_dir() / "node_modules/@node-llama-cpp/linux-x64");
  REQUIRE_MESSAGE(installed,
                  "llama.cpp's npm packages are missing: run tests/run.sh, or `npm ci --omit=optional` in "
                  "tests/reference/llama_cpp");
  std::vector<std::string> argv{"/usr/bin/env", "node", (reference_dir() / "greedy.mjs").string()};
  argv.insert(argv.end(), args.begin(), args.end());
  const std::string err_path = (tmp / "node.err").string();
  child node(argv, {}, err_path);
  const std::string out = node.read_all(std::chrono::seconds(120));
  const int rc = node.wait(std::chrono::seconds(10));
  INFO("node stderr:\n" << slurp(err_path));
  REQUIRE(rc == 0);
  return out;
}

/// One prompt's run on one side: its token ids, the greedy tokens and, before each of them,
/// logits (Tandem: all of them; llama.cpp: its largest few, as id and value).
struct side_run {
  std::vector<int32_t> prompt, greedy;
  std::vector<std::vector<float>> logits;
  std::vector<std::vector<std::pair<int32_t, float>>> top;
};

std::vector<side_run> run_llama_cpp(const std::string& model, const fs::path& tmp) {
  std::vector<std::string> args{"greedy", "--model", model, "--tokens", std::to_string(n_greedy), "--top", "8"};
  for (const auto& p : k_prompts) args.insert(args.end(), {"--prompt", p});
  const std::string out = run_reference(args, tmp);
  std::vector<side_run> runs(k_prompts.size());
  std::istringstream lines(out);
  for (std::string line; std::getline(lines, line);) {
    const auto w = split(line);
    if (w.size() < 2) continue;
    const size_t p = std::stoul(w[1]);
    REQUIRE(p < runs.size());
    if (w[0] == "prompt" || w[0] == "greedy") {
      auto& ids = w[0] == "prompt" ? runs[p].prompt : runs[p].greedy;
      for (size_t i = 2; i < w.size(); ++i) ids.push_back(std::stoi(w[i]));
    } else if (w[0] == "top") {
      std::vector<std::pair<int32_t, float>> t;
      for (size_t i = 3; i < w.size(); ++i) {
        const size_t colon = w[i].find(':');
        t.emplace_back(std::stoi(w[i].substr(0, colon)), std::stof(w[i].substr(colon + 1)));
      }
      runs[p].top.push_back(std::move(t));
    }
  }
  for (const auto& r : runs) {
    INFO("reference output:\n" << out);
    REQUIRE(r.greedy.size() == size_t(n_greedy));
    REQUIRE(r.top.size() == size_t(n_greedy));
  }
  return runs;
}

/// Tandem's greedy run: the prompt in one forward, then one token per forward (argmax).
side_run run_tandem(llama_model& model, const tokenizer& tok, const std::string& prompt) {
  side_run r;
  r.prompt = tok.encode(prompt, true);
  const int32_t page = 16, n_pages = int32_t(r.prompt.size() + n_greedy + page - 1) / page;
  kv_pool pool(model.layout(page), n_pages);
  std::vector<int32_t> pages(static_cast<size_t>(n_pages));
  for (int32_t i = 0; i < n_pages; ++i) pages[size_t(i)] = i;
  std::vector<float> logits;
  batch_seq s{r.prompt, 0, pages, true};
  model.forward(std::span(&s, 1), pool, logits);
  int32_t pos = int32_t(r.prompt.size());
  for (int32_t i = 0; i < n_greedy; ++i) {
    r.logits.push_back(logits);
    const int32_t next = int32_t(std::max_element(logits.begin(), logits.end()) - logits.begin());
    r.greedy.push_back(next);
    if (i + 1 == n_greedy) break;
    batch_seq d{std::span(&next, 1), pos++, pages, true};
    model.forward(std::span(&d, 1), pool, logits);
  }
  return r;
}

std::string ids_text(const std::vector<int32_t>& ids) {
  std::string s;
  for (int32_t id : ids) s += (s.empty() ? "" : " ") + std::to_string(id);
  return s;
}

/// Runs both sides on `path` and checks them. Tokens must be equal at every position; the
/// one exception is a near-tie: where llama.cpp's two candidates are within twice the logit
/// tolerance, Tandem may pick the other (the continuations then differ, so the comparison of
/// that prompt ends there). Logits of llama.cpp's top ids must agree within the tolerance.
void compare_with_llama_cpp(const std::string& path, const fs::path& tmp) {
  const auto f = gguf::file::open(path);
  const auto tok = tokenizer::from_gguf(f);
  const auto model = llama_model::load(f);
  // The type that decides the tolerance: the first layer's q projection (deepseek2's q LoRA
  // down-projection).
  const gguf::tensor_info* q = f.find_tensor("blk.0.attn_q.weight");
  if (q == nullptr) q = f.find_tensor("blk.0.attn_q_a.weight");
  REQUIRE(q != nullptr);
  const std::string type(to_string(q->type));
  // GELU models: llama.cpp's GELU reads a table of f16 values (GGML_GELU_FP16), ~5e-4 relative
  // per activation where Tandem computes tanh in f32; gemma2 f32 differs by up to 3.3e-4.
  const std::string arch_name = f.get_string("general.architecture");
  const float tol = arch_name == "gemma2" ? std::max(logit_tolerance(type), 1.5e-3f) : logit_tolerance(type);
  const auto want = run_llama_cpp(path, tmp);
  int compared = 0, near_ties = 0;
  float worst = 0;
  for (size_t p = 0; p < k_prompts.size(); ++p) {
    CAPTURE(path);
    CAPTURE(k_prompts[p]);
    const side_run got = run_tandem(*model, *tok, k_prompts[p]);
    INFO("prompt ids: tandem " << ids_text(got.prompt) << " / llama.cpp " << ids_text(want[p].prompt));
    REQUIRE(got.prompt == want[p].prompt);
    INFO("greedy: tandem " << ids_text(got.greedy) << " / llama.cpp " << ids_text(want[p].greedy));
    for (int32_t i = 0; i < n_greedy; ++i) {
      CAPTURE(i);
      const auto& top = want[p].top[size_t(i)];
      const auto& mine = got.logits[size_t(i)];
      for (const auto& [id, v] : top) {
        const float d = std::fabs(mine[size_t(id)] - v);
        worst = std::max(worst, d);
        INFO("token " << id << ": tandem logit " << mine[size_t(id)] << ", llama.cpp " << v << " (" << type
                      << " tolerance " << tol << ")");
        CHECK(d <= tol);
      }
      ++compared;
      if (got.greedy[size_t(i)] == want[p].greedy[size_t(i)]) continue;
      // Different tokens: only a near-tie in llama.cpp's own logits explains that.
      const int32_t other = got.greedy[size_t(i)];
      const auto it = std::find_if(top.begin(), top.end(), [&](const auto& e) { return e.first == other; });
      INFO("first different token at " << i << ": tandem " << other << ", llama.cpp " << want[p].greedy[size_t(i)]);
      REQUIRE_MESSAGE(it != top.end(), "tandem's token is not among llama.cpp's top 8");
      const float gap = top.front().second - it->second;
      MESSAGE("near-tie at token " << i << " of '" << k_prompts[p] << "': llama.cpp's logits differ by " << gap);
      CHECK(gap <= 2 * tol);
      ++near_ties;
      break;
    }
  }
  MESSAGE(fs::path(path).filename().string() << " (" << arch_name << ", " << type << "): " << compared << " greedy tokens compared over "
                                              << k_prompts.size() << " prompts, " << near_ties
                                              << " near-ties; largest logit difference " << worst);
  // Near-ties end a prompt's comparison early; most of it must still have been compared.
  const int at_least = int(k_prompts.size()) * n_greedy / 2;
  CHECK(compared >= at_least);
}

}  // namespace

TEST_CASE("reference: the r15m fixtures (f16, q8_0) give llama.cpp's prompt ids and greedy tokens") {
  temp_dir tmp;
  for (const char* name : {"r15m-f16.gguf", "r15m-q8_0.gguf"}) {
    const std::string path = std::string(TANDEM_SHARED_MODELS) + "/" + name;
    REQUIRE_MESSAGE(fs::exists(path), "missing fixture " << path);
    compare_with_llama_cpp(path, tmp.path);
  }
}

TEST_CASE("reference: tandem make-model files in every weight type give llama.cpp's greedy tokens") {
  temp_dir tmp;
  for (const auto& flags : k_made_models) {
    const std::string path = (tmp.path / "made.gguf").string();
    std::vector<std::string> argv{TANDEM_BINARY, "make-model", "--out", path};
    argv.insert(argv.end(), flags.begin(), flags.end());
    child mk(argv, {}, (tmp.path / "make-model.err").string());
    mk.read_all(std::chrono::seconds(120));
    std::string what;
    for (const auto& a : flags) what += " " + a;
    INFO("tandem make-model" << what << ": " << slurp(tmp.path / "make-model.err"));
    REQUIRE(mk.wait(std::chrono::seconds(10)) == 0);
    compare_with_llama_cpp(path, tmp.path);
  }
}

TEST_CASE("reference: bench model --compare-llama-cpp prints llama.cpp's speeds and Tandem's ratios to them") {
  temp_dir tmp;
  const std::string model = write_micro_model(tmp.path);
  const std::vector<std::string> base{TANDEM_BINARY, "bench",   "model", "--model", model, "--threads",
                                      "1",           "--batches", "1",   "--prompt", "16", "--context",
                                      "4",           "--steps",   "4",   "--bandwidth-mb", "16"};
  {
    std::vector<std::string> argv = base;
    argv.insert(argv.end(), {"--compare-llama-cpp", "--json"});
    child bench(argv, {}, (tmp.path / "bench.err").string());
    const std::string out = bench.read_all(std::chrono::seconds(120));
    INFO("stdout: " << out << "\nstderr: " << slurp(tmp.path / "bench.err"));
    REQUIRE(bench.wait(std::chrono::seconds(10)) == 0);
    std::smatch m;
    REQUIRE(std::regex_search(out, m,
                              std::regex(R"re("llama_cpp":\{"prefill_tokens_per_s":([0-9.]+),"prefill_ratio":([0-9.]+),)re"
                                         R"re("decode_batch1_tokens_per_s":([0-9.]+),"decode_batch1_ratio":([0-9.]+)\})re")));
    for (int i = 1; i <= 4; ++i) CHECK(std::stod(m[i]) > 0);
  }
  // Without the npm packages: an error that says what to run, before anything is measured.
  std::vector<std::string> argv = base;
  argv.insert(argv.end(), {"--compare-llama-cpp", "--llama-cpp-dir", (tmp.path / "nowhere").string()});
  child bench(argv, {}, (tmp.path / "bench.err").string());
  bench.read_all(std::chrono::seconds(120));
  CHECK(bench.wait(std::chrono::seconds(10)) == 1);
  const std::string err = slurp(tmp.path / "bench.err");
  INFO(err);
  CHECK(err.find("npm ci --omit=optional") != std::string::npos);
}
