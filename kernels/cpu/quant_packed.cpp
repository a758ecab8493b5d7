// The packed low-bit weights (quant_packed.h): which types pack on this CPU, the packing split
// over a pool, and the dispatch to each type's kernel (quant_packed_<type>.cpp).
#include "kernels/cpu/quant_packed.h"

#include <fmt/format.h>

#include <cstdlib>
#include <string_view>

#include "kernels/base/error.h"
#include "kernels/cpu/thread_pool.h"

namespace tandem::cpu {

namespace {

// A type's packer and kernel.
struct packed_kernel {
  quant_detail::pack_group_fn pack = nullptr;
  void (*rows)(const quant_packed&, const quant_acts&, float*, int64_t, int64_t) = nullptr;
};

// Nulls where no packed kernel exists: a new type adds its line here.
packed_kernel kernel_of(ggml_type t) {
  switch (t) {
    case ggml_type::q4_0: return {quant_detail::pack_group_q4_0, quant_detail::packed_rows_q4_0};
    case ggml_type::q4_K: return {quant_detail::pack_group_q4_K, quant_detail::packed_rows_q4_K};
    case ggml_type::q5_K: return {quant_detail::pack_group_q5_K, quant_detail::packed_rows_q5_K};
    case ggml_type::q6_K: return {quant_detail::pack_group_q6_K, quant_detail::packed_rows_q6_K};
    default: return {};
  }
}

}  // namespace

bool packs(ggml_type t) { return quant_detail::has_avx512_vnni() && has_packed_layout(t); }

bool has_packed_layout(ggml_type t) { return kernel_of(t).pack != nullptr; }

uint64_t packed_copy_bytes(const tensor_view& w) {
  const int64_t rows = w.ne[1], slices = w.ne[2] * w.ne[3];
  return uint64_t((rows + pack_rows - 1) / pack_rows * pack_rows) * row_bytes(w.type, w.cols()) * uint64_t(slices);
}

bool packing_enabled() {
  static const bool on = [] {
    const char* v = std::getenv("TANDEM_PACK");
    return v == nullptr || std::string_view(v) != "0";
  }();
  return on;
}

quant_packed pack_quant(const tensor_view& w, thread_pool* pool) {
  const quant_detail::pack_group_fn pack_group = kernel_of(w.type).pack;
  if (pack_group == nullptr)
    throw tandem::error(fmt::format("pack_quant: no packed layout for {} weights; use the unpacked view",
                                    to_string(w.type)));
  quant_packed p;
  p.type = w.type;
  p.rows = w.rows();
  p.cols = w.cols();
  p.bytes.resize(size_t(p.groups()) * p.group_bytes());
  parallel_for_if(pool, p.groups(), p.groups() * int64_t(p.group_bytes()), [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) pack_group(w, g * pack_rows, p.bytes.data() + size_t(g) * p.group_bytes());
  });
  return p;
}

void packed_rows(const quant_packed& p, const quant_acts& a, float* y, int64_t g0, int64_t g1) {
  const packed_kernel k = kernel_of(p.type);
  if (k.rows == nullptr)
    throw tandem::error(fmt::format("packed_rows: no packed kernel for {} weights", to_string(p.type)));
  k.rows(p, a, y, g0, g1);
}

}  // namespace tandem::cpu
