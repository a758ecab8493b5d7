#pragma once
// Small KV layout sets for the tests of page tables and caches over several pools.
#include "kernels/model/kv_pools.h"

namespace tandem::test {

/// A full pool (layer 0) and a window pool of `window` tokens (layer 1), page size 2.
inline kv_pools_layout two_small_pools(int32_t window) {
  kv_layout page;
  page.n_layers = 1;
  page.n_kv_heads = 1;
  page.head_dim = 4;
  page.page_size = 2;
  kv_pools_layout set;
  set.pools.push_back(kv_pool_spec{"full", page, 0, {0}});
  set.pools.push_back(kv_pool_spec{"window", page, window, {1}});
  return set;
}

}  // namespace tandem::test
