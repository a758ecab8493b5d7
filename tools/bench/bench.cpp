// tandem bench <mode>: dispatch to one benchmark. Add a mode by adding a row to `modes`
// and its function to bench_modes.h.
#include <cstdio>
#include <string>

#include "kernels/base/error.h"
#include "tools/bench/modes.h"
#include "tools/tandem/commands.h"

namespace tandem::cli {

namespace {

struct mode {
  const char* name;
  int (*run)(args);
  const char* help;
};

constexpr mode modes[] = {
    {"model", bench_model, "prefill/decode tokens/s of a GGUF model vs measured bandwidth and FMA peak"},
    {"control-plane", bench_control_plane, "CPU us per generated token of router/schedulers/streaming (null model)"},
    {"cache", bench_cache, "multi-turn agentic workload: TTFT/throughput with the KV cache off, L1, L1+L2(+L3)"},
    {"transfer", bench_transfer, "KV page transfer bandwidth over UCX vs memcpy (and ucx_perftest)"},
    {"serve", bench_serve, "HTTP load generator against a server: TTFT/TPOT/ITL, goodput, rejections"},
    {"burst", bench_burst, "3x-capacity burst against unbounded queues and Tandem's bounds: admitted p99 TTFT, rejections"},
    {"grammar", bench_grammar, "response_format mask time per step at batch 16 vs the model's forward step (ratio)"},
    {"soak", bench_soak, "3x capacity for 60 s: RSS growth, mailbox and queue high water vs bounds, one answer per request"},
};

void usage() {
  std::printf("usage: tandem bench <mode> [options]\n\nmodes:\n");
  for (const mode& m : modes) std::printf("  %-14s %s\n", m.name, m.help);
  std::printf("\nrun 'tandem bench <mode> --help' for the options of a mode\n");
}

}  // namespace

int bench(args a) {
  if (a.empty() || a[0] == "--help" || a[0] == "-h") {
    usage();
    return a.empty() ? 2 : 0;
  }
  for (const mode& m : modes)
    if (a[0] == m.name) return m.run(a.subspan(1));
  std::string names;
  for (const mode& m : modes) names += std::string(names.empty() ? "" : ", ") + m.name;
  throw tandem::error(error_kind::unimplemented,
                      "unknown bench mode '" + a[0] + "'; available: " + names);
}

}  // namespace tandem::cli
