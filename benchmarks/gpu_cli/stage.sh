#!/usr/bin/env bash
# Fills .gpu/ (git-ignored) with what benchmarks/gpu_cli/run.sh needs on the GPU machine, which
# has no network: llama.cpp's source without its vocab models and docs (~10 MB xz), 600 kB of
# enwiki calibration text, SmolLM2's tokenizer. From the repository root, after
# `bash scripts/install.sh` (the source, the default model and the corpus in the cache).
set -euo pipefail
cd "$(dirname "$0")/../.."
C=${VOODOO_CACHE:-$HOME/.cache/voodoo}
mkdir -p .gpu
grep -qx ".gpu/" .git/info/exclude 2>/dev/null || echo ".gpu/" >> .git/info/exclude
(cd $C/llama.cpp/0c1e57098 && tar cf - --exclude=./src/models --exclude=./src/docs \
  --exclude=./src/media --exclude=./src/benches ./src) | xz -T2 -3 > .gpu/llama-src.tar.xz
python3 - <<'PY'
from voodoo.data import read_documents
docs, _ = read_documents("enwiki")
out, n = [], 0
for d in docs:
    out.append(d); n += len(d)
    if n > 600_000:
        break
open(".gpu/calib.txt", "w").write("\n\n\n".join(out))
PY
rm -rf .gpu/tokenizer && cp -r $C/models/default/tokenizer .gpu/tokenizer
du -sh .gpu/*
