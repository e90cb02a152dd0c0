#!/usr/bin/python3
"""deepseek2_ref.py - independent NumPy reference forward pass for GGUF `deepseek2` models.

All arithmetic is float64 (weights are dequantised to float32 exactly as stored, then widened).
Implements /work/shared/docs/GGUF-MOE.md with llama.cpp's deepseek2 graph semantics:

  x = token_embd[tok]
  per layer:
    h  = rmsnorm(x) * attn_norm                     rmsnorm(v) = v / sqrt(mean(v^2) + eps)
    q  = W_qb rmsnorm(W_qa h)*q_a_norm  (or W_q h)  -> per head [q_nope (nope) | q_pe (rope)]
    c  = W_kva h -> kv (kv_lora) | k_pe (rope)      kv = rmsnorm(kv) * kv_a_norm
    rope (ggml NORM mode = adjacent pairs (2i, 2i+1)) on q_pe and k_pe, YaRN when
    rope.scaling.type == "yarn"; cache [kv ; k_pe] per position
    q_abs[h] = W_kb[h] @ q_nope[h]     (attn_k_b numpy (H, kv_lora, nope); = W_k[h]^T q_nope)
    s[h,t]   = (q_abs[h].kv_t + q_pe[h].k_pe_t) * kq_scale,  t <= pos;  p = softmax(s)
    o[h]     = W_vb[h] @ sum_t p[h,t] kv_t   (attn_v_b numpy (H, v_head, kv_lora))
    x += W_o concat(o)
    h2 = rmsnorm(x) * ffn_norm
    x += dense SwiGLU (layers < leading_dense_block_count) or MoE(h2) + shared SwiGLU(h2)
  logits = W_out (rmsnorm(x) * output_norm)

  MoE: logits_r = W_gate_inp h2; p = softmax | sigmoid (expert_gating_func 1 | 2; absent -> 1);
  s = p + exp_probs_b (selection only); if expert_group_count G > 1: group score = sum of the
  top-2 s in each group, keep expert_group_used_count best groups, others -> -inf; top-k of s
  (ties -> lower index); w = p[topk]; if expert_weights_norm: w /= max(sum w, 6.103515625e-5);
  if expert_weights_scale not in (0, 1): w *= scale; out = sum_i w_i W_down_i(silu(W_gate_i h2) *
  (W_up_i h2)). Fused ffn_gate_up_exps numpy (E, 2F, d): rows [0, F) gate, [F, 2F) up.
  Older files with merged attn_kv_b {kv_lora, H*(nope+v_head)}: numpy (H*(nope+v), kv_lora),
  per head the first nope rows are k (W_kb[h] = that block transposed), the next v_head rows v.

  kq_scale and RoPE magnitude follow llama.cpp (llama-context.cpp + models/deepseek2.cpp):
    F = rope.scaling.factor (freq_scale = 1/F; absent/0 -> 1), ext = 1 if type == "yarn" else 0
    L = rope.scaling.yarn_log_multiplier / 0.1   (the converter stores 0.1*mscale_all_dim)
    A = rope.scaling.attn_factor (default 1)
    if ext: af = (1 if L != 0 else 1 + 0.1 ln F) / (1 + 0.1 ln F)     else af = 1;   af *= A
    rope: cos/sin scaled by af * (1 + 0.1 ln F) if ext else af
    mscale = af * (1 + 0.1 ln F) * (1 + 0.1 L ln F);  kq_scale = mscale^2 / sqrt(nope + rope)
  (for DeepSeek-V2/V3 files: rope magnitude 1, kq_scale = (1 + 0.1 L ln F)^2 / sqrt(192)).
  YaRN theta per pair i (ggml rope_yarn): theta_e = pos * base^(-2i/n_rot), theta_i = theta_e/F,
  ramp = 1 - clamp((i - lo) / max(0.001, hi - lo), 0, 1), theta = theta_i (1 - ramp*ext) +
  theta_e ramp*ext, with lo = max(0, floor(c(beta_fast))), hi = min(n_rot - 1, ceil(c(beta_slow))),
  c(b) = n_rot ln(n_ctx_orig / (2 pi b)) / (2 ln base), beta_fast 32, beta_slow 1,
  n_ctx_orig = rope.scaling.original_context_length (default context_length); lo/hi computed in
  float32 like ggml.

  Activation quantization (act_quant=True, CLI --act-quant; default off): emulates what moetax and
  ggml do before a matmul whose weight is Q8_0 or Q4_0 (GGUF type 8 or 2): the input vector is
  cast to float32 and quantized to Q8_0 blocks (ggml quantize_row_q8_0), per block of 32:
    amax = max|x_i| (f32); d = amax/127 (f32); id = 1/d if d != 0 else 0 (f32);
    q_i = roundf(x_i * id) (f32 product, half away from zero); d16 = fp16(d) (nearest even)
  and the matmul takes q_i * float(d16) instead of x (then float64 as usual; see quantize_q8_0).
  Matmuls affected, each only when its own weight is q8_0/q4_0: attn_q / attn_q_a (attn-normed x),
  attn_q_b (normed q_a), attn_kv_a_mqa (attn-normed x), attn_k_b per head (q_nope of the head),
  attn_v_b per head (attention output o_h, kv_lora values), attn_output (concatenated heads),
  dense ffn_gate/ffn_up (ffn-normed x) and ffn_down (silu(gate)*up), shared experts gate/up/down,
  routed experts gate/up (ffn-normed x; fused ffn_gate_up_exps: its type) and down (expert hidden),
  output head (final-normed x). Never: the router ffn_gate_inp, the token-embedding lookup, and the
  merged attn_kv_b of older files (moetax converts it to F32 k_b/v_b at load, so k_b/v_b count as
  f32 there). With it the reference agrees with moetax's quantized-weight logits to float32
  rounding, instead of differing by activation-quantization noise and flipped expert choices,
  except after a position where some x_i * id lies within float32 rounding of a .5 boundary:
  there the engine's float32 x_i may round the other way, q_i differs by one, and the logits of
  that and every later position (through the KV cache) differ by ordinary quantization noise
  (~1e-2). m.qmargin[p] (act_quant only) is the smallest distance to such a boundary, relative
  to the block's amax, over all values quantized for position p (quantize_q8_0(margin=True));
  a few float32 ulps (say < 1e-6) marks position p as ambiguous. m.qties lists every value with
  margin < Model.QTIE_RECORD as (margin, position, key) in the last forward/prefill/step calls
  since reset; m.qflip (a set of such keys, kept across reset) makes those values round the
  other way, so a test can check whether an engine's differences are explained by such flips.
  A block's fp16 scale is such a boundary too: d = amax/127 within float32 rounding of the
  midpoint between two fp16 values rounds either way and moves the whole block by half an fp16
  ulp; such scales are listed in m.qties as well (their margin relative to d) and flipped the
  same way.

Python API
  m = Model(path, dtype=np.float64, expert_cache_mb=1024, act_quant=False, decompressed=0)
                               decompressed=n: positions < n as moetax's prefill with the keys and
                               values decompressed (--mla-prefill decompressed) computes them: the
                               same mathematics, with attn_k_b's and attn_v_b's inputs not quantized
  m.cfg                        dict of the hyper-parameters used (incl. kq_scale, rope params)
  m.forward(tokens)            -> ndarray [len(tokens), n_vocab] (float64), positions 0..n-1
  m.reset(); m.step(token)     -> ndarray [n_vocab] logits at the next position (KV cache)
  m.generate(prompt, n)        -> (tokens, logits [len(prompt)+n, n_vocab]) greedy decoding:
                                  logits of the prompt positions then of each generated token
  m.routing                    list of {"layer","pos","token","experts","weights"} appended by
                                  forward/step since the last reset (clear with m.routing.clear())
  m.qmargin                    act_quant: ndarray [positions run since reset], see above
  m.wtype                      {il: {key: ggml type}} of the per-layer matmul weights (the type
                                  act_quant acts on); m.output_type for the output head
  Building blocks (module level): rmsnorm, rope_norm, yarn_corr_dims, rope_params, route,
  moe_forward, softmax, silu, sigmoid, quantize_q8_0.

CLI
  /usr/bin/python3 tests/ref/deepseek2_ref.py MODEL --tokens 1,2,3 [--decode N] [--out logits.npy]
        [--routing routing.json] [--incremental] [--act-quant]
  writes float32 logits [len+N, n_vocab]: rows 0..len-1 are the prompt positions; generated token
  g_j = argmax(row len-1+j) (j = 0..N-1) is fed back and row len+j holds its logits. Prints
  "prompt argmax: ..." and "greedy: g_0,...,g_{N-1}". --routing writes JSON
  {"model","prompt","generated","n_layer","n_dense","routing": [{"layer","pos","token","experts",
  "weights"}, ...]} with one record per MoE layer per fed position (experts in top-k order).
  --incremental feeds the prompt one token at a time (default: one batched pass).
  --act-quant turns on the activation quantization described above (Model(act_quant=True)).
"""

import json
import math
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gguf_np import GGUFReader  # noqa: E402

NORM_W_CLAMP = 6.103515625e-5


# --------------------------------------------------------------------------------------------
# building blocks

def rmsnorm(x, w, eps):
    x = np.asarray(x)
    ms = np.mean(x * x, axis=-1, keepdims=True)
    return x / np.sqrt(ms + eps) * w


Q_TYPES = (2, 3, 6, 7, 8, 20)  # ggml Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL: matmuls on Q8_0-quantized activations


def quantize_q8_0(x, margin=False, flip=(), scale_margin=False):
    """Quantize-dequantize the last axis of x (a multiple of 32) as ggml's quantize_row_q8_0:
    x is cast to float32; per block of 32: amax = max|x| (f32), d = amax/127 (f32),
    id = 1/d or 0 (f32), q = roundf(x*id) (f32 product, ties away from zero), scale fp16(d).
    Returns q * float(fp16(d)) as float64, same shape as x. With margin=True returns
    (that, m) where m (same shape) is each value's distance from a rounding boundary relative
    to its block's amax: | |x*id| - (floor(|x*id|) + 0.5) | / 127 (inf in all-zero blocks): a
    change of x_i, or of amax, by about m * amax flips q_i by one. flip: flat indices (into x)
    whose q is rounded the other way (|q| one up if it was rounded down, else one down); an
    index x.size + b rounds block b's fp16 scale to the other neighbour of d instead.
    scale_margin=True (with margin) also returns sm, per block (in row-major block order): the
    distance of d from the midpoint between its two fp16 neighbours relative to d, so a change
    of amax by about sm * amax rounds the scale the other way, which moves every value of the
    block by up to half an fp16 ulp of d (inf in all-zero blocks)."""
    x = np.asarray(x)
    shp = x.shape
    if shp[-1] % 32:
        raise ValueError("quantize_q8_0: row length %d is not a multiple of 32" % shp[-1])
    xf = np.ascontiguousarray(x, dtype=np.float32).reshape(-1, 32)
    amax = np.max(np.abs(xf), axis=1)                             # float32
    d = amax / np.float32(127.0)                                  # float32
    inv = np.zeros_like(d)
    np.divide(np.float32(1.0), d, out=inv, where=d != 0)          # float32
    v = (xf * inv[:, None]).astype(np.float64)                    # float32 product, exact widen
    q = np.sign(v) * np.floor(np.abs(v) + 0.5)                    # roundf (exact in float64)
    h16 = d.astype(np.float16)                                    # round to nearest even
    other = np.where(h16.astype(np.float32) < d, np.nextafter(h16, np.float16(np.inf)),
                     np.nextafter(h16, np.float16(-np.inf)))      # d's other fp16 neighbour
    if len(flip):
        qf, vf = q.reshape(-1), v.reshape(-1)
        h16f = h16.copy()
        for i in flip:
            if i >= vf.size:                                      # a scale flip
                h16f[i - vf.size] = other[i - vf.size]
                continue
            a = abs(vf[i])
            qf[i] = math.copysign(math.floor(a) + (1.0 if a - math.floor(a) < 0.5 else 0.0), vf[i])
        d16 = h16f.astype(np.float64)
    else:
        d16 = h16.astype(np.float64)
    deq = (q * d16[:, None]).reshape(shp)
    if not margin:
        return deq
    a = np.abs(v)
    m = np.where((d != 0)[:, None], np.abs(a - np.floor(a) - 0.5) / 127.0, np.inf)
    if not scale_margin:
        return deq, m.reshape(shp)
    mid = (h16.astype(np.float64) + other.astype(np.float64)) / 2
    dd = d.astype(np.float64)
    sm = np.full(dd.shape, np.inf)
    np.divide(np.abs(dd - mid), dd, out=sm, where=dd != 0)
    return deq, m.reshape(shp), sm


def silu(x):
    return x / (1.0 + np.exp(-x))


def softmax(x, axis=-1):
    m = np.max(x, axis=axis, keepdims=True)
    e = np.exp(x - m)
    return e / np.sum(e, axis=axis, keepdims=True)


def sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def yarn_corr_dims(n_dims, n_ctx_orig, freq_base, beta_fast, beta_slow):
    """ggml_rope_yarn_corr_dims, evaluated in float32 like ggml (floor/ceil are sensitive)."""
    f = np.float32

    def corr_dim(n_rot):
        return f(n_dims) * f(np.log(f(n_ctx_orig) / (f(n_rot) * f(2) * f(math.pi)))) / \
            (f(2) * f(np.log(f(freq_base))))
    start = np.floor(corr_dim(beta_fast))
    end = np.ceil(corr_dim(beta_slow))
    return float(max(0.0, start)), float(min(n_dims - 1, end))


def rope_norm(x, pos, n_dims, freq_base=10000.0, freq_scale=1.0, ext_factor=0.0,
              attn_factor=1.0, corr_dims=(0.0, 0.0)):
    """ggml RoPE, NORM mode (adjacent pairs), on the last axis of x (length n_dims).
    x: (..., n_dims) with the leading axis (if any) broadcast against pos (shape (T,) or scalar):
    x shape (T, ..., n_dims) and pos shape (T,)."""
    x = np.asarray(x, dtype=np.float64)
    pos = np.asarray(pos, dtype=np.float64)
    half = n_dims // 2
    i = np.arange(half, dtype=np.float64)
    inv = freq_base ** (-2.0 * i / n_dims)                       # theta_scale^i
    theta_e = pos.reshape(pos.shape + (1,)) * inv                 # (T, half) or (half,)
    theta_i = freq_scale * theta_e
    mscale = attn_factor
    if ext_factor != 0.0:
        lo, hi = corr_dims
        y = (i - lo) / max(0.001, hi - lo)
        ramp = (1.0 - np.clip(y, 0.0, 1.0)) * ext_factor
        theta = theta_i * (1.0 - ramp) + theta_e * ramp
        mscale = attn_factor * (1.0 + 0.1 * math.log(1.0 / freq_scale))
    else:
        theta = theta_i
    c = np.cos(theta) * mscale
    s = np.sin(theta) * mscale
    # broadcast (T, half) over middle axes of x
    extra = x.ndim - 1 - pos.ndim
    if extra > 0:
        shp = pos.shape + (1,) * extra + (half,)
        c = c.reshape(shp)
        s = s.reshape(shp)
    x0 = x[..., 0::2]
    x1 = x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = x0 * c - x1 * s
    out[..., 1::2] = x0 * s + x1 * c
    return out


def rope_params(meta_get, arch="deepseek2"):
    """RoPE / YaRN / kq-scale parameters as llama.cpp derives them for deepseek2."""
    def k(s, d=None):
        return meta_get("%s.%s" % (arch, s), d)
    freq_base = float(k("rope.freq_base", 10000.0))
    stype = k("rope.scaling.type", "linear")
    factor = float(k("rope.scaling.factor", 0.0) or 0.0)
    if factor == 0.0:
        factor = float(k("rope.scale_linear", 0.0) or 0.0)
    freq_scale = 1.0 if factor == 0.0 else 1.0 / factor
    if stype == "none":
        freq_scale = 1.0
    ext = float(k("rope.scaling.yarn_ext_factor", -1.0))
    if ext < 0.0:
        ext = 1.0 if stype == "yarn" else 0.0
    L = k("rope.scaling.yarn_log_multiplier", None)
    L = 0.0 if L is None else float(L) / 0.1
    A = float(k("rope.scaling.attn_factor", 1.0))
    lnF = math.log(1.0 / freq_scale)
    af = 1.0
    if ext != 0.0:
        if L != 0.0:
            # deepseek2: mscale = mscale_all_dim -> get_mscale(F, L) / get_mscale(F, L) = 1
            m = L
            gm = (lambda s, ms: 1.0 if s <= 1.0 else 0.1 * ms * math.log(s) + 1.0)
            af = gm(1.0 / freq_scale, m) / gm(1.0 / freq_scale, L)
        else:
            af = 1.0 if freq_scale >= 1.0 else 1.0 + 0.1 * lnF
        af *= 1.0 / (1.0 + 0.1 * lnF)
    af *= A
    rope_mag = af * (1.0 + 0.1 * lnF) if ext != 0.0 else af
    attn_factor_org = af * (1.0 + 0.1 * lnF)
    mscale = attn_factor_org * (1.0 + 0.1 * L * lnF)
    n_ctx_train = int(k("context_length", 4096))
    n_ctx_orig = int(k("rope.scaling.original_context_length", 0) or n_ctx_train)
    beta_fast = float(k("rope.scaling.yarn_beta_fast", 32.0))
    beta_slow = float(k("rope.scaling.yarn_beta_slow", 1.0))
    return dict(freq_base=freq_base, scaling_type=stype, freq_scale=freq_scale, ext_factor=ext,
                yarn_log_mul=L, rope_attn_factor=A, attn_factor=af, rope_magnitude=rope_mag,
                mscale=mscale, n_ctx_orig=n_ctx_orig, beta_fast=beta_fast, beta_slow=beta_slow)


def route(logits, gating_func=1, bias=None, n_group=1, n_group_used=0, k=2, norm=False,
          scale=0.0):
    """One token's routing. logits (E,) -> (experts (k,), weights (k,), p (E,))."""
    logits = np.asarray(logits, dtype=np.float64)
    E = logits.shape[0]
    if gating_func == 2:
        p = sigmoid(logits)
    elif gating_func in (0, 1):
        p = softmax(logits)
    else:
        raise NotImplementedError("expert_gating_func %d" % gating_func)
    s = p + bias if bias is not None else p.copy()
    if n_group > 1:
        if E % n_group:
            raise ValueError("expert_count %d not divisible by expert_group_count %d" % (E, n_group))
        g = s.reshape(n_group, E // n_group)
        top2 = -np.sort(-g, axis=1, kind="stable")[:, :2]
        gs = top2.sum(axis=1)
        keep = np.argsort(-gs, kind="stable")[:n_group_used]
        mask = np.full(n_group, True)
        mask[keep] = False
        g = g.copy()
        g[mask, :] = -np.inf
        s = g.reshape(E)
    top = np.argsort(-s, kind="stable")[:k]
    w = p[top].copy()
    if norm:
        w = w / max(float(np.sum(w)), NORM_W_CLAMP)
    if scale != 0.0 and scale != 1.0:
        w = w * scale
    return top, w, p


def moe_forward(h, gate_inp, get_expert, probs_b, cfg, shared=None, aq=None):
    """MoE block for tokens h (T, d). gate_inp (E, d); get_expert(e) -> (gate (F, d), up (F, d),
    down (d, F)); cfg keys: gating_func, n_group, n_group_used, n_expert_used, w_norm, w_scale.
    shared: optional (gate, up, down) of the merged shared-expert FFN (added ungated).
    aq: optional aq(x, which, rows) -> the activation that matmul sees, which in "gate_exps",
    "up_exps", "down_exps", "sh_gate", "sh_up", "sh_down" (the router always takes h); rows:
    the token index (into h) of each row of x.
    Returns (out (T, d), [(experts, weights)] per token)."""
    if aq is None:
        def aq(x, which, rows):
            return x
    T = h.shape[0]
    all_t = np.arange(T)
    logits = h @ gate_inp.T                                       # (T, E)
    sel = [route(logits[t], cfg["gating_func"], probs_b, cfg["n_group"], cfg["n_group_used"],
                 cfg["n_expert_used"], cfg["w_norm"], cfg["w_scale"])[:2] for t in range(T)]
    out = np.zeros_like(h)
    hg, hu = aq(h, "gate_exps", all_t), aq(h, "up_exps", all_t)
    by_e = {}                     # group tokens by expert: one weight fetch per expert used
    for t, (e, w) in enumerate(sel):
        for j in range(len(e)):
            by_e.setdefault(int(e[j]), []).append((t, w[j]))
    for e in sorted(by_e):
        gate, up, down = get_expert(e)
        ts = np.array([t for t, _ in by_e[e]])
        ws = np.array([w for _, w in by_e[e]])
        y = aq(silu(hg[ts] @ gate.T) * (hu[ts] @ up.T), "down_exps", ts) @ down.T
        np.add.at(out, ts, y * ws[:, None])
    if shared is not None:
        sg, su, sd = shared
        hid = silu(aq(h, "sh_gate", all_t) @ sg.T) * (aq(h, "sh_up", all_t) @ su.T)
        out = out + aq(hid, "sh_down", all_t) @ sd.T
    return out, sel


# --------------------------------------------------------------------------------------------
# model

class Model:
    cells = "f32"   # the KV cache's cells (_cell): set "f16" or "q8_0" on an instance
    QTIE_RECORD = 1e-6

    def __init__(self, path, dtype=np.float64, expert_cache_mb=1024, act_quant=False, decompressed=0):
        self.path = path
        self.act_quant = bool(act_quant)
        self.decompressed = int(decompressed)
        self.qflip = set()
        self.r = GGUFReader(path)
        self.dtype = dtype
        r = self.r
        arch = r.arch
        if arch != "deepseek2":
            raise ValueError("%s: architecture %r is not deepseek2" % (path, arch))

        def k(s, d=None):
            return r.get("deepseek2." + s, d)
        c = {}
        c["n_embd"] = int(k("embedding_length"))
        c["n_layer"] = int(k("block_count"))
        c["n_head"] = int(k("attention.head_count"))
        c["eps"] = float(k("attention.layer_norm_rms_epsilon"))
        c["n_rot"] = int(k("rope.dimension_count"))
        c["kv_lora"] = int(k("attention.kv_lora_rank"))
        c["q_lora"] = int(k("attention.q_lora_rank", 0) or 0)
        c["n_dense"] = int(k("leading_dense_block_count", 0) or 0)
        c["n_expert"] = int(k("expert_count", 0) or 0)
        c["n_expert_used"] = int(k("expert_used_count", 0) or 0)
        c["n_group"] = int(k("expert_group_count", 0) or 0)
        c["n_group_used"] = int(k("expert_group_used_count", 0) or 0)
        c["n_shared"] = int(k("expert_shared_count", 0) or 0)
        c["w_scale"] = float(k("expert_weights_scale", 0.0) or 0.0)
        c["w_norm"] = bool(k("expert_weights_norm", False))
        gf = int(k("expert_gating_func", 0) or 0)
        c["gating_func"] = 1 if gf == 0 else gf
        H = c["n_head"]
        if k("attention.key_length_mla") is not None:
            c["head_k"] = int(k("attention.key_length_mla"))
            c["v_head"] = int(k("attention.value_length_mla"))
        else:
            c["head_k"] = int(k("attention.key_length"))
            c["v_head"] = int(k("attention.value_length"))
        c["nope"] = c["head_k"] - c["n_rot"]
        rp = rope_params(r.get)
        c.update(rope=rp)
        c["kq_scale"] = rp["mscale"] ** 2 / math.sqrt(c["head_k"])
        if rp["ext_factor"] != 0.0:
            c["corr_dims"] = yarn_corr_dims(c["n_rot"], rp["n_ctx_orig"], rp["freq_base"],
                                            rp["beta_fast"], rp["beta_slow"])
        else:
            c["corr_dims"] = (0.0, 0.0)
        self.cfg = c
        ti = r.info("token_embd.weight")
        c["n_vocab"] = ti.ne[1]

        # ---- weights (dense ones cached as float64) ----
        self._dense = {}
        L = []
        self.wtype = {}
        for il in range(c["n_layer"]):
            p = "blk.%d." % il
            lw = {}
            wt = self.wtype[il] = {}

            def ty(key, name):
                wt[key] = r.info(name).type
            lw["attn_norm"] = self._w(p + "attn_norm.weight")
            if p + "attn_q_a.weight" in r:
                lw["q_a"] = self._w(p + "attn_q_a.weight")
                lw["q_a_norm"] = self._w(p + "attn_q_a_norm.weight")
                lw["q_b"] = self._w(p + "attn_q_b.weight")
                ty("q_a", p + "attn_q_a.weight")
                ty("q_b", p + "attn_q_b.weight")
            else:
                lw["q"] = self._w(p + "attn_q.weight")
                ty("q", p + "attn_q.weight")
            lw["kv_a"] = self._w(p + "attn_kv_a_mqa.weight")
            ty("kv_a", p + "attn_kv_a_mqa.weight")
            lw["kv_a_norm"] = self._w(p + "attn_kv_a_norm.weight")
            nope, vh, kvl = c["nope"], c["v_head"], c["kv_lora"]
            if p + "attn_k_b.weight" in r:
                lw["k_b"] = self._w(p + "attn_k_b.weight")          # (H, kvl, nope)
                lw["v_b"] = self._w(p + "attn_v_b.weight")          # (H, vh, kvl)
                ty("k_b", p + "attn_k_b.weight")
                ty("v_b", p + "attn_v_b.weight")
            else:
                wt["k_b"] = wt["v_b"] = 0    # moetax splits attn_kv_b into F32 k_b / v_b
                kvb = self._w(p + "attn_kv_b.weight").reshape(H, nope + vh, kvl)
                lw["k_b"] = np.ascontiguousarray(kvb[:, :nope, :].transpose(0, 2, 1))
                lw["v_b"] = np.ascontiguousarray(kvb[:, nope:, :])
            assert lw["k_b"].shape == (H, kvl, nope), lw["k_b"].shape
            assert lw["v_b"].shape == (H, vh, kvl), lw["v_b"].shape
            lw["o"] = self._w(p + "attn_output.weight")
            ty("o", p + "attn_output.weight")
            lw["ffn_norm"] = self._w(p + "ffn_norm.weight")
            if il < c["n_dense"]:
                lw["gate"] = self._w(p + "ffn_gate.weight")
                lw["up"] = self._w(p + "ffn_up.weight")
                lw["down"] = self._w(p + "ffn_down.weight")
                for key in ("gate", "up", "down"):
                    ty(key, p + "ffn_%s.weight" % key)
            else:
                lw["gate_inp"] = self._w(p + "ffn_gate_inp.weight")
                lw["probs_b"] = self._w(p + "exp_probs_b.bias") if p + "exp_probs_b.bias" in r else None
                lw["fused"] = p + "ffn_gate_up_exps.weight" in r
                lw["exps"] = p
                if lw["fused"]:
                    ty("gate_exps", p + "ffn_gate_up_exps.weight")
                    wt["up_exps"] = wt["gate_exps"]
                else:
                    ty("gate_exps", p + "ffn_gate_exps.weight")
                    ty("up_exps", p + "ffn_up_exps.weight")
                ty("down_exps", p + "ffn_down_exps.weight")
                if p + "ffn_gate_shexp.weight" in r:
                    lw["sh_gate"] = self._w(p + "ffn_gate_shexp.weight")
                    lw["sh_up"] = self._w(p + "ffn_up_shexp.weight")
                    lw["sh_down"] = self._w(p + "ffn_down_shexp.weight")
                    for key in ("gate", "up", "down"):
                        ty("sh_" + key, p + "ffn_%s_shexp.weight" % key)
            L.append(lw)
        self.layers = L
        self.output_norm = self._w("output_norm.weight")
        out_name = "output.weight" if "output.weight" in r else "token_embd.weight"
        self.output = self._w(out_name)
        self.output_type = r.info(out_name).type
        self._ecache = {}
        self._ecache_bytes = 0
        self._ecache_max = int(expert_cache_mb) << 20
        self.routing = []
        self.reset()

    # ---- activation quantization ----
    def _aq(self, x, wtype, rows=None):
        """The activation a matmul with a weight of ggml type wtype sees. x: (T, ...) rows of
        the tokens being run (rows: their indices among them, default all); folds the rounding
        margins into self.qmargin."""
        if self.act_quant and wtype in Q_TYPES:
            hit = self._qmemo.get(id(x))          # one input, several matmuls: quantized once,
            if hit is not None and hit[0] is x:   # as moetax does (and one key for a flip)
                return hit[1]
            call = self._qcall
            self._qcall += 1
            flip = [i for c, i in self.qflip if c == call]
            deq, mg, sm = quantize_q8_0(x, margin=True, flip=flip, scale_margin=True)
            pos = self._positions if rows is None else self._positions[rows]
            mg = mg.reshape(mg.shape[0], -1)
            for i in np.flatnonzero(mg < self.QTIE_RECORD):
                self.qties.append((float(mg.flat[i]), int(pos[i // mg.shape[1]]), (call, int(i))))
            # a block's fp16 scale near its rounding midpoint: the key mg.size + block (see quantize_q8_0)
            nbr = mg.shape[1] // 32
            for b in np.flatnonzero(sm < self.QTIE_RECORD):
                self.qties.append((float(sm[b]), int(pos[b // nbr]), (call, int(mg.size + b))))
            np.minimum.at(self.qmargin, pos, np.minimum(mg.min(axis=1), sm.reshape(mg.shape[0], -1).min(axis=1)))
            deq = deq.astype(self.dtype)
            self._qmemo[id(x)] = (x, deq)
            return deq
        return x

    def _cell(self, x):
        """Rows x (T, ...) of the tokens being run (a token's cache row, flattened) as the KV cache's
        cells (self.cells) store them and read them back: f32 as they are, f16 each value rounded to
        float16, q8_0 the row padded with zeros to whole blocks of 32 and quantized as quantize_row_q8_0
        (include/moetax/kvcache.h). q8_0 cells fold their rounding near ties into self.qties, as _aq
        does, so a flip can round one the other way (moetax's float32 row and this float64 one may part
        at a tie)."""
        if self.cells == "f32":
            return x
        if self.cells == "f16":
            return np.asarray(x, dtype=np.float32).astype(np.float16).astype(self.dtype)
        if self.cells != "q8_0":
            raise ValueError("cells: %r" % self.cells)
        return self._q8_rows(x, 1)

    def _q8_rows(self, x, per_token):
        """Rows x (T * per_token rows of the tokens being run, in token order, each flattened) padded
        with zeros to whole blocks of 32 and quantized as quantize_row_q8_0, back in float at their
        width; rounding near ties folded into self.qties as _aq does."""
        xr = np.asarray(x).reshape(-1, x.shape[-1]) if per_token > 1 else np.asarray(x).reshape(x.shape[0], -1)
        R, n = xr.shape
        pad = (-n) % 32
        xp = np.concatenate([xr, np.zeros((R, pad))], axis=1) if pad else xr
        call = self._qcall
        self._qcall += 1
        flip = [i for c, i in self.qflip if c == call]
        deq, mg, sm = quantize_q8_0(xp, margin=True, flip=flip, scale_margin=True)
        pos = self._positions
        for i in np.flatnonzero(mg < self.QTIE_RECORD):
            self.qties.append((float(mg.flat[i]), int(pos[i // mg.shape[1] // per_token]), (call, int(i))))
        nbr = mg.shape[1] // 32
        for b in np.flatnonzero(sm < self.QTIE_RECORD):
            self.qties.append((float(sm[b]), int(pos[b // nbr // per_token]), (call, int(mg.size + b))))
        return deq[:, :n].reshape(x.shape).astype(self.dtype)

    def _cell_queries(self, q, fl=None):
        """Query rows q (T, H, k) as the scores over the cells see them: q8_0 cells take them quantized to
        Q8_0 blocks per head row (padded to whole blocks), as llama.cpp's q8_0 K cache does (and moetax's
        attention on the integer kernels); rows of tokens in the mask fl (moetax's decompressed prefill,
        whose scores are float) and other cells as they are."""
        if self.cells != "q8_0":
            return q
        if fl is None or not fl.any():
            return self._q8_rows(q, q.shape[1])
        out = np.array(q, copy=True)
        idx = np.flatnonzero(~fl)
        if idx.size:
            pos, self._positions = self._positions, self._positions[idx]
            out[idx] = self._q8_rows(q[idx], q.shape[1])
            self._positions = pos
        return out

    def _aq_part(self, x, wtype, fl):
        """_aq of the rows not in the mask fl (T,); those in it stay as they are."""
        if not fl.any():
            return self._aq(x, wtype)
        out = np.array(x, copy=True)
        idx = np.flatnonzero(~fl)
        if idx.size:
            out[idx] = self._aq(x[idx], wtype, rows=idx)
        return out

    # ---- weight access ----
    def _w(self, name):
        return self.r.tensor(name).astype(self.dtype)

    def expert(self, il, e):
        """(gate (F, d), up (F, d), down (d, F)) of routed expert e in layer il."""
        key = (il, e)
        hit = self._ecache.get(key)
        if hit is not None:
            return hit
        p = self.layers[il]["exps"]
        if self.layers[il]["fused"]:
            gu = self.r.slice3(p + "ffn_gate_up_exps.weight", e).astype(self.dtype)
            F = gu.shape[0] // 2
            gate, up = gu[:F], gu[F:]
        else:
            gate = self.r.slice3(p + "ffn_gate_exps.weight", e).astype(self.dtype)
            up = self.r.slice3(p + "ffn_up_exps.weight", e).astype(self.dtype)
        down = self.r.slice3(p + "ffn_down_exps.weight", e).astype(self.dtype)
        val = (gate, up, down)
        nb = gate.nbytes + up.nbytes + down.nbytes
        if self._ecache_bytes + nb <= self._ecache_max:
            self._ecache[key] = val
            self._ecache_bytes += nb
        return val

    def embed(self, tokens):
        tokens = np.asarray(tokens, dtype=np.int64)
        if tokens.size and (tokens.min() < 0 or tokens.max() >= self.cfg["n_vocab"]):
            raise ValueError("token id out of range [0, %d)" % self.cfg["n_vocab"])
        return self.r.rows("token_embd.weight", tokens).astype(self.dtype)

    # ---- state ----
    def reset(self):
        c = self.cfg
        self.pos = 0
        self.cache = [np.zeros((0, c["kv_lora"] + c["n_rot"]), dtype=self.dtype)
                      for _ in range(c["n_layer"])]
        self.routing = []
        self.qmargin = np.zeros(0)
        self.qties = []
        self._qcall = 0

    # ---- layers ----
    def _attention(self, il, h, positions):
        """h (T, d) for consecutive positions; appends to the layer cache; returns (T, d)."""
        c = self.cfg
        lw = self.layers[il]
        H, nope, rot, kvl, vh = c["n_head"], c["nope"], c["n_rot"], c["kv_lora"], c["v_head"]
        eps = c["eps"]
        T = h.shape[0]
        wt = self.wtype[il]
        aq = self._aq
        if "q" in lw:
            q = aq(h, wt["q"]) @ lw["q"].T
        else:
            qa = rmsnorm(aq(h, wt["q_a"]) @ lw["q_a"].T, lw["q_a_norm"], eps)
            q = aq(qa, wt["q_b"]) @ lw["q_b"].T
        q = q.reshape(T, H, nope + rot)
        q_nope, q_pe = q[:, :, :nope], q[:, :, nope:]
        ckv = aq(h, wt["kv_a"]) @ lw["kv_a"].T                                   # (T, kvl + rot)
        kv, k_pe = ckv[:, :kvl], ckv[:, kvl:]
        rp = c["rope"]
        rargs = dict(n_dims=rot, freq_base=rp["freq_base"], freq_scale=rp["freq_scale"],
                     ext_factor=rp["ext_factor"], attn_factor=rp["attn_factor"],
                     corr_dims=c["corr_dims"])
        q_pe = rope_norm(q_pe, positions, **rargs)                # (T, H, rot)
        k_pe = rope_norm(k_pe, positions, **rargs)                # (T, rot)
        kv = rmsnorm(kv, lw["kv_a_norm"], eps)
        row = self._cell(np.concatenate([kv, k_pe], axis=1))
        self.cache[il] = np.concatenate([self.cache[il], row], axis=0)
        K = self.cache[il]                                        # (P, kvl + rot)
        P = K.shape[0]
        # positions < self.decompressed: moetax's decompressed prefill, whose k_b / v_b inputs stay float
        fl = np.asarray(positions) < self.decompressed
        q_abs = np.einsum("hcn,thn->thc", lw["k_b"], self._aq_part(q_nope, wt["k_b"], fl))  # (T, H, kvl)
        Q = self._cell_queries(np.concatenate([q_abs, q_pe], axis=2), fl)   # (T, H, kvl + rot)
        scores = np.einsum("thc,pc->thp", Q, K) * c["kq_scale"]   # (T, H, P)
        pos_k = np.arange(P)
        mask = pos_k[None, :] > np.asarray(positions)[:, None]    # (T, P)
        scores = np.where(mask[:, None, :], -np.inf, scores)
        pr = softmax(scores, axis=-1)
        o = np.einsum("thp,pc->thc", pr, K[:, :kvl])              # (T, H, kvl)
        out = np.einsum("hvc,thc->thv", lw["v_b"], self._aq_part(o, wt["v_b"], fl)).reshape(T, H * vh)
        return aq(out, wt["o"]) @ lw["o"].T

    def _dense_ffn(self, il, h):
        lw, wt, aq = self.layers[il], self.wtype[il], self._aq
        hid = silu(aq(h, wt["gate"]) @ lw["gate"].T) * (aq(h, wt["up"]) @ lw["up"].T)
        return aq(hid, wt["down"]) @ lw["down"].T

    def _moe(self, il, h, positions, tokens):
        c = self.cfg
        lw = self.layers[il]
        shared = (lw["sh_gate"], lw["sh_up"], lw["sh_down"]) if "sh_gate" in lw else None
        wt = self.wtype[il]
        out, sel = moe_forward(h, lw["gate_inp"], lambda e: self.expert(il, e), lw["probs_b"], c,
                               shared, aq=lambda x, which, rows: self._aq(x, wt[which], rows))
        for t, (e, w) in enumerate(sel):
            self.routing.append({"layer": il, "pos": int(positions[t]),
                                 "token": None if tokens is None else int(tokens[t]),
                                 "experts": [int(x) for x in e], "weights": [float(x) for x in w]})
        return out

    def _run(self, tokens):
        c = self.cfg
        T = len(tokens)
        positions = np.arange(self.pos, self.pos + T)
        self._positions = positions
        self._qmemo = {}
        if self.qmargin.shape[0] < self.pos + T:
            self.qmargin = np.concatenate([self.qmargin, np.full(self.pos + T - self.qmargin.shape[0], np.inf)])
        x = self.embed(tokens)
        for il in range(c["n_layer"]):
            lw = self.layers[il]
            h = rmsnorm(x, lw["attn_norm"], c["eps"])
            x = x + self._attention(il, h, positions)
            h2 = rmsnorm(x, lw["ffn_norm"], c["eps"])
            if il < c["n_dense"]:
                x = x + self._dense_ffn(il, h2)
            else:
                x = x + self._moe(il, h2, positions, tokens)
        self.pos += T
        self._qmemo = {}
        xn = rmsnorm(x, self.output_norm, c["eps"])
        return self._aq(xn, self.output_type) @ self.output.T

    # ---- public API ----
    def forward(self, tokens):
        """Logits [len(tokens), n_vocab] for a sequence processed from position 0."""
        self.reset()
        return self._run(list(tokens))

    def step(self, token):
        """Feed one token at the current position; returns its logits [n_vocab]."""
        return self._run([int(token)])[0]

    def prefill(self, tokens):
        """Feed tokens (batched) continuing at the current position; returns their logits."""
        return self._run(list(tokens))

    def generate(self, prompt, n, incremental=False):
        """Greedy decode. Returns (generated tokens, logits [len(prompt)+n, n_vocab])."""
        self.reset()
        if incremental:
            rows = [self.step(t) for t in prompt]
        else:
            rows = list(self._run(list(prompt)))
        out = []
        for _ in range(n):
            nxt = int(np.argmax(rows[-1]))
            out.append(nxt)
            rows.append(self.step(nxt))
        return out, np.array(rows)


def main(argv=None):
    import argparse
    import time
    ap = argparse.ArgumentParser(description="NumPy float64 reference forward pass for deepseek2 GGUF")
    ap.add_argument("model")
    ap.add_argument("--tokens", required=True, help="comma-separated token ids")
    ap.add_argument("--decode", type=int, default=0, help="greedy decode steps after the prompt")
    ap.add_argument("--out", help="write float32 logits [len+decode, n_vocab] (.npy)")
    ap.add_argument("--routing", help="write chosen experts per layer per position (JSON)")
    ap.add_argument("--incremental", action="store_true", help="feed the prompt one token at a time")
    ap.add_argument("--act-quant", action="store_true",
                    help="quantize matmul inputs to Q8_0 blocks for Q8_0/Q4_0 weights, as moetax/ggml do")
    ap.add_argument("--print-config", action="store_true")
    a = ap.parse_args(argv)
    toks = [int(t) for t in a.tokens.replace(" ", "").split(",") if t != ""]
    if not toks:
        ap.error("--tokens is empty")
    t0 = time.time()
    m = Model(a.model, act_quant=a.act_quant)
    if a.print_config:
        print(json.dumps(m.cfg, indent=1, default=str))
    gen, logits = m.generate(toks, a.decode, incremental=a.incremental)
    dt = time.time() - t0
    if a.out:
        np.save(a.out, logits.astype(np.float32))
    if a.routing:
        with open(a.routing, "w") as f:
            json.dump({"model": a.model, "prompt": toks, "generated": gen,
                       "n_layer": m.cfg["n_layer"], "n_dense": m.cfg["n_dense"],
                       "routing": m.routing}, f)
    print("prompt argmax: %s" % ",".join(str(int(np.argmax(r))) for r in logits[:len(toks)]))
    print("greedy: %s" % ",".join(str(t) for t in gen))
    print("logits shape %s, %.2f s" % (list(logits.shape), dt), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
