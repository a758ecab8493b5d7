// The typed role protocols (actors/common/protocol.h, receive.h): what compiles, the gate
// table, the receive wrapper, and docs/architecture.md naming every message of every role.
#include <capnp/schema.h>
#include <doctest/doctest.h>
#include <spdlog/sinks/null_sink.h>
#include <spdlog/spdlog.h>

#include <fstream>
#include <set>
#include <sstream>
#include <string>

#include "actors/common/protocol.h"
#include "actors/common/receive.h"

using namespace tandem;

// A message kind outside a role's protocol does not compile: the concept is false, and so is
// a send through the role's handle.
template <class H, class M>
concept can_send = requires(const H& h) { h.template admit<M>(); };

static_assert(in_protocol<router_role, msg::event>);
static_assert(in_protocol<router_role, msg::credit>);
static_assert(!in_protocol<router_role, msg::forward>);
static_assert(!in_protocol<router_role, msg::handoff>);
static_assert(in_protocol<prefill_role, msg::submit>);
static_assert(!in_protocol<prefill_role, msg::handoff>);
static_assert(!in_protocol<prefill_role, msg::event>);
static_assert(in_protocol<decode_role, msg::handoff>);
static_assert(!in_protocol<decode_role, msg::requeue>);
static_assert(!in_protocol<decode_role, msg::alloc>);
static_assert(in_protocol<worker_role, msg::forward>);
static_assert(!in_protocol<worker_role, msg::submit>);
static_assert(!in_protocol<worker_role, msg::free>);
static_assert(in_protocol<cache_tier_role, msg::acquire>);
static_assert(!in_protocol<cache_tier_role, msg::forward>);
static_assert(!in_protocol<cache_tier_role, msg::abort>);
static_assert(can_send<role_handle<cache_tier_role>, msg::free>);
static_assert(!can_send<role_handle<cache_tier_role>, msg::submit>);
static_assert(!can_send<role_handle<worker_role>, msg::event>);
static_assert(!can_send<role_handle<router_role>, msg::kv_send>);
// The table: work may be refused, control never, kv orders are not gated.
static_assert(protocol_entry<prefill_role, msg::submit>::gate == gate_kind::work);
static_assert(protocol_entry<prefill_role, msg::requeue>::gate == gate_kind::control);
static_assert(protocol_entry<decode_role, msg::handoff>::gate == gate_kind::work);
static_assert(protocol_entry<cache_tier_role, msg::free>::gate == gate_kind::control);
static_assert(protocol_entry<worker_role, msg::kv_send>::gate == gate_kind::none);

namespace {

/// The union members of a role's schema struct, by name and discriminant.
template <class Role>
std::map<std::string, uint16_t> union_fields() {
  std::map<std::string, uint16_t> out;
  auto s = capnp::Schema::from<typename Role::in>();
  for (auto f : s.getUnionFields()) out[f.getProto().getName().cStr()] = f.getProto().getDiscriminantValue();
  return out;
}

template <class Role>
void check_table_covers_schema() {
  auto fields = union_fields<Role>();
  std::set<uint16_t> in_table;
  for_each_message<Role>([&](auto m) { in_table.insert(uint16_t(protocol_entry<Role, decltype(m)>::which)); });
  for (const auto& [name, d] : fields)
    CHECK_MESSAGE(in_table.count(d) == 1, Role::name, ": ", name, " has no entry in the table of protocol.h");
  CHECK(in_table.size() == fields.size());
}

std::shared_ptr<spdlog::logger> quiet() {
  return std::make_shared<spdlog::logger>("test", std::make_shared<spdlog::sinks::null_sink_mt>());
}

}  // namespace

TEST_CASE("protocol: every union member of every role has exactly one table entry") {
  check_table_covers_schema<router_role>();
  check_table_covers_schema<prefill_role>();
  check_table_covers_schema<decode_role>();
  check_table_covers_schema<worker_role>();
  check_table_covers_schema<cache_tier_role>();
  bool known = true;
  gate_of<prefill_role>(static_cast<schema::PrefillIn::Which>(999), &known);
  CHECK_FALSE(known);
  CHECK(gate_of<prefill_role>(schema::PrefillIn::SUBMIT) == gate_kind::work);
  CHECK(is_cast<prefill_role>(schema::PrefillIn::SUBMIT));
  CHECK_FALSE(is_cast<decode_role>(schema::DecodeIn::KV_DONE));
  CHECK_FALSE(is_cast<worker_role>(schema::WorkerIn::KV_SEND));
}

TEST_CASE("protocol: the handle enters the gate by the table and a dropped ticket leaves it") {
  role_handle<prefill_role> h(bounded_actor{caf::actor{}, std::make_shared<mailbox_gate>("prefill", 1)});
  {
    auto t = h.admit<msg::submit>();
    CHECK(static_cast<bool>(t));
    CHECK(h.gate->depth() == 1);
    CHECK_FALSE(static_cast<bool>(h.admit<msg::submit>()));  // work: refused at the bound
    CHECK(h.gate->rejected() == 1);
    auto c = h.admit<msg::abort>();  // control: counted in past the bound
    CHECK(static_cast<bool>(c));
    CHECK(h.gate->depth() == 2);
  }
  CHECK(h.gate->depth() == 0);  // neither was sent: both places are given back
  role_handle<worker_role> w(bounded_actor{caf::actor{}, std::make_shared<mailbox_gate>("worker", 1)});
  auto k = w.admit<msg::kv_send>();
  CHECK(static_cast<bool>(k));
  CHECK(w.gate->depth() == 0);  // not gated
}

TEST_CASE("protocol: receive dispatches on the role's union, leaves the gate and counts the rest") {
  inbox box{"decode", std::make_shared<mailbox_gate>("decode", 8), quiet()};
  std::string got;
  auto handlers = overloaded{
      [&](msg::handoff, schema::KvHandoff::Reader r) { got = std::string("handoff ") + r.getRequest().getId().cStr(); },
      [&](msg::submit, schema::SubmitRequest::Reader) { got = "submit"; },
      [&](msg::abort, schema::Abort::Reader r) {
        if (r.getHops() > 3) throw tandem::error(error_kind::failed, "too many hops");
        got = std::string("abort ") + r.getId().cStr();
      },
      [&](msg::credit_query, schema::StatsQuery::Reader) { got = "query"; },
  };
  auto send = [&](const wire& w) {
    box.gate->enter_control();
    receive<decode_role>(box, w, handlers);
  };
  send(make_role_wire<decode_role, msg::handoff>([](auto h) { h.initRequest().setId("r1"); }));
  CHECK(got == "handoff r1");
  send(make_role_wire<decode_role, msg::abort>([](auto a) { a.setId("r2"); }));
  CHECK(got == "abort r2");
  // Another role's message: counted and dropped, the handlers never see it.
  got.clear();
  send(make_role_wire<prefill_role, msg::abort>([](auto a) { a.setId("r3"); }));
  CHECK(got.empty());
  CHECK(box.unexpected == 1);
  // A kind of this role that comes another way (kvDone travels with kv_atom).
  send(make_role_wire<decode_role, msg::kv_done>([](auto d) { d.setId("r4"); }));
  CHECK(box.unexpected == 2);
  // A handler that throws, and bytes that do not parse.
  send(make_role_wire<decode_role, msg::abort>([](auto a) { a.setHops(5); }));
  CHECK(box.failed == 1);
  send(wire{std::vector<uint8_t>(7, 0)});
  CHECK(box.failed == 2);  // the framing check is a tandem::error
  CHECK(box.gate->depth() == 0);
  // The metric carries the counters.
  auto m = box.metrics();
  REQUIRE(m.size() == 3);
  CHECK(m[0].name == "actor_unexpected_messages_total");
  CHECK(m[0].value == 2);
}

TEST_CASE("protocol: a call that is not one of the role's calls is answered with an error reply") {
  inbox box{"cache_tier", std::make_shared<mailbox_gate>("cache_tier", 8), quiet()};
  auto handlers = overloaded{
      [&](msg::acquire, schema::AcquireRequest::Reader) -> wire {
        return make_reply([](schema::Reply::Builder r) { r.initAcquireReply().setOk(true); });
      },
      [&](msg::alloc, schema::AllocRequest::Reader) -> wire { throw tandem::error(error_kind::overloaded, "full"); },
  };
  auto call = [&](const wire& w) {
    box.gate->enter_control();
    wire r = receive_call<cache_tier_role, wire>(box, w, handlers);
    wire_reader rd(r);
    return rd.reply().which();
  };
  CHECK(call(make_role_wire<cache_tier_role, msg::acquire>([](auto) {})) == schema::Reply::ACQUIRE_REPLY);
  CHECK(call(make_role_wire<cache_tier_role, msg::alloc>([](auto) {})) == schema::Reply::ERROR);
  CHECK(call(make_role_wire<cache_tier_role, msg::free>([](auto) {})) == schema::Reply::ERROR);
  CHECK(box.unexpected == 1);
  CHECK(box.failed == 1);
}

namespace {

/// The text of docs/architecture.md from the heading naming `struct_name` to the next heading
/// of the same level.
std::string doc_section(const std::string& doc, const std::string& struct_name) {
  const std::string key = "`" + struct_name + "`";
  size_t at = std::string::npos;
  for (size_t p = doc.find("\n### "); p != std::string::npos; p = doc.find("\n### ", p + 1)) {
    const size_t eol = doc.find('\n', p + 1);
    if (doc.substr(p, eol - p).find(key) != std::string::npos) {
      at = p;
      break;
    }
  }
  if (at == std::string::npos) return "";
  const size_t next = doc.find("\n### ", at + 1);
  const size_t next2 = doc.find("\n## ", at + 1);
  return doc.substr(at, std::min(next, next2) - at);
}

template <class Role>
void check_doc_names(const std::string& doc) {
  const std::string struct_name = capnp::Schema::from<typename Role::in>().getShortDisplayName().cStr();
  const std::string sec = doc_section(doc, struct_name);
  REQUIRE_MESSAGE(!sec.empty(), "docs/architecture.md: add a '### ...' heading naming `", struct_name, "`");
  for (const auto& [name, d] : union_fields<Role>())
    CHECK_MESSAGE(sec.find("`" + name + "`") != std::string::npos, "docs/architecture.md, section of ", struct_name,
                  ": name the message `", name, "` (sender, receiver, work or control)");
}

}  // namespace

TEST_CASE("protocol: docs/architecture.md names every message of every role") {
  std::ifstream f(std::string(TANDEM_SOURCE_DIR) + "/docs/architecture.md");
  REQUIRE(f.good());
  std::stringstream ss;
  ss << f.rdbuf();
  const std::string doc = ss.str();
  check_doc_names<router_role>(doc);
  check_doc_names<prefill_role>(doc);
  check_doc_names<decode_role>(doc);
  check_doc_names<worker_role>(doc);
  check_doc_names<cache_tier_role>(doc);
  // The section test itself can fail: a name that is no message is not found.
  CHECK(doc_section(doc, "RouterIn").find("`noSuchMessage`") == std::string::npos);
}
