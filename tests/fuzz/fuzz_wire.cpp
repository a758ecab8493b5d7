// libFuzzer target: Cap'n Proto decoding of actor messages with the production limits
// (wire_reader on schema::Envelope, the bytes every actor and node accepts), walking the
// whole message so every pointer is followed under the traversal limit, then the per-role
// dispatch an ingress and the receive wrapper do (the role's union, its gate in the table).
#include <cstdint>

#include <capnp/any.h>
#include <capnp/dynamic.h>
#include <capnp/schema.h>

#include "actors/common/protocol.h"
#include "actors/common/wire.h"

namespace {

/// Visits every field reachable from `v` (bounded by the reader's traversal limit).
void walk(capnp::DynamicValue::Reader v, int depth) {
  if (depth > 64) return;
  switch (v.getType()) {
    case capnp::DynamicValue::STRUCT: {
      auto s = v.as<capnp::DynamicStruct>();
      KJ_IF_MAYBE(f, s.which()) { walk(s.get(*f), depth + 1); }
      for (auto f : s.getSchema().getNonUnionFields())
        if (s.has(f)) walk(s.get(f), depth + 1);
      break;
    }
    case capnp::DynamicValue::LIST: {
      // Zero-sized elements cost one traversal word each; wire_reader's budget is scaled to the
      // message size (docs/security.md), but a large message may still hold long lists:
      // visiting the first 4096 and the last covers the decoding, the rest only costs time.
      auto l = v.as<capnp::DynamicList>();
      for (unsigned i = 0; i < l.size() && i < 4096; ++i) walk(l[i], depth + 1);
      if (l.size() > 4096) walk(l[l.size() - 1], depth + 1);
      break;
    }
    case capnp::DynamicValue::TEXT: (void)v.as<capnp::Text>().size(); break;
    case capnp::DynamicValue::DATA: (void)v.as<capnp::Data>().size(); break;
    default: break;
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  tandem::wire w{std::vector<uint8_t>(data, data + size)};
  try {
    tandem::wire_reader r(w);
    walk(capnp::DynamicStruct::Reader(r.root()), 0);
    // The typed conversions actors use on received messages: the envelope's role, its kind,
    // the gate the table gives it (an unknown kind is reported, not trusted).
    auto env = r.root();
    bool known = false;
    switch (env.which()) {
      case tandem::schema::Envelope::ROUTER:
        (void)tandem::gate_of<tandem::router_role>(env.getRouter().which(), &known);
        break;
      case tandem::schema::Envelope::PREFILL:
        (void)tandem::gate_of<tandem::prefill_role>(env.getPrefill().which(), &known);
        break;
      case tandem::schema::Envelope::DECODE:
        (void)tandem::gate_of<tandem::decode_role>(env.getDecode().which(), &known);
        break;
      case tandem::schema::Envelope::WORKER:
        (void)tandem::gate_of<tandem::worker_role>(env.getWorker().which(), &known);
        break;
      case tandem::schema::Envelope::CACHE_TIER:
        (void)tandem::gate_of<tandem::cache_tier_role>(env.getCacheTier().which(), &known);
        break;
      case tandem::schema::Envelope::REPLY:
        (void)env.getReply().which();
        break;
      default:
        break;
    }
    (void)env.getVersion();
  } catch (const tandem::error&) {
  } catch (const kj::Exception&) {
  }
  return 0;
}
