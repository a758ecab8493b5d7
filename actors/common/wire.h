#pragma once
/// The one message payload actors exchange: a serialized `schema::Envelope` (Cap'n Proto).
/// Build with `make_wire`, read with `wire_reader` (explicit ReaderOptions), so no actor
/// repeats the framing. The same bytes cross nodes later.
#include <capnp/message.h>
#include <capnp/serialize.h>
#include <kj/array.h>

#include <caf/allowed_unsafe_message_type.hpp>
#include <caf/atom.hpp>
#include <caf/meta/type_name.hpp>
#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "kernels/base/error.h"
#include "schemas/internal.capnp.h"

namespace tandem {

/// Tags every actor message carrying a wire payload.
using wire_atom = caf::atom_constant<caf::atom("wire")>;
/// Tags a request/reply exchange (the handler replies with a wire); `wire_atom` messages
/// get no reply.
using call_atom = caf::atom_constant<caf::atom("call")>;
/// Periodic self-message (deadline checks, retries).
using tick_atom = caf::atom_constant<caf::atom("tick")>;
/// Stats query (bypasses mailbox gates: bounded by the caller's timeout).
using stats_atom = caf::atom_constant<caf::atom("stats")>;
/// Cluster shutdown: the router ends every running request with `disconnected`.
using stop_atom = caf::atom_constant<caf::atom("stop")>;
/// Local-only submission carrying the event callback (never crosses nodes).
using submit_atom = caf::atom_constant<caf::atom("submit")>;
/// Tags KV transfer orders to the worker and its kvDone answers. Not gated: an order follows a
/// request the scheduler already holds pages for, so they are bounded by the live requests.
using kv_atom = caf::atom_constant<caf::atom("kv")>;

/// Serialized Envelope bytes.
struct wire {
  std::vector<uint8_t> bytes;
};

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, wire& x) {
  return f(caf::meta::type_name("tandem_wire"), x.bytes);
}

/// Limits applied to every read: hostile or corrupt bytes cannot make us traverse without bound.
/// The traversal budget of one message is scaled to its size: Cap'n Proto charges a list of
/// zero-sized elements one word per element although the elements occupy no bytes, so under a
/// fixed budget a 48-byte message could declare 2^23 elements (and a reader that sizes vectors
/// by the list allocate and loop that much). A reader following each pointer once is charged
/// about the message's own size; the multiple leaves room for getters called again.
struct wire_limits {
  uint64_t traversal_limit_words = uint64_t(1) << 23;  ///< cap for any message: 64 MiB
  uint64_t traversal_words_per_word = 8;               ///< budget per word of the message ...
  uint64_t traversal_slack_words = 1024;               ///< ... plus this
  unsigned nesting_limit = 16;
  /// The traversal budget of a message of `message_words` words.
  uint64_t traversal_budget(uint64_t message_words) const;
};

/// Serializes a builder's message.
wire make_wire(capnp::MessageBuilder& mb);

/// Builds an Envelope with `fill(envelope_builder)`, stamps schema::WIRE_VERSION and
/// serializes it. Actors build role messages through actors/common/protocol.h instead.
wire make_wire(const std::function<void(schema::Envelope::Builder)>& fill);

/// Builds a Reply (the answer to a call or a stats query) with `fill(reply_builder)`.
wire make_reply(const std::function<void(schema::Reply::Builder)>& fill);
/// A Reply carrying only `e` (a call that failed before its handler answered).
wire make_error_reply(const tandem::error& e);

/// Holds aligned words and a reader over them; read `root()` while this lives.
class wire_reader {
 public:
  /// Throws tandem::error (failed) on malformed bytes.
  explicit wire_reader(const wire& w, const wire_limits& lim = {});
  schema::Envelope::Reader root() { return reader_->getRoot<schema::Envelope>(); }
  /// The Reply of an answer; throws tandem::error (failed) when the message is a role's.
  schema::Reply::Reader reply();

 private:
  kj::Array<capnp::word> words_;
  kj::Own<capnp::FlatArrayMessageReader> reader_;
};

// --- small conversions shared by the actors
std::vector<int32_t> to_vector(capnp::List<int32_t>::Reader l);
template <class Init>
void fill_list(Init&& init, std::span<const int32_t> v) {
  auto l = init(static_cast<unsigned>(v.size()));
  for (size_t i = 0; i < v.size(); ++i) l.set(static_cast<unsigned>(i), v[i]);
}
schema::ErrorKind to_schema(error_kind k);
error_kind from_schema(schema::ErrorKind k);
void set_error(schema::Error::Builder b, const tandem::error& e);
tandem::error read_error(schema::Error::Reader r);

/// The worker's reply to a forward request (or the transport error that replaced it): the
/// sampled tokens in batch order, or the error that ends every sequence of the batch.
std::optional<tandem::error> read_forward_result(const wire* w, const tandem::error* transport_err,
                                                 std::vector<int32_t>& sampled);

}  // namespace tandem
