#!/usr/bin/env bash
# Configures and builds the library, tests and the `sparse-mla` command line into build/.
# CUDA backends are built when nvcc is found (archs from SPARSE_MLA_CUDA_ARCHS, default 80;90a;120).
set -euo pipefail
cd "$(dirname "$0")/.."
"$(dirname "$0")/setup.sh"
build_dir=${BUILD_DIR:-build}
cmake -S . -B "$build_dir" -DCMAKE_BUILD_TYPE=Release ${SPARSE_MLA_CMAKE_ARGS:-}
# The log lets scripts/test.sh check what ptxas reported for the kernels compiled in this run.
cmake --build "$build_dir" -j "$(nproc)" 2>&1 | tee "$build_dir/build.log"
