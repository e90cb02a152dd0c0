/* moe.h - the fused MoE block: its own buffers (routing, dispatch plan, expert
 * activations, the store's acquisitions, the cross-layer prediction) and its
 * entry point (see moe.c). Internal. */
#ifndef MOETAX_MOE_H
#define MOETAX_MOE_H

#include <stdatomic.h>

#include "model/step.h"
#include "moe/readahead.h"

struct moetax_store;
struct moetax_dist;
struct moe_ep;

/* The dispatch plan of one MoE layer for the micro-batch. */
struct plan {
    int32_t n_active;      /* experts with at least one row */
    int32_t n_slots;       /* assignments planned (n * k less those a capacity factor dropped) */
    int32_t *active;       /* [E] expert ids, ascending */
    int32_t *count;        /* [E] rows per expert */
    int32_t *offset;       /* [E] first slot of each expert */
    int32_t *slot_token;   /* [U*k] token of each slot, grouped by expert */
    float *slot_w;         /* [U*k] routing weight of each slot */
    int32_t *fill;         /* [E] scratch */
    int32_t n_mine;        /* active experts this rank computes (all of them without a world) */
    int32_t *mine;         /* [E] their ids, ascending */
    int32_t *m_off, *m_cnt; /* [E] the slots of mine[i] this rank computes: all of the expert's, or
                             * its part of a replicated expert's (src/dist/eplb.c) */
    int32_t *part;         /* [E, H] slots per host of each expert (replicas only) */
    int32_t *rep_nh;       /* [E] replicated dispatch: this micro-batch's hosts per expert (eplb.c, */
    int32_t *rep_hosts;    /* [E, H] moetax_dist_plan_micro) and the hosts themselves */
};

/* per-worker state of the MoE block */
struct moe_worker {
    /* experts this worker holds from the expert store during one MoE block */
    const void *(*eptr)[3];  /* [E] gate, up, down matrix of expert e (valid if acq[e]) */
    uint8_t *acq;            /* [E] */
    int32_t *acq_list;       /* [E] */
    int n_acq;
    float *f;                /* [nf] routing scratch (2E), shared-expert down rows (U * 64) */
    size_t nf;
    /* decode (one token) and small batches (moe.c, own_route): this worker's routing of the
     * tokens (FW_OWN_ROWS x k), its dispatch plan, its own prepared expert hidden rows (k rows
     * of n_ff_exp, of eh; one token) and an expert's input rows gathered (a small batch) */
    int32_t *sel;
    float *selw;
    struct plan plan;
    struct act own_eh;
    struct act gat;
};

struct moe {
    int32_t k;                  /* routed experts per token */
    struct moetax_store *store; /* optional, not owned */
    bool prefetch;              /* with a store: prefetch the next layer's predicted experts */
    int read_ahead;             /* with prefetch: layers ahead that decode's predictions are offered to the
                                 * store's read-ahead list (moe/readahead.h); 0: the next layer's through
                                 * moetax_store_prefetch instead */
    struct moe_ra ra;           /* read_ahead > 0: the offers and their scores */
    float *router;              /* [U, E] router logits */
    float *sh_hid, *sh_tmp;     /* [U, Fs] shared experts' hidden, up (scratch) */
    float *eh;                  /* [U*k, F] expert hidden */
    float *eh_g;                /* [U*k, F] expert gate (scratch) */
    float *ydown;               /* [U*k, d] expert down outputs */
    _Atomic int32_t *gu_done;   /* [E] a batch whose down projections are split (moe.c, down_pieces):
                                 * gate/up blocks done per active expert; the last one prepares the
                                 * expert's hidden rows. Zero outside the two phases */
    struct act a_sh;            /* slot for the shared hidden */
    struct act a_exp;           /* slot for expert inputs (gathered) */
    struct act a_eh;            /* slot for expert hidden */
    struct plan plan;
    int32_t *sel;               /* [n_layer][U*k] routing of the last micro-batch */
    float *selw;                /* [n_layer][U*k] */
    float *pred_x, *pred_logits, *pred_p; /* [d], [E], [2E] prediction scratch (worker 0) */
    void *pred_q;               /* prepared pred_x */
    int32_t *pred;              /* [n_layer][U*k] experts predicted for a layer from the previous layer's residual */
    bool *pred_ok;              /* [n_layer] */
    int64_t *hist_n;            /* [n_layer] tokens whose routing sel holds (the last micro-batch
                                 * that reached the layer; 0: none yet): recent-token history */
    /* capacity factor (off when capacity_factor <= 0 or infinite): see apply_capacity */
    float capacity_factor;
    bool reroute;               /* overflow moved to the next-best expert with room, else dropped */
    int32_t *cap_count;         /* [E] */
    uint64_t *cap_order;        /* [U*k] */
    float *cap_tot;             /* [U] (-1: untouched) */
    float *cap_p;               /* [2E] */
    struct moe_worker *wk;      /* [n_threads] */
    int n_threads;
    /* expert parallelism (src/dist/dist.h): this rank computes the routed experts it owns
     * (all of them without a world), then the combine's collective gives it the others' */
    struct moetax_dist *dist;   /* NULL: one process */
    const int32_t *owner;       /* [n_layer, E] rank of each expert (the world's placement); NULL: all here */
    int rank;
    int64_t *slot_lo;           /* [P + 1] first row of each rank's slots in the gathered buffer */
    float *gbuf;                /* [U * k, d] rows packed by rank (a placement not in contiguous ranges) */
    float *partial;             /* [U, d] this rank's weighted sums (MOETAX_MPI_COMBINE=allreduce) */
    /* token-sharded dispatch (dist.h): the rank's own tokens go to the experts' ranks as
     * records, once per (token, rank); NULL: replicated (every rank routes every token) */
    struct moe_ep *ep;
};

struct moe_params {
    int32_t k;                  /* routed experts per token */
    struct moetax_store *store; /* optional */
    bool prefetch;
    float capacity_factor;      /* <= 0 or inf: off */
    bool reroute;
    struct moetax_dist *dist;   /* optional: expert parallelism over MPI */
};
moetax_status moe_init(struct moe *b, const struct fw_step *s, const struct moe_params *p);
void moe_free(struct moe *b);
/* Worker 0 at the start of a step: no layer has a prediction yet. */
void moe_step_begin(struct moe *b, const struct fw_step *s);
/* Layer il: reads the residual s->x (one token: normalises it itself) or the
 * ffn-normed s->xn prepared in s->a_in (a batch), adds the block's output
 * into s->x; phases as in moe.c, ends with a barrier. */
void moe_block(struct worker *w, struct moe *b, int il);
/* Decoding with the read-ahead (b->read_ahead > 0): offer experts [n] (-1 skipped) of layer T,
 * predicted from a layers before it, with their margins (moe/readahead.h); this rank's only,
 * with a world. */
void moe_offer(struct moe *b, int64_t E, int T, int a, const int32_t *experts, const float *margins, int n);

#endif
