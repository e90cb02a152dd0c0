/*
 * report.c - load a ledger or Chrome trace JSON (jansson), validate it, and
 * fold it into a struct moetax_report (see include/moetax/report.h).
 */
#include "moetax/report.h"
#include "moetax/readfile.h"

#include <jansson.h>
#include <math.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#define P MOETAX_PHASE_COUNT
#define MAX_WORKERS 65536
#define MAX_LAYERS 4096
#define MAX_EXPERTS 65536
#define MAX_EXPERTS_USED 256 /* as the model loader */
/* a step's counts (tokens, MoE layer passes, assignments): their sums over the steps a file can hold stay
 * far from overflowing */
#define MAX_STEP_COUNT ((int64_t)1 << 32)
/* a time: seconds in a ledger, microseconds in a trace (1e15 us: 31 years) */
#define MAX_TIME 1e15
/* the routing section's per-expert counts over all its layers */
#define MAX_ROUTING_COUNTS ((int64_t)1 << 24)

/* ---- small helpers ----------------------------------------------------------------- */

static moetax_status fmt_err(const char *name, const char *where, const char *what) {
    return moetax_error(MOETAX_ERR_FORMAT, "%s: %s: %s", name, where, what);
}

static int phase_from_name(const char *s) {
    for (int p = 0; p < P; p++)
        if (!strcmp(s, moetax_phase_name((enum moetax_phase)p))) return p;
    return -1;
}

/* A non-negative finite number. */
static moetax_status get_sec(const char *name, const char *where, const json_t *v, double *out) {
    if (!json_is_number(v)) return fmt_err(name, where, v ? "expected a number" : "missing");
    double d = json_number_value(v);
    if (!isfinite(d)) return fmt_err(name, where, "not a finite number");
    if (d > MAX_TIME) { /* their sums stay finite */
        char msg[96];
        snprintf(msg, sizeof msg, "%g is beyond anything a run records (%g)", d, MAX_TIME);
        return fmt_err(name, where, msg);
    }
    if (d < 0) {
        char msg[96];
        snprintf(msg, sizeof msg, "negative time %g", d);
        return fmt_err(name, where, msg);
    }
    *out = d;
    return MOETAX_OK;
}

/* An integer (an integral real is accepted) in [lo, hi]. */
static moetax_status get_int(const char *name, const char *where, const json_t *v, int64_t lo, int64_t hi,
                             int64_t *out) {
    int64_t x;
    if (json_is_integer(v)) x = (int64_t)json_integer_value(v);
    else if (json_is_real(v) && json_real_value(v) == floor(json_real_value(v)) && fabs(json_real_value(v)) < 9e15)
        x = (int64_t)json_real_value(v);
    else return fmt_err(name, where, v ? "expected an integer" : "missing");
    if (x < lo || x > hi) {
        char msg[128];
        snprintf(msg, sizeof msg, "%lld is out of range [%lld, %lld]", (long long)x, (long long)lo, (long long)hi);
        return fmt_err(name, where, msg);
    }
    *out = x;
    return MOETAX_OK;
}

static moetax_status key_int(const char *name, const char *parent, const json_t *obj, const char *key, int64_t lo,
                             int64_t hi, int64_t *out) {
    char where[256];
    snprintf(where, sizeof where, "%s%s%s", parent, parent[0] ? "." : "", key);
    return get_int(name, where, json_object_get(obj, key), lo, hi, out);
}

static moetax_status key_sec(const char *name, const char *parent, const json_t *obj, const char *key, double *out) {
    char where[256];
    snprintf(where, sizeof where, "%s%s%s", parent, parent[0] ? "." : "", key);
    return get_sec(name, where, json_object_get(obj, key), out);
}

/* An array of exactly n non-negative numbers. */
static moetax_status get_vec(const char *name, const char *where, const json_t *v, size_t n, double *out) {
    if (!json_is_array(v)) return fmt_err(name, where, v ? "expected an array" : "missing");
    if (json_array_size(v) != n) {
        char msg[96];
        snprintf(msg, sizeof msg, "expected %zu numbers, found %zu", n, json_array_size(v));
        return fmt_err(name, where, msg);
    }
    for (size_t i = 0; i < n; i++) {
        char w[300];
        snprintf(w, sizeof w, "%s[%zu]", where, i);
        moetax_status st = get_sec(name, w, json_array_get(v, i), &out[i]);
        if (st) return st;
    }
    return MOETAX_OK;
}

/* ---- aggregates --------------------------------------------------------------------- */

static bool agg_alloc(struct moetax_report_agg *a, int n_layer, int W) {
    a->layer_phase_s = calloc((size_t)n_layer * P + 1, sizeof(double));
    a->worker_busy_s = calloc((size_t)W, sizeof(double));
    a->worker_wait_s = calloc((size_t)W, sizeof(double));
    return a->layer_phase_s && a->worker_busy_s && a->worker_wait_s;
}

static void agg_free(struct moetax_report_agg *a) {
    free(a->layer_phase_s);
    free(a->worker_busy_s);
    free(a->worker_wait_s);
}

static void agg_sum_phases(struct moetax_report_agg *a, int n_layer) {
    for (int p = 0; p < P; p++) {
        double s = a->other_phase_s[p];
        for (int l = 0; l < n_layer; l++) s += a->layer_phase_s[(size_t)l * P + p];
        a->phase_s[p] = s;
    }
}

const struct moetax_report_agg *moetax_report_sel(const struct moetax_report *r) {
    return r->decode_only ? &r->decode : &r->all;
}

double moetax_report_phase_total(const struct moetax_report_agg *a) {
    double t = 0;
    for (int p = 0; p < P; p++) t += a->phase_s[p];
    return t;
}

double moetax_report_tax_share(const struct moetax_report_agg *a) {
    double tax = 0, total = moetax_report_phase_total(a);
    for (int p = 0; p < MOETAX_PHASE_N_TAX; p++) tax += a->phase_s[p];
    return total > 0 ? tax / total : 0;
}

double moetax_report_efficiency(const struct moetax_report_agg *a) { return 100.0 * (1.0 - moetax_report_tax_share(a)); }

void moetax_report_free(struct moetax_report *r) {
    if (!r) return;
    free(r->store);
    free(r->io);
    free(r->batches);
    for (int i = 0; i < r->n_ranks; i++) {
        moetax_report_free(r->ranks[i].r);
        free(r->ranks[i].layer_sent);
        free(r->ranks[i].layer_recv);
    }
    free(r->ranks);
    free(r->rank_layers);
    agg_free(&r->all);
    agg_free(&r->prefill);
    agg_free(&r->decode);
    free(r->moe_layer);
    free(r->timeline.layer_phase_s);
    free(r->timeline.spans);
    if (r->routing) {
        for (int i = 0; i < r->routing->n_layers; i++) free(r->routing->layers[i].load);
        free(r->routing->layers);
        free(r->routing);
    }
    free(r);
}

static struct moetax_report *report_new(const char *name, const struct moetax_report_params *p) {
    struct moetax_report *r = calloc(1, sizeof *r);
    if (!r) return NULL;
    snprintf(r->path, sizeof r->path, "%s", name);
    r->decode_only = p && p->decode_only;
    return r;
}

static moetax_status report_alloc(struct moetax_report *r) {
    bool ok = agg_alloc(&r->all, r->n_layer, r->n_workers) && agg_alloc(&r->prefill, r->n_layer, r->n_workers) &&
              agg_alloc(&r->decode, r->n_layer, r->n_workers);
    ok = ok && (r->moe_layer = calloc((size_t)r->n_layer + 1, sizeof(bool))) != NULL;
    ok = ok && (r->timeline.layer_phase_s = calloc((size_t)r->n_layer * P + 1, sizeof(double))) != NULL;
    return ok ? MOETAX_OK : moetax_error(MOETAX_ERR_NOMEM, "%s: out of memory", r->path);
}

/* ---- ledger ------------------------------------------------------------------------- */

struct ledger_ctx {
    const char *name;
    int n_phase_file;        /* length of the file's "phases" list */
    int map[64];             /* file phase index -> enum moetax_phase */
    int n_layer, W;
};

/* A row of per-phase seconds in the file's phase order -> out[P] (accumulated). */
static moetax_status get_phase_row(const struct ledger_ctx *c, const char *where, const json_t *v, double *out) {
    double tmp[64];
    moetax_status st = get_vec(c->name, where, v, (size_t)c->n_phase_file, tmp);
    if (st) return st;
    for (int i = 0; i < c->n_phase_file; i++) out[c->map[i]] += tmp[i];
    return MOETAX_OK;
}

/* {name: s} with known phase names only. */
static moetax_status check_phase_map(const struct ledger_ctx *c, const char *where, const json_t *v) {
    if (!v) return MOETAX_OK;
    if (!json_is_object(v)) return fmt_err(c->name, where, "expected an object {phase: seconds}");
    const char *key;
    json_t *val;
    json_object_foreach((json_t *)v, key, val) {
        char w[300];
        snprintf(w, sizeof w, "%.150s.%.120s", where, key);
        if (phase_from_name(key) < 0) return fmt_err(c->name, w, "unknown phase name");
        double d;
        moetax_status st = get_sec(c->name, w, val, &d);
        if (st) return st;
    }
    return MOETAX_OK;
}

/* Phase rows and worker vectors of a step or a totals object. */
static moetax_status get_rows(const struct ledger_ctx *c, const char *where, const json_t *o, double *layer_rows,
                              double *other, double *busy, double *wait) {
    char w[300];
    moetax_status st;
    snprintf(w, sizeof w, "%s.phase_s", where);
    if ((st = check_phase_map(c, w, json_object_get(o, "phase_s")))) return st;
    snprintf(w, sizeof w, "%s.other_phase_s", where);
    if ((st = get_phase_row(c, w, json_object_get(o, "other_phase_s"), other))) return st;
    const json_t *lp = json_object_get(o, "layer_phase_s");
    snprintf(w, sizeof w, "%s.layer_phase_s", where);
    if (!json_is_array(lp)) return fmt_err(c->name, w, lp ? "expected an array of per-layer rows" : "missing");
    if ((int64_t)json_array_size(lp) != c->n_layer) {
        char msg[96];
        snprintf(msg, sizeof msg, "expected %d rows (n_layer), found %zu", c->n_layer, json_array_size(lp));
        return fmt_err(c->name, w, msg);
    }
    for (int l = 0; l < c->n_layer; l++) {
        snprintf(w, sizeof w, "%s.layer_phase_s[%d]", where, l);
        if ((st = get_phase_row(c, w, json_array_get(lp, (size_t)l), layer_rows + (size_t)l * P))) return st;
    }
    double *tmp = malloc(sizeof(double) * (size_t)c->W);
    if (!tmp) return moetax_error(MOETAX_ERR_NOMEM, "out of memory");
    snprintf(w, sizeof w, "%s.worker_busy_s", where);
    st = get_vec(c->name, w, json_object_get(o, "worker_busy_s"), (size_t)c->W, tmp);
    for (int i = 0; !st && i < c->W; i++) busy[i] += tmp[i];
    snprintf(w, sizeof w, "%s.worker_wait_s", where);
    if (!st) st = get_vec(c->name, w, json_object_get(o, "worker_wait_s"), (size_t)c->W, tmp);
    for (int i = 0; !st && i < c->W; i++) wait[i] += tmp[i];
    free(tmp);
    return st;
}

static moetax_status get_agg(const struct ledger_ctx *c, const char *where, const json_t *o, struct moetax_report_agg *a) {
    if (!json_is_object(o)) return fmt_err(c->name, where, o ? "expected an object" : "missing");
    moetax_status st;
    if ((st = key_int(c->name, where, o, "steps", 0, INT64_MAX, &a->steps))) return st;
    if ((st = key_int(c->name, where, o, "tokens", 0, INT64_MAX, &a->tokens))) return st;
    if ((st = key_sec(c->name, where, o, "wall_s", &a->wall_s))) return st;
    if ((st = get_rows(c, where, o, a->layer_phase_s, a->other_phase_s, a->worker_busy_s, a->worker_wait_s))) return st;
    agg_sum_phases(a, c->n_layer);
    return MOETAX_OK;
}

/* The optional "store" section: numbers >= 0 (absent keys count as 0). */
static moetax_status parse_store(struct moetax_report *r, const char *name, const json_t *o) {
    if (!o || json_is_null(o)) return MOETAX_OK;
    if (!json_is_object(o)) return moetax_error(MOETAX_ERR_FORMAT, "%s: store: expected an object", name);
    struct moetax_report_store *s = calloc(1, sizeof *s);
    if (!s) return moetax_error(MOETAX_ERR_NOMEM, "out of memory");
    r->store = s;
    struct { const char *key; double *v; } nums[] = {
        {"slot_bytes", &s->slot_bytes}, {"budget_bytes", &s->budget_bytes}, {"bytes_read", &s->bytes_read},
        {"read_gbps", &s->read_gbps}, {"stall_s", &s->stall_s}, {"acquires", &s->acquires}, {"hits", &s->hits},
        {"loads", &s->loads}, {"reads", &s->reads}, {"predicted_issued", &s->predicted_issued},
        {"predicted_used", &s->predicted_used}, {"prefetch_wasted", &s->prefetch_wasted},
        {"prefetch_dropped", &s->prefetch_dropped},
    };
    for (size_t i = 0; i < sizeof nums / sizeof nums[0]; i++) {
        const json_t *v = json_object_get(o, nums[i].key);
        if (!v) continue;
        if (!json_is_number(v) || !(json_number_value(v) >= 0 && json_number_value(v) <= 1e18))
            return moetax_error(MOETAX_ERR_FORMAT, "%s: store.%s: expected a number within 0..1e18", name, nums[i].key);
        *nums[i].v = json_number_value(v);
    }
    const json_t *v = json_object_get(o, "n_slots");
    if (v && (!json_is_integer(v) || json_integer_value(v) < 0 || json_integer_value(v) > INT32_MAX))
        return moetax_error(MOETAX_ERR_FORMAT, "%s: store.n_slots: expected an integer >= 0", name);
    s->n_slots = v ? (int)json_integer_value(v) : 0;
    v = json_object_get(o, "tokens");
    if (v && (!json_is_integer(v) || json_integer_value(v) < 0))
        return moetax_error(MOETAX_ERR_FORMAT, "%s: store.tokens: expected an integer >= 0", name);
    s->tokens = v ? (int64_t)json_integer_value(v) : 0;
    s->direct_io = json_is_true(json_object_get(o, "direct_io"));
    return MOETAX_OK;
}

/* Where each batch size's row is in r->batches while the steps are read (rows are appended in
 * the order sizes first appear, and sorted at the end). */
struct batch_rows {
    int32_t *row; /* [cap]: batch size -> row + 1, 0 for none */
    int64_t cap;
    int n_alloc; /* rows allocated in r->batches */
};

static int by_batch(const void *a, const void *b) {
    const struct moetax_report_batch *x = a, *y = b;
    return (x->batch > y->batch) - (x->batch < y->batch);
}

/* A decode step into its batch size's row (steps[].batch, 1 when absent; steps[].moe optional). */
static moetax_status add_batch_step(struct moetax_report *r, struct batch_rows *rows, const char *name,
                                    const char *where, const json_t *s, int64_t tokens, double wall, const double *lrow,
                                    const double *other) {
    int64_t batch = 1;
    moetax_status st;
    if (json_object_get(s, "batch") && (st = key_int(name, where, s, "batch", 1, 1 << 20, &batch))) return st;
    if (batch >= rows->cap) {
        int64_t cap = rows->cap ? rows->cap : 64;
        while (cap <= batch) cap *= 2;
        int32_t *nr = realloc(rows->row, sizeof *nr * (size_t)cap);
        if (!nr) return moetax_error(MOETAX_ERR_NOMEM, "out of memory");
        memset(nr + rows->cap, 0, sizeof *nr * (size_t)(cap - rows->cap));
        rows->row = nr;
        rows->cap = cap;
    }
    if (!rows->row[batch]) {
        if (r->n_batches == rows->n_alloc) {
            const int n = rows->n_alloc ? 2 * rows->n_alloc : 8;
            struct moetax_report_batch *nb = realloc(r->batches, sizeof *nb * (size_t)n);
            if (!nb) return moetax_error(MOETAX_ERR_NOMEM, "out of memory");
            r->batches = nb;
            rows->n_alloc = n;
        }
        struct moetax_report_batch *nb = r->batches;
        memset(&nb[r->n_batches], 0, sizeof *nb);
        nb[r->n_batches].batch = batch;
        rows->row[batch] = ++r->n_batches;
    }
    struct moetax_report_batch *b = &r->batches[rows->row[batch] - 1];
    b->steps++;
    b->tokens += tokens;
    b->wall_s += wall;
    for (int l = -1; l < r->n_layer; l++)
        for (int p = 0; p < MOETAX_PHASE_COUNT; p++) {
            const double v = l < 0 ? other[p] : lrow[(size_t)l * MOETAX_PHASE_COUNT + p];
            b->phase_s += v;
            if (p == MOETAX_PHASE_WAIT) b->wait_s += v;
            if (moetax_phase_is_tax((enum moetax_phase)p)) b->tax_s += v;
        }
    const json_t *mo = json_object_get(s, "moe");
    if (!mo) return MOETAX_OK;
    char w[96];
    snprintf(w, sizeof w, "%s.moe", where);
    if (!json_is_object(mo)) return fmt_err(name, w, "expected an object");
    int64_t v[5];
    const char *keys[5] = {"layers", "experts", "assignments", "dropped", "rerouted"};
    for (int k = 0; k < 5; k++)
        if ((st = key_int(name, w, mo, keys[k], 0, MAX_STEP_COUNT, &v[k]))) return st;
    double eb, imb;
    if ((st = key_sec(name, w, mo, "expert_bytes", &eb)) || (st = key_sec(name, w, mo, "imbalance_sum", &imb))) return st;
    b->moe_layers += v[0];
    b->experts += v[1];
    b->assignments += v[2];
    b->dropped += v[3];
    b->rerouted += v[4];
    b->expert_bytes += eb;
    b->imbalance_sum += imb;
    return MOETAX_OK;
}

static moetax_status parse_steps(struct moetax_report *r, const struct ledger_ctx *c, const json_t *steps) {
    if (!json_is_array(steps)) return fmt_err(c->name, "steps", steps ? "expected an array" : "missing");
    size_t rows = (size_t)r->n_layer * P + 1;
    double *lrow = malloc(sizeof(double) * rows), *busy = malloc(sizeof(double) * (size_t)r->n_workers),
           *wait = malloc(sizeof(double) * (size_t)r->n_workers);
    moetax_status st = MOETAX_OK;
    if (!lrow || !busy || !wait) st = moetax_error(MOETAX_ERR_NOMEM, "out of memory");
    double best = -1;
    bool best_decode = false;
    struct batch_rows brows = {0};
    for (size_t i = 0; !st && i < json_array_size(steps); i++) {
        const json_t *s = json_array_get(steps, i);
        char where[64];
        snprintf(where, sizeof where, "steps[%zu]", i);
        if (!json_is_object(s)) { st = fmt_err(c->name, where, "expected an object"); break; }
        int64_t step, tokens;
        double wall, other[P] = {0};
        if ((st = key_int(c->name, where, s, "step", 0, INT64_MAX, &step))) break;
        if ((st = key_int(c->name, where, s, "tokens", 0, MAX_STEP_COUNT, &tokens))) break;
        if ((st = key_sec(c->name, where, s, "wall_s", &wall))) break;
        const char *kind = json_string_value(json_object_get(s, "kind"));
        char w[96];
        snprintf(w, sizeof w, "%s.kind", where);
        if (!kind || (strcmp(kind, "prefill") && strcmp(kind, "decode"))) {
            st = fmt_err(c->name, w, "expected \"prefill\" or \"decode\"");
            break;
        }
        bool decode = !strcmp(kind, "decode");
        memset(lrow, 0, sizeof(double) * rows);
        memset(busy, 0, sizeof(double) * (size_t)r->n_workers);
        memset(wait, 0, sizeof(double) * (size_t)r->n_workers);
        if ((st = get_rows(c, where, s, lrow, other, busy, wait))) break;
        if (decode && (st = add_batch_step(r, &brows, c->name, where, s, tokens, wall, lrow, other))) break;
        /* timeline: the slowest decode step; the slowest step if there is no decode step */
        if ((decode && (!best_decode || wall > best)) || (!decode && !best_decode && wall > best)) {
            best = wall;
            best_decode = decode;
            struct moetax_report_timeline *t = &r->timeline;
            t->valid = true;
            t->step = step;
            t->tokens = tokens;
            t->prefill = !decode;
            t->wall_s = wall;
            memcpy(t->other_phase_s, other, sizeof other);
            memcpy(t->layer_phase_s, lrow, sizeof(double) * rows);
        }
    }
    free(brows.row);
    if (r->n_batches > 1) qsort(r->batches, (size_t)r->n_batches, sizeof *r->batches, by_batch);
    free(lrow);
    free(busy);
    free(wait);
    return st;
}

/* ---- routing ------------------------------------------------------------------------ */

static int distinct_inter(const int32_t *a, int na, const int32_t *b, int nb, int *n_a_distinct) {
    int inter = 0, da = 0;
    for (int i = 0; i < na; i++) {
        bool dup = false;
        for (int j = 0; j < i && !dup; j++) dup = a[j] == a[i];
        if (dup) continue;
        da++;
        for (int j = 0; j < nb; j++)
            if (b[j] == a[i]) { inter++; break; }
    }
    if (n_a_distinct) *n_a_distinct = da;
    return inter;
}

/* An array of T expert sets (each null or k ids in [0, E), distinct if asked: a token's routing;
 * a prediction may repeat one) -> ids [T*k], valid [T]. */
static moetax_status get_sets(const char *name, const char *where, const json_t *v, size_t T, int k, int E,
                              bool distinct, int32_t *ids, uint8_t *valid) {
    if (!json_is_array(v)) return fmt_err(name, where, v ? "expected an array of expert sets" : "missing");
    if (json_array_size(v) != T) {
        char msg[96];
        snprintf(msg, sizeof msg, "expected %zu entries (one per token), found %zu", T, json_array_size(v));
        return fmt_err(name, where, msg);
    }
    for (size_t t = 0; t < T; t++) {
        const json_t *s = json_array_get(v, t);
        char w[300];
        snprintf(w, sizeof w, "%s[%zu]", where, t);
        valid[t] = 0;
        if (json_is_null(s)) continue;
        if (!json_is_array(s) || json_array_size(s) != (size_t)k) {
            char msg[96];
            snprintf(msg, sizeof msg, "expected null or %d expert ids", k);
            return fmt_err(name, w, msg);
        }
        for (int j = 0; j < k; j++) {
            int64_t id;
            char wj[320];
            snprintf(wj, sizeof wj, "%s[%d]", w, j);
            moetax_status st = get_int(name, wj, json_array_get(s, (size_t)j), 0, E - 1, &id);
            if (st) return st;
            for (int i = 0; distinct && i < j; i++)
                if (ids[t * (size_t)k + (size_t)i] == id) return fmt_err(name, wj, "an expert listed twice in one set");
            ids[t * (size_t)k + (size_t)j] = (int32_t)id;
        }
        valid[t] = 1;
    }
    return MOETAX_OK;
}

struct ranked {
    int64_t n;
    int32_t e;
};

static int busiest_first(const void *a, const void *b) { /* ties: lower id first */
    const struct ranked *x = a, *y = b;
    return x->n != y->n ? (x->n < y->n) - (x->n > y->n) : (x->e > y->e) - (x->e < y->e);
}

static void layer_stats(struct moetax_report_routing_layer *L, size_t T, int k, int E, const int32_t *step,
                        const int32_t *ex, const uint8_t *ev, const int32_t *pr, const uint8_t *pv, int64_t *tmp,
                        struct ranked *rank) {
    L->tokens = 0;
    for (size_t t = 0; t < T; t++) {
        if (!ev[t]) continue;
        L->tokens++;
        for (int j = 0; j < k; j++) L->load[ex[t * (size_t)k + (size_t)j]]++;
    }
    double sum = 0, sq = 0;
    L->load_min = INFINITY;
    L->load_max = 0;
    for (int e = 0; e < E; e++) {
        double x = (double)L->load[e];
        sum += x;
        if (x < L->load_min) L->load_min = x;
        if (x > L->load_max) L->load_max = x;
    }
    L->load_mean = sum / E;
    for (int e = 0; e < E; e++) sq += ((double)L->load[e] - L->load_mean) * ((double)L->load[e] - L->load_mean);
    L->load_cv = L->load_mean > 0 ? sqrt(sq / E) / L->load_mean : NAN;
    if (!L->tokens) L->load_min = L->load_max = L->load_mean = NAN;
    /* hottest experts (ties: lower id first) and the busiest quarter's share */
    for (int h = 0; h < MOETAX_REPORT_N_HOT; h++) { L->hot[h] = -1; L->hot_n[h] = 0; }
    int used = 0; /* the experts with a load: at most tokens x k of them */
    for (int e = 0; e < E; e++)
        if (L->load[e] > 0) rank[used++] = (struct ranked){L->load[e], e};
    qsort(rank, (size_t)used, sizeof *rank, busiest_first);
    const int quarter = (E + 3) / 4;
    double top = 0;
    for (int q = 0; q < quarter && q < used; q++) top += (double)rank[q].n;
    for (int q = 0; q < MOETAX_REPORT_N_HOT && q < used; q++) {
        L->hot[q] = rank[q].e;
        L->hot_n[q] = rank[q].n;
    }
    L->top_quarter_share = sum > 0 ? top / sum : NAN;
    /* batch imbalance over runs of tokens of the same step (tmp all 0 between runs) */
    double bsum = 0;
    L->n_batches = 0;
    for (int e = 0; e < E; e++) tmp[e] = 0;
    for (size_t t0 = 0; t0 < T;) {
        size_t t1 = t0;
        while (t1 < T && step[t1] == step[t0]) t1++;
        int64_t n = 0, mx = 0;
        for (size_t t = t0; t < t1; t++) {
            if (!ev[t]) continue;
            n++;
            for (int j = 0; j < k; j++) {
                const int64_t c = ++tmp[ex[t * (size_t)k + (size_t)j]];
                if (c > mx) mx = c;
            }
        }
        for (size_t t = t0; t < t1; t++)
            for (int j = 0; ev[t] && j < k; j++) tmp[ex[t * (size_t)k + (size_t)j]] = 0;
        if (n >= 2) {
            bsum += (double)mx / ((double)n * k / E);
            L->n_batches++;
        }
        t0 = t1;
    }
    L->batch_imbalance = L->n_batches ? bsum / (double)L->n_batches : NAN;
    /* overlap of adjacent tokens */
    double osum = 0;
    L->n_pairs = 0;
    for (size_t t = 0; t + 1 < T; t++) {
        if (!ev[t] || !ev[t + 1]) continue;
        osum += (double)distinct_inter(ex + t * (size_t)k, k, ex + (t + 1) * (size_t)k, k, NULL) / k;
        L->n_pairs++;
    }
    L->overlap = L->n_pairs ? osum / (double)L->n_pairs : NAN;
    /* prediction */
    double ps = 0, rs = 0;
    L->n_pred = 0;
    for (size_t t = 0; pr && t < T; t++) {
        if (!ev[t] || !pv[t]) continue;
        int np, na;
        int inter = distinct_inter(pr + t * (size_t)k, k, ex + t * (size_t)k, k, &np);
        distinct_inter(ex + t * (size_t)k, k, pr + t * (size_t)k, k, &na);
        ps += (double)inter / np;
        rs += (double)inter / na;
        L->n_pred++;
    }
    L->precision = L->n_pred ? ps / (double)L->n_pred : NAN;
    L->recall = L->n_pred ? rs / (double)L->n_pred : NAN;
}

static double mean_over_layers(const struct moetax_report_routing *R, size_t off) {
    double s = 0;
    int n = 0;
    for (int i = 0; i < R->n_layers; i++) {
        double v = *(const double *)((const char *)&R->layers[i] + off);
        if (!isnan(v)) { s += v; n++; }
    }
    return n ? s / n : NAN;
}

static moetax_status parse_routing(struct moetax_report *r, const char *name, const json_t *ro) {
    if (!ro || json_is_null(ro)) return MOETAX_OK;
    if (!json_is_object(ro)) return fmt_err(name, "routing", "expected an object or null");
    const json_t *layers = json_object_get(ro, "layers");
    if (!json_is_array(layers)) return fmt_err(name, "routing.layers", layers ? "expected an array" : "missing");
    int64_t tokens, first = 0;
    moetax_status st = key_int(name, "routing", ro, "tokens", 0, INT32_MAX, &tokens);
    if (st) return st;
    if (json_object_get(ro, "first_token") && (st = key_int(name, "routing", ro, "first_token", 0, INT64_MAX, &first)))
        return st;
    if (r->n_expert < 1) { /* a dense model's run with --routing-stats: nothing was routed */
        if (tokens == 0 && json_array_size(layers) == 0) return MOETAX_OK;
        return fmt_err(name, "n_expert", "must be >= 1 when there is a routing section with routed layers");
    }
    if (r->n_expert_used < 1 || r->n_expert_used > r->n_expert)
        return fmt_err(name, "n_expert_used", "must be in [1, n_expert] when there is a routing section");
    const int E = r->n_expert, k = r->n_expert_used;
    const size_t T = (size_t)tokens, nl = json_array_size(layers);
    if ((int64_t)nl * E > MAX_ROUTING_COUNTS) {
        char msg[128];
        snprintf(msg, sizeof msg, "%zu layers of %d experts: more than the %lld counts a report holds", nl, E,
                 (long long)MAX_ROUTING_COUNTS);
        return fmt_err(name, "routing.layers", msg);
    }
    struct moetax_report_routing *R = calloc(1, sizeof *R);
    int32_t *step = malloc(sizeof(int32_t) * (T + 1)), *ex = malloc(sizeof(int32_t) * (T * (size_t)k + 1)),
            *pr = malloc(sizeof(int32_t) * (T * (size_t)k + 1));
    uint8_t *ev = malloc(T + 1), *pv = malloc(T + 1);
    int64_t *tmp = malloc(sizeof(int64_t) * (size_t)E);
    struct ranked *rank = malloc(sizeof *rank * (size_t)E);
    bool *seen = calloc((size_t)r->n_layer + 1, sizeof(bool));
    if (R) R->layers = calloc(nl + 1, sizeof *R->layers);
    if (!R || !R->layers || !step || !ex || !pr || !ev || !pv || !tmp || !rank || !seen) {
        st = moetax_error(MOETAX_ERR_NOMEM, "%s: out of memory for the routing section", name);
        goto done;
    }
    R->n_expert = E;
    R->k = k;
    R->tokens = (int64_t)T;
    R->first_token = first;
    for (size_t i = 0; i < nl; i++) {
        const json_t *lo = json_array_get(layers, i);
        char where[64], w[96];
        snprintf(where, sizeof where, "routing.layers[%zu]", i);
        if (!json_is_object(lo)) { st = fmt_err(name, where, "expected an object"); goto done; }
        struct moetax_report_routing_layer *L = &R->layers[R->n_layers];
        int64_t layer;
        if ((st = key_int(name, where, lo, "layer", 0, r->n_layer - 1, &layer))) goto done;
        if (seen[layer]) {
            snprintf(w, sizeof w, "%s.layer", where);
            st = fmt_err(name, w, "a layer listed twice");
            goto done;
        }
        seen[layer] = true;
        L->layer = (int)layer;
        const json_t *sv = json_object_get(lo, "step");
        snprintf(w, sizeof w, "%s.step", where);
        if (!json_is_array(sv) || json_array_size(sv) != T) {
            st = fmt_err(name, w, "expected an array of step ids, one per token (routing.tokens)");
            goto done;
        }
        for (size_t t = 0; t < T; t++) {
            int64_t s;
            char wt[128];
            snprintf(wt, sizeof wt, "%s[%zu]", w, t);
            if ((st = get_int(name, wt, json_array_get(sv, t), 0, INT32_MAX, &s))) goto done;
            step[t] = (int32_t)s;
        }
        snprintf(w, sizeof w, "%s.experts", where);
        if ((st = get_sets(name, w, json_object_get(lo, "experts"), T, k, E, true, ex, ev))) goto done;
        const json_t *wv = json_object_get(lo, "weights");
        snprintf(w, sizeof w, "%s.weights", where);
        if (wv && !json_is_array(wv) && !json_is_null(wv)) { st = fmt_err(name, w, "expected an array"); goto done; }
        const json_t *pj = json_object_get(lo, "predicted");
        bool has_pred = pj && !json_is_null(pj);
        snprintf(w, sizeof w, "%s.predicted", where);
        if (has_pred && (st = get_sets(name, w, pj, T, k, E, false, pr, pv))) goto done;
        L->load = calloc((size_t)E, sizeof(int64_t));
        if (!L->load) { st = moetax_error(MOETAX_ERR_NOMEM, "out of memory"); goto done; }
        R->n_layers++;
        layer_stats(L, T, k, E, step, ex, ev, has_pred ? pr : NULL, pv, tmp, rank);
    }
    R->load_cv = mean_over_layers(R, offsetof(struct moetax_report_routing_layer, load_cv));
    R->top_quarter_share = mean_over_layers(R, offsetof(struct moetax_report_routing_layer, top_quarter_share));
    R->batch_imbalance = mean_over_layers(R, offsetof(struct moetax_report_routing_layer, batch_imbalance));
    R->overlap = mean_over_layers(R, offsetof(struct moetax_report_routing_layer, overlap));
    R->precision = mean_over_layers(R, offsetof(struct moetax_report_routing_layer, precision));
    R->recall = mean_over_layers(R, offsetof(struct moetax_report_routing_layer, recall));
    double m = (double)T * k / E;
    R->load_cv_chance = m > 0 ? sqrt((1 - (double)k / E) / m) : NAN;
    r->routing = R;
    R = NULL;
done:
    if (R) {
        for (int i = 0; i < R->n_layers; i++) free(R->layers[i].load);
        if (R->layers && R->n_layers < (int)nl + 1) free(R->layers[R->n_layers].load);
        free(R->layers);
        free(R);
    }
    free(step); free(ex); free(pr); free(ev); free(pv); free(tmp); free(rank); free(seen);
    return st;
}

static moetax_status parse_ledger(struct moetax_report *r, const char *name, const json_t *root);

/* "ranks": the ledgers of every rank under mpirun, each analysed as a report of its own, then
 * per MoE layer the rank that worked longest. */
static moetax_status parse_ranks(struct moetax_report *r, const char *name, const json_t *ra) {
    if (!ra) return MOETAX_OK;
    if (!json_is_array(ra) || json_array_size(ra) < 1 || json_array_size(ra) > 4096)
        return fmt_err(name, "ranks", "expected an array of 1 to 4096 ledgers");
    const int NR = (int)json_array_size(ra);
    if (!(r->ranks = calloc((size_t)NR, sizeof *r->ranks))) return moetax_error(MOETAX_ERR_NOMEM, "out of memory");
    r->n_ranks = NR;
    moetax_status st;
    for (int i = 0; i < NR; i++) {
        const json_t *d = json_array_get(ra, (size_t)i);
        char w[64];
        snprintf(w, sizeof w, "ranks[%d]", i);
        struct moetax_report_rank *k = &r->ranks[i];
        if (!json_is_object(d)) return fmt_err(name, w, "expected a ledger object");
        if (json_object_get(d, "ranks")) return fmt_err(name, w, "a rank's ledger has ranks of its own");
        int64_t rk;
        if ((st = key_int(name, w, d, "rank", 0, 4095, &rk))) return st;
        if (rk != i) return fmt_err(name, w, "rank out of order");
        k->rank = (int)rk;
        char sub[sizeof r->path];
        snprintf(sub, sizeof sub, "%s: %s", name, w);
        struct moetax_report_params pp = {.decode_only = r->decode_only};
        if (!(k->r = report_new(sub, &pp))) return moetax_error(MOETAX_ERR_NOMEM, "out of memory");
        if ((st = parse_ledger(k->r, sub, d))) return st;
        if (k->r->n_layer != r->n_layer) return fmt_err(name, w, "n_layer differs from rank 0's");
        const json_t *dj = json_object_get(d, "dist");
        if (dj) {
            if (!json_is_object(dj)) return fmt_err(name, w, "dist: expected an object");
            double *f[5] = {&k->bytes_sent, &k->bytes_recv, &k->collectives, &k->comm_s, &k->wait_s};
            static const char *const keys[5] = {"bytes_sent", "bytes_recv", "collectives", "comm_s", "wait_s"};
            char wd[80];
            snprintf(wd, sizeof wd, "%s.dist", w);
            for (int j = 0; j < 5; j++) {
                const json_t *v = json_object_get(dj, keys[j]);
                char wk[96];
                snprintf(wk, sizeof wk, "%s.%s", wd, keys[j]);
                if (!json_is_number(v) || !isfinite(json_number_value(v)) || json_number_value(v) < 0)
                    return fmt_err(name, wk, v ? "expected a finite number >= 0" : "missing");
                *f[j] = json_number_value(v);
            }
            k->has_dist = true;
            const json_t *ls = json_object_get(dj, "layer_bytes_sent"), *lr = json_object_get(dj, "layer_bytes_recv");
            if (ls || lr) { /* optional: [n_layer] each */
                char wk[128];
                snprintf(wk, sizeof wk, "%s.layer_bytes_sent/recv", wd);
                if (!json_is_array(ls) || !json_is_array(lr) || json_array_size(ls) != (size_t)r->n_layer ||
                    json_array_size(lr) != (size_t)r->n_layer)
                    return fmt_err(name, wk, "expected two arrays of n_layer numbers");
                k->layer_sent = calloc((size_t)r->n_layer, sizeof(double));
                k->layer_recv = calloc((size_t)r->n_layer, sizeof(double));
                if (!k->layer_sent || !k->layer_recv) return moetax_error(MOETAX_ERR_NOMEM, "out of memory");
                for (int l = 0; l < r->n_layer; l++) {
                    const json_t *a = json_array_get(ls, (size_t)l), *b = json_array_get(lr, (size_t)l);
                    if (!json_is_number(a) || !json_is_number(b) || !(json_number_value(a) >= 0) ||
                        !(json_number_value(b) >= 0) || !isfinite(json_number_value(a)) || !isfinite(json_number_value(b)))
                        return fmt_err(name, wk, "expected finite numbers >= 0");
                    k->layer_sent[l] = json_number_value(a);
                    k->layer_recv[l] = json_number_value(b);
                }
            }
        }
    }
    int nm = 0;
    for (int l = 0; l < r->n_layer; l++) nm += r->moe_layer[l];
    if (nm == 0) return MOETAX_OK;
    if (!(r->rank_layers = calloc((size_t)nm, sizeof *r->rank_layers))) return moetax_error(MOETAX_ERR_NOMEM, "out of memory");
    for (int l = 0; l < r->n_layer; l++) {
        if (!r->moe_layer[l]) continue;
        struct moetax_report_rank_layer *x = &r->rank_layers[r->n_rank_layers++];
        x->layer = l;
        x->slowest = -1;
        double sum = 0, cw = 0;
        for (int i = 0; i < NR; i++) {
            const double *ph = moetax_report_sel(r->ranks[i].r)->layer_phase_s + (size_t)l * MOETAX_PHASE_COUNT;
            double busy = 0;
            for (int p = 0; p < P; p++)
                if (p != MOETAX_PHASE_COMM && p != MOETAX_PHASE_WAIT) busy += ph[p];
            cw += ph[MOETAX_PHASE_COMM] + ph[MOETAX_PHASE_WAIT];
            sum += busy;
            if (x->slowest < 0 || busy > x->busy_max_s) x->slowest = i, x->busy_max_s = busy;
        }
        x->busy_mean_s = sum / NR;
        x->comm_wait_mean_s = cw / NR;
        x->has_bytes = true;
        x->bytes_max_rank = -1;
        for (int i = 0; i < NR; i++) {
            const struct moetax_report_rank *k = &r->ranks[i];
            if (!k->layer_sent) { x->has_bytes = false; break; }
            x->bytes_sent += k->layer_sent[l];
            if (x->bytes_max_rank < 0 || k->layer_sent[l] > x->bytes_max_sent)
                x->bytes_max_rank = i, x->bytes_max_sent = k->layer_sent[l], x->bytes_max_recv = k->layer_recv[l];
        }
    }
    return MOETAX_OK;
}

static moetax_status parse_ledger(struct moetax_report *r, const char *name, const json_t *root) {
    moetax_status st;
    int64_t v, W, L, E = 0, K = 0;
    if ((st = key_int(name, "", root, "moetax_ledger", 0, INT64_MAX, &v))) return st;
    if (v != 1)
        return moetax_error(MOETAX_ERR_UNSUPPORTED, "%s: moetax_ledger: version %lld is not supported (expected 1)",
                            name, (long long)v);
    r->source = MOETAX_REPORT_SOURCE_LEDGER;
    if ((st = key_int(name, "", root, "threads", 1, MAX_WORKERS, &W))) return st;
    if ((st = key_int(name, "", root, "n_layer", 0, MAX_LAYERS, &L))) return st;
    if (json_object_get(root, "n_expert") && (st = key_int(name, "", root, "n_expert", 0, MAX_EXPERTS, &E))) return st;
    if (json_object_get(root, "n_expert_used") && (st = key_int(name, "", root, "n_expert_used", 0, MAX_EXPERTS_USED, &K)))
        return st;
    r->n_workers = (int)W;
    r->n_layer = (int)L;
    r->n_expert = (int)E;
    r->n_expert_used = (int)K;
    const json_t *model = json_object_get(root, "model");
    if (model && !json_is_string(model)) return fmt_err(name, "model", "expected a string");
    snprintf(r->model, sizeof r->model, "%s", model ? json_string_value(model) : "");
    if ((st = report_alloc(r))) return st;

    struct ledger_ctx c = {.name = name, .n_layer = r->n_layer, .W = r->n_workers};
    const json_t *phases = json_object_get(root, "phases");
    if (!json_is_array(phases)) return fmt_err(name, "phases", phases ? "expected an array of names" : "missing");
    if (json_array_size(phases) > 64) return fmt_err(name, "phases", "too many phases");
    c.n_phase_file = (int)json_array_size(phases);
    bool seen[P] = {false};
    for (int i = 0; i < c.n_phase_file; i++) {
        char w[32];
        snprintf(w, sizeof w, "phases[%d]", i);
        const char *s = json_string_value(json_array_get(phases, (size_t)i));
        if (!s) return fmt_err(name, w, "expected a phase name");
        int p = phase_from_name(s);
        if (p < 0) {
            char msg[160];
            snprintf(msg, sizeof msg, "unknown phase name \"%.100s\"", s);
            return fmt_err(name, w, msg);
        }
        if (seen[p]) return fmt_err(name, w, "phase listed twice");
        seen[p] = true;
        c.map[i] = p;
    }
    const json_t *ml = json_object_get(root, "moe_layers");
    if (ml && !json_is_array(ml)) return fmt_err(name, "moe_layers", "expected an array of layer indices");
    for (size_t i = 0; ml && i < json_array_size(ml); i++) {
        char w[48];
        snprintf(w, sizeof w, "moe_layers[%zu]", i);
        int64_t l;
        if ((st = get_int(name, w, json_array_get(ml, i), 0, L - 1, &l))) return st;
        r->moe_layer[l] = true;
    }
    const json_t *ov = json_object_get(root, "overhead");
    if (json_is_object(ov) && json_object_get(ov, "span_ns") &&
        (st = key_sec(name, "overhead", ov, "span_ns", &r->span_ns)))
        return st;
    if (json_object_get(root, "dropped_steps") &&
        (st = key_int(name, "", root, "dropped_steps", 0, INT64_MAX, &r->dropped_steps)))
        return st;
    const json_t *tot = json_object_get(root, "totals");
    if ((st = get_agg(&c, "totals", tot, &r->all))) return st;
    if ((st = get_agg(&c, "totals.decode", json_object_get(tot, "decode"), &r->decode))) return st;
    if ((st = get_agg(&c, "totals.prefill", json_object_get(tot, "prefill"), &r->prefill))) return st;
    if ((st = parse_steps(r, &c, json_object_get(root, "steps")))) return st;
    if ((st = parse_store(r, name, json_object_get(root, "store")))) return st;
    if ((st = parse_routing(r, name, json_object_get(root, "routing")))) return st;
    return parse_ranks(r, name, json_object_get(root, "ranks"));
}

/* ---- trace -------------------------------------------------------------------------- */

struct iov { /* one read of the store's I/O tracks */
    double ts, dur, bytes; /* us, us, bytes */
    int kind;              /* 0 demand, 1 known, 2 predicted */
};

static int iov_cmp(const void *a, const void *b) {
    const struct iov *x = a, *y = b;
    return x->ts < y->ts ? -1 : (x->ts > y->ts);
}

static int dbl_cmp(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : (x > y);
}

/* The time windows wv [n][2] (sorted, disjoint; before[w]: their length before window w) cover
 * before x. */
static double covered(const double *wv, const double *before, size_t n, double x) {
    size_t lo = 0, hi = n; /* the windows starting at or before x: [0, lo) */
    while (lo < hi) {
        const size_t mid = lo + (hi - lo) / 2;
        if (wv[2 * mid] <= x) lo = mid + 1;
        else hi = mid;
    }
    if (!lo) return 0;
    const double in = (x < wv[2 * lo - 1] ? x : wv[2 * lo - 1]) - wv[2 * lo - 2];
    return before[lo - 1] + in;
}

/* The reads against the steps: busy time (a read in flight) and read time inside each step's
 * [t0, t1] (us). */
static moetax_status io_summary(struct moetax_report *r, struct iov *io, size_t nio, const double *win, size_t nwin) {
    struct moetax_report_io *o = calloc(1, sizeof *o);
    double *d = malloc(sizeof *d * (nio + 1));
    if (!o || !d) {
        free(o);
        free(d);
        return moetax_error(MOETAX_ERR_NOMEM, "out of memory");
    }
    qsort(io, nio, sizeof *io, iov_cmp);
    for (size_t i = 0; i < nio; i++) {
        o->reads[io[i].kind]++;
        o->bytes += io[i].bytes;
        d[i] = io[i].dur;
    }
    qsort(d, nio, sizeof *d, dbl_cmp);
    o->median_read_ms = nio ? 1e-3 * (nio % 2 ? d[nio / 2] : 0.5 * (d[nio / 2 - 1] + d[nio / 2])) : 0;
    free(d);
    /* the windows sorted and merged (a valid trace's are already in order and disjoint), and the time
     * they cover before each one's start: covered(x) is then a binary search, so reads x windows is
     * never walked (one long read once made every window scan every read before it) */
    double *wv = malloc(sizeof *wv * (2 * nwin + 1)), *before = malloc(sizeof *before * (nwin + 1));
    if (!wv || !before) {
        free(wv);
        free(before);
        free(o);
        return moetax_error(MOETAX_ERR_NOMEM, "out of memory");
    }
    memcpy(wv, win, sizeof *wv * 2 * nwin);
    qsort(wv, nwin, 2 * sizeof *wv, dbl_cmp); /* by start */
    size_t nw = 0;
    for (size_t w = 0; w < nwin; w++) {
        if (nw && wv[2 * w] <= wv[2 * nw - 1]) {
            if (wv[2 * w + 1] > wv[2 * nw - 1]) wv[2 * nw - 1] = wv[2 * w + 1];
            continue;
        }
        wv[2 * nw] = wv[2 * w], wv[2 * nw + 1] = wv[2 * w + 1];
        nw++;
    }
    before[0] = 0;
    for (size_t w = 0; w < nw; w++) before[w + 1] = before[w] + (wv[2 * w + 1] - wv[2 * w]);
    o->wall_s = 1e-6 * before[nw];
    /* reads, merged into busy stretches as they go (sorted by start above) */
    double cur0 = 0, cur1 = -INFINITY;
    for (size_t j = 0; j <= nio; j++) {
        const double s0 = j < nio ? io[j].ts : INFINITY, s1 = j < nio ? io[j].ts + io[j].dur : INFINITY;
        if (j < nio) o->inflight_s += 1e-6 * (covered(wv, before, nw, s1) - covered(wv, before, nw, s0));
        if (s0 > cur1) {
            if (cur1 > cur0) o->busy_s += 1e-6 * (covered(wv, before, nw, cur1) - covered(wv, before, nw, cur0));
            cur0 = s0;
            cur1 = s1;
        } else if (s1 > cur1) cur1 = s1;
    }
    free(wv);
    free(before);
    r->io = o;
    return MOETAX_OK;
}

struct ev {
    int64_t step, tokens;
    int worker, layer, phase;
    double ts, dur; /* us */
};

static int ev_cmp(const void *a, const void *b) {
    const struct ev *x = a, *y = b;
    if (x->step != y->step) return x->step < y->step ? -1 : 1;
    if (x->ts != y->ts) return x->ts < y->ts ? -1 : 1;
    return x->worker - y->worker;
}

static void add_span(struct moetax_report_agg *a, const struct ev *e, int W) {
    double s = 1e-6 * e->dur;
    if (e->layer < 0) a->other_phase_s[e->phase] += s / W;
    else a->layer_phase_s[(size_t)e->layer * P + e->phase] += s / W;
    if (e->phase == MOETAX_PHASE_WAIT) a->worker_wait_s[e->worker] += s;
    else a->worker_busy_s[e->worker] += s;
}

static moetax_status parse_trace(struct moetax_report *r, const char *name, const json_t *root) {
    r->source = MOETAX_REPORT_SOURCE_TRACE;
    const json_t *evs = json_object_get(root, "traceEvents");
    if (!json_is_array(evs)) return fmt_err(name, "traceEvents", "expected an array of events");
    size_t n = json_array_size(evs), m = 0, nio = 0;
    struct ev *E = malloc(sizeof *E * (n + 1));
    struct iov *IO = malloc(sizeof *IO * (n + 1));
    double *win = NULL;
    size_t nwin = 0;
    if (!E || !IO) {
        free(E);
        free(IO);
        return moetax_error(MOETAX_ERR_NOMEM, "%s: out of memory", name);
    }
    moetax_status st = MOETAX_OK;
    int64_t max_tid = -1, max_layer = -1;
    for (size_t i = 0; i < n; i++) {
        const json_t *e = json_array_get(evs, i);
        char where[64], w[96];
        snprintf(where, sizeof where, "traceEvents[%zu]", i);
        if (!json_is_object(e)) { st = fmt_err(name, where, "expected an object"); goto fail; }
        const char *ph = json_string_value(json_object_get(e, "ph"));
        const char *nm = json_string_value(json_object_get(e, "name"));
        const json_t *pid = json_object_get(e, "pid");
        if (json_is_integer(pid) && json_integer_value(pid) >= 100) continue; /* another rank's (a merged trace) */
        if (json_is_integer(pid) && json_integer_value(pid) != 0) { /* other tracks: the store's reads */
            const char *cat = json_string_value(json_object_get(e, "cat"));
            const json_t *ts = json_object_get(e, "ts"), *dur = json_object_get(e, "dur");
            if (ph && !strcmp(ph, "X") && cat && !strcmp(cat, "io") && json_is_number(ts) && json_is_number(dur) &&
                json_number_value(dur) >= 0 && json_number_value(dur) <= MAX_TIME &&
                fabs(json_number_value(ts)) <= MAX_TIME) {
                struct iov v = {.ts = json_number_value(ts), .dur = json_number_value(dur), .kind = 0};
                if (nm && !strncmp(nm, "known", 5)) v.kind = 1;
                else if (nm && !strncmp(nm, "predicted", 9)) v.kind = 2;
                const json_t *b = json_object_get(json_object_get(e, "args"), "bytes");
                v.bytes = json_is_number(b) && json_number_value(b) >= 0 && json_number_value(b) <= MAX_TIME
                              ? json_number_value(b) : 0; /* a read's bytes, within what the sums keep finite */
                IO[nio++] = v;
            }
            continue;
        }
        snprintf(w, sizeof w, "%s.ph", where);
        if (!ph) { st = fmt_err(name, w, "missing (expected a string such as \"X\")"); goto fail; }
        if (!strcmp(ph, "M")) {
            if (nm && !strcmp(nm, "thread_name")) {
                int64_t tid;
                if ((st = key_int(name, where, e, "tid", 0, MAX_WORKERS - 1, &tid))) goto fail;
                if (tid > max_tid) max_tid = tid;
            }
            continue;
        }
        if (strcmp(ph, "X")) continue; /* other event kinds carry no phase time */
        struct ev x;
        snprintf(w, sizeof w, "%s.name", where);
        if (!nm) { st = fmt_err(name, w, "missing (expected a phase name)"); goto fail; }
        if ((x.phase = phase_from_name(nm)) < 0) {
            char msg[160];
            snprintf(msg, sizeof msg, "unknown phase name \"%.100s\"", nm);
            st = fmt_err(name, w, msg);
            goto fail;
        }
        int64_t tid;
        if ((st = key_sec(name, where, e, "ts", &x.ts)) || (st = key_sec(name, where, e, "dur", &x.dur)) ||
            (st = key_int(name, where, e, "tid", 0, MAX_WORKERS - 1, &tid)))
            goto fail;
        x.worker = (int)tid;
        const json_t *args = json_object_get(e, "args");
        snprintf(w, sizeof w, "%s.args", where);
        if (!json_is_object(args)) { st = fmt_err(name, w, args ? "expected an object" : "missing"); goto fail; }
        int64_t layer;
        if ((st = key_int(name, w, args, "layer", -1, MAX_LAYERS - 1, &layer)) ||
            (st = key_int(name, w, args, "step", 0, INT64_MAX, &x.step)))
            goto fail;
        x.layer = (int)layer;
        x.tokens = 1;
        if (json_object_get(args, "tokens") && (st = key_int(name, w, args, "tokens", 1, MAX_STEP_COUNT, &x.tokens)))
            goto fail;
        if (tid > max_tid) max_tid = tid;
        if (layer > max_layer) max_layer = layer;
        E[m++] = x;
    }
    if (!m) { st = fmt_err(name, "traceEvents", "no spans (\"ph\": \"X\" events) to report"); goto fail; }
    const json_t *od = json_object_get(root, "otherData");
    if (json_is_object(od) && json_object_get(od, "dropped_spans") &&
        (st = key_int(name, "otherData", od, "dropped_spans", 0, INT64_MAX, &r->dropped_spans)))
        goto fail;
    if (json_is_object(od) && (st = parse_store(r, name, json_object_get(od, "store")))) goto fail;
    r->n_workers = (int)(max_tid + 1);
    r->n_layer = (int)(max_layer + 1);
    snprintf(r->model, sizeof r->model, "%s", "");
    if ((st = report_alloc(r))) goto fail;
    const int W = r->n_workers;
    qsort(E, m, sizeof *E, ev_cmp);
    win = malloc(sizeof *win * 2 * (m + 1)); /* each step's [t0, t1] */
    if (!win) { st = moetax_error(MOETAX_ERR_NOMEM, "%s: out of memory", name); goto fail; }
    double best = -1;
    bool best_decode = false;
    size_t best_i0 = 0, best_i1 = 0;
    for (size_t i0 = 0; i0 < m;) {
        size_t i1 = i0;
        int64_t tokens = 1;
        double t0 = INFINITY, t1 = 0;
        while (i1 < m && E[i1].step == E[i0].step) {
            if (E[i1].tokens > tokens) tokens = E[i1].tokens;
            if (E[i1].ts < t0) t0 = E[i1].ts;
            if (E[i1].ts + E[i1].dur > t1) t1 = E[i1].ts + E[i1].dur;
            i1++;
        }
        bool prefill = tokens > 1;
        double wall = 1e-6 * (t1 - t0);
        win[2 * nwin] = t0;
        win[2 * nwin + 1] = t1;
        nwin++;
        struct moetax_report_agg *as[2] = {&r->all, prefill ? &r->prefill : &r->decode};
        for (int a = 0; a < 2; a++) {
            as[a]->steps++;
            as[a]->tokens += tokens;
            as[a]->wall_s += wall;
            for (size_t i = i0; i < i1; i++) add_span(as[a], &E[i], W);
        }
        if ((!prefill && (!best_decode || wall > best)) || (prefill && !best_decode && wall > best)) {
            best = wall;
            best_decode = !prefill;
            best_i0 = i0;
            best_i1 = i1;
        }
        i0 = i1;
    }
    agg_sum_phases(&r->all, r->n_layer);
    agg_sum_phases(&r->prefill, r->n_layer);
    agg_sum_phases(&r->decode, r->n_layer);
    if (nio > 0) {
        if ((st = io_summary(r, IO, nio, win, nwin))) goto fail;
        r->io->stall_s = r->all.phase_s[MOETAX_PHASE_LOAD];
    }
    struct moetax_report_timeline *t = &r->timeline;
    t->spans = malloc(sizeof *t->spans * (best_i1 - best_i0 + 1));
    if (!t->spans) { st = moetax_error(MOETAX_ERR_NOMEM, "%s: out of memory", name); goto fail; }
    t->valid = true;
    t->step = E[best_i0].step;
    t->tokens = 1;
    double t0 = INFINITY;
    for (size_t i = best_i0; i < best_i1; i++) {
        if (E[i].tokens > t->tokens) t->tokens = E[i].tokens;
        if (E[i].ts < t0) t0 = E[i].ts;
    }
    t->prefill = t->tokens > 1;
    t->wall_s = best;
    for (size_t i = best_i0; i < best_i1; i++) {
        const struct ev *e = &E[i];
        if (e->layer < 0) t->other_phase_s[e->phase] += 1e-6 * e->dur / W;
        else t->layer_phase_s[(size_t)e->layer * P + e->phase] += 1e-6 * e->dur / W;
        t->spans[t->n_spans++] = (struct moetax_report_span){
            .worker = e->worker, .layer = e->layer, .phase = (enum moetax_phase)e->phase,
            .t0_us = e->ts - t0, .dur_us = e->dur};
    }
fail:
    free(E);
    free(IO);
    free(win);
    return st;
}

/* ---- entry points ------------------------------------------------------------------- */

moetax_status moetax_report_from_json(const json_t *root, const char *name, const struct moetax_report_params *p,
                                     struct moetax_report **out) {
    *out = NULL;
    if (!name) name = "(memory)";
    moetax_status st;
    struct moetax_report *r = NULL;
    if (!json_is_object(root)) {
        st = moetax_error(MOETAX_ERR_FORMAT, "%s: expected a JSON object (a moetax ledger or a Chrome trace)", name);
    } else if (!(r = report_new(name, p))) {
        st = moetax_error(MOETAX_ERR_NOMEM, "out of memory");
    } else if (json_object_get(root, "moetax_ledger")) {
        st = parse_ledger(r, name, root);
    } else if (json_object_get(root, "traceEvents")) {
        st = parse_trace(r, name, root);
    } else {
        st = moetax_error(MOETAX_ERR_FORMAT,
                          "%s: neither a moetax ledger (no \"moetax_ledger\" key) nor a Chrome trace (no \"traceEvents\")",
                          name);
    }
    if (st) {
        moetax_report_free(r);
        return st;
    }
    *out = r;
    return MOETAX_OK;
}

moetax_status moetax_report_parse(const char *text, size_t len, const char *name, const struct moetax_report_params *p,
                                  struct moetax_report **out) {
    *out = NULL;
    if (!name) name = "(memory)";
    json_error_t jerr;
    json_t *root = json_loadb(text, len, 0, &jerr);
    if (!root)
        return moetax_error(MOETAX_ERR_FORMAT, "%s: not valid JSON: line %d, column %d: %s", name, jerr.line,
                            jerr.column, jerr.text);
    const moetax_status st = moetax_report_from_json(root, name, p, out);
    json_decref(root);
    return st;
}

moetax_status moetax_report_load(const char *path, const struct moetax_report_params *p, struct moetax_report **out) {
    *out = NULL;
    char *buf;
    size_t len;
    moetax_status st = moetax_readfile_path(path, NULL, &buf, &len);
    if (st) return st;
    if (len == 0) st = moetax_error(MOETAX_ERR_FORMAT, "%s: the file is empty", path);
    else st = moetax_report_parse(buf, len, path, p, out);
    free(buf);
    return st;
}
