// tandem make-model (placeholder until its owner lands it).
#include "actors/common/error.h"
#include "tools/tandem/commands.h"

namespace tandem::cli {

int make_model(args) { throw tandem::error(error_kind::unimplemented, "tandem make-model is not implemented yet"); }

}  // namespace tandem::cli
