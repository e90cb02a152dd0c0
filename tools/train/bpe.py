"""Byte-level BPE (GPT-2 style), trained on the corpus: the tokenizer of the default model.

Pre-tokenization is GPT-2's regular expression (the `regex` module, Debian's
python3-regex, for \\p{L} and \\p{N}). Tokens 0..255 are the 256 bytes, written
in GPT-2's byte-to-unicode alphabet as llama.cpp expects for
tokenizer.ggml.model = "gpt2"; merges follow in the order they were learned;
the last token is <|endoftext|>, used as BOS/EOS and as the separator between
files.

Training counts the distinct pre-tokens once, then repeatedly merges the most
frequent adjacent pair (ties: the pair whose merged bytes sort first), updating
the pair counts only in the words that contain the merged pair.
"""
import collections
import heapq
import json

import regex

GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
EOT = "<|endoftext|>"
_PAT = regex.compile(GPT2_PATTERN)


def bytes_to_unicode():
    """GPT-2's reversible byte -> printable code point map."""
    bs = list(range(0x21, 0x7F)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


B2U = bytes_to_unicode()


def pretokenize(text):
    return _PAT.findall(text)


def train(texts, vocab_size, progress=None):
    """Learn vocab_size - 257 merges from texts. Returns the list of merges [(a_bytes, b_bytes)]."""
    n_merges = vocab_size - 257
    if n_merges < 0:
        raise ValueError("vocab_size %d < 257" % vocab_size)
    counts = collections.Counter()
    for t in texts:
        counts.update(pretokenize(t))
    words = [list(w.encode("utf-8")) for w in counts]          # symbols: token ids
    freq = list(counts.values())
    tok_bytes = [bytes([b]) for b in range(256)]
    pair_count = collections.defaultdict(int)
    where = collections.defaultdict(set)
    for wi, w in enumerate(words):
        f = freq[wi]
        for a, b in zip(w, w[1:]):
            pair_count[(a, b)] += f
            where[(a, b)].add(wi)

    def key(p):
        return (-pair_count[p], tok_bytes[p[0]] + tok_bytes[p[1]], tok_bytes[p[0]])

    heap = [key(p) + (p,) for p in pair_count]
    heapq.heapify(heap)
    merges = []
    while len(merges) < n_merges and heap:
        negc, _, _, p = heapq.heappop(heap)
        c = pair_count.get(p, 0)
        if c <= 0:
            continue
        if -negc != c:                      # stale entry: push the current count back
            heapq.heappush(heap, key(p) + (p,))
            continue
        a, b = p
        new = len(tok_bytes)
        tok_bytes.append(tok_bytes[a] + tok_bytes[b])
        merges.append((tok_bytes[a], tok_bytes[b]))
        touched = set()
        for wi in list(where.pop(p, ())):
            w = words[wi]
            f = freq[wi]
            for x, y in zip(w, w[1:]):      # remove this word's old pairs
                pair_count[(x, y)] -= f
                touched.add((x, y))
            out, i = [], 0
            while i < len(w):
                if i + 1 < len(w) and w[i] == a and w[i + 1] == b:
                    out.append(new)
                    i += 2
                else:
                    out.append(w[i])
                    i += 1
            words[wi] = out
            for x, y in zip(out, out[1:]):  # add the new ones
                pair_count[(x, y)] += f
                where[(x, y)].add(wi)
                touched.add((x, y))
        pair_count.pop(p, None)
        for q in touched:
            if q != p and pair_count.get(q, 0) > 0:
                heapq.heappush(heap, key(q) + (q,))
        if progress and len(merges) % 500 == 0:
            progress(len(merges), n_merges)
    return merges


class Tokenizer:
    """Encoder/decoder over a learned merge list (ranks = merge order)."""

    def __init__(self, merges):
        self.merges = [(bytes(a), bytes(b)) for a, b in merges]
        self.tok_bytes = [bytes([b]) for b in range(256)] + [a + b for a, b in self.merges]
        self.id_of = {t: i for i, t in enumerate(self.tok_bytes)}
        self.rank = {(self.id_of[a], self.id_of[b]): r for r, (a, b) in enumerate(self.merges)}
        self.eot = len(self.tok_bytes)
        self.n_vocab = self.eot + 1
        self._cache = {}

    def _word(self, w):
        ids = self._cache.get(w)
        if ids is not None:
            return ids
        ids = list(w.encode("utf-8"))
        rank = self.rank
        while len(ids) > 1:
            best, bi = None, -1
            for i in range(len(ids) - 1):
                r = rank.get((ids[i], ids[i + 1]))
                if r is not None and (best is None or r < best):
                    best, bi = r, i
            if best is None:
                break
            ids[bi:bi + 2] = [256 + best]
        if len(self._cache) < 1 << 20:
            self._cache[w] = ids
        return ids

    def encode(self, text):
        out = []
        for w in pretokenize(text):
            out.extend(self._word(w))
        return out

    def decode_bytes(self, ids):
        return b"".join(self.tok_bytes[i] if i < self.eot else b"" for i in ids)

    def token_strings(self):
        """Token texts in GPT-2's byte alphabet, as tokenizer.ggml.tokens stores them."""
        toks = ["".join(B2U[c] for c in t) for t in self.tok_bytes]
        return toks + [EOT]

    def merge_strings(self):
        return ["%s %s" % ("".join(B2U[c] for c in a), "".join(B2U[c] for c in b)) for a, b in self.merges]

    def save(self, path):
        with open(path, "w") as f:
            json.dump({"merges": [[a.hex(), b.hex()] for a, b in self.merges]}, f)

    @classmethod
    def from_merge_strings(cls, merges):
        """From tokenizer.ggml.merges ("left right" in GPT-2's byte alphabet)."""
        u2b = {u: b for b, u in B2U.items()}
        out = []
        for m in merges:
            a, b = m.split(" ")
            out.append((bytes(u2b[ch] for ch in a), bytes(u2b[ch] for ch in b)))
        return cls(out)

    @classmethod
    def load(cls, path):
        with open(path) as f:
            d = json.load(f)
        return cls([(bytes.fromhex(a), bytes.fromhex(b)) for a, b in d["merges"]])
