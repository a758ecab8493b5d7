// The hierarchical KV cache with real (random-weight) micro models of three architectures
// (llama; gemma2 with its window crossed; deepseek2 with latent pages): multi-turn conversations
// give the same greedy output with the cache off, L1 only, and L1+L2+L3 (after evictions and
// load-backs), and a new cluster on the same disk directory reuses the files.
// On the test scheduler (tests/actors/cluster_rig.h): the forward passes run on the test's thread.
#include <doctest/doctest.h>
#include <unistd.h>

#include <filesystem>
#include <map>

#include "actors/runtime/embedded_cluster.h"
#include "kernels/model/make_model.h"
#include "kernels/tokenizer/tokenizer.h"
#include "tests/actors/model_files.h"
#include "tests/actors/cluster_rig.h"
#include "tests/actors/support.h"

using namespace tandem;
using namespace tandem::test;
namespace fs = std::filesystem;

namespace {

/// A micro model of `arch` (written once per process, removed at exit). gemma2's window of 32
/// is crossed by every conversation below; deepseek2's pages hold its latent.
std::string micro_model(const std::string& arch) { return micro_model_file(arch, 11); }

cluster_options opts(const std::string& arch, bool cache, const cache_config& cc) {
  cluster_options o;
  o.model_path = micro_model(arch);
  o.lim.page_size = 16;
  o.lim.device_pages = 14;
  o.lim.prefill_chunk_tokens = 32;
  o.lim.prefix_cache = cache;
  o.cache = cc;
  o.log_level = "warn";
  return o;
}

double metric(const std::string& text, const std::string& line_prefix) {
  auto at = text.find("\n" + line_prefix + " ");
  if (at == std::string::npos) return -1;
  return std::stod(text.substr(at + line_prefix.size() + 2));
}

struct turns_result {
  std::vector<std::vector<int32_t>> out;
  std::vector<int32_t> cached;
  std::string metrics;
};

/// 3 sessions x 4 turns, sessions interleaved, one request at a time.
turns_result conversations(embedded_rig& c) {
  turns_result r;
  const auto& tok = c.tok();
  auto system = tok.encode("you are a helpful assistant. answer briefly and precisely, and keep the tone friendly.", true);
  std::vector<std::vector<int32_t>> hist(3, system);
  for (int t = 0; t < 4; ++t)
    for (int s = 0; s < 3; ++s) {
      auto& h = hist[size_t(s)];
      for (auto x : tok.encode(" user " + std::to_string(s) + " asks question " + std::to_string(t * 7 + s) +
                                   " about the weather in city number " + std::to_string(s * 3 + t),
                               false))
        h.push_back(x);
      collector col;
      auto id = "s" + std::to_string(s) + "t" + std::to_string(t);
      c.submit(make_req(id, h, 8), col.cb());
      REQUIRE(col.wait_finished(1));
      auto last = col.last(id);
      if (last.err) FAIL_CHECK(last.err->what());
      auto out = col.tokens(id);
      REQUIRE(out.size() == 8);
      r.out.push_back(out);
      r.cached.push_back(last.cached_tokens);
      h.insert(h.end(), out.begin(), out.end());
    }
  // Once the actors are quiet no request holds a page and no copy is in flight: used == cached
  // in every tier.
  c.run();
  r.metrics = c.metrics_text();
  if (metric(r.metrics, "tandem_cache_pages_used{tier=\"device\"}") ==
          metric(r.metrics, "tandem_cache_pages_cached{tier=\"device\"}") &&
      metric(r.metrics, "tandem_kv_pages_evictable") == metric(r.metrics, "tandem_kv_pages_cached") &&
      metric(r.metrics, "tandem_cache_pages_used{tier=\"host\"}") ==
          metric(r.metrics, "tandem_cache_pages_cached{tier=\"host\"}") &&
      metric(r.metrics, "tandem_cache_background_copies") == 0)
    return r;
  FAIL("pages did not return to the pools");
  return r;
}

}  // namespace

TEST_CASE("embedded_cluster(micro): multi-turn output with cache off == L1 == L1+L2+L3, and after a restart") {
  for (const std::string arch : {"llama", "gemma2", "deepseek2"}) {
    CAPTURE(arch);
    auto dir = (fs::temp_directory_path() / ("tandem_cache_l3_" + arch + "_" + std::to_string(getpid()))).string();
    fs::remove_all(dir);
    cache_config tiers;
    tiers.host_ratio = 1;
    tiers.write_policy = cache_write_policy::write_through;
    tiers.disk_dir = dir;
    tiers.disk_size_gb = 0.05;

    turns_result off, l1, hier, again;
    {
      auto c = std::make_unique<embedded_rig>(opts(arch, false, {}));
      off = conversations(*c);
    }
    {
      auto c = std::make_unique<embedded_rig>(opts(arch, true, {}));
      l1 = conversations(*c);
    }
    {
      auto c = std::make_unique<embedded_rig>(opts(arch, true, tiers));
      hier = conversations(*c);
    }
    {
      auto c = std::make_unique<embedded_rig>(opts(arch, true, tiers));
      again = conversations(*c);
    }
    CHECK(l1.out == off.out);
    CHECK(hier.out == off.out);
    CHECK(again.out == off.out);
    for (auto x : off.cached) CHECK(x == 0);
    // Later turns reuse the history, including the previous reply (cached by the decode side).
    CHECK(hier.cached.back() > 100);
    CHECK(metric(hier.metrics, "tandem_cache_evictions_total{tier=\"device\"}") > 0);
    CHECK(metric(hier.metrics, "tandem_cache_hit_tokens_total{tier=\"host\"}") > 0);
    CHECK(metric(hier.metrics, "tandem_cache_hit_tokens_total{tier=\"disk\"}") > 0);
    double sum_l1 = 0, sum_hier = 0;
    for (size_t i = 0; i < l1.cached.size(); ++i) sum_l1 += l1.cached[i], sum_hier += hier.cached[i];
    CHECK(sum_hier > sum_l1);  // the host and disk tiers keep what the small device pool drops
    // The restarted cluster's first turn of session 0 finds the system prompt on disk.
    CHECK(again.cached[0] >= 16);
    CHECK(metric(again.metrics, "tandem_cache_disk_restored_pages") > 0);
    CHECK(metric(again.metrics, "tandem_cache_disk_read_failures_total") == 0);
    fs::remove_all(dir);
  }
}
