#!/usr/bin/env bash
# The test command: builds the `dev` preset (-Werror) and runs every test, then the unit tests
# under ASan+UBSan. Usage: tests/run.sh [--no-asan]
set -euo pipefail
cd "$(dirname "$0")/.."

asan=1
for a in "$@"; do
  case "$a" in
    --no-asan) asan=0 ;;
    *) echo "usage: tests/run.sh [--no-asan]" >&2; exit 2 ;;
  esac
done

jobs=$(nproc)
# ccache where installed (deploy/install-deps.sh installs it): the CUDA `tandem` below
# (tests/gpu/prepare-deps.sh, build/cuda) compiles the same sources with the dev build's flags,
# so within one run it reuses the dev build's objects instead of compiling everything twice.
# Paths are hashed relative to the checkout, so build/dev and build/cuda share entries.
if command -v ccache >/dev/null && [[ -z ${CMAKE_CXX_COMPILER_LAUNCHER:-} ]]; then
  export CMAKE_C_COMPILER_LAUNCHER=ccache CMAKE_CXX_COMPILER_LAUNCHER=ccache
  export CCACHE_BASEDIR=${CCACHE_BASEDIR:-$PWD} CCACHE_NOHASHDIR=${CCACHE_NOHASHDIR:-1}
fi
# The openai npm client, the AI SDK and LangChain used by the end-to-end tests (lock file
# committed; no network at test time). Reinstalled when the lock file is newer than the install.
if [[ -f tests/e2e/openai/package-lock.json && ( ! -f tests/e2e/openai/node_modules/.package-lock.json ||
      tests/e2e/openai/package-lock.json -nt tests/e2e/openai/node_modules/.package-lock.json ) ]]; then
  (cd tests/e2e/openai && npm ci --no-audit --no-fund --loglevel=error)
fi
# llama.cpp as the reference implementation (tests/reference): node-llama-cpp's prebuilt CPU
# binary only (--omit=optional leaves out the GPU packages; its postinstall is skipped, so
# nothing is downloaded or compiled). About 85 MB, 10-20 s.
if [[ -f tests/reference/llama_cpp/package-lock.json && ! -d tests/reference/llama_cpp/node_modules ]]; then
  (cd tests/reference/llama_cpp && npm ci --omit=optional --no-audit --no-fund --loglevel=error)
fi

cmake --preset dev >/dev/null
cmake --build --preset dev -j "$jobs"
ctest --preset dev -j "$jobs" --timeout 600

# CUDA kernels and the CUDA backend must compile for sm_90 wherever nvcc exists (they run only
# on a GPU machine: tests/gpu/run.sh). Built as there: tests/gpu on its own, with fmt header-only from the copy
# prepare-deps.sh makes (the installed fmt is not looked for), so the script a lent GPU
# machine runs is the one checked here.
if [[ -x /usr/local/cuda/bin/nvcc ]]; then
  # The `tandem` binary with the CUDA backend (build/cuda: the dev build's flags, so ccache
  # reuses its objects), packed with its libraries for the GPU machines, and that bundle run
  # through its own loader in a clean environment on the CPU backend (everything but the GPU).
  tests/gpu/prepare-deps.sh >/dev/null
  tests/gpu/check-bundle.sh
  # ccache where installed: the standalone build compiles the CPU kernels and model code again.
  launch=()
  command -v ccache >/dev/null && launch=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache -DCMAKE_CUDA_COMPILER_LAUNCHER=ccache)
  cmake -S tests/gpu -B build/gpu-ci -DCMAKE_CUDA_COMPILER=/usr/local/cuda/bin/nvcc -DCMAKE_BUILD_TYPE=Release \
    -DCMAKE_DISABLE_FIND_PACKAGE_fmt=TRUE -DTANDEM_GPU_DEPS="$PWD/build/gpu-deps" "${launch[@]}" >/dev/null
  cmake --build build/gpu-ci -j "$jobs" --target test_cuda_ops test_cuda_backend
fi

# libFuzzer targets (clang): replay the committed corpus, then fuzz each target 15 s (the whole step stays under ~4 min on 2 cores).
tests/fuzz/run.sh 15

if ((asan)); then
  cmake --preset asan >/dev/null
  # Only the unit-test executables and the simulation (500 seeds under ASan; the dev run above
  # sweeps its default 2000): the end-to-end suite runs above.
  cmake --build --preset asan -j "$jobs" --target test_kernels test_actors test_transport test_config test_ucx test_sim
  TANDEM_SIM_SEEDS=500 TANDEM_SIM_CLUSTER_SEEDS=500 ctest --preset asan -j "$jobs" --timeout 900 -L 'test_kernels|test_actors|test_transport|test_config|test_ucx|test_sim'
fi
