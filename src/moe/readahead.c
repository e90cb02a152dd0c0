/* readahead.c - offers, scores and the read-ahead list of the expert store (see readahead.h). */
#include "moe/readahead.h"

#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "moetax/store.h"

/* Counts are halved once a class has this many tries: the estimate follows a run whose routing
 * drifts (a prompt, then generated text). */
#define RA_AGING 4096.0

moetax_status moe_ra_init(struct moe_ra *ra, int n_layer, int k) {
    memset(ra, 0, sizeof *ra);
    ra->L = n_layer;
    ra->k = k;
    const size_t m = (size_t)n_layer * MOE_RA_AHEAD_MAX * 2 * (size_t)k;
    ra->exp = calloc(m ? m : 1, sizeof *ra->exp);
    ra->margin = calloc(m ? m : 1, sizeof *ra->margin);
    ra->n = calloc((size_t)n_layer * MOE_RA_AHEAD_MAX + 1, sizeof *ra->n);
    ra->ol = calloc((size_t)MOE_RA_AHEAD_MAX * 2 * (size_t)k + 1, sizeof *ra->ol);
    ra->oe = calloc((size_t)MOE_RA_AHEAD_MAX * 2 * (size_t)k + 1, sizeof *ra->oe);
    ra->oc = calloc((size_t)MOE_RA_AHEAD_MAX * 2 * (size_t)k + 1, sizeof *ra->oc);
    if (!ra->exp || !ra->margin || !ra->n || !ra->ol || !ra->oe || !ra->oc) {
        moe_ra_free(ra);
        return moetax_error(MOETAX_ERR_NOMEM, "out of memory");
    }
    return MOETAX_OK;
}

void moe_ra_free(struct moe_ra *ra) {
    free(ra->exp);
    free(ra->margin);
    free(ra->n);
    free(ra->ol);
    free(ra->oe);
    free(ra->oc);
    memset(ra, 0, sizeof *ra);
}

void moe_ra_reset(struct moe_ra *ra) {
    if (ra->n) memset(ra->n, 0, sizeof *ra->n * (size_t)ra->L * MOE_RA_AHEAD_MAX);
}

/* Margin class: 0 for a margin <= 0 (the learned predictor's extras), else its power of two,
 * 2^-30 and below in class 1, 2^0 and above in the last. */
static int ra_class(float m) {
    if (!(m > 0)) return 0;
    int c = (int)floorf(log2f(m)) + 31;
    return c < 1 ? 1 : c >= MOE_RA_CLASSES ? MOE_RA_CLASSES - 1 : c;
}

void moe_ra_offer(struct moe_ra *ra, int T, int a, const int32_t *experts, const float *margin, int n) {
    if (!ra->n || T < 0 || T >= ra->L || a < 1 || a > MOE_RA_AHEAD_MAX) return;
    const size_t o = ((size_t)T * MOE_RA_AHEAD_MAX + (size_t)(a - 1)) * 2 * (size_t)ra->k;
    int m = 0;
    for (int i = 0; i < n && m < 2 * ra->k; i++) {
        if (experts[i] < 0) continue;
        ra->exp[o + (size_t)m] = experts[i];
        ra->margin[o + (size_t)m] = margin[i];
        m++;
    }
    ra->n[T * MOE_RA_AHEAD_MAX + a - 1] = m;
}

void moe_ra_score(struct moe_ra *ra, int T, const int32_t *actual, int k) {
    if (!ra->n || T < 0 || T >= ra->L) return;
    for (int a = 1; a <= MOE_RA_AHEAD_MAX; a++) {
        int32_t *n = &ra->n[T * MOE_RA_AHEAD_MAX + a - 1];
        const size_t o = ((size_t)T * MOE_RA_AHEAD_MAX + (size_t)(a - 1)) * 2 * (size_t)ra->k;
        for (int i = 0; i < *n; i++) {
            const int c = ra_class(ra->margin[o + (size_t)i]);
            bool hit = false;
            for (int j = 0; j < k && !hit; j++) hit = actual[j] == ra->exp[o + (size_t)i];
            if (ra->tries[a - 1][c] >= RA_AGING) {
                ra->tries[a - 1][c] *= 0.5;
                ra->hits[a - 1][c] *= 0.5;
            }
            ra->tries[a - 1][c] += 1;
            ra->hits[a - 1][c] += hit;
        }
        *n = 0;
    }
}

void moe_ra_issue(struct moe_ra *ra, struct moetax_store *store, int il, int depth) {
    if (!ra->n) return;
    const double min_p = moetax_store_read_ahead_min_precision(store);
    int m = 0;
    for (int a = 1; a <= depth && a <= MOE_RA_AHEAD_MAX; a++) {
        const int T = il + a;
        if (T >= ra->L) break;
        const int32_t n = ra->n[T * MOE_RA_AHEAD_MAX + a - 1];
        const size_t o = ((size_t)T * MOE_RA_AHEAD_MAX + (size_t)(a - 1)) * 2 * (size_t)ra->k;
        for (int i = 0; i < n; i++) {
            const int c = ra_class(ra->margin[o + (size_t)i]);
            /* a class's precision with one right and one wrong guess as the prior: a class seen
             * a few times does not pass a minimum above one half on luck */
            const double p = (ra->hits[a - 1][c] + 1.0) / (ra->tries[a - 1][c] + 2.0);
            if (p < min_p) continue;
            int j = m++; /* insertion: most precise first, the nearer layer first among equals */
            while (j > 0 && ra->oc[j - 1] < p) {
                ra->ol[j] = ra->ol[j - 1];
                ra->oe[j] = ra->oe[j - 1];
                ra->oc[j] = ra->oc[j - 1];
                j--;
            }
            ra->ol[j] = T;
            ra->oe[j] = ra->exp[o + (size_t)i];
            ra->oc[j] = p;
        }
    }
    moetax_store_read_ahead(store, ra->ol, ra->oe, m);
}

void moe_ra_margins(const float *sc, int64_t E, const int32_t *idx, int64_t k, float *out) {
    float best = -INFINITY;
    for (int64_t e = 0; e < E; e++) {
        if (!(sc[e] > best)) continue;
        bool chosen = false;
        for (int64_t j = 0; j < k && !chosen; j++) chosen = idx[j] == e;
        if (!chosen) best = sc[e];
    }
    for (int64_t j = 0; j < k; j++) out[j] = best == -INFINITY ? FLT_MAX : sc[idx[j]] - best;
}
