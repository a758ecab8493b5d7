#include "transport/rpc/rpc_listener.h"

#include <capnp/rpc-twoparty.h>
#include <spdlog/spdlog.h>

namespace tandem {

struct rpc_listener::connection {
  connection(kj::Own<kj::AsyncIoStream> s, const capnp::ReaderOptions& opt, capnp::Capability::Client bootstrap)
      : stream(kj::mv(s)),
        network(*stream, capnp::rpc::twoparty::Side::SERVER, opt),
        rpc(capnp::makeRpcServer(network, kj::mv(bootstrap))) {}
  kj::Own<kj::AsyncIoStream> stream;
  capnp::TwoPartyVatNetwork network;
  capnp::RpcSystem<capnp::rpc::twoparty::VatId> rpc;
};

void rpc_listener::log_errors::taskFailed(kj::Exception&& e) {
  // A peer that went away is routine (client closed); its requests were aborted.
  if (e.getType() == kj::Exception::Type::DISCONNECTED)
    spdlog::debug("{}: {}", name, e.getDescription().cStr());
  else
    spdlog::warn("{}: {}", name, e.getDescription().cStr());
}

rpc_listener::rpc_listener(std::string name, const limits& lim)
    : name_(std::move(name)), lim_(lim), tasks_(error_handler_) {}

rpc_listener::~rpc_listener() = default;

kj::Promise<void> rpc_listener::listen(kj::ConnectionReceiver& listener) {
  return listener.accept().then([this, &listener](kj::Own<kj::AsyncIoStream> s) {
    if (open_ >= lim_.max_rpc_connections) {
      ++rejected_;
      spdlog::warn("{}: {} connections open (limits.max_rpc_connections); closing a new one", name_, open_);
    } else {
      capnp::ReaderOptions opt;
      // Words of 8 bytes, with headroom for the message framing.
      opt.traversalLimitInWords = static_cast<uint64_t>(lim_.max_body_bytes) / 8 + 1024;
      opt.nestingLimit = 64;
      auto c = kj::heap<connection>(kj::mv(s), opt, bootstrap_);
      ++open_;
      auto done = c->network.onDisconnect();
      tasks_.add(done.attach(kj::mv(c), kj::defer([this] { --open_; })));
    }
    return listen(listener);
  });
}

}  // namespace tandem
