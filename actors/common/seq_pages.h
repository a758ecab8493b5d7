#pragma once
/// What the schedulers do with a sequence's page tables (kernels/model/seq_pages.h) that needs
/// an actor: give the pages back to the cache tier.
#include <string>

#include "actors/common/protocol.h"
#include "actors/common/pool_pages_wire.h"
#include "kernels/model/seq_pages.h"

namespace tandem {

/// Gives every page `pages` holds back to the cache tier (a FreePages message, past its
/// mailbox bound: the pages must come back) and empties it; nothing is sent when it holds none.
void send_free_pages(const role_handle<cache_tier_role>& cache, const std::string& id, pool_pages& pages);

}  // namespace tandem
