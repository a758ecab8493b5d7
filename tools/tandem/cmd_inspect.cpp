// tandem inspect HOST:PORT: the actors, in-flight requests and KV pools of a running node,
// read from its admin interface (schemas/admin.capnp) on the node's admin port.
#include <capnp/ez-rpc.h>
#include <kj/async-io.h>
#include <fmt/format.h>

#include <cstdio>

#include "kernels/base/error.h"
#include "schemas/admin.capnp.h"
#include "schemas/auth.capnp.h"
#include "transport/auth/api_keys.h"
#include "tools/tandem/commands.h"
#include "tools/tandem/flags.h"
#include "transport/http/json.h"

namespace tandem::cli {

namespace {

/// "healthy" (ready to serve), "draining"/"drained" (tandem inspect --drain), "degraded" (alive
/// but cannot serve: see readyStatus) or "UNHEALTHY".
const char* node_state(admin::NodeReport::Reader r) {
  if (!r.getHealthy()) return "UNHEALTHY";
  if (r.getDrain().size()) return r.getDrain().cStr();
  return r.getReady() ? "healthy" : "degraded";
}

std::string to_json(admin::NodeReport::Reader r, int32_t omitted) {
  json::writer w;
  w.begin_object();
  w.key("node").str(r.getNode().cStr());
  w.key("model").str(r.getModelId().cStr());
  w.key("healthy").boolean(r.getHealthy());
  w.key("ready").boolean(r.getReady());
  w.key("state").str(node_state(r));
  w.key("status").str(r.getStatus().cStr());
  w.key("ready_status").str(r.getReadyStatus().cStr());
  w.key("drain").str(r.getDrain().cStr());
  w.key("uptime_ms").num(r.getUptimeMs());
  w.key("actors").begin_array();
  for (auto a : r.getActors()) {
    w.begin_object()
        .key("name").str(a.getName().cStr())
        .key("state").str(a.getState().cStr())
        .key("mailbox_depth").num(a.getMailboxDepth())
        .key("mailbox_bound").num(a.getMailboxBound())
        .key("messages_handled").num(a.getMessagesHandled())
        .key("mailbox_rejected").num(a.getMailboxRejected())
        .key("restarts").num(a.getRestarts())
        .key("last_error").str(a.getLastError().cStr())
        .end_object();
  }
  w.end_array();
  w.key("requests").begin_array();
  for (auto q : r.getRequests()) {
    w.begin_object()
        .key("id").str(q.getId().cStr())
        .key("state").str(q.getState().cStr())
        .key("age_ms").num(q.getAgeMs())
        .key("prompt_tokens").num(q.getPromptTokens())
        .key("completion_tokens").num(q.getCompletionTokens())
        .end_object();
  }
  w.end_array();
  w.key("requests_omitted").num(omitted);
  w.key("pools").begin_array();
  for (auto p : r.getPools()) {
    w.begin_object()
        .key("name").str(p.getName().cStr())
        .key("pages_total").num(p.getPagesTotal())
        .key("pages_free").num(p.getPagesFree())
        .key("pages_cached").num(p.getPagesCached())
        .key("pages_evictable").num(p.getPagesEvictable())
        .key("bytes").num(p.getBytes())
        .end_object();
  }
  w.end_array();
  w.end_object();
  return w.take();
}

std::string to_text(admin::NodeReport::Reader r, int32_t omitted) {
  const bool degraded = r.getHealthy() && !r.getReady();
  std::string o = fmt::format("node {}  model {}  {}  up {:.1f} s  status: {}\n\n", r.getNode().cStr(),
                              r.getModelId().cStr(), node_state(r), double(r.getUptimeMs()) / 1000.0,
                              degraded ? r.getReadyStatus().cStr() : r.getStatus().cStr());
  o += fmt::format("{:<12} {:<14} {:>12} {:>10} {:>9} {:>9}  {}\n", "ACTOR", "STATE", "MAILBOX", "HANDLED", "REJECTED",
                   "RESTARTS", "LAST ERROR");
  for (auto a : r.getActors())
    o += fmt::format("{:<12} {:<14} {:>12} {:>10} {:>9} {:>9}  {}\n", a.getName().cStr(), a.getState().cStr(),
                     fmt::format("{}/{}", a.getMailboxDepth(), a.getMailboxBound()), a.getMessagesHandled(),
                     a.getMailboxRejected(), a.getRestarts(), a.getLastError().size() ? a.getLastError().cStr() : "-");
  o += fmt::format("\nREQUESTS ({} in flight{})\n", r.getRequests().size() + size_t(omitted),
                   omitted ? fmt::format(", {} oldest shown", r.getRequests().size()) : "");
  if (r.getRequests().size()) {
    o += fmt::format("{:<28} {:<10} {:>10} {:>8} {:>11}\n", "ID", "STATE", "AGE", "PROMPT", "COMPLETION");
    for (auto q : r.getRequests())
      o += fmt::format("{:<28} {:<10} {:>10} {:>8} {:>11}\n", q.getId().cStr(), q.getState().cStr(),
                       fmt::format("{} ms", q.getAgeMs()), q.getPromptTokens(), q.getCompletionTokens());
  }
  o += "\nKV POOLS\n";
  o += fmt::format("{:<8} {:>10} {:>10} {:>10} {:>10} {:>14}\n", "POOL", "PAGES", "FREE", "CACHED", "EVICTABLE", "BYTES");
  for (auto p : r.getPools())
    o += fmt::format("{:<8} {:>10} {:>10} {:>10} {:>10} {:>14}\n", p.getName().cStr(), p.getPagesTotal(),
                     p.getPagesFree(), p.getPagesCached(), p.getPagesEvictable(), p.getBytes());
  return o;
}

}  // namespace

int inspect(args a) {
  flags f;
  f.sw("json", "print one JSON object per report instead of tables")
      .opt("watch", "repeat every SECONDS until interrupted (or --count reports)", "0")
      .opt("count", "with --watch: stop after this many reports (0 = until interrupted)", "0")
      .opt("max-requests", "in-flight requests to list (oldest first)", "50")
      .opt("api-key-file", "file whose first key is sent to the node (default: $TANDEM_API_KEY)")
      .sw("drain", "drain the node first: no new work is routed to it, it finishes what it holds, then reports "
                   "drained (safe to stop); a restart or --undrain takes it back")
      .sw("undrain", "take a draining or drained node back into service first");
  const char* usage = "usage: tandem inspect HOST:PORT [--json] [--watch SECONDS] [--count N] [--drain | --undrain]\n"
                      "  HOST:PORT is the node's admin port (admin_port in the config, --admin-port of serve)\n";
  if (!f.parse(a)) {
    std::fprintf(stderr, "%s%s", usage, f.help().c_str());
    return 0;
  }
  if (f.positional().size() != 1) throw tandem::error(std::string("expected one HOST:PORT\n") + usage);
  const std::string& addr = f.positional()[0];
  auto colon = addr.rfind(':');
  if (colon == std::string::npos || colon == 0 || colon + 1 == addr.size())
    throw tandem::error(fmt::format("'{}' is not HOST:PORT; e.g. 127.0.0.1:8082", addr));
  std::string host = addr.substr(0, colon);
  int64_t port = 0;
  try {
    port = std::stoll(addr.substr(colon + 1));
  } catch (...) {
    port = -1;
  }
  if (port <= 0 || port > 65535) throw tandem::error(fmt::format("'{}': the port must be 1..65535", addr));
  double watch = f.real("watch");
  int64_t count = f.num("count");
  int64_t max_requests = f.num("max-requests");
  if (watch < 0) throw tandem::error("--watch SECONDS must be >= 0");
  if (max_requests < 0 || max_requests > 100000) throw tandem::error("--max-requests must be in 0..100000");
  bool json = f.on("json");
  if (f.on("drain") && f.on("undrain")) throw tandem::error("--drain and --undrain exclude each other; give one");
  std::string key = client_api_key(f.str("api-key-file"));

  try {
    capnp::EzRpcClient client(host, static_cast<unsigned>(port));
    auto& ws = client.getWaitScope();
    auto gate = client.getMain<auth::Gate>().authenticateRequest();
    gate.setKey(key);
    auto admin = gate.send().wait(ws).getCap().castAs<admin::Admin>();
    if (f.on("drain") || f.on("undrain")) {
      auto req = admin.drainRequest();
      req.setOn(f.on("drain"));
      auto resp = req.send().wait(ws);
      if (watch <= 0) {
        std::string out = json ? to_json(resp.getReport(), 0) + "\n" : to_text(resp.getReport(), 0);
        std::fputs(out.c_str(), stdout);
        return 0;
      }
    }
    for (int64_t n = 1;; ++n) {
      auto req = admin.inspectRequest();
      req.setMaxRequests(static_cast<int32_t>(max_requests));
      auto resp = req.send().wait(ws);
      std::string out = json ? to_json(resp.getReport(), resp.getRequestsOmitted()) + "\n"
                             : to_text(resp.getReport(), resp.getRequestsOmitted());
      if (watch > 0 && !json) std::fputs("\x1b[H\x1b[2J", stdout);  // clear the screen between reports
      std::fputs(out.c_str(), stdout);
      std::fflush(stdout);
      if (watch <= 0 || (count > 0 && n >= count)) break;
      client.getIoProvider().getTimer().afterDelay(static_cast<int64_t>(watch * 1000) * kj::MILLISECONDS).wait(ws);
    }
  } catch (const kj::Exception& e) {
    // The node refused the key: say so, not "is a node serving there?".
    if (e.getType() == kj::Exception::Type::FAILED && std::string_view(e.getDescription().cStr()).find("API key") != std::string_view::npos)
      throw tandem::error(error_kind::failed, fmt::format("cannot inspect {}: {}", addr, e.getDescription().cStr()));
    throw tandem::error(error_kind::disconnected,
                        fmt::format("cannot inspect {}: {}; is a node serving its admin port there (admin_port in the "
                                    "config, --admin-port of tandem serve)?",
                                    addr, e.getDescription().cStr()));
  }
  return 0;
}

}  // namespace tandem::cli
