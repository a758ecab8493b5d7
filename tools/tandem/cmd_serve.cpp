// tandem serve (placeholder until its owner lands it).
#include "actors/common/error.h"
#include "tools/tandem/commands.h"

namespace tandem::cli {

int serve(args) { throw tandem::error(error_kind::unimplemented, "tandem serve is not implemented yet"); }

}  // namespace tandem::cli
