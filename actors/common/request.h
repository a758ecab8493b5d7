#pragma once
/// A request as the schedulers keep it, with its conversion to and from the wire, and the
/// stop rules shared by the prefill (first token) and the decode (every later token).
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "actors/common/protocol.h"
#include "actors/common/wire.h"
#include "actors/runtime/serving_api.h"
#include "kernels/model/logprobs.h"
#include "kernels/model/sampler.h"

namespace tandem {

struct seq_request {
  std::string id;
  std::vector<int32_t> prompt;
  std::vector<int32_t> generated;  ///< tokens already produced (and emitted)
  std::vector<int32_t> stop_tokens;
  sampling_params sampling;
  int32_t max_tokens = 16;
  bool ignore_eos = false;
  int64_t deadline_ms = 0;
  uint64_t admit_order = 0;
  int32_t cached_tokens = 0;
  int32_t transfer_retries = 0;  ///< re-prefills after failed KV transfers
  std::string decode_target;  ///< the router's choice of decode target ("" = the prefill's own)
  int32_t logprobs = -1;      ///< top log-probabilities per sampled token (-1 = none; 0 = the token's own)
  int32_t n = 1;              ///< choices: the decode side forks the sequence into n (decode_fork.cpp)
  int32_t choice = 0;         ///< a fork's choice index
  bool fork_only = false;     ///< n > 1 and choice 0 ended at the prefill: only its forks go on

  static seq_request read(schema::SubmitRequest::Reader r);
  void write(schema::SubmitRequest::Builder b) const;
  /// prompt ++ generated
  std::vector<int32_t> all_tokens() const;
  int32_t total_len() const { return static_cast<int32_t>(prompt.size() + generated.size()); }
};

/// What the stop rules need to know about the model.
/// The sampling parameters on the wire (router -> schedulers -> worker), both ways.
sampling_params read_sampling(schema::SamplingParams::Reader sp);
void write_sampling(schema::SamplingParams::Builder sp, const sampling_params& p);
/// A forward step's sampling, token index and the history its penalties need (empty lists
/// unless they are set).
void write_step_sampling(schema::SeqStep::Builder st, const seq_request& r);

struct model_facts {
  int32_t eos_id = -1;
  int32_t max_context = 0;
  int32_t n_vocab = 0;
};

/// Applies a newly sampled token: appends it unless it is a stop token (stop tokens and EOS
/// end the request and are not part of the completion). Returns the finish reason, or
/// finish_reason::none if the request continues.
finish_reason apply_token(seq_request& r, int32_t token, const model_facts& m);

/// Where a request is (schema RequestStage); the router keeps it per in-flight request.
enum class request_stage : uint8_t { queued, prefill, decode, preempted, refused, retrying };
/// "queued", "prefill", ... (the in-flight table of `tandem inspect`).
const char* to_string(request_stage s);
schema::RequestStage to_schema(request_stage s);
request_stage from_schema(schema::RequestStage s);

/// A TokenEvent to the router. `first_index`: index in the completion of tokens[0], i.e. how many
/// tokens the request generated before these (r.generated.size() - tokens.size()).
/// `logprobs`: parallel to `tokens` when the request asked for them.
role_wire<router_role, msg::event> make_event(const std::string& id, const std::vector<int32_t>& tokens,
                                              finish_reason reason, const tandem::error* err, int32_t prompt_tokens,
                                              int32_t cached_tokens, request_stage state, int32_t first_index,
                                              std::span<const token_logprobs> logprobs = {}, int32_t choice = 0);

schema::FinishReason to_schema(finish_reason r);
finish_reason from_schema(schema::FinishReason r);

}  // namespace tandem
