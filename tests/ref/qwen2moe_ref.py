#!/usr/bin/python3
"""qwen2moe_ref.py - independent NumPy reference forward pass for GGUF `qwen2moe` models
(Qwen1.5-MoE, Qwen2-57B-A14B).

Derived from qwen3moe_ref.Model (float64, its own GGUF reader, deepseek2_ref's MoE block and
act-quant emulation). llama.cpp's qwen2moe graph (src/models/qwen2moe.cpp) differs from
qwen3moe's in these places:

  q = W_q h + b_q, k = W_k h + b_k, v = W_v h + b_v   (attn_{q,k,v}.bias, optional)
  no q/k norm; rope NEOX per head as qwen3moe;
  the MoE block: softmax router, top-k, the k probabilities NOT renormalised (norm_w false; a file
    with qwen2moe.expert_weights_norm = true, HF's norm_topk_prob, is renormalised as the HF model
    does, which llama.cpp does not), no scale; plus a shared expert (ffn_{gate,up,down}_shexp, width
    expert_shared_feed_forward_length) whose output is multiplied per token by
    sigmoid(ffn_gate_inp_shexp . h2), h2 the ffn-normed input:
      x += sum_i w_i expert_i(h2) + sigmoid(w_sg . h2) * shexp(h2)

Keys: qwen2moe.* as qwen3moe_ref reads them (the widths come from the tensors).
CLI: /usr/bin/python3 tests/ref/qwen2moe_ref.py MODEL --tokens 1,2,3 [--decode N] [--act-quant]
"""

import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import deepseek2_ref as ds  # noqa: E402
import qwen3moe_ref as q3  # noqa: E402


class Model(q3.Model):
    ARCH = "qwen2moe"
    QK_NORMS = ()
    W_NORM = False

    def __init__(self, path, dtype=np.float64, expert_cache_mb=1024, act_quant=False):
        super().__init__(path, dtype=dtype, expert_cache_mb=expert_cache_mb, act_quant=act_quant)
        r = self.r
        self.cfg["w_norm"] = bool(r.get("qwen2moe.expert_weights_norm", False))
        for il, lw in enumerate(self.layers):
            p = "blk.%d." % il
            wt = self.wtype[il]
            for key in ("q", "k", "v"):
                name = p + "attn_%s.bias" % key
                lw["b" + key] = self._w(name).reshape(-1) if name in r else None
            lw["sh_gate_inp"] = self._w(p + "ffn_gate_inp_shexp.weight").reshape(-1)
            wt["sh_gate_inp"] = r.info(p + "ffn_gate_inp_shexp.weight").type
            for key in ("gate", "up", "down"):
                lw["qs_" + key] = self._w(p + "ffn_%s_shexp.weight" % key)
                wt["qs_" + key] = r.info(p + "ffn_%s_shexp.weight" % key).type

    def _qk(self, lw, q, k, positions):
        c = self.cfg
        return (q3.rope_neox(q, positions, c["n_rot"], c["freq_base"]),
                q3.rope_neox(k, positions, c["n_rot"], c["freq_base"]))

    def _attention(self, il, h, positions):
        c = self.cfg
        lw, wt, aq = self.layers[il], self.wtype[il], self._aq
        H, Hkv, hk, hv = c["n_head"], c["n_head_kv"], c["head_k"], c["v_head"]
        T = h.shape[0]
        q = aq(h, wt["q"]) @ lw["q"].T
        k = aq(h, wt["k"]) @ lw["k"].T
        v = aq(h, wt["v"]) @ lw["v"].T
        if lw["bq"] is not None:
            q = q + lw["bq"]
        if lw["bk"] is not None:
            k = k + lw["bk"]
        if lw["bv"] is not None:
            v = v + lw["bv"]
        q, k = self._qk(lw, q.reshape(T, H, hk), k.reshape(T, Hkv, hk), positions)
        v = v.reshape(T, Hkv, hv)
        kv = self._cell(np.concatenate([k.reshape(T, -1), v.reshape(T, -1)], axis=1))   # one cell row each
        k, v = kv[:, :Hkv * hk].reshape(T, Hkv, hk), kv[:, Hkv * hk:].reshape(T, Hkv, hv)
        self.kcache[il] = np.concatenate([self.kcache[il], k], axis=0)
        self.vcache[il] = np.concatenate([self.vcache[il], v], axis=0)
        K, V = self.kcache[il], self.vcache[il]
        g = np.arange(H) // (H // Hkv)
        scores = np.einsum("thd,phd->thp", self._cell_queries(q), K[:, g, :]) * c["kq_scale"]
        mask = np.arange(K.shape[0])[None, :] > np.asarray(positions)[:, None]
        scores = np.where(mask[:, None, :], -np.inf, scores)
        o = np.einsum("thp,phd->thd", ds.softmax(scores, axis=-1), V[:, g, :]).reshape(T, H * hv)
        return aq(o, wt["o"]) @ lw["o"].T

    def _moe(self, il, h, positions, tokens):
        out = super()._moe(il, h, positions, tokens)        # routed experts (the qs_* keys are not
        # deepseek2_ref's sh_*, which it would add ungated): the shared expert is added here, gated
        lw, wt, aq = self.layers[il], self.wtype[il], self._aq
        hid = ds.silu(aq(h, wt["qs_gate"]) @ lw["qs_gate"].T) * (aq(h, wt["qs_up"]) @ lw["qs_up"].T)
        y = aq(hid, wt["qs_down"]) @ lw["qs_down"].T
        gate = ds.sigmoid(aq(h, wt["sh_gate_inp"]) @ lw["sh_gate_inp"])  # (T,)
        return out + gate[:, None] * y


if __name__ == "__main__":
    sys.exit(q3.main(model_cls=Model))
