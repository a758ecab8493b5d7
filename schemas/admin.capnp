@0x8e801311fb5551e4;
# Admin interface of a node (its admin_port): what `tandem inspect` shows.
using Cxx = import "/capnp/c++.capnp";
$Cxx.namespace("tandem::admin");

struct ActorInfo {
  name @0 :Text;             # the role: router, prefill, decode, worker, cache_tier
  state @1 :Text;            # running, not answering, escalated
  mailboxDepth @2 :Int32;
  mailboxBound @3 :Int32;
  messagesHandled @4 :Int64;
  mailboxRejected @5 :Int64;
  restarts @6 :Int64;        # restarts of the node's actors after this one failed
  lastError @7 :Text;        # cause of its last failure; empty if none
}

struct RequestInfo {
  id @0 :Text;
  state @1 :Text;            # queued, prefill, decode, ...
  ageMs @2 :Int64;
  promptTokens @3 :Int32;
  completionTokens @4 :Int32;
}

struct PoolInfo {
  name @0 :Text;             # device (host and disk tiers join with the cache tier)
  pagesTotal @1 :Int64;
  pagesFree @2 :Int64;
  pagesCached @3 :Int64;
  pagesEvictable @4 :Int64;
  bytes @5 :Int64;
}

struct NodeReport {
  node @0 :Text;
  modelId @1 :Text;
  healthy @2 :Bool;
  status @3 :Text;
  uptimeMs @4 :Int64;
  actors @5 :List(ActorInfo);
  requests @6 :List(RequestInfo);
  pools @7 :List(PoolInfo);
  # Readiness: healthy and able to serve (a router node has a live target of every role).
  # Healthy but not ready is shown as "degraded" with readyStatus as the reason.
  ready @8 :Bool;
  readyStatus @9 :Text;
  # Drain (`tandem inspect --drain`): "" serving, "draining" (no new work; finishing what it
  # holds) or "drained" (holds nothing and no router routes here: safe to stop).
  drain @10 :Text;
}

interface Admin {
  # A snapshot of the node; `maxRequests` bounds the in-flight list (oldest first).
  inspect @0 (maxRequests :Int32 = 1000) -> (report :NodeReport, requestsOmitted :Int32);
  # Drain (`on`) or undrain the node; the report after the change.
  drain @1 (on :Bool) -> (report :NodeReport);
}
