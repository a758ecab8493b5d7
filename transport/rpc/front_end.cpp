#include "transport/rpc/front_end.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <csignal>

#include <kj/async-io.h>
#include <kj/async-unix.h>
#include <spdlog/spdlog.h>

#include "transport/http/openai_server.h"
#include "transport/rpc/admin_server.h"
#include "transport/rpc/rpc_server.h"

namespace tandem {

namespace {

/// The address a listener really bound (getsockname), so the "listening on" line shows what
/// the kernel accepts connections on, not what was asked for.
std::string bound_address(kj::ConnectionReceiver& l, const std::string& fallback) {
  sockaddr_storage ss{};
  kj::uint len = sizeof ss;
  try {
    l.getsockname(reinterpret_cast<sockaddr*>(&ss), &len);
  } catch (const kj::Exception&) {
    return fallback;
  }
  char buf[INET6_ADDRSTRLEN] = {};
  if (ss.ss_family == AF_INET) inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(&ss)->sin_addr, buf, sizeof buf);
  else if (ss.ss_family == AF_INET6) inet_ntop(AF_INET6, &reinterpret_cast<sockaddr_in6*>(&ss)->sin6_addr, buf, sizeof buf);
  else return fallback;
  return buf;
}

}  // namespace

struct front_end::stopper {
  std::mutex m;
  bool requested = false;
  kj::Own<kj::CrossThreadPromiseFulfiller<void>> fulfiller;  ///< set while run() serves
};

front_end::front_end(serving_api& api, front_end_options opt)
    : api_(api), opt_(std::move(opt)), stop_(std::make_shared<stopper>()) {}

front_end::~front_end() = default;

void front_end::stop() {
  kj::Own<kj::CrossThreadPromiseFulfiller<void>> f;
  {
    std::lock_guard<std::mutex> lock(stop_->m);
    stop_->requested = true;
    f = kj::mv(stop_->fulfiller);
  }
  if (f) f->fulfill();
}

void front_end::run(const std::function<void(const listener_info&)>& on_listening) {
  auto io = kj::setupAsyncIo();
  auto& ws = io.waitScope;
  auto& timer = io.provider->getTimer();

  auto bind = [&](int port, const char* what) -> kj::Own<kj::ConnectionReceiver> {
    try {
      auto addr = io.provider->getNetwork().parseAddress(opt_.host, static_cast<uint32_t>(port)).wait(ws);
      return addr->listen();
    } catch (const kj::Exception& e) {
      throw error(error_kind::failed, fmt::format("cannot listen for {} on {}:{}: {}; pick another --host/--port", what,
                                                  opt_.host, port, e.getDescription().cStr()));
    }
  };

  kj::Own<openai_server> http;
  kj::Own<rpc_server> rpc;
  kj::Own<admin_server> admin;
  kj::Own<kj::ConnectionReceiver> http_l, rpc_l, admin_l;
  kj::Vector<kj::Promise<void>> serving;
  if (opt_.http_port >= 0) {
    http_l = bind(opt_.http_port, "http");
    http = kj::heap<openai_server>(api_, opt_.lim, timer);
    http->set_auth(opt_.keys, opt_.auth_allowlist);
    if (!opt_.chat_template.empty()) http->set_chat_template(opt_.chat_template);
  }
  if (opt_.rpc_port >= 0) {
    rpc_l = bind(opt_.rpc_port, "rpc");
    rpc = kj::heap<rpc_server>(api_, opt_.lim, timer);
    rpc->set_api_keys(opt_.keys);
  }
  if (http && rpc) http->set_extra_metrics([r = rpc.get()] { return r->metrics_text(); });
  if (opt_.admin_port >= 0) {
    admin_l = bind(opt_.admin_port, "admin");
    admin = kj::heap<admin_server>(api_, opt_.lim);
    admin->set_api_keys(opt_.keys);
  }
  auto on_fail = [](const char* what) {
    return [what](kj::Exception&& e) { spdlog::error("{} listener failed: {}", what, e.getDescription().cStr()); };
  };
  if (http) {
    serving.add(http->listen(*http_l).catch_(on_fail("http")));
    on_listening({"http", bound_address(*http_l, opt_.host), static_cast<uint16_t>(http_l->getPort())});
  }
  if (rpc) {
    serving.add(rpc->listen(*rpc_l).catch_(on_fail("rpc")));
    on_listening({"rpc", bound_address(*rpc_l, opt_.host), static_cast<uint16_t>(rpc_l->getPort())});
  }

  if (admin) {
    serving.add(admin->listen(*admin_l).catch_(on_fail("admin")));
    on_listening({"admin", bound_address(*admin_l, opt_.host), static_cast<uint16_t>(admin_l->getPort())});
  }

  auto paf = kj::newPromiseAndCrossThreadFulfiller<void>();
  {
    std::lock_guard<std::mutex> lock(stop_->m);
    if (stop_->requested) paf.fulfiller->fulfill();
    else stop_->fulfiller = kj::mv(paf.fulfiller);
  }
  kj::Promise<void> stopped = kj::mv(paf.promise);
  if (opt_.handle_signals) {
    auto sig = [&](int s) {
      return io.unixEventPort.onSignal(s).then([](siginfo_t info) { spdlog::info("signal {}: stopping", info.si_signo); });
    };
    stopped = stopped.exclusiveJoin(sig(SIGINT)).exclusiveJoin(sig(SIGTERM));
  }
  stopped.wait(ws);
  {
    std::lock_guard<std::mutex> lock(stop_->m);
    stop_->fulfiller = nullptr;
  }
  // Stop accepting; in-flight requests are cancelled with their objects below, which aborts
  // their engine requests.
  serving.clear();
  if (http) http->set_extra_metrics(nullptr);
  admin = nullptr;
  rpc = nullptr;
  http = nullptr;
}

}  // namespace tandem
