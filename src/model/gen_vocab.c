/*
 * gen_vocab.c - a small byte-level BPE vocabulary for generated models.
 *
 * Tokens use GPT-2's byte-to-unicode mapping (printable bytes stand for
 * themselves, the others map to U+0100.. in order), so llama.cpp's "gpt2"
 * tokenizer reads them. Merges are learned by plain BPE over the words of a
 * built-in English + Python text (a word: an optional leading space and a run
 * of letters, digits, or other symbols; whitespace runs alone). Ties between
 * equally frequent pairs go to the pair that sorts first, so the result is
 * deterministic. Ids past the merges and the two control tokens are made-up words that no
 * merge makes (see below).
 */
#include "moetax/gen.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const char k_corpus[] =
    "The quick brown fox jumps over the lazy dog. A mixture of experts routes each token to a few of many\n"
    "experts, so only a small part of the model is read for every token. The router scores the experts,\n"
    "keeps the top ones, and the outputs are combined with the routing weights. When the experts do not fit\n"
    "in memory they are read from the disk, and the time spent waiting for them is part of the tax.\n"
    "In the beginning there was the word, and the word was with the model, and the model was slow because\n"
    "it waited for its weights. We measure where the time goes: routing, dispatch, loading, waiting,\n"
    "combining, and the useful work of the experts and the attention layers. Then we make it faster.\n"
    "import os\nimport sys\nimport json\nfrom typing import List, Dict, Optional\n\n"
    "class Tokenizer:\n    def __init__(self, vocab, merges):\n        self.vocab = vocab\n"
    "        self.merges = merges\n        self.cache = {}\n\n    def encode(self, text):\n"
    "        tokens = []\n        for word in self.split(text):\n            tokens.extend(self.bpe(word))\n"
    "        return tokens\n\n    def decode(self, ids):\n        return ''.join(self.vocab[i] for i in ids)\n\n"
    "def main(argv=None):\n    if argv is None:\n        argv = sys.argv[1:]\n    for i in range(len(argv)):\n"
    "        print(i, argv[i])\n    result = {'status': 'ok', 'count': len(argv)}\n    return 0\n\n"
    "if __name__ == '__main__':\n    sys.exit(main())\n\n"
    "def read_file(path: str) -> Optional[str]:\n    try:\n        with open(path, 'r') as f:\n"
    "            return f.read()\n    except OSError as e:\n        print('error:', e)\n        return None\n\n"
    "for key, value in sorted(data.items()):\n    if value is not None and key in self.keys:\n"
    "        self.values[key] = value + 1\n    elif isinstance(value, list):\n        continue\n"
    "    else:\n        raise ValueError('bad value for ' + str(key))\n\n"
    "The numbers 0 1 2 3 4 5 6 7 8 9 10 100 1000 2024 are common, and so are the words of the language:\n"
    "time, person, year, way, day, thing, man, world, life, hand, part, child, eye, woman, place, work,\n"
    "week, case, point, government, company, number, group, problem, fact, be, have, do, say, get, make,\n"
    "go, know, take, see, come, think, look, want, give, use, find, tell, ask, feel, try, leave, call.\n"
    "def forward(self, x):\n    h = self.norm(x)\n    h = self.attention(h)\n    x = x + h\n"
    "    return x + self.feed_forward(self.ffn_norm(x))\n\n"
    "while True:\n    line = input()\n    if not line:\n        break\n    lines.append(line.strip())\n";

/* GPT-2 byte -> unicode code point */
static int byte_to_cp(int b) {
    if ((b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174 && b <= 255)) return b;
    int n = 0;
    for (int x = 0; x < b; x++)
        if (!((x >= 33 && x <= 126) || (x >= 161 && x <= 172) || (x >= 174 && x <= 255))) n++;
    return 256 + n;
}

static int put_utf8(char *o, int cp) {
    if (cp < 0x80) { o[0] = (char)cp; return 1; }
    o[0] = (char)(0xc0 | (cp >> 6));
    o[1] = (char)(0x80 | (cp & 0x3f));
    return 2;
}

struct word {
    int *sym;
    int n;
    int count;
};

struct pair {
    int a, b, count;
};

static int cmp_pair(const void *x, const void *y) {
    const struct pair *p = x, *q = y;
    if (p->a != q->a) return p->a < q->a ? -1 : 1;
    return (p->b > q->b) - (p->b < q->b);
}

static int cls(unsigned char c) {
    if ((c | 0x20) >= 'a' && (c | 0x20) <= 'z') return 1;
    if (c >= '0' && c <= '9') return 2;
    if (c == ' ' || c == '\n' || c == '\t' || c == '\r') return 3;
    return 4;
}

moetax_status moetax_gen_vocab_build(int n_vocab, struct moetax_gen_vocab *v) {
    memset(v, 0, sizeof *v);
    if (n_vocab < 260) return moetax_error(MOETAX_ERR_ARG, "vocabulary size %d is too small (need >= 260: 256 bytes + BOS/EOS)", n_vocab);
    v->n_tokens = n_vocab;
    v->tokens = calloc((size_t)n_vocab, sizeof(char *));
    v->token_type = calloc((size_t)n_vocab, sizeof(int32_t));
    v->merges = calloc((size_t)n_vocab, sizeof(char *));
    int max_merges = n_vocab - 258;
    /* pair tables: merge m makes token 256+m from (left[m], right[m]) */
    int *left = calloc((size_t)max_merges + 1, sizeof(int)), *right = calloc((size_t)max_merges + 1, sizeof(int));
    size_t nc = sizeof k_corpus - 1;
    struct word *words = calloc(nc, sizeof *words);
    if (!v->tokens || !v->token_type || !v->merges || !left || !right || !words) goto nomem;
    /* byte tokens */
    for (int b = 0; b < 256; b++) {
        char buf[4];
        int n = put_utf8(buf, byte_to_cp(b));
        buf[n] = 0;
        if (!(v->tokens[b] = strdup(buf))) goto nomem;
        v->token_type[b] = 1;
    }
    /* split into words, count duplicates */
    int n_words = 0;
    for (size_t i = 0; i < nc;) {
        size_t j = i;
        if (k_corpus[j] == ' ' && j + 1 < nc && cls((unsigned char)k_corpus[j + 1]) != 3) j++;
        int c = cls((unsigned char)k_corpus[j]);
        size_t e = j + 1;
        while (e < nc && cls((unsigned char)k_corpus[e]) == c) e++;
        int found = -1;
        for (int w = 0; w < n_words; w++)
            if (words[w].n == (int)(e - i)) {
                int same = 1;
                for (int k = 0; k < words[w].n && same; k++) same = words[w].sym[k] == (unsigned char)k_corpus[i + k];
                if (same) { found = w; break; }
            }
        if (found >= 0) words[found].count++;
        else {
            struct word *w = &words[n_words++];
            w->n = (int)(e - i);
            w->count = 1;
            if (!(w->sym = malloc(sizeof(int) * (size_t)w->n))) goto nomem;
            for (int k = 0; k < w->n; k++) w->sym[k] = (unsigned char)k_corpus[i + k];
        }
        i = e;
    }
    /* BPE: repeatedly merge the most frequent adjacent pair */
    int n_tok = 256, n_merges = 0;
    struct pair *pairs = malloc(nc * sizeof *pairs);
    if (!pairs) goto nomem;
    while (n_merges < max_merges) {
        size_t np = 0;
        for (int w = 0; w < n_words; w++)
            for (int k = 0; k + 1 < words[w].n; k++)
                pairs[np++] = (struct pair){words[w].sym[k], words[w].sym[k + 1], words[w].count};
        qsort(pairs, np, sizeof *pairs, cmp_pair);
        int best = 0, bl = -1, br = -1;
        for (size_t i = 0; i < np;) {
            size_t j = i;
            int c = 0;
            while (j < np && pairs[j].a == pairs[i].a && pairs[j].b == pairs[i].b) c += pairs[j++].count;
            if (c > best) { best = c; bl = pairs[i].a; br = pairs[i].b; } /* sorted: first max wins ties */
            i = j;
        }
        if (best < 2) break;
        int nt = n_tok++;
        left[n_merges] = bl;
        right[n_merges] = br;
        size_t ll = strlen(v->tokens[bl]), rl = strlen(v->tokens[br]);
        char *tok = malloc(ll + rl + 1), *mg = malloc(ll + rl + 2);
        if (!tok || !mg) { free(tok); free(mg); free(pairs); goto nomem; }
        memcpy(tok, v->tokens[bl], ll);
        memcpy(tok + ll, v->tokens[br], rl + 1);
        memcpy(mg, v->tokens[bl], ll);
        mg[ll] = ' ';
        memcpy(mg + ll + 1, v->tokens[br], rl + 1);
        v->tokens[nt] = tok;
        v->token_type[nt] = 1;
        v->merges[n_merges++] = mg;
        for (int w = 0; w < n_words; w++) {
            int o = 0;
            for (int k = 0; k < words[w].n; k++) {
                if (k + 1 < words[w].n && words[w].sym[k] == bl && words[w].sym[k + 1] == br) {
                    words[w].sym[o++] = nt;
                    k++;
                } else words[w].sym[o++] = words[w].sym[k];
            }
            words[w].n = o;
        }
    }
    free(pairs);
    v->n_merges = n_merges;
    /* control tokens, then unused padding */
    v->bos_id = n_tok;
    v->eos_id = n_tok + 1;
    if (!(v->tokens[n_tok] = strdup("<|begin_of_text|>")) || !(v->tokens[n_tok + 1] = strdup("<|end_of_text|>"))) goto nomem;
    v->token_type[n_tok] = v->token_type[n_tok + 1] = 3;
    /* the rest: made-up words (a space, then three consonant-vowel syllables spelling the id
     * in base 75), normal tokens that no merge makes, so that text never encodes to them but
     * every id a random model samples decodes to text (a server's stream shows each token) */
    static const char cons[] = "bdfghjklmnprstv", vow[] = "aeiou";
    for (int t = n_tok + 2; t < n_vocab; t++) {
        char buf[32];
        for (int salt = 0;; salt++) {
            int x = t + salt * 1000003, o = 0;
            o += put_utf8(buf, byte_to_cp(' '));
            for (int syl = 0; syl < 3 || x > 0; syl++, x /= 75) {
                buf[o++] = cons[(x % 75) / 5];
                buf[o++] = vow[(x % 75) % 5];
            }
            buf[o] = 0;
            int dup = 0;
            for (int u = 0; u < n_tok + 2 && !dup; u++) dup = !strcmp(v->tokens[u], buf); /* the others differ */
            if (!dup) break;
        }
        if (!(v->tokens[t] = strdup(buf))) goto nomem;
        v->token_type[t] = 1;
    }
    for (int w = 0; w < n_words; w++) free(words[w].sym);
    free(words);
    free(left);
    free(right);
    return MOETAX_OK;
nomem:
    if (words)
        for (size_t w = 0; w < nc; w++) free(words[w].sym);
    free(words);
    free(left);
    free(right);
    moetax_gen_vocab_free(v);
    return moetax_error(MOETAX_ERR_NOMEM, "out of memory building the vocabulary");
}

void moetax_gen_vocab_free(struct moetax_gen_vocab *v) {
    if (v->tokens)
        for (int i = 0; i < v->n_tokens; i++) free(v->tokens[i]);
    if (v->merges)
        for (int i = 0; i < v->n_merges; i++) free(v->merges[i]);
    free(v->tokens);
    free(v->token_type);
    free(v->merges);
    memset(v, 0, sizeof *v);
}
