// tandem generate: stream a completion from a running node over Cap'n Proto RPC.
#include <cstdio>

#include "kernels/base/error.h"
#include "tools/tandem/commands.h"
#include "tools/tandem/flags.h"
#include "transport/auth/api_keys.h"
#include "transport/client/client.h"

namespace tandem::cli {

int generate(args a) {
  flags f;
  f.opt("host", "node address", "127.0.0.1")
      .opt("port", "the node's RPC port", "8081")
      .opt("prompt", "prompt text (required)")
      .opt("max-tokens", "tokens to generate", "16")
      .opt("temperature", "0 = greedy", "1.0")
      .opt("top-p", "nucleus sampling; 1 = off", "1.0")
      .opt("top-k", "0 = off", "0")
      .opt("seed", "sampling seed", "0")
      .sw("ignore-eos", "keep generating past EOS")
      .opt("logprobs", "print each token's log-probability and this many alternatives (0 to 20) to stderr; -1 = off", "-1")
      .opt("api-key-file", "file whose first key is sent to the node (default: $TANDEM_API_KEY)");
  if (!f.parse(a)) {
    std::fprintf(stderr, "usage: tandem generate --prompt TEXT [options]\n%s", f.help().c_str());
    return 0;
  }
  if (!f.has("prompt")) throw tandem::error("--prompt TEXT is required");
  int64_t port = f.num("port");
  if (port <= 0 || port > 65535) throw tandem::error("flag --port = " + std::to_string(port) + " is not a port; use 1..65535");
  client_params p;
  p.max_tokens = static_cast<int32_t>(f.num("max-tokens"));
  p.temperature = static_cast<float>(f.real("temperature"));
  p.top_p = static_cast<float>(f.real("top-p"));
  p.top_k = static_cast<int32_t>(f.num("top-k"));
  p.seed = static_cast<uint64_t>(f.num("seed"));
  p.ignore_eos = f.on("ignore-eos");
  p.logprobs = static_cast<int32_t>(f.num("logprobs"));

  auto c = client::connect(f.str("host"), static_cast<uint16_t>(port), client_api_key(f.str("api-key-file")));
  auto r = c->generate(f.str("prompt"), p, [](std::string_view text) {
    std::fwrite(text.data(), 1, text.size(), stdout);
    std::fflush(stdout);
    return true;
  });
  std::fputc('\n', stdout);
  std::fflush(stdout);  // the summary on stderr must come after the text
  for (const auto& t : r.logprobs) {
    std::fprintf(stderr, "token %d logprob %.6f", t.token, double(t.logprob));
    for (const auto& e : t.top) std::fprintf(stderr, " | %d %.6f", e.token, double(e.logprob));
    std::fputc('\n', stderr);
  }
  std::fprintf(stderr, "tandem generate: %s, finish_reason=%s, prompt_tokens=%d, completion_tokens=%d\n", r.request_id.c_str(),
               r.finish_reason.c_str(), r.prompt_tokens, r.completion_tokens);
  return 0;
}

}  // namespace tandem::cli
