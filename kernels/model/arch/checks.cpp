#include "kernels/model/arch/checks.h"

#include <fmt/format.h>

#include "kernels/base/error.h"
#include "kernels/cpu/ops.h"

namespace tandem::arch {

void check_weight(const tensor_view& t, const std::string& name, int64_t cols, int64_t rows, int64_t mats) {
  if (t.data == nullptr) throw tandem::error(fmt::format("model tensor {} is missing", name));
  if (!is_supported(t.type))
    throw tandem::error(fmt::format("model tensor {} has type {}; supported are {}", name, to_string(t.type),
                                    supported_types_list));
  if (t.cols() != cols || t.ne[1] != rows || t.ne[2] * t.ne[3] != mats) {
    if (mats == 1)
      throw tandem::error(fmt::format("model tensor {} is {}x{} (cols x rows), expected {}x{}", name, t.cols(),
                                      t.rows(), cols, rows));
    throw tandem::error(fmt::format("model tensor {} is {}x{}x{} (cols x rows x matrices), expected {}x{}x{}", name,
                                    t.cols(), t.ne[1], t.ne[2] * t.ne[3], cols, rows, mats));
  }
  if (cols % block_elems(t.type) != 0)
    throw tandem::error(fmt::format("model tensor {} is {} with {} columns, not a multiple of its block of {}", name,
                                    to_string(t.type), cols, block_elems(t.type)));
  const size_t need = row_bytes(t.type, cols) * size_t(rows) * size_t(mats);
  if (t.nbytes != 0 && t.nbytes < need)
    throw tandem::error(fmt::format("model tensor {} holds {} bytes, needs {}", name, t.nbytes, need));
}

std::vector<float> vector_weight(const tensor_view& t, const std::string& name, int64_t n) {
  check_weight(t, name, n, 1);
  std::vector<float> out(static_cast<size_t>(n));
  cpu::dequantize_row(t.type, t.row(0), out.data(), n);
  return out;
}

std::vector<float> optional_vector_weight(const tensor_view& t, const std::string& name, int64_t n) {
  if (t.data == nullptr) return {};
  return vector_weight(t, name, n);
}

size_t check_batch(std::span<const batch_seq> batch, const model_config& c, const kv_pools& pools,
                   std::vector<int32_t>& tokens, std::vector<int32_t>& positions) {
  const int32_t ps = pools.set().page_size();
  tokens.clear();
  positions.clear();
  size_t n_logits = 0;
  for (size_t s = 0; s < batch.size(); ++s) {
    const batch_seq& b = batch[s];
    const int64_t end = int64_t(b.pos) + int64_t(b.tokens.size());
    if (b.pos < 0) throw tandem::error(fmt::format("batch sequence {}: negative position {}", s, b.pos));
    if (b.want_logits && b.tokens.empty())
      throw tandem::error(fmt::format("batch sequence {} wants logits but has no new tokens", s));
    if (c.n_ctx > 0 && end > c.n_ctx)
      throw tandem::error(fmt::format("batch sequence {}: positions up to {} exceed the context length {}", s, end,
                                      c.n_ctx));
    if (b.pool_pages.empty() ? pools.size() != 1 : b.pool_pages.size() != pools.size())
      throw tandem::error(fmt::format("batch sequence {}: {} page tables for {} KV pools ({})", s,
                                      b.pool_pages.empty() ? 1 : b.pool_pages.size(), pools.size(),
                                      pools.set().describe()));
    for (size_t p = 0; p < pools.size(); ++p) {
      const std::span<const int32_t> table = b.pages_of(p);
      const kv_pool_spec& spec = pools.set().pools[p];
      const kv_pool& pool = pools[p];
      if (int64_t(table.size()) * ps < end)
        throw tandem::error(fmt::format("batch sequence {}: {} pages of {} tokens cannot hold {} positions; "
                                        "allocate more pages",
                                        s, table.size(), ps, end));
      // Every page attention reads ([first live block, end)), not only the ones written now.
      for (int64_t i = spec.first_live_block(b.pos); i < (end + ps - 1) / ps; ++i) {
        const int32_t page = table[size_t(i)];
        if (page < 0 || page >= pool.n_pages())
          throw tandem::error(fmt::format("batch sequence {}: page id {} is outside the {} pool of {} pages", s,
                                          page, spec.name, pool.n_pages()));
      }
    }
    for (size_t i = 0; i < b.tokens.size(); ++i) {
      if (b.tokens[i] < 0 || b.tokens[i] >= c.n_vocab)
        throw tandem::error(fmt::format("batch sequence {}: token id {} is out of range [0, {})", s, b.tokens[i],
                                        c.n_vocab));
      tokens.push_back(b.tokens[i]);
      positions.push_back(b.pos + int32_t(i));
    }
    n_logits += b.want_logits ? 1 : 0;
  }
  return n_logits;
}

}  // namespace tandem::arch
