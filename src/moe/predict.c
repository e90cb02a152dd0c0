/*
 * predict.c - the learned expert predictor inside the MoE block (see moe/predict.h and
 * include/moetax/predict.h for the model and its features).
 *
 * Worker 0 calls moe_predict_learned once per MoE layer and micro-batch, after the layer has
 * routed. It keeps, per layer, the MoE input rows of the last two micro-batches that reached
 * it (with their sequence and position, routing and router logits), so that:
 *   - a prediction of layer T made at layer l (the store's prefetch) finds the previous
 *     token's row at T among the micro-batch before (decode: the token before);
 *   - once T has routed, every pair (l, a) targeting T is scored on T's tokens: the router
 *     guess (T's router on the normed row of l) and the learned map, each against the experts
 *     T chose, with the features a decode step would have had (the previous token's row at T
 *     from this micro-batch or the one before). For one token per micro-batch this is exactly
 *     the prediction the prefetch used;
 *   - when fitting, the same features and T's true router logits go into the fit's sums;
 *   - with --dump-features, the layer's rows go to the feature file.
 * Selection from predicted logits follows the router's rules (gating, bias, group limit,
 * top-k), as in moe.c; a margin adds up to k more experts by confidence.
 */
#include "moe/predict.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "moetax/outfile.h"
#include "moetax/predict.h"
#include "moetax/store.h"

struct rows {
    float *x;         /* [U][d] */
    float *z;         /* [U][E] router logits */
    int32_t *sel;     /* [U][k] experts chosen */
    int32_t *seq, *pos;
    int64_t n;
    uint64_t stamp;   /* micro-batch these rows are of; 0: none */
};

struct run {
    int64_t U, d, E, k, F, H;
    int L, first_moe;
    uint64_t stamp;
    struct rows *cur, *old; /* [L] the last micro-batch at the layer, the one before */
    float **router;         /* [L] F32 router rows [E][d], NULL for dense layers */
    float *feat;            /* [U][F] */
    float *z, *p;           /* [E], [2E] */
    float *zb, *zt, *hb;    /* [U][E], [U][E], [U][H]: a micro-batch's estimated logits, hidden layer */
    /* the weights as the kernels read them (prepared at setup, see MOETAX_PREDICT_WEIGHTS): per
     * pair W [E][F], W1 [H][F], W2 [E][H] */
    enum moetax_type wtype;
    int64_t Fp;             /* F padded for the type's blocks (zeros) */
    struct mat { void *data; size_t row_bytes; int64_t ncols; } *mw, *mw1, *mw2; /* [pairs] */
    float *fpad;            /* [U][max(Fp, H)] a row of features (or hidden units) padded with zeros */
    void *xq;               /* the kernels' prepared activations of fpad */
    uint64_t gen;           /* the predictor's weights_gen the matrices were prepared from */
    int32_t *idx;           /* [2k] */
    int32_t *list;          /* [E + U * 2k] distinct experts, a prediction two ahead or the extras */
    int32_t *extra;         /* [U][k] the margin's extra experts of the prefetch's prediction, -1: none */
    float *mg;              /* [2k] decoding with the read-ahead: the offered experts' margins */
    /* one token per micro-batch (decode): the predictions made for layer T one layer ahead (the
     * router guess of moe.c and the learned one, with its extras), kept to be scored when T
     * routes instead of computed again (the features are the same) */
    int32_t *saved_router, *saved_learned; /* [L][k], [L][2k] */
    int32_t *saved_n;                      /* [L] experts in saved_learned */
    uint64_t *saved_stamp;                 /* [L] micro-batch they are of; 0: none */
    bool broken;            /* out of memory at setup: the predictor stays off */
};

static void free_mats(struct run *r);

static void rows_free(struct rows *r) {
    free(r->x);
    free(r->z);
    free(r->sel);
    free(r->seq);
    free(r->pos);
}

static void run_free(void *v) {
    struct run *r = v;
    if (!r) return;
    for (int l = 0; l < r->L; l++) {
        if (r->cur) rows_free(&r->cur[l]);
        if (r->old) rows_free(&r->old[l]);
        if (r->router) free(r->router[l]);
    }
    free(r->cur);
    free(r->old);
    free(r->router);
    free(r->feat);
    free(r->z);
    free(r->p);
    free(r->zb);
    free(r->zt);
    free(r->hb);
    if (r->mw && r->mw1 && r->mw2) free_mats(r);
    free(r->mw);
    free(r->mw1);
    free(r->mw2);
    free(r->fpad);
    free(r->xq);
    free(r->idx);
    free(r->list);
    free(r->extra);
    free(r->mg);
    free(r->saved_router);
    free(r->saved_learned);
    free(r->saved_n);
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

/* The type the engine reads the predictor's matrices in: MOETAX_PREDICT_WEIGHTS=q8_0 (default:
 * about a quarter of F32's bytes, the kernels' fastest matrix x vector; features and hidden units
 * quantized per block of 32 as the model's activations are), f16 or f32 (the file's values). */
static enum moetax_type weights_type(void) {
    const char *e = getenv("MOETAX_PREDICT_WEIGHTS");
    if (e && !strcmp(e, "f32")) return MOETAX_TYPE_F32;
    if (e && !strcmp(e, "f16")) return MOETAX_TYPE_F16;
    return MOETAX_TYPE_Q8_0;
}

/* rows x cols of src (row stride cols floats) into m as type t, cols padded with zeros to ncols */
static bool prepare(const struct moetax_kernels *K, enum moetax_type t, const float *src, int64_t rows, int64_t cols,
                    int64_t ncols, struct mat *m) {
    m->ncols = ncols;
    m->row_bytes = moetax_row_size(t, ncols);
    if (!(m->data = malloc(m->row_bytes * (size_t)rows))) return false;
    float *row = calloc((size_t)ncols, sizeof(float));
    if (!row) return false;
    for (int64_t i = 0; i < rows; i++) {
        memcpy(row, src + i * cols, sizeof(float) * (size_t)cols);
        char *dst = (char *)m->data + (size_t)i * m->row_bytes;
        if (t == MOETAX_TYPE_F32) memcpy(dst, row, sizeof(float) * (size_t)ncols);
        else if (t == MOETAX_TYPE_F16) K->fp32_to_fp16(row, (uint16_t *)(void *)dst, ncols);
        else moetax_quantize_row_q8_0_ref(row, (moetax_block_q8_0 *)(void *)dst, ncols);
    }
    free(row);
    return moetax_kernels_repack(K, t, m->data, m->data, rows, ncols) == MOETAX_OK;
}

static void free_mats(struct run *r) {
    for (int q = 0; q < r->L * MOETAX_PREDICT_AHEAD_MAX; q++) {
        free(r->mw[q].data);
        free(r->mw1[q].data);
        free(r->mw2[q].data);
        r->mw[q] = r->mw1[q] = r->mw2[q] = (struct mat){0};
    }
}

/* Every present pair's matrices as the kernels read them, from the predictor's weights now. */
static bool prepare_all(const struct fw_step *s, const struct moetax_predictor *p, struct run *r) {
    free_mats(r);
    bool ok = true;
    for (int q = 0; ok && q < p->n_layer * p->ahead; q++) {
        const float *w1, *b1, *w2;
        if (!p->have[q]) continue;
        const int layer = q / p->ahead, a = q % p->ahead + 1;
        ok = prepare(s->K, r->wtype, moetax_predictor_weights(p, layer, a), r->E, r->F, r->Fp, &r->mw[q]);
        if (ok && moetax_predictor_hidden(p, layer, a, &w1, &b1, &w2))
            ok = prepare(s->K, r->wtype, w1, r->H, r->F, r->Fp, &r->mw1[q]) &&
                 prepare(s->K, r->wtype, w2, r->E, r->H, r->H, &r->mw2[q]);
    }
    r->gen = p->weights_gen;
    return ok;
}

static struct run *run_get(struct moetax_predictor *p, const struct fw_step *s, const struct moe *b) {
    struct run *r = p->run;
    if (r && !r->broken && r->gen != p->weights_gen && !prepare_all(s, p, r)) r->broken = true; /* refitted */
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
    r->H = p->n_hidden;
    r->L = m->hp.n_layer;
    r->first_moe = -1;
    r->cur = calloc((size_t)r->L, sizeof *r->cur);
    r->old = calloc((size_t)r->L, sizeof *r->old);
    r->router = calloc((size_t)r->L, sizeof *r->router);
    r->feat = malloc(sizeof(float) * (size_t)(r->U * r->F));
    r->z = malloc(sizeof(float) * (size_t)r->E);
    r->p = malloc(sizeof(float) * (size_t)(2 * r->E));
    r->zb = malloc(sizeof(float) * (size_t)(r->U * r->E));
    r->zt = malloc(sizeof(float) * (size_t)(r->U * r->E));
    r->hb = malloc(sizeof(float) * (size_t)(r->U * r->H + 1));
    r->idx = malloc(sizeof(int32_t) * (size_t)(2 * r->k));
    r->list = malloc(sizeof(int32_t) * (size_t)(r->E + 2 * r->U * r->k));
    r->extra = malloc(sizeof(int32_t) * (size_t)(r->U * r->k));
    r->mg = calloc((size_t)(2 * r->k), sizeof(float));
    r->saved_router = malloc(sizeof(int32_t) * (size_t)(r->L * r->k));
    r->saved_learned = malloc(sizeof(int32_t) * (size_t)(r->L * 2 * r->k));
    r->saved_n = calloc((size_t)r->L, sizeof(int32_t));
    r->saved_stamp = calloc((size_t)r->L, sizeof(uint64_t));
    bool ok = r->cur && r->old && r->router && r->feat && r->z && r->p && r->zb && r->zt && r->hb && r->idx && r->list && r->extra && r->mg &&
              r->saved_router && r->saved_learned && r->saved_n && r->saved_stamp;
    for (int l = 0; ok && l < r->L; l++) {
        if (!m->layers[l].is_moe) continue;
        if (r->first_moe < 0) r->first_moe = l;
        struct rows *rs[2] = {&r->cur[l], &r->old[l]};
        for (int i = 0; i < 2 && ok; i++) {
            rs[i]->x = malloc(sizeof(float) * (size_t)(r->U * r->d));
            rs[i]->z = malloc(sizeof(float) * (size_t)(r->U * r->E));
            rs[i]->sel = malloc(sizeof(int32_t) * (size_t)(r->U * r->k));
            rs[i]->seq = malloc(sizeof(int32_t) * (size_t)r->U);
            rs[i]->pos = malloc(sizeof(int32_t) * (size_t)r->U);
            ok = rs[i]->x && rs[i]->z && rs[i]->sel && rs[i]->seq && rs[i]->pos;
        }
        if (ok) ok = (r->router[l] = malloc(sizeof(float) * (size_t)(r->E * r->d))) != NULL;
        if (ok && !moe_predict_router_rows(m, l, r->router[l])) {
            free(r->router[l]);
            r->router[l] = NULL;
        }
    }
    /* the matrices as the kernels read them; Q8_0 needs rows of whole blocks of 32 */
    r->wtype = weights_type();
    if (r->wtype == MOETAX_TYPE_Q8_0 && r->H % 32) r->wtype = MOETAX_TYPE_F16;
    r->Fp = r->wtype == MOETAX_TYPE_Q8_0 ? (r->F + 31) / 32 * 32 : r->F;
    const int np = r->L * MOETAX_PREDICT_AHEAD_MAX;
    const int64_t wide = r->Fp > r->H ? r->Fp : r->H;
    if (ok) {
        r->mw = calloc((size_t)np, sizeof *r->mw);
        r->mw1 = calloc((size_t)np, sizeof *r->mw1);
        r->mw2 = calloc((size_t)np, sizeof *r->mw2);
        r->fpad = calloc((size_t)(r->U * wide), sizeof(float));
        r->xq = malloc(moetax_act_size(r->wtype, wide, r->U) + 64);
        ok = r->mw && r->mw1 && r->mw2 && r->fpad && r->xq;
    }
    if (ok) ok = prepare_all(s, p, r);
    r->broken = !ok;
    return ok ? r : NULL;
}

/* The row of (seq, pos) in rs, or -1. */
static int64_t find_row(const struct rows *rs, int32_t seq, int32_t pos, int64_t below) {
    const int64_t n = below < rs->n ? below : rs->n;
    for (int64_t i = n; i-- > 0;)
        if (rs->seq[i] == seq && rs->pos[i] == pos) return i;
    return -1;
}

/* Features of one token for target layer T: [norm(x) * ffn_norm_T ; norm(prev) * ffn_norm_T or 0 ;
 * onehot(sel) ; gate(z) ; 1] (blocks by p->features). sel [k], z [E]: the source layer's routing of
 * the token (FEAT_ROUTE only). */
static void features(const struct fw_step *s, const struct moetax_predictor *p, const struct run *r, int T,
                     const float *x, const float *prev, const int32_t *sel, const float *z, float *f) {
    const float *w = s->m->layers[T].ffn_norm;
    const float eps = s->m->hp.rms_eps;
    s->K->rmsnorm(f, x, w, r->d, eps);
    int64_t o = r->d;
    if (p->features & MOETAX_PREDICT_FEAT_PREV) {
        if (prev) s->K->rmsnorm(f + o, prev, w, r->d, eps);
        else memset(f + o, 0, sizeof(float) * (size_t)r->d);
        o += r->d;
    }
    if (p->features & MOETAX_PREDICT_FEAT_ROUTE) {
        float *oh = f + o, *g = f + o + r->E;
        memset(oh, 0, sizeof(float) * (size_t)r->E);
        for (int64_t j = 0; j < r->k; j++)
            if (sel[j] >= 0 && sel[j] < r->E) oh[sel[j]] = 1.0f;
        memcpy(g, z, sizeof(float) * (size_t)r->E);
        if (s->m->hp.gating_func == 2) s->K->sigmoid(g, r->E);
        else s->K->softmax(g, r->E, NULL);
        o += 2 * r->E;
    }
    f[o] = 1.0f;
}

/* Selection scores of layer T from logits z into r->p + E (gate, bias, group limit as moe.c's
 * route_token), the gated probabilities in r->p; returns the scores. */
static float *selection_scores(const struct fw_step *s, const struct run *r, int T, const float *z) {
    const struct moetax_hparams *hp = &s->m->hp;
    const float *bias = s->m->layers[T].exp_probs_b;
    const int64_t E = r->E;
    float *p = r->p, *sc = r->p + E;
    memcpy(p, z, sizeof(float) * (size_t)E);
    if (hp->gating_func == 2) s->K->sigmoid(p, E);
    else s->K->softmax(p, E, NULL);
    for (int64_t e = 0; e < E; e++) sc[e] = bias ? p[e] + bias[e] : p[e];
    return sc;
}

static void group_limit(const struct fw_step *s, const struct run *r, float *sc) {
    const struct moetax_hparams *hp = &s->m->hp;
    const int64_t E = r->E;
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
}

/* Experts of layer T from logits z, as the router selects them (moe.c route_token), into idx [k];
 * with margin > 0 also up to k more into extra [k] (-1 after the last): the experts of the groups
 * the router keeps, outside idx, whose score is within margin of idx's k-th. Returns the extras'
 * count. With mg (optional, [2k]): the read-ahead's score margins (moe/readahead.h) of idx, then
 * of the extras (their score minus the k-th's, <= 0). */
static int select_experts(const struct fw_step *s, const struct run *r, int T, const float *z, float margin,
                          int32_t *idx, int32_t *extra, float *mg) {
    float *sc = selection_scores(s, r, T, z);
    group_limit(s, r, sc);
    s->K->topk(sc, r->E, r->k, idx, NULL);
    if (mg) moe_ra_margins(sc, r->E, idx, r->k, mg);
    if (!(margin > 0) || !extra) return 0;
    const float kth = sc[idx[r->k - 1]];
    for (int64_t j = 0; j < r->k; j++) sc[idx[j]] = -INFINITY; /* the chosen ones out of the running */
    int m = 0;
    for (; m < r->k; m++) {
        int64_t best = -1;
        for (int64_t e = 0; e < r->E; e++)
            if (sc[e] >= kth - margin && (best < 0 || sc[e] > sc[best])) best = e;
        if (best < 0) break;
        extra[m] = (int32_t)best;
        if (mg) mg[r->k + m] = sc[best] - kth;
        sc[best] = -INFINITY;
    }
    for (int j = m; j < r->k; j++) extra[j] = -1;
    return m;
}

/* Estimated logits zb [n][E] of pair (layer, a) from features feat [n][F]: W f (+ W2 relu(W1 f +
 * b1)), each matrix read once for the n tokens (the kernels' matrix x vectors). */
static void mat_times(const struct fw_step *s, struct run *r, const struct mat *m, int64_t rows, const float *x,
                      int64_t n, float *y, int64_t ldy) {
    const void *xq = x;
    if (r->wtype == MOETAX_TYPE_Q8_0) {
        s->K->quantize_act(r->wtype, x, m->ncols, m->ncols, n, r->xq);
        xq = r->xq;
    }
    s->K->matmul(r->wtype, m->data, m->row_bytes, 0, rows, m->ncols, xq, n, y, ldy);
}

static void predict_logits(const struct fw_step *s, const struct moetax_predictor *p, struct run *r, int layer, int a,
                           const float *feat, int64_t n, float *zb) {
    const float *w1, *b1, *w2;
    const int64_t E = r->E, F = r->F, Fp = r->Fp, H = r->H;
    const int q = moetax_predictor_pair(p, layer, a);
    const float *x = feat;
    if (!r->mw[q].data) { /* not prepared (cannot happen: prepare_all follows the weights) */
        memset(zb, 0, sizeof(float) * (size_t)(n * E));
        return;
    }
    if (Fp != F) { /* rows padded with zeros to whole blocks */
        for (int64_t t = 0; t < n; t++) {
            memcpy(r->fpad + t * Fp, feat + t * F, sizeof(float) * (size_t)F);
            memset(r->fpad + t * Fp + F, 0, sizeof(float) * (size_t)(Fp - F));
        }
        x = r->fpad;
    }
    mat_times(s, r, &r->mw[q], E, x, n, zb, E);
    if (!moetax_predictor_hidden(p, layer, a, &w1, &b1, &w2)) return;
    float *h = r->hb;
    mat_times(s, r, &r->mw1[q], H, x, n, h, H); /* x is read (quantized) before fpad is reused */
    for (int64_t t = 0; t < n; t++)
        for (int64_t j = 0; j < H; j++) {
            const float v = h[t * H + j] + b1[j];
            h[t * H + j] = v > 0 ? v : 0;
        }
    mat_times(s, r, &r->mw2[q], E, h, n, r->zt, E);
    for (int64_t i = 0; i < n * E; i++) zb[i] += r->zt[i];
}

static void matvec(const struct fw_step *s, const float *W, int64_t rows, int64_t cols, int64_t stride,
                   const float *f, float *z) {
    for (int64_t e = 0; e < rows; e++) z[e] = s->K->dot(W + e * stride, f, cols);
}

/* pred [np] against actual [k] (-1: none) */
static void score(struct moetax_predict_score *sc, const int32_t *pred, int64_t np, const int32_t *actual, int64_t k) {
    sc->tokens++;
    sc->predicted += (uint64_t)np;
    for (int64_t j = 0; j < k; j++) {
        if (actual[j] < 0) continue;
        sc->actual++;
        for (int64_t i = 0; i < np; i++)
            if (pred[i] == actual[j]) { sc->hits++; break; }
    }
}

/* Distinct experts of rows [nk] into out (at most E), in order; -1 skipped. */
static int distinct(const int32_t *rows, int64_t nk, int64_t E, int32_t *out) {
    int m = 0;
    for (int64_t i = 0; i < nk; i++) {
        bool seen = rows[i] < 0 || rows[i] >= E;
        for (int j = 0; j < m && !seen; j++) seen = out[j] == rows[i];
        if (!seen) out[m++] = rows[i];
    }
    return m;
}

/* Queue reads of rows' distinct experts of layer (this rank's only, with a world). */
static void prefetch_rows(const struct moe *b, struct run *r, int layer, const int32_t *rows, int64_t nk, bool predicted) {
    int m = distinct(rows, nk, r->E, r->list), n = 0;
    for (int i = 0; i < m; i++)
        if (!b->owner || b->owner[(int64_t)layer * r->E + r->list[i]] == b->rank) r->list[n++] = r->list[i];
    if (n) moetax_store_prefetch(b->store, layer, r->list, n, predicted);
}

/* Deeper prefetch: the learned guess for the MoE layer two ahead of il. Decoding with the store's
 * read-ahead (b->read_ahead >= 2) it is offered there, with its margins: the read-ahead reads it as
 * the disk has room and as far as guesses like it have been right. Otherwise (a batch, or the
 * read-ahead off) it is read only while the I/O workers have room (the store drops a prediction
 * when every worker is busy or the disk was busy most of the last token) and while that
 * distance's guesses have been mostly right on this run (MOE_PREDICT_TWO_AHEAD_MIN_PRECISION over
 * at least 16 scored tokens), queued after those the nearer layers need: this layer's known
 * experts, then the guess for il + 1 (with its extras), which the block would queue next anyway
 * (a repeated request for an expert in flight or resident is a no-op). */
#define MOE_PREDICT_TWO_AHEAD_MIN_PRECISION 0.6
static void prefetch_two_ahead(const struct fw_step *s, struct moe *b, struct moetax_predictor *p, struct run *r,
                               int il) {
    if (!moetax_predictor_weights(p, il, 2) || !b->prefetch) return;
    const int q2 = moetax_predictor_pair(p, il, 2), T2 = p->target[q2], nq = p->n_layer * p->ahead;
    const struct moetax_predict_score *sc = &p->score[(size_t)MOETAX_PREDICT_LEARNED * (size_t)nq + (size_t)q2];
    const int64_t n = s->n, d = r->d, E = r->E, k = r->k, F = r->F, U = s->n_ubatch;
    const bool ra = b->read_ahead >= 2 && n == 1;
    if (T2 < 0) return;
    if (!ra && (sc->tokens < 16 || (double)sc->hits < MOE_PREDICT_TWO_AHEAD_MIN_PRECISION * (double)sc->predicted))
        return;
    int32_t *sel2 = r->list + E; /* [n][2k] */
    if (!ra) {
        prefetch_rows(b, r, il, b->sel + (int64_t)il * U * k, n * k, false);
        prefetch_rows(b, r, il + 1, b->pred + (int64_t)(il + 1) * U * k, n * k, true);
        prefetch_rows(b, r, il + 1, r->extra, n * k, true);
    }
    for (int64_t t = 0; t < n; t++) {
        const int64_t pi = find_row(&r->cur[T2], s->seq[t], s->pos[t] - 1, r->cur[T2].n);
        features(s, p, r, T2, s->x + t * d, pi >= 0 ? r->cur[T2].x + pi * d : NULL, b->sel + ((int64_t)il * U + t) * k,
                 b->router + t * E, r->feat + t * F);
    }
    predict_logits(s, p, r, il, 2, r->feat, n, r->zb);
    for (int64_t t = 0; t < n; t++)
        select_experts(s, r, T2, r->zb + t * E, p->margin, sel2 + t * 2 * k, sel2 + t * 2 * k + k, ra ? r->mg : NULL);
    if (ra) moe_offer(b, E, T2, 2, sel2, r->mg, (int)(2 * k));
    else prefetch_rows(b, r, T2, sel2, n * 2 * k, true);
}

/* ---- the feature file (profile --dump-features) ------------------------------------------- */

struct dump {
    struct moetax_outfile *o;
    FILE *f;
    bool ok;
    int err; /* errno of the first write that failed */
    uint64_t records;
};

/* n bytes to the file while every write so far went through; the first failure's errno kept */
static void putb(struct dump *D, const void *p, size_t n) {
    if (D->ok && fwrite(p, 1, n, D->f) != n) {
        D->ok = false;
        D->err = errno;
    }
}
static void put32(struct dump *D, uint32_t v) {
    unsigned char b[4];
    for (int i = 0; i < 4; i++) b[i] = (unsigned char)(v >> (8 * i));
    putb(D, b, 4);
}
static void putf(struct dump *D, const float *x, int64_t n) {
    for (int64_t i = 0; i < n && D->ok; i++) {
        uint32_t u;
        memcpy(&u, &x[i], 4);
        put32(D, u);
    }
}

moetax_status moe_predict_dump_open(struct moetax_predictor *p, const struct moetax_model *m, const char *path) {
    if (p->dump) return moetax_error(MOETAX_ERR_ARG, "predictor: a feature file is open already");
    struct dump *D = calloc(1, sizeof *D);
    if (!D) return moetax_error(MOETAX_ERR_NOMEM, "out of memory");
    moetax_status st = moetax_outfile_open(path, &D->o);
    if (st) {
        free(D);
        return st;
    }
    D->f = moetax_outfile_file(D->o);
    D->ok = true;
    const struct moetax_hparams *hp = &m->hp;
    const int64_t d = hp->n_embd, E = hp->n_expert;
    uint32_t n_moe = 0;
    for (int l = 0; l < hp->n_layer; l++) n_moe += m->layers[l].is_moe;
    putb(D, "MTXFEAT\0", 8);
    const uint32_t h[9] = {1, (uint32_t)hp->n_layer, (uint32_t)d, (uint32_t)E, (uint32_t)p->n_expert_used,
                           (uint32_t)hp->gating_func, (uint32_t)(hp->n_expert_group > 1 ? hp->n_expert_group : 1),
                           (uint32_t)(hp->n_expert_group > 1 ? hp->n_expert_group_used : 1), n_moe};
    for (int i = 0; i < 9; i++) put32(D, h[i]);
    putf(D, &hp->rms_eps, 1);
    char model[64] = {0};
    snprintf(model, sizeof model, "%s", p->model);
    putb(D, model, 64);
    float *row = malloc(sizeof(float) * (size_t)(E * d + E));
    if (!row) D->ok = false, D->err = ENOMEM;
    for (int l = 0; D->ok && l < hp->n_layer; l++) {
        if (!m->layers[l].is_moe) continue;
        put32(D, (uint32_t)l);
        putf(D, m->layers[l].ffn_norm, d);
        if (!moe_predict_router_rows(m, l, row)) {
            free(row);
            moetax_outfile_abort(D->o);
            free(D);
            return moetax_error(MOETAX_ERR_ARG, "--dump-features: layer %d's router is of a type that does not convert", l);
        }
        putf(D, row, E * d);
        for (int64_t e = 0; e < E; e++) row[e] = m->layers[l].exp_probs_b ? m->layers[l].exp_probs_b[e] : 0.0f;
        putf(D, row, E);
    }
    free(row);
    p->dump = D;
    return MOETAX_OK;
}

moetax_status moe_predict_dump_close(struct moetax_predictor *p, bool commit, uint64_t *records) {
    struct dump *D = p->dump;
    if (!D) return MOETAX_OK;
    p->dump = NULL;
    if (records) *records = D->records;
    moetax_status st = MOETAX_OK;
    if (commit && !D->ok) {
        const int e = D->err ? D->err : fflush(D->f) ? errno : 0;
        st = moetax_error(MOETAX_ERR_IO, "%s: writing the feature file failed%s%s", moetax_outfile_target(D->o),
                          e ? ": " : "", e ? strerror(e) : "");
        moetax_outfile_abort(D->o);
    } else if (commit) st = moetax_outfile_commit(D->o);
    else moetax_outfile_abort(D->o);
    free(D);
    return st;
}

static void dump_rows(const struct fw_step *s, const struct moe *b, struct dump *D, int il, int64_t E, int64_t k) {
    const int64_t d = s->m->hp.n_embd, U = s->n_ubatch;
    for (int64_t t = 0; t < s->n && D->ok; t++) {
        put32(D, (uint32_t)il);
        put32(D, (uint32_t)s->seq[t]);
        put32(D, (uint32_t)s->pos[t]);
        put32(D, (uint32_t)(s->tokens ? s->tokens[t] : -1));
        putf(D, s->x + t * d, d);
        putf(D, b->router + t * E, E);
        const int32_t *sel = b->sel + ((int64_t)il * U + t) * k;
        for (int64_t j = 0; j < k; j++) put32(D, (uint32_t)sel[j]);
        D->records++;
    }
}

/* ---- per layer ------------------------------------------------------------------------------ */

void moe_predict_learned(const struct fw_step *s, struct moe *b, int il) {
    struct moetax_predictor *p = b->store ? moetax_store_predictor(b->store) : NULL;
    if (!p || p->n_layer != s->m->hp.n_layer || p->n_embd != s->m->hp.n_embd || p->n_expert != s->m->hp.n_expert)
        return;
    struct run *r = run_get(p, s, b);
    if (!r || r->k != b->k) return;
    const int64_t n = s->n, d = r->d, E = r->E, k = r->k, F = r->F, U = s->n_ubatch;
    if (il == r->first_moe) r->stamp++;
    if (p->dump) dump_rows(s, b, p->dump, il, E, k);
    /* this micro-batch's rows at il */
    struct rows tmp = r->old[il];
    r->old[il] = r->cur[il];
    r->cur[il] = tmp;
    struct rows *cur = &r->cur[il];
    memcpy(cur->x, s->x, sizeof(float) * (size_t)(n * d));
    memcpy(cur->z, b->router, sizeof(float) * (size_t)(n * E));
    memcpy(cur->sel, b->sel + (int64_t)il * U * k, sizeof(int32_t) * (size_t)(n * k));
    memcpy(cur->seq, s->seq, sizeof(int32_t) * (size_t)n);
    memcpy(cur->pos, s->pos, sizeof(int32_t) * (size_t)n);
    cur->n = n;
    cur->stamp = r->stamp;

    /* the prefetch's prediction for il + 1 below takes a few microseconds: this layer's own
     * experts are queued first (moe.c queues them again after this: a no-op) */
    const int T = il + 1;
    const float *W = moetax_predictor_weights(p, il, 1);
    const bool predict = p->use && W && T < r->L && p->target[moetax_predictor_pair(p, il, 1)] == T && b->pred_ok[T];
    if (predict && b->prefetch) prefetch_rows(b, r, il, cur->sel, n * k, false);

    /* score (and fit) the pairs that target il, on its routing */
    const int32_t *actual = b->sel + (int64_t)il * U * k;
    const int nq = p->n_layer * p->ahead;
    for (int a = 1; a <= p->ahead; a++) {
        int src = -1;
        for (int l = 0; l < il; l++)
            if (p->target[moetax_predictor_pair(p, l, a)] == il) src = l;
        if (src < 0 || r->cur[src].stamp != r->stamp || r->cur[src].n != n || !r->router[il]) continue;
        const int q = moetax_predictor_pair(p, src, a);
        const float *Wq = moetax_predictor_weights(p, src, a);
        struct moetax_predict_score *sr = &p->score[(size_t)MOETAX_PREDICT_ROUTER * (size_t)nq + (size_t)q];
        struct moetax_predict_score *sl = &p->score[(size_t)MOETAX_PREDICT_LEARNED * (size_t)nq + (size_t)q];
        if (a == 1 && n == 1 && r->saved_stamp[il] == r->stamp && !p->xtx) { /* decode: as predicted */
            score(sr, r->saved_router + il * k, k, actual, k);
            if (Wq) score(sl, r->saved_learned + il * 2 * k, r->saved_n[il], actual, k);
            continue;
        }
        const struct rows *rs = &r->cur[src];
        for (int64_t t = 0; t < n; t++) {
            int64_t pi = find_row(cur, s->seq[t], s->pos[t] - 1, t);
            const float *prev = pi >= 0 ? cur->x + pi * d : NULL;
            if (!prev && (pi = find_row(&r->old[il], s->seq[t], s->pos[t] - 1, r->old[il].n)) >= 0)
                prev = r->old[il].x + pi * d;
            float *f = r->feat + t * F;
            features(s, p, r, il, rs->x + t * d, prev, rs->sel + t * k, rs->z + t * E, f);
            matvec(s, r->router[il], E, d, d, f, r->z); /* the router guess: T's router on the normed row */
            select_experts(s, r, il, r->z, 0, r->idx, NULL, NULL);
            score(sr, r->idx, k, actual + t * k, k);
        }
        if (Wq) {
            predict_logits(s, p, r, src, a, r->feat, n, r->zb);
            for (int64_t t = 0; t < n; t++) {
                const int m = select_experts(s, r, il, r->zb + t * E, p->margin, r->idx, r->idx + k, NULL);
                score(sl, r->idx, k + m, actual + t * k, k);
            }
        }
        if (p->xtx) moetax_predictor_fit_add(p, src, a, r->feat, b->router, n);
    }

    /* the prefetch's prediction for il + 1: the learned map in place of the router guess, its
     * extras (a margin) read after it */
    if (!predict) return;
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    int32_t *pred = b->pred + (int64_t)T * U * k;
    if (n == 1) memcpy(r->saved_router + T * k, pred, sizeof(int32_t) * (size_t)k);
    int n_extra = 0;
    for (int64_t t = 0; t < n; t++) {
        const int64_t pi = find_row(&r->cur[T], s->seq[t], s->pos[t] - 1, r->cur[T].n);
        features(s, p, r, T, s->x + t * d, pi >= 0 ? r->cur[T].x + pi * d : NULL, cur->sel + t * k, cur->z + t * E,
                 r->feat + t * F);
    }
    predict_logits(s, p, r, il, 1, r->feat, n, r->zb);
    const bool ra = b->read_ahead > 0 && n == 1 && b->prefetch;
    for (int64_t t = 0; t < n; t++) {
        n_extra += select_experts(s, r, T, r->zb + t * E, p->margin, pred + t * k, r->extra + t * k, ra ? r->mg : NULL);
        if (!(p->margin > 0))
            for (int64_t j = 0; j < k; j++) r->extra[t * k + j] = -1;
    }
    if (ra) { /* the learned guess, extras included, in place of the router guess's offer */
        memcpy(r->idx, pred, sizeof(int32_t) * (size_t)k);
        memcpy(r->idx + k, r->extra, sizeof(int32_t) * (size_t)k);
        moe_offer(b, E, T, 1, r->idx, r->mg, (int)(2 * k));
    }
    if (n == 1) {
        int32_t *sv = r->saved_learned + T * 2 * k;
        memcpy(sv, pred, sizeof(int32_t) * (size_t)k);
        int m = (int)k;
        for (int64_t j = 0; j < k; j++)
            if (r->extra[j] >= 0) sv[m++] = r->extra[j];
        r->saved_n[T] = m;
        r->saved_stamp[T] = r->stamp;
    }
    if (n_extra && b->prefetch && !ra) { /* in the order the block reads: this layer, the top-k guess, the extras */
        prefetch_rows(b, r, T, pred, n * k, true);
        prefetch_rows(b, r, T, r->extra, n * k, true);
    }
    prefetch_two_ahead(s, b, p, r, il);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    p->predict_ns += (uint64_t)((t1.tv_sec - t0.tv_sec) * 1000000000ll + (t1.tv_nsec - t0.tv_nsec));
    p->predict_n += (uint64_t)n;
}
