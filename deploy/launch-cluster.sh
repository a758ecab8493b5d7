#!/usr/bin/env bash
# Starts, stops or shows the nodes of a cluster config (docs/config.md, docs/operations.md):
# each node is one `tandem serve --config FILE --node NAME`, over ssh on its `host`, or here
# with --local. The config is checked with `tandem check-config` first: on an invalid config
# nothing is started. Start waits for every node's readiness (/health/ready of a router node, the
# admin interface of the others) and, if one does not come up, names it, shows its log tail and
# stops what this run started. Several configs: their nodes together (e.g. replicas that are
# each an embedded cluster: one all-roles node per config); node names must differ.
#
# usage: deploy/launch-cluster.sh CONFIG... [--local] [--nodes a,b] [--stop | --status]
#                                 [--run-dir DIR] [--timeout SECONDS]
# environment:
#   TANDEM_BIN          tandem binary here (check-config, inspect, --local nodes); default: this
#                       repository's build/dev/tools/tandem or build/default/tools/tandem, else
#                       `tandem` on PATH (cmake --install build/default puts it there)
#   TANDEM_REMOTE_BIN   tandem binary on the hosts (ssh); default: tandem
#   TANDEM_SSH          ssh command; default: ssh
#   TANDEM_SSH_OPTS     options of ssh and scp; default: -o BatchMode=yes -o ConnectTimeout=10
#   TANDEM_SCP          scp command; default: scp
#   TANDEM_RUN_DIR      same as --run-dir; default: /tmp/tandem-cluster-<config name>
#   TANDEM_SERVE_ARGS   more `tandem serve` flags (e.g. --log-format json)
#   TANDEM_STOP_TIMEOUT seconds between SIGTERM and SIGKILL on --stop; default: 20
# The run dir holds, on the host of each node, NAME.pid and NAME.log (and the config over ssh:
# copied there with scp); here it holds nodes.tsv, the node list of the last start, which
# --stop and --status use so they work even after a config was edited. Over ssh, give
# model.path as an absolute path on the hosts (nodes run in the ssh user's home directory).
# With [security] api_key_file, the readiness checks send the file's first key (the file named
# by the config, read here; TANDEM_API_KEY overrides it).
# Exit: 0 ok; 1 invalid config, a node failed to start, or --status found a node down; 2 usage.
set -euo pipefail

usage() {
  sed -n '/^# usage:/,/^# Exit:/p' "$0" | sed 's/^# \{0,1\}//' >&2
  exit "${1:-2}"
}

configs=() local_mode=0 only="" action=start run_dir=${TANDEM_RUN_DIR:-} timeout_s=60
while (($#)); do
  case "$1" in
    --local) local_mode=1 ;;
    --nodes) only=${2:?--nodes needs a comma-separated list of node names}; shift ;;
    --nodes=*) only=${1#*=} ;;
    --stop) action=stop ;;
    --status) action=status ;;
    --run-dir) run_dir=${2:?--run-dir needs a directory}; shift ;;
    --run-dir=*) run_dir=${1#*=} ;;
    --timeout) timeout_s=${2:?--timeout needs seconds}; shift ;;
    --timeout=*) timeout_s=${1#*=} ;;
    -h | --help) usage 0 ;;
    -*) echo "launch-cluster: unknown option $1" >&2; usage ;;
    *) configs+=("$1") ;;
  esac
  shift
done
((${#configs[@]})) || { echo "launch-cluster: no config file given" >&2; usage; }
[[ $timeout_s =~ ^[0-9]+$ ]] || { echo "launch-cluster: --timeout $timeout_s is not a number of seconds" >&2; exit 2; }

# shellcheck source=deploy/find-tandem.sh
. "$(dirname "${BASH_SOURCE[0]}")/find-tandem.sh"
tandem=$(find_tandem) || { echo "launch-cluster: cannot run anything without tandem (see above)" >&2; exit 2; }
remote_tandem=${TANDEM_REMOTE_BIN:-tandem}
ssh_cmd=${TANDEM_SSH:-ssh}
scp_cmd=${TANDEM_SCP:-scp}
read -r -a ssh_opts <<<"${TANDEM_SSH_OPTS:--o BatchMode=yes -o ConnectTimeout=10}"
stop_timeout_s=${TANDEM_STOP_TIMEOUT:-20}
run_dir=${run_dir:-/tmp/tandem-cluster-$(basename "${configs[0]}" .toml)}
mkdir -p "$run_dir"
run_dir=$(cd "$run_dir" && pwd)

# --- the node list: `tandem check-config --list-nodes` (this script never parses TOML)
cfgs=() names=() hosts=() numas=() roles=() http_ports=() admin_ports=() key_files=()
load_nodes() {
  local cfg name host numa role http _rpc admin _ps keyf _rest
  while IFS=$'\t' read -r cfg name host numa role http _rpc admin _ps keyf _rest; do
    [[ -n $name ]] || continue
    cfgs+=("$cfg") names+=("$name") hosts+=("$host") numas+=("$numa") roles+=("$role") http_ports+=("$http") admin_ports+=("$admin")
    key_files+=("${keyf:--}")
  done <<<"$1"
}

# nodes.tsv: the config file of each node, then its --list-nodes line.
listing=""
if [[ $action == start || ! -f $run_dir/nodes.tsv ]]; then
  for c in "${configs[@]}"; do
    [[ -f $c ]] || { echo "launch-cluster: config file $c not found" >&2; exit 2; }
    abs=$(cd "$(dirname "$c")" && pwd)/$(basename "$c")
    # check-config's problems and notes go to our stderr as they are; stdout is the node list.
    if ! nodes=$("$tandem" check-config --list-nodes "$c"); then
      echo "launch-cluster: $c is invalid (see above); nothing was started or stopped" >&2
      exit 1
    fi
    while IFS= read -r line; do [[ -n $line ]] && listing+="$abs"$'\t'"$line"$'\n'; done <<<"$nodes"
  done
  [[ $action == start ]] && printf '%s' "$listing" >"$run_dir/nodes.tsv"
else
  listing=$(cat "$run_dir/nodes.tsv")
fi
load_nodes "$listing"
for i in "${!names[@]}"; do
  for j in "${!names[@]}"; do
    ((i < j)) && [[ ${names[$i]} == "${names[$j]}" ]] &&
      { echo "launch-cluster: node name '${names[$i]}' is in ${cfgs[$i]} and ${cfgs[$j]}; rename one" >&2; exit 1; }
  done
done

selected=()
if [[ -n $only ]]; then
  IFS=, read -r -a wanted <<<"$only"
  for w in "${wanted[@]}"; do
    found=0
    for i in "${!names[@]}"; do [[ ${names[$i]} == "$w" ]] && { selected+=("$i"); found=1; }; done
    ((found)) || { echo "launch-cluster: --nodes: no node '$w'; the nodes: ${names[*]}" >&2; exit 2; }
  done
else
  selected=("${!names[@]}")
fi

# --- running a shell command line on a node's machine
q() { printf '%q' "$1"; }
is_router() { [[ ,${roles[$1]}, == *,router,* ]]; }
# The address this script reaches node $1 at: its host, or loopback for a wildcard bind.
reach_host() {
  local h=${hosts[$1]}
  if [[ $h == 0.0.0.0 ]]; then ((local_mode)) && h=127.0.0.1 || h=""; fi
  printf '%s' "$h"
}
# on_node I CMDLINE: runs CMDLINE (POSIX sh) here with --local, else over ssh on node I's host.
on_node() {
  if ((local_mode)); then
    sh -c "$2"
  else
    "$ssh_cmd" "${ssh_opts[@]}" "$(reach_host "$1")" "$2"
  fi
}
pid_file() { printf '%s/%s.pid' "$run_dir" "${names[$1]}"; }
log_file() { printf '%s/%s.log' "$run_dir" "${names[$1]}"; }
# A sh function (for on_node scripts): `running` succeeds if the pid file names a live
# `tandem serve ... --node NAME` (not a zombie, not a reused pid).
running_fn() {
  cat <<EOF
running() {
  [ -f $(q "$(pid_file "$1")") ] || return 1
  pid=\$(cat $(q "$(pid_file "$1")"))
  [ -n "\$pid" ] || return 1
  st=\$(ps -o stat= -p "\$pid" 2>/dev/null) || return 1
  case "\$st" in Z*) return 1 ;; esac
  ps -o args= -p "\$pid" 2>/dev/null | grep -qE -- $(q "--node ${names[$1]}( |\$)")
}
EOF
}

# Listening port $2 (http|admin) of node $1: the config's, or the one its log names if 0.
node_port() {
  local p
  if [[ $2 == http ]]; then p=${http_ports[$1]}; else p=${admin_ports[$1]}; fi
  if [[ $p == 0 ]]; then
    p=$(on_node "$1" "grep -oE 'tandem: $2 listening on [^ ]+:[0-9]+\$' $(q "$(log_file "$1")") 2>/dev/null | tail -1" |
      sed -E 's/.*:([0-9]+)$/\1/') || true
  fi
  printf '%s' "$p"
}

# Readiness of node $1: a router node's GET /health/ready answers 200 (it has a live target of
# every role; /health only says the process is alive); another node's admin interface reports
# ready. Prints the reason on failure: "degraded: WHY" for a node that is alive but cannot serve.
healthy() {
  local h port body code key err
  h=$(reach_host "$1")
  key=$(api_key "$1") || return 1
  if is_router "$1"; then
    port=$(node_port "$1" http)
    [[ -n $port ]] || { echo "no http listening line in its log yet"; return 1; }
    local auth=()
    [[ -n $key ]] && auth=(-H "Authorization: Bearer $key")
    body=$(curl -s --max-time 2 "${auth[@]}" -w '\n%{http_code}' "http://$h:$port/health/ready") || { echo "GET http://$h:$port/health/ready does not answer"; return 1; }
    code=${body##*$'\n'}
    body=${body%$'\n'*}
    [[ $code == 200 ]] && return 0
    if [[ $body == *'"status":"degraded"'* || $body == *'"status":"draining"'* || $body == *'"status":"drained"'* ]]; then
      # A draining node's reason starts with "draining:" / "drained:" (tandem inspect --drain).
      echo "degraded: $(printf '%s' "$body" | sed -E 's/.*"reason":"(([^"\\]|\\.)*)".*/\1/')"
    else
      echo "GET http://$h:$port/health/ready answers $code: $body"
    fi
    return 1
  else
    port=$(node_port "$1" admin)
    [[ -n $port ]] || { echo "no admin listening line in its log yet"; return 1; }
    # inspect reads the key from TANDEM_API_KEY (its --api-key-file default).
    if ! body=$(TANDEM_API_KEY=$key "$tandem" inspect "$h:$port" --json --count 1 2>"$run_dir/.inspect.err"); then
      err=$(tail -n 1 "$run_dir/.inspect.err" 2>/dev/null)
      if [[ $err == *401* || $err == *nauthori* || $err == *"API key"* ]]; then
        echo "its admin interface $h:$port refuses our API key ($err): check [security] api_key_file or TANDEM_API_KEY"
      else
        echo "its admin interface $h:$port does not answer${err:+: $err}"
      fi
      return 1
    fi
    [[ $body == *'"ready":true'* ]] && return 0
    if [[ $body == *'"state":"degraded"'* || $body == *'"state":"draining"'* || $body == *'"state":"drained"'* ]]; then
      echo "degraded: $(printf '%s' "$body" | sed -E 's/.*"ready_status":"(([^"\\]|\\.)*)".*/\1/')"
    else
      echo "its admin interface $h:$port does not report healthy"
    fi
    return 1
  fi
}

is_running() { on_node "$1" "$(running_fn "$1"); running"; }

# The API key the readiness checks send to node $1: TANDEM_API_KEY if exported, else the first
# key of the config's [security] api_key_file (read here; "" when auth is off). Fails with
# what is missing when the config enables auth but the file cannot be read here.
api_key() {
  local f=${key_files[$1]:--} line
  [[ -n ${TANDEM_API_KEY:-} ]] && { printf '%s' "$TANDEM_API_KEY"; return 0; }
  [[ $f == - ]] && return 0
  if [[ ! -r $f ]]; then
    echo "its config (${cfgs[$1]}) enables auth with [security] api_key_file = $f, which is not readable here; make it readable by this user or export TANDEM_API_KEY=<one of its keys>"
    return 1
  fi
  while IFS= read -r line || [[ -n $line ]]; do
    line=${line//[[:space:]]/}  # keys have no spaces (transport/auth/api_keys.cpp)
    [[ -n $line && $line != \#* ]] && { printf '%s' "$line"; return 0; }
  done <"$f"
  echo "[security] api_key_file = $f (config ${cfgs[$1]}) has no key; add one per line, or export TANDEM_API_KEY"
  return 1
}

log_tail() {
  echo "--- last lines of ${names[$1]}'s log ($(reach_host "$1"):$(log_file "$1")):" >&2
  on_node "$1" "tail -n 30 $(q "$(log_file "$1")") 2>&1" >&2 || true
}

start_node() {
  local i=$1 cfg serve_bin
  if ((local_mode)); then
    cfg=${cfgs[$i]}
    serve_bin=$(realpath "$(command -v "$tandem")")
  else
    [[ -n $(reach_host "$i") ]] || { echo "launch-cluster: node ${names[$i]} has host 0.0.0.0; ssh needs its address" >&2; return 1; }
    cfg=$run_dir/$(basename "${cfgs[$i]}")
    on_node "$i" "mkdir -p $(q "$run_dir")"
    "$scp_cmd" "${ssh_opts[@]}" -q "${cfgs[$i]}" "$(reach_host "$i"):$cfg"
    serve_bin=$remote_tandem
  fi
  # numactl binds CPUs and memory to the node's NUMA node (-1: not pinned); without numactl on
  # that machine the node runs unpinned, with a warning.
  on_node "$i" "
    $(running_fn "$i")
    if running; then echo \"launch-cluster: ${names[$i]} is already running (pid \$pid)\"; exit 3; fi
    mkdir -p $(q "$run_dir")
    pre=''
    if [ ${numas[$i]} -ge 0 ]; then
      if command -v numactl >/dev/null 2>&1; then pre='numactl --cpunodebind=${numas[$i]} --membind=${numas[$i]}'
      else echo 'launch-cluster: warning: numactl is not installed on ${hosts[$i]}; ${names[$i]} runs without NUMA binding (deploy/install-deps.sh installs it)' >&2; fi
    fi
    UCX_TCP_CM_REUSEADDR=\${UCX_TCP_CM_REUSEADDR:-y} setsid nohup \$pre $(q "$serve_bin") serve --config $(q "$cfg") --node $(q "${names[$i]}") ${TANDEM_SERVE_ARGS:-} \
      </dev/null >$(q "$(log_file "$i")") 2>&1 &
    echo \$! >$(q "$(pid_file "$i")")
    echo \"launch-cluster: started ${names[$i]} on ${hosts[$i]} (pid \$!\${pre:+, \$pre})\""
}

stop_node() {
  on_node "$1" "
    $(running_fn "$1")
    if ! running; then rm -f $(q "$(pid_file "$1")"); echo '${names[$1]}: not running'; exit 0; fi
    kill -TERM \"\$pid\"
    n=0
    while running; do
      n=\$((n + 1))
      if [ \$n -ge $((stop_timeout_s * 10)) ]; then
        kill -KILL \"\$pid\"; echo '${names[$1]}: did not stop within ${stop_timeout_s} s of SIGTERM; killed'
        break
      fi
      sleep 0.1
    done
    rm -f $(q "$(pid_file "$1")")
    echo \"${names[$1]}: stopped (pid \$pid)\""
}

case $action in
  start)
    started=()
    # Schedulers first, the router last: it is the node clients talk to.
    order=()
    for i in "${selected[@]}"; do is_router "$i" || order+=("$i"); done
    for i in "${selected[@]}"; do is_router "$i" && order+=("$i"); done
    for i in "${order[@]}"; do
      rc=0
      start_node "$i" || rc=$?
      ((rc == 3)) && continue  # already running: not ours to stop if another node fails
      if ((rc != 0)); then
        echo "launch-cluster: could not start ${names[$i]} on ${hosts[$i]}" >&2
        for j in "${started[@]}"; do stop_node "$j" >&2 || true; done
        exit 1
      fi
      started+=("$i")
    done
    deadline=$(($(date +%s) + timeout_s))
    for i in "${order[@]}"; do
      until why=$(healthy "$i"); do
        failed=""
        is_running "$i" || failed="exited"
        (($(date +%s) < deadline)) || failed="not healthy within ${timeout_s} s: $why"
        if [[ -n $failed ]]; then
          echo "launch-cluster: node ${names[$i]} (${hosts[$i]}) failed: $failed" >&2
          log_tail "$i"
          echo "launch-cluster: stopping the nodes this run started" >&2
          for j in "${started[@]}"; do stop_node "$j" >&2 || true; done
          exit 1
        fi
        sleep 0.2
      done
      echo "launch-cluster: ${names[$i]} is healthy"
    done
    ;;
  stop)
    for i in "${selected[@]}"; do stop_node "$i"; done
    ;;
  status)
    status=0
    printf '%-16s %-16s %-36s %-8s %s\n' NODE HOST ROLES PID STATE
    for i in "${selected[@]}"; do
      pid=- state=""
      if is_running "$i"; then
        pid=$(on_node "$i" "cat $(q "$(pid_file "$i")")")
        if why=$(healthy "$i"); then
          state=healthy
        elif [[ $why == degraded:* ]]; then
          state=$why
          status=1
        else
          state="running, unhealthy: $why"
          status=1
        fi
      else
        state="not running"
        status=1
      fi
      printf '%-16s %-16s %-36s %-8s %s\n' "${names[$i]}" "${hosts[$i]}" "${roles[$i]}" "$pid" "$state"
    done
    exit $status
    ;;
esac
