#!/usr/bin/env bash
# deploy/systemd: install-units.sh writes a node's env file from `check-config --list-nodes`
# (numactl binding from numa_node) and refuses an invalid config or an unknown node; the
# installed units pass `systemd-analyze verify` without a single warning (a broken copy does
# not: the check can fail) and carry the crash-loop settings; their ExecStartPre fails on a bad
# config with check-config's message; their ExecStart (as systemd expands it, run here) starts
# a healthy node under numactl; a config error (a missing model file) exits 78 from
# ExecStartPre and from serve, which RestartPreventExitStatus= keeps from restarting.
# usage: check_systemd_units.sh TANDEM_BINARY SOURCE_DIR. Exit 77 (skipped) only without
# systemd-analyze (Debian's systemd package; deploy/install-deps.sh installs it).
set -euo pipefail
tandem=$(realpath "$1")
src=$2
install=$src/deploy/systemd/install-units.sh
if ! command -v systemd-analyze >/dev/null; then
  echo "SKIPPED: systemd-analyze is not installed (Debian package systemd; deploy/install-deps.sh installs it)"
  exit 77
fi
command -v numactl >/dev/null || { echo "FAIL: numactl is not installed (deploy/install-deps.sh installs it)" >&2; exit 1; }

tmp=$(mktemp -d)
pid=""
cleanup() {
  [[ -n $pid ]] && { kill "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true; }
  rm -rf "$tmp"
}
trap cleanup EXIT
fail() {
  echo "FAIL: $*" >&2
  for f in "$tmp"/*.out "$tmp"/*.log; do [[ -f $f ]] && { echo "--- $f" >&2; tail -20 "$f" >&2; }; done
  exit 1
}
units=$tmp/units envs=$tmp/env

port_free() { ! (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }
base=0
for _ in $(seq 1 50); do
  b=$((20000 + (RANDOM % 1200) * 10))  # below the ephemeral range (32768+) that clients take ports from
  port_free "$b" && port_free $((b + 1)) && port_free $((b + 2)) && { base=$b; break; }
done
((base)) || fail "no free loopback ports"
"$tandem" make-model --preset micro --out "$tmp/micro.gguf" >/dev/null 2>&1 || fail "make-model failed"
cat >"$tmp/solo.toml" <<TOML
[limits]
kv_cache_mb = 16
[model]
path = "$tmp/micro.gguf"
[[node]]
name = "solo"
host = "127.0.0.1"
roles = ["router", "prefill", "decode", "cache", "worker"]
http_port = $base
rpc_port = $((base + 1))
admin_port = $((base + 2))
numa_node = 0
TOML
cat >"$tmp/pd.toml" <<'TOML'
[[node]]
name = "r"
host = "10.0.0.1"
roles = ["router"]
cluster_port = 9000
[[node]]
name = "p"
host = "10.0.0.2"
roles = ["prefill", "cache", "worker"]
numa_node = 1
cluster_port = 9000
kv_port = 9001
[[node]]
name = "d"
host = "10.0.0.3"
roles = ["decode", "cache", "worker"]
cluster_port = 9000
TOML

# 1. env files: the config, the node and its numactl binding.
for n in p d; do
  "$install" "$tmp/pd.toml" "$n" --bin "$tandem" --unit-dir "$units" --env-dir "$envs" >"$tmp/install-$n.out" 2>&1 ||
    fail "install-units pd.toml $n"
done
"$install" "$tmp/solo.toml" solo --bin "$tandem" --unit-dir "$units" --env-dir "$envs" >"$tmp/install-solo.out" 2>&1 ||
  fail "install-units solo.toml solo"
grep -qx "TANDEM_CONFIG=\"$tmp/pd.toml\"" "$envs/p.env" && grep -qx "TANDEM_NODE=p" "$envs/p.env" || fail "p.env: $(cat "$envs/p.env")"
grep -qx 'TANDEM_NUMACTL_ARGS="--cpunodebind=1 --membind=1"' "$envs/p.env" || fail "p.env has not numa_node 1's binding"
grep -qx 'TANDEM_NUMACTL_ARGS="--localalloc"' "$envs/d.env" || fail "d.env (numa_node -1) is not unpinned"
grep -q "ExecStart=/usr/bin/numactl \$TANDEM_NUMACTL_ARGS $tandem serve" "$units/tandem-node@.service" || fail "the unit does not run this tandem"

# 2. refusals: an invalid config, an unknown node.
sed 's/"decode", "cache"/"decoder", "cache"/' "$tmp/pd.toml" >"$tmp/bad.toml"
if "$install" "$tmp/bad.toml" x --bin "$tandem" --unit-dir "$tmp/u2" --env-dir "$tmp/e2" >"$tmp/bad.out" 2>&1; then fail "an invalid config was installed"; fi
grep -q "unknown role; did you mean 'decode'?" "$tmp/bad.out" || fail "check-config's message is not shown"
[[ ! -e $tmp/e2 ]] || fail "an invalid config wrote files"
if "$install" "$tmp/pd.toml" zz --bin "$tandem" --unit-dir "$tmp/u2" --env-dir "$tmp/e2" >"$tmp/unknown.out" 2>&1; then fail "an unknown node was installed"; fi
grep -q "has no node 'zz'; its nodes: r p d" "$tmp/unknown.out" || fail "the unknown node is not named"

# 3. systemd-analyze verify, on instances; any message is a failure (it only warns about bad values).
verify() {
  local out
  out=$(cd "$units" && systemd-analyze verify --man=no "$@" 2>&1) && [[ -z $out ]] || { echo "$out"; return 1; }
}
for n in p solo; do
  ln -sf tandem-node@.service "$units/tandem-node@$n.service"
  ln -sf tandem-node-failed@.service "$units/tandem-node-failed@$n.service"
done
out=$(verify tandem-node@p.service tandem-node-failed@p.service tandem-node@solo.service) || fail "systemd-analyze verify: $out"
sed 's/^Restart=on-failure/Restart=on-fialure/' "$units/tandem-node@.service" >"$units/broken@.service"
ln -sf broken@.service "$units/broken@p.service"
if verify broken@p.service >/dev/null; then fail "systemd-analyze verify accepts a broken unit: this check cannot fail"; fi
rm "$units"/broken@*
for want in '^Restart=on-failure$' '^StartLimitIntervalSec=[1-9]' '^StartLimitBurst=[1-9]' '^OnFailure=tandem-node-failed@%i.service$' \
  "^ExecStartPre=$tandem check-config --node \\\${TANDEM_NODE} \\\${TANDEM_CONFIG}\$" '^RestartPreventExitStatus=64 78$' '^LimitNOFILE=[1-9]' "^EnvironmentFile=$envs/%i.env\$"; do
  grep -qE "$want" "$units/tandem-node@.service" || fail "tandem-node@.service has no line matching $want"
done

# 4. The unit's commands as systemd expands them (${X}: one word; $X: split at spaces).
expand() {  # UNIT_KEY ENV_FILE
  sed -n "s/^$1=//p" "$units/tandem-node@.service" | sed -e 's/^-//'
}
run_unit_cmd() {  # KEY ENV_FILE
  # shellcheck disable=SC1090  # the env file install-units.sh wrote
  (set -a && . "$2" && set +a && eval "exec $(expand "$1")")
}
cp "$envs/p.env" "$tmp/bad.env"
sed -i "s|^TANDEM_CONFIG=.*|TANDEM_CONFIG=\"$tmp/bad.toml\"|" "$tmp/bad.env"
if run_unit_cmd ExecStartPre "$tmp/bad.env" >"$tmp/pre.out" 2>&1; then fail "ExecStartPre passes a bad config"; fi
grep -q "unknown role; did you mean 'decode'?" "$tmp/pre.out" || fail "ExecStartPre does not show check-config's message"
run_unit_cmd ExecStartPre "$envs/solo.env" >"$tmp/pre-ok.out" 2>&1 || fail "ExecStartPre fails on a valid config"

# 5. The restart decision of the unit, as systemd makes it (Restart=on-failure with
#    RestartPreventExitStatus=, systemd.service(5)): a config error stops the unit at once, a
#    crash is restarted (until the start limit). Simulated on the unit's own lines and the exit
#    codes tandem gives, so it runs without a running systemd.
restart_prevented() {  # CODE: is it in the unit's RestartPreventExitStatus=?
  local c
  for c in $(sed -n 's/^RestartPreventExitStatus=//p' "$units/tandem-node@.service"); do [[ $c == "$1" ]] && return 0; done
  return 1
}
would_restart() {  # CODE (128+N = killed by signal N)
  grep -qx 'Restart=on-failure' "$units/tandem-node@.service" || return 1
  [[ $1 != 0 ]] && ! restart_prevented "$1"
}
sed "s|^path = .*|path = \"$tmp/missing.gguf\"|" "$tmp/solo.toml" >"$tmp/nomodel.toml"
cp "$envs/solo.env" "$tmp/nomodel.env"
sed -i "s|^TANDEM_CONFIG=.*|TANDEM_CONFIG=\"$tmp/nomodel.toml\"|" "$tmp/nomodel.env"
code=0
run_unit_cmd ExecStartPre "$tmp/nomodel.env" >"$tmp/nomodel-pre.out" 2>&1 || code=$?
[[ $code == 78 ]] || fail "ExecStartPre on a missing model file exits $code, not 78 (EX_CONFIG)"
grep -q "missing.gguf\": no such file; node 'solo' runs on this machine" "$tmp/nomodel-pre.out" || fail "ExecStartPre does not name the missing model"
! would_restart "$code" || fail "the unit would restart after a config error (exit $code)"
code=0
run_unit_cmd ExecStart "$tmp/nomodel.env" >"$tmp/nomodel-serve.out" 2>&1 || code=$?
[[ $code == 78 ]] || fail "serve on a missing model file exits $code, not 78"
! would_restart "$code" || fail "the unit would restart after serve's config error (exit $code)"
code=0
run_unit_cmd ExecStartPre "$tmp/bad.env" >/dev/null 2>&1 || code=$?
[[ $code == 78 ]] && ! would_restart "$code" || fail "an invalid config exits $code and the unit would restart"
code=0
(set -a && . "$envs/solo.env" && set +a && exec "$tandem" serve --config "$TANDEM_CONFIG" --node "$TANDEM_NODE" --bogus) >/dev/null 2>&1 || code=$?
[[ $code == 64 ]] && ! would_restart "$code" || fail "a usage error exits $code and the unit would restart"
would_restart 1 || fail "the unit would not restart a node whose supervisor gave up (exit 1)"
would_restart 134 || fail "the unit would not restart a crash (SIGABRT)"
run_unit_cmd ExecStart "$envs/solo.env" >"$tmp/solo.log" 2>&1 &
pid=$!
for _ in $(seq 1 300); do
  curl -sf "http://127.0.0.1:$base/health" -o /dev/null && break
  kill -0 "$pid" 2>/dev/null || fail "ExecStart exited"
  sleep 0.1
done
# The background job is a subshell; the node is the process numactl exec'd into tandem.
node_pid=$(pgrep -n -f -- "serve --config $tmp/solo.toml --node solo") || fail "no tandem serve process of ExecStart"
kill "$pid" 2>/dev/null || true
pid=$node_pid
curl -sf "http://127.0.0.1:$base/health" -o /dev/null || fail "the node of ExecStart is not healthy within 30 s"
tr '\0' ' ' <"/proc/$pid/cmdline" | grep -q "serve --config $tmp/solo.toml --node solo" || fail "ExecStart's process is not tandem serve: $(tr '\0' ' ' <"/proc/$pid/cmdline")"
[[ $(awk '/^Cpus_allowed_list/ {print $2}' "/proc/$pid/status") == "$(cat /sys/devices/system/node/node0/cpulist)" ]] ||
  fail "the node is not bound to NUMA node 0's CPUs"
grep -q 'bind:0' "/proc/$pid/numa_maps" 2>/dev/null || fail "the node's memory is not bound to NUMA node 0"
echo "ok: env files, refusals, systemd-analyze verify, no restart on exit 64/78, ExecStartPre/ExecStart under numactl"
