// The architectures beyond llama across processes: a qwen3, a gemma2 (sliding window crossed)
// and a deepseek2 model (latent KV pages, experts) served by router, prefill and decode nodes
// give the single process's greedy text.
#include <doctest/doctest.h>

#include <string>
#include <vector>

#include "kernels/model/make_model.h"
#include "tests/e2e/pd_harness.h"
#include "tests/e2e/process.h"

using namespace tandem;
using namespace tandem::e2e;

TEST_CASE("pd: qwen3, gemma2 and deepseek2 models give the single-process greedy output across nodes") {
  for (const char* arch : {"qwen3", "gemma2", "deepseek2"}) {
    CAPTURE(arch);
    temp_dir dir;
    const std::string model = (dir.path / (std::string(arch) + ".gguf")).string();
    make_model_options o;
    o.preset = "tiny-15m";
    o.arch = arch;
    o.dtype = ggml_type::f16;
    o.sliding_window = 8;  // gemma2: every prompt below plus 24 tokens crosses it
    write_random_llama(o, model);
    server single(model, (dir.path / "single.log").string());
    std::vector<completion> want;
    for (const auto& p : pd_prompts) want.push_back(complete(single.http_port, p, 24));
    pd_cluster pd(model, dir.path, "fail", true);
    INFO(pd.logs());
    for (size_t i = 0; i < pd_prompts.size(); ++i) {
      auto got = complete(pd.router().http, pd_prompts[i], 24);
      INFO("prompt " << i << ": " << got.raw);
      REQUIRE(got.status == 200);
      CHECK(got.text == want[i].text);
      CHECK(got.finish_reason == want[i].finish_reason);
    }
  }
}
