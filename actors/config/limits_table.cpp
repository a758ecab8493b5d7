#include "actors/config/limits_table.h"

namespace tandem::config_detail {

const std::vector<i32_field>& limits_i32_fields() {
  static const std::vector<i32_field> f = {
      {"router_mailbox", &limits::router_mailbox, 1, "set a mailbox bound such as 4096"},
      {"prefill_mailbox", &limits::prefill_mailbox, 1, "set a mailbox bound such as 1024"},
      {"decode_mailbox", &limits::decode_mailbox, 1, "set a mailbox bound such as 1024"},
      {"worker_mailbox", &limits::worker_mailbox, 1, "set a mailbox bound such as 256"},
      {"cache_tier_mailbox", &limits::cache_tier_mailbox, 1, "set a mailbox bound such as 1024"},
      {"max_queued_requests", &limits::max_queued_requests, 1, "allow at least one queued request, e.g. 256"},
      {"max_inflight_requests", &limits::max_inflight_requests, 1, "allow at least one request, e.g. 1024"},
      {"request_timeout_ms", &limits::request_timeout_ms, 1, "use e.g. 600000 (10 minutes)"},
      {"prefill_chunk_tokens", &limits::prefill_chunk_tokens, 1, "use e.g. 256"},
      {"max_running_seqs", &limits::max_running_seqs, 1, "use e.g. 32"},
      {"max_prefill_batch_seqs", &limits::max_prefill_batch_seqs, 1, "use e.g. 8"},
      {"page_size", &limits::page_size, 1, "use 16 tokens per page (at most 4096)"},
      {"device_pages", &limits::device_pages, 0, "use 0 to derive it from kv_cache_mb"},
      {"kv_cache_mb", &limits::kv_cache_mb, 0, "use e.g. 256"},
      {"max_context", &limits::max_context, 0, "use 0 for the model's context length"},
      {"max_new_tokens", &limits::max_new_tokens, 1, "use e.g. 4096"},
      {"max_grammar_bytes", &limits::max_grammar_bytes, 1, "use e.g. 65536"},
      {"max_rpc_connections", &limits::max_rpc_connections, 1, "use e.g. 256"},
      {"http_header_timeout_ms", &limits::http_header_timeout_ms, 1, "use e.g. 15000 (15 s)"},
      {"http_max_head_bytes", &limits::http_max_head_bytes, 1, "use e.g. 65536 (64 KiB, at most 65536)"},
      {"http_max_head_readers_per_client", &limits::http_max_head_readers_per_client, 1, "use e.g. 64"},
      {"http_body_timeout_ms", &limits::http_body_timeout_ms, 1, "use e.g. 30000 (30 s)"},
      {"http_stream_backlog_tokens", &limits::http_stream_backlog_tokens, 1, "use e.g. 1024"},
      {"http_stream_socket_bytes", &limits::http_stream_socket_bytes, 1, "use e.g. 65536"},
      {"rpc_stream_backlog_tokens", &limits::rpc_stream_backlog_tokens, 1, "use e.g. 1024"},
      {"rpc_socket_bytes", &limits::rpc_socket_bytes, 1, "use e.g. 262144"},
      {"supervisor_max_restarts", &limits::supervisor_max_restarts, 0, "use e.g. 3 (0 = escalate at the first failure)"},
      {"supervisor_period_ms", &limits::supervisor_period_ms, 1, "use e.g. 60000 (1 minute)"},
      {"max_queue_wait_ms", &limits::max_queue_wait_ms, 0, "use e.g. 2000 (0 = off)"},
      {"queue_timeout_ms", &limits::queue_timeout_ms, 0, "use e.g. 30000 (0 = off)"},
      {"rate_limit_rps", &limits::rate_limit_rps, 0, "use e.g. 10 requests per second per client (0 = off)"},
      {"rate_limit_burst", &limits::rate_limit_burst, 0, "use e.g. 20 (0 = rate_limit_rps)"},
      {"rate_limit_max_clients", &limits::rate_limit_max_clients, 1, "use e.g. 4096"},
      {"router_max_retries", &limits::router_max_retries, 0, "use e.g. 2 (0 = no retries)"},
      {"router_retry_base_ms", &limits::router_retry_base_ms, 1, "use e.g. 5"},
      {"router_retry_max_ms", &limits::router_retry_max_ms, 1, "use e.g. 200"},
      {"breaker_failures", &limits::breaker_failures, 1, "use e.g. 5"},
      {"breaker_cooldown_ms", &limits::breaker_cooldown_ms, 1, "use e.g. 1000"},
      {"router_heartbeat_ms", &limits::router_heartbeat_ms, 1, "use e.g. 1000"},
      {"router_max_migrations", &limits::router_max_migrations, 0, "use e.g. 2 (0 = never move a stream)"},
      {"max_decode_waiting_seqs", &limits::max_decode_waiting_seqs, -1,
       "use 0 (= twice the decode batch size), a count, or -1 (off)"},
      {"prefill_pause_decode_waiting_seqs", &limits::prefill_pause_decode_waiting_seqs, -1,
       "use 0 (= the decode batch size), a count, or -1 (never pause prefill for decode)"},
      {"threads", &limits::threads, 1, "use the number of cores to compute on"},
      {"scheduler_threads", &limits::scheduler_threads, 1, "use 2 or more"},
  };
  return f;
}


const std::vector<i64_field>& limits_i64_fields() {
  static const std::vector<i64_field> f = {
      {"max_queued_tokens", &limits::max_queued_tokens, "allow at least one prompt's tokens, e.g. 262144"},
      {"max_body_bytes", &limits::max_body_bytes, "use e.g. 4194304 (4 MiB)"},
  };
  return f;
}

}  // namespace tandem::config_detail
