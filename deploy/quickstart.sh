#!/usr/bin/env bash
# Quickstart on a fresh Debian 12 machine: installs packages, builds, writes a model with
# `tandem make-model`, starts an embedded single-process cluster and sends one completion.
# Usage: deploy/quickstart.sh [--once]    (--once: stop the server after the demo request)
set -euo pipefail
cd "$(dirname "$0")/.."

once=0
[[ "${1:-}" == "--once" ]] && once=1
build_dir=${BUILD_DIR:-build/default}
port=${TANDEM_PORT:-8080}
rpc_port=${TANDEM_RPC_PORT:-8081}

./deploy/install-deps.sh
if [[ "$build_dir" == build/default ]]; then
  cmake --preset default >/dev/null
fi
cmake --build "$build_dir" -j "$(nproc)" --target tandem
tandem="$build_dir/tools/tandem"

model=build/models/tiny-15m-f16.gguf
mkdir -p build/models
[[ -f "$model" ]] || "$tandem" make-model --preset tiny-15m --dtype f16 --seed 1 --out "$model"

log=$(mktemp)
"$tandem" serve --model "$model" --host 127.0.0.1 --port "$port" --rpc-port "$rpc_port" >"$log" 2>&1 &
server=$!
trap 'kill $server 2>/dev/null; wait $server 2>/dev/null; rm -f "$log"' EXIT
for _ in $(seq 1 300); do
  grep -q "http listening" "$log" && break
  kill -0 $server 2>/dev/null || { cat "$log"; echo "quickstart: server exited" >&2; exit 1; }
  sleep 0.1
done
grep -q "http listening" "$log" || { cat "$log"; echo "quickstart: server did not start" >&2; exit 1; }

echo "== POST /v1/completions"
curl -sS --fail-with-body http://127.0.0.1:$port/v1/completions \
  -H 'Content-Type: application/json' \
  -d '{"prompt":"Once upon a time","max_tokens":16,"temperature":0}'
echo
echo "== tandem generate (Cap'n Proto RPC)"
"$tandem" generate --host 127.0.0.1 --port "$rpc_port" --prompt "Once upon a time" --max-tokens 16
echo

echo "tandem is built at $tandem; the deploy scripts find it there. To put it on PATH:" \
  "cmake --install $build_dir (to /usr/local/bin; --prefix DIR for DIR/bin)"
if ((once)); then
  exit 0
fi
echo "serving on http://127.0.0.1:$port (OpenAI API) and rpc 127.0.0.1:$rpc_port; Ctrl-C stops"
trap - EXIT
wait $server
