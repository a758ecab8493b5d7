@0xf38861b72eb303ba;
# Messages between actors (router, schedulers, worker, cache tier). Every actor message is
# one of these structs, serialized; the same bytes cross nodes later.
# Every actor message is an `Envelope` (a union of the per-role protocols at the end of this
# file), carried as bytes in `tandem::wire`.
$import "/capnp/c++.capnp".namespace("tandem::schema");

enum ErrorKind {
  failed @0;
  overloaded @1;
  disconnected @2;
  unimplemented @3;
}

struct Error {
  kind @0 :ErrorKind;
  message @1 :Text;
}

struct SamplingParams {
  temperature @0 :Float32 = 1.0;
  topK @1 :Int32 = 0;
  topP @2 :Float32 = 1.0;
  seed @3 :UInt64 = 0;
  presencePenalty @4 :Float32 = 0.0;    # OpenAI's, over the generated tokens
  frequencyPenalty @5 :Float32 = 0.0;
  repetitionPenalty @6 :Float32 = 1.0;  # HF/llama.cpp's, over prompt + generated
  minP @7 :Float32 = 0.0;
  logitBias @8 :List(LogitBias);
  # What the output must match (response_format, tool calls): each worker compiles it and
  # masks every step (kernels/grammar); steps then carry penaltyGenerated to replay the state.
  grammar @9 :GrammarSpec;
}

struct GrammarSpec {
  kind @0 :UInt8;             # tandem::grammar_kind: 0 none, 1 json_object, 2 json_schema
  source @1 :Text;            # the JSON schema for json_schema
}

struct LogitBias {
  token @0 :Int32;
  bias @1 :Float32;
}

# A request accepted by the router, on its way to (or back to) the prefill scheduler.
struct SubmitRequest {
  id @0 :Text;
  prompt @1 :List(Int32);
  sampling @2 :SamplingParams;
  maxTokens @3 :Int32;
  stopTokens @4 :List(Int32);
  ignoreEos @5 :Bool;
  deadlineMs @6 :Int64;       # absolute, on the cluster clock
  # Preempted sequences come back for recompute with the tokens they already produced
  # (all emitted); the prefill runs prompt ++ generated and samples token index |generated|.
  generated @7 :List(Int32);
  admitOrder @8 :UInt64;      # arrival order (kept across preemption: "youngest" = largest)
  cachedTokens @9 :Int32;     # prompt tokens served from the prefix cache at first prefill
  transferRetries @10 :Int32; # re-prefills after failed KV transfers (bounds the recompute policy)
  decodeTarget @11 :Text;     # the decode target the router paired with the prefill ("" = the prefill's own)
  logprobs @12 :Int32 = -1;   # log-probabilities per sampled token with this many top entries; -1 = none
  # `n` choices (OpenAI's n): one prefill; the decode side forks the sequence into n once it
  # has the prompt's KV and the first token (actors/decode_scheduler/decode_fork.cpp).
  n @13 :Int32 = 1;
  choice @14 :Int32;          # a fork's choice index (0 = the sequence the prefill handed off)
  # n > 1 and choice 0 ended at its first token (the prefill reported its end): the decode side
  # makes forks 1..n-1 from the handed-off KV and frees the sequence itself.
  forkOnly @15 :Bool;
}

# Where KV pages live; a cross-node version ships pages between pools using these fields.
# The same struct travels in handoffs and in the UCX handshake (KvHello), so both sides of a
# transfer compare one description.
struct KvLayout {
  nLayers @0 :Int32;
  nKvHeads @1 :Int32;
  headDim @2 :Int32;
  pageSize @3 :Int32;
  dtype @4 :KvDtype;          # element type of K and V (kv_layout::dtype)
  # What a page holds per layer, in order; empty = the standard K and V of nKvHeads x headDim
  # in dtype. An MLA model has one "latent" component (kv_lora_rank + rope dims per token).
  components @5 :List(KvComponent);
  # A layout of several pools (kernels/model/kv_pools.h, e.g. gemma2's full-context pool and
  # its sliding-window pool): every pool, pool 0 first (whose page the fields above repeat).
  # Empty = one full pool of every layer with the page above.
  pools @6 :List(KvPoolSpec);
}

# One pool of a layout set (kv_pool_spec).
struct KvPoolSpec {
  name @0 :Text;              # "full", "window"
  page @1 :KvLayout;          # its page geometry (no nested pools)
  windowTokens @2 :Int32;     # 0 = full context; W = a token reads only the last W positions
  layers @3 :List(Int32);     # the model layers it holds, ascending
}

# The pages of one pool other than pool 0, indexed by block; -1 = a window block released
# (never read again). Messages that carry pages keep pool 0 in their `pages` list and the other
# pools, in order, in `extraPools` (empty for a one-pool layout).
struct PoolPages {
  pages @0 :List(Int32);
}

struct KvComponent {
  name @0 :Text;
  nHeads @1 :Int32;
  headDim @2 :Int32;
  elemBytes @3 :Int32;
}

# The UCX KV handshake (transport/ucx/kv_handshake.h, kv_auth.h), each message after its magic
# and version words: KvChallenge both ways, then KvProof both ways, then (each side once it has
# checked the peer's proof) KvHello. No rkey or pool address travels before the proof passed.
struct KvChallenge {
  node @0 :Text;
  nonce @1 :Data;             # 32 random bytes the peer must MAC
}

struct KvProof {
  mac @0 :Data;               # HMAC-SHA256 under the cluster secret; empty = no secret
}

# Who the peer is, the layout of its pool, and where and how to write into it.
struct KvHello {
  node @0 :Text;
  model @1 :Text;
  layout @2 :KvLayout;
  poolBase @3 :UInt64;        # remote virtual address of page 0
  nPages @4 :Int32;
  rkey @5 :Data;              # packed remote key of the pool registration
  workerAddress @6 :Data;     # the peer dials it for a data endpoint
  extraPools @7 :List(KvPoolRegion);  # pools 1.. of the layout set (pool 0 is the fields above)
}

# Where a peer writes one more pool of a layout set.
struct KvPoolRegion {
  poolBase @0 :UInt64;
  nPages @1 :Int32;
  rkey @2 :Data;
}

enum KvDtype {
  f32 @0;
  f16 @1;
}

struct PageDescriptor {
  poolId @0 :Text;            # which pool holds the pages ("node/worker")
  node @1 :Text;
  pageIds @2 :List(Int32);
  layout @3 :KvLayout;
  validTokens @4 :Int32;      # positions [0, validTokens) hold KV
  extraPools @5 :List(PoolPages);
}

# Prefill -> decode: the sequence with its KV pages (ownership of the page refs moves).
struct KvHandoff {
  request @0 :SubmitRequest;  # generated includes the first token sampled by the prefill
  kv @1 :PageDescriptor;
  # Non-zero when the pages live in another node's pool: the decode side allocates its own
  # pages and pulls the KV with this transfer id (actors/worker/kv_port.h).
  transferId @2 :UInt64;
  handoffSeq @3 :UInt64;      # unique per sending prefill (kv.node): a link's late copy of a
                              # handoff already taken is recognized and ignored by the decode
}

# Scheduler -> its worker: drive a KV page transfer with a peer node's worker
# (actors/worker/worker_kv.h).
# kvSend (prefill): write `pages` to the destination `peerNode` once it sends descriptors; the
#   pages are the worker's from then on (it frees them when the send ends).
# kvReceive (decode): receive into `pages` (allocated here) from the source `peerNode`.
# kvAbort (either): stop the live transfers of request `id` (only `transferId` unless it is 0).
struct KvTransferOrder {
  transferId @0 :UInt64;
  id @1 :Text;                # request id
  peerNode @2 :Text;
  pages @3 :List(Int32);
  extraPools @4 :List(PoolPages);
}

# Worker -> decode scheduler: the receive ended, arrived or failed (`error` says why); `pages`
# are the caller's again (exactly once).
struct KvTransferDone {
  transferId @0 :UInt64;
  id @1 :Text;
  delivered @2 :Bool;         # destination: the KV is in the pages; source: it was written out
  pages @3 :List(Int32);
  error @4 :Text;             # why it failed (empty when delivered)
  extraPools @5 :List(PoolPages);
}

# One sequence of a forward batch (prefill chunk or decode step).
struct SeqStep {
  id @0 :Text;
  tokens @1 :List(Int32);     # new tokens
  pos @2 :Int32;              # position of tokens[0]
  pages @3 :List(Int32);      # page table covering [0, pos + |tokens|)
  sample @4 :Bool;            # sample a token from the last new token's logits
  sampling @5 :SamplingParams;
  tokenIndex @6 :Int32;       # index of the sampled token in the completion (seeds the sampler)
  # What the penalties look at (empty unless the sampling sets them): the prompt (for
  # repetitionPenalty only) and the tokens generated so far. Bounded by the context.
  penaltyPrompt @7 :List(Int32);
  penaltyGenerated @8 :List(Int32);
  logprobs @9 :Int32 = -1;    # return the sampled token's log-probability and this many top ones; -1 = none
  extraPools @10 :List(PoolPages);  # page tables of pools 1.. (window pools: -1 before the window)
}

# Scheduler -> worker; the reply is a ForwardResult.
struct ForwardBatch {
  seqs @0 :List(SeqStep);
  phase @1 :StageRole;        # for logs and metrics
}

struct ForwardResult {
  tokens @0 :List(Int32);     # one per seq, -1 where sample was false
  error @1 :Error;            # set when `failed` is true
  failed @2 :Bool;
  elapsedUs @3 :Int64;
  logprobs @4 :List(TokenLogprobs);  # one per seq when any seq asked (token -1 where it did not); else empty
}

# A sampled token's log-probability and the most likely alternatives (kernels/model/logprobs.h).
struct TokenLogprobs {
  token @0 :Int32;
  logprob @1 :Float32;
  topTokens @2 :List(Int32);     # most likely first
  topLogprobs @3 :List(Float32);
}

# Compatibility names of the design: a prefill batch is a ForwardBatch of prefill chunks.
using PrefillBatch = ForwardBatch;
using PrefillResult = ForwardResult;
using DecodeStep = ForwardBatch;

enum FinishReason {
  none @0;
  stop @1;
  length @2;
  abort @3;
  error @4;
}

# The two scheduling stages (a credit's sender, a forward batch's phase).
enum StageRole {
  prefill @0;
  decode @1;
}

# Where a request is (the router's in-flight table; `tandem inspect` shows its name).
enum RequestStage {
  queued @0;     # at the router, or waiting in a prefill queue
  prefill @1;
  decode @2;
  preempted @3;  # decode gave it back for recompute (its pages were needed)
  refused @4;    # a handoff the decode side refused
  retrying @5;   # router-internal: between targets after a refusal
}

# Stage -> router: new tokens of a request and, at most once, its end.
struct TokenEvent {
  id @0 :Text;
  tokens @1 :List(Int32);
  finished @2 :Bool;
  reason @3 :FinishReason;
  error @4 :Error;            # meaningful iff reason == error
  promptTokens @5 :Int32;
  cachedTokens @6 :Int32;
  state @7 :RequestStage;     # where the request is now
  firstIndex @8 :Int32;       # index in the completion of tokens[0] (tokens generated before
                              # this event): the router orders the events of different stages
                              # (links), drops duplicates and holds back after a gap
  logprobs @9 :List(TokenLogprobs);  # parallel to tokens when the request asked for them
  choice @10 :Int32;          # which of the request's n choices (SubmitRequest.n) these tokens belong to
}

# Router -> prefill -> decode (-> prefill ...): drop the request and free its pages.
# It follows the request between stages; `hops` bounds the chase.
struct Abort {
  id @0 :Text;
  hops @1 :Int32;
  # The front end ended the request because its text reached a stop string: it finishes (and
  # is counted in tandem_requests_finished_total) as `stop`, not `abort`.
  stopString @2 :Bool;
  # Only this choice of an n > 1 request (its stop string matched); -1 = the whole request.
  choice @3 :Int32 = -1;
}

# Cache tier: pages for a prompt (longest cached prefix + fresh pages for the rest).
struct AcquireRequest {
  id @0 :Text;
  tokens @1 :List(Int32);
  usePrefixCache @2 :Bool;
}

struct AcquireReply {
  id @0 :Text;
  ok @1 :Bool;
  pages @2 :List(Int32);      # covering every token; the first cachedTokens/pageSize are shared
  cachedTokens @3 :Int32;
  error @4 :Error;
  retryable @5 :Bool;         # the pool could fit it once other requests free pages
  extraPools @6 :List(PoolPages);
}

struct AllocRequest {
  id @0 :Text;
  count @1 :Int32;
  extraCounts @2 :List(Int32);  # pages of pools 1.. (empty: none)
  # A sequence forks (decode, n > 1): one more reference on each page of `holds` (pool 0) and
  # `extraHolds` (pools 1..), which the fork shares; the k-th page allocated in a pool becomes a
  # copy of the k-th page of `copyFrom` / `extraCopyFrom` of that pool, made by the worker
  # before the reply (copy-on-write of the block the fork writes first).
  holds @3 :List(Int32);
  extraHolds @4 :List(PoolPages);
  copyFrom @5 :List(Int32);
  extraCopyFrom @6 :List(PoolPages);
}

struct AllocReply {
  ok @0 :Bool;
  pages @1 :List(Int32);
  error @2 :Error;
  free @3 :Int32;  # pages an allocation can have now: the free list plus evictable cached pages
  total @4 :Int32; # pages in the pool (0 = not reported)
  extraPools @5 :List(PoolPages);
  extraFree @6 :List(Int32);   # `free` of pools 1..
}

struct FreePages {
  id @0 :Text;
  pages @1 :List(Int32);
  extraPools @2 :List(PoolPages);  # -1 entries are skipped
}

# Caches the full pages of `tokens` (the cache takes its own reference).
struct InsertPrefix {
  id @0 :Text;
  tokens @1 :List(Int32);
  pages @2 :List(Int32);
  extraPools @3 :List(PoolPages);
}

# Cache tier -> worker: page copies between the tiers of the hierarchical KV cache. The worker
# owns the memory of the device pool (L1) and the host pool (L2) and the files of the disk
# tier (L3); the cache tier owns the bookkeeping and asks for copies. Ops run in order.
enum CacheOpKind {
  deviceToHost @0;   # backup (write-through) or write-back on L1 eviction
  hostToDevice @1;   # load-back of an L2 hit
  hostToDisk @2;     # L3 write (write-through, or write-back on L2 eviction)
  diskToHost @3;     # L3 hit: read, verify the checksum, place in a host page
  dropDisk @4;       # L3 eviction: delete the file
  deviceToDevice @5; # a fork's copy-on-write: device page `device` into device page `deviceTo`
}

struct CacheOp {
  kind @0 :CacheOpKind;
  device @1 :Int32;           # device page (deviceToHost, hostToDevice)
  host @2 :Int32;             # host page (all but dropDisk)
  hash @3 :UInt64;            # chain hash of the prefix ending with this page: names the file
  parent @4 :UInt64;          # chain hash of the prefix before it (stored, checked on read)
  tokens @5 :List(Int32);     # the page's tokens (stored, checked on read)
  pool @6 :Int32;             # which pool of the layout set the pages belong to (0 = the first)
  deviceTo @7 :Int32;         # deviceToDevice: the destination page
}

struct CacheCopy {
  id @0 :Text;                # what asked (request id or "backup")
  ops @1 :List(CacheOp);
}

struct CacheCopyReply {
  failed @0 :List(UInt32);    # indices of ops that failed (bad checksum, missing file, I/O error)
  error @1 :Text;             # the first failure, for the log
  bytes @2 :UInt64;           # bytes copied
  elapsedUs @3 :Int64;
}

struct Metric {
  name @0 :Text;              # without the tandem_ prefix
  labels @1 :Text;            # `reason="x"` or empty
  value @2 :Float64;
  kind @3 :Text;              # "counter" or "gauge"
  help @4 :Text;
}

struct Histogram {
  name @0 :Text;
  help @1 :Text;
  bounds @2 :List(Float64);   # upper bounds, +Inf implied
  counts @3 :List(UInt64);    # per bucket (not cumulative), |bounds| + 1
  sum @4 :Float64;
  count @5 :UInt64;
}

struct StatsQuery {
  from @0 :Text;
  # As a creditQuery to a draining target: the requests the router still has there, once it
  # saw the target's draining credit (-1: it has not). 0 lets the target report drained.
  holds @1 :Int32 = -1;
}

struct StatsReply {
  actor @0 :Text;
  metrics @1 :List(Metric);
  histograms @2 :List(Histogram);
}

# Scheduler -> router: what the scheduler can still take (sent when it changes, and as the
# answer to a CreditQuery, the router's heartbeat). The router admits against it before it
# sends work, so it can refuse what the target could not place.
struct Credit {
  target @0 :Text;            # "node/prefill" or "node/decode"
  role @1 :StageRole;
  seq @2 :UInt64;             # increases with every credit of the target
  received @3 :UInt64;        # prefill: submissions taken off its mailbox (admitted or refused); decode: handoffs taken from its own node's prefill
  queuedRequests @4 :Int32;   # prefill: requests waiting
  queuedTokens @5 :Int64;     # prefill: prompt tokens waiting (and being prefilled)
  freeRequests @6 :Int32;     # prefill: max_queued_requests - queuedRequests
  freeTokens @7 :Int64;       # prefill: max_queued_tokens - queuedTokens
  tokensPerS @8 :Float64;     # prefill: measured drain rate of the queue (0 = not measured yet)
  freePages @9 :Int32;        # decode: KV pages free or evictable at the last allocation (-1 = unknown)
  runningSeqs @10 :Int32;     # decode: sequences in the batch
  waitingSeqs @11 :Int32;     # decode: handed off, waiting for a batch slot
  maxRunningSeqs @12 :Int32;  # decode: limits.max_running_seqs
  activeTokens @13 :Int64;    # prefill: prompt tokens admitted past the queue and not computed yet
  draining @14 :Bool;         # the node is draining (tandem inspect --drain): route no new work here
  unreachable @15 :List(Text);  # prefill: decode targets ("node/decode") its node cannot reach now
}

# --- Per-role protocols (actors/common/protocol.h): each role's actor receives exactly the
# messages of its union; the table of which are work (may be refused, `overloaded`) and which
# are control is in actors/common/protocol.h. docs/architecture.md lists every message with
# sender and receiver (tests/actors/test_protocol_doc.cpp checks that it names each one).

# The router (actors/router).
struct RouterIn {
  union {
    submit @0 :SubmitRequest;     # front end -> router (local only, with the event callback)
    event @1 :TokenEvent;         # prefill/decode -> router
    credit @2 :Credit;            # prefill/decode -> router
    requeue @3 :SubmitRequest;    # decode -> router: recompute after preemption or a failed KV transfer
    abort @4 :Abort;              # front end -> router
  }
}

# The prefill scheduler (actors/prefill_scheduler).
struct PrefillIn {
  union {
    submit @0 :SubmitRequest;     # router -> prefill
    requeue @1 :SubmitRequest;    # router -> prefill (already admitted)
    abort @2 :Abort;              # router/decode -> prefill
    creditQuery @3 :StatsQuery;   # router -> prefill: send a Credit now (heartbeat)
    credit @4 :Credit;            # decode -> prefill (the decode scheduler sharing the worker)
  }
}

# The decode scheduler (actors/decode_scheduler).
struct DecodeIn {
  union {
    handoff @0 :KvHandoff;        # prefill -> decode
    submit @1 :SubmitRequest;     # router -> decode: prefill on the decode target (conditional disaggregation)
    abort @2 :Abort;              # router/prefill -> decode
    creditQuery @3 :StatsQuery;   # router -> decode
    kvDone @4 :KvTransferDone;    # worker -> decode: a KV receive ended
  }
}

# The worker (actors/worker).
struct WorkerIn {
  union {
    forward @0 :ForwardBatch;     # prefill/decode -> worker (call: ForwardResult)
    cacheCopy @1 :CacheCopy;      # cache tier -> worker (call: CacheCopyReply)
    kvSend @2 :KvTransferOrder;   # prefill -> worker: hand these pages to that node (the worker frees them)
    kvReceive @3 :KvTransferOrder;  # decode -> worker (answered with DecodeIn.kvDone)
    kvAbort @4 :KvTransferOrder;  # prefill/decode -> worker (id, and transferId unless 0, are read)
  }
}

# The cache tier (actors/cache_tier).
struct CacheTierIn {
  union {
    acquire @0 :AcquireRequest;   # prefill/decode -> cache tier (call: AcquireReply)
    alloc @1 :AllocRequest;       # decode -> cache tier (call: AllocReply)
    free @2 :FreePages;           # prefill/decode -> cache tier
    insert @3 :InsertPrefix;      # prefill/decode -> cache tier
  }
}

# The answer to a call (CAF request/response) or a stats query; never sent on its own.
struct Reply {
  union {
    error @0 :Error;              # the call failed before its handler answered
    forwardResult @1 :ForwardResult;
    acquireReply @2 :AcquireReply;
    allocReply @3 :AllocReply;
    cacheCopyReply @4 :CacheCopyReply;
    statsReply @5 :StatsReply;
  }
}

# Every actor message, framed by role: a remote link routes it by `which()` without reading
# the message. Protocol 2 (wireVersion): protocol 1 was one flat union of 24 messages.
const wireVersion :UInt32 = 2;

struct Envelope {
  union {
    router @0 :RouterIn;
    prefill @1 :PrefillIn;
    decode @2 :DecodeIn;
    worker @3 :WorkerIn;
    cacheTier @4 :CacheTierIn;
    reply @5 :Reply;
  }
  # wireVersion of the sender (make_wire sets it); a node's ingress refuses other versions.
  version @6 :UInt32;
}
