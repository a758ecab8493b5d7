@0xfc0037b7556face4;
# External RPC API of a node: generate (streaming to a client callback), abort, health, stats.
$import "/capnp/c++.capnp".namespace("tandem::api");

# Same kinds as tandem::error_kind: they tell the caller what to do next.
enum ErrorKind {
  failed @0;         # the request is bad or the operation broke: do not retry as is
  overloaded @1;     # a bound was hit: back off and retry later
  disconnected @2;   # a peer went away: reconnect / retry on another node
  unimplemented @3;  # the feature is not supported: do not retry
}

struct Error {
  kind @0 :ErrorKind;
  message @1 :Text;
}

struct SamplingParams {
  temperature @0 :Float32 = 1.0;  # 0 = greedy
  topK @1 :Int32 = 0;             # 0 = off
  topP @2 :Float32 = 1.0;         # 1 = off
  seed @3 :UInt64 = 0;
}

struct GenerateRequest {
  prompt :union {
    text @0 :Text;              # the server tokenizes (BOS added)
    tokens @1 :List(Int32);     # used as is
  }
  sampling @2 :SamplingParams;
  maxTokens @3 :Int32 = 16;
  stop @4 :List(Text);          # stop strings, matched in the detokenized text and trimmed
  ignoreEos @5 :Bool = false;
  # Log-probabilities of each generated token (TokenSink.tokens' logprobs), as the HTTP API's
  # chat `logprobs` / `top_logprobs`: topLogprobs (0 to 20) alternatives, most likely first;
  # topLogprobs > 0 needs logprobs. docs/api.md says which distribution they come from.
  logprobs @6 :Bool = false;
  topLogprobs @7 :Int32 = 0;
}

struct LogprobEntry {
  token @0 :Int32;
  logprob @1 :Float32;   # natural log; -inf when it underflows
}

struct TokenLogprobs {
  token @0 :Int32;       # the generated token
  logprob @1 :Float32;
  top @2 :List(LogprobEntry);  # the request's topLogprobs most likely tokens
}

enum FinishReason {
  none @0;
  stop @1;    # EOS, a stop token or a stop string
  length @2;  # maxTokens reached
  abort @3;   # aborted by the client
  error @4;   # see Done.error
}

struct Usage {
  promptTokens @0 :Int32;
  completionTokens @1 :Int32;
  cachedTokens @2 :Int32;
}

# The client's callback object; the node calls it as tokens are produced.
interface TokenSink {
  # New tokens and the text that became complete with them (valid UTF-8, may be empty).
  # With GenerateRequest.logprobs, `logprobs` has one entry per id, in the same order.
  tokens @0 (ids :List(Int32), text :Text, logprobs :List(TokenLogprobs)) -> stream;
  # Exactly one call ends every accepted request; `error` is set iff reason == error.
  done @1 (reason :FinishReason, usage :Usage, error :Error) -> ();
}

struct Health {
  ok @0 :Bool;
  status @1 :Text;
  uptimeMs @2 :Int64;
  modelId @3 :Text;
  maxContext @4 :Int32;
  # Readiness (GET /health/ready): alive and able to serve; readyStatus says why not.
  ready @5 :Bool;
  readyStatus @6 :Text;
}

struct Stats {
  requestsTotal @0 :Int64;
  requestsRunning @1 :Int64;
  requestsQueued @2 :Int64;
  tokensGenerated @3 :Int64;
  kvPagesTotal @4 :Int64;
  kvPagesFree @5 :Int64;
  rejectedOverloaded @6 :Int64;
}

interface Node {
  # Validates and submits; returns at once with the request id. Invalid requests throw a
  # `failed` exception with a message naming the parameter. Every accepted request ends with
  # exactly one sink.done() call.
  generate @0 (request :GenerateRequest, sink :TokenSink) -> (requestId :Text);
  # Best effort: the request ends with reason `abort`.
  abort @1 (requestId :Text) -> ();
  health @2 () -> (health :Health);
  stats @3 () -> (stats :Stats);
}
