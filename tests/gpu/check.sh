#!/usr/bin/env bash
# The GPU check in one call (see tests/gpu/check.py):  bash tests/gpu/check.sh OUT_DIR [--quick] [...]
set -euo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec python3 tests/gpu/check.py "$@"
