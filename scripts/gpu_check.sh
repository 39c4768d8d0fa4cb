#!/usr/bin/env bash
# One call on the GPU machine: build (all cores, CUDA for the local GPU), run the C++ GPU tests,
# the Python tests, the sanitizers, `sparse-mla run` and the benchmark. Logs and JSON go to
# $OUT (or ./gpu-out; the logs packed into logs-<time>.tar.gz); a short table is printed last.
#   scripts/gpu_check.sh [steps...]   steps: build test python sanitize run bench (default: all)
# Without the build step, build-gpu/ must hold binaries built for this GPU (e.g. built elsewhere
# with -DSPARSE_MLA_CUDA_ARCHS=90a and carried along). The benchmark records SPARSE_MLA_COMMIT when
# set: compute it where the repository lives (a copied tree's .git may be stale).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-$PWD/gpu-out}
mkdir -p "$out"
steps=${*:-build test python sanitize run bench}
archs=${SPARSE_MLA_CUDA_ARCHS:-90a}
build_dir=build-gpu
declare -A result

step() {  # step NAME COMMAND...: runs COMMAND, logs to $out/NAME.log, records PASS/FAIL and time
  local name=$1; shift
  local t0=$SECONDS
  echo "== $name: $*" >&2
  if "$@" >"$out/$name.log" 2>&1; then result[$name]="PASS"; else result[$name]="FAIL(rc=$?)"; fi
  result[$name]="${result[$name]} $((SECONDS - t0))s"
  tail -n 5 "$out/$name.log" >&2
}

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv >"$out/gpu.txt" 2>&1
for s in $steps; do
  case $s in
    build)
      step build bash -c "cmake -S . -B $build_dir -G Ninja -DCMAKE_BUILD_TYPE=Release \
        -DSPARSE_MLA_CUDA=ON -DSPARSE_MLA_CUDA_ARCHS='$archs' && cmake --build $build_dir -j 16" ;;
    test)  # the whole gtest binary (CPU and GPU tests); GPU tests must not skip here
      step test bash -c "$build_dir/tests/cpp/sparse_mla_tests --gtest_brief=1 && \
        ! $build_dir/tests/cpp/sparse_mla_tests --gtest_filter='Cuda*:*/Cuda*' | grep -q SKIPPED"
      # the GPU tests again on the Hopper backend (fails where sm90 is not usable), its kernel
      # also on the small test shapes that the library would route to the portable kernels
      step test_sm90 bash -c "SPARSE_MLA_TEST_BACKEND=sm90 SPARSE_MLA_SM90_SMALL_BATCHES=1 \
        $build_dir/tests/cpp/sparse_mla_tests \
        --gtest_brief=1 --gtest_filter='Cuda*:*/Cuda*'" ;;
    python)
      step python bash -c "python3 -m pip install -q --no-build-isolation --no-deps . \
        -C cmake.define.SPARSE_MLA_CUDA_ARCHS='$archs' -C build-dir=build-py-gpu && \
        python3 -m pytest tests/python -q -rs" ;;
    sanitize)  # the representative subset, on the portable and on the Hopper backend
      filter=${SANITIZE_FILTER:-CudaKV.*:CudaMerge.*:CudaSparseDecodeCorners.*:CudaSparseDecodeLengths.*:CudaDenseDecodeCorners.*:CudaDenseDecodeDeterminism.*:CudaGraph.*:CudaPlan.*:CudaSparseDecodePlan.*:CudaFuzzDecode.*:CudaFuzzKvOps.*}
      step sanitize bash tools/gpu_sanitize.sh $build_dir "$out" "$filter"
      step sanitize_sm90 env SPARSE_MLA_TEST_BACKEND=sm90 SPARSE_MLA_SM90_SMALL_BATCHES=1 \
        bash tools/gpu_sanitize.sh $build_dir "$out/sm90" "$filter" ;;
    run)
      step run bash -c "$build_dir/tools/sparse-mla run && \
        $build_dir/tools/sparse-mla run --model dsv4-pro --batch 64 --context 32768 --mtp && \
        $build_dir/tools/sparse-mla run --backend cuda" ;;
    bench)  # with the SM clock sampled: the long rows run at the GPU's power limit
      # (docs/benchmarking.md), which bench_clocks.csv shows (reason 0x4: SW power cap)
      nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw.instant,clocks_event_reasons.active \
        --format=csv,noheader -lms 100 >"$out/bench_clocks.csv" 2>&1 &
      sampler=$!
      step bench bash -c "$build_dir/tools/sparse-mla bench --out-dir '$out' ${BENCH_ARGS:-}"
      kill $sampler 2>/dev/null
      awk -F', ' 'NF >= 4 && $2 + 0 > 0 { n++; if (!m || $2 + 0 < m) m = $2 + 0;
        if ($4 ~ /[4-7c-f]$/) c++ } END { if (n) printf "bench clocks: %d samples, lowest SM clock %d MHz, %d at the SW power cap\n", n, m, c }' \
        "$out/bench_clocks.csv" >"$out/bench_clocks.txt" ;;
  esac
done

echo
echo "GPU check ($(head -2 "$out/gpu.txt" | tail -1))"
printf '%-10s %s\n' step result
for s in $steps; do
  printf '%-10s %s\n' "$s" "${result[$s]:-skipped}"
  [ "$s" = test ] && printf '%-10s %s\n' test_sm90 "${result[test_sm90]:-skipped}"
  [ "$s" = sanitize ] && printf '%-10s %s\n' sanitize_sm90 "${result[sanitize_sm90]:-skipped}"
done
grep -h -E "PASSED|FAILED" "$out/test.log" "$out/test_sm90.log" 2>/dev/null | tail -6
cat "$out/sanitize_summary.txt" 2>/dev/null
[ -f "$out/sm90/sanitize_summary.txt" ] && { echo "sm90 backend:"; cat "$out/sm90/sanitize_summary.txt"; }
grep -h -E "passed|failed" "$out/python.log" 2>/dev/null | tail -1
cat "$out/bench_clocks.txt" 2>/dev/null
# The device tool returns at most 8 files: the logs this script wrote travel as one archive beside
# the results, named by time so that a later call into the same $out keeps the earlier one.
(cd "$out" || exit
  written=()
  for f in {build,test,test_sm90,python,sanitize,sanitize_sm90,run,bench}.log \
    sanitize_{memcheck,racecheck,initcheck,synccheck}.log sanitize_summary.txt sm90 \
    bench_clocks.csv bench_clocks.txt; do
    [ -e "$f" ] && written+=("$f")
  done
  if [ ${#written[@]} -gt 0 ]; then
    tar -czf "logs-$(date +%Y%m%d-%H%M%S).tar.gz" "${written[@]}" && rm -rf "${written[@]}"
  fi)
