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
# the host build only the five tools tools/main_job.py runs and the converter's C encoder (libs3d8-native)
bash ci/setup.sh --main
S3D8_TARGETS="llama-quantize llama-imatrix llama-perplexity llama-cli llama-bench s3d8-native" bash ci/build.sh host
exec "$PY" tools/main_job.py "$@"
