// n > 1 (OpenAI's n) through the embedded cluster with real (random-weight) micro models: one
// prefill, the decode side forks the sequence (decode_fork.cpp), each choice streams its own
// events and ends once, and every KV page comes back after the choices end or are aborted.
// On the test scheduler (tests/actors/cluster_rig.h): the forward passes run on the test's thread.
#include <doctest/doctest.h>
#include <unistd.h>

#include <condition_variable>
#include <functional>
#include <filesystem>
#include <map>
#include <mutex>

#include "actors/runtime/embedded_cluster.h"
#include "kernels/model/make_model.h"
#include "kernels/tokenizer/tokenizer.h"
#include "tests/actors/cluster_rig.h"
#include "tests/actors/model_files.h"
#include "tests/actors/support.h"

using namespace tandem;
using namespace tandem::test;
namespace fs = std::filesystem;

namespace {

std::string micro_model(const std::string& arch) { return micro_model_file(arch, 13); }

cluster_options opts(const std::string& arch) {
  cluster_options o;
  o.model_path = micro_model(arch);
  o.lim.page_size = 16;
  o.lim.device_pages = 64;
  o.lim.prefill_chunk_tokens = 32;
  o.lim.prefix_cache = false;  // every page goes back to the free list
  o.log_level = "warn";
  return o;
}

double metric(const std::string& text, const std::string& name) {
  auto at = text.find("\n" + name + " ");
  if (at == std::string::npos) return -1;
  return std::stod(text.substr(at + name.size() + 2));
}

/// Events by choice; counts finished events per choice (exactly one each).
struct choices_collector {
  std::mutex m;
  std::condition_variable cv;
  std::map<int32_t, std::vector<token_event>> by_choice;
  std::map<int32_t, int> finishes;
  int finished = 0;

  event_callback cb() {
    return [this](token_event ev) {
      std::lock_guard lk(m);
      if (ev.finished) ++finished, ++finishes[ev.choice];
      by_choice[ev.choice].push_back(std::move(ev));
      cv.notify_all();
    };
  }
  /// Runs the actors until `ok` holds (evaluated with `m` held).
  bool wait(const std::function<bool()>& ok, const std::string& what) {
    return current_scheduler().pump(
        [&] {
          std::lock_guard lk(m);
          return ok();
        },
        what);
  }
  bool wait_finished(int n) {
    return wait([&] { return finished >= n; }, std::to_string(n) + " finished choices");
  }
  bool wait_tokens(int32_t choice, size_t n) {
    return wait(
        [&] {
          size_t c = 0;
          for (auto& e : by_choice[choice]) c += e.tokens.size();
          return c >= n;
        },
        std::to_string(n) + " tokens of choice " + std::to_string(choice));
  }
  std::vector<int32_t> tokens(int32_t choice) {
    std::lock_guard lk(m);
    std::vector<int32_t> out;
    for (auto& e : by_choice[choice]) out.insert(out.end(), e.tokens.begin(), e.tokens.end());
    return out;
  }
  token_event last(int32_t choice) {
    std::lock_guard lk(m);
    return by_choice[choice].back();
  }
};

/// Runs `r` and returns each choice's tokens (every choice finished exactly once, no error).
std::vector<std::vector<int32_t>> run(embedded_rig& c, completion_request r) {
  choices_collector col;
  const int32_t n = r.n;
  c.submit(std::move(r), col.cb());
  REQUIRE(col.wait_finished(n));
  std::vector<std::vector<int32_t>> out;
  for (int32_t k = 0; k < n; ++k) {
    CAPTURE(k);
    CHECK(col.finishes[k] == 1);
    auto last = col.last(k);
    if (last.err) FAIL_CHECK(last.err->what());
    CHECK(last.reason == finish_reason::length);
    out.push_back(col.tokens(k));
  }
  CHECK(col.finished == n);
  return out;
}

/// Every page is free again once the actors are quiet (the frees land after the finished events).
std::string pages_back(embedded_rig& c) {
  c.run();
  std::string text = c.metrics_text();
  if (metric(text, "tandem_kv_pages_free") == metric(text, "tandem_kv_pages_total")) return text;
  FAIL("KV pages did not return to the pool: " << metric(text, "tandem_kv_pages_free") << " of "
                                                << metric(text, "tandem_kv_pages_total") << " free");
  return text;
}

std::vector<int32_t> prompt_of(const tokenizer& tok) {
  return tok.encode("the quick brown fox jumps over the lazy dog and keeps on running", true);
}

}  // namespace

TEST_CASE("n choices (micro llama): greedy n=3 == n=1 three times, from one prefill, every page back") {
  auto c = std::make_unique<embedded_rig>(opts("llama"));
  const auto prompt = prompt_of(c->tok());
  auto one = run(*c, make_req("one", prompt, 12));
  REQUIRE(one.size() == 1);
  REQUIRE(one[0].size() == 12);
  auto before = pages_back(*c);
  auto r = make_req("three", prompt, 12);
  r.n = 3;
  auto three = run(*c, r);
  REQUIRE(three.size() == 3);
  for (const auto& t : three) CHECK(t == one[0]);
  auto after = pages_back(*c);
  // One prefill for the n = 3 request: one more admitted, its prompt's tokens computed once.
  CHECK(metric(after, "tandem_prefill_admitted_total") - metric(before, "tandem_prefill_admitted_total") == 1);
  CHECK(metric(after, "tandem_prefill_tokens_total") - metric(before, "tandem_prefill_tokens_total") ==
        double(prompt.size()));
  CHECK(metric(after, "tandem_decode_forks_total") == 2);
  CHECK(metric(after, "tandem_decode_fork_tokens_total") == 2);
  CHECK(metric(after, "tandem_kv_fork_page_copies_total") == 2);
  // The request is counted once.
  CHECK(metric(after, "tandem_requests_finished_total{reason=\"length\"}") == 2);
}

TEST_CASE("n choices (micro llama): seeded sampling gives different choices that replay equal") {
  auto c = std::make_unique<embedded_rig>(opts("llama"));
  const auto prompt = prompt_of(c->tok());
  auto r = make_req("s", prompt, 16, 1.0f, 1234);
  r.n = 3;
  auto a = run(*c, r);
  r.request_id = "s2";
  auto b = run(*c, r);
  CHECK(a == b);
  REQUIRE(a.size() == 3);
  CHECK((a[0] != a[1] || a[1] != a[2]));
  // Choice 0 keeps the request's seed: it equals the n = 1 output.
  auto one = run(*c, make_req("s1", prompt, 16, 1.0f, 1234));
  CHECK(one[0] == a[0]);
  pages_back(*c);
}

TEST_CASE("n choices (micro llama): an abort mid-decode ends every choice and every page comes back") {
  auto c = std::make_unique<embedded_rig>(opts("llama"));
  auto r = make_req("ab", prompt_of(c->tok()), 300);
  r.n = 3;
  choices_collector col;
  c->submit(r, col.cb());
  REQUIRE(col.wait_tokens(1, 3));
  c->abort("ab");
  REQUIRE(col.wait_finished(3));
  for (int32_t k = 0; k < 3; ++k) {
    CAPTURE(k);
    CHECK(col.finishes[k] == 1);
    CHECK(col.last(k).reason == finish_reason::abort);
  }
  auto text = pages_back(*c);
  CHECK(metric(text, "tandem_requests_finished_total{reason=\"abort\"}") == 1);
}

TEST_CASE("n choices (micro llama): one choice stopped at its stop string, the others go on") {
  auto c = std::make_unique<embedded_rig>(opts("llama"));
  auto r = make_req("st", prompt_of(c->tok()), 300);
  r.n = 3;
  choices_collector col;
  c->submit(r, col.cb());
  REQUIRE(col.wait_tokens(1, 2));
  c->stop_choice_at_stop_string("st", 1);
  REQUIRE(col.wait_finished(3));
  CHECK(col.last(1).reason == finish_reason::stop);
  CHECK(col.tokens(1).size() < 300);
  CHECK(col.tokens(0).size() == 300);
  CHECK(col.tokens(2).size() == 300);
  pages_back(*c);
}

TEST_CASE("n choices (micro gemma2, sliding-window pool): greedy n=3 == n=1, every page back") {
  auto c = std::make_unique<embedded_rig>(opts("gemma2"));
  // Longer than the micro gemma2's window of 32: the window pool's blocks are released.
  std::vector<int32_t> prompt;
  for (int i = 0; i < 5; ++i) {
    auto p = prompt_of(c->tok());
    prompt.insert(prompt.end(), p.begin(), p.end());
  }
  REQUIRE(prompt.size() >= 64);
  // 47: the fork's recomputed position reads a window block the sequence's next one does not
  // ((47 - 32 + 1) / 16 = 1 but (46 - 32 + 1) / 16 = 0): the prefill keeps it for the forks.
  for (size_t len : {size_t(64), size_t(48), size_t(47), size_t(33), size_t(32), size_t(17)}) {
    CAPTURE(len);
    std::vector<int32_t> p(prompt.begin(), prompt.begin() + static_cast<std::ptrdiff_t>(len));
    auto one = run(*c, make_req("g1_" + std::to_string(len), p, 40));
    auto r = make_req("g3_" + std::to_string(len), p, 40);
    r.n = 3;
    auto three = run(*c, r);
    REQUIRE(three.size() == 3);
    for (const auto& t : three) CHECK(t == one[0]);
    pages_back(*c);
  }
}

TEST_CASE("n choices (micro llama): choice 0 ending at its first token still gives every choice") {
  // max_tokens 1: choice 0 ends at the prefill; the handoff carries the KV for the forks alone.
  auto c = std::make_unique<embedded_rig>(opts("llama"));
  const auto prompt = prompt_of(c->tok());
  auto one = run(*c, make_req("f1", prompt, 1));
  auto r = make_req("f3", prompt, 1);
  r.n = 3;
  auto three = run(*c, r);
  REQUIRE(three.size() == 3);
  for (const auto& t : three) CHECK(t == one[0]);
  auto text = pages_back(*c);
  CHECK(metric(text, "tandem_decode_forks_total") == 2);
  CHECK(metric(text, "tandem_requests_finished_total{reason=\"length\"}") == 2);
}

TEST_CASE("n choices (micro llama): a full KV pool fails the request (never preempted), every choice ends, pages back") {
  auto o = opts("llama");
  o.lim.device_pages = 10;  // 160 tokens: three forks of ~110 tokens each cannot all fit
  auto c = std::make_unique<embedded_rig>(o);
  auto r = make_req("full", prompt_of(c->tok()), 100);
  r.n = 3;
  choices_collector col;
  c->submit(r, col.cb());
  REQUIRE(col.wait_finished(3));
  for (int32_t k = 0; k < 3; ++k) {
    CAPTURE(k);
    CHECK(col.finishes[k] == 1);
    auto last = col.last(k);
    REQUIRE(last.err.has_value());
    CHECK(last.err->kind() == error_kind::overloaded);
  }
  auto text = pages_back(*c);
  CHECK(metric(text, "tandem_requests_finished_total{reason=\"error\"}") == 1);
  CHECK(metric(text, "tandem_decode_preemptions_total") == 0);
}
