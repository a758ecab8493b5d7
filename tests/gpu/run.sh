#!/usr/bin/env bash
# GPU checks (needs an NVIDIA GPU + CUDA at /usr/local/cuda): builds the CUDA kernels for
# sm_90 and runs their tests against the CPU kernels, then prints each kernel's achieved
# bandwidth as GB/s and as a fraction of the card's peak. Exits non-zero on any mismatch.
# Takes well under 3 minutes on an H200 (most of it is the build).
#
# It builds tests/gpu on its own (not the whole project): the lent GPU machines have CUDA,
# CMake and a compiler but none of Debian's packages. Where fmt is not installed it uses the
# headers tests/gpu/prepare-deps.sh copied into build/gpu-deps (run that first, here, and carry
# build/gpu-deps along).
set -euo pipefail
cd "$(dirname "$0")/../.."
nvcc=/usr/local/cuda/bin/nvcc
[[ -x $nvcc ]] || nvcc=$(command -v nvcc || true)
[[ -n $nvcc ]] || { echo "tests/gpu/run.sh: no nvcc (looked at /usr/local/cuda/bin and PATH)" >&2; exit 1; }
args=(-DCMAKE_CUDA_COMPILER="$nvcc" -DCMAKE_BUILD_TYPE=Release)
command -v ninja >/dev/null && args+=(-G Ninja)
[[ -d build/gpu-deps ]] && args+=(-DTANDEM_GPU_DEPS="$PWD/build/gpu-deps")
cmake -S tests/gpu -B build/gpu "${args[@]}" >/dev/null
cmake --build build/gpu -j "$(nproc)" --target test_cuda_ops
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
timeout 150 ./build/gpu/test_cuda_ops
