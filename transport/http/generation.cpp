#include "transport/http/generation.h"

#include <chrono>
#include <cmath>
#include <random>
#include <utility>

#include <fmt/format.h>

namespace tandem::transport {

struct event_channel::shared {
  std::mutex m;
  std::deque<token_event> queue;
  size_t queued_tokens = 0;
  kj::Own<kj::CrossThreadPromiseFulfiller<void>> waiter;  ///< armed while next() waits
  size_t overflow_limit = 0;
  kj::Own<kj::CrossThreadPromiseFulfiller<void>> overflow;  ///< armed by overflow()
  bool closed = false;
};

event_channel::event_channel() : s_(std::make_shared<shared>()) {}

event_channel::~event_channel() { close(); }

event_callback event_channel::callback() const {
  return [s = s_](token_event ev) {
    kj::Own<kj::CrossThreadPromiseFulfiller<void>> w, o;
    {
      std::lock_guard<std::mutex> lock(s->m);
      if (s->closed) return;
      s->queued_tokens += std::max<size_t>(ev.tokens.size(), 1);
      s->queue.push_back(std::move(ev));
      w = kj::mv(s->waiter);
      if (s->overflow && s->queued_tokens > s->overflow_limit) o = kj::mv(s->overflow);
    }
    if (w) w->fulfill();
    if (o) o->fulfill();
  };
}

kj::Promise<std::vector<token_event>> event_channel::next() {
  auto take = [s = s_]() {
    std::lock_guard<std::mutex> lock(s->m);
    std::vector<token_event> out(std::make_move_iterator(s->queue.begin()), std::make_move_iterator(s->queue.end()));
    s->queue.clear();
    s->queued_tokens = 0;
    return out;
  };
  std::unique_lock<std::mutex> lock(s_->m);
  if (!s_->queue.empty()) {
    lock.unlock();
    return take();
  }
  auto paf = kj::newPromiseAndCrossThreadFulfiller<void>();
  s_->waiter = kj::mv(paf.fulfiller);
  lock.unlock();
  return paf.promise.then(kj::mv(take));
}

kj::Promise<void> event_channel::overflow(size_t limit) {
  std::lock_guard<std::mutex> lock(s_->m);
  if (s_->queued_tokens > limit) return kj::READY_NOW;
  auto paf = kj::newPromiseAndCrossThreadFulfiller<void>();
  s_->overflow = kj::mv(paf.fulfiller);
  s_->overflow_limit = limit;
  return kj::mv(paf.promise);
}

void event_channel::close() {
  kj::Own<kj::CrossThreadPromiseFulfiller<void>> w, o;
  std::lock_guard<std::mutex> lock(s_->m);
  s_->closed = true;
  s_->queue.clear();
  s_->queued_tokens = 0;
  w = kj::mv(s_->waiter);
  o = kj::mv(s_->overflow);
}

text_assembler::text_assembler(const tokenizer& tok, std::vector<std::string> stop) : dec_(tok) {
  for (auto& s : stop)
    if (!s.empty()) stop_.push_back(std::move(s));
}

std::string text_assembler::push(std::span<const int32_t> ids) {
  std::string out;
  for (int32_t id : ids) {
    if (stopped_) break;
    ++consumed_;
    pending_ += dec_.push(id);
    for (const auto& [rid, text] : rendered_)
      if (rid == id) pending_ += text;
    if (stop_.empty()) {
      out += pending_;
      pending_.clear();
      continue;
    }
    // Any match starts inside pending_: everything emitted was known not to start one.
    size_t best = std::string::npos;
    for (auto& s : stop_) best = std::min(best, pending_.find(s));
    if (best != std::string::npos) {
      out.append(pending_, 0, best);
      pending_.clear();
      stopped_ = true;
      break;
    }
    // Hold back the longest suffix that is a proper prefix of a stop string.
    size_t hold = 0;
    for (auto& s : stop_) {
      for (size_t k = std::min(s.size() - 1, pending_.size()); k > hold; --k) {
        if (pending_.compare(pending_.size() - k, k, s, 0, k) == 0) {
          hold = k;
          break;
        }
      }
    }
    out.append(pending_, 0, pending_.size() - hold);
    pending_.erase(0, pending_.size() - hold);
  }
  return out;
}

std::string text_assembler::finish() {
  if (stopped_) return "";
  pending_ += dec_.flush();
  // A stop string may still complete with the flushed bytes.
  size_t best = std::string::npos;
  for (auto& s : stop_) best = std::min(best, pending_.find(s));
  if (best != std::string::npos) {
    stopped_ = true;
    pending_.resize(best);
  }
  return std::exchange(pending_, {});
}

std::optional<param_error> check_params(const generation_params& p, size_t prompt_tokens,
                                        int32_t max_context, const limits& lim) {
  const auto& s = p.sampling;
  if (!std::isfinite(s.temperature) || s.temperature < 0.0f || s.temperature > 2.0f)
    return param_error{"temperature", fmt::format("temperature = {} is out of range; use 0 (greedy) to 2", s.temperature)};
  if (!std::isfinite(s.top_p) || s.top_p <= 0.0f || s.top_p > 1.0f)
    return param_error{"top_p", fmt::format("top_p = {} is out of range; use a value in (0, 1]", s.top_p)};
  if (s.top_k < 0)
    return param_error{"top_k", fmt::format("top_k = {} is out of range; use 0 (off) or a positive count", s.top_k)};
  if (p.max_tokens <= 0 || p.max_tokens > lim.max_new_tokens)
    return param_error{"max_tokens", fmt::format("max_tokens = {} is out of range; use 1 to {} (limits.max_new_tokens)",
                                                 p.max_tokens, lim.max_new_tokens)};
  if (p.stop.size() > max_stop_strings)
    return param_error{"stop", fmt::format("stop has {} strings; at most {} are allowed", p.stop.size(), max_stop_strings)};
  for (auto& st : p.stop)
    if (st.size() > max_stop_bytes)
      return param_error{"stop", fmt::format("a stop string is {} bytes long; at most {} are allowed", st.size(), max_stop_bytes)};
  if (prompt_tokens == 0) return param_error{"prompt", "prompt is empty; send at least one token"};
  if (static_cast<int64_t>(prompt_tokens) + p.max_tokens > max_context)
    return param_error{"max_tokens", fmt::format("prompt ({} tokens) + max_tokens ({}) = {} exceeds the model context of {} tokens; "
                                                 "shorten the prompt or lower max_tokens",
                                                 prompt_tokens, p.max_tokens, prompt_tokens + p.max_tokens, max_context)};
  return std::nullopt;
}

completion_request make_request(std::string id, std::vector<int32_t> prompt, const generation_params& p,
                                const tokenizer& tok, const limits& lim) {
  completion_request r;
  r.request_id = std::move(id);
  r.prompt = std::move(prompt);
  r.sampling = p.sampling;
  r.max_tokens = p.max_tokens;
  r.ignore_eos = p.ignore_eos;
  if (!p.ignore_eos && tok.eos_id() >= 0) r.stop_tokens.push_back(tok.eos_id());
  r.deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(lim.request_timeout_ms);
  return r;
}

std::string finish_reason_name(finish_reason r) {
  switch (r) {
    case finish_reason::stop: return "stop";
    case finish_reason::length: return "length";
    case finish_reason::abort: return "abort";
    case finish_reason::error: return "error";
    case finish_reason::none: break;
  }
  return "none";
}

request_ids::request_ids(std::string prefix) : prefix_(std::move(prefix)), salt_(std::random_device{}()) {}

std::string request_ids::next() { return fmt::format("{}-{:08x}{:08x}", prefix_, salt_, ++counter_); }

}  // namespace tandem::transport
