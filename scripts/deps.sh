#!/usr/bin/env bash
# Installs the Debian 12 packages moetax needs, only those that are missing.
# A no-op (no apt call at all) when everything is present.
# Usage: scripts/deps.sh [build|test|train]
#   test adds what the test suite needs; train what tools/train/ needs to retrain the default model
set -euo pipefail
mode=${1:-build}
# libmicrohttpd: moetax serve; OpenMPI: expert parallelism (mpirun -np N moetax ...);
# liburing: the expert store's io_uring reads (--io-engine uring)
pkgs=(gcc g++ make cmake pkg-config libjansson-dev libmicrohttpd-dev libopenmpi-dev openmpi-bin liburing-dev)
if [ "$mode" = test ]; then
  # numpy for the independent reference (tests/ref), clang + compiler-rt for libFuzzer,
  # chromium to render the report's HTML page headless; curl and wrk: clients of moetax serve's tests
  # torch + regex: the trained default model's PyTorch reference and its tokenizer's trainer;
  # OpenBLAS: without it Debian's torch multiplies with the reference BLAS, and the
  # trained model's float64 reference pass takes ~2 minutes instead of ~10 seconds
  pkgs+=(python3 python3-numpy python3-torch python3-regex libopenblas0-pthread clang libclang-rt-14-dev chromium curl wrk)
fi
if [ "$mode" = train ]; then
  # OpenBLAS: without it Debian's torch multiplies with the reference BLAS
  pkgs+=(python3 python3-numpy python3-torch python3-regex libopenblas0-pthread)
fi
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi
echo "moetax: installing missing Debian packages: ${missing[*]}" >&2
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
  command -v sudo >/dev/null 2>&1 || { echo "moetax: need root (or sudo) to install: ${missing[*]}" >&2; exit 1; }
  SUDO=sudo
fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
