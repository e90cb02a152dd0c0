/* cmd_perplexity.c - `moetax perplexity`: perplexity of a model over a text
 * file or a folder of files (in the style of llama-perplexity).
 *
 * Each file is one document: [BOS] + its tokens (BOS when the tokenizer adds
 * one, as at the start of a prompt). Every token after the first is scored,
 * once, by a sliding window: windows of --ctx tokens start every --stride
 * tokens; each window is evaluated from an empty KV cache and scores the
 * tokens that no earlier window scored, so every scored token but those near
 * a document's start sees at least ctx - stride tokens of context. The result
 * is exp(mean negative log-likelihood) over all scored tokens of all files,
 * with the standard error of the mean NLL carried to the perplexity
 * (ppl * stderr), as llama-perplexity prints it. */
#include <dirent.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "cli.h"
#include "config_cli.h"
#include "commands.h"
#include "moetax/kvcache.h"
#include "moetax/ledger.h"
#include "moetax/model.h"
#include "moetax/tokenizer.h"

static void usage(FILE *f) {
    fprintf(f, "usage: moetax perplexity [-m FILE] -f TEXT|DIR [-c N] [--stride N] [-t N] [--max-files N]\n"
               "                         [--experts-used K] [--capacity-factor C [--overflow drop|reroute]]\n"
               "                         [--ubatch N] [--parallel B] [--per-file] [--json] [--no-mmap]\n\n"
               "Perplexity of the model over a text file, or over every regular file of a folder (sorted by\n"
               "name; hidden files skipped), each file a document that starts with BOS. Tokens are scored by a\n"
               "sliding window: windows of -c tokens (default: the model's context length, at most 512) every\n"
               "--stride tokens (default c/2), each from an empty cache, each token scored once.\n"
               "  --experts-used K  route each token to K experts instead of the file's count (run-time top-k)\n"
               "  --capacity-factor C  each expert takes at most ceil(C x tokens x k / E) assignments of a\n"
               "               micro-batch (--ubatch tokens, default 64), the highest routing weights first; the\n"
               "               rest are dropped (--overflow drop, the default) or moved to the token's next-best\n"
               "               expert with room (--overflow reroute); the share of assignments dropped and moved\n"
               "               is printed. With --ubatch B it measures the quality cost of capping a step of B tokens\n"
               "  --ubatch N   tokens per micro-batch (default 64; with --parallel B: B)\n"
               "  --parallel B  score B windows at once as B sequences of one batch, interleaved token by token,\n"
               "               so that each micro-batch holds one token of each window: the routing of B sequences\n"
               "               decoding together (what a capacity factor caps in batched decoding); the same\n"
               "               perplexity as one window at a time without a capacity factor\n"
               "  --per-file   print each file's token count and perplexity\n"
               "  --no-mmap    copy the weights into private memory of 2 MiB pages (see 'moetax bench')\n"
               "  --check-finite  check every hidden state after each layer (a NaN or inf names the layer)\n"
               "  --json       print the result as one JSON object on stdout\n"
               CLI_CACHE_TYPE_HELP CLI_MLA_PREFILL_HELP
               CLI_CONFIG_HELP
               CLI_MAX_INPUT_HELP
               "               (per file)\n"
               "A NaN or infinite log-likelihood (a broken model) is an error naming the file and the token.\n"
               "A progress bar goes to stderr when it is a terminal (MOETAX_PROGRESS=1 forces it).\n");
}

struct acc {
    double sum, sum2; /* of the token NLLs */
    int64_t n;        /* tokens scored */
    int64_t evald;    /* tokens evaluated (windows overlap) */
};

/* -log softmax(row)[target], in double */
static double token_nll(const float *row, int64_t V, int32_t target) {
    float mx = row[0];
    for (int64_t v = 1; v < V; v++) mx = row[v] > mx ? row[v] : mx;
    double s = 0;
    for (int64_t v = 0; v < V; v++) s += exp((double)row[v] - (double)mx);
    return log(s) + (double)mx - (double)row[target];
}

/* Score one document's tokens with the sliding window. */
static moetax_status score_doc(const char *file, struct moetax_ctx *c, const int32_t *ids, int64_t n, int64_t ctx,
                               int64_t stride, int64_t V, float *logits, struct acc *a, cli_progress *pr,
                               uint64_t *done) {
    int64_t scored_to = 1; /* next token index to score */
    for (int64_t begin = 0; scored_to < n; begin += stride) {
        int64_t end = begin + ctx < n ? begin + ctx : n;
        moetax_ctx_reset(c);
        moetax_status st = moetax_ctx_eval(c, ids + begin, end - begin, logits, true);
        if (st) { /* name the file and the window (the message is copied: it is the buffer written) */
            char msg[1024];
            snprintf(msg, sizeof msg, "%s", moetax_last_error());
            return moetax_error(st, "%s: the window at token %lld: %s", file, (long long)begin, msg);
        }
        a->evald += end - begin;
        for (int64_t j = scored_to; j < end; j++) {
            double l = token_nll(logits + (size_t)(j - 1 - begin) * (size_t)V, V, ids[j]);
            if (!isfinite(l))
                return moetax_error(MOETAX_ERR_NUMERIC,
                                    "%s: token %lld: the log-likelihood is %s (the logits of the window at token %lld "
                                    "are not finite): the model's weights or its input give NaN or infinity",
                                    file, (long long)j, isnan(l) ? "NaN" : "infinite", (long long)begin);
            a->sum += l;
            a->sum2 += l * l;
            a->n++;
        }
        *done += (uint64_t)(end - scored_to);
        scored_to = end;
        cli_progress_update(pr, *done);
    }
    return MOETAX_OK;
}

/* --parallel B: the windows of every document scored B at a time, as B sequences of one
 * batch, interleaved token by token, so that each micro-batch of B tokens holds one token of
 * each window: the routing a step of B sequences decoding together sees (a capacity
 * factor then caps what it caps in batched decoding). Same tokens and windows as
 * score_doc, so the same perplexity without a capacity factor. */
struct window { int f; int64_t begin, end, from; };

static moetax_status score_parallel(char **files, int32_t **docs, const int64_t *doc_n, int n_files, struct moetax_ctx *c,
                                    int64_t ctx, int64_t stride, int B, int64_t V, struct acc *per, cli_progress *pr,
                                    uint64_t *done) {
    int64_t nw = 0, cap = 64;
    struct window *w = malloc(sizeof *w * (size_t)cap);
    struct moetax_batch b = {0};
    moetax_status st = w ? moetax_batch_init(&b, (int32_t)(B * ctx)) : moetax_error(MOETAX_ERR_NOMEM, "out of memory");
    for (int f = 0; !st && f < n_files; f++) {
        if (doc_n[f] < 2) continue;
        for (int64_t begin = 0, scored_to = 1; scored_to < doc_n[f]; begin += stride) {
            if (nw == cap) {
                struct window *nwp = realloc(w, sizeof *w * (size_t)(cap *= 2));
                if (!nwp) { st = moetax_error(MOETAX_ERR_NOMEM, "out of memory"); break; }
                w = nwp;
            }
            const int64_t end = begin + ctx < doc_n[f] ? begin + ctx : doc_n[f];
            w[nw++] = (struct window){.f = f, .begin = begin, .end = end, .from = scored_to};
            scored_to = end;
        }
    }
    for (int64_t g = 0; !st && g < nw; g += B) {
        const int64_t ng = nw - g < B ? nw - g : B;
        moetax_ctx_reset(c);
        moetax_batch_clear(&b);
        for (int64_t i = 0; i < ctx; i++)
            for (int64_t q = 0; q < ng && !st; q++) {
                const struct window *x = &w[g + q];
                if (x->begin + i < x->end)
                    st = moetax_batch_add(&b, docs[x->f][x->begin + i], (int32_t)i, (int32_t)q,
                                          x->begin + i + 1 >= x->from && x->begin + i + 1 < x->end);
            }
        if (!st && (st = moetax_ctx_decode(c, &b))) {
            char msg[1024];
            snprintf(msg, sizeof msg, "%s", moetax_last_error());
            st = moetax_error(st, "%s: the windows from token %lld: %s", files[w[g].f], (long long)w[g].begin, msg);
        }
        for (int32_t e = 0; !st && e < b.n_tokens; e++) {
            if (!b.logits[e]) continue;
            const struct window *x = &w[g + b.seq[e]];
            const int64_t j = x->begin + b.pos[e] + 1; /* the token these logits predict */
            const double l = token_nll(moetax_ctx_logits_ith(c, e), V, docs[x->f][j]);
            if (!isfinite(l)) {
                st = moetax_error(MOETAX_ERR_NUMERIC, "%s: token %lld: the log-likelihood is %s", files[x->f], (long long)j,
                                  isnan(l) ? "NaN" : "infinite");
                break;
            }
            struct acc *a = &per[x->f];
            a->sum += l;
            a->sum2 += l * l;
            a->n++;
            (*done)++;
        }
        for (int64_t q = 0; q < ng; q++) per[w[g + q].f].evald += w[g + q].end - w[g + q].begin;
        cli_progress_update(pr, *done);
    }
    moetax_batch_free(&b);
    free(w);
    return st;
}

int cmd_perplexity(int argc, char **argv) {
    const char *model = NULL, *input = NULL;
    int64_t n_threads = 0, ctx = 0, stride = 0, max_files = 0;
    struct moetax_model_params mp = {0};
    bool check_finite = false; /* --check-finite */
    enum moetax_type kv_type = MOETAX_TYPE_F32; /* --cache-type */
    enum moetax_attn_prefill prefill = MOETAX_ATTN_PREFILL_ABSORBED; /* --mla-prefill */
    int k_ctx = 0; /* --experts-used: run-time top-k, a context parameter (0: the model's) */
    bool per_file = false, json = false;
    double capf = 0;
    int64_t ubatch = 0, parallel = 0;
    struct acc *per = NULL;
    enum moetax_overflow overflow = MOETAX_OVERFLOW_DROP;
    bool overflow_given = false;
    struct moetax_ledger *led = NULL;
    uint64_t max_input = 0;
    struct cli_config cfg; /* --config: defaults, the options below win */
    if (cli_config_scan(argc, argv, &cfg)) return cli_usage_error("perplexity", "%s", moetax_last_error());
    if (cfg.loaded) {
        n_threads = cfg.threads, k_ctx = cfg.experts_used, mp.no_mmap = cfg.no_mmap, kv_type = cfg.cache_type;
        prefill = cfg.mla_prefill;
        capf = cfg.capacity_factor, overflow = cfg.overflow;
    }
    mp.expert_type = cfg.expert_type; /* --expert-type or the file's */
    for (int i = 1; i < argc; i++) {
        const char *v = NULL;
        bool err = false;
        if (cli_flag(argv, i, "-h", "--help")) { usage(stdout); return 0; }
        else if (cli_config_opt(argc, argv, &i, &err)) { if (err) return 2; }
        else if (cli_opt(argc, argv, &i, "-m", "--model", &model, &err)) { if (err) return 2; }
        else if (cli_opt(argc, argv, &i, "-f", "--file", &input, &err)) { if (err) return 2; }
        else if (cli_opt(argc, argv, &i, "-c", "--ctx", &v, &err)) {
            if (err || !cli_parse_i64(v, &ctx) || ctx < 2 || ctx > 1 << 20) return cli_usage_error("perplexity", "-c needs a window of 2..1048576 tokens");
        } else if (cli_opt(argc, argv, &i, NULL, "--stride", &v, &err)) {
            if (err || !cli_parse_i64(v, &stride) || stride < 1) return cli_usage_error("perplexity", "--stride needs a count >= 1");
        } else if (cli_opt(argc, argv, &i, NULL, "--max-files", &v, &err)) {
            if (err || !cli_parse_i64(v, &max_files) || max_files < 1) return cli_usage_error("perplexity", "--max-files needs a count >= 1");
        } else if (cli_opt(argc, argv, &i, "-t", "--threads", &v, &err)) {
            if (err || !cli_parse_i64(v, &n_threads) || n_threads < 1 || n_threads > 512)
                return cli_usage_error("perplexity", "-t needs a thread count in 1..512");
        } else if (cli_opt(argc, argv, &i, NULL, "--experts-used", &v, &err)) {
            if (err || !cli_parse_experts_used(v, &k_ctx))
                return cli_usage_error("perplexity", "--experts-used needs a count in 1..256");
        } else if (cli_opt(argc, argv, &i, NULL, "--capacity-factor", &v, &err)) {
            if (!err && !strcmp(v, "inf")) capf = INFINITY;
            else if (err || !cli_parse_f64(v, &capf) || !(capf > 0) || !cli_capacity_factor_ok(&capf))
                return cli_usage_error("perplexity", "--capacity-factor needs a number >= 1e-45 (inf: off)");
        } else if (cli_opt(argc, argv, &i, NULL, "--overflow", &v, &err)) {
            if (err || (strcmp(v, "drop") && strcmp(v, "reroute")))
                return cli_usage_error("perplexity", "--overflow: expected drop or reroute");
            overflow_given = true;
            overflow = strcmp(v, "drop") ? MOETAX_OVERFLOW_REROUTE : MOETAX_OVERFLOW_DROP;
        } else if (cli_opt(argc, argv, &i, NULL, "--parallel", &v, &err)) {
            if (err || !cli_parse_i64(v, &parallel) || parallel < 1 || parallel > 256)
                return cli_usage_error("perplexity", "--parallel needs a count of windows in 1..256");
        } else if (cli_opt(argc, argv, &i, NULL, "--ubatch", &v, &err)) {
            if (err || !cli_parse_i64(v, &ubatch) || ubatch < 1 || ubatch > 4096)
                return cli_usage_error("perplexity", "--ubatch needs a count in 1..4096");
        } else if (!strcmp(argv[i], "--per-file")) per_file = true;
        else if (!strcmp(argv[i], "--no-mmap")) mp.no_mmap = true;
        else if (!strcmp(argv[i], "--check-finite")) check_finite = true;
        else if (cli_cache_type_opt("perplexity", argc, argv, &i, &kv_type, &err)) { if (err) return 2; }
        else if (cli_mla_prefill_opt("perplexity", argc, argv, &i, &prefill, &err)) { if (err) return 2; }
        else if (!strcmp(argv[i], "--json")) json = true;
        else if (cli_max_input_opt("perplexity", argc, argv, &i, &max_input, &err)) { if (err) return 2; }
        else return cli_usage_error("perplexity", "unknown option '%s'", argv[i]);
    }
    if (!input) return cli_usage_error("perplexity", "no text given (-f FILE or -f DIR)");
    if (overflow_given && capf == 0) /* the overflow of a cap that is not there */
        return cli_usage_error("perplexity", "--overflow goes with --capacity-factor C (without it nothing overflows)");
    if (!model) model = cli_default_model_path();

    char **files = NULL;
    int n_files = 0;
    moetax_status st = cli_list_inputs(input, &files, &n_files);
    if (st) return cli_fail("perplexity", st);
    if (max_files && n_files > max_files) {
        for (int i = (int)max_files; i < n_files; i++) free(files[i]);
        n_files = (int)max_files;
    }
    struct moetax_model *m = NULL;
    struct moetax_tokenizer *tok = NULL;
    struct moetax_ctx *c = NULL;
    int32_t **docs = calloc((size_t)n_files, sizeof *docs);
    int64_t *doc_n = calloc((size_t)n_files, sizeof *doc_n);
    float *logits = NULL;
    struct acc total = {0};
    int n_empty = 0;
    double t0 = cli_now();
    if (!docs || !doc_n) { st = moetax_error(MOETAX_ERR_NOMEM, "out of memory"); goto done; }
    if ((st = moetax_model_load_ex(model, &mp, &m))) goto done;
    if ((st = moetax_tokenizer_load(m->gguf, &tok))) goto done;
    if (moetax_tokenizer_n_vocab(tok) != m->hp.n_vocab) {
        st = moetax_error(MOETAX_ERR_FORMAT, "%s: the vocabulary has %d tokens but token_embd has %d rows", model,
                          moetax_tokenizer_n_vocab(tok), m->hp.n_vocab);
        goto done;
    }
    if ((st = moetax_model_check_experts_used(m, k_ctx))) goto done;
    if (!ctx) ctx = m->hp.n_ctx_train > 0 && m->hp.n_ctx_train < 512 ? m->hp.n_ctx_train : 512;
    if (ctx > m->hp.n_ctx_train && m->hp.n_ctx_train > 0)
        fprintf(stderr, "moetax perplexity: warning: -c %lld is longer than the %d tokens the model was trained on\n",
                (long long)ctx, (int)m->hp.n_ctx_train);
    if (!stride) stride = ctx / 2 > 0 ? ctx / 2 : 1;
    if (stride > ctx - 1) {
        st = moetax_error(MOETAX_ERR_ARG, "--stride %lld must be below -c %lld (a window scores at most c - 1 new tokens)",
                          (long long)stride, (long long)ctx);
        goto done;
    }
    /* tokenize everything first: the progress bar counts tokens */
    uint64_t to_score = 0;
    bool bos = moetax_tokenizer_add_bos(tok) && moetax_tokenizer_bos(tok) >= 0;
    for (int f = 0; f < n_files; f++) {
        char *text;
        size_t len;
        if ((st = cli_read_file(files[f], max_input, &text, &len))) goto done;
        int64_t n = 0;
        st = cli_encode(tok, text, len, bos, 0, &docs[f], &n);
        free(text);
        if (st) goto done;
        doc_n[f] = n;
        if (n < 2) n_empty++;
        else to_score += (uint64_t)(n - 1);
    }
    if (to_score == 0) { st = moetax_error(MOETAX_ERR_ARG, "%s: no file has two or more tokens to score", input); goto done; }
    const int64_t bs = MOETAX_KV_BLOCK_DEFAULT;
    struct moetax_ctx_params cp = {.check_finite = check_finite, .kv_type = kv_type, .attn_prefill = prefill, .n_ctx = (int32_t)ctx, .n_threads = (int32_t)n_threads,
                                   .n_expert_used = k_ctx, .capacity_factor = (float)capf, .overflow = overflow,
                                   .n_ubatch = ubatch ? (int32_t)ubatch : 64}; /* the cap's micro-batch, as documented */
    if (parallel) { /* B windows at once, one token of each per micro-batch unless --ubatch says */
        cp.n_ctx = (int32_t)(parallel * ((ctx + bs - 1) / bs * bs));
        cp.n_seq_max = (int32_t)parallel;
        if (!ubatch) cp.n_ubatch = (int32_t)parallel;
    }
    if ((st = moetax_ctx_init(m, &cp, &c))) goto done;
    if (capf > 0) { /* the ledger counts what the capacity factor dropped and moved */
        struct moetax_ledger_params lp = {.n_workers = moetax_ctx_n_threads(c), .n_layer = m->hp.n_layer};
        if ((st = moetax_ledger_init(&lp, &led))) goto done;
        moetax_ctx_set_ledger(c, led);
    }
    logits = malloc(sizeof(float) * (size_t)m->hp.n_vocab * (size_t)ctx);
    if (!logits) { st = moetax_error(MOETAX_ERR_NOMEM, "out of memory for %lld x %d logits", (long long)ctx, (int)m->hp.n_vocab); goto done; }
    if (!json)
        printf("perplexity: %s over %d file%s (%llu tokens to score), window %lld, stride %lld, %d threads, %d experts per token\n",
               model, n_files, n_files == 1 ? "" : "s", (unsigned long long)to_score, (long long)ctx, (long long)stride,
               moetax_ctx_n_threads(c), moetax_ctx_n_expert_used(c));
    cli_progress pr;
    cli_progress_init(&pr, "perplexity", to_score);
    uint64_t done = 0;
    if (!(per = calloc((size_t)n_files, sizeof *per))) { st = moetax_error(MOETAX_ERR_NOMEM, "out of memory"); goto done; }
    if (parallel &&
        (st = score_parallel(files, docs, doc_n, n_files, c, ctx, stride, (int)parallel, m->hp.n_vocab, per, &pr, &done)))
        goto done;
    for (int f = 0; f < n_files; f++) {
        if (doc_n[f] < 2) continue;
        struct acc a = per[f];
        if (!parallel &&
            (st = score_doc(files[f], c, docs[f], doc_n[f], ctx, stride, m->hp.n_vocab, logits, &a, &pr, &done)))
            goto done;
        total.sum += a.sum;
        total.sum2 += a.sum2;
        total.n += a.n;
        total.evald += a.evald;
        if (per_file && !json) {
            if (pr.enabled) fprintf(stderr, "\r\033[K");
            printf("  %-60s %7lld tokens  ppl %9.4f\n", files[f], (long long)a.n, exp(a.sum / (double)a.n));
        }
    }
    cli_progress_done(&pr);
    {
        double secs = cli_now() - t0;
        double mean = total.sum / (double)total.n;
        double var = total.sum2 / (double)total.n - mean * mean;
        double se = total.n > 1 && var > 0 ? sqrt(var / (double)(total.n - 1)) : 0;
        double ppl = exp(mean);
        if (!isfinite(ppl) || !isfinite(se)) { /* each NLL was finite: their sum overflowed */
            st = moetax_error(MOETAX_ERR_NUMERIC, "%s: the perplexity is not finite (mean NLL %g over %lld tokens)",
                              input, mean, (long long)total.n);
            goto done;
        }
        struct moetax_ledger_moe_stats ms = {0};
        if (led) moetax_ledger_moe_totals(led, false, &ms);
        const double n_asg = (double)(ms.assignments + ms.dropped);
        const double drop_share = n_asg > 0 ? (double)ms.dropped / n_asg : 0, move_share = n_asg > 0 ? (double)ms.rerouted / n_asg : 0;
        if (json) {
            json_t *o = cli_jobj("ooooooiiIIIiiooooo", "capacity_factor", capf > 0 && isfinite(capf) ? cli_jnum(capf) : json_null(),
                                  "overflow", cli_jstr(overflow == MOETAX_OVERFLOW_REROUTE ? "reroute" : "drop"),
                                  "dropped_share", cli_jnum(drop_share), "rerouted_share", cli_jnum(move_share), "model",
                                  cli_jstr(model), "input", cli_jstr(input), "files", n_files - n_empty,
                                  "files_skipped", n_empty, "tokens", (json_int_t)total.n, "ctx", (json_int_t)ctx,
                                  "stride", (json_int_t)stride, "threads", moetax_ctx_n_threads(c), "experts_used",
                                  moetax_ctx_n_expert_used(c), "nll", cli_jnum(mean), "nll_stderr", cli_jnum(se),
                                  "ppl", cli_jnum(ppl), "ppl_stderr", cli_jnum(ppl * se), "seconds", cli_jnum(secs));
            if ((st = cli_json_print(stdout, o))) goto done;
        } else {
            if (n_empty) printf("skipped %d file%s with fewer than two tokens\n", n_empty, n_empty == 1 ? "" : "s");
            printf("scored %lld tokens in %.1f s (%.0f tokens evaluated/s)\n", (long long)total.n, secs,
                   (double)total.evald / (secs > 0 ? secs : 1));
            printf("Final estimate: PPL = %.4f +/- %.4f\n", ppl, ppl * se);
            if (led)
                printf("capacity factor %g (%s, micro-batches of %lld tokens): %.2f%% of the assignments dropped, "
                       "%.2f%% rerouted\n", capf, overflow == MOETAX_OVERFLOW_REROUTE ? "reroute" : "drop",
                       (long long)moetax_ctx_n_ubatch(c), 100 * drop_share, 100 * move_share);
        }
    }
done:
    if (docs)
        for (int f = 0; f < n_files; f++) free(docs[f]);
    free(docs);
    free(doc_n);
    for (int f = 0; f < n_files; f++) free(files[f]);
    free(files);
    free(logits);
    moetax_ctx_free(c);
    moetax_ledger_free(led);
    free(per);
    moetax_tokenizer_free(tok);
    moetax_model_free(m);
    if (st) return cli_fail("perplexity", st);
    return 0;
}
