#include "actors/common/wire.h"

#include <capnp/serialize.h>
#include <fmt/format.h>
#include <kj/exception.h>

#include <algorithm>
#include <cstring>

namespace tandem {

wire make_wire(capnp::MessageBuilder& mb) {
  auto words = capnp::messageToFlatArray(mb);
  auto bytes = words.asBytes();
  return wire{std::vector<uint8_t>(bytes.begin(), bytes.end())};
}

wire make_wire(const std::function<void(schema::Envelope::Builder)>& fill) {
  capnp::MallocMessageBuilder mb;
  auto env = mb.initRoot<schema::Envelope>();
  fill(env);
  env.setVersion(schema::WIRE_VERSION);
  return make_wire(mb);
}

wire make_reply(const std::function<void(schema::Reply::Builder)>& fill) {
  return make_wire([&](schema::Envelope::Builder env) { fill(env.initReply()); });
}

wire make_error_reply(const tandem::error& e) {
  return make_reply([&](schema::Reply::Builder r) { set_error(r.initError(), e); });
}

schema::Reply::Reader wire_reader::reply() {
  auto env = root();
  if (!env.isReply())
    throw tandem::error(error_kind::failed,
                        "expected a reply, got a role message (a peer of another protocol version?)");
  return env.getReply();
}

uint64_t wire_limits::traversal_budget(uint64_t message_words) const {
  const uint64_t cap = traversal_limit_words;
  if (traversal_words_per_word != 0 && message_words > (cap - std::min(cap, traversal_slack_words)) / traversal_words_per_word)
    return cap;
  return std::min(cap, message_words * traversal_words_per_word + traversal_slack_words);
}

wire_reader::wire_reader(const wire& w, const wire_limits& lim) {
  if (w.bytes.empty() || w.bytes.size() % sizeof(capnp::word) != 0)
    throw tandem::error(error_kind::failed,
                        fmt::format("malformed actor message: {} bytes is not a whole number of 8-byte words",
                                    w.bytes.size()));
  // The vector's bytes need not be word-aligned: copy before reading.
  words_ = kj::heapArray<capnp::word>(w.bytes.size() / sizeof(capnp::word));
  std::memcpy(words_.begin(), w.bytes.data(), w.bytes.size());
  capnp::ReaderOptions opts;
  opts.traversalLimitInWords = lim.traversal_budget(w.bytes.size() / sizeof(capnp::word));
  opts.nestingLimit = static_cast<int>(lim.nesting_limit);
  try {
    reader_ = kj::heap<capnp::FlatArrayMessageReader>(words_.asPtr(), opts);
  } catch (const kj::Exception& e) {
    throw tandem::error(error_kind::failed,
                        fmt::format("malformed actor message: {}", e.getDescription().cStr()));
  }
}

std::vector<int32_t> to_vector(capnp::List<int32_t>::Reader l) {
  std::vector<int32_t> v;
  v.reserve(l.size());
  for (auto x : l) v.push_back(x);
  return v;
}

schema::ErrorKind to_schema(error_kind k) {
  switch (k) {
    case error_kind::failed:
      return schema::ErrorKind::FAILED;
    case error_kind::overloaded:
      return schema::ErrorKind::OVERLOADED;
    case error_kind::disconnected:
      return schema::ErrorKind::DISCONNECTED;
    case error_kind::unimplemented:
      return schema::ErrorKind::UNIMPLEMENTED;
  }
  return schema::ErrorKind::FAILED;
}

error_kind from_schema(schema::ErrorKind k) {
  switch (k) {
    case schema::ErrorKind::FAILED:
      return error_kind::failed;
    case schema::ErrorKind::OVERLOADED:
      return error_kind::overloaded;
    case schema::ErrorKind::DISCONNECTED:
      return error_kind::disconnected;
    case schema::ErrorKind::UNIMPLEMENTED:
      return error_kind::unimplemented;
  }
  return error_kind::failed;
}

void set_error(schema::Error::Builder b, const tandem::error& e) {
  b.setKind(to_schema(e.kind()));
  b.setMessage(e.what());
}

tandem::error read_error(schema::Error::Reader r) {
  return tandem::error(from_schema(r.getKind()), std::string(r.getMessage().cStr()));
}

std::optional<tandem::error> read_forward_result(const wire* w, const tandem::error* transport_err,
                                                 std::vector<int32_t>& sampled) {
  if (transport_err) return *transport_err;
  if (!w) return std::nullopt;
  try {
    wire_reader rd(*w);
    auto env = rd.reply();
    if (env.isError()) return read_error(env.getError());
    if (!env.isForwardResult()) return tandem::error(error_kind::failed, "worker sent an unexpected reply");
    auto r = env.getForwardResult();
    if (r.getFailed()) return read_error(r.getError());
    sampled = to_vector(r.getTokens());
  } catch (const tandem::error& e) {
    return e;
  }
  return std::nullopt;
}

}  // namespace tandem
