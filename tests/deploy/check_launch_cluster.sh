#!/usr/bin/env bash
# deploy/launch-cluster.sh on this machine: an invalid config starts nothing; two all-roles
# nodes (one config each) start with --local on loopback ports, answer /health and a
# completion, show in --status, stop one by one and all; a node that cannot start is named with
# its log tail and the node started before it is stopped; the ssh path (fake ssh/scp that run
# here) copies the config and starts the node the same way. No process is left behind.
# usage: check_launch_cluster.sh TANDEM_BINARY SOURCE_DIR
set -euo pipefail
tandem=$(realpath "$1")
src=$2
launch=$src/deploy/launch-cluster.sh
export TANDEM_BIN=$tandem

tmp=$(mktemp -d)
cleanup() {
  # Whatever a failed check left running: stop it through the script, then make sure.
  for d in "$tmp"/run*; do [[ -f $d/nodes.tsv ]] && TANDEM_STOP_TIMEOUT=5 "$launch" x --local --stop --run-dir "$d" >/dev/null 2>&1 || true; done
  rm -rf "$tmp"
}
trap cleanup EXIT
fail() {
  echo "FAIL: $*" >&2
  for f in "$tmp"/*.out "$tmp"/run*/*.log; do [[ -f $f ]] && { echo "--- $f" >&2; tail -20 "$f" >&2; }; done
  exit 1
}
# A live process (an exited one may be a zombie until init reaps it).
alive() { local st; st=$(ps -o stat= -p "$1" 2>/dev/null) && [[ $st != Z* ]]; }
# Processes serving a config of this test.
leftovers() {
  local p
  for p in $(pgrep -f -- "--config $tmp/"); do alive "$p" && echo "$p"; done
  true
}

# Six free loopback ports per node (two nodes, one spare per test step).
port_free() { ! (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }
# claim_port P: an exclusive flock on the file the e2e tests' free_tcp_port (tests/e2e/ports.h)
# locks, so a test running beside this script never picks the same port; held until exit.
claim_port() {
  local dir=${TMPDIR:-/tmp}/tandem-test-ports fd
  mkdir -p "$dir" 2>/dev/null || return 0
  exec {fd}>>"$dir/$1" || return 0
  flock -n "$fd" && return 0
  exec {fd}>&-
  return 1
}
base=0
for _ in $(seq 1 50); do
  b=$((20000 + (RANDOM % 1200) * 10))  # below the ephemeral range (32768+) that clients take ports from
  ok=1
  for p in $(seq "$b" $((b + 9))); do port_free "$p" && claim_port "$p" || { ok=0; break; }; done
  ((ok)) && { base=$b; break; }
done
((base)) || fail "no 10 free consecutive loopback ports found"

"$tandem" make-model --preset micro --out "$tmp/micro.gguf" >/dev/null 2>&1 || fail "make-model failed"
# node_config NAME HTTP_PORT [MODEL]: a single all-roles node (an embedded cluster).
node_config() {
  cat >"$tmp/$1.toml" <<TOML
[limits]
kv_cache_mb = 16
[model]
path = "${3:-$tmp/micro.gguf}"
[[node]]
name = "$1"
host = "127.0.0.1"
roles = ["router", "prefill", "decode", "cache", "worker"]
http_port = $2
rpc_port = $(($2 + 1))
admin_port = $(($2 + 2))
TOML
}
node_config a "$base"
node_config b $((base + 3))

# 1. invalid config: check-config's message, exit 1, nothing started.
sed 's/"worker"/"wrker"/' "$tmp/a.toml" >"$tmp/bad.toml"
if "$launch" "$tmp/bad.toml" --local --run-dir "$tmp/run-bad" >"$tmp/bad.out" 2>&1; then fail "an invalid config was launched"; fi
grep -q "unknown role; did you mean 'worker'?" "$tmp/bad.out" || fail "check-config's message is not shown"
grep -q "is invalid (see above); nothing was started" "$tmp/bad.out" || fail "no refusal line"
[[ -z $(ls "$tmp/run-bad") ]] || fail "an invalid config left files in the run dir: $(ls "$tmp/run-bad")"
[[ -z $(leftovers) ]] || fail "an invalid config started a process"

# 2. two nodes: start, health, a completion each, status.
run=$tmp/run
"$launch" "$tmp/a.toml" "$tmp/b.toml" --local --run-dir "$run" --timeout 60 >"$tmp/start.out" 2>&1 || fail "start failed"
grep -q "a is healthy" "$tmp/start.out" && grep -q "b is healthy" "$tmp/start.out" || fail "start did not report both nodes healthy"
for p in "$base" $((base + 3)); do
  curl -sf "http://127.0.0.1:$p/health" -o /dev/null || fail "/health of port $p"
  curl -sf -H 'Content-Type: application/json' "http://127.0.0.1:$p/v1/completions" -d '{"prompt":"hello","max_tokens":4,"temperature":0}' | grep -q '"finish_reason":"length"' ||
    fail "completion on port $p"
done
"$launch" x --local --status --run-dir "$run" >"$tmp/status.out" || fail "--status of two healthy nodes is not 0"
[[ $(grep -cE '^(a|b) +127\.0\.0\.1 .* healthy$' "$tmp/status.out") == 2 ]] || fail "--status does not show both healthy: $(cat "$tmp/status.out")"
pid_a=$(cat "$run/a.pid") pid_b=$(cat "$run/b.pid")

# 3. starting again leaves running nodes alone; --stop --nodes b stops only b.
"$launch" "$tmp/a.toml" "$tmp/b.toml" --local --run-dir "$run" >"$tmp/again.out" 2>&1 || fail "second start failed"
grep -q "a is already running (pid $pid_a)" "$tmp/again.out" || fail "second start did not see a running"
"$launch" x --local --stop --nodes b --run-dir "$run" >"$tmp/stop-b.out" || fail "--stop --nodes b"
grep -q "b: stopped (pid $pid_b)" "$tmp/stop-b.out" || fail "b was not stopped"
! alive "$pid_b" || fail "b (pid $pid_b) still runs after --stop"
alive "$pid_a" || fail "--stop --nodes b stopped a"
if "$launch" x --local --status --run-dir "$run" >"$tmp/status2.out"; then fail "--status is 0 with b down"; fi
grep -qE '^b +127\.0\.0\.1 .* not running$' "$tmp/status2.out" || fail "--status does not show b down"
"$launch" x --local --stop --run-dir "$run" >/dev/null || fail "--stop"
! alive "$pid_a" || fail "a (pid $pid_a) still runs after --stop"

# 4. a node whose model file is missing: check-config refuses it, nothing starts. A node that
#    passes the check but cannot start (it binds an address this machine does not have): named, its log shown, and the node
#    started before it in this run is stopped again.
node_config m $((base + 6)) "$tmp/missing.gguf"
if "$launch" "$tmp/a.toml" "$tmp/m.toml" --local --run-dir "$tmp/run-nomodel" >"$tmp/nomodel.out" 2>&1; then fail "a config with a missing model was launched"; fi
grep -q "missing.gguf\": no such file; node 'm' runs on this machine" "$tmp/nomodel.out" || fail "the missing model is not named"
grep -q "is invalid (see above); nothing was started" "$tmp/nomodel.out" || fail "no refusal line for the missing model"
[[ -z $(leftovers) ]] || fail "a config with a missing model started a process"
node_config e $((base + 6))
sed -i 's/^host = .*/host = "192.0.2.1"/' "$tmp/e.toml"  # TEST-NET-1: not an address of this machine
if "$launch" "$tmp/a.toml" "$tmp/e.toml" --local --run-dir "$tmp/run-fail" --timeout 30 >"$tmp/fail.out" 2>&1; then fail "a broken node was reported started"; fi
grep -q "node e (192.0.2.1) failed: exited" "$tmp/fail.out" || fail "the failed node is not named"
grep -q -- "--- last lines of e's log" "$tmp/fail.out" || fail "the failed node's log tail is not shown"
grep -q "a: stopped" "$tmp/fail.out" || fail "the node started before the failure was not stopped"

# 4b. [security] api_key_file: the readiness checks read the key from the file the config
#     names (no TANDEM_API_KEY exported), also where /health/ready itself needs the key.
unset TANDEM_API_KEY
openssl rand -hex 32 >"$tmp/keys" 2>/dev/null || head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$tmp/keys"
chmod 600 "$tmp/keys"
node_config k $((base + 6))
printf '[security]\napi_key_file = "%s"\nauth_allowlist = ["/health"]\n' "$tmp/keys" >>"$tmp/k.toml"
"$launch" "$tmp/k.toml" --local --run-dir "$tmp/run-key" --timeout 60 >"$tmp/key.out" 2>&1 || fail "a node with api_key_file did not start"
grep -q "k is healthy" "$tmp/key.out" || fail "the node with api_key_file is not reported healthy"
"$launch" x --local --status --run-dir "$tmp/run-key" >"$tmp/key-status.out" || fail "--status of a node with api_key_file"
chmod 000 "$tmp/keys"
if [[ ! -r $tmp/keys ]]; then  # (root reads it anyway)
  if "$launch" x --local --status --run-dir "$tmp/run-key" >"$tmp/key-status2.out" 2>&1; then fail "--status passes without a readable key"; fi
  grep -q "api_key_file = $tmp/keys, which is not readable here" "$tmp/key-status2.out" || fail "the unreadable key file is not named: $(cat "$tmp/key-status2.out")"
fi
chmod 600 "$tmp/keys"
"$launch" x --local --stop --run-dir "$tmp/run-key" >/dev/null || fail "--stop of the node with api_key_file"

# 4c. the binary: without TANDEM_BIN, a build of the repository the script is in, or PATH; a
#     clear message when there is none.
mkdir -p "$tmp/repo/build/dev/tools" "$tmp/bare"
cp -r "$src/deploy" "$tmp/repo/"
cp -r "$src/deploy" "$tmp/bare/"
ln -s "$tandem" "$tmp/repo/build/dev/tools/tandem"
(unset TANDEM_BIN && PATH=/usr/bin:/bin "$tmp/repo/deploy/launch-cluster.sh" "$tmp/a.toml" --local --status --run-dir "$tmp/run-bin" >"$tmp/bin.out" 2>&1) || true
grep -q "not running" "$tmp/bin.out" || fail "launch-cluster does not find build/dev/tools/tandem of its repository: $(cat "$tmp/bin.out")"
if (unset TANDEM_BIN && PATH=/usr/bin:/bin "$tmp/bare/deploy/launch-cluster.sh" "$tmp/a.toml" --local --status >"$tmp/nobin.out" 2>&1); then fail "launch-cluster ran without a tandem binary"; fi
grep -q "no tandem binary found" "$tmp/nobin.out" && grep -q "cmake --install build/default" "$tmp/nobin.out" || fail "no clear message without a binary: $(cat "$tmp/nobin.out")"

# 5. the ssh path: fake ssh/scp that run here, recording the hosts they were given.
cat >"$tmp/fake-ssh" <<'SH'
#!/usr/bin/env bash
while [[ $1 == -o ]]; do shift 2; done
echo "$1" >>"$FAKE_SSH_LOG"; shift
exec sh -c "$1"
SH
cat >"$tmp/fake-scp" <<'SH'
#!/usr/bin/env bash
while [[ $1 == -o || $1 == -q ]]; do [[ $1 == -o ]] && shift; shift; done
echo "scp ${2%%:*}" >>"$FAKE_SSH_LOG"
cp "$1" "${2#*:}"
SH
chmod +x "$tmp/fake-ssh" "$tmp/fake-scp"
export FAKE_SSH_LOG=$tmp/ssh.log TANDEM_SSH=$tmp/fake-ssh TANDEM_SCP=$tmp/fake-scp TANDEM_REMOTE_BIN=$tandem
"$launch" "$tmp/b.toml" --run-dir "$tmp/run-ssh" >"$tmp/ssh.out" 2>&1 || fail "start over (fake) ssh"
grep -q "b is healthy" "$tmp/ssh.out" || fail "b not healthy over ssh"
[[ -f $tmp/run-ssh/b.toml ]] || fail "the config was not copied to the host"
grep -q "^scp 127.0.0.1$" "$FAKE_SSH_LOG" && grep -q "^127.0.0.1$" "$FAKE_SSH_LOG" || fail "ssh/scp were not given the node's host"
pgrep -f -- "--config $tmp/run-ssh/b.toml --node b" >/dev/null || fail "the node does not run the copied config"
"$launch" x --stop --run-dir "$tmp/run-ssh" >/dev/null || fail "--stop over ssh"
unset TANDEM_SSH TANDEM_SCP

[[ -z $(leftovers) ]] || fail "processes left: $(leftovers)"
echo "ok: launch-cluster.sh start/status/stop, failure report, ssh path; no process left"
