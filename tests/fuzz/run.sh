#!/usr/bin/env bash
# Builds the libFuzzer targets with clang (their own CMake project, only the sources they
# exercise), replays the committed corpus (regressions included), then fuzzes each target for
# a bounded time. Fails on any crash, leak, sanitizer report or hang.
#   tests/fuzz/run.sh [SECONDS_PER_TARGET]   (default 20; 0 = replay only)
# New inputs found while fuzzing go to build/fuzz/found/<target>/ (not the committed corpus);
# a crashing input is written to build/fuzz/artifacts/: fix the bug, then copy the input into
# tests/fuzz/corpus/<target>/ as a regression.
set -euo pipefail
cd "$(dirname "$0")/../.."

secs=${1:-20}
targets=(http rpc wire gguf kv jinja tool_calls grammar)
build=build/fuzz
start=$(date +%s)

if ! command -v clang++ >/dev/null; then
  echo "fuzz: clang++ is missing; run deploy/install-deps.sh (clang, libclang-rt-14-dev)" >&2
  exit 1
fi
launcher=()
command -v ccache >/dev/null && launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache -DCMAKE_C_COMPILER_LAUNCHER=ccache)
CC=clang CXX=clang++ cmake -S tests/fuzz -B "$build" -DCMAKE_BUILD_TYPE=RelWithDebInfo "${launcher[@]}" >/dev/null
cmake --build "$build" -j "$(nproc)" --target "${targets[@]/#/fuzz_}"
echo "fuzz: built in $(( $(date +%s) - start )) s"

mkdir -p "$build/artifacts"
# The HTTP target runs a kj event loop per input; others are pure decoders. Same options for all.
opts=(-rss_limit_mb=2048 -timeout=10 -max_len=65536 -artifact_prefix="$build/artifacts/" -print_final_stats=0)
for t in "${targets[@]}"; do
  corpus=tests/fuzz/corpus/$t
  found=$build/found/$t
  mkdir -p "$found"
  # Seeds kept outside the repository: the jinja target also starts from the real chat templates.
  seeds=()
  [[ $t == jinja && -d ../shared/chat-templates ]] && seeds=(../shared/chat-templates)
  # Replay: every committed input, once.
  "$build/fuzz_$t" "${opts[@]}" -runs=0 "$corpus" "${seeds[@]}" >"$build/replay_$t.log" 2>&1 || {
    cat "$build/replay_$t.log" >&2
    echo "fuzz: $t failed replaying $corpus" >&2
    exit 1
  }
  if ((secs > 0)); then
    "$build/fuzz_$t" "${opts[@]}" -max_total_time="$secs" "$found" "$corpus" "${seeds[@]}" >"$build/fuzz_$t.log" 2>&1 || {
      tail -n 60 "$build/fuzz_$t.log" >&2
      echo "fuzz: $t found a failure; the input is in $build/artifacts/" >&2
      exit 1
    }
  fi
  echo "fuzz: $t ok ($(grep -c . <(ls "$corpus")) seeds$( ((secs > 0)) && echo ", $(grep -ao 'Done [0-9]* runs' "$build/fuzz_$t.log" | tail -1 | cut -d' ' -f2) runs in ${secs} s"))"
done
echo "fuzz: all targets ok in $(( $(date +%s) - start )) s"
