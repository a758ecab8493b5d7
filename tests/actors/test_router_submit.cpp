// The router's local submit goes through the same receive wrapper as every other message
// (actors/common/receive.h): a submit it cannot read still answers its callback, once, as a
// `malformed` refusal, and the router keeps serving.
#include <doctest/doctest.h>

#include "actors/common/protocol.h"
#include "tests/actors/router_rig.h"

using namespace tandem;
using namespace tandem::test;

namespace {

/// Sends `w` as a router submit with the collector's callback.
void submit_bytes(router_rig& r, const wire& w) {
  r.router.gate->enter_control();
  caf::anon_send(r.router.handle, submit_atom::value, w, callback_box{r.col.cb()});
}

}  // namespace

TEST_CASE("router submit: unreadable bytes or another role's message answer the callback as malformed") {
  router_rig r;
  r.add_target("n0/prefill", "prefill", "prefill");
  router_options ro;
  ro.lim = small_limits();
  ro.model = model_facts{-1, 4096, 64};
  r.launch(ro);

  submit_bytes(r, wire{{1, 2, 3}});  // not a whole number of words
  REQUIRE(r.col.wait_finished(1));
  seq_request other;
  other.id = "x";
  other.prompt = {1, 2};
  other.max_tokens = 2;
  submit_bytes(r, make_role_wire<prefill_role, msg::submit>([&](schema::SubmitRequest::Builder b) { other.write(b); }));
  REQUIRE(r.col.wait_finished(2));
  {
    std::lock_guard lk(r.col.m);
    const auto& evs = r.col.events["?"];
    REQUIRE(evs.size() == 2);  // one end each (both unread, so both named "?"), nothing for "x"
    for (const auto& ev : evs) {
      CHECK(ev.finished);
      CHECK(ev.reject_reason == "malformed");
      REQUIRE(ev.err);
      CHECK(ev.err->kind() == error_kind::failed);
    }
    CHECK(r.col.events.count("x") == 0);
  }
  const auto st = r.stats();
  CHECK(st.value("rejections_total", "actor=\"router\",reason=\"malformed\"") == 2);
  CHECK(st.value("actor_malformed_messages_total", "actor=\"router\"") == 0);  // the framing check is a tandem::error
  CHECK(st.value("actor_failed_messages_total", "actor=\"router\"") == 1);
  CHECK(st.value("actor_unexpected_messages_total", "actor=\"router\"") == 1);
  CHECK(r.router.gate->depth() == 0);  // each left the gate

  // The router still takes a good submit.
  r.submit("good");
  REQUIRE(r.prefill[0]->wait_submits(1));
}
