#!/usr/bin/env bash
# GPU checks (needs an NVIDIA GPU + CUDA at /usr/local/cuda): builds the CUDA kernels for
# sm_90 and runs their tests against the CPU kernels, then prints each kernel's achieved
# bandwidth as GB/s and as a fraction of the card's peak. Exits non-zero on any mismatch.
# Takes well under 3 minutes on an H200 (most of it is the build).
set -euo pipefail
cd "$(dirname "$0")/../.."
gen=()
command -v ninja >/dev/null && gen=(-G Ninja)
cmake -S . -B build/gpu "${gen[@]}" -DTANDEM_CUDA=ON -DTANDEM_BUILD_TESTS=OFF \
  -DCMAKE_CUDA_COMPILER=/usr/local/cuda/bin/nvcc -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build/gpu -j "$(nproc)" --target test_cuda_ops
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
timeout 150 ./build/gpu/kernels/cuda/test_cuda_ops
