/*
 * ledger.c - per-phase accounting, step records, trace spans and routing
 * records (see include/moetax/ledger.h for the design and the file format).
 */
#include "moetax/ledger.h"
#include "moetax/outfile.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static const char *k_phase_names[MOETAX_PHASE_COUNT] = {
    "route", "dispatch", "load", "comm", "wait", "combine", "expert",
    "shared", "attn", "dense", "norm", "head", "embd", "sample",
};

const char *moetax_phase_name(enum moetax_phase p) {
    return (unsigned)p < MOETAX_PHASE_COUNT ? k_phase_names[p] : "unknown";
}

bool moetax_phase_is_tax(enum moetax_phase p) { return (unsigned)p < MOETAX_PHASE_N_TAX; }

struct span {
    uint64_t t0, t1;
    int32_t step, tokens;
    int16_t worker, layer;
    uint8_t phase;
};

struct step_rec {
    int64_t step, tokens, pos;
    int64_t batch;  /* sequences decoded together */
    struct moetax_ledger_moe_stats moe;
    bool prefill;
    double wall_s;
    double *phase;  /* [(n_layer + 1) * P]: row 0 = layer -1 */
    double *busy;   /* [W] */
    double *wait;   /* [W] */
};

struct agg {
    struct moetax_ledger_moe_stats moe;
    int64_t steps, tokens;
    double wall_s;
    double *phase;  /* [(n_layer + 1) * P] */
    double *busy, *wait;
};

struct moetax_ledger {
    struct moetax_ledger_params p;
    bool enabled;
    int64_t n_rows;          /* (n_layer + 1) * P */
    /* current step, per worker, each on its own allocation (no false sharing) */
    uint64_t **acc;          /* [W][n_rows] ns */
    uint64_t *span_count;    /* [W * 8]: spans written by worker w at [w * 8] (a cache line each) */
    uint64_t t_step;
    int64_t cur_tokens, cur_pos, cur_batch;
    struct moetax_ledger_moe_stats cur_moe;
    bool cur_prefill;
    int64_t n_steps;
    /* window of step records */
    struct step_rec *win;
    int64_t win_n;           /* records written (the window holds the last min(win_n, window)) */
    struct agg all, dec, pre;
    /* trace ring */
    struct span *spans;
    int64_t n_spans;         /* spans written */
    /* routing ring */
    int k;
    int32_t *r_exp, *r_pred;
    float *r_w;
    int32_t *r_step;
    uint8_t *r_has_pred;     /* [window * n_layer] */
    uint8_t *r_valid;        /* [window * n_layer] */
    int64_t r_base;          /* tokens recorded before the current step */
    int64_t r_tokens;        /* tokens recorded so far */
    double span_cost_ns;
};

uint64_t moetax_ledger_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static bool agg_init(struct agg *a, int64_t rows, int W) {
    a->phase = calloc((size_t)rows, sizeof(double));
    a->busy = calloc((size_t)W, sizeof(double));
    a->wait = calloc((size_t)W, sizeof(double));
    return a->phase && a->busy && a->wait;
}

static void agg_free(struct agg *a) { free(a->phase); free(a->busy); free(a->wait); }

moetax_status moetax_ledger_init(const struct moetax_ledger_params *p, struct moetax_ledger **out) {
    *out = NULL;
    if (!p || p->n_workers < 1 || p->n_layer < 0 || p->window < 0 || p->trace_cap < 0 || p->routing_window < 0)
        return moetax_error(MOETAX_ERR_ARG, "ledger: invalid parameters");
    struct moetax_ledger *l = calloc(1, sizeof *l);
    if (!l) return moetax_error(MOETAX_ERR_NOMEM, "out of memory");
    l->p = *p;
    if (!l->p.window) l->p.window = 1024;
    l->enabled = true;
    const int W = p->n_workers;
    l->n_rows = (int64_t)(p->n_layer + 1) * MOETAX_PHASE_COUNT;
    bool ok = true;
    l->acc = calloc((size_t)W, sizeof *l->acc);
    l->span_count = calloc((size_t)W * 8, sizeof(uint64_t));
    ok = l->acc && l->span_count;
    for (int w = 0; ok && w < W; w++) ok = (l->acc[w] = calloc((size_t)l->n_rows, sizeof(uint64_t))) != NULL;
    l->win = calloc((size_t)l->p.window, sizeof *l->win);
    ok = ok && l->win;
    for (int i = 0; ok && i < l->p.window; i++) {
        l->win[i].phase = calloc((size_t)l->n_rows, sizeof(double));
        l->win[i].busy = calloc((size_t)W, sizeof(double));
        l->win[i].wait = calloc((size_t)W, sizeof(double));
        ok = l->win[i].phase && l->win[i].busy && l->win[i].wait;
    }
    ok = ok && agg_init(&l->all, l->n_rows, W) && agg_init(&l->dec, l->n_rows, W) && agg_init(&l->pre, l->n_rows, W);
    if (ok && p->trace_cap > 0) ok = (l->spans = malloc(sizeof *l->spans * (size_t)p->trace_cap)) != NULL;
    l->k = p->n_expert_used > 0 ? p->n_expert_used : 1;
    if (ok && p->routing_window > 0 && p->n_layer > 0) {
        size_t n = (size_t)p->routing_window * (size_t)p->n_layer;
        l->r_exp = malloc(n * (size_t)l->k * sizeof(int32_t));
        l->r_pred = malloc(n * (size_t)l->k * sizeof(int32_t));
        l->r_w = malloc(n * (size_t)l->k * sizeof(float));
        l->r_step = calloc((size_t)p->routing_window, sizeof(int32_t));
        l->r_has_pred = calloc(n, 1);
        l->r_valid = calloc(n, 1);
        ok = l->r_exp && l->r_pred && l->r_w && l->r_step && l->r_has_pred && l->r_valid;
    }
    if (!ok) {
        moetax_ledger_free(l);
        return moetax_error(MOETAX_ERR_NOMEM, "out of memory for the ledger");
    }
    /* cost of one span record: two clock reads and an add */
    uint64_t t0 = moetax_ledger_now();
    const int reps = 20000;
    for (int i = 0; i < reps; i++) {
        uint64_t a = moetax_ledger_now(), b = moetax_ledger_now();
        l->acc[0][i % l->n_rows] += b - a;
    }
    l->span_cost_ns = (double)(moetax_ledger_now() - t0) / reps;
    memset(l->acc[0], 0, sizeof(uint64_t) * (size_t)l->n_rows);
    *out = l;
    return MOETAX_OK;
}

void moetax_ledger_free(struct moetax_ledger *l) {
    if (!l) return;
    if (l->acc)
        for (int w = 0; w < l->p.n_workers; w++) free(l->acc[w]);
    free(l->acc);
    free(l->span_count);
    if (l->win)
        for (int i = 0; i < l->p.window; i++) { free(l->win[i].phase); free(l->win[i].busy); free(l->win[i].wait); }
    free(l->win);
    agg_free(&l->all);
    agg_free(&l->dec);
    agg_free(&l->pre);
    free(l->spans);
    free(l->r_exp); free(l->r_pred); free(l->r_w); free(l->r_step); free(l->r_has_pred); free(l->r_valid);
    free(l);
}

void moetax_ledger_enable(struct moetax_ledger *l, bool on) { l->enabled = on; }
bool moetax_ledger_enabled(const struct moetax_ledger *l) { return l && l->enabled; }
double moetax_ledger_span_cost_ns(struct moetax_ledger *l) { return l->span_cost_ns; }

void moetax_ledger_span(struct moetax_ledger *l, int w, enum moetax_phase ph, int layer, uint64_t t0, uint64_t t1) {
    if (!l || !l->enabled || w < 0 || w >= l->p.n_workers) return;
    if (layer < -1 || layer >= l->p.n_layer) layer = -1;
    uint64_t d = t1 > t0 ? t1 - t0 : 0;
    l->acc[w][(int64_t)(layer + 1) * MOETAX_PHASE_COUNT + ph] += d;
    if (l->spans && d) {
        /* ring slot: each worker owns slots w, w + W, ...; no sharing between workers */
        int64_t cap = l->p.trace_cap - l->p.trace_cap % l->p.n_workers;
        if (cap <= 0) return;
        uint64_t *cnt = &l->span_count[w * 8];
        int64_t slot = (int64_t)((*cnt * (uint64_t)l->p.n_workers + (uint64_t)w) % (uint64_t)cap);
        (*cnt)++;
        l->spans[slot] = (struct span){.t0 = t0, .t1 = t1, .step = (int32_t)l->n_steps,
                                       .tokens = (int32_t)l->cur_tokens, .worker = (int16_t)w,
                                       .layer = (int16_t)layer, .phase = (uint8_t)ph};
    }
}

void moetax_ledger_step_begin(struct moetax_ledger *l, int64_t tokens, int64_t pos, bool prefill) {
    if (!l) return;
    for (int w = 0; w < l->p.n_workers; w++) memset(l->acc[w], 0, sizeof(uint64_t) * (size_t)l->n_rows);
    l->cur_tokens = tokens;
    l->cur_pos = pos;
    l->cur_prefill = prefill;
    l->cur_batch = 1;
    memset(&l->cur_moe, 0, sizeof l->cur_moe);
    l->r_base = l->r_tokens;
    l->t_step = moetax_ledger_now();
}

static void moe_add(struct moetax_ledger_moe_stats *a, const struct moetax_ledger_moe_stats *b) {
    a->moe_layers += b->moe_layers;
    a->experts += b->experts;
    a->assignments += b->assignments;
    a->dropped += b->dropped;
    a->rerouted += b->rerouted;
    a->expert_bytes += b->expert_bytes;
    a->imbalance_sum += b->imbalance_sum;
}

static void agg_add(struct agg *a, const struct step_rec *r, int64_t rows, int W) {
    moe_add(&a->moe, &r->moe);
    a->steps++;
    a->tokens += r->tokens;
    a->wall_s += r->wall_s;
    for (int64_t i = 0; i < rows; i++) a->phase[i] += r->phase[i];
    for (int w = 0; w < W; w++) { a->busy[w] += r->busy[w]; a->wait[w] += r->wait[w]; }
}

void moetax_ledger_step_batch(struct moetax_ledger *l, int64_t n_seq) {
    if (l) l->cur_batch = n_seq;
}

void moetax_ledger_moe(struct moetax_ledger *l, int layer, int64_t experts, int64_t max_count, int64_t assignments,
                       double expert_bytes, int64_t dropped, int64_t rerouted) {
    if (!l || !l->enabled || layer < 0 || layer >= l->p.n_layer) return;
    struct moetax_ledger_moe_stats *m = &l->cur_moe;
    m->moe_layers++;
    m->experts += experts;
    m->assignments += assignments;
    m->dropped += dropped;
    m->rerouted += rerouted;
    m->expert_bytes += expert_bytes;
    /* most loaded expert / mean assignments per used expert: 1 when every used expert has as many */
    m->imbalance_sum += experts > 0 && assignments > 0 ? (double)max_count * (double)experts / (double)assignments : 1.0;
}

void moetax_ledger_moe_totals(const struct moetax_ledger *l, bool decode_only, struct moetax_ledger_moe_stats *out) {
    *out = (decode_only ? &l->dec : &l->all)->moe;
}

void moetax_ledger_step_end(struct moetax_ledger *l) {
    if (!l || !l->enabled) return;
    const int W = l->p.n_workers;
    struct step_rec *r = &l->win[l->win_n % l->p.window];
    r->step = l->n_steps;
    r->tokens = l->cur_tokens;
    r->pos = l->cur_pos;
    r->prefill = l->cur_prefill;
    r->batch = l->cur_batch;
    r->moe = l->cur_moe;
    r->wall_s = 1e-9 * (double)(moetax_ledger_now() - l->t_step);
    memset(r->phase, 0, sizeof(double) * (size_t)l->n_rows);
    for (int w = 0; w < W; w++) {
        double busy = 0, wait = 0;
        for (int64_t i = 0; i < l->n_rows; i++) {
            double s = 1e-9 * (double)l->acc[w][i];
            r->phase[i] += s / W;
            if (i % MOETAX_PHASE_COUNT == MOETAX_PHASE_WAIT) wait += s;
            else busy += s;
        }
        r->busy[w] = busy;
        r->wait[w] = wait;
    }
    agg_add(&l->all, r, l->n_rows, W);
    agg_add(r->prefill ? &l->pre : &l->dec, r, l->n_rows, W);
    l->win_n++;
    l->n_steps++;
}

void moetax_ledger_add(struct moetax_ledger *l, enum moetax_phase ph, int layer, double seconds) {
    if (!l || !l->enabled || l->win_n == 0) return;
    if (layer < -1 || layer >= l->p.n_layer) layer = -1;
    struct step_rec *r = &l->win[(l->win_n - 1) % l->p.window];
    int64_t i = (int64_t)(layer + 1) * MOETAX_PHASE_COUNT + ph;
    r->phase[i] += seconds;
    r->wall_s += seconds;
    struct agg *as[2] = {&l->all, r->prefill ? &l->pre : &l->dec};
    for (int k = 0; k < 2; k++) { as[k]->phase[i] += seconds; as[k]->wall_s += seconds; }
}

bool moetax_ledger_routing_on(const struct moetax_ledger *l) { return l && l->enabled && l->r_exp; }

void moetax_ledger_routing(struct moetax_ledger *l, int layer, int64_t n, const int32_t *experts, const float *weights,
                           const int32_t *predicted) {
    if (!moetax_ledger_routing_on(l) || layer < 0 || layer >= l->p.n_layer) return;
    const int k = l->k, L = l->p.n_layer;
    for (int64_t t = 0; t < n; t++) {
        int64_t tok = l->r_base + t;
        int64_t slot = tok % l->p.routing_window;
        size_t cell = (size_t)slot * (size_t)L + (size_t)layer;
        memcpy(l->r_exp + cell * (size_t)k, experts + t * k, sizeof(int32_t) * (size_t)k);
        memcpy(l->r_w + cell * (size_t)k, weights + t * k, sizeof(float) * (size_t)k);
        l->r_has_pred[cell] = predicted != NULL;
        if (predicted) memcpy(l->r_pred + cell * (size_t)k, predicted + t * k, sizeof(int32_t) * (size_t)k);
        l->r_valid[cell] = 1;
        l->r_step[slot] = (int32_t)l->n_steps;
        if (tok + 1 > l->r_tokens) {
            /* a new token: clear its other layers' cells (they may hold an old token) */
            for (int j = 0; j < L; j++)
                if (j != layer) l->r_valid[(size_t)slot * (size_t)L + (size_t)j] = 0;
            l->r_tokens = tok + 1;
        }
    }
}

void moetax_ledger_totals(const struct moetax_ledger *l, bool decode_only, double phase_s[MOETAX_PHASE_COUNT],
                          double *wall_s, int64_t *tokens, int64_t *steps) {
    const struct agg *a = decode_only ? &l->dec : &l->all;
    for (int p = 0; p < MOETAX_PHASE_COUNT; p++) {
        double s = 0;
        for (int r = 0; r <= l->p.n_layer; r++) s += a->phase[r * MOETAX_PHASE_COUNT + p];
        phase_s[p] = s;
    }
    if (wall_s) *wall_s = a->wall_s;
    if (tokens) *tokens = a->tokens;
    if (steps) *steps = a->steps;
}

double moetax_ledger_tax_share(const double phase_s[MOETAX_PHASE_COUNT]) {
    double tax = 0, total = 0;
    for (int p = 0; p < MOETAX_PHASE_COUNT; p++) {
        total += phase_s[p];
        if (moetax_phase_is_tax((enum moetax_phase)p)) tax += phase_s[p];
    }
    return total > 0 ? tax / total : 0;
}

void moetax_ledger_reset(struct moetax_ledger *l) {
    const int W = l->p.n_workers;
    struct agg *as[3] = {&l->all, &l->dec, &l->pre};
    for (int k = 0; k < 3; k++) {
        as[k]->steps = as[k]->tokens = 0;
        as[k]->wall_s = 0;
        memset(&as[k]->moe, 0, sizeof as[k]->moe);
        memset(as[k]->phase, 0, sizeof(double) * (size_t)l->n_rows);
        memset(as[k]->busy, 0, sizeof(double) * (size_t)W);
        memset(as[k]->wait, 0, sizeof(double) * (size_t)W);
    }
    l->win_n = 0;
    l->n_steps = 0;
    for (int w = 0; w < W; w++) l->span_count[w * 8] = 0;
    l->r_tokens = l->r_base = 0;
    if (l->r_valid) memset(l->r_valid, 0, (size_t)l->p.routing_window * (size_t)l->p.n_layer);
}

/* ---- output ----------------------------------------------------------------------- */

static void json_phase_map(FILE *f, const double *phase_rows, int n_layer) {
    fputc('{', f);
    for (int p = 0; p < MOETAX_PHASE_COUNT; p++) {
        double s = 0;
        for (int r = 0; r <= n_layer; r++) s += phase_rows[r * MOETAX_PHASE_COUNT + p];
        fprintf(f, "%s\"%s\": %.9g", p ? ", " : "", k_phase_names[p], s);
    }
    fputc('}', f);
}

static void json_rows(FILE *f, const double *phase_rows, int n_layer) {
    fputs("\"other_phase_s\": [", f);
    for (int p = 0; p < MOETAX_PHASE_COUNT; p++) fprintf(f, "%s%.9g", p ? ", " : "", phase_rows[p]);
    fputs("], \"layer_phase_s\": [", f);
    for (int r = 1; r <= n_layer; r++) {
        fputs(r > 1 ? ", [" : "[", f);
        for (int p = 0; p < MOETAX_PHASE_COUNT; p++)
            fprintf(f, "%s%.9g", p ? ", " : "", phase_rows[r * MOETAX_PHASE_COUNT + p]);
        fputc(']', f);
    }
    fputc(']', f);
}

static void json_vec(FILE *f, const char *name, const double *v, int n) {
    fprintf(f, "\"%s\": [", name);
    for (int i = 0; i < n; i++) fprintf(f, "%s%.9g", i ? ", " : "", v[i]);
    fputc(']', f);
}

/* , "moe": {...}: a step's (or a sum of steps') MoE batch figures */
static void json_moe(FILE *f, const struct moetax_ledger_moe_stats *m) {
    fprintf(f, ", \"moe\": {\"layers\": %lld, \"experts\": %lld, \"assignments\": %lld, \"expert_bytes\": %.17g, "
            "\"imbalance_sum\": %.17g, \"dropped\": %lld, \"rerouted\": %lld}",
            (long long)m->moe_layers, (long long)m->experts, (long long)m->assignments, m->expert_bytes,
            m->imbalance_sum, (long long)m->dropped, (long long)m->rerouted);
}

static void json_agg(FILE *f, const struct moetax_ledger *l, const struct agg *a) {
    fprintf(f, "{\"steps\": %lld, \"tokens\": %lld, \"wall_s\": %.9g, \"phase_s\": ", (long long)a->steps,
            (long long)a->tokens, a->wall_s);
    json_phase_map(f, a->phase, l->p.n_layer);
    fputs(", ", f);
    json_rows(f, a->phase, l->p.n_layer);
    fputs(", ", f);
    json_vec(f, "worker_busy_s", a->busy, l->p.n_workers);
    fputs(", ", f);
    json_vec(f, "worker_wait_s", a->wait, l->p.n_workers);
    if (a->moe.moe_layers) json_moe(f, &a->moe);
    fputc('}', f);
}

/* Bytes of the well-formed UTF-8 sequence at s (Unicode's table 3-7: no overlong forms, no surrogates,
 * nothing past U+10FFFF), 0 where there is none. */
static int utf8_seq(const unsigned char *s) {
    const unsigned char c = s[0];
    int n;
    unsigned char lo = 0x80, hi = 0xBF;
    if (c >= 0xC2 && c <= 0xDF) n = 2;
    else if (c >= 0xE0 && c <= 0xEF) n = 3, lo = c == 0xE0 ? 0xA0 : 0x80, hi = c == 0xED ? 0x9F : 0xBF;
    else if (c >= 0xF0 && c <= 0xF4) n = 4, lo = c == 0xF0 ? 0x90 : 0x80, hi = c == 0xF4 ? 0x8F : 0xBF;
    else return 0;
    if (s[1] < lo || s[1] > hi) return 0;
    for (int i = 2; i < n; i++)
        if (s[i] < 0x80 || s[i] > 0xBF) return 0;
    return n;
}

/* A JSON string: a byte that is not part of well-formed UTF-8 (a path in another encoding) is U+FFFD,
 * since JSON readers refuse it (report, and Python's json, rejected such a ledger whole). */
static void json_str(FILE *f, const char *s) {
    fputc('"', f);
    for (const unsigned char *p = (const unsigned char *)s; p && *p;) {
        const unsigned char c = *p;
        if (c == '"' || c == '\\') fprintf(f, "\\%c", c);
        else if (c < 0x20) fprintf(f, "\\u%04x", c);
        else if (c < 0x80) fputc(c, f);
        else {
            const int n = utf8_seq(p);
            if (n) fwrite(p, 1, (size_t)n, f), p += n;
            else fputs("\\ufffd", f), p++;
            continue;
        }
        p++;
    }
    fputc('"', f);
}

moetax_status moetax_ledger_write_json(const struct moetax_ledger *l, const struct moetax_ledger_meta *meta,
                                       const char *path) {
    /* a temporary file renamed into place: a full disk never leaves a truncated ledger */
    struct moetax_outfile *out;
    moetax_status ost = moetax_outfile_open(path, &out);
    if (ost) return ost;
    FILE *f = moetax_outfile_file(out);
    const int L = l->p.n_layer;
    fputs("{\"moetax_ledger\": 1, \"model\": ", f);
    json_str(f, meta && meta->model ? meta->model : "");
    fprintf(f, ", \"threads\": %d, \"n_layer\": %d, \"n_expert\": %d, \"n_expert_used\": %d, \"moe_layers\": [",
            l->p.n_workers, L, meta ? meta->n_expert : 0, meta ? meta->n_expert_used : 0);
    for (int i = 0; meta && i < meta->n_moe_layers; i++) fprintf(f, "%s%d", i ? ", " : "", meta->moe_layers[i]);
    fputs("],\n \"phases\": [", f);
    for (int p = 0; p < MOETAX_PHASE_COUNT; p++) fprintf(f, "%s\"%s\"", p ? ", " : "", k_phase_names[p]);
    fputs("], \"tax_phases\": [", f);
    for (int p = 0; p < MOETAX_PHASE_N_TAX; p++) fprintf(f, "%s\"%s\"", p ? ", " : "", k_phase_names[p]);
    fprintf(f, "],\n \"overhead\": {\"span_ns\": %.2f},\n \"steps\": [", l->span_cost_ns);
    int64_t first = l->win_n > l->p.window ? l->win_n - l->p.window : 0;
    for (int64_t i = first; i < l->win_n; i++) {
        const struct step_rec *r = &l->win[i % l->p.window];
        fprintf(f, "%s\n  {\"step\": %lld, \"kind\": \"%s\", \"tokens\": %lld, \"pos\": %lld, \"batch\": %lld, "
                "\"wall_s\": %.9g, \"phase_s\": ",
                i > first ? "," : "", (long long)r->step, r->prefill ? "prefill" : "decode", (long long)r->tokens,
                (long long)r->pos, (long long)r->batch, r->wall_s);
        json_phase_map(f, r->phase, L);
        fputs(", ", f);
        json_rows(f, r->phase, L);
        fputs(", ", f);
        json_vec(f, "worker_busy_s", r->busy, l->p.n_workers);
        fputs(", ", f);
        json_vec(f, "worker_wait_s", r->wait, l->p.n_workers);
        if (r->moe.moe_layers) json_moe(f, &r->moe);
        fputc('}', f);
    }
    fputs("],\n \"totals\": ", f);
    /* totals with decode/prefill sub-objects */
    json_agg(f, l, &l->all);
    fseek(f, -1, SEEK_CUR);
    fputs(", \"decode\": ", f);
    json_agg(f, l, &l->dec);
    fputs(", \"prefill\": ", f);
    json_agg(f, l, &l->pre);
    fputs("},\n \"routing\": ", f);
    if (!l->r_exp) fputs("null", f);
    else {
        int64_t n = l->r_tokens < l->p.routing_window ? l->r_tokens : l->p.routing_window;
        int64_t t0 = l->r_tokens - n;
        fprintf(f, "{\"tokens\": %lld, \"first_token\": %lld, \"layers\": [", (long long)n, (long long)t0);
        bool first_layer = true;
        for (int layer = 0; layer < L; layer++) {
            bool any = false;
            for (int64_t t = t0; t < l->r_tokens && !any; t++)
                any = l->r_valid[(size_t)(t % l->p.routing_window) * (size_t)L + (size_t)layer];
            if (!any) continue;
            fprintf(f, "%s\n  {\"layer\": %d, \"step\": [", first_layer ? "" : ",", layer);
            first_layer = false;
            for (int64_t t = t0; t < l->r_tokens; t++)
                fprintf(f, "%s%d", t > t0 ? "," : "", l->r_step[t % l->p.routing_window]);
            const char *names[3] = {"experts", "weights", "predicted"};
            for (int kind = 0; kind < 3; kind++) {
                fprintf(f, "], \"%s\": [", names[kind]);
                for (int64_t t = t0; t < l->r_tokens; t++) {
                    size_t cell = (size_t)(t % l->p.routing_window) * (size_t)L + (size_t)layer;
                    if (t > t0) fputc(',', f);
                    if (!l->r_valid[cell] || (kind == 2 && !l->r_has_pred[cell])) { fputs("null", f); continue; }
                    fputc('[', f);
                    for (int j = 0; j < l->k; j++) {
                        if (kind == 1) fprintf(f, "%s%.6g", j ? "," : "", l->r_w[cell * (size_t)l->k + (size_t)j]);
                        else fprintf(f, "%s%d", j ? "," : "", (kind ? l->r_pred : l->r_exp)[cell * (size_t)l->k + (size_t)j]);
                    }
                    fputc(']', f);
                }
            }
            fputs("]}", f);
        }
        fputs("]}", f);
    }
    if (meta && meta->store_json) fprintf(f, ",\n \"store\": %s", meta->store_json);
    fprintf(f, ",\n \"dropped_steps\": %lld}\n", (long long)first);
    return moetax_outfile_commit(out);
}

moetax_status moetax_ledger_write_trace(const struct moetax_ledger *l, const char *path) {
    return moetax_ledger_write_trace_ex(l, path, NULL);
}

/* Spans of the extra processes (moetax_trace_extra) as "X" events of process pid, on thread tid
 * (< 0: each span's own track). */
static void write_extra_spans(FILE *f, const struct moetax_trace_span *sp, int64_t n, int pid, int tid, uint64_t tmin) {
    for (int64_t i = 0; i < n; i++) {
        const struct moetax_trace_span *s = &sp[i];
        fprintf(f, ",\n  {\"name\": \"%s\", \"cat\": \"%s\", \"ph\": \"X\", \"ts\": %.3f, \"dur\": %.3f, \"pid\": %d, "
                   "\"tid\": %d, \"args\": {%s}}",
                s->name, s->cat, 1e-3 * (double)(s->t0 - tmin), 1e-3 * (double)(s->t1 > s->t0 ? s->t1 - s->t0 : 0), pid,
                tid < 0 ? s->track : tid, s->args);
    }
}

moetax_status moetax_ledger_write_trace_ex(const struct moetax_ledger *l, const char *path,
                                           const struct moetax_trace_extra *x) {
    if (!l->spans) return moetax_error(MOETAX_ERR_ARG, "the ledger was created without a trace buffer");
    struct moetax_outfile *out;
    moetax_status ost = moetax_outfile_open(path, &out);
    if (ost) return ost;
    FILE *f = moetax_outfile_file(out);
    const int W = l->p.n_workers;
    int64_t cap = l->p.trace_cap - l->p.trace_cap % W;
    uint64_t tmin = UINT64_MAX;
    int64_t total = 0, dropped = 0;
    for (int w = 0; w < W; w++) {
        int64_t c = (int64_t)l->span_count[w * 8];
        int64_t per = cap / W;
        total += c < per ? c : per;
        dropped += c > per ? c - per : 0;
    }
    for (int w = 0; w < W; w++) {
        int64_t c = (int64_t)l->span_count[w * 8], per = cap / W;
        for (int64_t i = 0; i < (c < per ? c : per); i++) {
            const struct span *s = &l->spans[(i * W + w) % cap];
            if (s->t0 < tmin) tmin = s->t0;
        }
    }
    const int64_t nx = x && x->spans ? x->n_spans : 0, no = x && x->spans2 && x->process2 ? x->n_spans2 : 0;
    for (int64_t i = 0; i < nx; i++)
        if (x->spans[i].t0 < tmin) tmin = x->spans[i].t0;
    for (int64_t i = 0; i < no; i++)
        if (x->spans2[i].t0 < tmin) tmin = x->spans2[i].t0;
    fprintf(f, "{\"displayTimeUnit\": \"ms\", \"otherData\": {\"producer\": \"moetax\", \"spans\": %lld, \"dropped_spans\": %lld, "
               "\"t0_ns\": %llu%s%s},\n \"traceEvents\": [\n", (long long)total, (long long)dropped,
            (unsigned long long)(tmin == UINT64_MAX ? 0 : tmin), x && x->other_json ? ", \"store\": " : "",
            x && x->other_json ? x->other_json : "");
    fprintf(f, "  {\"name\": \"process_name\", \"ph\": \"M\", \"pid\": 0, \"tid\": 0, \"args\": {\"name\": \"moetax\"}}");
    for (int w = 0; w < W; w++)
        fprintf(f, ",\n  {\"name\": \"thread_name\", \"ph\": \"M\", \"pid\": 0, \"tid\": %d, \"args\": {\"name\": \"worker %d\"}}", w, w);
    for (int w = 0; w < W; w++) {
        int64_t c = (int64_t)l->span_count[w * 8], per = cap / W;
        int64_t start = c > per ? c - per : 0;
        for (int64_t i = start; i < c; i++) {
            const struct span *s = &l->spans[(i * W + w) % cap];
            fprintf(f, ",\n  {\"name\": \"%s\", \"cat\": \"%s\", \"ph\": \"X\", \"ts\": %.3f, \"dur\": %.3f, \"pid\": 0, "
                       "\"tid\": %d, \"args\": {\"layer\": %d, \"step\": %d, \"tokens\": %d}}",
                    k_phase_names[s->phase], moetax_phase_is_tax((enum moetax_phase)s->phase) ? "tax" : "work",
                    1e-3 * (double)(s->t0 - tmin), 1e-3 * (double)(s->t1 - s->t0), s->worker, s->layer, s->step,
                    s->tokens);
        }
    }
    if (x && x->n_tracks > 0) {
        fprintf(f, ",\n  {\"name\": \"process_name\", \"ph\": \"M\", \"pid\": 1, \"tid\": 0, \"args\": {\"name\": \"%s\"}}",
                x->process ? x->process : "tracks");
        for (int t = 0; t < x->n_tracks; t++)
            fprintf(f, ",\n  {\"name\": \"thread_name\", \"ph\": \"M\", \"pid\": 1, \"tid\": %d, \"args\": {\"name\": \"%s\"}}",
                    t, x->track_names[t]);
    }
    write_extra_spans(f, x ? x->spans : NULL, nx, 1, -1, tmin);
    if (no > 0)
        fprintf(f, ",\n  {\"name\": \"process_name\", \"ph\": \"M\", \"pid\": 2, \"tid\": 0, \"args\": {\"name\": \"%s\"}}"
                   ",\n  {\"name\": \"thread_name\", \"ph\": \"M\", \"pid\": 2, \"tid\": 0, \"args\": {\"name\": \"%s\"}}",
                x->process2, x->process2);
    write_extra_spans(f, x ? x->spans2 : NULL, no, 2, 0, tmin);
    fputs("\n ]}\n", f);
    return moetax_outfile_commit(out);
}

void moetax_ledger_write_prometheus(const struct moetax_ledger *l, FILE *f) {
    double ph[MOETAX_PHASE_COUNT], wall;
    int64_t tokens, steps;
    moetax_ledger_totals(l, false, ph, &wall, &tokens, &steps);
    fputs("# HELP moetax_phase_seconds_total Time spent per phase (averaged over workers).\n"
          "# TYPE moetax_phase_seconds_total counter\n", f);
    for (int p = 0; p < MOETAX_PHASE_COUNT; p++)
        fprintf(f, "moetax_phase_seconds_total{phase=\"%s\",tax=\"%s\"} %.9g\n", k_phase_names[p],
                moetax_phase_is_tax((enum moetax_phase)p) ? "true" : "false", ph[p]);
    fprintf(f, "# HELP moetax_steps_total Steps evaluated.\n# TYPE moetax_steps_total counter\nmoetax_steps_total %lld\n",
            (long long)steps);
    fprintf(f, "# HELP moetax_tokens_total Tokens evaluated.\n# TYPE moetax_tokens_total counter\nmoetax_tokens_total %lld\n",
            (long long)tokens);
    fprintf(f, "# HELP moetax_step_seconds_total Wall time of all steps.\n# TYPE moetax_step_seconds_total counter\n"
               "moetax_step_seconds_total %.9g\n", wall);
    double share = moetax_ledger_tax_share(ph);
    fprintf(f, "# HELP moetax_tax_share Share of step time spent on synchronization tax.\n# TYPE moetax_tax_share gauge\n"
               "moetax_tax_share %.6f\n", share);
    fprintf(f, "# HELP moetax_efficiency 100 * (1 - tax share).\n# TYPE moetax_efficiency gauge\nmoetax_efficiency %.4f\n",
            100 * (1 - share));
    for (int w = 0; w < l->p.n_workers; w++)
        fprintf(f, "moetax_worker_wait_seconds_total{worker=\"%d\"} %.9g\n", w, l->all.wait[w]);
}
