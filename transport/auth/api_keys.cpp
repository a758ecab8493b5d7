#include "transport/auth/api_keys.h"

#include <sys/stat.h>

#include <cerrno>
#include <cstdlib>
#include <cctype>
#include <cstring>
#include <fstream>

#include <fmt/format.h>

#include "kernels/base/error.h"

namespace tandem {

namespace {

std::string_view trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t' || s.front() == '\r')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t' || s.back() == '\r')) s.remove_suffix(1);
  return s;
}

/// Compares without branching on the bytes: the time depends only on the lengths.
bool equal_constant_time(std::string_view a, std::string_view b) {
  // Walk the configured key's length whatever the candidate's length, so a prefix does not
  // finish sooner than a full mismatch.
  unsigned char diff = a.size() == b.size() ? 0 : 1;
  for (size_t i = 0; i < a.size(); ++i) {
    unsigned char cb = i < b.size() ? static_cast<unsigned char>(b[i]) : 0;
    diff = static_cast<unsigned char>(diff | (static_cast<unsigned char>(a[i]) ^ cb));
  }
  return diff == 0;
}

}  // namespace

api_keys::api_keys(std::vector<std::string> keys) : keys_(std::move(keys)) {}

api_keys api_keys::load_file(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0)
    throw error(error_kind::failed, fmt::format("api key file {}: {}; create it with one key per line and chmod 600 it",
                                                path, std::strerror(errno)));
  if (!S_ISREG(st.st_mode)) throw error(error_kind::failed, fmt::format("api key file {} is not a regular file", path));
  if (st.st_mode & (S_IRWXG | S_IRWXO))
    throw error(error_kind::failed,
                fmt::format("api key file {} is accessible by group or others (mode {:03o}); run `chmod 600 {}`", path,
                            st.st_mode & 0777, path));
  std::ifstream in(path);
  if (!in) throw error(error_kind::failed, fmt::format("api key file {}: cannot be read; check its owner", path));
  std::vector<std::string> keys;
  std::string line;
  int lineno = 0;
  while (std::getline(in, line)) {
    ++lineno;
    auto k = trim(line);
    if (k.empty() || k.front() == '#') continue;
    if (k.size() < min_api_key_bytes)
      throw error(error_kind::failed,
                  fmt::format("api key file {}:{}: the key is {} bytes; use at least {} (e.g. `openssl rand -hex 32`)", path,
                              lineno, k.size(), min_api_key_bytes));
    for (char c : k)
      if (static_cast<unsigned char>(c) <= 0x20 || static_cast<unsigned char>(c) >= 0x7f)
        throw error(error_kind::failed,
                    fmt::format("api key file {}:{}: a key must be printable ASCII without spaces (it travels in an "
                                "HTTP header)",
                                path, lineno));
    keys.emplace_back(k);
  }
  if (keys.empty())
    throw error(error_kind::failed,
                fmt::format("api key file {} holds no key; add one per line (e.g. `openssl rand -hex 32 >> {}`)", path, path));
  return api_keys(std::move(keys));
}

bool api_keys::check(std::string_view key) const {
  if (keys_.empty()) return true;
  bool ok = false;
  for (auto& k : keys_) ok |= equal_constant_time(k, key);  // no early exit: every key is compared
  return ok;
}

std::optional<std::string_view> bearer_token(std::string_view h) {
  h = trim(h);
  if (h.size() < 7) return std::nullopt;
  static constexpr std::string_view scheme = "bearer ";
  for (size_t i = 0; i < scheme.size(); ++i)
    if (static_cast<char>(std::tolower(static_cast<unsigned char>(h[i]))) != scheme[i]) return std::nullopt;
  auto t = trim(h.substr(scheme.size()));
  if (t.empty()) return std::nullopt;
  return t;
}

std::string client_api_key(const std::string& key_file) {
  if (!key_file.empty()) {
    // load_file guarantees at least one key; the client sends the first.
    return api_keys::load_file(key_file).keys_.front();
  }
  if (const char* e = std::getenv("TANDEM_API_KEY")) return std::string(trim(e));
  return "";
}

}  // namespace tandem
