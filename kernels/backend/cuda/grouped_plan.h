#pragma once
/// The host's plan of a grouped quantized matmul (the CUDA backend's matmul_batch over
/// q4_0/q8_0/q4_K/q5_K/q6_K weights, e.g. every routed expert of a MoE step): each distinct
/// input (pointer, rows, width, activation group) is quantized once, all of one group size in
/// one launch; all matmuls of one weight type go in one launch. Plain C++ (no CUDA): the
/// offsets and work-item numbering are tested on the CPU (tests/kernels/test_grouped_plan.cpp).
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

namespace tandem::cuda_backend {

/// One quantized matmul of the batch: y [rows][n] = W x, x [rows][k].
struct quant_job {
  const float* x = nullptr;
  int64_t rows = 0, k = 0, n = 0;
  uint32_t type = 0;  ///< ggml type id
  int group = 32;     ///< its activation group (quant_group)
};

/// A distinct input: where its int8 values, scales and sums go in the scratch area, and its
/// first block in its group size's quantize launch.
struct planned_input {
  const float* x = nullptr;
  int64_t rows = 0, k = 0;
  int group = 32;
  size_t qs_at = 0, d_at = 0, sums_at = 0;
  int64_t first = 0;
};

/// A job in its weight type's launch: its input and its first work item.
struct planned_job {
  size_t job = 0;
  size_t input = 0;  ///< index into inputs[group == 256]
  int64_t first = 0;
};

struct planned_type {
  uint32_t type = 0;
  std::vector<planned_job> jobs;
  int64_t items = 0;  ///< work items (one warp per weight row and activation row)
};

struct grouped_quant_plan {
  std::vector<planned_input> inputs[2];  ///< [0] group 32, [1] group 256
  int64_t blocks[2] = {0, 0};            ///< quantize blocks per launch (one per row and group)
  std::vector<planned_type> types;       ///< in order of first appearance
  size_t bytes = 0;                      ///< scratch bytes for every input's quantized form
};

/// Plans `jobs` (rows > 0 each). Areas are 16-byte aligned and never overlap.
inline grouped_quant_plan plan_grouped_quant(std::span<const quant_job> jobs) {
  grouped_quant_plan p;
  auto align = [](size_t b) { return (b + 15) / 16 * 16; };
  for (size_t j = 0; j < jobs.size(); ++j) {
    const quant_job& q = jobs[j];
    const int g = q.group == 256 ? 1 : 0;
    std::vector<planned_input>& in = p.inputs[g];
    size_t at = in.size();
    for (size_t i = 0; i < in.size(); ++i)
      if (in[i].x == q.x && in[i].rows == q.rows && in[i].k == q.k) at = i;
    if (at == in.size()) {
      planned_input n{.x = q.x, .rows = q.rows, .k = q.k, .group = q.group};
      n.qs_at = p.bytes;
      p.bytes = align(p.bytes + size_t(q.rows * q.k));
      n.d_at = p.bytes;
      p.bytes = align(p.bytes + size_t(q.rows * (q.k / q.group)) * sizeof(float));
      n.sums_at = p.bytes;
      p.bytes = align(p.bytes + size_t(q.rows * (q.k / 32)) * sizeof(int16_t));
      n.first = p.blocks[g];
      p.blocks[g] += q.rows * (q.k / q.group);
      in.push_back(n);
    }
    planned_type* t = nullptr;
    for (planned_type& x : p.types)
      if (x.type == q.type) t = &x;
    if (t == nullptr) {
      p.types.push_back(planned_type{.type = q.type});
      t = &p.types.back();
    }
    t->jobs.push_back(planned_job{.job = j, .input = at, .first = t->items});
    t->items += q.n * q.rows;
  }
  return p;
}

}  // namespace tandem::cuda_backend
