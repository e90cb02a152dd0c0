/* cmd_profile.c - `moetax profile -m FILE -f TEXT|DIR [-o PROFILE]`: runs text
 * through the model and writes a routing profile (moetax/profile.h): per MoE
 * layer how often each expert is chosen and with which others, and which
 * experts of the next MoE layer follow each one. `moetax report PROFILE` shows
 * it. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "commands.h"
#include "moetax/model.h"
#include "moetax/profile.h"
#include "moetax/predict.h"
#include "moetax/store.h"
#include "moetax/tokenizer.h"
#include "moe/predict.h"
#include "store_cli.h"

static void usage(FILE *f) {
    fprintf(f, "usage: moetax profile [-m FILE] -f TEXT|DIR [-o PROFILE.json] [-c N] [--max-tokens N] [-t N]\n"
               "                      [--experts-used K] [--fit-predictor [--predictor-out FILE]] [--predictor FILE]\n"
               "                      [--dump-features FILE]\n\n"
               "Runs the text (a file, or every regular file of a folder, each from BOS) through the model in\n"
               "windows of -c tokens (default 256) and writes its routing profile: per MoE layer the experts'\n"
               "frequencies and co-selections, and the transitions from each MoE layer's experts to the\n"
               "next one's (JSON; see include/moetax/profile.h). `moetax report PROFILE` shows it as heat maps.\n"
               "  -o FILE          the profile (default profile.json)\n"
               "  --max-tokens N   stop after N tokens\n"
               "  -u, --ubatch N   tokens per micro-batch (default 64; 1: token by token, as decode predicts)\n"
               "  --fit-predictor  also fit a learned expert predictor on the text (include/moetax/predict.h: per MoE\n"
               "                   layer a linear map from its residual and the previous token's to the next MoE\n"
               "                   layer's router logits, ridge regression towards that router) and write it to\n"
               "                   --predictor-out (default: the profile's name with .pred for .json); scored on\n"
               "                   the same text (use --predictor on other text for a held-out score); a predictor\n"
               "                   with a hidden layer: --dump-features, then tools/train/fit_predictor.py\n"
               "  --predictor FILE score a fitted predictor on this text against the router guess\n"
               "  --predictor-margin X   with --predictor: predict up to k more experts per token, those within X of\n"
               "                   the k-th's selection score (default: the file's margin; precision and recall apart)\n"
               "  --dump-features FILE   write every MoE layer's input rows, router logits and experts to FILE\n"
               "                   (include/moetax/predict.h; 16 + 4 (n_embd + n_expert + k) bytes per token and MoE\n"
               "                   layer: 1.2 KB on the default model), for tools/train/fit_predictor.py\n"
               "  --predictor-route      also the current layer's routing (its experts and probabilities) as features\n"
               "  --predictor-lambda X   ridge strength relative to the features' scale (default 0.1)\n"
               "  --predictor-ahead N    also fit N MoE layers ahead (1..2, default 1)\n"
               "  --predictor-no-prev    without the previous token's residual as features\n"
               CLI_MAX_INPUT_HELP);
}

int cmd_profile(int argc, char **argv) {
    const char *model = NULL, *input = NULL, *out = "profile.json";
    int64_t n_threads = 0, ctx = 256, max_tokens = 0;
    int k_ctx = 0;
    uint64_t max_input = 0;
    const char *pred_in = NULL, *pred_out = NULL;
    bool fit = false, no_prev = false, route = false;
    const char *dump_out = NULL;
    double lambda = 0.1, margin = -1;
    int64_t ahead = 1, ubatch = 64;
    for (int i = 1; i < argc; i++) {
        const char *v = NULL;
        bool err = false;
        if (cli_flag(argv, i, "-h", "--help")) { usage(stdout); return 0; }
        else if (cli_opt(argc, argv, &i, "-m", "--model", &model, &err)) { if (err) return 2; }
        else if (cli_opt(argc, argv, &i, "-f", "--file", &input, &err)) { if (err) return 2; }
        else if (cli_opt(argc, argv, &i, "-o", "--output", &out, &err)) { if (err) return 2; }
        else if (cli_opt(argc, argv, &i, "-c", "--ctx", &v, &err)) {
            if (err || !cli_parse_i64(v, &ctx) || ctx < 1 || ctx > 1 << 16) return cli_usage_error("profile", "-c: 1..65536");
        } else if (cli_opt(argc, argv, &i, NULL, "--max-tokens", &v, &err)) {
            if (err || !cli_parse_i64(v, &max_tokens) || max_tokens < 1) return cli_usage_error("profile", "--max-tokens: >= 1");
        } else if (cli_opt(argc, argv, &i, "-t", "--threads", &v, &err)) {
            if (err || !cli_parse_i64(v, &n_threads) || n_threads < 1 || n_threads > 512)
                return cli_usage_error("profile", "-t: 1..512");
        } else if (cli_opt(argc, argv, &i, NULL, "--experts-used", &v, &err)) {
            if (err || !cli_parse_experts_used(v, &k_ctx)) return cli_usage_error("profile", "--experts-used: 1..256");
        } else if (!strcmp(argv[i], "--fit-predictor")) fit = true;
        else if (!strcmp(argv[i], "--predictor-no-prev")) no_prev = true;
        else if (!strcmp(argv[i], "--predictor-route")) route = true;
        else if (cli_opt(argc, argv, &i, NULL, "--dump-features", &dump_out, &err)) { if (err) return 2; }
        else if (cli_opt(argc, argv, &i, NULL, "--predictor-margin", &v, &err)) {
            if (err || !cli_parse_f64(v, &margin) || !(margin >= 0) || margin > 1e6)
                return cli_usage_error("profile", "--predictor-margin: a number in 0..1e6");
        }
        else if (cli_opt(argc, argv, &i, NULL, "--predictor-out", &pred_out, &err)) { if (err) return 2; }
        else if (cli_opt(argc, argv, &i, NULL, "--predictor", &pred_in, &err)) { if (err) return 2; }
        else if (cli_opt(argc, argv, &i, NULL, "--predictor-lambda", &v, &err)) {
            if (err || !cli_parse_f64(v, &lambda) || !(lambda >= 0) || lambda > 1e6)
                return cli_usage_error("profile", "--predictor-lambda: a number in 0..1e6");
        } else if (cli_opt(argc, argv, &i, "-u", "--ubatch", &v, &err)) {
            if (err || !cli_parse_i64(v, &ubatch) || ubatch < 1 || ubatch > 4096) return cli_usage_error("profile", "--ubatch: 1..4096");
        } else if (cli_opt(argc, argv, &i, NULL, "--predictor-ahead", &v, &err)) {
            if (err || !cli_parse_i64(v, &ahead) || ahead < 1 || ahead > MOETAX_PREDICT_AHEAD_MAX)
                return cli_usage_error("profile", "--predictor-ahead: 1..%d", MOETAX_PREDICT_AHEAD_MAX);
        } else if (cli_max_input_opt("profile", argc, argv, &i, &max_input, &err)) { if (err) return 2; }
        else return cli_usage_error("profile", "unknown option '%s'", argv[i]);
    }
    if (!input) return cli_usage_error("profile", "no text given (-f FILE or -f DIR)");
    if (fit && pred_in) return cli_usage_error("profile", "--fit-predictor and --predictor: fit one or score one");
    if (margin >= 0 && !pred_in) return cli_usage_error("profile", "--predictor-margin: with --predictor FILE");
    char pred_path[4096];
    if (fit && !pred_out) { /* beside the profile: P.json -> P.pred */
        size_t n = strlen(out);
        if (n >= 5 && !strcmp(out + n - 5, ".json")) snprintf(pred_path, sizeof pred_path, "%.*s.pred", (int)(n - 5), out);
        else snprintf(pred_path, sizeof pred_path, "%s.pred", out);
        pred_out = pred_path;
    }
    const char *outs[3] = {out};
    int n_outs = 1;
    if (fit) outs[n_outs++] = pred_out;
    if (dump_out) outs[n_outs++] = dump_out;
    if (!model) model = cli_default_model_path();
    const char *ins[2] = {model, input};
    moetax_status st = cli_check_io(outs, n_outs, ins, 2);
    if (st) return cli_usage_error("profile", "%s", moetax_last_error());
    char **files = NULL;
    int n_files = 0;
    if ((st = cli_list_inputs(input, &files, &n_files))) return cli_fail("profile", st);
    struct moetax_model *m = NULL;
    struct moetax_tokenizer *tok = NULL;
    struct moetax_ctx *c = NULL;
    struct moetax_profile *prof = NULL;
    struct moetax_store *store = NULL;
    struct moetax_predictor *pred = NULL;
    float **router = NULL;
    int32_t *ids = NULL;
    int moe[4096], n_moe = 0;
    const int32_t *routes[4096];
    const double t0 = cli_now();
    if ((st = moetax_model_load(model, &m))) goto done;
    if ((st = moetax_model_check_experts_used(m, k_ctx))) goto done;
    if ((st = moetax_tokenizer_load(m->gguf, &tok))) goto done;
    for (int l = 0; l < m->hp.n_layer && n_moe < 4096; l++)
        if (m->layers[l].is_moe) moe[n_moe++] = l;
    struct moetax_ctx_params cp = {.n_ctx = (int32_t)ctx, .n_threads = (int32_t)n_threads, .n_expert_used = k_ctx,
                                   .n_ubatch = (int32_t)ubatch};
    const char *base = strrchr(model, '/') ? strrchr(model, '/') + 1 : model;
    if (fit || pred_in || dump_out) {
        /* the predictor rides on an expert store that holds every expert (same bits as the mapping) */
        const uint64_t keys = (uint64_t)n_moe * (uint64_t)m->hp.n_expert;
        struct moetax_store_params sp = {.budget_bytes = cli_store_expert_bytes(m) + keys * 3 * 8192,
                                         .policy = MOETAX_STORE_NEXT_USE, .trace_cap = -1};
        int ub = (int)ubatch;
        if ((st = moetax_model_store_open(m, &sp, ub, k_ctx, &store, &ub))) goto done;
        cp.store = store;
        cp.n_ubatch = ub;
        const int kk = k_ctx ? k_ctx : m->hp.n_expert_used;
        if (fit || !pred_in) { /* fit, or only dump: a predictor without weights carries the rows */
            const uint32_t feat = MOETAX_PREDICT_FEAT_CUR | (no_prev ? 0 : MOETAX_PREDICT_FEAT_PREV) |
                                  (route ? MOETAX_PREDICT_FEAT_ROUTE : 0);
            if ((st = moetax_predictor_new(base, m->hp.n_layer, m->hp.n_embd, m->hp.n_expert, kk, moe, n_moe, (int)ahead,
                                           feat, &pred)))
                goto done;
            if (fit && (st = moetax_predictor_fit_begin(pred))) goto done;
            pred->use = false;
        } else {
            bool is_moe[4096] = {false};
            for (int l = 0; l < m->hp.n_layer && l < 4096; l++) is_moe[l] = m->layers[l].is_moe;
            const struct moetax_predict_model pm = {m->hp.n_layer, m->hp.n_embd, m->hp.n_expert, is_moe};
            if (m->hp.n_layer > 4096) {
                st = moetax_error(MOETAX_ERR_ARG, "--predictor: more than 4096 layers");
                goto done;
            }
            if ((st = moetax_predictor_load(pred_in, &pm, &pred))) goto done;
            if (margin >= 0) pred->margin = (float)margin;
        }
        if (dump_out && (st = moe_predict_dump_open(pred, m, dump_out))) goto done;
        moetax_store_set_predictor(store, pred, false);
    }
    if ((st = moetax_ctx_init(m, &cp, &c))) goto done;
    /* the fit's pairs solve side by side on the run's threads (each a copy of its equations) */
    if (pred && fit) pred->fit_threads = moetax_ctx_n_threads(c) < 8 ? moetax_ctx_n_threads(c) : 8;
    if ((st = moetax_profile_new(base, m->hp.n_layer, moe, n_moe, m->hp.n_expert, moetax_ctx_n_expert_used(c), &prof)))
        goto done;
    const int64_t U = moetax_ctx_n_ubatch(c);
    int64_t text_tokens = 0; /* of the files' texts, the BOS left out */
    const bool bos = moetax_tokenizer_add_bos(tok) && moetax_tokenizer_bos(tok) >= 0;
    for (int f = 0; f < n_files && !st && !(max_tokens && prof->tokens >= max_tokens); f++) {
        char *text;
        size_t len;
        if ((st = cli_read_file(files[f], max_input, &text, &len))) break;
        int64_t n = 0;
        free(ids);
        st = cli_encode(tok, text, len, bos, 0, &ids, &n);
        free(text);
        if (!st) text_tokens += n - (bos && n > 0);
        /* windows of ctx tokens from an empty cache, each chunk of U tokens read back from the routing */
        for (int64_t w0 = 0; !st && w0 < n && !(max_tokens && prof->tokens >= max_tokens); w0 += ctx) {
            moetax_ctx_reset(c);
            const int64_t w1 = w0 + ctx < n ? w0 + ctx : n;
            for (int64_t i = w0; !st && i < w1; i += U) {
                int64_t nb = w1 - i < U ? w1 - i : U;
                if (max_tokens && prof->tokens + nb > max_tokens) nb = max_tokens - prof->tokens;
                if (nb <= 0) break;
                if ((st = moetax_ctx_eval(c, ids + i, nb, NULL, false))) break;
                for (int q = 0; q < n_moe; q++) routes[q] = moetax_ctx_routing(c, moe[q], NULL, NULL);
                st = moetax_profile_add(prof, nb, routes);
            }
        }
    }
    if (!st && (prof->tokens == 0 || text_tokens == 0)) /* at most the BOS (an empty text): no text's routing */
        st = moetax_error(MOETAX_ERR_ARG, "%s: no text to profile (%lld token%s: the text is empty)", input,
                          (long long)prof->tokens, prof->tokens == 1 ? ", the BOS" : "s");
    if (!st) st = moetax_profile_write(prof, out);
    if (!st && dump_out) {
        uint64_t rec = 0;
        if (!(st = moe_predict_dump_close(pred, true, &rec)))
            fprintf(stderr, "moetax profile: %llu feature rows (%lld tokens x %d MoE layers) written to %s\n",
                    (unsigned long long)rec, (long long)prof->tokens, n_moe, dump_out);
    }
    if (!st && fit) { /* the fit, pulled towards each target layer's router */
        const double tf = cli_now();
        if (!(router = calloc((size_t)m->hp.n_layer, sizeof *router))) st = moetax_error(MOETAX_ERR_NOMEM, "out of memory");
        for (int q = 0; !st && q < n_moe; q++) {
            const int l = moe[q];
            if (!(router[l] = malloc(sizeof(float) * (size_t)m->hp.n_expert * (size_t)m->hp.n_embd)))
                st = moetax_error(MOETAX_ERR_NOMEM, "out of memory");
            else if (!moe_predict_router_rows(m, l, router[l])) {
                free(router[l]);
                router[l] = NULL;
            }
        }
        if (!st) st = moetax_predictor_fit_solve(pred, lambda, (const float *const *)router);
        if (!st) st = moetax_predictor_write(pred, pred_out);
        if (!st)
            fprintf(stderr, "moetax profile: predictor fitted on %llu tokens (lambda %g, %d ahead, %s) in %.1f s: %s\n",
                    (unsigned long long)pred->tokens, lambda, (int)ahead,
                    no_prev ? (route ? "current residual + routing" : "current residual")
                            : (route ? "current residual + previous token's + routing" : "current residual + previous token's"),
                    cli_now() - tf, pred_out);
    }
    if (!st && pred && (fit || pred_in)) {
        fprintf(stderr, "moetax profile: %s on this text:\n", fit ? "the router guess (the learned predictor: --predictor on other text)"
                                                                      : "predictors");
        cli_predictor_summary(stderr, pred, m);
        if (pred->predict_n)
            fprintf(stderr, "  the learned prediction took %.2f us per token and MoE layer (%llu predictions, %d hidden)\n",
                    1e-3 * (double)pred->predict_ns / (double)pred->predict_n, (unsigned long long)pred->predict_n,
                    pred->n_hidden);
    }
    if (!st)
        fprintf(stderr, "moetax profile: %lld tokens of %d file%s through %d MoE layers (%d experts, %d used) in %.1f s: "
                "%s (moetax report %s)\n", (long long)prof->tokens, n_files, n_files == 1 ? "" : "s", n_moe,
                m->hp.n_expert, prof->n_expert_used, cli_now() - t0, out, out);
done:
    free(ids);
    moetax_profile_free(prof);
    moetax_ctx_free(c);
    moetax_store_free(store);
    if (pred) moe_predict_dump_close(pred, false, NULL);
    moetax_predictor_free(pred);
    if (router)
        for (int l = 0; l < m->hp.n_layer; l++) free(router[l]);
    free(router);
    moetax_tokenizer_free(tok);
    moetax_model_free(m);
    for (int f = 0; f < n_files; f++) free(files[f]);
    free(files);
    return st ? cli_fail("profile", st) : 0;
}
