#!/usr/bin/env bash
# fuzz_run.sh FUZZER MOETAX CORPUS SECONDS [MAX_LEN] - run one libFuzzer target for SECONDS from
# CORPUS, seeding it first (when empty) with small generated models: tiny and tiny-v3 in f32, q8_0
# and q4_0 (2 layers, d 32), a 1-layer q4_0 one of 26 KiB, and qwen3moe, qwen2moe, olmoe and
# Mixtral files in q8_0 and q4_0 (2 layers, d 32, 51-94 KiB). Used by scripts/test.sh (briefly)
# and by the CTests fuzz_*_long (label slow).
set -uo pipefail
fuzzer=$1 moetax=$2 corpus=$3 seconds=$4 max_len=${5:-131072}
mkdir -p "$corpus"
case "$fuzzer" in
  */fuzz_api) "$(dirname "$0")/fuzz_api_seed.sh" "$corpus" || exit 1; max_len=${5:-8192} ;;
  */fuzz_files) "$(dirname "$0")/fuzz_files_seed.sh" "$moetax" "$corpus" || exit 1; max_len=${5:-262144} ;;
esac
if [ -z "$(ls -A "$corpus")" ]; then
  small=(--vocab 260 --embd 32 --ff 32 --expert-ff 32)
  for preset in tiny tiny-v3; do
    for t in f32 q8_0 q4_0; do
      "$moetax" gen --preset $preset --type $t --layers 2 "${small[@]}" -o "$corpus/$preset-$t.gguf" >/dev/null 2>&1 || exit 1
    done
  done
  "$moetax" gen --preset tiny --type q4_0 --layers 1 --experts 4 --experts-used 2 "${small[@]}" \
      -o "$corpus/tiny-1layer-q4_0.gguf" >/dev/null 2>&1 || exit 1
  # the other architectures (grouped-query attention, q/k norms, biases, a gated shared expert)
  for arch in qwen3moe qwen2moe olmoe mixtral; do
    extra=(); [ $arch = qwen2moe ] && extra=(--heads 4 --head-dim 8 --shared-ff 32)
    for t in q8_0 q4_0; do
      "$moetax" gen --preset tiny --arch $arch --type $t --layers 2 "${small[@]}" "${extra[@]}" \
          -o "$corpus/$arch-$t.gguf" >/dev/null 2>&1 || exit 1
    done
  done
fi
# what it finds (crash-*, leak-*, oom-*, timeout-*, slow-unit-*) goes beside the corpus (CORPUS-crash-...), not
# into the working directory
"$fuzzer" -max_total_time="$seconds" -max_len="$max_len" -rss_limit_mb=2048 -print_final_stats=1 \
    -artifact_prefix="${corpus%/}-" "$corpus" 2>&1 | tail -5
exit "${PIPESTATUS[0]}"
