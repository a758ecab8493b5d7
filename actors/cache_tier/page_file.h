#pragma once
/// On-disk format of the L3 (disk) tier of the KV cache: one file per cached page group (a
/// radix node: the KV of `page_size` tokens, every layer), named by the layout fingerprint and
/// the chain hash of the token prefix ending with that page, so a restarted process finds its
/// pages again from the tokens alone. Layout of a file:
///   64-byte header: magic "TKVP", version, layout fingerprint, chain hash, parent hash,
///                   token count, payload bytes, CRC32C of everything else
///   tokens (int32 x page_size), payload (kv_layout::page_bytes()).
/// Readers verify every header field against what they expect and the checksum; any mismatch
/// is a miss, never wrong KV.
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "kernels/model/kv_pools.h"

namespace tandem {

/// CRC32C (Castagnoli), software slicing-by-8; `crc` continues a previous call.
uint32_t crc32c(const void* data, size_t n, uint32_t crc = 0);

/// Hash of a prefix: mixes the previous prefix's hash with the next page's tokens (64-bit,
/// xxhash-style multiply/rotate rounds). The root prefix has hash 0.
uint64_t chain_hash(uint64_t parent, std::span<const int32_t> tokens);

/// The fingerprint that names pool p's files of a layout set: the page layout's own for a
/// one-pool set (the files of earlier versions), else mixed with the pool's index and window
/// so two pools of equal page geometry never share a file.
uint64_t pool_file_fingerprint(const kv_pools_layout& set, size_t p);

/// "<fingerprint 16 hex>-<hash 16 hex>.kvp"
std::string page_file_name(uint64_t layout_fingerprint, uint64_t hash);

/// Writes the file atomically (temporary file + rename). Throws tandem::error on I/O failure.
void write_page_file(const std::string& dir, uint64_t layout_fingerprint, uint64_t hash, uint64_t parent,
                     std::span<const int32_t> tokens, const uint8_t* payload, size_t payload_bytes);

/// Reads and verifies a file into `payload` (payload_bytes); false with `why` set on a missing
/// file, short read, header mismatch or bad checksum.
bool read_page_file(const std::string& dir, uint64_t layout_fingerprint, uint64_t hash, uint64_t parent,
                    std::span<const int32_t> tokens, uint8_t* payload, size_t payload_bytes, std::string& why);

/// Deletes a page file; missing files are fine.
void remove_page_file(const std::string& dir, uint64_t layout_fingerprint, uint64_t hash);

struct page_file_entry {
  uint64_t hash = 0;
  int64_t mtime_ns = 0;  ///< oldest first = least recently written
};

/// Page files of this layout in `dir` whose size is `file_bytes` (others are ignored), oldest
/// first. Creates `dir` if missing; throws tandem::error if it cannot.
std::vector<page_file_entry> scan_page_files(const std::string& dir, uint64_t layout_fingerprint,
                                             uint64_t file_bytes);

}  // namespace tandem
