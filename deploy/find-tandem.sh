# shellcheck shell=bash
# Sourced by the deploy scripts: find_tandem prints the tandem binary to run here, or fails
# with what to do. The order: $TANDEM_BIN; a build of this repository (build/dev, build/default,
# build/release: what deploy/quickstart.sh and the CMake presets build); `tandem` on PATH
# (`cmake --install build/default` puts it in /usr/local/bin).
find_tandem() {
  local repo c
  if [[ -n ${TANDEM_BIN:-} ]]; then
    c=$(command -v "$TANDEM_BIN" 2>/dev/null) && [[ -x $c ]] && { printf '%s\n' "$c"; return 0; }
    echo "TANDEM_BIN=$TANDEM_BIN is not an executable; point it at the tandem binary (e.g. build/default/tools/tandem)" >&2
    return 1
  fi
  repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
  for c in "$repo/build/dev/tools/tandem" "$repo/build/default/tools/tandem" "$repo/build/release/tools/tandem"; do
    [[ -f $c && -x $c ]] && { printf '%s\n' "$c"; return 0; }
  done
  c=$(command -v tandem 2>/dev/null) && { printf '%s\n' "$c"; return 0; }
  echo "no tandem binary found: not in TANDEM_BIN, not built in $repo/build/{dev,default,release}/tools/, not on PATH;" \
    "build it (deploy/quickstart.sh, or cmake --preset default && cmake --build build/default --target tandem)," \
    "then install it (cmake --install build/default) or set TANDEM_BIN=/path/to/tandem" >&2
  return 1
}
