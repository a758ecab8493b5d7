#pragma once
/// The KV page geometry of the UCX engine tests: small enough that a transfer is a few hundred
/// bytes, with more than one layer and head so a misplaced offset shows.
#include "kernels/model/kv_pool.h"

namespace tandem::test {

inline kv_layout small_layout() {
  kv_layout l;
  l.n_layers = 3;
  l.n_kv_heads = 2;
  l.head_dim = 8;
  l.page_size = 4;
  return l;
}

}  // namespace tandem::test
