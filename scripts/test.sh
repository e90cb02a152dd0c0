#!/usr/bin/env bash
# The whole test suite: install what is missing, build, run CTest (Release),
# the unit tests again under AddressSanitizer+UndefinedBehaviorSanitizer and the
# threaded ones under ThreadSanitizer, and the GGUF and model-loader fuzzers briefly.
# MOETAX_SLOW=1 also runs the tests labelled 'slow'.
set -uo pipefail
cd "$(dirname "$0")/.."
scripts/deps.sh test || exit 1
jobs=$(nproc)
passed=0; failed=0; failed_names=()
stage() { # name, command...
  local name=$1; shift
  echo "=== $name"
  if "$@"; then passed=$((passed + 1)); else failed=$((failed + 1)); failed_names+=("$name"); fi
}
# one -LE only: ctest keeps the first of several (mpi tests then ran twice, the first time beside others)
exclude=(-LE mpi)
[ "${MOETAX_SLOW:-0}" = 1 ] || exclude=(-LE 'slow|mpi')

build() { # dir, cmake args... [-- targets...]
  local dir=$1; shift
  local args=() targets=()
  while [ $# -gt 0 ] && [ "$1" != -- ]; do args+=("$1"); shift; done
  [ $# -gt 0 ] && { shift; targets=("$@"); }
  cmake -S . -B "$dir" -DCMAKE_BUILD_TYPE=Release "${args[@]}" >/dev/null || return 1
  [ ${#targets[@]} -gt 0 ] && targets=(--target "${targets[@]}")
  cmake --build "$dir" -j"$jobs" "${targets[@]}" 2>&1 | grep -E "warning|error"
  test "${PIPESTATUS[0]}" -eq 0
}
built_for() { # dir label cmake args...: configure, then build only what that label's tests run
  local dir=$1 label=$2; shift 2
  build "$dir" "$@" -- "tests_$label" # moetax and the label's C tests (tests/CMakeLists.txt)
}

stage "build (release)" build build
stage "ctest (release)" ctest --test-dir build --output-on-failure -j"$jobs" "${exclude[@]}"
# expert parallelism: mpirun -np 1/2 oversubscribed, alone (its ranks spin while they wait);
# not under the sanitizers (OpenMPI's own allocations are reported as leaks)
stage "ctest mpi (release)" ctest --test-dir build --output-on-failure -L mpi
stage "build (asan+ubsan)" built_for build-asan unit -DCMAKE_BUILD_TYPE=RelWithDebInfo -DMOETAX_SANITIZE=address,undefined
stage "ctest unit (asan+ubsan)" ctest --test-dir build-asan --output-on-failure -j"$jobs" -L unit
stage "build (tsan)" built_for build-tsan threads -DCMAKE_BUILD_TYPE=RelWithDebInfo -DMOETAX_SANITIZE=thread
stage "ctest threads (tsan)" ctest --test-dir build-tsan --output-on-failure -j"$jobs" -L threads

fuzz() { # the GGUF reader, the model loader (hyper-parameters, tensors, tokenizer), the server's request
         # parsing and the side files (ledgers, traces, profiles, predictors), side by side (each fuzzer is one
         # process), each for half of MOETAX_FUZZ_SECONDS (default 30): on 2 cores that is the CPU time of
         # running them one after the other for a quarter each; the seeds come from the release build's moetax
  build build-fuzz -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++ -DMOETAX_FUZZ=ON \
      -DMOETAX_SANITIZE=fuzzer-no-link,address,undefined -DCMAKE_BUILD_TYPE=RelWithDebInfo \
      -- fuzzers || return 1
  local part=$(( ${MOETAX_FUZZ_SECONDS:-30} / 2 )) f pids=() rc=0
  tests/fuzz_run.sh build-fuzz/tests/fuzz_gguf ./build/moetax build-fuzz/corpus "$part" 65536 \
      >build-fuzz/fuzz_gguf.out 2>&1 & pids+=($!)
  tests/fuzz_run.sh build-fuzz/tests/fuzz_model ./build/moetax build-fuzz/corpus-model "$part" 131072 \
      >build-fuzz/fuzz_model.out 2>&1 & pids+=($!)
  tests/fuzz_run.sh build-fuzz/tests/fuzz_api ./build/moetax build-fuzz/corpus-api "$part" \
      >build-fuzz/fuzz_api.out 2>&1 & pids+=($!)
  tests/fuzz_run.sh build-fuzz/tests/fuzz_files ./build/moetax build-fuzz/corpus-files "$part" \
      >build-fuzz/fuzz_files.out 2>&1 & pids+=($!)
  for f in 0 1 2 3; do wait "${pids[$f]}" || rc=1; done
  for f in gguf model api files; do echo "--- fuzz_$f"; cat "build-fuzz/fuzz_$f.out"; done
  [ $rc -eq 0 ] || return 1
  [ "${MOETAX_SLOW:-0}" = 1 ] || return 0
  cmake --build build-fuzz -j"$jobs" --target moetax >/dev/null || return 1 # the long runs' seeds
  ctest --test-dir build-fuzz --output-on-failure -L slow -R '^fuzz_'
}
stage "fuzz gguf reader, model loader, server requests, side files" fuzz

echo
[ $failed -eq 0 ] || echo "failed stages: ${failed_names[*]}"
echo "stages: $passed passed, $failed failed"
[ $failed -eq 0 ]
