#include "actors/common/limits.h"

#include <fmt/format.h>

#include "actors/common/limits_table.h"

namespace tandem {

std::string limits::validate() const {
  // Each field's own bounds come from the one table (actors/common/limits_table.h) ...
  for (const auto& f : limit_fields())
    if (f.is_integer())
      if (auto msg = check_limit(f, f.get(*this)); !msg.empty()) return msg;
  // ... and what only the combination can say, here.
  if (device_pages == 0 && kv_cache_mb <= 0)
    return fmt::format("limits.kv_cache_mb = {} must be > 0 when device_pages is 0; set one of them", kv_cache_mb);
  if (rate_limit_burst > 0 && rate_limit_rps == 0)
    return fmt::format("limits.rate_limit_burst = {} needs limits.rate_limit_rps > 0; set both or neither",
                       rate_limit_burst);
  if (router_retry_max_ms < router_retry_base_ms)
    return fmt::format("limits.router_retry_max_ms = {} is below router_retry_base_ms = {}; raise it",
                       router_retry_max_ms, router_retry_base_ms);
  return "";
}

}  // namespace tandem
