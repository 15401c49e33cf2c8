#!/usr/bin/env bash
# The test command (README.md): install, bootstrap, run every test.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
# the suite needs about 3 GB of temporary space while it runs (removed at the end)
free_kb=$(df -Pk "${TMPDIR:-/tmp}" 2>/dev/null | awk 'NR == 2 {print $4}' || true)
if [ "${free_kb:-0}" -lt 4000000 ]; then
    echo "[test] warning: only $((free_kb / 1024)) MiB free in ${TMPDIR:-/tmp}; the tests need" \
         "about 3 GB there (set TMPDIR to a bigger disk, or free space: voodoo doctor shows" \
         "the size of Voodoo's cache)" >&2
fi
python3 -m pytest -q -ra --durations=40 tests "$@"
