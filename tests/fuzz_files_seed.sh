#!/usr/bin/env bash
# fuzz_files_seed.sh MOETAX CORPUS - seed the side-file fuzzer (fuzz_files) when the corpus folder is
# empty: a ledger and a trace of a run, a routing profile and a fitted predictor of the tiny preset
# (the shape fuzz_files loads predictors for), each behind the byte that picks its reader (0 report,
# 1 profile, 2 predictor).
set -eu
moetax=$1 corpus=$2
mkdir -p "$corpus"
[ -z "$(ls -A "$corpus")" ] || exit 0
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# each step's output kept, and shown when it fails (set -e then ends the seeding, and the fuzz stage with it)
step() { "$@" >"$tmp/step.log" 2>&1 || { echo "fuzz_files_seed.sh: failed: $*" >&2; cat "$tmp/step.log" >&2; return 1; }; }
step "$moetax" gen --preset tiny -o "$tmp/tiny.gguf"
printf 'def add(a, b):\n    return a + b\n\nprint(add(1, 2))\n%.0s' 1 2 3 4 > "$tmp/text.txt"
step "$moetax" profile -m "$tmp/tiny.gguf" -f "$tmp/text.txt" -o "$tmp/prof.json" --fit-predictor
step "$moetax" run -m "$tmp/tiny.gguf" -p "def f(" -n 8 --temp 0 --ledger "$tmp/led.json" --trace "$tmp/trace.json" \
    --expert-budget 160K
"$moetax" run -m "$tmp/tiny.gguf" --parallel 2 -f "$tmp/text.txt" -n 4 --temp 0 --ledger "$tmp/led2.json" \
    >/dev/null 2>&1 || true  # a batched run's ledger, where it works (optional)
seed() { { printf "\\x$1"; cat "$2"; } > "$corpus/seed-$3"; }
seed 00 "$tmp/led.json" ledger
seed 00 "$tmp/trace.json" trace
[ -s "$tmp/led2.json" ] && seed 00 "$tmp/led2.json" ledger-batch
seed 01 "$tmp/prof.json" profile
seed 02 "$tmp/prof.pred" predictor
