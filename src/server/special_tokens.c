/* special_tokens.c - split a prompt at control tokens' texts (see special_tokens.h). */
#include "server/special_tokens.h"

#include <stdlib.h>
#include <string.h>

struct special {
    char *text;
    size_t len;
    int32_t id;
};

/* A trie of the specials' bytes (children as sibling lists): at each position of a prompt the longest
 * special that starts there is found in the length of that match, not by trying every special (a
 * vocabulary's ~1000 specials, nearly all starting with '<', made that the prompt's length times their
 * number). */
struct trie_node {
    int32_t child, sibling; /* -1: none */
    int32_t special;        /* index into v of the special ending here, -1: none */
    uint8_t byte;
};

struct srv_specials {
    struct special *v;
    int n;
    struct trie_node *t; /* t[0]: the root */
    int32_t n_t, cap_t;
};

static int32_t trie_add_node(struct srv_specials *s, uint8_t byte, int32_t sibling) {
    if (s->n_t == s->cap_t) {
        int32_t cap = s->cap_t ? s->cap_t * 2 : 256;
        struct trie_node *t = realloc(s->t, sizeof *t * (size_t)cap);
        if (!t) return -1;
        s->t = t;
        s->cap_t = cap;
    }
    s->t[s->n_t] = (struct trie_node){.child = -1, .sibling = sibling, .special = -1, .byte = byte};
    return s->n_t++;
}

/* Special k into the trie (the first of equal texts keeps them). */
static bool trie_insert(struct srv_specials *s, int k) {
    int32_t node = 0;
    const struct special *sp = &s->v[k];
    for (size_t j = 0; j < sp->len; j++) {
        const uint8_t b = (uint8_t)sp->text[j];
        int32_t c = s->t[node].child;
        while (c >= 0 && s->t[c].byte != b) c = s->t[c].sibling;
        if (c < 0) {
            if ((c = trie_add_node(s, b, s->t[node].child)) < 0) return false;
            s->t[node].child = c;
        }
        node = c;
    }
    if (s->t[node].special < 0) s->t[node].special = k;
    return true;
}

/* The longest special that text[0..len) starts with, or NULL. */
static const struct special *trie_longest(const struct srv_specials *s, const char *text, size_t len) {
    const struct special *hit = NULL;
    int32_t node = 0;
    for (size_t j = 0; j < len; j++) {
        int32_t c = s->t[node].child;
        while (c >= 0 && s->t[c].byte != (uint8_t)text[j]) c = s->t[c].sibling;
        if (c < 0) break;
        node = c;
        if (s->t[node].special >= 0) hit = &s->v[s->t[node].special];
    }
    return hit;
}

moetax_status srv_specials_load(const struct moetax_gguf *g, struct srv_specials **out) {
    *out = NULL;
    struct srv_specials *s = calloc(1, sizeof *s);
    if (!s) return moetax_error(MOETAX_ERR_NOMEM, "out of memory");
    const struct moetax_gguf_kv *toks = moetax_gguf_find_kv(g, "tokenizer.ggml.tokens");
    const struct moetax_gguf_kv *types = moetax_gguf_find_kv(g, "tokenizer.ggml.token_type");
    if (!toks || !types || toks->type != MOETAX_GGUF_TYPE_ARRAY || types->type != MOETAX_GGUF_TYPE_ARRAY ||
        toks->arr_type != MOETAX_GGUF_TYPE_STRING || !toks->arr_str || types->arr_n != toks->arr_n ||
        toks->arr_n > INT32_MAX) {
        *out = s; /* no token types: no special tokens */
        return MOETAX_OK;
    }
    for (int pass = 0; pass < 2; pass++) {
        int n = 0;
        for (uint64_t i = 0; i < toks->arr_n; i++) {
            int64_t ty;
            if (!moetax_gguf_arr_i64(types, i, &ty)) continue;
            if (ty != MOETAX_TOKEN_TYPE_CONTROL && ty != MOETAX_TOKEN_TYPE_USER_DEFINED) continue;
            const struct moetax_gguf_str *t = &toks->arr_str[i];
            if (t->len < 2) continue;
            if (pass == 1) {
                struct special *sp = &s->v[n];
                if (!(sp->text = malloc(t->len))) { s->n = n; srv_specials_free(s); return moetax_error(MOETAX_ERR_NOMEM, "out of memory"); }
                memcpy(sp->text, t->data, t->len);
                sp->len = t->len;
                sp->id = (int32_t)i;
            }
            n++;
        }
        if (pass == 0 && n && !(s->v = calloc((size_t)n, sizeof *s->v))) {
            free(s);
            return moetax_error(MOETAX_ERR_NOMEM, "out of memory");
        }
        if (pass == 1) s->n = n;
    }
    bool ok = trie_add_node(s, 0, -1) == 0;
    for (int k = 0; ok && k < s->n; k++) ok = trie_insert(s, k);
    if (!ok) {
        srv_specials_free(s);
        return moetax_error(MOETAX_ERR_NOMEM, "out of memory");
    }
    *out = s;
    return MOETAX_OK;
}

void srv_specials_free(struct srv_specials *s) {
    if (!s) return;
    for (int i = 0; i < s->n; i++) free(s->v[i].text);
    free(s->v);
    free(s->t);
    free(s);
}

int srv_specials_count(const struct srv_specials *s) { return s ? s->n : 0; }

struct idbuf {
    int32_t *v;
    int64_t n, cap;
};

static bool push_text(const struct moetax_tokenizer *tok, struct idbuf *b, const char *t, size_t len, bool bos) {
    if (!len && !bos) return true;
    int64_t need = 0;
    moetax_tokenizer_encode(tok, t, len, bos, NULL, 0, &need);
    if (b->n + need > b->cap) {
        int64_t cap = (b->n + need) * 2 + 16;
        int32_t *v = realloc(b->v, sizeof(int32_t) * (size_t)cap);
        if (!v) return false;
        b->v = v;
        b->cap = cap;
    }
    int64_t got = 0;
    if (moetax_tokenizer_encode(tok, t, len, bos, b->v + b->n, b->cap - b->n, &got) != MOETAX_OK) return false;
    b->n += got;
    return true;
}

moetax_status srv_encode_special(const struct moetax_tokenizer *tok, const struct srv_specials *s, const char *text,
                                 size_t len, bool add_bos, int32_t **ids, int64_t *n) {
    struct idbuf b = {0};
    size_t start = 0, i = 0;
    bool bos = add_bos;
    while (i < len) {
        const struct special *hit = s && s->n ? trie_longest(s, text + i, len - i) : NULL;
        if (!hit) { i++; continue; }
        if (!push_text(tok, &b, text + start, i - start, bos)) goto oom;
        bos = false;
        if (b.n + 1 > b.cap) {
            int64_t cap = b.cap * 2 + 16;
            int32_t *v = realloc(b.v, sizeof(int32_t) * (size_t)cap);
            if (!v) goto oom;
            b.v = v;
            b.cap = cap;
        }
        b.v[b.n++] = hit->id;
        i += hit->len;
        start = i;
    }
    if (!push_text(tok, &b, text + start, len - start, bos)) goto oom;
    *ids = b.v;
    *n = b.n;
    return MOETAX_OK;
oom:
    free(b.v);
    return moetax_error(MOETAX_ERR_NOMEM, "out of memory while tokenizing the prompt");
}
