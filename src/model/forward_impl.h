/* forward_impl.h - the inference context and the phases of a step, shared by
 * src/model/forward.c (scheduler), src/attn/mla.c and src/moe/moe.c. Internal. */
#ifndef MOETAX_FORWARD_IMPL_H
#define MOETAX_FORWARD_IMPL_H

#include <stdatomic.h>
#include <stdint.h>

#include "moetax/kernels.h"
#include "moetax/ledger.h"
#include "moetax/model.h"
#include "moetax/pool.h"

/* Prepared activations of one input matrix [n rows, ncols] for every weight
 * type the model uses: float types read x itself; Q8_0/Q4_0 get their own
 * prepared copies (see include/moetax/kernels.h). */
struct act {
    const float *x;
    int64_t ncols, n;
    void *q8, *q4;       /* buffers owned by the context */
    size_t cap_q8, cap_q4;
};

/* The dispatch plan of one MoE layer for the micro-batch. */
struct plan {
    int32_t n_active;      /* experts with at least one row */
    int32_t *active;       /* [E] expert ids, ascending */
    int32_t *count;        /* [E] rows per expert */
    int32_t *offset;       /* [E] first slot of each expert */
    int32_t *slot_token;   /* [U*k] token of each slot, grouped by expert */
    float *slot_w;         /* [U*k] routing weight of each slot */
    int32_t *fill;         /* [E] scratch */
};

/* per-thread scratch */
struct scratch {
    /* experts this worker holds from the expert store during one MoE block */
    const void *(*eptr)[3];  /* [E] gate, up, down matrix of expert e (valid if acq[e]) */
    uint8_t *acq;            /* [E] */
    int32_t *acq_list;       /* [E] */
    int n_acq;
    float *f;              /* floats: scores [n_ctx], vectors */
    size_t nf;
    void *q;               /* prepared activations for per-head matmuls */
    size_t nq;
    /* decode (one token): this worker's own prepared input row (width d / q_lora / H*v /
     * the shared experts' hidden, normalised into own_x) and expert hidden rows (k rows
     * of n_ff_exp, of c->eh) */
    struct act own_in, own_eh;
    float *own_x;
    /* decode: this worker's routing of the token (k) and dispatch plan */
    int32_t *sel;
    float *selw;
    struct plan plan;
};

struct moetax_ctx {
    const struct moetax_model *m;
    const struct moetax_kernels *K;
    struct moetax_pool *pool;
    bool own_pool;
    int n_threads;
    int64_t n_ctx, n_ubatch, pos;
    int32_t n_expert_used; /* k: routed experts per token (ctx param, default the model's) */
    int64_t kv_row;        /* kv_lora + rope */
    float *kv;             /* [n_layer][n_ctx][kv_row] */

    /* micro-batch buffers (U = n_ubatch) */
    float *x;              /* [U, d] residual */
    float *xn;             /* [U, max(d, q_lora)] normed input of a projection */
    float *qa;             /* [U, q_lora] */
    float *q;              /* [U, H*(nope+rope)] */
    float *kva;            /* [U, kv_lora + rope] */
    float *qabs;           /* [U, H, kv_lora + rope] */
    float *attv;           /* [U, H*v_head] */
    float *oatt;           /* [U, H, kv_lora] attention outputs before W_vb (batches) */
    float *tmp;            /* [U, max(d, ...)] matmul output before the residual add */
    float *hid;            /* [U, max(n_ff, F*n_shared)] dense / shared hidden */
    float *router;         /* [U, E] router logits */
    float *ropecs;         /* [U, rope] cos/sin of each token's position (once per micro-batch) */
    float *eh;             /* [U*k, F] expert hidden */
    float *eh_g;           /* [U*k, F] expert gate (scratch) */
    struct act a_in;       /* slot for inputs of width d / q_lora / H*v */
    struct act a_hid;      /* slot for dense/shared hidden */
    struct act a_exp;      /* slot for expert inputs (gathered) */
    struct act a_eh;       /* slot for expert hidden */
    struct plan plan;
    int32_t *sel;          /* [n_layer][U*k] routing of the last micro-batch */
    float *selw;           /* [n_layer][U*k] */
    int64_t sel_n;         /* tokens routed in the last micro-batch */
    struct scratch *scr;   /* [n_threads] */

    /* the step being run (set before moetax_pool_run) */
    const int32_t *tokens;
    int64_t n, pos0;
    float *logits;
    bool all_logits;
    struct moetax_ledger *ledger; /* optional, not owned */
    struct moetax_store *store;   /* optional, not owned */
    bool prefetch;                /* with a store: prefetch the next layer's predicted experts */
    _Atomic int err_status;       /* first error raised inside a step (e.g. an expert read) */
    char err_msg[512];
    enum moetax_phase delay_phase; /* test hook (moetax_ctx_test_delay) */
    uint64_t delay_ns;
    float *ydown;          /* [U*k, d] expert down outputs */
    float *pred_x, *pred_logits, *pred_p; /* [d], [E], [2E] prediction scratch (worker 0) */
    void *pred_q;          /* prepared pred_x */
    int32_t *pred;         /* [n_layer][U*k] experts predicted for a layer from the previous layer's residual */
    bool *pred_ok;         /* [n_layer] */
    int64_t *hist_n;       /* [n_layer] tokens whose routing c->sel holds (the last micro-batch
                            * that reached the layer; 0: none yet): recent-token history */
};

/* Per-worker view of a step: phase counter for the chunk counters, and the
 * ledger phase being timed. */
struct worker {
    struct moetax_ctx *c;
    int ith, nth;
    int phase;
    struct moetax_ledger *ledger; /* NULL or disabled: no timing */
    enum moetax_phase lph;        /* ledger phase being timed */
    int layer;
    uint64_t t0;
};

/* Begin a phase of work (ledger phase ph, layer or -1): worker 0 resets the
 * chunk counter of the next phase. */
void fw_phase_begin(struct worker *w, enum moetax_phase ph, int layer);
/* Switch the ledger phase being timed within a phase of work. */
void fw_mark(struct worker *w, enum moetax_phase ph);
/* End a phase: barrier; the time at the barrier is booked to wait. */
void fw_phase_end(struct worker *w);
/* Next dynamic chunk of the current phase, or -1 when n items are done. */
int64_t fw_chunk(struct worker *w, int64_t n, int64_t step);
/* Dynamic split of n rows into blocks of `block`: the next block [*r0, *r1) of
 * the current phase for this worker, false when all are taken. Balances
 * workers that run at different speeds (a shared machine, a late wake-up). */
bool fw_rows(struct worker *w, int64_t n, int64_t block, int64_t *r0, int64_t *r1);
/* Static split [*r0, *r1) of n items for this worker, aligned to `align`. */
void fw_split(const struct worker *w, int64_t n, int64_t align, int64_t *r0, int64_t *r1);

/* A view of an activation slot's buffers describing the matrix x [n, ncols].
 * The slot's buffers never change after init, so every worker can take a view
 * while worker 0 publishes the descriptor with fw_act_publish (the barrier at
 * the end of the phase makes it visible to the next phases). */
struct act fw_act_view(const struct act *slot, const float *x, int64_t ncols, int64_t n);
void fw_act_publish(const struct worker *w, struct act *slot, const struct act *view);
/* Decode (one token): the one row x [ncols] (normalised with norm_w first,
 * unless NULL) prepared in this worker's own slot, for the matmuls of the
 * phase in progress. Every worker does this same small work, instead of one
 * of them doing it in a phase of its own that ends with a barrier: a barrier
 * less each time, same bits. Valid until this worker's next call. */
const struct act *fw_own_row(struct worker *w, const float *x, int64_t ncols, const float *norm_w);
/* Begin a phase that reads rows [0, n) of src [n, ncols] normalised with
 * weight and prepared: a batch normalises them into dst (may be src) and
 * prepares them in c->a_in in a phase of its own (ledger phase ph, split
 * across workers, ending with a barrier), then begins the phase `next`; one
 * token begins a phase as ph, makes the row in this worker's own slot
 * (fw_own_row) and goes on as `next`, without a barrier. Returns the act. */
const struct act *fw_norm_input(struct worker *w, enum moetax_phase ph, enum moetax_phase next, int layer, float *dst,
                                const float *src, const float *weight, int64_t ncols);
/* Same for the k expert hidden rows of c->eh (n_ff_exp wide, one token). */
const struct act *fw_own_eh(struct worker *w, int64_t k);
/* Prepare rows [t0, t1) of an activation (x set, ncols, n). */
void fw_act_prep(const struct moetax_ctx *c, struct act *a, int64_t t0, int64_t t1);
/* The xq pointer for a weight type. */
const void *fw_act_for(const struct act *a, enum moetax_type t);
/* y[b * ldy + r] for r in [r0, r1) of matrix `mat` of w, rows b < n of a. */
void fw_matmul(const struct moetax_ctx *c, const struct moetax_weight *w, int64_t mat, int64_t r0, int64_t r1,
               const struct act *a, int64_t b0, int64_t n, float *y, int64_t ldy);
/* Same with the matrix given by its address (e.g. an expert held by the store). */
void fw_matmul_at(const struct moetax_ctx *c, const struct moetax_weight *w, const void *mat, int64_t r0, int64_t r1,
                  const struct act *a, int64_t b0, int64_t n, float *y, int64_t ldy);
/* Record the first error of a step (the message of the calling thread). */
void fw_fail(struct moetax_ctx *c, moetax_status st);
/* Same, writing y[b * ldy + (r - r0)]. */
void fw_matmul_rel(const struct moetax_ctx *c, const struct moetax_weight *w, int64_t mat, int64_t r0, int64_t r1,
                   const struct act *a, int64_t b0, int64_t n, float *y, int64_t ldy);

/* attention (src/attn/mla.c): from the normed input in c->xn to c->tmp = attention output rows
 * added into c->x; uses phases, ends with a barrier. */
void fw_attention(struct worker *w, int il);
/* MoE block (src/moe/moe.c): reads ffn-normed c->xn prepared in c->a_in, adds into c->x. */
void fw_moe(struct worker *w, int il);

#endif
