#!/usr/bin/env bash
# Rebuild the default model from scratch: tokenizer, training, export, quantization,
# held-out perplexity per type. About 90 minutes on 2 cores (see models/README.md).
#
#   bash tools/train/make_default_model.sh [WORK]      (default WORK: build-train/)
#
# Writes WORK/{tokenizer.json,ckpt.pt,log.jsonl}, WORK/pycode-20m-{f32,q8_0,q4_0}.gguf,
# WORK/heldout/ (the held-out source files) and WORK/perplexity.txt. Copy
# WORK/pycode-20m-q8_0.gguf to models/ to make it the default.
set -euo pipefail
cd "$(dirname "$0")/../.."
work=${1:-build-train}
scripts/deps.sh build
scripts/deps.sh train
scripts/build.sh
mkdir -p "$work"
/usr/bin/python3 tools/train/train.py --out "$work" --steps "${MOETAX_TRAIN_STEPS:-600}" --resume
/usr/bin/python3 tools/train/export.py "$work/ckpt.pt" "$work/tokenizer.json" "$work/pycode-20m-f32.gguf"
./build/moetax quantize "$work/pycode-20m-f32.gguf" "$work/pycode-20m-q8_0.gguf" q8_0
./build/moetax quantize "$work/pycode-20m-f32.gguf" "$work/pycode-20m-q4_0.gguf" q4_0
/usr/bin/python3 tools/train/corpus.py --write-heldout "$work/heldout"
: > "$work/perplexity.txt"
for t in f32 q8_0 q4_0; do
  ./build/moetax perplexity -m "$work/pycode-20m-$t.gguf" -f "$work/heldout" --json | tee -a "$work/perplexity.txt"
done
