#pragma once
/// The receive side of the role protocols (actors/common/protocol.h): one wrapper every
/// actor's behaviour uses for its wire messages. It leaves the mailbox gate (gated atoms),
/// parses with the wire limits, dispatches on the role's union to the behaviour's handlers,
/// catches tandem::error / malformed bytes / std::exception (a call answers an error reply, a
/// cast logs), and counts a message of another role or of a kind this binary does not know
/// (`unexpected`, exported by `inbox::metrics`) before dropping it.
///
/// Handlers are one overload set taking (msg::kind, payload reader): every message of the
/// role delivered with that atom must have one, or the behaviour does not compile.
#include <fmt/format.h>
#include <kj/exception.h>
#include <spdlog/logger.h>

#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include "actors/common/metrics.h"
#include "actors/common/protocol.h"

namespace tandem {

/// Per actor: its gate, its log, and the counters of messages it could not take.
struct inbox {
  std::string actor;  ///< for logs and the metric label
  std::shared_ptr<mailbox_gate> gate;
  std::shared_ptr<spdlog::logger> log;
  int64_t unexpected = 0;  ///< another role's message, an unknown kind, or the wrong atom
  int64_t malformed = 0;   ///< bytes that do not parse
  int64_t failed = 0;      ///< a handler threw

  /// The counters as metric samples (label actor="<actor>").
  std::vector<metric_sample> metrics() const;
  void count_unexpected(const char* why);
};

/// Overload set from lambdas.
template <class... Fs>
struct overloaded : Fs... {
  using Fs::operator()...;
};
template <class... Fs>
overloaded(Fs...) -> overloaded<Fs...>;

namespace receive_detail {

template <class Atom>
constexpr bool gated = !std::is_same_v<Atom, kv_atom>;

/// Calls the handler of the message `in` holds among `Role`'s messages delivered by `Atom`
/// (its answer into the optional `*out` unless R is void); false if there is none (the sender
/// used another atom, or a newer kind).
template <class Role, class Atom, class R, class H>
bool dispatch(typename Role::in::Reader in, H& h, R* out) {
  bool done = false;
  const auto w = in.which();
  for_each_message<Role>([&](auto m) {
    using M = decltype(m);
    using E = protocol_entry<Role, M>;
    if constexpr (std::is_same_v<typename E::atom, Atom>) {
      static_assert(std::is_invocable_v<H&, M, typename E::payload::Reader>,
                    "the behaviour has no handler for a message of its role's protocol");
      if (done || w != E::which) return;
      done = true;
      if constexpr (std::is_void_v<R>)
        h(m, E::get(in));
      else
        out->emplace(h(m, E::get(in)));
    }
  });
  return done;
}

}  // namespace receive_detail

/// A cast (no reply): (wire_atom, wire) or, ungated, (kv_atom, wire). A message that cannot
/// be taken (another role's, a kind not delivered this way, malformed bytes, or a handler that
/// threw) is counted and logged, then `on_error(tandem::error)` hears why: a message that
/// carries its own answer path (the router's local submit and its callback) answers it there.
template <class Role, class Atom = wire_atom, class H, class OnError>
void receive(inbox& box, const wire& w, H&& h, OnError&& on_error) {
  if constexpr (receive_detail::gated<Atom>) box.gate->leave();
  std::optional<tandem::error> err;  // answered after the catch: on_error itself may throw
  try {
    wire_reader rd(w);
    auto env = rd.root();
    if (!Role::is(env)) {
      box.count_unexpected("a message of another role");
      err.emplace(error_kind::failed, fmt::format("{}: a message of another role", box.actor));
    } else if (!receive_detail::dispatch<Role, Atom, void>(Role::get(env), h, nullptr)) {
      box.count_unexpected("a message kind it does not take this way");
      err.emplace(error_kind::failed, fmt::format("{}: a message kind it does not take this way", box.actor));
    }
  } catch (const tandem::error& e) {
    ++box.failed;
    box.log->error("{}: {}", box.actor, e.what());
    err.emplace(e);
  } catch (const kj::Exception& e) {
    ++box.malformed;
    box.log->error("{}: malformed message: {}", box.actor, e.getDescription().cStr());
    err.emplace(error_kind::failed, fmt::format("malformed message: {}", e.getDescription().cStr()));
  } catch (const std::exception& e) {
    ++box.failed;
    box.log->error("{}: {}", box.actor, e.what());
    err.emplace(error_kind::failed, fmt::format("{}: {}", box.actor, e.what()));
  }
  if (err) on_error(*err);
}

/// `receive` for a message with no answer path: a failure is only counted and logged.
template <class Role, class Atom = wire_atom, class H>
void receive(inbox& box, const wire& w, H&& h) {
  receive<Role, Atom>(box, w, std::forward<H>(h), [](const tandem::error&) {});
}

/// A call (call_atom): the handler's answer, or `on_error(tandem::error)` when it threw or the
/// message was not one of the role's calls.
template <class Role, class Result, class H, class OnError>
Result receive_call(inbox& box, const wire& w, H&& h, OnError&& on_error) {
  box.gate->leave();
  try {
    wire_reader rd(w);
    auto env = rd.root();
    std::optional<Result> out;
    if (!Role::is(env) || !receive_detail::dispatch<Role, call_atom, std::optional<Result>>(Role::get(env), h, &out)) {
      box.count_unexpected("a request it does not take");
      return on_error(tandem::error(error_kind::unimplemented,
                                    fmt::format("{}: unexpected request message", box.actor)));
    }
    return std::move(*out);
  } catch (const tandem::error& e) {
    ++box.failed;
    return on_error(e);
  } catch (const kj::Exception& e) {
    ++box.malformed;
    return on_error(
        tandem::error(error_kind::failed, fmt::format("malformed request: {}", e.getDescription().cStr())));
  } catch (const std::exception& e) {
    ++box.failed;
    return on_error(tandem::error(error_kind::failed, fmt::format("{}: {}", box.actor, e.what())));
  }
}

/// `receive_call` answering an error Reply on failure.
template <class Role, class Result, class H>
Result receive_call(inbox& box, const wire& w, H&& h) {
  return receive_call<Role, Result>(box, w, std::forward<H>(h),
                                    [](const tandem::error& e) -> Result { return make_error_reply(e); });
}

}  // namespace tandem
