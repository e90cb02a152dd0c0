/*
 * tokenizer.c - byte-level BPE ("gpt2") tokenizer; see moetax/tokenizer.h.
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

/* pre-tokenizer code point classes: \p{L}, \p{N}, \s, and everything else */
enum { CLS_L = MOETAX_UNI_L, CLS_N = MOETAX_UNI_N, CLS_S = MOETAX_UNI_S, CLS_O = MOETAX_UNI_O };

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

/* Only GPT-2's pre-tokenizer rules are implemented: any other tokenizer.ggml.pre
 * (llama3, qwen2, deepseek-llm, ...) is warned about on stderr, once per process,
 * naming the value; the file still loads (its tokens may then differ from the
 * model's own tokenizer's). */
static void warn_pre(const struct moetax_gguf *g) {
    static atomic_flag warned = ATOMIC_FLAG_INIT;
    static const char *const gpt2_like[] = {"default", "gpt2", "gpt-2"};
    const struct moetax_gguf_kv *pk = moetax_gguf_find_kv(g, KEY_PRE);
    if (!pk) return;
    if (pk->type == MOETAX_GGUF_TYPE_STRING)
        for (size_t i = 0; i < sizeof gpt2_like / sizeof gpt2_like[0]; i++)
            if (pk->v.str.len == strlen(gpt2_like[i]) && !memcmp(pk->v.str.data, gpt2_like[i], pk->v.str.len)) return;
    if (atomic_flag_test_and_set(&warned)) return;
    if (pk->type == MOETAX_GGUF_TYPE_STRING)
        fprintf(stderr, "moetax: warning: %s: %s = \"%.*s\" is not implemented; moetax pre-tokenizes with GPT-2's "
                        "rules, so its tokens may differ from the model's tokenizer\n",
                g->path, KEY_PRE, SHOWN(pk->v.str.len), pk->v.str.data);
    else
        fprintf(stderr, "moetax: warning: %s: %s is a %s, not a string; moetax pre-tokenizes with GPT-2's rules\n",
                g->path, KEY_PRE, moetax_gguf_type_name(pk->type));
}

moetax_status moetax_tokenizer_load(const struct moetax_gguf *g, struct moetax_tokenizer **out) {
    *out = NULL;
    const struct moetax_gguf_kv *mk = moetax_gguf_find_kv(g, KEY_MODEL);
    if (!mk) return moetax_error(MOETAX_ERR_NOT_FOUND, "%s: %s is missing (no tokenizer in this file)", g->path, KEY_MODEL);
    if (mk->type != MOETAX_GGUF_TYPE_STRING)
        return moetax_error(MOETAX_ERR_FORMAT, "%s: %s: expected a string, found %s", g->path, KEY_MODEL,
                            moetax_gguf_type_name(mk->type));
    const struct moetax_gguf_str *model = &mk->v.str;
    if (!(model->len == 4 && memcmp(model->data, "gpt2", 4) == 0)) {
        const char *what = "";
        if (model->len == 5 && memcmp(model->data, "llama", 5) == 0) what = " (SentencePiece)";
        else if (model->len == 4 && memcmp(model->data, "bert", 4) == 0) what = " (WordPiece)";
        else if (model->len == 2 && memcmp(model->data, "t5", 2) == 0) what = " (Unigram)";
        return moetax_error(MOETAX_ERR_UNSUPPORTED,
                            "%s: %s = \"%.*s\"%s is not supported; moetax supports only \"gpt2\" (byte-level BPE)",
                            g->path, KEY_MODEL, SHOWN(model->len), model->data, what);
    }
    warn_pre(g);
    struct moetax_tokenizer *t = calloc(1, sizeof *t);
    if (!t) return moetax_error(MOETAX_ERR_NOMEM, "out of memory for the tokenizer");
    t->bos = t->eos = t->eot = t->eom = -1;
    moetax_status st = load_gpt2(t, g);
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
    bool ok = true;
    for (size_t i = 0, j; i < len && ok; i = j) {
        j = pretoken_end(s, len, i);
        /* symbol indices are int32: a pre-token over 1 GiB is merged in pieces */
        for (size_t k = i; k < j && ok; k += BPE_WORD_MAX)
            ok = bpe_word(t, &w, s + k, j - k < BPE_WORD_MAX ? j - k : BPE_WORD_MAX, &e);
    }
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
    for (int64_t i = 0; i < n; i++) {
        int32_t tok = toks[i];
        if (tok < 0 || tok >= t->n_vocab)
            return moetax_error(MOETAX_ERR_ARG, "tokenizer decode: token %lld is id %d, outside [0, %d)", (long long)i,
                                (int)tok, (int)t->n_vocab);
        size_t l = t->dec_off[tok + 1] - t->dec_off[tok];
        if (o < cap) memcpy(buf + o, t->dec + t->dec_off[tok], l < cap - o ? l : cap - o);
        o += l;
    }
    *n_out = o;
    if (o < cap) buf[o] = '\0';
    if (o > cap)
        return moetax_error(MOETAX_ERR_LIMIT, "tokenizer decode: %zu bytes do not fit in a buffer of %zu", o, cap);
    return MOETAX_OK;
}
