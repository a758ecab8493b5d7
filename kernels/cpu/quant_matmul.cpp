// Low-bit matmul: activation quantization, the portable (scalar) kernels that define the
// arithmetic, and the split across threads. The vector kernels are in quant_matmul_avx2.cpp
// and quant_matmul_avx512.cpp.
#include "kernels/cpu/quant_matmul.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "kernels/base/error.h"
#include "kernels/cpu/ops.h"
#include "kernels/cpu/quant_packed.h"
#include "kernels/cpu/quant_ref.h"
#include "kernels/cpu/thread_pool.h"

namespace tandem::cpu {

void quantize_acts(const float* x, int64_t batch, int64_t k, int group, quant_acts& a) {
  quantize_acts(x, batch, k, group, a, quant_detail::has_avx512_vnni() ? cpu_isa::avx512 : cpu_isa::scalar);
}

void quantize_acts(const float* x, int64_t batch, int64_t k, int group, quant_acts& a, cpu_isa isa) {
  a.k = k;
  a.batch = batch;
  a.group = group;
  a.groups = k / group;
  a.qs.resize(size_t(batch * k));
  a.d.resize(size_t(batch * a.groups));
  a.sums.resize(size_t(batch * (k / 32)));
  const int64_t lanes = a.pair_lanes();
  if (group == 32) {
    a.off128.resize(size_t(batch * lanes));
    a.d16.resize(size_t(batch * lanes));
    // Zeros in the high half of an odd last pair; every other lane is written below.
    if ((k / 32) % 2 != 0)
      for (int64_t b = 0; b < batch; ++b)
        for (int64_t l = (b + 1) * lanes - 8; l < (b + 1) * lanes; ++l) {
          a.off128[size_t(l)] = 0;
          a.d16[size_t(l)] = 0.0f;
        }
  }
  if (isa == cpu_isa::avx512 && quant_detail::has_avx512_vnni())
    return quant_detail::quantize_acts_avx512(x, batch, k, group, a);
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t g = 0; g < k / group; ++g) {
      const float* v = x + b * k + g * group;
      float amax = 0.0f;
      for (int i = 0; i < group; ++i) amax = std::max(amax, std::fabs(v[i]));
      const float id = amax > 0.0f ? 127.0f / amax : 0.0f;
      a.d[size_t(b * (k / group) + g)] = amax / 127.0f;
      int8_t* q = a.qs.data() + b * k + g * group;
      // Round to nearest even by adding and subtracting 1.5 * 2^23 (exact for |v * id| <= 127,
      // a plain loop the compiler vectorises; lrintf's call was 8% of a prefill). NaNs and
      // infinities (id = 0 or a NaN scale) are clamped like any value.
      for (int i = 0; i < group; ++i) {
        const float r = (v[i] * id + 12582912.0f) - 12582912.0f;
        q[i] = int8_t(r >= 127.0f ? 127 : r <= -127.0f ? -127 : r == r ? int(r) : 0);
      }
      for (int s = 0; s < group / 32; ++s) {
        int sum = 0;
        for (int i = 0; i < 32; ++i) sum += q[32 * s + i];
        a.sums[size_t(b * (k / 32) + (g * group) / 32 + s)] = int16_t(sum);
      }
    }
  if (group != 32) return;
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t g = 0; g < k / 32; ++g) {
      const int8_t* q = a.q(b) + 32 * g;
      const int64_t base = b * lanes + g / 2 * 16 + 8 * (g % 2);
      for (int l = 0; l < 8; ++l) {
        const int s4 = q[4 * l] + q[4 * l + 1] + q[4 * l + 2] + q[4 * l + 3];
        a.off128[size_t(base + l)] = -128 * s4;
        a.d16[size_t(base + l)] = a.d[size_t(b * (k / 32) + g)];
      }
    }
}

namespace quant_detail {

namespace {

float dot_q4_0(const block_q4_0* w, const int8_t* x, const float* dx, int64_t nb) {
  float acc = 0.0f;
  for (int64_t i = 0; i < nb; ++i) {
    int s = 0;
    for (int e = 0; e < 32; ++e) {
      const int q = e < 16 ? w[i].qs[e] & 0xF : w[i].qs[e - 16] >> 4;
      s += (q - 8) * x[32 * i + e];
    }
    acc = std::fma(fp16_to_fp32(w[i].d) * dx[i], float(s), acc);
  }
  return acc;
}

float dot_q8_0(const block_q8_0* w, const int8_t* x, const float* dx, int64_t nb) {
  float lanes[16] = {};
  for (int64_t i = 0; i < nb; ++i) {
    const float dd = fp16_to_fp32(w[i].d) * dx[i];
    for (int l = 0; l < 8; ++l) {
      int s = 0;
      for (int e = 4 * l; e < 4 * l + 4; ++e) s += int(w[i].qs[e]) * x[32 * i + e];
      float& lane = lanes[8 * (i % 2) + l];
      lane = std::fma(dd, float(s), lane);
    }
  }
  return tree16(lanes);
}

template <class Block>
float dot_k4(const Block* w, const int8_t* x, const float* dx, const int16_t* sums, int64_t nb) {
  float acc = 0.0f;
  for (int64_t i = 0; i < nb; ++i) {
    int isum = 0, msum = 0;
    for (int j = 0; j < 8; ++j) {
      uint8_t sc, m;
      k4_scale_min(j, w[i].scales, sc, m);
      int s = 0;
      for (int l = 0; l < 32; ++l) {
        const int e = 32 * j + l, g = e / 64;
        int q = e % 64 < 32 ? w[i].qs[32 * g + l] & 0xF : w[i].qs[32 * g + l] >> 4;
        if constexpr (requires { w[i].qh; }) q += ((w[i].qh[l] >> j) & 1) << 4;
        s += q * x[qk_k * i + e];
      }
      isum += int(sc) * s;
      msum += int(m) * sums[8 * i + j];
    }
    const float dx_i = dx[i];
    acc = std::fma(fp16_to_fp32(w[i].d) * dx_i, float(isum), acc);
    acc = std::fma(-(fp16_to_fp32(w[i].dmin) * dx_i), float(msum), acc);
  }
  return acc;
}

float dot_q6_K(const block_q6_K* w, const int8_t* x, const float* dx, int64_t nb) {
  float acc = 0.0f;
  for (int64_t i = 0; i < nb; ++i) {
    int isum = 0;
    for (int j = 0; j < 16; ++j) {
      int s = 0;
      for (int t = 0; t < 16; ++t) {
        const int e = 16 * j + t, h = e / 128, r = e % 128, l = r % 32, k = r / 32;
        const uint8_t lo = w[i].ql[64 * h + 32 * (k % 2) + l];
        const int q = ((k < 2 ? lo & 0xF : lo >> 4) | ((w[i].qh[32 * h + l] >> (2 * k)) & 3) << 4) - 32;
        s += q * x[qk_k * i + e];
      }
      isum += int(w[i].scales[j]) * s;
    }
    acc = std::fma(fp16_to_fp32(w[i].d) * dx[i], float(isum), acc);
  }
  return acc;
}

}  // namespace

void rows_scalar(const tensor_view& w, const quant_acts& a, float* y, int64_t r0, int64_t r1) {
  const int64_t k = w.cols(), n = w.rows();
  for (int64_t r = r0; r < r1; ++r)
    for (int64_t b = 0; b < a.batch; ++b) {
      const void* row = w.row(r);
      float v = 0.0f;
      switch (w.type) {
        case ggml_type::q4_0: v = dot_q4_0(static_cast<const block_q4_0*>(row), a.q(b), a.scale(b), k / 32); break;
        case ggml_type::q8_0: v = dot_q8_0(static_cast<const block_q8_0*>(row), a.q(b), a.scale(b), k / 32); break;
        case ggml_type::q4_K:
          v = dot_k4(static_cast<const block_q4_K*>(row), a.q(b), a.scale(b), a.sum32(b), k / qk_k);
          break;
        case ggml_type::q5_K:
          v = dot_k4(static_cast<const block_q5_K*>(row), a.q(b), a.scale(b), a.sum32(b), k / qk_k);
          break;
        default: v = dot_q6_K(static_cast<const block_q6_K*>(row), a.q(b), a.scale(b), k / qk_k); break;
      }
      y[b * n + r] = v;
    }
}

bool has_avx512_vnni() {
  static const bool ok = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni") &&
                         __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                         __builtin_cpu_supports("f16c");
  return ok;
}

}  // namespace quant_detail

namespace {

// Chunks of whole 24-row groups (tiles of 8 and 4 rows; the bits never depend on the split);
// a packed weight's chunks are whole 16-row groups (quant_packed.h).
constexpr int64_t group_rows = 24;

void run_rows(const tensor_view& w, const quant_acts& a, float* y, int64_t r0, int64_t r1, cpu_isa isa) {
  using namespace quant_detail;
  if (isa == cpu_isa::avx512 && has_avx512_vnni()) return rows_avx512(w, a, y, r0, r1);
  if (isa == cpu_isa::avx512 || isa == cpu_isa::avx2) return rows_avx2(w, a, y, r0, r1);
  rows_scalar(w, a, y, r0, r1);
}

// Whether weight w runs its packed copy on path `isa`.
bool runs_packed(const quant_weight& w, cpu_isa isa) {
  return w.packed != nullptr && isa == cpu_isa::avx512 && packs(w.packed->type);
}

// The rows of one split unit (group) of w on path `isa`.
int64_t unit_rows(const quant_weight& w, cpu_isa isa) { return runs_packed(w, isa) ? pack_rows : group_rows; }

// Groups [g0, g1) of w (in unit_rows) for every activation row of `a`.
void run_groups(const quant_weight& w, const quant_acts& a, float* y, int64_t g0, int64_t g1, cpu_isa isa) {
  if (runs_packed(w, isa)) return packed_rows(*w.packed, a, y, g0, g1);
  run_rows(*w.view, a, y, g0 * group_rows, std::min(w.view->rows(), g1 * group_rows), isa);
}

void check_weight(const quant_weight& qw) {
  const tensor_view& w = *qw.view;
  if (!int8_matmul(w.type))
    throw tandem::error(fmt::format("quant_matmul: {} is not a low-bit or q8_0 weight type", to_string(w.type)));
  if (w.cols() % block_elems(w.type) != 0)
    throw tandem::error(fmt::format("matmul: {} weight with {} columns is not a multiple of its block of {}",
                                    to_string(w.type), w.cols(), block_elems(w.type)));
  if (qw.packed != nullptr && (qw.packed->type != w.type || qw.packed->rows != w.rows() || qw.packed->cols != w.cols()))
    throw tandem::error("quant_matmul: a packed copy does not match its weight's type and shape; pack the weight again");
}

}  // namespace

void quant_matmul(const tensor_view& w, const float* x, int64_t batch, float* y, thread_pool* pool, cpu_isa isa) {
  const quant_weight ws[] = {{&w, nullptr}};
  float* ys[] = {y};
  quant_matmul_many(ws, x, batch, ys, pool, isa);
}

namespace {
// Decode batches (up to steal_max_batch activation rows) split a packed matmul with
// thread_pool::parallel_for_steal, in pieces of about steal_piece_bytes of weights: each
// thread then reads one stream (the packed kernels prefetch across pieces, up to the weight's
// end) and the threads end within about a piece of each other. With dynamic chunks (4 a
// thread) each thread restarted its stream at every chunk (its first piece took ~2.6 us
// longer than the rest) and the threads ended 27-52 us apart in a llama-1b q4_0 step's FFN
// matmuls (190-390 us), 5-6 us with stealing (2 threads, Zen 5). Variants alternated every
// 10 decode steps in one process, 3 runs: q4_0 batch 1 a step -4 to -7%, its qkv and o
// matmuls +8-18% GB/s, gate+up +1-6%; q4_K -7%, q6_K -6%, q5_K -4%, Q4_K_M -2%; batch 8
// q4_0 -6%, q5_K -2%. Pieces of 128, 256 and 512 KiB measured alike. Row-major kernels
// (q8_0, unpacked weights) read several streams over their range, which pieces cut short
// (q8_0 batch 1: -14 to -30% tokens/s): they keep dynamic chunks, as does prefill, whose blocks
// of groups reuse each activation tile.
constexpr int64_t steal_max_batch = 8;
constexpr int64_t steal_piece_bytes = int64_t(256) << 10;
}  // namespace

void quant_matmul_many(std::span<const quant_weight> ws, const float* x, int64_t batch, std::span<float* const> ys,
                       thread_pool* pool, cpu_isa isa) {
  if (ws.size() != ys.size()) throw tandem::error("quant_matmul_many: one output per weight");
  if (ws.empty() || batch <= 0) return;
  const int64_t k = ws[0].view->cols();
  int64_t work = 0;
  bool need32 = false, need256 = false;
  std::vector<int64_t> off(1, 0);  // first row group of each weight
  bool packed = true;              // every weight on a packed kernel
  int64_t unit_bytes = 1;          // the largest row group's
  for (const quant_weight& w : ws) {
    check_weight(w);
    if (w.view->cols() != k) throw tandem::error("quant_matmul_many: the weights must have the same columns");
    (act_group(w.view->type) == 32 ? need32 : need256) = true;
    work += w.view->rows() * k * batch;
    const int64_t u = unit_rows(w, isa);
    off.push_back(off.back() + (w.view->rows() + u - 1) / u);
    packed = packed && runs_packed(w, isa);
    unit_bytes = std::max<int64_t>(unit_bytes, u * int64_t(row_bytes(w.view->type, k)));
  }
  // Kept between calls on the calling thread: a decode step runs several matmuls per layer.
  thread_local quant_acts acts32, acts256;
  if (need32) quantize_acts(x, batch, k, 32, acts32, isa);
  if (need256) quantize_acts(x, batch, k, 256, acts256, isa);
  // Named here, on the calling thread: inside `run` (on the workers) the names would mean the
  // workers' own thread_local buffers.
  const quant_acts &a32 = acts32, &a256 = acts256;
  auto run = [&](int64_t g0, int64_t g1) {
    for (size_t i = 0; i < ws.size(); ++i) {
      const int64_t lo = std::max(g0, off[i]) - off[i], hi = std::min(g1, off[i + 1]) - off[i];
      if (lo >= hi) continue;
      run_groups(ws[i], act_group(ws[i].view->type) == 32 ? a32 : a256, ys[i], lo, hi, isa);
    }
  };
  if (pool == nullptr || pool->size() == 1 || work < matmul_min_parallel_work) return run(0, off.back());
  if (packed && batch <= steal_max_batch)
    return pool->parallel_for_steal(off.back(), std::max<int64_t>(1, steal_piece_bytes / unit_bytes), run);
  pool->parallel_for_dynamic(off.back(), 4, run);
}

void quant_matmul_jobs(std::span<const quant_weight> ws, std::span<const float* const> xs,
                       std::span<const int64_t> batches, std::span<float* const> ys, thread_pool* pool,
                       cpu_isa isa) {
  if (ws.size() != xs.size() || ws.size() != batches.size() || ws.size() != ys.size())
    throw tandem::error("quant_matmul_jobs: one input, batch and output per weight");
  int64_t work = 0;
  // Row groups weighing their job's batch (see matmul_jobs), numbered one after another.
  std::vector<int64_t> off(1, 0), per;
  // Kept between calls on the calling thread (a decode step runs a few of these a layer);
  // only read by the workers.
  thread_local std::vector<quant_acts> acts;
  if (acts.size() < ws.size()) acts.resize(ws.size());
  for (size_t i = 0; i < ws.size(); ++i) {
    const tensor_view& w = *ws[i].view;
    check_weight(ws[i]);
    const int64_t b = std::max<int64_t>(0, batches[i]);
    if (b > 0) quantize_acts(xs[i], b, w.cols(), act_group(w.type), acts[i], isa);
    work += w.rows() * w.cols() * b;
    per.push_back(std::max<int64_t>(1, b));
    const int64_t u = unit_rows(ws[i], isa);
    off.push_back(off.back() + (b > 0 ? (w.rows() + u - 1) / u * b : 0));
  }
  const std::vector<quant_acts>& a = acts;  // the caller's, named here (see quant_matmul_many)
  auto run = [&](int64_t u0, int64_t u1) {
    for_weighted_parts(off, per, u0, u1,
                       [&](size_t i, int64_t lo, int64_t hi) { run_groups(ws[i], a[i], ys[i], lo, hi, isa); });
  };
  if (pool == nullptr || pool->size() == 1 || work < matmul_min_parallel_work) return run(0, off.back());
  pool->parallel_for_dynamic(off.back(), 4, run);
}

}  // namespace tandem::cpu
