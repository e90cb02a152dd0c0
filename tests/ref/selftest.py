#!/usr/bin/python3
"""selftest.py - checks of the Python reference (gguf_np.py, deepseek2_ref.py).

  /usr/bin/python3 tests/ref/selftest.py [-v] [--keep DIR] [--moetax PATH]

Prints one line per check and 'N passed, M failed'; exit code 1 if any check failed.
With --moetax (or when build/moetax exists and `moetax gen --help` works) it also reads a file made
by `moetax gen --preset tiny` and runs the reference forward on it.
"""

import json
import math
import os
import struct
import subprocess
import sys
import tempfile
import time
import traceback

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import gguf_np as G  # noqa: E402
import make_tiny_gguf as MK  # noqa: E402
import deepseek2_ref as R  # noqa: E402

RESULTS = []
VERBOSE = False


def check(name):
    def deco(fn):
        def run(*a, **kw):
            t0 = time.time()
            try:
                fn(*a, **kw)
                RESULTS.append((name, True, ""))
                print("PASS %-55s %.2fs" % (name, time.time() - t0))
            except Exception as e:  # noqa: BLE001
                msg = "%s: %s" % (type(e).__name__, e)
                RESULTS.append((name, False, msg))
                print("FAIL %-55s %s" % (name, msg))
                if VERBOSE:
                    traceback.print_exc()
        run.__name__ = fn.__name__
        return run
    return deco


def eq(a, b, what=""):
    if a != b:
        raise AssertionError("%s: %r != %r" % (what, a, b))


def close(a, b, tol, what=""):
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    if a.shape != b.shape:
        raise AssertionError("%s: shape %s != %s" % (what, a.shape, b.shape))
    d = float(np.max(np.abs(a - b))) if a.size else 0.0
    if not d <= tol:
        raise AssertionError("%s: max abs diff %.3g > %.3g" % (what, d, tol))


# ============================================================================================
# reader

ALL_KVS = [
    ("general.architecture", G.T_STRING, "deepseek2"),
    ("t.u8", G.T_UINT8, 250), ("t.i8", G.T_INT8, -120), ("t.u16", G.T_UINT16, 65000),
    ("t.i16", G.T_INT16, -32000), ("t.u32", G.T_UINT32, 4000000000),
    ("t.i32", G.T_INT32, -2000000000), ("t.f32", G.T_FLOAT32, 0.1),
    ("t.bool_t", G.T_BOOL, True), ("t.bool_f", G.T_BOOL, False),
    ("t.str", G.T_STRING, "h\u00e9llo \u4e16\u754c"), ("t.str_empty", G.T_STRING, ""),
    ("t.u64", G.T_UINT64, 18000000000000000000), ("t.i64", G.T_INT64, -9000000000000000000),
    ("t.f64", G.T_FLOAT64, 1.0 / 3.0),
    ("t.arr_u8", ("array", G.T_UINT8), [0, 1, 255]),
    ("t.arr_i8", ("array", G.T_INT8), [-128, 0, 127]),
    ("t.arr_u16", ("array", G.T_UINT16), [1, 65535]),
    ("t.arr_i16", ("array", G.T_INT16), [-32768, 32767]),
    ("t.arr_u32", ("array", G.T_UINT32), [7, 4294967295]),
    ("t.arr_i32", ("array", G.T_INT32), list(range(-10, 30))),
    ("t.arr_f32", ("array", G.T_FLOAT32), [0.5, -1.25, 3.0e38]),
    ("t.arr_bool", ("array", G.T_BOOL), [True, False, True]),
    ("t.arr_str", ("array", G.T_STRING), ["a", "", "\u00fc b"]),
    ("t.arr_u64", ("array", G.T_UINT64), [2 ** 64 - 1, 0]),
    ("t.arr_i64", ("array", G.T_INT64), [-(2 ** 63), 2 ** 63 - 1]),
    ("t.arr_f64", ("array", G.T_FLOAT64), [math.pi, -0.0]),
    ("t.arr_empty", ("array", G.T_INT32), []),
    ("t.arr_nested", ("array", ("array", G.T_INT32)), [[1, 2], [], [3]]),
    ("t.arr_nested_str", ("array", ("array", G.T_STRING)), [["x", "y"], ["z"]]),
    ("t.arr_nested2", ("array", ("array", ("array", G.T_UINT8))), [[[1], [2, 3]], []]),
]


def expected_value(vtype, v):
    if vtype == G.T_FLOAT32:
        return float(np.float32(v))
    if isinstance(vtype, tuple):
        return [expected_value(vtype[1], x) for x in v]
    return v


def reader_tensors(rng):
    return [
        ("a.f32", G.TYPE_F32, rng.standard_normal((3, 5)).astype(np.float32)),
        ("a.f16", G.TYPE_F16, rng.standard_normal((4, 7)).astype(np.float32)),
        ("a.bf16", G.TYPE_BF16, rng.standard_normal((2, 3, 6)).astype(np.float32)),
        ("a.q8_0", G.TYPE_Q8_0, rng.standard_normal((5, 64)).astype(np.float32)),
        ("a.q4_0", G.TYPE_Q4_0, rng.standard_normal((3, 4, 96)).astype(np.float32)),
        ("a.vec", G.TYPE_F32, rng.standard_normal(33).astype(np.float32)),
        ("a.q8_3d", G.TYPE_Q8_0, rng.standard_normal((4, 6, 32)).astype(np.float32)),
        ("a.4d", G.TYPE_F16, rng.standard_normal((2, 2, 3, 4)).astype(np.float32)),
    ]


def test_reader(tmp):
    rng = np.random.default_rng(1)

    @check("reader: all metadata value types (v3, alignment 32)")
    def _meta():
        path = os.path.join(tmp, "kv.gguf")
        MK.write_gguf(path, ALL_KVS, [])
        r = G.GGUFReader(path)
        eq(r.version, 3, "version")
        eq(r.alignment, 32, "alignment")
        eq(len(r.metadata), len(ALL_KVS), "n kv")
        for key, vtype, v in ALL_KVS:
            got = r.metadata[key]
            exp = expected_value(vtype, v)
            if got != exp or type(got) is not type(exp):
                raise AssertionError("%s: %r (%s) != %r" % (key, got, type(got).__name__, exp))
            tname = r.metadata_types[key]
            if isinstance(vtype, tuple):
                et = vtype[1]
                want = "array[%s]" % G.VALUE_TYPE_NAMES[G.T_ARRAY if isinstance(et, tuple) else et]
            else:
                want = G.VALUE_TYPE_NAMES[vtype]
            eq(tname, want, key + " type")
        eq(r.n_tensors, 0, "n tensors")
        # data section starts at the aligned end of the header
        eq(r.data_offset % 32, 0, "data offset aligned")
        r.close()

    @check("reader: tensors round-trip f32/f16/bf16/q8_0/q4_0, 1-4 dims")
    def _tensors():
        for version, align in ((3, None), (2, 64), (3, 256)):
            path = os.path.join(tmp, "t%d_%s.gguf" % (version, align))
            tens = reader_tensors(rng)
            exp = MK.write_gguf(path, [("general.architecture", G.T_STRING, "x")], tens,
                                alignment=align, version=version)
            r = G.GGUFReader(path)
            eq(r.version, version, "version")
            eq(r.alignment, align or 32, "alignment")
            eq(list(r.tensors), [t[0] for t in tens], "tensor order")
            for name, ttype, arr in tens:
                ti = r.info(name)
                eq(ti.ne, list(reversed(arr.shape)), name + " ne")
                eq(ti.shape, arr.shape, name + " shape")
                eq(ti.type, ttype, name + " type")
                eq(ti.offset % (align or 32), 0, name + " offset aligned")
                got = r.tensor(name)
                eq(got.dtype, np.dtype(np.float32), name + " dtype")
                if not np.array_equal(got, exp[name]):
                    raise AssertionError("%s: values differ (max %.3g)" % (
                        name, np.max(np.abs(got - exp[name]))))
                # quantisation error sanity (the writer's, not the reader's)
                tol = {G.TYPE_F32: 0, G.TYPE_F16: 2e-3, G.TYPE_BF16: 2e-2, G.TYPE_Q8_0: 3e-2,
                       G.TYPE_Q4_0: 0.5}[ttype]
                close(got, arr, tol * max(1.0, float(np.max(np.abs(arr)))), name + " vs source")
                raw = r.raw(name)
                eq(raw.size, ti.nbytes, name + " nbytes")
                eq(bytes(raw), MK.encode_tensor(arr, ttype)[0], name + " raw bytes")
            # rows / slice3
            full = r.tensor("a.q8_0")
            close(r.rows("a.q8_0", [4, 0, 2]), full[[4, 0, 2]], 0, "rows q8_0")
            close(r.rows("a.f16", [1]), r.tensor("a.f16")[[1]], 0, "rows f16")
            q3 = r.tensor("a.q4_0")
            for i in range(3):
                close(r.slice3("a.q4_0", i), q3[i], 0, "slice3 q4_0")
            close(r.slice3("a.bf16", 1), r.tensor("a.bf16")[1], 0, "slice3 bf16")
            r.close()

    @check("reader: hand-made q8_0 / q4_0 / bf16 / f16 blocks")
    def _blocks():
        # Q8_0: d = 0.5 (f16 0x3800), q = -16..15
        q = np.arange(-16, 16, dtype=np.int8)
        blk = struct.pack("<H", 0x3800) + q.tobytes()
        got = G.dequantize(np.frombuffer(blk, np.uint8), G.TYPE_Q8_0)
        close(got, q.astype(np.float64) * 0.5, 0, "q8_0")
        # Q4_0: d = 2.0 (0x4000); byte j = (j) | ((15 - j) << 4)
        qs = bytes([(j & 15) | (((15 - j) & 15) << 4) for j in range(16)])
        blk = struct.pack("<H", 0x4000) + qs
        got = G.dequantize(np.frombuffer(blk, np.uint8), G.TYPE_Q4_0)
        want = [(j - 8) * 2.0 for j in range(16)] + [((15 - j) - 8) * 2.0 for j in range(16)]
        close(got, want, 0, "q4_0")
        # BF16 0x3FC0 = 1.5, 0xC000 = -2; F16 0x3C00 = 1, 0xC500 = -5
        got = G.dequantize(np.frombuffer(struct.pack("<HH", 0x3FC0, 0xC000), np.uint8), G.TYPE_BF16)
        close(got, [1.5, -2.0], 0, "bf16")
        got = G.dequantize(np.frombuffer(struct.pack("<HH", 0x3C00, 0xC500), np.uint8), G.TYPE_F16)
        close(got, [1.0, -5.0], 0, "f16")

    @check("reader: fnv1a64 known vectors (C helper and Python)")
    def _fnv():
        vec = {b"": 0xCBF29CE484222325, b"a": 0xAF63DC4C8601EC8C, b"foobar": 0x85944171F73967E8}
        for s, h in vec.items():
            eq(G.fnv1a64(s), h, "fnv %r" % s)
            eq(G._fnv_py(s), h, "fnv py %r" % s)
        big = np.random.default_rng(3).integers(0, 256, 100000, dtype=np.uint8)
        eq(G.fnv1a64(big), G._fnv_py(big), "fnv big C vs python")

    @check("reader: rejects bad magic / version / truncation / misalignment")
    def _bad():
        path = os.path.join(tmp, "good.gguf")
        MK.write_gguf(path, [("general.architecture", G.T_STRING, "x")],
                      [("w", G.TYPE_F32, np.ones((2, 4), np.float32))])
        good = open(path, "rb").read()
        cases = {"magic": b"GGUX" + good[4:], "version": good[:4] + struct.pack("<I", 9) + good[8:],
                 "truncated header": good[:40], "truncated data": good[:-8]}
        # misaligned tensor offset: two tensors, bump the second one's offset by 4
        p2 = os.path.join(tmp, "two.gguf")
        MK.write_gguf(p2, [("general.architecture", G.T_STRING, "x")],
                      [("w1", G.TYPE_F32, np.ones((2, 4), np.float32)),
                       ("w2", G.TYPE_F32, np.ones((2, 4), np.float32))])
        two = bytearray(open(p2, "rb").read())
        at = two.index(struct.pack("<Q", 2) + b"w2") + 8 + 2 + 4 + 16 + 4
        off = struct.unpack_from("<Q", two, at)[0]
        eq(off, 32, "second tensor offset")
        struct.pack_into("<Q", two, at, off + 4)
        cases["misaligned offset"] = bytes(two)
        for what, data in cases.items():
            p = os.path.join(tmp, "bad.gguf")
            open(p, "wb").write(data)
            try:
                G.GGUFReader(p)
            except G.GGUFError:
                continue
            raise AssertionError("accepted a file with bad %s" % what)

    @check("reader: CLI --json (header line + one line per tensor)")
    def _cli():
        path = os.path.join(tmp, "cli.gguf")
        tens = reader_tensors(rng)
        exp = MK.write_gguf(path, ALL_KVS, tens)
        out = subprocess.run([sys.executable, os.path.join(HERE, "gguf_np.py"), path, "--json"],
                             check=True, stdout=subprocess.PIPE).stdout.decode()
        lines = [json.loads(x) for x in out.splitlines()]
        head = lines[0]
        eq(head["version"], 3, "version")
        eq(head["metadata"]["t.arr_i32"], {"type": "int32", "n": 40}, "array summary")
        eq(head["metadata"]["t.arr_str"], ["a", "", "\u00fc b"], "short array")
        eq(len(lines) - 1, len(tens), "tensor lines")
        for row, (name, ttype, arr) in zip(lines[1:], tens):
            eq(set(row), {"name", "type", "ne", "offset", "nbytes", "fnv1a64", "sum", "sumsq"}, "keys")
            eq(row["name"], name, "name")
            eq(row["type"], G.GGML_TYPES[ttype][0], "type")
            eq(row["ne"], list(reversed(arr.shape)), "ne")
            e = exp[name].astype(np.float64)
            close(row["sum"], e.sum(), 1e-9 * max(1, np.abs(e).sum()), "sum")
            close(row["sumsq"], (e * e).sum(), 1e-9 * max(1, (e * e).sum()), "sumsq")
            raw = MK.encode_tensor(arr, ttype)[0]
            eq(row["fnv1a64"], "%016x" % G._fnv_py(raw), "fnv")
            eq(len(row["fnv1a64"]), 16, "fnv width")

    _meta()
    _tensors()
    _blocks()
    _fnv()
    _bad()
    _cli()


# ============================================================================================
# forward pass building blocks

def rope_direct(x, pos, n_dims, base, freq_scale=1.0, ext_factor=0.0, attn_factor=1.0,
                corr=(0.0, 0.0)):
    """Scalar restatement of ggml's rope_yarn + NORM-mode rotation for one vector."""
    out = list(x)
    for i0 in range(0, n_dims, 2):
        theta_extrap = pos * base ** (-float(i0) / n_dims)
        theta_interp = freq_scale * theta_extrap
        theta = theta_interp
        mscale = attn_factor
        if ext_factor != 0.0:
            y = (i0 // 2 - corr[0]) / max(0.001, corr[1] - corr[0])
            ramp_mix = (1 - min(1.0, max(0.0, y))) * ext_factor
            theta = theta_interp * (1 - ramp_mix) + theta_extrap * ramp_mix
            mscale *= 1.0 + 0.1 * math.log(1.0 / freq_scale)
        c, s = math.cos(theta) * mscale, math.sin(theta) * mscale
        x0, x1 = x[i0], x[i0 + 1]
        out[i0] = x0 * c - x1 * s
        out[i0 + 1] = x0 * s + x1 * c
    return np.array(out)


def test_blocks():
    rng = np.random.default_rng(7)

    @check("rope: NORM mode (adjacent pairs) vs direct formula")
    def _rope():
        n = 8
        x = rng.standard_normal((5, 3, n))
        pos = np.array([0, 1, 2, 7, 1000])
        got = R.rope_norm(x, pos, n, freq_base=10000.0)
        for t in range(5):
            for h in range(3):
                close(got[t, h], rope_direct(x[t, h], pos[t], n, 10000.0), 1e-12, "rope")
        # position 0 is the identity; rotation preserves pair norms; relative-position property
        close(got[0], x[0], 0, "pos 0")
        q, k = rng.standard_normal(n), rng.standard_normal(n)
        a = R.rope_norm(q, 5, n) @ R.rope_norm(k, 3, n)
        b = R.rope_norm(q, 102, n) @ R.rope_norm(k, 100, n)
        close(a, b, 1e-10, "relative position")
        # explicit pair check: dims (0,1) rotate by angle pos (theta_scale^0 = 1)
        v = np.zeros(n)
        v[0] = 1.0
        r = R.rope_norm(v, 2, n)
        close(r[:2], [math.cos(2), math.sin(2)], 1e-15, "pair (0,1)")
        close(r[2:], np.zeros(n - 2), 0, "other pairs untouched")

    @check("rope: YaRN (ggml rope_yarn ramp/mix/mscale) vs direct formula")
    def _yarn():
        n, base, F = 64, 10000.0, 40.0
        lo, hi = R.yarn_corr_dims(n, 4096, base, 32.0, 1.0)
        eq((lo, hi), (10.0, 23.0), "corr dims (64, 4096, 1e4, 32, 1)")
        x = rng.standard_normal((3, n))
        pos = np.array([0, 17, 3000])
        for af in (1.0, 0.7):
            got = R.rope_norm(x, pos, n, base, 1.0 / F, 1.0, af, (lo, hi))
            for t in range(3):
                close(got[t], rope_direct(x[t], pos[t], n, base, 1.0 / F, 1.0, af, (lo, hi)), 1e-9,
                      "yarn")
        # ramp: pairs below lo are pure extrapolation (theta_extrap), above hi pure interpolation
        v = np.zeros(n)
        v[0] = 1.0
        r = R.rope_norm(v, 5, n, base, 1.0 / F, 1.0, 1.0 / (1 + 0.1 * math.log(F)), (lo, hi))
        close(r[:2], [math.cos(5.0), math.sin(5.0)], 1e-12, "yarn pair 0 = extrapolation")

    @check("rope_params: llama.cpp deepseek2 kq_scale / attn_factor chain")
    def _rp():
        def meta(d):
            return lambda k, dflt=None: d.get(k, dflt)
        A = "deepseek2."
        # no scaling: mscale 1, rope magnitude 1
        p = R.rope_params(meta({A + "rope.freq_base": 10000.0}))
        eq((p["freq_scale"], p["ext_factor"], p["mscale"], p["rope_magnitude"]), (1.0, 0.0, 1.0, 1.0), "plain")
        # DeepSeek-V2-Lite: yarn, factor 40, mscale_all_dim 0.707 stored as 0.0707
        p = R.rope_params(meta({A + "rope.scaling.type": "yarn", A + "rope.scaling.factor": 40.0,
                                A + "rope.scaling.original_context_length": 4096,
                                A + "rope.scaling.yarn_log_multiplier": 0.0707}))
        close(p["rope_magnitude"], 1.0, 1e-12, "V2-Lite rope magnitude")
        close(p["mscale"], 1 + 0.1 * 0.707 * math.log(40), 1e-9, "V2-Lite mscale")
        close(p["attn_factor"], 1 / (1 + 0.1 * math.log(40)), 1e-12, "attn_factor passed to rope")
        # yarn without log multiplier: rope magnitude = mscale = 1 + 0.1 ln F (ggml applies it)
        p = R.rope_params(meta({A + "rope.scaling.type": "yarn", A + "rope.scaling.factor": 4.0}))
        close(p["rope_magnitude"], 1 + 0.1 * math.log(4), 1e-12, "yarn no L rope magnitude")
        close(p["mscale"], 1 + 0.1 * math.log(4), 1e-12, "yarn no L mscale")

    @check("moe: routing softmax / top-k / ties to lower index")
    def _route_sm():
        lg = np.array([1.0, 3.0, 3.0, 0.5])
        e, w, p = R.route(lg, 1, None, 1, 0, 2, False, 0.0)
        ex = np.exp(lg - 3.0)
        ex /= ex.sum()
        eq(list(e), [1, 2], "tie -> lower index first")
        close(w, [ex[1], ex[2]], 1e-15, "weights = p[topk]")
        close(p, ex, 1e-15, "softmax")
        e, w, _ = R.route(lg, 1, None, 1, 0, 2, True, 1.0)
        close(w, [0.5, 0.5], 1e-15, "renormalised")
        e, w, _ = R.route(lg, 1, None, 1, 0, 3, False, 2.0)
        close(w, 2.0 * ex[[1, 2, 0]], 1e-15, "scaled, no norm")
        e, w, _ = R.route(lg, 1, None, 1, 0, 2, False, 1.0)
        close(w, ex[[1, 2]], 1e-15, "scale 1 = none")

    @check("moe: sigmoid + selection bias (weights from unbiased p)")
    def _route_bias():
        p = np.array([0.5, 0.6, 0.7, 0.8])
        lg = np.log(p / (1 - p))
        b = np.array([1.0, 0.0, 0.0, 0.0])
        e, w, pp = R.route(lg, 2, b, 1, 0, 2, False, 0.0)
        eq(list(e), [0, 3], "bias picks expert 0")
        close(w, [0.5, 0.8], 1e-12, "weights unbiased")
        e, w, _ = R.route(lg, 2, b, 1, 0, 2, True, 2.5)
        close(w, [2.5 * 0.5 / 1.3, 2.5 * 0.8 / 1.3], 1e-12, "norm then scale")
        # clamp: tiny weights are divided by 6.103515625e-5, not by their sum
        e, w, _ = R.route(np.full(4, -30.0), 2, None, 1, 0, 2, True, 0.0)
        sg = 1 / (1 + math.exp(30.0))
        close(w, [sg / 6.103515625e-5] * 2, 1e-18, "sum clamp")

    @check("moe: group-limited top-k (top-2 sum per group, keep best groups)")
    def _route_group():
        s = np.array([0.9, 0.01, 0.6, 0.6, 0.2, 0.95, 0.01, 0.01])
        lg = np.log(s / (1 - s))
        # groups of 2: sums 0.91, 1.2, 1.15, 0.02 -> keep groups 1, 2 -> experts {2,3,4,5}
        e, w, _ = R.route(lg, 2, None, 4, 2, 2, False, 0.0)
        eq(list(e), [5, 2], "grouped top-2")
        e, w, _ = R.route(lg, 2, None, 1, 0, 2, False, 0.0)
        eq(list(e), [5, 0], "ungrouped top-2")
        # group tie (0.91 vs 0.91) -> lower group index kept
        s = np.array([0.9, 0.01, 0.9, 0.01, 0.3, 0.3, 0.1, 0.1])
        lg = np.log(s / (1 - s))
        e, _, _ = R.route(lg, 2, None, 4, 1, 2, False, 0.0)
        eq(list(e), [0, 1], "group tie -> group 0")
        # groups of 4 with bias: score uses biased s; top-2 within group, not top-1
        # p = sigmoid(0) = 0.5 for every expert
        b = np.array([0.4, 0.0, 0.0, 0.0, 0.3, 0.3, 0.0, 0.0])
        e, w, _ = R.route(np.zeros(8), 2, b, 2, 1, 2, False, 0.0)
        # group 0: top2 0.9 + 0.5 = 1.4; group 1: 0.8 + 0.8 = 1.6 -> group 1
        eq(list(e), [4, 5], "top-2 group sum beats top-1")
        close(w, [0.5, 0.5], 1e-15, "weights p")

    @check("moe: hand-computed MoE block (E=4, k=2, d=2, F=1, shared)")
    def _moe_hand():
        h = np.array([[1.0, -2.0]])
        gate_inp = np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [-1.0, 0.0]])
        # logits = [1, -2, -1, -1] -> softmax top-2: experts 0 and then 2 (tie 2/3 -> 2)
        ex = {e: (np.array([[0.5 * (e + 1), 0.0]]), np.array([[0.0, 1.0 + e]]),
                  np.array([[1.0], [float(e)]])) for e in range(4)}
        shared = (np.array([[1.0, 1.0]]), np.array([[2.0, 0.0]]), np.array([[0.5], [-0.5]]))
        cfg = dict(gating_func=1, n_group=0, n_group_used=0, n_expert_used=2, w_norm=True,
                   w_scale=2.5)
        out, sel = R.moe_forward(h, gate_inp, lambda e: ex[e], None, cfg, shared)
        lg = [1.0, -2.0, -1.0, -1.0]
        z = sum(math.exp(v) for v in lg)
        p = [math.exp(v) / z for v in lg]
        eq([int(x) for x in sel[0][0]], [0, 2], "experts")
        w0, w2 = p[0] / (p[0] + p[2]) * 2.5, p[2] / (p[0] + p[2]) * 2.5

        def silu(v):
            return v / (1 + math.exp(-v))
        # expert e: g = 0.5(e+1)*x0, u = (1+e)*x1, y = [1, e] * silu(g)*u
        y0 = silu(0.5 * 1.0) * (1.0 * -2.0)
        y2 = silu(1.5 * 1.0) * (3.0 * -2.0)
        sh = silu(1.0 - 2.0) * 2.0
        want = [w0 * y0 * 1 + w2 * y2 * 1 + 0.5 * sh, w0 * y0 * 0 + w2 * y2 * 2 - 0.5 * sh]
        close(out[0], want, 1e-14, "moe output")
        close(sel[0][1], [w0, w2], 1e-15, "weights")

    @check("act quant: quantize_q8_0 on hand-computed blocks")
    def _aq_hand():
        # block A: amax 127 -> d = 1, id = 1, fp16(1) = 1: q = roundf(x), ties away from zero
        a = np.zeros(32)
        a[:10] = [127.0, 2.5, -2.5, 0.5, -0.5, 1.5, 3.49, -126.5, 0.49, 6.5]
        qa = np.zeros(32)
        qa[:10] = [127, 3, -3, 1, -1, 2, 3, -127, 0, 7]     # np.round would give 2, -2, 0, -0, .., -126, .., 6
        # block B: all zero -> d = 0, id = 0: all q = 0 (no NaN)
        # block C: amax 0.9 (f32 0.89999998) -> d = 0.9f/127 = 0.0070866141 = 2^-8 * 1.8141732,
        # mantissa 0.8141732 * 1024 = 833.713 -> fp16 rounds to 834 (truncation: 833):
        # d16 = 2^-8 * (1 + 834/1024) = 0.00708770751953125; id = 1/d = 141.11111 (f32);
        # 0.9 * id = 127.0, 0.45 * id = 63.5 -> 64, -0.3 * id = -42.33 -> -42, 0.1 * id = 14.11 -> 14
        c = np.zeros(32)
        c[[0, 5, 17, 31]] = [0.9, 0.45, -0.3, 0.1]
        qc = np.zeros(32)
        qc[[0, 5, 17, 31]] = [127, 64, -42, 14]
        x = np.stack([np.concatenate([a, np.zeros(32), c]), np.concatenate([c, a, np.zeros(32)])])
        got, mg = R.quantize_q8_0(x, margin=True)
        eq(got.shape, (2, 96), "shape")
        eq(got.dtype, np.dtype(np.float64), "dtype")
        d16 = 0.00708770751953125
        want = np.stack([np.concatenate([qa, np.zeros(32), qc * d16]),
                         np.concatenate([qc * d16, qa, np.zeros(32)])])
        close(got, want, 0, "dequantized")
        if not np.all(np.isfinite(got)):
            raise AssertionError("non-finite output")
        close(mg[0, :4], [0.5 / 127, 0, 0, 0], 0, "margins: 127.0 is 0.5 from a tie, 2.5 / 0.5 are ties")
        if not np.all(np.isinf(mg[0, 32:64])):
            raise AssertionError("zero block margin should be inf")
        close(mg[0, 64 + 5], 0.0, 0, "63.5 is a tie")
        close(R.quantize_q8_0(a[None, :])[0], qa, 0, "1-D block row")
        fl = qa.copy()
        fl[[1, 2, 6, 8]] = [2, -2, 4, 1]          # 2.5 -> 2, -2.5 -> -2, 3.49 -> 4, 0.49 -> 1
        close(R.quantize_q8_0(a, flip=[1, 2, 6, 8]), fl, 0, "flip: round the other way")
        try:
            R.quantize_q8_0(np.ones(48))
            raise AssertionError("row of 48 accepted")
        except ValueError:
            pass

    @check("act quant: quantize_q8_0 == scalar ggml quantize_row_q8_0 (random, ties)")
    def _aq_scalar():
        def f32(v):
            return struct.unpack("<f", struct.pack("<f", v))[0]

        def f16(v):
            return struct.unpack("<e", struct.pack("<e", v))[0]   # round to nearest even

        def roundf(v):
            return math.copysign(math.floor(abs(v) + 0.5), v)

        def scalar(xb):
            xb = [f32(float(v)) for v in xb]
            amax = max(abs(v) for v in xb)
            d = f32(amax / 127.0)            # f32 / f32 rounded once: exact in double, then f32
            idv = f32(1.0 / d) if d != 0 else 0.0
            return [roundf(f32(v * idv)) * f16(d) for v in xb]
        rng = np.random.default_rng(3)
        rows = [rng.standard_normal(32) * s_ for s_ in (1e-3, 0.7, 3.0, 1e3)]
        # exact ties: amax 127 (d = 1) and 127/8 (d = 1/8, id = 8): x*id = k + 0.5
        t = np.arange(32) - 15.5
        t[0] = 127.0
        rows += [t, -t / 8, t * 0.1, t * 3.3]
        rows.append(rng.standard_normal(32) * 1e-6)           # d16 subnormal in fp16
        x = np.array(rows)
        got = R.quantize_q8_0(x)
        want = np.array([scalar(r) for r in rows])
        close(got, want, 0, "vs scalar")

    _rope()
    _yarn()
    _rp()
    _route_sm()
    _route_bias()
    _route_group()
    _moe_hand()
    _aq_hand()
    _aq_scalar()


# ============================================================================================
# naive (loop) forward: non-absorbed MHA form of MLA, per-token loops

def naive_forward(m, tokens):
    c = m.cfg
    H, nope, rot, kvl = c["n_head"], c["nope"], c["n_rot"], c["kv_lora"]
    eps = c["eps"]
    rp = c["rope"]

    def rms(v, w):
        return v / math.sqrt(float(np.mean(v * v)) + eps) * w

    def rope(v, pos):
        return rope_direct(v, pos, rot, rp["freq_base"], rp["freq_scale"], rp["ext_factor"],
                           rp["attn_factor"], c["corr_dims"])

    emb = m.r.tensor("token_embd.weight").astype(np.float64)
    xs = [emb[t].copy() for t in tokens]
    for il in range(c["n_layer"]):
        lw = m.layers[il]
        Ks, Vs = [], []                      # decompressed per-head keys/values
        new = []
        for pos, x in enumerate(xs):
            h = rms(x, lw["attn_norm"])
            if "q" in lw:
                q = lw["q"] @ h
            else:
                q = lw["q_b"] @ rms(lw["q_a"] @ h, lw["q_a_norm"])
            ckv = lw["kv_a"] @ h
            kv = rms(ckv[:kvl], lw["kv_a_norm"])
            kpe = rope(ckv[kvl:], pos)
            Kh = []
            Vh = []
            for hd in range(H):
                Wk = lw["k_b"][hd].T         # (nope, kvl): k_nope = Wk kv
                Wv = lw["v_b"][hd]           # (vh, kvl)
                Kh.append(np.concatenate([Wk @ kv, kpe]))
                Vh.append(Wv @ kv)
            Ks.append(Kh)
            Vs.append(Vh)
            heads = []
            for hd in range(H):
                qh = q[hd * (nope + rot):(hd + 1) * (nope + rot)]
                qh = np.concatenate([qh[:nope], rope(qh[nope:], pos)])
                sc = np.array([qh @ Ks[t][hd] for t in range(pos + 1)]) * c["kq_scale"]
                sc = np.exp(sc - sc.max())
                sc /= sc.sum()
                heads.append(sum(sc[t] * Vs[t][hd] for t in range(pos + 1)))
            x = x + lw["o"] @ np.concatenate(heads)
            h2 = rms(x, lw["ffn_norm"])
            if il < c["n_dense"]:
                g = lw["gate"] @ h2
                y = lw["down"] @ (g / (1 + np.exp(-g)) * (lw["up"] @ h2))
            else:
                lg = lw["gate_inp"] @ h2
                if c["gating_func"] == 2:
                    p = 1 / (1 + np.exp(-lg))
                else:
                    p = np.exp(lg - lg.max())
                    p /= p.sum()
                s = p + (lw["probs_b"] if lw["probs_b"] is not None else 0)
                E = len(s)
                allowed = set(range(E))
                if c["n_group"] > 1:
                    gsz = E // c["n_group"]
                    gsc = [sum(sorted(s[g * gsz:(g + 1) * gsz], reverse=True)[:2]) for g in range(c["n_group"])]
                    order = sorted(range(c["n_group"]), key=lambda g: (-gsc[g], g))[:c["n_group_used"]]
                    allowed = {e for g in order for e in range(g * gsz, (g + 1) * gsz)}
                cand = sorted(allowed, key=lambda e: (-s[e], e))[:c["n_expert_used"]]
                w = [p[e] for e in cand]
                if c["w_norm"]:
                    tot = max(sum(w), 6.103515625e-5)
                    w = [v / tot for v in w]
                if c["w_scale"] not in (0.0, 1.0):
                    w = [v * c["w_scale"] for v in w]
                y = np.zeros_like(h2)
                for e, we in zip(cand, w):
                    gt, up, dn = m.expert(il, e)
                    g = gt @ h2
                    y = y + we * (dn @ (g / (1 + np.exp(-g)) * (up @ h2)))
                if "sh_gate" in lw:
                    g = lw["sh_gate"] @ h2
                    y = y + lw["sh_down"] @ (g / (1 + np.exp(-g)) * (lw["sh_up"] @ h2))
            new.append(x + y)
        xs = new
    return np.array([m.output @ rms(x, m.output_norm) for x in xs])


def test_forward(tmp):
    paths = {}
    for v in ("v2", "v2kvb", "v2fused", "v3"):
        paths[v] = os.path.join(tmp, "tiny_%s.gguf" % v)
        MK.make(paths[v], v, seed=11)
    toks = [5, 17, 255, 3, 299, 0, 42, 42, 100, 7, 8, 9, 260, 1, 2, 150]
    full = {}

    for v in ("v2", "v3"):
        @check("forward %s: step-by-step == full sequence (1e-9)" % v)
        def _inc(v=v):
            m = R.Model(paths[v])
            t0 = time.time()
            L = m.forward(toks)
            dt = time.time() - t0
            full[v] = L
            eq(L.shape, (len(toks), 300), "shape")
            if not np.all(np.isfinite(L)):
                raise AssertionError("non-finite logits")
            m.reset()
            inc = np.array([m.step(t) for t in toks])
            close(inc, L, 1e-9, "incremental vs full")
            m.reset()
            a = m.prefill(toks[:5])
            b = m.prefill(toks[5:])
            close(np.concatenate([a, b]), L, 1e-9, "chunked prefill vs full")
            if dt > 2.0:
                raise AssertionError("16 tokens took %.2fs (> 2 s)" % dt)

        _inc()

        @check("forward %s: vectorised == naive loop (non-absorbed MLA)" % v)
        def _naive(v=v):
            m = R.Model(paths[v])
            L = m.forward(toks[:8])
            N = naive_forward(m, toks[:8])
            close(L, N, 1e-9 * max(1.0, float(np.abs(N).max())), "naive")

        _naive()

    @check("forward: merged attn_kv_b and fused gate_up files == split ones")
    def _variants():
        L = R.Model(paths["v2"]).forward(toks)
        for v in ("v2kvb", "v2fused"):
            close(R.Model(paths[v]).forward(toks), L, 1e-12, v)

    @check("forward v3: routing renormalised x2.5, groups respected, bias used")
    def _routing():
        m = R.Model(paths["v3"])
        m.forward(toks)
        c = m.cfg
        eq(len(m.routing), len(toks) * (c["n_layer"] - c["n_dense"]), "records")
        gsz = c["n_expert"] // c["n_group"]
        for rec in m.routing:
            close(sum(rec["weights"]), 2.5, 1e-12, "weight sum")
            eq(len(rec["experts"]), c["n_expert_used"], "k")
            eq(len(set(rec["experts"])), c["n_expert_used"], "distinct experts")
            groups = {e // gsz for e in rec["experts"]}
            if len(groups) > c["n_group_used"]:
                raise AssertionError("experts from %d groups" % len(groups))
        m2 = R.Model(paths["v2"])
        m2.forward(toks)
        for rec in m2.routing:
            if not sum(rec["weights"]) < 1.0:
                raise AssertionError("v2 (softmax, no norm) weights sum >= 1")

    @check("forward: generate() greedy tokens and CLI --out/--routing")
    def _cli():
        m = R.Model(paths["v3"])
        gen, L = m.generate(toks[:4], 5)
        eq(L.shape, (9, 300), "logits rows")
        m.reset()
        rows = [m.step(t) for t in toks[:4]]
        for g in gen:
            eq(int(np.argmax(rows[-1])), g, "greedy token")
            rows.append(m.step(g))
        close(np.array(rows), L, 1e-9, "generate logits")
        out = os.path.join(tmp, "logits.npy")
        rj = os.path.join(tmp, "routing.json")
        res = subprocess.run([sys.executable, os.path.join(HERE, "deepseek2_ref.py"), paths["v3"],
                              "--tokens", ",".join(map(str, toks[:4])), "--decode", "5",
                              "--out", out, "--routing", rj],
                             check=True, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL).stdout.decode()
        arr = np.load(out)
        eq(arr.dtype, np.dtype(np.float32), "npy dtype")
        close(arr, L.astype(np.float32), 0, "npy logits")
        if ("greedy: " + ",".join(map(str, gen))) not in res:
            raise AssertionError("CLI greedy line missing: %r" % res)
        rt = json.load(open(rj))
        eq(len(rt["routing"]), 9 * 2, "routing records")

    @check("forward: act_quant (no-op without Q weights; batching; CLI --act-quant)")
    def _act_quant():
        # v2 tiny has only f32/f16/bf16 weights: act_quant changes nothing
        close(R.Model(paths["v2"], act_quant=True).forward(toks), R.Model(paths["v2"]).forward(toks), 0, "v2")
        m = R.Model(paths["v3"], act_quant=True)                  # q8_0 / q4_0 matmuls
        eq(m.wtype[1]["q_a"], G.TYPE_Q8_0, "v3 q_a type")
        eq(m.wtype[1]["o"], G.TYPE_Q4_0, "v3 attn_output type")
        eq(m.wtype[1]["q_b"], G.TYPE_F16, "v3 q_b type")
        L = m.forward(toks)
        eq(m.qmargin.shape, (len(toks),), "qmargin")
        if not (np.all(np.isfinite(L)) and np.all(m.qmargin >= 0) and np.all(np.isfinite(m.qmargin))):
            raise AssertionError("non-finite logits or margins")
        F = R.Model(paths["v3"]).forward(toks)
        if not 0 < float(np.abs(L - F).max()) < float(np.abs(F).max()):
            raise AssertionError("act_quant difference %g not in (0, max|F|)" % float(np.abs(L - F).max()))
        m.reset()
        inc = np.array([m.step(t) for t in toks])
        close(inc, L, 1e-9, "incremental vs full")
        out = os.path.join(tmp, "logits_aq.npy")
        subprocess.run([sys.executable, os.path.join(HERE, "deepseek2_ref.py"), paths["v3"],
                        "--tokens", ",".join(map(str, toks[:4])), "--decode", "3", "--act-quant",
                        "--out", out], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        _, L2 = R.Model(paths["v3"], act_quant=True).generate(toks[:4], 3)
        close(np.load(out), L2.astype(np.float32), 0, "CLI --act-quant logits")

    _variants()
    _routing()
    _cli()
    _act_quant()


def test_moetax(tmp, exe):
    @check("moetax gen --preset tiny: reader + reference forward")
    def _gen():
        path = os.path.join(tmp, "moetax_tiny.gguf")
        subprocess.run([exe, "gen", "--preset", "tiny", "-o", path], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        r = G.GGUFReader(path)
        for name in r.tensors:
            if r.info(name).type in G.DEQUANT_TYPES:
                v = r.tensor(name)
                if not np.all(np.isfinite(v)):
                    raise AssertionError("%s: non-finite values" % name)
        m = R.Model(path)
        L = m.forward([1, 2, 3, 4])
        m.reset()
        inc = np.array([m.step(t) for t in [1, 2, 3, 4]])
        close(inc, L, 1e-9, "incremental")
    _gen()


def main():
    global VERBOSE
    import argparse
    ap = argparse.ArgumentParser()
    ap.add_argument("-v", action="store_true")
    ap.add_argument("--keep", help="write the test files into this directory")
    ap.add_argument("--moetax", help="path of the moetax binary (default: build/moetax if present)")
    a = ap.parse_args()
    VERBOSE = a.v
    tmpctx = None
    if a.keep:
        os.makedirs(a.keep, exist_ok=True)
        tmp = a.keep
    else:
        tmpctx = tempfile.TemporaryDirectory(prefix="moetax_ref_")
        tmp = tmpctx.name
    test_reader(tmp)
    test_blocks()
    test_forward(tmp)
    exe = a.moetax or os.path.join(HERE, "..", "..", "build", "moetax")
    if os.path.exists(exe):
        ok = subprocess.run([exe, "gen", "--help"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL).returncode == 0
        if ok:
            test_moetax(tmp, exe)
        else:
            print("SKIP moetax gen (gen --help failed)")
    else:
        print("SKIP moetax gen (no %s)" % exe)
    n_pass = sum(1 for r in RESULTS if r[1])
    n_fail = len(RESULTS) - n_pass
    print("%d passed, %d failed" % (n_pass, n_fail))
    if tmpctx:
        tmpctx.cleanup()
    return 1 if n_fail else 0


if __name__ == "__main__":
    sys.exit(main())
