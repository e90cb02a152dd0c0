// ctest-labels: unit
/* test_tokenizer_spm.c - SentencePiece ("llama") vocabularies on a tiny GGUF
 * written here: score order and leftmost ties, byte fallback, add_space_prefix,
 * user-defined tokens, BOS defaults, decode (leading space after BOS) and round
 * trips; and llama3's ignore_merges on a tiny byte-level BPE vocabulary.
 * (llama.cpp's llama-spm suite runs in test_tokenizer_llama.c when its
 * vocabulary is at hand.) */
#include "moetax/gguf.h"
#include "moetax/tokenizer.h"
#include "testutil.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAXV 400
#define SP "\xe2\x96\x81" /* U+2581 */

struct sv {
    int n;
    char *text[MAXV];
    float score[MAXV];
    int32_t type[MAXV];
};

static int sv_add(struct sv *v, const char *text, float score, int32_t type) {
    v->text[v->n] = strdup(text);
    v->score[v->n] = score;
    v->type[v->n] = type;
    return v->n++;
}

static int sv_id(const struct sv *v, const char *text) {
    for (int i = 0; i < v->n; i++)
        if (!strcmp(v->text[i], text)) return i;
    return -1;
}

/* 0 <unk>, 1 <s>, 2 </s>, 3..258 <0xXX>, then pieces */
static void sv_base(struct sv *v) {
    v->n = 0;
    sv_add(v, "<unk>", 0, MOETAX_TOKEN_TYPE_UNKNOWN);
    sv_add(v, "<s>", 0, MOETAX_TOKEN_TYPE_CONTROL);
    sv_add(v, "</s>", 0, MOETAX_TOKEN_TYPE_CONTROL);
    for (int b = 0; b < 256; b++) {
        char t[8];
        snprintf(t, sizeof t, "<0x%02X>", b);
        sv_add(v, t, 0, MOETAX_TOKEN_TYPE_BYTE);
    }
    static const char *const singles[] = {SP, "h", "e", "l", "o", "w", "r", "d", "a", "b"};
    for (size_t i = 0; i < sizeof singles / sizeof singles[0]; i++) sv_add(v, singles[i], -10, MOETAX_TOKEN_TYPE_NORMAL);
}

static void sv_free(struct sv *v) {
    for (int i = 0; i < v->n; i++) free(v->text[i]);
    v->n = 0;
}

/* space_prefix / add_bos: -1 omits the key */
static struct moetax_tokenizer *sv_load(const struct sv *v, const char *name, int space_prefix, int add_bos) {
    const char *path = tu_path(name);
    struct moetax_gguf_writer *w = NULL;
    if (moetax_gguf_writer_init(path, &w)) return NULL;
    moetax_gguf_writer_set_str(w, "general.architecture", "deepseek2");
    moetax_gguf_writer_set_str(w, "tokenizer.ggml.model", "llama");
    moetax_gguf_writer_set_arr_str(w, "tokenizer.ggml.tokens", (const char *const *)v->text, (uint64_t)v->n);
    moetax_gguf_writer_set_arr(w, "tokenizer.ggml.scores", MOETAX_GGUF_TYPE_FLOAT32, v->score, (uint64_t)v->n);
    moetax_gguf_writer_set_arr(w, "tokenizer.ggml.token_type", MOETAX_GGUF_TYPE_INT32, v->type, (uint64_t)v->n);
    moetax_gguf_writer_set_i32(w, "tokenizer.ggml.bos_token_id", 1);
    moetax_gguf_writer_set_i32(w, "tokenizer.ggml.eos_token_id", 2);
    moetax_gguf_writer_set_i32(w, "tokenizer.ggml.unknown_token_id", 0);
    if (space_prefix >= 0) moetax_gguf_writer_set_bool(w, "tokenizer.ggml.add_space_prefix", space_prefix != 0);
    if (add_bos >= 0) moetax_gguf_writer_set_bool(w, "tokenizer.ggml.add_bos_token", add_bos != 0);
    moetax_status st = moetax_gguf_writer_finish(w);
    moetax_gguf_writer_free(w);
    if (st) return NULL;
    struct moetax_gguf *g = NULL;
    struct moetax_tokenizer *t = NULL;
    if (moetax_gguf_open(path, &g) == MOETAX_OK) {
        if (moetax_tokenizer_load(g, &t)) fprintf(stderr, "load: %s\n", moetax_last_error());
        moetax_gguf_close(g);
    }
    return t;
}

/* encode text and compare with the space-separated token texts in want
 * ("#N" = the byte token of 0xN hex) */
static void expect(const struct sv *v, const struct moetax_tokenizer *t, const char *text, bool bos, const char *want) {
    int32_t ids[256], exp[256];
    int64_t n = 0;
    int ne = 0;
    char buf[512];
    snprintf(buf, sizeof buf, "%s", want);
    for (char *tok = strtok(buf, " "); tok; tok = strtok(NULL, " ")) {
        if (tok[0] == '#') exp[ne++] = 3 + (int32_t)strtol(tok + 1, NULL, 16);
        else exp[ne++] = sv_id(v, tok);
    }
    moetax_status st = moetax_tokenizer_encode(t, text, strlen(text), bos, ids, 256, &n);
    bool ok = st == MOETAX_OK && n == ne && !memcmp(ids, exp, (size_t)ne * sizeof *ids);
    CHECK_MSG(ok, "encode \"%s\": want %s", text, want);
    if (!ok) {
        fprintf(stderr, "   got");
        for (int64_t i = 0; i < n; i++) fprintf(stderr, " %d(%s)", ids[i], v->text[ids[i]]);
        fprintf(stderr, "\n");
    }
}

static bool round_trip(const struct moetax_tokenizer *t, const char *s, size_t n, bool bos) {
    int32_t *ids = malloc((n + 2) * sizeof *ids);
    char *back = malloc(n + 8);
    int64_t m = 0;
    size_t nb = 0;
    bool ok = moetax_tokenizer_encode(t, s, n, bos, ids, (int64_t)n + 2, &m) == MOETAX_OK &&
              moetax_tokenizer_decode(t, ids, m, back, n + 8, &nb) == MOETAX_OK && nb == n && !memcmp(back, s, n);
    free(ids);
    free(back);
    return ok;
}

static void test_spm(void) {
    struct sv v;
    sv_base(&v);
    sv_add(&v, SP "h", -3, MOETAX_TOKEN_TYPE_NORMAL);
    sv_add(&v, "el", -2, MOETAX_TOKEN_TYPE_NORMAL);
    sv_add(&v, "ll", -1.5f, MOETAX_TOKEN_TYPE_NORMAL);
    sv_add(&v, "lo", -1, MOETAX_TOKEN_TYPE_NORMAL);
    sv_add(&v, "ab", -1, MOETAX_TOKEN_TYPE_NORMAL);
    sv_add(&v, "ba", -1, MOETAX_TOKEN_TYPE_NORMAL);
    sv_add(&v, SP "w", -4, MOETAX_TOKEN_TYPE_NORMAL);
    sv_add(&v, "or", -4, MOETAX_TOKEN_TYPE_NORMAL);
    sv_add(&v, "<|u|>", 0, MOETAX_TOKEN_TYPE_USER_DEFINED);
    struct moetax_tokenizer *t = sv_load(&v, "spm.gguf", -1, -1);
    CHECK(t != NULL);
    if (!t) { sv_free(&v); return; }
    CHECK(moetax_tokenizer_add_bos(t));                   /* SPM default */
    CHECK_EQ_INT(moetax_tokenizer_bos(t), 1);
    CHECK_EQ_INT(moetax_tokenizer_eos(t), 2);
    /* lo (-1) before ll (-1.5), el (-2), ▁h (-3); the stale ll is skipped */
    expect(&v, t, "hello", false, SP "h el lo");
    expect(&v, t, "hello", true, "<s> " SP "h el lo");
    /* equal scores: the leftmost pair first */
    expect(&v, t, "aba", false, SP " ab a");
    expect(&v, t, "bab", false, SP " ba b");
    /* byte fallback for characters that are not pieces; spaces are ▁ */
    expect(&v, t, "h\xc3\xa9", false, SP "h #C3 #A9");
    expect(&v, t, "x y", false, SP " #78 " SP " #79");
    expect(&v, t, "hello world", false, SP "h el lo " SP "w or l d");
    expect(&v, t, "", false, "");
    expect(&v, t, "", true, "<s>");
    /* user-defined tokens are cut out; the text after one gets a space in front again */
    expect(&v, t, "a<|u|>b", false, SP " a <|u|> " SP " b");
    /* text that spells a control token is not that token */
    expect(&v, t, "<s>", false, SP " #3C #73 #3E");

    /* decode: ▁ back to space, bytes, control tokens empty, the first space dropped (after BOS too) */
    char buf[64];
    int n = moetax_tokenizer_token_to_bytes(t, sv_id(&v, SP "h"), buf, sizeof buf);
    CHECK(n == 2 && !memcmp(buf, " h", 2));
    n = moetax_tokenizer_token_to_bytes(t, 3 + 0xC3, buf, sizeof buf);
    CHECK(n == 1 && (unsigned char)buf[0] == 0xC3);
    CHECK_EQ_INT(moetax_tokenizer_token_to_bytes(t, 1, buf, sizeof buf), 0);
    int32_t ids[] = {1, sv_id(&v, SP "h"), sv_id(&v, "el"), sv_id(&v, "lo"), sv_id(&v, SP "w"), 3 + 0xC3, 3 + 0xA9, 2};
    size_t nb = 0;
    CHECK(moetax_tokenizer_decode(t, ids, 8, buf, sizeof buf, &nb) == MOETAX_OK && nb == 9 &&
          !memcmp(buf, "hello w\xc3\xa9", 9));
    CHECK(moetax_tokenizer_decode(t, ids + 1, 3, buf, sizeof buf, &nb) == MOETAX_OK && nb == 5 &&
          !memcmp(buf, "hello", 5));

    /* round trips on random valid UTF-8 (no U+2581 in the text). Not for any
     * bytes: a lead byte swallows the next bytes whole, so "\xe3 " takes two
     * bytes of the U+2581 that stands for the space, as in llama.cpp. */
    static const char *const chars[] = {"h", "e", "l", "o", " ", "a", "b", "x", "\n", "\xc3\xa9", "\xe3\x81\x82",
                                        "\xf0\x9f\x98\x80", "\x80", "  "};
    tu_rng r = {12345};
    int bad = 0;
    for (int it = 0; it < 2000; it++) {
        char s[256];
        size_t len = 0, k = (size_t)(tu_rand_u64(&r) % 40);
        for (size_t i = 0; i < k; i++) {
            const char *c = chars[tu_rand_u64(&r) % (sizeof chars / sizeof chars[0])];
            memcpy(s + len, c, strlen(c));
            len += strlen(c);
        }
        if (!round_trip(t, s, len, it & 1)) bad++;
    }
    CHECK_EQ_INT(bad, 0);
    /* s[0] = 0 too */
    CHECK(round_trip(t, "\0a b", 4, true));
    moetax_tokenizer_free(t);

    /* add_space_prefix = false; add_bos_token = false */
    t = sv_load(&v, "spm_nospace.gguf", 0, 0);
    CHECK(t != NULL);
    if (t) {
        CHECK(!moetax_tokenizer_add_bos(t));
        expect(&v, t, "hello", false, "h el lo");
        expect(&v, t, " hello", false, SP "h el lo");
        CHECK(round_trip(t, "hello world", 11, true));
        CHECK(round_trip(t, " hello", 6, false));
        moetax_tokenizer_free(t);
    }
    sv_free(&v);
}

/* GPT-2's byte -> code point map, as UTF-8 */
static void b2u_text(int b, char *out) {
    int n = 0, cp = -1;
    for (int x = 0; x < 256; x++) {
        bool pr = (x >= 0x21 && x <= 0x7e) || (x >= 0xa1 && x <= 0xac) || (x >= 0xae && x <= 0xff);
        int c = pr ? x : 0x100 + n++;
        if (x == b) cp = c;
    }
    if (cp < 0x80) { out[0] = (char)cp; out[1] = 0; }
    else { out[0] = (char)(0xc0 | (cp >> 6)); out[1] = (char)(0x80 | (cp & 0x3f)); out[2] = 0; }
}

static struct moetax_tokenizer *bpe_load(const char *name, const char *pre) {
    char *toks[260];
    for (int b = 0; b < 256; b++) {
        toks[b] = malloc(4);
        b2u_text(b, toks[b]);
    }
    toks[256] = strdup("ab");
    toks[257] = strdup("abc");
    const char *merges[] = {"a b"};
    const char *path = tu_path(name);
    struct moetax_gguf_writer *w = NULL;
    struct moetax_tokenizer *t = NULL;
    if (!moetax_gguf_writer_init(path, &w)) {
        moetax_gguf_writer_set_str(w, "tokenizer.ggml.model", "gpt2");
        moetax_gguf_writer_set_str(w, "tokenizer.ggml.pre", pre);
        moetax_gguf_writer_set_arr_str(w, "tokenizer.ggml.tokens", (const char *const *)toks, 258);
        moetax_gguf_writer_set_arr_str(w, "tokenizer.ggml.merges", merges, 1);
        moetax_status st = moetax_gguf_writer_finish(w);
        moetax_gguf_writer_free(w);
        struct moetax_gguf *g = NULL;
        if (!st && !moetax_gguf_open(path, &g)) {
            if (moetax_tokenizer_load(g, &t)) fprintf(stderr, "load: %s\n", moetax_last_error());
            moetax_gguf_close(g);
        }
    }
    for (int i = 0; i < 258; i++) free(toks[i]);
    return t;
}

/* llama3's ignore_merges: "abc" is a token that no merge reaches */
static void test_ignore_merges(void) {
    int32_t ids[16];
    int64_t n = 0;
    struct moetax_tokenizer *t = bpe_load("bpe_gpt2.gguf", "gpt2");
    CHECK(t != NULL);
    if (t) {
        CHECK(moetax_tokenizer_encode(t, "abc", 3, false, ids, 16, &n) == MOETAX_OK && n == 2 && ids[0] == 256 &&
              ids[1] == 'c');
        moetax_tokenizer_free(t);
    }
    t = bpe_load("bpe_llama3.gguf", "llama-bpe");
    CHECK(t != NULL);
    if (t) {
        CHECK(moetax_tokenizer_encode(t, "abc", 3, false, ids, 16, &n) == MOETAX_OK && n == 1 && ids[0] == 257);
        CHECK(moetax_tokenizer_encode(t, "abcd", 4, false, ids, 16, &n) == MOETAX_OK && n == 3 && ids[0] == 256 &&
              ids[1] == 'c' && ids[2] == 'd');
        moetax_tokenizer_free(t);
    }
}

int main(int argc, char **argv) {
    tu_init(argc, argv);
    test_spm();
    test_ignore_merges();
    return tu_finish("test_tokenizer_spm");
}
