// ctest-labels: unit
/* test_tokenizer.c - byte-level BPE tokenizer: known encodings on a hand-made
 * vocabulary (table-driven, pins the GPT-2 pre-tokenizer rules), round trips on
 * the `moetax gen` vocabularies, a slow reference BPE, malformed vocabularies,
 * buffer limits, and the encode speed on a 1 MB text. */
#include "moetax/gen.h"
#include "moetax/gguf.h"
#include "moetax/tokenizer.h"
#include "testutil.h"

#include <stdlib.h>
#include <string.h>
#include <time.h>

/* ---- a vocabulary under construction (raw bytes and GPT-2 encoded text) ---- */

#define MAXTOK 1024
#define MAXMERGE 512

struct vocab {
    int n;
    char *raw[MAXTOK];  /* the bytes a token stands for */
    size_t raw_len[MAXTOK];
    char *enc[MAXTOK];  /* GPT-2 byte-to-unicode text, as stored in GGUF */
    int32_t type[MAXTOK];
    int nm;
    char *merge[MAXMERGE];
};

/* GPT-2's byte -> code point map, written independently of the library. */
static int b2u(int b) {
    static int tab[256], init = 0;
    if (!init) {
        int n = 0;
        for (int x = 0; x < 256; x++) {
            bool printable = (x >= '!' && x <= '~') || (x >= 0xa1 && x <= 0xac) || (x >= 0xae && x <= 0xff);
            tab[x] = printable ? x : 256 + n++;
        }
        init = 1;
    }
    return tab[b];
}

static char *encode_raw(const char *raw, size_t n) {
    char *o = malloc(2 * n + 1), *p = o;
    for (size_t i = 0; i < n; i++) {
        int cp = b2u((unsigned char)raw[i]);
        if (cp < 0x80) *p++ = (char)cp;
        else { *p++ = (char)(0xc0 | (cp >> 6)); *p++ = (char)(0x80 | (cp & 0x3f)); }
    }
    *p = 0;
    return o;
}

static int vocab_add(struct vocab *v, const char *raw, size_t n, int32_t type) {
    int id = v->n++;
    v->raw[id] = malloc(n + 1);
    memcpy(v->raw[id], raw, n);
    v->raw[id][n] = 0;
    v->raw_len[id] = n;
    v->enc[id] = encode_raw(raw, n);
    v->type[id] = type;
    return id;
}

/* Add a token verbatim (not byte-encoded: control tokens). */
static int vocab_add_text(struct vocab *v, const char *text, int32_t type) {
    int id = vocab_add(v, text, strlen(text), type);
    free(v->enc[id]);
    v->enc[id] = strdup(text);
    return id;
}

static void vocab_add_merge(struct vocab *v, const char *l, const char *r, int32_t type) {
    char *el = encode_raw(l, strlen(l)), *er = encode_raw(r, strlen(r));
    size_t n = strlen(el) + strlen(er) + 2;
    v->merge[v->nm] = malloc(n);
    snprintf(v->merge[v->nm++], n, "%s %s", el, er);
    free(el);
    free(er);
    char joined[256];
    snprintf(joined, sizeof joined, "%s%s", l, r);
    vocab_add(v, joined, strlen(joined), type);
}

static void vocab_bytes(struct vocab *v) {
    for (int b = 0; b < 256; b++) {
        char c = (char)b;
        vocab_add(v, &c, 1, MOETAX_TOKEN_TYPE_NORMAL);
    }
}

static void vocab_free(struct vocab *v) {
    for (int i = 0; i < v->n; i++) { free(v->raw[i]); free(v->enc[i]); }
    for (int i = 0; i < v->nm; i++) free(v->merge[i]);
    memset(v, 0, sizeof *v);
}

static int vocab_find_raw(const struct vocab *v, const char *raw) {
    for (int i = 0; i < v->n; i++)
        if (v->type[i] == MOETAX_TOKEN_TYPE_NORMAL && v->raw_len[i] == strlen(raw) && !memcmp(v->raw[i], raw, v->raw_len[i]))
            return i;
    return -1;
}

/* ---- writing a vocabulary to GGUF, with ways to break it ---------------------- */

#define OMIT INT64_MIN

struct wopt {
    const char *model;     /* NULL: omit tokenizer.ggml.model */
    const char *pre;       /* NULL: omit */
    int64_t bos, eos, eot; /* OMIT: no key */
    int add_bos;           /* -1: omit the key */
    bool no_tokens, tokens_as_int, no_merges, types_short, no_types, model_as_int;
    const char *extra_merge; /* appended to the merges as is */
};

static struct wopt wopt_default(void) {
    struct wopt o = {.model = "gpt2", .pre = "default", .bos = OMIT, .eos = OMIT, .eot = OMIT, .add_bos = -1};
    return o;
}

static moetax_status write_and_load(const struct vocab *v, const struct wopt *o, const char *name,
                                    struct moetax_tokenizer **out) {
    *out = NULL;
    const char *path = tu_path(name);
    struct moetax_gguf_writer *w = NULL;
    moetax_status st = moetax_gguf_writer_init(path, &w);
    if (st) return st;
    moetax_gguf_writer_set_str(w, "general.architecture", "deepseek2");
    if (o->model_as_int) moetax_gguf_writer_set_u32(w, "tokenizer.ggml.model", 2);
    else if (o->model) moetax_gguf_writer_set_str(w, "tokenizer.ggml.model", o->model);
    if (o->pre) moetax_gguf_writer_set_str(w, "tokenizer.ggml.pre", o->pre);
    if (o->tokens_as_int) {
        int32_t *ids = malloc(sizeof(int32_t) * (size_t)v->n);
        for (int i = 0; i < v->n; i++) ids[i] = i;
        moetax_gguf_writer_set_arr(w, "tokenizer.ggml.tokens", MOETAX_GGUF_TYPE_INT32, ids, (uint64_t)v->n);
        free(ids);
    } else if (!o->no_tokens) {
        moetax_gguf_writer_set_arr_str(w, "tokenizer.ggml.tokens", (const char *const *)v->enc, (uint64_t)v->n);
    }
    if (!o->no_types)
        moetax_gguf_writer_set_arr(w, "tokenizer.ggml.token_type", MOETAX_GGUF_TYPE_INT32, v->type,
                                   (uint64_t)(o->types_short ? v->n - 1 : v->n));
    if (!o->no_merges) {
        const char *m[MAXMERGE + 1];
        int nm = 0;
        for (int i = 0; i < v->nm; i++) m[nm++] = v->merge[i];
        if (o->extra_merge) m[nm++] = o->extra_merge;
        moetax_gguf_writer_set_arr_str(w, "tokenizer.ggml.merges", m, (uint64_t)nm);
    }
    if (o->bos != OMIT) moetax_gguf_writer_set_i32(w, "tokenizer.ggml.bos_token_id", (int32_t)o->bos);
    if (o->eos != OMIT) moetax_gguf_writer_set_i32(w, "tokenizer.ggml.eos_token_id", (int32_t)o->eos);
    if (o->eot != OMIT) moetax_gguf_writer_set_i32(w, "tokenizer.ggml.eot_token_id", (int32_t)o->eot);
    if (o->add_bos >= 0) moetax_gguf_writer_set_bool(w, "tokenizer.ggml.add_bos_token", o->add_bos != 0);
    st = moetax_gguf_writer_finish(w);
    moetax_gguf_writer_free(w);
    if (st) return st;
    struct moetax_gguf *g = NULL;
    if ((st = moetax_gguf_open(path, &g))) return st;
    st = moetax_tokenizer_load(g, out);
    moetax_gguf_close(g); /* the tokenizer must not depend on the mapping */
    return st;
}

/* ---- helpers ------------------------------------------------------------------------ */

/* Encode; with out == NULL only count the tokens. */
static int64_t enc(const struct moetax_tokenizer *t, const char *s, size_t n, int32_t *out, int64_t cap) {
    int64_t k = -1;
    moetax_status st = moetax_tokenizer_encode(t, s, n, false, out, cap, &k);
    bool ok = st == MOETAX_OK || (!out && st == MOETAX_ERR_LIMIT);
    CHECK_MSG(ok, "encode: %s", moetax_last_error());
    return ok ? k : -1;
}

static bool round_trip(const struct moetax_tokenizer *t, const char *s, size_t n) {
    int64_t cap = (int64_t)n + 2;
    int32_t *ids = malloc(sizeof(int32_t) * (size_t)cap);
    char *back = malloc(n + 1);
    int64_t k = -1;
    size_t m = 0;
    bool ok = moetax_tokenizer_encode(t, s, n, false, ids, cap, &k) == MOETAX_OK &&
              moetax_tokenizer_decode(t, ids, k, back, n + 1, &m) == MOETAX_OK && m == n && memcmp(back, s, n) == 0;
    for (int64_t i = 0; ok && i < k; i++) {
        int32_t ty = moetax_tokenizer_token_type(t, ids[i]);
        ok = ty != MOETAX_TOKEN_TYPE_CONTROL && ty != MOETAX_TOKEN_TYPE_UNUSED && ty != MOETAX_TOKEN_TYPE_UNKNOWN;
    }
    free(ids);
    free(back);
    return ok;
}

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* ---- the hand-made vocabulary and the table of known encodings --------------- */

static const char *const k_merges[][2] = {
    {" ", " "}, {"  ", " "}, {"\n", "\n"}, {" ", "\n"}, {"\t", " "},
    {"h", "e"}, {"l", "l"}, {"he", "ll"}, {"hell", "o"}, {" ", "hello"},
    {"w", "o"}, {"wo", "r"}, {"wor", "l"}, {"worl", "d"}, {" ", "world"},
    {"'", "s"}, {"'", "t"}, {"r", "e"}, {"'", "re"}, {"v", "e"}, {"'", "ve"}, {"'", "m"}, {"'", "ll"},
    {"'", "d"}, {"'", "S"}, {"d", "o"}, {"do", "n"}, {"n", "'"}, {"e", "'"},
    {"1", "2"}, {"12", "3"}, {" ", "123"}, {"a", "1"}, {"1", "a"}, {"3", "4"},
    {"!", "!"}, {"!!", "!"}, {" ", "!!!"}, {"?", "!"}, {"!", " "}, {".", "\n"}, {" ", "'"},
    {"\xc3", "\xa9"}, {"c", "a"}, {"ca", "f"}, {"caf", "\xc3\xa9"}, {"\xc3\xa9", "1"},
    {"<", "|"}, {"\t", "hello"}, {"\n", "hello"}, {"z", "z"},
};

/* Up to 12 expected pieces per case (raw bytes of each token), NULL-terminated. */
struct enc_case {
    const char *text;
    const char *pieces[12];
};

static const struct enc_case k_cases[] = {
    {"", {NULL}},
    {"hello", {"hello", NULL}},
    {" hello", {" hello", NULL}},
    {"hello world", {"hello", " world", NULL}},
    /* \s+(?!\S): a run of spaces gives all but the last, which leads the word */
    {"hello  world", {"hello", " ", " world", NULL}},
    {"hello   world", {"hello", "  ", " world", NULL}},
    {"hello    world", {"hello", "   ", " world", NULL}},
    {"  hello", {" ", " hello", NULL}},
    /* ... and the whole run at the end of the text */
    {"hello   ", {"hello", "   ", NULL}},
    {"hello \n world", {"hello", " \n", " world", NULL}},
    {"hello\n\nworld", {"hello", "\n", "\n", "world", NULL}},
    {"hello\n\n", {"hello", "\n\n", NULL}},
    {"hello.\nworld", {"hello", ".", "\n", "world", NULL}},
    /* only a plain space leads a word; a tab is whitespace of its own */
    {"hello\t world", {"hello", "\t", " world", NULL}},
    {"\thello", {"\t", "hello", NULL}},
    {"\nhello", {"\n", "hello", NULL}},
    {"a\n\nhello", {"a", "\n", "\n", "hello", NULL}},
    /* contractions: lower case only, split off the word before them */
    {"don't", {"don", "'t", NULL}},
    {"he's", {"he", "'s", NULL}},
    {"he're", {"he", "'re", NULL}},
    {"he've", {"he", "'ve", NULL}},
    {"he'll", {"he", "'ll", NULL}},
    {"he'd", {"he", "'d", NULL}},
    {"he'm", {"he", "'m", NULL}},
    {"'sup", {"'s", "u", "p", NULL}},
    {"HE'S", {"H", "E", "'", "S", NULL}},
    {"he 's", {"he", " '", "s", NULL}},
    {"''s", {"'", "'", "s", NULL}},
    /* letters, digits and other symbols are separate runs; digits are unlimited */
    {"a1", {"a", "1", NULL}},
    {"1a", {"1", "a", NULL}},
    {"1234", {"123", "4", NULL}},
    {"hello 123", {"hello", " 123", NULL}},
    {"12 34", {"12", " ", "34", NULL}},
    {"!!!", {"!!!", NULL}},
    {"wow !!!", {"wo", "w", " !!!", NULL}},
    {"!! ", {"!!", " ", NULL}},
    {"?!", {"?!", NULL}},
    {"hello!!!world", {"hello", "!!!", "world", NULL}},
    /* non-ASCII letters join a letter run; a non-ASCII letter then a digit split */
    {"caf\xc3\xa9", {"caf\xc3\xa9", NULL}},
    {"\xc3\xa9" "1", {"\xc3\xa9", "1", NULL}},
    /* a merge that would build a control token is ignored */
    {"<|>", {"<|", ">", NULL}},
};

static void test_known_encodings(void) {
    struct vocab v = {0};
    vocab_bytes(&v);
    for (size_t i = 0; i < sizeof k_merges / sizeof k_merges[0]; i++)
        vocab_add_merge(&v, k_merges[i][0], k_merges[i][1], MOETAX_TOKEN_TYPE_NORMAL);
    vocab_add_merge(&v, "<|", ">", MOETAX_TOKEN_TYPE_CONTROL); /* "<|>" is a control token */
    int bos = vocab_add_text(&v, "<|bos|>", MOETAX_TOKEN_TYPE_CONTROL);
    int eos = vocab_add_text(&v, "<|eos|>", MOETAX_TOKEN_TYPE_CONTROL);
    int eot = vocab_add_text(&v, "<|eot|>", MOETAX_TOKEN_TYPE_CONTROL);
    vocab_add_text(&v, "<|unused_0|>", MOETAX_TOKEN_TYPE_UNUSED);

    struct wopt o = wopt_default();
    o.bos = bos;
    o.eos = eos;
    o.eot = eot;
    struct moetax_tokenizer *t = NULL;
    moetax_status st = write_and_load(&v, &o, "tok_hand.gguf", &t);
    CHECK_MSG(st == MOETAX_OK, "%s", moetax_last_error());
    if (!t) { vocab_free(&v); return; }
    CHECK_EQ_INT(moetax_tokenizer_n_vocab(t), v.n);
    CHECK_EQ_INT(moetax_tokenizer_bos(t), bos);
    CHECK_EQ_INT(moetax_tokenizer_eos(t), eos);
    CHECK(!moetax_tokenizer_add_bos(t)); /* gpt2 + pre "default" + no key: false, as llama.cpp */
    CHECK(moetax_tokenizer_is_eog(t, eos));
    CHECK(moetax_tokenizer_is_eog(t, eot));
    CHECK(!moetax_tokenizer_is_eog(t, bos));
    CHECK(!moetax_tokenizer_is_eog(t, -1));
    CHECK(!moetax_tokenizer_is_eog(t, v.n));

    for (size_t c = 0; c < sizeof k_cases / sizeof k_cases[0]; c++) {
        const struct enc_case *kc = &k_cases[c];
        int32_t exp[12], got[64];
        int ne = 0;
        for (; kc->pieces[ne]; ne++) {
            exp[ne] = vocab_find_raw(&v, kc->pieces[ne]);
            CHECK_MSG(exp[ne] >= 0, "case %zu: piece \"%s\" is not in the test vocabulary", c, kc->pieces[ne]);
        }
        int64_t k = enc(t, kc->text, strlen(kc->text), got, 64);
        bool same = k == ne;
        for (int i = 0; same && i < ne; i++) same = got[i] == exp[i];
        if (!same) {
            fprintf(stderr, "case %zu \"%s\": got", c, kc->text);
            for (int64_t i = 0; i < k; i++) fprintf(stderr, " [%s]", got[i] >= 0 && got[i] < v.n ? v.raw[got[i]] : "?");
            fprintf(stderr, "\n");
        }
        CHECK_MSG(same, "case %zu: \"%s\"", c, kc->text);
        CHECK(round_trip(t, kc->text, strlen(kc->text)));
    }

    /* equal ranks merge leftmost first, on the short (scan) and long (heap) paths */
    for (int len = 3; len <= 301; len += 2) {
        char zs[301];
        int32_t zid[200];
        memset(zs, 'z', (size_t)len);
        int64_t nz = enc(t, zs, (size_t)len, zid, 200);
        CHECK_EQ_INT(nz, len / 2 + 1);
        CHECK_MSG(nz > 1 && zid[0] == vocab_find_raw(&v, "zz") && zid[nz - 1] == 'z', "%d z's", len);
    }

    /* BOS in front when asked */
    int32_t ids[8];
    int64_t k = 0;
    CHECK(moetax_tokenizer_encode(t, "hello", 5, true, ids, 8, &k) == MOETAX_OK);
    CHECK_EQ_INT(k, 2);
    CHECK_EQ_INT(ids[0], bos);
    CHECK_EQ_INT(ids[1], vocab_find_raw(&v, "hello"));

    /* control text is not parsed as a special token */
    k = enc(t, "<|eos|>", 7, NULL, 0);
    CHECK(k > 1);

    /* token_to_bytes: control tokens give "", bytes give themselves */
    char buf[16];
    CHECK_EQ_INT(moetax_tokenizer_token_to_bytes(t, eos, buf, 16), 0);
    CHECK_EQ_INT(moetax_tokenizer_token_to_bytes(t, 0xe9, buf, 16), 1);
    CHECK_EQ_INT((unsigned char)buf[0], 0xe9);
    int hello = vocab_find_raw(&v, "hello");
    CHECK_EQ_INT(moetax_tokenizer_token_to_bytes(t, hello, buf, 3), -5);
    CHECK_EQ_INT(moetax_tokenizer_token_to_bytes(t, hello, buf, 5), 5);
    CHECK(memcmp(buf, "hello", 5) == 0);
    CHECK_EQ_INT(moetax_tokenizer_token_to_bytes(t, -1, buf, 16), 0);
    CHECK_EQ_INT(moetax_tokenizer_token_type(t, eos), MOETAX_TOKEN_TYPE_CONTROL);
    CHECK_EQ_INT(moetax_tokenizer_token_type(t, v.n), -1);

    /* limits: encode */
    const char *txt = "hello world hello";
    int64_t need = enc(t, txt, strlen(txt), NULL, 0);
    CHECK_EQ_INT(need, 3);
    k = -1;
    CHECK(moetax_tokenizer_encode(t, txt, strlen(txt), false, NULL, 0, &k) == MOETAX_ERR_LIMIT);
    CHECK_EQ_INT(k, 3);
    CHECK(moetax_tokenizer_encode(t, txt, strlen(txt), true, ids, 3, &k) == MOETAX_ERR_LIMIT);
    CHECK_EQ_INT(k, 4);
    CHECK(strstr(moetax_last_error(), "4 tokens") != NULL);
    CHECK(moetax_tokenizer_encode(t, txt, strlen(txt), true, ids, 4, &k) == MOETAX_OK);
    CHECK_EQ_INT(k, 4);
    CHECK(moetax_tokenizer_encode(t, NULL, 3, false, ids, 4, &k) == MOETAX_ERR_ARG);
    CHECK(moetax_tokenizer_encode(t, NULL, 0, false, ids, 4, &k) == MOETAX_OK && k == 0);
    CHECK(moetax_tokenizer_encode(t, txt, 3, false, ids, -1, &k) == MOETAX_ERR_ARG);

    /* limits: decode */
    int32_t hw[3] = {hello, vocab_find_raw(&v, " world"), eos};
    size_t m = 0;
    char out[32];
    CHECK(moetax_tokenizer_decode(t, hw, 3, out, 5, &m) == MOETAX_ERR_LIMIT);
    CHECK_EQ_INT(m, 11);
    CHECK(memcmp(out, "hello", 5) == 0);
    CHECK(moetax_tokenizer_decode(t, hw, 3, NULL, 0, &m) == MOETAX_ERR_LIMIT && m == 11);
    CHECK(moetax_tokenizer_decode(t, hw, 3, out, 11, &m) == MOETAX_OK && m == 11);
    CHECK(moetax_tokenizer_decode(t, hw, 3, out, sizeof out, &m) == MOETAX_OK && m == 11);
    CHECK(strcmp(out, "hello world") == 0);
    int32_t badids[2] = {hello, v.n};
    CHECK(moetax_tokenizer_decode(t, badids, 2, out, sizeof out, &m) == MOETAX_ERR_ARG);
    CHECK(strstr(moetax_last_error(), "token 1") != NULL);
    moetax_tokenizer_free(t);

    /* add_bos: the key wins; without it, true for the llama3-style pre-tokenizers */
    o.add_bos = 1;
    CHECK(write_and_load(&v, &o, "tok_hand_ab1.gguf", &t) == MOETAX_OK && t && moetax_tokenizer_add_bos(t));
    moetax_tokenizer_free(t);
    o.add_bos = -1;
    o.pre = "llama-bpe";
    CHECK(write_and_load(&v, &o, "tok_hand_ab2.gguf", &t) == MOETAX_OK && t && moetax_tokenizer_add_bos(t));
    moetax_tokenizer_free(t);
    o.add_bos = 0;
    CHECK(write_and_load(&v, &o, "tok_hand_ab3.gguf", &t) == MOETAX_OK && t && !moetax_tokenizer_add_bos(t));
    moetax_tokenizer_free(t);
    o.add_bos = 1;
    o.bos = OMIT; /* no BOS token: never add one */
    CHECK(write_and_load(&v, &o, "tok_hand_ab4.gguf", &t) == MOETAX_OK && t && !moetax_tokenizer_add_bos(t));
    if (t) {
        CHECK_EQ_INT(moetax_tokenizer_bos(t), -1);
        CHECK(moetax_tokenizer_encode(t, "hello", 5, true, ids, 8, &k) == MOETAX_OK && k == 1);
    }
    moetax_tokenizer_free(t);
    /* no token_type array: every token is normal and decodes byte-level */
    o = wopt_default();
    o.no_types = true;
    CHECK(write_and_load(&v, &o, "tok_hand_notypes.gguf", &t) == MOETAX_OK && t);
    if (t) {
        CHECK_EQ_INT(moetax_tokenizer_token_type(t, eos), MOETAX_TOKEN_TYPE_NORMAL);
        CHECK_EQ_INT(moetax_tokenizer_token_to_bytes(t, eos, buf, 16), 7);
    }
    moetax_tokenizer_free(t);
    vocab_free(&v);
}

/* ---- malformed vocabularies --------------------------------------------------------- */

static void expect_fail(const struct vocab *v, const struct wopt *o, const char *name, moetax_status want,
                        const char *msg1, const char *msg2) {
    struct moetax_tokenizer *t = NULL;
    moetax_status st = write_and_load(v, o, name, &t);
    CHECK_MSG(st == want, "%s: got %s, want %s (%s)", name, moetax_status_name(st), moetax_status_name(want),
              moetax_last_error());
    CHECK(t == NULL);
    const char *e = moetax_last_error();
    CHECK_MSG(strstr(e, msg1) != NULL, "%s: message \"%s\" lacks \"%s\"", name, e, msg1);
    if (msg2) CHECK_MSG(strstr(e, msg2) != NULL, "%s: message \"%s\" lacks \"%s\"", name, e, msg2);
    moetax_tokenizer_free(t);
}

static void test_malformed(void) {
    struct vocab v = {0};
    vocab_bytes(&v);
    vocab_add_merge(&v, "a", "b", MOETAX_TOKEN_TYPE_NORMAL);
    vocab_add_merge(&v, "ab", "c", MOETAX_TOKEN_TYPE_NORMAL);
    vocab_add_text(&v, "<|eos|>", MOETAX_TOKEN_TYPE_CONTROL);

    struct wopt o = wopt_default();
    struct moetax_tokenizer *t = NULL;
    CHECK_MSG(write_and_load(&v, &o, "tok_ok.gguf", &t) == MOETAX_OK, "%s", moetax_last_error());
    moetax_tokenizer_free(t);

    o = wopt_default(); o.extra_merge = "zz q";
    expect_fail(&v, &o, "tok_bad_merge_left.gguf", MOETAX_ERR_FORMAT, "tokenizer.ggml.merges[2]", "\"zz\"");
    o = wopt_default(); o.extra_merge = "a zz";
    expect_fail(&v, &o, "tok_bad_merge_right.gguf", MOETAX_ERR_FORMAT, "tokenizer.ggml.merges[2]", "right part");
    o = wopt_default(); o.extra_merge = "a d"; /* "ad" is not a token */
    expect_fail(&v, &o, "tok_bad_merge_joined.gguf", MOETAX_ERR_FORMAT, "tokenizer.ggml.merges[2]", "\"ad\"");
    o = wopt_default(); o.extra_merge = "abc";
    expect_fail(&v, &o, "tok_bad_merge_nospace.gguf", MOETAX_ERR_FORMAT, "tokenizer.ggml.merges[2]", "left right");
    o = wopt_default(); o.bos = v.n;
    expect_fail(&v, &o, "tok_bad_bos.gguf", MOETAX_ERR_FORMAT, "tokenizer.ggml.bos_token_id", "out of range");
    o = wopt_default(); o.eos = -5;
    expect_fail(&v, &o, "tok_bad_eos.gguf", MOETAX_ERR_FORMAT, "tokenizer.ggml.eos_token_id", "out of range");
    o = wopt_default(); o.tokens_as_int = true;
    expect_fail(&v, &o, "tok_bad_tokens_type.gguf", MOETAX_ERR_FORMAT, "tokenizer.ggml.tokens", "array of strings");
    o = wopt_default(); o.no_tokens = true; o.no_types = true;
    expect_fail(&v, &o, "tok_no_tokens.gguf", MOETAX_ERR_NOT_FOUND, "tokenizer.ggml.tokens", "missing");
    o = wopt_default(); o.no_merges = true;
    expect_fail(&v, &o, "tok_no_merges.gguf", MOETAX_ERR_NOT_FOUND, "tokenizer.ggml.merges", "missing");
    o = wopt_default(); o.model = "llama";
    expect_fail(&v, &o, "tok_llama.gguf", MOETAX_ERR_FORMAT, "<0x00>", "SPM vocabulary needs byte fallback");
    o = wopt_default(); o.model = "rwkv";
    expect_fail(&v, &o, "tok_rwkv.gguf", MOETAX_ERR_UNSUPPORTED, "\"rwkv\"", "gpt2");
    o = wopt_default(); o.model = NULL;
    expect_fail(&v, &o, "tok_no_model.gguf", MOETAX_ERR_NOT_FOUND, "tokenizer.ggml.model", "missing");
    o = wopt_default(); o.model_as_int = true;
    expect_fail(&v, &o, "tok_model_int.gguf", MOETAX_ERR_FORMAT, "tokenizer.ggml.model", "string");
    o = wopt_default(); o.types_short = true;
    expect_fail(&v, &o, "tok_types_short.gguf", MOETAX_ERR_FORMAT, "tokenizer.ggml.token_type", "one per token");

    /* a vocabulary without the byte token for 'A' */
    struct vocab nb = {0};
    for (int b = 0; b < 256; b++) {
        char c = (char)b;
        if (b != 'A') vocab_add(&nb, &c, 1, MOETAX_TOKEN_TYPE_NORMAL);
    }
    o = wopt_default();
    expect_fail(&nb, &o, "tok_no_byte.gguf", MOETAX_ERR_FORMAT, "byte 0x41", "tokenizer.ggml.tokens");
    vocab_free(&nb);
    vocab_free(&v);
}

/* ---- a slow reference BPE over GPT-2 text, for one pre-token --------------------- */

static void ref_bpe(const struct moetax_gen_vocab *gv, const char *raw, size_t n, int32_t *out, int64_t *n_out) {
    static size_t mlen[8192];
    for (int r = 0; r < gv->n_merges && r < 8192; r++) mlen[r] = strlen(gv->merges[r]);
    char **sym = malloc(n * sizeof *sym);
    size_t m = n;
    for (size_t i = 0; i < n; i++) sym[i] = encode_raw(raw + i, 1);
    for (;;) {
        int best_rank = -1;
        size_t best = 0;
        for (size_t i = 0; i + 1 < m; i++) {
            size_t la = strlen(sym[i]), lb = strlen(sym[i + 1]);
            for (int r = 0; r < gv->n_merges && (best_rank < 0 || r < best_rank); r++) {
                const char *mg = gv->merges[r];
                if (mlen[r] == la + lb + 1 && !memcmp(mg, sym[i], la) && mg[la] == ' ' && !memcmp(mg + la + 1, sym[i + 1], lb)) {
                    best_rank = r;
                    best = i;
                    break;
                }
            }
        }
        if (best_rank < 0) break;
        size_t la = strlen(sym[best]), lb = strlen(sym[best + 1]);
        char *j = malloc(la + lb + 1);
        memcpy(j, sym[best], la);
        memcpy(j + la, sym[best + 1], lb + 1);
        free(sym[best]);
        free(sym[best + 1]);
        sym[best] = j;
        memmove(sym + best + 1, sym + best + 2, (m - best - 2) * sizeof *sym);
        m--;
    }
    for (size_t i = 0; i < m; i++) {
        out[i] = -1;
        for (int k = 0; k < gv->n_tokens; k++)
            if (!strcmp(gv->tokens[k], sym[i])) { out[i] = k; break; }
        free(sym[i]);
    }
    free(sym);
    *n_out = (int64_t)m;
}

static moetax_status load_gen_vocab(int n_vocab, struct moetax_gen_vocab *gv, const char *name,
                                    struct moetax_tokenizer **t) {
    *t = NULL;
    moetax_status st = moetax_gen_vocab_build(n_vocab, gv);
    if (st) return st;
    const char *path = tu_path(name);
    struct moetax_gguf_writer *w = NULL;
    if ((st = moetax_gguf_writer_init(path, &w))) return st;
    moetax_gguf_writer_set_str(w, "tokenizer.ggml.model", "gpt2");
    moetax_gguf_writer_set_arr_str(w, "tokenizer.ggml.tokens", (const char *const *)gv->tokens, (uint64_t)gv->n_tokens);
    moetax_gguf_writer_set_arr(w, "tokenizer.ggml.token_type", MOETAX_GGUF_TYPE_INT32, gv->token_type, (uint64_t)gv->n_tokens);
    moetax_gguf_writer_set_arr_str(w, "tokenizer.ggml.merges", (const char *const *)gv->merges, (uint64_t)gv->n_merges);
    moetax_gguf_writer_set_u32(w, "tokenizer.ggml.bos_token_id", (uint32_t)gv->bos_id);
    moetax_gguf_writer_set_u32(w, "tokenizer.ggml.eos_token_id", (uint32_t)gv->eos_id);
    st = moetax_gguf_writer_finish(w);
    moetax_gguf_writer_free(w);
    if (st) return st;
    struct moetax_gguf *g = NULL;
    if ((st = moetax_gguf_open(path, &g))) return st;
    st = moetax_tokenizer_load(g, t);
    moetax_gguf_close(g);
    return st;
}

static void test_reference_bpe(void) {
    struct moetax_gen_vocab gv;
    struct moetax_tokenizer *t = NULL;
    moetax_status st = load_gen_vocab(512, &gv, "tok_gen512.gguf", &t);
    CHECK_MSG(st == MOETAX_OK, "%s", moetax_last_error());
    if (!t) { moetax_gen_vocab_free(&gv); return; }
    tu_rng r = {0x1234567};
    static const char letters[] = "etaoinshrdlucmfwypvbgkqjxzETAOI";
    int32_t got[1024], want[1024];
    /* single pre-tokens (letter runs, with or without a leading space) of every
     * length up to 300: short ones take the scan path, long ones the heap */
    for (int trial = 0; trial < 130; trial++) {
        size_t n = trial < 100 ? 1 + (size_t)(tu_rand_u64(&r) % 48) : 49 + (size_t)(tu_rand_u64(&r) % 250);
        char word[320];
        size_t o = 0;
        if (trial & 1) word[o++] = ' ';
        for (; o < n + (size_t)(trial & 1); o++) word[o] = letters[tu_rand_u64(&r) % (sizeof letters - 1)];
        int64_t kg = enc(t, word, o, got, 1024), kw = 0;
        ref_bpe(&gv, word, o, want, &kw);
        bool same = kg == kw;
        for (int64_t i = 0; same && i < kg; i++) same = got[i] == want[i];
        CHECK_MSG(same, "trial %d: %zu-byte word, %lld vs %lld tokens", trial, o, (long long)kg, (long long)kw);
    }
    /* a repeated pattern ties merges of equal rank: leftmost first */
    char rep[200];
    for (int i = 0; i < 199; i++) rep[i] = "the"[i % 3];
    int64_t kg = enc(t, rep, 199, got, 1024), kw = 0;
    ref_bpe(&gv, rep, 199, want, &kw);
    CHECK_EQ_INT(kg, kw);
    CHECK(kg == kw && memcmp(got, want, sizeof(int32_t) * (size_t)kg) == 0);
    moetax_tokenizer_free(t);
    moetax_gen_vocab_free(&gv);
}

/* ---- round trips on the generated vocabularies ---------------------------------- */

static const char *const k_texts[] = {
    "The quick brown fox jumps over the lazy dog.",
    "def main(argv=None):\n    if argv is None:\n        argv = sys.argv[1:]\n    return 0\n",
    "class Tokenizer:\n\tdef __init__(self):\n\t\tself.cache = {}  # comment\n\n\n",
    "\xce\x9a\xce\xb1\xce\xbb\xce\xb7\xce\xbc\xce\xad\xcf\x81\xce\xb1 \xce\xba\xcf\x8c\xcf\x83\xce\xbc\xce\xb5", /* Greek */
    "\xe4\xbd\xa0\xe5\xa5\xbd\xef\xbc\x8c\xe4\xb8\x96\xe7\x95\x8c\xe3\x80\x82",                             /* CJK */
    "emoji \xf0\x9f\x98\x80\xf0\x9f\x91\x8d\xf0\x9f\x8f\xbd and \xe2\x9c\x93",                            /* emoji */
    "invalid \xff\xfe \xc3 \x80\x80 \xed\xa0\x80 \xf4\x90\x80\x80 end",                                     /* not UTF-8 */
    "",
    " ",
    "     ",
    "\n",
    "\n\n\n",
    " \t \n \r\n  \x0b\x0c ",
    "a  b   c    d     e\t\tf\n\ng",
    "it's don't they're we've I'm you'll he'd 'S 's",
    "x=1+2*3; y=[4,5,6]; z={'a': 0x7f} // 12345678901234567890",
};

static void check_round_trips(const struct moetax_tokenizer *t, const char *what) {
    for (size_t i = 0; i < sizeof k_texts / sizeof k_texts[0]; i++)
        CHECK_MSG(round_trip(t, k_texts[i], strlen(k_texts[i])), "%s: text %zu", what, i);
    char all[512];
    for (int i = 0; i < 512; i++) all[i] = (char)(i & 255);
    CHECK_MSG(round_trip(t, all, 512), "%s: all bytes", what);
    CHECK_MSG(round_trip(t, "a\0b", 3), "%s: NUL byte", what);
    tu_rng r = {99};
    for (int trial = 0; trial < 300; trial++) {
        char buf[300];
        size_t n = (size_t)(tu_rand_u64(&r) % sizeof buf);
        int mode = trial % 3;
        for (size_t i = 0; i < n; i++) {
            uint64_t x = tu_rand_u64(&r);
            if (mode == 0) buf[i] = (char)(x & 255);                            /* any bytes */
            else if (mode == 1) buf[i] = " \n\t'aeiousthd0123.,!é"[x % 22];    /* mostly ASCII */
            else buf[i] = (char)(0x80 + (x & 127));                               /* high bytes */
        }
        CHECK_MSG(round_trip(t, buf, n), "%s: random text %d (%zu bytes)", what, trial, n);
    }
}

static void test_gen_file(void) {
    const char *path = tu_path("tok_tiny.gguf");
    char cmd[2048];
    snprintf(cmd, sizeof cmd, "%s gen --preset tiny -o %s 2>&1", tu_moetax_bin, path);
    char *out = NULL;
    int rc = tu_run(cmd, &out);
    CHECK_MSG(rc == 0, "moetax gen: %s", out ? out : "");
    free(out);
    if (rc != 0) return;
    struct moetax_gguf *g = NULL;
    CHECK(moetax_gguf_open(path, &g) == MOETAX_OK);
    if (!g) return;
    struct moetax_tokenizer *t = NULL;
    CHECK_MSG(moetax_tokenizer_load(g, &t) == MOETAX_OK, "%s", moetax_last_error());
    moetax_gguf_close(g);
    if (!t) return;
    CHECK_EQ_INT(moetax_tokenizer_n_vocab(t), 512);
    CHECK(moetax_tokenizer_add_bos(t)); /* moetax gen writes add_bos_token = true */
    CHECK(moetax_tokenizer_bos(t) >= 256);
    CHECK(moetax_tokenizer_is_eog(t, moetax_tokenizer_eos(t)));
    char buf[32];
    CHECK_EQ_INT(moetax_tokenizer_token_to_bytes(t, moetax_tokenizer_bos(t), buf, 32), 0);
    /* common words of the training text become single tokens */
    int32_t ids[16];
    int64_t k = enc(t, " the", 4, ids, 16);
    CHECK_EQ_INT(k, 1);
    check_round_trips(t, "tiny");
    moetax_tokenizer_free(t);
}

static void test_speed(void) {
    struct moetax_gen_vocab gv;
    struct moetax_tokenizer *t = NULL;
    moetax_status st = load_gen_vocab(8192, &gv, "tok_gen8192.gguf", &t);
    CHECK_MSG(st == MOETAX_OK, "%s", moetax_last_error());
    printf("vocabulary: %d tokens, %d merges\n", gv.n_tokens, gv.n_merges);
    moetax_gen_vocab_free(&gv);
    if (!t) return;
    check_round_trips(t, "8192");

    /* ~1 MiB of English, Python and some UTF-8 */
    static const char *const parts[] = {
        "The router scores the experts and keeps the top ones. ",
        "When the experts do not fit in memory they are read from the disk.\n",
        "    for key, value in sorted(data.items()):\n        self.values[key] = value + 1\n",
        "def forward(self, x):\n    return x + self.feed_forward(self.ffn_norm(x))\n\n",
        "\xce\x9a\xce\xb1\xce\xbb\xce\xb7\xce\xbc\xce\xad\xcf\x81\xce\xb1 \xe4\xbd\xa0\xe5\xa5\xbd 2024-05-09, 3.14159!\n",
    };
    size_t cap = 1 << 20, n = 0;
    char *text = malloc(cap);
    tu_rng r = {7};
    while (n < cap) {
        const char *p = parts[tu_rand_u64(&r) % 5];
        size_t l = strlen(p);
        if (n + l > cap) l = cap - n;
        memcpy(text + n, p, l);
        n += l;
    }
    int32_t *ids = malloc(sizeof(int32_t) * (cap + 1));
    int64_t k = 0;
    double t0 = now_s();
    st = moetax_tokenizer_encode(t, text, n, false, ids, (int64_t)cap + 1, &k);
    double dt = now_s() - t0;
    CHECK(st == MOETAX_OK);
    printf("encode: %zu bytes -> %lld tokens in %.1f ms: %.1f MB/s (%.2f bytes/token)\n", n, (long long)k, dt * 1e3,
           (double)n / dt / 1e6, (double)n / (double)k);
    CHECK_MSG(dt < 2.0, "encoding 1 MiB took %.2f s", dt);
    char *back = malloc(n + 1);
    size_t m = 0;
    t0 = now_s();
    CHECK(moetax_tokenizer_decode(t, ids, k, back, n + 1, &m) == MOETAX_OK);
    dt = now_s() - t0;
    printf("decode: %.1f MB/s\n", (double)n / dt / 1e6);
    CHECK(m == n && memcmp(back, text, n) == 0);

    /* one 256 KiB pre-token (CJK has no spaces): the heap path stays fast */
    size_t nl = 256 << 10;
    for (size_t i = 0; i < nl; i++) text[i] = (char)("\xe4\xbd\xa0\xe5\xa5\xbd"[i % 6]);
    t0 = now_s();
    st = moetax_tokenizer_encode(t, text, nl, false, ids, (int64_t)cap, &k);
    dt = now_s() - t0;
    CHECK(st == MOETAX_OK);
    printf("encode: one %zu-byte word in %.1f ms\n", nl, dt * 1e3);
    CHECK_MSG(dt < 2.0, "one long word took %.2f s", dt);
    CHECK(round_trip(t, text, nl));
    free(back);
    free(ids);
    free(text);
    moetax_tokenizer_free(t);
}

/* A synthetic 100k-token vocabulary: random words (with a leading space),
 * each built by a chain of merges ("w o" -> "wo", "wo r" -> "wor", ...). */
static uint64_t fnv(const char *p, size_t n) {
    uint64_t h = 1469598103934665603ull;
    for (size_t i = 0; i < n; i++) h = (h ^ (unsigned char)p[i]) * 1099511628211ull;
    return h;
}

static void test_large_vocab(void) {
    enum { TARGET = 100000, HCAP = 1 << 18 };
    char **tok = malloc(sizeof(char *) * (TARGET + 64));
    char **merges = malloc(sizeof(char *) * (TARGET + 64));
    int32_t *set = malloc(sizeof(int32_t) * HCAP);
    char **words = malloc(sizeof(char *) * TARGET);
    memset(set, 0xff, sizeof(int32_t) * HCAP);
    int n = 0, nm = 0, nw = 0;
    for (int b = 0; b < 256; b++) {
        char c = (char)b;
        tok[n++] = encode_raw(&c, 1);
    }
    tu_rng r = {4242};
    while (n < TARGET) {
        char w[16];
        int len = 3 + (int)(tu_rand_u64(&r) % 9);
        w[0] = ' ';
        for (int i = 1; i < len; i++) w[i] = (char)('a' + (int)(tu_rand_u64(&r) % 26));
        for (int k = 2; k <= len && n < TARGET; k++) {
            /* the prefix w[0..k) is new? then merge (w[0..k-1], w[k-1]) makes it */
            char *e = encode_raw(w, (size_t)k);
            uint64_t h = fnv(e, strlen(e)) & (HCAP - 1);
            bool found = false;
            for (; set[h] >= 0; h = (h + 1) & (HCAP - 1))
                if (!strcmp(tok[set[h]], e)) { found = true; break; }
            if (found) { free(e); continue; }
            set[h] = n;
            tok[n++] = e;
            char *l = encode_raw(w, (size_t)k - 1), *rr = encode_raw(w + k - 1, 1);
            size_t ml = strlen(l) + strlen(rr) + 2;
            merges[nm] = malloc(ml);
            snprintf(merges[nm++], ml, "%s %s", l, rr);
            free(l);
            free(rr);
            if (k == len) words[nw++] = strndup(w, (size_t)len);
        }
    }
    const char *path = tu_path("tok_large.gguf");
    struct moetax_gguf_writer *wr = NULL;
    CHECK(moetax_gguf_writer_init(path, &wr) == MOETAX_OK);
    moetax_gguf_writer_set_str(wr, "tokenizer.ggml.model", "gpt2");
    moetax_gguf_writer_set_arr_str(wr, "tokenizer.ggml.tokens", (const char *const *)tok, (uint64_t)n);
    moetax_gguf_writer_set_arr_str(wr, "tokenizer.ggml.merges", (const char *const *)merges, (uint64_t)nm);
    CHECK(moetax_gguf_writer_finish(wr) == MOETAX_OK);
    moetax_gguf_writer_free(wr);
    struct moetax_gguf *g = NULL;
    struct moetax_tokenizer *t = NULL;
    CHECK(moetax_gguf_open(path, &g) == MOETAX_OK);
    double t0 = now_s();
    if (g) CHECK_MSG(moetax_tokenizer_load(g, &t) == MOETAX_OK, "%s", moetax_last_error());
    double dt_load = now_s() - t0;
    moetax_gguf_close(g);
    if (t) {
        size_t cap = 1 << 20, len = 0;
        char *text = malloc(cap);
        while (nw > 0) {
            const char *w = words[tu_rand_u64(&r) % (uint64_t)nw];
            size_t l = strlen(w);
            if (len + l > cap) break;
            memcpy(text + len, w, l);
            len += l;
        }
        int32_t *ids = malloc(sizeof(int32_t) * cap);
        int64_t k = 0;
        t0 = now_s();
        CHECK(moetax_tokenizer_encode(t, text, len, false, ids, (int64_t)cap, &k) == MOETAX_OK);
        double dt = now_s() - t0;
        printf("%d-token vocabulary (%d merges): load %.1f ms; encode %zu bytes -> %lld tokens in %.1f ms: %.1f MB/s\n",
               n, nm, dt_load * 1e3, len, (long long)k, dt * 1e3, (double)len / dt / 1e6);
        CHECK_MSG(dt < 2.0, "encoding took %.2f s", dt);
        CHECK(round_trip(t, text, len));
        /* each word is one token: every merge chain ran to the end */
        int64_t words_in_text = 0;
        for (size_t i = 0; i < len; i++) words_in_text += text[i] == ' ';
        CHECK_EQ_INT(k, words_in_text);
        free(ids);
        free(text);
        moetax_tokenizer_free(t);
    }
    for (int i = 0; i < n; i++) free(tok[i]);
    for (int i = 0; i < nm; i++) free(merges[i]);
    for (int i = 0; i < nw; i++) free(words[i]);
    free(tok);
    free(merges);
    free(words);
    free(set);
}

int main(int argc, char **argv) {
    tu_init(argc, argv);
    test_known_encodings();
    test_malformed();
    test_reference_bpe();
    test_gen_file();
    test_speed();
    test_large_vocab();
    return tu_finish("test_tokenizer");
}
