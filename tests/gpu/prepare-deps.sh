#!/usr/bin/env bash
# Packs into build/gpu-deps what tests/gpu/run.sh needs and the lent GPU machines lack (they have
# CUDA 13, CMake and a compiler, but none of Debian's packages and no network):
#  - include/fmt: Debian's fmt headers, which the standalone tests/gpu build uses header-only;
#  - tandem/: the `tandem` binary built here with the CUDA backend (preset `cuda`, build/cuda),
#    stripped, with every shared library it links from Debian (CAF, capnp/kj, UCX and its cma
#    transport module, spdlog, fmt, OpenSSL's crypto, PCRE2, hwloc, numa, toml++, libstdc++ and
#    glibc with its dynamic loader, cudart), and `tandem/run`, which starts it through the
#    carried loader with only the bundle's libraries, the machine's cuBLAS (/usr/local/cuda/lib64)
#    and its driver (libcuda, from the machine's loader cache). Neither the driver nor cuBLAS is
#    carried (cuBLASLt alone is 540 MB); both machines have CUDA 13.
# Run it here, then the checks there with that folder carried along (the device tool: carry
# ["build/gpu-deps"], command "tests/gpu/run.sh"). build/ is ignored: nothing here is committed.
# Usage: tests/gpu/prepare-deps.sh [--headers-only]   (without nvcc: the headers only)
set -euo pipefail
cd "$(dirname "$0")/../.."
headers_only=0
[[ ${1:-} == --headers-only ]] && headers_only=1
src=/usr/include/fmt
if [[ ! -f $src/format.h ]]; then
  echo "prepare-deps: $src/format.h is missing; install Debian's libfmt-dev (deploy/install-deps.sh)" >&2
  exit 1
fi
rm -rf build/gpu-deps
mkdir -p build/gpu-deps/include
cp -r "$src" build/gpu-deps/include/
nvcc=/usr/local/cuda/bin/nvcc
if ((headers_only)) || [[ ! -x $nvcc ]]; then
  echo "build/gpu-deps: fmt headers only ($(du -sh build/gpu-deps | cut -f1))"
  exit 0
fi

# The CUDA tandem: the `cuda` preset's folder, with the dev build's flags (-Werror) so ccache
# finds the dev build's objects; only the `tandem` target.
launch=()
command -v ccache >/dev/null && launch=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache -DCMAKE_C_COMPILER_LAUNCHER=ccache
                                      -DCMAKE_CUDA_COMPILER_LAUNCHER=ccache)
cmake --preset cuda -DTANDEM_WERROR=ON -DTANDEM_BUILD_TESTS=OFF "${launch[@]}" >/dev/null
cmake --build build/cuda -j "$(nproc)" --target tandem
bin=build/cuda/tools/tandem

out=build/gpu-deps/tandem
mkdir -p "$out/bin" "$out/lib/ucx"
strip -o "$out/bin/tandem" "$bin"
# UCX loads its transport modules from the folder `ucx` beside libucs; tcp, shared memory and
# self are in libuct itself, cma (cross-memory attach between processes) is a module. The
# InfiniBand modules need libibverbs, which the GPU machines lack: not carried.
ucxdir=$(dirname "$(ldd "$bin" | awk '$1 ~ /^libucs\.so/ {print $3}')")/ucx
cp -L "$ucxdir/libuct_cma.so.0" "$out/lib/ucx/"
# Every library the binary and the module need, by soname (cudart too: 0.7 MB), except the
# machine's own CUDA (libcuda: the driver; cuBLAS/cuBLASLt: /usr/local/cuda/lib64 there).
{ ldd "$bin"; ldd "$ucxdir/libuct_cma.so.0"; } | awk '$2 == "=>" && $3 ~ /^\// {print $1, $3}' | sort -u |
  while read -r soname path; do
    case $soname in
      libcuda.so* | libcublas* | libnvidia*) continue ;;
    esac
    cp -L "$path" "$out/lib/$soname"
  done
# glibc entire (its parts must come from one build: libcuda and cuBLAS load librt, libdl and
# libpthread, which must not come from the machine's glibc) and its loader.
for l in libc.so.6 libm.so.6 libdl.so.2 libpthread.so.0 librt.so.1; do
  [[ -f $out/lib/$l ]] || cp -L "/lib/x86_64-linux-gnu/$l" "$out/lib/$l"
done
loader=$(ldd "$bin" | awk '$1 ~ /ld-linux/ {print $1}')
cp -L "$loader" "$out/lib/ld-linux-x86-64.so.2"
cat >"$out/run" <<'EOF'
#!/bin/sh
# The carried tandem (tests/gpu/prepare-deps.sh) through the carried loader: the bundle's
# libraries first, then the machine's cuBLAS; the driver (libcuda.so.1) from TANDEM_DRIVER_LIB,
# /usr/local/nvidia/lib64 or the machine's loader cache.
d=$(cd "$(dirname "$0")" && pwd)
path="$d/lib:${TANDEM_CUDA_LIB:-/usr/local/cuda/lib64}"
for x in ${TANDEM_DRIVER_LIB:-} /usr/local/nvidia/lib64; do
  [ -d "$x" ] && path="$path:$x"
done
exec "$d/lib/ld-linux-x86-64.so.2" --library-path "$path" "$d/bin/tandem" "$@"
EOF
chmod +x "$out/run"
size_mb=$(du -sm build/gpu-deps | cut -f1)
if ((size_mb > 60)); then
  echo "prepare-deps: build/gpu-deps is ${size_mb} MiB; the device tool carries 64 MiB with the working tree" >&2
  exit 1
fi
echo "build/gpu-deps: fmt headers and the CUDA tandem with its libraries (${size_mb} MiB); carry it to the GPU machine with tests/gpu/run.sh"
