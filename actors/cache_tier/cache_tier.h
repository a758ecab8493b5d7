#pragma once
/// Cache tier actor: owns the page allocator and the radix prefix cache of one KV pool.
/// Other actors pass page ids; only the worker touches page memory.
///  - call Acquire{tokens}: longest cached prefix (whole pages, at most |tokens|-1 tokens so
///    the last prompt token is always computed) + fresh pages for the rest -> AcquireReply.
///  - call Alloc{count} -> AllocReply (evicts unreferenced cached pages if needed).
///  - send Free{pages}, Insert{tokens, pages} (no reply).
#include <spdlog/logger.h>

#include <caf/actor_system.hpp>
#include <memory>

#include "actors/common/bounded_mailbox.h"

namespace tandem {

struct cache_tier_options {
  int32_t n_pages = 0;
  int32_t page_size = 16;
  bool prefix_cache = true;
  int32_t mailbox_bound = 1024;
};

bounded_actor spawn_cache_tier(caf::actor_system& sys, const cache_tier_options& opt,
                               std::shared_ptr<spdlog::logger> log);

}  // namespace tandem
