#!/usr/bin/python3
"""Export a trained checkpoint to GGUF (F32) in llama.cpp's deepseek2 layout.

    /usr/bin/python3 tools/train/export.py WORK/ckpt.pt WORK/tokenizer.json OUT-f32.gguf
    ./build/moetax quantize OUT-f32.gguf OUT-q8_0.gguf q8_0       # then Q8_0 / Q4_0 via moetax

Keys and tensor names follow shared/docs/GGUF-MOE.md (the same as `moetax gen` and llama.cpp's
converter): MLA with the split attn_k_b {nope, kv_lora, H} / attn_v_b {kv_lora, v_head, H},
V3 routing keys (expert_gating_func 2 = sigmoid, exp_probs_b.bias, expert_group_count /
expert_group_used_count, expert_weights_norm, expert_weights_scale), and the byte-level BPE
tokenizer (tokenizer.ggml.model "gpt2", pre "gpt2").

load_gguf_into(model, path) does the reverse (any weight type, dequantized with the
independent NumPy reader), so the PyTorch model can run exactly the weights moetax runs.
"""
import os
import sys

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "..", "tests", "ref"))
import bpe  # noqa: E402
import gguf_np as G  # noqa: E402
from make_tiny_gguf import write_gguf  # noqa: E402
from model import Model  # noqa: E402

A = "deepseek2."


def tensor_map(model):
    """[(gguf name, torch tensor in GGUF numpy shape)] for every weight."""
    c = model.c
    H, nope, vh, kvl = c["n_head"], c["nope"], c["v_head"], c["kv_lora"]
    out = [("token_embd.weight", model.embd)]
    for il, b in enumerate(model.blocks):
        p = "blk.%d." % il
        at = b.attn
        kv_b3 = at.wkv_b.view(H, nope + vh, kvl)
        out += [(p + "attn_norm.weight", b.attn_norm),
                (p + "attn_q.weight", at.wq),
                (p + "attn_kv_a_mqa.weight", at.wkv_a),
                (p + "attn_kv_a_norm.weight", at.kv_norm),
                (p + "attn_k_b.weight", kv_b3[:, :nope, :].transpose(1, 2)),    # (H, kvl, nope)
                (p + "attn_v_b.weight", kv_b3[:, nope:, :]),                     # (H, vh, kvl)
                (p + "attn_output.weight", at.wo),
                (p + "ffn_norm.weight", b.ffn_norm)]
        f = b.ffn
        if il < c["n_dense"]:
            out += [(p + "ffn_gate.weight", f.gate), (p + "ffn_up.weight", f.up), (p + "ffn_down.weight", f.down)]
        else:
            out += [(p + "ffn_gate_inp.weight", f.gate_inp),
                    (p + "exp_probs_b.bias", f.bias),
                    (p + "ffn_gate_exps.weight", f.gate),
                    (p + "ffn_up_exps.weight", f.up),
                    (p + "ffn_down_exps.weight", f.down),
                    (p + "ffn_gate_shexp.weight", f.shared.gate),
                    (p + "ffn_up_shexp.weight", f.shared.up),
                    (p + "ffn_down_shexp.weight", f.shared.down)]
    out += [("output_norm.weight", model.out_norm), ("output.weight", model.out)]
    return out


def metadata(c, tok, name, ctx):
    toks = tok.token_strings()
    ttype = [1] * (len(toks) - 1) + [3]
    return [("general.architecture", G.T_STRING, "deepseek2"),
            ("general.name", G.T_STRING, name),
            ("general.file_type", G.T_UINT32, 0),
            (A + "context_length", G.T_UINT32, ctx),
            (A + "embedding_length", G.T_UINT32, c["d"]),
            (A + "block_count", G.T_UINT32, c["n_layer"]),
            (A + "feed_forward_length", G.T_UINT32, c["n_ff"]),
            (A + "attention.head_count", G.T_UINT32, c["n_head"]),
            (A + "attention.head_count_kv", G.T_UINT32, 1),
            (A + "attention.key_length", G.T_UINT32, c["kv_lora"] + c["rope"]),
            (A + "attention.value_length", G.T_UINT32, c["kv_lora"]),
            (A + "attention.key_length_mla", G.T_UINT32, c["nope"] + c["rope"]),
            (A + "attention.value_length_mla", G.T_UINT32, c["v_head"]),
            (A + "rope.freq_base", G.T_FLOAT32, c["rope_base"]),
            (A + "rope.dimension_count", G.T_UINT32, c["rope"]),
            (A + "attention.layer_norm_rms_epsilon", G.T_FLOAT32, c["eps"]),
            (A + "attention.q_lora_rank", G.T_UINT32, 0),
            (A + "attention.kv_lora_rank", G.T_UINT32, c["kv_lora"]),
            (A + "expert_used_count", G.T_UINT32, c["k"]),
            (A + "expert_count", G.T_UINT32, c["n_expert"]),
            (A + "expert_shared_count", G.T_UINT32, c["n_shared"]),
            (A + "expert_feed_forward_length", G.T_UINT32, c["expert_ff"]),
            (A + "leading_dense_block_count", G.T_UINT32, c["n_dense"]),
            (A + "expert_gating_func", G.T_UINT32, 2),
            (A + "expert_weights_norm", G.T_BOOL, True),
            (A + "expert_weights_scale", G.T_FLOAT32, c["scale"]),
            (A + "expert_group_count", G.T_UINT32, c["n_group"]),
            (A + "expert_group_used_count", G.T_UINT32, c["n_group_used"]),
            (A + "vocab_size", G.T_UINT32, c["vocab"]),
            ("tokenizer.ggml.model", G.T_STRING, "gpt2"),
            ("tokenizer.ggml.pre", G.T_STRING, "gpt-2"),   # llama.cpp's name for GPT-2's rules
            ("tokenizer.ggml.tokens", ("array", G.T_STRING), toks),
            ("tokenizer.ggml.token_type", ("array", G.T_INT32), ttype),
            ("tokenizer.ggml.merges", ("array", G.T_STRING), tok.merge_strings()),
            ("tokenizer.ggml.bos_token_id", G.T_UINT32, tok.eot),
            ("tokenizer.ggml.eos_token_id", G.T_UINT32, tok.eot),
            ("tokenizer.ggml.add_bos_token", G.T_BOOL, True)]


def export(ckpt_path, tok_path, out_path, name="moetax-pycode-20m"):
    st = torch.load(ckpt_path)
    c = st["config"]
    model = Model(c)
    model.load_state_dict(st["model"])
    tok = bpe.Tokenizer.load(tok_path)
    if tok.n_vocab != c["vocab"]:
        raise SystemExit("export: tokenizer has %d tokens, the model %d" % (tok.n_vocab, c["vocab"]))
    write_f32(model, tok, out_path, name, int(st.get("seq", 256)))
    return model


def write_f32(model, tok, out_path, name, ctx):
    """Write model (any Model) and its tokenizer as an F32 GGUF file."""
    with torch.no_grad():
        tensors = [(n, G.TYPE_F32, t.detach().contiguous().numpy().astype(np.float32)) for n, t in tensor_map(model)]
    write_gguf(out_path, metadata(model.c, tok, name, ctx), tensors, alignment=32)


def load_gguf_into(path):
    """A Model built from a GGUF file's metadata, with its weights dequantized to float32."""
    r = G.GGUFReader(path)
    kv = r.metadata

    def k(s):
        return kv[A + s]
    c = dict(vocab=int(k("vocab_size")), d=int(k("embedding_length")), n_layer=int(k("block_count")),
             n_dense=int(k("leading_dense_block_count")), n_ff=int(k("feed_forward_length")),
             n_head=int(k("attention.head_count")), nope=int(k("attention.key_length_mla")) - int(k("rope.dimension_count")),
             rope=int(k("rope.dimension_count")), v_head=int(k("attention.value_length_mla")),
             kv_lora=int(k("attention.kv_lora_rank")), n_expert=int(k("expert_count")),
             expert_ff=int(k("expert_feed_forward_length")), k=int(k("expert_used_count")),
             n_shared=int(k("expert_shared_count")), n_group=int(k("expert_group_count")),
             n_group_used=int(k("expert_group_used_count")), scale=float(k("expert_weights_scale")),
             eps=float(k("attention.layer_norm_rms_epsilon")), rope_base=float(k("rope.freq_base")),
             ctx=int(k("context_length")))
    model = Model(c)
    with torch.no_grad():
        for name, t in tensor_map(model):
            arr = r.tensor(name)
            src = torch.from_numpy(np.ascontiguousarray(arr, dtype=np.float32)).reshape(t.shape)
            if name.startswith("blk.") and (name.endswith("attn_k_b.weight") or name.endswith("attn_v_b.weight")):
                il = int(name.split(".")[1])
                at = model.blocks[il].attn
                H, nope, vh, kvl = c["n_head"], c["nope"], c["v_head"], c["kv_lora"]
                kv_b3 = at.wkv_b.data.view(H, nope + vh, kvl)
                if name.endswith("attn_k_b.weight"):
                    kv_b3[:, :nope, :] = src.transpose(1, 2)
                else:
                    kv_b3[:, nope:, :] = src
            else:
                t.copy_(src)
    return model


if __name__ == "__main__":
    import argparse
    ap = argparse.ArgumentParser(description="export a checkpoint to an F32 GGUF file")
    ap.add_argument("ckpt")
    ap.add_argument("tokenizer")
    ap.add_argument("out")
    ap.add_argument("--name", default="moetax-pycode-20m")
    a = ap.parse_args()
    m = export(a.ckpt, a.tokenizer, a.out, a.name)
    tot, act = m.n_params()
    print("%s: %.2f M parameters (%.2f M active per token)" % (a.out, tot / 1e6, act / 1e6))
