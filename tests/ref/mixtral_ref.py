#!/usr/bin/python3
"""mixtral_ref.py - independent NumPy reference forward pass for GGUF `llama` files with
experts (Mixtral).

Derived from qwen3moe_ref.Model (float64, its own GGUF reader, deepseek2_ref's MoE block and
act-quant emulation). llama.cpp's llama graph (src/models/llama.cpp) with ffn_gate_inp differs
from qwen3moe's in:

  no q/k norm;
  rope NORM mode: adjacent pairs (x[2i], x[2i+1]) rotated by pos * freq_base^(-2i/n_rot)
    (deepseek2_ref.rope_norm), not NEOX's (x[i], x[i + n_rot/2]);
  the MoE block as qwen3moe's: softmax router, top-k, the k weights renormalised (norm_w
    true; this equals Mixtral's softmax over the k selected logits), no scale.

Keys: llama.* as qwen3moe_ref reads them. A dense llama file (no experts) is refused.
CLI: /usr/bin/python3 tests/ref/mixtral_ref.py MODEL --tokens 1,2,3 [--decode N] [--act-quant]
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import deepseek2_ref as ds  # noqa: E402
import qwen3moe_ref as q3  # noqa: E402


class Model(q3.Model):
    ARCH = "llama"
    QK_NORMS = ()
    W_NORM = True

    def _qk(self, lw, q, k, positions):
        c = self.cfg
        return (ds.rope_norm(q, positions, c["n_rot"], c["freq_base"]),
                ds.rope_norm(k, positions, c["n_rot"], c["freq_base"]))


if __name__ == "__main__":
    sys.exit(q3.main(model_cls=Model))
