#!/usr/bin/env bash
# GPU checks (needs an NVIDIA GPU + CUDA at /usr/local/cuda): builds the CUDA kernels for
# sm_90 and runs their tests against the CPU reference with a bandwidth figure.
set -euo pipefail
cd "$(dirname "$0")/../.."
cmake -S . -B build/gpu -G Ninja -DTANDEM_CUDA=ON -DTANDEM_BUILD_TESTS=OFF \
  -DCMAKE_CUDA_COMPILER=/usr/local/cuda/bin/nvcc -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build/gpu -j "$(nproc)" --target test_cuda_ops
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
./build/gpu/kernels/cuda/test_cuda_ops
