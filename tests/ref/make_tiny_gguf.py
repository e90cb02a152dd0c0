#!/usr/bin/python3
"""make_tiny_gguf.py - writes tiny random deepseek2 GGUF files with a minimal, independent writer.

For self-testing the Python reference (gguf_np.py, deepseek2_ref.py) before/independently of
`moetax gen`. Tensor names and keys follow /work/shared/docs/GGUF-MOE.md (prefix `deepseek2.`).

Variants (--variant):
  v2       V2-Lite style: softmax (expert_gating_func absent -> softmax), no selection bias, no
           groups, q_lora 0 (plain attn_q), attn_k_b/attn_v_b, no rope scaling, all F32/F16.
  v2kvb    same weights as v2 but the older merged attn_kv_b (no *_mla keys, key_length =
           nope+rope, value_length = v_head, head_count_kv = H), like pre-MLA conversions.
  v2fused  same weights as v2 but fused ffn_gate_up_exps {d, 2F, E} (first F rows gate, next F up).
  v3       V3 style: sigmoid (func 2), exp_probs_b.bias, 4 groups / 2 used, q_lora > 0,
           expert_weights_norm true, expert_weights_scale 2.5, YaRN (factor 4, orig ctx 256,
           yarn_log_multiplier 0.1*0.707 as llama.cpp's converter writes it), Q8_0 experts,
           Q4_0 attn_output / dense FFN, F16 embeddings, BF16 output head, alignment 64.

Dims: d 64, H 4, nope 16, rope 8, kv_lora 32, v_head 16, E 8, k 2, expert width 32,
1 shared expert, 1 leading dense layer (n_ff 96), 3 layers, vocab 300.

Python API
  write_gguf(path, kvs, tensors, alignment=None, version=3) -> {name: dequantised float32 array}
      kvs: list of (key, vtype, value); vtype is a gguf_np T_* id, or ("array", elem) where
           elem is a T_* id or another ("array", elem) for nested arrays.
      tensors: list of (name, ggml_type_id, float32 ndarray in numpy shape).
  build_model(variant, seed=0) -> (kvs, tensors)   (float32 weights before quantisation)
  make(path, variant="v2", seed=0) -> expected dict (what a reader must return)

CLI: /usr/bin/python3 tests/ref/make_tiny_gguf.py OUT.gguf [--variant v2|v2kvb|v2fused|v3] [--seed N]
"""

import os
import struct
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gguf_np as G  # noqa: E402  (constants only; the writer below is separate code)


# --------------------------------------------------------------------------------------------
# quantisers (own, simple; the reader must return exactly q*d of what is written)

def _f16(x):
    return np.asarray(x, dtype=np.float32).astype(np.float16)


def quant_q8_0(x):
    x = np.asarray(x, dtype=np.float32).reshape(-1, 32)
    amax = np.max(np.abs(x), axis=1)
    d = amax / 127.0
    d16 = _f16(d)
    df = d16.astype(np.float32)
    inv = np.where(df > 0, 1.0 / np.where(df > 0, df, 1), 0).astype(np.float32)
    q = np.clip(np.rint(x * inv[:, None]), -127, 127).astype(np.int8)
    blocks = np.zeros((x.shape[0], 34), dtype=np.uint8)
    blocks[:, :2] = d16.view(np.uint8).reshape(-1, 2)
    blocks[:, 2:] = q.view(np.uint8)
    deq = q.astype(np.float32) * df[:, None]
    return blocks.reshape(-1), deq.reshape(-1)


def quant_q4_0(x):
    x = np.asarray(x, dtype=np.float32).reshape(-1, 32)
    idx = np.argmax(np.abs(x), axis=1)
    mx = x[np.arange(x.shape[0]), idx]
    d = mx / -8.0
    d16 = _f16(d)
    df = d16.astype(np.float32)
    inv = np.where(df != 0, 1.0 / np.where(df != 0, df, 1), 0).astype(np.float32)
    q = np.clip(np.floor(x * inv[:, None] + 8.5), 0, 15).astype(np.uint8)
    blocks = np.zeros((x.shape[0], 18), dtype=np.uint8)
    blocks[:, :2] = d16.view(np.uint8).reshape(-1, 2)
    blocks[:, 2:] = q[:, :16] | (q[:, 16:] << 4)
    deq = (q.astype(np.float32) - 8.0) * df[:, None]
    return blocks.reshape(-1), deq.reshape(-1)


def encode_tensor(arr, ttype):
    """-> (bytes, dequantised float32 array of the same shape)."""
    a = np.asarray(arr, dtype=np.float32)
    if ttype == G.TYPE_F32:
        return a.astype("<f4").tobytes(), a.copy()
    if ttype == G.TYPE_F16:
        h = a.astype("<f2")
        return h.tobytes(), h.astype(np.float32)
    if ttype == G.TYPE_BF16:
        u = a.view(np.uint32)
        # round to nearest even
        r = ((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)).astype("<u2")
        return r.tobytes(), (r.astype(np.uint32) << np.uint32(16)).view(np.float32).reshape(a.shape)
    if ttype == G.TYPE_Q8_0:
        b, d = quant_q8_0(a)
        return b.tobytes(), d.reshape(a.shape)
    if ttype == G.TYPE_Q4_0:
        b, d = quant_q4_0(a)
        return b.tobytes(), d.reshape(a.shape)
    raise ValueError("cannot encode type %d" % ttype)


# --------------------------------------------------------------------------------------------
# writer

_SCALAR_FMT = {G.T_UINT8: "<B", G.T_INT8: "<b", G.T_UINT16: "<H", G.T_INT16: "<h",
               G.T_UINT32: "<I", G.T_INT32: "<i", G.T_FLOAT32: "<f", G.T_BOOL: "<?",
               G.T_UINT64: "<Q", G.T_INT64: "<q", G.T_FLOAT64: "<d"}


def _w_str(s):
    b = s.encode("utf-8") if isinstance(s, str) else bytes(s)
    return struct.pack("<Q", len(b)) + b


def _w_value(vtype, value):
    if isinstance(vtype, tuple):
        assert vtype[0] == "array"
        elem = vtype[1]
        etid = G.T_ARRAY if isinstance(elem, tuple) else elem
        out = [struct.pack("<IQ", etid, len(value))]
        for v in value:
            out.append(_w_value(elem, v))
        return b"".join(out)
    if vtype == G.T_STRING:
        return _w_str(value)
    return struct.pack(_SCALAR_FMT[vtype], value)


def _vtype_id(vtype):
    return G.T_ARRAY if isinstance(vtype, tuple) else vtype


def write_gguf(path, kvs, tensors, alignment=None, version=3):
    align = alignment or G.DEFAULT_ALIGNMENT
    kvs = list(kvs)
    if alignment is not None:
        kvs = [kv for kv in kvs if kv[0] != "general.alignment"]
        kvs.insert(1 if kvs else 0, ("general.alignment", G.T_UINT32, alignment))
    head = [b"GGUF", struct.pack("<IQQ", version, len(tensors), len(kvs))]
    for key, vtype, value in kvs:
        head.append(_w_str(key) + struct.pack("<I", _vtype_id(vtype)) + _w_value(vtype, value))
    blobs, expected = [], {}
    off = 0
    infos = []
    for name, ttype, arr in tensors:
        arr = np.asarray(arr, dtype=np.float32)
        data, deq = encode_tensor(arr, ttype)
        expected[name] = deq
        ne = list(reversed(arr.shape))
        infos.append(_w_str(name) + struct.pack("<I", len(ne)) + struct.pack("<%dQ" % len(ne), *ne)
                     + struct.pack("<IQ", ttype, off))
        blobs.append((off, data))
        off += len(data)
        off = (off + align - 1) // align * align
    header = b"".join(head) + b"".join(infos)
    pad = (-len(header)) % align
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(header + b"\0" * pad)
        pos = 0
        for o, data in blobs:
            if o > pos:
                f.write(b"\0" * (o - pos))
            f.write(data)
            pos = o + len(data)
        if off > pos:
            f.write(b"\0" * (off - pos))
    os.replace(tmp, path)
    return expected


# --------------------------------------------------------------------------------------------
# tiny deepseek2 model

DIMS = dict(d=64, H=4, nope=16, rope=8, kv_lora=32, v_head=16, E=8, k=2, F=32, n_shared=1,
            n_dense=1, n_layer=3, n_ff=96, vocab=300, q_lora=48)


def build_model(variant="v2", seed=0):
    if variant not in ("v2", "v2kvb", "v2fused", "v3"):
        raise ValueError("unknown variant %s" % variant)
    D = DIMS
    d, H, nope, rope, kvl, vh = D["d"], D["H"], D["nope"], D["rope"], D["kv_lora"], D["v_head"]
    E, F, V = D["E"], D["F"], D["vocab"]
    v3 = variant == "v3"
    q_lora = D["q_lora"] if v3 else 0
    rng = np.random.default_rng(seed)

    def w(out, inp, scale=1.0):
        return (rng.standard_normal((out, inp)) * scale / np.sqrt(inp)).astype(np.float32)

    def norm(n):
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    A = "deepseek2."
    kvs = [("general.architecture", G.T_STRING, "deepseek2"),
           ("general.name", G.T_STRING, "tiny-%s" % variant),
           ("general.file_type", G.T_UINT32, 1),
           (A + "context_length", G.T_UINT32, 1024),
           (A + "embedding_length", G.T_UINT32, d),
           (A + "block_count", G.T_UINT32, D["n_layer"]),
           (A + "feed_forward_length", G.T_UINT32, D["n_ff"]),
           (A + "attention.head_count", G.T_UINT32, H),
           (A + "rope.freq_base", G.T_FLOAT32, 10000.0),
           (A + "attention.layer_norm_rms_epsilon", G.T_FLOAT32, 1e-6),
           (A + "expert_used_count", G.T_UINT32, D["k"]),
           (A + "expert_count", G.T_UINT32, E),
           (A + "leading_dense_block_count", G.T_UINT32, D["n_dense"]),
           (A + "vocab_size", G.T_UINT32, V),
           (A + "attention.kv_lora_rank", G.T_UINT32, kvl),
           (A + "rope.dimension_count", G.T_UINT32, rope),
           (A + "expert_feed_forward_length", G.T_UINT32, F),
           (A + "expert_shared_count", G.T_UINT32, D["n_shared"])]
    if variant == "v2kvb":
        kvs += [(A + "attention.head_count_kv", G.T_UINT32, H),
                (A + "attention.key_length", G.T_UINT32, nope + rope),
                (A + "attention.value_length", G.T_UINT32, vh)]
    else:
        kvs += [(A + "attention.head_count_kv", G.T_UINT32, 1),
                (A + "attention.key_length", G.T_UINT32, kvl + rope),
                (A + "attention.value_length", G.T_UINT32, kvl),
                (A + "attention.key_length_mla", G.T_UINT32, nope + rope),
                (A + "attention.value_length_mla", G.T_UINT32, vh)]
    if v3:
        kvs += [(A + "attention.q_lora_rank", G.T_UINT32, q_lora),
                (A + "expert_weights_scale", G.T_FLOAT32, 2.5),
                (A + "expert_weights_norm", G.T_BOOL, True),
                (A + "expert_gating_func", G.T_UINT32, 2),
                (A + "expert_group_count", G.T_UINT32, 4),
                (A + "expert_group_used_count", G.T_UINT32, 2),
                (A + "rope.scaling.type", G.T_STRING, "yarn"),
                (A + "rope.scaling.factor", G.T_FLOAT32, 4.0),
                (A + "rope.scaling.original_context_length", G.T_UINT32, 256),
                (A + "rope.scaling.yarn_log_multiplier", G.T_FLOAT32, 0.1 * 0.707)]
    else:
        kvs += [(A + "expert_weights_scale", G.T_FLOAT32, 1.0)]
    toks = ["<s>", "</s>", "<unk>"] + ["<0x%02X>" % i for i in range(256)] + \
        ["tok%d" % i for i in range(V - 259)]
    ttype = [3, 3, 2] + [6] * 256 + [1] * (V - 259)
    kvs += [("tokenizer.ggml.model", G.T_STRING, "gpt2"),
            ("tokenizer.ggml.pre", G.T_STRING, "default"),
            ("tokenizer.ggml.tokens", ("array", G.T_STRING), toks),
            ("tokenizer.ggml.token_type", ("array", G.T_INT32), ttype),
            ("tokenizer.ggml.merges", ("array", G.T_STRING), ["t o", "to k", "1 2"]),
            ("tokenizer.ggml.bos_token_id", G.T_UINT32, 0),
            ("tokenizer.ggml.eos_token_id", G.T_UINT32, 1),
            ("tokenizer.ggml.add_bos_token", G.T_BOOL, True)]

    f32, f16, bf16, q8, q4 = G.TYPE_F32, G.TYPE_F16, G.TYPE_BF16, G.TYPE_Q8_0, G.TYPE_Q4_0
    t_emb = f16 if v3 else f32
    t_out = bf16 if v3 else f16
    t_mat = q8 if v3 else f16      # attention projections with ne0 % 32 == 0
    t_o = q4 if v3 else f16        # attn_output, dense ffn
    t_exp = q8 if v3 else f16      # experts
    t_sh = q4 if v3 else f32       # shared expert

    tensors = [("token_embd.weight", t_emb, (rng.standard_normal((V, d)) * 0.5).astype(np.float32))]
    for il in range(D["n_layer"]):
        p = "blk.%d." % il
        tensors.append((p + "attn_norm.weight", f32, norm(d)))
        if q_lora:
            tensors.append((p + "attn_q_a.weight", t_mat, w(q_lora, d)))
            tensors.append((p + "attn_q_a_norm.weight", f32, norm(q_lora)))
            tensors.append((p + "attn_q_b.weight", f16, w(H * (nope + rope), q_lora)))
        else:
            tensors.append((p + "attn_q.weight", t_mat, w(H * (nope + rope), d)))
        tensors.append((p + "attn_kv_a_mqa.weight", t_mat, w(kvl + rope, d)))
        tensors.append((p + "attn_kv_a_norm.weight", f32, norm(kvl)))
        kv_b = w(H * (nope + vh), kvl, 2.0)                      # HF kv_b_proj layout
        kv_b3 = kv_b.reshape(H, nope + vh, kvl)
        if variant == "v2kvb":
            tensors.append((p + "attn_kv_b.weight", f32, kv_b))
        else:
            k_b = np.ascontiguousarray(kv_b3[:, :nope, :].transpose(0, 2, 1))   # (H, kvl, nope)
            v_b = np.ascontiguousarray(kv_b3[:, nope:, :])                      # (H, vh, kvl)
            tensors.append((p + "attn_k_b.weight", f32, k_b))
            tensors.append((p + "attn_v_b.weight", f16 if v3 else f32, v_b))
        tensors.append((p + "attn_output.weight", t_o, w(d, H * vh)))
        tensors.append((p + "ffn_norm.weight", f32, norm(d)))
        if il < D["n_dense"]:
            tensors.append((p + "ffn_gate.weight", t_o, w(D["n_ff"], d)))
            tensors.append((p + "ffn_up.weight", t_o, w(D["n_ff"], d)))
            tensors.append((p + "ffn_down.weight", t_o, w(d, D["n_ff"])))
        else:
            tensors.append((p + "ffn_gate_inp.weight", f32, w(E, d, 3.0)))
            if v3:
                tensors.append((p + "exp_probs_b.bias", f32, (0.2 * rng.standard_normal(E)).astype(np.float32)))
            gate = np.stack([w(F, d) for _ in range(E)])
            up = np.stack([w(F, d) for _ in range(E)])
            down = np.stack([w(d, F) for _ in range(E)])
            if variant == "v2fused":
                tensors.append((p + "ffn_gate_up_exps.weight", t_exp, np.concatenate([gate, up], axis=1)))
            else:
                tensors.append((p + "ffn_gate_exps.weight", t_exp, gate))
                tensors.append((p + "ffn_up_exps.weight", t_exp, up))
            tensors.append((p + "ffn_down_exps.weight", t_exp, down))
            Fs = F * D["n_shared"]
            tensors.append((p + "ffn_gate_shexp.weight", t_sh, w(Fs, d)))
            tensors.append((p + "ffn_up_shexp.weight", t_sh, w(Fs, d)))
            tensors.append((p + "ffn_down_shexp.weight", t_sh, w(d, Fs)))
    tensors.append(("output_norm.weight", f32, norm(d)))
    tensors.append(("output.weight", t_out, w(V, d, 2.0)))
    return kvs, tensors


def make(path, variant="v2", seed=0):
    kvs, tensors = build_model(variant, seed)
    return write_gguf(path, kvs, tensors, alignment=64 if variant == "v3" else None)


def main(argv=None):
    import argparse
    ap = argparse.ArgumentParser(description="write a tiny random deepseek2 GGUF")
    ap.add_argument("out")
    ap.add_argument("--variant", default="v2", choices=["v2", "v2kvb", "v2fused", "v3"])
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    make(a.out, a.variant, a.seed)
    print("wrote %s (%d bytes)" % (a.out, os.path.getsize(a.out)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
