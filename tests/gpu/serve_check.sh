#!/usr/bin/env bash
# Serving on CUDA, with the `tandem` binary carried in build/gpu-deps/tandem (built here by
# tests/gpu/prepare-deps.sh; the GPU machines have no Debian packages, so it runs through its
# carried loader and libraries: build/gpu-deps/tandem/run). tests/gpu/run.sh calls it first;
# alone: tests/gpu/serve_check.sh [--backend cpu] (cpu: the packaging check without a GPU, both
# servers on the CPU backend; TANDEM_SERVE_CHECK_PRESET picks a smaller model for it). In about a
# minute on an H100:
#  1. `tandem make-model --preset small-110m` (f16);
#  2. `tandem serve --backend cuda` (host KV tier on: its copies stage through pinned buffers)
#     and a CPU serve of the same file; one greedy HTTP completion of 16 tokens, equal on both;
#  3. an abort storm on the CUDA server: 96 streamed requests, each cut by closing its
#     connection after 0..8 chunks; then the device pool must be whole (every page free or
#     cached by no one, no request running, no staging buffer busy, the server saw clients go
#     away: /metrics) and the same completion still equal;
#  4. served decode tokens/s at 1 and 32 concurrent greedy requests of 64 tokens (CUDA);
#  5. a router / prefill / decode cluster of three processes on the same model with [model]
#     backend = the backend: its KV crosses from the prefill node's device pool to the decode
#     node's over UCX (tcp) through both nodes' pinned staging slots; the same completion as the
#     CPU server, and afterwards every staging slot free again (tandem_kv_staging_* on /metrics).
# Server logs go to $OUT when set (the device tool brings them back), else a temp folder.
set -euo pipefail
cd "$(dirname "$0")/../.."
backend=cuda
[[ ${1:-} == --backend ]] && backend=$2
run=build/gpu-deps/tandem/run
if [[ ! -x $run ]]; then
  echo "serve_check: no carried tandem at $run; run tests/gpu/prepare-deps.sh where nvcc and Debian's packages are" >&2
  exit 1
fi
py=$(command -v python3 || true)
[[ -n $py ]] || { echo "serve_check: python3 is missing (the HTTP client)" >&2; exit 1; }
client=(timeout 300 "$py" tests/gpu/serve_client.py)
# The driver for the carried loader: where the machine's loader cache has it.
if [[ -z ${TANDEM_DRIVER_LIB:-} ]] && command -v ldconfig >/dev/null; then
  lib=$(ldconfig -p | awk '/libcuda\.so\.1 / {print $NF; exit}')
  [[ -n $lib ]] && export TANDEM_DRIVER_LIB=$(dirname "$lib")
fi
work=$(mktemp -d)
logs=${OUT:-$work}
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done
  rm -rf "$work"
}
trap cleanup EXIT
fail() {
  echo "serve_check: FAILED: $*" >&2
  for f in "$logs"/serve-*.log; do [[ -f $f ]] && { echo "--- $f (last 30 lines)"; tail -30 "$f"; }; done
  exit 1
}

preset=${TANDEM_SERVE_CHECK_PRESET:-small-110m}
model=$work/$preset-f16.gguf
"$run" make-model --preset "$preset" --dtype f16 --seed 1 --out "$model" >/dev/null || fail "make-model"
# serve NAME PORT BACKEND [flags...]: in the background, its log in $logs
serve() {
  local name=$1 port=$2 be=$3
  shift 3
  "$run" serve --model "$model" --host 127.0.0.1 --port "$port" --rpc-port $((port + 1)) --backend "$be" "$@" \
    >"$logs/serve-$name.log" 2>&1 &
  pids+=($!)
}
cpu_url=http://127.0.0.1:18180
dev_url=http://127.0.0.1:18190
serve cpu 18180 cpu
serve "$backend" 18190 "$backend" --host-ratio 1
"${client[@]}" wait "$cpu_url" 120 >/dev/null || fail "the CPU server did not become ready"
"${client[@]}" wait "$dev_url" 120 >/dev/null || fail "the $backend server did not become ready"
# Every library the servers mapped is the bundle's, CUDA's or the driver's (nothing of the
# machine's own: that is what the GPU machines lack).
bundle=$PWD/build/gpu-deps/tandem/lib
for p in "${pids[@]}"; do
  foreign=$(awk '$6 ~ /\.so/ {print $6}' "/proc/$p/maps" | sort -u | grep -v "^$bundle/" | grep -v "^/usr/local/cuda" |
            grep -v "^/usr/local/nvidia" | { if [[ -n ${TANDEM_DRIVER_LIB:-} ]]; then grep -v "^$TANDEM_DRIVER_LIB/"; else cat; fi; } || true)
  if [[ -n $foreign ]]; then
    # On the CPU backend (the packaging check, check-bundle.sh) that is a hole in the bundle; on
    # the GPU machine the driver may bring its own.
    [[ $backend == cpu ]] && fail "server $p maps libraries from outside the bundle: $foreign"
    echo "note: server $p maps libraries from outside the bundle: $foreign"
  fi
done
echo "checked: the libraries both servers mapped"
grep -h "worker up\|staging" "$logs/serve-$backend.log" | head -4 || true

prompt="The quick brown fox jumps over the lazy dog and then"
ref=$("${client[@]}" complete "$cpu_url" "$prompt" 16) || fail "the CPU completion"
got=$("${client[@]}" complete "$dev_url" "$prompt" 16) || fail "the $backend completion"
echo "cpu:   $ref"
echo "$backend: $got"
[[ $ref == "$got" ]] || fail "greedy 16 tokens differ between the CPU and the $backend server"
echo "ok: greedy 16 tokens over HTTP equal on cpu and $backend"

storm=$("${client[@]}" storm "$dev_url" 96) || fail "abort storm: $storm"
echo "storm: $storm"
settled=$("${client[@]}" settled "$dev_url" 60 1) || fail "the device pool is not whole after the abort storm: $settled"
echo "ok: device pool whole after the storm: $settled"
again=$("${client[@]}" complete "$dev_url" "$prompt" 16) || fail "the completion after the storm"
[[ $again == "$got" ]] || fail "after the storm the completion differs: $again"
echo "ok: the same completion after the storm"

for conc in 1 32; do
  tp=$("${client[@]}" throughput "$dev_url" "$conc" 64) || fail "throughput at $conc"
  echo "served decode ($backend, $preset f16, 64 tokens each): $tp"
done

# 5. Prefill and decode in separate processes: pages staged for UCX on both ends.
pd=$work/pd.toml
cat >"$pd" <<EOF
[limits]
page_size = 16
kv_cache_mb = 64
max_running_seqs = 32
[model]
path = "$model"
backend = "$backend"
[transfer]
timeout_ms = 10000
[[node]]
name = "router"
host = "127.0.0.1"
roles = ["router"]
http_port = 18200
rpc_port = 18201
admin_port = 18202
cluster_port = 18203
[[node]]
name = "prefill-0"
host = "127.0.0.1"
roles = ["prefill", "cache", "worker"]
http_port = 18210
rpc_port = 18211
admin_port = 18212
cluster_port = 18213
kv_port = 18214
[[node]]
name = "decode-0"
host = "127.0.0.1"
roles = ["decode", "cache", "worker"]
http_port = 18220
rpc_port = 18221
admin_port = 18222
cluster_port = 18223
EOF
for node in prefill-0 decode-0 router; do
  TANDEM_KV_TLS=tcp "$run" serve --config "$pd" --node "$node" >"$logs/serve-pd-$node.log" 2>&1 &
  pids+=($!)
done
for port in 18210 18220 18200; do
  "${client[@]}" wait "http://127.0.0.1:$port" 120 >/dev/null || fail "the cluster node on port $port did not become ready"
done
pd_got=$("${client[@]}" complete http://127.0.0.1:18200 "$prompt" 16) || fail "the completion through the cluster"
[[ $pd_got == "$ref" ]] || fail "the prefill/decode cluster's completion differs from the CPU server's: $pd_got"
echo "ok: prefill and decode in two processes ($backend) give the CPU server's completion"
for port in 18210 18220; do
  st=$("${client[@]}" staging "http://127.0.0.1:$port" 30 "$backend") || fail "staging on the node of port $port: $st"
  echo "staging (node on port $port): $st"
done
echo "serve_check ($backend): all ok"
