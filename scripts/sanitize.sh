#!/usr/bin/env bash
# Builds the C++ test suite and the `sparse-mla` command line with AddressSanitizer and
# UndefinedBehaviorSanitizer (CUDA off: the CPU backend, API and KV tools) into build-asan/, then
# runs ctest and a small `sparse-mla run`. Any sanitizer report aborts the process that hit it, so
# the script fails on the first memory error, leak or undefined behaviour.
#
#   scripts/sanitize.sh [--clang]      default compiler: gcc
# Environment: BUILD_DIR (default build-asan, or build-asan-clang with --clang), JOBS (default nproc), CTEST_ARGS (extra ctest
# arguments, e.g. "-R Fuzz"), RUN_ARGS (one `sparse-mla run` with these arguments instead of the
# default two).
set -euo pipefail
cd "$(dirname "$0")/.."

cc=gcc
cxx=g++
default_dir=build-asan
if [[ ${1:-} == --clang ]]; then
  cc=clang
  cxx=clang++
  default_dir=build-asan-clang
fi
build_dir=${BUILD_DIR:-$default_dir}
jobs=${JOBS:-$(nproc)}

scripts/setup.sh
CC=$cc CXX=$cxx cmake -S . -B "$build_dir" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DSPARSE_MLA_CUDA=OFF \
  -DSPARSE_MLA_SANITIZE=address,undefined >/dev/null
cmake --build "$build_dir" -j "$jobs" --target sparse_mla_tests sparse_mla_cli

# LLVM's libomp (clang builds) keeps thread descriptors allocated when omp_set_num_threads changes
# the team size, which LeakSanitizer reports at exit; only allocations made inside libomp are
# suppressed.
echo "leak:libomp.so" >"$build_dir/lsan.supp"
export LSAN_OPTIONS=${LSAN_OPTIONS:-suppressions=$PWD/$build_dir/lsan.supp}
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=1:check_initialization_order=1:strict_init_order=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}

echo "== ctest ($build_dir, address,undefined)" >&2
# shellcheck disable=SC2086
ctest --test-dir "$build_dir" --output-on-failure -j "$jobs" --timeout 1200 ${CTEST_ARGS:-}

# A Flash step, then a Pro step with MTP (s_q = 2) and an odd batch, both verified in the tool.
runs=("${RUN_ARGS:---backend cpu --batch 2 --context 2048}")
[[ -z ${RUN_ARGS:-} ]] && runs+=("--backend cpu --model dsv4-pro --mtp --batch 3 --context 4096")
for args in "${runs[@]}"; do
  echo "== sparse-mla run $args" >&2
  # shellcheck disable=SC2086
  "$build_dir/tools/sparse-mla" run $args
done
echo "sanitize.sh: ctest and sparse-mla run passed under address,undefined" >&2
