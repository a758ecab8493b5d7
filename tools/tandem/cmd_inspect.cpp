// tandem inspect (placeholder until its owner lands it).
#include "actors/common/error.h"
#include "tools/tandem/commands.h"

namespace tandem::cli {

int inspect(args) { throw tandem::error(error_kind::unimplemented, "tandem inspect is not implemented yet"); }

}  // namespace tandem::cli
