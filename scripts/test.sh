#!/usr/bin/env bash
# Builds everything and runs the whole test suite: C++ (ctest; GPU tests skip without a GPU), the
# Python package (built into a virtual environment, then pytest) and a short run of every fuzzer.
set -euo pipefail
cd "$(dirname "$0")/.."
build_dir=${BUILD_DIR:-build}

scripts/build.sh
# No kernel may spill registers or use local memory (ptxas -warn-spills,-warn-lmem-usage): a
# spill in a decode kernel is a performance regression that no test would catch. Only what this
# run compiled is checked (all of it on a clean clone, as in CI).
if grep -q "ptxas warning" "$build_dir/build.log"; then
  grep "ptxas warning" "$build_dir/build.log" >&2
  echo "test.sh: ptxas reported spills or local memory (above)" >&2
  exit 1
fi
ctest --test-dir "$build_dir" --output-on-failure -j "$(nproc)"

venv=${VENV_DIR:-.venv}
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
"$venv/bin/python" -m pip install -q --upgrade pip
"$venv/bin/python" -m pip install -q numpy ml_dtypes pytest
# The Python tests exercise the CPU backend, so the extension is built without CUDA here; the GPU
# machine builds it with CUDA (docs/python.md).
"$venv/bin/python" -m pip install -q . -C cmake.define.SPARSE_MLA_CUDA=OFF -C build-dir=build-py
set +e
"$venv/bin/python" -m pytest tests/python -q
rc=$?
set -e
if [ $rc -eq 5 ]; then
  echo "test.sh: pytest collected no tests" >&2
  exit 1
fi
[ $rc -eq 0 ] || exit $rc

# Each libFuzzer target briefly (ASan + UBSan); long runs: docs/robustness.md.
scripts/fuzz.sh --seconds "${FUZZ_SECONDS:-20}"
