#pragma once
/// Low-bit weights repacked for the AVX-512 VNNI kernels (what llama.cpp's CPU "repack" buffers
/// do): each group of 16 consecutive rows is stored interleaved, so that one 64-byte vector
/// holds the same few elements of 16 rows (32-bit lane i = row i). A kernel then meets one
/// broadcast group of activation bytes with 16 rows per instruction and needs no horizontal
/// sums: on the row-major layout every (weight row, activation row) pair costs its own
/// reduction, which is what kept the q4_0 and q4_K prefill tiles at 0.84-0.96 x llama.cpp.
///
/// A packed weight has the original's blocks (the same bytes per row, reordered), so a decode
/// step reads as many bytes as from the file; rows past the last real row of the last group
/// are zeros and their outputs are never written. Each type's layout and kernel live in
/// quant_packed_<type>.cpp; quant_packed.cpp picks among them.
#include <cstdint>
#include <vector>

#include "kernels/cpu/huge_pages.h"
#include "kernels/cpu/quant_matmul.h"
#include "kernels/cpu/simd.h"
#include "kernels/tensor.h"

namespace tandem::cpu {

class thread_pool;

/// Requests the 64-byte lines of [p, min(p + bytes, end)) into L2: a batch-1 kernel's
/// software prefetch ahead of its stream, never past `end`, the end of the packed weight (a
/// thread walks its share of a weight in pieces, one stream across them; what follows the
/// weight is no stream of this call's). The packed q4_K / q5_K kernel's: with kick_page
/// instead, a llama-1b Q4_K_M decode step fell from 79-82 to 52-57 tokens/s (2 threads,
/// alternating runs).
inline void prefetch_l2(const void* p, int64_t bytes, const void* end) {
  const char* b = static_cast<const char*>(p);
  const char* e = static_cast<const char*>(end);
  for (int64_t o = 0; o < bytes && b + o < e; o += 64) prefetch_t1(b + o);
}

/// Bytes a batch-1 kernel requests at the start of each 4 KiB page of its stream (kick_page).
inline constexpr int64_t page_kick_bytes = 256;

/// The page_kick_bytes at `at` into L2, those below `end` only.
inline void kick_lines(uintptr_t at, uintptr_t end) {
  for (uintptr_t o = 0; o < uintptr_t(page_kick_bytes) && at + o < end; o += 64)
    prefetch_t1(reinterpret_cast<const void*>(at + o));
}

/// A batch-1 kernel's software prefetch, called once per step of its sequential stream with
/// the step's bytes some distance further on: when [p, p + bytes] reaches into a new 4 KiB
/// page below `end`, requests that page's first page_kick_bytes into L2 (never at or past
/// `end`, as prefetch_l2). The hardware prefetcher follows a stream
/// within a 4 KiB page and must find it again on each new one, which a kernel that computes
/// between its loads lets it do late; a request for every line instead (what the kernels did)
/// holds the core's few miss buffers, and the stream ran no faster than with none. Measured
/// (packed q4_0, 547 MB of llama-1b weights, each thread half of every weight, no barriers,
/// Zen 5, variants alternated in one process): 1 thread every line 26 GB/s, none 27, page
/// starts 31-34 (plain loads 33-36); 2 threads 48-52, 49-54, 57-61 (plain loads 64-68).
inline void kick_page(const void* p, int64_t bytes, const void* end) {
  const uintptr_t b = reinterpret_cast<uintptr_t>(p), page = (b + uintptr_t(bytes)) & ~uintptr_t(4095);
  if (page > b) kick_lines(page, reinterpret_cast<uintptr_t>(end));
}

/// The start of a batch-1 stream at p: its first page_kick_bytes, and those of every 4 KiB
/// page that begins in (p, p + bytes), as kick_page would have requested them had the stream
/// begun `bytes` earlier.
inline void kick_pages(const void* p, int64_t bytes, const void* end) {
  const uintptr_t b = reinterpret_cast<uintptr_t>(p), e = reinterpret_cast<uintptr_t>(end);
  kick_lines(b, e);
  for (uintptr_t page = (b & ~uintptr_t(4095)) + 4096; page < b + uintptr_t(bytes); page += 4096)
    kick_lines(page, e);
}

/// Rows per interleaved group.
inline constexpr int64_t pack_rows = 16;

/// A low-bit weight's packed copy: groups of pack_rows rows, group_bytes() each.
struct quant_packed {
  ggml_type type = ggml_type::q4_0;
  int64_t rows = 0, cols = 0;
  /// On 2 MiB pages: batch-1 decode streams it, and on 4 KiB pages every page costs a TLB
  /// miss and stops the hardware prefetcher (the mapped file's f16 weights read 67-71 instead
  /// of 78-81 ms a llama-1b step from a 2 MiB-page copy, 1 thread).
  std::vector<uint8_t, huge_page_allocator<uint8_t>> bytes;
  size_t group_bytes() const { return size_t(pack_rows) * row_bytes(type, cols); }
  int64_t groups() const { return (rows + pack_rows - 1) / pack_rows; }
  const uint8_t* group(int64_t g) const { return bytes.data() + size_t(g) * group_bytes(); }
};

/// Whether this CPU runs a packed kernel for weights of type `t` (AVX-512 VNNI and a kernel
/// for the type): pack_weights then makes a packed copy of such a weight on the avx512 path.
bool packs(ggml_type t);
/// Whether weights of type `t` have a packed layout (on any CPU; packs() also needs the ISA).
bool has_packed_layout(ggml_type t);
/// Bytes of the packed copy of `w`: each 2-D slice (an expert of a 3-D tensor) padded to
/// whole groups. What the RAM check counts per worker.
uint64_t packed_copy_bytes(const tensor_view& w);
/// False when the environment has TANDEM_PACK=0 (low-bit weights then stay in the file's
/// layout: the same bits, the row-major kernels); read once.
bool packing_enabled();

/// The packed copy of `w` (a type packs() is true for), its groups split over `pool`'s
/// threads. Throws tandem::error for a type without a packed layout.
quant_packed pack_quant(const tensor_view& w, thread_pool* pool = nullptr);

/// y[b][r] ([a.batch] rows of p.rows values) for the real rows of groups [g0, g1) and every
/// activation row of `a`, by p's type's kernel (needs packs(p.type)): the bits rows_scalar
/// gives the unpacked weight.
void packed_rows(const quant_packed& p, const quant_acts& a, float* y, int64_t g0, int64_t g1);

namespace quant_detail {

/// Writes one packed group: rows r0 .. r0 + 15 of w (rows past w.rows() as zeros) into dst
/// (group_bytes() bytes).
using pack_group_fn = void (*)(const tensor_view& w, int64_t r0, uint8_t* dst);

/// The packed copy of w group by group on the calling thread (tests; pack_quant splits it
/// over a pool).
inline quant_packed pack_groups(const tensor_view& w, pack_group_fn pack_group) {
  quant_packed p;
  p.type = w.type;
  p.rows = w.rows();
  p.cols = w.cols();
  p.bytes.resize(size_t(p.groups()) * p.group_bytes());
  for (int64_t g = 0; g < p.groups(); ++g) pack_group(w, g * pack_rows, p.bytes.data() + size_t(g) * p.group_bytes());
  return p;
}

/// Per type: pack_group_<type> packs one group; packed_rows_<type> writes y[b][r] ([a.batch]
/// rows of p.rows values) for the real rows r of groups [g0, g1) and every activation row b of
/// `a` (quantize_acts with act_group(type)), on AVX-512 VNNI (has_avx512_vnni()), with the bits
/// rows_scalar gives the unpacked weight (quant_matmul.h's recipe), for every batch size.
void pack_group_q4_0(const tensor_view& w, int64_t r0, uint8_t* dst);
void packed_rows_q4_0(const quant_packed& p, const quant_acts& a, float* y, int64_t g0, int64_t g1);
/// rows_avx512 of an unpacked q4_0 weight: rows [r0, r1) packed a few groups at a time into a
/// per-thread buffer, then packed_rows_q4_0's kernel (the same bits).
void rows_q4_0_repacked(const tensor_view& w, const quant_acts& a, float* y, int64_t r0, int64_t r1);
void pack_group_q4_K(const tensor_view& w, int64_t r0, uint8_t* dst);
void packed_rows_q4_K(const quant_packed& p, const quant_acts& a, float* y, int64_t g0, int64_t g1);
void pack_group_q5_K(const tensor_view& w, int64_t r0, uint8_t* dst);
void packed_rows_q5_K(const quant_packed& p, const quant_acts& a, float* y, int64_t g0, int64_t g1);
void pack_group_q6_K(const tensor_view& w, int64_t r0, uint8_t* dst);
void packed_rows_q6_K(const quant_packed& p, const quant_acts& a, float* y, int64_t g0, int64_t g1);

}  // namespace quant_detail

}  // namespace tandem::cpu
