# Shared settings for the ci/ scripts (sourced, not run).
REPO_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
export S3D8_CACHE=${S3D8_CACHE:-$REPO_ROOT/.cache}
VENV=${S3D8_VENV:-$REPO_ROOT/.venv}
PY=$VENV/bin/python
# ccache lives under the ignored cache folder; paths relative to the repo so clones share hits
export CCACHE_DIR=${CCACHE_DIR:-$S3D8_CACHE/ccache}
export CCACHE_BASEDIR=${CCACHE_BASEDIR:-$REPO_ROOT}
export CCACHE_MAXSIZE=${CCACHE_MAXSIZE:-5G}
export CCACHE_NOHASHDIR=1
JOBS=${S3D8_JOBS:-$(nproc)}
export S3D8_BIN_DIR=${S3D8_BIN_DIR:-$REPO_ROOT/build/host/bin}
