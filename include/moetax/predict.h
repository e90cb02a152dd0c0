/*
 * moetax/predict.h - a learned expert predictor for the expert store's prefetch.
 *
 * DESIGN
 *   The store prefetches the experts a layer will route to before the layer
 *   routes. The guess it has without training is the target layer's router
 *   applied to the current residual. A learned predictor replaces that guess:
 *   for each MoE layer l and distance a (1..ahead) the a-th MoE layer after it,
 *   T, gets estimated router logits
 *       z = W f + W2 relu(W1 f + b1)        (the second term only with n_hidden > 0)
 *       f = [ rmsnorm(h_l) * ffn_norm_T ;        (n_embd)
 *             rmsnorm(h_T(prev)) * ffn_norm_T ;  (n_embd, FEAT_PREV only)
 *             onehot(sel_l) ; gate(z_l) ;        (2 n_expert, FEAT_ROUTE only)
 *             1 ]
 *   h_l is the MoE input residual of the token at layer l, h_T(prev) that of
 *   the same sequence's previous token at layer T (zero when there is none: the
 *   first token of a sequence), sel_l the experts layer l chose for the token and
 *   gate(z_l) its router's probabilities (sigmoid or softmax of its logits, as
 *   the model gates). The experts are then selected from z by T's own rules
 *   (gating function, selection bias, group limit, top-k). With `margin` > 0 a
 *   token also gets up to k more experts: those of the groups the rule keeps,
 *   outside the top-k, whose selection score (gate(z) + bias) is within margin
 *   of the k-th chosen one's (a variable number per token, by confidence:
 *   recall up, precision down).
 *
 *   Two fits write the same file. `moetax profile --fit-predictor` fits the
 *   linear map in C: with W = [G_T 0 0] (G_T the router of T) it is the router
 *   guess, so the fit is ridge regression towards it:
 *       W = argmin sum_t |W f_t - y_t|^2 + lambda * m * |W - W_router|^2
 *   y_t T's true router logits, m the mean of diag(sum_t f_t f_t^T) (lambda is
 *   relative to the features' scale); the bias column is not pulled. Solved by
 *   Cholesky on the normal equations (double). `tools/train/fit_predictor.py`
 *   (PyTorch) fits the same ridge map, then the hidden layer with it on the
 *   logits' squared error, from rows `moetax profile --dump-features` wrote
 *   (format below). Prediction costs [n_expert x n_feat] (+ [n_hidden x n_feat]
 *   + [n_expert x n_hidden]) multiply-adds per token and distance; the engine
 *   reads W1 in F16 (rounded once when it first predicts: half the bytes; the
 *   estimated logits move by about 1e-3 relative, a selection seldom) and the
 *   rest in F32, a micro-batch's tokens in one pass over each matrix.
 *
 *   File format (little-endian; moetax_predictor_write / _load):
 *     header, 128 bytes:
 *       char     magic[8]      "MTXPRED\0"
 *       uint32   version       2 (1: the same without n_hidden, margin and FEAT_ROUTE, still read)
 *       uint32   n_layer, n_embd, n_expert, n_expert_used
 *       uint32   ahead         1..MOETAX_PREDICT_AHEAD_MAX
 *       uint32   features      MOETAX_PREDICT_FEAT_* bits (FEAT_CUR always set)
 *       uint32   n_feat        n_embd * (1 + (FEAT_PREV ? 1 : 0)) + (FEAT_ROUTE ? 2 n_expert : 0) + 1
 *       uint32   n_pairs       entries that follow
 *       uint32   n_hidden      0..MOETAX_PREDICT_HIDDEN_MAX (version 1: reserved, 0)
 *       uint64   tokens        tokens fitted on
 *       float32  lambda
 *       float32  margin        >= 0, finite; 0: exactly k experts per token (version 1: reserved, 0)
 *       char     model[64]     model file name it was fitted for (NUL-terminated)
 *     n_pairs entries, each:
 *       uint32   layer, ahead, target, reserved (0)
 *       float32  w[n_expert][n_feat]   finite
 *       n_hidden > 0 only:
 *       float32  w1[n_hidden][n_feat], b1[n_hidden], w2[n_expert][n_hidden]   finite
 *     uint64     FNV-1a 64 of every byte before it
 *   The file's size must be exactly what the header says; a size, count, layer
 *   or value out of range, a duplicate pair, a version other than 1 or 2 or a
 *   checksum mismatch is MOETAX_ERR_FORMAT naming the file, the field and its
 *   offset.
 *
 *   Feature rows (`moetax profile --dump-features FILE`, read by
 *   tools/train/fit_predictor.py; little-endian):
 *     header: char magic[8] "MTXFEAT\0"; uint32 version 1, n_layer, n_embd,
 *       n_expert, n_expert_used, gating_func (1 softmax, 2 sigmoid),
 *       n_expert_group, n_expert_group_used, n_moe; float32 rms_eps;
 *       char model[64]; then per MoE layer (ascending): uint32 layer,
 *       float32 ffn_norm[n_embd], router[n_expert][n_embd], bias[n_expert]
 *       (the selection bias, 0 without one)
 *     records to the end of the file, one per token and MoE layer in the order
 *       the layers ran: int32 layer, seq, pos, token; float32 h[n_embd] (the MoE
 *       input residual), z[n_expert] (the router logits); int32 sel[n_expert_used]
 *
 * INVARIANTS
 *   - A predictor only chooses what is read ahead; the experts a token is
 *     computed with come from the router, so logits do not depend on it.
 *   - score counts are per token: predicted = experts predicted (k each, up
 *     to 2k with a margin),
 *     actual = experts the token used, hits = both. precision = hits /
 *     predicted, recall = hits / actual.
 */
#ifndef MOETAX_PREDICT_H
#define MOETAX_PREDICT_H

#include <stdbool.h>
#include <stdint.h>

#include "moetax/status.h"

#ifdef __cplusplus
extern "C" {
#endif

enum { MOETAX_PREDICT_AHEAD_MAX = 2, MOETAX_PREDICT_HIDDEN_MAX = 4096, MOETAX_PREDICT_VERSION = 2 };
enum { MOETAX_PREDICT_HEADER_BYTES = 128, MOETAX_PREDICT_PAIR_HEADER_BYTES = 16 };
enum moetax_predict_feature {
    MOETAX_PREDICT_FEAT_CUR = 1,  /* the current residual, normed for the target layer */
    MOETAX_PREDICT_FEAT_PREV = 2, /* the previous token's residual at the target layer */
    MOETAX_PREDICT_FEAT_ROUTE = 4, /* the current layer's routing: one-hot of its experts, its probabilities */
};
enum { MOETAX_PREDICT_FEAT_ALL = 7 };
/* What a score is kept for: the router guess or the learned map. */
enum moetax_predict_kind { MOETAX_PREDICT_ROUTER = 0, MOETAX_PREDICT_LEARNED = 1, MOETAX_PREDICT_KINDS = 2 };
const char *moetax_predict_kind_name(enum moetax_predict_kind k); /* "router", "learned" */

struct moetax_predict_score {
    uint64_t tokens, predicted, actual, hits;
};

struct moetax_predictor {
    char model[64];
    int32_t n_layer, n_embd, n_expert, n_expert_used;
    int32_t ahead;            /* distances 1..ahead */
    uint32_t features;        /* MOETAX_PREDICT_FEAT_* */
    int32_t n_feat;
    int32_t n_hidden;         /* 0: linear */
    float lambda;             /* of the fit (informational once fitted) */
    float margin;             /* extra experts within this score of the k-th (0: none) */
    uint64_t tokens;          /* fitted on */
    /* pair (layer l, distance a): index l * ahead + a - 1 */
    int32_t *target;          /* [n_layer * ahead] target layer, -1: no such pair */
    uint8_t *have;            /* [n_layer * ahead] weights present */
    float *w;                 /* [n_layer * ahead][n_expert][n_feat] */
    float *w1, *b1, *w2;      /* n_hidden > 0: [pairs][n_hidden][n_feat], [pairs][n_hidden], [pairs][n_expert][n_hidden] */
    /* fitting (moetax_predictor_fit_begin .. _solve): sums of f f^T (upper triangle) and f y^T */
    double *xtx;              /* [pairs][n_feat][n_feat] or NULL */
    double *xty;              /* [pairs][n_feat][n_expert] */
    uint64_t *fit_n;          /* [pairs] tokens added */
    float *fit_buf;           /* [live pairs][n_feat + n_expert][chunk]: tokens not yet in the sums, transposed */
    uint32_t *fit_buf_n;      /* [live pairs] tokens in fit_buf */
    float *fit_scratch;       /* a block of the chunk's products */
    int32_t fit_threads;      /* fit_solve solves up to this many pairs side by side (0 or 1: one) */
    /* scores of each kind per pair, added by whoever predicts (one thread at a time) */
    struct moetax_predict_score *score; /* [KINDS][n_layer * ahead] */
    bool use;                 /* drive the store's prefetch (else only scored) */
    uint64_t weights_gen;     /* bumped by whatever changes the weights (fit_solve): the engine then
                               * prepares its copies of them again (set it after writing w by hand) */
    /* the prefetch's predictions (one and two layers ahead, features included, not the scoring):
     * their time and how many token-layers they were made for */
    uint64_t predict_ns, predict_n;
    void *dump;               /* profile --dump-features: the open feature file (src/moe/predict.c) */
    void *run;                /* the engine's scratch (src/moe/predict.c), freed with the predictor */
    void (*run_free)(void *run);
};

/* An unfitted predictor (weights: the router guess is applied by whoever fits; zero here) for a
 * model of n_layer layers whose MoE layers are moe_layers[0..n_moe), ascending: pair (moe_layers[i],
 * a) targets moe_layers[i + a]. features: MOETAX_PREDICT_FEAT_CUR, optionally | FEAT_PREV |
 * FEAT_ROUTE; n_hidden 0 (linear) .. MOETAX_PREDICT_HIDDEN_MAX (its weights zero). */
moetax_status moetax_predictor_new(const char *model, int n_layer, int n_embd, int n_expert, int n_expert_used,
                                   const int *moe_layers, int n_moe, int ahead, uint32_t features,
                                   struct moetax_predictor **out);
moetax_status moetax_predictor_new_hidden(const char *model, int n_layer, int n_embd, int n_expert,
                                          int n_expert_used, const int *moe_layers, int n_moe, int ahead,
                                          uint32_t features, int n_hidden, struct moetax_predictor **out);
/* n_feat of a predictor of these features */
int moetax_predictor_n_feat(int n_embd, int n_expert, uint32_t features);
void moetax_predictor_free(struct moetax_predictor *p);
static inline int moetax_predictor_pair(const struct moetax_predictor *p, int layer, int a) {
    return layer * p->ahead + a - 1;
}
/* Weights [n_expert][n_feat] of (layer, a), NULL if absent. */
const float *moetax_predictor_weights(const struct moetax_predictor *p, int layer, int a);
/* The hidden layer's weights of (layer, a): w1 [n_hidden][n_feat], b1 [n_hidden], w2
 * [n_expert][n_hidden]; false (all NULL) without a hidden layer or for an absent pair. */
bool moetax_predictor_hidden(const struct moetax_predictor *p, int layer, int a, const float **w1, const float **b1,
                             const float **w2);
/* Estimated logits z [n_expert] of (layer, a) from features f [n_feat] (scratch: n_hidden
 * floats), plain C: the reference the engine's kernels follow (they may differ in the last bits). */
void moetax_predictor_eval(const struct moetax_predictor *p, int layer, int a, const float *f, float *z,
                           float *scratch);

/* Fitting: allocate the sums (MOETAX_ERR_NOMEM names the bytes), add n tokens' features
 * f [n][n_feat] and target logits y [n][n_expert] of a pair, then solve. router[l] is layer l's
 * router [n_expert][n_embd] (F32, NULL for a dense layer): the prior the fit is pulled to. Pairs
 * with fewer than 1 token get no weights. */
moetax_status moetax_predictor_fit_begin(struct moetax_predictor *p);
void moetax_predictor_fit_add(struct moetax_predictor *p, int layer, int a, const float *f, const float *y,
                              int64_t n);
moetax_status moetax_predictor_fit_solve(struct moetax_predictor *p, double lambda, const float *const *router);

moetax_status moetax_predictor_write(const struct moetax_predictor *p, const char *path);
/* The model a predictor is loaded for: is_moe [n_layer]. */
struct moetax_predict_model {
    int n_layer, n_embd, n_expert;
    const bool *is_moe;
};
/* Load a predictor written for `model`: the header's shape is compared with the model's before
 * anything is allocated (MOETAX_ERR_ARG names what differs), and every pair must predict the a-th
 * MoE layer after a MoE layer (MOETAX_ERR_FORMAT names the offset and field). */
moetax_status moetax_predictor_load(const char *path, const struct moetax_predict_model *model,
                                    struct moetax_predictor **out);
/* Sum of a kind's scores over the pairs at distance a (0: all distances). */
struct moetax_predict_score moetax_predictor_total(const struct moetax_predictor *p, enum moetax_predict_kind kind,
                                                   int a);
void moetax_predictor_score_reset(struct moetax_predictor *p);

#ifdef __cplusplus
}
#endif
#endif
