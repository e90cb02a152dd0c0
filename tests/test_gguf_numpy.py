#!/usr/bin/python3
# ctest-labels: unit
"""test_gguf_numpy.py - a second GGUF parser that shares no code with the engine
(tests/ref/gguf_np.py, NumPy) reads files written by `moetax gen` and must agree
with `moetax inspect --json --checksums` on every key and every tensor: name,
type, shape, offset, size, FNV-1a of the bytes, and the sum and sum of squares
of the dequantized values (so the two dequantizers are checked against each other).

usage: test_gguf_numpy.py MOETAX_BIN WORKDIR
"""
import json
import math
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "ref"))
import gguf_np  # noqa: E402

from checks import check, summary  # noqa: E402  (tests/ref/checks.py)


def close(a, b, rel):
    return abs(a - b) <= rel * max(1.0, abs(a), abs(b))


def compare(moetax, path):
    out = subprocess.run([moetax, "inspect", path, "--json", "--checksums"], check=True,
                         capture_output=True, text=True).stdout
    c = json.loads(out)
    r = gguf_np.GGUFReader(path)
    check(c["version"] == r.version and c["alignment"] == r.alignment and c["data_offset"] == r.data_offset,
          f"{path}: header differs")
    # metadata: same keys, same values (floats to float32 precision; long arrays by type and length)
    check(list(c["metadata"].keys()) == list(r.metadata.keys()), f"{path}: metadata keys differ")
    for k, v in r.metadata.items():
        cv = c["metadata"].get(k)
        if isinstance(v, list):
            if len(v) > 16:
                check(isinstance(cv, dict) and cv.get("n") == len(v), f"{path}: {k}: array length")
            else:
                check(cv == v or all(close(float(x), float(y), 1e-6) for x, y in zip(cv, v)), f"{path}: {k}: {cv} vs {v}")
        elif isinstance(v, float):
            check(close(cv, v, 1e-6), f"{path}: {k}: {cv} vs {v}")
        else:
            check(cv == v, f"{path}: {k}: {cv!r} vs {v!r}")
    # tensors: everything, in file order
    ct = c["tensors"]
    names = list(r.tensors.keys())
    check([t["name"] for t in ct] == names, f"{path}: tensor names/order differ")
    for t in ct:
        info = r.tensors.get(t["name"])
        if info is None:
            check(False, f"{path}: {t['name']} missing in numpy reader")
            continue
        h, ssum, ssq = r.checksums(t["name"])
        s = {"fnv1a64": h, "sum": ssum, "sumsq": ssq}
        check(t["type"] == info.type_name, f"{t['name']}: type {t['type']} vs {info.type_name}")
        check(t["ne"] == list(info.ne), f"{t['name']}: ne {t['ne']} vs {info.ne}")
        check(t["offset"] == info.offset and t["nbytes"] == info.nbytes, f"{t['name']}: offset/nbytes")
        check(t["fnv1a64"] == s["fnv1a64"], f"{t['name']}: fnv {t['fnv1a64']} vs {s['fnv1a64']}")
        # both sum float32 values in float64: only the summation order differs
        check(close(t["sum"], s["sum"], 1e-9), f"{t['name']}: sum {t['sum']} vs {s['sum']}")
        check(close(t["sumsq"], s["sumsq"], 1e-9), f"{t['name']}: sumsq {t['sumsq']} vs {s['sumsq']}")


def main():
    moetax, work = sys.argv[1], sys.argv[2]
    os.makedirs(work, exist_ok=True)
    cases = [("tiny", t, []) for t in ("f32", "f16", "bf16", "q8_0", "q4_0")]
    cases += [("tiny-v3", "q8_0", []), ("tiny-v3", "q4_0", ["--fused-gate-up", "--kv-b-merged"])]
    for preset, t, extra in cases:
        path = os.path.join(work, f"np_{preset}_{t}.gguf")
        subprocess.run([moetax, "gen", "--preset", preset, "--type", t, "-o", path] + extra, check=True,
                       capture_output=True)
        compare(moetax, path)
    # a file written by the numpy side's own writer reads the same in moetax
    sys.path.insert(0, os.path.join(HERE, "ref"))
    import make_tiny_gguf  # noqa: E402
    path = os.path.join(work, "np_written_v3.gguf")
    make_tiny_gguf.main([path, "--variant", "v3"]) if hasattr(make_tiny_gguf, "main") else \
        subprocess.run(["/usr/bin/python3", os.path.join(HERE, "ref", "make_tiny_gguf.py"), path, "--variant", "v3"],
                       check=True, capture_output=True)
    compare(moetax, path)
    return summary()


if __name__ == "__main__":
    sys.exit(main())
