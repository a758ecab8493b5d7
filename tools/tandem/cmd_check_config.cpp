// tandem check-config (placeholder until its owner lands it).
#include "actors/common/error.h"
#include "tools/tandem/commands.h"

namespace tandem::cli {

int check_config(args) { throw tandem::error(error_kind::unimplemented, "tandem check-config is not implemented yet"); }

}  // namespace tandem::cli
