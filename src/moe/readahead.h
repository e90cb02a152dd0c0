/* readahead.h - the MoE block's side of the expert store's read-ahead (include/moetax/store.h,
 * READ-AHEAD): which predicted experts of the next layers are worth a read of idle disk time.
 * Internal.
 *
 * On each MoE layer of a decoded token (one token per micro-batch) the block offers, per target
 * layer T and distance a (T is the a-th layer ahead), the experts predicted for T with their
 * score margins (a guess's selection score minus the best score it did not choose: how far a
 * guess is from flipping). When T routes, every offer for T is scored against T's experts, per
 * distance and margin class (powers of two; the learned predictor's extras, below the k-th,
 * form a class of their own). The list handed to the store holds the offers for the next
 * `depth` layers whose class has been right at least the store's minimum precision of the time
 * on this run, ordered by that precision: so confidence is learned per model and predictor, not
 * assumed from the scale of its scores. */
#ifndef MOETAX_MOE_READAHEAD_H
#define MOETAX_MOE_READAHEAD_H

#include <stdbool.h>
#include <stdint.h>

#include "moetax/status.h"

struct moetax_store;

enum { MOE_RA_AHEAD_MAX = 2, MOE_RA_CLASSES = 32 };

struct moe_ra {
    int L, k;              /* layers, experts per token */
    int32_t *exp;          /* [L][AHEAD_MAX][2k] experts offered for layer T from distance a */
    float *margin;         /* [L][AHEAD_MAX][2k] their margins */
    int32_t *n;            /* [L][AHEAD_MAX] experts offered (0: none) */
    double tries[MOE_RA_AHEAD_MAX][MOE_RA_CLASSES], hits[MOE_RA_AHEAD_MAX][MOE_RA_CLASSES];
    int32_t *ol, *oe;      /* [AHEAD_MAX * 2k] the list for the store: layers, experts */
    double *oc;            /* [AHEAD_MAX * 2k] their classes' precision */
};

moetax_status moe_ra_init(struct moe_ra *ra, int n_layer, int k);
void moe_ra_free(struct moe_ra *ra);
/* A step begins: offers of an earlier step are not scored. */
void moe_ra_reset(struct moe_ra *ra);
/* Offer experts [n] (n <= 2k; -1 skipped) predicted for layer T from a layers before it, with their
 * margins; replaces an earlier offer of the same (T, a). */
void moe_ra_offer(struct moe_ra *ra, int T, int a, const int32_t *experts, const float *margin, int n);
/* Layer T has routed (actual [k], -1: none): score its offers, then forget them. */
void moe_ra_score(struct moe_ra *ra, int T, const int32_t *actual, int k);
/* Hand the store the offers for layers il + 1 .. il + depth that pass its minimum precision. */
void moe_ra_issue(struct moe_ra *ra, struct moetax_store *store, int il, int depth);
/* The margins out [k] of experts idx [k] chosen by top-k from scores sc [E] (-inf: out of the
 * running): sc[idx[j]] minus the best score not chosen (FLT_MAX when every other is -inf). */
void moe_ra_margins(const float *sc, int64_t E, const int32_t *idx, int64_t k, float *out);

#endif
