#pragma once
/// The strict JSON reader and writer moved to kernels/base/json.h (the grammar compiler in
/// kernels/ uses it too); this header stays so that the front end's many includes keep working.
#include "kernels/base/json.h"
