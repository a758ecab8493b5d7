#!/usr/bin/env bash
# Installs every Debian 12 package Tandem needs to build, test and run.
# Idempotent; run as root or with sudo available.
set -euo pipefail

packages=(
  build-essential cmake ninja-build pkg-config git curl ca-certificates ccache
  libcaf-dev capnproto libcapnp-dev libucx-dev ucx-utils
  libspdlog-dev libfmt-dev doctest-dev libssl-dev libnuma-dev libhwloc-dev libpcre2-dev libtomlplusplus-dev
  libxxhash-dev
  nodejs npm iproute2
  prometheus jq
  numactl systemd procps
  clang libclang-rt-14-dev
  python3 python3-jinja2
)

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
# nodejs/npm may come from outside Debian (the image ships node); only require a working binary.
if command -v node >/dev/null && command -v npm >/dev/null; then
  filtered=()
  for p in "${missing[@]}"; do [[ "$p" == nodejs || "$p" == npm ]] || filtered+=("$p"); done
  missing=("${filtered[@]}")
fi

# The chat-template tests' reference renderer needs jinja2 in `python3`, from Debian or not.
if python3 -c 'import jinja2' 2>/dev/null; then
  filtered=()
  for p in "${missing[@]}"; do [[ "$p" == python3 || "$p" == python3-jinja2 ]] || filtered+=("$p"); done
  missing=("${filtered[@]}")
fi

if ((${#missing[@]} == 0)); then
  echo "install-deps: all packages present"
  exit 0
fi

SUDO=""
if [[ $(id -u) -ne 0 ]]; then
  command -v sudo >/dev/null || { echo "install-deps: run as root or install sudo; missing: ${missing[*]}" >&2; exit 1; }
  SUDO=sudo
fi
echo "install-deps: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
