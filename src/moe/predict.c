/*
 * predict.c - the learned expert predictor inside the MoE block (see moe/predict.h and
 * include/moetax/predict.h for the model and its features).
 *
 * Worker 0 calls moe_predict_learned once per MoE layer and micro-batch, after the layer has
 * routed. It keeps, per layer, the MoE input rows of the last two micro-batches that reached
 * it (with their sequence and position), so that:
 *   - a prediction of layer T made at layer l (the store's prefetch) finds the previous
 *     token's row at T among the micro-batch before (decode: the token before);
 *   - once T has routed, every pair (l, a) targeting T is scored on T's tokens: the router
 *     guess (T's router on the normed row of l) and the learned map, each against the experts
 *     T chose, with the features a decode step would have had (the previous token's row at T
 *     from this micro-batch or the one before). For one token per micro-batch this is exactly
 *     the prediction the prefetch used;
 *   - when fitting, the same features and T's true router logits go into the fit's sums.
 * Selection from predicted logits follows the router's rules (gating, bias, group limit,
 * top-k), as in moe.c.
 */
#include "moe/predict.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "moetax/predict.h"
#include "moetax/store.h"

struct rows {
    float *x;         /* [U][d] */
    int32_t *seq, *pos;
    int64_t n;
    uint64_t stamp;   /* micro-batch these rows are of; 0: none */
};

struct run {
    int64_t U, d, E, k, F;
    int L, first_moe;
    uint64_t stamp;
    struct rows *cur, *old; /* [L] the last micro-batch at the layer, the one before */
    float **router;         /* [L] F32 router rows [E][d], NULL for dense layers */
    float *feat;            /* [U][F] */
    float *z, *p;           /* [E], [2E] */
    int32_t *idx;           /* [k] */
    int32_t *list;          /* [E + U * k] distinct experts, a prediction two ahead */
    /* one token per micro-batch (decode): the predictions made for layer T one layer ahead (the
     * router guess of moe.c and the learned one), kept to be scored when T routes instead of
     * computed again (the features are the same) */
    int32_t *saved_router, *saved_learned; /* [L][k] */
    uint64_t *saved_stamp;                 /* [L] micro-batch they are of; 0: none */
    bool broken;            /* out of memory at setup: the predictor stays off */
};

static void run_free(void *v) {
    struct run *r = v;
    if (!r) return;
    for (int l = 0; l < r->L; l++) {
        if (r->cur) { free(r->cur[l].x); free(r->cur[l].seq); free(r->cur[l].pos); }
        if (r->old) { free(r->old[l].x); free(r->old[l].seq); free(r->old[l].pos); }
        if (r->router) free(r->router[l]);
    }
    free(r->cur);
    free(r->old);
    free(r->router);
    free(r->feat);
    free(r->z);
    free(r->p);
    free(r->idx);
    free(r->list);
    free(r->saved_router);
    free(r->saved_learned);
    free(r->saved_stamp);
    free(r);
}

bool moe_predict_router_rows(const struct moetax_model *m, int layer, float *out) {
    const struct moetax_layer *l = &m->layers[layer];
    const int64_t d = m->hp.n_embd, E = m->hp.n_expert;
    if (!l->is_moe || !l->gate_inp.data) return false;
    const char *base = l->gate_inp.file_data ? l->gate_inp.file_data : l->gate_inp.data;
    for (int64_t e = 0; e < E; e++)
        if (!moetax_to_float(l->gate_inp.type, base + (size_t)e * l->gate_inp.row_bytes, out + e * d, d)) return false;
    return true;
}

static struct run *run_get(struct moetax_predictor *p, const struct fw_step *s, const struct moe *b) {
    struct run *r = p->run;
    if (r) return r->broken || r->U < s->n_ubatch ? NULL : r;
    const struct moetax_model *m = s->m;
    r = calloc(1, sizeof *r);
    if (!r) return NULL;
    p->run = r;
    p->run_free = run_free;
    r->U = s->n_ubatch;
    r->d = m->hp.n_embd;
    r->E = m->hp.n_expert;
    r->k = b->k;
    r->F = p->n_feat;
    r->L = m->hp.n_layer;
    r->first_moe = -1;
    r->cur = calloc((size_t)r->L, sizeof *r->cur);
    r->old = calloc((size_t)r->L, sizeof *r->old);
    r->router = calloc((size_t)r->L, sizeof *r->router);
    r->feat = malloc(sizeof(float) * (size_t)(r->U * r->F));
    r->z = malloc(sizeof(float) * (size_t)r->E);
    r->p = malloc(sizeof(float) * (size_t)(2 * r->E));
    r->idx = malloc(sizeof(int32_t) * (size_t)r->k);
    r->list = malloc(sizeof(int32_t) * (size_t)(r->E + r->U * r->k));
    r->saved_router = malloc(sizeof(int32_t) * (size_t)(r->L * r->k));
    r->saved_learned = malloc(sizeof(int32_t) * (size_t)(r->L * r->k));
    r->saved_stamp = calloc((size_t)r->L, sizeof(uint64_t));
    bool ok = r->cur && r->old && r->router && r->feat && r->z && r->p && r->idx && r->list && r->saved_router &&
              r->saved_learned && r->saved_stamp;
    for (int l = 0; ok && l < r->L; l++) {
        if (!m->layers[l].is_moe) continue;
        if (r->first_moe < 0) r->first_moe = l;
        struct rows *rs[2] = {&r->cur[l], &r->old[l]};
        for (int i = 0; i < 2 && ok; i++) {
            rs[i]->x = malloc(sizeof(float) * (size_t)(r->U * r->d));
            rs[i]->seq = malloc(sizeof(int32_t) * (size_t)r->U);
            rs[i]->pos = malloc(sizeof(int32_t) * (size_t)r->U);
            ok = rs[i]->x && rs[i]->seq && rs[i]->pos;
        }
        if (ok) ok = (r->router[l] = malloc(sizeof(float) * (size_t)(r->E * r->d))) != NULL;
        if (ok && !moe_predict_router_rows(m, l, r->router[l])) {
            free(r->router[l]);
            r->router[l] = NULL;
        }
    }
    r->broken = !ok;
    return ok ? r : NULL;
}

/* The row of (seq, pos) in rs, or NULL. */
static const float *find_row(const struct run *r, const struct rows *rs, int32_t seq, int32_t pos, int64_t below) {
    const int64_t n = below < rs->n ? below : rs->n;
    for (int64_t i = n; i-- > 0;)
        if (rs->seq[i] == seq && rs->pos[i] == pos) return rs->x + i * r->d;
    return NULL;
}

/* Features of one token for target layer T: [norm(x) * ffn_norm_T ; norm(prev) * ffn_norm_T or 0 ; 1]. */
static void features(const struct fw_step *s, const struct moetax_predictor *p, const struct run *r, int T,
                     const float *x, const float *prev, float *f) {
    const float *w = s->m->layers[T].ffn_norm;
    const float eps = s->m->hp.rms_eps;
    s->K->rmsnorm(f, x, w, r->d, eps);
    int64_t o = r->d;
    if (p->features & MOETAX_PREDICT_FEAT_PREV) {
        if (prev) s->K->rmsnorm(f + o, prev, w, r->d, eps);
        else memset(f + o, 0, sizeof(float) * (size_t)r->d);
        o += r->d;
    }
    f[o] = 1.0f;
}

/* Experts of layer T from logits z (scratch r->p), as the router selects them (moe.c route_token). */
static void select_experts(const struct fw_step *s, const struct run *r, int T, const float *z, int32_t *idx) {
    const struct moetax_hparams *hp = &s->m->hp;
    const float *bias = s->m->layers[T].exp_probs_b;
    const int64_t E = r->E;
    float *p = r->p, *sc = r->p + E;
    memcpy(p, z, sizeof(float) * (size_t)E);
    if (hp->gating_func == 2) s->K->sigmoid(p, E);
    else s->K->softmax(p, E);
    for (int64_t e = 0; e < E; e++) sc[e] = bias ? p[e] + bias[e] : p[e];
    if (hp->n_expert_group > 1 && hp->n_expert_group <= 256 && E % hp->n_expert_group == 0) {
        const int64_t G = hp->n_expert_group, per = E / G;
        float gscore[256];
        int32_t gidx[256];
        for (int64_t g = 0; g < G; g++) {
            float a = -INFINITY, c = -INFINITY;
            for (int64_t e = g * per; e < (g + 1) * per; e++) {
                if (sc[e] > a) { c = a; a = sc[e]; }
                else if (sc[e] > c) c = sc[e];
            }
            gscore[g] = a + c;
        }
        s->K->topk(gscore, G, hp->n_expert_group_used, gidx, NULL);
        bool keep[256] = {false};
        for (int64_t j = 0; j < hp->n_expert_group_used; j++) keep[gidx[j]] = true;
        for (int64_t g = 0; g < G; g++)
            if (!keep[g])
                for (int64_t e = g * per; e < (g + 1) * per; e++) sc[e] = -INFINITY;
    }
    s->K->topk(sc, E, r->k, idx, NULL);
}

static void matvec(const struct fw_step *s, const float *W, int64_t rows, int64_t cols, int64_t stride,
                   const float *f, float *z) {
    for (int64_t e = 0; e < rows; e++) z[e] = s->K->dot(W + e * stride, f, cols);
}

static void score(struct moetax_predict_score *sc, const int32_t *pred, int64_t k, const int32_t *actual) {
    sc->tokens++;
    sc->predicted += (uint64_t)k;
    for (int64_t j = 0; j < k; j++) {
        if (actual[j] < 0) continue;
        sc->actual++;
        for (int64_t i = 0; i < k; i++)
            if (pred[i] == actual[j]) { sc->hits++; break; }
    }
}

/* Distinct experts of rows [n][k] into out (at most E), in order; -1 skipped. */
static int distinct(const int32_t *rows, int64_t nk, int64_t E, int32_t *out) {
    int m = 0;
    for (int64_t i = 0; i < nk; i++) {
        bool seen = rows[i] < 0 || rows[i] >= E;
        for (int j = 0; j < m && !seen; j++) seen = out[j] == rows[i];
        if (!seen) out[m++] = rows[i];
    }
    return m;
}

/* Deeper prefetch: the learned guess for the MoE layer two ahead of il, read only while the I/O
 * workers have room (the store drops a prediction when every worker is busy or the disk was busy
 * most of the last token) and while that distance's guesses have been mostly right on this run
 * (MOE_PREDICT_TWO_AHEAD_MIN_PRECISION over at least 16 scored tokens). Its reads are queued
 * after those the nearer layers need: this layer's known experts, then the guess for il + 1,
 * which the block would queue next anyway (a repeated request for an expert in flight or
 * resident is a no-op). */
#define MOE_PREDICT_TWO_AHEAD_MIN_PRECISION 0.6
static void prefetch_two_ahead(const struct fw_step *s, struct moe *b, struct moetax_predictor *p, struct run *r,
                               int il) {
    const float *W2 = moetax_predictor_weights(p, il, 2);
    if (!W2 || !b->prefetch) return;
    const int q2 = moetax_predictor_pair(p, il, 2), T2 = p->target[q2], nq = p->n_layer * p->ahead;
    const struct moetax_predict_score *sc = &p->score[(size_t)MOETAX_PREDICT_LEARNED * (size_t)nq + (size_t)q2];
    if (T2 < 0 || sc->tokens < 16 || (double)sc->hits < MOE_PREDICT_TWO_AHEAD_MIN_PRECISION * (double)sc->predicted) return;
    const int64_t n = s->n, d = r->d, E = r->E, k = r->k, F = r->F, U = s->n_ubatch;
    int32_t *list = r->list, *sel2 = r->list + E;
    int m = distinct(b->sel + (int64_t)il * U * k, n * k, E, list);
    moetax_store_prefetch(b->store, il, list, m, false);
    m = distinct(b->pred + (int64_t)(il + 1) * U * k, n * k, E, list);
    moetax_store_prefetch(b->store, il + 1, list, m, true);
    for (int64_t t = 0; t < n; t++) {
        const float *prev = find_row(r, &r->cur[T2], s->seq[t], s->pos[t] - 1, r->cur[T2].n);
        float *f = r->feat + t * F;
        features(s, p, r, T2, s->x + t * d, prev, f);
        matvec(s, W2, E, F, F, f, r->z);
        select_experts(s, r, T2, r->z, sel2 + t * k);
    }
    m = distinct(sel2, n * k, E, list);
    moetax_store_prefetch(b->store, T2, list, m, true);
}

void moe_predict_learned(const struct fw_step *s, struct moe *b, int il) {
    struct moetax_predictor *p = b->store ? moetax_store_predictor(b->store) : NULL;
    if (!p || p->n_layer != s->m->hp.n_layer || p->n_embd != s->m->hp.n_embd || p->n_expert != s->m->hp.n_expert)
        return;
    struct run *r = run_get(p, s, b);
    if (!r || r->k != b->k) return;
    const int64_t n = s->n, d = r->d, E = r->E, k = r->k, F = r->F, U = s->n_ubatch;
    if (il == r->first_moe) r->stamp++;
    /* this micro-batch's rows at il */
    struct rows tmp = r->old[il];
    r->old[il] = r->cur[il];
    r->cur[il] = tmp;
    struct rows *cur = &r->cur[il];
    memcpy(cur->x, s->x, sizeof(float) * (size_t)(n * d));
    memcpy(cur->seq, s->seq, sizeof(int32_t) * (size_t)n);
    memcpy(cur->pos, s->pos, sizeof(int32_t) * (size_t)n);
    cur->n = n;
    cur->stamp = r->stamp;

    /* score (and fit) the pairs that target il, on its routing */
    const int32_t *actual = b->sel + (int64_t)il * U * k;
    const int nq = p->n_layer * p->ahead;
    for (int a = 1; a <= p->ahead; a++) {
        int src = -1;
        for (int l = 0; l < il; l++)
            if (p->target[moetax_predictor_pair(p, l, a)] == il) src = l;
        if (src < 0 || r->cur[src].stamp != r->stamp || r->cur[src].n != n || !r->router[il]) continue;
        const int q = moetax_predictor_pair(p, src, a);
        const float *W = moetax_predictor_weights(p, src, a);
        if (a == 1 && n == 1 && r->saved_stamp[il] == r->stamp && !p->xtx) { /* decode: as predicted */
            score(&p->score[(size_t)MOETAX_PREDICT_ROUTER * (size_t)nq + (size_t)q], r->saved_router + il * k, k, actual);
            if (W)
                score(&p->score[(size_t)MOETAX_PREDICT_LEARNED * (size_t)nq + (size_t)q], r->saved_learned + il * k, k,
                      actual);
            continue;
        }
        for (int64_t t = 0; t < n; t++) {
            const float *prev = find_row(r, cur, s->seq[t], s->pos[t] - 1, t);
            if (!prev) prev = find_row(r, &r->old[il], s->seq[t], s->pos[t] - 1, r->old[il].n);
            float *f = r->feat + t * F;
            features(s, p, r, il, r->cur[src].x + t * d, prev, f);
            matvec(s, r->router[il], E, d, d, f, r->z); /* the router guess: T's router on the normed row */
            select_experts(s, r, il, r->z, r->idx);
            score(&p->score[(size_t)MOETAX_PREDICT_ROUTER * (size_t)nq + (size_t)q], r->idx, k, actual + t * k);
            if (W) {
                matvec(s, W, E, F, F, f, r->z);
                select_experts(s, r, il, r->z, r->idx);
                score(&p->score[(size_t)MOETAX_PREDICT_LEARNED * (size_t)nq + (size_t)q], r->idx, k, actual + t * k);
            }
        }
        if (p->xtx) moetax_predictor_fit_add(p, src, a, r->feat, b->router, n);
    }

    /* the prefetch's prediction for il + 1: the learned map in place of the router guess */
    const int T = il + 1;
    const float *W = moetax_predictor_weights(p, il, 1);
    if (!p->use || !W || T >= r->L || p->target[moetax_predictor_pair(p, il, 1)] != T || !b->pred_ok[T]) return;
    int32_t *pred = b->pred + (int64_t)T * U * k;
    if (n == 1) memcpy(r->saved_router + T * k, pred, sizeof(int32_t) * (size_t)k);
    for (int64_t t = 0; t < n; t++) {
        const float *prev = find_row(r, &r->cur[T], s->seq[t], s->pos[t] - 1, r->cur[T].n);
        float *f = r->feat + t * F;
        features(s, p, r, T, s->x + t * d, prev, f);
        matvec(s, W, E, F, F, f, r->z);
        select_experts(s, r, T, r->z, pred + t * k);
    }
    if (n == 1) {
        memcpy(r->saved_learned + T * k, pred, sizeof(int32_t) * (size_t)k);
        r->saved_stamp[T] = r->stamp;
    }
    prefetch_two_ahead(s, b, p, r, il);
}
