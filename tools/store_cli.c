#include "store_cli.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cli.h"
#include "moetax/predict.h"
#include "moetax/profile.h"
#ifdef MOETAX_WITH_MPI
#include "dist/dist.h"
#endif

static bool store_opt(int argc, char **argv, int *i, struct cli_store_opts *o, bool *err) {
    const char *v = NULL;
    if (cli_opt(argc, argv, i, NULL, "--expert-budget", &o->budgets, err)) return true;
    if (cli_opt(argc, argv, i, NULL, "--policy", &v, err)) {
        o->policy_set = true;
        if (!*err && !moetax_store_policy_parse(v, &o->policy)) {
            fprintf(stderr, "moetax: --policy must be lru, lfu, lfru or next-use, not '%s'\n", v);
            *err = true;
        }
        return true;
    }
    if (cli_opt(argc, argv, i, NULL, "--io-threads", &v, err)) {
        int64_t n;
        if (!*err && (!cli_parse_i64(v, &n) || n < 1 || n > 64)) {
            fprintf(stderr, "moetax: --io-threads must be in 1..64\n");
            *err = true;
        }
        if (!*err) o->io_threads = (int)n;
        return true;
    }
    if (cli_opt(argc, argv, i, NULL, "--io-engine", &v, err)) {
        if (!*err && !moetax_store_io_engine_parse(v, &o->io_engine)) {
            fprintf(stderr, "moetax: --io-engine must be pread or uring, not '%s'\n", v);
            *err = true;
        }
        return true;
    }
    if (cli_opt(argc, argv, i, NULL, "--read-ahead", &v, err)) {
        int64_t n;
        if (!*err && !strcmp(v, "off")) o->read_ahead = MOETAX_STORE_READ_AHEAD_OFF;
        else if (!*err && cli_parse_i64(v, &n) && n >= 1 && n <= MOETAX_STORE_READ_AHEAD_MAX) o->read_ahead = (int)n;
        else if (!*err) {
            fprintf(stderr, "moetax: --read-ahead must be off or 1..%d, not '%s'\n", MOETAX_STORE_READ_AHEAD_MAX, v);
            *err = true;
        }
        return true;
    }
    if (cli_opt(argc, argv, i, NULL, "--read-ahead-min", &v, err)) {
        double x;
        if (!*err && (!cli_parse_f64(v, &x) || !(x > 0 && x <= 1))) {
            fprintf(stderr, "moetax: --read-ahead-min must be a precision above 0 and at most 1, not '%s'\n", v);
            *err = true;
        }
        if (!*err) o->read_ahead_min = x;
        return true;
    }
    if (cli_opt(argc, argv, i, NULL, "--warm", &o->warm, err)) return true;
    if (cli_opt(argc, argv, i, NULL, "--predictor", &o->predictor, err)) return true;
    if (!strcmp(argv[*i], "--no-prefetch")) { o->no_prefetch = true; return true; }
    if (!strcmp(argv[*i], "--buffered-io")) { o->buffered = true; return true; }
    return false;
}

bool cli_store_opt(int argc, char **argv, int *i, struct cli_store_opts *o, bool *err) {
    const char *a = argv[*i];
    if (!store_opt(argc, argv, i, o, err)) return false;
    if (!o->given && strncmp(a, "--expert-budget", strlen("--expert-budget")) != 0) o->given = a;
    return true;
}

moetax_status cli_store_check(const struct cli_store_opts *o, bool list) {
    moetax_status st = cli_store_check_budgets(o->budgets, list);
    if (!st && !o->budgets && o->given)
        st = moetax_error(MOETAX_ERR_ARG, "%.*s needs --expert-budget: it is an option of the expert store, which "
                          "holds the routed experts only with a budget", (int)strcspn(o->given, "="), o->given);
    return st;
}

enum moetax_store_policy cli_store_policy(const struct cli_store_opts *o) {
    return o->policy_set ? o->policy : MOETAX_STORE_NEXT_USE;
}

static const char *store_help_fmt(void) {
    return "  --expert-budget B    keep routed experts in an expert store of B bytes of RAM (e.g. 2G, 512M, or\n"
           "                       25%% of the slots every expert needs: 100%% holds them all); the rest is read\n"
           "                       from the file on demand (O_DIRECT) and prefetched from the next layer's\n"
           "                       router prediction\n"
           "  --policy P           eviction: lru, lfu, lfru (frequency-weighted LRU) or next-use (expected\n"
           "                       next use from the layer cycle, the frequency and the prefetches; the default)\n"
           "  --no-prefetch        read each expert only when a work item needs it (no early reads of the\n"
           "                       layer's experts, no prediction for the next layer)\n"
           "  --read-ahead N|off   decoding, read the predicted experts of up to N layers ahead (1 or 2; default\n"
           "                       %s) in the disk's idle time: those whose kind of guess (distance, score\n"
           "                       margin) has been right at least --read-ahead-min of the time on this run,\n"
           "                       most precise first, while the bytes queued stay below what the disk reads\n"
           "                       in one layer's compute time (both measured); off: only the next layer's,\n"
           "                       dropped while the I/O threads are busy or the disk was busy most of a token\n"
           "  --read-ahead-min P   that precision (default %.2f)\n"
           "  --buffered-io        read through the page cache instead of O_DIRECT\n"
           "  --io-threads N       I/O workers, i.e. experts read at once (default 4)\n"
           "  --io-engine E        how they read: pread (one pread per span) or uring (io_uring: all spans of an\n"
           "                       expert submitted at once; pread when io_uring is unavailable); default: %s\n"
           "  --warm PROFILE       a warm start from a routing profile (moetax profile): before the first\n"
           "                       token the store is filled with the experts the profile uses most, and\n"
           "                       the eviction policy takes its frequencies as a prior (16 tokens' weight)\n"
           "  --predictor FILE     prefetch from a learned predictor (moetax profile --fit-predictor) instead of\n"
           "                       the next layer's router on the current residual; the store's summary scores both\n";
}

const char *cli_store_help(void) {
    static char buf[4096];
    char ra[16];
    if (MOETAX_STORE_READ_AHEAD_DEFAULT > 0) snprintf(ra, sizeof ra, "%d", (int)MOETAX_STORE_READ_AHEAD_DEFAULT);
    else snprintf(ra, sizeof ra, "off");
    snprintf(buf, sizeof buf, store_help_fmt(), ra, MOETAX_STORE_READ_AHEAD_MIN_PRECISION,
             moetax_store_io_engine_name(moetax_store_io_engine_default()));
    return buf;
}

uint64_t cli_store_expert_bytes(const struct moetax_model *m) {
    uint64_t b = 0;
    for (int il = 0; il < m->hp.n_layer; il++) {
        const struct moetax_layer *l = &m->layers[il];
        if (!l->is_moe) continue;
        int32_t own = 0; /* under mpirun: this rank's experts (a budget in % is of those) */
        for (int e = 0; e < m->hp.n_expert; e++) own += moetax_model_expert_owned(m, il, e);
        b += ((uint64_t)l->gate_exps.mat_bytes * (l->fused_gate_up ? 1 : 2) + l->down_exps.mat_bytes) * (uint64_t)own;
    }
    return b;
}

#define CLI_BUDGET_MAX_PCT 1000.0

static moetax_status check_budget(const char *s) {
    size_t n = strlen(s);
    if (n == 0) return moetax_error(MOETAX_ERR_ARG, "--expert-budget: an empty budget");
    if (s[n - 1] == '%') {
        char buf[32];
        double pct;
        if (n >= sizeof buf || (memcpy(buf, s, n - 1), buf[n - 1] = 0, !cli_parse_f64(buf, &pct)))
            return moetax_error(MOETAX_ERR_ARG, "--expert-budget: '%s' is not a percentage (e.g. 25%%)", s);
        if (pct <= 0 || pct > CLI_BUDGET_MAX_PCT)
            return moetax_error(MOETAX_ERR_ARG,
                                "--expert-budget: %s is out of range: a share of the store that holds every routed "
                                "expert, above 0%% and at most %.0f%% (100%% holds every expert)", s, CLI_BUDGET_MAX_PCT);
        return MOETAX_OK;
    }
    uint64_t b;
    if (!cli_parse_size(s, &b))
        return moetax_error(MOETAX_ERR_ARG, "--expert-budget: '%s' is not a size (2G, 512M) or a percentage (25%%)", s);
    if (b == 0) return moetax_error(MOETAX_ERR_ARG, "--expert-budget: %s is zero bytes", s);
    return MOETAX_OK;
}

moetax_status cli_store_check_budgets(const char *budgets, bool list) {
    if (!budgets) return MOETAX_OK;
    if (!list && strchr(budgets, ','))
        return moetax_error(MOETAX_ERR_ARG, "--expert-budget: one budget, not a list ('%s'; bench takes a list)", budgets);
    char item[64];
    for (const char *p = budgets;;) {
        size_t len = strcspn(p, ",");
        if (len >= sizeof item) return moetax_error(MOETAX_ERR_ARG, "--expert-budget: '%.*s' is too long", (int)len, p);
        memcpy(item, p, len);
        item[len] = 0;
        moetax_status st = check_budget(item);
        if (st) return st;
        if (!p[len]) return MOETAX_OK;
        p += len + 1;
    }
}

bool cli_store_parse_budget(const char *s, uint64_t all, uint64_t *out) {
    size_t n = strlen(s);
    if (n > 1 && s[n - 1] == '%') {
        char buf[32];
        double pct;
        if (n >= sizeof buf) return false;
        memcpy(buf, s, n - 1);
        buf[n - 1] = 0;
        if (!cli_parse_f64(buf, &pct) || pct <= 0 || pct > CLI_BUDGET_MAX_PCT) return false;
        *out = (uint64_t)((double)all * pct / 100.0);
        return true;
    }
    return cli_parse_size(s, out) && *out > 0;
}

moetax_status cli_store_open(const struct moetax_model *m, const struct cli_store_opts *o, uint64_t budget,
                             int *n_ubatch, struct moetax_store **out) {
    struct moetax_store_params p = {.budget_bytes = budget, .policy = cli_store_policy(o), .buffered_io = o->buffered,
                                    .n_io_threads = o->io_threads, .io_engine = o->io_engine,
                                    .read_log_cap = o->read_log_cap, .read_ahead = o->read_ahead,
                                    .read_ahead_min_precision = o->read_ahead_min};
    moetax_status st = moetax_model_store_open(m, &p, *n_ubatch, o->n_expert_used, out, n_ubatch);
#ifdef MOETAX_WITH_MPI
    /* each rank fits its micro-batch to its own store: every rank steps with the smallest */
    if (moetax_dist_world()) st = moetax_dist_agree_min(st, n_ubatch);
#endif
    if (!st && o->predictor && (st = cli_store_predictor(m, *out, o->predictor))) {
        moetax_store_free(*out);
        *out = NULL;
    }
    if (!st && o->warm && (st = cli_store_warm(m, *out, o->warm))) {
        moetax_store_free(*out);
        *out = NULL;
    }
    return st;
}

struct ranked {
    double share;
    int32_t q; /* MoE layer x E + expert */
};

static int most_used_first(const void *a, const void *b) { /* ties: the profile's order */
    const struct ranked *x = a, *y = b;
    return x->share != y->share ? (x->share < y->share) - (x->share > y->share) : (x->q > y->q) - (x->q < y->q);
}

/* The share of a layer's tokens that use an expert, from a profile; the experts ranked by it,
 * all layers together, fill the store's slots (most used first); the shares are the prior. */
moetax_status cli_store_warm(const struct moetax_model *m, struct moetax_store *s, const char *path) {
    struct moetax_profile *p;
    moetax_status st = moetax_profile_load(path, &p);
    if (st) return st;
    const int E = p->n_expert;
    if (p->n_layer != m->hp.n_layer || E != m->hp.n_expert || p->tokens < 1) {
        st = moetax_error(MOETAX_ERR_ARG, "--warm %s: a profile of %d layers x %d experts (%lld tokens), the model has "
                          "%d x %d", path, p->n_layer, E, (long long)p->tokens, m->hp.n_layer, m->hp.n_expert);
        moetax_profile_free(p);
        return st;
    }
    for (int mi = 0; mi < p->n_moe; mi++)
        if (!m->layers[p->moe_layer[mi]].is_moe) {
            st = moetax_error(MOETAX_ERR_ARG, "--warm %s: layers[%d] is layer %d, not a MoE layer of the model", path, mi,
                              p->moe_layer[mi]);
            moetax_profile_free(p);
            return st;
        }
    const int n = p->n_moe * E;
    double *share = malloc(sizeof(double) * (size_t)n);
    struct ranked *order = malloc(sizeof *order * (size_t)n);
    int32_t *layers = malloc(sizeof(int32_t) * (size_t)n), *experts = malloc(sizeof(int32_t) * (size_t)n);
    if (!share || !order || !layers || !experts) st = moetax_error(MOETAX_ERR_NOMEM, "out of memory");
    for (int q = 0; !st && q < n; q++) {
        share[q] = (double)p->freq[q] / (double)p->tokens;
        order[q] = (struct ranked){share[q], q};
    }
    if (!st) qsort(order, (size_t)n, sizeof *order, most_used_first);
    int fill = 0; /* the most used of this process's own experts (all of them without mpirun) */
    for (int q = 0; !st && q < n && fill < moetax_store_n_slots(s); q++)
        if (moetax_model_expert_owned(m, p->moe_layer[order[q].q / E], order[q].q % E)) {
            layers[fill] = p->moe_layer[order[q].q / E];
            experts[fill++] = order[q].q % E;
        }
    for (int mi = 0; !st && mi < p->n_moe; mi++) {
        const double w = p->tokens < 16 ? (double)p->tokens : 16.0; /* a light prior: live counts soon outweigh it */
        moetax_store_set_prior(s, p->moe_layer[mi], share + (size_t)mi * E, w);
    }
    if (!st) st = moetax_store_warm(s, layers, experts, fill);
    free(share);
    free(order);
    free(layers);
    free(experts);
    moetax_profile_free(p);
    return st;
}

moetax_status cli_store_predictor(const struct moetax_model *m, struct moetax_store *s, const char *path) {
    struct moetax_predictor *p;
    bool is_moe[4096] = {false};
    for (int l = 0; l < m->hp.n_layer && l < 4096; l++) is_moe[l] = m->layers[l].is_moe;
    if (m->hp.n_layer > 4096) return moetax_error(MOETAX_ERR_ARG, "--predictor: more than 4096 layers");
    const struct moetax_predict_model pm = {m->hp.n_layer, m->hp.n_embd, m->hp.n_expert, is_moe};
    moetax_status st = moetax_predictor_load(path, &pm, &p);
    if (st) return st;
    moetax_store_set_predictor(s, p, true);
    return MOETAX_OK;
}

static void score_line(FILE *f, const char *what, struct moetax_predict_score r, struct moetax_predict_score l) {
    fprintf(f, "%s: router guess P %.1f%% R %.1f%%", what, r.predicted ? 100.0 * (double)r.hits / (double)r.predicted : 0,
            r.actual ? 100.0 * (double)r.hits / (double)r.actual : 0);
    if (l.tokens) /* a predictor being fitted has no learned scores yet */
        fprintf(f, ", learned P %.1f%% R %.1f%%", l.predicted ? 100.0 * (double)l.hits / (double)l.predicted : 0,
                l.actual ? 100.0 * (double)l.hits / (double)l.actual : 0);
    fprintf(f, " (%llu tokens)\n", (unsigned long long)r.tokens);
}

void cli_predictor_summary(FILE *f, const struct moetax_predictor *p, const struct moetax_model *m) {
    if (!p) return;
    (void)m;
    const int nq = p->n_layer * p->ahead;
    for (int a = 1; a <= p->ahead; a++) {
        struct moetax_predict_score r = moetax_predictor_total(p, MOETAX_PREDICT_ROUTER, a);
        struct moetax_predict_score l = moetax_predictor_total(p, MOETAX_PREDICT_LEARNED, a);
        if (!r.tokens) continue;
        char what[96];
        snprintf(what, sizeof what, "  predictors, %d layer%s ahead (per token; prefetch from the %s)", a, a == 1 ? "" : "s",
                 p->use ? "learned one" : "router guess");
        score_line(f, what, r, l);
        for (int q = a - 1; q < nq; q += p->ahead) {
            const struct moetax_predict_score *rq = &p->score[(size_t)MOETAX_PREDICT_ROUTER * (size_t)nq + (size_t)q];
            const struct moetax_predict_score *lq = &p->score[(size_t)MOETAX_PREDICT_LEARNED * (size_t)nq + (size_t)q];
            if (!rq->tokens) continue;
            snprintf(what, sizeof what, "    layer %d -> %d", q / p->ahead, p->target[q]);
            score_line(f, what, *rq, *lq);
        }
    }
}

double cli_predictor_recall(const struct moetax_store *s, int kind) {
    const struct moetax_predictor *p = moetax_store_predictor(s);
    if (!p || kind < 0 || kind >= MOETAX_PREDICT_KINDS) return NAN;
    struct moetax_predict_score r = moetax_predictor_total(p, (enum moetax_predict_kind)kind, 1);
    return r.actual ? (double)r.hits / (double)r.actual : NAN;
}

void cli_store_summary(FILE *f, const struct moetax_store *s, int64_t tokens) {
    struct moetax_store_stats st;
    moetax_store_get_stats(s, &st);
    double hit = st.acquires ? (double)st.hits / (double)st.acquires : 0;
    double prec = st.predicted_issued ? (double)st.predicted_used / (double)st.predicted_issued : 0;
    fprintf(f, "  expert store: %d slots of %.2f MiB, %s; hit rate %.1f%% (%llu of %llu acquires waited)\n", st.n_slots,
            (double)st.slot_bytes / (1 << 20),
            st.direct_io_active ? "O_DIRECT" : st.direct_io_fallback ? "buffered (O_DIRECT refused)" : "buffered",
            100 * hit, (unsigned long long)st.misses, (unsigned long long)st.acquires);
    fprintf(f, "  reads (%s%s): %.1f MiB in %llu requests, %.2f GB/s while reading",
            moetax_store_io_engine_name(st.io_engine), st.io_engine_fallback ? ", io_uring unavailable" : "",
            (double)st.bytes_read / (1 << 20), (unsigned long long)st.reads, st.read_gbps);
    if (tokens > 0) /* per token only when the caller knows how many tokens the store served */
        fprintf(f, "; %.2f MiB read and %.2f ms stalled per token", (double)st.bytes_read / (1 << 20) / (double)tokens,
                1e-6 * (double)st.stall_ns / (double)tokens);
    fprintf(f, "\n");
    fprintf(f, "  prefetch: %llu predicted reads, precision %.1f%%; %llu wasted, %llu dropped, %llu late\n",
            (unsigned long long)st.predicted_issued, 100 * prec, (unsigned long long)st.prefetch_wasted,
            (unsigned long long)st.prefetch_dropped, (unsigned long long)st.prefetch_late);
    if (st.ahead_offered) /* the read-ahead list's share of them */
        fprintf(f, "  read-ahead: %llu of %llu offered experts read, %llu of those used (%.1f%%), %llu dropped unread\n",
                (unsigned long long)st.ahead_issued, (unsigned long long)st.ahead_offered,
                (unsigned long long)st.ahead_used,
                st.ahead_issued ? 100.0 * (double)st.ahead_used / (double)st.ahead_issued : 0.0,
                (unsigned long long)st.ahead_stale);
    cli_predictor_summary(f, moetax_store_predictor(s), NULL);
}

bool cli_peak_rss_reset(void) {
    FILE *f = fopen("/proc/self/clear_refs", "w");
    if (!f) return false;
    bool ok = fputs("5", f) >= 0;
    return (fclose(f) == 0) && ok;
}

uint64_t cli_peak_rss_bytes(void) {
    FILE *f = fopen("/proc/self/status", "r");
    if (!f) return 0;
    char line[256];
    unsigned long kb = 0;
    while (fgets(line, sizeof line, f))
        if (sscanf(line, "VmHWM: %lu kB", &kb) == 1) break;
    fclose(f);
    return (uint64_t)kb * 1024;
}

uint64_t cli_rss_bytes(void) {
    FILE *f = fopen("/proc/self/statm", "r");
    if (!f) return 0;
    unsigned long size = 0, rss = 0;
    int n = fscanf(f, "%lu %lu", &size, &rss);
    fclose(f);
    return n == 2 ? (uint64_t)rss * (uint64_t)sysconf(_SC_PAGESIZE) : 0;
}
