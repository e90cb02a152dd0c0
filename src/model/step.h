/* step.h - the phases of a step and the helpers every stage of it uses: the
 * work split (chunks, rows, static splits), phase begin/end with the ledger's
 * timing and the barrier, activation slots (prepared Q8_0/Q4_0 copies), matmul
 * items and the step's first error. Internal.
 *
 * DESIGN
 *   A step is one moetax_pool_run over one micro-batch: every worker walks the
 *   same sequence of phases. struct fw_step holds what all stages share: the
 *   model, kernels, pool, the micro-batch's tokens (id, position, sequence),
 *   the residual x, the normed input xn and its prepared slot a_in (the
 *   scheduler's contract with attention and the MoE block: a stage reads its
 *   normed input from there and adds its output into x), the per-worker own-row
 *   slots of the one-token path, the ledger and the first error. Each stage
 *   (src/attn/mla.c, src/moe/moe.c, the dense FFN in src/model/forward.c) owns
 *   its other buffers in a state struct of its own.
 *
 *   Phases rotate over the pool's chunk counters: at the start of phase p
 *   worker 0 resets the counter of phase p+1, and the barrier ending phase p
 *   publishes it.
 */
#ifndef MOETAX_STEP_H
#define MOETAX_STEP_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

#include "moetax/kernels.h"
#include "moetax/ledger.h"
#include "moetax/model.h"
#include "moetax/pool.h"

/* Prepared activations of one input matrix [n rows, ncols] for every weight
 * type the model uses: float types read x itself; Q8_0/Q4_0 get their own
 * prepared copies, and k-quants block_q8_K rows (qk; rows of a multiple of 256
 * values) where the slot has them (see include/moetax/kernels.h). An act made by
 * hand without qk has its k-quant rows made per matmul call instead. */
/* The type whose prepared rows fill an act's qk slot: block_q8_K rows, the same for every k-quant. */
#define FW_ACT_KQ_TYPE MOETAX_TYPE_Q4_K

struct act {
    const float *x;
    int64_t ncols, n;
    void *q8, *q4, *qk;  /* buffers owned by whoever allocated the slot (fw_act_alloc) */
    size_t cap_q8, cap_q4, cap_qk;
};

/* Per-worker buffers of the step helpers: the own rows of one token, or of a
 * small batch (fw_own_rows). */
enum {
    FW_OWN_ROWS = 8,      /* at most this many rows ... */
    FW_OWN_ELEMS = 16384, /* ... of at most this many floats in all */
};
struct fw_own {
    struct act in; /* this worker's own prepared input rows (fw_own_rows) */
    float *x;      /* [FW_OWN_ROWS][max width] the rows normalised */
};

struct fw_step {
    const struct moetax_model *m;
    const struct moetax_kernels *K;
    /* the weights' matmul: K->matmul_stream for a model larger than the last-level cache
     * (moetax_kernels_streamed), else K->matmul; the same bits either way */
    void (*mm)(enum moetax_type wtype, const void *w, size_t row_bytes, int64_t row0, int64_t row1, int64_t ncols,
               const void *xq, int64_t n_batch, float *y, int64_t ldy);
    bool streamed;         /* mm is K->matmul_stream: the weights come from memory, not the caches */
    struct moetax_pool *pool;
    int n_threads;
    int64_t n_ubatch;      /* U: most tokens per micro-batch */
    int64_t max_cols;      /* widest row an own-row slot holds */
    bool float_by_row;     /* float weights with several batch rows: one row at a time (fw_matmul) */

    /* the micro-batch being run (set before moetax_pool_run) */
    int64_t n;             /* tokens */
    const int32_t *tokens; /* [n] */
    const int32_t *pos;    /* [n] position of each token in its sequence */
    const int32_t *seq;    /* [n] sequence id of each token */
    bool one_per_seq;      /* no two tokens of the micro-batch belong to one sequence */
    /* token-sharded dispatch (src/dist/dist.h; else NULL): every rank's tokens in this
     * micro-batch [P], and each of this rank's tokens' index in the whole batch [n] */
    const int32_t *ep_n, *gidx;

    float *x;              /* [U, d] residual */
    float *xn;             /* [U, max(d, q_lora)] normed input of a projection */
    struct act a_in;       /* slot for inputs of width d / q_lora / H*v (U rows) */
    struct fw_own *own;    /* [n_threads] */

    /* fw_rows' block counters: per chunk counter of the pool (a phase's, see fw_phase_begin),
     * one per worker [MOETAX_POOL_N_CHUNK_COUNTERS * n_threads], each on its own cache line */
    struct fw_rowctr { _Atomic int64_t v; char pad[64 - sizeof(int64_t)]; } *rowctr;

    struct moetax_ledger *ledger;   /* optional, not owned */
    enum moetax_phase delay_phase;  /* test hook (moetax_ctx_test_delay) */
    uint64_t delay_ns;
    _Atomic int err_status;         /* first error raised inside a step (e.g. an expert read) */
    char err_msg[512];
};

/* Per-worker view of a step: phase counter for the chunk counters, and the
 * ledger phase being timed. */
struct worker {
    struct fw_step *s;
    int ith, nth;
    int phase;
    struct moetax_ledger *ledger; /* NULL or disabled: no timing */
    enum moetax_phase lph;        /* ledger phase being timed */
    int layer;
    uint64_t t0;
};

/* Allocate the step's shared buffers for micro-batches of U tokens, rows up to
 * `incols` wide in a_in and `max_cols` in the own-row slots. */
moetax_status fw_step_init(struct fw_step *s, const struct moetax_model *m, struct moetax_pool *pool, int64_t U,
                           int64_t incols, int64_t max_cols);
void fw_step_free(struct fw_step *s);

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
 * workers that run at different speeds (a shared machine, a late wake-up). Each
 * worker takes the blocks of its own contiguous share in order, then the next
 * ones left in the others' shares: a worker's reads of a matrix stay one stream
 * (blocks dealt out in turn made every worker skip every other block, which the
 * hardware prefetchers do not follow). At most one fw_rows or fw_chunk_own loop
 * per phase. */
bool fw_rows(struct worker *w, int64_t n, int64_t block, int64_t *r0, int64_t *r1);
/* The same for n items in order (e.g. row blocks, or an expert's blocks one after the other):
 * the next item for this worker, or -1 when all are taken. */
int64_t fw_chunk_own(struct worker *w, int64_t n);
/* Reset the counters of fw_rows for a step's first phases (as the pool's chunk counters 0
 * and 1 are reset before each run). */
void fw_rows_reset(struct fw_step *s, int counter);
/* Static split [*r0, *r1) of n items for this worker, aligned to `align`. */
void fw_split(const struct worker *w, int64_t n, int64_t align, int64_t *r0, int64_t *r1);

/* An activation slot for `rows` rows of up to `ncols` columns: prepared buffers
 * for the types the model uses, and x itself when own_x. */
moetax_status fw_act_alloc(const struct moetax_model *m, struct act *a, int64_t ncols, int64_t rows, bool own_x);
void fw_act_free(struct act *a, bool own_x);
/* A view of an activation slot's buffers describing the matrix x [n, ncols].
 * The slot's buffers never change after init, so every worker can take a view
 * while worker 0 publishes the descriptor with fw_act_publish (the barrier at
 * the end of the phase makes it visible to the next phases). */
struct act fw_act_view(const struct act *slot, const float *x, int64_t ncols, int64_t n);
/* Whether a's k-quant rows are prepared in its qk slot (fw_act_prep; else made per matmul call). */
bool fw_act_has_qk(const struct act *a);
void fw_act_publish(const struct worker *w, struct act *slot, const struct act *view);
/* Decode (one token): the one row x [ncols] (normalised with norm_w first,
 * unless NULL) prepared in this worker's own slot, for the matmuls of the
 * phase in progress. Every worker does this same small work, instead of one
 * of them doing it in a phase of its own that ends with a barrier: a barrier
 * less each time, same bits. Valid until this worker's next call. */
const struct act *fw_own_row(struct worker *w, const float *x, int64_t ncols, const float *norm_w);
/* The same for n rows x [n, ncols] of a small batch (fw_own_fits): every worker
 * makes all n rows (n x the work of one, still less than a barrier for the few
 * rows of a batch of decoding sequences). */
const struct act *fw_own_rows(struct worker *w, const float *x, int64_t ncols, int64_t n, const float *norm_w);
/* Whether n rows of ncols go to fw_own_rows rather than a phase of their own. */
static inline bool fw_own_fits(int64_t n, int64_t ncols) {
    return n == 1 || (n <= FW_OWN_ROWS && n * ncols <= FW_OWN_ELEMS);
}
/* This worker's share of rows [t_first, n) of src [n, ncols]: normalised with
 * weight into dst (may be src) and prepared in the shared slot s->a_in, which
 * then describes all n rows. */
void fw_norm_rows(struct worker *w, float *dst, const float *src, const float *weight, int64_t ncols,
                  int64_t t_first);
/* Begin a phase that reads rows [0, n) of src [n, ncols] normalised with
 * weight and prepared: a batch normalises them into dst (may be src) and
 * prepares them in s->a_in in a phase of its own (ledger phase ph, split
 * across workers, ending with a barrier), then begins the phase `next`; one
 * token, or a small batch (fw_own_fits), begins a phase as ph, makes the rows
 * in this worker's own slot (fw_own_rows) and goes on as `next`, without a
 * barrier. Returns the act. */
const struct act *fw_norm_input(struct worker *w, enum moetax_phase ph, enum moetax_phase next, int layer, float *dst,
                                const float *src, const float *weight, int64_t ncols);
/* Whether a micro-batch's attention can run token-parallel (attn/mla.c, attn/gqa.c): a model in
 * the caches (a streamed one would read the attention's weights once per worker), every token of
 * its own sequence (so no token needs a cache row another worker writes), at least one token per
 * worker, and each worker's rows of up to `width` floats within its own slot (fw_own_fits). */
bool fw_tokens_parallel(const struct worker *w, int64_t width);
/* Token-parallel attention: begins the layer's phase (ledger NORM, then
 * ATTN) and gives this worker's tokens [*t0, *t1) (a static split) with their residual rows
 * normalised by norm_w and prepared in its own slot (fw_own_rows); NULL when it has none. */
const struct act *fw_tokens_begin(struct worker *w, int layer, const float *norm_w, int64_t *t0, int64_t *t1);
/* ... and ends it: x += W_o attv for tokens [t0, t1) (attv [n, width], out [n, d] scratch), then the
 * phase's barrier. */
void fw_tokens_end(struct worker *w, const struct moetax_weight *wo, const float *attv, int64_t width, float *out,
                   int64_t t0, int64_t t1);
/* Prepare rows [t0, t1) of an activation (x set, ncols, n). */
void fw_act_prep(const struct fw_step *s, struct act *a, int64_t t0, int64_t t1);
/* The xq pointer for a weight type. */
const void *fw_act_for(const struct act *a, enum moetax_type t);
/* y[b * ldy + r] for r in [r0, r1) of matrix `mat` of w, rows b < n of a. */
void fw_matmul(const struct fw_step *s, const struct moetax_weight *w, int64_t mat, int64_t r0, int64_t r1,
               const struct act *a, int64_t b0, int64_t n, float *y, int64_t ldy);
/* Same with the matrix given by its address (e.g. an expert held by the store). */
void fw_matmul_at(const struct fw_step *s, const struct moetax_weight *w, const void *mat, int64_t r0, int64_t r1,
                  const struct act *a, int64_t b0, int64_t n, float *y, int64_t ldy);
/* fw_matmul_at of w into y, then of w2 (rows r0..r1 too) into y2: k-quant weights of one width
 * share one preparation of a's rows (gate and up); the same results as the two calls. */
void fw_matmul2_at(const struct fw_step *s, const struct moetax_weight *w, const void *mat,
                   const struct moetax_weight *w2, const void *mat2, int64_t r0, int64_t r1, const struct act *a,
                   int64_t b0, int64_t n, float *y, float *y2, int64_t ldy);
/* Same, writing y[b * ldy + (r - r0)]. */
void fw_matmul_rel(const struct fw_step *s, const struct moetax_weight *w, int64_t mat, int64_t r0, int64_t r1,
                   const struct act *a, int64_t b0, int64_t n, float *y, int64_t ldy);
/* Record the first error of a step (the message of the calling thread). */
void fw_fail(struct fw_step *s, moetax_status st);

#endif
