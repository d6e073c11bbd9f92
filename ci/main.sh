#!/usr/bin/env bash
# The main job (README): set-up, build the host tools, then run tools/main_job.py on the embedded default
# model. Arguments go to tools/main_job.py (`bash ci/main.sh --help`).
set -euo pipefail
cd "$(dirname "$0")/.."
source ci/env.sh
if [[ "${1:-}" == "-h" || "${1:-}" == "--help" ]]; then
    exec "${PY}" tools/main_job.py --help 2>/dev/null || sed -n 2,3p "$0"
fi
# only what the main job needs: no cross compilers, QEMU, clang, browser or web page (ci/setup.sh --main), and of
# the host build only the five tools tools/main_job.py runs and the converter's C encoder (libs3d8-native). The
# Python venv installs (network, one core) while the tree builds.
t0=$SECONDS
bash ci/setup.sh --main --no-python
pylog=$(mktemp)
bash ci/setup.sh --main --python-only > "$pylog" 2>&1 &
py_pid=$!
trap 'kill "$py_pid" 2>/dev/null; rm -f "$pylog"' EXIT
S3D8_TARGETS="llama-quantize llama-imatrix llama-perplexity llama-completion llama-bench s3d8-native" \
    bash ci/build.sh host
py_status=0
wait "$py_pid" || py_status=$?
cat "$pylog" >&2
((py_status == 0)) || { echo "main: the Python set-up failed (above)" >&2; exit 1; }
trap - EXIT
rm -f "$pylog"
printf '\033[1m[main]\033[0m set-up and build took %d s\n' $((SECONDS - t0)) >&2
exec "$PY" tools/main_job.py "$@"
