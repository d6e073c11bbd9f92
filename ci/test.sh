#!/usr/bin/env bash
# The project's test command (README; .ci/run calls exactly this):
#   set-up → build (both aarch64 variants, static, with llama-cli/llama-mtmd-cli/llama-mllama-dump, while the web page
#   builds; then host, then vulkan: ggml-vulkan with the tools its tests run, docs/gpu.md) →
#   lint (ruff + mypy over the Python tree, ci/lint.py) → pytest (tests/python/test_phone_path.py runs those aarch64 tools under qemu-aarch64 against x86,
#   tests/python/test_vulkan.py the vulkan build's on Mesa's lavapipe) → CTest on x86 → CTest of both aarch64 builds
#   under qemu-aarch64 -cpu max → CTest of the vulkan build (label vulkan, on lavapipe) → upstream's own CTest suite (label main) on the
#   patched tree → the series against every upstream tree of ci/upstream.py (ci/check_upstream.py) → the fuzz build (clang, ASan + UBSan) and its
#   CTest: the regression inputs and a bounded run of every fuzz target (S3D8_FUZZ_SECONDS each, default 20;
#   tests/fuzz) → one summary line "N passed, M failed".
# Every suite runs even when an earlier one fails; the exit status is non-zero on any failure.
# S3D8_SKIP_CROSS=1 skips the aarch64 builds (reported, and counted as a failure, never as a pass; the phone-path
# tests then skip, which counts as failures too).
set -uo pipefail
cd "$(dirname "$0")/.."
source ci/env.sh

t_setup=$SECONDS
bash ci/setup.sh --no-ui || { echo "setup failed"; echo "0 passed, 1 failed"; exit 1; }

results=build/test-results
rm -rf "$results" && mkdir -p "$results"
printf 'setup\t%d\n' $((SECONDS - t_setup)) > "$results/timings.tsv"
status=0
# wall time of each step, printed by ci/summarize.py with the slowest test cases (where CI time goes)
timed() {
    local name=$1 t0=$SECONDS rc=0
    shift
    "$@" || rc=$?
    printf '%s\t%d\n' "$name" $((SECONDS - t0)) >> "$results/timings.tsv"
    return $rc
}
presets=(aarch64-dotprod aarch64-i8mm host vulkan)
if [[ "${S3D8_SKIP_CROSS:-0}" == 1 ]]; then
    presets=(host vulkan)
    echo "aarch64 builds skipped by S3D8_SKIP_CROSS=1" > "$results/skipped-cross.txt"
fi

# llama-server's web page (ci/ui.sh: npm ci and a vite build, mostly one core) is built beside the aarch64 builds;
# the host build, which embeds it, waits for it. A failed page build fails the run (the browser test fails too).
(
    t0=$SECONDS rc=0
    bash ci/ui.sh || rc=$?
    printf 'web page (beside the aarch64 builds)\t%d\n' $((SECONDS - t0)) >> "$results/timings.tsv"
    exit $rc
) &
ui_pid=$!

for preset in "${presets[@]}"; do
    if [[ $preset == host ]] && ! wait "$ui_pid"; then
        echo "the web page's build (ci/ui.sh) failed" > "$results/ui.failed"
        status=1
    fi
    if ! timed "build $preset" bash ci/build.sh "$preset"; then
        echo "build of $preset failed" > "$results/build-$preset.failed"
        status=1
    fi
done

# lint and type check of the whole Python tree (ruff, mypy; pyproject.toml), one JUnit case each
printf '\033[1m[test]\033[0m lint (ruff, mypy)\n' >&2
timed lint "$PY" ci/lint.py --junitxml="$results/lint.xml" || status=1

printf '\033[1m[test]\033[0m pytest\n' >&2
# pytest-xdist: one worker per core, each test file on one worker (its module fixtures run once); the suite is
# nearly all single-threaded (CPU time = 1.05 x wall time, measured 2026-12-02), so this halves its wall time
timed pytest "$PY" -m pytest -q -p no:cacheprovider -n "$JOBS" --dist loadfile --junitxml="$results/pytest.xml" \
    tests/python || status=1

for preset in "${presets[@]}"; do
    [[ -f "$results/build-$preset.failed" ]] && continue
    printf '\033[1m[test]\033[0m ctest %s\n' "$preset" >&2
    timed "ctest $preset" ctest --preset "$preset" --output-junit "$PWD/$results/ctest-$preset.xml" || status=1
done

# upstream's own suite (label main) on the patched tree, built with the host preset; the checks that need the
# network are left out by the preset, each named with its reason in docs/upstreaming.md
if [[ ! -f "$results/build-host.failed" ]]; then
    printf '\033[1m[test]\033[0m ctest upstream\n' >&2
    timed "ctest upstream" ctest --preset upstream --output-junit "$PWD/$results/ctest-upstream.xml" || status=1
fi

# the series against every upstream tree ci/upstream.py lists for checking (the pin and any newer one): each
# patch applies cleanly, and no ggml type id of ours is taken there
printf '\033[1m[test]\033[0m check_upstream\n' >&2
timed "check upstream" "$PY" ci/check_upstream.py --junitxml="$results/check-upstream.xml" || status=1

# the loaders' fuzz targets (docs/reliability.md, "Fuzzing the loaders"): ASan + UBSan build, replay of the
# regression inputs, then a bounded run per target; any crash or sanitizer report fails its test
if timed "build fuzz" bash ci/build.sh fuzz; then
    printf '\033[1m[test]\033[0m ctest fuzz\n' >&2
    timed "ctest fuzz" ctest --preset fuzz --output-junit "$PWD/$results/ctest-fuzz.xml" || status=1
else
    echo "build of fuzz failed" > "$results/build-fuzz.failed"
    status=1
fi

# the mutation check's daily sample (docs/reliability.md, "Mutation check"): five of ci/mutants.py's faults, drawn
# by the date, each applied alone, rebuilt and given only the tests of its code; a fault that the tests let pass (a
# survivor) or a mutant whose line is gone (a stale list) fails the step
if [[ ! -f "$results/build-host.failed" && ! -f "$results/build-vulkan.failed" ]]; then
    printf '\033[1m[test]\033[0m mutants (the daily sample of five)\n' >&2
    timed mutants "$PY" ci/mutants.py --sample 5 --seed "$(date -u +%Y%m%d)" --junitxml="$results/mutants.xml" \
        --log "$results/mutants.log" || status=1
fi

"$PY" ci/summarize.py "$results" || status=1
exit $status
