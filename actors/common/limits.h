#pragma once
/// Every bound in the runtime lives here: mailboxes, queues, pools, batch sizes, bodies.
/// `tandem serve` fills this from flags/config; nothing else invents a limit.
#include <cstdint>
#include <string>

namespace tandem {

struct limits {
  // --- mailboxes (messages waiting per actor before senders get `overloaded`)
  int32_t router_mailbox = 4096;
  int32_t prefill_mailbox = 1024;
  int32_t decode_mailbox = 1024;
  int32_t worker_mailbox = 256;
  int32_t cache_tier_mailbox = 1024;

  // --- admission
  int32_t max_queued_requests = 256;     ///< per prefill scheduler
  int64_t max_queued_tokens = 262144;    ///< prompt tokens waiting for prefill
  int32_t max_inflight_requests = 1024;  ///< router's in-flight table
  int32_t request_timeout_ms = 600000;   ///< default deadline of a request
  /// Refuse (503) when the chosen prefill target's estimated queue wait (queued tokens /
  /// measured drain rate) would exceed this; keeps admitted TTFT bounded in a burst. 0 = off.
  int32_t max_queue_wait_ms = 0;
  /// A request still queued (no prefill started) this long after arrival ends with 504. 0 = off.
  int32_t queue_timeout_ms = 0;
  /// Per client (bearer token, else address) token bucket at the HTTP front end: 429 beyond. 0 = off.
  int32_t rate_limit_rps = 0;
  int32_t rate_limit_burst = 0;          ///< bucket size; 0 = rate_limit_rps (at least 1)
  int32_t rate_limit_max_clients = 4096; ///< buckets kept; the least recently seen client goes first
  /// Refuse (503, decode_pages) while the decode target is backed up (sequences waiting for a
  /// batch slot) and its free KV pages cannot hold the new prompt.
  bool decode_page_admission = true;
  /// Refuse (503, decode_queue) while this many sequences already wait for a slot in the
  /// decode target's batch: a burst then cannot build a decode backlog that every admitted
  /// request sits behind. 0 = twice the target's max_running_seqs (two batches waiting); -1 = off.
  int32_t max_decode_waiting_seqs = 0;
  /// Prefill and decode on one worker (both roles on a node): the prefill scheduler starts no
  /// step while the decode scheduler has a running batch and this many sequences waiting for
  /// a slot in it. Alternating one step each, a 256-token prefill step (~70 ms on tiny-15m)
  /// against a 5 ms decode step gave decode ~7% of the worker in a burst: prefill handed off
  /// sequences faster than decode finished them, and the backlog was refused as decode_queue
  /// even at 0.8x load. Pausing slows the prefill drain instead, which the router's wait
  /// estimate measures. 0 = max_running_seqs (one full batch waiting); -1 = never pause.
  int32_t prefill_pause_decode_waiting_seqs = 0;

  // --- routing
  int32_t router_max_retries = 2;        ///< re-routes of a request refused (overloaded/disconnected) before its first token
  int32_t router_retry_base_ms = 5;      ///< first retry backoff; doubles per retry (jittered)
  int32_t router_retry_max_ms = 200;     ///< backoff cap
  int32_t breaker_failures = 5;          ///< consecutive `disconnected` failures that open a target's circuit breaker
  int32_t breaker_cooldown_ms = 1000;    ///< open -> half-open (one probe) after this
  int32_t router_heartbeat_ms = 1000;    ///< credit query to a quiet target; stale (unhealthy) after 3x
  /// Stream migration ([router] migration): a request that loses its target after it was sent
  /// (node down, a stage error that is not the client's fault, or a target silent for 1.5
  /// heartbeats while the request is there) continues on another target from the tokens it
  /// streamed. Off: it ends with `disconnected` (within 2 heartbeats of a silent death).
  bool router_migration = true;
  int32_t router_max_migrations = 2;     ///< moves of one request; a loss beyond ends it with `disconnected`

  // --- batching
  int32_t prefill_chunk_tokens = 256;    ///< chunked prefill: tokens per forward step
  int32_t max_running_seqs = 32;         ///< decode continuous batch size
  int32_t max_prefill_batch_seqs = 8;

  // --- KV cache
  int32_t page_size = 16;                ///< tokens per KV page
  int32_t device_pages = 0;              ///< 0 = derive from kv_cache_mb
  int32_t kv_cache_mb = 256;
  bool prefix_cache = true;

  // --- requests
  int32_t max_context = 0;               ///< 0 = the model's context length
  int32_t max_new_tokens = 4096;
  /// Choices of one request (OpenAI's n): its forks share the prompt's KV pages at decode and
  /// take a batch slot each (also bounded by max_running_seqs).
  int32_t max_choices = 8;
  /// Bytes of a request's response_format JSON schema (compiled by every worker that samples it).
  int32_t max_grammar_bytes = 65536;
  /// A request naming a model this server does not serve is answered (with the served model)
  /// instead of 404 model_not_found: for clients that hard-code a model name.
  bool accept_any_model_name = false;
  int64_t max_body_bytes = 4 << 20;      ///< HTTP request body
  int32_t max_rpc_connections = 256;     ///< open Cap'n Proto RPC connections; more are closed at accept
  int32_t http_header_timeout_ms = 15000;  ///< a request head must arrive within this (slowloris): 408 after
  /// Bytes of one HTTP request head (request line + headers); 431 beyond. At most 65536
  /// (kj-http's own head buffer is larger; ours answers first).
  int32_t http_max_head_bytes = 65536;
  /// Connections of one client address reading a request head at once; more are answered 429
  /// and closed, so a slowloris client cannot hold every connection.
  int32_t http_max_head_readers_per_client = 64;
  int32_t http_body_timeout_ms = 30000;    ///< a request body must arrive within this (408 after)
  /// Tokens of one SSE stream waiting while its client does not read (the socket is full):
  /// beyond this the request is aborted (its pages freed) and the stream closed without [DONE].
  int32_t http_stream_backlog_tokens = 1024;
  /// Kernel send buffer (SO_SNDBUF) of a streaming connection: the socket's share of a slow
  /// client's backlog (loopback autotuning would otherwise let it grow to megabytes).
  int32_t http_stream_socket_bytes = 65536;
  /// Tokens of one RPC stream waiting while its client's TokenSink does not take them (the
  /// stream's flow-control window is full): beyond this the request is aborted (its pages
  /// freed) and the sink gets done(error, overloaded).
  int32_t rpc_stream_backlog_tokens = 1024;
  /// Kernel send buffer (SO_SNDBUF) of an RPC connection. Cap'n Proto sizes a stream's flow
  /// window from it, so it bounds what a client that stopped reading holds in flight.
  int32_t rpc_socket_bytes = 262144;

  // --- KV transfers between nodes (transport/ucx/transfer_state.h)
  int32_t kv_transfer_max_live = 1024;   ///< live transfers of a node; more are refused (overloaded)
  /// Failed or cancelled transfers kept (their pages unwritable) until the peer confirms or a
  /// quarantine period ends; beyond this the peer's connection is closed.
  int32_t kv_transfer_max_quarantined = 1024;
  int32_t kv_transfer_max_early_descriptors = 256;  ///< page descriptors that arrived before their transfer

  // --- cache tier
  int32_t cache_max_background_copies = 8;  ///< backup batches in flight before backups are skipped

  // --- node control
  int32_t query_timeout_ms = 5000;       ///< stats / health / inspect / drain requests to a node's actors
  int32_t link_timeout_ms = 60000;       ///< how long a node's start waits for the other nodes

  // --- supervision
  int32_t supervisor_max_restarts = 3;   ///< restarts of a node's actors allowed per period; one more escalates
  int32_t supervisor_period_ms = 60000;  ///< the restart intensity's period

  // --- compute
  int32_t threads = 1;                   ///< kernel threads of the worker
  int32_t scheduler_threads = 2;         ///< CAF scheduler threads

  /// Empty if consistent, else a message naming the field, value and fix.
  std::string validate() const;
};

}  // namespace tandem
