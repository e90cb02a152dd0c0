#!/usr/bin/python3
"""qwen3moe_ref.py - independent NumPy reference forward pass for GGUF `qwen3moe` models.

float64 arithmetic on the dequantised weights, its own GGUF reader (gguf_np.py); the MoE block,
RMSNorm, activation quantization (act_quant) and the Model API are deepseek2_ref's (this class
derives from deepseek2_ref.Model and replaces the hyper-parameters, weights and attention).
llama.cpp's qwen3moe graph (src/models/qwen3moe.cpp):

  x = token_embd[tok]
  per layer:
    h = rmsnorm(x) * attn_norm
    q = W_q h -> (H, hd); k = W_k h -> (Hkv, hd); v = W_v h -> (Hkv, hd)
    q = rmsnorm(q per head) * attn_q_norm;  k = rmsnorm(k per head) * attn_k_norm   (over hd)
    rope NEOX (pairs (i, i + n_rot/2)) on q and k, n_rot = rope.dimension_count (default hd),
      theta_i = pos * freq_base^(-2i/n_rot)
    query head h reads KV head g = h // (H / Hkv) (ggml's broadcast);
    s = q_h . k_g(j) / sqrt(hd), j <= pos;  o_h = sum_j softmax(s)_j v_g(j)
    x += W_o concat(o)
    h2 = rmsnorm(x) * ffn_norm;  x += MoE(h2): softmax router, top-k, weights renormalised
      (w / max(sum w, 6.103515625e-5)), no scale, no shared expert, every layer
  logits = W_out (rmsnorm(x) * output_norm)

Keys: qwen3moe.{embedding_length, block_count, attention.head_count, attention.head_count_kv
(default head_count), attention.key_length / value_length (default n_embd / n_head),
rope.dimension_count, rope.freq_base (default 10000), attention.layer_norm_rms_epsilon,
expert_count, expert_used_count, expert_feed_forward_length}. No rope scaling (a file with
rope.scaling.* is refused here).

Python API: as deepseek2_ref.Model (forward, step, prefill, generate, routing, act_quant).
olmoe_ref.py and mixtral_ref.py derive from this Model: the class attributes ARCH (the key
prefix), QK_NORMS (the q/k norm tensors read), W_NORM (renormalise the top-k) and the hook
_qk (q/k norm and rope) are what they replace.
CLI: /usr/bin/python3 tests/ref/qwen3moe_ref.py MODEL --tokens 1,2,3 [--decode N] [--act-quant]
"""

import math
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import deepseek2_ref as ds  # noqa: E402
from gguf_np import GGUFReader  # noqa: E402


def rope_neox(x, pos, n_dims, freq_base):
    """ggml RoPE, NEOX mode: rotates the pairs (x[i], x[i + n_dims/2]) of the first n_dims values
    of the last axis; x (T, heads, hd), pos (T,)."""
    x = np.asarray(x, dtype=np.float64)
    half = n_dims // 2
    i = np.arange(half, dtype=np.float64)
    theta = np.asarray(pos, dtype=np.float64)[:, None] * freq_base ** (-2.0 * i / n_dims)   # (T, half)
    c = np.cos(theta)[:, None, :]
    s = np.sin(theta)[:, None, :]
    out = x.copy()
    x0, x1 = x[..., :half], x[..., half:n_dims]
    out[..., :half] = x0 * c - x1 * s
    out[..., half:n_dims] = x0 * s + x1 * c
    return out


class Model(ds.Model):
    ARCH = "qwen3moe"
    QK_NORMS = ("attn_q_norm", "attn_k_norm")
    W_NORM = True

    def __init__(self, path, dtype=np.float64, expert_cache_mb=1024, act_quant=False):
        self.path = path
        self.act_quant = bool(act_quant)
        self.qflip = set()
        self.r = r = GGUFReader(path)
        self.dtype = dtype
        A = self.ARCH
        if r.arch != A:
            raise ValueError("%s: architecture %r is not %s" % (path, r.arch, A))

        def k(s, d=None):
            return r.get(A + "." + s, d)
        if any(key.startswith(A + ".rope.scaling.") for key in r.metadata):
            raise NotImplementedError("rope scaling")
        c = {}
        c["n_embd"] = int(k("embedding_length"))
        c["n_layer"] = int(k("block_count"))
        c["n_head"] = int(k("attention.head_count"))
        c["n_head_kv"] = int(k("attention.head_count_kv", c["n_head"]))
        c["head_k"] = int(k("attention.key_length", c["n_embd"] // c["n_head"]))
        c["v_head"] = int(k("attention.value_length", c["n_embd"] // c["n_head"]))
        c["n_rot"] = int(k("rope.dimension_count", c["head_k"]))
        c["freq_base"] = float(k("rope.freq_base", 10000.0))
        c["eps"] = float(k("attention.layer_norm_rms_epsilon"))
        c["n_expert"] = int(k("expert_count"))
        c["n_expert_used"] = int(k("expert_used_count"))
        c.update(n_dense=0, n_group=0, n_group_used=0, n_shared=0, w_scale=0.0, w_norm=self.W_NORM, gating_func=1)
        c["kq_scale"] = 1.0 / math.sqrt(c["head_k"])
        c["n_vocab"] = r.info("token_embd.weight").ne[1]
        self.cfg = c
        self._dense = {}
        self.layers, self.wtype = [], {}
        for il in range(c["n_layer"]):
            p = "blk.%d." % il
            lw, wt = {}, {}
            self.wtype[il] = wt
            for key, name in (("q", "attn_q"), ("k", "attn_k"), ("v", "attn_v"), ("o", "attn_output")):
                lw[key] = self._w(p + name + ".weight")
                wt[key] = r.info(p + name + ".weight").type
            for key in ("attn_norm",) + tuple(self.QK_NORMS) + ("ffn_norm",):
                lw[key] = self._w(p + key + ".weight")
            lw["gate_inp"] = self._w(p + "ffn_gate_inp.weight")
            lw["probs_b"] = None
            lw["fused"] = False
            lw["exps"] = p
            for key in ("gate", "up", "down"):
                wt[key + "_exps"] = r.info(p + "ffn_%s_exps.weight" % key).type
            self.layers.append(lw)
        self.output_norm = self._w("output_norm.weight")
        out_name = "output.weight" if "output.weight" in r else "token_embd.weight"
        self.output = self._w(out_name)
        self.output_type = r.info(out_name).type
        self._ecache, self._ecache_bytes, self._ecache_max = {}, 0, int(expert_cache_mb) << 20
        self.routing = []
        self.reset()

    def reset(self):
        c = self.cfg
        self.pos = 0
        self.kcache = [np.zeros((0, c["n_head_kv"], c["head_k"]), dtype=self.dtype) for _ in range(c["n_layer"])]
        self.vcache = [np.zeros((0, c["n_head_kv"], c["v_head"]), dtype=self.dtype) for _ in range(c["n_layer"])]
        self.routing = []
        self.qmargin = np.zeros(0)
        self.qties = []
        self._qcall = 0

    def _qk(self, lw, q, k, positions):
        """q (T, H, hd), k (T, Hkv, hd) after the projections -> normed and roped: per-head
        RMSNorm over hd, NEOX rope."""
        c = self.cfg
        q = rope_neox(ds.rmsnorm(q, lw["attn_q_norm"], c["eps"]), positions, c["n_rot"], c["freq_base"])
        k = rope_neox(ds.rmsnorm(k, lw["attn_k_norm"], c["eps"]), positions, c["n_rot"], c["freq_base"])
        return q, k

    def _attention(self, il, h, positions):
        c = self.cfg
        lw, wt, aq = self.layers[il], self.wtype[il], self._aq
        H, Hkv, hk, hv = c["n_head"], c["n_head_kv"], c["head_k"], c["v_head"]
        T = h.shape[0]
        q = (aq(h, wt["q"]) @ lw["q"].T).reshape(T, H, hk)
        k = (aq(h, wt["k"]) @ lw["k"].T).reshape(T, Hkv, hk)
        v = (aq(h, wt["v"]) @ lw["v"].T).reshape(T, Hkv, hv)
        q, k = self._qk(lw, q, k, positions)
        kv = self._cell(np.concatenate([k.reshape(T, -1), v.reshape(T, -1)], axis=1))   # one cell row each
        k, v = kv[:, :Hkv * hk].reshape(T, Hkv, hk), kv[:, Hkv * hk:].reshape(T, Hkv, hv)
        self.kcache[il] = np.concatenate([self.kcache[il], k], axis=0)
        self.vcache[il] = np.concatenate([self.vcache[il], v], axis=0)
        K, V = self.kcache[il], self.vcache[il]                     # (P, Hkv, hd)
        g = np.arange(H) // (H // Hkv)                              # KV head of each query head
        scores = np.einsum("thd,phd->thp", self._cell_queries(q), K[:, g, :]) * c["kq_scale"]
        mask = np.arange(K.shape[0])[None, :] > np.asarray(positions)[:, None]
        scores = np.where(mask[:, None, :], -np.inf, scores)
        o = np.einsum("thp,phd->thd", ds.softmax(scores, axis=-1), V[:, g, :]).reshape(T, H * hv)
        return aq(o, wt["o"]) @ lw["o"].T


def main(argv=None, model_cls=Model):
    import argparse
    ap = argparse.ArgumentParser(description="NumPy float64 reference forward pass for %s GGUF" % model_cls.ARCH)
    ap.add_argument("model")
    ap.add_argument("--tokens", required=True)
    ap.add_argument("--decode", type=int, default=0)
    ap.add_argument("--out")
    ap.add_argument("--act-quant", action="store_true")
    a = ap.parse_args(argv)
    toks = [int(t) for t in a.tokens.split(",") if t]
    m = model_cls(a.model, act_quant=a.act_quant)
    gen, logits = m.generate(toks, a.decode)
    if a.out:
        np.save(a.out, logits.astype(np.float32))
    print("greedy: %s" % ",".join(str(t) for t in gen))
    return 0


if __name__ == "__main__":
    sys.exit(main())
