#!/usr/bin/env bash
# llama-server's web page and the browser test's driver, built once into the ignored cache (called by ci/setup.sh):
#   * upstream's UI (tools/ui of the patched tree, a Svelte app): `npm ci` (every package checked against
#     tools/ui/package-lock.json's integrity hashes) and `npm run build` in a copy of the sources, the result kept
#     in $S3D8_CACHE/ui/dist. The build is keyed by a hash of every file of tools/ui (package-lock.json included)
#     and the node version: it is redone only when one of them changes. CMakeLists.txt embeds that folder into
#     llama-server (S3D8_UI_DIST; "-- UI: embedded N assets" at build time).
#   * playwright-core for tests/browser (tests/browser/package-lock.json), in $S3D8_CACHE/browser-test.
# npm's own cache is $S3D8_CACHE/npm: a rebuild after a source change downloads nothing that was downloaded once,
# and a run with both keys unchanged runs no npm at all (offline). The UI build's node_modules stays in
# $S3D8_CACHE/ui/build (deleting ~1 GB of small files costs minutes on a slow disk; the next `npm ci` replaces it).
# S3D8_SKIP_UI=1: nothing is built, llama-server has no web page and the browser test fails (no node/npm here).
set -euo pipefail
cd "$(dirname "$0")/.."
source ci/env.sh

log() { printf '\033[1m[setup]\033[0m %s\n' "$*" >&2; }

UI_SRC=${S3D8_UI_SRC:-work/llama.cpp/tools/ui}
UI_CACHE=$S3D8_CACHE/ui
export npm_config_cache=$S3D8_CACHE/npm
NPM_FLAGS=(--prefer-offline --no-audit --no-fund --loglevel=error)

if [[ "${S3D8_SKIP_UI:-0}" == 1 ]]; then
    log "S3D8_SKIP_UI=1: llama-server's web page is not built"
    exit 0
fi
# upstream's UI (vite 7) needs node >= 20.19
if ! command -v npm >/dev/null || ! node -e 'const [a, b] = process.versions.node.split(".").map(Number);
        process.exit(a > 20 || (a === 20 && b >= 19) ? 0 : 1)' 2>/dev/null; then
    log "llama-server's web page needs node >= 20.19 and npm ($(node --version 2>/dev/null || echo 'no node')):" \
        "install them (e.g. NodeSource's nodejs), or set S3D8_SKIP_UI=1 to build without the page"
    exit 1
fi

# every file of the UI's sources (nothing under it is built in place: the build runs in a copy), by relative path
ui_key() {
    {
        node --version
        (cd "$UI_SRC" && find . -type f -not -path './node_modules/*' -not -path './dist/*' \
            -not -path './.svelte-kit/*' -print0 | LC_ALL=C sort -z | xargs -0 sha256sum)
    } | sha256sum | cut -c1-16
}

key=$(ui_key)
if [[ "$(cat "$UI_CACHE/dist.key" 2>/dev/null)" == "$key" && -f "$UI_CACHE/dist/index.html" ]]; then
    :
else
    log "building llama-server's web page (npm ci + npm run build of $UI_SRC, key $key)"
    t0=$SECONDS
    # the sources copied into $work; its node_modules of an earlier build is left to `npm ci` (which replaces it)
    work=$UI_CACHE/build
    rm -rf "$UI_CACHE/dist.new"
    mkdir -p "$work"
    find "$work" -mindepth 1 -maxdepth 1 -not -name node_modules -exec rm -rf {} +
    cp -a "$UI_SRC/." "$work/"
    # the pinned upstream release (build.json, shown on the page)
    build_number=$(sed -n 's/^PIN = "\(.*\)"/\1/p' ci/upstream.py)
    (
        cd "$work"
        npm ci "${NPM_FLAGS[@]}"
        LLAMA_UI_OUT_DIR="$UI_CACHE/dist.new" LLAMA_BUILD_NUMBER="$build_number" \
            npm run build --silent >build.log 2>&1 || { tail -50 build.log; exit 1; }
    )
    [[ -f "$UI_CACHE/dist.new/index.html" ]] || { log "the UI build wrote no index.html"; exit 1; }
    rm -rf "$UI_CACHE/dist"
    mv "$UI_CACHE/dist.new" "$UI_CACHE/dist"
    echo "$key" > "$UI_CACHE/dist.key"
    log "web page built: $(find "$UI_CACHE/dist" -type f | wc -l) files in $((SECONDS - t0)) s"
fi

# playwright-core for the browser test (it drives Debian's chromium; no browser download)
BT_CACHE=$S3D8_CACHE/browser-test
bt_key=$(cat tests/browser/package.json tests/browser/package-lock.json | sha256sum | cut -c1-16)
if [[ "$(cat "$BT_CACHE/.key" 2>/dev/null)" != "$bt_key" || ! -d "$BT_CACHE/node_modules/playwright-core" ]]; then
    log "installing the browser test's playwright-core into $BT_CACHE"
    rm -rf "$BT_CACHE"
    mkdir -p "$BT_CACHE"
    cp tests/browser/package.json tests/browser/package-lock.json "$BT_CACHE/"
    (cd "$BT_CACHE" && npm ci "${NPM_FLAGS[@]}" --ignore-scripts)
    echo "$bt_key" > "$BT_CACHE/.key"
fi
