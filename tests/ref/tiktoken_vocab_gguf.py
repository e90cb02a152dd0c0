#!/usr/bin/python3
"""tiktoken_vocab_gguf.py - a vocabulary-only GGUF ("gpt2" byte-level BPE) from a tiktoken rank file.

llama.cpp's tokenizer suites for qwen2 and llama-bpe (tests/test_tokenizer_llama.c) need
models/ggml-vocab-qwen2.gguf and models/ggml-vocab-llama-bpe.gguf, which this repository does not
commit (the models' licenses) and which are not always at hand. Both vocabularies are published as
tiktoken rank files (one "base64(token bytes) rank" per line): Qwen's qwen.tiktoken (Qwen-7B,
also the base of Qwen1.5/Qwen2's vocab.json) and Llama 3's tokenizer.model. This script turns
such a file into the tokenizer part of a GGUF as llama.cpp's converter writes it for those models:

  tokenizer.ggml.model       "gpt2"
  tokenizer.ggml.pre         --pre (qwen2, llama-bpe)
  tokenizer.ggml.tokens      id order; token bytes in GPT-2's byte-to-unicode alphabet; the
                             special tokens after the ranks; ids up to --vocab-size that have no
                             token become "[PAD<id>]" (UNUSED), as the converter pads to the
                             model's vocab_size
  tokenizer.ggml.token_type  NORMAL (1) for ranked tokens, CONTROL (3) for special ones,
                             UNUSED (5) for padding
  tokenizer.ggml.merges      "left right" for every split of every ranked token into two
                             ranked tokens, ordered by the rank of the whole token, then by
                             the ranks of left and right (how Hugging Face's tiktoken
                             conversion derives merges: BPE on this list picks, among adjacent
                             pairs, the one whose concatenation has the lowest rank, which is
                             tiktoken's own rule)
  bos/eos ids, add_bos_token (--bos, --eos, --add-bos)

Presets (--preset) hold the special tokens of the two models:
  qwen2      <|endoftext|> <|im_start|> <|im_end|> after 151643 ranks (Qwen1.5's tokenizer.json),
             vocab_size 151936, bos = eos = <|endoftext|>, add_bos false
  llama-bpe  <|begin_of_text|> ... 256 specials after 128000 ranks (Llama 3's tokenizer.py),
             bos <|begin_of_text|>, eos <|end_of_text|>, add_bos true

CLI: /usr/bin/python3 tests/ref/tiktoken_vocab_gguf.py RANKS OUT.gguf --preset qwen2|llama-bpe
"""

import argparse
import base64
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gguf_np as G  # noqa: E402
from make_tiny_gguf import write_gguf  # noqa: E402

TYPE_NORMAL, TYPE_CONTROL, TYPE_UNUSED = 1, 3, 5


def byte_to_unicode():
    """GPT-2's byte alphabet: printable bytes stand for themselves, the rest map to U+0100 on."""
    keep = list(range(0x21, 0x7F)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(0x100 + extra)
            extra += 1
    return table


def read_ranks(path):
    ranks = {}
    with open(path, "rb") as f:
        for no, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            parts = line.split()
            if len(parts) != 2:
                raise SystemExit(f"{path}:{no}: expected 'base64 rank', found {line[:60]!r}")
            tok, rank = base64.b64decode(parts[0]), int(parts[1])
            if tok in ranks:
                raise SystemExit(f"{path}:{no}: token {tok!r} ranked twice")
            ranks[tok] = rank
    ids = sorted(ranks.values())
    if ids != list(range(len(ids))):
        raise SystemExit(f"{path}: ranks are not 0..{len(ids) - 1} without gaps")
    return ranks


def derive_merges(ranks):
    merges = []
    for tok, rank in ranks.items():
        if len(tok) < 2:
            continue
        local = []
        for k in range(1, len(tok)):
            a, b = tok[:k], tok[k:]
            if a in ranks and b in ranks:
                local.append((rank, ranks[a], ranks[b], a, b))
        merges.extend(local)
    merges.sort()
    return [(m[3], m[4]) for m in merges]


def llama3_specials():
    names = ["<|begin_of_text|>", "<|end_of_text|>"] + [f"<|reserved_special_token_{i}|>" for i in range(4)]
    names += ["<|start_header_id|>", "<|end_header_id|>", "<|reserved_special_token_4|>", "<|eot_id|>"]
    names += [f"<|reserved_special_token_{i}|>" for i in range(5, 256 - 5)]
    return names


PRESETS = {
    "qwen2": dict(arch="qwen2", specials=["<|endoftext|>", "<|im_start|>", "<|im_end|>"], vocab_size=151936,
                  bos="<|endoftext|>", eos="<|endoftext|>", add_bos=False),
    "llama-bpe": dict(arch="llama", specials=llama3_specials(), vocab_size=128256,
                      bos="<|begin_of_text|>", eos="<|end_of_text|>", add_bos=True),
}


def build(ranks_path, preset):
    p = PRESETS[preset]
    ranks = read_ranks(ranks_path)
    b2u = byte_to_unicode()
    n_rank = len(ranks)
    n = max(p["vocab_size"], n_rank + len(p["specials"]))
    tokens = [None] * n
    types = [TYPE_UNUSED] * n
    for tok, rank in ranks.items():
        tokens[rank] = "".join(b2u[b] for b in tok)
        types[rank] = TYPE_NORMAL
    for i, s in enumerate(p["specials"]):
        tokens[n_rank + i] = s
        types[n_rank + i] = TYPE_CONTROL
    for i in range(n):
        if tokens[i] is None:
            tokens[i] = f"[PAD{i}]"
    merges = [" ".join("".join(b2u[c] for c in part) for part in m) for m in derive_merges(ranks)]
    ids = {s: n_rank + i for i, s in enumerate(p["specials"])}
    kvs = [
        ("general.architecture", G.T_STRING, p["arch"]),
        ("general.name", G.T_STRING, f"{preset} vocabulary from {os.path.basename(ranks_path)}"),
        ("tokenizer.ggml.model", G.T_STRING, "gpt2"),
        ("tokenizer.ggml.pre", G.T_STRING, preset),
        ("tokenizer.ggml.tokens", ("array", G.T_STRING), tokens),
        ("tokenizer.ggml.token_type", ("array", G.T_INT32), types),
        ("tokenizer.ggml.merges", ("array", G.T_STRING), merges),
        ("tokenizer.ggml.bos_token_id", G.T_UINT32, ids[p["bos"]]),
        ("tokenizer.ggml.eos_token_id", G.T_UINT32, ids[p["eos"]]),
        ("tokenizer.ggml.add_bos_token", G.T_BOOL, p["add_bos"]),
    ]
    return kvs, n, len(merges)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("ranks", help="tiktoken rank file (qwen.tiktoken, Llama 3's tokenizer.model)")
    ap.add_argument("out", help="output .gguf (vocabulary only, no tensors)")
    ap.add_argument("--preset", required=True, choices=sorted(PRESETS))
    a = ap.parse_args(argv)
    kvs, n, n_merges = build(a.ranks, a.preset)
    write_gguf(a.out, kvs, [])
    print(f"{a.out}: {n} tokens, {n_merges} merges, pre {a.preset}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
