#!/usr/bin/python3
# ctest-labels: unit
# ctest-cost: 12
"""test_tokenizer_gpt2.py - moetax's byte-level BPE tokenizer against the Python reference
(tools/train/bpe.py: GPT-2's pre-tokenizer regex run by the `regex` module), through
`moetax tokenize` on GGUF files that hold only tokenizer metadata.

Two vocabularies:
  corpus    bpe.train on 60 files of Debian's Python standard library (tools/train/corpus.py),
            vocab 1000: held-out files, the non-ASCII training files and the Unicode text below
            must give exactly the Python ids.
  boundary  merges learned on the Unicode and random texts WITHOUT pre-tokenization (windows of
            4 code points), so most adjacent byte pairs have a merge, also across the regex's
            pre-token boundaries: a pre-token that moetax joins or splits where the regex does not
            changes the ids (with the corpus vocabulary a wrong boundary often goes unseen).
Random texts mix ASCII, letters/numbers/spaces/other of many scripts, random code points and
bytes that are not valid UTF-8. For those bytes Python has no reference text, but decoding with
errors="surrogateescape" turns each invalid byte into one lone surrogate, which the regex
classifies as "other": exactly moetax's documented rule. Also: --pieces gives the text back
byte for byte, BOS, the checked-in unicode_classes.h matches the installed regex module, and
clear errors (exit 1) and usage errors (exit 2).

usage: test_tokenizer_gpt2.py MOETAX_BIN WORKDIR
"""
import collections
import os
import random
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "tools", "train"))
sys.path.insert(0, os.path.join(HERE, "ref"))
import regex  # noqa: E402  (Debian's python3-regex; a missing module fails the test)

import bpe  # noqa: E402
import corpus  # noqa: E402
import gguf_np as G  # noqa: E402
from make_tiny_gguf import write_gguf  # noqa: E402

from checks import check, summary  # noqa: E402  (tests/ref/checks.py)


def run(args, **kw):
    return subprocess.run(args, capture_output=True, timeout=600, **kw)


# Every case of the pre-tokenizer: letters, numbers, spaces and "other" outside ASCII, a space
# leading each class, runs of (Unicode) spaces before words and at the end, contractions.
HAND = (
    "Café naïve façade Straße ΩΣ λόγος; Привет мир! 漢字かなカナ 한국어 ªµº ǅ ʰ\n"
    "numbers: ٣٤٥ ۷۸ ²³ ½ Ⅻ ① ١٢abc x² 3½ ४२ 〇 ⅔ 𝟙𝟚 ¹⁰\n"
    "symbols: — → © € ™ ± × ÷ « » „quotes“ … • ¶ § ¿¡ 〜 ㊗\n"
    "emoji: 😀👍🏽 🇫🇷 ❤️ 👨\u200d👩\u200d👧 ✓ a😀b 1😀2\n"
    "spaces:\u00a0nbsp\u3000ideo\u2009thin\u2003em\u202fnarrow\u205fmath\u1680ogham\u0085nel"
    "\u2028ls\u2029ps\u000bvt\u000cff end\n"
    "not spaces: zero\u200bwidth word\u2060joiner\ufeffbom mongolian\u180evs\u001cfs\u001fus\n"
    "combining: e\u0301 a\u0308b Z\u0335\u0336 \u0301start cafe\u0301s 1\u20e3 \u0903x\n"
    "tabs\t\tand\t \tmixed \t\nCRLF\r\n\r\nlines\r\n  \r\n\n\n   indented\n\t\tdeep\n"
    "contractions: it's we'll they're I've I'm he'd don't 'S 'LL 'RE it'S We'Ll x's 'sup ''s\n"
    "leading: a  b   c    1  2   !!  ??   é  漢   ٣  —  😀  \u00a0x  \u3000y \u3000\u3000z\n"
    "runs: x\u3000\u3000\u3000y 7\u00a0\u00a0 8 \u2003\u2003w !\u00a0\u00a0?\n"
    "trailing spaces   \n"
    "ends with spaces \u3000 "
)

# Pieces for the random texts (str: UTF-8 encoded; bytes: written as they are).
POOL = (list("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789") +
        list(" " * 12 + "\t\n\r\x0b\x0c" + "!\"#$%&()*+,-./:;<=>?@[\\]^_`{|}~") +
        ["'", "'s", "'t", "'re", "'ve", "'m", "'ll", "'d", "'S", "'RE", "\r\n", "  ", "\n\n"] +
        list("éßΩжλ漢字かカ한ªµǅʰ") + list("٣²½Ⅻ①〇४⅔𝟙") +
        list("\u00a0\u3000\u2009\u2003\u202f\u205f\u1680\u0085\u2028\u2029") +
        list("—→©€™«»…😀👍🏽\u200d\ufe0f\u200b\u2060\ufeff\u0301\u0308\u20e3\u0903\x00\x1c\x7f") +
        [b"\xff", b"\xfe", b"\xc3", b"\x80", b"\xbf", b"\xed\xa0\x80", b"\xe4\xbd", b"\xf4\x90\x80\x80",
         b"\xc0\x80", b"\xf0\x9f\x98", b"\xf8\x88\x80\x80\x80"])


def random_texts(n, seed):
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        parts = []
        for _ in range(rng.randrange(50, 400)):
            r = rng.random()
            if r < 0.06:  # any code point outside ASCII (mostly unassigned, CJK, other)
                cp = rng.randrange(0x80, 0x110000)
                while 0xD800 <= cp <= 0xDFFF:
                    cp = rng.randrange(0x80, 0x110000)
                parts.append(chr(cp))
            else:
                parts.append(rng.choice(POOL))
        out.append(b"".join(p if isinstance(p, bytes) else p.encode("utf-8") for p in parts))
    return out


def bpe_bytes(tok, b):
    """BPE of one pre-token given as bytes (as Tokenizer._word, which takes str)."""
    ids = list(b)
    while len(ids) > 1:
        pairs = [(tok.rank[(ids[i], ids[i + 1])], i) for i in range(len(ids) - 1) if (ids[i], ids[i + 1]) in tok.rank]
        if not pairs:
            break
        r, i = min(pairs)
        ids[i:i + 2] = [256 + r]
    return ids


def ref_encode(tok, data):
    """Python's ids for any bytes: each byte that is not valid UTF-8 is one "other" code point."""
    try:
        return tok.encode(data.decode("utf-8"))
    except UnicodeDecodeError:
        text = data.decode("utf-8", "surrogateescape")
        return [i for w in bpe.pretokenize(text) for i in bpe_bytes(tok, w.encode("utf-8", "surrogateescape"))]


def unique_merges(merges):
    """Drop merges whose result repeats an earlier token (a vocabulary must not hold duplicates)."""
    seen = {bytes([b]) for b in range(256)}
    out = []
    for a, b in merges:
        if a + b not in seen:
            seen.add(a + b)
            out.append((a, b))
    return out


def write_vocab(path, tok):
    toks = tok.token_strings()
    assert len(toks) == tok.n_vocab and toks[tok.eot] == bpe.EOT
    check(len(set(toks)) == len(toks), f"{path}: token texts are unique")
    kvs = [("general.architecture", G.T_STRING, "deepseek2"),
           ("general.name", G.T_STRING, "tokenizer only (test_tokenizer_gpt2)"),
           ("tokenizer.ggml.model", G.T_STRING, "gpt2"),
           ("tokenizer.ggml.pre", G.T_STRING, "gpt2"),
           ("tokenizer.ggml.tokens", ("array", G.T_STRING), toks),
           ("tokenizer.ggml.token_type", ("array", G.T_INT32), [1] * (len(toks) - 1) + [3]),
           ("tokenizer.ggml.merges", ("array", G.T_STRING), tok.merge_strings()),
           ("tokenizer.ggml.bos_token_id", G.T_UINT32, tok.eot),
           ("tokenizer.ggml.eos_token_id", G.T_UINT32, tok.eot),
           ("tokenizer.ggml.add_bos_token", G.T_BOOL, True)]
    write_gguf(path, kvs, [])


def parse_ids(out):
    s = out.decode().strip()
    return [int(x) for x in s.split(",")] if s else []


def unescape(line):
    out, i = bytearray(), 0
    while i < len(line):
        c = line[i]
        if c != 0x5C:  # backslash
            out.append(c)
            i += 1
            continue
        e = line[i + 1:i + 2]
        if e == b"x":
            out.append(int(line[i + 2:i + 4], 16))
            i += 4
        else:
            out += {b"\\": b"\\", b"n": b"\n", b"r": b"\r", b"t": b"\t"}[e]
            i += 2
    return bytes(out)


def first_diff(a, b):
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def compare(mt, gguf, tok, name, data, work):
    """moetax tokenize --no-bos -f FILE against the Python ids of data."""
    path = os.path.join(work, "tok_gpt2_text.bin")
    with open(path, "wb") as f:
        f.write(data)
    r = run([mt, "tokenize", "-m", gguf, "--no-bos", "-f", path])
    if not check(r.returncode == 0, f"{name}: rc {r.returncode}: {r.stderr.decode(errors='replace')}"):
        return
    got, want = parse_ids(r.stdout), ref_encode(tok, data)
    if got != want:
        i = first_diff(got, want)
        pos = len(tok.decode_bytes(want[:i]))
        check(False, f"{name}: {len(got)} ids, Python {len(want)}; first difference at id {i} (byte {pos}, text "
                     f"{data[max(0, pos - 12):pos + 12]!r}): moetax {got[i:i + 6]} = "
                     f"{[tok.tok_bytes[k] if k < tok.eot else '<eot>' for k in got[i:i + 6]]}, Python {want[i:i + 6]} = "
                     f"{[tok.tok_bytes[k] for k in want[i:i + 6]]}")
    else:
        check(True, name)


def main():
    mt, work = sys.argv[1], sys.argv[2]
    os.makedirs(work, exist_ok=True)

    # the checked-in class tables are those of the installed regex module
    r = run([sys.executable, os.path.join(ROOT, "tools", "train", "gen_unicode_tables.py"), "--check"])
    check(r.returncode == 0, f"src/runtime/unicode_classes.h is up to date: {r.stderr.decode(errors='replace')}")

    # the hand-written text covers what it claims (as the regex module classifies it)
    classes = {"L": regex.compile(r"\p{L}"), "N": regex.compile(r"\p{N}"), "S": regex.compile(r"\s")}

    def cls(ch):
        return next((k for k, p in classes.items() if p.fullmatch(ch)), "O")
    seen = collections.Counter(cls(ch) for ch in HAND if ord(ch) > 127)
    check(all(seen[k] >= 5 for k in "LNSO"), f"hand text has non-ASCII code points of every class: {seen}")
    check(cls("\u0301") == "O" and cls("²") == "N" and cls("\u00a0") == "S" and cls("\u200b") == "O",
          "regex classes: U+0301 other, ² number, U+00A0 space, U+200B other")
    pre = bpe.pretokenize(HAND)
    lead = collections.Counter(cls(w[1]) for w in pre if len(w) > 1 and w[0] == " " and ord(w[1]) > 127)
    check(all(lead[k] >= 1 for k in "LNO"), f"a space leads non-ASCII letters, numbers, other: {lead}")
    check("\u3000\u3000" in pre and " \u3000" in pre and "'s" in pre and "'RE" not in pre,
          "hand text: runs of U+3000, a space before U+3000, contractions")

    # vocabulary 1: trained on the corpus
    train, held = corpus.split()
    t_texts = [t for _, t in train[::10][:60]]
    merges = bpe.train(t_texts, 1000)
    check(len(merges) == 1000 - 257, f"corpus vocabulary: {len(merges)} merges")
    tok = bpe.Tokenizer(merges)
    gguf = os.path.join(work, "tok_gpt2_corpus.gguf")
    write_vocab(gguf, tok)

    for rel, text in held:
        compare(mt, gguf, tok, f"held-out {rel}", text.encode("utf-8"), work)
    non_ascii = sorted(((sum(ord(c) > 127 for c in t), rel, t) for rel, t in train), reverse=True)[:4]
    for n, rel, text in non_ascii:
        check(n > 0, f"{rel} has non-ASCII text")
        compare(mt, gguf, tok, f"non-ASCII file {rel}", text.encode("utf-8"), work)
    compare(mt, gguf, tok, "hand-written Unicode text (corpus vocabulary)", HAND.encode("utf-8"), work)

    # vocabulary 2: merges across the regex's boundaries
    rnd = random_texts(30, seed=20240509)
    texts = [HAND] + [t.decode("utf-8", "replace") for t in rnd[:10]]
    windows = collections.Counter(t[i:i + 4] for t in texts for i in range(len(t)))
    saved = bpe.pretokenize
    bpe.pretokenize = lambda s: [s]  # train on the windows as they are (bpe.train looks the name up)
    try:
        wmerges = bpe.train(list(windows.elements()), 3000)
    finally:
        bpe.pretokenize = saved
    wtok = bpe.Tokenizer(unique_merges(wmerges))
    check(wtok.n_vocab > 2000, f"boundary vocabulary: {wtok.n_vocab} tokens")
    wgguf = os.path.join(work, "tok_gpt2_boundary.gguf")
    write_vocab(wgguf, wtok)
    compare(mt, wgguf, wtok, "hand-written Unicode text (boundary vocabulary)", HAND.encode("utf-8"), work)
    for i, data in enumerate(rnd):
        compare(mt, wgguf, wtok, f"random text {i} ({len(data)} bytes)", data, work)
    # the reference for invalid bytes uses Tokenizer.encode's BPE
    check([i for w in bpe.pretokenize(HAND) for i in bpe_bytes(wtok, w.encode())] == wtok.encode(HAND),
          "bpe_bytes is Tokenizer.encode's BPE")

    # --pieces: the bytes of each token, escaped; together they are the text
    for name, g, t, data in (("hand", wgguf, wtok, HAND.encode("utf-8")), ("random", wgguf, wtok, rnd[0]),
                             ("hand, corpus vocabulary", gguf, tok, HAND.encode("utf-8"))):
        path = os.path.join(work, "tok_gpt2_pieces.bin")
        with open(path, "wb") as f:
            f.write(data)
        r = run([mt, "tokenize", "-m", g, "--no-bos", "--pieces", "-f", path])
        check(r.returncode == 0, f"--pieces {name}: rc {r.returncode}")
        lines = r.stdout.split(b"\n")
        check(lines[-1] == b"", f"--pieces {name}: ends with a newline")
        pieces = [unescape(x) for x in lines[:-1]]
        want = ref_encode(t, data)
        check(pieces == [t.tok_bytes[i] for i in want], f"--pieces {name}: the pieces of the Python ids")
        check(b"".join(pieces) == data, f"--pieces {name}: concatenated they are the text, byte for byte")
        try:
            r.stdout.decode("utf-8")
            err = None
        except UnicodeDecodeError as e:
            err = e
        check(err is None, f"--pieces {name}: the output is UTF-8 (invalid bytes escaped): {err}")

    # -p, stdin, BOS, empty text
    r = run([mt, "tokenize", "-m", gguf, "-p", "Straße — 漢字 it's"])
    check(r.returncode == 0 and parse_ids(r.stdout) == [tok.eot] + tok.encode("Straße — 漢字 it's"),
          f"-p with BOS (add_bos_token true): {r.stdout!r} {r.stderr!r}")
    r = run([mt, "tokenize", "-m", gguf, "--ids", "--no-bos", "-f", "-"], input=HAND.encode())
    check(r.returncode == 0 and parse_ids(r.stdout) == tok.encode(HAND), "-f - reads standard input")
    r = run([mt, "tokenize", "-m", gguf, "--no-bos", "-p", ""])
    check(r.returncode == 0 and r.stdout == b"\n", f"empty text: {r.stdout!r}")
    r = run([mt, "tokenize", "-m", gguf, "--pieces", "-p", "a"])
    check(r.returncode == 0 and r.stdout == b"\na\n", f"--pieces with BOS: an empty line first: {r.stdout!r}")

    # errors: exit 1 with a message; usage errors: exit 2
    notok = os.path.join(work, "tok_gpt2_notok.gguf")
    write_gguf(notok, [("general.architecture", G.T_STRING, "deepseek2")], [])
    missing = os.path.join(work, "tok_gpt2_missing.gguf")
    for args, rc, want in (
            (["-m", missing, "-p", "x"], 1, "tok_gpt2_missing.gguf"),
            (["-m", notok, "-p", "x"], 1, "tokenizer.ggml.model"),
            (["-m", gguf, "-f", os.path.join(work, "tok_gpt2_missing.txt")], 1, "tok_gpt2_missing.txt"),
            (["-p", "x"], 0, ""),   # no -m: the default model (committed) or $MOETAX_MODEL
            (["-m", gguf], 2, "-p"),
            (["-m", gguf, "-p", "x", "-f", "y"], 2, "-p"),
            (["-m", gguf, "-p", "x", "--ids", "--pieces"], 2, "--pieces"),
            (["-m", gguf, "-p", "x", "--frobnicate"], 2, "--frobnicate"),
            (["-m"], 2, "-m")):
        r = run([mt, "tokenize"] + args)
        err = r.stderr.decode(errors="replace")
        if rc == 0:
            check(r.returncode == 0 and parse_ids(r.stdout), f"tokenize {args}: rc {r.returncode}, {err!r}")
            continue
        check(r.returncode == rc and want in err and "moetax" in err, f"tokenize {args}: rc {r.returncode}, {err!r}")
    return summary()


if __name__ == "__main__":
    sys.exit(main())
