// libFuzzer target: the Cap'n Proto RPC accept side of the Node and admin ports
// (rpc_listener::serve: the production ReaderOptions, the auth Gate bootstrap) fed arbitrary
// bytes as the client's message stream. Auth is on; the key in the seeds opens the Gate, behind
// which sits a capability that refuses every call.
#include <cstdint>

#include <capnp/capability.h>
#include <kj/async-io.h>
#include <spdlog/spdlog.h>

#include "transport/rpc/rpc_listener.h"

namespace {

struct env {
  env() {
    spdlog::set_level(spdlog::level::off);
    lim.max_body_bytes = 1 << 16;
    listener = kj::heap<tandem::rpc_listener>("fuzz", lim);
    // Any capability will do behind the Gate: calls on it fail as unimplemented.
    listener->set_bootstrap(capnp::Capability::Client(KJ_EXCEPTION(UNIMPLEMENTED, "fuzz: nothing behind the gate")));
    listener->set_api_keys(std::make_shared<tandem::api_keys>(std::vector<std::string>{"fuzz-key-0123456789"}));
  }
  kj::AsyncIoContext io = kj::setupAsyncIo();
  tandem::limits lim;
  kj::Own<tandem::rpc_listener> listener;
};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static env* e = new env();
  auto pipe = kj::newTwoWayPipe();
  auto served = e->listener->serve(kj::mv(pipe.ends[0])).catch_([](kj::Exception&&) {});
  auto& client = *pipe.ends[1];
  auto wrote = client.write(data, size)
                   .then([&client] { client.shutdownWrite(); })
                   .catch_([](kj::Exception&&) {})
                   .eagerlyEvaluate(nullptr);
  auto replies = client.readAllBytes(1 << 20).catch_([](kj::Exception&&) { return kj::Array<kj::byte>(); });
  replies.wait(e->io.waitScope);
  // The connection must end on its own once the server gave up on the input; the rest of a
  // write it stopped reading is dropped (a socket would buffer it; the in-memory pipe blocks).
  served.wait(e->io.waitScope);
  return 0;
}
