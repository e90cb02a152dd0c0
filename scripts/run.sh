#!/usr/bin/env bash
# The main job: install what is missing, build, generate the default model if it
# is missing, and run it. Arguments are passed to `moetax run` (e.g. -p "text" -n 32).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/deps.sh build
scripts/build.sh
model=${MOETAX_MODEL:-models/default.gguf}
if [ ! -f "$model" ]; then
  echo "moetax: generating the default model ($model: the 'small' preset, q8_0)" >&2
  ./build/moetax gen --preset small --type q8_0 -o "$model"
fi
if ./build/moetax run --help >/dev/null 2>&1; then
  exec ./build/moetax run -m "$model" "$@"
fi
# the forward pass is not built yet: show the model
exec ./build/moetax inspect "$model" --no-tensors
