#include "actors/common/limits.h"

#include <fmt/format.h>

namespace tandem {

namespace {
std::string positive(const char* name, int64_t v, const char* fix) {
  if (v > 0) return "";
  return fmt::format("limits.{} = {} must be > 0; {}", name, v, fix);
}
}  // namespace

std::string limits::validate() const {
  for (auto msg : {
           positive("router_mailbox", router_mailbox, "set a mailbox bound such as 4096"),
           positive("prefill_mailbox", prefill_mailbox, "set a mailbox bound such as 1024"),
           positive("decode_mailbox", decode_mailbox, "set a mailbox bound such as 1024"),
           positive("worker_mailbox", worker_mailbox, "set a mailbox bound such as 256"),
           positive("cache_tier_mailbox", cache_tier_mailbox, "set a mailbox bound such as 1024"),
           positive("max_queued_requests", max_queued_requests, "allow at least one queued request"),
           positive("max_queued_tokens", max_queued_tokens, "allow at least one prompt's tokens"),
           positive("max_inflight_requests", max_inflight_requests, "allow at least one request"),
           positive("request_timeout_ms", request_timeout_ms, "use e.g. 600000 (10 minutes)"),
           positive("prefill_chunk_tokens", prefill_chunk_tokens, "use e.g. 256"),
           positive("max_running_seqs", max_running_seqs, "use e.g. 32"),
           positive("max_prefill_batch_seqs", max_prefill_batch_seqs, "use e.g. 8"),
           positive("page_size", page_size, "use 16 tokens per page"),
           positive("max_new_tokens", max_new_tokens, "use e.g. 4096"),
           positive("max_grammar_bytes", max_grammar_bytes, "use e.g. 65536"),
           positive("max_body_bytes", max_body_bytes, "use e.g. 4194304 (4 MiB)"),
           positive("http_header_timeout_ms", http_header_timeout_ms, "use e.g. 15000 (15 s)"),
           positive("http_max_head_bytes", http_max_head_bytes, "use e.g. 65536 (64 KiB)"),
           positive("http_max_head_readers_per_client", http_max_head_readers_per_client, "use e.g. 64"),
           positive("http_body_timeout_ms", http_body_timeout_ms, "use e.g. 30000 (30 s)"),
           positive("http_stream_backlog_tokens", http_stream_backlog_tokens, "use e.g. 1024"),
           positive("http_stream_socket_bytes", http_stream_socket_bytes, "use e.g. 65536"),
           positive("rpc_stream_backlog_tokens", rpc_stream_backlog_tokens, "use e.g. 1024"),
           positive("rpc_socket_bytes", rpc_socket_bytes, "use e.g. 262144"),
           positive("supervisor_period_ms", supervisor_period_ms, "use e.g. 60000 (1 minute)"),
           positive("rate_limit_max_clients", rate_limit_max_clients, "use e.g. 4096"),
           positive("router_retry_base_ms", router_retry_base_ms, "use e.g. 5"),
           positive("router_retry_max_ms", router_retry_max_ms, "use e.g. 200"),
           positive("breaker_failures", breaker_failures, "use e.g. 5"),
           positive("breaker_cooldown_ms", breaker_cooldown_ms, "use e.g. 1000"),
           positive("router_heartbeat_ms", router_heartbeat_ms, "use e.g. 1000"),
           positive("threads", threads, "use the number of cores to compute on"),
           positive("scheduler_threads", scheduler_threads, "use 2 or more"),
       }) {
    if (!msg.empty()) return msg;
  }
  if (device_pages < 0) return fmt::format("limits.device_pages = {} must be >= 0 (0 derives it from kv_cache_mb)", device_pages);
  if (device_pages == 0 && kv_cache_mb <= 0)
    return fmt::format("limits.kv_cache_mb = {} must be > 0 when device_pages is 0; set one of them", kv_cache_mb);
  if (supervisor_max_restarts < 0)
    return fmt::format("limits.supervisor_max_restarts = {} must be >= 0 (0 = never restart, escalate at once)",
                       supervisor_max_restarts);
  for (auto [name, v] : {std::pair<const char*, int32_t>{"max_queue_wait_ms", max_queue_wait_ms},
                         {"queue_timeout_ms", queue_timeout_ms},
                         {"rate_limit_rps", rate_limit_rps},
                         {"rate_limit_burst", rate_limit_burst},
                         {"router_max_retries", router_max_retries},
                         {"router_max_migrations", router_max_migrations}})
    if (v < 0) return fmt::format("limits.{} = {} must be >= 0 (0 = off)", name, v);
  if (prefill_pause_decode_waiting_seqs < -1)
    return fmt::format("limits.prefill_pause_decode_waiting_seqs = {} must be >= -1 (-1 = never pause, 0 = "
                       "max_running_seqs)",
                       prefill_pause_decode_waiting_seqs);
  if (max_decode_waiting_seqs < -1)
    return fmt::format("limits.max_decode_waiting_seqs = {} must be >= -1 (-1 = off, 0 = twice the decode batch size)",
                       max_decode_waiting_seqs);
  if (rate_limit_burst > 0 && rate_limit_rps == 0)
    return fmt::format("limits.rate_limit_burst = {} needs limits.rate_limit_rps > 0; set both or neither",
                       rate_limit_burst);
  if (router_retry_max_ms < router_retry_base_ms)
    return fmt::format("limits.router_retry_max_ms = {} is below router_retry_base_ms = {}; raise it",
                       router_retry_max_ms, router_retry_base_ms);
  if (max_context < 0) return fmt::format("limits.max_context = {} must be >= 0 (0 = the model's)", max_context);
  if (http_max_head_bytes > 65536 || http_max_head_bytes < 1024)
    return fmt::format("limits.http_max_head_bytes = {} must be 1024..65536; use e.g. 65536", http_max_head_bytes);
  if (page_size > 4096) return fmt::format("limits.page_size = {} is too large; use 16..256 tokens", page_size);
  return "";
}

}  // namespace tandem
