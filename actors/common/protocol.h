#pragma once
/// Typed per-role protocols. Each role's actor receives one Cap'n Proto union
/// (schemas/internal.capnp: RouterIn, PrefillIn, DecodeIn, WorkerIn, CacheTierIn) and nothing
/// else. `role_handle<R>` is the only way to send to a role: it builds R's union (a message
/// kind outside R's protocol does not compile: `in_protocol<R, M>`) and enters R's mailbox
/// gate itself, as the table below says: `work` messages may be refused (`overloaded`),
/// `control` ones are always counted in (they release resources or end accepted requests),
/// `none` ones (kv_atom) are not gated (bounded by the transfers a scheduler holds pages for).
/// The receive side is `receive<R>` (actors/common/receive.h).
#include <caf/actor.hpp>
#include <caf/send.hpp>
#include <tuple>
#include <type_traits>
#include <utility>

#include "actors/common/bounded_mailbox.h"
#include "actors/common/wire.h"

namespace tandem {

/// Message kinds, one tag per message of any role (the same kind may belong to several).
namespace msg {
struct submit {};
struct requeue {};
struct event {};
struct credit {};
struct abort {};
struct credit_query {};
struct handoff {};
struct kv_done {};
struct forward {};
struct cache_copy {};
struct kv_send {};
struct kv_receive {};
struct kv_abort {};
struct acquire {};
struct alloc {};
struct free {};
struct insert {};
}  // namespace msg

/// How a message passes the receiver's mailbox gate.
enum class gate_kind {
  work,     ///< creates work: try_enter, may be refused with `overloaded`
  control,  ///< releases resources or ends accepted work: enter_control, never refused
  none,     ///< not gated (kv_atom: bounded by the transfers in flight)
};

// --- roles: the Envelope branch and the message kinds of each (the table is below)
struct router_role {
  using in = schema::RouterIn;
  static constexpr const char* name = "router";
  using messages = std::tuple<msg::submit, msg::event, msg::credit, msg::requeue, msg::abort>;
  static in::Builder init(schema::Envelope::Builder e) { return e.initRouter(); }
  static bool is(schema::Envelope::Reader e) { return e.isRouter(); }
  static in::Reader get(schema::Envelope::Reader e) { return e.getRouter(); }
};
struct prefill_role {
  using in = schema::PrefillIn;
  static constexpr const char* name = "prefill";
  using messages =
      std::tuple<msg::submit, msg::requeue, msg::abort, msg::credit_query, msg::credit>;
  static in::Builder init(schema::Envelope::Builder e) { return e.initPrefill(); }
  static bool is(schema::Envelope::Reader e) { return e.isPrefill(); }
  static in::Reader get(schema::Envelope::Reader e) { return e.getPrefill(); }
};
struct decode_role {
  using in = schema::DecodeIn;
  static constexpr const char* name = "decode";
  using messages = std::tuple<msg::handoff, msg::submit, msg::abort, msg::credit_query, msg::kv_done>;
  static in::Builder init(schema::Envelope::Builder e) { return e.initDecode(); }
  static bool is(schema::Envelope::Reader e) { return e.isDecode(); }
  static in::Reader get(schema::Envelope::Reader e) { return e.getDecode(); }
};
struct worker_role {
  using in = schema::WorkerIn;
  static constexpr const char* name = "worker";
  using messages = std::tuple<msg::forward, msg::cache_copy, msg::kv_send, msg::kv_receive, msg::kv_abort>;
  static in::Builder init(schema::Envelope::Builder e) { return e.initWorker(); }
  static bool is(schema::Envelope::Reader e) { return e.isWorker(); }
  static in::Reader get(schema::Envelope::Reader e) { return e.getWorker(); }
};
struct cache_tier_role {
  using in = schema::CacheTierIn;
  static constexpr const char* name = "cache_tier";
  using messages = std::tuple<msg::acquire, msg::alloc, msg::free, msg::insert>;
  static in::Builder init(schema::Envelope::Builder e) { return e.initCacheTier(); }
  static bool is(schema::Envelope::Reader e) { return e.isCacheTier(); }
  static in::Reader get(schema::Envelope::Reader e) { return e.getCacheTier(); }
};

/// One message of a role's protocol: its union member, payload, CAF atom and gate. The primary
/// template is empty: a (role, kind) pair without a specialization is not in the protocol.
template <class Role, class Msg>
struct protocol_entry {};

/// True when `Msg` is a message `Role` receives.
template <class Role, class Msg>
concept in_protocol = requires { protocol_entry<Role, Msg>::gate; };

#define TANDEM_PROTOCOL_ENTRY(ROLE, MSG, CAMEL, UPPER, PAYLOAD, ATOM, GATE)                      \
  template <>                                                                                   \
  struct protocol_entry<ROLE, msg::MSG> {                                                       \
    using payload = schema::PAYLOAD;                                                            \
    using atom = ATOM;                                                                          \
    static constexpr gate_kind gate = gate_kind::GATE;                                          \
    static constexpr ROLE::in::Which which = ROLE::in::UPPER;                                   \
    static payload::Builder init(ROLE::in::Builder b) { return b.init##CAMEL(); }               \
    static void set(ROLE::in::Builder b, payload::Reader r) { b.set##CAMEL(r); }                \
    static payload::Reader get(ROLE::in::Reader r) { return r.get##CAMEL(); }                   \
  }

// --- THE table: which message each role takes, how it is delivered, work or control.
//     (router submit: local only, with the event callback; kv_atom: worker <-> schedulers.)
TANDEM_PROTOCOL_ENTRY(router_role, submit, Submit, SUBMIT, SubmitRequest, submit_atom, work);
TANDEM_PROTOCOL_ENTRY(router_role, event, Event, EVENT, TokenEvent, wire_atom, control);
TANDEM_PROTOCOL_ENTRY(router_role, credit, Credit, CREDIT, Credit, wire_atom, control);
TANDEM_PROTOCOL_ENTRY(router_role, requeue, Requeue, REQUEUE, SubmitRequest, wire_atom, control);
TANDEM_PROTOCOL_ENTRY(router_role, abort, Abort, ABORT, Abort, wire_atom, control);

TANDEM_PROTOCOL_ENTRY(prefill_role, submit, Submit, SUBMIT, SubmitRequest, wire_atom, work);
TANDEM_PROTOCOL_ENTRY(prefill_role, requeue, Requeue, REQUEUE, SubmitRequest, wire_atom, control);
TANDEM_PROTOCOL_ENTRY(prefill_role, abort, Abort, ABORT, Abort, wire_atom, control);
TANDEM_PROTOCOL_ENTRY(prefill_role, credit_query, CreditQuery, CREDIT_QUERY, StatsQuery, wire_atom, control);
TANDEM_PROTOCOL_ENTRY(prefill_role, credit, Credit, CREDIT, Credit, wire_atom, control);

TANDEM_PROTOCOL_ENTRY(decode_role, handoff, Handoff, HANDOFF, KvHandoff, wire_atom, work);
TANDEM_PROTOCOL_ENTRY(decode_role, submit, Submit, SUBMIT, SubmitRequest, wire_atom, work);
TANDEM_PROTOCOL_ENTRY(decode_role, abort, Abort, ABORT, Abort, wire_atom, control);
TANDEM_PROTOCOL_ENTRY(decode_role, credit_query, CreditQuery, CREDIT_QUERY, StatsQuery, wire_atom, control);
TANDEM_PROTOCOL_ENTRY(decode_role, kv_done, KvDone, KV_DONE, KvTransferDone, kv_atom, none);

TANDEM_PROTOCOL_ENTRY(worker_role, forward, Forward, FORWARD, ForwardBatch, call_atom, work);
TANDEM_PROTOCOL_ENTRY(worker_role, cache_copy, CacheCopy, CACHE_COPY, CacheCopy, call_atom, control);
TANDEM_PROTOCOL_ENTRY(worker_role, kv_send, KvSend, KV_SEND, KvTransferOrder, kv_atom, none);
TANDEM_PROTOCOL_ENTRY(worker_role, kv_receive, KvReceive, KV_RECEIVE, KvTransferOrder, kv_atom, none);
TANDEM_PROTOCOL_ENTRY(worker_role, kv_abort, KvAbort, KV_ABORT, KvTransferOrder, kv_atom, none);

TANDEM_PROTOCOL_ENTRY(cache_tier_role, acquire, Acquire, ACQUIRE, AcquireRequest, call_atom, work);
TANDEM_PROTOCOL_ENTRY(cache_tier_role, alloc, Alloc, ALLOC, AllocRequest, call_atom, work);
TANDEM_PROTOCOL_ENTRY(cache_tier_role, free, Free, FREE, FreePages, wire_atom, control);
TANDEM_PROTOCOL_ENTRY(cache_tier_role, insert, Insert, INSERT, InsertPrefix, wire_atom, control);

#undef TANDEM_PROTOCOL_ENTRY

/// Calls `f(M{})` for each message kind M of `Role`.
template <class Role, class F>
void for_each_message(F&& f) {
  std::apply([&](auto... m) { (f(m), ...); }, typename Role::messages{});
}

/// The gate of the message `w` of `Role`'s union (the table above, at run time: a node's
/// ingress admits messages from other nodes with it). `known` is false for a kind this
/// binary does not know.
template <class Role>
gate_kind gate_of(typename Role::in::Which w, bool* known = nullptr) {
  gate_kind g = gate_kind::control;
  bool found = false;
  for_each_message<Role>([&](auto m) {
    using E = protocol_entry<Role, decltype(m)>;
    if (E::which == w) g = E::gate, found = true;
  });
  if (known) *known = found;
  return g;
}

/// Whether `w` of `Role` travels as (wire_atom, wire), the only form that crosses nodes.
template <class Role>
bool is_cast(typename Role::in::Which w) {
  bool cast = false;
  for_each_message<Role>([&](auto m) {
    using E = protocol_entry<Role, decltype(m)>;
    if (E::which == w) cast = std::is_same_v<typename E::atom, wire_atom>;
  });
  return cast;
}

/// Builds message `M` of `Role` with `fill(payload_builder)`.
template <class Role, class M, class Fill>
  requires in_protocol<Role, M>
wire make_role_wire(Fill&& fill) {
  return make_wire([&](schema::Envelope::Builder env) {
    fill(protocol_entry<Role, M>::init(Role::init(env)));
  });
}

/// A message built ahead of sending (e.g. by a helper shared by several senders), typed by
/// its role and kind so only `role_handle<Role>` sends it.
template <class Role, class M>
  requires in_protocol<Role, M>
struct role_wire {
  wire w;
  template <class Fill>
  static role_wire make(Fill&& fill) {
    return role_wire{make_role_wire<Role, M>(std::forward<Fill>(fill))};
  }
  operator const wire&() const { return w; }  // NOLINT: tests and links pass the bytes on
};

/// Builds message `M` of `Role` as a copy of `payload`.
template <class Role, class M>
  requires in_protocol<Role, M>
wire copy_role_wire(typename protocol_entry<Role, M>::payload::Reader payload) {
  return make_wire([&](schema::Envelope::Builder env) { protocol_entry<Role, M>::set(Role::init(env), payload); });
}

/// A place taken in a mailbox gate (or none needed). Sending consumes it; dropped unused, it
/// leaves the gate again, so a sender that changes its mind cannot leak a place.
class gate_ticket {
 public:
  gate_ticket() = default;
  static gate_ticket granted(mailbox_gate* g) {
    gate_ticket t;
    t.gate_ = g;
    t.ok_ = true;
    return t;
  }
  gate_ticket(gate_ticket&& o) noexcept : gate_(std::exchange(o.gate_, nullptr)), ok_(std::exchange(o.ok_, false)) {}
  gate_ticket& operator=(gate_ticket&& o) noexcept {
    release();
    gate_ = std::exchange(o.gate_, nullptr);
    ok_ = std::exchange(o.ok_, false);
    return *this;
  }
  gate_ticket(const gate_ticket&) = delete;
  gate_ticket& operator=(const gate_ticket&) = delete;
  ~gate_ticket() { release(); }
  /// False: the gate refused a work message.
  explicit operator bool() const { return ok_; }
  /// The message was enqueued: its receiver leaves the gate.
  void consume() {
    gate_ = nullptr;
    ok_ = false;
  }

 private:
  void release() {
    if (gate_) gate_->leave();
    gate_ = nullptr;
  }
  mailbox_gate* gate_ = nullptr;
  bool ok_ = false;
};

/// An actor of role `Role` with its mailbox gate. Send with `send` / `send_anon` / `call`;
/// `handle` and `gate` stay readable for stats, monitoring, exits and tests.
template <class Role>
struct role_handle {
  using role = Role;
  caf::actor handle;
  std::shared_ptr<mailbox_gate> gate;

  role_handle() = default;
  /// The spawn functions return untyped bounded_actors; a peer_set or route target types them.
  role_handle(bounded_actor a) : handle(std::move(a.handle)), gate(std::move(a.gate)) {}  // NOLINT
  explicit operator bool() const { return static_cast<bool>(handle) && gate != nullptr; }
  bounded_actor untyped() const { return bounded_actor{handle, gate}; }

  /// Takes a place in the gate for `M` as the table says (refused: a false ticket).
  template <class M>
    requires in_protocol<Role, M>
  [[nodiscard]] gate_ticket admit() const {
    return admit_as(protocol_entry<Role, M>::gate);
  }
  /// Takes a place in the gate as `g` says (the table's entry of the message).
  [[nodiscard]] gate_ticket admit_as(gate_kind g) const {
    switch (g) {
      case gate_kind::work:
        if (!gate->try_enter()) return {};
        return gate_ticket::granted(gate.get());
      case gate_kind::control:
        gate->enter_control();
        return gate_ticket::granted(gate.get());
      case gate_kind::none:
        break;
    }
    return gate_ticket::granted(nullptr);
  }

  /// Sends `M` built by `fill(payload_builder)` from `self` (extra: trailing message elements,
  /// e.g. the router submit's callback). False (nothing sent) if the gate refused it.
  template <class M, class Self, class Fill, class... Extra>
    requires in_protocol<Role, M> && (!std::is_same_v<std::decay_t<Fill>, gate_ticket>)
  bool send(Self* self, Fill&& fill, Extra&&... extra) const {
    auto t = admit<M>();
    if (!t) return false;
    send<M>(self, std::move(t), std::forward<Fill>(fill), std::forward<Extra>(extra)...);
    return true;
  }
  /// Sends with a ticket taken before (state changed between admission and sending).
  template <class M, class Self, class Fill, class... Extra>
    requires in_protocol<Role, M>
  void send(Self* self, gate_ticket t, Fill&& fill, Extra&&... extra) const {
    deliver<M>(self, std::move(t), make_role_wire<Role, M>(std::forward<Fill>(fill)), std::forward<Extra>(extra)...);
  }
  /// Sends a message built before; `self` may be a null `std::nullptr_t*` (see send_anon).
  template <class M, class Self>
  bool send(Self* self, role_wire<Role, M> m) const {
    auto t = admit<M>();
    if (!t) return false;
    deliver<M>(self, std::move(t), std::move(m.w));
    return true;
  }
  template <class M>
  bool send_anon(role_wire<Role, M> m) const {
    return send(static_cast<std::nullptr_t*>(nullptr), std::move(m));
  }
  /// `send` without a sending actor (callbacks, threads outside the actors).
  template <class M, class Fill, class... Extra>
    requires in_protocol<Role, M> && (!std::is_same_v<std::decay_t<Fill>, gate_ticket>)
  bool send_anon(Fill&& fill, Extra&&... extra) const {
    return send<M>(static_cast<std::nullptr_t*>(nullptr), std::forward<Fill>(fill),
                   std::forward<Extra>(extra)...);
  }
  /// `send_anon` with a ticket taken before.
  template <class M, class Fill, class... Extra>
    requires in_protocol<Role, M>
  void send_anon(gate_ticket t, Fill&& fill, Extra&&... extra) const {
    send<M>(static_cast<std::nullptr_t*>(nullptr), std::move(t), std::forward<Fill>(fill),
            std::forward<Extra>(extra)...);
  }
  /// Sends `M` as a copy of `payload` (a message passed on).
  template <class M, class Self>
    requires in_protocol<Role, M>
  bool send_copy(Self* self, typename protocol_entry<Role, M>::payload::Reader payload) const {
    auto t = admit<M>();
    if (!t) return false;
    deliver<M>(self, std::move(t), copy_role_wire<Role, M>(payload));
    return true;
  }

  /// Request/response: sends `M` (a call_atom message) and hands its reply wire to `on_reply`,
  /// a CAF error to `on_error`. False (nothing sent) if the gate refused it.
  template <class M, class Self, class Fill, class OnReply, class OnError>
    requires in_protocol<Role, M> && std::is_same_v<typename protocol_entry<Role, M>::atom, call_atom>
  bool call(Self* self, Fill&& fill, OnReply&& on_reply, OnError&& on_error) const {
    auto t = admit<M>();
    if (!t) return false;
    call<M>(self, std::move(t), std::forward<Fill>(fill), std::forward<OnReply>(on_reply),
            std::forward<OnError>(on_error));
    return true;
  }

  /// `call` with a ticket taken before (state changed between admission and sending).
  template <class M, class Self, class Fill, class OnReply, class OnError>
    requires in_protocol<Role, M> && std::is_same_v<typename protocol_entry<Role, M>::atom, call_atom>
  void call(Self* self, gate_ticket t, Fill&& fill, OnReply&& on_reply, OnError&& on_error) const {
    wire w = make_role_wire<Role, M>(std::forward<Fill>(fill));
    t.consume();
    self->request(handle, caf::infinite, call_atom::value, std::move(w))
        .then(std::forward<OnReply>(on_reply), std::forward<OnError>(on_error));
  }

  /// Passes on bytes received from another node (already a message of this role). `which`
  /// picks the gate from the table. Refused work: false.
  bool forward_remote(const wire& w, typename Role::in::Which which) const {
    auto t = admit_as(gate_of<Role>(which));
    if (!t) return false;
    t.consume();
    caf::anon_send(handle, wire_atom::value, w);
    return true;
  }

 private:
  /// Enqueues `w` with M's atom from `self` (null: anonymously); the receiver leaves the gate.
  template <class M, class Self, class... Extra>
  void deliver(Self* self, gate_ticket t, wire w, Extra&&... extra) const {
    using E = protocol_entry<Role, M>;
    t.consume();
    if constexpr (std::is_same_v<Self, std::nullptr_t>)
      caf::anon_send(handle, typename E::atom{}, std::move(w), std::forward<Extra>(extra)...);
    else
      self->send(handle, typename E::atom{}, std::move(w), std::forward<Extra>(extra)...);
  }
};

/// Wiring of a scheduler (or a link) to the other roles (local message, sent once after spawning).
struct peer_set {
  role_handle<router_role> router;
  role_handle<prefill_role> prefill;
  role_handle<decode_role> decode;
  role_handle<worker_role> worker;
  role_handle<cache_tier_role> cache;
};

}  // namespace tandem

#include <caf/allowed_unsafe_message_type.hpp>
#include <caf/atom.hpp>
namespace tandem {
using peers_atom = caf::atom_constant<caf::atom("peers")>;
}
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(tandem::peer_set)
