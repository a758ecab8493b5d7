#pragma once
/// Split-context attention (FlashDecoding): a query row's positions [lo, pos] are cut into
/// chunks of k_split_positions; each chunk's block leaves a partial softmax (its maximum score
/// m, its sum of exp(score - m) l, and the unnormalised weighted V sum acc), and a merge
/// rescales the partials to their common maximum and divides once. The chunk length is fixed,
/// so a row's partition and bits depend only on the row (never on the batch around it), while
/// a small batch still gets many blocks per row to fill the device.
///
/// Plain C++17, no CUDA headers: the merge kernel (attention.cu) and the host's plan
/// (cuda_backend.cpp) use it, and tests/kernels/test_split_softmax.cpp checks the math on the
/// CPU against one softmax over all positions.
#include <cmath>
#include <cstddef>
#include <cstdint>

#if defined(__CUDACC__)
#define TANDEM_HD __host__ __device__
#else
#define TANDEM_HD
#endif

namespace tandem::cuda_backend {

/// Positions per split of one query row.
constexpr int k_split_positions = 256;

/// Splits of a row attending [lo, pos]: 1 for up to k_split_positions positions.
TANDEM_HD inline int split_count(int lo, int pos) {
  const int n = pos - lo + 1;
  return n <= k_split_positions ? 1 : (n + k_split_positions - 1) / k_split_positions;
}

/// Split s of a row covers positions [lo + s * k_split_positions, min(pos, that + chunk - 1)].
TANDEM_HD inline int split_first(int lo, int s) { return lo + s * k_split_positions; }
TANDEM_HD inline int split_last(int lo, int pos, int s) {
  const int last = lo + (s + 1) * k_split_positions - 1;
  return last < pos ? last : pos;
}

TANDEM_HD inline float split_exp(float x) {
#if defined(__CUDA_ARCH__)
  return __expf(x);
#else
  return std::exp(x);
#endif
}

/// One partial of a split: m = -inf when it saw no position (then l = 0 and acc is not read).
/// The merged maximum of n partials' maxima (m[s * stride]).
TANDEM_HD inline float merged_max(const float* m, int n, int stride) {
  float M = -INFINITY;
  for (int s = 0; s < n; ++s) M = m[s * stride] > M ? m[s * stride] : M;
  return M;
}

/// The merged softmax denominator: sum_s l_s exp(m_s - M), empty partials skipped.
TANDEM_HD inline float merged_sum(const float* m, const float* l, int n, int stride, float M) {
  float L = 0.0f;
  for (int s = 0; s < n; ++s)
    if (m[s * stride] != -INFINITY) L += l[s * stride] * split_exp(m[s * stride] - M);
  return L;
}

/// Output element e: sum_s acc_s[e] exp(m_s - M) / L (0 when nothing was attended).
TANDEM_HD inline float merged_elem(const float* m, const float* acc, int n, int stride, float M, float L) {
  float o = 0.0f;
  for (int s = 0; s < n; ++s)
    if (m[s * stride] != -INFINITY) o += acc[s * stride] * split_exp(m[s * stride] - M);
  return L > 0.0f ? o / L : 0.0f;
}

/// Floats one partial takes for a head of dv values: m, l, then acc[dv].
TANDEM_HD inline int partial_floats(int dv) { return dv + 2; }

}  // namespace tandem::cuda_backend
