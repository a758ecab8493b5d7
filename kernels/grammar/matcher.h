#pragma once
/// The grammar as a pushdown automaton over bytes, and the per-step token mask.
///
/// A matcher state is a set of stacks (as llama.cpp's GBNF matcher): each stack's top is the
/// byte set to match next, the frames below are where to continue when a rule ends; the empty
/// stack means the grammar is complete. Stacks are hash-consed (a stack is a node id; equal
/// stacks are the same id) so a state is a small sorted vector of ids, transitions per
/// (stack, byte) are memoized, and the mask of a state over the whole vocabulary is computed
/// once by walking the token trie (a subtree is skipped as soon as its prefix is dead) and then
/// cached per state: repeated states (inside a string, between fields, every request with the
/// same schema) cost a hash lookup.
///
/// Not thread-safe: an automaton (and its caches) belongs to one thread, e.g. one worker.
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

#include "kernels/grammar/grammar.h"

namespace tandem::grammar {

/// The vocabulary as the mask sees it: each token's bytes in a trie, in preorder.
class token_trie {
 public:
  /// `token_bytes[id]`: the bytes of token id ("" for control tokens: never allowed).
  token_trie(std::vector<std::string> token_bytes, int32_t eos_id);
  struct node {
    uint8_t byte = 0;
    uint32_t depth = 0;
    uint32_t end = 0;  ///< index after this node's subtree
    uint32_t tok_begin = 0, tok_end = 0;  ///< tokens whose bytes end here (in `toks`)
  };
  int32_t n_vocab() const { return int32_t(bytes_.size()); }
  int32_t eos_id() const { return eos_id_; }
  const std::string& bytes(int32_t id) const { return bytes_[size_t(id)]; }
  const std::vector<node>& nodes() const { return nodes_; }
  const std::vector<int32_t>& toks() const { return toks_; }
  uint32_t max_depth() const { return max_depth_; }

 private:
  std::vector<std::string> bytes_;
  int32_t eos_id_;
  std::vector<node> nodes_;  ///< nodes_[0] is the root (no byte)
  std::vector<int32_t> toks_;
  uint32_t max_depth_ = 0;
};

/// Bounds of one automaton's tables.
/// Bounds of one automaton's tables (a few tens of MiB at most).
struct automaton_limits {
  size_t max_stacks = size_t(1) << 18;       ///< interned stacks; beyond, advancing throws
  size_t max_mask_bytes = size_t(8) << 20;   ///< cached masks (n_vocab bits each); cleared when full
  size_t max_memo = size_t(1) << 18;         ///< memoized transitions; cleared when full
};

/// A set of stacks, sorted; contains 0 (the empty stack) when the grammar is complete.
using state = std::vector<uint32_t>;

class automaton {
 public:
  automaton(grammar g, std::shared_ptr<const token_trie> vocab, automaton_limits lim = {});
  const grammar& rules() const { return g_; }
  const token_trie& vocab() const { return *vocab_; }
  state initial();
  static bool accepting(const state& s) { return !s.empty() && s.front() == 0; }
  /// The state after byte `b` (empty = `b` is not allowed).
  void advance_byte(const state& s, uint8_t b, state& out);
  /// Advances `s` over token `id`; false (and `s` unchanged) if the grammar does not allow it.
  /// EOS is allowed only in an accepting state (which it keeps).
  bool advance_token(state& s, int32_t id);
  /// The tokens allowed in `s`, one bit per token id (EOS when accepting). The reference is
  /// valid until the next call.
  const std::vector<uint64_t>& mask(const state& s);
  struct counters {
    int64_t mask_hits = 0, mask_misses = 0, trie_nodes_walked = 0;
  };
  const counters& stats() const { return stats_; }
  size_t n_stacks() const { return nodes_.size(); }

 private:
  uint32_t intern(uint32_t pos, uint32_t parent);
  void normalize(uint32_t pos, uint32_t parent, state& out, int depth);
  /// Memoized: the stacks after stack `id` takes byte `b`, as [offset, offset + len) of memo_pool_.
  std::pair<uint32_t, uint32_t> step(uint32_t id, uint8_t b);
  void compute_mask(const state& s, std::vector<uint64_t>& bits);

  grammar g_;
  std::shared_ptr<const token_trie> vocab_;
  automaton_limits lim_;
  struct stack_node {
    uint32_t pos, parent;
  };
  std::vector<stack_node> nodes_;  ///< nodes_[0]: the empty stack
  std::unordered_map<uint64_t, uint32_t> intern_;
  /// (stack, byte) -> memo_pool_ range, open addressing with linear probing: the lookup every
  /// trie node of a mask walk makes (std::unordered_map's node chasing doubled the walk).
  struct memo_slot {
    uint64_t key = ~uint64_t(0);  ///< empty
    uint32_t off = 0, len = 0;
  };
  std::vector<memo_slot> memo_;  ///< a power of two, at most half full
  size_t memo_used_ = 0;
  std::vector<uint32_t> memo_pool_;
  memo_slot* memo_find(uint64_t key);
  std::unordered_map<std::string, std::vector<uint64_t>> masks_;
  std::vector<state> levels_;  ///< scratch of compute_mask, one state per trie depth
  state scratch_;
  counters stats_;
};

/// One sequence's position in a grammar.
class matcher {
 public:
  explicit matcher(std::shared_ptr<automaton> a) : a_(std::move(a)), s_(a_->initial()) {}
  bool accept(int32_t token) { return a_->advance_token(s_, token); }
  bool complete() const { return automaton::accepting(s_); }
  const std::vector<uint64_t>& mask() { return a_->mask(s_); }
  const state& current() const { return s_; }
  automaton& owner() { return *a_; }

 private:
  std::shared_ptr<automaton> a_;
  state s_;
};

/// Sets the logits of the tokens not in `mask` to -inf. Returns how many stay allowed.
int64_t apply_mask(std::span<float> logits, const std::vector<uint64_t>& mask);

}  // namespace tandem::grammar
