// Router admission of a request with n > 1 choices: the forks take batch slots and pages at the
// decode target (decode_fork.cpp), so the decode queue and page checks count them.
#include <doctest/doctest.h>

#include "tests/actors/router_rig.h"

using namespace tandem;
using namespace tandem::test;

namespace {
/// One prefill target p0 and one decode target d0 that only the test's credits speak for.
struct rig : router_rig {
  rig() {
    add_target("p0/prefill", "prefill", "prefill");
    add_target("d0/decode", "decode", "decode");
    router_options ro;
    ro.lim = small_limits();
    ro.model = model_facts{-1, 4096, 64};
    ro.tick_ms = 1;
    launch(ro, /*answering=*/true);
    decode[0]->set_answer(false);
  }
  ~rig() { stop(); }
  int finished() {
    std::lock_guard lk(col.m);
    return col.finished;
  }
};

/// A decode credit from d0 with `free_pages` pages and `waiting` sequences waiting (batch of 2, full).
void decode_credit(rig& r, uint64_t seq, int64_t free_pages, int32_t waiting) {
  r.send(make_role_wire<router_role, msg::credit>([&](schema::Credit::Builder c) {
    c.setTarget("d0/decode");
    c.setRole(schema::StageRole::DECODE);
    c.setSeq(seq);
    c.setFreePages(free_pages);
    c.setRunningSeqs(2);
    c.setWaitingSeqs(waiting);
    c.setMaxRunningSeqs(2);
  }));
}

seq_request choices(const std::string& id, int32_t n) {
  seq_request q;
  q.id = id;
  q.prompt = {1, 2, 3, 4, 5, 6, 7};  // with the page of the first token: 2 pages of 4 tokens
  q.max_tokens = 4;
  q.n = n;
  return q;
}
}  // namespace

TEST_CASE("router admission: n choices count n sequences against the decode queue bound") {
  rig r;
  decode_credit(r, 1000, 100000, 2);  // bound: 2 x max_running_seqs = 4
  r.submit(choices("three", 3));      // 2 waiting + 3 > 4
  REQUIRE(r.col.wait_finished(1));
  auto ev = r.col.last("three");
  REQUIRE(ev.err);
  CHECK(ev.err->kind() == error_kind::overloaded);
  CHECK(ev.reject_reason == "decode_queue");
  CHECK(std::string(ev.err->what()).find("n = 3 choices") != std::string::npos);
  r.submit(choices("two", 2));  // 2 + 2 = 4: admitted
  REQUIRE(r.prefill[0]->wait_submits(1));
  CHECK(r.prefill[0]->submit(0).id == "two");
  CHECK(r.prefill[0]->submit(0).n == 2);
  decode_credit(r, 1001, 100000, 0);  // nothing waiting: any n fits behind an empty queue
  r.submit(choices("eight", 8));
  REQUIRE(r.prefill[0]->wait_submits(2));
  CHECK(r.prefill[0]->submit(1).id == "eight");
  CHECK(r.finished() == 1);
}

TEST_CASE("router admission: n choices need a page per extra fork at a backed-up decode target") {
  rig r;
  decode_credit(r, 1000, 3, 1);   // 3 free pages, 1 sequence waiting
  r.submit(choices("three", 3));  // 2 pages + 2 forks' pages > 3
  REQUIRE(r.col.wait_finished(1));
  auto ev = r.col.last("three");
  REQUIRE(ev.err);
  CHECK(ev.reject_reason == "decode_pages");
  CHECK(std::string(ev.err->what()).find("needs 4 pages") != std::string::npos);
  r.submit(choices("two", 2));  // 2 + 1 = 3 pages: admitted
  REQUIRE(r.prefill[0]->wait_submits(1));
  CHECK(r.prefill[0]->submit(0).id == "two");
  CHECK(r.finished() == 1);
}
