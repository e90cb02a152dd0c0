// ctest-labels: unit
/* test_special_tokens.c - the server's split of a chat prompt at control tokens
 * (src/server/special_tokens.c) against a plain reference: at each position the
 * longest control or user-defined token text that starts there becomes its id, the
 * text between them is encoded as usual. The vocabulary is a generated model's with
 * control tokens appended whose texts overlap (one a prefix of another, one made of
 * two others, shared long prefixes like DeepSeek's placeholders); the prompts are random strings of those texts, their prefixes and
 * plain characters. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "moetax/gguf.h"
#include "moetax/tokenizer.h"
#include "server/special_tokens.h"
#include "testutil.h"

static const char *const specials[] = {
    "<|a|>", "<|a|>b", "<|a", "<|b|>", "<|a|><|b|>", "x<|", "<|", "<|place|0|>", "<|place|1|>", "<|place|10|>",
    "<|place|11|>", "<|place|1", "\xef\xbd\x9c" "end\xe2\x96\x81", "||",
};
#define N_SPECIAL ((int)(sizeof specials / sizeof specials[0]))

/* ids of text by the reference: specials[k] is id base + k (texts under 2 bytes would not be) */
static int64_t reference(const struct moetax_tokenizer *tok, const char *text, size_t len, int32_t base, int32_t *out,
                         int64_t cap) {
    int64_t n = 0;
    size_t start = 0, i = 0;
    bool bos = moetax_tokenizer_add_bos(tok);
    while (i < len) {
        int best = -1;
        size_t best_len = 0;
        for (int k = 0; k < N_SPECIAL; k++) {
            const size_t l = strlen(specials[k]);
            if (l >= 2 && l <= len - i && l > best_len && !memcmp(text + i, specials[k], l)) best = k, best_len = l;
        }
        if (best < 0) { i++; continue; }
        int64_t got = 0;
        if (i > start || bos) moetax_tokenizer_encode(tok, text + start, i - start, bos, out + n, cap - n, &got);
        n += got;
        bos = false;
        out[n++] = base + best;
        i += best_len;
        start = i;
    }
    int64_t got = 0;
    if (len > start || bos) moetax_tokenizer_encode(tok, text + start, len - start, bos, out + n, cap - n, &got);
    return n + got;
}

int main(int argc, char **argv) {
    tu_init(argc, argv);
    char model[512], vocab[512], cmd[1200];
    snprintf(model, sizeof model, "%s", tu_path("special_tiny.gguf"));
    snprintf(vocab, sizeof vocab, "%s", tu_path("special_vocab.gguf"));
    snprintf(cmd, sizeof cmd, "%s gen --preset tiny -o %s >/dev/null 2>&1", tu_moetax_bin, model);
    CHECK_EQ_INT(tu_run(cmd, NULL), 0);
    struct moetax_gguf *g = NULL;
    if (moetax_gguf_open(model, &g) != MOETAX_OK) { CHECK_MSG(0, "%s", moetax_last_error()); return tu_finish("test_special_tokens"); }
    /* the tokenizer's keys, its tokens and types with the specials appended (no tensors) */
    const struct moetax_gguf_kv *toks = moetax_gguf_find_kv(g, "tokenizer.ggml.tokens");
    const struct moetax_gguf_kv *types = moetax_gguf_find_kv(g, "tokenizer.ggml.token_type");
    CHECK(toks && types && toks->arr_n == types->arr_n);
    const int32_t base = (int32_t)toks->arr_n, n_all = base + N_SPECIAL;
    const char **texts = malloc(sizeof *texts * (size_t)n_all);
    char **owned = calloc((size_t)base, sizeof *owned);
    int32_t *ty = malloc(sizeof *ty * (size_t)n_all);
    struct moetax_gguf_writer *w = NULL;
    CHECK(texts && owned && ty && moetax_gguf_writer_init(vocab, &w) == MOETAX_OK);
    for (int32_t i = 0; i < base; i++) {
        int64_t t = 0;
        moetax_gguf_arr_i64(types, (uint64_t)i, &t);
        ty[i] = (int32_t)t;
        owned[i] = malloc(toks->arr_str[i].len + 1);
        memcpy(owned[i], toks->arr_str[i].data, toks->arr_str[i].len);
        owned[i][toks->arr_str[i].len] = 0;
        texts[i] = owned[i];
    }
    for (int k = 0; k < N_SPECIAL; k++) {
        texts[base + k] = specials[k];
        ty[base + k] = k == 4 ? MOETAX_TOKEN_TYPE_USER_DEFINED : MOETAX_TOKEN_TYPE_CONTROL;
    }
    for (uint64_t i = 0; i < g->n_kv; i++) {
        const struct moetax_gguf_kv *kv = &g->kv[i];
        if (kv->key.len < 10 || memcmp(kv->key.data, "tokenizer.", 10) || kv == toks || kv == types) continue;
        CHECK(moetax_gguf_writer_copy_kv(w, g, kv) == MOETAX_OK);
    }
    CHECK(moetax_gguf_writer_set_arr_str(w, "tokenizer.ggml.tokens", texts, (uint64_t)n_all) == MOETAX_OK);
    CHECK(moetax_gguf_writer_set_arr(w, "tokenizer.ggml.token_type", MOETAX_GGUF_TYPE_INT32, ty, (uint64_t)n_all) ==
          MOETAX_OK);
    CHECK_MSG(moetax_gguf_writer_finish(w) == MOETAX_OK, "%s", moetax_last_error());
    moetax_gguf_writer_free(w);
    for (int32_t i = 0; i < base; i++) free(owned[i]);
    free(owned);
    free(texts);
    free(ty);
    moetax_gguf_close(g);

    struct moetax_gguf *v = NULL;
    struct moetax_tokenizer *tok = NULL;
    struct srv_specials *sp = NULL;
    CHECK_MSG(moetax_gguf_open(vocab, &v) == MOETAX_OK, "%s", moetax_last_error());
    CHECK_MSG(v && moetax_tokenizer_load(v, &tok) == MOETAX_OK, "%s", moetax_last_error());
    CHECK_MSG(v && srv_specials_load(v, &sp) == MOETAX_OK, "%s", moetax_last_error());
    if (!tok || !sp) return tu_finish("test_special_tokens");
    CHECK(srv_specials_count(sp) >= N_SPECIAL); /* the model's own (BOS, EOS) besides, which no prompt here spells */

    static const char *const parts[] = {"<|a|>", "<|a|>b", "<|a", "<|b|>", "x<|", "<", "|", ">", "<|place|", "0|>", "1",
                                        "1|>", "<|place|1", "\xef\xbd\x9c", "end\xe2\x96\x81", "||", "a", " ", "b", "x",
                                        "def f(x):", "\n"};
    tu_rng r = {42};
    char text[600];
    int32_t *want = malloc(sizeof(int32_t) * 4096);
    int bad = 0;
    for (int trial = 0; trial < 3000 && bad < 5; trial++) {
        size_t len = 0;
        const int n_parts = 1 + (int)(tu_rand_u64(&r) % 40);
        for (int p = 0; p < n_parts; p++) {
            const char *s = parts[tu_rand_u64(&r) % (sizeof parts / sizeof parts[0])];
            const size_t l = strlen(s);
            if (len + l >= sizeof text) break;
            memcpy(text + len, s, l);
            len += l;
        }
        int32_t *got = NULL;
        int64_t n_got = 0, n_want = reference(tok, text, len, base, want, 4096);
        if (srv_encode_special(tok, sp, text, len, moetax_tokenizer_add_bos(tok), &got, &n_got) != MOETAX_OK) {
            CHECK_MSG(0, "%s", moetax_last_error());
            break;
        }
        if (n_got != n_want || memcmp(got, want, sizeof(int32_t) * (size_t)n_got)) {
            CHECK_MSG(0, "trial %d: '%.*s': %lld ids, the reference %lld", trial, (int)len, text, (long long)n_got,
                      (long long)n_want);
            bad++;
        }
        free(got);
    }
    free(want);
    srv_specials_free(sp);
    moetax_tokenizer_free(tok);
    moetax_gguf_close(v);
    return tu_finish("test_special_tokens");
}
