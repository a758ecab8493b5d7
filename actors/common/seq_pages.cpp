#include "actors/common/seq_pages.h"

#include <caf/all.hpp>

namespace tandem {

void send_free_pages(const role_handle<cache_tier_role>& cache, const std::string& id, pool_pages& pages) {
  if (!holds_pages(pages)) {
    pages.clear();
    return;
  }
  cache.send_anon<msg::free>([&](schema::FreePages::Builder f) {
    f.setId(id);
    write_pool_pages(f, pages);
  });
  pages.clear();
}

}  // namespace tandem
