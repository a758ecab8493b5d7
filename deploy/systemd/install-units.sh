#!/usr/bin/env bash
# Installs the systemd units of one node of a cluster config on this machine: the env file
# ENV_DIR/NODE.env (from `tandem check-config --list-nodes`: the config, the node, its numactl
# binding) and tandem-node@.service + tandem-node-failed@.service in UNIT_DIR with the tandem
# binary's path. Refuses an invalid config (check-config's messages are shown).
#
# usage: deploy/systemd/install-units.sh CONFIG NODE [--bin PATH] [--unit-dir DIR] [--env-dir DIR]
#   --bin       tandem binary the units run (default: $TANDEM_BIN, this repository's build, or
#               `tandem` on PATH, as deploy/find-tandem.sh finds it)
#   --unit-dir  where the unit files go (default /etc/systemd/system)
#   --env-dir   where NODE.env goes (default /etc/tandem/nodes)
# Then: systemctl daemon-reload && systemctl enable --now tandem-node@NODE
# Extra `tandem serve` flags: TANDEM_SERVE_ARGS in NODE.env (kept when it is rewritten).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)

usage() { sed -n '/^# usage:/,/^# Then:/p' "$0" | sed 's/^# \{0,1\}//' >&2; exit "${1:-2}"; }
args=() bin="" unit_dir=/etc/systemd/system env_dir=/etc/tandem/nodes
while (($#)); do
  case "$1" in
    --bin) bin=${2:?--bin needs a path}; shift ;;
    --unit-dir) unit_dir=${2:?--unit-dir needs a directory}; shift ;;
    --env-dir) env_dir=${2:?--env-dir needs a directory}; shift ;;
    -h | --help) usage 0 ;;
    -*) echo "install-units: unknown option $1" >&2; usage ;;
    *) args+=("$1") ;;
  esac
  shift
done
((${#args[@]} == 2)) || usage
config=${args[0]} node=${args[1]}
[[ -f $config ]] || { echo "install-units: config file $config not found" >&2; exit 2; }
config=$(cd "$(dirname "$config")" && pwd)/$(basename "$config")
# shellcheck source=deploy/find-tandem.sh
. "$(dirname "${BASH_SOURCE[0]}")/../find-tandem.sh"
if [[ -z $bin ]]; then bin=$(find_tandem) || { echo "install-units: give --bin PATH" >&2; exit 2; }; fi
[[ -x $bin ]] || { echo "install-units: --bin $bin is not an executable; give the tandem binary" >&2; exit 2; }
bin=$(realpath "$bin")

if ! listing=$("$bin" check-config --list-nodes "$config"); then
  echo "install-units: $config is invalid (see above); nothing was installed" >&2
  exit 1
fi
line=$(awk -F'\t' -v n="$node" '$1 == n' <<<"$listing")
[[ -n $line ]] || { echo "install-units: $config has no node '$node'; its nodes: $(cut -f1 <<<"$listing" | tr '\n' ' ')" >&2; exit 1; }
IFS=$'\t' read -r _name _host numa roles _rest <<<"$line"
if ((numa >= 0)); then numactl_args="--cpunodebind=$numa --membind=$numa"; else numactl_args="--localalloc"; fi
command -v numactl >/dev/null || echo "install-units: warning: numactl is not installed here; the unit runs /usr/bin/numactl (deploy/install-deps.sh installs it)" >&2

mkdir -p "$unit_dir" "$env_dir"
env_file=$env_dir/$node.env
serve_args=""
[[ -f $env_file ]] && serve_args=$(sed -n 's/^TANDEM_SERVE_ARGS=//p' "$env_file")
cat >"$env_file.tmp" <<ENV
# Written by deploy/systemd/install-units.sh from \`tandem check-config --list-nodes\`; rerun it
# after changing the node's numa_node. Read by tandem-node@$node.service.
TANDEM_CONFIG="$config"
TANDEM_NODE=$node
TANDEM_ROLES=$roles
TANDEM_NUMACTL_ARGS="$numactl_args"
TANDEM_SERVE_ARGS=$serve_args
ENV
mv "$env_file.tmp" "$env_file"

for u in tandem-node@.service tandem-node-failed@.service; do
  sed -e "s|/usr/local/bin/tandem|$bin|g" -e "s|/etc/tandem/nodes/|$env_dir/|g" "$here/$u" >"$unit_dir/$u.tmp"
  mv "$unit_dir/$u.tmp" "$unit_dir/$u"
done
echo "install-units: node $node ($roles; numactl $numactl_args): $env_file, $unit_dir/tandem-node@.service"
if [[ $unit_dir == /etc/systemd/system && -d /run/systemd/system ]]; then
  systemctl daemon-reload
  echo "install-units: start it with: systemctl enable --now tandem-node@$node"
fi
