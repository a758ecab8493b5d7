// `tandem bench burst` with tiny durations on the micro model: the run completes and its JSON
// has every field, with consistent counts (not the timings, which depend on the machine).
#include <doctest/doctest.h>

#include <fstream>
#include <sstream>

#include "tests/e2e/process.h"
#include "transport/http/json.h"

using namespace tandem;
using namespace tandem::e2e;

TEST_CASE("bench burst: one run, both clusters, every JSON field, no request without a final answer") {
  temp_dir dir;
  const std::string model = write_micro_model(dir.path);
  const std::string json_path = (dir.path / "burst.json").string();
  child c({TANDEM_BINARY, "bench", "burst", "--model", model, "--capacity-s", "0.3", "--load-s", "0.3", "--burst-s",
           "0.3", "--max-tokens", "4", "--prompt-tokens", "16", "--prefill-chunk-tokens", "64", "--json", json_path},
          {}, (dir.path / "bench.log").string());
  const std::string out = c.read_all(std::chrono::seconds(120));
  INFO("stdout:\n" << out);
  REQUIRE(c.wait(std::chrono::seconds(10)) == 0);
  CHECK(out.find("goal: bounded admitted p99 TTFT <= 1.5x") != std::string::npos);
  std::ifstream in(json_path);
  std::stringstream ss;
  ss << in.rdbuf();
  auto j = json::parse(ss.str());
  REQUIRE(j.find("capacity_rps"));
  REQUIRE(j.find("prefill_chunk_tokens"));
  CHECK(j.find("prefill_chunk_tokens")->i == 64);  // both clusters ran with the flag's step size
  CHECK(j.find("capacity_rps")->num > 0);
  REQUIRE(j.find("capacity_bounded_rps"));
  CHECK(j.find("capacity_bounded_rps")->num > 0);  // the bounded cluster's warm-up completed requests
  const json::value* clusters = j.find("clusters");
  REQUIRE(clusters);
  for (const char* name : {"unbounded", "bounded"}) {
    INFO("cluster " << name);
    const json::value* cl = clusters->find(name);
    REQUIRE(cl);
    for (const char* ph : {"load_0_8x", "burst_3x", "load_0_8x_after_burst"}) {
      INFO("phase " << ph);
      const json::value* p = cl->find(ph);
      // The 0.8x load after the burst runs on the bounded cluster only (its bounds' cost at
      // normal load).
      if (std::string(ph) == "load_0_8x_after_burst" && std::string(name) == "unbounded") {
        CHECK_FALSE(p);
        continue;
      }
      REQUIRE(p);
      for (const char* k : {"rate", "sent", "completed", "rejected", "status", "ttft_ms", "rejection_ms", "without_final_answer"})
        CHECK_MESSAGE(p->find(k), "missing " << k);
      const json::value* st = p->find("status");
      REQUIRE(st);
      // Every request sent got a status (200, 503, 504, 429) and nothing is unaccounted.
      CHECK(st->find("200")->i + st->find("503")->i + st->find("504")->i + st->find("429")->i == p->find("sent")->i);
      CHECK(p->find("without_final_answer")->i == 0);
      CHECK(p->find("ttft_ms")->find("p99"));
    }
    for (const char* k : {"ttft_p99_ratio", "max_queue_wait_ms", "queue_high_water_requests", "queue_bound_requests",
                          "queue_high_water_tokens", "queue_bound_tokens"})
      CHECK_MESSAGE(cl->find(k), "missing " << k);
    // The deepest queue never exceeds its bound.
    CHECK(cl->find("queue_high_water_requests")->num <= cl->find("queue_bound_requests")->num);
  }
  CHECK(clusters->find("bounded")->find("max_queue_wait_ms")->num > 0);
  const json::value* goal = j.find("goal");
  REQUIRE(goal);
  for (const char* k : {"ttft_ratio", "ttft_ratio_max", "ttft_met", "rejection_p99_ms", "rejection_met",
                        "queue_within_bound", "without_final_answer"})
    CHECK_MESSAGE(goal->find(k), "missing " << k);
  CHECK(goal->find("without_final_answer")->i == 0);
  REQUIRE(j.find("calibration_p99_ratio"));
  CHECK(j.find("calibration_p99_ratio")->num >= 0);  // 0 only if the bounded 0.8x run completed nothing
  CHECK(out.find("calibration: max_queue_wait_ms") != std::string::npos);
  // The bound came from the bounded cluster's own 0.8x run and is the one its router applied
  // in the burst (read back from its metrics after being set live).
  REQUIRE(j.find("queue_wait_bound_source"));
  CHECK(j.find("queue_wait_bound_source")->s == "bounded_load_0_8x_p99");
  REQUIRE(j.find("queue_wait_bound_in_force_ms"));
  CHECK(j.find("queue_wait_bound_in_force_ms")->num == clusters->find("bounded")->find("max_queue_wait_ms")->num);
  REQUIRE(j.find("prefill_pause_decode_waiting_seqs"));
  CHECK(j.find("prefill_pause_decode_waiting_seqs")->i == 0);
}
