#!/usr/bin/env bash
# One fuzzing session of one target (libFuzzer, one process, one job), used by CTest for the bounded CI run
# and by hand for the long runs (docs/reliability.md, "Fuzzing the loaders"):
#   bash tests/fuzz/run.sh FUZZER WORKDIR BUDGET SEED_DIR...
#     FUZZER   build/fuzz/bin/fuzz-<target>
#     WORKDIR  kept between runs: corpus/ (grows; later runs continue from it), artifacts/ (crashing inputs),
#              messages.txt (the distinct rejection messages, numbers as '#'), log (libFuzzer's output)
#     BUDGET   -max_total_time=SECONDS or -runs=N
# Exit status: libFuzzer's (0: no crash, leak, timeout, out-of-memory or sanitizer report).
set -uo pipefail
fuzzer=$1 work=$2 budget=$3
shift 3
# S3D8_FUZZ_SECONDS overrides a time budget (ci/test.sh passes it through CTest)
if [[ -n "${S3D8_FUZZ_SECONDS:-}" && "$budget" == -max_total_time=* ]]; then
    budget=-max_total_time=$S3D8_FUZZ_SECONDS
fi
mkdir -p "$work/corpus" "$work/artifacts"
export ASAN_OPTIONS=${ASAN_OPTIONS:-halt_on_error=1:abort_on_error=0:detect_leaks=1:allocator_may_return_null=0:handle_abort=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-halt_on_error=1:print_stacktrace=1:report_error_type=1}
export S3D8_FUZZ_MESSAGES=$work/messages.txt
name=$(basename "$fuzzer")
start=$(date +%s)
"$fuzzer" -print_final_stats=1 -timeout=60 -rss_limit_mb=2048 -malloc_limit_mb=2048 \
    -artifact_prefix="$work/artifacts/" "$budget" "$work/corpus" "$@" >> "$work/log" 2>&1
rc=$?
execs=$(grep -a 'stat::number_of_executed_units' "$work/log" | tail -1 | awk '{print $2}')
rate=$(grep -a 'stat::average_exec_per_sec' "$work/log" | tail -1 | awk '{print $2}')
sort -u -o "$work/messages.txt" "$work/messages.txt" 2>/dev/null || true
echo "$name: ${execs:-?} inputs in $(( $(date +%s) - start )) s (${rate:-?}/s), exit status $rc," \
     "$(ls "$work/corpus" | wc -l) in the corpus, $(wc -l < "$work/messages.txt" 2>/dev/null || echo 0) distinct messages"
if [[ $rc != 0 ]]; then
    echo "--- $name failed; the input is in $work/artifacts/, the end of $work/log:"
    tail -n 80 "$work/log"
fi
exit $rc
