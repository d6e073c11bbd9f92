# Shared settings for the ci/ scripts (sourced, not run).
REPO_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
export S3D8_CACHE=${S3D8_CACHE:-$REPO_ROOT/.cache}
VENV=${S3D8_VENV:-$REPO_ROOT/.venv}
PY=$VENV/bin/python
# The compile caches (ccache, and ci/glslc_cache.py for the Vulkan shaders) live in one folder per machine, so that
# a fresh clone on the same machine (CI runs on the submitting session's machine) reuses its objects; paths are made
# relative to the repo, so clones share hits. Where that folder cannot be made, they stay in the clone's ignored
# cache folder (a bare machine builds everything either way).
S3D8_MACHINE_CACHE=${S3D8_MACHINE_CACHE:-/var/cache/llama-mobile-s3d8}
mkdir -p "$S3D8_MACHINE_CACHE" 2>/dev/null && [[ -w $S3D8_MACHINE_CACHE ]] || S3D8_MACHINE_CACHE=$S3D8_CACHE
export CCACHE_DIR=${CCACHE_DIR:-$S3D8_MACHINE_CACHE/ccache}
export S3D8_GLSLC_CACHE=${S3D8_GLSLC_CACHE:-$S3D8_MACHINE_CACHE/glslc}
export CCACHE_BASEDIR=${CCACHE_BASEDIR:-$REPO_ROOT}
export CCACHE_MAXSIZE=${CCACHE_MAXSIZE:-5G}
export CCACHE_NOHASHDIR=1
JOBS=${S3D8_JOBS:-$(nproc)}
export S3D8_BIN_DIR=${S3D8_BIN_DIR:-$REPO_ROOT/build/host/bin}
