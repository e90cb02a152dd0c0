#!/usr/bin/python3
# ctest-labels: unit
"""test_kq_quant_np.py - `moetax quantize IN OUT q3_k|q2_k` writes the bytes of ggml's
quantize_row_q3_K_ref / quantize_row_q2_K_ref (make_q3_quants with do_rmse,
make_qkx2_quants with use_mad), checked against a NumPy port written here (float32 at
every step, in ggml's order of operations, vectorised over 16-value groups only), on
a GGUF file written here: random normal rows of several magnitudes, all-zero rows,
rows below ggml's GROUP_MAX_EPS, constant rows, rows of one outlier, positive-only and
negative-only rows, sparse rows. Also: the dequantized sums `moetax inspect --json
--checksums` prints agree with a NumPy dequantization of the same bytes, moetax's
dequantization of random blocks (`quantize ... f32`) equals NumPy's bit for bit, and a tensor
whose rows are not a multiple of 256 becomes q8_0, named on stderr.

usage: test_kq_quant_np.py MOETAX_BIN WORKDIR
"""
import json
import os
import struct
import subprocess
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "ref"))
import gguf_np  # noqa: E402
from checks import check, summary  # noqa: E402

F = np.float32


def rint(v):
    """ggml's nearest_int (the 1.5 * 2^23 trick): round half to even, for |v| < 2^22."""
    return np.rint(v).astype(np.int64)


def fp16(v):
    return np.asarray(v, dtype=F).astype(np.float16)


# ---------------------------------------------------------------- Q3_K

def make_q3_quants(x):
    """x: (G, 16) float32 -> (scale (G,), L (G, 16) int in 0..7, 0 for all-zero groups)."""
    nmax = 4
    G = x.shape[0]
    ax = np.abs(x)
    imax = np.argmax(ax, axis=1)  # the first of the largest magnitude (ggml: strict >)
    amax = ax[np.arange(G), imax]
    mx = x[np.arange(G), imax]
    zero = amax < F(1e-15)
    mx = np.where(zero, F(1), mx)
    iscale = (F(-nmax) / mx).astype(F)
    L = np.clip(rint(iscale[:, None] * x), -nmax, nmax - 1)
    sumlx = np.zeros(G, F)
    suml2 = np.zeros(G, F)
    for i in range(16):
        w = x[:, i] * x[:, i]
        sumlx = sumlx + w * x[:, i] * L[:, i].astype(F)
        suml2 = suml2 + w * L[:, i].astype(F) * L[:, i].astype(F)
    # ggml stops after a pass without a change; another pass would change nothing either
    for _ in range(5):
        for i in range(16):
            xi = x[:, i]
            w = xi * xi
            Li = L[:, i].astype(F)
            slx = sumlx - w * xi * Li
            pos = slx > 0
            sl2 = suml2 - w * Li * Li
            with np.errstate(divide="ignore", invalid="ignore"):
                q = np.where(pos, xi * sl2 / np.where(pos, slx, F(1)), F(0)).astype(F)
            new_l = np.clip(rint(q), -nmax, nmax - 1)
            nl = new_l.astype(F)
            slx2 = slx + w * xi * nl
            sl22 = sl2 + w * nl * nl
            upd = pos & (new_l != L[:, i]) & (sl22 > 0) & (slx2 * slx2 * suml2 > sumlx * sumlx * sl22)
            L[:, i] = np.where(upd, new_l, L[:, i])
            sumlx = np.where(upd, slx2, sumlx)
            suml2 = np.where(upd, sl22, suml2)
    with np.errstate(divide="ignore", invalid="ignore"):
        scale = np.where(suml2 > 0, sumlx / np.where(suml2 > 0, suml2, F(1)), F(0)).astype(F)
    L = L + nmax
    scale = np.where(zero, F(0), scale)
    L[zero] = 0
    return scale, L


def quantize_q3_k(x):
    """x: (B, 256) float32 -> (B, 110) uint8, ggml's quantize_row_q3_K_ref."""
    B = x.shape[0]
    scales, L = make_q3_quants(x.reshape(B * 16, 16))
    scales = scales.reshape(B, 16)
    L = L.reshape(B, 256)
    out = np.zeros((B, 110), np.uint8)
    ia = np.argmax(np.abs(scales), axis=1)
    max_scale = scales[np.arange(B), ia]
    has = max_scale != 0
    iscale = (F(-32) / np.where(has, max_scale, F(1))).astype(F)
    ls = np.clip(rint(iscale[:, None] * scales), -32, 31) + 32  # 0..63
    ls = np.where(has[:, None], ls, 0)
    sc12 = np.zeros((B, 12), np.int64)
    for j in range(16):
        if j < 8:
            sc12[:, j] |= ls[:, j] & 0xF
        else:
            sc12[:, j - 8] |= (ls[:, j] & 0xF) << 4
        sc12[:, j % 4 + 8] |= (ls[:, j] >> 4) << (2 * (j // 4))
    d16 = np.where(has, fp16((F(1) / iscale).astype(F)), np.float16(0))
    dall = d16.astype(F)
    for j in range(16):
        dj = (dall * (ls[:, j] - 32).astype(F)).astype(F)
        nz = dj != 0
        with np.errstate(divide="ignore", invalid="ignore"):
            q = x[:, 16 * j:16 * j + 16] / np.where(nz, dj, F(1))[:, None]
        lq = np.clip(rint(q), -4, 3) + 4
        L[:, 16 * j:16 * j + 16] = np.where(nz[:, None], lq, L[:, 16 * j:16 * j + 16])
    hm = np.zeros((B, 32), np.int64)
    for v in range(256):
        hi = L[:, v] > 3
        hm[:, v % 32] |= np.where(hi, 1 << (v // 32), 0)
        L[:, v] = np.where(hi, L[:, v] - 4, L[:, v])
    qs = np.zeros((B, 64), np.int64)
    for h in range(2):
        for l in range(32):
            b = 128 * h
            qs[:, 32 * h + l] = L[:, b + l] | (L[:, b + l + 32] << 2) | (L[:, b + l + 64] << 4) | (L[:, b + l + 96] << 6)
    out[:, 0:32] = hm
    out[:, 32:96] = qs
    out[:, 96:108] = sc12
    out[:, 108:110] = d16.reshape(B, 1).view(np.uint8)
    return out


def dequantize_q3_k(b):
    B = b.shape[0]
    hm, qs, sc12 = b[:, 0:32].astype(np.int64), b[:, 32:96].astype(np.int64), b[:, 96:108].astype(np.int64)
    d = np.ascontiguousarray(b[:, 108:110]).view("<f2").astype(F).reshape(B)
    y = np.zeros((B, 256), F)
    for v in range(256):
        h, k, l, j = v // 128, (v % 128) // 32, v % 32, v // 16
        s6 = ((sc12[:, j] if j < 8 else sc12[:, j - 8] >> 4) & 0xF) | (((sc12[:, 8 + j % 4] >> (2 * (j // 4))) & 3) << 4)
        q = ((qs[:, 32 * h + l] >> (2 * k)) & 3) - np.where((hm[:, l] >> (4 * h + k)) & 1, 0, 4)
        y[:, v] = (d * (s6 - 32).astype(F)) * q.astype(F)
    return y


# ---------------------------------------------------------------- Q2_K

def make_qkx2_quants(x, w, nmax, rmin, rdelta, nstep):
    """use_mad = true (Q2_K). x, w: (G, n) float32 -> (scale (G,), the_min (G,), L (G, n))."""
    G, n = x.shape
    mn = x[:, 0].copy()
    mx = x[:, 0].copy()
    sum_w = w[:, 0].copy()
    sum_x = sum_w * x[:, 0]
    for i in range(1, n):
        mn = np.minimum(mn, x[:, i])
        mx = np.maximum(mx, x[:, i])
        sum_w = sum_w + w[:, i]
        sum_x = sum_x + w[:, i] * x[:, i]
    mn = np.where(mn > 0, F(0), mn)
    eq = mx == mn
    rng = np.where(eq, F(1), mx - mn).astype(F)
    iscale = (F(nmax) / rng).astype(F)
    scale = (F(1) / iscale).astype(F)
    L = np.clip(rint(iscale[:, None] * (x - mn[:, None])), 0, nmax)
    best = np.zeros(G, F)
    for i in range(n):
        diff = np.abs(scale * L[:, i].astype(F) + mn - x[:, i])
        best = best + w[:, i] * diff
    for s in range(nstep + 1):
        # ggml's loop reads min as updated by an earlier step (in max - min too)
        rng = np.where(eq, F(1), mx - mn).astype(F)
        isc = ((F(rmin) + F(rdelta) * F(s) + F(nmax)) / rng).astype(F)
        La = np.clip(rint(isc[:, None] * (x - mn[:, None])), 0, nmax)
        sl = np.zeros(G, F)
        sl2 = np.zeros(G, F)
        sxl = np.zeros(G, F)
        for i in range(n):
            l = La[:, i].astype(F)
            sl = sl + w[:, i] * l
            sl2 = sl2 + w[:, i] * l * l
            sxl = sxl + w[:, i] * l * x[:, i]
        D = sum_w * sl2 - sl * sl
        ok = D > 0
        Dd = np.where(ok, D, F(1))
        ts = ((sum_w * sxl - sum_x * sl) / Dd).astype(F)
        tm = ((sl2 * sum_x - sl * sxl) / Dd).astype(F)
        clampm = tm > 0
        tm = np.where(clampm, F(0), tm)
        with np.errstate(divide="ignore", invalid="ignore"):
            ts = np.where(clampm, sxl / np.where(sl2 != 0, sl2, F(1)), ts).astype(F)
        cur = np.zeros(G, F)
        for i in range(n):
            diff = np.abs(ts * La[:, i].astype(F) + tm - x[:, i])
            cur = cur + w[:, i] * diff
        upd = ok & (cur < best)
        L = np.where(upd[:, None], La, L)
        best = np.where(upd, cur, best)
        scale = np.where(upd, ts, scale)
        mn = np.where(upd, tm, mn)
    scale = np.where(eq, F(0), scale)
    L[eq] = 0
    return scale, -mn, L


def quantize_q2_k(x):
    """x: (B, 256) float32 -> (B, 84) uint8, ggml's quantize_row_q2_K_ref."""
    B = x.shape[0]
    xg = x.reshape(B * 16, 16)
    scales, mins, L = make_qkx2_quants(xg, np.abs(xg), 3, -0.5, 0.1, 15)
    scales, mins, L = scales.reshape(B, 16), mins.reshape(B, 16), L.reshape(B, 256)
    max_scale = np.maximum(F(0), scales.max(axis=1))
    max_min = np.maximum(F(0), mins.max(axis=1))
    q4 = F(15)
    hs, hm = max_scale > 0, max_min > 0
    isc = (q4 / np.where(hs, max_scale, F(1))).astype(F)
    imn = (q4 / np.where(hm, max_min, F(1))).astype(F)
    sc = np.where(hs[:, None], rint(isc[:, None] * scales), 0) & 0xFF
    sc = (sc | np.where(hm[:, None], rint(imn[:, None] * mins) << 4, 0)) & 0xFF
    d16 = np.where(hs, fp16((max_scale / q4).astype(F)), np.float16(0))
    m16 = np.where(hm, fp16((max_min / q4).astype(F)), np.float16(0))
    df, mf = d16.astype(F), m16.astype(F)
    for j in range(16):
        dj = (df * (sc[:, j] & 0xF).astype(F)).astype(F)
        nz = dj != 0
        dm = (mf * (sc[:, j] >> 4).astype(F)).astype(F)
        with np.errstate(divide="ignore", invalid="ignore"):
            q = (x[:, 16 * j:16 * j + 16] + dm[:, None]) / np.where(nz, dj, F(1))[:, None]
        lq = np.clip(rint(q), 0, 3)
        L[:, 16 * j:16 * j + 16] = np.where(nz[:, None], lq, L[:, 16 * j:16 * j + 16])
    qs = np.zeros((B, 64), np.int64)
    for h in range(2):
        for l in range(32):
            b = 128 * h
            qs[:, 32 * h + l] = L[:, b + l] | (L[:, b + l + 32] << 2) | (L[:, b + l + 64] << 4) | (L[:, b + l + 96] << 6)
    out = np.zeros((B, 84), np.uint8)
    out[:, 0:16] = sc
    out[:, 16:80] = qs
    out[:, 80:82] = d16.reshape(B, 1).view(np.uint8)
    out[:, 82:84] = m16.reshape(B, 1).view(np.uint8)
    return out


def dequantize_q2_k(b):
    B = b.shape[0]
    sc, qs = b[:, 0:16].astype(np.int64), b[:, 16:80].astype(np.int64)
    d = np.ascontiguousarray(b[:, 80:82]).view("<f2").astype(F).reshape(B)
    dm = np.ascontiguousarray(b[:, 82:84]).view("<f2").astype(F).reshape(B)
    y = np.zeros((B, 256), F)
    for v in range(256):
        h, k, l, j = v // 128, (v % 128) // 32, v % 32, v // 16
        q = (qs[:, 32 * h + l] >> (2 * k)) & 3
        y[:, v] = (d * (sc[:, j] & 0xF).astype(F)) * q.astype(F) - dm * (sc[:, j] >> 4).astype(F)
    return y


# ---------------------------------------------------------------- Q5_0

def quantize_q5_0(x):
    """x: (nb, 32) float32 -> (nb, 22) uint8 blocks, as ggml's quantize_row_q5_0_ref: d = the value
    of largest magnitude (the first of equals) / -16, q = min(31, trunc(x / d + 16.5))."""
    x = np.asarray(x, F)
    mx = x[np.arange(x.shape[0]), np.argmax(np.abs(x), axis=1)]
    d = (mx / F(-16)).astype(F)
    with np.errstate(divide="ignore"):
        idv = np.where(d != 0, F(1) / np.where(d != 0, d, F(1)), F(0)).astype(F)
    v = (x * idv[:, None]).astype(F)
    q = np.minimum(31, np.trunc((v + F(16.5)).astype(F)).astype(np.int64))
    out = np.zeros((x.shape[0], 22), np.uint8)
    out[:, 0:2] = fp16(d).view(np.uint8).reshape(-1, 2)
    qh = np.zeros(x.shape[0], np.uint64)
    for j in range(32):
        qh |= ((q[:, j] >> 4) & 1).astype(np.uint64) << np.uint64(j)
    out[:, 2:6] = qh.astype("<u4").view(np.uint8).reshape(-1, 4)
    out[:, 6:] = ((q[:, :16] & 15) | ((q[:, 16:] & 15) << 4)).astype(np.uint8)
    return out


def quantize_x_1(x, bits):
    """x: (nb, 32) float32 -> Q4_1 (bits 4, 20-byte) or Q5_1 (bits 5, 24-byte) blocks, as ggml's
    quantize_row_q4_1_ref / q5_1_ref: m = min, d = (max - min) / (2^bits - 1), q = trunc((x - m) / d +
    0.5) (Q4_1: at most 15)."""
    x = np.asarray(x, F)
    mn, mx = x.min(axis=1), x.max(axis=1)
    d = ((mx - mn) / F((1 << bits) - 1)).astype(F)
    with np.errstate(divide="ignore"):
        idv = np.where(d != 0, F(1) / np.where(d != 0, d, F(1)), F(0)).astype(F)
    v = ((x - mn[:, None]).astype(F) * idv[:, None]).astype(F)
    q = np.trunc((v + F(0.5)).astype(F)).astype(np.int64)
    if bits == 4:
        q = np.minimum(15, q)
    bs = 20 if bits == 4 else 24
    out = np.zeros((x.shape[0], bs), np.uint8)
    out[:, 0:2] = fp16(d).view(np.uint8).reshape(-1, 2)
    out[:, 2:4] = fp16(mn).view(np.uint8).reshape(-1, 2)
    if bits == 5:
        qh = np.zeros(x.shape[0], np.uint64)
        for j in range(32):
            qh |= ((q[:, j] >> 4) & 1).astype(np.uint64) << np.uint64(j)
        out[:, 4:8] = qh.astype("<u4").view(np.uint8).reshape(-1, 4)
    out[:, bs - 16:] = ((q[:, :16] & 15) | ((q[:, 16:] & 15) << 4)).astype(np.uint8)
    return out


IQ4NL = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.int64)


def iq4nl_index(v):
    """ggml's best_index_int8 over the IQ4_NL levels, elementwise (float32 v): the nearest level,
    the upper one on a tie."""
    v = np.asarray(v, F)
    hi = np.clip(np.searchsorted(IQ4NL.astype(F), v, side="right"), 1, 15)
    lo_d = (v - IQ4NL[hi - 1].astype(F)).astype(F)
    hi_d = (IQ4NL[hi].astype(F) - v).astype(F)
    idx = np.where(lo_d < hi_d, hi - 1, hi)
    idx = np.where(v <= F(IQ4NL[0]), 0, idx)
    return np.where(v >= F(IQ4NL[15]), 15, idx)


def quantize_iq4_nl(x):
    """x: (nb, 32) float32 -> (nb, 18) uint8 blocks, as ggml's quantize_iq4_nl without importance
    weights (llama-quantize's IQ4_NL): weights x^2, the first scale max / 127 refined to sum(wqx) /
    sum(wq^2), then 15 tries from (t - 127) / max, t = -7..7, kept where sum(wqx)^2 / sum(wq^2) grows;
    sums in float32 in the order of j."""
    x = np.asarray(x, F)
    nb = x.shape[0]
    w = (x * x).astype(F)
    ia = np.argmax(np.abs(x), axis=1)
    amax = np.abs(x)[np.arange(nb), ia]
    mx = x[np.arange(nb), ia]
    ok = amax >= F(1e-15)
    safe_mx = np.where(ok, mx, F(1))

    def sums(idv):
        q = IQ4NL[iq4nl_index((idv[:, None] * x).astype(F))].astype(F)
        sqx, sq2 = np.zeros(nb, F), np.zeros(nb, F)
        for j in range(32):
            sqx = (sqx + ((w[:, j] * q[:, j]).astype(F) * x[:, j]).astype(F)).astype(F)
            sq2 = (sq2 + ((w[:, j] * q[:, j]).astype(F) * q[:, j]).astype(F)).astype(F)
        return sqx, sq2

    d0 = (-safe_mx / F(-127)).astype(F)
    sqx, sq2 = sums((F(1) / d0).astype(F))
    d = np.where(sq2 > 0, (sqx / np.where(sq2 > 0, sq2, F(1))).astype(F), F(0)).astype(F)
    best = (d * sqx).astype(F)
    for t in range(-7, 8):
        sqx, sq2 = sums((F(t - 127) / safe_mx).astype(F))
        better = (sq2 > 0) & ((sqx * sqx).astype(F) > (best * sq2).astype(F))
        dn = (sqx / np.where(sq2 > 0, sq2, F(1))).astype(F)
        d = np.where(better, dn, d)
        best = np.where(better, (dn * sqx).astype(F), best)
    d = np.where(ok, d, F(0)).astype(F)
    idv = np.where(d != 0, F(1) / np.where(d != 0, d, F(1)), F(0)).astype(F)
    L = iq4nl_index((idv[:, None] * x).astype(F))
    out = np.zeros((nb, 18), np.uint8)
    out[:, 0:2] = fp16(d).view(np.uint8).reshape(-1, 2)
    out[:, 2:] = (L[:, :16] | (L[:, 16:] << 4)).astype(np.uint8)
    return out


# ---------------------------------------------------------------- a GGUF of F32 tensors

def write_gguf(path, tensors):
    """tensors: [(name, float32 array of shape (rows, ncols))] or [(name, (type id, ncols, rows,
    raw bytes))] -> a GGUF v3 file."""
    tensors = [(n, a if isinstance(a, tuple) else (0, a.shape[1], a.shape[0], a.astype("<f4").tobytes()))
               for n, a in tensors]
    def s(b):
        return struct.pack("<Q", len(b)) + b
    kv = [(b"general.architecture", 8, s(b"llama")), (b"general.alignment", 4, struct.pack("<I", 32))]
    head = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(kv))
    for k, t, v in kv:
        head += s(k) + struct.pack("<I", t) + v
    off = 0
    offs = []
    for name, (tid, ne0, ne1, raw) in tensors:
        offs.append(off)
        off += (len(raw) + 31) // 32 * 32
    for (name, (tid, ne0, ne1, raw)), o in zip(tensors, offs):
        head += s(name.encode()) + struct.pack("<IQQIQ", 2, ne0, ne1, tid, o)
    head += b"\0" * ((-len(head)) % 32)
    with open(path, "wb") as f:
        f.write(head)
        for name, (tid, ne0, ne1, raw) in tensors:
            f.write(raw)
            f.write(b"\0" * ((-len(raw)) % 32))


def test_rows(rng):
    rows = []
    for scale in (1.0, 0.02, 300.0, 1e-4):
        rows += list(rng.standard_normal((6, 512)).astype(F) * F(scale))
    rows.append(np.zeros(512, F))
    rows.append(np.full(512, F(1e-20)))                      # below GROUP_MAX_EPS
    rows.append(np.full(512, F(0.75)))                       # constant
    r = np.zeros(512, F); r[37] = F(5.0); rows.append(r)     # one outlier
    r = np.zeros(512, F); r[300] = F(-2.5); r[301] = F(1e-3); rows.append(r)
    rows.append(np.abs(rng.standard_normal(512)).astype(F))  # positive only (min 0)
    rows.append(-np.abs(rng.standard_normal(512)).astype(F))
    r = rng.standard_normal(512).astype(F); r[rng.random(512) < 0.8] = 0; rows.append(r)  # sparse
    r = rng.standard_normal(512).astype(F); r[:16] *= F(1000); rows.append(r)              # one loud group
    r = rng.integers(-4, 4, 512).astype(F) * F(0.125); rows.append(r)                       # on a grid (ties)
    return np.stack(rows).astype(F)


def main():
    moetax, work = sys.argv[1], sys.argv[2]
    os.makedirs(work, exist_ok=True)
    rng = np.random.default_rng(18)
    a = test_rows(rng)
    b = rng.standard_normal((40, 768)).astype(F) * F(0.05)
    odd = rng.standard_normal((3, 96)).astype(F)
    src = os.path.join(work, "kqnp_f32.gguf")
    write_gguf(src, [("a.weight", a), ("b.weight", b), ("odd.weight", odd)])
    for tname, tid, bsz, quant, deq in (("q3_k", 11, 110, quantize_q3_k, dequantize_q3_k),
                                        ("q2_k", 10, 84, quantize_q2_k, dequantize_q2_k)):
        dst = os.path.join(work, "kqnp_%s.gguf" % tname)
        p = subprocess.run([moetax, "quantize", src, dst, tname], capture_output=True, text=True)
        check(p.returncode == 0, "%s: quantize failed: %s" % (tname, p.stderr))
        if p.returncode:
            continue
        check("odd.weight: 96 columns are not a multiple of 256 (%s): q8_0 instead" % tname in p.stderr,
              "%s: the fallback is named: %s" % (tname, p.stderr))
        r = gguf_np.GGUFReader(dst)
        check(r.get("general.file_type") == (12 if tid == 11 else 10), "%s: general.file_type" % tname)
        check(r.info("odd.weight").type == 8, "%s: odd.weight is q8_0" % tname)
        sums = {}
        for name, x in (("a.weight", a), ("b.weight", b)):
            info = r.info(name)
            check(info.type == tid, "%s: %s has type %d" % (tname, name, info.type))
            got = np.frombuffer(bytes(r.raw(name)), np.uint8).reshape(-1, bsz)
            want = quant(x.reshape(-1, 256))
            nbad = int(np.sum(np.any(got != want, axis=1)))
            check(nbad == 0, "%s %s: %d of %d super-blocks differ from the NumPy port of ggml's reference (first %s)"
                  % (tname, name, nbad, got.shape[0], np.argwhere(np.any(got != want, axis=1))[:3].ravel()))
            y = deq(got).astype(np.float64)
            sums[name] = (float(y.sum()), float((y * y).sum()))
            err = np.abs(deq(want).reshape(x.shape) - x).max() / max(1e-30, float(np.abs(x).max()))
            print("%s %s: max |dequant - x| / max |x| = %.4f" % (tname, name, err))
        r.close()
        out = subprocess.run([moetax, "inspect", dst, "--json", "--checksums"], capture_output=True, text=True)
        check(out.returncode == 0, "%s: inspect --checksums failed: %s" % (tname, out.stderr))
        if out.returncode == 0:
            js = json.loads(out.stdout)
            ts = {t["name"]: t for t in js["tensors"]}
            for name, (s1, s2) in sums.items():
                t = ts.get(name, {})
                c = t.get("checksums", t)
                gs, gq = c.get("sum"), c.get("sum_sq", c.get("sumsq"))
                check(gs is not None and abs(gs - s1) <= 1e-4 * max(1.0, abs(s1), s2 ** 0.5) and
                      gq is not None and abs(gq - s2) <= 1e-5 * max(1.0, s2),
                      "%s %s: inspect's dequantized sums %s %s vs NumPy %r %r" % (tname, name, gs, gq, s1, s2))
    # Q5_0, Q4_1, Q5_1: moetax quantize == NumPy ports of ggml's quantize_row_q5_0_ref / q4_1_ref /
    # q5_1_ref; q4_k and q5_k take Q5_0 and Q5_1 for rows that are not whole super-blocks, as
    # llama-quantize does (file type: LLAMA_FTYPE_MOSTLY_*; the fallbacks: the k-quant's own)
    q41, q51 = (lambda x: quantize_x_1(x, 4)), (lambda x: quantize_x_1(x, 5))
    for tname, tid, bs, quant, ft, bound, kq in (("q5_0", 6, 22, quantize_q5_0, 8, 1 / 16, None),
                                                 ("q4_k", 6, 22, quantize_q5_0, None, 1 / 16, 12),
                                                 ("q4_1", 3, 20, q41, 3, 1 / 15, None),
                                                 ("q5_1", 7, 24, q51, 9, 1 / 31, None),
                                                 ("q5_k", 7, 24, q51, None, 1 / 31, 13),
                                                 ("iq4_nl", 20, 18, quantize_iq4_nl, 25, 0.125, None)):
        dst = os.path.join(work, "kqnp_%s.gguf" % tname)
        p = subprocess.run([moetax, "quantize", src, dst, tname], capture_output=True, text=True)
        check(p.returncode == 0, "%s: quantize failed: %s" % (tname, p.stderr))
        if p.returncode:
            continue
        r = gguf_np.GGUFReader(dst)
        child = gguf_np.GGML_TYPES[tid][0]
        if kq is not None:
            check("odd.weight: 96 columns are not a multiple of 256 (%s): %s instead" % (tname, child) in p.stderr,
                  "%s: the fallback to %s is named: %s" % (tname, child, p.stderr))
            check(r.info("a.weight").type == kq, "%s: a.weight is %s" % (tname, tname))
            names = (("odd.weight", odd),)
        else:
            check(r.get("general.file_type") == ft, "%s: general.file_type %s" % (tname, r.get("general.file_type")))
            names = (("a.weight", a), ("b.weight", b), ("odd.weight", odd))
        for name, x in names:
            check(r.info(name).type == tid, "%s: %s has type %d" % (tname, name, r.info(name).type))
            got = np.frombuffer(bytes(r.raw(name)), np.uint8).reshape(-1, bs)
            want = quant(x.reshape(-1, 32))
            nbad = int(np.sum(np.any(got != want, axis=1)))
            check(nbad == 0, "%s %s: %d of %d %s blocks differ from the NumPy port of ggml's reference (first %s)"
                  % (tname, name, nbad, got.shape[0], child, np.argwhere(np.any(got != want, axis=1))[:3].ravel()))
            y = gguf_np.dequantize(got.reshape(-1), tid).reshape(x.shape)
            err = np.abs(y - x).max() / max(1e-30, float(np.abs(x).max()))
            check(err <= bound, "%s %s: max |dequant - x| / max |x| = %.4f" % (tname, name, err))
        r.close()
    # moetax's dequantization (moetax_to_float, through quantize ... f32) of any bytes == NumPy's
    # (which equals upstream dequantize_row_q{3,2}_K, checked by hand): random blocks with
    # random finite F16 scales
    for tname, tid, bsz, doffs, deq in (("q3_k", 11, 110, (108,), dequantize_q3_k),
                                        ("q2_k", 10, 84, (80, 82), dequantize_q2_k),
                                        ("q5_0", 6, 22, (0,), lambda b: gguf_np.dequantize(b.reshape(-1), 6)),
                                        ("iq4_nl", 20, 18, (0,), lambda b: gguf_np.dequantize(b.reshape(-1), 20)),
                                        ("q4_1", 3, 20, (0, 2), lambda b: gguf_np.dequantize(b.reshape(-1), 3)),
                                        ("q5_1", 7, 24, (0, 2), lambda b: gguf_np.dequantize(b.reshape(-1), 7))):
        nblk = 768 * 16 // (256 if bsz > 34 else 32)
        blocks = rng.integers(0, 256, (nblk, bsz)).astype(np.uint8)
        for o in doffs:
            blocks[:, o:o + 2] = (rng.standard_normal(nblk) * 0.1).astype("<f2").view(np.uint8).reshape(nblk, 2)
        src = os.path.join(work, "kqnp_rand_%s.gguf" % tname)
        dst = os.path.join(work, "kqnp_rand_%s_f32.gguf" % tname)
        write_gguf(src, [("r.weight", (tid, 768, 16, blocks.tobytes()))])
        p = subprocess.run([moetax, "quantize", src, dst, "f32"], capture_output=True, text=True)
        check(p.returncode == 0, "%s: quantize to f32 failed: %s" % (tname, p.stderr))
        if p.returncode == 0:
            r = gguf_np.GGUFReader(dst)
            got = np.frombuffer(bytes(r.raw("r.weight")), "<f4")
            want = deq(blocks).reshape(-1)
            check(np.array_equal(got.view(np.uint32), want.view(np.uint32)),
                  "%s: moetax's dequantization of random blocks differs from NumPy's (%d values)"
                  % (tname, int(np.sum(got != want))))
            r.close()
    return summary()


if __name__ == "__main__":
    sys.exit(main())
