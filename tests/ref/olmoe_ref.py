#!/usr/bin/python3
"""olmoe_ref.py - independent NumPy reference forward pass for GGUF `olmoe` models (OLMoE).

Derived from qwen3moe_ref.Model (float64, its own GGUF reader, deepseek2_ref's MoE block and
act-quant emulation). llama.cpp's olmoe graph (src/models/olmoe.cpp) differs from qwen3moe's
in two places only:

  q = rmsnorm(W_q h over its whole row of H*hd values) * attn_q_norm   {H*hd}
  k = rmsnorm(W_k h over its whole row of Hkv*hd values) * attn_k_norm {Hkv*hd}
    (the norm comes before the heads are split, so one mean square per token, not per head),
    then rope NEOX per head as qwen3moe;
  the MoE block: softmax router, top-k, the k probabilities NOT renormalised (norm_w false),
    no scale, no shared expert.

Keys: olmoe.* as qwen3moe_ref reads them (the experts' width comes from the tensors).
CLI: /usr/bin/python3 tests/ref/olmoe_ref.py MODEL --tokens 1,2,3 [--decode N] [--act-quant]
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import deepseek2_ref as ds  # noqa: E402
import qwen3moe_ref as q3  # noqa: E402


class Model(q3.Model):
    ARCH = "olmoe"
    W_NORM = False

    def _qk(self, lw, q, k, positions):
        c = self.cfg
        T, H, hd = q.shape
        Hkv = k.shape[1]
        q = ds.rmsnorm(q.reshape(T, H * hd), lw["attn_q_norm"], c["eps"]).reshape(T, H, hd)
        k = ds.rmsnorm(k.reshape(T, Hkv * hd), lw["attn_k_norm"], c["eps"]).reshape(T, Hkv, hd)
        return (q3.rope_neox(q, positions, c["n_rot"], c["freq_base"]),
                q3.rope_neox(k, positions, c["n_rot"], c["freq_base"]))


if __name__ == "__main__":
    sys.exit(q3.main(model_cls=Model))
