/* cmd_eval.c - `moetax eval`: run token ids through a model and write the
 * logits, for comparing against a reference implementation (tests/ref). */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "commands.h"
#include "config_cli.h"
#include "moetax/model.h"
#include "moetax/outfile.h"

static void usage(FILE *f) {
    fprintf(f, "usage: moetax eval -m FILE --tokens 1,2,3 [--decode N] [--out LOGITS.f32] [-t N] [--ubatch N]\n"
               "                   [--step-by-step] [--routing] [--no-mmap]\n\n"
               "Evaluates the prompt tokens from position 0, then N greedy decode steps, and writes the logits\n"
               "as raw little-endian float32 [tokens + N, n_vocab] (prompt rows, then one row per decoded\n"
               "token). Prints the greedy tokens.\n"
               "  --step-by-step  evaluate the prompt one token at a time (decode path) instead of one batch\n"
               "  --routing       print the experts chosen for each token of the last micro-batch\n"
               "  --no-mmap       copy the weights into private memory (2 MiB pages) instead of reading the mapping\n"
               "  --expert-type T routed experts re-quantized in memory at load (q8_0, q4_0, ...), the rest as stored\n"
               "  --check-finite  check every hidden state after each layer (a NaN or inf names the layer)\n"
               CLI_CACHE_TYPE_HELP CLI_MLA_PREFILL_HELP);
}

int cmd_eval(int argc, char **argv) {
    const char *model = NULL, *out = NULL, *toks = NULL;
    struct moetax_model_params mp = {0};
    bool check_finite = false; /* --check-finite */
    enum moetax_type kv_type = MOETAX_TYPE_F32; /* --cache-type */
    enum moetax_attn_prefill prefill = MOETAX_ATTN_PREFILL_ABSORBED; /* --mla-prefill */
    int64_t n_decode = 0, n_threads = 0, ubatch = 0;
    bool step = false, routing = false;
    for (int i = 1; i < argc; i++) {
        const char *v = NULL;
        bool err = false;
        if (cli_flag(argv, i, "-h", "--help")) { usage(stdout); return 0; }
        else if (cli_opt(argc, argv, &i, "-m", "--model", &model, &err)) { if (err) return 2; }
        else if (cli_opt(argc, argv, &i, NULL, "--tokens", &toks, &err)) { if (err) return 2; }
        else if (cli_opt(argc, argv, &i, "-o", "--out", &out, &err)) { if (err) return 2; }
        else if (cli_opt(argc, argv, &i, NULL, "--decode", &v, &err)) {
            if (err || !cli_parse_i64(v, &n_decode) || n_decode < 0 || n_decode > (1 << 24))
                return cli_usage_error("eval", "--decode needs a count in 0..16777216");
        } else if (cli_opt(argc, argv, &i, "-t", "--threads", &v, &err)) {
            if (err || !cli_parse_i64(v, &n_threads) || n_threads < 1 || n_threads > 512)
                return cli_usage_error("eval", "-t needs a thread count in 1..512");
        } else if (cli_opt(argc, argv, &i, NULL, "--ubatch", &v, &err)) {
            if (err || !cli_parse_i64(v, &ubatch) || ubatch < 1) return cli_usage_error("eval", "--ubatch needs a count >= 1");
        } else if (!strcmp(argv[i], "--step-by-step")) step = true;
        else if (!strcmp(argv[i], "--routing")) routing = true;
        else if (!strcmp(argv[i], "--no-mmap")) mp.no_mmap = true;
        else if (cli_opt(argc, argv, &i, NULL, "--expert-type", &v, &err)) {
            if (err || !cli_expert_type_parse(v, &mp.expert_type))
                return cli_usage_error("eval", "--expert-type: expected q8_0, q4_0, q4_1, q5_0, q5_1, f16, bf16, q2_k..q6_k");
        }
        else if (!strcmp(argv[i], "--check-finite")) check_finite = true;
        else if (cli_cache_type_opt("eval", argc, argv, &i, &kv_type, &err)) { if (err) return 2; }
        else if (cli_mla_prefill_opt("eval", argc, argv, &i, &prefill, &err)) { if (err) return 2; }
        else return cli_usage_error("eval", "unknown option '%s'", argv[i]);
    }
    if (!model) return cli_usage_error("eval", "no model given (-m FILE)");
    if (!toks) return cli_usage_error("eval", "no tokens given (--tokens 1,2,3)");
    moetax_status st;
    const char *outs[1] = {out}, *ins[1] = {model};
    if ((st = cli_check_io(outs, 1, ins, 1))) return cli_usage_error("eval", "%s", moetax_last_error());
    int64_t tk[4096];
    int n = cli_parse_int_list(toks, tk, 4096);
    if (n <= 0) return cli_usage_error("eval", "--tokens: expected a comma-separated list of at most 4096 token ids");
    for (int i = 0; i < n; i++) /* the model's vocabulary is checked once it is loaded; an int32 first */
        if (tk[i] < 0 || tk[i] > INT32_MAX) return cli_usage_error("eval", "--tokens: %lld is not a token id", (long long)tk[i]);
    struct moetax_model *m;
    st = moetax_model_load_ex(model, &mp, &m);
    if (st) return cli_fail("eval", st);
    cli_warn_past_train("eval", m, n + n_decode, "--tokens + --decode");
    struct moetax_ctx_params cp = {.check_finite = check_finite, .kv_type = kv_type, .attn_prefill = prefill, .n_ctx = (int32_t)(n + n_decode + 1), .n_threads = (int32_t)n_threads,
                                   .n_ubatch = (int32_t)ubatch};
    struct moetax_ctx *c;
    if ((st = moetax_ctx_init(m, &cp, &c))) { moetax_model_free(m); return cli_fail("eval", st); }
    const int64_t V = m->hp.n_vocab;
    float *logits = malloc(sizeof(float) * (size_t)V * (size_t)(n + n_decode));
    int32_t *ids = malloc(sizeof(int32_t) * (size_t)(n + n_decode));
    if (!logits || !ids) { st = moetax_error(MOETAX_ERR_NOMEM, "out of memory"); goto done; }
    for (int i = 0; i < n; i++) ids[i] = (int32_t)tk[i];
    if (step) {
        for (int i = 0; i < n && !st; i++) st = moetax_ctx_eval(c, ids + i, 1, logits + (size_t)i * V, false);
    } else {
        st = moetax_ctx_eval(c, ids, n, logits, true);
    }
    for (int i = 0; !st && i < n; i++) st = cli_check_logits(logits + (size_t)i * V, V, i);
    if (st) goto done;
    printf("greedy:");
    for (int64_t j = 0; !st && j < n_decode; j++) {
        const float *row = logits + (size_t)(n - 1 + j) * V;
        int32_t best = 0;
        for (int64_t v = 1; v < V; v++) if (row[v] > row[best]) best = (int32_t)v;
        ids[n + j] = best;
        printf(" %d", best);
        st = moetax_ctx_eval(c, ids + n + j, 1, logits + (size_t)(n + j) * V, false);
        if (!st) st = cli_check_logits(logits + (size_t)(n + j) * V, V, n + j);
    }
    printf("\n");
    if (!st && routing) {
        for (int il = 0; il < m->hp.n_layer; il++) {
            const float *w;
            int64_t nt;
            const int32_t *sel = moetax_ctx_routing(c, il, &w, &nt);
            if (!sel) continue;
            for (int64_t t = 0; t < nt; t++) {
                printf("layer %d token %lld:", il, (long long)t);
                const int k = moetax_ctx_n_expert_used(c);
                for (int j = 0; j < k; j++) printf(" %d(%.4f)", sel[t * k + j], w[t * k + j]);
                printf("\n");
            }
        }
    }
    if (!st && out) { /* a temporary file renamed into place: never a truncated file under OUT */
        struct moetax_outfile *of;
        if (!(st = moetax_outfile_open(out, &of))) {
            if (fwrite(logits, sizeof(float) * (size_t)V, (size_t)(n + n_decode), moetax_outfile_file(of)) !=
                (size_t)(n + n_decode)) {
                st = moetax_error(MOETAX_ERR_IO, "%s: cannot write the logits: %s", out, strerror(errno));
                moetax_outfile_abort(of);
            } else st = moetax_outfile_commit(of);
        }
    }
done:
    free(logits);
    free(ids);
    moetax_ctx_free(c);
    moetax_model_free(m);
    if (st) return cli_fail("eval", st);
    return 0;
}
