#!/usr/bin/env bash
# The main job: install what is missing, build, and run the default model (a small
# DeepSeek-style MoE trained on Python source, committed under models/; see
# models/README.md). Arguments are passed to `moetax run` (e.g. -p "text" -n 32).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/deps.sh build
scripts/build.sh
model=${MOETAX_MODEL:-models/pycode-20m-q8_0.gguf}
if [ ! -f "$model" ]; then
  echo "moetax: the model $model is missing (the default one is committed: git checkout -- models/)" >&2
  exit 1
fi
if [ $# -eq 0 ]; then
  set -- -p $'import os\n\n\ndef main(' -n 64 --temp 0
fi
exec ./build/moetax run -m "$model" "$@"
