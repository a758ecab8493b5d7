#!/usr/bin/env bash
# GPU checks, one command: tests/gpu/run.sh (needs an NVIDIA GPU + CUDA at /usr/local/cuda or
# nvcc on PATH). First, here: tests/gpu/prepare-deps.sh. Then on the lent machine the device
# tool's run with carry ["build/gpu-deps"] and command "tests/gpu/run.sh". In one go:
#  0. tests/gpu/serve_check.sh: the carried CUDA `tandem` (prepare-deps.sh built and packed it):
#     `tandem serve --backend cuda` against a CPU serve of the same model over HTTP, an abort
#     storm leaving the device pool whole, served decode tokens/s at 1 and 32 requests, and a
#     router/prefill/decode cluster of three processes whose KV crosses UCX through pinned slots;
# then it builds tests/gpu on its own for sm_90 and runs:
#  1. test_cuda_ops: the kernels of kernels/cuda against the CPU kernels, with each kernel's
#     bandwidth as GB/s and as a fraction of the card's peak;
#  2. test_cuda_backend: the CUDA backend (kernels/backend/cuda) against the CPU backend op by
#     op (stated tolerances, batch invariance bit for bit; split-context attention, grouped
#     quantized matmuls, the device sample op), greedy 16 tokens of make-model presets of every
#     architecture equal to the CPU's, decode steps through CUDA graphs equal to eager ones,
#     decode tokens/s of small-110m at batch 1 and 32 (graphs and eager), and paged decode
#     attention (batch 32, 4, 1) and page copies as fractions of the measured device-to-device
#     copy bandwidth.
# Exits non-zero on any mismatch. A few minutes on an H100 (most of it the build).
#
# It builds tests/gpu on its own (not the whole project): the lent GPU machines have CUDA,
# CMake and a compiler but none of Debian's packages. Where fmt is not installed it uses the
# headers tests/gpu/prepare-deps.sh copied into build/gpu-deps: run that first, here, and
# carry build/gpu-deps along (the device tool: carry ["build/gpu-deps"], command
# "tests/gpu/run.sh").
set -euo pipefail
cd "$(dirname "$0")/../.."
# Serving first: it needs no build, so its result comes back even if the builds below run long.
serve_status=0
timeout 240 tests/gpu/serve_check.sh || serve_status=1
nvcc=/usr/local/cuda/bin/nvcc
[[ -x $nvcc ]] || nvcc=$(command -v nvcc || true)
[[ -n $nvcc ]] || { echo "tests/gpu/run.sh: no nvcc (looked at /usr/local/cuda/bin and PATH)" >&2; exit 1; }
args=(-DCMAKE_CUDA_COMPILER="$nvcc" -DCMAKE_BUILD_TYPE=Release)
command -v ninja >/dev/null && args+=(-G Ninja)
[[ -d build/gpu-deps ]] && args+=(-DTANDEM_GPU_DEPS="$PWD/build/gpu-deps")
cmake -S tests/gpu -B build/gpu "${args[@]}" >/dev/null
cmake --build build/gpu -j "$(nproc)" --target test_cuda_ops test_cuda_backend
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
status=0
timeout 150 ./build/gpu/test_cuda_ops || status=1
models=$(mktemp -d)
trap 'rm -rf "$models"' EXIT
timeout 300 ./build/gpu/test_cuda_backend "$models" || status=1
((serve_status == 0)) || status=1
exit $status
