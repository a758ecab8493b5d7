// The incident Tandem exists for, with Tandem's keys: a prefill node with an *absolute* host
// KV tier size (host_size_gb, the setting that made a DeepSeek deployment's model-specific pool
// crash-loop at start) on models whose KV pages are not K/V per head: deepseek2 (MLA latent)
// and gemma2 (sliding-window layers). check-config accepts it and prints the node's tiers, the
// nodes start, greedy output equals a single process without a host tier, and prompts that
// come back after the small device pool evicted them are served from the host tier.
#include <doctest/doctest.h>

#include <string>
#include <vector>

#include "kernels/model/make_model.h"
#include "tests/e2e/cluster_harness.h"
#include "tests/e2e/process.h"

using namespace tandem;
using namespace tandem::e2e;

namespace {

/// Distinct prompts of ~50 tokens each (3-4 pages of 16), so a 48-page pool cannot keep them all.
std::vector<std::string> seed_prompts() {
  std::vector<std::string> p;
  const char* topics[] = {"rivers", "mountains", "oceans", "forests", "deserts", "cities", "islands", "valleys",
                          "glaciers", "plains", "volcanoes", "lakes"};
  for (const char* t : topics)
    p.push_back(std::string("Tell me everything you know about ") + t +
                ", how they form, who lives near them, what grows there, how people travel across them in winter "
                "and in summer, and why they matter to the climate of the whole planet today");
  return p;
}

std::string check_config_output(const std::string& config, int& code) {
  child c({TANDEM_BINARY, "check-config", config}, {}, "");
  std::string out = c.read_all(std::chrono::seconds(60));
  code = c.wait(std::chrono::seconds(10));
  return out;
}

}  // namespace

TEST_CASE("seed incident: an absolute host tier size on a deepseek2 and a gemma2 prefill node is accepted and used") {
  for (const char* arch : {"deepseek2", "gemma2"}) {
    CAPTURE(arch);
    temp_dir dir;
    const std::string model = (dir.path / (std::string(arch) + ".gguf")).string();
    make_model_options o;
    o.preset = "tiny-15m";
    o.arch = arch;
    o.dtype = ggml_type::f16;
    o.sliding_window = 16;  // gemma2: every prompt crosses it
    write_random_llama(o, model);

    const auto prompts = seed_prompts();
    constexpr int32_t max_tokens = 12;
    std::vector<completion_result> want;
    {
      server single(model, (dir.path / "single.log").string());
      for (const auto& p : prompts) want.push_back(complete_greedy(single.http_port, p, max_tokens));
    }

    // The seed's shape: only the prefill node has a host tier, sized in GiB; the decode node none.
    const std::string head = "[limits]\npage_size = 16\ndevice_pages = 48\nmax_running_seqs = 8\n\n[model]\npath = \"" +
                             model + "\"\n\n[cache]\nenabled = true\n\n[transfer]\nfailure_policy = \"fail\"\n"
                             "timeout_ms = 5000\n";
    const std::string prefill_cache = "[node.cache]\nhost_size_gb = 0.02\nwrite_policy = \"write_through\"\n";
    node_cluster cl(dir.path, head,
                    {{"router", {"router"}, {}},
                     {"prefill-0", {"prefill", "cache", "worker"}, {}, prefill_cache},
                     {"decode-0", {"decode", "cache", "worker"}, {}}});
    INFO(cl.logs());

    int code = -1;
    const std::string report = check_config_output(cl.config(), code);
    INFO(report);
    CHECK(code == 0);
    CHECK(report.find("node prefill-0: cache: host 0.02 GiB") != std::string::npos);
    CHECK(report.find("node decode-0: cache: no host tier") != std::string::npos);
    // The plan: the GiB split across the model's pools (gemma2: full and window), whole pages each.
    CHECK(report.find("host tier: 0.02 GiB") != std::string::npos);
    CHECK(report.find("pool 'full': ") != std::string::npos);
    if (std::string(arch) == "gemma2") CHECK(report.find("pool 'window': ") != std::string::npos);

    const uint16_t port = cl.node("router").http;
    for (size_t i = 0; i < prompts.size(); ++i) {
      auto got = complete_greedy(port, prompts[i], max_tokens);
      INFO("prompt " << i << ": " << got.raw);
      REQUIRE(got.status == 200);
      CHECK(got.text == want[i].text);
    }
    // The first prompts were evicted from the 48-page device pool by the later ones; asked
    // again, their pages come back from the host tier, and the output is still the same.
    for (size_t i = 0; i < 3; ++i) {
      auto got = complete_greedy(port, prompts[i], max_tokens);
      REQUIRE(got.status == 200);
      CHECK(got.text == want[i].text);
    }
    const uint16_t prefill_http = cl.node("prefill-0").http;
    const std::string m = poll_metrics(prefill_http, [](const std::string& t) {
      return series(t, "tandem_cache_hit_tokens_total{tier=\"host\"}") > 0;
    });
    INFO(m);
    CHECK(series(m, "tandem_cache_evictions_total{tier=\"device\"}") > 0);
    CHECK(series(m, "tandem_cache_hit_tokens_total{tier=\"host\"}") > 0);
    CHECK(series(m, "tandem_cache_pages_total{tier=\"host\"}") > 0);
    CHECK(series(m, "tandem_kv_pool_host_pages_total{pool=\"full\"}") > 0);
    if (std::string(arch) == "gemma2") {
      // The window pool has host pages of its own, in proportion to its (ring-sized) device pool.
      CHECK(series(m, "tandem_kv_pool_host_pages_total{pool=\"window\"}") > 0);
      CHECK(series(m, "tandem_kv_pool_host_pages_cached{pool=\"window\"}") > 0);
    }
    // The decode node allocated no host tier.
    const std::string dm = test::get(cl.node("decode-0").http, "/metrics").body;
    CHECK(series(dm, "tandem_cache_pages_total{tier=\"host\"}") == 0);
  }
}
