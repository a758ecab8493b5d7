#pragma once
/// Error kinds shared by every layer (kernels, actors, transport); it lives at the bottom
/// (kernels/base) so that kernels/ includes nothing from actors/.
/// Like KJ's exception types: the kind tells the caller what to do next.
#include <cstdint>
#include <stdexcept>
#include <string>
#include <string_view>

namespace tandem {

/// What the caller should do about an error.
enum class error_kind : uint8_t {
  failed = 0,         ///< the request is bad or the operation broke: do not retry as is
  overloaded = 1,     ///< a bound was hit: back off and retry later
  disconnected = 2,   ///< a peer went away: reconnect / retry on another node
  unimplemented = 3,  ///< the feature or message is not supported: do not retry
};

/// Lower-case name of an error kind ("failed", "overloaded", ...).
constexpr std::string_view to_string(error_kind k) {
  switch (k) {
    case error_kind::failed: return "failed";
    case error_kind::overloaded: return "overloaded";
    case error_kind::disconnected: return "disconnected";
    case error_kind::unimplemented: return "unimplemented";
  }
  return "failed";
}

/// An error with a kind and a message that says what to do.
class error : public std::runtime_error {
 public:
  error(error_kind kind, const std::string& message) : std::runtime_error(message), kind_(kind) {}
  explicit error(const std::string& message) : error(error_kind::failed, message) {}
  /// What the caller should do.
  error_kind kind() const noexcept { return kind_; }

 private:
  error_kind kind_;
};

}  // namespace tandem
