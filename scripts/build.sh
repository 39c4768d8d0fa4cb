#!/usr/bin/env bash
# Configures and builds the library, tests and the `sparse-mla` command line into build/.
# CUDA backends are built when nvcc is found (archs from SPARSE_MLA_CUDA_ARCHS, default 80;90a;120).
set -euo pipefail
cd "$(dirname "$0")/.."
"$(dirname "$0")/setup.sh"
build_dir=${BUILD_DIR:-build}
cmake -S . -B "$build_dir" -DCMAKE_BUILD_TYPE=Release ${SPARSE_MLA_CMAKE_ARGS:-}
cmake --build "$build_dir" -j "$(nproc)"
