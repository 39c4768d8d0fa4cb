#!/usr/bin/env bash
# Builds the libFuzzer targets of fuzz/ with clang, AddressSanitizer and UndefinedBehaviorSanitizer
# into build-fuzz/ and runs each for a time or a number of executions, starting from the committed
# seeds (fuzz/corpus/<target>/; new inputs go to build-fuzz/corpus/, never into the repository).
# Prints executions, speed and findings per target; exits 1 if any target found something (the
# reproducer is saved as build-fuzz/artifacts/<target>-crash-*).
#
#   scripts/fuzz.sh [--seconds N | --runs N] [--update-corpus] [TARGET...]
#     --seconds N        run each target for N seconds (default 20)
#     --runs N           run each target for N executions instead
#     --update-corpus    merge what the run found into fuzz/corpus/<target>/ (minimized)
#     TARGET             validation, format, kv_ops, decode (default: all)
# Environment: BUILD_DIR (default build-fuzz), NICE (default 10). See docs/robustness.md.
set -euo pipefail
cd "$(dirname "$0")/.."

seconds=20
runs=""
update=0
targets=()
while [[ $# -gt 0 ]]; do
  case $1 in
    --seconds) seconds=$2; shift 2 ;;
    --runs) runs=$2; shift 2 ;;
    --update-corpus) update=1; shift ;;
    -h|--help) sed -n '2,13p' "$0"; exit 0 ;;
    -*) echo "fuzz.sh: unknown option $1" >&2; exit 2 ;;
    *) targets+=("$1"); shift ;;
  esac
done
[[ ${#targets[@]} -gt 0 ]] || targets=(validation format kv_ops decode)
build_dir=${BUILD_DIR:-build-fuzz}
nice_level=${NICE:-10}

# clang, its libFuzzer/sanitizer runtimes and the LLVM OpenMP runtime (Debian packages).
have_libfuzzer() {
  echo 'extern "C" int LLVMFuzzerTestOneInput(const unsigned char*, unsigned long) { return 0; }' |
    clang++ -x c++ -fsanitize=fuzzer,address,undefined - -o /dev/null >/dev/null 2>&1
}
need_install=0
if ! command -v clang++ >/dev/null || ! have_libfuzzer; then need_install=1; fi
ls /usr/lib/llvm-*/lib/libomp.so >/dev/null 2>&1 || need_install=1
if [[ $need_install -eq 1 ]]; then
  echo "fuzz.sh: installing clang, libclang-rt-dev (libFuzzer) and libomp-dev" >&2
  if [[ $(id -u) -ne 0 ]]; then
    echo "fuzz.sh: need root for apt-get (or install clang libclang-rt-dev libomp-dev)" >&2
    exit 2
  fi
  apt-get update -qq && apt-get install -y -qq clang libclang-rt-dev libomp-dev cmake make
  have_libfuzzer || { echo "fuzz.sh: clang still cannot link libFuzzer" >&2; exit 2; }
fi

CC=clang CXX=clang++ cmake -S . -B "$build_dir" -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DSPARSE_MLA_CUDA=OFF -DSPARSE_MLA_BUILD_TESTS=OFF -DSPARSE_MLA_BUILD_TOOLS=OFF \
  -DSPARSE_MLA_BUILD_FUZZERS=ON -DSPARSE_MLA_SANITIZE=fuzzer-no-link,address,undefined >/dev/null
cmake --build "$build_dir" -j "$(nproc)" --target "${targets[@]/#/fuzz_}"

export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=0}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
mkdir -p "$build_dir/artifacts"
found=0
summary=()
for t in "${targets[@]}"; do
  corpus=$build_dir/corpus/$t
  mkdir -p "$corpus"
  [[ -d fuzz/corpus/$t ]] && cp -n fuzz/corpus/$t/* "$corpus"/ 2>/dev/null || true
  limit=(-max_total_time="$seconds")
  [[ -n $runs ]] && limit=(-runs="$runs")
  log=$build_dir/fuzz_$t.log
  echo "== fuzz_$t ${limit[*]}" >&2
  set +e
  nice -n "$nice_level" "$build_dir/fuzz/fuzz_$t" "$corpus" "${limit[@]}" -print_final_stats=1 \
    -artifact_prefix="$build_dir/artifacts/$t-" >"$log" 2>&1
  rc=$?
  set -e
  execs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$log" | grep -o '[0-9]*$' || echo "?")
  speed=$(grep -o 'stat::average_exec_per_sec: *[0-9]*' "$log" | grep -o '[0-9]*$' || echo "?")
  if [[ $rc -ne 0 ]]; then
    found=1
    finding=$(grep -m1 -E "found:|ERROR:|runtime error" "$log" || echo "exit status $rc")
    summary+=("$(printf '%-11s %12s %9s/s  FINDING: %s' "$t" "${execs:-?}" "${speed:-?}" "$finding")")
    tail -n 30 "$log" >&2
  else
    summary+=("$(printf '%-11s %12s %9s/s  no findings' "$t" "$execs" "$speed")")
  fi
  if [[ $update -eq 1 && $rc -eq 0 ]]; then
    mkdir -p "fuzz/corpus/$t.new"
    # Edge coverage only (no hit counters): keeps the committed seed set small.
    nice -n "$nice_level" "$build_dir/fuzz/fuzz_$t" -merge=1 -use_counters=0 "fuzz/corpus/$t.new" \
      "fuzz/corpus/$t" "$corpus" >>"$log" 2>&1
    rm -rf "fuzz/corpus/$t" && mv "fuzz/corpus/$t.new" "fuzz/corpus/$t"
  fi
done

echo
printf '%-11s %12s %11s  %s\n' target executions speed result
printf '%s\n' "${summary[@]}"
exit $found
