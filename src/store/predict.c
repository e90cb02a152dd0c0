/* predict.c - the learned expert predictor: fitting (ridge regression towards the router),
 * the file and its checks, scores. See include/moetax/predict.h. The engine's side (features
 * from the residual, prediction, scoring during a run) is src/moe/predict.c. */
#include "moetax/predict.h"

#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "moetax/kernels.h"
#include "moetax/outfile.h"

static const char MAGIC[8] = {'M', 'T', 'X', 'P', 'R', 'E', 'D', 0};
enum { VERSION = MOETAX_PREDICT_VERSION };

const char *moetax_predict_kind_name(enum moetax_predict_kind k) {
    switch (k) {
    case MOETAX_PREDICT_ROUTER: return "router";
    case MOETAX_PREDICT_LEARNED: return "learned";
    case MOETAX_PREDICT_KINDS: break;
    }
    return "?";
}

static int n_pairs_of(const struct moetax_predictor *p) { return p->n_layer * p->ahead; }

int moetax_predictor_n_feat(int n_embd, int n_expert, uint32_t features) {
    return n_embd * ((features & MOETAX_PREDICT_FEAT_PREV) ? 2 : 1) + ((features & MOETAX_PREDICT_FEAT_ROUTE) ? 2 * n_expert : 0) +
           1;
}

moetax_status moetax_predictor_new_hidden(const char *model, int n_layer, int n_embd, int n_expert,
                                          int n_expert_used, const int *moe_layers, int n_moe, int ahead,
                                          uint32_t features, int n_hidden, struct moetax_predictor **out) {
    *out = NULL;
    if (n_layer < 1 || n_layer > 4096 || n_embd < 1 || n_embd > 1 << 16 || n_expert < 1 || n_expert > 1 << 16 ||
        n_expert_used < 1 || n_expert_used > n_expert || ahead < 1 || ahead > MOETAX_PREDICT_AHEAD_MAX ||
        !(features & MOETAX_PREDICT_FEAT_CUR) || (features & ~(uint32_t)MOETAX_PREDICT_FEAT_ALL) || n_moe < 0 ||
        n_moe > n_layer || n_hidden < 0 || n_hidden > MOETAX_PREDICT_HIDDEN_MAX)
        return moetax_error(MOETAX_ERR_ARG,
                            "predictor: %d layers, width %d, %d experts (%d used), %d ahead, features %u, %d hidden: "
                            "out of range", n_layer, n_embd, n_expert, n_expert_used, ahead, features, n_hidden);
    for (int i = 0; i < n_moe; i++)
        if (moe_layers[i] < 0 || moe_layers[i] >= n_layer || (i > 0 && moe_layers[i] <= moe_layers[i - 1]))
            return moetax_error(MOETAX_ERR_ARG, "predictor: MoE layers must ascend within 0..%d", n_layer - 1);
    struct moetax_predictor *p = calloc(1, sizeof *p);
    if (!p) return moetax_error(MOETAX_ERR_NOMEM, "out of memory");
    snprintf(p->model, sizeof p->model, "%s", model ? model : "");
    p->n_layer = n_layer;
    p->n_embd = n_embd;
    p->n_expert = n_expert;
    p->n_expert_used = n_expert_used;
    p->ahead = ahead;
    p->features = features;
    p->n_feat = moetax_predictor_n_feat(n_embd, n_expert, features);
    p->n_hidden = n_hidden;
    p->use = true;
    const size_t np = (size_t)n_pairs_of(p), H = (size_t)n_hidden, F = (size_t)p->n_feat, E = (size_t)n_expert;
    p->target = malloc(sizeof(int32_t) * np);
    p->have = calloc(np, 1);
    p->w = calloc(np * E * F, sizeof(float));
    p->score = calloc((size_t)MOETAX_PREDICT_KINDS * np, sizeof *p->score);
    bool ok = p->target && p->have && p->w && p->score;
    if (ok && H) {
        p->w1 = calloc(np * H * F, sizeof(float));
        p->b1 = calloc(np * H, sizeof(float));
        p->w2 = calloc(np * E * H, sizeof(float));
        ok = p->w1 && p->b1 && p->w2;
    }
    if (!ok) {
        moetax_predictor_free(p);
        return moetax_error(MOETAX_ERR_NOMEM,
                            "out of memory for a predictor of %d layers x %d experts x %d features (%d hidden)", n_layer,
                            n_expert, (int)F, n_hidden);
    }
    for (size_t i = 0; i < np; i++) p->target[i] = -1;
    for (int i = 0; i < n_moe; i++)
        for (int a = 1; a <= ahead && i + a < n_moe; a++) p->target[moetax_predictor_pair(p, moe_layers[i], a)] = moe_layers[i + a];
    *out = p;
    return MOETAX_OK;
}

moetax_status moetax_predictor_new(const char *model, int n_layer, int n_embd, int n_expert, int n_expert_used,
                                   const int *moe_layers, int n_moe, int ahead, uint32_t features,
                                   struct moetax_predictor **out) {
    return moetax_predictor_new_hidden(model, n_layer, n_embd, n_expert, n_expert_used, moe_layers, n_moe, ahead, features,
                                       0, out);
}

void moetax_predictor_free(struct moetax_predictor *p) {
    if (!p) return;
    if (p->run_free) p->run_free(p->run);
    free(p->target);
    free(p->have);
    free(p->w);
    free(p->w1);
    free(p->b1);
    free(p->w2);
    free(p->xtx);
    free(p->xty);
    free(p->fit_n);
    free(p->fit_buf);
    free(p->fit_buf_n);
    free(p->fit_scratch);
    free(p->score);
    free(p);
}

const float *moetax_predictor_weights(const struct moetax_predictor *p, int layer, int a) {
    if (!p || layer < 0 || layer >= p->n_layer || a < 1 || a > p->ahead) return NULL;
    const int q = moetax_predictor_pair(p, layer, a);
    return p->have[q] ? p->w + (size_t)q * (size_t)p->n_expert * (size_t)p->n_feat : NULL;
}

bool moetax_predictor_hidden(const struct moetax_predictor *p, int layer, int a, const float **w1, const float **b1,
                             const float **w2) {
    *w1 = *b1 = *w2 = NULL;
    if (!p || !p->n_hidden || !moetax_predictor_weights(p, layer, a)) return false;
    const size_t q = (size_t)moetax_predictor_pair(p, layer, a), H = (size_t)p->n_hidden;
    *w1 = p->w1 + q * H * (size_t)p->n_feat;
    *b1 = p->b1 + q * H;
    *w2 = p->w2 + q * (size_t)p->n_expert * H;
    return true;
}

void moetax_predictor_eval(const struct moetax_predictor *p, int layer, int a, const float *f, float *z,
                           float *scratch) {
    const float *W = moetax_predictor_weights(p, layer, a), *w1, *b1, *w2;
    const int F = p->n_feat, E = p->n_expert, H = p->n_hidden;
    for (int e = 0; e < E; e++) {
        float acc = 0;
        if (W)
            for (int i = 0; i < F; i++) acc += W[(size_t)e * F + i] * f[i];
        z[e] = acc;
    }
    if (!moetax_predictor_hidden(p, layer, a, &w1, &b1, &w2)) return;
    for (int h = 0; h < H; h++) {
        float acc = b1[h];
        for (int i = 0; i < F; i++) acc += w1[(size_t)h * F + i] * f[i];
        scratch[h] = acc > 0 ? acc : 0;
    }
    for (int e = 0; e < E; e++) {
        float acc = 0;
        for (int h = 0; h < H; h++) acc += w2[(size_t)e * H + h] * scratch[h];
        z[e] += acc;
    }
}

/* ---- fitting ------------------------------------------------------------------------------ */

/* Tokens a pair's buffer holds, transposed, before the double sums take their products (each a
 * float sum over these tokens), and feature rows per block of those products. */
enum { FIT_CHUNK = 256, FIT_BLOCK = 64 };

moetax_status moetax_predictor_fit_begin(struct moetax_predictor *p) {
    const size_t np = (size_t)n_pairs_of(p), F = (size_t)p->n_feat, E = (size_t)p->n_expert;
    free(p->xtx);
    free(p->xty);
    free(p->fit_n);
    free(p->fit_buf);
    free(p->fit_buf_n);
    free(p->fit_scratch);
    p->xtx = p->xty = NULL;
    p->fit_n = calloc(np, sizeof *p->fit_n);
    size_t n_live = 0;
    for (size_t q = 0; q < np; q++) n_live += p->target[q] >= 0;
    /* the sums of absent pairs take no room: xtx / xty are indexed by live pair */
    p->xtx = calloc(n_live * F * F + 1, sizeof(double));
    p->xty = calloc(n_live * F * E + 1, sizeof(double));
    p->fit_buf = malloc(sizeof(float) * (n_live * (F + E) * FIT_CHUNK + 1));
    p->fit_buf_n = calloc(n_live + 1, sizeof *p->fit_buf_n);
    p->fit_scratch = malloc(sizeof(float) * FIT_BLOCK * (F > E ? F : E));
    if (!p->fit_n || !p->xtx || !p->xty || !p->fit_buf || !p->fit_buf_n || !p->fit_scratch) {
        free(p->xtx);
        free(p->xty);
        free(p->fit_n);
        free(p->fit_buf);
        free(p->fit_buf_n);
        free(p->fit_scratch);
        p->xtx = p->xty = NULL;
        p->fit_n = NULL;
        p->fit_buf = p->fit_scratch = NULL;
        p->fit_buf_n = NULL;
        return moetax_error(MOETAX_ERR_NOMEM, "predictor: out of memory for the fit's sums (%.0f MiB)",
                            (double)(n_live * F * (F + E) * sizeof(double)) / (1 << 20));
    }
    return MOETAX_OK;
}

/* index of pair q among the live pairs (those with a target) */
static size_t live_index(const struct moetax_predictor *p, int q) {
    size_t i = 0;
    for (int r = 0; r < q; r++) i += p->target[r] >= 0;
    return i;
}

/* Live pair li's buffered tokens into its double sums, through the kernel table's F32 matmul:
 * the buffer holds the features transposed (xt: one row of FIT_CHUNK tokens per feature; a
 * partial chunk's other columns are zeroed, so they add nothing) and the targets likewise
 * (yt). A block of feature rows times the rows from that block on gives the block's part of
 * the upper triangle of f^T f, and the rows times the targets' rows give f^T y. F32
 * activations are the rows as they are (kernels.h), so the buffer serves as both operands. */
static void fit_flush(struct moetax_predictor *p, size_t li) {
    const size_t F = (size_t)p->n_feat, E = (size_t)p->n_expert, C = FIT_CHUNK, c = p->fit_buf_n[li];
    if (c == 0) return;
    float *xt = p->fit_buf + li * (F + E) * C, *yt = xt + F * C, *g = p->fit_scratch; /* g: [max(F, E)][FIT_BLOCK] */
    for (size_t i = 0; c < C && i < F + E; i++) memset(xt + i * C + c, 0, sizeof(float) * (C - c));
    double *A = p->xtx + li * F * F, *B = p->xty + li * F * E;
    const struct moetax_kernels *k = moetax_kernels_get();
    for (size_t i0 = 0; i0 < F; i0 += FIT_BLOCK) {
        const size_t ni = F - i0 < FIT_BLOCK ? F - i0 : FIT_BLOCK, nj = F - i0;
        /* g[b * ni + r] = sum over the chunk of f[i0 + r] f[i0 + b], b < nj */
        k->matmul(MOETAX_TYPE_F32, xt + i0 * C, sizeof(float) * C, 0, (int64_t)ni, (int64_t)C, xt + i0 * C,
                  (int64_t)nj, g, (int64_t)ni);
        for (size_t b = 0; b < nj; b++)
            for (size_t r = 0; r < ni && r <= b; r++) A[(i0 + r) * F + i0 + b] += g[b * ni + r];
        /* g[e * ni + r] = sum over the chunk of f[i0 + r] y[e] */
        k->matmul(MOETAX_TYPE_F32, xt + i0 * C, sizeof(float) * C, 0, (int64_t)ni, (int64_t)C, yt, (int64_t)E, g,
                  (int64_t)ni);
        for (size_t r = 0; r < ni; r++) {
            double *Bi = B + (i0 + r) * E;
            for (size_t e = 0; e < E; e++) Bi[e] += g[e * ni + r];
        }
    }
    p->fit_buf_n[li] = 0;
}

void moetax_predictor_fit_add(struct moetax_predictor *p, int layer, int a, const float *f, const float *y,
                              int64_t n) {
    if (!p->xtx || layer < 0 || layer >= p->n_layer || a < 1 || a > p->ahead || n <= 0) return;
    const int q = moetax_predictor_pair(p, layer, a);
    if (p->target[q] < 0) return;
    const size_t F = (size_t)p->n_feat, E = (size_t)p->n_expert, C = FIT_CHUNK, li = live_index(p, q);
    float *xt = p->fit_buf + li * (F + E) * C, *yt = xt + F * C;
    for (int64_t t = 0; t < n; t++) {
        const size_t c = p->fit_buf_n[li];
        const float *ft = f + (size_t)t * F, *ty = y + (size_t)t * E;
        for (size_t i = 0; i < F; i++) xt[i * C + c] = ft[i];
        for (size_t e = 0; e < E; e++) yt[e * C + c] = ty[e];
        if (++p->fit_buf_n[li] == C) fit_flush(p, li);
    }
    p->fit_n[q] += (uint64_t)n;
}

/* sum of a[k] b[k], k < n, in four independent chains (the compiler keeps a single chain's order,
 * which leaves the multiplier waiting on each add) */
static double dot_d(const double *a, const double *b, size_t n) {
    double s0 = 0, s1 = 0, s2 = 0, s3 = 0;
    size_t k = 0;
    for (; k + 4 <= n; k += 4) {
        s0 += a[k] * b[k];
        s1 += a[k + 1] * b[k + 1];
        s2 += a[k + 2] * b[k + 2];
        s3 += a[k + 3] * b[k + 3];
    }
    for (; k < n; k++) s0 += a[k] * b[k];
    return (s0 + s1) + (s2 + s3);
}

/* c[0..4) = sums of a[k] b0..3[k], k < n: one pass over a for four rows */
static void dot4_d(const double *a, const double *b0, const double *b1, const double *b2, const double *b3, size_t n,
                   double c[4]) {
    double s0 = 0, s1 = 0, s2 = 0, s3 = 0;
    for (size_t k = 0; k < n; k++) {
        const double x = a[k];
        s0 += x * b0[k];
        s1 += x * b1[k];
        s2 += x * b2[k];
        s3 += x * b3[k];
    }
    c[0] = s0, c[1] = s1, c[2] = s2, c[3] = s3;
}

/* Cholesky A = L L^T in place (lower triangle of A, n x n, row-major); false if not positive.
 * Four columns at a time: each row below them is read once for the four (the matrix is read
 * n / 4 times instead of n, where a model's widths make it larger than the caches). */
static bool cholesky(double *A, size_t n) {
    for (size_t j0 = 0; j0 < n; j0 += 4) {
        const size_t w = n - j0 < 4 ? n - j0 : 4;
        for (size_t j = j0; j < j0 + w; j++) { /* the panel's own rows, as the plain algorithm */
            const double *rj = A + j * n;
            double d = rj[j] - dot_d(rj, rj, j);
            if (!(d > 0)) return false;
            d = sqrt(d);
            A[j * n + j] = d;
            for (size_t i = j + 1; i < j0 + w; i++) {
                const double *ri = A + i * n;
                A[i * n + j] = (ri[j] - dot_d(ri, rj, j)) / d;
            }
        }
        if (w < 4) continue; /* the last columns: no rows below them */
        const double *r0 = A + j0 * n, *r1 = r0 + n, *r2 = r1 + n, *r3 = r2 + n;
        for (size_t i = j0 + 4; i < n; i++) {
            double *ri = A + i * n, c[4];
            dot4_d(ri, r0, r1, r2, r3, j0, c); /* over the columns before the panel */
            for (size_t q = 0; q < 4; q++) { /* then the panel's earlier columns */
                const double *rq = A + (j0 + q) * n;
                double sq = ri[j0 + q] - c[q];
                for (size_t m = 0; m < q; m++) sq -= ri[j0 + m] * rq[j0 + m];
                ri[j0 + q] = sq / rq[j0 + q];
            }
        }
    }
    return true;
}

/* Solve L L^T X = B for B [n][m] in place. */
static void chol_solve(const double *L, size_t n, double *B, size_t m) {
    for (size_t i = 0; i < n; i++) { /* forward: L Z = B */
        double *bi = B + i * m;
        for (size_t k = 0; k < i; k++) {
            const double l = L[i * n + k];
            if (l == 0) continue;
            const double *bk = B + k * m;
            for (size_t c = 0; c < m; c++) bi[c] -= l * bk[c];
        }
        for (size_t c = 0; c < m; c++) bi[c] /= L[i * n + i];
    }
    for (size_t i = n; i-- > 0;) { /* back: L^T X = Z */
        double *bi = B + i * m;
        for (size_t k = i + 1; k < n; k++) {
            const double l = L[k * n + i];
            if (l == 0) continue;
            const double *bk = B + k * m;
            for (size_t c = 0; c < m; c++) bi[c] -= l * bk[c];
        }
        for (size_t c = 0; c < m; c++) bi[c] /= L[i * n + i];
    }
}

/* One pair's solve (fit_solve, possibly on a thread of its own). */
enum { SOLVE_PENDING, SOLVE_OK, SOLVE_SKIP, SOLVE_NOMEM, SOLVE_SINGULAR, SOLVE_NOT_FINITE };
struct solve_job {
    struct moetax_predictor *p;
    double lambda;
    const float *const *router;
    int first, step;    /* pairs first, first + step, ... */
    unsigned char *res; /* [pairs] SOLVE_* */
};

static void *solve_pairs(void *arg) {
    const struct solve_job *j = arg;
    struct moetax_predictor *p = j->p;
    const size_t F = (size_t)p->n_feat, E = (size_t)p->n_expert, d = (size_t)p->n_embd;
    double *A = malloc(sizeof(double) * F * F), *B = malloc(sizeof(double) * F * E);
    for (int q = j->first; q < n_pairs_of(p); q += j->step) {
        const int T = p->target[q];
        j->res[q] = SOLVE_SKIP;
        if (T < 0 || p->fit_n[q] < 1) continue;
        if (!A || !B) {
            j->res[q] = SOLVE_NOMEM;
            continue;
        }
        const size_t li = live_index(p, q);
        const double *S = p->xtx + li * F * F, *Y = p->xty + li * F * E;
        double m = 0;
        for (size_t i = 0; i < F; i++) m += S[i * F + i];
        m = m / (double)F;
        const double r = j->lambda * m + 1e-9 * (m > 0 ? m : 1); /* a floor keeps a feature never seen solvable */
        for (size_t i = 0; i < F; i++)
            for (size_t k = 0; k <= i; k++) A[i * F + k] = A[k * F + i] = S[k * F + i]; /* S holds the upper triangle */
        memcpy(B, Y, sizeof(double) * F * E);
        const float *G = j->router ? j->router[T] : NULL; /* [E][d] */
        for (size_t i = 0; i < F; i++) {
            const bool bias = i == F - 1;
            A[i * F + i] += bias ? 1e-9 * (m > 0 ? m : 1) : r;
            if (G && i < d && !bias)
                for (size_t e = 0; e < E; e++) B[i * E + e] += r * (double)G[e * d + i];
        }
        if (!cholesky(A, F)) {
            j->res[q] = SOLVE_SINGULAR;
            continue;
        }
        chol_solve(A, F, B, E);
        float *W = p->w + (size_t)q * E * F;
        bool finite = true;
        for (size_t e = 0; e < E; e++)
            for (size_t i = 0; i < F; i++) {
                W[e * F + i] = (float)B[i * E + e];
                finite = finite && isfinite(W[e * F + i]);
            }
        j->res[q] = finite ? SOLVE_OK : SOLVE_NOT_FINITE;
    }
    free(A);
    free(B);
    return NULL;
}

moetax_status moetax_predictor_fit_solve(struct moetax_predictor *p, double lambda, const float *const *router) {
    if (!p->xtx) return moetax_error(MOETAX_ERR_ARG, "predictor: solve without fit_begin");
    if (!(lambda >= 0) || !isfinite(lambda)) return moetax_error(MOETAX_ERR_ARG, "predictor: lambda %g: expected >= 0", lambda);
    const int np = n_pairs_of(p);
    for (int q = 0; q < np; q++) /* the tokens still buffered */
        if (p->target[q] >= 0) fit_flush(p, live_index(p, q));
    /* the pairs are independent: up to fit_threads solve them side by side, each with its own
     * copy of the normal equations */
    int live = 0;
    for (int q = 0; q < np; q++) live += p->target[q] >= 0 && p->fit_n[q] >= 1;
    int nt = p->fit_threads > 1 ? p->fit_threads : 1;
    if (nt > live) nt = live > 0 ? live : 1;
    unsigned char *res = calloc((size_t)np + 1, 1);
    struct solve_job *jobs = calloc((size_t)nt, sizeof *jobs);
    pthread_t *th = calloc((size_t)nt, sizeof *th);
    if (!res || !jobs || !th) {
        free(res);
        free(jobs);
        free(th);
        return moetax_error(MOETAX_ERR_NOMEM, "out of memory");
    }
    unsigned char *running = calloc((size_t)nt, 1);
    for (int t = 0; t < nt; t++) {
        jobs[t] = (struct solve_job){.p = p, .lambda = lambda, .router = router, .first = t, .step = nt, .res = res};
        /* without a thread of its own (or for t = 0) the calling thread takes a job's pairs */
        if (t > 0 && running && pthread_create(&th[t], NULL, solve_pairs, &jobs[t]) == 0) running[t] = 1;
    }
    for (int t = 0; t < nt; t++)
        if (!running || !running[t]) solve_pairs(&jobs[t]);
    for (int t = 1; running && t < nt; t++)
        if (running[t]) pthread_join(th[t], NULL);
    free(running);
    /* the first failing pair, in order, names the error */
    moetax_status st = MOETAX_OK;
    uint64_t tokens = 0;
    for (int q = 0; q < np; q++) {
        MOETAX_ASSERT(res[q] != SOLVE_PENDING); /* every pair went to exactly one job */
        p->have[q] = res[q] == SOLVE_OK;
        if (res[q] == SOLVE_OK && p->fit_n[q] > tokens) tokens = p->fit_n[q];
        if (st || res[q] == SOLVE_OK || res[q] == SOLVE_SKIP) continue;
        if (res[q] == SOLVE_NOMEM) st = moetax_error(MOETAX_ERR_NOMEM, "out of memory");
        else if (res[q] == SOLVE_SINGULAR)
            st = moetax_error(MOETAX_ERR_NUMERIC, "predictor: layer %d -> %d: the normal equations are singular "
                              "(lambda %g; try a larger --predictor-lambda)", q / p->ahead, p->target[q], lambda);
        else st = moetax_error(MOETAX_ERR_NUMERIC, "predictor: layer %d -> %d: the fit is not finite", q / p->ahead,
                               p->target[q]);
    }
    free(res);
    free(jobs);
    free(th);
    p->weights_gen++;
    if (!st) {
        p->lambda = (float)lambda;
        p->tokens = tokens;
    }
    return st;
}

/* ---- the file ------------------------------------------------------------------------------ */

static uint64_t fnv1a(uint64_t h, const void *data, size_t n) {
    const unsigned char *b = data;
    for (size_t i = 0; i < n; i++) {
        h ^= b[i];
        h *= 0x100000001b3ull;
    }
    return h;
}
#define FNV_OFFSET 0xcbf29ce484222325ull

static void put32(unsigned char *b, uint32_t v) {
    for (int i = 0; i < 4; i++) b[i] = (unsigned char)(v >> (8 * i));
}
static void put64(unsigned char *b, uint64_t v) {
    for (int i = 0; i < 8; i++) b[i] = (unsigned char)(v >> (8 * i));
}
static uint32_t get32(const unsigned char *b) {
    uint32_t v = 0;
    for (int i = 0; i < 4; i++) v |= (uint32_t)b[i] << (8 * i);
    return v;
}
static uint64_t get64(const unsigned char *b) {
    uint64_t v = 0;
    for (int i = 0; i < 8; i++) v |= (uint64_t)b[i] << (8 * i);
    return v;
}
static uint32_t fbits(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}
static float bitsf(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static void header_bytes(const struct moetax_predictor *p, uint32_t n_pairs, unsigned char *h) {
    memset(h, 0, MOETAX_PREDICT_HEADER_BYTES);
    memcpy(h, MAGIC, 8);
    put32(h + 8, VERSION);
    put32(h + 12, (uint32_t)p->n_layer);
    put32(h + 16, (uint32_t)p->n_embd);
    put32(h + 20, (uint32_t)p->n_expert);
    put32(h + 24, (uint32_t)p->n_expert_used);
    put32(h + 28, (uint32_t)p->ahead);
    put32(h + 32, p->features);
    put32(h + 36, (uint32_t)p->n_feat);
    put32(h + 40, n_pairs);
    put32(h + 44, (uint32_t)p->n_hidden);
    put64(h + 48, p->tokens);
    put32(h + 56, fbits(p->lambda));
    put32(h + 60, fbits(p->margin));
    memcpy(h + 64, p->model, strnlen(p->model, 63));
}

moetax_status moetax_predictor_write(const struct moetax_predictor *p, const char *path) {
    uint32_t n_pairs = 0;
    for (int q = 0; q < n_pairs_of(p); q++) n_pairs += p->have[q];
    struct moetax_outfile *o;
    moetax_status st = moetax_outfile_open(path, &o);
    if (st) return st;
    FILE *f = moetax_outfile_file(o);
    unsigned char h[MOETAX_PREDICT_HEADER_BYTES];
    header_bytes(p, n_pairs, h);
    uint64_t sum = fnv1a(FNV_OFFSET, h, sizeof h);
    bool ok = fwrite(h, 1, sizeof h, f) == sizeof h;
    const size_t row = (size_t)p->n_expert * (size_t)p->n_feat, H = (size_t)p->n_hidden;
    const size_t vals = row + H * ((size_t)p->n_feat + 1 + (size_t)p->n_expert);
    unsigned char *buf = malloc(vals * 4);
    if (!buf) ok = false;
    for (int q = 0; ok && q < n_pairs_of(p); q++) {
        if (!p->have[q]) continue;
        unsigned char ph[MOETAX_PREDICT_PAIR_HEADER_BYTES] = {0};
        put32(ph, (uint32_t)(q / p->ahead));
        put32(ph + 4, (uint32_t)(q % p->ahead + 1));
        put32(ph + 8, (uint32_t)p->target[q]);
        const float *w = p->w + (size_t)q * row;
        for (size_t i = 0; i < row; i++) put32(buf + 4 * i, fbits(w[i]));
        if (H) {
            const float *parts[3] = {p->w1 + (size_t)q * H * (size_t)p->n_feat, p->b1 + (size_t)q * H,
                                     p->w2 + (size_t)q * (size_t)p->n_expert * H};
            const size_t len[3] = {H * (size_t)p->n_feat, H, (size_t)p->n_expert * H};
            size_t at = row;
            for (int k = 0; k < 3; k++)
                for (size_t i = 0; i < len[k]; i++, at++) put32(buf + 4 * at, fbits(parts[k][i]));
        }
        sum = fnv1a(fnv1a(sum, ph, sizeof ph), buf, vals * 4);
        ok = fwrite(ph, 1, sizeof ph, f) == sizeof ph && fwrite(buf, 1, vals * 4, f) == vals * 4;
    }
    free(buf);
    unsigned char tail[8];
    put64(tail, sum);
    ok = ok && fwrite(tail, 1, 8, f) == 8;
    if (!ok) {
        moetax_outfile_abort(o);
        return moetax_error(MOETAX_ERR_IO, "%s: writing the predictor failed", path);
    }
    return moetax_outfile_commit(o);
}

static moetax_status bad(const char *path, uint64_t off, const char *field, const char *what) {
    return moetax_error(MOETAX_ERR_FORMAT, "%s: offset %llu: %s: %s", path, (unsigned long long)off, field, what);
}

/* the a-th MoE layer after layer `layer` of the model, -1 if none */
static int moe_after(const struct moetax_predict_model *m, int layer, int a) {
    for (int l = layer + 1; l < m->n_layer; l++)
        if (m->is_moe[l] && --a == 0) return l;
    return -1;
}

moetax_status moetax_predictor_load(const char *path, const struct moetax_predict_model *model,
                                    struct moetax_predictor **out) {
    *out = NULL;
    /* before fopen, by name: a FIFO would block in it, a directory opens and seeks to a size of its own */
    struct stat sb;
    if (stat(path, &sb) == 0 && !S_ISREG(sb.st_mode))
        return moetax_error(MOETAX_ERR_ARG, "%s: %s", path,
                            S_ISDIR(sb.st_mode)    ? "is a directory, not a predictor file"
                            : S_ISFIFO(sb.st_mode) ? "not a regular file (a FIFO): a predictor is a file"
                                                   : "not a regular file (a device or socket): a predictor is a file");
    FILE *f = fopen(path, "rb");
    if (!f) return moetax_error(MOETAX_ERR_IO, "%s: cannot open the predictor: %s", path, strerror(errno));
    unsigned char *data = NULL;
    moetax_status st = MOETAX_OK;
    long size = -1;
    if (fseek(f, 0, SEEK_END) == 0) size = ftell(f);
    if (size < 0 || fseek(f, 0, SEEK_SET) != 0) st = moetax_error(MOETAX_ERR_IO, "%s: not a seekable file", path);
    else if ((uint64_t)size < MOETAX_PREDICT_HEADER_BYTES + 8)
        st = bad(path, 0, "header", "the file is shorter than the 128-byte header and checksum");
    else if ((uint64_t)size > ((uint64_t)1 << 34))
        st = bad(path, 0, "size", "larger than 16 GiB: not a predictor");
    unsigned char h[MOETAX_PREDICT_HEADER_BYTES];
    if (!st && fread(h, 1, sizeof h, f) != sizeof h) st = moetax_error(MOETAX_ERR_IO, "%s: read error", path);
    uint32_t version = 0, n_layer = 0, n_embd = 0, E = 0, k = 0, ahead = 0, features = 0, n_feat = 0, n_pairs = 0,
             H = 0;
    if (!st) {
        version = get32(h + 8);
        n_layer = get32(h + 12), n_embd = get32(h + 16), E = get32(h + 20), k = get32(h + 24);
        ahead = get32(h + 28), features = get32(h + 32), n_feat = get32(h + 36), n_pairs = get32(h + 40);
        H = get32(h + 44);
        const float lambda = bitsf(get32(h + 56)), margin = bitsf(get32(h + 60));
        const uint32_t known = version == 1 ? 3u : (uint32_t)MOETAX_PREDICT_FEAT_ALL;
        if (memcmp(h, MAGIC, 8)) st = bad(path, 0, "magic", "not a moetax predictor (expected \"MTXPRED\")");
        else if (version != 1 && version != 2)
            st = bad(path, 8, "version", version > 2 ? "newer than this moetax reads (1 or 2): refit the predictor or update"
                                                     : "expected 1 or 2");
        else if (n_layer < 1 || n_layer > 4096) st = bad(path, 12, "n_layer", "out of range 1..4096");
        else if (n_embd < 1 || n_embd > 1 << 16) st = bad(path, 16, "n_embd", "out of range 1..65536");
        else if (E < 1 || E > 1 << 16) st = bad(path, 20, "n_expert", "out of range 1..65536");
        else if (k < 1 || k > E) st = bad(path, 24, "n_expert_used", "out of range 1..n_expert");
        else if (ahead < 1 || ahead > MOETAX_PREDICT_AHEAD_MAX) st = bad(path, 28, "ahead", "out of range 1..2");
        else if (!(features & MOETAX_PREDICT_FEAT_CUR) || (features & ~known)) st = bad(path, 32, "features", "unknown bits");
        else if (n_feat != (uint32_t)moetax_predictor_n_feat((int)n_embd, (int)E, features))
            st = bad(path, 36, "n_feat", "does not match n_embd, n_expert and features");
        else if (n_pairs > n_layer * ahead) st = bad(path, 40, "n_pairs", "more than n_layer x ahead");
        else if (H > (version == 1 ? 0u : (uint32_t)MOETAX_PREDICT_HIDDEN_MAX))
            st = bad(path, 44, "n_hidden", version == 1 ? "expected 0 (reserved in version 1)" : "out of range 0..4096");
        else if (!isfinite(lambda) || lambda < 0) st = bad(path, 56, "lambda", "not a number >= 0");
        else if (!isfinite(margin) || margin < 0 || (version == 1 && get32(h + 60)))
            st = bad(path, 60, "margin", version == 1 ? "expected 0 (reserved in version 1)" : "not a number >= 0");
        else if (!memchr(h + 64, 0, 64)) st = bad(path, 64, "model", "not NUL-terminated");
        else if (n_layer != (uint32_t)model->n_layer || n_embd != (uint32_t)model->n_embd ||
                 E != (uint32_t)model->n_expert)
            st = moetax_error(MOETAX_ERR_ARG, "%s: a predictor for %u layers, width %u, %u experts (%.63s); the model "
                              "has %d, %d, %d", path, n_layer, n_embd, E, (const char *)h + 64, model->n_layer,
                              model->n_embd, model->n_expert);
    }
    const uint64_t vals = (uint64_t)E * n_feat + (uint64_t)H * ((uint64_t)n_feat + 1 + E);
    const uint64_t entry = MOETAX_PREDICT_PAIR_HEADER_BYTES + vals * 4;
    if (!st && (uint64_t)size != MOETAX_PREDICT_HEADER_BYTES + (uint64_t)n_pairs * entry + 8) {
        char what[160];
        snprintf(what, sizeof what, "the file has %lld bytes, the header implies %llu (%u pairs of %llu bytes)",
                 (long long)size, (unsigned long long)(MOETAX_PREDICT_HEADER_BYTES + (uint64_t)n_pairs * entry + 8),
                 n_pairs, (unsigned long long)entry);
        st = bad(path, 40, "size", what);
    }
    if (!st && !(data = malloc((size_t)size - MOETAX_PREDICT_HEADER_BYTES)))
        st = moetax_error(MOETAX_ERR_NOMEM, "%s: out of memory", path);
    if (!st && fread(data, 1, (size_t)size - MOETAX_PREDICT_HEADER_BYTES, f) != (size_t)size - MOETAX_PREDICT_HEADER_BYTES)
        st = moetax_error(MOETAX_ERR_IO, "%s: read error", path);
    fclose(f);
    if (!st) {
        const uint64_t body = (uint64_t)n_pairs * entry;
        uint64_t sum = fnv1a(fnv1a(FNV_OFFSET, h, sizeof h), data, (size_t)body);
        if (sum != get64(data + body)) st = bad(path, MOETAX_PREDICT_HEADER_BYTES + body, "checksum", "FNV-1a mismatch: the file is damaged");
    }
    struct moetax_predictor *p = NULL;
    if (!st) {
        char name[64];
        memcpy(name, h + 64, 64);
        /* the pairs' targets come from the entries, not from a layer list */
        st = moetax_predictor_new_hidden(name, (int)n_layer, (int)n_embd, (int)E, (int)k, NULL, 0, (int)ahead, features,
                                         (int)H, &p);
    }
    for (uint32_t i = 0; !st && i < n_pairs; i++) {
        const unsigned char *e = data + (uint64_t)i * entry;
        const uint64_t off = MOETAX_PREDICT_HEADER_BYTES + (uint64_t)i * entry;
        const uint32_t layer = get32(e), a = get32(e + 4), target = get32(e + 8);
        if (layer >= n_layer) { st = bad(path, off, "pair layer", "out of range"); break; }
        if (a < 1 || a > ahead) { st = bad(path, off + 4, "pair ahead", "out of range 1..ahead"); break; }
        if (!model->is_moe[layer]) { st = bad(path, off, "pair layer", "not a MoE layer of the model"); break; }
        const int want = moe_after(model, (int)layer, (int)a);
        if ((int)target != want) {
            char what[128];
            if (want < 0) snprintf(what, sizeof what, "layer %u, but the model has no MoE layer %u after layer %u", target, a, layer);
            else snprintf(what, sizeof what, "layer %u, but the MoE layer %u after layer %u is layer %d", target, a, layer, want);
            st = bad(path, off + 8, "pair target", what);
            break;
        }
        if (get32(e + 12) != 0) { st = bad(path, off + 12, "pair reserved", "expected 0"); break; }
        const int q = moetax_predictor_pair(p, (int)layer, (int)a);
        if (p->have[q]) { st = bad(path, off, "pair", "duplicate (layer, ahead)"); break; }
        float *dst[4] = {p->w + (size_t)q * E * n_feat, H ? p->w1 + (size_t)q * H * n_feat : NULL,
                         H ? p->b1 + (size_t)q * H : NULL, H ? p->w2 + (size_t)q * E * H : NULL};
        const uint64_t len[4] = {(uint64_t)E * n_feat, (uint64_t)H * n_feat, H, (uint64_t)E * H};
        uint64_t o = 0;
        for (int part = 0; part < 4 && !st; part++)
            for (uint64_t j = 0; j < len[part]; j++, o++) {
                const float v = bitsf(get32(e + MOETAX_PREDICT_PAIR_HEADER_BYTES + 4 * o));
                if (!isfinite(v)) {
                    st = bad(path, off + MOETAX_PREDICT_PAIR_HEADER_BYTES + 4 * o, "weight", "not finite");
                    break;
                }
                dst[part][j] = v;
            }
        if (st) break;
        p->have[q] = 1;
        p->target[q] = (int32_t)target;
    }
    if (!st) {
        p->tokens = get64(h + 48);
        p->lambda = bitsf(get32(h + 56));
        p->margin = bitsf(get32(h + 60));
    }
    free(data);
    if (st) {
        moetax_predictor_free(p);
        return st;
    }
    *out = p;
    return MOETAX_OK;
}

struct moetax_predict_score moetax_predictor_total(const struct moetax_predictor *p, enum moetax_predict_kind kind,
                                                   int a) {
    struct moetax_predict_score s = {0};
    for (int q = 0; q < n_pairs_of(p); q++) {
        if (a && q % p->ahead + 1 != a) continue;
        const struct moetax_predict_score *x = &p->score[(size_t)kind * (size_t)n_pairs_of(p) + (size_t)q];
        s.tokens += x->tokens;
        s.predicted += x->predicted;
        s.actual += x->actual;
        s.hits += x->hits;
    }
    return s;
}

void moetax_predictor_score_reset(struct moetax_predictor *p) {
    memset(p->score, 0, sizeof *p->score * (size_t)MOETAX_PREDICT_KINDS * (size_t)n_pairs_of(p));
}
