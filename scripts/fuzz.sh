#!/usr/bin/env bash
# Builds the libFuzzer targets (fuzz/) in a Clang build with ASan and UBSan in every layer
# (build-fuzz/), then runs each for FUZZ_SECONDS on a scratch copy of its seed corpus
# (fuzz/corpus/<name>/; the checked-in seeds are never changed). Fails on the first crash,
# leak, sanitizer report, broken invariant, timeout or out-of-memory, leaving the input that
# caused it (crash-*, leak-*, timeout-*, oom-*) and each target's log in FUZZ_OUT.
#
#   FUZZ_SECONDS    seconds per target (default 20)
#   FUZZ_TARGETS    space-separated names to run (default: every fuzz/*_fuzzer.cc)
#   FUZZ_BUILD_DIR  the Clang build (default build-fuzz)
#   FUZZ_OUT        logs, crash inputs and scratch corpora (default $FUZZ_BUILD_DIR/fuzz-out)
#   FUZZ_JOBS       build parallelism (default nproc)
# Further arguments go to every libFuzzer run, e.g. `scripts/fuzz.sh -runs=10000000` (then
# FUZZ_SECONDS=0 lifts the time limit).
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=${FUZZ_SECONDS:-20}
build=${FUZZ_BUILD_DIR:-build-fuzz}
out=${FUZZ_OUT:-$build/fuzz-out}
jobs=${FUZZ_JOBS:-$(nproc)}
if [ -n "${FUZZ_TARGETS:-}" ]; then
  read -r -a targets <<<"$FUZZ_TARGETS"
else
  targets=()
  for f in fuzz/*_fuzzer.cc; do targets+=("$(basename "$f" _fuzzer.cc)"); done
fi

start=$SECONDS
CC=clang CXX=clang++ cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DKVFERRY_WITH_CUDA=OFF -DKVFERRY_SANITIZER=address,undefined -DKVFERRY_BUILD_FUZZERS=ON \
  -DKVFERRY_BUILD_TESTS=OFF >/dev/null
cmake --build "$build" -j "$jobs" --target kvferry_fuzzers
echo "fuzz: built in $((SECONDS - start)) s"

# Libraries built with recoverable UBSan checks must stop at the first report too.
export UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1
export ASAN_OPTIONS=detect_leaks=1
mkdir -p "$out"
failed=()
for name in "${targets[@]}"; do
  bin=$build/fuzz/${name}_fuzzer
  corpus=$out/corpus/$name
  rm -rf "$corpus"
  mkdir -p "$corpus"
  cp fuzz/corpus/"$name"/* "$corpus"/
  args=(-timeout=10 -print_final_stats=1 -artifact_prefix="$out/$name-")
  [ "$seconds" -gt 0 ] && args+=(-max_total_time="$seconds")
  [ -f fuzz/dict/"$name".dict ] && args+=(-dict=fuzz/dict/"$name".dict)
  log=$out/$name.log
  run_start=$SECONDS
  if "$bin" "${args[@]}" "$@" "$corpus" >"$log" 2>&1; then
    # From libFuzzer's last status line ("#N DONE cov: C ft: F corp: U/Bb ...") and final stats.
    cov=$(grep -E '^#[0-9]+[[:space:]]+DONE' "$log" | tail -1 |
      grep -oE 'cov: [0-9]+ ft: [0-9]+ corp: [0-9]+/[0-9]+[a-zA-Z]*' || true)
    execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log")
    echo "fuzz: $name: ${execs:-?} runs in $((SECONDS - run_start)) s, no crash; $cov"
  else
    echo "fuzz: $name FAILED (log: $log); its last lines:" >&2
    tail -n 40 "$log" >&2
    failed+=("$name")
  fi
done
echo "fuzz: ${#targets[@]} targets in $((SECONDS - start)) s in all"
if [ ${#failed[@]} -gt 0 ]; then
  echo "fuzz: failed: ${failed[*]} (inputs that failed: $out/<name>-crash-*, leak-*, ...)" >&2
  exit 1
fi
