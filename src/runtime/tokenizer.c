/*
 * tokenizer.c - byte-level BPE ("gpt2") and SentencePiece ("llama") tokenizers; see moetax/tokenizer.h.
 *
 * Layout after load: per token its type and its decoded bytes (one arena), the
 * 256 byte tokens, and an open-addressing hash map from a pair of token ids to
 * (merge rank, merged id). The token text -> id map is only needed while the
 * merges are read and is freed at the end of load.
 */
#include "moetax/tokenizer.h"

#include "unicode_classes.h" /* generated: \p{L}, \p{N}, \s as the Python regex module has them */

#include <limits.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define KEY_MODEL "tokenizer.ggml.model"
#define KEY_PRE "tokenizer.ggml.pre"
#define KEY_TOKENS "tokenizer.ggml.tokens"
#define KEY_TYPES "tokenizer.ggml.token_type"
#define KEY_MERGES "tokenizer.ggml.merges"
#define KEY_ADD_BOS "tokenizer.ggml.add_bos_token"
#define KEY_SCORES "tokenizer.ggml.scores"
#define KEY_SPACE_PREFIX "tokenizer.ggml.add_space_prefix"

/* pre-tokenizer code point classes: \p{L}, \p{N}, \s, and everything else */
enum { CLS_L = MOETAX_UNI_L, CLS_N = MOETAX_UNI_N, CLS_S = MOETAX_UNI_S, CLS_O = MOETAX_UNI_O };

/* pre-tokenizer rule sets (see "the other pre-tokenizers" below) */
enum pre_type { PRE_GPT2, PRE_LLAMA3, PRE_QWEN2, PRE_DEEPSEEK_LLM, PRE_DEEPSEEK_CODER, PRE_DEEPSEEK3 };

/* Short pre-tokens use a plain scan; longer ones a heap. */
#define BPE_SCAN_MAX 48
/* Longest run of bytes merged as one (symbol indices are int32). */
#define BPE_WORD_MAX ((size_t)1 << 30)

struct merge_slot {
    uint64_t key; /* (left << 32) | right; SLOT_EMPTY when free */
    int32_t rank;
    int32_t result;
};
#define SLOT_EMPTY UINT64_MAX

struct moetax_tokenizer {
    int32_t n_vocab;
    int32_t bos, eos, eot, eom; /* -1: none */
    bool add_bos;
    int8_t *type;     /* [n_vocab] token_type (values outside 0..6 stored as 0) */
    size_t *dec_off;  /* [n_vocab + 1] decoded bytes of token i: dec[dec_off[i] .. dec_off[i+1]) */
    char *dec;
    int32_t byte_tok[256];
    struct merge_slot *merges;
    uint64_t merge_mask; /* capacity - 1 (power of two) */
    int pre;             /* enum pre_type */
    int32_t *udef;       /* [n_udef] user-defined token ids, longest text first */
    int32_t n_udef;
    /* SentencePiece ("llama") vocabularies */
    bool spm;
    bool space_prefix;   /* tokenizer.ggml.add_space_prefix (default true) */
    int32_t unk;         /* tokenizer.ggml.unknown_token_id, -1: none */
    float *score;        /* [n_vocab] tokenizer.ggml.scores (0 without the key) */
    char *raw;           /* token texts as in the file: raw[raw_off[i] .. raw_off[i+1]) */
    size_t *raw_off;     /* [n_vocab + 1] */
    int32_t *tmap;       /* raw text -> id (open addressing, -1: empty) */
    uint64_t tmap_mask;
    /* llama3's ignore_merges: decoded bytes -> id of normal/byte/user tokens */
    bool ignore_merges;
    int32_t *wmap;
    uint64_t wmap_mask;
};

/* ---- GPT-2 byte <-> unicode ------------------------------------------------ */

static bool byte_is_printable(int b) {
    return (b >= 0x21 && b <= 0x7e) || (b >= 0xa1 && b <= 0xac) || (b >= 0xae && b <= 0xff);
}

/* byte -> code point, and code point (< 0x144) -> byte or -1 */
static void byte_unicode_tables(int b2u[256], int u2b[0x144]) {
    for (int c = 0; c < 0x144; c++) u2b[c] = -1;
    int n = 0;
    for (int b = 0; b < 256; b++) {
        b2u[b] = byte_is_printable(b) ? b : 0x100 + n++;
        u2b[b2u[b]] = b;
    }
}

static int put_utf8(char *o, int cp) {
    if (cp < 0x80) { o[0] = (char)cp; return 1; }
    o[0] = (char)(0xc0 | (cp >> 6)); /* cp < 0x800 here */
    o[1] = (char)(0x80 | (cp & 0x3f));
    return 2;
}

/* Decode one UTF-8 code point at s[0..n); returns its length, or 0 if the
 * bytes there are not a valid (shortest-form) sequence. */
static int utf8_next(const unsigned char *s, size_t n, int *cp) {
    unsigned c = s[0];
    if (c < 0x80) { *cp = (int)c; return 1; }
    int len, v;
    if ((c & 0xe0) == 0xc0) { len = 2; v = (int)(c & 0x1f); }
    else if ((c & 0xf0) == 0xe0) { len = 3; v = (int)(c & 0x0f); }
    else if ((c & 0xf8) == 0xf0) { len = 4; v = (int)(c & 0x07); }
    else return 0;
    if ((size_t)len > n) return 0;
    for (int i = 1; i < len; i++) {
        if ((s[i] & 0xc0) != 0x80) return 0;
        v = (v << 6) | (int)(s[i] & 0x3f);
    }
    static const int min_cp[5] = {0, 0, 0x80, 0x800, 0x10000};
    if (v < min_cp[len] || v > 0x10ffff || (v >= 0xd800 && v <= 0xdfff)) return 0;
    *cp = v;
    return len;
}

/* ---- hashing ------------------------------------------------------------------ */

static uint64_t hash_bytes(const char *p, size_t n) {
    uint64_t h = 1469598103934665603ull; /* FNV-1a */
    for (size_t i = 0; i < n; i++) h = (h ^ (unsigned char)p[i]) * 1099511628211ull;
    return h ^ (h >> 29);
}

static uint64_t hash_pair(uint64_t k) {
    k ^= k >> 33;
    k *= 0xff51afd7ed558ccdull;
    k ^= k >> 33;
    k *= 0xc4ceb9fe1a85ec53ull;
    return k ^ (k >> 33);
}

static uint64_t pow2_at_least(uint64_t n) {
    uint64_t c = 16;
    while (c < n) c <<= 1;
    return c;
}

/* token text -> id, for load only; strings point into the GGUF mapping */
struct str_map {
    int32_t *slot; /* -1: empty */
    uint64_t mask;
    const struct moetax_gguf_str *strs;
};

static int32_t str_map_find(const struct str_map *m, const char *p, size_t n) {
    for (uint64_t h = hash_bytes(p, n) & m->mask;; h = (h + 1) & m->mask) {
        int32_t id = m->slot[h];
        if (id < 0) return -1;
        const struct moetax_gguf_str *s = &m->strs[id];
        if (s->len == n && (n == 0 || memcmp(s->data, p, n) == 0)) return id;
    }
}

/* Later duplicates replace earlier ones (llama.cpp's token_to_id does the same). */
static void str_map_put(struct str_map *m, int32_t id) {
    const struct moetax_gguf_str *s = &m->strs[id];
    for (uint64_t h = hash_bytes(s->data, (size_t)s->len) & m->mask;; h = (h + 1) & m->mask) {
        int32_t o = m->slot[h];
        if (o < 0 || (m->strs[o].len == s->len && (s->len == 0 || memcmp(m->strs[o].data, s->data, (size_t)s->len) == 0))) {
            m->slot[h] = id;
            return;
        }
    }
}

static const struct merge_slot *merge_find(const struct moetax_tokenizer *t, int32_t a, int32_t b) {
    uint64_t key = ((uint64_t)(uint32_t)a << 32) | (uint32_t)b;
    for (uint64_t h = hash_pair(key) & t->merge_mask;; h = (h + 1) & t->merge_mask) {
        const struct merge_slot *s = &t->merges[h];
        if (s->key == key) return s;
        if (s->key == SLOT_EMPTY) return NULL;
    }
}

/* ---- load ----------------------------------------------------------------------- */

static bool type_is_hidden(int type) {
    return type == MOETAX_TOKEN_TYPE_CONTROL || type == MOETAX_TOKEN_TYPE_UNUSED ||
           type == MOETAX_TOKEN_TYPE_UNKNOWN;
}

/* Print at most 48 bytes of a string for a message. */
#define SHOWN(n) ((int)((n) > 48 ? 48 : (n)))

static moetax_status read_token_id(const struct moetax_gguf *g, const char *key, int32_t n_vocab, int32_t *out) {
    *out = -1;
    const struct moetax_gguf_kv *kv = moetax_gguf_find_kv(g, key);
    if (!kv) return MOETAX_OK;
    int64_t v;
    if (moetax_gguf_get_i64(g, key, &v) != MOETAX_OK)
        return moetax_error(MOETAX_ERR_FORMAT, "%s: %s: expected an integer token id, found %s", g->path, key,
                            moetax_gguf_type_name(kv->type));
    if (v == -1) return MOETAX_OK;
    if (v < 0 || v >= n_vocab)
        return moetax_error(MOETAX_ERR_FORMAT, "%s: %s = %lld is out of range (the vocabulary has %d tokens)",
                            g->path, key, (long long)v, (int)n_vocab);
    *out = (int32_t)v;
    return MOETAX_OK;
}

static void decode_token_text(struct moetax_tokenizer *t, const int u2b[0x144], int32_t id,
                              const struct moetax_gguf_str *s, size_t *pos) {
    int type = t->type[id];
    const unsigned char *p = (const unsigned char *)s->data;
    size_t n = (size_t)s->len, o = *pos;
    if (type_is_hidden(type)) {
        /* nothing */
    } else if (type == MOETAX_TOKEN_TYPE_USER_DEFINED) {
        memcpy(t->dec + o, p, n);
        o += n;
    } else {
        for (size_t i = 0; i < n;) {
            int cp, l = utf8_next(p + i, n - i, &cp);
            if (l == 0) { t->dec[o++] = (char)p[i++]; continue; } /* invalid UTF-8: copy the byte */
            if (cp < 0x144 && u2b[cp] >= 0) t->dec[o++] = (char)u2b[cp];
            else { memcpy(t->dec + o, p + i, (size_t)l); o += (size_t)l; } /* outside the mapping: as is */
            i += (size_t)l;
        }
    }
    t->dec_off[id + 1] = o;
    *pos = o;
}

static moetax_status load_merges(struct moetax_tokenizer *t, const struct moetax_gguf *g, const struct str_map *map) {
    const struct moetax_gguf_kv *kv = moetax_gguf_find_kv(g, KEY_MERGES);
    if (!kv) return moetax_error(MOETAX_ERR_NOT_FOUND, "%s: %s is missing (required for tokenizer model \"gpt2\")", g->path, KEY_MERGES);
    if (kv->type != MOETAX_GGUF_TYPE_ARRAY || kv->arr_type != MOETAX_GGUF_TYPE_STRING)
        return moetax_error(MOETAX_ERR_FORMAT, "%s: %s: expected an array of strings, found %s%s%s", g->path, KEY_MERGES,
                            moetax_gguf_type_name(kv->type), kv->type == MOETAX_GGUF_TYPE_ARRAY ? " of " : "",
                            kv->type == MOETAX_GGUF_TYPE_ARRAY ? moetax_gguf_type_name(kv->arr_type) : "");
    if (kv->arr_n > (uint64_t)INT32_MAX)
        return moetax_error(MOETAX_ERR_FORMAT, "%s: %s: %llu merges do not fit in int32", g->path, KEY_MERGES,
                            (unsigned long long)kv->arr_n);
    uint64_t cap = pow2_at_least(kv->arr_n * 2 + 1);
    t->merges = malloc(cap * sizeof *t->merges);
    if (!t->merges) return moetax_error(MOETAX_ERR_NOMEM, "out of memory for %llu merges", (unsigned long long)kv->arr_n);
    t->merge_mask = cap - 1;
    for (uint64_t i = 0; i < cap; i++) t->merges[i].key = SLOT_EMPTY;

    size_t joined_cap = 256;
    char *joined = malloc(joined_cap);
    if (!joined) return moetax_error(MOETAX_ERR_NOMEM, "out of memory reading %s", KEY_MERGES);
    moetax_status st = MOETAX_OK;
    for (uint64_t i = 0; i < kv->arr_n; i++) {
        const struct moetax_gguf_str *m = &kv->arr_str[i];
        size_t n = (size_t)m->len;
        /* split at the first space after the first byte, as llama.cpp does */
        const char *sp = n > 1 ? memchr(m->data + 1, ' ', n - 1) : NULL;
        if (!sp || sp + 1 == m->data + n) {
            st = moetax_error(MOETAX_ERR_FORMAT, "%s: %s[%llu] = \"%.*s\": expected \"left right\"", g->path, KEY_MERGES,
                              (unsigned long long)i, SHOWN(n), m->data);
            break;
        }
        size_t nl = (size_t)(sp - m->data), nr = n - nl - 1;
        int32_t a = str_map_find(map, m->data, nl), b = str_map_find(map, sp + 1, nr);
        if (a < 0 || b < 0) {
            bool left = a < 0;
            st = moetax_error(MOETAX_ERR_FORMAT, "%s: %s[%llu] = \"%.*s\": %s part \"%.*s\" is not a token in %s", g->path,
                              KEY_MERGES, (unsigned long long)i, SHOWN(n), m->data, left ? "left" : "right",
                              SHOWN(left ? nl : nr), left ? m->data : sp + 1, KEY_TOKENS);
            break;
        }
        if (nl + nr > joined_cap) {
            while (joined_cap < nl + nr) joined_cap *= 2;
            char *nj = realloc(joined, joined_cap);
            if (!nj) { st = moetax_error(MOETAX_ERR_NOMEM, "out of memory reading %s", KEY_MERGES); break; }
            joined = nj;
        }
        memcpy(joined, m->data, nl);
        memcpy(joined + nl, sp + 1, nr);
        int32_t r = str_map_find(map, joined, nl + nr);
        if (r < 0) {
            st = moetax_error(MOETAX_ERR_FORMAT, "%s: %s[%llu] = \"%.*s\": the joined text \"%.*s\" is not a token in %s",
                              g->path, KEY_MERGES, (unsigned long long)i, SHOWN(n), m->data, SHOWN(nl + nr), joined,
                              KEY_TOKENS);
            break;
        }
        if (type_is_hidden(t->type[r])) continue; /* never produce control/unused/unknown tokens */
        uint64_t key = ((uint64_t)(uint32_t)a << 32) | (uint32_t)b;
        for (uint64_t h = hash_pair(key) & t->merge_mask;; h = (h + 1) & t->merge_mask) {
            struct merge_slot *s = &t->merges[h];
            if (s->key == key) break; /* duplicate pair: the lower rank stays */
            if (s->key == SLOT_EMPTY) {
                s->key = key;
                s->rank = (int32_t)i;
                s->result = r;
                break;
            }
        }
    }
    free(joined);
    return st;
}

/* ---- byte strings in an arena -> id (SPM texts, ignore_merges words) ---------- */

static int32_t arena_find(const int32_t *slot, uint64_t mask, const char *arena, const size_t *off, const char *p,
                          size_t n) {
    for (uint64_t h = hash_bytes(p, n) & mask;; h = (h + 1) & mask) {
        int32_t id = slot[h];
        if (id < 0) return -1;
        if (off[id + 1] - off[id] == n && (n == 0 || memcmp(arena + off[id], p, n) == 0)) return id;
    }
}

/* Map the ids for which keep(t, id) holds; later duplicates replace earlier ones. */
static moetax_status arena_map_build(const struct moetax_tokenizer *t, const char *arena, const size_t *off,
                                     bool (*keep)(const struct moetax_tokenizer *, int32_t), int32_t **slot_out,
                                     uint64_t *mask_out) {
    uint64_t cap = pow2_at_least((uint64_t)t->n_vocab * 2 + 1);
    int32_t *slot = malloc(cap * sizeof *slot);
    if (!slot) return moetax_error(MOETAX_ERR_NOMEM, "out of memory for the token map");
    memset(slot, 0xff, cap * sizeof *slot);
    uint64_t mask = cap - 1;
    for (int32_t id = 0; id < t->n_vocab; id++) {
        if (keep && !keep(t, id)) continue;
        const char *p = arena + off[id];
        size_t n = off[id + 1] - off[id];
        for (uint64_t h = hash_bytes(p, n) & mask;; h = (h + 1) & mask) {
            int32_t o = slot[h];
            if (o < 0 || (off[o + 1] - off[o] == n && (n == 0 || memcmp(arena + off[o], p, n) == 0))) {
                slot[h] = id;
                break;
            }
        }
    }
    *slot_out = slot;
    *mask_out = mask;
    return MOETAX_OK;
}

/* ---- SentencePiece load ------------------------------------------------------------ */

static int hex_digit(int c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    return -1;
}

/* Decoded bytes of an SPM token (llama.cpp's token_to_piece, special = false):
 * normal and undefined: the text with U+2581 back to a space; byte: the byte of
 * "<0xXX>"; user-defined: the text; control, unused, unknown: nothing. */
static void decode_spm_text(struct moetax_tokenizer *t, int32_t id, const unsigned char *p, size_t n, size_t *pos) {
    int type = t->type[id];
    size_t o = *pos;
    if (type_is_hidden(type)) {
        /* nothing */
    } else if (type == MOETAX_TOKEN_TYPE_BYTE) {
        int hi = n == 6 ? hex_digit(p[3]) : -1, lo = n == 6 ? hex_digit(p[4]) : -1;
        if (hi >= 0 && lo >= 0 && !memcmp(p, "<0x", 3) && p[5] == '>') t->dec[o++] = (char)(hi * 16 + lo);
    } else if (type == MOETAX_TOKEN_TYPE_USER_DEFINED) {
        memcpy(t->dec + o, p, n);
        o += n;
    } else {
        for (size_t i = 0; i < n;) {
            if (i + 3 <= n && p[i] == 0xe2 && p[i + 1] == 0x96 && p[i + 2] == 0x81) {
                t->dec[o++] = ' ';
                i += 3;
            } else {
                t->dec[o++] = (char)p[i++];
            }
        }
    }
    t->dec_off[id + 1] = o;
    *pos = o;
}

static moetax_status load_spm(struct moetax_tokenizer *t, const struct moetax_gguf *g, const struct moetax_gguf_str *strs) {
    int32_t n = t->n_vocab;
    moetax_status st;
    if ((st = read_token_id(g, "tokenizer.ggml.unknown_token_id", n, &t->unk))) return st;
    t->space_prefix = true;
    const struct moetax_gguf_kv *sp = moetax_gguf_find_kv(g, KEY_SPACE_PREFIX);
    if (sp) {
        if (sp->type != MOETAX_GGUF_TYPE_BOOL)
            return moetax_error(MOETAX_ERR_FORMAT, "%s: %s: expected bool, found %s", g->path, KEY_SPACE_PREFIX,
                                moetax_gguf_type_name(sp->type));
        t->space_prefix = sp->v.u64 != 0;
    }
    t->score = calloc((size_t)n, sizeof *t->score);
    if (!t->score) return moetax_error(MOETAX_ERR_NOMEM, "out of memory for %d token scores", (int)n);
    const struct moetax_gguf_kv *sk = moetax_gguf_find_kv(g, KEY_SCORES);
    if (sk) {
        if (sk->type != MOETAX_GGUF_TYPE_ARRAY ||
            (sk->arr_type != MOETAX_GGUF_TYPE_FLOAT32 && sk->arr_type != MOETAX_GGUF_TYPE_FLOAT64))
            return moetax_error(MOETAX_ERR_FORMAT, "%s: %s: expected an array of float32, found %s%s%s", g->path,
                                KEY_SCORES, moetax_gguf_type_name(sk->type), sk->type == MOETAX_GGUF_TYPE_ARRAY ? " of " : "",
                                sk->type == MOETAX_GGUF_TYPE_ARRAY ? moetax_gguf_type_name(sk->arr_type) : "");
        if (sk->arr_n != (uint64_t)n)
            return moetax_error(MOETAX_ERR_FORMAT, "%s: %s has %llu entries, expected %d (one per token)", g->path,
                                KEY_SCORES, (unsigned long long)sk->arr_n, (int)n);
        for (int32_t i = 0; i < n; i++) {
            if (sk->arr_type == MOETAX_GGUF_TYPE_FLOAT32) memcpy(&t->score[i], (const char *)sk->arr_data + 4 * (size_t)i, 4);
            else {
                double d;
                memcpy(&d, (const char *)sk->arr_data + 8 * (size_t)i, 8);
                t->score[i] = (float)d;
            }
        }
    }
    size_t total = 0;
    for (int32_t i = 0; i < n; i++) total += (size_t)strs[i].len;
    t->raw = malloc(total + 1);
    t->raw_off = malloc(((size_t)n + 1) * sizeof *t->raw_off);
    t->dec = malloc(total + 1);
    t->dec_off = malloc(((size_t)n + 1) * sizeof *t->dec_off);
    if (!t->raw || !t->raw_off || !t->dec || !t->dec_off)
        return moetax_error(MOETAX_ERR_NOMEM, "out of memory for %d tokens", (int)n);
    t->raw_off[0] = t->dec_off[0] = 0;
    size_t pos = 0;
    for (int32_t i = 0; i < n; i++) {
        size_t l = (size_t)strs[i].len;
        if (l) memcpy(t->raw + t->raw_off[i], strs[i].data, l);
        t->raw_off[i + 1] = t->raw_off[i] + l;
        decode_spm_text(t, i, (const unsigned char *)strs[i].data, l, &pos);
    }
    if ((st = arena_map_build(t, t->raw, t->raw_off, NULL, &t->tmap, &t->tmap_mask))) return st;
    /* byte fallback: "<0xXX>", else the byte itself as a token (llama.cpp's byte_to_token), else unk */
    for (int b = 0; b < 256; b++) {
        static const char hex[] = "0123456789ABCDEF";
        char txt[6] = {'<', '0', 'x', hex[b >> 4], hex[b & 15], '>'};
        int32_t id = arena_find(t->tmap, t->tmap_mask, t->raw, t->raw_off, txt, 6);
        if (id < 0) {
            char c = (char)b;
            id = arena_find(t->tmap, t->tmap_mask, t->raw, t->raw_off, &c, 1);
        }
        if (id < 0) id = t->unk;
        if (id < 0)
            return moetax_error(MOETAX_ERR_FORMAT,
                                "%s: %s: no byte token \"<0x%02X>\" (nor a one-byte token, nor an unknown token) for "
                                "byte 0x%02x; an SPM vocabulary needs byte fallback for every byte",
                                g->path, KEY_TOKENS, b, b);
        t->byte_tok[b] = id;
    }
    return MOETAX_OK;
}

static moetax_status load_gpt2(struct moetax_tokenizer *t, const struct moetax_gguf *g) {
    const struct moetax_gguf_kv *kv = moetax_gguf_find_kv(g, KEY_TOKENS);
    if (!kv) return moetax_error(MOETAX_ERR_NOT_FOUND, "%s: %s is missing", g->path, KEY_TOKENS);
    if (kv->type != MOETAX_GGUF_TYPE_ARRAY || kv->arr_type != MOETAX_GGUF_TYPE_STRING)
        return moetax_error(MOETAX_ERR_FORMAT, "%s: %s: expected an array of strings, found %s%s%s", g->path, KEY_TOKENS,
                            moetax_gguf_type_name(kv->type), kv->type == MOETAX_GGUF_TYPE_ARRAY ? " of " : "",
                            kv->type == MOETAX_GGUF_TYPE_ARRAY ? moetax_gguf_type_name(kv->arr_type) : "");
    if (kv->arr_n == 0) return moetax_error(MOETAX_ERR_FORMAT, "%s: %s is empty", g->path, KEY_TOKENS);
    if (kv->arr_n > (uint64_t)INT32_MAX)
        return moetax_error(MOETAX_ERR_FORMAT, "%s: %s: %llu tokens do not fit in int32", g->path, KEY_TOKENS,
                            (unsigned long long)kv->arr_n);
    int32_t n = (int32_t)kv->arr_n;
    const struct moetax_gguf_str *strs = kv->arr_str;
    t->n_vocab = n;

    /* token types */
    t->type = malloc((size_t)n);
    if (!t->type) return moetax_error(MOETAX_ERR_NOMEM, "out of memory for %d token types", (int)n);
    memset(t->type, MOETAX_TOKEN_TYPE_NORMAL, (size_t)n);
    const struct moetax_gguf_kv *tk = moetax_gguf_find_kv(g, KEY_TYPES);
    if (tk) {
        bool int_arr = tk->type == MOETAX_GGUF_TYPE_ARRAY && tk->arr_type != MOETAX_GGUF_TYPE_STRING &&
                       tk->arr_type != MOETAX_GGUF_TYPE_ARRAY && tk->arr_type != MOETAX_GGUF_TYPE_FLOAT32 &&
                       tk->arr_type != MOETAX_GGUF_TYPE_FLOAT64 && tk->arr_type != MOETAX_GGUF_TYPE_BOOL;
        if (!int_arr)
            return moetax_error(MOETAX_ERR_FORMAT, "%s: %s: expected an array of integers, found %s%s%s", g->path,
                                KEY_TYPES, moetax_gguf_type_name(tk->type), tk->type == MOETAX_GGUF_TYPE_ARRAY ? " of " : "",
                                tk->type == MOETAX_GGUF_TYPE_ARRAY ? moetax_gguf_type_name(tk->arr_type) : "");
        if (tk->arr_n != (uint64_t)n)
            return moetax_error(MOETAX_ERR_FORMAT, "%s: %s has %llu entries, expected %d (one per token)", g->path,
                                KEY_TYPES, (unsigned long long)tk->arr_n, (int)n);
        for (int32_t i = 0; i < n; i++) {
            int64_t v = 0;
            if (!moetax_gguf_arr_i64(tk, (uint64_t)i, &v)) v = 0;
            t->type[i] = (int8_t)(v >= 0 && v <= MOETAX_TOKEN_TYPE_BYTE ? v : MOETAX_TOKEN_TYPE_UNDEFINED);
        }
    }

    /* special ids and add_bos */
    moetax_status st;
    if ((st = read_token_id(g, "tokenizer.ggml.bos_token_id", n, &t->bos))) return st;
    if ((st = read_token_id(g, "tokenizer.ggml.eos_token_id", n, &t->eos))) return st;
    if ((st = read_token_id(g, "tokenizer.ggml.eot_token_id", n, &t->eot))) return st;
    if ((st = read_token_id(g, "tokenizer.ggml.eom_token_id", n, &t->eom))) return st;
    const struct moetax_gguf_kv *ab = moetax_gguf_find_kv(g, KEY_ADD_BOS);
    if (ab) {
        if (ab->type != MOETAX_GGUF_TYPE_BOOL)
            return moetax_error(MOETAX_ERR_FORMAT, "%s: %s: expected bool, found %s", g->path, KEY_ADD_BOS,
                                moetax_gguf_type_name(ab->type));
        t->add_bos = ab->v.u64 != 0;
    } else if (t->spm) {
        t->add_bos = true; /* llama.cpp's default for SPM */
    } else {
        static const char *const bos_pre[] = {"llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1",
                                              "pixtral", "midm-2.0", "lfm2", "tekken", "chameleon"};
        const struct moetax_gguf_kv *pk = moetax_gguf_find_kv(g, KEY_PRE);
        if (pk && pk->type == MOETAX_GGUF_TYPE_STRING)
            for (size_t i = 0; i < sizeof bos_pre / sizeof bos_pre[0]; i++)
                if (pk->v.str.len == strlen(bos_pre[i]) && memcmp(pk->v.str.data, bos_pre[i], strlen(bos_pre[i])) == 0)
                    t->add_bos = true;
    }
    if (t->bos < 0) t->add_bos = false;
    if (t->spm) return load_spm(t, g, strs);

    /* decoded bytes: never longer than the token text */
    int b2u[256], u2b[0x144];
    byte_unicode_tables(b2u, u2b);
    size_t total = 0;
    for (int32_t i = 0; i < n; i++) total += (size_t)strs[i].len; /* inside the file: no overflow */
    t->dec_off = malloc(((size_t)n + 1) * sizeof *t->dec_off);
    t->dec = malloc(total + 1);
    if (!t->dec_off || !t->dec) return moetax_error(MOETAX_ERR_NOMEM, "out of memory for %d tokens", (int)n);
    t->dec_off[0] = 0;
    size_t pos = 0;
    for (int32_t i = 0; i < n; i++) decode_token_text(t, u2b, i, &strs[i], &pos);

    /* text -> id */
    struct str_map map = {.strs = strs};
    uint64_t cap = pow2_at_least((uint64_t)n * 2 + 1);
    map.slot = malloc(cap * sizeof *map.slot);
    if (!map.slot) return moetax_error(MOETAX_ERR_NOMEM, "out of memory for the token map");
    map.mask = cap - 1;
    memset(map.slot, 0xff, cap * sizeof *map.slot);
    for (int32_t i = 0; i < n; i++) str_map_put(&map, i);

    /* byte tokens */
    for (int b = 0; b < 256; b++) {
        char txt[4];
        int l = put_utf8(txt, b2u[b]);
        int32_t id = str_map_find(&map, txt, (size_t)l);
        if (id < 0 || type_is_hidden(t->type[id])) {
            free(map.slot);
            return moetax_error(MOETAX_ERR_FORMAT,
                                "%s: %s: %s for byte 0x%02x (text \"%.*s\"); a gpt2 vocabulary needs all 256 byte tokens",
                                g->path, KEY_TOKENS, id < 0 ? "no token" : "only a control/unused/unknown token", b, l, txt);
        }
        t->byte_tok[b] = id;
    }
    st = load_merges(t, g, &map);
    free(map.slot);
    return st;
}

/* tokenizer.ggml.pre -> rule set, as llama.cpp maps the names
 * (llama_vocab::impl::load). Names whose rules moetax lacks are warned about on
 * stderr (once per process), naming the value and the rule used instead (GPT-2's). */
struct pre_name {
    const char *name;
    int pre;
};
static const struct pre_name pre_names[] = {
    {"default", PRE_GPT2}, {"gpt2", PRE_GPT2}, {"gpt-2", PRE_GPT2}, {"phi-2", PRE_GPT2}, {"olmo", PRE_GPT2},
    {"mpt", PRE_GPT2}, {"jina-es", PRE_GPT2}, {"jina-de", PRE_GPT2}, {"gigachat", PRE_GPT2},
    {"jina-v2-es", PRE_GPT2}, {"jina-v2-de", PRE_GPT2}, {"a.x-4.0", PRE_GPT2}, {"mellum", PRE_GPT2},
    {"modern-bert", PRE_GPT2}, {"jina-v1-en", PRE_GPT2}, {"jina-v2-code", PRE_GPT2}, {"roberta-bpe", PRE_GPT2},
    {"llama3", PRE_LLAMA3}, {"llama-v3", PRE_LLAMA3}, {"llama-bpe", PRE_LLAMA3}, {"falcon3", PRE_LLAMA3},
    {"falcon-h1", PRE_LLAMA3}, {"pixtral", PRE_LLAMA3}, {"midm-2.0", PRE_LLAMA3}, {"lfm2", PRE_LLAMA3},
    {"dbrx", PRE_LLAMA3}, {"smaug-bpe", PRE_LLAMA3},
    {"qwen2", PRE_QWEN2}, {"deepseek-r1-qwen", PRE_QWEN2}, {"kormo", PRE_QWEN2}, {"f2llmv2", PRE_QWEN2},
    {"megrez", PRE_QWEN2}, {"stablelm2", PRE_QWEN2}, {"hunyuan", PRE_QWEN2}, {"solar-open", PRE_QWEN2},
    {"deepseek-llm", PRE_DEEPSEEK_LLM}, {"deepseek-coder", PRE_DEEPSEEK_CODER}, {"deepseek-v3", PRE_DEEPSEEK3},
};

static int pre_from_file(const struct moetax_gguf *g) {
    static atomic_flag warned = ATOMIC_FLAG_INIT;
    const struct moetax_gguf_kv *pk = moetax_gguf_find_kv(g, KEY_PRE);
    if (!pk) return PRE_GPT2;
    if (pk->type == MOETAX_GGUF_TYPE_STRING)
        for (size_t i = 0; i < sizeof pre_names / sizeof pre_names[0]; i++)
            if (pk->v.str.len == strlen(pre_names[i].name) && !memcmp(pk->v.str.data, pre_names[i].name, pk->v.str.len))
                return pre_names[i].pre;
    if (atomic_flag_test_and_set(&warned)) return PRE_GPT2;
    if (pk->type == MOETAX_GGUF_TYPE_STRING)
        fprintf(stderr, "moetax: warning: %s: %s = \"%.*s\" is not implemented; moetax pre-tokenizes with GPT-2's "
                        "rules ('s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+) "
                        "instead, so its tokens may differ from the model's tokenizer\n",
                g->path, KEY_PRE, SHOWN(pk->v.str.len), pk->v.str.data);
    else
        fprintf(stderr, "moetax: warning: %s: %s is a %s, not a string; moetax pre-tokenizes with GPT-2's rules\n",
                g->path, KEY_PRE, moetax_gguf_type_name(pk->type));
    return PRE_GPT2;
}

/* llama.cpp sets ignore_merges for these tokenizer.ggml.pre values (its LLAMA3 type). */
static bool pre_ignores_merges(const struct moetax_gguf *g) {
    static const char *const names[] = {"llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1",
                                        "pixtral", "midm-2.0", "lfm2"};
    const struct moetax_gguf_kv *pk = moetax_gguf_find_kv(g, KEY_PRE);
    if (!pk || pk->type != MOETAX_GGUF_TYPE_STRING) return false;
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
        if (pk->v.str.len == strlen(names[i]) && !memcmp(pk->v.str.data, names[i], pk->v.str.len)) return true;
    return false;
}

/* A pre-token that is the text of one of these tokens is emitted whole
 * (ignore_merges). Control, unused and unknown tokens decode to "" and are
 * never looked up. */
static bool word_keep(const struct moetax_tokenizer *t, int32_t id) {
    return !type_is_hidden(t->type[id]) && t->dec_off[id + 1] > t->dec_off[id];
}

/* User-defined tokens are cut out of the text before pre-tokenization, longest
 * text first, ties by id (llama.cpp's tokenizer_st_partition with
 * parse_special = false). */
struct udef_key {
    size_t len;
    int32_t id;
};
static int udef_cmp(const void *a, const void *b) {
    const struct udef_key *x = a, *y = b;
    if (x->len != y->len) return x->len > y->len ? -1 : 1;
    return x->id < y->id ? -1 : x->id > y->id;
}

static moetax_status load_udef(struct moetax_tokenizer *t) {
    int32_t n = 0;
    for (int32_t i = 0; i < t->n_vocab; i++)
        if (t->type[i] == MOETAX_TOKEN_TYPE_USER_DEFINED && t->dec_off[i + 1] > t->dec_off[i]) n++;
    if (n == 0) return MOETAX_OK;
    t->udef = malloc((size_t)n * sizeof *t->udef);
    struct udef_key *k = malloc((size_t)n * sizeof *k);
    if (!t->udef || !k) {
        free(k);
        return moetax_error(MOETAX_ERR_NOMEM, "out of memory for %d user-defined tokens", (int)n);
    }
    for (int32_t i = 0, m = 0; i < t->n_vocab; i++)
        if (t->type[i] == MOETAX_TOKEN_TYPE_USER_DEFINED && t->dec_off[i + 1] > t->dec_off[i])
            k[m++] = (struct udef_key){t->dec_off[i + 1] - t->dec_off[i], i};
    qsort(k, (size_t)n, sizeof *k, udef_cmp);
    for (int32_t i = 0; i < n; i++) t->udef[i] = k[i].id;
    t->n_udef = n;
    free(k);
    return MOETAX_OK;
}

moetax_status moetax_tokenizer_load(const struct moetax_gguf *g, struct moetax_tokenizer **out) {
    *out = NULL;
    const struct moetax_gguf_kv *mk = moetax_gguf_find_kv(g, KEY_MODEL);
    if (!mk) return moetax_error(MOETAX_ERR_NOT_FOUND, "%s: %s is missing (no tokenizer in this file)", g->path, KEY_MODEL);
    if (mk->type != MOETAX_GGUF_TYPE_STRING)
        return moetax_error(MOETAX_ERR_FORMAT, "%s: %s: expected a string, found %s", g->path, KEY_MODEL,
                            moetax_gguf_type_name(mk->type));
    const struct moetax_gguf_str *model = &mk->v.str;
    bool spm = model->len == 5 && memcmp(model->data, "llama", 5) == 0;
    if (!spm && !(model->len == 4 && memcmp(model->data, "gpt2", 4) == 0)) {
        const char *what = "";
        if (model->len == 4 && memcmp(model->data, "bert", 4) == 0) what = " (WordPiece)";
        else if (model->len == 2 && memcmp(model->data, "t5", 2) == 0) what = " (Unigram)";
        return moetax_error(MOETAX_ERR_UNSUPPORTED,
                            "%s: %s = \"%.*s\"%s is not supported; moetax supports \"gpt2\" (byte-level BPE) and "
                            "\"llama\" (SentencePiece)",
                            g->path, KEY_MODEL, SHOWN(model->len), model->data, what);
    }
    int pre = spm ? PRE_GPT2 : pre_from_file(g);
    struct moetax_tokenizer *t = calloc(1, sizeof *t);
    if (!t) return moetax_error(MOETAX_ERR_NOMEM, "out of memory for the tokenizer");
    t->bos = t->eos = t->eot = t->eom = t->unk = -1;
    t->pre = pre;
    t->spm = spm;
    t->ignore_merges = !spm && pre_ignores_merges(g);
    moetax_status st = load_gpt2(t, g);
    if (!st) st = load_udef(t);
    if (!st && t->ignore_merges) st = arena_map_build(t, t->dec, t->dec_off, word_keep, &t->wmap, &t->wmap_mask);
    if (st) {
        moetax_tokenizer_free(t);
        return st;
    }
    *out = t;
    return MOETAX_OK;
}

void moetax_tokenizer_free(struct moetax_tokenizer *t) {
    if (!t) return;
    free(t->type);
    free(t->dec_off);
    free(t->dec);
    free(t->merges);
    free(t->udef);
    free(t->score);
    free(t->raw);
    free(t->raw_off);
    free(t->tmap);
    free(t->wmap);
    free(t);
}

int32_t moetax_tokenizer_n_vocab(const struct moetax_tokenizer *t) { return t->n_vocab; }
int32_t moetax_tokenizer_bos(const struct moetax_tokenizer *t) { return t->bos; }
int32_t moetax_tokenizer_eos(const struct moetax_tokenizer *t) { return t->eos; }
bool moetax_tokenizer_add_bos(const struct moetax_tokenizer *t) { return t->add_bos; }

bool moetax_tokenizer_is_eog(const struct moetax_tokenizer *t, int32_t tok) {
    return tok >= 0 && tok < t->n_vocab && (tok == t->eos || tok == t->eot || tok == t->eom);
}

int32_t moetax_tokenizer_token_type(const struct moetax_tokenizer *t, int32_t tok) {
    return tok >= 0 && tok < t->n_vocab ? t->type[tok] : -1;
}

/* ---- encode ----------------------------------------------------------------------- */

struct sym {
    int32_t id;
    int32_t prev, next; /* -1 at the ends; prev == -2: merged away */
};

struct cand {
    int32_t rank;
    int32_t left, right; /* symbol indices */
    int32_t a, b;        /* their ids when pushed (stale if they changed) */
};

struct bpe_scratch {
    struct sym *sym;
    struct cand *heap;
    int32_t *ids, *rank;
    size_t cap;      /* symbols */
    size_t heap_cap; /* entries */
};

struct emitter {
    int32_t *out;
    int64_t cap, n;
};

static inline void emit(struct emitter *e, int32_t id) {
    if (e->n < e->cap) e->out[e->n] = id;
    e->n++;
}

static bool cand_less(const struct cand *x, const struct cand *y) {
    return x->rank < y->rank || (x->rank == y->rank && x->left < y->left);
}

static void heap_push(struct cand *h, size_t *n, struct cand c) {
    size_t i = (*n)++;
    while (i > 0) {
        size_t p = (i - 1) / 2;
        if (!cand_less(&c, &h[p])) break;
        h[i] = h[p];
        i = p;
    }
    h[i] = c;
}

static struct cand heap_pop(struct cand *h, size_t *n) {
    struct cand top = h[0], last = h[--(*n)];
    size_t i = 0, m = *n;
    for (;;) {
        size_t c = 2 * i + 1;
        if (c >= m) break;
        if (c + 1 < m && cand_less(&h[c + 1], &h[c])) c++;
        if (!cand_less(&h[c], &last)) break;
        h[i] = h[c];
        i = c;
    }
    if (m > 0) h[i] = last;
    return top;
}

static void push_pair(const struct moetax_tokenizer *t, struct bpe_scratch *w, size_t *hn, int32_t l, int32_t r) {
    if (l < 0 || r < 0) return;
    const struct merge_slot *ms = merge_find(t, w->sym[l].id, w->sym[r].id);
    if (!ms) return;
    heap_push(w->heap, hn, (struct cand){ms->rank, l, r, w->sym[l].id, w->sym[r].id});
}

/* BPE over a long pre-token: linked symbols and a heap of candidate pairs
 * ordered by (rank, position); stale entries are skipped when popped. */
static void bpe_heap(const struct moetax_tokenizer *t, struct bpe_scratch *w, const unsigned char *p, size_t n,
                     struct emitter *e) {
    for (size_t i = 0; i < n; i++)
        w->sym[i] = (struct sym){t->byte_tok[p[i]], (int32_t)i - 1, i + 1 < n ? (int32_t)i + 1 : -1};
    size_t hn = 0;
    for (size_t i = 0; i + 1 < n; i++) push_pair(t, w, &hn, (int32_t)i, (int32_t)i + 1);
    while (hn > 0) {
        struct cand c = heap_pop(w->heap, &hn);
        struct sym *L = &w->sym[c.left], *R = &w->sym[c.right];
        if (L->prev == -2 || R->prev == -2 || L->next != c.right || L->id != c.a || R->id != c.b) continue;
        L->id = merge_find(t, c.a, c.b)->result;
        L->next = R->next;
        if (R->next >= 0) w->sym[R->next].prev = c.left;
        R->prev = -2;
        push_pair(t, w, &hn, L->prev, c.left);
        push_pair(t, w, &hn, c.left, L->next);
    }
    for (int32_t i = 0; i >= 0; i = w->sym[i].next) emit(e, w->sym[i].id);
}

/* BPE over a short pre-token: scan for the lowest rank, ranks cached per pair. */
static void bpe_scan(const struct moetax_tokenizer *t, struct bpe_scratch *w, const unsigned char *p, size_t n,
                     struct emitter *e) {
    int32_t *ids = w->ids, *rank = w->rank; /* rank[i]: pair (i, i+1), INT32_MAX if none */
    for (size_t i = 0; i < n; i++) ids[i] = t->byte_tok[p[i]];
    for (size_t i = 0; i + 1 < n; i++) {
        const struct merge_slot *ms = merge_find(t, ids[i], ids[i + 1]);
        rank[i] = ms ? ms->rank : INT32_MAX;
    }
    size_t m = n;
    while (m > 1) {
        size_t best = 0;
        for (size_t i = 1; i + 1 < m; i++)
            if (rank[i] < rank[best]) best = i;
        if (rank[best] == INT32_MAX) break;
        ids[best] = merge_find(t, ids[best], ids[best + 1])->result;
        memmove(ids + best + 1, ids + best + 2, (m - best - 2) * sizeof *ids);
        memmove(rank + best + 1, rank + best + 2, (m >= best + 3 ? m - best - 3 : 0) * sizeof *rank);
        m--;
        for (size_t i = best > 0 ? best - 1 : 0; i <= best && i + 1 < m; i++) {
            const struct merge_slot *ms = merge_find(t, ids[i], ids[i + 1]);
            rank[i] = ms ? ms->rank : INT32_MAX;
        }
    }
    for (size_t i = 0; i < m; i++) emit(e, ids[i]);
}

static bool bpe_word(const struct moetax_tokenizer *t, struct bpe_scratch *w, const unsigned char *p, size_t n,
                     struct emitter *e) {
    if (n == 1) { emit(e, t->byte_tok[p[0]]); return true; }
    if (n <= BPE_SCAN_MAX) {
        bpe_scan(t, w, p, n, e);
        return true;
    }
    if (n > w->cap) {
        size_t c = w->cap ? w->cap : 256;
        while (c < n) c *= 2;
        struct sym *s = realloc(w->sym, c * sizeof *s);
        if (!s) return false;
        w->sym = s;
        w->cap = c;
    }
    /* each merge pushes at most two pairs, on top of the n - 1 initial ones */
    if (3 * n > w->heap_cap) {
        struct cand *h = realloc(w->heap, 3 * n * sizeof *h);
        if (!h) return false;
        w->heap = h;
        w->heap_cap = 3 * n;
    }
    bpe_heap(t, w, p, n, e);
    return true;
}

/* ---- pre-tokenization ------------------------------------------------------------ */

static bool in_ranges(const struct moetax_uni_range *r, size_t n, uint32_t cp) {
    if (cp < r[0].first || cp > r[n - 1].last) return false;
    size_t lo = 0, hi = n; /* the range holding cp, if any, is in [lo, hi) */
    while (hi - lo > 1) {
        size_t mid = lo + (hi - lo) / 2;
        if (r[mid].first <= cp) lo = mid;
        else hi = mid;
    }
    return cp <= r[lo].last;
}

static int cp_class(uint32_t cp) {
    if (cp < 0x80) return moetax_uni_ascii[cp];
    if (in_ranges(moetax_uni_L, MOETAX_UNI_L_COUNT, cp)) return CLS_L;
    if (in_ranges(moetax_uni_N, MOETAX_UNI_N_COUNT, cp)) return CLS_N;
    if (in_ranges(moetax_uni_S, MOETAX_UNI_S_COUNT, cp)) return CLS_S;
    return CLS_O;
}

/* Class of the code point at s[i] (i < len) and its length in bytes. A byte
 * that does not start a valid UTF-8 sequence is one code point of class O. */
static inline int class_at(const unsigned char *s, size_t len, size_t i, size_t *n) {
    if (s[i] < 0x80) {
        *n = 1;
        return moetax_uni_ascii[s[i]];
    }
    int cp, l = utf8_next(s + i, len - i, &cp);
    if (l == 0) {
        *n = 1;
        return CLS_O;
    }
    *n = (size_t)l;
    return cp_class((uint32_t)cp);
}

/* End of the pre-token that starts at s[i]: GPT-2's regex
 *   's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
 * over code points, as the regex module matches it: the first alternative that
 * matches at i wins, and runs are greedy. */
static size_t pretoken_end(const unsigned char *s, size_t len, size_t i) {
    /* 's|'t|'re|'ve|'m|'ll|'d (lower case only, as in GPT-2) */
    if (s[i] == '\'' && i + 1 < len) {
        unsigned char c1 = s[i + 1], c2 = i + 2 < len ? s[i + 2] : 0;
        if (c1 == 's' || c1 == 't' || c1 == 'm' || c1 == 'd') return i + 2;
        if ((c1 == 'r' && c2 == 'e') || (c1 == 'v' && c2 == 'e') || (c1 == 'l' && c2 == 'l')) return i + 3;
    }
    size_t n, j;
    int c = class_at(s, len, i, &n);
    j = i + n;
    /* ' ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+': exactly one U+0020 may lead a run */
    if (s[i] == ' ' && j < len) {
        int c1 = class_at(s, len, j, &n);
        if (c1 != CLS_S) {
            c = c1;
            j += n;
        }
    }
    if (c != CLS_S) {
        while (j < len && class_at(s, len, j, &n) == c) j += n;
        return j;
    }
    /* '\s+(?!\S)' backs off one code point when a non-space follows, so that
     * the last space can lead the next word; a single space code point before
     * a non-space is '\s+' */
    size_t last = i; /* start of the last code point of the run */
    while (j < len && class_at(s, len, j, &n) == CLS_S) {
        last = j;
        j += n;
    }
    return j < len && last > i ? last : j;
}

/* ---- the other pre-tokenizers (llama.cpp's rule lists) ----------------------------
 *
 * llama.cpp (src/llama-vocab.cpp, src/unicode.cpp) splits text for these with a
 * list of regexes applied in turn: each one splits every piece left by the
 * previous one into its matches and the gaps between them. qwen2 and llama3 use
 * llama.cpp's hand-written scanners; the deepseek lists run through std::regex
 * (ECMAScript: leftmost match, alternatives in order, greedy runs) over a
 * "collapsed" text in which each code point >= 128 stands for its category
 * (white space first), so that \p{L}, \p{N}, \p{P}, \p{S}, \p{M} and \s mean, for
 * ASCII, exactly: A-Za-z; 0-9; !"#%&'()*,-./:;?@[\]_{}; $+<=>^`| (not '~');
 * nothing; and \t\n\v\f\r and space. The scanners below implement those facts,
 * they copy no regex engine. Text is decoded as llama.cpp decodes it: a byte that
 * does not start a well-formed sequence becomes U+FFFD (and is encoded as such). */


/* general category groups */
enum { GC_L, GC_N, GC_P, GC_M, GC_S, GC_U, GC_O };

static bool in_ranges(const struct moetax_uni_range *r, size_t n, uint32_t cp);

static int cp_gc(uint32_t c) {
    if (c < 0x80) {
        if ((c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z')) return GC_L;
        if (c >= '0' && c <= '9') return GC_N;
        if (c < 0x20 || c == 0x7f || c == ' ') return GC_O;
        if (c == '$' || c == '+' || c == '<' || c == '=' || c == '>' || c == '^' || c == '`' || c == '|' || c == '~')
            return GC_S;
        return GC_P;
    }
    if (in_ranges(moetax_uni_L, MOETAX_UNI_L_COUNT, c)) return GC_L;
    if (in_ranges(moetax_uni_N, MOETAX_UNI_N_COUNT, c)) return GC_N;
    if (in_ranges(moetax_uni_P, MOETAX_UNI_P_COUNT, c)) return GC_P;
    if (in_ranges(moetax_uni_M, MOETAX_UNI_M_COUNT, c)) return GC_M;
    if (in_ranges(moetax_uni_Y, MOETAX_UNI_Y_COUNT, c)) return GC_S;
    if (in_ranges(moetax_uni_U, MOETAX_UNI_U_COUNT, c)) return GC_U;
    return GC_O;
}

/* llama.cpp's white space (unicode_set_whitespace) */
static bool ws_ll(uint32_t c) {
    return (c >= 0x09 && c <= 0x0d) || c == 0x20 || c == 0x85 || c == 0xa0 || c == 0x1680 ||
           (c >= 0x2000 && c <= 0x200a) || c == 0x2028 || c == 0x2029 || c == 0x202f || c == 0x205f || c == 0x3000;
}

/* the classes of the collapsed text */
static bool c_ws(uint32_t c) { return ws_ll(c); } /* ASCII: \t\n\v\f\r, space; others: 0x0B */
static bool c_L(uint32_t c) { return !ws_ll(c) && cp_gc(c) == GC_L; }
static bool c_N(uint32_t c) { return !ws_ll(c) && cp_gc(c) == GC_N; }
static bool c_P(uint32_t c) { return c != '~' && !ws_ll(c) && cp_gc(c) == GC_P; }
static bool c_S(uint32_t c) { return c != '~' && !ws_ll(c) && cp_gc(c) == GC_S; }
static bool c_M(uint32_t c) { return !ws_ll(c) && cp_gc(c) == GC_M; }
static bool c_LM(uint32_t c) { return c_L(c) || c_M(c); }
static bool c_PS(uint32_t c) { return c == '~' ? false : (c_P(c) || c_S(c)); }
static bool is_crlf(uint32_t c) { return c == '\r' || c == '\n'; }

struct cp_range { uint32_t first, last; };

static bool in_list(const struct cp_range *r, size_t n, uint32_t c) {
    if (c > 0x7f && ws_ll(c)) c = 0x0b; /* std::wregex sees non-ASCII white space as VT */
    for (size_t i = 0; i < n; i++)
        if (c >= r[i].first && c <= r[i].last) return true;
    return false;
}

/* deepseek-llm's letters (its second regex, as code point ranges) */
static const struct cp_range ds_letters[] = {
    {0x0041, 0x005A}, {0x0061, 0x007A}, {0x00B5, 0x00B5}, {0x00C0, 0x00D6}, {0x00D8, 0x00F6}, {0x00F8, 0x01BA},
    {0x01BC, 0x01BF}, {0x01C4, 0x0293}, {0x0295, 0x02AF}, {0x0370, 0x0373}, {0x0376, 0x0377}, {0x037B, 0x037D},
    {0x037F, 0x037F}, {0x0386, 0x0386}, {0x0388, 0x038A}, {0x038C, 0x038C}, {0x038E, 0x03A1}, {0x03A3, 0x03F5},
    {0x03F7, 0x0481}, {0x048A, 0x052F}, {0x0531, 0x0556}, {0x10A0, 0x10C5}, {0x13A0, 0x13F5}, {0x13F8, 0x13FD},
    {0x1C90, 0x1CBA}, {0x1CBD, 0x1CBF}, {0x1D00, 0x1D2B}, {0x1D6B, 0x1D77}, {0x1D79, 0x1D9A}, {0x1E00, 0x1F15},
    {0x1F18, 0x1F1D}, {0x1F20, 0x1F45}, {0x1F48, 0x1F4D}, {0x1F50, 0x1F57}, {0x1F59, 0x1F59}, {0x1F5B, 0x1F5B},
    {0x1F5D, 0x1F5D}, {0x1F5F, 0x1F7D}, {0x1F80, 0x1FB4}, {0x1FB6, 0x1FBC}, {0x1FBE, 0x1FBE}, {0x1FC2, 0x1FC4},
    {0x1FC6, 0x1FCC}, {0x1FD0, 0x1FD3}, {0x1FD6, 0x1FDB}, {0x1FE0, 0x1FEC}, {0x1FF2, 0x1FF4}, {0x1FF6, 0x1FFC},
    {0x2102, 0x2102}, {0x2107, 0x2107}, {0x210A, 0x2113}, {0x2115, 0x2115}, {0x2119, 0x211D}, {0x2124, 0x2124},
    {0x2126, 0x2126}, {0x2128, 0x2128}, {0x212A, 0x212D}, {0x212F, 0x2134}, {0x2139, 0x2139}, {0x213C, 0x213F},
    {0x2145, 0x2149}, {0x214E, 0x214E}, {0x2183, 0x2184}, {0x2C00, 0x2C7B}, {0x2C7E, 0x2CE4}, {0x2CEB, 0x2CEE},
    {0x2CF2, 0x2CF3}, {0xA640, 0xA66D}, {0xA680, 0xA69B}, {0xA722, 0xA76F}, {0xA771, 0xA787}, {0xA78B, 0xA78E},
    {0xAB70, 0xABBF}, {0xFB00, 0xFB06}, {0xFB13, 0xFB17}, {0xFF21, 0xFF3A}, {0xFF41, 0xFF5A}, {0x10400, 0x1044F},
    {0x104B0, 0x104D3}, {0x104D8, 0x104FB}, {0x10C80, 0x10CB2}, {0x10CC0, 0x10CF2}, {0x118A0, 0x118DF},
    {0x1E900, 0x1E943},
};
/* deepseek-llm's punctuation: [!-/:-~！-／：-～‘-‟　-。] */
static const struct cp_range ds_punct[] = {{0x21, 0x2F}, {0x3A, 0x7E}, {0xFF01, 0xFF0F}, {0xFF1A, 0xFF5E},
                                           {0x2018, 0x201F}, {0x3000, 0x3002}};
/* deepseek-llm/-coder's CJK: [一-龥ࠀ-一가-퟿] */
static const struct cp_range ds_cjk[] = {{0x4E00, 0x9FA5}, {0x0800, 0x4E00}, {0xAC00, 0xD7FF}};
/* deepseek-v3's CJK: [一-龥぀-ゟ゠-ヿ] */
static const struct cp_range ds3_cjk[] = {{0x4E00, 0x9FA5}, {0x3040, 0x309F}, {0x30A0, 0x30FF}};

#define N_OF(a) (sizeof(a) / sizeof((a)[0]))

/* A list of piece lengths (code points). */
struct pieces {
    size_t *len;
    size_t n, cap;
};

static bool pieces_add(struct pieces *p, size_t len) {
    if (len == 0) return true;
    if (p->n == p->cap) {
        size_t c = p->cap ? 2 * p->cap : 64;
        size_t *l = realloc(p->len, c * sizeof *l);
        if (!l) return false;
        p->len = l;
        p->cap = c;
    }
    p->len[p->n++] = len;
    return true;
}

/* A rule: the end of the match that starts at i within [i, e), or i if none does there. */
typedef size_t (*rule_fn)(const uint32_t *c, size_t i, size_t e);

static size_t run_of(const uint32_t *c, size_t i, size_t e, bool (*f)(uint32_t)) {
    while (i < e && f(c[i])) i++;
    return i;
}
static size_t run_list(const uint32_t *c, size_t i, size_t e, const struct cp_range *r, size_t n) {
    while (i < e && in_list(r, n, c[i])) i++;
    return i;
}

static size_t r_crlf(const uint32_t *c, size_t i, size_t e) { (void)e; return is_crlf(c[i]) ? i + 1 : i; }
/* \s?[SET]+ over the wide text */
static size_t ws_opt_list(const uint32_t *c, size_t i, size_t e, const struct cp_range *r, size_t n) {
    if (c_ws(c[i]) && i + 1 < e && in_list(r, n, c[i + 1])) return run_list(c, i + 1, e, r, n);
    return run_list(c, i, e, r, n);
}
static size_t r_ds_letters(const uint32_t *c, size_t i, size_t e) { return ws_opt_list(c, i, e, ds_letters, N_OF(ds_letters)); }
static size_t r_ds_punct(const uint32_t *c, size_t i, size_t e) { return ws_opt_list(c, i, e, ds_punct, N_OF(ds_punct)); }
/* \s+$. apply_rule tries a piece's positions in order, so the end of the white space run that holds
 * position i is remembered for the positions after it in the same run (scanning the run again at each
 * of them made a long run that does not end the piece quadratic: 200k spaces and a digit took 27 s);
 * apply_rule forgets it before each pass. */
static _Thread_local struct { bool valid; const uint32_t *c; size_t e, from, to; } g_ws_run;
static size_t r_ws_end(const uint32_t *c, size_t i, size_t e) {
    if (!c_ws(c[i])) return i;
    if (!(g_ws_run.valid && g_ws_run.c == c && g_ws_run.e == e && i >= g_ws_run.from && i < g_ws_run.to)) {
        g_ws_run.valid = true;
        g_ws_run.c = c;
        g_ws_run.e = e;
        g_ws_run.from = i;
        g_ws_run.to = run_of(c, i, e, c_ws);
    }
    return g_ws_run.to == e ? e : i;
}
static size_t r_ds_cjk(const uint32_t *c, size_t i, size_t e) { return run_list(c, i, e, ds_cjk, N_OF(ds_cjk)); }
static size_t r_ds3_cjk(const uint32_t *c, size_t i, size_t e) { return run_list(c, i, e, ds3_cjk, N_OF(ds3_cjk)); }
static size_t r_nums(const uint32_t *c, size_t i, size_t e) { return run_of(c, i, e, c_N); }
static size_t r_num1(const uint32_t *c, size_t i, size_t e) { (void)e; return c_N(c[i]) ? i + 1 : i; }
static size_t r_num3(const uint32_t *c, size_t i, size_t e) {
    size_t j = i;
    while (j < e && j < i + 3 && c_N(c[j])) j++;
    return j;
}
/* \s?\p{cls}+ over the collapsed text */
static size_t ws_opt_run(const uint32_t *c, size_t i, size_t e, bool (*f)(uint32_t)) {
    if (c_ws(c[i]) && i + 1 < e && f(c[i + 1])) return run_of(c, i + 1, e, f);
    return run_of(c, i, e, f);
}
static size_t r_ws_letters(const uint32_t *c, size_t i, size_t e) { return ws_opt_run(c, i, e, c_L); }
static size_t r_ws_punct(const uint32_t *c, size_t i, size_t e) { return ws_opt_run(c, i, e, c_P); }

static bool ascii_alpha(uint32_t c) { return (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z'); }
static bool ascii_punct(uint32_t c) {
    return (c >= 0x21 && c <= 0x2f) || (c >= 0x3a && c <= 0x40) || (c >= 0x5b && c <= 0x60) || (c >= 0x7b && c <= 0x7e);
}

/* \s+(?!\S)|\s+ and \s*[\r\n]+ share this: the white-space alternatives */
static size_t ws_tail(const uint32_t *c, size_t i, size_t e, bool crlf_alt) {
    size_t q = run_of(c, i, e, c_ws);
    if (q == i) return i;
    if (crlf_alt) { /* \s*[\r\n]+: up to the last \r or \n of the run */
        for (size_t k = q; k > i; k--)
            if (is_crlf(c[k - 1])) return k;
    }
    if (q < e && q - i >= 2) return q - 1; /* \s+(?!\S) gives back the last one */
    return q;                              /* at the end (?!\S) holds; else \s+ */
}

/* deepseek-v3's third regex:
 *   [!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+|
 *    ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+ */
static size_t r_ds3_main(const uint32_t *c, size_t i, size_t e) {
    if (ascii_punct(c[i]) && i + 1 < e && ascii_alpha(c[i + 1])) return run_of(c, i + 1, e, ascii_alpha);
    bool pre = !is_crlf(c[i]) && !c_L(c[i]) && !c_P(c[i]) && !c_S(c[i]);
    if (pre && i + 1 < e && c_LM(c[i + 1])) return run_of(c, i + 1, e, c_LM);
    if (c_LM(c[i])) return run_of(c, i, e, c_LM);
    size_t j = i;
    if (c[i] == ' ' && i + 1 < e && c_PS(c[i + 1])) j = i + 1;
    if (c_PS(c[j])) {
        j = run_of(c, j, e, c_PS);
        return run_of(c, j, e, is_crlf);
    }
    return ws_tail(c, i, e, true);
}

/* Split every piece of *in with rule f into matches and the gaps between them. */
static bool apply_rule(const uint32_t *c, const struct pieces *in, struct pieces *out, rule_fn f) {
    out->n = 0;
    g_ws_run.valid = false; /* r_ws_end's run, of an earlier text maybe at the same address */
    size_t start = 0;
    for (size_t k = 0; k < in->n; k++) {
        size_t e = start + in->len[k], gap = start;
        for (size_t i = start; i < e;) {
            size_t j = f(c, i, e);
            if (j == i) { i++; continue; }
            if (!pieces_add(out, i - gap) || !pieces_add(out, j - i)) return false;
            gap = i = j;
        }
        if (!pieces_add(out, e - gap)) return false;
        start = e;
    }
    return true;
}

/* llama.cpp's scanners for llama3 (digits in threes) and qwen2 (single digits):
 *   (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+
 * with llama.cpp's classes: letters and numbers as Unicode has them, white space
 * its own set (ws_ll). */
static bool l_L(uint32_t c) { return cp_gc(c) == GC_L; }
static bool l_N(uint32_t c) { return cp_gc(c) == GC_N; }
static bool l_other(uint32_t c) { return !ws_ll(c) && !l_L(c) && !l_N(c); }
static uint32_t lower_ascii(uint32_t c) { return c >= 'A' && c <= 'Z' ? c + 32 : c; }

static bool split_llama3(const uint32_t *c, size_t b, size_t e, bool digits3, struct pieces *out) {
    for (size_t i = b; i < e;) {
        size_t j = i;
        uint32_t c0 = c[i];
        if (c0 == '\'' && i + 1 < e) {
            uint32_t c1 = lower_ascii(c[i + 1]), c2 = i + 2 < e ? lower_ascii(c[i + 2]) : 0;
            if (c1 == 's' || c1 == 't' || c1 == 'm' || c1 == 'd') j = i + 2;
            else if ((c1 == 'r' && c2 == 'e') || (c1 == 'v' && c2 == 'e') || (c1 == 'l' && c2 == 'l')) j = i + 3;
        }
        if (j == i && !is_crlf(c0) && !l_N(c0) && (l_L(c0) || (i + 1 < e && l_L(c[i + 1]))))
            j = run_of(c, i + 1, e, l_L);
        if (j == i && l_N(c0)) {
            /* qwen2's digits one at a time (scanning the run first for each made a run quadratic) */
            j = digits3 ? run_of(c, i, e, l_N) : i + 1;
            while (j - i > 3) { /* \p{N}{1,3} repeated */
                if (!pieces_add(out, 3)) return false;
                i += 3;
            }
        }
        if (j == i) {
            size_t k = c0 == ' ' && i + 1 < e ? i + 1 : i;
            if (l_other(c[k])) {
                j = run_of(c, k, e, l_other);
                j = run_of(c, j, e, is_crlf);
            }
        }
        if (j == i) {
            size_t q = run_of(c, i, e, ws_ll);
            if (q > i) {
                size_t last = 0;
                for (size_t k = i; k < q; k++)
                    if (is_crlf(c[k])) last = k + 1;
                j = last ? last : (q - i > 1 && q < e ? q - 1 : q);
            }
        }
        if (j == i) j = i + 1;
        if (!pieces_add(out, j - i)) return false;
        i = j;
    }
    return true;
}

/* llama.cpp's lenient UTF-8 decoding (unicode_cpts_from_utf8): continuation
 * bytes are checked, nothing else; a bad lead byte becomes U+FFFD. */
static size_t cps_from_utf8(const unsigned char *s, size_t n, uint32_t *out) {
    size_t m = 0;
    for (size_t i = 0; i < n;) {
        unsigned c = s[i];
        int len = c < 0x80 ? 1 : !(c & 0x40) ? 0 : !(c & 0x20) ? 2 : !(c & 0x10) ? 3 : !(c & 0x08) ? 4 : 0;
        bool ok = len > 0 && i + (size_t)len <= n;
        for (int k = 1; ok && k < len; k++) ok = (s[i + k] & 0xc0) == 0x80;
        if (!ok) { out[m++] = 0xfffd; i++; continue; }
        uint32_t v = len == 1 ? c : len == 2 ? (c & 0x1f) : len == 3 ? (c & 0x0f) : (c & 0x07);
        for (int k = 1; k < len; k++) v = (v << 6) | (s[i + k] & 0x3f);
        out[m++] = v;
        i += (size_t)len;
    }
    return m;
}

static size_t utf8_put(unsigned char *o, uint32_t cp) {
    if (cp < 0x80) { o[0] = (unsigned char)cp; return 1; }
    if (cp < 0x800) { o[0] = (unsigned char)(0xc0 | (cp >> 6)); o[1] = (unsigned char)(0x80 | (cp & 0x3f)); return 2; }
    if (cp < 0x10000) {
        o[0] = (unsigned char)(0xe0 | (cp >> 12));
        o[1] = (unsigned char)(0x80 | ((cp >> 6) & 0x3f));
        o[2] = (unsigned char)(0x80 | (cp & 0x3f));
        return 3;
    }
    o[0] = (unsigned char)(0xf0 | (cp >> 18));
    o[1] = (unsigned char)(0x80 | ((cp >> 12) & 0x3f));
    o[2] = (unsigned char)(0x80 | ((cp >> 6) & 0x3f));
    o[3] = (unsigned char)(0x80 | (cp & 0x3f));
    return 4;
}

/* The rule list of a pre-tokenizer (NULL-terminated). */
static const rule_fn rules_deepseek_llm[] = {r_crlf, r_ds_letters, r_ds_punct, r_ws_end, r_ds_cjk, r_nums, NULL};
static const rule_fn rules_deepseek_coder[] = {r_crlf, r_ws_letters, r_ws_punct, r_ds_cjk, r_num1, NULL};
static const rule_fn rules_deepseek3[] = {r_num3, r_ds3_cjk, r_ds3_main, NULL};

/* Pre-tokenize s[0..n) (a fragment without user-defined tokens) with a
 * non-GPT-2 rule set; *out gets the piece lengths in code points of cps. */
static bool pre_split(int pre, const uint32_t *cps, size_t m, struct pieces *out, struct pieces *tmp) {
    out->n = 0;
    if (m == 0) return true;
    if (pre == PRE_LLAMA3 || pre == PRE_QWEN2) return split_llama3(cps, 0, m, pre == PRE_LLAMA3, out);
    const rule_fn *rules = pre == PRE_DEEPSEEK_LLM ? rules_deepseek_llm
                           : pre == PRE_DEEPSEEK_CODER ? rules_deepseek_coder : rules_deepseek3;
    if (!pieces_add(out, m)) return false;
    for (const rule_fn *r = rules; *r; r++) {
        if (!apply_rule(cps, out, tmp, *r)) return false;
        struct pieces sw = *out;
        *out = *tmp;
        *tmp = sw;
    }
    return true;
}

/* A piece of the text: raw bytes [off, off + len), or a user-defined token. */
struct frag {
    size_t off, len;
    int32_t tok; /* -1: raw */
};

struct frags {
    struct frag *f;
    size_t n, cap;
};

static bool frags_add(struct frags *v, struct frag x) {
    if (v->n == v->cap) {
        size_t c = v->cap ? 2 * v->cap : 16;
        struct frag *f = realloc(v->f, c * sizeof *f);
        if (!f) return false;
        v->f = f;
        v->cap = c;
    }
    v->f[v->n++] = x;
    return true;
}

/* First occurrence of pat[0..pl) (pl >= 1) in h[0..n), or NULL. */
static const char *find_bytes(const char *h, size_t n, const char *pat, size_t pl) {
    for (size_t i = 0; i + pl <= n;) {
        const char *c = memchr(h + i, pat[0], n - pl + 1 - i);
        if (!c) return NULL;
        if (!memcmp(c, pat, pl)) return c;
        i = (size_t)(c - h) + 1;
    }
    return NULL;
}

/* Split the raw fragments of *v at every occurrence of each user-defined token,
 * the longest tokens first. */
static bool partition_udef(const struct moetax_tokenizer *t, const char *text, size_t len, struct frags *v) {
    struct frags tmp = {0};
    bool ok = true;
    for (int32_t u = 0; u < t->n_udef && ok; u++) {
        int32_t id = t->udef[u];
        const char *pat = t->dec + t->dec_off[id];
        size_t pl = t->dec_off[id + 1] - t->dec_off[id];
        if (pl > len || !find_bytes(text, len, pat, pl)) continue;
        tmp.n = 0;
        for (size_t k = 0; k < v->n && ok; k++) {
            struct frag f = v->f[k];
            if (f.tok >= 0) { ok = frags_add(&tmp, f); continue; }
            size_t p = f.off, e = f.off + f.len;
            for (;;) {
                const char *hit = e - p >= pl ? find_bytes(text + p, e - p, pat, pl) : NULL;
                if (!hit) break;
                size_t h = (size_t)(hit - text);
                if (h > p) ok = ok && frags_add(&tmp, (struct frag){p, h - p, -1});
                ok = ok && frags_add(&tmp, (struct frag){h, pl, id});
                p = h + pl;
            }
            if (e > p) ok = ok && frags_add(&tmp, (struct frag){p, e - p, -1});
        }
        struct frags sw = *v;
        *v = tmp;
        tmp = sw;
    }
    free(tmp.f);
    return ok;
}

static bool bpe_bytes(const struct moetax_tokenizer *t, struct bpe_scratch *w, const unsigned char *p, size_t n,
                      struct emitter *e) {
    if (t->wmap && n > 0) {
        int32_t id = arena_find(t->wmap, t->wmap_mask, t->dec, t->dec_off, (const char *)p, n);
        if (id >= 0) { emit(e, id); return true; }
    }
    bool ok = true;
    /* symbol indices are int32: a pre-token over 1 GiB is merged in pieces */
    for (size_t k = 0; k < n && ok; k += BPE_WORD_MAX) ok = bpe_word(t, w, p + k, n - k < BPE_WORD_MAX ? n - k : BPE_WORD_MAX, e);
    return ok;
}

/* Encode one raw fragment. */
static bool encode_raw(const struct moetax_tokenizer *t, struct bpe_scratch *w, const unsigned char *s, size_t len,
                       struct emitter *e) {
    if (t->pre == PRE_GPT2) {
        bool ok = true;
        for (size_t i = 0, j; i < len && ok; i = j) {
            j = pretoken_end(s, len, i);
            ok = bpe_bytes(t, w, s + i, j - i, e);
        }
        return ok;
    }
    uint32_t *cps = malloc((len + 1) * sizeof *cps);
    unsigned char *buf = NULL;
    struct pieces out = {0}, tmp = {0};
    bool ok = cps != NULL;
    size_t m = ok ? cps_from_utf8(s, len, cps) : 0;
    ok = ok && pre_split(t->pre, cps, m, &out, &tmp);
    size_t maxp = 0;
    for (size_t k = 0; ok && k < out.n; k++)
        if (out.len[k] > maxp) maxp = out.len[k];
    if (ok && maxp) ok = (buf = malloc(4 * maxp)) != NULL;
    for (size_t k = 0, c = 0; ok && k < out.n; c += out.len[k++]) {
        size_t nb = 0;
        for (size_t i = c; i < c + out.len[k]; i++) nb += utf8_put(buf + nb, cps[i]);
        ok = bpe_bytes(t, w, buf, nb, e);
    }
    free(cps);
    free(buf);
    free(out.len);
    free(tmp.len);
    return ok;
}

/* ---- SentencePiece encode (llama.cpp's llm_tokenizer_spm) ------------------------------ */

struct spm_sym {
    size_t off, n;       /* bytes of the escaped text; n == 0: merged away */
    int64_t prev, next;  /* -1 at the ends */
};

struct spm_bigram {
    float score;
    int64_t left, right;
    size_t size;
};

/* highest score first, then the leftmost */
static bool bigram_before(const struct spm_bigram *x, const struct spm_bigram *y) {
    return x->score > y->score || (x->score == y->score && x->left < y->left);
}

struct spm_work {
    const struct moetax_tokenizer *t;
    const char *s;
    struct spm_sym *sym;
    struct spm_bigram *heap;
    size_t hn;
};

static int32_t spm_lookup(const struct moetax_tokenizer *t, const char *p, size_t n) {
    int32_t id = arena_find(t->tmap, t->tmap_mask, t->raw, t->raw_off, p, n);
    return id >= 0 && !type_is_hidden(t->type[id]) ? id : -1;
}

static void spm_try_bigram(struct spm_work *w, int64_t l, int64_t r) {
    if (l < 0 || r < 0) return;
    size_t size = w->sym[l].n + w->sym[r].n;
    int32_t id = spm_lookup(w->t, w->s + w->sym[l].off, size);
    if (id < 0) return;
    struct spm_bigram c = {w->t->score[id], l, r, size};
    size_t i = w->hn++;
    while (i > 0) {
        size_t p = (i - 1) / 2;
        if (!bigram_before(&c, &w->heap[p])) break;
        w->heap[i] = w->heap[p];
        i = p;
    }
    w->heap[i] = c;
}

static struct spm_bigram spm_pop(struct spm_work *w) {
    struct spm_bigram *h = w->heap, top = h[0], last = h[--w->hn];
    size_t i = 0, m = w->hn;
    for (;;) {
        size_t c = 2 * i + 1;
        if (c >= m) break;
        if (c + 1 < m && bigram_before(&h[c + 1], &h[c])) c++;
        if (!bigram_before(&h[c], &last)) break;
        h[i] = h[c];
        i = c;
    }
    if (m > 0) h[i] = last;
    return top;
}

/* UTF-8 length from the lead byte alone, as llama.cpp's unicode_len_utf8 */
static size_t spm_char_len(unsigned char c) {
    static const unsigned char lookup[16] = {1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 3, 4};
    return lookup[c >> 4];
}

/* Tokenize one escaped fragment s[0..n). */
static bool spm_session(const struct moetax_tokenizer *t, const char *s, size_t n, struct emitter *e) {
    if (n == 0) return true;
    struct spm_work w = {.t = t, .s = s};
    w.sym = malloc(n * sizeof *w.sym);
    w.heap = malloc(3 * n * sizeof *w.heap); /* n - 1 seeds, at most two per merge */
    if (!w.sym || !w.heap) {
        free(w.sym);
        free(w.heap);
        return false;
    }
    int64_t m = 0;
    for (size_t off = 0; off < n; m++) {
        size_t l = spm_char_len((unsigned char)s[off]);
        if (l > n - off) l = n - off;
        w.sym[m] = (struct spm_sym){off, l, m - 1, off + l == n ? -1 : m + 1};
        off += l;
    }
    for (int64_t i = 1; i < m; i++) spm_try_bigram(&w, i - 1, i);
    while (w.hn > 0) {
        struct spm_bigram b = spm_pop(&w);
        struct spm_sym *L = &w.sym[b.left], *R = &w.sym[b.right];
        if (L->n == 0 || R->n == 0 || L->n + R->n != b.size) continue; /* stale */
        L->n += R->n;
        R->n = 0;
        L->next = R->next;
        if (R->next >= 0) w.sym[R->next].prev = b.left;
        spm_try_bigram(&w, L->prev, b.left);
        spm_try_bigram(&w, b.left, L->next);
    }
    for (int64_t i = 0; i != -1; i = w.sym[i].next) {
        const struct spm_sym *y = &w.sym[i];
        int32_t id = spm_lookup(t, s + y->off, y->n);
        if (id >= 0) emit(e, id);
        else
            for (size_t j = 0; j < y->n; j++) emit(e, t->byte_tok[(unsigned char)s[y->off + j]]);
    }
    free(w.sym);
    free(w.heap);
    return true;
}

/* One raw fragment of an SPM vocabulary: a space in front when asked, every
 * space as U+2581, then the session. */
static bool spm_fragment(const struct moetax_tokenizer *t, const char *s, size_t len, bool prefix, struct emitter *e) {
    char *b = malloc(3 * (len + 1));
    if (!b) return false;
    size_t o = 0;
    if (prefix) { memcpy(b, "\xe2\x96\x81", 3); o = 3; }
    for (size_t i = 0; i < len; i++) {
        if (s[i] == ' ') { memcpy(b + o, "\xe2\x96\x81", 3); o += 3; }
        else b[o++] = s[i];
    }
    bool ok = spm_session(t, b, o, e);
    free(b);
    return ok;
}

moetax_status moetax_tokenizer_encode(const struct moetax_tokenizer *t, const char *text, size_t len,
                                      bool add_bos, int32_t *out, int64_t cap, int64_t *n_out) {
    *n_out = 0;
    if (len > 0 && !text) return moetax_error(MOETAX_ERR_ARG, "tokenizer encode: text is NULL with length %zu", len);
    if (cap < 0 || (cap > 0 && !out))
        return moetax_error(MOETAX_ERR_ARG, "tokenizer encode: invalid output buffer (cap %lld)", (long long)cap);
    int32_t ids_buf[BPE_SCAN_MAX], rank_buf[BPE_SCAN_MAX];
    struct bpe_scratch w = {.ids = ids_buf, .rank = rank_buf};
    struct emitter e = {out, cap, 0};
    if (add_bos && t->bos >= 0) emit(&e, t->bos);

    const unsigned char *s = (const unsigned char *)text;
    struct frags fr = {0};
    bool ok = true;
    if (len > 0) {
        ok = frags_add(&fr, (struct frag){0, len, -1});
        if (ok && t->n_udef) ok = partition_udef(t, text, len, &fr);
    }
    bool prev_special = true; /* SPM: a space in front of the first fragment and of any after a token */
    for (size_t k = 0; k < fr.n && ok; k++) {
        if (fr.f[k].tok >= 0) {
            emit(&e, fr.f[k].tok);
            prev_special = true;
        } else if (t->spm) {
            ok = spm_fragment(t, text + fr.f[k].off, fr.f[k].len, t->space_prefix && prev_special, &e);
            prev_special = false;
        } else {
            ok = encode_raw(t, &w, s + fr.f[k].off, fr.f[k].len, &e);
        }
    }
    free(fr.f);
    free(w.sym);
    free(w.heap);
    if (!ok) return moetax_error(MOETAX_ERR_NOMEM, "tokenizer encode: out of memory (%zu-byte text)", len);
    *n_out = e.n;
    if (e.n > cap)
        return moetax_error(MOETAX_ERR_LIMIT, "tokenizer encode: %lld tokens do not fit in a buffer of %lld",
                            (long long)e.n, (long long)cap);
    return MOETAX_OK;
}

/* ---- decode ------------------------------------------------------------------------- */

int moetax_tokenizer_token_to_bytes(const struct moetax_tokenizer *t, int32_t tok, char *buf, int cap) {
    if (tok < 0 || tok >= t->n_vocab) return 0;
    size_t n = t->dec_off[tok + 1] - t->dec_off[tok];
    if (n > INT_MAX) n = INT_MAX; /* a single token of 2 GiB: not a real vocabulary */
    if (cap < 0 || (size_t)cap < n) return -(int)n;
    if (n) memcpy(buf, t->dec + t->dec_off[tok], n);
    return (int)n;
}

moetax_status moetax_tokenizer_decode(const struct moetax_tokenizer *t, const int32_t *toks, int64_t n,
                                      char *buf, size_t cap, size_t *n_out) {
    *n_out = 0;
    if (n < 0 || (n > 0 && !toks)) return moetax_error(MOETAX_ERR_ARG, "tokenizer decode: invalid token array (n %lld)", (long long)n);
    if (cap > 0 && !buf) return moetax_error(MOETAX_ERR_ARG, "tokenizer decode: buffer is NULL with cap %zu", cap);
    size_t o = 0;
    /* SPM with add_space_prefix: the space the encoder put in front comes off the first token (after BOS) */
    int64_t strip_at = !(t->spm && t->space_prefix) ? -1 : n > 0 && toks[0] == t->bos && t->bos >= 0 ? 1 : 0;
    for (int64_t i = 0; i < n; i++) {
        int32_t tok = toks[i];
        if (tok < 0 || tok >= t->n_vocab)
            return moetax_error(MOETAX_ERR_ARG, "tokenizer decode: token %lld is id %d, outside [0, %d)", (long long)i,
                                (int)tok, (int)t->n_vocab);
        const char *src = t->dec + t->dec_off[tok];
        size_t l = t->dec_off[tok + 1] - t->dec_off[tok];
        if (i == strip_at && l > 0 && src[0] == ' ') { src++; l--; }
        if (o < cap) memcpy(buf + o, src, l < cap - o ? l : cap - o);
        o += l;
    }
    *n_out = o;
    if (o < cap) buf[o] = '\0';
    if (o > cap)
        return moetax_error(MOETAX_ERR_LIMIT, "tokenizer decode: %zu bytes do not fit in a buffer of %zu", o, cap);
    return MOETAX_OK;
}
