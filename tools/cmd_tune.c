/* cmd_tune.c - `moetax tune`: choose the levers that cut the tax for a model, this
 * machine and a workload, with the quality cost measured.
 *
 * Levers: threads (1 .. online CPUs), routed experts per token (the file's k down to
 * ceil(k/2)), --no-mmap (weights in private 2 MiB pages), the routed experts' precision
 * (as stored, or re-quantized in memory at load to Q8_0 from a float file, to Q4_0 from
 * anything wider: --expert-type), under --memory the expert store (budgets that fit x
 * next-use/lfu x prefetch), and, for --workload batch:N, the batch size (N, the powers of two
 * below it) and the capacity factor (off, 1.25, 1.0; overflow dropped or rerouted; a C whose capacity per
 * expert at that batch size, ceil(C B k / E), is B or another C's is left out). Quality depends
 * on k, the capacity factor, the expert type and the batch size only (threads, paging and the
 * store change no bit, or float rounding at most), so it is measured once per (k, capacity,
 * expert type, batch), scored as batched decode sees it: the mean KL divergence of the next-token
 * distributions against the exact configuration on a calibration text, top-1
 * agreement, and the perplexity change. Speed is measured for every configuration as a
 * paired ratio against the default one (all threads, the file's k, mapped, no capacity
 * factor, the full batch), run alternately in the same process, because these machines drift;
 * beside it TTFT (the prefill of --prompt tokens, every sequence's together), per-sequence TPOT
 * p50/p99 (each decode step's own timestamps), and the ledger's decode phases per token and tax
 * share. The log carries all of them; a speed entry of an older tune without them is measured
 * again (its quality entries are reused). --max-tpot bounds the recommendation's p99 TPOT, --max-kl its KL.
 *
 * A configuration fits when its footprint (bench's RSS bound: the resident weights with the
 * experts at their precision, or the store's budget instead of them, + KV + overhead) is
 * within --memory; one that does not is never on the front nor recommended (the default is
 * still measured: it is the reference of every ratio).
 *
 * Search within --time (successive halving): 1. quality of every (k, capacity, expert type,
 * batch; and the default with F16 or Q8_0 KV cells) on a short text, in order of the levers moved (past half of --time only the
 * default's and what the log holds); those within twice the allowed loss go on; 2. a short
 * speed pair for each of them that fits x threads x paging, and for the store's configurations; then the
 * combinations of the best store configuration with each smaller k that survived; 3. the
 * default and the better half of the fitting survivors, those within the allowed loss on
 * the short text first (past --time the default and the first of them still run): the long
 * text's quality and three speed pairs. The Pareto front (speed vs KL) of the fitting
 * stage-3 configurations, the recommendation (the fastest within --max-quality-loss of
 * perplexity), and --explain (the ledger's phases of the default against the
 * recommendation, and the quality each of its levers cost alone) are printed; -o writes the
 * recommendation as a configuration run/bench/perplexity/serve read with --config;
 * --html a page with the front as an SVG chart. Then, for an MLA model's decode workload, the prefill form
 * (prefill_stage): --mla-prefill auto against the absorbed form on the recommendation, by TTFT, taken where it
 * pays within the quality bounds. */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <jansson.h>

#include "cli.h"
#include "commands.h"
#include "config_cli.h"
#include "core/printable.h"
#include "moetax/kernels.h"
#include "moetax/ledger.h"
#include "moetax/model.h"
#include "moetax/outfile.h"
#include "moetax/report.h"
#include "moetax/tokenizer.h"
#include "store_cli.h"

static void usage(FILE *f) {
    fprintf(f, "usage: moetax tune [-m FILE] [--time 10m] [--max-quality-loss 1%%] [--workload decode|batch:N]\n"
               "                   [--memory SIZE] [--calib TEXT|DIR] [-o CONFIG.json] [--html PAGE] [--log FILE]\n"
               "                   [--prompt N] [--max-tpot MS] [--max-kl X] [--explain] [--json]\n\n"
               "Sweeps the levers that apply (threads, routed experts per token from the file's k down to k/2,\n"
               "--no-mmap, the experts' precision (--expert-type q8_0/q4_0), the KV cache's cells (--cache-type\n"
               "f16/q8_0), under --memory the expert store, and for batch:N the batch size (N, N/2, .. 1) and the\n"
               "capacity factor (off, 1.25, 1.0; overflow dropped or rerouted)), measures decode speed (aggregate tokens/s) as paired ratios against the default\n"
               "configuration run alternately, TTFT, per-sequence TPOT p50/p99 and the ledger's phases per\n"
               "token, and quality as the KL divergence of next-token distributions against the exact\n"
               "configuration, top-1 agreement and the perplexity change on a calibration text; successive\n"
               "halving within --time. Prints the Pareto front (speed vs KL) and a recommendation: the fastest\n"
               "configuration whose perplexity rises by at most --max-quality-loss (and, with --max-tpot, whose\n"
               "p99 TPOT is within it). On an MLA (DeepSeek2) model's decode workload it then times the\n"
               "recommendation's TTFT with --mla-prefill auto against the absorbed form, alternately, and\n"
               "takes auto where it is 5%% faster and the configuration with every micro-batch decompressed\n"
               "keeps the quality bounds (--prompt sets the prompt: auto decompresses long ones).\n"
               "  --calib TEXT|DIR  calibration text (default: the default model's held-out Python files from\n"
               "                    /usr/lib/python3.11, as tools/train/corpus.py splits them)\n"
               "  --workload W      decode (one sequence, the default) or batch:N (N sequences decoding together)\n"
               "  --memory SIZE     only configurations whose footprint fits SIZE (4G, 512M) are on the front\n"
               "  --prompt N        the workload's prompt length: TTFT is its prefill (micro-batches of 512 tokens,\n"
               "                    as run's), decode runs after it (64)\n"
               "  --max-tpot MS     recommend only a configuration whose per-sequence p99 TPOT is within MS\n"
               "  --max-kl X        recommend only a configuration whose mean KL divergence from the exact\n"
               "                    distributions is at most X (nats; 0: exact ones only). The perplexity bound\n"
               "                    alone can pass a lossy lever whose change is within the text's noise\n"
               "  --log FILE        one line per measurement; a rerun reuses them (default: tune.log beside -o;\n"
               "                    /dev/null: none); a file tune did not write is refused, left as it is\n"
               "  -o FILE           write the recommendation as a configuration (--config FILE elsewhere)\n"
               "  --html PAGE       the results and the front as one page\n"
               "  --explain         the ledger's phases per token of the default and the recommendation, TTFT,\n"
               "                    TPOT, and the quality each lever cost\n"
               "  --json            the results as JSON lines on stdout: one per configuration (\"config\"),\n"
               "                    then, on an MLA model, the prefill form's ({\"kind\": \"prefill_form\"})\n");
}

/* ---- calibration text ------------------------------------------------------------------ */

static uint32_t crc32_of(const char *s) {
    uint32_t c = 0xffffffffu;
    for (; *s; s++) {
        c ^= (uint8_t)*s;
        for (int k = 0; k < 8; k++) c = c & 1 ? (c >> 1) ^ 0xedb88320u : c >> 1;
    }
    return c ^ 0xffffffffu;
}

/* Relative paths of the *.py files under root/rel (recursive), appended to *v. */
static void walk_py(const char *root, const char *rel, char ***v, int *n, int *cap) {
    char dir[4096];
    snprintf(dir, sizeof dir, "%s%s%s", root, rel[0] ? "/" : "", rel);
    DIR *d = opendir(dir);
    if (!d) return;
    struct dirent *e;
    while ((e = readdir(d))) {
        if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
        char r2[4096], full[8192];
        snprintf(r2, sizeof r2, "%s%s%s", rel, rel[0] ? "/" : "", e->d_name);
        snprintf(full, sizeof full, "%s/%s", root, r2);
        struct stat sb;
        if (lstat(full, &sb)) continue;
        if (S_ISDIR(sb.st_mode)) walk_py(root, r2, v, n, cap);
        else if (S_ISREG(sb.st_mode) && strlen(e->d_name) > 3 && !strcmp(e->d_name + strlen(e->d_name) - 3, ".py")) {
            if (*n == *cap) {
                char **nv = realloc(*v, sizeof **v * (size_t)(*cap = *cap ? 2 * *cap : 256));
                if (!nv) break;
                *v = nv;
            }
            (*v)[(*n)++] = strdup(r2);
        }
    }
    closedir(d);
}

static int cmp_str(const void *a, const void *b) { return strcmp(*(char *const *)a, *(char *const *)b); }

/* The calibration tokens: --calib's file(s), or the held-out stdlib files; up to max_tokens. */
static moetax_status calib_tokens(const struct moetax_tokenizer *tok, const char *calib, int64_t max_tokens, int32_t **out,
                                  int64_t *n_out) {
    char **files = NULL;
    int n_files = 0, cap = 0;
    const char *root = "/usr/lib/python3.11";
    moetax_status st = MOETAX_OK;
    if (calib) {
        if ((st = cli_list_inputs(calib, &files, &n_files))) st = moetax_error(st, "--calib: %s", moetax_last_error());
    } else {
        walk_py(root, "", &files, &n_files, &cap);
        qsort(files, (size_t)n_files, sizeof *files, cmp_str);
        int k = 0;
        for (int i = 0; i < n_files; i++) {
            if (crc32_of(files[i]) % 20 == 0) {
                char full[8192];
                snprintf(full, sizeof full, "%s/%s", root, files[i]);
                free(files[i]);
                files[k++] = strdup(full);
            } else free(files[i]);
        }
        n_files = k;
        if (!n_files)
            st = moetax_error(MOETAX_ERR_NOT_FOUND, "no calibration text: %s holds no held-out Python files (pass --calib "
                              "TEXT|DIR)", root);
    }
    int32_t *ids = malloc(sizeof(int32_t) * (size_t)(max_tokens + 1));
    int64_t n = 0;
    if (!st && !ids) st = moetax_error(MOETAX_ERR_NOMEM, "out of memory");
    const bool bos = moetax_tokenizer_add_bos(tok) && moetax_tokenizer_bos(tok) >= 0;
    for (int f = 0; !st && f < n_files && n < max_tokens; f++) {
        char *text;
        size_t len;
        if (cli_read_file(files[f], 64 << 20, &text, &len)) continue; /* unreadable ones are skipped */
        int32_t *buf = NULL;
        int64_t m = 0;
        if (!cli_encode(tok, text, len, bos, 0, &buf, &m)) {
            const int64_t take = m < max_tokens - n ? m : max_tokens - n;
            memcpy(ids + n, buf, sizeof(int32_t) * (size_t)take);
            n += take;
        }
        free(buf);
        free(text);
    }
    for (int f = 0; f < n_files; f++) free(files[f]);
    free(files);
    if (!st && n < 64) st = moetax_error(MOETAX_ERR_ARG, "the calibration text has %lld tokens (at least 64 needed)", (long long)n);
    if (st) { free(ids); return st; }
    *out = ids;
    *n_out = n;
    return MOETAX_OK;
}

/* ---- configurations ------------------------------------------------------------------------ */

struct tcfg {
    int threads, k;
    int batch;          /* sequences decoding together (--workload batch:N sweeps N, N/2, .. 1); 0: decode (one) */
    float cap;          /* 0: off */
    enum moetax_overflow overflow; /* with cap: dropped (0) or rerouted to the token's best other expert with room */
    bool no_mmap;
    uint64_t budget;    /* expert store's budget in bytes; 0: no store (the experts mapped) */
    enum moetax_store_policy policy;
    bool no_prefetch;
    enum moetax_type etype; /* routed experts re-quantized at load (--expert-type); MOETAX_EXPERT_TYPE_AS_STORED */
    enum moetax_type kv;    /* the KV cache's cells (--cache-type): MOETAX_TYPE_F32 (0, the default), F16, Q8_0 */
    enum moetax_attn_prefill prefill; /* MLA prompts (--mla-prefill): absorbed (0, the default), or the stage after
                                         the recommendation's: auto (its TTFT), decompressed (its quality) */
};

#define TUNE_ETYPES 3 /* as stored, Q8_0, Q4_0 */

struct tres {
    struct tcfg c;
    int stage;          /* the last stage it reached */
    bool q_long;        /* quality on the long text */
    double kl, top1, ppl, dppl; /* quality (dppl: relative perplexity change) */
    double ratio, tps, tax, p99_ms; /* speed: paired ratio against the default, its tokens/s (all sequences) */
    double ttft_ms, p50_ms;   /* time to the first token of a prompt of --prompt tokens (each sequence's, prefilled
                                 together), per-sequence TPOT p50 (p99_ms: p99) from the decode steps' timestamps */
    double step_us;           /* decode wall time per token (a step's / its sequences), as the phases are */
    double phase_us[MOETAX_PHASE_COUNT]; /* the ledger's decode phases per token */
    bool pareto;
    bool fits;          /* its footprint is within --memory (always without --memory) */
    uint64_t footprint; /* bytes, as bench's RSS bound */
    int tier;           /* stage-3 order: 0 the default, 1 within the loss on the short text, 2 within twice it */
};

struct tune {
    const char *model_path;
    struct moetax_model *m[2][TUNE_ETYPES]; /* [no_mmap][expert type] (loaded when first needed) */
    enum moetax_type etypes[TUNE_ETYPES];   /* the expert types tried: [0] as stored */
    int n_etypes;
    int32_t *calib;
    int64_t n_calib, n_short, window;
    int batch;                  /* the workload's sequences (1: decode); each configuration runs its own c->batch */
    int prompt;                 /* the workload's prompt length (--prompt): TTFT's prefill, decode's context */
    int stale;                  /* speed entries of the log without TTFT / TPOT / phases (older tune): measured again */
    float *ref;                 /* exact log-probabilities [n_calib - 1, V] (the long text) */
    double ref_ppl[2];          /* exact perplexity on the short and the long text */
    double t_end;
    FILE *log;                  /* --log: one JSON line per measurement (appended) */
    const char *log_path;
    json_t **logged;            /* the entries of the log read at the start */
    int n_logged, reused;
};

static int etype_index(const struct tune *t, enum moetax_type e) {
    for (int i = 0; i < t->n_etypes; i++)
        if (t->etypes[i] == e) return i;
    return 0;
}

static moetax_status model_for(struct tune *t, const struct tcfg *c, struct moetax_model **out) {
    const int ei = etype_index(t, c->etype);
    if (!t->m[c->no_mmap][ei]) {
        struct moetax_model_params mp = {.no_mmap = c->no_mmap, .expert_type = c->etype};
        moetax_status st = moetax_model_load_ex(t->model_path, &mp, &t->m[c->no_mmap][ei]);
        if (st) return st;
    }
    *out = t->m[c->no_mmap][ei];
    return MOETAX_OK;
}

/* The expert types worth trying for a file whose routed experts are of type `stored`: Q8_0
 * from a float file, Q4_0 from anything wider than 4 bits. */
static int expert_types(enum moetax_type stored, enum moetax_type *out) {
    int n = 0;
    out[n++] = MOETAX_EXPERT_TYPE_AS_STORED;
    const bool is_float = stored == MOETAX_TYPE_F32 || stored == MOETAX_TYPE_F16 || stored == MOETAX_TYPE_BF16;
    if (is_float) out[n++] = MOETAX_TYPE_Q8_0;
    if (is_float || stored == MOETAX_TYPE_Q8_0 || stored == MOETAX_TYPE_Q6_K || stored == MOETAX_TYPE_Q5_K)
        out[n++] = MOETAX_TYPE_Q4_0;
    return n;
}

/* The routed experts' bytes at type e (as stored: the file's), all of them resident. */
static uint64_t expert_bytes_as(const struct moetax_model *m, enum moetax_type e) {
    if (e == MOETAX_EXPERT_TYPE_AS_STORED) return cli_store_expert_bytes(m);
    uint64_t b = 0;
    for (int il = 0; il < m->hp.n_layer; il++) {
        const struct moetax_layer *l = &m->layers[il];
        if (!l->is_moe) continue;
        const struct moetax_weight *ws[3] = {&l->gate_exps, l->fused_gate_up ? NULL : &l->up_exps, &l->down_exps};
        for (int i = 0; i < 3; i++)
            if (ws[i]) b += (uint64_t)moetax_row_size(e, ws[i]->ne[0]) * (uint64_t)ws[i]->ne[1] * (uint64_t)ws[i]->ne[2];
    }
    return b;
}

/* A decode step's capacity per expert (moe.c's apply_capacity): ceil(C B k / E), within 1 .. B k. */
static int ecap(float cf, int batch, int k, int n_expert) {
    const double b = batch > 1 ? batch : 1, c = ceil((double)cf * b * k / (n_expert > 0 ? n_expert : 1));
    return c < 1 ? 1 : c > b * k ? (int)(b * k) : (int)c;
}

static int levers_moved(const struct tcfg *c, const struct tcfg *d) {
    return (c->k != d->k) + (c->etype != d->etype) + (c->cap != d->cap || c->overflow != d->overflow) +
           (c->batch != d->batch) + (c->kv != d->kv) + (c->prefill != d->prefill);
}

static bool is_default(const struct tcfg *c, const struct tcfg *d) {
    return c->threads == d->threads && c->k == d->k && c->batch == d->batch && !c->no_mmap && c->cap == 0 &&
           !c->budget &&
           c->etype == MOETAX_EXPERT_TYPE_AS_STORED && c->kv == MOETAX_TYPE_F32 && c->prefill == MOETAX_ATTN_PREFILL_ABSORBED;
}

/* log-softmax of a row in double, into lp (as float) */
static void log_softmax(const float *x, int64_t V, float *lp) {
    float mx = x[0];
    for (int64_t v = 1; v < V; v++) mx = x[v] > mx ? x[v] : mx;
    double s = 0;
    for (int64_t v = 0; v < V; v++) s += exp((double)x[v] - mx);
    const double ls = log(s) + mx;
    for (int64_t v = 0; v < V; v++) lp[v] = (float)((double)x[v] - ls);
}

/* Logits of calibration tokens [0, n) under configuration c, in windows of t->window tokens
 * from an empty cache, scored as c->batch sequences of one batch (interleaved: each micro-batch one
 * token of every sequence, as batched decode sees them, so a capacity factor drops what it would) when > 1:
 * cb(token index j, logits row predicting token j + 1). */
typedef void (*row_cb)(void *u, int64_t j, const float *row);
static moetax_status run_windows(struct tune *t, const struct tcfg *c, int64_t n, row_cb cb, void *u) {
    struct moetax_model *m;
    moetax_status st = model_for(t, c, &m);
    if (st) return st;
    const int B = c->batch > 1 ? c->batch : 1;
    const int64_t W = t->window;
    struct moetax_ctx_params cp = {.n_ctx = (int32_t)(B * ((W + 31) / 32 * 32)), .n_threads = c->threads,
                                   .n_expert_used = c->k, .capacity_factor = c->cap, .overflow = c->overflow,
                                   .n_seq_max = B, .kv_type = c->kv, .attn_prefill = c->prefill,
                                   .n_ubatch = B > 1 ? B : 64};
    struct moetax_ctx *ctx;
    if ((st = moetax_ctx_init(m, &cp, &ctx))) return st;
    struct moetax_batch b;
    if ((st = moetax_batch_init(&b, (int32_t)(B * W)))) { moetax_ctx_free(ctx); return st; }
    for (int64_t g0 = 0; !st && g0 < n - 1; g0 += (int64_t)B * W) {
        moetax_ctx_reset(ctx);
        moetax_batch_clear(&b);
        for (int64_t i = 0; i < W; i++)
            for (int q = 0; q < B; q++) {
                const int64_t j = g0 + (int64_t)q * W + i;
                if (j < n - 1 && i < W) moetax_batch_add(&b, t->calib[j], (int32_t)i, q, true);
            }
        if (!b.n_tokens) break;
        if ((st = moetax_ctx_decode(ctx, &b))) break;
        for (int e = 0; e < b.n_tokens; e++) cb(u, g0 + (int64_t)b.seq[e] * W + b.pos[e], moetax_ctx_logits_ith(ctx, e));
    }
    moetax_batch_free(&b);
    moetax_ctx_free(ctx);
    return st;
}

struct ref_u { struct tune *t; int64_t V; double nll; int64_t n; };
static void ref_row(void *u, int64_t j, const float *row) {
    struct ref_u *r = u;
    float *lp = r->t->ref + (size_t)j * (size_t)r->V;
    log_softmax(row, r->V, lp);
    r->nll -= lp[r->t->calib[j + 1]];
    r->n++;
}

/* per token, summed in token order afterwards: the rows arrive in batch order, and a configuration
 * whose logits do not depend on the batch size must score the same to the last bit at every size */
struct q_u { struct tune *t; int64_t V; float *lp; double *kl, *nll; int64_t n, top1; };
static void q_row(void *u, int64_t j, const float *row) {
    struct q_u *q = u;
    const float *p = q->t->ref + (size_t)j * (size_t)q->V;
    log_softmax(row, q->V, q->lp);
    double kl = 0;
    int64_t a = 0, b = 0;
    for (int64_t v = 0; v < q->V; v++) {
        kl += exp((double)p[v]) * ((double)p[v] - (double)q->lp[v]);
        if (p[v] > p[a]) a = v;
        if (q->lp[v] > q->lp[b]) b = v;
    }
    q->kl[j] = kl > 0 ? kl : 0;
    q->top1 += a == b;
    q->nll[j] = -(double)q->lp[q->t->calib[j + 1]];
    q->n++;
}

/* Quality of c on the first n calibration tokens (n = n_short or n_calib). */
static moetax_status quality(struct tune *t, struct tres *r, int64_t n, bool is_long) {
    const int64_t V = t->m[0][0]->hp.n_vocab;
    const size_t nr = (size_t)(n > 0 ? n : 1);
    struct q_u q = {.t = t, .V = V, .lp = malloc(sizeof(float) * (size_t)V), .kl = calloc(nr, sizeof(double)),
                    .nll = calloc(nr, sizeof(double))};
    moetax_status st = q.lp && q.kl && q.nll ? run_windows(t, &r->c, n, q_row, &q)
                                             : moetax_error(MOETAX_ERR_NOMEM, "out of memory");
    double kl = 0, nll = 0;
    for (int64_t j = 0; !st && j < n; j++) kl += q.kl[j], nll += q.nll[j];
    free(q.lp), free(q.kl), free(q.nll);
    if (st) return st;
    r->kl = q.n ? kl / (double)q.n : 0;
    r->top1 = q.n ? (double)q.top1 / (double)q.n : 0;
    r->ppl = exp(nll / (double)(q.n ? q.n : 1));
    r->dppl = r->ppl / t->ref_ppl[is_long] - 1;
    r->q_long = is_long;
    return MOETAX_OK;
}

/* One speed measurement of c: c->batch prompts of t->prompt tokens prefilled together (TTFT: that
 * step's wall time, after which every sequence has its first token; in micro-batches of run's and
 * serve's default size, MOETAX_UBATCH_DEFAULT tokens), then `steps` decode steps of
 * one token per sequence. Per-sequence TPOT is a step's time (each sequence gets one token per
 * step), from each step's own timestamps; the ledger records the decode steps only. */
struct smeas {
    double tps, ttft_ms, p50_ms, p99_ms, tax, step_us;
    double phase_us[MOETAX_PHASE_COUNT];
};
/* Where a speed measurement's prompts start in the calibration text: a new place for each pair of runs
 * (the two runs of a pair read the same tokens, so that they route alike) */
static int64_t next_off(const struct tune *t) {
    static uint64_t salt = 0;
    salt++;
    return (int64_t)((salt * 7919) % (uint64_t)(t->n_calib > 1000 ? t->n_calib - 1000 : 1));
}

static moetax_status speed_once(struct tune *t, const struct tcfg *c, int steps, int64_t off, struct smeas *sm) {
    struct moetax_model *m;
    moetax_status st = model_for(t, c, &m);
    if (st) return st;
    const int B = c->batch > 1 ? c->batch : 1, P = t->prompt;
    const int64_t per = (P + steps + 1 + 31) / 32 * 32;
    struct moetax_ctx_params cp = {.n_ctx = (int32_t)(B * per), .n_threads = c->threads, .n_expert_used = c->k,
                                   .capacity_factor = c->cap, .overflow = c->overflow, .n_seq_max = B,
                                   .n_ubatch = B > MOETAX_UBATCH_DEFAULT ? B : MOETAX_UBATCH_DEFAULT, .kv_type = c->kv,
                                   .attn_prefill = c->prefill};
    struct moetax_ctx *ctx = NULL;
    struct moetax_ledger *led = NULL;
    struct moetax_store *store = NULL;
    struct moetax_batch b = {0};
    double *dt = malloc(sizeof(double) * (size_t)steps);
    if (!dt) return moetax_error(MOETAX_ERR_NOMEM, "out of memory");
    if (c->budget) { /* as bench's --expert-budget: the store opened for the budget, the micro-batch fitted to it */
        struct cli_store_opts so = {.policy = c->policy, .policy_set = true, .n_expert_used = c->k,
                                    .no_prefetch = c->no_prefetch};
        int ub = cp.n_ubatch;
        if (!(st = cli_store_open(m, &so, c->budget, &ub, &store))) {
            cp.store = store;
            cp.n_ubatch = ub;
            cp.no_prefetch = c->no_prefetch;
        }
    }
    if (!st && !(st = moetax_ctx_init(m, &cp, &ctx))) {
        struct moetax_ledger_params lp = {.n_workers = moetax_ctx_n_threads(ctx), .n_layer = m->hp.n_layer};
        st = moetax_ledger_init(&lp, &led);
    }
    if (!st) st = moetax_batch_init(&b, P * B);
    if (!st) {
        for (int i = 0; i < P; i++)
            for (int s = 0; s < B; s++)
                moetax_batch_add(&b, t->calib[(off + s * 97 + i) % t->n_calib], i, s, i == P - 1);
        const double a0 = cli_now();
        st = moetax_ctx_decode(ctx, &b);
        sm->ttft_ms = 1e3 * (cli_now() - a0);
        moetax_ctx_set_ledger(ctx, led);
        double total = 0;
        for (int j = 0; !st && j < steps; j++) {
            moetax_batch_clear(&b);
            for (int s = 0; s < B; s++)
                moetax_batch_add(&b, t->calib[(off + s * 97 + P + j) % t->n_calib], P + j, s, true);
            const double a = cli_now();
            st = moetax_ctx_decode(ctx, &b);
            dt[j] = cli_now() - a;
            total += dt[j];
        }
        if (!st) {
            sm->tps = (double)(B * steps) / total;
            sm->step_us = 1e6 * total / (double)(B * steps);
            double ph[MOETAX_PHASE_COUNT];
            int64_t tok;
            moetax_ledger_totals(led, true, ph, NULL, &tok, NULL);
            for (int p = 0; p < MOETAX_PHASE_COUNT; p++) sm->phase_us[p] = tok ? 1e6 * ph[p] / (double)tok : 0;
            sm->tax = moetax_ledger_tax_share(ph);
            sm->p50_ms = 1e3 * cli_percentile(dt, steps, 0.5);
            sm->p99_ms = 1e3 * cli_percentile(dt, steps, 0.99);
        }
    }
    if (ctx) moetax_ctx_set_ledger(ctx, NULL);
    moetax_batch_free(&b);
    moetax_ledger_free(led);
    moetax_ctx_free(ctx);
    moetax_store_free(store);
    free(dt);
    return st;
}

/* Paired ratio: `pairs` alternations of the default d and c; the median of c/d (aggregate tokens/s),
 * and of c's tokens/s, TTFT, TPOT p50/p99; c's phases, tax share and wall per token from the pair of
 * the median ratio. */
/* stage 3 takes as many pairs as half of the time left allows, so that a longer --time buys a steadier median */
#define TUNE_MAX_PAIRS 15

static moetax_status speed(struct tune *t, const struct tcfg *d, struct tres *r, int pairs, int steps) {
    double ratios[TUNE_MAX_PAIRS], tpss[TUNE_MAX_PAIRS], ttft[TUNE_MAX_PAIRS], p50[TUNE_MAX_PAIRS], p99[TUNE_MAX_PAIRS];
    struct smeas ms[TUNE_MAX_PAIRS];
    if (pairs > TUNE_MAX_PAIRS) pairs = TUNE_MAX_PAIRS;
    moetax_status st = MOETAX_OK;
    for (int i = 0; i < pairs && !st; i++) {
        struct smeas sd;
        const int64_t off = next_off(t);
        if ((st = speed_once(t, d, steps, off, &sd))) break;
        if ((st = speed_once(t, &r->c, steps, off, &ms[i]))) break;
        ratios[i] = ms[i].tps / sd.tps;
        tpss[i] = ms[i].tps, ttft[i] = ms[i].ttft_ms, p50[i] = ms[i].p50_ms, p99[i] = ms[i].p99_ms;
    }
    if (st) return st;
    int mi = 0; /* the pair of the median ratio */
    double sorted[TUNE_MAX_PAIRS];
    memcpy(sorted, ratios, sizeof(double) * (size_t)pairs);
    r->ratio = cli_percentile(sorted, pairs, 0.5);
    for (int i = 0; i < pairs; i++)
        if (ratios[i] == r->ratio) mi = i;
    r->tps = cli_percentile(tpss, pairs, 0.5);
    r->ttft_ms = cli_percentile(ttft, pairs, 0.5);
    r->p50_ms = cli_percentile(p50, pairs, 0.5);
    r->p99_ms = cli_percentile(p99, pairs, 0.5);
    r->tax = ms[mi].tax, r->step_us = ms[mi].step_us;
    memcpy(r->phase_us, ms[mi].phase_us, sizeof r->phase_us);
    return MOETAX_OK;
}

static void cfg_name(const struct tcfg *c, char *buf, size_t n) {
    char cap[32] = "";
    if (c->cap > 0)
        snprintf(cap, sizeof cap, " cf %g%s", (double)c->cap, c->overflow == MOETAX_OVERFLOW_REROUTE ? " reroute" : "");
    char sto[64] = "";
    if (c->budget)
        snprintf(sto, sizeof sto, " store %.1fM %s%s", (double)c->budget / (1 << 20), moetax_store_policy_name(c->policy),
                 c->no_prefetch ? " no-prefetch" : "");
    char et[32] = "";
    if (c->etype != MOETAX_EXPERT_TYPE_AS_STORED) snprintf(et, sizeof et, " experts %s", moetax_type_name(c->etype));
    char bs[16] = "";
    if (c->batch > 0) snprintf(bs, sizeof bs, " b%d", c->batch);
    char kv[16] = "";
    if (c->kv != MOETAX_TYPE_F32) snprintf(kv, sizeof kv, " kv %s", moetax_type_name(c->kv));
    char pf[32] = "";
    if (c->prefill != MOETAX_ATTN_PREFILL_ABSORBED) snprintf(pf, sizeof pf, " prefill %s", cli_mla_prefill_name(c->prefill));
    snprintf(buf, n, "t%d k%d%s%s%s%s%s%s%s", c->threads, c->k, bs, c->no_mmap ? " no-mmap" : "", et, cap, sto, kv, pf);
}

/* Quality is measured per (k, capacity factor, expert type, batch size, KV cells): the capacity factor drops by
 * the micro-batch's loads, so by B; with it off, B should change no bit (the quantized kernels are
 * batch-invariant), which measuring it per B shows (KL 0) rather than assumes. */
static bool same_quality(const struct tcfg *a, const struct tcfg *b) {
    return a->k == b->k && a->cap == b->cap && (a->cap == 0 || a->overflow == b->overflow) && a->etype == b->etype &&
           a->batch == b->batch && a->kv == b->kv && a->prefill == b->prefill;
}

/* ---- the log (--log): one JSON line per measurement, a header line naming what was tuned ---- */

static uint32_t hash_tokens(const int32_t *v, int64_t n) { /* FNV-1a over the token ids */
    uint32_t h = 2166136261u;
    for (int64_t i = 0; i < n; i++)
        for (int b = 0; b < 4; b++) h = (h ^ (uint8_t)((uint32_t)v[i] >> (8 * b))) * 16777619u;
    return h;
}

/* ---- reading the log back: only what tune wrote is reused or appended to ---- */

/* A log line is one small JSON object (a speed entry, the longest, carries some thirty numbers): a longer
 * line, or a NUL byte, means the file is not a log tune wrote. */
#define TUNE_LOG_LINE_MAX 65536
/* Times in a log entry: beyond a day is damage, not a measurement. */
#define TUNE_LOG_DAY_MS 8.64e7
#define TUNE_LOG_DAY_US 8.64e10

enum log_line_status { LOG_LINE_OK, LOG_LINE_NUL, LOG_LINE_LONG, LOG_LINE_IO };

/* The next line of f into buf (TUNE_LOG_LINE_MAX + 1 bytes; *n = 0 at the end of the file), its newline
 * included where it has one (*nl). At most TUNE_LOG_LINE_MAX bytes are read for a line that is longer. */
static enum log_line_status log_getline(FILE *f, char *buf, size_t *n, bool *nl) {
    *n = 0;
    *nl = false;
    int c;
    while ((c = getc(f)) != EOF) {
        if (c == 0) return LOG_LINE_NUL;
        if (*n == TUNE_LOG_LINE_MAX) return LOG_LINE_LONG;
        buf[(*n)++] = (char)c;
        if (c == '\n') { *nl = true; break; }
    }
    buf[*n] = 0;
    return ferror(f) ? LOG_LINE_IO : LOG_LINE_OK;
}

/* The key whose value Jansson stopped in (a NaN, a number out of range), to name the field: the last "key":
 * before byte pos of the line (a log line is one flat object); "" when there is none. */
static void log_key_before(const char *s, size_t len, size_t pos, char *out, size_t n) {
    out[0] = 0;
    for (size_t i = pos < len ? pos : len; i >= 2; i--) {
        if (s[i - 1] != ':' || s[i - 2] != '"') continue;
        const size_t e = i - 2;
        size_t b = e;
        while (b > 0 && s[b - 1] != '"') b--;
        if (b == 0) return;
        moetax_printable(out, n, s + b, e - b, MOETAX_PRINTABLE_ASCII);
        return;
    }
}

/* What a field holds, for a message: missing, its number, its string (cut, printable), or its JSON type. */
static void log_describe(const json_t *v, char *out, size_t n) {
    if (!v) snprintf(out, n, "missing");
    else if (json_is_number(v)) snprintf(out, n, "%.17g", json_number_value(v));
    else if (json_is_string(v)) {
        char s[41];
        const char *x = json_string_value(v);
        const size_t k = moetax_printable(s, sizeof s, x, SIZE_MAX, MOETAX_PRINTABLE_ASCII);
        snprintf(out, n, "the string \"%s\"%s", s, x[k] ? "..." : "");
    } else if (json_is_array(v)) snprintf(out, n, "an array of %zu", json_array_size(v));
    else snprintf(out, n, "%s", json_is_object(v) ? "an object" : json_is_boolean(v) ? "a boolean" : "null");
}

static moetax_status log_bad(const char *path, long line, const char *key, const json_t *v, const char *expected) {
    char got[96];
    log_describe(v, got, sizeof got);
    return moetax_error(MOETAX_ERR_FORMAT, "--log %s: line %ld: \"%s\" is %s, expected %s: the log is damaged (tune "
                        "writes no such entry); remove that line to measure it again, or give another --log", path,
                        line, key, got, expected);
}

/* A number an entry's reuse reads: present, a JSON number, finite, within [lo, hi] (above lo when lo_open). */
static moetax_status log_num(const char *path, long line, const char *key, const json_t *v, double lo, double hi,
                             bool lo_open) {
    const double x = json_number_value(v);
    if (json_is_number(v) && isfinite(x) && (lo_open ? x > lo : x >= lo) && x <= hi) return MOETAX_OK;
    char want[80];
    if (isinf(hi)) snprintf(want, sizeof want, "a finite number %s %g", lo_open ? ">" : ">=", lo);
    else snprintf(want, sizeof want, "a number in %c%g, %g]", lo_open ? '(' : '[', lo, hi);
    return log_bad(path, line, key, v, want);
}

/* An entry of the log, as quality_logged / speed_logged write it: what log_find matches (kind, stage, config)
 * and every field that their reuse reads, each present, of its type and in its range. A speed entry of an
 * older tune (none of ttft_ms, tpot_p50_ms, step_us, prompt: before they were logged) is matched only, to be
 * measured again (t->stale), so its other fields are not read and not checked. */
static moetax_status log_check_entry(const char *path, long line, const json_t *o) {
    if (!json_is_object(o)) {
        char got[96];
        log_describe(o, got, sizeof got);
        return moetax_error(MOETAX_ERR_FORMAT, "--log %s: line %ld is %s, expected an entry (a JSON object): the log "
                            "is damaged; remove that line, or give another --log", path, line, got);
    }
    const json_t *v = json_object_get(o, "kind");
    const char *kind = json_string_value(v);
    const bool is_speed = kind && !strcmp(kind, "speed");
    if (!kind || (!is_speed && strcmp(kind, "quality"))) return log_bad(path, line, "kind", v, "\"quality\" or \"speed\"");
    v = json_object_get(o, "stage");
    const json_int_t stage = json_integer_value(v);
    if (!json_is_integer(v) || (stage != 3 && stage != (is_speed ? 2 : 1)))
        return log_bad(path, line, "stage", v, is_speed ? "2 or 3 (a speed entry)" : "1 or 3 (a quality entry)");
    v = json_object_get(o, "config");
    if (!json_is_string(v) || !json_string_length(v) || json_string_length(v) >= 128)
        return log_bad(path, line, "config", v, "a configuration's name (1 to 127 characters)");
    moetax_status st = MOETAX_OK;
    if (!is_speed) {
        static const struct { const char *key; double lo, hi; bool lo_open; } q[] = {
            {"kl", 0, 1e6, false}, {"top1", 0, 1, false}, {"ppl", 1, INFINITY, false}, {"ppl_change", -1, INFINITY, true}};
        for (size_t i = 0; !st && i < sizeof q / sizeof *q; i++)
            st = log_num(path, line, q[i].key, json_object_get(o, q[i].key), q[i].lo, q[i].hi, q[i].lo_open);
        return st;
    }
    const char *newer[] = {"ttft_ms", "tpot_p50_ms", "step_us", "prompt"};
    bool any = false;
    for (size_t i = 0; i < sizeof newer / sizeof *newer; i++) any |= json_object_get(o, newer[i]) != NULL;
    if (!any) return MOETAX_OK;
    v = json_object_get(o, "prompt");
    if (!json_is_integer(v) || json_integer_value(v) < 1 || json_integer_value(v) > 1024)
        return log_bad(path, line, "prompt", v, "an integer in 1..1024 (--prompt)");
    static const struct { const char *key; double lo, hi; bool lo_open; } s[] = {
        {"speed_ratio", 0, 1e6, true}, {"tokens_per_s", 0, 1e9, true}, {"tax_share", 0, 1, false},
        {"p99_ms", 0, TUNE_LOG_DAY_MS, false}, {"tpot_p50_ms", 0, TUNE_LOG_DAY_MS, false},
        {"ttft_ms", 0, TUNE_LOG_DAY_MS, false}, {"step_us", 0, TUNE_LOG_DAY_US, false}};
    for (size_t i = 0; !st && i < sizeof s / sizeof *s; i++)
        st = log_num(path, line, s[i].key, json_object_get(o, s[i].key), s[i].lo, s[i].hi, s[i].lo_open);
    if (st) return st;
    v = json_object_get(o, "phase_us"); /* the ledger's phases, in enum moetax_phase's order */
    if (!json_is_array(v) || json_array_size(v) != MOETAX_PHASE_COUNT) {
        char want[64];
        snprintf(want, sizeof want, "an array of %d numbers (the ledger's phases)", MOETAX_PHASE_COUNT);
        return log_bad(path, line, "phase_us", v, want);
    }
    for (int p = 0; !st && p < MOETAX_PHASE_COUNT; p++) {
        char key[32];
        snprintf(key, sizeof key, "phase_us[%d]", p);
        st = log_num(path, line, key, json_array_get(v, (size_t)p), 0, TUNE_LOG_DAY_US, false);
    }
    return st;
}

/* --log /dev/null: nothing kept, nothing reused */
static bool is_null_device(const struct stat *sb) {
    struct stat nb;
    return S_ISCHR(sb->st_mode) && !stat("/dev/null", &nb) && S_ISCHR(nb.st_mode) && nb.st_rdev == sb->st_rdev;
}

/* Read an existing log (fd) into t->logged: its first line the header `hdr` (its keys compared: another
 * tuning's log is refused), then one entry a line (log_check_entry). *cut: where a last line cut by an
 * interruption (no newline, not JSON) starts, else -1; *nl_missing: the last line lacks its newline. */
static moetax_status log_read(struct tune *t, const char *path, int fd, const json_t *hdr, bool *have_hdr, off_t *cut,
                              bool *nl_missing) {
    FILE *f = fdopen(fd, "r");
    if (!f) {
        close(fd);
        return moetax_error(MOETAX_ERR_IO, "--log %s: cannot read: %s", path, strerror(errno));
    }
    char *buf = malloc(TUNE_LOG_LINE_MAX + 1);
    moetax_status st = buf ? MOETAX_OK : moetax_error(MOETAX_ERR_NOMEM, "out of memory");
    const char *untouched = "not a log tune wrote, so it is left untouched: give another --log";
    long line = 0;
    off_t off = 0;
    while (!st) {
        size_t n;
        bool nl;
        const enum log_line_status ls = log_getline(f, buf, &n, &nl);
        line++;
        if (ls == LOG_LINE_NUL)
            st = moetax_error(MOETAX_ERR_FORMAT, "--log %s: line %ld holds a NUL byte (at offset %lld): %s", path,
                              line, (long long)(off + (off_t)n), untouched);
        else if (ls == LOG_LINE_LONG)
            st = moetax_error(MOETAX_ERR_FORMAT, "--log %s: line %ld is longer than %d bytes, the most a log line may "
                              "be: %s", path, line, TUNE_LOG_LINE_MAX, untouched);
        else if (ls == LOG_LINE_IO)
            st = moetax_error(MOETAX_ERR_IO, "--log %s: cannot read line %ld: %s", path, line, strerror(errno));
        if (st || !n) break;
        json_error_t je;
        json_t *o = json_loadb(buf, n, JSON_REJECT_DUPLICATES, &je);
        const char *resumed = *have_hdr && !o && buf[0] == '{' ? strstr(buf + 1, "{\"kind\"") : NULL;
        if (resumed) { /* an older tune appended its next entry to a line an interruption had cut: that entry */
            o = json_loadb(resumed, n - (size_t)(resumed - buf), JSON_REJECT_DUPLICATES, &je);
            if (o) fprintf(stderr, "moetax tune: --log %s: line %ld begins with a line an interrupted run cut: that "
                           "part skipped\n", path, line);
        }
        if (!o) {
            if (*have_hdr && !nl && buf[0] == '{') { *cut = off; break; } /* the last entry, cut by an interruption */
            char key[48], in[64] = "";
            log_key_before(buf, n, (size_t)je.position, key, sizeof key);
            if (key[0]) snprintf(in, sizeof in, ", in \"%s\"", key);
            st = *have_hdr ? moetax_error(MOETAX_ERR_FORMAT, "--log %s: line %ld is not valid JSON (%s, column %d%s): the log "
                                          "is damaged; remove that line to measure it again, or give another --log",
                                          path, line, je.text, je.column, in)
                           : moetax_error(MOETAX_ERR_FORMAT, "--log %s: line 1 is not valid JSON (%s, column %d): %s", path,
                                          je.text, je.column, untouched);
            break;
        }
        if (!*have_hdr) { /* the header: what was tuned */
            if (!json_is_object(o) || !json_object_get(o, "moetax_tune_log"))
                st = moetax_error(MOETAX_ERR_FORMAT, "--log %s: line 1 is not a tune log's header (it has no "
                                  "\"moetax_tune_log\"): %s", path, untouched);
            const char *keys[] = {"moetax_tune_log", "model", "model_size", "model_mtime", "calib_tokens",
                                  "calib_hash", "workload", "cpus", "cpu", "kernels"};
            for (size_t k = 0; k < sizeof keys / sizeof *keys && !st; k++)
                if (!json_equal(json_object_get(o, keys[k]), json_object_get(hdr, keys[k]))) {
                    char *a = json_dumps(json_object_get(o, keys[k]), JSON_ENCODE_ANY),
                         *b = json_dumps(json_object_get(hdr, keys[k]), JSON_ENCODE_ANY);
                    st = moetax_error(MOETAX_ERR_ARG, "--log %s is of another tuning (%s %.200s there, %.200s now): "
                                      "not mixed; give another --log or remove it", path, keys[k], a ? a : "none",
                                      b ? b : "none");
                    free(a);
                    free(b);
                }
            json_decref(o);
            *have_hdr = true;
        } else if ((st = log_check_entry(path, line, o))) {
            json_decref(o);
        } else {
            json_t **nv = realloc(t->logged, sizeof *nv * (size_t)(t->n_logged + 1));
            if (!nv) { json_decref(o); st = moetax_error(MOETAX_ERR_NOMEM, "out of memory"); break; }
            t->logged = nv;
            t->logged[t->n_logged++] = o;
        }
        *nl_missing = !nl;
        off += (off_t)n;
    }
    free(buf);
    fclose(f);
    return st;
}

/* This machine's CPU as /proc/cpuinfo names it ("model name"; "" where it does not), into buf. */
static void cpu_model_name(char *buf, size_t n) {
    buf[0] = 0;
    FILE *f = fopen("/proc/cpuinfo", "r");
    if (!f) return;
    char line[512];
    while (fgets(line, sizeof line, f)) {
        if (strncmp(line, "model name", 10)) continue;
        const char *v = strchr(line, ':');
        if (!v) break;
        v++;
        while (*v == ' ' || *v == '\t') v++;
        snprintf(buf, n, "%.*s", (int)strcspn(v, "\n"), v);
        break;
    }
    fclose(f);
}

/* Open the log: the entries of an existing one whose header matches (model path, size, mtime, calibration
 * tokens and hash, workload, and the machine: online CPUs, CPU model, kernel table, since its speed ratios
 * are against this machine's default) are kept for reuse; another header is refused. Only a log tune wrote is read
 * and appended to: a directory, a device (but the null device: no log), a FIFO, a socket, and a file whose
 * first line is not a log's header or whose lines are not its entries are refused and left as they are.
 * All of it before anything is measured. */
static moetax_status log_open(struct tune *t, const char *path) {
    struct stat sb;
    if (stat(t->model_path, &sb)) return moetax_error(MOETAX_ERR_IO, "%s: cannot stat", t->model_path);
    char wl[32];
    snprintf(wl, sizeof wl, t->batch > 1 ? "batch:%d" : "decode", t->batch);
    char hash[16];
    snprintf(hash, sizeof hash, "%08x", hash_tokens(t->calib, t->n_calib));
    char cpu[256];
    cpu_model_name(cpu, sizeof cpu);
    const long ncpu = sysconf(_SC_NPROCESSORS_ONLN);
    /* the path and CPU name through cli_jstr: text that is not UTF-8 is a null there, not a failed header */
    json_t *hdr = json_pack("{s:i,s:o,s:I,s:I,s:I,s:s,s:s,s:I,s:o,s:s}", "moetax_tune_log", 1, "model",
                            cli_jstr(t->model_path), "model_size", (json_int_t)sb.st_size, "model_mtime",
                            (json_int_t)sb.st_mtime, "calib_tokens", (json_int_t)t->n_calib, "calib_hash", hash,
                            "workload", wl, "cpus", (json_int_t)(ncpu > 0 ? ncpu : 1), "cpu", cli_jstr(cpu), "kernels",
                            moetax_kernels_get()->name);
    if (!hdr) return moetax_error(MOETAX_ERR_NOMEM, "out of memory");
    moetax_status st = MOETAX_OK;
    bool have_hdr = false, nl_missing = false;
    off_t cut = -1;
    struct stat lb;
    /* O_NONBLOCK: opening a FIFO that has no writer would wait for one */
    int fd = open(path, O_RDONLY | O_NONBLOCK | O_CLOEXEC);
    const bool exists = fd >= 0;
    if (fd < 0 && errno != ENOENT) st = moetax_error(MOETAX_ERR_IO, "--log %s: cannot open: %s", path, strerror(errno));
    else if (exists && fstat(fd, &lb)) st = moetax_error(MOETAX_ERR_IO, "--log %s: cannot stat: %s", path, strerror(errno));
    else if (exists && S_ISDIR(lb.st_mode))
        st = moetax_error(MOETAX_ERR_ARG, "--log %s is a directory: give the path of a file (the log: one JSON line "
                          "per measurement)", path);
    else if (exists && is_null_device(&lb)) { /* no log kept */
        close(fd);
        json_decref(hdr);
        return MOETAX_OK;
    } else if (exists && !S_ISREG(lb.st_mode))
        st = moetax_error(MOETAX_ERR_ARG, "--log %s is not a regular file (a device, FIFO or socket): give the path "
                          "of a file (the log: one JSON line per measurement), or /dev/null for none", path);
    if (exists && st) close(fd);
    else if (exists) st = log_read(t, path, fd, hdr, &have_hdr, &cut, &nl_missing); /* closes fd */
    if (!st) { /* appended to: the file that was read (not one put in its place meanwhile), or a new one */
        int wfd = open(path, O_WRONLY | O_APPEND | O_CLOEXEC | (exists ? 0 : O_CREAT | O_EXCL), 0666);
        struct stat wb;
        if (wfd < 0) st = moetax_error(MOETAX_ERR_IO, "--log %s: cannot open for appending: %s", path, strerror(errno));
        else if (fstat(wfd, &wb) || !S_ISREG(wb.st_mode) ||
                 (exists && (wb.st_dev != lb.st_dev || wb.st_ino != lb.st_ino)))
            st = moetax_error(MOETAX_ERR_IO, "--log %s changed while it was read: not appended to", path);
        else if (cut >= 0 && ftruncate(wfd, cut))
            st = moetax_error(MOETAX_ERR_IO, "--log %s: cannot drop its cut last line: %s", path, strerror(errno));
        else if (!(t->log = fdopen(wfd, "a")))
            st = moetax_error(MOETAX_ERR_IO, "--log %s: cannot open for appending: %s", path, strerror(errno));
        if (st && wfd >= 0) close(wfd);
    }
    if (!st && cut >= 0)
        fprintf(stderr, "moetax tune: --log %s: its last line, cut by an interrupted run (no newline, not JSON), "
                "dropped\n", path);
    else if (!st && nl_missing) fputc('\n', t->log); /* the last line ended without its newline: the next one starts */
    if (!st && !have_hdr) {
        char *s = json_dumps(hdr, JSON_COMPACT);
        fprintf(t->log, "%s\n", s ? s : "{}");
        free(s);
    }
    if (!st && (fflush(t->log) || ferror(t->log)))
        st = moetax_error(MOETAX_ERR_IO, "--log %s: cannot write: %s", path, strerror(errno));
    json_decref(hdr);
    return st;
}

/* The logged measurement of `name` at `stage` (log_read checked every entry). A speed entry of an older
 * tune (no TTFT, TPOT p50 or per-token wall: before they were measured; no ubatch: its TTFT in micro-batches
 * of 64 tokens) or of another --prompt is not
 * reused: that configuration is measured again (t->stale counts them, said at the end); its quality
 * entries still are. */
static json_t *log_find(struct tune *t, const char *kind, int stage, const char *name) {
    for (int i = t->n_logged - 1; i >= 0; i--) {
        json_t *o = t->logged[i];
        if (strcmp(json_string_value(json_object_get(o, "kind")), kind) ||
            json_integer_value(json_object_get(o, "stage")) != stage ||
            strcmp(json_string_value(json_object_get(o, "config")), name))
            continue;
        if (!strcmp(kind, "speed") && (!json_object_get(o, "ttft_ms") ||
                                       json_integer_value(json_object_get(o, "prompt")) != t->prompt ||
                                       json_integer_value(json_object_get(o, "ubatch")) != MOETAX_UBATCH_DEFAULT))
            return NULL;
        return o;
    }
    return NULL;
}

/* Append a measurement of `name` to the log: only an entry that log_read would take back (a value that
 * is not a finite number cannot be written as JSON, and a later run would refuse the log); a write that
 * fails stops the log. Either is said on stderr: the measurement itself stands. */
static void log_put(struct tune *t, json_t *o, const char *name) {
    if (t->log) {
        if (!o || log_check_entry(t->log_path, 0, o)) {
            fprintf(stderr, "moetax tune: --log %s: the measurement of '%s' is not logged (a value that is not a "
                    "finite number, or outside what a log holds)\n", t->log_path, name);
        } else {
            char *s = json_dumps(o, JSON_COMPACT | JSON_REAL_PRECISION(17));
            if (!s || fprintf(t->log, "%s\n", s) < 0 || fflush(t->log)) {
                fprintf(stderr, "moetax tune: --log %s: cannot write (%s): the log stops here; the rest is measured "
                        "but not logged\n", t->log_path, s ? strerror(errno) : "out of memory");
                fclose(t->log);
                t->log = NULL;
            }
            free(s);
        }
    }
    json_decref(o);
}

static double jnum(json_t *o, const char *k) { return json_number_value(json_object_get(o, k)); }

/* The log's name of a quality measurement: what it depends on (same_quality) */
static void quality_name(const struct tcfg *c, char *name, size_t n) {
    char bs[16] = "";
    if (c->batch > 0) snprintf(bs, sizeof bs, " b%d", c->batch);
    snprintf(name, n, "k%d cf %g%s%s%s%s%s%s%s%s", c->k, (double)c->cap,
             c->cap > 0 && c->overflow == MOETAX_OVERFLOW_REROUTE ? " reroute" : "",
             c->etype != MOETAX_EXPERT_TYPE_AS_STORED ? " experts " : "",
             c->etype != MOETAX_EXPERT_TYPE_AS_STORED ? moetax_type_name(c->etype) : "", bs,
             c->kv != MOETAX_TYPE_F32 ? " kv " : "", c->kv != MOETAX_TYPE_F32 ? moetax_type_name(c->kv) : "",
             c->prefill != MOETAX_ATTN_PREFILL_ABSORBED ? " prefill " : "",
             c->prefill != MOETAX_ATTN_PREFILL_ABSORBED ? cli_mla_prefill_name(c->prefill) : "");
}

/* quality() through the log: the measurement of (k, capacity, expert type, batch) at this stage if logged */
static moetax_status quality_logged(struct tune *t, struct tres *r, int64_t n, bool is_long, int stage) {
    char name[128];
    quality_name(&r->c, name, sizeof name);
    json_t *o = log_find(t, "quality", stage, name);
    if (o) {
        r->kl = jnum(o, "kl"), r->top1 = jnum(o, "top1"), r->ppl = jnum(o, "ppl"), r->dppl = jnum(o, "ppl_change");
        r->q_long = is_long;
        t->reused++;
        return MOETAX_OK;
    }
    moetax_status st = quality(t, r, n, is_long);
    if (!st)
        log_put(t, json_pack("{s:s,s:i,s:s,s:I,s:f,s:f,s:f,s:f}", "kind", "quality", "stage", stage, "config", name,
                             "tokens", (json_int_t)n, "kl", r->kl, "top1", r->top1, "ppl", r->ppl, "ppl_change", r->dppl),
                name);
    return st;
}

/* speed() through the log */
static moetax_status speed_logged(struct tune *t, const struct tcfg *d, struct tres *r, int pairs, int steps, int stage) {
    char name[128];
    cfg_name(&r->c, name, sizeof name);
    json_t *o = log_find(t, "speed", stage, name);
    if (o) {
        r->ratio = jnum(o, "speed_ratio"), r->tps = jnum(o, "tokens_per_s"), r->tax = jnum(o, "tax_share");
        r->p99_ms = jnum(o, "p99_ms"), r->p50_ms = jnum(o, "tpot_p50_ms"), r->ttft_ms = jnum(o, "ttft_ms");
        r->step_us = jnum(o, "step_us");
        json_t *ph = json_object_get(o, "phase_us");
        for (int p = 0; p < MOETAX_PHASE_COUNT; p++) r->phase_us[p] = json_number_value(json_array_get(ph, (size_t)p));
        t->reused++;
        return MOETAX_OK;
    }
    for (int i = t->n_logged - 1; i >= 0; i--) { /* an older tune's entry for it: counted, not reused */
        json_t *x = t->logged[i];
        const char *k = json_string_value(json_object_get(x, "kind")),
                   *c = json_string_value(json_object_get(x, "config"));
        if (k && c && !strcmp(k, "speed") && !strcmp(c, name) &&
            json_integer_value(json_object_get(x, "stage")) == stage) {
            t->stale++;
            break;
        }
    }
    moetax_status st = speed(t, d, r, pairs, steps);
    if (!st) {
        json_t *ph = json_array();
        for (int p = 0; p < MOETAX_PHASE_COUNT; p++) json_array_append_new(ph, json_real(r->phase_us[p]));
        json_t *e = json_pack("{s:s,s:i,s:s,s:i,s:i,s:f,s:f,s:f,s:f,s:o}", "kind", "speed", "stage", stage, "config", name,
                              "pairs", pairs, "steps", steps, "speed_ratio", r->ratio, "tokens_per_s", r->tps, "tax_share",
                              r->tax, "p99_ms", r->p99_ms, "phase_us", ph);
        if (e) { /* a value that is not finite is left out here, and log_put refuses the entry */
            json_object_set_new(e, "tpot_p50_ms", json_real(r->p50_ms));
            json_object_set_new(e, "ttft_ms", json_real(r->ttft_ms));
            json_object_set_new(e, "step_us", json_real(r->step_us));
            json_object_set_new(e, "prompt", json_integer(t->prompt));
            json_object_set_new(e, "ubatch", json_integer(MOETAX_UBATCH_DEFAULT)); /* TTFT's micro-batches */
        }
        log_put(t, e, name);
    }
    return st;
}

/* ---- the prefill form (MLA) ------------------------------------------------------------------ */

/* After the recommendation, for an MLA model's decode workload: --mla-prefill auto (a prompt's micro-batch
 * decompressed where the cost model says it takes fewer operations, moetax_attn_prefill) against the absorbed
 * form on the recommended configuration, the TTFT of a --prompt-token prompt run alternately, and the
 * decompressed form's quality on the long calibration text (every window's micro-batches decompressed: the
 * most auto can change; logged like the other quality measurements, the TTFT pairs are not). Taken when auto's
 * median TTFT ratio is at most PREFILL_TAKE and that quality is within the bounds. Decode is the same either
 * way (one token per step is always absorbed), so the decode speed ratios do not see this lever. */
#define PREFILL_TAKE 0.95
#define PREFILL_PAIRS 7
_Static_assert(PREFILL_PAIRS <= TUNE_MAX_PAIRS, "the pairs' arrays");
struct prefill_res {
    bool tried, taken;
    bool q_long;                       /* quality on the long text (past --time: the short one) */
    bool identical;                    /* auto's prompt logits are the absorbed form's, bit for bit: at this prompt
                                          length the cost model keeps the absorbed form (nothing timed then) */
    const char *why;                   /* not tried, or not taken: why */
    int pairs;
    double ttft_abs, ttft_auto, ratio; /* medians of the pairs (ratio: of auto / absorbed per pair) */
    double kl, top1, dppl;             /* the recommended configuration with every micro-batch decompressed, against the
                                          exact distributions (long text) */
};

/* The logits of the last token of a --prompt-token prompt (the calibration text's first tokens) under c's
 * threads, k, KV cells and prefill form in micro-batches of speed_once's size (into out, the vocabulary's
 * floats): whether auto changes anything at this length. The store is left out (it changes no
 * bit), and so is the capacity factor (a batch workload's lever; this stage runs for the decode workload). */
static moetax_status prompt_logits(struct tune *t, const struct tcfg *c, float *out) {
    struct moetax_model *m;
    moetax_status st = model_for(t, c, &m);
    if (st) return st;
    const int P = t->prompt;
    struct moetax_ctx_params cp = {.n_ctx = (int32_t)((P + 31) / 32 * 32), .n_threads = c->threads, .n_expert_used = c->k,
                                   .n_ubatch = MOETAX_UBATCH_DEFAULT, .kv_type = c->kv, .attn_prefill = c->prefill};
    struct moetax_ctx *ctx = NULL;
    struct moetax_batch b = {0};
    if (!(st = moetax_ctx_init(m, &cp, &ctx)) && !(st = moetax_batch_init(&b, P))) {
        for (int i = 0; i < P; i++) moetax_batch_add(&b, t->calib[i % t->n_calib], i, 0, i == P - 1);
        if (!(st = moetax_ctx_decode(ctx, &b)))
            memcpy(out, moetax_ctx_logits_ith(ctx, P - 1), sizeof(float) * (size_t)m->hp.n_vocab);
    }
    moetax_batch_free(&b);
    moetax_ctx_free(ctx);
    return st;
}

static moetax_status prefill_stage(struct tune *t, const struct tcfg *rc, double max_loss, double max_kl,
                                   struct prefill_res *p) {
    struct tcfg ca = *rc, cb = *rc;
    cb.prefill = MOETAX_ATTN_PREFILL_ABSORBED;
    ca.prefill = MOETAX_ATTN_PREFILL_AUTO;
    const size_t V = (size_t)t->m[0][0]->hp.n_vocab;
    float *la = malloc(sizeof(float) * V), *lb = malloc(sizeof(float) * V);
    moetax_status st = la && lb ? MOETAX_OK : moetax_error(MOETAX_ERR_NOMEM, "out of memory");
    if (!st && !(st = prompt_logits(t, &cb, lb)) && !(st = prompt_logits(t, &ca, la)))
        p->identical = !memcmp(la, lb, sizeof(float) * V);
    free(la), free(lb);
    if (st) return st;
    p->tried = true;
    if (p->identical) {
        p->why = "auto's logits for the prompt are the absorbed form's, bit for bit: at this prompt length the cost "
                 "model keeps the absorbed form (a longer --prompt may decompress), or this configuration cannot "
                 "decompress";
        return MOETAX_OK;
    }
    /* the quality first (past --time on the short text only): a form outside the bounds is not timed */
    const bool late = cli_now() > t->t_end;
    struct tres q = {.c = *rc};
    q.c.prefill = MOETAX_ATTN_PREFILL_DECOMPRESSED;
    if ((st = late ? quality_logged(t, &q, t->n_short, false, 1) : quality_logged(t, &q, t->n_calib, true, 3))) return st;
    p->kl = q.kl, p->top1 = q.top1, p->dppl = q.dppl, p->q_long = !late;
    if (!(p->dppl <= max_loss)) {
        p->why = "with the decompressed form the perplexity change is beyond --max-quality-loss";
        return MOETAX_OK;
    }
    if (max_kl >= 0 && !(p->kl <= max_kl)) {
        p->why = "with the decompressed form the KL is beyond --max-kl";
        return MOETAX_OK;
    }
    /* pairs on the same prompt, the forms' order alternating (ABBA) */
    double ra[TUNE_MAX_PAIRS], ta[TUNE_MAX_PAIRS], tb[TUNE_MAX_PAIRS];
    const int pairs = late ? 3 : PREFILL_PAIRS;
    for (int i = 0; i < pairs; i++) {
        struct smeas sa, sb;
        const int64_t off = next_off(t);
        if (i % 2 == 0 ? (st = speed_once(t, &cb, 1, off, &sb)) || (st = speed_once(t, &ca, 1, off, &sa))
                       : (st = speed_once(t, &ca, 1, off, &sa)) || (st = speed_once(t, &cb, 1, off, &sb)))
            return st;
        tb[i] = sb.ttft_ms, ta[i] = sa.ttft_ms, ra[i] = sa.ttft_ms / sb.ttft_ms;
    }
    p->pairs = pairs;
    p->ratio = cli_percentile(ra, pairs, 0.5);
    p->ttft_abs = cli_percentile(tb, pairs, 0.5);
    p->ttft_auto = cli_percentile(ta, pairs, 0.5);
    p->taken = p->ratio <= PREFILL_TAKE;
    if (!p->taken)
        p->why = "auto's TTFT is not 5% below the absorbed form's: decompressing does not pay enough at this prompt "
                 "length on this machine";
    return MOETAX_OK;
}

/* The stage's result as JSON (--json's line, the -o file's "measured"), or NULL where it was not tried */
static json_t *prefill_json(const struct prefill_res *p, int prompt) {
    if (!p->tried && !p->why) return NULL;
    json_t *o = json_object();
    json_object_set_new(o, "kind", json_string("prefill_form"));
    if (!p->tried) {
        json_object_set_new(o, "prefill_form", json_null());
        json_object_set_new(o, "why", json_string(p->why));
        return o;
    }
    json_object_set_new(o, "prefill_form", json_string(p->taken ? "auto" : "absorbed"));
    json_object_set_new(o, "taken", json_boolean(p->taken));
    json_object_set_new(o, "prompt", json_integer(prompt));
    json_object_set_new(o, "identical", json_boolean(p->identical));
    if (p->identical) {
        json_object_set_new(o, "why", json_string(p->why));
        return o;
    }
    json_object_set_new(o, "pairs", json_integer(p->pairs));
    if (p->pairs) { /* timed (its quality within the bounds) */
        json_object_set_new(o, "ttft_ms_absorbed", cli_jnum(p->ttft_abs));
        json_object_set_new(o, "ttft_ms_auto", cli_jnum(p->ttft_auto));
        json_object_set_new(o, "ttft_ratio", cli_jnum(p->ratio));
    }
    json_object_set_new(o, "quality_text", json_string(p->q_long ? "long" : "short"));
    json_object_set_new(o, "kl", cli_jnum(p->kl));
    json_object_set_new(o, "top1", cli_jnum(p->top1));
    json_object_set_new(o, "ppl_change", cli_jnum(p->dppl));
    if (p->why) json_object_set_new(o, "why", json_string(p->why));
    return o;
}

/* The stage's result as one sentence (the table's line, the HTML page's paragraph); empty where it was not tried
 * and has nothing to say (a GQA model) */
static void prefill_sentence(const struct prefill_res *p, int prompt, char *buf, size_t n) {
    buf[0] = 0;
    if (!p->tried) {
        if (p->why) snprintf(buf, n, "prefill form (--mla-prefill): not tried: %s", p->why);
    } else if (p->identical)
        snprintf(buf, n, "prefill form (--mla-prefill, a %d-token prompt): not taken: %s", prompt, p->why);
    else if (!p->pairs)
        snprintf(buf, n, "prefill form (--mla-prefill, a %d-token prompt): not taken: %s (with every micro-batch "
                 "decompressed KL %.3g, perplexity %+.2f%% on the %s text)", prompt, p->why, p->kl, 100 * p->dppl,
                 p->q_long ? "long" : "short");
    else
        snprintf(buf, n, "prefill form (--mla-prefill, the recommended configuration, a %d-token prompt): auto's TTFT "
                 "%.2f ms against the absorbed form's %.2f ms (%.3fx, the median of %d alternating pairs); with every "
                 "micro-batch decompressed, its quality KL %.3g, top-1 %.1f%%, perplexity %+.2f%%: %s%s", prompt,
                 p->ttft_auto, p->ttft_abs, p->ratio, p->pairs, p->kl, 100 * p->top1, 100 * p->dppl,
                 p->taken ? "taken (--mla-prefill auto)" : "not taken: ", p->taken ? "" : p->why);
}

static void prefill_print(FILE *f, const struct prefill_res *p, int prompt) {
    char line[1024];
    prefill_sentence(p, prompt, line, sizeof line);
    if (line[0]) fprintf(f, "\n%s\n", line);
}

/* ---- the command ------------------------------------------------------------------------- */

/* stage 3's order: tier (the default, within the loss, within twice it), then the stage-2 speed */
static int cmp_stage3(const void *a, const void *b) {
    const struct tres *x = *(struct tres *const *)a, *y = *(struct tres *const *)b;
    if (x->tier != y->tier) return x->tier - y->tier;
    return (x->ratio < y->ratio) - (x->ratio > y->ratio);
}

static moetax_status write_html(const char *path, struct tres *res, int n, const struct tres *rec, const char *model,
                                const struct prefill_res *pf, int prompt) {
    struct moetax_outfile *out;
    moetax_status st = moetax_outfile_open(path, &out);
    if (st) return st;
    FILE *f = moetax_outfile_file(out);
    fprintf(f, "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>moetax tune</title><style>"
               "body{font-family:sans-serif;margin:24px;color:#222}td,th{border:1px solid #ccc;padding:3px 8px;"
               "font-size:13px}table{border-collapse:collapse}.tick{font-size:10px;fill:#444}</style></head><body>\n"
               "<h1>moetax tune</h1>\n<p>");
    moetax_report_html_text(f, model); /* a path is text, not markup */
    fputs("</p>\n", f);
    double kmax = 1e-6, rmin = 1e9, rmax = 0;
    for (int i = 0; i < n; i++)
        if (res[i].stage == 3) {
            kmax = fmax(kmax, res[i].kl);
            rmin = fmin(rmin, res[i].ratio);
            rmax = fmax(rmax, res[i].ratio);
        }
    if (rmax <= rmin) rmax = rmin + 0.1;
    const double W = 640, H = 360, L = 60, T = 20, cw = W - L - 20, ch = H - T - 40;
    fprintf(f, "<h2>Speed against quality (stage 3)</h2>\n<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%.0f\" "
               "height=\"%.0f\" role=\"img\" aria-label=\"pareto front\"><title>Speed ratio against KL divergence</title>\n"
               "<line x1=\"%.0f\" y1=\"%.0f\" x2=\"%.0f\" y2=\"%.0f\" stroke=\"#888\"/><line x1=\"%.0f\" y1=\"%.0f\" "
               "x2=\"%.0f\" y2=\"%.0f\" stroke=\"#888\"/>\n<text x=\"%.0f\" y=\"%.0f\" class=\"tick\">KL divergence "
               "(nats/token) to %.3g</text><text x=\"4\" y=\"%.0f\" class=\"tick\">%.2fx</text><text x=\"4\" y=\"%.0f\" "
               "class=\"tick\">%.2fx</text>\n", W, H, L, T + ch, L + cw, T + ch, L, T, L, T + ch, L, H - 8, kmax, T + 8,
            rmax, T + ch, rmin);
    for (int i = 0; i < n; i++) {
        if (res[i].stage != 3) continue;
        char name[128];
        cfg_name(&res[i].c, name, sizeof name);
        const double x = L + cw * res[i].kl / kmax, y = T + ch * (1 - (res[i].ratio - rmin) / (rmax - rmin));
        fprintf(f, "<circle cx=\"%.1f\" cy=\"%.1f\" r=\"%d\" fill=\"%s\"><title>%s: %.3fx, KL %.4g, ppl %+.2f%%</title>"
                   "</circle>\n", x, y, &res[i] == rec ? 7 : 4, res[i].pareto ? "#d62728" : res[i].fits ? "#1f5fa8" : "#aaaaaa", name, res[i].ratio,
                res[i].kl, 100 * res[i].dppl);
    }
    fputs("</svg>\n<p>Red: the Pareto front (no other configuration is both faster and closer to the exact "
          "distributions) among the configurations that fit; grey: does not fit --memory (the default as the reference of the ratios); the large point: the recommendation.</p>\n<table><tr><th>configuration</th><th>stage</th>"
          "<th>speed ratio</th><th>tokens/s</th><th>TTFT ms</th><th>TPOT p50 ms</th><th>TPOT p99 ms</th><th>KL</th>"
          "<th>top-1</th><th>perplexity</th><th>tax</th></tr>\n", f);
    for (int i = 0; i < n; i++) {
        char name[128];
        cfg_name(&res[i].c, name, sizeof name);
        fprintf(f, "<tr><td>%s%s</td><td>%d</td><td>%.3f</td><td>%.1f</td><td>%.2f</td><td>%.3f</td><td>%.3f</td><td>%.4g</td>"
                   "<td>%.1f%%</td><td>%+.2f%%</td><td>%.1f%%</td></tr>\n", name,
                &res[i] == rec ? " (recommended)" : res[i].fits ? "" : " (does not fit)", res[i].stage, res[i].ratio,
                res[i].tps, res[i].ttft_ms, res[i].p50_ms, res[i].p99_ms, res[i].kl, 100 * res[i].top1, 100 * res[i].dppl,
                100 * res[i].tax);
    }
    fputs("</table>\n", f);
    char line[1024];
    prefill_sentence(pf, prompt, line, sizeof line);
    if (line[0]) {
        fputs("<h2>Prefill form</h2>\n<p>", f);
        moetax_report_html_text(f, line);
        fputs("</p>\n", f);
    }
    fputs("</body></html>\n", f);
    if (ferror(f)) { moetax_outfile_abort(out); return moetax_error(MOETAX_ERR_IO, "%s: writing failed", path); }
    return moetax_outfile_commit(out);
}

/* The quality each lever of rec cost alone (the measured configuration with only that lever
 * moved from the default), then together: experts per token, expert type, capacity factor, KV cells;
 * threads, paging and the store cost none. Long-text figures where measured (*: short). */
static void explain_quality(const struct tres *res, int n, const struct tres *rec, const struct tcfg *def) {
    struct { const char *what; struct tcfg c; bool moved; char from[32], to[32]; } lv[5];
    lv[0].what = "experts per token", lv[0].c = (struct tcfg){.k = rec->c.k, .batch = def->batch};
    lv[0].moved = rec->c.k != def->k;
    snprintf(lv[0].from, sizeof lv[0].from, "%d", def->k), snprintf(lv[0].to, sizeof lv[0].to, "%d", rec->c.k);
    lv[1].what = "expert type", lv[1].c = (struct tcfg){.k = def->k, .batch = def->batch, .etype = rec->c.etype};
    lv[1].moved = rec->c.etype != MOETAX_EXPERT_TYPE_AS_STORED;
    snprintf(lv[1].from, sizeof lv[1].from, "as stored");
    snprintf(lv[1].to, sizeof lv[1].to, "%s", moetax_type_name(rec->c.etype));
    /* the capacity factor drops by the micro-batch's loads: alone means at the recommendation's batch size */
    lv[2].what = "capacity factor", lv[2].c = (struct tcfg){.k = def->k, .batch = rec->c.batch, .cap = rec->c.cap,
                                                           .overflow = rec->c.overflow};
    lv[2].moved = rec->c.cap > 0;
    snprintf(lv[2].from, sizeof lv[2].from, "off");
    snprintf(lv[2].to, sizeof lv[2].to, "%g%s", (double)rec->c.cap,
             rec->c.overflow == MOETAX_OVERFLOW_REROUTE ? " reroute" : "");
    lv[3].what = "batch size", lv[3].c = (struct tcfg){.k = def->k, .batch = rec->c.batch};
    lv[3].moved = rec->c.batch != def->batch;
    snprintf(lv[3].from, sizeof lv[3].from, "%d", def->batch > 1 ? def->batch : 1);
    snprintf(lv[3].to, sizeof lv[3].to, "%d", rec->c.batch > 1 ? rec->c.batch : 1);
    lv[4].what = "KV cells", lv[4].c = (struct tcfg){.k = def->k, .batch = def->batch, .kv = rec->c.kv};
    lv[4].moved = rec->c.kv != MOETAX_TYPE_F32;
    snprintf(lv[4].from, sizeof lv[4].from, "f32");
    snprintf(lv[4].to, sizeof lv[4].to, "%s", moetax_type_name(rec->c.kv));
    int moved = 0;
    printf("  quality (perplexity change, KL against the exact configuration):\n");
    for (int i = 0; i < 5; i++) {
        if (!lv[i].moved) continue;
        moved++;
        const struct tres *q = NULL;
        for (int j = 0; j < n && !q; j++)
            if (res[j].stage >= 1 && same_quality(&res[j].c, &lv[i].c)) q = &res[j];
        if (q)
            printf("    %-18s %s -> %s alone: %+.2f%%%s, KL %.3g\n", lv[i].what, lv[i].from, lv[i].to, 100 * q->dppl,
                   q->q_long ? "" : "*", q->kl);
        else printf("    %-18s %s -> %s alone: not measured\n", lv[i].what, lv[i].from, lv[i].to);
    }
    if (rec->c.budget) printf("    expert store       exact: no quality cost\n");
    if (moved > 1) printf("    together           %+.2f%%%s, KL %.3g\n", 100 * rec->dppl, rec->q_long ? "" : "*", rec->kl);
    if (!moved) printf("    none: threads, paging and the store change no bit of the result\n");
}

int cmd_tune(int argc, char **argv) {
    const char *model = NULL, *calib = NULL, *out = NULL, *html = NULL, *v = NULL, *logp = NULL;
    uint64_t memory = 0; /* --memory; 0: not given */
    double time_s = 600, max_loss = 0.01;
    int batch = 1, prompt = 64;
    double max_tpot = 0; /* --max-tpot MS (p99); 0: none */
    double max_kl = -1;  /* --max-kl X; < 0: none */
    bool explain = false, json = false;
    for (int i = 1; i < argc; i++) {
        bool err = false;
        if (cli_flag(argv, i, "-h", "--help")) { usage(stdout); return 0; }
        else if (cli_opt(argc, argv, &i, "-m", "--model", &model, &err)) { if (err) return 2; }
        else if (cli_opt(argc, argv, &i, NULL, "--calib", &calib, &err)) { if (err) return 2; }
        else if (cli_opt(argc, argv, &i, "-o", "--output", &out, &err)) { if (err) return 2; }
        else if (cli_opt(argc, argv, &i, NULL, "--html", &html, &err)) { if (err) return 2; }
        else if (cli_opt(argc, argv, &i, NULL, "--log", &logp, &err)) { if (err) return 2; }
        else if (cli_opt(argc, argv, &i, NULL, "--memory", &v, &err)) {
            if (err || !cli_parse_size(v, &memory) || memory < 1)
                return cli_usage_error("tune", "--memory: a size (e.g. 4G, 512M)");
        }
        else if (cli_opt(argc, argv, &i, NULL, "--time", &v, &err)) {
            char *end = NULL;
            double x = err ? -1 : strtod(v, &end);
            if (end && (*end == 'm' || *end == 's') && end[1] == 0) x *= *end == 'm' ? 60 : 1, end++;
            if (err || !end || *end || !(x >= 10 && x <= 86400)) return cli_usage_error("tune", "--time: 10s .. 24h (e.g. 10m, 90s)");
            time_s = x;
        } else if (cli_opt(argc, argv, &i, NULL, "--max-quality-loss", &v, &err)) {
            char *end = NULL;
            double x = err ? -1 : strtod(v, &end);
            if (end && *end == '%' && end[1] == 0) x /= 100, end++;
            if (err || !end || *end || !(x >= 0 && x < 10)) return cli_usage_error("tune", "--max-quality-loss: e.g. 1%% or 0.01");
            max_loss = x;
        } else if (cli_opt(argc, argv, &i, NULL, "--workload", &v, &err)) {
            int64_t nb = 0;
            if (!err && !strcmp(v, "decode")) batch = 1;
            else if (!err && !strncmp(v, "batch:", 6) && cli_parse_i64(v + 6, &nb) && nb >= 1 && nb <= 256) batch = (int)nb;
            else return cli_usage_error("tune", "--workload: decode or batch:N (N in 1..256)");
        } else if (cli_opt(argc, argv, &i, NULL, "--prompt", &v, &err)) {
            char *end = NULL;
            const long x = err ? -1 : strtol(v, &end, 10);
            if (err || !end || *end || x < 1 || x > 1024) return cli_usage_error("tune", "--prompt: tokens, 1..1024");
            prompt = (int)x;
        } else if (cli_opt(argc, argv, &i, NULL, "--max-tpot", &v, &err)) {
            char *end = NULL;
            const double x = err ? -1 : strtod(v, &end);
            if (err || !end || (*end && strcmp(end, "ms")) || !(x > 0))
                return cli_usage_error("tune", "--max-tpot: milliseconds (e.g. 20ms)");
            max_tpot = x;
        } else if (cli_opt(argc, argv, &i, NULL, "--max-kl", &v, &err)) {
            char *end = NULL;
            const double x = err ? -1 : strtod(v, &end);
            if (err || !end || *end || !(x >= 0 && x <= 100))
                return cli_usage_error("tune", "--max-kl: a divergence in nats, 0..100 (e.g. 0.01)");
            max_kl = x;
        } else if (!strcmp(argv[i], "--explain")) explain = true;
        else if (!strcmp(argv[i], "--json")) json = true;
        else return cli_usage_error("tune", "unknown option '%s'", argv[i]);
    }
    if (!model) model = cli_default_model_path();
    const char *outs[2] = {out, html}, *ins[2] = {model, calib};
    moetax_status st = cli_check_io(outs, 2, ins, 2);
    if (st) return cli_usage_error("tune", "%s", moetax_last_error());
    struct tune t = {.model_path = model, .batch = batch, .prompt = prompt, .window = 128};
    const double t0 = cli_now();
    t.t_end = t0 + time_s;
    struct moetax_tokenizer *tok = NULL;
    struct tres *res = NULL;
    int nres = 0;
    struct moetax_model *m0;
    if ((st = model_for(&t, &(struct tcfg){0}, &m0))) goto done;
    if (m0->hp.n_expert < 1) { st = moetax_error(MOETAX_ERR_ARG, "%s has no routed experts: nothing to tune", model); goto done; }
    if ((st = moetax_tokenizer_load(m0->gguf, &tok))) goto done;
    if ((st = calib_tokens(tok, calib, 2048, &t.calib, &t.n_calib))) goto done;
    char logbuf[4096];
    if (!logp) { /* beside -o, else in the working directory */
        const char *sl = out ? strrchr(out, '/') : NULL;
        if (sl) snprintf(logbuf, sizeof logbuf, "%.*s/tune.log", (int)(sl - out), out);
        else snprintf(logbuf, sizeof logbuf, "tune.log");
        logp = logbuf;
    }
    t.log_path = logp;
    if ((st = log_open(&t, logp))) goto done;
    t.n_short = t.n_calib / 4 > 128 ? t.n_calib / 4 : (t.n_calib < 128 ? t.n_calib : 128);
    const int64_t V = m0->hp.n_vocab, K = m0->hp.n_expert_used;
    const int ncpu = (int)sysconf(_SC_NPROCESSORS_ONLN) > 0 ? (int)sysconf(_SC_NPROCESSORS_ONLN) : 1;
    const struct tcfg def = {.threads = ncpu, .k = (int)K, .batch = batch > 1 ? batch : 0};
    /* the footprint, as bench's RSS bound: the weights resident (the file) + KV + the process's overhead; with a
     * store the routed experts' part of the file becomes the budget */
    struct stat fsb;
    const uint64_t fbytes = stat(model, &fsb) == 0 ? (uint64_t)fsb.st_size : 0, ebytes = cli_store_expert_bytes(m0);
    /* the KV cache at each cell type tried (F32: the default's; 0 where the model cannot take that type, as
     * Q8_0 cells on heads that are not whole blocks) */
    const enum moetax_type kvtypes[3] = {MOETAX_TYPE_F32, MOETAX_TYPE_F16, MOETAX_TYPE_Q8_0};
    uint64_t kvbt[3] = {0};
    for (int x = 0; x < 3; x++) {
        struct moetax_ctx_params cp = {.n_ctx = (int32_t)(batch * (2048 + prompt)), .n_threads = 1, .n_seq_max = batch,
                                       .kv_type = kvtypes[x]};
        struct moetax_ctx *c0;
        if ((st = moetax_ctx_init(m0, &cp, &c0))) {
            if (x == 0) goto done;
            st = MOETAX_OK;
            continue;
        }
        kvbt[x] = moetax_ctx_kv_bytes(c0);
        moetax_ctx_free(c0);
    }
    const uint64_t kvb = kvbt[0];
    const uint64_t fixed = (fbytes > ebytes ? fbytes - ebytes : 0) + kvb + CLI_RSS_OVERHEAD_BYTES,
                   full = fixed + ebytes;
    const bool fits = !memory || full <= memory; /* the default fits */
    {   /* the expert types tried: as stored, and the narrower ones re-quantized at load */
        enum moetax_type stored = MOETAX_TYPE_F32;
        for (int il = 0; il < m0->hp.n_layer; il++)
            if (m0->layers[il].is_moe) { stored = m0->layers[il].down_exps.type; break; }
        t.n_etypes = expert_types(stored, t.etypes);
    }
    uint64_t efoot[TUNE_ETYPES]; /* the footprint with the experts at each type, mapped (no store) */
    bool some_fit = fits;
    for (int e = 0; e < t.n_etypes; e++) {
        efoot[e] = fixed + expert_bytes_as(m0, t.etypes[e]);
        some_fit |= efoot[e] <= memory;
    }
    uint64_t budgets[3] = {0};
    int nbud = 0;
    if (memory) {
        printf("memory: the model's full footprint is %.1f MiB (weights %.1f MiB resident, of them routed experts %.1f "
               "MiB; KV %.1f MiB; overhead %.0f MiB) against --memory %.1f MiB: %s\n", (double)full / (1 << 20),
               (double)fbytes / (1 << 20), (double)ebytes / (1 << 20), (double)kvb / (1 << 20),
               (double)CLI_RSS_OVERHEAD_BYTES / (1 << 20), (double)memory / (1 << 20),
               fits ? "it fits (the expert store is offered only if it measures faster; it rarely does)"
                    : "it does not fit: configurations that fit are the candidates; the default is measured as the "
                      "reference of the speed ratios only");
        for (int e = 1; e < t.n_etypes; e++)
            printf("memory: with the routed experts as %s: %.1f MiB: %s\n", moetax_type_name(t.etypes[e]),
                   (double)efoot[e] / (1 << 20), efoot[e] <= memory ? "fits" : "does not fit");
        for (int x = 1; x < 3; x++)
            if (kvbt[x])
                printf("memory: with %s KV cells: %.1f MiB (KV %.1f MiB): %s\n", moetax_type_name(kvtypes[x]),
                       (double)(full - kvb + kvbt[x]) / (1 << 20), (double)kvbt[x] / (1 << 20),
                       full - kvb + kvbt[x] <= memory ? "fits" : "does not fit");
        /* the largest budget that fits (whole slots; at most the experts' size), 75% and 50% of it */
        const uint64_t maxb = memory > fixed ? memory - fixed : 0;
        const uint64_t all = moetax_model_store_bytes_all(m0), cap = all ? all : ebytes; /* every expert's slot */
        const uint64_t top = fits ? cap : (maxb < cap ? maxb : cap);
        const double share[3] = {1, 0.75, 0.5};
        for (int b = 0; b < 3; b++) {
            uint64_t bb = (uint64_t)((double)top * share[b]) / 4096 * 4096;
            int ub = 64;
            struct cli_store_opts so = {.n_expert_used = (int)K};
            struct moetax_store *s0 = NULL;
            if (!cli_store_open(m0, &so, bb > 4096 ? bb : 4096, &ub, &s0) && bb >= 4096) budgets[nbud++] = bb;
            else if (b == 0 && !some_fit) {
                /* the smallest budget the store accepts, from its message ("give at least X MiB") */
                char msg[512];
                snprintf(msg, sizeof msg, "%s", s0 ? "" : moetax_last_error());
                if (s0) { /* 4 KiB would do (never for a real model): ask with nothing */
                    moetax_store_free(s0);
                    s0 = NULL;
                    ub = 64;
                    if (cli_store_open(m0, &so, 1, &ub, &s0)) snprintf(msg, sizeof msg, "%s", moetax_last_error());
                }
                const char *e = strstr(msg, "at least ");
                double minmib = e ? atof(e + 9) : 0;
                uint64_t fmin = full;
                for (int x = 0; x < t.n_etypes; x++) fmin = efoot[x] < fmin ? efoot[x] : fmin;
                st = moetax_error(MOETAX_ERR_LIMIT, "--memory %.1f MiB: no configuration fits: the model needs %.1f MiB "
                                  "without the store (%.1f MiB with its experts at the narrowest type tried), and with "
                                  "it at least %.1f MiB (%.1f MiB besides the experts + the store's minimum budget "
                                  "%.3f MiB: %s)", (double)memory / (1 << 20), (double)full / (1 << 20),
                                  (double)fmin / (1 << 20), (double)fixed / (1 << 20) + minmib,
                                  (double)fixed / (1 << 20), minmib, e ? "one token's experts" : msg);
                moetax_store_free(s0);
                goto done;
            }
            moetax_store_free(s0);
            if (fits || (b == 0 && !nbud)) break; /* fits: the full budget only; none: no store */
        }
    }
    if (!(t.ref = malloc(sizeof(float) * (size_t)(t.n_calib * V)))) { st = moetax_error(MOETAX_ERR_NOMEM, "out of memory"); goto done; }
    {   /* the exact distributions: the file's k, no capacity factor, the experts as stored */
        struct ref_u r = {.t = &t, .V = V};
        if ((st = run_windows(&t, &def, t.n_calib, ref_row, &r))) goto done;
        t.ref_ppl[1] = exp(r.nll / (double)r.n);
        double nll = 0; /* the short text: its rows are the first ones (windows are causal) */
        for (int64_t j = 0; j + 1 < t.n_short; j++) nll -= t.ref[(size_t)j * (size_t)V + (size_t)t.calib[j + 1]];
        t.ref_ppl[0] = exp(nll / (double)(t.n_short - 1));
    }
    /* the candidates: the default first (the reference of every ratio, measured even where it does not fit), then
     * every (k, capacity, expert type) x threads x paging that fits, then the store's configurations */
    const float caps[5] = {0, 1.25f, 1.25f, 1.0f, 1.0f}; /* odd: overflow dropped, even (> 0): rerouted */
    const int ncap = batch > 1 ? 5 : 1;
    int bsz[10], nb = 0; /* batch sizes: N, then the powers of two below it down to 1; decode: one */
    bsz[nb++] = batch > 1 ? batch : 0;
    for (int x = 1 << 8; batch > 1 && x >= 1; x >>= 1)
        if (x < batch) bsz[nb++] = x;
    const int kmin = (int)((K + 1) / 2);
    res = calloc((size_t)(1 + ncpu * 2 * (K - kmin + 1) * ncap * t.n_etypes * nb + 3 * 2 * 2 + (K - kmin + 1) + 2),
                 sizeof *res);
    if (!res) { st = moetax_error(MOETAX_ERR_NOMEM, "out of memory"); goto done; }
    res[nres++] = (struct tres){.c = def};
    int n_nofit = 0, n_capsame = 0;
    for (int bi = 0; bi < nb; bi++)
    for (int k = (int)K; k >= kmin; k--)
        for (int ci = 0; ci < ncap; ci++)
            for (int e = 0; e < t.n_etypes; e++)
                for (int th = ncpu; th >= 1; th--)
                    for (int nm = 0; nm < 2; nm++) {
                        const struct tcfg c = {.threads = th, .k = k, .batch = bsz[bi], .cap = caps[ci], .no_mmap = nm,
                                               .etype = t.etypes[e],
                                               .overflow = ci && !(ci & 1) ? MOETAX_OVERFLOW_REROUTE : MOETAX_OVERFLOW_DROP};
                        if (is_default(&c, &def)) continue;
                        if (c.cap > 0) { /* a decode step's capacity per expert: ceil(C B k / E), at least 1 */
                            const int ec = ecap(c.cap, c.batch, k, (int)m0->hp.n_expert);
                            /* an expert takes at most one assignment per token: a capacity of B drops nothing (it is
                             * off); a capacity an earlier C gave at this B is that configuration again */
                            if (ec >= (c.batch > 1 ? c.batch : 1) || (ci > 2 && ecap(caps[ci - 2], c.batch, k,
                                                                                 (int)m0->hp.n_expert) == ec)) {
                                n_capsame += th == ncpu && !nm;
                                continue;
                            }
                        }
                        if (memory && efoot[e] > memory) { n_nofit++; continue; }
                        res[nres++] = (struct tres){.c = c};
                    }
    /* the store's configurations: exact (the same experts, read into slots), so their quality is the default's */
    const enum moetax_store_policy pols[2] = {MOETAX_STORE_NEXT_USE, MOETAX_STORE_LFU};
    for (int b = 0; b < nbud; b++)
        for (int pi = 0; pi < 2; pi++)
            for (int np = 0; np < 2; np++)
                res[nres++] = (struct tres){.c = {.threads = ncpu, .k = (int)K, .batch = def.batch, .budget = budgets[b],
                                                  .policy = pols[pi], .no_prefetch = np}};
    /* the KV cache's cells: F16 and Q8_0 (half and about a quarter of the default's F32 bytes; rounding of the
     * cached rows, so a quality lever), on the default otherwise */
    for (int x = 1; x < 3; x++)
        if (kvbt[x]) {
            struct tcfg c = def;
            c.kv = kvtypes[x];
            res[nres++] = (struct tres){.c = c};
        }
    /* the order of stages 1 and 2 (both cut by --time): by how many of the quality levers (k, expert type, capacity
     * factor, batch size) each moves from the default, so every lever alone is measured before combinations of them;
     * within one count as built (stable) */
    for (int i = 2; i < nres; i++) {
        const struct tres x = res[i];
        int j = i;
        while (j > 1 && levers_moved(&res[j - 1].c, &def) > levers_moved(&x.c, &def)) res[j] = res[j - 1], j--;
        res[j] = x;
    }
    const int n_single = nres; /* then the combinations (after stage 2) */
    for (int i = 0; i < nres; i++) {
        res[i].footprint = res[i].c.budget ? fixed + res[i].c.budget : efoot[etype_index(&t, res[i].c.etype)];
        for (int x = 1; x < 3; x++) /* the KV cache at its cells' type */
            if (res[i].c.kv == kvtypes[x]) res[i].footprint = res[i].footprint - kvb + kvbt[x];
        res[i].fits = !memory || res[i].footprint <= memory;
    }
    if (nbud)
        printf("memory: %d expert-store configurations (budgets", nbud * 4);
    for (int b = 0; b < nbud; b++) printf(" %.1f MiB", (double)budgets[b] / (1 << 20));
    if (nbud) printf("; next-use and lfu; prefetch on and off): exact, no quality cost, so their quality is not "
                     "measured (the default's is theirs)\n");
    if (n_nofit) printf("memory: %d configurations do not fit and are not measured\n", n_nofit);
    if (n_capsame && !json)
        printf("capacity factor: %d configurations left out: at their batch size the capacity per expert (ceil(C B k / "
               "E), at least 1) is B, which drops nothing, or the one a larger C gave\n", n_capsame);
    fprintf(stderr, "moetax tune: %s, %d configurations, calibration %lld tokens (short %lld), workload %s%d, %.0f s\n",
            model, nres, (long long)t.n_calib, (long long)t.n_short, batch > 1 ? "batch:" : "decode ", batch, time_s);
    /* speed runs long enough to beat the timer's and the machine's noise: steps for ~0.15 s of the
     * default (stage 2 takes one pair, stage 3 three) */
    int steps2 = 32, steps3 = 64, pairs3 = 3;
    {
        struct smeas sm;
        if ((st = speed_once(&t, &def, 32, next_off(&t), &sm))) goto done;
        const double per_step = (double)batch / (sm.tps > 0 ? sm.tps : 1);
        steps2 = (int)fmin(fmax(0.15 / per_step, 32), 2048);
        steps3 = (int)fmin(fmax(0.3 / per_step, 64), 4096);
        if (steps3 + 20 > t.n_calib) steps3 = (int)t.n_calib - 20, steps2 = steps2 < steps3 ? steps2 : steps3;
    }
    cli_progress pr;
    cli_progress_init(&pr, "tune", (uint64_t)nres * 3);
    uint64_t done_n = 0;
    /* stage 1: quality of each (k, capacity, expert type, batch) on the short text, shared by its threads/paging/
     * store; past half of --time only the default's and what the log holds (the others stay at stage 0) */
    int n_qcut = 0, nfit_q = 0; /* nfit_q: fitting configurations besides the default with a quality */
    for (int i = 0; i < nres && !st; i++) {
        struct tres *r = &res[i];
        const struct tres *same = NULL;
        for (int j = 0; j < i && !same; j++)
            if (same_quality(&res[j].c, &r->c) && res[j].stage >= 1) same = &res[j];
        if (same) { r->kl = same->kl; r->top1 = same->top1; r->ppl = same->ppl; r->dppl = same->dppl; }
        else {
            char qn[128];
            quality_name(&r->c, qn, sizeof qn);
            /* the default, and where it does not fit one that does, are always measured */
            if (i && (fits || !r->fits || nfit_q) && cli_now() > t0 + time_s / 2 && !log_find(&t, "quality", 1, qn)) {
                n_qcut++;
                continue;
            }
            struct tres q = {.c = {.threads = def.threads, .k = r->c.k, .batch = r->c.batch, .cap = r->c.cap,
                                   .overflow = r->c.overflow,
                                   .etype = r->c.etype, .kv = r->c.kv}};
            if ((st = quality_logged(&t, &q, t.n_short, false, 1))) break;
            r->kl = q.kl; r->top1 = q.top1; r->ppl = q.ppl; r->dppl = q.dppl;
        }
        r->stage = 1;
        nfit_q += i && r->fits;
        cli_progress_update(&pr, ++done_n);
    }
    /* stage 2: one short speed pair for those within twice the allowed loss */
    struct tres **live = malloc(sizeof *live * (size_t)(nres + K));
    int nlive = 0, nfit_live = 0;
    if (!live) st = moetax_error(MOETAX_ERR_NOMEM, "out of memory");
    const double loss2 = 2 * max_loss + 0.002;
    double pair2_s = 0; /* wall time of the stage-2 pairs measured (not reused from the log) */
    int n_pair2 = 0;
    for (int i = 0; i < nres && !st; i++) {
        char nm[128];
        cfg_name(&res[i].c, nm, sizeof nm);
        /* past --time only what the log holds, and the default and (where the default does not fit) one that fits */
        const bool must = is_default(&res[i].c, &def) || (!fits && res[i].fits && !nfit_live);
        if (res[i].stage < 1 || res[i].dppl > loss2 || (cli_now() > t.t_end && !must && !log_find(&t, "speed", 2, nm)))
            continue;
        const int reused0 = t.reused;
        const double ts0 = cli_now();
        if ((st = speed_logged(&t, &def, &res[i], 1, steps2, 2))) break;
        if (t.reused == reused0) pair2_s += cli_now() - ts0, n_pair2++;
        res[i].stage = 2;
        live[nlive++] = &res[i];
        nfit_live += res[i].fits && !is_default(&res[i].c, &def);
        cli_progress_update(&pr, ++done_n);
    }
    /* combinations among the survivors: the fastest store configuration with each smaller k that stage 1 kept (its
     * quality is that k's, the store being exact); precision x k is in the grid above (its quality is not additive) */
    const struct tres *bst = NULL;
    for (int i = 0; i < nlive; i++)
        if (live[i]->c.budget && (!bst || live[i]->ratio > bst->ratio)) bst = live[i];
    for (int k = (int)K - 1; bst && !st && k >= kmin; k--) {
        struct tres *r = &res[nres];
        *r = (struct tres){.c = bst->c, .footprint = bst->footprint, .fits = bst->fits};
        r->c.k = k;
        char nm[128];
        cfg_name(&r->c, nm, sizeof nm);
        if (cli_now() > t.t_end && !log_find(&t, "speed", 2, nm)) continue;
        const struct tres *q = NULL;
        for (int i = 0; i < n_single && !q; i++)
            if (res[i].stage >= 1 && same_quality(&res[i].c, &r->c)) q = &res[i];
        struct tres qm = {.c = {.threads = def.threads, .k = k, .batch = r->c.batch, .cap = r->c.cap,
                                .overflow = r->c.overflow, .kv = r->c.kv}};
        if (!q) { /* that k's mapped configurations did not fit --memory: its quality measured now */
            if ((st = quality_logged(&t, &qm, t.n_short, false, 1))) break;
            q = &qm;
        }
        if (q->dppl > loss2) continue;
        nres++;
        r->stage = 1;
        r->kl = q->kl, r->top1 = q->top1, r->ppl = q->ppl, r->dppl = q->dppl;
        if ((st = speed_logged(&t, &def, r, 1, steps2, 2))) break;
        r->stage = 2;
        live[nlive++] = r;
    }
    /* stage 3: the default, then the fitting survivors, those within the allowed loss on the short text first, each
     * group by its stage-2 speed; the better half of them (at least 3): long quality, three speed pairs. Past --time
     * the default and the first survivor (the most promising recommendation) still run, the rest only from the log */
    if (!st) {
        for (int i = 0; i < nlive; i++)
            live[i]->tier = is_default(&live[i]->c, &def) ? 0 : live[i]->dppl <= max_loss ? 1 : 2;
        qsort(live, (size_t)nlive, sizeof *live, cmp_stage3);
        int ncand = 0;
        for (int i = 0; i < nlive; i++) ncand += live[i]->tier > 0 && live[i]->fits;
        const int keep_c = ncand / 2 > 3 ? ncand / 2 : (ncand < 3 ? ncand : 3);
        /* pairs: 3, or as many as half of the time left allows for the default and keep_c candidates (a stage-2 pair's
         * measured time scaled to stage 3's steps; the other half is for the long quality runs and the margin) */
        if (n_pair2) {
            const double pair3_s = pair2_s / n_pair2 * (double)steps3 / steps2;
            const double left = t.t_end - cli_now();
            const int fit = (int)(0.5 * left / (pair3_s * (keep_c + 1)));
            pairs3 = fit < 3 ? 3 : fit > TUNE_MAX_PAIRS ? TUNE_MAX_PAIRS : fit;
        }
        bool cut = false;
        for (int i = 0, taken = 0; i < nlive && !st; i++) {
            struct tres *r = live[i];
            const bool is_def = r->tier == 0;
            if (!is_def && (!r->fits || taken++ >= keep_c)) continue;
            char nm[128];
            cfg_name(&r->c, nm, sizeof nm);
            if (cli_now() > t.t_end && !is_def && taken > 1 && !log_find(&t, "speed", 3, nm)) {
                if (!cut) fprintf(stderr, "\nmoetax tune: --time spent, stage 3 cut short\n");
                cut = true;
                continue;
            }
            const struct tres *same = NULL;
            for (int j = 0; j < nres && !same; j++)
                if (&res[j] != r && res[j].q_long && same_quality(&res[j].c, &r->c)) same = &res[j];
            if (same) { r->kl = same->kl; r->top1 = same->top1; r->ppl = same->ppl; r->dppl = same->dppl; r->q_long = true; }
            else if ((st = quality_logged(&t, r, t.n_calib, true, 3))) break;
            if ((st = speed_logged(&t, &def, r, pairs3, steps3, 3))) break;
            r->stage = 3;
            cli_progress_update(&pr, done_n += 2);
        }
    }
    cli_progress_done(&pr);
    free(live);
    if (st) goto done;
    /* the long text's quality for every configuration of the same (k, capacity, expert type) */
    for (int i = 0; i < nres; i++)
        if (res[i].q_long)
            for (int j = 0; j < nres; j++)
                if (!res[j].q_long && same_quality(&res[j].c, &res[i].c)) {
                    res[j].kl = res[i].kl, res[j].top1 = res[i].top1, res[j].ppl = res[i].ppl, res[j].dppl = res[i].dppl;
                    res[j].q_long = true;
                }
    /* the front and the recommendation: stage 3, configurations that fit only */
    struct tres *rec = NULL, *dres = NULL;
    for (int i = 0; i < nres; i++) {
        struct tres *r = &res[i];
        if (r->stage != 3) continue;
        if (is_default(&r->c, &def)) dres = r;
        r->pareto = r->fits;
        for (int j = 0; j < nres && r->pareto; j++)
            if (j != i && res[j].stage == 3 && res[j].fits && res[j].ratio >= r->ratio && res[j].kl <= r->kl &&
                (res[j].ratio > r->ratio || res[j].kl < r->kl))
                r->pareto = false;
        if (r->dppl <= max_loss && r->fits && (!max_tpot || r->p99_ms <= max_tpot) && (max_kl < 0 || r->kl <= max_kl) &&
            (!rec || r->ratio > rec->ratio))
            rec = r;
    }
    /* within 2% of the default is noise on these machines: then the default is the recommendation */
    const bool keep_default = rec && dres && dres->fits && (!max_tpot || dres->p99_ms <= max_tpot) &&
                              (rec == dres || rec->ratio < 1.02);
    const struct tres *best = rec;
    if (keep_default) rec = dres;
    struct prefill_res pf = {0};
    static char pf_err[320];
    if (rec && m0->hp.attn == MOETAX_ATTN_MLA) {
        if (batch > 1)
            pf.why = "a batch workload's prompts are prefilled together, and auto decompresses only a micro-batch of "
                     "one sequence's consecutive positions";
        else if ((st = prefill_stage(&t, &rec->c, max_loss, max_kl, &pf))) { /* the stage's failure keeps the rest */
            snprintf(pf_err, sizeof pf_err, "not measured: %s", moetax_last_error());
            moetax_clear_error();
            pf = (struct prefill_res){.why = pf_err};
            st = MOETAX_OK;
        }
    }
    if (json)
        for (int i = 0; i < nres; i++) {
            char name[128];
            cfg_name(&res[i].c, name, sizeof name);
            json_t *jo = cli_jobj("siiifbffffffb", "config", name, "stage", res[i].stage, "threads",
                                            res[i].c.threads, "experts_used", res[i].c.k, "capacity_factor",
                                            (double)res[i].c.cap, "no_mmap", res[i].c.no_mmap, "speed_ratio",
                                            res[i].ratio, "tokens_per_s", res[i].tps, "kl", res[i].kl, "top1", res[i].top1,
                                            "ppl_change", res[i].dppl, "tax_share", res[i].tax, "pareto", res[i].pareto);
            json_object_set_new(jo, "expert_budget_mib", json_real((double)res[i].c.budget / (1 << 20)));
            json_object_set_new(jo, "policy", res[i].c.budget ? json_string(moetax_store_policy_name(res[i].c.policy))
                                                              : json_null());
            json_object_set_new(jo, "prefetch", json_boolean(res[i].c.budget && !res[i].c.no_prefetch));
            json_object_set_new(jo, "expert_type", res[i].c.etype != MOETAX_EXPERT_TYPE_AS_STORED
                                                       ? json_string(moetax_type_name(res[i].c.etype)) : json_null());
            json_object_set_new(jo, "cache_type", json_string(moetax_type_name(res[i].c.kv)));
            json_object_set_new(jo, "fits", json_boolean(res[i].fits));
            json_object_set_new(jo, "footprint_mib", json_real((double)res[i].footprint / (1 << 20)));
            json_object_set_new(jo, "recommended", json_boolean(&res[i] == rec));
            json_object_set_new(jo, "batch", json_integer(res[i].c.batch > 1 ? res[i].c.batch : 1));
            json_object_set_new(jo, "overflow", res[i].c.cap > 0 ? json_string(res[i].c.overflow == MOETAX_OVERFLOW_REROUTE
                                                                                    ? "reroute" : "drop") : json_null());
            if (res[i].stage >= 2) { /* measured: TTFT, per-sequence TPOT, the ledger's decode phases per token */
                json_object_set_new(jo, "ttft_ms", json_real(res[i].ttft_ms));
                json_object_set_new(jo, "tpot_p50_ms", json_real(res[i].p50_ms));
                json_object_set_new(jo, "tpot_p99_ms", json_real(res[i].p99_ms));
                json_object_set_new(jo, "step_us_per_token", json_real(res[i].step_us));
                json_t *ph = json_object();
                for (int p = 0; p < MOETAX_PHASE_COUNT; p++)
                    json_object_set_new(ph, moetax_phase_name((enum moetax_phase)p), json_real(res[i].phase_us[p]));
                json_object_set_new(jo, "phase_us_per_token", ph);
            }
            cli_json_print(stdout, jo);
        }
    if (json) {
        json_t *pj = prefill_json(&pf, prompt);
        if (pj) cli_json_print(stdout, pj);
    } else {
        printf("moetax tune: %s, workload %s, exact perplexity %.3f on %lld calibration tokens\n\n", model,
               batch > 1 ? "batch" : "decode", t.ref_ppl[1], (long long)t.n_calib);
        printf("  %-44s %5s %8s %10s %8s %8s %8s %10s %7s %10s %7s %6s\n", "configuration", "stage", "speed", "tokens/s",
               "TTFT ms", "TPOT p50", "p99 ms", "KL", "top-1", "perplexity", "tax", "front");
        /* quality is of the long text where measured there (*: the short text only) */
        for (int i = 0; i < nres; i++) {
            if (res[i].stage < 2) continue;
            char name[128];
            cfg_name(&res[i].c, name, sizeof name);
            printf("  %-44s %5d %7.3fx %10.1f %8.2f %8.3f %8.3f %10.3g %6.1f%% %+9.2f%%%s %6.1f%% %6s%s%s\n", name,
                   res[i].stage, res[i].ratio, res[i].tps, res[i].ttft_ms, res[i].p50_ms, res[i].p99_ms, res[i].kl, 100 * res[i].top1, 100 * res[i].dppl, res[i].q_long ? " " : "*", 100 * res[i].tax,
                   res[i].pareto ? "yes" : "", &res[i] == rec ? "  <- recommended" : "",
                   res[i].fits ? "" : "  (does not fit --memory: the reference only)");
        }
        int dropped = 0, late = 0, q0 = 0;
        for (int i = 0; i < nres; i++) {
            dropped += res[i].stage == 1 && res[i].dppl > loss2;
            late += res[i].stage == 1 && res[i].dppl <= loss2;
            q0 += res[i].stage == 0;
        }
        if (dropped)
            printf("  (%d configurations stopped at stage 1: their perplexity rose by more than twice the %.1f%% allowed "
                   "on the short text)\n", dropped, 100 * max_loss);
        if (late) printf("  (%d configurations within it stopped at stage 1: --time spent before their speed)\n", late);
        if (q0)
            printf("  (%d configurations not measured: half of --time spent before their quality (%d measurements); "
                   "a longer --time or a rerun with this --log goes on)\n", q0, n_qcut);
        printf("\n  speed: paired ratio of decode tokens/s (all sequences) against the default (t%d k%lld%s), run alternately\n"
               "  (stage 2 one pair of %d steps, stage 3 the median of %d pairs of %d steps);\n"
               "  TTFT: the prefill of a %d-token prompt (each sequence's, together); TPOT: a decode step's time (each\n"
               "  sequence gets one token per step), p50 and p99 of the steps; KL: mean divergence of the next-token\n"
               "  distributions from the exact ones; perplexity: its change; tax: the ledger's tax phases' share\n",
               def.threads, (long long)K, batch > 1 ? " at the full batch" : "", steps2, pairs3, steps3, prompt);
    }
    if (!rec) {
        char tp[64] = "", kl[64] = "";
        if (max_tpot) snprintf(tp, sizeof tp, "has a p99 TPOT within %.3g ms and ", max_tpot);
        if (max_kl >= 0) snprintf(kl, sizeof kl, "has a KL within %.3g and ", max_kl);
        st = moetax_error(MOETAX_ERR_LIMIT, "no configuration measured in stage 3 %s%s%skeeps the perplexity within %.2f%% of "
                          "the exact one (raise --max-quality-loss%s%s%s or --time)", memory ? "fits --memory and " : "", tp, kl,
                          100 * max_loss, memory ? ", --memory" : "", max_tpot ? ", --max-tpot" : "",
                          max_kl >= 0 ? ", --max-kl" : "");
        goto done;
    }
    {
        char name[128];
        cfg_name(&best->c, name, sizeof name);
        if (!json) {
            if (keep_default)
            {
                char dn[128];
                cfg_name(&def, dn, sizeof dn);
                printf("\nrecommendation: the default configuration (%s): no configuration within %.1f%% of its "
                       "perplexity%s measured faster by more than noise (best %s at %.3fx)\n", dn, 100 * max_loss,
                       max_tpot || max_kl >= 0 ? " and the other bounds" : "", name, best->ratio);
            }
            else
                printf("\nrecommendation: %s: %.2fx the default's decode speed, perplexity %+.2f%%, KL %.3g, top-1 %.1f%%\n",
                       name, rec->ratio, 100 * rec->dppl, rec->kl, 100 * rec->top1);
            prefill_print(stdout, &pf, prompt);
        }
        if (explain && dres && !json) {
            printf("\nexplain (ledger, us per token, default -> recommended):\n");
            for (int p = 0; p < MOETAX_PHASE_COUNT; p++) {
                const double a = dres->phase_us[p], b = rec->phase_us[p];
                if (a < 0.05 && b < 0.05) continue;
                printf("  %-9s %-4s %9.1f -> %9.1f  (%+.1f)\n", moetax_phase_name((enum moetax_phase)p),
                       moetax_phase_is_tax((enum moetax_phase)p) ? "tax" : "work", a, b, b - a);
            }
            double sa = 0, sb = 0;
            for (int p = 0; p < MOETAX_PHASE_COUNT; p++) sa += dres->phase_us[p], sb += rec->phase_us[p];
            printf("  %-14s %9.1f -> %9.1f  (the phases' sum; wall per token %.1f -> %.1f)\n", "all", sa, sb,
                   dres->step_us, rec->step_us);
            printf("  tax share %.1f%% -> %.1f%%\n", 100 * dres->tax, 100 * rec->tax);
            if (sa > 0) { /* Amdahl: what the expert levers could give at most, from the default's own phases */
                const enum moetax_phase ex[] = {MOETAX_PHASE_ROUTE, MOETAX_PHASE_DISPATCH, MOETAX_PHASE_LOAD,
                                                MOETAX_PHASE_EXPERT, MOETAX_PHASE_COMBINE};
                double e = 0;
                for (size_t i = 0; i < sizeof ex / sizeof *ex; i++) e += dres->phase_us[ex[i]];
                printf("  the routed experts' own phases (route, dispatch, load, expert, combine) are %.1f%% of the "
                       "default's: through them\n  the expert levers (top-k, expert type, store) give at most %.2fx even at no "
                       "cost; the rest: attention %.1f%%,\n  wait %.1f%% (barriers; the expert levers shrink it too), "
                       "shared experts %.1f%%\n",
                       100 * e / sa, e < sa ? sa / (sa - e) : 0.0, 100 * dres->phase_us[MOETAX_PHASE_ATTN] / sa,
                       100 * dres->phase_us[MOETAX_PHASE_WAIT] / sa, 100 * dres->phase_us[MOETAX_PHASE_SHARED] / sa);
            }
            printf("  TTFT (%d-token prompt%s) %.2f -> %.2f ms; TPOT p50 %.3f -> %.3f ms, p99 %.3f -> %.3f ms\n", prompt,
                   batch > 1 ? "s, prefilled together" : "", dres->ttft_ms, rec->ttft_ms, dres->p50_ms, rec->p50_ms,
                   dres->p99_ms, rec->p99_ms);
            if (rec->c.batch != dres->c.batch)
                printf("  batch %d -> %d sequences: aggregate %.1f -> %.1f tokens/s\n", dres->c.batch > 1 ? dres->c.batch : 1,
                       rec->c.batch > 1 ? rec->c.batch : 1, dres->tps, rec->tps);
            explain_quality(res, nres, rec, &def);
            if (pf.taken)
                printf("  --mla-prefill auto: TTFT %.2f -> %.2f ms; the quality with every micro-batch decompressed (the "
                       "most auto changes): KL %.3g, perplexity %+.2f%%\n", pf.ttft_abs, pf.ttft_auto, pf.kl,
                       100 * pf.dppl);
        }
        if (out) {
            struct cli_config cc = {.threads = rec->c.threads, .experts_used = rec->c.k, .capacity_factor = rec->c.cap,
                                    .overflow = rec->c.overflow,
                                    .no_mmap = rec->c.no_mmap, .no_prefetch = rec->c.budget && rec->c.no_prefetch,
                                    .expert_type = rec->c.etype, .cache_type = rec->c.kv,
                                    .mla_prefill = pf.taken ? MOETAX_ATTN_PREFILL_AUTO : MOETAX_ATTN_PREFILL_ABSORBED};
            if (rec->c.budget) {
                snprintf(cc.expert_budget, sizeof cc.expert_budget, "%lluK", (unsigned long long)(rec->c.budget >> 10));
                snprintf(cc.policy, sizeof cc.policy, "%s", moetax_store_policy_name(rec->c.policy));
            }
            json_t *meas = json_object();
            json_object_set_new(meas, "model", json_string(model));
            json_object_set_new(meas, "workload", json_string(batch > 1 ? "batch" : "decode"));
            json_object_set_new(meas, "batch", json_integer(rec->c.batch > 1 ? rec->c.batch : 1));
            json_object_set_new(meas, "ttft_ms", json_real(pf.taken ? pf.ttft_auto : rec->ttft_ms));
            json_object_set_new(meas, "tpot_p50_ms", json_real(rec->p50_ms));
            json_object_set_new(meas, "tpot_p99_ms", json_real(rec->p99_ms));
            json_object_set_new(meas, "tax_share", json_real(rec->tax));
            json_object_set_new(meas, "speed_ratio", json_real(rec->ratio));
            json_object_set_new(meas, "tokens_per_s", json_real(rec->tps));
            json_object_set_new(meas, "kl", json_real(rec->kl));
            json_object_set_new(meas, "ppl_change", json_real(rec->dppl));
            json_object_set_new(meas, "top1", json_real(rec->top1));
            json_object_set_new(meas, "footprint_mib", json_real((double)rec->footprint / (1 << 20)));
            json_t *pj = prefill_json(&pf, prompt);
            if (pj) json_object_set_new(meas, "prefill", pj);
            json_t *extra = json_object();
            json_object_set_new(extra, "measured", meas);
            if ((st = cli_config_write(out, &cc, extra))) goto done;
            if (!json) printf("configuration written to %s (moetax run --config %s)\n", out, out);
        }
        if (html && (st = write_html(html, res, nres, rec, model, &pf, prompt))) goto done;
        if (html && !json) printf("HTML page written to %s\n", html);
    }
    fprintf(stderr, "moetax tune: %.0f s\n", cli_now() - t0);
done:
    if (t.reused) fprintf(stderr, "moetax tune: %d measurements reused from %s\n", t.reused, logp);
    if (t.stale)
        fprintf(stderr, "moetax tune: %d speed measurements in %s had no TTFT / TPOT / per-token wall (an older tune) or "
                "another --prompt: measured again (their quality was reused)\n", t.stale, logp);
    if (t.log) fclose(t.log);
    for (int i = 0; i < t.n_logged; i++) json_decref(t.logged[i]);
    free(t.logged);
    free(res);
    free(t.ref);
    free(t.calib);
    moetax_tokenizer_free(tok);
    for (int nm = 0; nm < 2; nm++)
        for (int e = 0; e < TUNE_ETYPES; e++) moetax_model_free(t.m[nm][e]);
    return st ? cli_fail("tune", st) : 0;
}
