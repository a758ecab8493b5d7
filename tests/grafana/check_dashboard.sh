#!/usr/bin/env bash
# Starts `tandem serve` on a micro model and Debian's prometheus scraping it with
# deploy/grafana/prometheus.yml, waits for a scrape through prometheus's HTTP API, and checks
# that every metric queried by deploy/grafana/tandem-dashboard.json exists (or is in
# metrics-allowlist.txt with a reason) and is documented in docs/metrics.md.
# usage: check_dashboard.sh TANDEM_BINARY SOURCE_DIR. Exit 77 (ctest: skipped) only if prometheus is absent.
set -euo pipefail
tandem=$1
src=$2
dash=$src/deploy/grafana/tandem-dashboard.json
allow=$src/deploy/grafana/metrics-allowlist.txt

if ! command -v prometheus >/dev/null; then
  echo "SKIPPED: the prometheus binary is not installed (deploy/install-deps.sh installs Debian's prometheus)"
  exit 77
fi

tmp=$(mktemp -d)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done
  rm -rf "$tmp"
}
trap cleanup EXIT

fail() {
  echo "FAIL: $*" >&2
  for f in "$tmp"/*.log; do [[ -f $f ]] && { echo "--- $f" >&2; tail -20 "$f" >&2; }; done
  exit 1
}

# Polls "$@" until it succeeds or `deadline` (seconds from now) passes.
wait_for() {
  local deadline=$(( $(date +%s) + $1 ))
  shift
  until "$@"; do
    (( $(date +%s) < deadline )) || return 1
    sleep 0.2
  done
}

"$tandem" make-model --out "$tmp/micro.gguf" --preset micro >"$tmp/make-model.log" 2>&1 || fail "make-model failed"

# tandem: free ports, read from its listening lines.
mkfifo "$tmp/serve.out"
"$tandem" serve --model "$tmp/micro.gguf" --port 0 --rpc-port 0 --log-level warn >"$tmp/serve.out" 2>"$tmp/serve.log" &
pids+=($!)
exec 3<"$tmp/serve.out"
http_port=""
while [[ -z $http_port ]]; do
  IFS= read -r -t 30 line <&3 || fail "tandem serve printed no listening line"
  [[ $line =~ ^tandem:\ http\ listening\ on\ 127\.0\.0\.1:([0-9]+)$ ]] && http_port=${BASH_REMATCH[1]}
done
# Drain the rest of its stdout so it never blocks on the fifo.
cat <&3 >/dev/null &
pids+=($!)

# One finished request, so the per-request series exist.
curl -sf -X POST "http://127.0.0.1:$http_port/v1/completions" \
  -H 'Content-Type: application/json' -d '{"prompt":"hello","max_tokens":3}' >/dev/null || fail "completion request failed"

# prometheus: the shipped scrape config, pointed at this node, scraping every second.
sed -e "s/127\.0\.0\.1:8080/127.0.0.1:$http_port/" -e "s/scrape_interval: 10s/scrape_interval: 1s/" \
  "$src/deploy/grafana/prometheus.yml" >"$tmp/prometheus.yml"
grep -q "127.0.0.1:$http_port" "$tmp/prometheus.yml" || fail "prometheus.yml has no 127.0.0.1:8080 target to point at the node"
prom_port=""
for try in 1 2 3 4 5; do
  port=$(( 20000 + (RANDOM % 20000) ))
  prometheus --config.file="$tmp/prometheus.yml" --storage.tsdb.path="$tmp/data" \
    --web.listen-address="127.0.0.1:$port" >"$tmp/prometheus.log" 2>&1 &
  ppid=$!
  if wait_for 20 curl -sf "http://127.0.0.1:$port/-/ready" -o /dev/null; then
    pids+=($ppid)
    prom_port=$port
    break
  fi
  kill "$ppid" 2>/dev/null || true
  wait "$ppid" 2>/dev/null || true
done
[[ -n $prom_port ]] || fail "prometheus did not become ready"
api="http://127.0.0.1:$prom_port/api/v1"

scraped() {
  curl -sf "$api/query" --data-urlencode 'query=tandem_node_up' | grep -q '"node":"local"'
}
wait_for 30 scraped || fail "prometheus did not scrape the node within 30 s"
curl -sf "$api/targets" | grep -q '"health":"up"' || fail "the scrape target is not up"

names=$(curl -sf "$api/label/__name__/values") || fail "cannot list metric names"
status=0
# Every panel query must be valid PromQL (Grafana's $node variable stands for all nodes).
command -v jq >/dev/null || fail "jq is not installed (deploy/install-deps.sh installs it)"
while IFS= read -r expr; do
  q=${expr//\$node/.*}
  if ! out=$(curl -s "$api/query" --data-urlencode "query=$q") || ! grep -q '"status":"success"' <<<"$out"; then
    echo "FAIL: dashboard query does not evaluate: $expr: $out"
    status=1
  elif grep -qE '"(NaN|\+Inf|-Inf)"' <<<"$out"; then
    # This node has no host or disk tier and little traffic: a ratio over an unconfigured tier
    # or an idle window must show nothing, not NaN (guard the divisor with "> 0").
    echo "FAIL: dashboard query gives NaN/Inf on an idle node without host/disk tiers: $expr: $out"
    status=1
  fi
done < <(jq -r '.. | objects | select(has("expr")) | .expr' "$dash")
[[ $(jq -r '.. | objects | select(has("expr")) | .expr' "$dash" | wc -l) -gt 20 ]] || fail "found too few dashboard queries"
for m in $(grep -o 'tandem_[a-z0-9_]*' "$dash" | sort -u); do
  base=$(sed -E 's/_(bucket|sum|count)$//' <<<"$m")
  grep -q "^| \`$base\` |" "$src/docs/metrics.md" || { echo "FAIL: $m (dashboard) is not documented in docs/metrics.md"; status=1; }
  if grep -q "\"$m\"" <<<"$names"; then
    echo "ok: $m"
  elif reason=$(grep -E "^$m[[:space:]]" "$allow"); then
    echo "allowed missing: $reason"
  else
    echo "FAIL: $m (dashboard) is not in prometheus; add it to the node or to $allow with a reason"
    status=1
  fi
done
# An allowlisted metric that exists now should leave the allowlist.
for m in $(grep -Eo '^tandem_[a-z0-9_]+' "$allow"); do
  if grep -q "\"$m\"" <<<"$names"; then echo "FAIL: $m is produced now; remove it from $allow"; status=1; fi
  grep -q "$m" "$dash" || { echo "FAIL: $m is allowlisted but the dashboard does not use it"; status=1; }
done
exit $status
