#include "actors/common/seq_pages.h"

#include <caf/all.hpp>

namespace tandem {

void send_free_pages(const bounded_actor& cache, const std::string& id, pool_pages& pages) {
  if (!holds_pages(pages)) {
    pages.clear();
    return;
  }
  cache.gate->enter_control();
  caf::anon_send(cache.handle, wire_atom::value, make_wire([&](schema::Envelope::Builder env) {
                   auto f = env.initFree();
                   f.setId(id);
                   write_pool_pages(f, pages);
                 }));
  pages.clear();
}

}  // namespace tandem
