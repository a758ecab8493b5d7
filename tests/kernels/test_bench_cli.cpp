// `tandem bench`: the mode dispatch and that each mode runs end to end and prints what it
// promises (no timing is asserted; the numbers are for people, see tools/bench/).
#include <doctest/doctest.h>

#include <array>
#include <cstdio>
#include <string>
#include <sys/wait.h>
#include <tuple>

namespace {

/// Runs a shell command; returns its exit status and stdout+stderr.
std::pair<int, std::string> run(const std::string& args) {
  const std::string cmd = std::string(TANDEM_BINARY) + " " + args + " 2>&1";
  FILE* p = popen(cmd.c_str(), "r");
  REQUIRE(p != nullptr);
  std::string out;
  std::array<char, 4096> buf{};
  size_t n;
  while ((n = fread(buf.data(), 1, buf.size(), p)) > 0) out.append(buf.data(), n);
  const int st = pclose(p);
  return {WIFEXITED(st) ? WEXITSTATUS(st) : -1, out};
}

}  // namespace

TEST_CASE("bench cli: modes are listed, an unknown one names the available ones") {
  auto [rc, out] = run("bench --help");
  CHECK(rc == 0);
  CHECK(out.find("model") != std::string::npos);
  CHECK(out.find("control-plane") != std::string::npos);
  std::tie(rc, out) = run("bench nosuch");
  CHECK(rc == 1);
  CHECK(out.find("available: model, control-plane") != std::string::npos);
  std::tie(rc, out) = run("bench model");
  CHECK(rc == 1);
  CHECK(out.find("missing --model FILE") != std::string::npos);
}

TEST_CASE("bench cli: model mode reports prefill and every decode batch with their ratios") {
  const std::string model = std::string(TANDEM_SHARED_MODELS) + "/r15m-q8_0.gguf";
  auto [rc, out] = run("bench model --model " + model +
                       " --threads 2 --prompt 16 --batches 1,3 --steps 1 --context 4 --bandwidth-mb 16 --json");
  REQUIRE(rc == 0);
  CHECK(out.find("\"weight_type\":\"q8_0\"") != std::string::npos);
  CHECK(out.find("\"read_bandwidth_gbs\":") != std::string::npos);
  CHECK(out.find("\"peak_fma_gflops\":") != std::string::npos);
  CHECK(out.find("\"prefill\":{\"tokens\":16") != std::string::npos);
  CHECK(out.find("{\"batch\":1,") != std::string::npos);
  CHECK(out.find("{\"batch\":3,") != std::string::npos);
  CHECK(out.find("\"roofline_fraction\":") != std::string::npos);
  // Each decode row carries the bandwidth probed next to it (its own roofline), and it is real.
  const std::string bw_key = "\"read_bandwidth_gbs\":";
  for (const char* row : {"{\"batch\":1,", "{\"batch\":3,"}) {
    const size_t at = out.find(row), end = out.find('}', at), bw = out.find(bw_key, at);
    REQUIRE(bw < end);
    CHECK(std::stod(out.substr(bw + bw_key.size())) > 0.1);
  }
  CHECK(out.find("\"kv_pools\":[{\"name\":\"full\"") != std::string::npos);  // a llama: one full pool
  std::tie(rc, out) = run("bench model --model " + model + " --batches 0");
  CHECK(rc == 1);
  CHECK(out.find("--batches expects") != std::string::npos);
  // A second kernel path in the same run: its figures and the ratio of each.
  std::tie(rc, out) = run("bench model --model " + model +
                          " --threads 2 --prompt 16 --batches 1,3 --steps 1 --context 4 --bandwidth-mb 16 --compare-isa scalar "
                          "--json");
  REQUIRE(rc == 0);
  CHECK(out.find("\"compare\":{\"isa\":\"scalar\",\"kv_cache_dtype\":\"f32\",\"prefill_tokens_per_s\":") !=
        std::string::npos);
  CHECK(out.find("\"prefill_ratio\":") != std::string::npos);
  CHECK(out.find("{\"batch\":3,\"tokens_per_s\":") != std::string::npos);
  std::tie(rc, out) = run("bench model --model " + model + " --compare-isa sse9");
  CHECK(rc == 1);
  CHECK(out.find("unknown kernel path 'sse9'") != std::string::npos);
  // The KV cache type, and a second one in the same run.
  std::tie(rc, out) = run("bench model --model " + model +
                          " --threads 2 --prompt 16 --batches 1,3 --steps 1 --context 4 --bandwidth-mb 16 "
                          "--kv-cache-dtype f16 --compare-kv-cache-dtype f32 --json");
  REQUIRE(rc == 0);
  CHECK(out.find("\"kv_cache_dtype\":\"f16\"") != std::string::npos);
  CHECK(out.find("\"compare\":{\"isa\":") != std::string::npos);
  CHECK(out.find("\"kv_cache_dtype\":\"f32\",\"prefill_tokens_per_s\":") != std::string::npos);
  std::tie(rc, out) = run("bench model --model " + model + " --kv-cache-dtype f8");
  CHECK(rc == 1);
  CHECK(out.find("--kv-cache-dtype f8 is not a KV cache type; use f32 or f16") != std::string::npos);
  // The compared type is checked before the model loads (a missing file is not reached).
  std::tie(rc, out) = run("bench model --model /nonexistent.gguf --compare-kv-cache-dtype q4");
  CHECK(rc == 1);
  CHECK(out.find("--compare-kv-cache-dtype q4 is not a KV cache type; use f32 or f16") != std::string::npos);
}

TEST_CASE("bench cli: control-plane mode generates every token and reports CPU per token") {
  auto [rc, out] = run("bench control-plane --requests 6 --tokens 10 --batch 4 --json");
  REQUIRE(rc == 0);
  CHECK(out.find("\"tokens\":60,") != std::string::npos);
  CHECK(out.find("\"control_plane_cpu_us_per_token\":") != std::string::npos);
  std::tie(rc, out) = run("bench model --null --requests 2 --tokens 3");
  CHECK(rc == 0);
  CHECK(out.find("us CPU per generated token") != std::string::npos);
}

TEST_CASE("bench cli: grammar mode prints the mask time per step next to the forward step") {
  const std::string model = std::string(TANDEM_SHARED_MODELS) + "/r15m-q8_0.gguf";
  auto [rc, out] = run("bench grammar --model " + model + " --batch 4 --steps 20 --context 4");
  REQUIRE_MESSAGE(rc == 0, out);
  CHECK(out.find("vocabulary 32000 tokens") != std::string::npos);
  CHECK(out.find("mask per step (batch 4)") != std::string::npos);
  CHECK(out.find("forward decode step (batch 4") != std::string::npos);
  CHECK(out.find("mask / forward: mean") != std::string::npos);
  std::tie(rc, out) = run("bench grammar");
  CHECK(rc == 1);
  CHECK(out.find("missing --model FILE") != std::string::npos);
}
