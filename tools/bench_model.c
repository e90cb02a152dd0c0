/* bench_model.c - `moetax bench -m FILE`: prefill (ppN) and decode (tgN) speed as
 * llama-bench reports them, plus TPOT percentiles, active bytes per token, the
 * achieved weight-streaming GB/s and its ratio to the read bandwidth measured
 * by the same run (moetax bench mem's probe).
 *
 * The ledger is always on. Its own overhead is measured in the same run: the
 * decode repetitions alternate ledger on / off, and the medians are compared.
 * With --twin DENSE.gguf the dense twin runs the same tests in the same session
 * and the MoE-minus-dense time per decoded token is printed beside the
 * ledger's tax per token. */
#include <ctype.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "bench.h"
#include "config_cli.h"
#include "cli.h"
#include "ledger_cli.h"
#include "store_cli.h"
#include "moetax/gguf.h"
#include "moetax/kernels.h"
#include "moetax/kvcache.h"
#include "moetax/membw.h"
#include "moetax/model.h"
#include "moetax/pool.h"
#include "moetax/tokenizer.h"

static void usage(FILE *f) {
    fprintf(f, "usage: moetax bench -m FILE [-p 64,512] [-n 32,128] [-t 1,2] [-r REPS] [--json] [--no-mem] [--no-mmap]\n"
               "                    [--twin DENSE.gguf] [--ledger FILE] [--trace FILE] [--metrics]\n\n"
               "  -p LIST        prompt lengths for prefill tests ppN (default 64; 0 = none)\n"
               "  -n LIST        generation lengths for decode tests tgN (default 32; 0 = none)\n"
               "  -t LIST        thread counts (default: online CPUs)\n"
               "  -r N           repetitions, the median is reported (default 5)\n"
               "  -d N           depth: N tokens in the sequence's KV cache before each test, prefilled untimed\n"
               "                 and outside the ledger (llama-bench's -d; tests named 'tg32 @ d4096'): decode and\n"
               "                 prefill at a long context, where attention's reads of the cache add to the\n"
               "                 weights' (GB/s and the roofline count the weights only)\n"
               "  --json         one JSON object per test: test, threads, tokens_per_s, tpot_p50_ms, tpot_p99_ms,\n"
               "                 active_bytes_per_token, gbps, read_gbps, roofline_ratio, paired_ratio, us_per_layer,\n"
               "                 tax_share, ledger_overhead, ubatch, mla_prefill, cache_type, weights_huge_share (the share of the\n"
               "                 resident weights in 2 MiB pages; 4 KiB pages stream slower, and the read probe uses\n"
               "                 2 MiB pages)\n"
               "                 roofline_ratio = gbps / read_gbps (read bandwidth measured once per thread count);\n"
               "                 paired_ratio = median over repetitions of gbps / a read pass just before each one\n"
               "                 (robust to a machine whose bandwidth drifts; decode, without --expert-budget);\n"
               "                 above 1.1 it is a measurement error: null, with paired_ratio_raw and\n"
               "                 paired_ratio_error (the table prints 'error (...)'); --batch: bandwidth_ratio alike\n"
               "  --no-mem       skip the read-bandwidth probe (no roofline ratio)\n"
               CLI_CACHE_TYPE_HELP CLI_MLA_PREFILL_HELP
               "  -ub, --ubatch N  tokens per micro-batch of a prompt (default 512, llama.cpp's; more takes more\n"
               "                 memory and, with --mla-prefill auto, fewer decompressions of a long prompt's\n"
               "                 positions; with --expert-budget the store's)\n"
               CLI_CONFIG_HELP
               "  --adapt-threads  run each step on all -t threads or half of them, whichever measures faster\n"
               "                 (a machine busy with other work; ppN/tgN tests)\n"
               "  --no-mmap      copy the weights into private memory of 2 MiB pages instead of reading them\n"
               "                 in place from the file mapping (see weights_huge_share)\n"
               "  --experts-used K  route each token to K experts instead of the file's count (run-time\n"
               "                 top-k; active bytes count K; see 'moetax perplexity --experts-used' for quality)\n"
               "  --twin FILE    also run the dense twin (moetax gen --dense-twin-of) and compare\n"
               "  -f TEXT        feed the tests the tokens of this text (the model's tokenizer), fresh text each\n"
               "                 repetition (wrapping around), instead of pseudo-random token ids: real routing\n"
               "                 locality for --expert-budget and --batch (decode feeds the text, not samples)\n"
               "  --batch LIST   instead of ppN/tgN: B sequences decode together for each B (e.g. 1,2,4,8,16),\n"
               "                 each with its own prompt of -p tokens (prefilled first, together), then -n steps\n"
               "                 of one token per sequence, like llama-batched-bench; per B: aggregate t/s, TPOT\n"
               "                 p50/p99 per sequence, distinct experts read per step, expert bytes per token,\n"
               "                 load imbalance, wait and tax share, and the step's bandwidth ratio (the bytes it\n"
               "                 read over the read bandwidth measured just before each repetition). The Bs'\n"
               "                 repetitions take turns (-r times: one of each B), so that a drifting machine slows\n"
               "                 all alike, and 'vs B' (JSON: vs_batch, tokens_per_s_ratio) is the median over\n"
               "                 repetitions of a B's t/s over the first B's in the same repetition\n"
               "  --capacity-factor C  with --batch: each expert takes at most ceil(C x tokens x k / E)\n"
               "                 assignments per step (off by default); --overflow drop|reroute (default drop)\n"
               "  --expert-budget LIST  also run decode with the routed experts behind an expert store of\n"
               "                 each budget (e.g. 100%%,50%%,25%%,10%% of the experts, or sizes like 512M); each\n"
               "                 budget's lines give hit rate against Belady's (per acquire, and per expert use\n"
               "                 against Belady's and the best static set's), prefetch precision/recall, the\n"
               "                 store's read GB/s against the device's random reads of the same size and queue\n"
               "                 depth (moetax bench io, measured right after that budget's run), time per\n"
               "                 token against the ideal max(mapped time, bytes read / device GB/s), and the\n"
               "                 run's peak RSS against its bound: slots + non-expert weights + KV cache +\n"
               "                 64 MiB for the process (code, heap, buffers, the store's tables); the store\n"
               "                 options below (--policy, --no-prefetch, --io-threads, ...) apply to every budget;\n"
               "                 --ledger / --trace FILE also write one file per budget, FILE.budget-50pct.json\n"
               "%s%s"
               "Weights are faulted in before timing (page faults are not part of a step). In decode tests\n"
               "the ledger is on for every other token; ledger_overhead = median token time with it on /\n"
               "median token time with it off - 1 (TPOT percentiles are of the ledger-on tokens).\n",
            cli_ledger_help(), cli_store_help());
}


struct opts {
    int64_t pp[16], tg[16];
    int npp, ntg;
    int64_t reps;
    int64_t depth;       /* -d: tokens in the sequence's cache before each test (llama-bench's -d) */
    bool json, mem;
    struct cli_ledger_opts lo;
    struct cli_store_opts so;
    const char *budget;  /* this run's expert budget (one item of so.budgets), NULL: mapped */
    int experts_used;    /* --experts-used: run-time top-k (0: the model's) */
    bool no_mmap;        /* --no-mmap: private copies in 2 MiB pages */
    bool adapt_threads;  /* --adapt-threads */
    enum moetax_type expert_type; /* --expert-type: routed experts re-quantized at load */
    enum moetax_type kv_type; /* --cache-type */
    enum moetax_attn_prefill prefill; /* --mla-prefill */
    int64_t ubatch;                   /* -ub, --ubatch (0: the context's default) */
    const int32_t *text;      /* -f TEXT: the tests' tokens, fresh text each repetition (NULL: pseudo-random ids) */
    int64_t n_text;
};

struct result {
    double tps, p50, p99, us_layer, tax_share, overhead, tax_us; /* decode: ledger tax per token (us) */
    double paired; /* decode: median over repetitions of (GB/s / a read-bandwidth pass just before it) */
    double phase_us[MOETAX_PHASE_COUNT];                         /* ledger us per token by phase */
    /* with an expert store (decode tests) */
    double hit_rate, belady, precision, recall, read_mib_per_token, store_gbps, rss_mib, budget_mib;
    int read_ahead;                   /* the store's read-ahead depth (-1: off) */
    double ahead_per_token, ahead_precision; /* its reads per token, the share of them used */
    double use_hit, belady_use; /* per expert use (one per layer pass): share needing no read; < 0: unknown */
    double rss_bound_mib;       /* slots + non-expert weights + KV cache + CLI_RSS_OVERHEAD_BYTES */
    bool rss_peak;              /* rss_mib is the run's peak (else the RSS at its end) */
    double static_use;          /* the best static set of experts on the use trace (see store.h) */
    uint64_t req_bytes; /* mean bytes per read request of the store */
    /* the warm-up repetition when it found the store fresh (decode first, -p 0): the first n
     * tokens from a cold store (or one --warm filled); < 0: the store had been used before */
    double cold_hit, cold_us;
    double steady_hit; /* the timed repetitions' own hit rate */
    bool has_store;
};

/* Every --expert-budget item is a size or share the store can open with (it holds a token's experts),
 * checked on the loaded model before the first test, so that a bad one does not end the benchmark
 * after the mapped runs. */
static moetax_status budgets_fit(const struct moetax_model *m, const struct opts *o) {
    char *list = strdup(o->so.budgets);
    if (!list) return moetax_error(MOETAX_ERR_NOMEM, "out of memory");
    moetax_status st = MOETAX_OK;
    const uint64_t all = moetax_model_store_bytes_all(m);
    for (char *save = NULL, *tok = strtok_r(list, ",", &save); tok && !st; tok = strtok_r(NULL, ",", &save)) {
        uint64_t budget = 0;
        if (!cli_store_parse_budget(tok, all, &budget))
            st = moetax_error(MOETAX_ERR_ARG, "--expert-budget: '%s' is not a size (2G, 512M) or a percentage (25%%)", tok);
        else if ((st = moetax_model_store_check_budget(m, budget, o->experts_used)))
            st = moetax_error(st, "--expert-budget %s: %s", tok, moetax_last_error());
    }
    free(list);
    return st;
}

/* Run every test of one model at one thread count; results[kind][i]. */
static moetax_status bench_model(const char *path, struct moetax_pool *pool, double read_gbps, const struct opts *o,
                                 bool write_outputs, struct result res[2][16]) {
    /* with a budget, the peak RSS of this run alone (the mapped run before it is unmapped) */
    const bool peak_ok = o->budget && cli_peak_rss_reset();
    struct moetax_model *m;
    struct moetax_model_params mp = {.no_mmap = o->no_mmap, .expert_type = o->expert_type};
    moetax_status st = moetax_model_load_ex(path, &mp, &m);
    if (st) return st;
    if (!o->budget && o->so.budgets && (st = budgets_fit(m, o))) {
        moetax_model_free(m);
        return st;
    }
    /* page faults are paid at load (resident part) and at context creation (routed experts,
     * unless they are behind the expert store), not inside the timed steps */
    const double active = moetax_model_active_bytes_k(m, o->experts_used);
    const int threads = moetax_pool_n_threads(pool);
    int64_t max_tok = 1;
    for (int i = 0; i < o->npp; i++) if (o->pp[i] > max_tok) max_tok = o->pp[i];
    for (int i = 0; i < o->ntg; i++) if (o->tg[i] + 1 > max_tok) max_tok = o->tg[i] + 1;
    const int64_t D = o->depth;
    int32_t *toks = malloc(sizeof(int32_t) * (size_t)(max_tok + D)); /* [D depth tokens][the test's] */
    float *logits = malloc(sizeof(float) * (size_t)m->hp.n_vocab);
    double *times = malloc(sizeof(double) * (size_t)(max_tok * o->reps + 1));
    double *times_off = malloc(sizeof(double) * (size_t)(max_tok * o->reps + 1));
    double *rep_on = malloc(sizeof(double) * (size_t)(o->reps + 1));
    double *rep_pair = malloc(sizeof(double) * (size_t)(o->reps + 1));
    struct moetax_ctx *c = NULL;
    struct moetax_ledger *led = NULL;
    struct moetax_store *store = NULL;
    struct moetax_membw_probe *probe = NULL; /* paired roofline (mapped runs only: it would count in a store run's RSS) */
    bool paired_bad = false; /* a printed paired ratio was a measurement error (cli_paired_note) */
    if (!toks || !logits || !times || !times_off || !rep_on || !rep_pair) {
        st = moetax_error(MOETAX_ERR_NOMEM, "out of memory");
        goto done;
    }
    if (read_gbps > 0 && !o->budget && o->ntg > 0 && (st = moetax_membw_probe_new(pool, (size_t)512 << 20, &probe)))
        goto done;
    for (int64_t i = 0; i < max_tok + D; i++)
        toks[i] = o->text ? o->text[i % o->n_text] : (int32_t)((i * 7919 + 13) % m->hp.n_vocab);
    struct moetax_ctx_params cp = {.n_ctx = (int32_t)(max_tok + D) + 1, .pool = pool, .n_expert_used = o->experts_used,
                                   .kv_type = o->kv_type, .adapt_threads = o->adapt_threads,
                                   .attn_prefill = o->prefill, .n_ubatch = (int32_t)o->ubatch};
    uint64_t budget = 0;
    if (o->budget) {
        if (!cli_store_parse_budget(o->budget, moetax_model_store_bytes_all(m), &budget)) {
            st = moetax_error(MOETAX_ERR_ARG, "--expert-budget: '%s' is not a size (2G, 512M) or a percentage (25%%)", o->budget);
            goto done;
        }
        int ub = 64;
        struct cli_store_opts so = o->so;
        if (write_outputs && o->lo.trace_path) so.read_log_cap = (int64_t)1 << 16; /* the trace's I/O tracks */
        if ((st = cli_store_open(m, &so, budget, &ub, &store))) goto done;
        cp.store = store;
        cp.n_ubatch = ub;
        cp.no_prefetch = o->so.no_prefetch;
    }
    if ((st = moetax_ctx_init(m, &cp, &c))) goto done;
    /* how the weights are paged once faulted in (< 0: unknown, e.g. no /proc) */
    uint64_t wres = 0, whuge = 0;
    const double huge_share = !moetax_model_weight_pages(m, &wres, &whuge) && wres ? (double)whuge / (double)wres : -1;
    if ((st = cli_ledger_new(m, threads, &o->lo, &led))) goto done;
    moetax_ctx_set_ledger(c, led);
    const char *base = strrchr(path, '/') ? strrchr(path, '/') + 1 : path;
    for (int kind = 0; kind < 2 && !st; kind++) {
        int nlist = kind == 0 ? o->npp : o->ntg;
        for (int li = 0; li < nlist && !st; li++) {
            int64_t n = kind == 0 ? o->pp[li] : o->tg[li];
            int nt = 0, non = 0, npair = 0;
            double ph0[MOETAX_PHASE_COUNT], ph1[MOETAX_PHASE_COUNT];
            int64_t tok0, tok1;
            struct moetax_store_stats ss0 = {0}, ss1 = {0}, ssc = {0};
            double cold_dt = 0;
            if (store) moetax_store_get_stats(store, &ssc);
            moetax_ledger_totals(led, false, ph0, NULL, &tok0, NULL);
            /* r = -1: warm-up. Decode: within each repetition the ledger is on for every other
             * token (the parity alternates between repetitions, so both sets see the same
             * positions); its overhead is the ratio of the two sets' median token times. */
            int ntoff = 0;
            for (int64_t r = -1; r < o->reps && !st; r++) {
                double bw = 0;
                /* each repetition its own tokens: the same ones again would find the expert
                 * store holding exactly what they route to (the repetition before loaded it) */
                for (int64_t i = 0; i < max_tok + D; i++)
                    toks[i] = o->text ? o->text[((r + 1) * (max_tok + D) + i) % o->n_text]
                                      : (int32_t)((i * 7919 + 13 + (r + 1) * 104729) % m->hp.n_vocab);
                moetax_ctx_reset(c);
                if (D > 0) { /* the depth: in the cache before the test, neither timed nor in the ledger */
                    moetax_ledger_enable(led, false);
                    if ((st = moetax_ctx_eval(c, toks, D, logits, false))) break;
                }
                if (probe && kind == 1) bw = cli_read_pass(probe); /* the warm-up's (r < 0) is not used */
                if (r < 0) bw = 0;
                moetax_ledger_enable(led, true);
                const int32_t *tt = toks + D;
                double t0 = cli_now();
                if (kind == 0) {
                    st = moetax_ctx_eval(c, tt, n, logits, false);
                } else {
                    for (int64_t j = 0; j < n && !st; j++) {
                        bool on = r < 0 || ((j + r) % 2 == 0);
                        moetax_ledger_enable(led, on);
                        double a = cli_now();
                        st = moetax_ctx_eval(c, tt + j, 1, logits, false);
                        double dtj = cli_now() - a;
                        if (r >= 0) {
                            if (on) times[nt++] = dtj;
                            else times_off[ntoff++] = dtj;
                        }
                    }
                }
                double dt = cli_now() - t0;
                if (r >= 0) rep_on[non++] = (double)n / dt;
                if (bw > 0) rep_pair[npair++] = active * (double)n / dt / 1e9 / bw;
                if (r < 0) { /* drop the warm-up from the ledger totals and the store's counts */
                    cold_dt = dt;
                    moetax_ledger_totals(led, false, ph0, NULL, &tok0, NULL);
                    if (store) moetax_store_get_stats(store, &ss0);
                }
            }
            moetax_ledger_enable(led, true);
            if (st) break;
            moetax_ledger_totals(led, false, ph1, NULL, &tok1, NULL);
            double dph[MOETAX_PHASE_COUNT], tax = 0;
            for (int p = 0; p < MOETAX_PHASE_COUNT; p++) {
                dph[p] = ph1[p] - ph0[p];
                if (moetax_phase_is_tax((enum moetax_phase)p)) tax += dph[p];
            }
            struct result *rr = &res[kind][li];
            if (store) {
                moetax_store_get_stats(store, &ss1);
                uint64_t pi = ss1.predicted_issued - ss0.predicted_issued, pu = ss1.predicted_used - ss0.predicted_used;
                uint64_t loads = ss1.loads - ss0.loads;
                rr->has_store = true;
                /* hit rate and Belady's optimum over every acquire since the store opened (both from a
                 * cold cache, so they compare like with like) */
                rr->hit_rate = ss1.acquires ? (double)ss1.hits / (double)ss1.acquires : 0;
                const bool fresh = ssc.acquires == 0 && ss0.acquires > 0;
                rr->cold_hit = fresh ? (double)ss0.hits / (double)ss0.acquires : -1;
                rr->cold_us = fresh ? 1e6 * cold_dt / (double)n : -1;
                rr->steady_hit = ss1.acquires > ss0.acquires
                                     ? (double)(ss1.hits - ss0.hits) / (double)(ss1.acquires - ss0.acquires) : 0;
                rr->precision = pi ? (double)pu / (double)pi : 0;
                rr->read_ahead = moetax_store_read_ahead_depth(store);
                const uint64_t ai = ss1.ahead_issued - ss0.ahead_issued, au = ss1.ahead_used - ss0.ahead_used;
                rr->ahead_per_token = (double)ai / (double)(n * o->reps);
                rr->ahead_precision = ai ? (double)au / (double)ai : 0;
                /* recall: of the experts that had to be read, the share a prediction had fetched */
                uint64_t demand = loads > pi ? loads - pi : 0;
                rr->recall = pu + demand ? (double)pu / (double)(pu + demand) : 0;
                int64_t ntr = n * o->reps; /* every measured repetition */
                rr->read_mib_per_token = (double)(ss1.bytes_read - ss0.bytes_read) / (1 << 20) / (double)ntr;
                uint64_t busy = ss1.io_busy_ns - ss0.io_busy_ns;
                rr->store_gbps = busy ? (double)(ss1.bytes_read - ss0.bytes_read) / (double)busy : 0;
                rr->budget_mib = (double)budget / (1 << 20);
                rr->req_bytes = ss1.reads > ss0.reads ? (ss1.bytes_read - ss0.bytes_read) / (ss1.reads - ss0.reads) : 0;
                /* Belady's optimal hit rate over the same acquires (the store's trace), same slot count */
                int64_t ntrace = moetax_store_trace(store, NULL, NULL, 0);
                int32_t *tl = malloc(sizeof(int32_t) * (size_t)(ntrace + 1)), *te = malloc(sizeof(int32_t) * (size_t)(ntrace + 1));
                if (tl && te) {
                    ntrace = moetax_store_trace(store, tl, te, ntrace);
                    rr->belady = moetax_store_belady_hit_rate(tl, te, ntrace, moetax_store_n_slots(store));
                    /* per expert use: an expert is acquired once per worker and layer pass, so many
                     * acquires hit whatever the policy. A use needed a read when its expert was not
                     * resident: it was read for it (on demand, as the layer's known demand, or by a
                     * prediction that it then used). Loads of predictions never used serve no use. */
                    int64_t nu = moetax_store_trace_uses(tl, te, ntrace);
                    rr->use_hit = rr->belady_use = rr->static_use = -1;
                    if (nu > 0 && (uint64_t)ntrace == ss1.acquires) { /* the whole trace was kept */
                        /* both counted as reads complete (predictions still in flight are in neither) */
                        uint64_t unused = ss1.predicted_loaded > ss1.predicted_used ? ss1.predicted_loaded - ss1.predicted_used : 0;
                        uint64_t read_for_use = ss1.loads > unused ? ss1.loads - unused : 0;
                        rr->use_hit = 1.0 - (double)read_for_use / (double)nu;
                        rr->belady_use = moetax_store_belady_hit_rate(tl, te, nu, moetax_store_n_slots(store));
                        /* the static set leaves room for the experts one decoded token's layer pins
                         * (its k: every worker acquires the same ones) */
                        const int64_t k_used = o->experts_used ? o->experts_used : m->hp.n_expert_used;
                        int64_t held = moetax_store_n_slots(store) - k_used;
                        if (held >= 1) rr->static_use = moetax_store_static_hit_rate(tl, te, nu, held);
                    }
                }
                free(tl);
                free(te);
            }
            rr->rss_peak = peak_ok && cli_peak_rss_bytes() > 0;
            rr->rss_mib = (double)(rr->rss_peak ? cli_peak_rss_bytes() : cli_rss_bytes()) / (1 << 20);
            if (store) {
                struct stat fs;
                struct moetax_store_stats sst;
                moetax_store_get_stats(store, &sst);
                uint64_t fbytes = stat(path, &fs) == 0 ? (uint64_t)fs.st_size : 0, eb = cli_store_expert_bytes(m);
                rr->rss_bound_mib = (double)((uint64_t)sst.n_slots * sst.slot_bytes + (fbytes > eb ? fbytes - eb : 0) +
                                             moetax_ctx_kv_bytes(c) + CLI_RSS_OVERHEAD_BYTES) / (1 << 20);
            }
            rr->tps = cli_percentile(rep_on, non, 0.5);
            rr->paired = npair ? cli_percentile(rep_pair, npair, 0.5) : 0;
            double med_on = nt ? cli_percentile(times, nt, 0.5) : 0, med_off = ntoff ? cli_percentile(times_off, ntoff, 0.5) : 0;
            rr->overhead = med_off > 0 ? med_on / med_off - 1 : 0;
            rr->p50 = kind ? 1e3 * med_on : 0;
            rr->p99 = kind ? 1e3 * cli_percentile(times, nt, 0.99) : 0;
            rr->tax_share = moetax_ledger_tax_share(dph);
            rr->tax_us = tok1 > tok0 ? 1e6 * tax / (double)(tok1 - tok0) : 0;
            for (int p = 0; p < MOETAX_PHASE_COUNT; p++) rr->phase_us[p] = tok1 > tok0 ? 1e6 * dph[p] / (double)(tok1 - tok0) : 0;
            double gbps = kind ? active * rr->tps / 1e9 : 0;
            double ratio = kind && read_gbps > 0 ? gbps / read_gbps : 0;
            rr->us_layer = 1e6 / rr->tps / m->hp.n_layer;
            char test[48];
            if (D > 0) snprintf(test, sizeof test, "%s%lld @ d%lld", kind ? "tg" : "pp", (long long)n, (long long)D);
            else snprintf(test, sizeof test, "%s%lld", kind ? "tg" : "pp", (long long)n);
            if (o->json && rr->has_store && kind)
                st = cli_json_print(stdout, cli_jobj("osiosbiooooooooooooobooooooooo",
                    "model", cli_jstr(base), "test", test, "threads", threads, "expert_budget_mib", cli_jnum(rr->budget_mib),
                    "policy", moetax_store_policy_name(cli_store_policy(&o->so)), "prefetch", !o->so.no_prefetch,
                    "read_ahead", rr->read_ahead, "ahead_reads_per_token", cli_jnum(rr->ahead_per_token),
                    "ahead_precision", cli_jnum(rr->ahead_precision),
                    "tokens_per_s", cli_jnum(rr->tps), "hit_rate", cli_jnum(rr->hit_rate), "belady_hit_rate",
                    cli_jnum(rr->belady), "prefetch_precision", cli_jnum(rr->precision), "prefetch_recall",
                    cli_jnum(rr->recall), "read_mib_per_token", cli_jnum(rr->read_mib_per_token), "store_read_gbps",
                    cli_jnum(rr->store_gbps), "tax_share", cli_jnum(rr->tax_share), "load_us_per_token",
                    cli_jnum(rr->phase_us[MOETAX_PHASE_LOAD]), "rss_mib", cli_jnum(rr->rss_mib), "rss_bound_mib",
                    cli_jnum(rr->rss_bound_mib), "rss_is_peak", rr->rss_peak, "use_hit_rate", cli_jnum(rr->use_hit),
                    "belady_use_hit_rate", cli_jnum(rr->belady_use), "static_use_hit_rate", cli_jnum(rr->static_use),
                    "predictor_router_recall", cli_jnum(cli_predictor_recall(store, 0)), /* --predictor: per token, */
                    "predictor_learned_recall", cli_jnum(cli_predictor_recall(store, 1)), /* one layer ahead */
                    "cold_hit_rate", rr->cold_hit >= 0 ? cli_jnum(rr->cold_hit) : json_null(),
                    "cold_us_per_token", rr->cold_us >= 0 ? cli_jnum(rr->cold_us) : json_null(),
                    "steady_hit_rate", cli_jnum(rr->steady_hit), "us_per_token", cli_jnum(1e6 / rr->tps)));
            else if (rr->has_store && kind)
                printf("| %s | %d | %s | budget %.0f MiB (%s, %s) | %.2f t/s | hit %.1f%% (Belady %.1f%%), per use %.1f%% (Belady %.1f%%, static %.1f%%) | prefetch P %.0f%% R %.0f%% |"
                       " %.2f MiB read/token at %.2f GB/s | tax %.1f%% | %s %.0f MiB (bound %.0f) |\n",
                       base, threads, test, rr->budget_mib, moetax_store_policy_name(cli_store_policy(&o->so)),
                       o->so.no_prefetch ? "no prefetch" : rr->read_ahead > 1 ? "prefetch, read-ahead 2"
                                                         : rr->read_ahead == 1 ? "prefetch, read-ahead 1" : "prefetch, read-ahead off",
                       rr->tps, 100 * rr->hit_rate, 100 * rr->belady,
                       100 * rr->use_hit, 100 * rr->belady_use, 100 * rr->static_use,
                       100 * rr->precision, 100 * rr->recall, rr->read_mib_per_token, rr->store_gbps, 100 * rr->tax_share,
                       rr->rss_peak ? "peak RSS" : "RSS", rr->rss_mib, rr->rss_bound_mib);
            if (!o->json && rr->has_store && kind && rr->cold_hit >= 0)
                printf("|   | cold start: the first %lld tokens (the warm-up, from a store just opened%s) hit %.1f%% at %.0f us/token; "
                       "the timed repetitions after them %.1f%% at %.0f us/token |\n",
                       (long long)n, o->so.warm ? " and filled from the --warm profile" : "", 100 * rr->cold_hit,
                       rr->cold_us, 100 * rr->steady_hit, 1e6 / rr->tps);
            else if (o->json) {
                json_t *jo = cli_jobj("osioooooooooooIobI",
                    "model", cli_jstr(base), "test", test, "threads", threads, "tokens_per_s", cli_jnum(rr->tps),
                    "tpot_p50_ms", cli_jnum(rr->p50), "tpot_p99_ms", cli_jnum(rr->p99), "active_bytes_per_token",
                    cli_jnum(active), "gbps", cli_jnum(gbps), "read_gbps", cli_jnum(read_gbps), "roofline_ratio",
                    cli_jnum(ratio), "us_per_layer", cli_jnum(rr->us_layer),
                    "tax_share", cli_jnum(rr->tax_share), "tax_us_per_token", cli_jnum(rr->tax_us), "ledger_overhead",
                    cli_jnum(kind ? rr->overhead : 0.0), "reps", (json_int_t)o->reps, "weights_huge_share",
                    cli_jnum(huge_share), "no_mmap", o->no_mmap, "depth", (json_int_t)D);
                if (jo) { /* how prompts ran (a ppN row's figures depend on both) */
                    json_object_set_new(jo, "ubatch", json_integer(moetax_ctx_n_ubatch(c)));
                    json_object_set_new(jo, "mla_prefill", json_string(cli_mla_prefill_name(o->prefill)));
                    json_object_set_new(jo, "cache_type", json_string(moetax_type_name(o->kv_type)));
                }
                if (jo && !cli_paired_json(jo, "paired_ratio", rr->paired)) {
                    json_decref(jo);
                    jo = NULL;
                }
                st = cli_json_print(stdout, jo);
            } else if (kind) {
                char cell[48];
                printf("| %s | %d | %s | %.2f | %.3f | %.3f | %.2f | %.2f | %.1f%% | %s | %.1f | %.1f%% | %+.1f%% |\n",
                       base, threads, test, rr->tps, rr->p50, rr->p99, gbps, read_gbps, 100 * ratio,
                       cli_paired_cell(rr->paired, cell, sizeof cell), rr->us_layer, 100 * rr->tax_share,
                       100 * rr->overhead);
                paired_bad |= cli_paired_bad(rr->paired);
            }
            else
                printf("| %s | %d | %s | %.2f | | | | %.2f | | | %.1f | %.1f%% | |\n", base, threads, test, rr->tps,
                       read_gbps, rr->us_layer, 100 * rr->tax_share);
            fflush(stdout);
        }
    }
    if (!st && !o->json) {
        if (paired_bad) cli_paired_note(stderr);
        fprintf(stderr, "%s, %d threads%s%s:\n", base, threads, o->budget ? ", expert budget " : "", o->budget ? o->budget : "");
        cli_ledger_summary(stderr, led, o->ntg > 0);
        if (store) cli_store_summary(stderr, store, 0);
        if (o->adapt_threads && c) {
            int64_t probes, switches;
            moetax_ctx_adapt_stats(c, &probes, &switches);
            fprintf(stderr, "  adapt-threads: %lld probe steps, %lld switches, on %d of %d threads at the end\n",
                    (long long)probes, (long long)switches, moetax_ctx_threads_now(c), threads);
        }
        if (huge_share >= 0)
            fprintf(stderr, "  weights: %.0f MiB resident, %.0f%% of them in 2 MiB pages%s\n", (double)wres / 1048576,
                    100 * huge_share,
                    huge_share >= 0.9 ? ""
                    : o->no_mmap      ? " (the rest in 4 KiB pages: is transparent huge page support off?)"
                                      : " (the rest in 4 KiB pages, which stream slower: the file's pages sat in the "
                                        "page cache in small folios; --no-mmap copies the weights into 2 MiB pages)");
        const struct moetax_hparams *hp = &m->hp;
        bool prompts = false;
        for (int i = 0; i < o->npp; i++) prompts |= o->pp[i] > 1;
        if (hp->attn == MOETAX_ATTN_MLA && prompts && o->prefill == MOETAX_ATTN_PREFILL_ABSORBED &&
            hp->n_embd_head_qk_nope + hp->n_embd_head_v < 2 * hp->kv_lora_rank) /* mla.c, dec_pays */
            fprintf(stderr, "  prompts: MLA in the absorbed form (--mla-prefill auto decompresses a long prompt's keys "
                            "and values: fewer operations, other last bits)\n");
    }
    if (!st && write_outputs) st = cli_ledger_outputs(led, m, path, &o->lo, store, 0);
done:
    moetax_ctx_free(c);
    moetax_store_free(store);
    moetax_ledger_free(led);
    free(toks); free(logits); free(times); free(times_off); free(rep_on); free(rep_pair);
    moetax_membw_probe_free(probe);
    moetax_model_free(m);
    return st;
}

/* The tokens of a text file with the model's tokenizer (-f): at least 2 of them. */
moetax_status bench_text_tokens(const char *model, const char *path, int32_t **out, int64_t *n) {
    struct moetax_gguf *g;
    moetax_status st = moetax_gguf_open(model, &g);
    if (st) return st;
    struct moetax_tokenizer *tok = NULL;
    char *text = NULL;
    size_t len = 0;
    *out = NULL;
    if (!(st = moetax_tokenizer_load(g, &tok)) && !(st = cli_read_file(path, 0, &text, &len))) {
        if (!(st = cli_encode(tok, text, len, false, 0, out, n)) && *n < 2)
            st = moetax_error(MOETAX_ERR_ARG, "-f %s: fewer than 2 tokens of text", path);
    }
    if (st) { free(*out); *out = NULL; }
    free(text);
    moetax_tokenizer_free(tok);
    moetax_gguf_close(g);
    return st;
}

/* path with ".budget-B" before its extension, B the budget with '%' spelled "pct" */
static const char *budget_path(char *buf, size_t cap, const char *path, const char *budget) {
    char b[64];
    size_t k = 0;
    for (const char *c = budget; *c && k + 4 < sizeof b; c++) {
        if (*c == '%') k += (size_t)snprintf(b + k, sizeof b - k, "pct");
        else if (isalnum((unsigned char)*c) || *c == '.') b[k++] = *c;
    }
    b[k] = 0;
    const char *slash = strrchr(path, '/'), *dot = strrchr(path, '.');
    if (!dot || (slash && dot < slash)) dot = path + strlen(path);
    snprintf(buf, cap, "%.*s.budget-%s%s", (int)(dot - path), path, b, dot);
    return buf;
}

/* Everything that can be checked before the tests run: the budgets, the output paths
 * (one per budget too), the twin, and test lengths beyond the model's trained context. */
static moetax_status bench_check_upfront(const char *model, const char *twin, const struct opts *o) {
    moetax_status st = cli_store_check(&o->so, true);
    if (!st && o->so.budgets && !o->ntg) /* -n 0 (its zeros are dropped): the budgets' runs decode only */
        st = moetax_error(MOETAX_ERR_ARG, "--expert-budget measures decoding: give -n of 1 or more");
    if (!st && o->json && o->lo.metrics)
        st = moetax_error(MOETAX_ERR_ARG, "--json and --metrics both print on stdout: use one");
    const char *outs[2] = {o->lo.json_path, o->lo.trace_path}, *ins[2] = {model, twin};
    if (!st) st = cli_check_io(outs, 2, ins, 2);
    if (!st && o->so.budgets && (o->lo.json_path || o->lo.trace_path)) {
        char lpath[1024], tpath[1024], *list = strdup(o->so.budgets); /* the list whole, however long */
        if (!list) return moetax_error(MOETAX_ERR_NOMEM, "out of memory");
        size_t n_items = 1;
        for (const char *c = list; *c; c++) n_items += *c == ',';
        char (*seen)[64] = calloc(n_items, sizeof *seen); /* the budgets' file-name parts so far: two equal
                                                           * ones would write one file */
        size_t n_seen = 0;
        if (!seen) st = moetax_error(MOETAX_ERR_NOMEM, "out of memory");
        for (char *save = NULL, *tok = strtok_r(list, ",", &save); tok && !st; tok = strtok_r(NULL, ",", &save)) {
            const char *bo[2] = {o->lo.json_path ? budget_path(lpath, sizeof lpath, o->lo.json_path, tok) : NULL,
                                 o->lo.trace_path ? budget_path(tpath, sizeof tpath, o->lo.trace_path, tok) : NULL};
            char part[64];
            budget_path(part, sizeof part, "", tok);
            for (size_t i = 0; i < n_seen && !st; i++)
                if (!strcmp(seen[i], part))
                    st = moetax_error(MOETAX_ERR_ARG, "--expert-budget lists '%s' twice: each budget's run writes its "
                                      "own --ledger / --trace file (%s)", tok, bo[0] ? bo[0] : bo[1]);
            if (!st && n_seen < n_items) snprintf(seen[n_seen++], sizeof seen[0], "%s", part);
            if (!st) st = cli_check_io(bo, 2, ins, 2);
        }
        free(seen);
        free(list);
    }
    for (int k = 0; k < 2 && !st; k++) {
        const char *path = k ? twin : model;
        struct moetax_gguf *g;
        if (!path) continue;
        if ((st = moetax_gguf_open(path, &g))) {
            char msg[1024];
            snprintf(msg, sizeof msg, "%s", moetax_last_error());
            if (k) st = moetax_error(st, "--twin: %s", msg);
            break;
        }
        char arch[64] = "", key[96];
        uint32_t n_ctx = 0;
        moetax_gguf_get_str(g, "general.architecture", arch, sizeof arch);
        snprintf(key, sizeof key, "%s.context_length", arch);
        int64_t longest = 0;
        for (int i = 0; i < o->npp; i++) longest = o->pp[i] > longest ? o->pp[i] : longest;
        for (int i = 0; i < o->ntg; i++) longest = o->tg[i] + 1 > longest ? o->tg[i] + 1 : longest;
        longest += o->depth;
        if (!k && !moetax_gguf_get_u32(g, key, &n_ctx) && n_ctx > 0 && longest > (int64_t)n_ctx)
            fprintf(stderr, "moetax bench: warning: a test of %lld positions is longer than the %u the model was "
                    "trained on: the speed is measured (on a KV cache that large), the outputs mean nothing\n",
                    (long long)longest, n_ctx);
        moetax_gguf_close(g);
    }
    return st;
}

int bench_model_main(int argc, char **argv) {
    const char *model = NULL, *twin = NULL;
    struct opts o = {.pp = {64}, .tg = {32}, .npp = 1, .ntg = 1, .reps = 5, .mem = true};
    int64_t th[16] = {0};
    int nth = 0;
    struct bench_batch_opts bo = {.overflow = MOETAX_OVERFLOW_DROP};
    bool overflow_given = false;
    const char *text_path = NULL;
    struct cli_config cfg; /* --config: defaults, the options below win */
    if (cli_config_scan(argc, argv, &cfg)) return cli_usage_error("bench", "%s", moetax_last_error());
    if (cfg.loaded) {
        if (cfg.threads) th[0] = cfg.threads, nth = 1;
        o.experts_used = o.so.n_expert_used = o.lo.n_expert_used = cfg.experts_used;
        o.no_mmap = cfg.no_mmap, o.kv_type = cfg.cache_type, o.prefill = cfg.mla_prefill;
        bo.capacity_factor = (float)cfg.capacity_factor, bo.overflow = cfg.overflow;
        cli_config_store(&cfg, &o.so);
    }
    o.expert_type = bo.expert_type = cfg.expert_type; /* --expert-type or the file's */
    for (int i = 1; i < argc; i++) {
        const char *v = NULL;
        bool err = false;
        if (cli_flag(argv, i, "-h", "--help")) { usage(stdout); return 0; }
        else if (cli_config_opt(argc, argv, &i, &err)) { if (err) return 2; }
        else if (cli_opt(argc, argv, &i, "-m", "--model", &model, &err)) { if (err) return 2; }
        else if (cli_opt(argc, argv, &i, NULL, "--twin", &twin, &err)) { if (err) return 2; }
        else if (cli_opt(argc, argv, &i, "-p", "--n-prompt", &v, &err)) {
            if (err || (o.npp = cli_parse_int_list(v, o.pp, 16)) < 0) return cli_usage_error("bench", "-p: expected a list like 64,512");
        } else if (cli_opt(argc, argv, &i, "-n", "--n-gen", &v, &err)) {
            if (err || (o.ntg = cli_parse_int_list(v, o.tg, 16)) < 0) return cli_usage_error("bench", "-n: expected a list like 32,128");
        } else if (cli_opt(argc, argv, &i, "-t", "--threads", &v, &err)) {
            if (err || (nth = cli_parse_threads("bench", v, th, 16)) < 0) return 2;
        } else if (cli_opt(argc, argv, &i, "-d", "--depth", &v, &err)) {
            if (err || !cli_parse_i64(v, &o.depth) || o.depth < 0 || o.depth > (1 << 24))
                return cli_usage_error("bench", "-d: the tokens before each test, 0..16777216");
        } else if (cli_opt(argc, argv, &i, "-r", "--repetitions", &v, &err)) {
            if (err || !cli_parse_i64(v, &o.reps) || o.reps < 1 || o.reps > 1000) return cli_usage_error("bench", "-r: 1..1000");
        } else if (!strcmp(argv[i], "--json")) o.json = true;
        else if (!strcmp(argv[i], "--no-mem")) o.mem = false;
        else if (!strcmp(argv[i], "--no-mmap")) o.no_mmap = true;
        else if (cli_opt(argc, argv, &i, "-ub", "--ubatch", &v, &err)) {
            if (err || !cli_parse_i64(v, &o.ubatch) || o.ubatch < 1 || o.ubatch > 4096)
                return cli_usage_error("bench", "--ubatch needs a count in 1..4096");
        }
        else if (!strcmp(argv[i], "--adapt-threads")) o.adapt_threads = true;
        else if (cli_cache_type_opt("bench", argc, argv, &i, &o.kv_type, &err)) { if (err) return 2; }
        else if (cli_mla_prefill_opt("bench", argc, argv, &i, &o.prefill, &err)) { if (err) return 2; }
        else if (cli_opt(argc, argv, &i, NULL, "--experts-used", &v, &err)) {
            if (err || !cli_parse_experts_used(v, &o.experts_used))
                return cli_usage_error("bench", "--experts-used needs a count in 1..256");
            o.so.n_expert_used = o.lo.n_expert_used = o.experts_used;
        }
        else if (cli_opt(argc, argv, &i, "-f", "--file", &text_path, &err)) { if (err) return 2; }
        else if (cli_opt(argc, argv, &i, NULL, "--batch", &v, &err)) {
            if (err || (bo.n_batch = cli_parse_int_list(v, bo.batch, 16)) <= 0)
                return cli_usage_error("bench", "--batch: expected a list like 1,2,4,8,16");
            for (int j = 0; j < bo.n_batch; j++)
                if (bo.batch[j] < 1 || bo.batch[j] > MOETAX_KV_SEQ_MAX_DEFAULT * 16)
                    return cli_usage_error("bench", "--batch: %lld sequences: expected 1..%d", (long long)bo.batch[j],
                                           MOETAX_KV_SEQ_MAX_DEFAULT * 16);
        } else if (cli_opt(argc, argv, &i, NULL, "--capacity-factor", &v, &err)) {
            char *end = NULL;
            double cf = err ? -1 : !strcmp(v, "inf") ? INFINITY : strtod(v, &end);
            if (cf == INFINITY) end = (char *)"";
            if (err || !end || *end || !(cf > 0) || !cli_capacity_factor_ok(&cf))
                return cli_usage_error("bench", "--capacity-factor: expected a number >= 1e-45 (inf: off)");
            bo.capacity_factor = (float)cf;
        } else if (cli_opt(argc, argv, &i, NULL, "--overflow", &v, &err)) {
            if (err || (strcmp(v, "drop") && strcmp(v, "reroute")))
                return cli_usage_error("bench", "--overflow: expected drop or reroute");
            overflow_given = true;
            bo.overflow = strcmp(v, "drop") ? MOETAX_OVERFLOW_REROUTE : MOETAX_OVERFLOW_DROP;
        }
        else if (cli_ledger_opt(argc, argv, &i, &o.lo, &err)) { if (err) return 2; }
        else if (cli_store_opt(argc, argv, &i, &o.so, &err)) { if (err) return 2; }
        else return cli_usage_error("bench", "unknown option '%s'", argv[i]);
    }
    if (overflow_given && bo.capacity_factor == 0) /* the overflow of a cap that is not there */
        return cli_usage_error("bench", "--overflow goes with --capacity-factor C (without it nothing overflows)");
    int32_t *text_ids = NULL; /* -f: tokenized once, with the model's tokenizer, after every check */
    if (text_path && !model) return cli_usage_error("bench", "no model given (-m FILE)");
    /* each within -d's range, --batch's too: the tests' tokens (and -d before them) are allocated and
     * counted in int32 */
    for (int i = 0; i < o.npp; i++)
        if (o.pp[i] < 0 || o.pp[i] > (1 << 24)) return cli_usage_error("bench", "-p values must be within 0..16777216");
    for (int i = 0; i < o.ntg; i++)
        if (o.tg[i] < 0 || o.tg[i] > (1 << 24)) return cli_usage_error("bench", "-n values must be within 0..16777216");
    if (bo.n_batch && o.depth) return cli_usage_error("bench", "-d goes with the ppN/tgN tests, not --batch");
    /* the store's figures (hit rate, MiB read per token) would count the depth's reads too */
    if (o.depth && o.so.budgets) return cli_usage_error("bench", "-d does not combine with --expert-budget yet");
    if (bo.n_batch) { /* B sequences together: its own table */
        if (!model) return cli_usage_error("bench", "no model given (-m FILE)");
        if (twin || o.so.budgets || o.lo.metrics)
            return cli_usage_error("bench", "--batch does not combine with --twin, --expert-budget or --metrics yet");
        {
            const char *outs[2] = {o.lo.json_path, o.lo.trace_path}, *ins[1] = {model};
            moetax_status ost = cli_check_io(outs, 2, ins, 1);
            if (ost) return cli_usage_error("bench", "%s", moetax_last_error());
        }
        if (text_path) {
            moetax_status tst = bench_text_tokens(model, text_path, &text_ids, &bo.n_text);
            if (tst) return cli_fail("bench", tst);
            bo.text = text_ids;
        }
        bo.lo = &o.lo;
        bo.n_prompt = o.npp > 0 ? o.pp[0] : 0;
        bo.n_gen = o.ntg > 0 && o.tg[0] > 0 ? o.tg[0] : 32;
        bo.reps = o.reps;
        bo.json = o.json;
        bo.no_mmap = o.no_mmap;
        bo.kv_type = o.kv_type;
        bo.experts_used = o.experts_used;
        moetax_status st = MOETAX_OK;
        for (int ti = 0; ti < (nth ? nth : 1) && !st; ti++) {
            struct moetax_pool *pool;
            struct moetax_pool_params pp = {.n_threads = nth ? (int)th[ti] : 0};
            if ((st = moetax_pool_init(&pp, &pool))) break;
            double read_gbps = 0;
            if (o.mem) st = moetax_membw_read(pool, (size_t)512 << 20, 5, &read_gbps);
            if (!st) st = bench_batch_run(model, pool, o.mem ? read_gbps : 0, &bo);
            moetax_pool_free(pool);
        }
        free(text_ids);
        return st ? cli_fail("bench", st) : 0;
    }
    if (bo.capacity_factor > 0 && !cfg.loaded) return cli_usage_error("bench", "--capacity-factor applies to --batch runs");
    if (!model) return cli_usage_error("bench", "no model given (-m FILE); for the machine alone see 'moetax bench mem'");
    /* a 0 in a list means "none of this kind" */
    int k = 0;
    for (int i = 0; i < o.npp; i++) if (o.pp[i]) o.pp[k++] = o.pp[i];
    o.npp = k;
    k = 0;
    for (int i = 0; i < o.ntg; i++) if (o.tg[i]) o.tg[k++] = o.tg[i];
    o.ntg = k;
    if (nth == 0) { th[0] = 0; nth = 1; }
    /* a --config's budget (a tuned decode setting) does not stop a prefill-only run: its store runs,
     * which decode only, are left out; one given here is checked (bench_check_upfront) */
    if (cfg.loaded && o.so.budgets == cfg.expert_budget && !o.ntg) o.so.budgets = NULL;
    moetax_status st = bench_check_upfront(model, twin, &o);
    if (st) return cli_fail("bench", st);
    if (text_path) {
        if ((st = bench_text_tokens(model, text_path, &text_ids, &o.n_text))) return cli_fail("bench", st);
        o.text = text_ids;
    }
    if (!o.json)
        printf("kernels: %s%s%s (MOETAX_KERNELS=ref|avx2|avx512 chooses); a model larger than the %.0f MiB last-level "
               "cache decodes with the streaming prefetch\n",
               moetax_kernels_get()->name, *moetax_kernels_extras(moetax_kernels_get()) ? " with " : "",
               moetax_kernels_extras(moetax_kernels_get()), (double)moetax_cpu_llc_bytes() / (1 << 20));
    if (!o.json)
        printf("| model | threads | test | t/s | TPOT p50 ms | TPOT p99 ms | GB/s | read GB/s | roofline | paired | us/layer | tax | ledger cost |\n"
               "|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
    for (int ti = 0; ti < nth && !st; ti++) {
        struct moetax_pool *pool;
        struct moetax_pool_params pp = {.n_threads = (int)th[ti]};
        if ((st = moetax_pool_init(&pp, &pool))) break;
        double read_gbps = 0;
        if (o.mem) st = moetax_membw_read(pool, (size_t)512 << 20, 5, &read_gbps);
        struct result moe[2][16] = {{{0}}}, dense[2][16] = {{{0}}};
        if (!st) st = bench_model(model, pool, read_gbps, &o, ti == nth - 1, moe);
        /* the same tests with routed experts behind the expert store, one run per budget */
        if (!st && o.so.budgets) {
            double io_ref = 0;
            char *list = strdup(o.so.budgets); /* the list whole, however long (a cut dropped budgets) */
            if (!list) st = moetax_error(MOETAX_ERR_NOMEM, "out of memory");
            int nb = 0;
            for (char *save = NULL, *tok = list ? strtok_r(list, ",", &save) : NULL; tok && !st;
                 tok = strtok_r(NULL, ",", &save)) {
                struct opts ob = o;
                ob.budget = tok;
                ob.npp = 0; /* decode only: the store's figures are per decoded token */
                struct result br[2][16] = {{{0}}};
                /* --ledger / --trace: each budget's run to its own file, FILE.budget-50pct.json etc. */
                char lpath[1024], tpath[1024];
                ob.lo.json_path = o.lo.json_path ? budget_path(lpath, sizeof lpath, o.lo.json_path, tok) : NULL;
                ob.lo.trace_path = o.lo.trace_path ? budget_path(tpath, sizeof tpath, o.lo.trace_path, tok) : NULL;
                ob.lo.metrics = false; /* printed once, for the mapped run */
                st = bench_model(model, pool, read_gbps, &ob, ti == nth - 1 && (ob.lo.json_path || ob.lo.trace_path), br);
                if (st) break;
                /* the uring engine has all spans of an expert in flight at once (gate, up, down) */
                const enum moetax_store_io_engine eng =
                    o.so.io_engine ? o.so.io_engine : moetax_store_io_engine_default();
                const int ref_qd = (o.so.io_threads ? o.so.io_threads : 4) * (eng == MOETAX_STORE_IO_URING ? 3 : 1);
                {
                    /* the device's random read bandwidth for the store's request size (one span of an
                     * expert) and queue depth (the reads its I/O threads have in flight), measured right
                     * after each budget's run: a virtual disk's bandwidth drifts, so each budget is
                     * judged against its own reading */
                    io_ref = bench_io_measure(model, br[1][0].req_bytes ? br[1][0].req_bytes : (1u << 18), ref_qd,
                                              true, o.so.buffered, 2.0);
                }
                for (int i = 0; !st && i < o.ntg; i++) {
                    const struct result *b = &br[1][i];
                    double t_res = 1e6 / moe[1][i].tps, t_b = 1e6 / b->tps;
                    double t_io = io_ref > 0 ? b->read_mib_per_token * (1 << 20) / (io_ref * 1e9) * 1e6 : 0;
                    double ideal = t_res > t_io ? t_res : t_io;
                    if (o.json) {
                        char test[32];
                        snprintf(test, sizeof test, "store_tg%lld", (long long)o.tg[i]);
                        st = cli_json_print(stdout, cli_jobj("soioooooooooooo", "test", test,
                            "expert_budget", cli_jstr(tok), "threads", moetax_pool_n_threads(pool), "us_per_token",
                            cli_jnum(t_b), "mapped_us_per_token", cli_jnum(t_res), "io_ref_gbps", cli_jnum(io_ref),
                            "store_read_gbps", cli_jnum(b->store_gbps), "io_ratio",
                            cli_jnum(io_ref > 0 ? b->store_gbps / io_ref : 0), "ideal_us_per_token", cli_jnum(ideal),
                            "vs_ideal", cli_jnum(t_b / ideal), "hit_rate", cli_jnum(b->hit_rate), "belady_hit_rate",
                            cli_jnum(b->belady), "use_hit_rate", cli_jnum(b->use_hit), "belady_use_hit_rate",
                            cli_jnum(b->belady_use), "static_use_hit_rate", cli_jnum(b->static_use)));
                    }
                    else
                        printf("|   | %.0f us/token (mapped %.0f); reads at %.2f GB/s = %.0f%% of the device's %.2f GB/s "
                               "(random %.0f KiB, qd %d); ideal max(mapped, read time) %.0f us: %.2fx of ideal; "
                               "hit rate %.0f%% = %.0f%% of Belady; per expert use %.0f%% = %.0f%% of Belady's %.0f%%, %.0f%% of the best static set's %.0f%% |\n",
                               t_b, t_res, b->store_gbps, io_ref > 0 ? 100 * b->store_gbps / io_ref : 0, io_ref,
                               (double)(b->req_bytes ? b->req_bytes : (1u << 18)) / 1024, ref_qd,
                               ideal, t_b / ideal, 100 * b->hit_rate, b->belady > 0 ? 100 * b->hit_rate / b->belady : 0,
                               100 * b->use_hit, b->belady_use > 0 ? 100 * b->use_hit / b->belady_use : 0,
                               100 * b->belady_use, b->static_use > 0 ? 100 * b->use_hit / b->static_use : 0,
                               100 * b->static_use);
                }
                nb++;
            }
            free(list);
        }
        if (!st && twin) {
            struct opts ot = o;
            ot.lo = (struct cli_ledger_opts){0};
            ot.experts_used = 0; /* the dense twin has no routed experts (its FFN matches the file's k) */
            st = bench_model(twin, pool, read_gbps, &ot, false, dense);
            for (int i = 0; !st && i < o.ntg; i++) {
                const struct result *a = &moe[1][i], *b = &dense[1][i];
                double t_moe = 1e6 / a->tps, t_dense = 1e6 / b->tps, diff = t_moe - t_dense;
                /* decompose MoE - dense with both ledgers: the tax phases, the FFN arithmetic
                 * (routed + shared experts against the dense FFN), and everything else */
                double dtax = 0, dffn, dother = 0;
                for (int p = 0; p < MOETAX_PHASE_N_TAX; p++) dtax += a->phase_us[p] - b->phase_us[p];
                dffn = a->phase_us[MOETAX_PHASE_EXPERT] + a->phase_us[MOETAX_PHASE_SHARED] + a->phase_us[MOETAX_PHASE_DENSE] -
                       (b->phase_us[MOETAX_PHASE_EXPERT] + b->phase_us[MOETAX_PHASE_SHARED] + b->phase_us[MOETAX_PHASE_DENSE]);
                for (int p = MOETAX_PHASE_N_TAX; p < MOETAX_PHASE_COUNT; p++)
                    if (p != MOETAX_PHASE_EXPERT && p != MOETAX_PHASE_SHARED && p != MOETAX_PHASE_DENSE)
                        dother += a->phase_us[p] - b->phase_us[p];
                double ledger_diff = dtax + dffn + dother;
                /* stated margin: the two measures agree if the ledger's account of the difference is
                 * within 25% of the measured difference (or 5% of the MoE step, for small differences) */
                double margin = fmax(0.25 * fabs(diff), 0.05 * t_moe);
                bool agree = fabs(ledger_diff - diff) <= margin;
                if (o.json) {
                    char test[32];
                    snprintf(test, sizeof test, "twin_tg%lld", (long long)o.tg[i]);
                    st = cli_json_print(stdout, cli_jobj("siooooooooob", "test", test, "threads",
                        moetax_pool_n_threads(pool), "moe_us_per_token", cli_jnum(t_moe), "dense_us_per_token",
                        cli_jnum(t_dense), "moe_minus_dense_us", cli_jnum(diff), "ledger_tax_us", cli_jnum(a->tax_us),
                        "dense_tax_us", cli_jnum(b->tax_us), "delta_tax_us", cli_jnum(dtax), "delta_ffn_us",
                        cli_jnum(dffn), "delta_other_us", cli_jnum(dother), "ledger_explains_us",
                        cli_jnum(ledger_diff), "agree", agree));
                }
                else {
                    printf("\ndense twin, tg%lld, %d threads: MoE %.1f us/token, dense %.1f us/token: MoE - dense = %.1f us\n",
                           (long long)o.tg[i], moetax_pool_n_threads(pool), t_moe, t_dense, diff);
                    printf("  the ledgers: tax %+.1f us (MoE %.1f, dense %.1f), FFN arithmetic %+.1f us (experts vs dense FFN),"
                           " other %+.1f us: %.1f us explained\n", dtax, a->tax_us, b->tax_us, dffn, dother, ledger_diff);
                    printf("  %s (margin: 25%% of the difference or 5%% of the MoE step)%s\n",
                           agree ? "the twin and the ledgers agree" : "the twin and the ledgers DISAGREE",
                           dffn > 0.25 * fabs(diff) ? "; a large part of MoE - dense is expert arithmetic on many small"
                                                     " matrices, which the ledger books as work, not tax" : "");
                }
            }
        }
        moetax_pool_free(pool);
    }
    free(text_ids);
    if (st) return cli_fail("bench", st);
    return 0;
}
