#include "kernels/grammar/matcher.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <numeric>

#include "kernels/base/error.h"

namespace tandem::grammar {

token_trie::token_trie(std::vector<std::string> token_bytes, int32_t eos_id)
    : bytes_(std::move(token_bytes)), eos_id_(eos_id) {
  std::vector<int32_t> order;
  for (int32_t i = 0; i < int32_t(bytes_.size()); ++i)
    if (!bytes_[size_t(i)].empty() && i != eos_id) order.push_back(i);
  std::stable_sort(order.begin(), order.end(),
                   [&](int32_t a, int32_t b) { return bytes_[size_t(a)] < bytes_[size_t(b)]; });
  // Sorted strings arrive in preorder: keep the path of open nodes, close the ones past the
  // common prefix with the next string.
  nodes_.push_back({});
  std::vector<uint32_t> path{0};
  const std::string* prev = nullptr;
  for (int32_t id : order) {
    const std::string& s = bytes_[size_t(id)];
    size_t lcp = 0;
    if (prev)
      while (lcp < prev->size() && lcp < s.size() && (*prev)[lcp] == s[lcp]) ++lcp;
    while (path.size() > lcp + 1) {
      nodes_[path.back()].end = uint32_t(nodes_.size());
      path.pop_back();
    }
    for (size_t d = lcp; d < s.size(); ++d) {
      node n;
      n.byte = uint8_t(s[d]);
      n.depth = uint32_t(d + 1);
      n.tok_begin = n.tok_end = uint32_t(toks_.size());
      path.push_back(uint32_t(nodes_.size()));
      nodes_.push_back(n);
    }
    max_depth_ = std::max<uint32_t>(max_depth_, uint32_t(s.size()));
    node& last = nodes_[path.back()];
    if (last.tok_end != toks_.size()) throw tandem::error("token_trie: tokens of one node are not contiguous");
    toks_.push_back(id);
    last.tok_end = uint32_t(toks_.size());
    prev = &s;
  }
  while (!path.empty()) {
    nodes_[path.back()].end = uint32_t(nodes_.size());
    path.pop_back();
  }
}

automaton::automaton(grammar g, std::shared_ptr<const token_trie> vocab, automaton_limits lim)
    : g_(std::move(g)), vocab_(std::move(vocab)), lim_(lim) {
  nodes_.push_back({0, 0});
  levels_.resize(vocab_->max_depth() + 1);
  memo_.resize(size_t(1) << 12);
}

uint32_t automaton::intern(uint32_t pos, uint32_t parent) {
  const uint64_t key = (uint64_t(pos) << 32) | parent;
  auto it = intern_.find(key);
  if (it != intern_.end()) return it->second;
  if (nodes_.size() >= lim_.max_stacks)
    throw tandem::error(error_kind::overloaded,
                        fmt::format("grammar: more than {} parser stacks; the grammar nests too deep or is too "
                                    "ambiguous, simplify the schema",
                                    lim_.max_stacks));
  const uint32_t id = uint32_t(nodes_.size());
  nodes_.push_back({pos, parent});
  intern_.emplace(key, id);
  return id;
}

void automaton::normalize(uint32_t pos, uint32_t parent, state& out, int depth) {
  if (depth > 4096) throw tandem::error("grammar: rule expansion deeper than 4096; the grammar is too deep");
  const element& e = g_.elems[pos];
  switch (e.kind) {
    case elem_kind::bytes:
      out.push_back(intern(pos, parent));
      return;
    case elem_kind::end:
      if (parent == 0) {
        out.push_back(0);
        return;
      }
      normalize(nodes_[parent].pos, nodes_[parent].parent, out, depth + 1);
      return;
    case elem_kind::rule: {
      // A reference in tail position returns straight to our caller (no frame).
      const uint32_t ret = g_.elems[pos + 1].kind == elem_kind::end ? parent : intern(pos + 1, parent);
      for (uint32_t a : g_.rule_alts[e.arg]) normalize(a, ret, out, depth + 1);
      return;
    }
  }
}

state automaton::initial() {
  state s;
  for (uint32_t a : g_.rule_alts[g_.root]) normalize(a, 0, s, 0);
  std::sort(s.begin(), s.end());
  s.erase(std::unique(s.begin(), s.end()), s.end());
  return s;
}

automaton::memo_slot* automaton::memo_find(uint64_t key) {
  const size_t mask = memo_.size() - 1;
  for (size_t i = size_t((key * 0x9E3779B97F4A7C15ull) >> 20) & mask;; i = (i + 1) & mask)
    if (memo_[i].key == key || memo_[i].key == ~uint64_t(0)) return &memo_[i];
}

std::pair<uint32_t, uint32_t> automaton::step(uint32_t id, uint8_t b) {
  const uint64_t key = (uint64_t(id) << 8) | b;
  if (memo_slot* s = memo_find(key); s->key == key) return {s->off, s->len};
  if (memo_used_ >= lim_.max_memo || memo_pool_.size() >= 4 * lim_.max_memo) {
    std::fill(memo_.begin(), memo_.end(), memo_slot{});
    memo_used_ = 0;
    memo_pool_.clear();
  } else if (2 * (memo_used_ + 1) > memo_.size()) {
    std::vector<memo_slot> old(memo_.size() * 2);
    old.swap(memo_);
    for (const auto& s : old)
      if (s.key != ~uint64_t(0)) *memo_find(s.key) = s;
  }
  scratch_.clear();
  const stack_node n = nodes_[id];
  normalize(n.pos + 1, n.parent, scratch_, 0);
  std::sort(scratch_.begin(), scratch_.end());
  scratch_.erase(std::unique(scratch_.begin(), scratch_.end()), scratch_.end());
  std::pair<uint32_t, uint32_t> r{uint32_t(memo_pool_.size()), uint32_t(scratch_.size())};
  memo_pool_.insert(memo_pool_.end(), scratch_.begin(), scratch_.end());
  *memo_find(key) = {key, r.first, r.second};
  ++memo_used_;
  return r;
}

void automaton::advance_byte(const state& s, uint8_t b, state& out) {
  out.clear();
  for (uint32_t id : s) {
    if (id == 0) continue;
    if (!g_.sets[g_.elems[nodes_[id].pos].arg].has(b)) continue;
    auto [off, len] = step(id, b);
    out.insert(out.end(), memo_pool_.begin() + off, memo_pool_.begin() + off + len);
  }
  if (s.size() > 1) {
    std::sort(out.begin(), out.end());
    out.erase(std::unique(out.begin(), out.end()), out.end());
  }
}

bool automaton::advance_token(state& s, int32_t id) {
  if (id < 0 || id >= vocab_->n_vocab()) return false;
  if (id == vocab_->eos_id()) return accepting(s);
  const std::string& bytes = vocab_->bytes(id);
  if (bytes.empty()) return false;
  state cur = s, next;
  for (char c : bytes) {
    advance_byte(cur, uint8_t(c), next);
    if (next.empty()) return false;
    cur.swap(next);
  }
  s = std::move(cur);
  return true;
}

void automaton::compute_mask(const state& s, std::vector<uint64_t>& bits) {
  const token_trie& t = *vocab_;
  bits.assign((size_t(t.n_vocab()) + 63) / 64, 0);
  const auto& nodes = t.nodes();
  const auto& toks = t.toks();
  levels_[0] = s;
  for (uint32_t i = 1; i < nodes.size();) {
    const auto& nd = nodes[i];
    state& cur = levels_[nd.depth];
    advance_byte(levels_[nd.depth - 1], nd.byte, cur);
    ++stats_.trie_nodes_walked;
    if (cur.empty()) {
      i = nd.end;  // no token with this prefix can be allowed
      continue;
    }
    for (uint32_t k = nd.tok_begin; k < nd.tok_end; ++k) bits[size_t(toks[k]) >> 6] |= uint64_t(1) << (toks[k] & 63);
    ++i;
  }
  if (accepting(s) && t.eos_id() >= 0) bits[size_t(t.eos_id()) >> 6] |= uint64_t(1) << (t.eos_id() & 63);
}

const std::vector<uint64_t>& automaton::mask(const state& s) {
  std::string key(reinterpret_cast<const char*>(s.data()), s.size() * sizeof(uint32_t));
  auto it = masks_.find(key);
  if (it != masks_.end()) {
    ++stats_.mask_hits;
    return it->second;
  }
  ++stats_.mask_misses;
  const size_t mask_bytes = (size_t(vocab_->n_vocab()) + 63) / 64 * 8 + key.size() + 64;
  if ((masks_.size() + 1) * mask_bytes > lim_.max_mask_bytes) masks_.clear();
  std::vector<uint64_t> bits;
  compute_mask(s, bits);
  return masks_.emplace(std::move(key), std::move(bits)).first->second;
}

int64_t apply_mask(std::span<float> logits, const std::vector<uint64_t>& mask) {
  int64_t allowed = 0;
  const size_t n = logits.size();
  for (size_t w = 0; w * 64 < n; ++w) {
    const uint64_t bits = w < mask.size() ? mask[w] : 0;
    const size_t end = std::min(n, w * 64 + 64);
    if (bits == ~uint64_t(0) && end == w * 64 + 64) {
      allowed += 64;
      continue;
    }
    if (bits == 0) {  // the common word in a constrained state
      std::fill(logits.begin() + ptrdiff_t(w * 64), logits.begin() + ptrdiff_t(end), -INFINITY);
      continue;
    }
    for (size_t i = w * 64; i < end; ++i) {
      if ((bits >> (i & 63)) & 1)
        ++allowed;
      else
        logits[i] = -INFINITY;
    }
  }
  return allowed;
}

}  // namespace tandem::grammar
