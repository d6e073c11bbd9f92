#!/usr/bin/env bash
# Configure and build CMake presets (default: host). Incremental: a second run builds nothing.
#   bash ci/build.sh                       # host tools + C tests
#   bash ci/build.sh aarch64-dotprod aarch64-i8mm
#   S3D8_TARGETS="llama-quantize llama-cli" bash ci/build.sh host   # only these targets (ci/main.sh)
set -euo pipefail
cd "$(dirname "$0")/.."
source ci/env.sh
presets=("$@")
((${#presets[@]})) || presets=(host)
for preset in "${presets[@]}"; do
    printf '\033[1m[build]\033[0m %s\n' "$preset" >&2
    # configure when the build folder is new or the presets/toolchain changed since it was configured (a
    # preset's cache variables only reach an existing build folder through `cmake --preset`)
    stamp=build/$preset/.s3d8-presets.sha256
    # (and when ci/ui.sh's web page appeared or went, which decides whether llama-server embeds one: CMakeLists.txt)
    ui=absent
    [[ -f $S3D8_CACHE/ui/dist/index.html ]] && ui=present
    digest=$( (cat CMakePresets.json cmake/*.cmake; echo "web page $ui") | sha256sum | cut -c1-16)
    if [[ ! -f build/$preset/CMakeCache.txt || "$(cat "$stamp" 2>/dev/null)" != "$digest" ]]; then
        log=$(mktemp)
        cmake --preset "$preset" > "$log" 2>&1 || { cat "$log"; rm -f "$log"; exit 1; }
        rm -f "$log"
        echo "$digest" > "$stamp"
    fi
    # shellcheck disable=SC2086  # a space-separated list of target names
    cmake --build --preset "$preset" -j "$JOBS" ${S3D8_TARGETS:+--target $S3D8_TARGETS}
done
