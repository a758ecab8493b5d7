#pragma once
/// API keys (bearer tokens) of a node's external interfaces: the OpenAI HTTP API, the
/// Cap'n Proto `Node` API and the admin interface. Keys come from a file, one per line;
/// an empty set means authentication is off. See docs/security.md.
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace tandem {

class api_keys {
 public:
  /// No keys: check() accepts everything.
  api_keys() = default;
  explicit api_keys(std::vector<std::string> keys);

  /// Reads one key per line (blank lines and lines starting with '#' skipped, surrounding
  /// whitespace trimmed). Throws tandem::error (failed) naming the fix if the file is missing,
  /// readable by group or others (chmod 600), holds no key, or a key is shorter than 16 bytes.
  static api_keys load_file(const std::string& path);

  /// True if authentication is off (no keys configured).
  bool empty() const { return keys_.empty(); }
  size_t size() const { return keys_.size(); }
  /// True if `key` is one of the keys (or there are none). Constant time in the content of
  /// `key` and of every configured key: every key is compared, byte by byte, without early exit.
  bool check(std::string_view key) const;

 private:
  friend std::string client_api_key(const std::string& key_file);
  std::vector<std::string> keys_;
};

/// The token of an `Authorization: Bearer TOKEN` header value; nullopt if it is not one.
std::optional<std::string_view> bearer_token(std::string_view authorization);

/// The key a client tool uses: the first key of `key_file` if set (same checks as
/// api_keys::load_file), else the environment variable TANDEM_API_KEY, else "".
std::string client_api_key(const std::string& key_file);

/// Shortest key accepted: shorter ones are guessable.
constexpr size_t min_api_key_bytes = 16;

}  // namespace tandem
