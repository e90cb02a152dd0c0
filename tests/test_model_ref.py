#!/usr/bin/python3
# ctest-labels: unit;model
"""test_model_ref.py - moetax's logits against the independent NumPy reference
(tests/ref/deepseek2_ref.py, float64, its own GGUF reader) on tiny V2-style and
V3-style models: the prompt (one prefill batch) and 8 greedy decode steps.

The reference computes on the dequantized weights with float activations. Stated
tolerances, as max |moetax - ref| over all logits divided by max |ref|:
  f32, f16, bf16:  2e-5  (same weights, float32 vs float64 arithmetic)
  q8_0, q4_0:      0.05  (moetax quantizes activations to 8 bits, as ggml does)
and for the quantized types the greedy token agrees on at least 90% of rows.
Decode rows are compared on the same tokens: the reference is run on the prompt
followed by moetax's greedy tokens.

usage: test_model_ref.py MOETAX_BIN WORKDIR
"""
import os
import subprocess
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "ref"))
import deepseek2_ref  # noqa: E402

TOL = {"f32": 2e-5, "f16": 2e-5, "bf16": 2e-5, "q8_0": 0.05, "q4_0": 0.05}
passed = failed = 0


def check(cond, msg):
    global passed, failed
    if cond:
        passed += 1
    else:
        failed += 1
        print("FAIL:", msg)


def compare(moetax, work, name, gen_args, wtype, prompt, n_decode=8):
    path = os.path.join(work, f"ref_{name}_{wtype}.gguf")
    subprocess.run([moetax, "gen"] + gen_args + ["--type", wtype, "-o", path], check=True, capture_output=True)
    out = os.path.join(work, f"ref_{name}_{wtype}.f32")
    r = subprocess.run([moetax, "eval", "-m", path, "--tokens", ",".join(map(str, prompt)), "--decode", str(n_decode),
                        "--out", out], check=True, capture_output=True, text=True)
    greedy = [int(x) for x in r.stdout.split(":")[1].split()]
    model = deepseek2_ref.Model(path)
    V = model.cfg["n_vocab"] if "n_vocab" in model.cfg else None
    ours = np.fromfile(out, dtype=np.float32)
    tokens = prompt + greedy
    ref = model.forward(tokens)[: len(prompt) + n_decode]
    ours = ours.reshape(ref.shape)
    err = float(np.abs(ours - ref).max())
    mag = float(np.abs(ref).max())
    agree = float(np.mean(np.argmax(ours, axis=1) == np.argmax(ref, axis=1)))
    print(f"{name:10s} {wtype:5s} max|err| {err:.3g}  max|ref| {mag:.3g}  rel {err / mag:.2e}  argmax agree {agree:.0%}")
    check(err <= TOL[wtype] * mag, f"{name} {wtype}: rel error {err / mag:.3g} > {TOL[wtype]}")
    if wtype in ("q8_0", "q4_0"):
        check(agree >= 0.9, f"{name} {wtype}: argmax agreement {agree:.0%} < 90%")
    else:
        check(agree == 1.0, f"{name} {wtype}: argmax agreement {agree:.0%}")
    del V


def main():
    moetax, work = sys.argv[1], sys.argv[2]
    os.makedirs(work, exist_ok=True)
    prompt = [1, 17, 42, 99, 256, 300, 7, 480, 3, 64, 128, 200]
    variants = [
        ("v2", ["--preset", "tiny"]),
        ("v3", ["--preset", "tiny-v3"]),
        ("v3-layout", ["--preset", "tiny-v3", "--fused-gate-up", "--kv-b-merged", "--seed", "5"]),
        ("v2-wide", ["--preset", "tiny", "--embd", "128", "--experts", "16", "--experts-used", "4",
                     "--expert-ff", "64", "--seed", "9"]),
    ]
    for name, args in variants:
        for wtype in ("f32", "f16", "bf16", "q8_0", "q4_0"):
            compare(moetax, work, name, args, wtype, prompt)
    print(f"{passed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
