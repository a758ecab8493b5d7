// pack_weights (ops.h): a model's matmul weights prepared once for a kernel path: the amx tile
// copy, the packed low-bit copy, and the in-memory copy of the rest (weight_copy.h).
#include <memory>
#include <vector>

#include "kernels/cpu/amx.h"
#include "kernels/cpu/ops.h"
#include "kernels/cpu/quant_packed.h"
#include "kernels/cpu/weight_copy.h"

namespace tandem::cpu {

packed_weight pack_weight(const tensor_view& w, cpu_isa isa, thread_pool* pool) {
  return pack_weights(std::span<const tensor_view>(&w, 1), isa, pool).front();
}

std::vector<packed_weight> pack_weights(std::span<const tensor_view> ws, cpu_isa isa, thread_pool* pool,
                                        weight_prep prep) {
  isa = resolve_isa(isa);
  std::vector<packed_weight> out;
  out.reserve(ws.size());
  size_t total = 0;
  if (isa == cpu_isa::amx)
    for (const tensor_view& w : ws)
      if (amx_handles(w.type)) total += amx_packed_bytes(w);
  std::shared_ptr<uint16_t> arena = total > 0 ? amx_arena(total) : nullptr;
  size_t offset = 0;  // in values
  for (const tensor_view& w : ws) {
    packed_weight p;
    p.view = w;
    p.isa = isa;
    if (arena && amx_handles(w.type)) {
      p.amx = std::make_shared<const amx_matrix>(amx_pack(w, pool, arena, offset));
      offset += amx_packed_bytes(w) / 2;
    }
    if (prep.pack_low_bit && vector_isa(isa) == cpu_isa::avx512 && packs(w.type) &&
        w.cols() % block_elems(w.type) == 0)
      p.quant = std::make_shared<const quant_packed>(pack_quant(w, pool));
    out.push_back(std::move(p));
  }
  if (prep.copy_rest) {
    std::vector<tensor_view*> rest;
    for (packed_weight& p : out)
      if (!p.amx && !p.quant) rest.push_back(&p.view);
    const std::shared_ptr<const uint8_t> copy = copy_weights(rest, pool);
    for (packed_weight& p : out)
      if (!p.amx && !p.quant) p.copy = copy;
  }
  return out;
}

}  // namespace tandem::cpu
