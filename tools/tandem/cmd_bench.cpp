// tandem bench (placeholder until its owner lands it).
#include "actors/common/error.h"
#include "tools/tandem/commands.h"

namespace tandem::cli {

int bench(args) { throw tandem::error(error_kind::unimplemented, "tandem bench is not implemented yet"); }

}  // namespace tandem::cli
