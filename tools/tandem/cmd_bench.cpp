// tandem bench (placeholder until its owner lands it).
#include "actors/common/error.h"
#include "tools/tandem/commands.h"

namespace tandem::cli {

int bench_cache(args a);     // tools/tandem/bench_cache.cpp
int bench_transfer(args a);  // tools/tandem/bench_transfer.cpp

int bench(args a) {
  if (!a.empty() && a[0] == "cache") return bench_cache(a.subspan(1));
  if (!a.empty() && a[0] == "transfer") return bench_transfer(a.subspan(1));
  throw tandem::error(error_kind::unimplemented, "tandem bench is not implemented yet");
}

}  // namespace tandem::cli
