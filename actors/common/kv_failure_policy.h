#pragma once
/// What a decode node does with a request whose cross-node KV transfer failed
/// ([transfer] failure_policy, parsed once by the config; docs/kv_transfer.md, *Failures*).
#include <cstdint>
#include <optional>
#include <string_view>

namespace tandem {

enum class kv_failure_policy : uint8_t {
  recompute,  ///< re-prefill it through the router (at most max_transfer_retries times), then fail
  fail,       ///< end it with a `disconnected` error naming the request, both nodes and the cause
};

/// The config's spelling.
constexpr const char* to_string(kv_failure_policy p) {
  return p == kv_failure_policy::fail ? "fail" : "recompute";
}

/// The policy a config value names, or nullopt.
constexpr std::optional<kv_failure_policy> parse_kv_failure_policy(std::string_view s) {
  if (s == "recompute") return kv_failure_policy::recompute;
  if (s == "fail") return kv_failure_policy::fail;
  return std::nullopt;
}

}  // namespace tandem
