#!/usr/bin/env bash
# fuzz_api_seed.sh CORPUS - seed the server request fuzzer (fuzz_api) with request bodies of
# every shape the API takes, when the corpus folder is empty.
set -eu
corpus=$1
mkdir -p "$corpus"
[ -z "$(ls -A "$corpus")" ] || exit 0
i=0
while IFS= read -r line; do
  i=$((i + 1))
  printf '%s' "$line" > "$corpus/seed-$i.json"
done <<'SEEDS'
{"prompt": "def f(", "max_tokens": 8, "temperature": 0}
{"prompt": ["import os"], "max_tokens": 4, "stream": true, "stream_options": {"include_usage": true}}
{"prompt": "x", "stop": ["\n", "def"], "top_k": 40, "top_p": 0.95, "min_p": 0.05, "seed": 7, "n": 1}
{"messages": [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "def f("}], "max_tokens": 8}
{"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "text", "text": " there"}]}], "max_completion_tokens": 3}
{"messages": [{"role": "assistant", "content": null}], "temperature": 1.5, "unknown": {"a": [1, 2, 3]}}
{"prompt": "\u00e9\ud83d\ude00", "max_tokens": -1, "temperature": "hot"}
SEEDS
