#!/usr/bin/env bash
# The overload soak (issue 8): `tandem bench soak` on the tiny-15m model, 3x the measured
# capacity for TANDEM_SOAK_S seconds (default 60). The bench exits 1 when a goal is missed
# (RSS growth >= 5% after the warm-up, a mailbox or queue past its bound, a request without
# exactly one final answer); this script also checks that its JSON is complete.
# Usage: tests/soak/run.sh TANDEM_BINARY
set -euo pipefail
tandem=${1:?usage: run.sh TANDEM_BINARY}
secs=${TANDEM_SOAK_S:-60}  # >= 10
warmup=$(( secs >= 30 ? 10 : secs / 3 ))
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
"$tandem" make-model --preset tiny-15m --out "$dir/tiny.gguf" >/dev/null
rc=0
"$tandem" bench soak --model "$dir/tiny.gguf" --duration-s "$secs" --warmup-s "$warmup" --json "$dir/soak.json" || rc=$?
if [[ ! -s "$dir/soak.json" ]]; then
  echo "soak: no JSON written (exit $rc)" >&2
  exit 1
fi
python3 - "$dir/soak.json" <<'PY'
import json, sys
j = json.load(open(sys.argv[1]))
problems = []
for k in ("capacity_rps", "sent", "answered", "status", "rss", "bounds", "goal"):
    if k not in j: problems.append("missing " + k)
if not problems:
    if j["capacity_rps"] <= 0: problems.append("no capacity measured")
    if sum(j["status"].values()) != j["sent"]: problems.append("statuses do not add up to the requests sent")
    if j["answered"] != j["sent"]: problems.append(f"answered {j['answered']} of {j['sent']}")
    if len(j["bounds"]) < 5: problems.append("fewer than 5 mailboxes reported")
    for b in j["bounds"]:
        if b["bound"] <= 0 or b["high_water"] > b["bound"]: problems.append(f"{b['what']}: {b['high_water']} of {b['bound']}")
    if len(j["rss"]["samples"]) < 4 * (j["duration_s"] - 1): problems.append("too few RSS samples")
for p in problems: print("soak:", p, file=sys.stderr)
sys.exit(1 if problems else 0)
PY
exit "$rc"
