#!/usr/bin/env bash
# Multi-node checks across network namespaces (root only). Each node of a config gets its own
# namespace with the config's `host` (10.77.0.x/24) on a veth pair whose other end is a port
# of a bridge in a hub namespace; a client namespace (10.77.0.100) sends the requests. Nodes
# run with UCX_TLS=tcp UCX_TCP_CM_REUSEADDR=y (no shared memory across "machines"). The
# reference output is a single-process `tandem serve` of the same model on the client
# namespace's loopback. Everything is torn down on exit (trap), and the run fails if a
# namespace of it is left behind.
#
# Scenarios:
#   replicas  two all-roles nodes (one single-node config each) in two namespaces: greedy
#             completions over HTTP and `tandem generate` over Cap'n Proto RPC equal the
#             reference; with one node's link down its requests fail (curl's error is shown)
#             while the other serves, and after the link is up again they succeed.
#   launch    deploy/launch-cluster.sh in the client namespace starts two nodes "over ssh" (a
#             fake ssh running `ip netns exec` in the node's namespace), waits for their
#             health over veth, they give the reference output, --status, --stop.
#   pd        (on by default; TANDEM_NETNS_PD=0 skips it) router, prefill and decode in three namespaces,
#             one config with cluster_port/kv_port per node: greedy output equals the
#             reference; with the prefill node's link down a request fails with an HTTP error
#             (transfer.failure_policy = "fail") instead of hanging; after up it succeeds.
#             Then 6 link flaps of router, prefill and decode in a seeded random order
#             (TANDEM_NETNS_SEED), two requests in flight across each: each ends once (the
#             reference text or an HTTP error with a message), both pools are whole after, and
#             every node is alive and serves the reference output.
#
# usage: tests/netns/run.sh TANDEM_BINARY
# Not root, or no `ip`: exit 1 with the reason, or 77 (ctest: skipped) if TANDEM_SKIP_NETNS=1.
set -euo pipefail
tandem=$(realpath "${1:?usage: tests/netns/run.sh TANDEM_BINARY}")

skip_or_fail() {
  if [[ ${TANDEM_SKIP_NETNS:-0} == 1 ]]; then
    echo "SKIPPED (TANDEM_SKIP_NETNS=1): $*"
    exit 77
  fi
  echo "FAIL: $*; the network-namespace tests need root and iproute2 (deploy/install-deps.sh);" \
    "set TANDEM_SKIP_NETNS=1 to skip them on this machine" >&2
  exit 1
}
[[ $(id -u) == 0 ]] || skip_or_fail "not running as root (uid $(id -u))"
command -v ip >/dev/null || skip_or_fail "the ip command (iproute2) is not installed"
command -v curl >/dev/null && command -v jq >/dev/null || { echo "FAIL: curl and jq are needed (deploy/install-deps.sh)" >&2; exit 1; }

start_s=$(date +%s.%N)
tag=tdm$$                     # namespaces: $tag-hub, $tag-client, $tag-<node>
tmp=$(mktemp -d)
pids=()
namespaces=()
veth_count=0

cleanup() {
  local rc=$? p ns left
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done
  # Anything else still inside (a client that hung): killed with its namespace.
  for ns in "${namespaces[@]}"; do
    for p in $(ip netns pids "$ns" 2>/dev/null); do kill -9 "$p" 2>/dev/null || true; done
    ip netns del "$ns" 2>/dev/null || true
  done
  left=$(ip netns list | awk '{print $1}' | grep "^$tag-" || true)
  if [[ -n $left ]]; then
    echo "FAIL: namespaces left behind: $left" >&2
    rc=1
  fi
  ((rc == 0)) || for f in "$tmp"/*.log; do [[ -f $f ]] && { echo "--- $f" >&2; tail -15 "$f" >&2; }; done
  rm -rf "$tmp"
  exit $rc
}
trap cleanup EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }
step() { awk -v a="$start_s" -v b="$(date +%s.%N)" -v m="$*" 'BEGIN { printf "[%5.1f s] %s\n", b - a, m }'; }

# Polls "$@" until it succeeds, fails for good (status 2) or $1 seconds pass.
wait_for() {
  local deadline=$(($(date +%s) + $1)) rc
  shift
  while true; do
    rc=0
    "$@" || rc=$?
    ((rc == 0)) && return 0
    ((rc == 2)) && return 2
    (($(date +%s) < deadline)) || return 1
    sleep 0.1
  done
}

# --- the network: a bridge in the hub namespace, one veth pair per namespace
hub=$tag-hub
ip netns add "$hub" || skip_or_fail "ip netns add failed (no CAP_SYS_ADMIN or no netns support)"
namespaces+=("$hub")
ip -n "$hub" link set lo up
ip -n "$hub" link add br0 type bridge
ip -n "$hub" link set br0 up

declare -A veth_of   # address -> hub-side veth
# add_ns NAME ADDRESS: a namespace on the bridge with ADDRESS/24 on its eth0.
add_ns() {
  local ns=$tag-$1 addr=$2 vh vn
  veth_count=$((veth_count + 1))
  vh=tv$$h$veth_count vn=tv$$n$veth_count
  ip netns add "$ns"
  namespaces+=("$ns")
  ip link add "$vh" type veth peer name "$vn"
  ip link set "$vh" netns "$hub"
  ip link set "$vn" netns "$ns"
  ip -n "$hub" link set "$vh" master br0 up
  ip -n "$ns" link set "$vn" name eth0
  ip -n "$ns" addr add "$addr/24" dev eth0
  ip -n "$ns" link set eth0 up
  ip -n "$ns" link set lo up
  veth_of[$addr]=$vh
}
client=$tag-client
add_ns client 10.77.0.100
in_client() { ip netns exec "$client" "$@"; }

# --- the model and the single-process reference on the client's loopback
"$tandem" make-model --preset micro --out "$tmp/micro.gguf" >"$tmp/make-model.log" 2>&1 || fail "make-model failed"
in_client "$tandem" serve --model "$tmp/micro.gguf" --host 127.0.0.1 --port 8080 --rpc-port 8081 --kv-cache-mb 16 \
  >"$tmp/reference.log" 2>&1 &
pids+=($!)

prompts=("Once upon a time" "The quick brown fox" "hello")
# completion HOST PORT PROMPT [CURL_OPTION...]: the greedy completion text (16 tokens), from the
# client namespace.
completion() {
  local body
  body=$(jq -cn --arg p "$3" '{prompt: $p, max_tokens: 16, temperature: 0}')
  in_client curl -sS --fail-with-body --max-time 20 -H "Content-Type: application/json" "${@:4}" "http://$1:$2/v1/completions" -d "$body" | jq -er '.choices[0].text'
}
health() { in_client curl -sf --max-time 2 "http://$1:$2/health" -o /dev/null; }
wait_for 30 health 127.0.0.1 8080 || fail "the reference server did not become healthy"
declare -A reference
for p in "${prompts[@]}"; do
  reference[$p]=$(completion 127.0.0.1 8080 "$p") || fail "reference completion"
  [[ -n ${reference[$p]} ]] || fail "the reference completion of '$p' is empty"
done
reference_rpc=$(in_client "$tandem" generate --host 127.0.0.1 --port 8081 --prompt "${prompts[0]}" --max-tokens 16 --temperature 0 \
  2>>"$tmp/generate.log") || fail "reference tandem generate"
[[ -n $reference_rpc ]] || fail "the reference tandem generate output is empty"
step "reference ready (single process on the client's loopback)"

# start_nodes CONFIG...: every node of the configs in its own namespace at its host address.
declare -A node_addr node_roles node_http node_admin node_pid
start_nodes() {
  local c listing name host _numa roles http _rpc admin _rest
  for c in "$@"; do
    listing=$("$tandem" check-config --list-nodes "$c" 2>"$tmp/check-config.log") ||
      fail "$c is invalid: $(cat "$tmp/check-config.log")"
    while IFS=$'\t' read -r name host _numa roles http _rpc admin _rest; do
      [[ $host == 10.77.0.* ]] || fail "node $name of $c has host $host; the harness needs 10.77.0.x"
      add_ns "$name" "$host"
      ip netns exec "$tag-$name" env UCX_TLS=tcp UCX_TCP_CM_REUSEADDR=y \
        "$tandem" serve --config "$c" --node "$name" >"$tmp/$name.log" 2>&1 &
      pids+=($!)
      node_addr[$name]=$host node_roles[$name]=$roles node_http[$name]=$http node_admin[$name]=$admin node_pid[$name]=$!
    done <<<"$listing"
  done
}
node_healthy() {
  local n=$1
  kill -0 "${node_pid[$n]}" 2>/dev/null || return 2
  if [[ ,${node_roles[$n]}, == *,router,* ]]; then
    health "${node_addr[$n]}" "${node_http[$n]}"
  else
    in_client "$tandem" inspect "${node_addr[$n]}:${node_admin[$n]}" --json --count 1 2>/dev/null | grep -q '"healthy":true'
  fi
}
wait_nodes() {
  local n rc
  for n in "$@"; do
    rc=0
    wait_for 30 node_healthy "$n" || rc=$?
    ((rc != 2)) || fail "node $n (${node_addr[$n]}) exited; see $n.log below"
    ((rc == 0)) || fail "node $n (${node_addr[$n]}) is not healthy within 30 s; see $n.log below"
  done
}
link() { ip -n "$hub" link set "${veth_of[${node_addr[$1]}]}" "$2"; }
check_same() {
  local where=$1 host=$2 port=$3 p got
  for p in "${prompts[@]}"; do
    got=$(completion "$host" "$port" "$p") || fail "completion '$p' on $where failed"
    [[ $got == "${reference[$p]}" ]] || fail "$where: '$p' -> '$got', the single process gives '${reference[$p]}'"
  done
}

# --- scenario: two all-roles nodes
node_config() {  # NAME ADDRESS
  cat >"$tmp/$1.toml" <<EOF
[limits]
kv_cache_mb = 16
[model]
path = "$tmp/micro.gguf"
[[node]]
name = "$1"
host = "$2"
roles = ["router", "prefill", "decode", "cache", "worker"]
http_port = 8080
rpc_port = 8081
admin_port = 8082
EOF
}
node_config n0 10.77.0.2
node_config n1 10.77.0.3
start_nodes "$tmp/n0.toml" "$tmp/n1.toml"
wait_nodes n0 n1
step "replicas: n0 (10.77.0.2) and n1 (10.77.0.3) healthy"
for n in n0 n1; do
  check_same "$n" "${node_addr[$n]}" 8080
  got=$(in_client "$tandem" generate --host "${node_addr[$n]}" --port 8081 --prompt "${prompts[0]}" --max-tokens 16 --temperature 0 \
    2>>"$tmp/generate.log") ||
    fail "tandem generate on $n failed"
  [[ $got == "$reference_rpc" ]] || fail "$n: tandem generate gives '$got', the single process '$reference_rpc'"
done
step "replicas: greedy output over veth (HTTP and RPC) equals the single process"

link n1 down
if err=$(completion 10.77.0.3 8080 "${prompts[0]}" --connect-timeout 2 --max-time 4 2>&1); then fail "a request to n1 succeeded with its link down: $err"; fi
[[ $err == *"curl: ("* ]] || fail "no clear error for n1 with its link down: '$err'"
echo "  n1 link down: request fails: $err"
check_same "n0 while n1 is down" 10.77.0.2 8080
link n1 up
wait_for 10 health 10.77.0.3 8080 || fail "n1 does not answer within 10 s after its link is up"
check_same "n1 after link up" 10.77.0.3 8080
step "replicas: n1 link down -> requests fail, n0 serves; link up -> n1 serves the same output"

# --- scenario: deploy/launch-cluster.sh run from the client namespace, its ssh going into the
#     node namespaces (a fake ssh: `ip netns exec`), health-checking the nodes over veth
src=$(cd "$(dirname "$0")/../.." && pwd)
node_config l0 10.77.0.4
node_config l1 10.77.0.5
add_ns l0 10.77.0.4
add_ns l1 10.77.0.5
printf '10.77.0.4 %s\n10.77.0.5 %s\n' "$tag-l0" "$tag-l1" >"$tmp/hosts"
cat >"$tmp/fake-ssh" <<'SH'
#!/usr/bin/env bash
while [[ $1 == -o ]]; do shift 2; done
ns=$(awk -v h="$1" '$1 == h { print $2 }' "$NETNS_HOSTS")
[[ -n $ns ]] || { echo "fake ssh: no namespace for host $1" >&2; exit 255; }
exec ip netns exec "$ns" sh -c "$2"
SH
cat >"$tmp/fake-scp" <<'SH'
#!/usr/bin/env bash
while [[ $1 == -o || $1 == -q ]]; do [[ $1 == -o ]] && shift; shift; done
cp "$1" "${2#*:}"
SH
chmod +x "$tmp/fake-ssh" "$tmp/fake-scp"
launch() {
  in_client env TANDEM_BIN="$tandem" TANDEM_REMOTE_BIN="$tandem" TANDEM_SSH="$tmp/fake-ssh" TANDEM_SCP="$tmp/fake-scp" \
    NETNS_HOSTS="$tmp/hosts" "$src/deploy/launch-cluster.sh" "$@" --run-dir "$tmp/launch"
}
launch "$tmp/l0.toml" "$tmp/l1.toml" --timeout 30 >"$tmp/launch.log" 2>&1 || fail "launch-cluster.sh over (fake) ssh into the namespaces failed"
[[ -n $(ip netns pids "$tag-l0") && -n $(ip netns pids "$tag-l1") ]] || fail "launch-cluster.sh did not start the nodes in their namespaces"
check_same l0 10.77.0.4 8080
check_same l1 10.77.0.5 8080
launch x --status >"$tmp/launch-status.log" 2>&1 || fail "launch-cluster.sh --status: $(cat "$tmp/launch-status.log")"
launch x --stop >>"$tmp/launch.log" 2>&1 || fail "launch-cluster.sh --stop"
[[ -z $(ip netns pids "$tag-l0") && -z $(ip netns pids "$tag-l1") ]] || fail "processes left in l0/l1 after --stop"
step "launch: launch-cluster.sh started l0, l1 in their namespaces (health over veth), same output, stopped them"

# --- scenario: prefill/decode disaggregation across three namespaces
if [[ ${TANDEM_NETNS_PD:-1} == 1 ]]; then
  cat >"$tmp/pd.toml" <<EOF
[limits]
kv_cache_mb = 16
request_timeout_ms = 10000
[model]
path = "$tmp/micro.gguf"
[transfer]
failure_policy = "fail"
timeout_ms = 2000
[[node]]
name = "router"
host = "10.77.0.11"
roles = ["router"]
http_port = 8080
rpc_port = 8081
admin_port = 8082
cluster_port = 9000
[[node]]
name = "prefill"
host = "10.77.0.12"
roles = ["prefill", "cache", "worker"]
http_port = 8080
rpc_port = 8081
admin_port = 8082
cluster_port = 9000
kv_port = 9001
[[node]]
name = "decode"
host = "10.77.0.13"
roles = ["decode", "cache", "worker"]
http_port = 8080
rpc_port = 8081
admin_port = 8082
cluster_port = 9000
kv_port = 9001
EOF
  start_nodes "$tmp/pd.toml"
  wait_nodes prefill decode router
  step "pd: router, prefill, decode healthy"
  check_same "pd cluster" 10.77.0.11 8080
  step "pd: greedy output across three namespaces equals the single process"
  link prefill down
  code=$(in_client curl -sS --max-time 30 -o "$tmp/pd-down.json" -w '%{http_code}' http://10.77.0.11:8080/v1/completions \
    -H "Content-Type: application/json" \
    -d '{"prompt":"hello","max_tokens":16,"temperature":0}') || fail "the router did not answer with prefill's link down"
  ((code >= 500)) || fail "with prefill's link down the router answered $code: $(cat "$tmp/pd-down.json")"
  msg=$(jq -er '.error.message' "$tmp/pd-down.json") || fail "no error message: $(cat "$tmp/pd-down.json")"
  echo "  prefill link down: HTTP $code: $msg"
  link prefill up
  wait_for 20 node_healthy prefill || fail "prefill is not healthy within 20 s after its link is up"
  ok_after() { completion 10.77.0.11 8080 "${prompts[0]}" >/dev/null 2>&1; }
  wait_for 20 ok_after || fail "the pd cluster does not serve within 20 s after prefill's link is up"
  check_same "pd cluster after link up" 10.77.0.11 8080
  step "pd: prefill link down -> HTTP error; link up -> same output again"

  # Link flaps in a seeded random order (TANDEM_NETNS_SEED replays one), each 0.3 s down while
  # two requests are in flight. Every request ends once: 200 with the single process's text, or
  # an HTTP error with a JSON message. Then both pools are whole and every node is alive.
  pages_free() { in_client curl -sf --max-time 2 "http://${node_addr[$1]}:8080/metrics" | awk '$1 == "tandem_kv_pages_free" { print $2 }'; }
  quiet() {  # NODE PAGES: the node's pool is whole and no transfer holds pages
    local m
    m=$(in_client curl -sf --max-time 2 "http://${node_addr[$1]}:8080/metrics") || return 1
    awk -v want="$2" '$1 == "tandem_kv_pages_free" && $2 == want { f = 1 }
      ($1 == "tandem_kv_transfer_live" || $1 == "tandem_kv_transfer_quarantined_pages") && $2 != 0 { bad = 1 }
      END { exit !(f && !bad) }' <<<"$m"
  }
  free_prefill=$(pages_free prefill) free_decode=$(pages_free decode)
  [[ -n $free_prefill && -n $free_decode ]] || fail "no tandem_kv_pages_free on prefill/decode"
  seed=${TANDEM_NETNS_SEED:-20261203}
  RANDOM=$seed
  order=(prefill decode router prefill decode router)
  for ((i = ${#order[@]} - 1; i > 0; i--)); do
    j=$((RANDOM % (i + 1)))
    t=${order[i]} order[i]=${order[j]} order[j]=$t
  done
  flap_ok=0 flap_err=0
  for f in "${!order[@]}"; do
    n=${order[f]}
    fpids=()
    for k in 0 1; do
      body=$(jq -cn --arg p "${prompts[k]}" '{prompt: $p, max_tokens: 16, temperature: 0}')
      in_client curl -sS --max-time 20 -o "$tmp/flap-$f-$k.json" -w '%{http_code}' -H "Content-Type: application/json" \
        http://10.77.0.11:8080/v1/completions -d "$body" >"$tmp/flap-$f-$k.code" 2>>"$tmp/flap-curl.log" &
      fpids+=($!)
    done
    link "$n" down
    sleep 0.3  # the fault's duration, not a wait for a condition
    link "$n" up
    for p in "${fpids[@]}"; do wait "$p" || fail "flap $f ($n): a request got no HTTP answer within 20 s: $(cat "$tmp/flap-curl.log")"; done
    for k in 0 1; do
      code=$(cat "$tmp/flap-$f-$k.code")
      if [[ $code == 200 ]]; then
        got=$(jq -er '.choices[0].text' "$tmp/flap-$f-$k.json") || fail "flap $f ($n): 200 without a completion"
        [[ $got == "${reference[${prompts[k]}]}" ]] || fail "flap $f ($n): '${prompts[k]}' -> '$got', the single process gives '${reference[${prompts[k]}]}'"
        flap_ok=$((flap_ok + 1))
      else
        ((code >= 400)) || fail "flap $f ($n): HTTP $code"
        jq -er '.error.message' "$tmp/flap-$f-$k.json" >/dev/null || fail "flap $f ($n): HTTP $code without an error message"
        flap_err=$((flap_err + 1))
      fi
    done
  done
  wait_for 20 quiet prefill "$free_prefill" || fail "prefill's pool is not whole after the flaps ($(pages_free prefill) of $free_prefill pages free)"
  wait_for 20 quiet decode "$free_decode" || fail "decode's pool is not whole after the flaps ($(pages_free decode) of $free_decode pages free)"
  for n in router prefill decode; do kill -0 "${node_pid[$n]}" 2>/dev/null || fail "node $n died during the link flaps"; done
  wait_for 20 ok_after || fail "the pd cluster does not serve within 20 s after the flaps"
  check_same "pd cluster after the flaps" 10.77.0.11 8080
  step "pd: ${#order[@]} link flaps (seed $seed: ${order[*]}): $flap_ok requests completed, $flap_err ended with an HTTP error; pools whole, every node alive"
else
  echo "  (pd scenario skipped: TANDEM_NETNS_PD=0)"
fi
step "ok"
