#pragma once
/// Token log-probabilities on the wire (worker -> schedulers -> router), both ways.
#include <span>
#include <vector>

#include "actors/common/wire.h"
#include "kernels/model/logprobs.h"

namespace tandem {

/// Writes `v` into the list `init(n)` returns.
template <class Init>
void write_logprobs(Init&& init, std::span<const token_logprobs> v) {
  if (v.empty()) return;
  auto l = init(static_cast<unsigned>(v.size()));
  for (size_t i = 0; i < v.size(); ++i) {
    auto e = l[static_cast<unsigned>(i)];
    e.setToken(v[i].token);
    e.setLogprob(v[i].logprob);
    const auto& top = v[i].top;
    auto tt = e.initTopTokens(static_cast<unsigned>(top.size()));
    auto tl = e.initTopLogprobs(static_cast<unsigned>(top.size()));
    for (size_t k = 0; k < top.size(); ++k) {
      tt.set(static_cast<unsigned>(k), top[k].token);
      tl.set(static_cast<unsigned>(k), top[k].logprob);
    }
  }
}

/// The log-probabilities of a worker's forward reply, one per sequence (token -1 where the
/// sequence did not ask); empty when none asked or the reply is not a result.
std::vector<token_logprobs> read_forward_logprobs(const wire& w);

/// Reads a list; top entries beyond max_top_logprobs (a peer's bug) are dropped.
std::vector<token_logprobs> read_logprobs(capnp::List<schema::TokenLogprobs>::Reader l);

}  // namespace tandem
