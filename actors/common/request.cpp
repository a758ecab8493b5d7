#include "actors/common/request.h"

#include <algorithm>

#include "actors/common/logprobs_wire.h"

namespace tandem {

sampling_params read_sampling(schema::SamplingParams::Reader sp) {
  sampling_params p;
  p.temperature = sp.getTemperature();
  p.top_k = sp.getTopK();
  p.top_p = sp.getTopP();
  p.seed = sp.getSeed();
  p.presence_penalty = sp.getPresencePenalty();
  p.frequency_penalty = sp.getFrequencyPenalty();
  p.repetition_penalty = sp.getRepetitionPenalty();
  p.min_p = sp.getMinP();
  auto lb = sp.getLogitBias();
  p.logit_bias.reserve(lb.size());
  for (auto e : lb) p.logit_bias.emplace_back(e.getToken(), e.getBias());
  if (sp.hasGrammar()) {
    auto g = sp.getGrammar();
    p.grammar.kind = grammar_kind(g.getKind());  // an unknown kind fails at the worker's compile
    p.grammar.source = g.getSource().cStr();
  }
  return p;
}

void write_sampling(schema::SamplingParams::Builder sp, const sampling_params& p) {
  sp.setTemperature(p.temperature);
  sp.setTopK(p.top_k);
  sp.setTopP(p.top_p);
  sp.setSeed(p.seed);
  sp.setPresencePenalty(p.presence_penalty);
  sp.setFrequencyPenalty(p.frequency_penalty);
  sp.setRepetitionPenalty(p.repetition_penalty);
  sp.setMinP(p.min_p);
  if (!p.logit_bias.empty()) {
    auto lb = sp.initLogitBias(static_cast<unsigned>(p.logit_bias.size()));
    for (unsigned i = 0; i < lb.size(); ++i) {
      lb[i].setToken(p.logit_bias[i].first);
      lb[i].setBias(p.logit_bias[i].second);
    }
  }
  if (p.grammar.active()) {
    auto g = sp.initGrammar();
    g.setKind(uint8_t(p.grammar.kind));
    g.setSource(p.grammar.source);
  }
}

void write_step_sampling(schema::SeqStep::Builder st, const seq_request& r) {
  write_sampling(st.initSampling(), r.sampling);
  const auto& p = r.sampling;
  if (p.repetition_penalty != 1.0f) fill_list([&](unsigned n) { return st.initPenaltyPrompt(n); }, r.prompt);
  if (p.repetition_penalty != 1.0f || p.presence_penalty != 0.0f || p.frequency_penalty != 0.0f || p.grammar.active())
    fill_list([&](unsigned n) { return st.initPenaltyGenerated(n); }, r.generated);
  st.setTokenIndex(static_cast<int32_t>(r.generated.size()));
  st.setLogprobs(r.logprobs);
}

seq_request seq_request::read(schema::SubmitRequest::Reader r) {
  seq_request s;
  s.id = r.getId().cStr();
  s.prompt = to_vector(r.getPrompt());
  s.generated = to_vector(r.getGenerated());
  s.stop_tokens = to_vector(r.getStopTokens());
  s.sampling = read_sampling(r.getSampling());
  s.max_tokens = r.getMaxTokens();
  s.ignore_eos = r.getIgnoreEos();
  s.deadline_ms = r.getDeadlineMs();
  s.admit_order = r.getAdmitOrder();
  s.cached_tokens = r.getCachedTokens();
  s.transfer_retries = r.getTransferRetries();
  s.decode_target = r.getDecodeTarget().cStr();
  s.logprobs = r.getLogprobs();
  s.n = std::max(1, r.getN());
  s.choice = r.getChoice();
  s.fork_only = r.getForkOnly();
  return s;
}

void seq_request::write(schema::SubmitRequest::Builder b) const {
  b.setId(id);
  fill_list([&](unsigned n) { return b.initPrompt(n); }, prompt);
  fill_list([&](unsigned n) { return b.initGenerated(n); }, generated);
  fill_list([&](unsigned n) { return b.initStopTokens(n); }, stop_tokens);
  write_sampling(b.initSampling(), sampling);
  b.setMaxTokens(max_tokens);
  b.setIgnoreEos(ignore_eos);
  b.setDeadlineMs(deadline_ms);
  b.setAdmitOrder(admit_order);
  b.setCachedTokens(cached_tokens);
  b.setTransferRetries(transfer_retries);
  if (!decode_target.empty()) b.setDecodeTarget(decode_target);
  b.setLogprobs(logprobs);
  b.setN(n);
  b.setChoice(choice);
  b.setForkOnly(fork_only);
}

std::vector<int32_t> seq_request::all_tokens() const {
  std::vector<int32_t> t = prompt;
  t.insert(t.end(), generated.begin(), generated.end());
  return t;
}

finish_reason apply_token(seq_request& r, int32_t token, const model_facts& m) {
  if (std::find(r.stop_tokens.begin(), r.stop_tokens.end(), token) != r.stop_tokens.end())
    return finish_reason::stop;
  if (!r.ignore_eos && m.eos_id >= 0 && token == m.eos_id) return finish_reason::stop;
  r.generated.push_back(token);
  if (static_cast<int32_t>(r.generated.size()) >= r.max_tokens) return finish_reason::length;
  if (m.max_context > 0 && r.total_len() >= m.max_context) return finish_reason::length;
  return finish_reason::none;
}

schema::FinishReason to_schema(finish_reason r) {
  switch (r) {
    case finish_reason::none:
      return schema::FinishReason::NONE;
    case finish_reason::stop:
      return schema::FinishReason::STOP;
    case finish_reason::length:
      return schema::FinishReason::LENGTH;
    case finish_reason::abort:
      return schema::FinishReason::ABORT;
    case finish_reason::error:
      return schema::FinishReason::ERROR;
  }
  return schema::FinishReason::NONE;
}

finish_reason from_schema(schema::FinishReason r) {
  switch (r) {
    case schema::FinishReason::NONE:
      return finish_reason::none;
    case schema::FinishReason::STOP:
      return finish_reason::stop;
    case schema::FinishReason::LENGTH:
      return finish_reason::length;
    case schema::FinishReason::ABORT:
      return finish_reason::abort;
    case schema::FinishReason::ERROR:
      return finish_reason::error;
  }
  return finish_reason::none;
}

const char* to_string(request_stage s) {
  switch (s) {
    case request_stage::queued: return "queued";
    case request_stage::prefill: return "prefill";
    case request_stage::decode: return "decode";
    case request_stage::preempted: return "preempted";
    case request_stage::refused: return "refused";
    case request_stage::retrying: return "retrying";
  }
  return "queued";
}

schema::RequestStage to_schema(request_stage s) { return static_cast<schema::RequestStage>(static_cast<uint16_t>(s)); }

request_stage from_schema(schema::RequestStage s) {
  const auto v = static_cast<uint16_t>(s);
  return v <= static_cast<uint16_t>(request_stage::retrying) ? static_cast<request_stage>(v) : request_stage::queued;
}

role_wire<router_role, msg::event> make_event(const std::string& id, const std::vector<int32_t>& tokens,
                                              finish_reason reason, const tandem::error* err, int32_t prompt_tokens,
                                              int32_t cached_tokens, request_stage state, int32_t first_index,
                                              std::span<const token_logprobs> logprobs, int32_t choice) {
  return role_wire<router_role, msg::event>::make([&](schema::TokenEvent::Builder e) {
    e.setId(id);
    fill_list([&](unsigned n) { return e.initTokens(n); }, tokens);
    e.setFinished(reason != finish_reason::none);
    e.setReason(to_schema(reason));
    if (err) set_error(e.initError(), *err);
    e.setPromptTokens(prompt_tokens);
    e.setCachedTokens(cached_tokens);
    e.setState(to_schema(state));
    e.setFirstIndex(first_index);
    write_logprobs([&](unsigned n) { return e.initLogprobs(n); }, logprobs);
    e.setChoice(choice);
  });
}

}  // namespace tandem
