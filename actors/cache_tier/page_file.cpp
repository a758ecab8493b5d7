#include "actors/cache_tier/page_file.h"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <system_error>

#include "kernels/base/error.h"

namespace tandem {

namespace {

constexpr uint32_t k_magic = 0x504b5654;  // "TKVP" little-endian
constexpr uint32_t k_version = 1;
constexpr size_t k_header_bytes = 64;

struct header {
  uint32_t magic = k_magic;
  uint32_t version = k_version;
  uint64_t layout = 0;
  uint64_t hash = 0;
  uint64_t parent = 0;
  uint32_t n_tokens = 0;
  uint32_t crc = 0;
  uint64_t payload_bytes = 0;
  uint8_t pad[16] = {};
};
static_assert(sizeof(header) == k_header_bytes);

using crc_table = std::array<std::array<uint32_t, 256>, 8>;

const crc_table& table() {
  static const crc_table t = [] {
    crc_table x{};
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;
      x[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; ++i)
      for (size_t s = 1; s < 8; ++s) x[s][i] = (x[s - 1][i] >> 8) ^ x[0][x[s - 1][i] & 0xff];
    return x;
  }();
  return t;
}

uint32_t file_crc(const header& h, std::span<const int32_t> tokens, const uint8_t* payload, size_t n) {
  header z = h;
  z.crc = 0;
  uint32_t c = crc32c(&z, sizeof z);
  c = crc32c(tokens.data(), tokens.size_bytes(), c);
  return crc32c(payload, n, c);
}

std::string path_of(const std::string& dir, uint64_t fp, uint64_t hash) {
  return (std::filesystem::path(dir) / page_file_name(fp, hash)).string();
}

}  // namespace

uint32_t crc32c(const void* data, size_t n, uint32_t crc) {
  const auto& t = table();
  const auto* p = static_cast<const uint8_t*>(data);
  uint32_t c = ~crc;
  while (n >= 8) {
    uint32_t lo, hi;
    std::memcpy(&lo, p, 4);
    std::memcpy(&hi, p + 4, 4);
    lo ^= c;
    c = t[7][lo & 0xff] ^ t[6][(lo >> 8) & 0xff] ^ t[5][(lo >> 16) & 0xff] ^ t[4][lo >> 24] ^ t[3][hi & 0xff] ^
        t[2][(hi >> 8) & 0xff] ^ t[1][(hi >> 16) & 0xff] ^ t[0][hi >> 24];
    p += 8;
    n -= 8;
  }
  while (n--) c = (c >> 8) ^ t[0][(c ^ *p++) & 0xff];
  return ~c;
}

uint64_t chain_hash(uint64_t parent, std::span<const int32_t> tokens) {
  constexpr uint64_t p1 = 0x9E3779B185EBCA87ull, p2 = 0xC2B2AE3D27D4EB4Full, p3 = 0x165667B19E3779F9ull;
  auto rotl = [](uint64_t x, int r) { return (x << r) | (x >> (64 - r)); };
  uint64_t h = parent ^ p3 ^ (uint64_t(tokens.size()) * p1);
  for (int32_t t : tokens) {
    uint64_t k = uint64_t(uint32_t(t)) * p2;
    k = rotl(k, 31) * p1;
    h = rotl(h ^ k, 27) * p1 + p2;
  }
  h ^= h >> 33;
  h *= p2;
  h ^= h >> 29;
  h *= p3;
  h ^= h >> 32;
  return h == 0 ? 1 : h;  // 0 is the root
}

uint64_t pool_file_fingerprint(const kv_pools_layout& set, size_t p) {
  const uint64_t fp = set.pools.at(p).page.fingerprint();
  if (set.pools.size() <= 1) return fp;
  const std::vector<int32_t> salt = {int32_t(p), set.pools[p].window_tokens, int32_t(set.pools.size())};
  return chain_hash(fp, salt);
}

std::string page_file_name(uint64_t layout_fingerprint, uint64_t hash) {
  return fmt::format("{:016x}-{:016x}.kvp", layout_fingerprint, hash);
}

void write_page_file(const std::string& dir, uint64_t fp, uint64_t hash, uint64_t parent,
                     std::span<const int32_t> tokens, const uint8_t* payload, size_t payload_bytes) {
  header h;
  h.layout = fp;
  h.hash = hash;
  h.parent = parent;
  h.n_tokens = static_cast<uint32_t>(tokens.size());
  h.payload_bytes = payload_bytes;
  h.crc = file_crc(h, tokens, payload, payload_bytes);
  const std::string path = path_of(dir, fp, hash);
  const std::string tmp = path + ".tmp";
  {
    std::FILE* f = std::fopen(tmp.c_str(), "wb");
    if (!f)
      throw tandem::error(error_kind::failed, fmt::format("cannot create cache file {}: {}; check that "
                                                          "cache.disk_dir is writable",
                                                          tmp, std::strerror(errno)));
    bool ok = std::fwrite(&h, sizeof h, 1, f) == 1 &&
              (tokens.empty() || std::fwrite(tokens.data(), tokens.size_bytes(), 1, f) == 1) &&
              std::fwrite(payload, payload_bytes, 1, f) == 1;
    ok = (std::fclose(f) == 0) && ok;
    if (!ok) {
      std::remove(tmp.c_str());
      throw tandem::error(error_kind::failed,
                          fmt::format("short write to cache file {} (disk full?); free space in cache.disk_dir "
                                      "or lower cache.disk_size_gb",
                                      tmp));
    }
  }
  std::error_code ec;
  std::filesystem::rename(tmp, path, ec);
  if (ec) {
    std::filesystem::remove(tmp, ec);
    throw tandem::error(error_kind::failed, fmt::format("cannot rename cache file into {}", path));
  }
}

bool read_page_file(const std::string& dir, uint64_t fp, uint64_t hash, uint64_t parent,
                    std::span<const int32_t> tokens, uint8_t* payload, size_t payload_bytes, std::string& why) {
  const std::string path = path_of(dir, fp, hash);
  std::FILE* f = std::fopen(path.c_str(), "rb");
  if (!f) {
    why = fmt::format("{}: {}", path, std::strerror(errno));
    return false;
  }
  header h;
  std::vector<int32_t> got(tokens.size());
  bool ok = std::fread(&h, sizeof h, 1, f) == 1 && h.magic == k_magic && h.version == k_version &&
            h.layout == fp && h.hash == hash && h.parent == parent && h.n_tokens == tokens.size() &&
            h.payload_bytes == payload_bytes;
  if (ok)
    ok = (got.empty() || std::fread(got.data(), got.size() * sizeof(int32_t), 1, f) == 1) &&
         std::fread(payload, payload_bytes, 1, f) == 1 && std::fgetc(f) == EOF;
  std::fclose(f);
  if (!ok) {
    why = fmt::format("{}: truncated file or header mismatch", path);
    return false;
  }
  if (!std::equal(got.begin(), got.end(), tokens.begin())) {
    why = fmt::format("{}: tokens differ (hash collision)", path);
    return false;
  }
  if (file_crc(h, got, payload, payload_bytes) != h.crc) {
    why = fmt::format("{}: bad checksum", path);
    return false;
  }
  return true;
}

void remove_page_file(const std::string& dir, uint64_t fp, uint64_t hash) {
  std::error_code ec;
  std::filesystem::remove(path_of(dir, fp, hash), ec);
}

std::vector<page_file_entry> scan_page_files(const std::string& dir, uint64_t fp, uint64_t file_bytes) {
  namespace fs = std::filesystem;
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec || !fs::is_directory(dir))
    throw tandem::error(error_kind::failed,
                        fmt::format("cache.disk_dir = '{}' cannot be created or is not a directory ({}); point "
                                    "it at a writable directory",
                                    dir, ec.message()));
  const std::string prefix = fmt::format("{:016x}-", fp);
  std::vector<page_file_entry> out;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    const std::string name = e.path().filename().string();
    if (name.size() != 16 + 1 + 16 + 4 || name.rfind(prefix, 0) != 0 || name.substr(33) != ".kvp") continue;
    std::error_code ec2;
    if (!e.is_regular_file(ec2) || e.file_size(ec2) != file_bytes) continue;
    page_file_entry pe;
    try {
      pe.hash = std::stoull(name.substr(17, 16), nullptr, 16);
    } catch (const std::exception&) {
      continue;
    }
    pe.mtime_ns = std::chrono::duration_cast<std::chrono::nanoseconds>(
                      e.last_write_time(ec2).time_since_epoch())
                      .count();
    out.push_back(pe);
  }
  std::sort(out.begin(), out.end(),
            [](const page_file_entry& a, const page_file_entry& b) { return a.mtime_ns < b.mtime_ns; });
  return out;
}

}  // namespace tandem
