#pragma once
// Moved to kernels/base/error.h (below the kernels and actors layers); this forwarder goes once
// every include names the new place.
#include "kernels/base/error.h"
