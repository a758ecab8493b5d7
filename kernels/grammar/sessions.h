#pragma once
/// A worker's grammar state: compiled automata cached by spec (bounded), and one matcher per
/// sequence keyed by request id (bounded, least recently used out first), each remembering
/// the tokens it advanced over, so a decode step advances over the one new token. A sequence
/// this worker has not seen (a decode node after a KV handoff, a recompute after preemption,
/// an evicted entry) replays its generated tokens: the state depends only on them.
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

#include "kernels/grammar/grammar_spec.h"
#include "kernels/grammar/json_schema.h"
#include "kernels/grammar/matcher.h"

namespace tandem::grammar {

struct session_limits {
  size_t max_grammars = 16;    ///< compiled automata kept (each bounded by `tables`)
  size_t max_seqs = 4096;      ///< per-sequence matchers kept
  schema_limits schema;
  automaton_limits tables;
};

class grammar_sessions {
 public:
  grammar_sessions(std::shared_ptr<const token_trie> vocab, session_limits lim = {});
  /// Sets the logits of the tokens `spec` does not allow after `generated` to -inf (EOS stays
  /// only when the output is complete). Throws tandem::error when the spec does not compile,
  /// `generated` breaks the grammar, or no token is allowed. An automaton whose stack table
  /// filled up (its interned stacks only grow) is dropped and rebuilt once: its sequences
  /// replay on the fresh one.
  void constrain(const std::string& id, const grammar_spec& spec, std::span<const int32_t> generated,
                 std::span<float> logits);
  /// The sequence sampled `token` (its next step's `generated` ends with it): advance now.
  void accepted(const std::string& id, int32_t token);
  /// The automaton of `spec` (compiled on first use).
  std::shared_ptr<automaton> automaton_for(const grammar_spec& spec);
  struct counters {
    int64_t compiles = 0, replays = 0, replayed_tokens = 0, steps = 0, rebuilds = 0;
  };
  const counters& stats() const { return stats_; }
  size_t n_seqs() const { return seqs_.size(); }

 private:
  void constrain_once(const std::string& id, const grammar_spec& spec, std::span<const int32_t> generated,
                      std::span<float> logits);
  /// Forgets the automaton of `key` and every sequence on it.
  void drop(const std::string& key);
  struct seq_entry {
    std::string key;  ///< the spec's cache key
    std::unique_ptr<matcher> m;
    std::vector<int32_t> tokens;  ///< advanced over so far
    uint64_t used = 0;
  };
  struct grammar_entry {
    std::shared_ptr<automaton> a;
    uint64_t used = 0;
  };
  static std::string key_of(const grammar_spec& spec);
  std::shared_ptr<const token_trie> vocab_;
  session_limits lim_;
  std::unordered_map<std::string, grammar_entry> grammars_;
  std::unordered_map<std::string, seq_entry> seqs_;
  uint64_t clock_ = 0;
  counters stats_;
};

}  // namespace tandem::grammar
