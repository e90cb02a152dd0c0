#!/usr/bin/python3
# ctest-labels: unit
"""test_tokenizer_llama3.py - moetax's llama3 ("llama-bpe") and qwen2 pre-tokenizers against the
regular expressions llama.cpp gives for them (src/llama-vocab.cpp, LLAMA_VOCAB_PRE_TYPE_LLAMA3 and
_QWEN2), run by Python's `regex` module, through `moetax tokenize` on tokenizer-only GGUF files.

  llama-bpe  (?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|
             \\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+
             and ignore_merges: a pre-token that is the text of a token is that token
  qwen2      the same with \\p{N} for \\p{N}{1,3}, merges always

llama.cpp's suites (test_tokenizer_llama) check these rules on 46 texts with the models' own
vocabularies, which are not committed. This test needs none: a vocabulary whose merges were
learned on 4-code-point windows WITHOUT pre-tokenization (so most adjacent pairs merge, also
across the rules' boundaries: a boundary moetax puts elsewhere changes the ids) is written once
per rule set, and moetax must give the ids of regex + BPE for the hand-written Unicode text of
test_tokenizer_gpt2 and random texts (letters, numbers, spaces and "other" of many scripts,
digit runs, CR/LF, contractions in both cases, random code points). Bytes that are not UTF-8 are
included where llama.cpp's decoding is the per-byte one (each bad byte is U+FFFD, decoding goes
on at the next byte); surrogates, overlong forms and code points above U+10FFFF, which llama.cpp
decodes as numbers Python has no str for, are left out. The other tokenizer.ggml.pre names llama.cpp
maps to these regexes (llama3, falcon3, dbrx, smaug-bpe; deepseek-r1-qwen, stablelm2, megrez, hunyuan,
solar-open) must give the same ids, with ignore_merges where llama.cpp sets it, and no warning.

usage: test_tokenizer_llama3.py MOETAX_BIN WORKDIR
"""
import codecs
import collections
import os
import random
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(ROOT, "tools", "train"))
sys.path.insert(0, os.path.join(HERE, "ref"))
import regex  # noqa: E402

import bpe  # noqa: E402
import gguf_np as G  # noqa: E402
from make_tiny_gguf import write_gguf  # noqa: E402
from test_tokenizer_gpt2 import HAND, POOL, bpe_bytes, parse_ids, unique_merges  # noqa: E402

from checks import check, summary  # noqa: E402

_CONTR = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_REST = r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
RULES = {
    "llama-bpe": regex.compile(_CONTR + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}" + _REST),
    "qwen2": regex.compile(_CONTR + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}" + _REST),
}
IGNORE_MERGES = {"llama-bpe": True, "qwen2": False}
# other tokenizer.ggml.pre names llama.cpp gives these regexes: (name, rules, ignore_merges)
ALIASES = (("llama3", "llama-bpe", True), ("falcon3", "llama-bpe", True), ("dbrx", "llama-bpe", False),
           ("smaug-bpe", "llama-bpe", False), ("deepseek-r1-qwen", "qwen2", False), ("stablelm2", "qwen2", False),
           ("megrez", "qwen2", False), ("hunyuan", "qwen2", False), ("solar-open", "qwen2", False))

# llama.cpp's decoding of bad bytes: one U+FFFD each, go on at the next byte
codecs.register_error("moetax_per_byte", lambda e: ("\ufffd", e.start + 1))
# llama.cpp decodes these to code points Python's str cannot hold or rejects (D800, 0 overlong, 0x110000)
_NO_PY = (b"\xed\xa0\x80", b"\xc0\x80", b"\xf4\x90\x80\x80")
# words (pre-tokens of HAND, also put in the random texts) made tokens that BPE does not reach
WHOLE = ("Straße", " façade", " λόγος", "Привет", " 漢字かなカナ")
PIECES = list(WHOLE) + [p for p in POOL if p not in _NO_PY] + [
    "1234567", "12", "٣٤٥٦٧", "  12", "'Ll", "'vE", "x'D", "\r\r\n", " \n ", "\u3000\n", "a1b22c333"]


def random_texts(n, seed):
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        parts = []
        for _ in range(rng.randrange(50, 400)):
            if rng.random() < 0.06:
                cp = rng.randrange(0x80, 0x110000)
                while 0xD800 <= cp <= 0xDFFF:
                    cp = rng.randrange(0x80, 0x110000)
                parts.append(chr(cp))
            else:
                parts.append(rng.choice(PIECES))
        out.append(b"".join(p if isinstance(p, bytes) else p.encode("utf-8") for p in parts))
    return out


def ref_encode(tok, pre, data, ignore_merges=None):
    if ignore_merges is None:
        ignore_merges = IGNORE_MERGES[pre]
    text = data.decode("utf-8", "moetax_per_byte")
    ids = []
    for w in RULES[pre].findall(text):
        b = w.encode("utf-8")
        if ignore_merges and b in tok.id_of:
            ids.append(tok.id_of[b])
        else:
            ids += bpe_bytes(tok, b)
    return ids


def write_vocab(path, tok, pre):
    kvs = [("general.architecture", G.T_STRING, "llama"),
           ("general.name", G.T_STRING, "tokenizer only (test_tokenizer_llama3)"),
           ("tokenizer.ggml.model", G.T_STRING, "gpt2"),
           ("tokenizer.ggml.pre", G.T_STRING, pre),
           ("tokenizer.ggml.tokens", ("array", G.T_STRING), tok.token_strings()),
           ("tokenizer.ggml.token_type", ("array", G.T_INT32), [1] * (tok.n_vocab - 1) + [3]),
           ("tokenizer.ggml.merges", ("array", G.T_STRING), tok.merge_strings()),
           ("tokenizer.ggml.bos_token_id", G.T_UINT32, tok.eot),
           ("tokenizer.ggml.eos_token_id", G.T_UINT32, tok.eot)]
    write_gguf(path, kvs, [])


def moetax_ids(mt, gguf, data, work):
    path = os.path.join(work, "tok_llama3_text.bin")
    with open(path, "wb") as f:
        f.write(data)
    r = subprocess.run([mt, "tokenize", "-m", gguf, "--no-bos", "-f", path], capture_output=True, timeout=600)
    if r.returncode == 0 and r.stderr:
        return -1, "no warning expected: " + r.stderr.decode(errors="replace")
    return r.returncode, parse_ids(r.stdout) if r.returncode == 0 else r.stderr.decode(errors="replace")


def compare(mt, gguf, tok, pre, name, data, work):
    rc, got = moetax_ids(mt, gguf, data, work)
    if not check(rc == 0, f"{pre} {name}: rc {rc}: {got}"):
        return False
    want = ref_encode(tok, pre, data)
    if got == want:
        return check(True, name)
    i = next((k for k, (x, y) in enumerate(zip(got, want)) if x != y), min(len(got), len(want)))
    pos = len(b"".join(tok.tok_bytes[k] for k in want[:i]))
    return check(False, f"{pre} {name}: {len(got)} ids, regex {len(want)}; first difference at id {i} (byte {pos}, "
                        f"text {data[max(0, pos - 12):pos + 12]!r}): moetax "
                        f"{[tok.tok_bytes[k] for k in got[i:i + 6] if k < tok.eot]}, regex "
                        f"{[tok.tok_bytes[k] for k in want[i:i + 6]]}")


def main():
    mt, work = sys.argv[1], sys.argv[2]
    os.makedirs(work, exist_ok=True)

    rnd = random_texts(40, seed=20261201)
    texts = [HAND] + [t.decode("utf-8", "replace") for t in rnd[:12]]
    windows = collections.Counter(t[i:i + 4] for t in texts for i in range(len(t)))
    saved = bpe.pretokenize
    bpe.pretokenize = lambda s: [s]  # merges across every boundary (bpe.train looks the name up)
    try:
        merges = bpe.train(list(windows.elements()), 3000)
    finally:
        bpe.pretokenize = saved
    # whole words built right to left at the lowest priority: BPE does not reach them, so with
    # ignore_merges these words are one token and without it they are not
    for w in WHOLE:
        b = w.encode("utf-8")
        merges += [(b[k:k + 1], b[k + 1:]) for k in range(len(b) - 2, -1, -1)]
    tok = bpe.Tokenizer(unique_merges(merges))
    check(tok.n_vocab > 2000, f"boundary vocabulary: {tok.n_vocab} tokens")

    # the rules tell the two apart, and the texts reach what the rules are about
    check(RULES["llama-bpe"].findall("12345 'S") == ["123", "45", " '", "S"] and
          RULES["qwen2"].findall("12345 'S") == ["1", "2", "3", "4", "5", " '", "S"] and
          RULES["qwen2"].findall("'S x") == ["'S", " x"], "the regexes: digits in threes / one by one, 'S")
    kinds = collections.Counter()
    for t in rnd:
        for w in RULES["llama-bpe"].findall(t.decode("utf-8", "moetax_per_byte")):
            if w[0] not in "\r\n" and len(w) > 1 and regex.match(r"[^\p{L}\p{N}]\p{L}", w) and w[0] != " ":
                kinds["other+letters"] += 1
            if regex.fullmatch(r"\p{N}{3}", w):
                kinds["three digits"] += 1
            if regex.fullmatch(r"\s*[\r\n]+", w) and len(w) > 1:
                kinds["spaces+newlines"] += 1
            if regex.fullmatch(r" ?[^\s\p{L}\p{N}]+[\r\n]+", w):
                kinds["other+newlines"] += 1
            if w[0] == "'" and w[1:2] in ("S", "T", "M", "D", "L", "R", "V"):
                kinds["upper-case contraction"] += 1
            if w.encode() in tok.id_of and len(w) > 1 and bpe_bytes(tok, w.encode()) != [tok.id_of[w.encode()]]:
                kinds["ignore_merges changes the ids"] += 1
    check(len(kinds) == 6 and min(kinds.values()) >= 3, f"random texts cover every rule: {dict(kinds)}")
    unreached = [w for w in WHOLE if bpe_bytes(tok, w.encode()) != [tok.id_of[w.encode()]]]
    check(len(unreached) == len(WHOLE), f"BPE reaches none of the whole-word tokens: {unreached} of {WHOLE}")

    for pre in ("llama-bpe", "qwen2"):
        gguf = os.path.join(work, f"tok_llama3_{pre}.gguf")
        write_vocab(gguf, tok, pre)
        compare(mt, gguf, tok, pre, "hand-written Unicode text", HAND.encode("utf-8"), work)
        bad = 0
        for i, data in enumerate(rnd):
            bad += not compare(mt, gguf, tok, pre, f"random text {i} ({len(data)} bytes)", data, work)
        check(bad == 0, f"{pre}: {len(rnd) - bad}/{len(rnd)} random texts")
        # the other rule set's ids differ: the comparison can fail
        other = "qwen2" if pre == "llama-bpe" else "llama-bpe"
        rc, got = moetax_ids(mt, gguf, HAND.encode("utf-8"), work)
        check(rc == 0 and got != ref_encode(tok, other, HAND.encode("utf-8")),
              f"{pre}: moetax's ids are not those of the {other} rules")

    # the other names of these rules: the same ids as the rules (ignore_merges as llama.cpp sets it)
    data = HAND.encode("utf-8") + b"".join(rnd[:3])
    for name, rules, im in ALIASES:
        gguf = os.path.join(work, "tok_llama3_alias.gguf")
        write_vocab(gguf, tok, name)
        rc, got = moetax_ids(mt, gguf, data, work)
        check(rc == 0 and got == ref_encode(tok, rules, data, im) and got != ref_encode(tok, rules, data, not im),
              f"tokenizer.ggml.pre {name}: the {rules} rules, ignore_merges {im}: rc {rc}")
    return summary()


if __name__ == "__main__":
    sys.exit(main())
