#!/usr/bin/env bash
# The bundle tests/gpu/prepare-deps.sh packs for the GPU machines (build/gpu-deps/tandem),
# checked here without a GPU (tests/run.sh runs it wherever nvcc is):
#  1. through the carried loader, every library the binary links resolves inside the bundle
#     (cuBLAS: the CUDA folder, as on the GPU machine);
#  2. tests/gpu/serve_check.sh --backend cpu in a clean environment (env -i: no
#     LD_LIBRARY_PATH, a bare PATH): make-model, two servers, the HTTP completion, the abort
#     storm and the pool check, all through build/gpu-deps/tandem/run; serve_check fails if a
#     server maps a library from outside the bundle;
#  3. `serve --backend cuda` here, where no GPU is, fails at start naming the fix.
set -euo pipefail
cd "$(dirname "$0")/../.."
b=build/gpu-deps/tandem
[[ -x $b/run ]] || { echo "check-bundle: no $b/run; run tests/gpu/prepare-deps.sh first" >&2; exit 1; }
lib=$PWD/$b/lib
listed=$(env -i "$lib/ld-linux-x86-64.so.2" --library-path "$lib:/usr/local/cuda/lib64" --list "$b/bin/tandem")
outside=$(awk '$2 == "=>" {print $1, $3}' <<<"$listed" | grep -v " $lib/" | grep -v " /usr/local/cuda" || true)
if [[ -n $outside ]]; then
  echo "check-bundle: libraries resolved outside the bundle:" >&2
  echo "$outside" >&2
  exit 1
fi
echo "ok: every linked library resolves in the bundle ($(grep -c ' => ' <<<"$listed") libraries)"
env -i PATH=/usr/bin:/bin TANDEM_SERVE_CHECK_PRESET=tiny-15m tests/gpu/serve_check.sh --backend cpu
model=$(mktemp --suffix=.gguf)
trap 'rm -f "$model"' EXIT
env -i PATH=/usr/bin:/bin "$b/run" make-model --preset tiny-15m --out "$model" >/dev/null
if msg=$(env -i PATH=/usr/bin:/bin timeout 60 "$b/run" serve --model "$model" --port 0 --rpc-port 0 --backend cuda 2>&1); then
  echo "check-bundle: serve --backend cuda started on a machine without a GPU" >&2
  exit 1
fi
grep -q "cuda" <<<"$msg" || { echo "check-bundle: serve --backend cuda failed without naming CUDA: $msg" >&2; exit 1; }
echo "ok: serve --backend cuda without a GPU fails at start: $(tail -1 <<<"$msg")"
