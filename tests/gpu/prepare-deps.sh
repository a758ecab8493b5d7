#!/usr/bin/env bash
# Copies into build/gpu-deps what tests/gpu/run.sh needs and the lent GPU machines lack: Debian's
# fmt headers (libfmt-dev), which the CPU kernels there use header-only. Run it here, then run
# the checks there with that folder carried along (the device tool: carry ["build/gpu-deps"],
# command "tests/gpu/run.sh"). build/ is ignored: the copy is never committed.
set -euo pipefail
cd "$(dirname "$0")/../.."
src=/usr/include/fmt
if [[ ! -f $src/format.h ]]; then
  echo "prepare-deps: $src/format.h is missing; install Debian's libfmt-dev (deploy/install-deps.sh)" >&2
  exit 1
fi
rm -rf build/gpu-deps
mkdir -p build/gpu-deps/include
cp -r "$src" build/gpu-deps/include/
echo "build/gpu-deps: fmt headers ($(du -sh build/gpu-deps | cut -f1)); carry it to the GPU machine with tests/gpu/run.sh"
