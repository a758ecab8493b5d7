#include "kernels/grammar/sessions.h"

#include <fmt/format.h>

#include <algorithm>

#include "kernels/base/error.h"

namespace tandem::grammar {

namespace {
/// Drops the least recently used entry of `m` (O(size): only when a new entry arrives full).
template <typename Map>
void evict_oldest(Map& m) {
  auto oldest = std::min_element(m.begin(), m.end(),
                                 [](const auto& a, const auto& b) { return a.second.used < b.second.used; });
  if (oldest != m.end()) m.erase(oldest);
}
}  // namespace

grammar_sessions::grammar_sessions(std::shared_ptr<const token_trie> vocab, session_limits lim)
    : vocab_(std::move(vocab)), lim_(lim) {
  if (!vocab_) throw tandem::error("grammar_sessions: no vocabulary");
}

std::string grammar_sessions::key_of(const grammar_spec& spec) {
  return std::string(1, char(spec.kind)) + spec.source;
}

std::shared_ptr<automaton> grammar_sessions::automaton_for(const grammar_spec& spec) {
  const std::string key = key_of(spec);
  auto it = grammars_.find(key);
  if (it == grammars_.end()) {
    auto a = std::make_shared<automaton>(compile_grammar(spec, lim_.schema), vocab_, lim_.tables);
    ++stats_.compiles;
    if (grammars_.size() >= lim_.max_grammars) evict_oldest(grammars_);
    it = grammars_.emplace(key, grammar_entry{std::move(a), 0}).first;
  }
  it->second.used = ++clock_;
  return it->second.a;
}

void grammar_sessions::constrain(const std::string& id, const grammar_spec& spec, std::span<const int32_t> generated,
                                 std::span<float> logits) {
  ++stats_.steps;
  try {
    constrain_once(id, spec, generated, logits);
  } catch (const tandem::error& e) {
    if (e.kind() != error_kind::overloaded) throw;
    ++stats_.rebuilds;
    drop(key_of(spec));
    constrain_once(id, spec, generated, logits);
  }
}

void grammar_sessions::drop(const std::string& key) {
  grammars_.erase(key);
  for (auto it = seqs_.begin(); it != seqs_.end();) it = it->second.key == key ? seqs_.erase(it) : std::next(it);
}

void grammar_sessions::constrain_once(const std::string& id, const grammar_spec& spec,
                                      std::span<const int32_t> generated, std::span<float> logits) {
  const std::string key = key_of(spec);
  auto it = seqs_.find(id);
  const bool reuse = it != seqs_.end() && it->second.key == key && it->second.tokens.size() <= generated.size() &&
                     std::equal(it->second.tokens.begin(), it->second.tokens.end(), generated.begin());
  if (!reuse) {
    if (it != seqs_.end()) seqs_.erase(it);
    if (seqs_.size() >= lim_.max_seqs) evict_oldest(seqs_);
    seq_entry e;
    e.key = key;
    e.m = std::make_unique<matcher>(automaton_for(spec));
    it = seqs_.emplace(id, std::move(e)).first;
    if (!generated.empty()) ++stats_.replays;
  }
  seq_entry& e = it->second;
  e.used = ++clock_;
  for (size_t i = e.tokens.size(); i < generated.size(); ++i) {
    if (!reuse) ++stats_.replayed_tokens;
    if (!e.m->accept(generated[i])) {
      const int32_t t = generated[i];
      seqs_.erase(it);
      throw tandem::error(error_kind::failed,
                          fmt::format("request {}: generated token {} (index {}) breaks its response_format grammar", id,
                                      t, i));
    }
    e.tokens.push_back(generated[i]);
  }
  if (apply_mask(logits, e.m->mask()) == 0)
    throw tandem::error(error_kind::failed,
                        fmt::format("request {}: no token of the vocabulary continues its response_format grammar", id));
}

void grammar_sessions::accepted(const std::string& id, int32_t token) {
  auto it = seqs_.find(id);
  if (it == seqs_.end()) return;
  if (it->second.m->accept(token))
    it->second.tokens.push_back(token);
  else
    seqs_.erase(it);  // the next step replays (and reports) from its generated tokens
}

}  // namespace tandem::grammar
