#!/usr/bin/env bash
# Configure and build CMake presets (default: host). Incremental: a second run builds nothing.
#   bash ci/build.sh                       # host tools + C tests
#   bash ci/build.sh aarch64-dotprod aarch64-i8mm
set -euo pipefail
cd "$(dirname "$0")/.."
source ci/env.sh
presets=("$@")
((${#presets[@]})) || presets=(host)
for preset in "${presets[@]}"; do
    printf '\033[1m[build]\033[0m %s\n' "$preset" >&2
    if [[ ! -f build/$preset/CMakeCache.txt ]]; then
        log=$(mktemp)
        cmake --preset "$preset" > "$log" 2>&1 || { cat "$log"; rm -f "$log"; exit 1; }
        rm -f "$log"
    fi
    cmake --build --preset "$preset" -j "$JOBS"
done
