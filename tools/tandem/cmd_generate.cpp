// tandem generate (placeholder until its owner lands it).
#include "actors/common/error.h"
#include "tools/tandem/commands.h"

namespace tandem::cli {

int generate(args) { throw tandem::error(error_kind::unimplemented, "tandem generate is not implemented yet"); }

}  // namespace tandem::cli
