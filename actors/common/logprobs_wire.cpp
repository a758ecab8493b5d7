#include "actors/common/logprobs_wire.h"

#include <algorithm>

namespace tandem {

std::vector<token_logprobs> read_logprobs(capnp::List<schema::TokenLogprobs>::Reader l) {
  std::vector<token_logprobs> out;
  out.reserve(l.size());
  for (auto e : l) {
    token_logprobs t;
    t.token = e.getToken();
    t.logprob = e.getLogprob();
    auto tt = e.getTopTokens();
    auto tl = e.getTopLogprobs();
    const unsigned n = std::min({tt.size(), tl.size(), static_cast<unsigned>(max_top_logprobs)});
    t.top.reserve(n);
    for (unsigned k = 0; k < n; ++k) t.top.push_back({tt[k], tl[k]});
    out.push_back(std::move(t));
  }
  return out;
}

std::vector<token_logprobs> read_forward_logprobs(const wire& w) {
  try {
    wire_reader rd(w);
    auto env = rd.reply();
    if (!env.isForwardResult()) return {};
    return read_logprobs(env.getForwardResult().getLogprobs());
  } catch (const tandem::error&) {
    return {};  // read_forward_result reports the bad reply
  }
}

}  // namespace tandem
