#pragma once
/// The avx512 group kernels of mla_attention (kernels/cpu/mla_attention.cpp): kGroup tokens
/// of one head at once, the same bits as the per-token dot / softmax / axpy calls.
#include <cstdint>

namespace tandem::cpu::mla_detail {

/// Tokens per group.
constexpr int kGroup = 8;

/// att[g * att_stride + p] = (dot(ql[g], c_p, kv_lora_rank) + dot(qp[g], k_pe_p, rope_dims)) * scale
/// for g < gn and p < len0 + g, as dot() computes it on the avx512 path; rows[p] is position
/// p's cached [c_p | k_pe_p]. kv_lora_rank and rope_dims must be multiples of 16.
void group_scores(const float* const* ql, const float* const* qp, int gn, int64_t len0, const float* const* rows,
                  int32_t kv_lora_rank, int32_t rope_dims, float scale, float* att, int64_t att_stride);

/// out[g] = sum over p < len0 + g of att[g * att_stride + p] * c_p, as a chain of axpy() calls
/// from zero in ascending p computes it on the avx512 path (kv_lora_rank a multiple of 16).
void group_values(const float* att, int64_t att_stride, int gn, int64_t len0, const float* const* rows,
                  int32_t kv_lora_rank, float* const* out);

}  // namespace tandem::cpu::mla_detail
