#!/usr/bin/env bash
# The test command (README.md): install, bootstrap, run every test.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
python3 -m pytest -q -ra --durations=25 tests "$@"
