/*
 * test_tokenizer_llama.c - llama.cpp's tokenizer test suites (test-tokenizer-0):
 * for each vocabulary, models/ggml-vocab-NAME.gguf holds the tokenizer and
 * .gguf.inp / .gguf.out the inputs (separated by "\n__ggml_vocab_test__\n") and
 * the expected ids (one line per input, no BOS: llama.cpp tokenizes with
 * add_special = false, parse_special = false).
 *
 * usage: test_tokenizer_llama [MOETAX WORKDIR]   (CTest's arguments; unused)
 *   Each suite of the list below loads its .gguf from tests/data/llama-vocab/
 *   when it is committed there (tests/data/README.md: which and why), else from
 *   $MOETAX_LLAMA_VOCAB_DIR (llama.cpp's models/, or files made as the README
 *   says), else it is skipped with a note. The committed .inp/.out always run
 *   against it; a .inp/.out pair beside the .gguf in $MOETAX_LLAMA_VOCAB_DIR
 *   that differs from the committed one (another llama.cpp version's texts)
 *   runs too. Exit 0 when every suite that ran passed 100% (the committed gpt-2
 *   suite always runs).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "moetax/gguf.h"
#include "moetax/tokenizer.h"

static const char *const suites[] = {"gpt-2", "deepseek-llm", "deepseek-coder", "qwen2", "llama-bpe", "llama-spm",
                                     "phi-3", "deepseek-v3", "olmo"};

static char *read_all(const char *path, size_t *n) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    size_t cap = 1 << 16, len = 0;
    char *b = malloc(cap + 1);
    for (size_t r; b && (r = fread(b + len, 1, cap - len, f)) > 0;) {
        len += r;
        if (len == cap) {
            char *nb = realloc(b, 2 * cap + 1);
            if (!nb) { free(b); b = NULL; break; }
            b = nb;
            cap *= 2;
        }
    }
    fclose(f);
    if (b) b[len] = 0;
    *n = len;
    return b;
}

/* gguf: the vocabulary; pin/pout: the texts and ids; what: which texts (for the report).
 * 1 pass, 0 fail, -1 skipped */
static int run_suite(const char *name, const char *path, const char *pin, const char *pout, const char *what) {
    size_t nin, nout;
    char *inp = read_all(pin, &nin), *outp = read_all(pout, &nout);
    FILE *probe = fopen(path, "rb");
    long gsize = 0;
    if (probe) { fseek(probe, 0, SEEK_END); gsize = ftell(probe); fclose(probe); }
    if (!inp || !outp || gsize <= 0) {
        printf("SKIP %s: %s not found (or empty)\n", name, !inp ? pin : !outp ? pout : path);
        free(inp);
        free(outp);
        return -1;
    }
    struct moetax_gguf *g = NULL;
    struct moetax_tokenizer *t = NULL;
    moetax_status st0 = moetax_gguf_open(path, &g);
    if (!st0) st0 = moetax_tokenizer_load(g, &t);
    if (st0 == MOETAX_ERR_UNSUPPORTED) {
        printf("SKIP %s: moetax does not accept this vocabulary: %s\n", name, moetax_last_error());
        moetax_gguf_close(g);
        free(inp);
        free(outp);
        return -1;
    }
    if (st0) {
        printf("FAIL %s: cannot load: %s\n", name, moetax_last_error());
        moetax_gguf_close(g);
        free(inp);
        free(outp);
        return 0;
    }
    moetax_gguf_close(g);
    static const char sep[] = "\n__ggml_vocab_test__\n";
    size_t seplen = sizeof sep - 1;
    int n_test = 0, n_pass = 0;
    char *ip = inp, *iend = inp + nin, *op = outp;
    int32_t *ids = malloc(1 << 20);
    while (ip < iend) {
        char *next = NULL;
        for (char *q = ip; q + seplen <= iend; q++)
            if (!memcmp(q, sep, seplen)) { next = q; break; }
        size_t tl = next ? (size_t)(next - ip) : (size_t)(iend - ip);
        char *eol = strchr(op, '\n');
        if (!eol) eol = op + strlen(op);
        /* expected ids */
        int32_t want[4096];
        int nw = 0;
        for (char *q = op; q < eol;) {
            char *end;
            long v = strtol(q, &end, 10);
            if (end == q) { q++; continue; }
            if (nw < 4096) want[nw++] = (int32_t)v;
            q = end;
        }
        int64_t n = 0;
        moetax_status st = moetax_tokenizer_encode(t, ip, tl, false, ids, (1 << 20) / 4, &n);
        bool ok = st == MOETAX_OK && n == nw && (n == 0 || !memcmp(ids, want, (size_t)n * sizeof *ids));
        n_test++;
        n_pass += ok;
        if (!ok) {
            printf("  %s: input %d \"%.*s\": expected", name, n_test, (int)(tl > 60 ? 60 : tl), ip);
            for (int i = 0; i < nw; i++) printf(" %d", want[i]);
            printf("\n      got");
            for (int64_t i = 0; i < n; i++) printf(" %d", ids[i]);
            printf("\n");
        }
        op = *eol ? eol + 1 : eol;
        if (!next) break;
        ip = next + seplen;
    }
    free(ids);
    moetax_tokenizer_free(t);
    free(inp);
    free(outp);
    printf("%s %s: %d/%d inputs (%s)\n", n_pass == n_test ? "PASS" : "FAIL", name, n_pass, n_test, what);
    return n_pass == n_test;
}

static bool have(const char *dir, const char *name, const char *ext) {
    char path[8192];
    snprintf(path, sizeof path, "%s/ggml-vocab-%s.gguf%s", dir, name, ext);
    FILE *f = fopen(path, "rb");
    if (!f) return false;
    fclose(f);
    return true;
}

/* Both files read and equal byte for byte. */
static bool same_file(const char *a, const char *b) {
    size_t na, nb;
    char *x = read_all(a, &na), *y = read_all(b, &nb);
    bool same = x && y && na == nb && !memcmp(x, y, na);
    free(x);
    free(y);
    return same;
}

int main(int argc, char **argv) {
    (void)argc;
    (void)argv;
    char here[4096];
    snprintf(here, sizeof here, "%s", __FILE__);
    char *slash = strrchr(here, '/');
    if (slash) *slash = 0;
    else snprintf(here, sizeof here, ".");
    char committed[4200];
    snprintf(committed, sizeof committed, "%s/data/llama-vocab", here);
    const char *env = getenv("MOETAX_LLAMA_VOCAB_DIR");
    if (env && !*env) env = NULL;
    int ran = 0, failed = 0;
    for (size_t i = 0; i < sizeof suites / sizeof suites[0]; i++) {
        const char *name = suites[i];
        const char *dir = have(committed, name, "") ? committed : env;
        if (!dir) {
            printf("SKIP %s: its vocabulary is not committed (license; tests/data/README.md) and "
                   "MOETAX_LLAMA_VOCAB_DIR is not set\n", name);
            continue;
        }
        char path[8192], cin[8200], cout[8200], ein[8200], eout[8200];
        snprintf(path, sizeof path, "%s/ggml-vocab-%s.gguf", dir, name);
        if (!have(dir, name, "")) {
            printf("SKIP %s: %s not found\n", name, path);
            continue;
        }
        snprintf(cin, sizeof cin, "%s/ggml-vocab-%s.gguf.inp", committed, name);
        snprintf(cout, sizeof cout, "%s/ggml-vocab-%s.gguf.out", committed, name);
        bool own = env && strcmp(env, committed) && have(env, name, ".inp") && have(env, name, ".out");
        if (own) {
            snprintf(ein, sizeof ein, "%s/ggml-vocab-%s.gguf.inp", env, name);
            snprintf(eout, sizeof eout, "%s/ggml-vocab-%s.gguf.out", env, name);
        }
        bool have_c = have(committed, name, ".inp") && have(committed, name, ".out");
        int r = -1;
        if (have_c) r = run_suite(name, path, cin, cout, "committed texts");
        if (own && (!have_c || !same_file(cin, ein) || !same_file(cout, eout))) {
            int r2 = run_suite(name, path, ein, eout, "texts beside the vocabulary");
            if (r2 >= 0) r = r < 0 ? r2 : r && r2;
        } else if (!have_c) {
            printf("SKIP %s: no .inp/.out committed nor beside %s\n", name, path);
        }
        if (r >= 0) ran++;
        if (r == 0) failed++;
    }
    printf("%d suites ran, %d failed\n", ran, failed);
    return failed || ran == 0 ? 1 : 0;
}
