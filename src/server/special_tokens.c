/* special_tokens.c - split a prompt at control tokens' texts (see special_tokens.h). */
#include "server/special_tokens.h"

#include <stdlib.h>
#include <string.h>

struct special {
    char *text;
    size_t len;
    int32_t id;
};

struct srv_specials {
    struct special *v; /* longest first */
    int n;
};

static int by_len_desc(const void *a, const void *b) {
    const struct special *x = a, *y = b;
    return (x->len < y->len) - (x->len > y->len);
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
    qsort(s->v, (size_t)s->n, sizeof *s->v, by_len_desc);
    *out = s;
    return MOETAX_OK;
}

void srv_specials_free(struct srv_specials *s) {
    if (!s) return;
    for (int i = 0; i < s->n; i++) free(s->v[i].text);
    free(s->v);
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
        const struct special *hit = NULL;
        for (int k = 0; s && k < s->n; k++) {
            const struct special *sp = &s->v[k];
            if (sp->len <= len - i && sp->text[0] == text[i] && memcmp(text + i, sp->text, sp->len) == 0) { hit = sp; break; }
        }
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
