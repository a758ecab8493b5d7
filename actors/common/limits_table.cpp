#include "actors/common/limits_table.h"


#include <vector>

#include <fmt/format.h>

namespace tandem {

namespace {

constexpr int64_t i32_max = std::numeric_limits<int32_t>::max();
constexpr int64_t i64_max = std::numeric_limits<int64_t>::max();

limit_field i32(const char* key, int32_t limits::*m, int64_t min, int64_t max, const char* unit, const char* flag,
                const char* meaning, const char* fix) {
  limit_field f{key};
  f.i32 = m;
  f.min = min;
  f.max = max;
  f.unit = unit;
  f.serve_flag = flag;
  f.meaning = meaning;
  f.fix = fix;
  return f;
}

limit_field i64(const char* key, int64_t limits::*m, const char* unit, const char* flag, const char* meaning,
                const char* fix) {
  limit_field f{key};
  f.i64 = m;
  f.min = 1;
  f.max = i64_max;
  f.unit = unit;
  f.serve_flag = flag;
  f.meaning = meaning;
  f.fix = fix;
  return f;
}

limit_field flag(const char* key, bool limits::*m, const char* serve_flag, const char* meaning) {
  limit_field f{key};
  f.boolean = m;
  f.min = 0;
  f.max = 1;
  f.serve_flag = serve_flag;
  f.meaning = meaning;
  f.fix = "use true or false";
  return f;
}

const std::vector<limit_field>& table() {
  using L = limits;
  static const std::vector<limit_field> t = {
      // --- mailboxes
      i32("router_mailbox", &L::router_mailbox, 1, i32_max, "messages", nullptr,
          "router mailbox bound; senders get `overloaded` beyond", "set a mailbox bound such as 4096"),
      i32("prefill_mailbox", &L::prefill_mailbox, 1, i32_max, "messages", nullptr, "prefill scheduler mailbox bound",
          "set a mailbox bound such as 1024"),
      i32("decode_mailbox", &L::decode_mailbox, 1, i32_max, "messages", nullptr, "decode scheduler mailbox bound",
          "set a mailbox bound such as 1024"),
      i32("worker_mailbox", &L::worker_mailbox, 1, i32_max, "messages", nullptr, "worker mailbox bound",
          "set a mailbox bound such as 256"),
      i32("cache_tier_mailbox", &L::cache_tier_mailbox, 1, i32_max, "messages", nullptr, "cache tier mailbox bound",
          "set a mailbox bound such as 1024"),
      // --- admission
      i32("max_queued_requests", &L::max_queued_requests, 1, i32_max, "requests", "max-queued-requests",
          "requests waiting for prefill (per prefill scheduler) before new ones get 503",
          "allow at least one queued request, e.g. 256"),
      i64("max_queued_tokens", &L::max_queued_tokens, "tokens", "max-queued-tokens",
          "prompt tokens waiting for prefill before new requests get 503",
          "allow at least one prompt's tokens, e.g. 262144"),
      i32("max_inflight_requests", &L::max_inflight_requests, 1, i32_max, "requests", nullptr,
          "the router's in-flight table", "allow at least one request, e.g. 1024"),
      i32("request_timeout_ms", &L::request_timeout_ms, 1, i32_max, "ms", "request-timeout-ms",
          "default deadline of every request", "use e.g. 600000 (10 minutes)"),
      i32("max_queue_wait_ms", &L::max_queue_wait_ms, 0, i32_max, "ms", "max-queue-wait-ms",
          "503 when the chosen prefill target's estimated queue wait would exceed this (0 = off)",
          "use e.g. 2000 (0 = off)"),
      i32("queue_timeout_ms", &L::queue_timeout_ms, 0, i32_max, "ms", "queue-timeout-ms",
          "504 for a request still queued (no prefill started) this long (0 = off)", "use e.g. 30000 (0 = off)"),
      i32("rate_limit_rps", &L::rate_limit_rps, 0, i32_max, "requests/s", "rate-limit-rps",
          "per-client (bearer token, else address) requests/s before 429 (0 = off)",
          "use e.g. 10 requests per second per client (0 = off)"),
      i32("rate_limit_burst", &L::rate_limit_burst, 0, i32_max, "requests", "rate-limit-burst",
          "per-client bucket size (0 = rate_limit_rps)", "use e.g. 20 (0 = rate_limit_rps)"),
      i32("rate_limit_max_clients", &L::rate_limit_max_clients, 1, i32_max, "clients", nullptr,
          "rate-limit buckets kept; the least recently seen client goes first", "use e.g. 4096"),
      flag("decode_page_admission", &L::decode_page_admission, nullptr,
           "503 decode_pages while the decode target is backed up and its free pages cannot hold the prompt"),
      i32("max_decode_waiting_seqs", &L::max_decode_waiting_seqs, -1, i32_max, "sequences", nullptr,
          "503 decode_queue while this many sequences wait for a decode batch slot (0 = twice max_running_seqs, "
          "-1 = off)",
          "use 0 (= twice the decode batch size), a count, or -1 (off)"),
      i32("prefill_pause_decode_waiting_seqs", &L::prefill_pause_decode_waiting_seqs, -1, i32_max, "sequences",
          nullptr,
          "with prefill and decode on one worker, prefill pauses while this many sequences wait for a decode slot "
          "(0 = max_running_seqs, -1 = never)",
          "use 0 (= the decode batch size), a count, or -1 (never pause prefill for decode)"),
      // --- routing
      i32("router_max_retries", &L::router_max_retries, 0, i32_max, "retries", nullptr,
          "re-routes of a request refused before its first token", "use e.g. 2 (0 = no retries)"),
      i32("router_retry_base_ms", &L::router_retry_base_ms, 1, i32_max, "ms", nullptr,
          "first retry back-off; doubles per retry (jittered)", "use e.g. 5"),
      i32("router_retry_max_ms", &L::router_retry_max_ms, 1, i32_max, "ms", nullptr, "retry back-off cap",
          "use e.g. 200"),
      i32("breaker_failures", &L::breaker_failures, 1, i32_max, "failures", nullptr,
          "consecutive `disconnected` failures that open a target's circuit breaker", "use e.g. 5"),
      i32("breaker_cooldown_ms", &L::breaker_cooldown_ms, 1, i32_max, "ms", nullptr,
          "open breaker -> half-open (one probe) after this", "use e.g. 1000"),
      i32("router_heartbeat_ms", &L::router_heartbeat_ms, 1, i32_max, "ms", nullptr,
          "credit query to a quiet target; stale after 3x", "use e.g. 1000"),
      i32("router_max_migrations", &L::router_max_migrations, 0, i32_max, "moves", nullptr,
          "moves of one stream to another target; a loss beyond ends it", "use e.g. 2 (0 = never move a stream)"),
      // --- batching
      i32("prefill_chunk_tokens", &L::prefill_chunk_tokens, 1, i32_max, "tokens", nullptr,
          "chunked prefill: tokens per forward step", "use e.g. 256"),
      i32("max_running_seqs", &L::max_running_seqs, 1, i32_max, "sequences", "max-running-seqs",
          "decode batch size", "use e.g. 32"),
      i32("max_prefill_batch_seqs", &L::max_prefill_batch_seqs, 1, i32_max, "sequences", nullptr,
          "sequences in one prefill step", "use e.g. 8"),
      // --- KV cache
      i32("page_size", &L::page_size, 1, 4096, "tokens", "page-size", "tokens per KV page",
          "use 16 tokens per page (at most 4096)"),
      i32("device_pages", &L::device_pages, 0, i32_max, "pages", "device-pages",
          "KV pages of the device pool (0 = derive from kv_cache_mb)", "use 0 to derive it from kv_cache_mb"),
      i32("kv_cache_mb", &L::kv_cache_mb, 0, i32_max, "MiB", "kv-cache-mb",
          "device KV pool size when device_pages is 0", "use e.g. 256"),
      flag("prefix_cache", &L::prefix_cache, nullptr, "reuse cached prompt prefixes (radix cache)"),
      // --- requests
      i32("max_context", &L::max_context, 0, i32_max, "tokens", nullptr,
          "prompt + output tokens of one request (0 = the model's context length; at most that)",
          "use 0 for the model's context length"),
      i32("max_new_tokens", &L::max_new_tokens, 1, i32_max, "tokens", nullptr,
          "output tokens of one request (and the default max_tokens' bound)", "use e.g. 4096"),
      i32("max_choices", &L::max_choices, 1, 64, "choices", "max-choices",
          "choices of one request (n): forks sharing the prompt's KV pages, one batch slot each", "use e.g. 8"),
      i32("max_grammar_bytes", &L::max_grammar_bytes, 1, i32_max, "bytes", nullptr,
          "a response_format JSON schema (compiled by every worker that samples it)", "use e.g. 65536"),
      flag("accept_any_model_name", &L::accept_any_model_name, "accept-any-model-name",
           "a request naming another model is served by this one instead of 404 model_not_found"),
      i64("max_body_bytes", &L::max_body_bytes, "bytes", "max-body-bytes", "largest HTTP request body",
          "use e.g. 4194304 (4 MiB)"),
      i32("max_rpc_connections", &L::max_rpc_connections, 1, i32_max, "connections", nullptr,
          "open Cap'n Proto RPC connections; more are closed at accept", "use e.g. 256"),
      i32("http_header_timeout_ms", &L::http_header_timeout_ms, 1, i32_max, "ms", nullptr,
          "a request head must arrive within this; 408 and close after", "use e.g. 15000 (15 s)"),
      i32("http_max_head_bytes", &L::http_max_head_bytes, 1024, 65536, "bytes", nullptr,
          "request line + headers; 431 beyond", "use e.g. 65536 (64 KiB)"),
      i32("http_max_head_readers_per_client", &L::http_max_head_readers_per_client, 1, i32_max, "connections",
          nullptr, "connections of one address reading a head at once; 429 beyond", "use e.g. 64"),
      i32("http_body_timeout_ms", &L::http_body_timeout_ms, 1, i32_max, "ms", nullptr,
          "a request body must arrive within this; 408 after", "use e.g. 30000 (30 s)"),
      i32("http_stream_backlog_tokens", &L::http_stream_backlog_tokens, 1, i32_max, "tokens", nullptr,
          "tokens of an SSE stream waiting on a client that does not read; the request is aborted beyond",
          "use e.g. 1024"),
      i32("http_stream_socket_bytes", &L::http_stream_socket_bytes, 1, i32_max, "bytes", nullptr,
          "SO_SNDBUF of a streaming connection", "use e.g. 65536"),
      i32("rpc_stream_backlog_tokens", &L::rpc_stream_backlog_tokens, 1, i32_max, "tokens", nullptr,
          "tokens of an RPC stream waiting on its sink; the request is aborted beyond", "use e.g. 1024"),
      i32("rpc_socket_bytes", &L::rpc_socket_bytes, 1, i32_max, "bytes", nullptr,
          "SO_SNDBUF of an RPC connection (bounds a stream's flow window)", "use e.g. 262144"),
      // --- KV transfers
      i32("kv_transfer_max_live", &L::kv_transfer_max_live, 1, i32_max, "transfers", nullptr,
          "live KV transfers of a node (sending and receiving); more are refused as overloaded",
          "use e.g. 1024"),
      i32("kv_transfer_max_quarantined", &L::kv_transfer_max_quarantined, 1, i32_max, "transfers", nullptr,
          "failed transfers whose pages stay unwritable until the peer confirms; beyond, the peer is closed",
          "use e.g. 1024"),
      i32("kv_transfer_max_early_descriptors", &L::kv_transfer_max_early_descriptors, 1, i32_max, "descriptors",
          nullptr, "page descriptors that arrived before their transfer started; more are dropped", "use e.g. 256"),
      // --- cache tier
      i32("cache_max_background_copies", &L::cache_max_background_copies, 1, i32_max, "batches", nullptr,
          "host/disk backup batches in flight; beyond, backups are skipped (counted)", "use e.g. 8"),
      // --- node control
      i32("query_timeout_ms", &L::query_timeout_ms, 1, i32_max, "ms", nullptr,
          "stats, health, inspect and drain requests to a node's actors", "use e.g. 5000"),
      i32("link_timeout_ms", &L::link_timeout_ms, 1, i32_max, "ms", nullptr,
          "how long a node's start waits for the other nodes of the cluster", "use e.g. 60000 (1 minute)"),
      // --- supervision
      i32("supervisor_max_restarts", &L::supervisor_max_restarts, 0, i32_max, "restarts", nullptr,
          "restarts of a node's actors per period; one more escalates",
          "use e.g. 3 (0 = escalate at the first failure)"),
      i32("supervisor_period_ms", &L::supervisor_period_ms, 1, i32_max, "ms", nullptr,
          "the restart intensity's period", "use e.g. 60000 (1 minute)"),
      // --- compute
      i32("threads", &L::threads, 1, 4096, "threads", "threads", "kernel threads of the worker",
          "use the number of cores to compute on"),
      i32("scheduler_threads", &L::scheduler_threads, 1, i32_max, "threads", nullptr, "CAF scheduler threads",
          "use 2 or more"),
  };
  return t;
}

}  // namespace

void limit_field::set(limits& l, int64_t v) const {
  if (i32) l.*i32 = int32_t(v);
  else if (i64) l.*i64 = v;
  else l.*boolean = v != 0;
}

std::string limit_field::default_text() const {
  const limits d{};
  if (boolean) return d.*boolean ? "true" : "false";
  return std::to_string(get(d));
}

std::string limit_field::range_text() const {
  if (boolean) return "bool";
  const bool open = max == i32_max || max == i64_max;
  return open ? fmt::format(">= {}", min) : fmt::format("{}..{}", min, max);
}

std::span<const limit_field> limit_fields() { return table(); }

const limit_field* find_limit(std::string_view key) {
  for (const auto& f : table())
    if (key == f.key) return &f;
  return nullptr;
}

std::string check_limit(const limit_field& f, int64_t v, const std::string& subject) {
  if (v >= f.min && v <= f.max) return "";
  return fmt::format("{} = {} must be {}; {}", subject.empty() ? std::string("limits.") + f.key : subject, v,
                     f.range_text(), f.fix);
}

std::string limits_markdown() {
  std::string s = "| key | type | default | range | unit | `tandem serve` flag | meaning |\n|---|---|---|---|---|---|---|\n";
  for (const auto& f : table()) {
    s += fmt::format("| `{}` | {} | {} | {} | {} | {} | {} |\n", f.key, f.boolean ? "bool" : "int", f.default_text(),
                     f.boolean ? "true/false" : f.range_text(), f.unit, f.serve_flag ? fmt::format("`--{}`", f.serve_flag) : "",
                     f.meaning);
  }
  return s;
}

}  // namespace tandem
