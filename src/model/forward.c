/*
 * forward.c - the inference context and the step scheduler.
 *
 * One moetax_pool_run per micro-batch: every worker walks the same phases
 * (embedding, then per layer attention and FFN/MoE, then the head), splitting
 * each phase's work by (ith, nth) or by the pool's atomic chunk counters, with
 * a barrier between phases (src/model/step.h). The stages own their buffers:
 * attention (the architecture's: src/attn/mla.h or src/attn/gqa.h) over the paged KV cache (moetax/kvcache.h), the
 * MoE block (src/moe/moe.h) and the dense FFN (here); they share only the
 * residual and the normed input of fw_step.
 *
 * A batch (moetax_batch) holds tokens of any sequences at their next
 * positions; its cells are reserved at once (all or nothing), then it runs in
 * micro-batches of at most n_ubatch tokens. Attention runs per token over its
 * own sequence's blocks; everything else treats the micro-batch as one matrix,
 * so the MoE block routes all its tokens at once and reads each expert once.
 *
 * Barriers per layer for one decoded token: attention 3 (4 with q_lora, +1
 * when kv_a is not fused, see mla.c), then MoE 3 or dense 3. A micro-batch of
 * several tokens: attention 6 (8 with q_lora), FFN norm 1, MoE 6 or dense 3.
 * Plus 1 for the embedding and 1-2 for the head per step.
 */
#include <math.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "attn/gqa.h"
#include "attn/mla.h"
#include "model/step.h"
#include "moe/moe.h"
#include "moetax/kvcache.h"
#include "moetax/store.h"
#ifdef MOETAX_WITH_MPI
#include "dist/dist.h"
#endif

/* the dense FFN's buffers */
struct dense {
    float *hid, *tmp;      /* [U, n_ff] hidden, up (scratch) */
    struct act a_hid;      /* slot for the hidden */
};

/* adapt_threads: the threads a step runs on, chosen from measured step times (see
 * moetax_ctx_params.adapt_threads). Steps are compared within a shape: micro-batches of
 * 2^b .. 2^(b+1)-1 tokens (bucket b), each with its own smoothed time. */
enum { ADAPT_BUCKETS = 12, ADAPT_PROBE_STEPS = 3 };
struct adapt {
    bool on;
    int cur;                    /* threads steps run on now */
    int bucket;                 /* of the step in progress */
    double ema_ns[ADAPT_BUCKETS]; /* smoothed step time at cur (0: none yet) */
    int since[ADAPT_BUCKETS];   /* steps since the bucket's last probe */
    int every;                  /* probe period (doubles while probes lose) */
    int probe;                  /* the thread count of the probe in progress, 0: none */
    int probe_n;                /* its steps so far (ADAPT_PROBE_STEPS in all, of bucket probe_b) */
    int probe_b;
    bool probing;               /* the step in progress is one of the probe's */
    double probe_ns[3];
    int64_t switches, probes;
    bool force;       /* tests (MOETAX_ADAPT_THREADS_FORCE=1): every probe wins */
};

struct moetax_ctx {
    const struct moetax_model *m;
    struct moetax_pool *pool;
    bool own_pool;
    int n_threads;
    struct adapt adapt;
    int64_t n_ctx, n_ubatch;
    int32_t n_expert_used; /* k: routed experts per token (ctx param, default the model's) */
    struct moetax_kvcache *kv;
    struct fw_step step;
    struct mla attn;       /* MOETAX_ATTN_MLA */
    struct gqa gqa;        /* MOETAX_ATTN_GQA */
    struct moe moe;
    struct dense dense;
    int64_t sel_n;         /* tokens routed in the last micro-batch */
    bool check_finite;     /* check the residual after the embedding and every layer */

    /* the micro-batch's outputs: token out_tok[o] gives logits row o of logits */
    int32_t *out_tok;      /* [U] */
    int64_t n_out;
    float *logits;         /* NULL: no logits this micro-batch */
    _Atomic int logits_bad; /* a worker found a logit that is not finite (decode_local names it) */

    /* moetax_ctx_decode's outputs: logits of the batch entries that asked, in order */
    float *out_buf;
    int64_t out_cap;       /* rows */
    int32_t *out_row;      /* [entries] row of each entry, -1: none */
    int64_t out_row_cap, n_entries;
    /* moetax_ctx_eval's batch for sequence 0 */
    int32_t *eval_pos, *eval_seq;
    bool *eval_want;
    int64_t eval_cap;
    /* token-sharded dispatch (src/dist/dist.h): this rank runs the batch's sequences with
     * seq % P == rank; ep_* hold its share of the batch and its logits */
    bool ep;
    int ep_rank, ep_size;
    int32_t *ep_tok, *ep_pos, *ep_seq, *ep_src; /* [cap] its tokens, and their index in the batch */
    /* the micro-batches: ep_ubn [n_ub, P] every rank's tokens in each, ep_ub0 [n_ub + 1] this
     * rank's first token of each */
    int32_t *ep_ubn;
    int64_t *ep_ub0, ep_ub_cap;
    bool *ep_want;
    int64_t ep_cap;
    float *ep_logits;      /* [rows, V] the logits of all ranks' wanting tokens, by rank */
    int64_t ep_logits_cap; /* rows */
};

/* ---- the step ---------------------------------------------------------------------- */

static void dense_ffn(struct worker *w, struct dense *D, const struct moetax_layer *l, int il) {
    struct fw_step *s = w->s;
    const int64_t n = s->n, d = s->m->hp.n_embd, ff = l->ffn_gate.ne[1];
    int64_t r0, r1;
    /* decode or a small batch: each worker normalises and prepares the rows itself (see
     * fw_own_rows; the caller skipped the norm's phase) */
    const bool own = fw_own_fits(n, d);
    fw_phase_begin(w, own ? MOETAX_PHASE_NORM : MOETAX_PHASE_DENSE, il);
    const struct act *ain = own ? fw_own_rows(w, s->x, d, n, l->ffn_norm) : &s->a_in;
    fw_mark(w, MOETAX_PHASE_DENSE);
    while (fw_rows(w, ff, 64, &r0, &r1)) {
        fw_matmul(s, &l->ffn_gate, 0, r0, r1, ain, 0, n, D->hid, ff);
        fw_matmul(s, &l->ffn_up, 0, r0, r1, ain, 0, n, D->tmp, ff);
        for (int64_t t = 0; t < n; t++)
            s->K->silu_mul(D->hid + t * ff + r0, D->hid + t * ff + r0, D->tmp + t * ff + r0, r1 - r0);
    }
    fw_phase_end(w);
    fw_phase_begin(w, MOETAX_PHASE_DENSE, il);
    struct act ah = fw_act_view(&D->a_hid, D->hid, ff, n);
    fw_act_publish(w, &D->a_hid, &ah);
    fw_split(w, n, 1, &r0, &r1);
    fw_act_prep(s, &ah, r0, r1);
    fw_phase_end(w);
    fw_phase_begin(w, MOETAX_PHASE_DENSE, il);
    while (fw_rows(w, d, 64, &r0, &r1)) {
        fw_matmul(s, &l->ffn_down, 0, r0, r1, &D->a_hid, 0, n, D->tmp, d);
        for (int64_t t = 0; t < n; t++)
            for (int64_t r = r0; r < r1; r++) s->x[t * d + r] += D->tmp[t * d + r];
    }
    fw_phase_end(w);
}

/* The head's input: the final norm of the rows that give logits (out_tok), compacted
 * into xn and prepared in a_in, in a phase of its own. */
static void head_rows(struct worker *w, const struct moetax_ctx *c) {
    struct fw_step *s = w->s;
    const int64_t d = s->m->hp.n_embd;
    int64_t r0, r1;
    fw_phase_begin(w, MOETAX_PHASE_HEAD, -1);
    fw_split(w, c->n_out, 1, &r0, &r1);
    for (int64_t o = r0; o < r1; o++)
        s->K->rmsnorm(s->xn + o * d, s->x + (int64_t)c->out_tok[o] * d, s->m->output_norm, d, s->m->hp.rms_eps);
    struct act v = fw_act_view(&s->a_in, s->xn, d, c->n_out);
    fw_act_publish(w, &s->a_in, &v);
    fw_act_prep(s, &v, r0, r1);
    fw_phase_end(w);
}

/* --check-finite: this worker's rows of the residual after layer il (-1: the embedding).
 * Run right after a barrier, before the next phase writes x (attention's first phases
 * only read it), so every worker may read all of x; the first non-finite value is the
 * step's error. */
static void check_rows(struct worker *w, int il) {
    struct fw_step *s = w->s;
    const int64_t d = s->m->hp.n_embd;
    int64_t r0, r1;
    fw_split(w, s->n, 1, &r0, &r1);
    for (int64_t t = r0; t < r1; t++)
        for (int64_t j = 0; j < d; j++)
            if (!isfinite(s->x[t * d + j])) {
                char where[64];
                if (il < 0) snprintf(where, sizeof where, "the token embedding");
                else snprintf(where, sizeof where, "layer %d", il);
                fw_fail(s, moetax_error(MOETAX_ERR_NUMERIC,
                                        "%s: the hidden state of token %lld (sequence %d, position %d) is not finite "
                                        "(element %lld is %g)", where, (long long)t, s->seq[t], s->pos[t], (long long)j,
                                        (double)s->x[t * d + j]));
                return;
            }
}

/* Whether the n floats at x are all finite: an exponent field of all ones is inf or NaN.
 * Branch-free over the row (it runs on every logit of every step). */
static bool all_finite(const float *x, int64_t n) {
    int64_t i = 0;
    uint32_t bad = 0;
#if defined(__SSE2__)
    const __m128i ex = _mm_set1_epi32(0x7f800000);
    __m128i acc = _mm_setzero_si128();
    for (; i + 4 <= n; i += 4) {
        const __m128i v = _mm_and_si128(_mm_loadu_si128((const __m128i *)(x + i)), ex);
        acc = _mm_or_si128(acc, _mm_cmpeq_epi32(v, ex));
    }
    bad = (uint32_t)_mm_movemask_epi8(acc);
#endif
    for (; i < n; i++) {
        uint32_t u;
        memcpy(&u, x + i, sizeof u);
        bad |= (u & 0x7f800000u) == 0x7f800000u;
    }
    return bad == 0;
}

static void step_worker(void *arg, int ith, int nth) {
    struct moetax_ctx *c = arg;
    struct fw_step *s = &c->step;
    const struct moetax_model *m = c->m;
    const struct moetax_hparams *hp = &m->hp;
    struct worker w = {.s = s, .ith = ith, .nth = nth, .phase = 0,
                       .ledger = moetax_ledger_enabled(s->ledger) ? s->ledger : NULL};
    const int64_t n = s->n, d = hp->n_embd;
    int64_t r0, r1;

    if (ith == 0) moe_step_begin(&c->moe, s);
    if (c->ep && n == 0) { /* no tokens of this rank in the micro-batch: it serves its experts */
        for (int il = 0; il < hp->n_layer; il++)
            if (m->layers[il].is_moe) moe_block(&w, &c->moe, il);
        return;
    }
    /* embedding rows and each position's rope cos/sin */
    fw_phase_begin(&w, MOETAX_PHASE_EMBD, -1);
    fw_split(&w, n, 1, &r0, &r1);
    for (int64_t t = r0; t < r1; t++) {
        const struct moetax_weight *te = &m->tok_embd;
        moetax_to_float(te->type, (const char *)te->data + (size_t)s->tokens[t] * te->row_bytes, s->x + t * d, d);
        if (hp->attn == MOETAX_ATTN_GQA) gqa_rope_token(&c->gqa, s, t);
        else mla_rope_token(&c->attn, s, t);
    }
    fw_phase_end(&w);
    if (c->check_finite) check_rows(&w, -1);

    for (int il = 0; il < hp->n_layer; il++) {
        const struct moetax_layer *l = &m->layers[il];
        if (hp->attn == MOETAX_ATTN_GQA) gqa_attention(&w, &c->gqa, il);
        else mla_attention(&w, &c->attn, il);
        /* decode and small batches: in the FFN's first phase (fw_own_rows; token-sharded MoE: here) */
        if (!fw_own_fits(n, d) || (c->ep && l->is_moe)) {
            fw_phase_begin(&w, MOETAX_PHASE_NORM, il);
            fw_norm_rows(&w, s->xn, s->x, l->ffn_norm, d, 0);
            fw_phase_end(&w);
        }
        if (l->is_moe) moe_block(&w, &c->moe, il);
        else dense_ffn(&w, &c->dense, l, il);
        if (c->check_finite) check_rows(&w, il);
    }

    if (!c->logits || c->n_out == 0) return;
    /* head: final norm of the rows that give logits, then the output matrix */
    const struct act *ah = &s->a_in;
    bool run = true; /* the rows that give logits are consecutive tokens (one, or a decode step's) */
    for (int64_t o = 1; o < c->n_out; o++) run &= c->out_tok[o] == c->out_tok[0] + o;
    if (!run || !fw_own_fits(c->n_out, d)) {
        head_rows(&w, c);
        fw_phase_begin(&w, MOETAX_PHASE_HEAD, -1);
    } else { /* few: each worker normalises and prepares them itself (see fw_own_rows) */
        fw_phase_begin(&w, MOETAX_PHASE_HEAD, -1);
        ah = fw_own_rows(&w, s->x + (int64_t)c->out_tok[0] * d, d, c->n_out, m->output_norm);
    }
    bool finite = true;
    while (fw_rows(&w, hp->n_vocab, 256, &r0, &r1)) {
        fw_matmul(s, &m->output, 0, r0, r1, ah, 0, c->n_out, c->logits, hp->n_vocab);
        /* this worker's block of every row, while it is in cache (decode_local names the first
         * bad logit only when some worker found one) */
        for (int64_t o = 0; o < c->n_out && finite; o++) finite = all_finite(c->logits + o * hp->n_vocab + r0, r1 - r0);
    }
    if (!finite) atomic_store_explicit(&c->logits_bad, 1, memory_order_relaxed);
    fw_phase_end(&w);
}

/* ---- context --------------------------------------------------------------------- */

static int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }

moetax_status moetax_ctx_init(const struct moetax_model *m, const struct moetax_ctx_params *p,
                              struct moetax_ctx **out) {
    *out = NULL;
    const struct moetax_hparams *hp = &m->hp;
    struct moetax_ctx *c = calloc(1, sizeof *c);
    if (!c) return moetax_error(MOETAX_ERR_NOMEM, "out of memory");
    c->m = m;
    c->n_ctx = p && p->n_ctx > 0 ? p->n_ctx : (hp->n_ctx_train < 4096 ? hp->n_ctx_train : 4096);
    c->n_ubatch = p && p->n_ubatch > 0 ? p->n_ubatch : MOETAX_UBATCH_DEFAULT;
    if (c->n_ubatch > c->n_ctx) c->n_ubatch = c->n_ctx;
    moetax_status st = MOETAX_OK;
    if (c->n_ctx > (1 << 24)) {
        st = moetax_error(MOETAX_ERR_ARG, "context size %lld is too large (max %d)", (long long)c->n_ctx, 1 << 24);
        free(c);
        return st;
    }
    struct moetax_store *store = p ? p->store : NULL;
    const int32_t k_req = p ? p->n_expert_used : 0;
    if ((st = moetax_model_check_experts_used(m, k_req))) {
        free(c);
        return st;
    }
    c->n_expert_used = k_req ? k_req : hp->n_expert_used;
    c->check_finite = p && p->check_finite;
    if (p && (isnan(p->capacity_factor) || p->capacity_factor < 0)) {
        st = moetax_error(MOETAX_ERR_ARG, "capacity factor %g: expected a number > 0 (or 0 / inf: off)",
                          (double)p->capacity_factor);
        free(c);
        return st;
    }
    if (store && hp->n_expert > 0) { /* every expert one layer uses for a micro-batch is pinned at once */
        int64_t own = 1; /* under mpirun the store holds this rank's experts only: most owned in a layer */
        for (int il = 0; il < hp->n_layer; il++) {
            int64_t cnt = 0;
            for (int e = 0; m->layers[il].is_moe && e < hp->n_expert; e++) cnt += moetax_model_expert_owned(m, il, e);
            own = cnt > own ? cnt : own;
        }
        const int64_t kk = c->n_expert_used < own ? c->n_expert_used : own;
        int64_t tok = c->n_ubatch; /* token-sharded dispatch: a unit holds records of every rank's tokens */
#ifdef MOETAX_WITH_MPI
        if (moetax_dist_world() && moetax_dist_world()->dispatch) tok *= moetax_dist_world()->size;
#endif
        const int64_t need = tok * kk < own ? tok * kk : own;
        if (moetax_store_n_slots(store) < need) {
            st = moetax_error(MOETAX_ERR_ARG,
                              "the expert store holds %d experts, but a micro-batch of %lld tokens with %d experts "
                              "each pins up to %lld: open it with this n_ubatch and n_expert_used",
                              moetax_store_n_slots(store), (long long)c->n_ubatch, c->n_expert_used,
                              (long long)need);
            free(c);
            return st;
        }
    }
    /* without a store the experts are read where the model holds them: repacked once if the
     * kernels read their type repacked, else the mapping (prefaulted) */
    if (!store && (st = moetax_model_prepare_experts(m))) {
        free(c);
        return st;
    }
    if (p && p->pool) c->pool = p->pool;
    else {
        struct moetax_pool_params pp = {.n_threads = p ? p->n_threads : 0};
        st = moetax_pool_init(&pp, &c->pool);
        if (st) { free(c); return st; }
        c->own_pool = true;
    }
    c->n_threads = moetax_pool_n_threads(c->pool);
    c->adapt = (struct adapt){.on = p && p->adapt_threads && c->n_threads > 1, .cur = c->n_threads, .every = 16};
    {
        const char *f = getenv("MOETAX_ADAPT_THREADS_FORCE");
        c->adapt.force = f && !strcmp(f, "1");
    }
    const int64_t U = c->n_ubatch, d = hp->n_embd, H = hp->n_head, vh = hp->n_embd_head_v;
    const int64_t ql = hp->q_lora_rank, k = hp->n_expert ? c->n_expert_used : 1;
    /* the FFN widths of the tensors bound (the keys' values are checked only against those) */
    int64_t ffmax = 1, ffdense = 1;
    for (int il = 0; il < hp->n_layer; il++) {
        ffmax = max64(ffmax, m->layers[il].ffn_gate.ne[1]);
        ffmax = max64(ffmax, m->layers[il].gate_sh.ne[1]);
        if (!m->layers[il].is_moe) ffdense = max64(ffdense, m->layers[il].ffn_gate.ne[1]);
    }
    const int64_t incols = max64(max64(d, ql), H * vh);
    /* the KV cache: n_ctx cells in all, rounded up to whole blocks */
    const int32_t bs = p && p->kv_block > 0 ? p->kv_block : MOETAX_KV_BLOCK_DEFAULT;
    struct moetax_kvcache_params kp = {.n_cells = (c->n_ctx + bs - 1) / bs * bs, .block_size = bs,
                                       .n_seq_max = p && p->n_seq_max > 0 ? p->n_seq_max : MOETAX_KV_SEQ_MAX_DEFAULT,
                                       .type = p ? p->kv_type : MOETAX_TYPE_F32};
    c->n_ctx = kp.n_cells;
    const bool gqa = hp->attn == MOETAX_ATTN_GQA;
    st = moetax_kvcache_init(hp->n_layer, gqa ? gqa_kv_row(hp) : hp->kv_lora_rank + hp->n_embd_head_qk_rope, &kp, &c->kv);
    if (!st) st = fw_step_init(&c->step, m, c->pool, U, incols, max64(incols, ffmax));
    if (!st) st = gqa ? gqa_init(&c->gqa, &c->step, c->kv) : mla_init(&c->attn, &c->step, c->kv,
                                                                          p ? p->attn_prefill : MOETAX_ATTN_PREFILL_ABSORBED);
    struct moe_params mp = {.k = (int32_t)k, .store = store, .prefetch = store && !(p && p->no_prefetch),
                            .capacity_factor = p ? p->capacity_factor : 0,
                            .reroute = p && p->overflow == MOETAX_OVERFLOW_REROUTE};
#ifdef MOETAX_WITH_MPI
    mp.dist = moetax_dist_world(); /* under mpirun: this rank's experts, the combine's collective */
    if (mp.dist && mp.dist->size > 1 && mp.dist->dispatch && hp->n_expert > 0) {
        c->ep = true;
        c->ep_rank = mp.dist->rank;
        c->ep_size = mp.dist->size;
    }
    if (mp.dist && mp.dist->size > 1) c->adapt.on = false; /* every rank keeps its threads (not measured yet) */
#endif
    if (!st) st = moe_init(&c->moe, &c->step, &mp);
    if (!st) {
        c->dense.hid = calloc((size_t)(U * ffdense), sizeof(float));
        c->dense.tmp = calloc((size_t)(U * max64(d, ffdense)), sizeof(float));
        c->out_tok = calloc((size_t)U, sizeof(int32_t));
        if (!c->dense.hid || !c->dense.tmp || !c->out_tok) st = moetax_error(MOETAX_ERR_NOMEM, "out of memory");
    }
    if (!st) st = fw_act_alloc(m, &c->dense.a_hid, ffdense, U, false);
    if (st) {
        moetax_ctx_free(c);
        return st;
    }
    *out = c;
    return MOETAX_OK;
}

void moetax_ctx_free(struct moetax_ctx *c) {
    if (!c) return;
    mla_free(&c->attn);
    gqa_free(&c->gqa);
    moe_free(&c->moe);
    fw_step_free(&c->step);
    free(c->dense.hid);
    free(c->dense.tmp);
    fw_act_free(&c->dense.a_hid, false);
    moetax_kvcache_free(c->kv);
    if (c->own_pool) moetax_pool_free(c->pool);
    free(c->out_tok);
    free(c->out_buf);
    free(c->out_row);
    free(c->eval_pos);
    free(c->eval_seq);
    free(c->eval_want);
    free(c->ep_tok); free(c->ep_pos); free(c->ep_seq); free(c->ep_src); free(c->ep_want); free(c->ep_logits);
    free(c->ep_ubn); free(c->ep_ub0);
    free(c);
}

void moetax_ctx_reset(struct moetax_ctx *c) { moetax_kvcache_clear(c->kv); }
int64_t moetax_ctx_pos(const struct moetax_ctx *c) { return moetax_kvcache_seq_len(c->kv, 0); }
int64_t moetax_ctx_seq_pos(const struct moetax_ctx *c, int32_t seq) { return moetax_kvcache_seq_len(c->kv, seq); }
int64_t moetax_ctx_n_ctx(const struct moetax_ctx *c) { return c->n_ctx; }
int moetax_ctx_n_threads(const struct moetax_ctx *c) { return c->n_threads; }
int moetax_ctx_n_expert_used(const struct moetax_ctx *c) { return c->n_expert_used; }
int64_t moetax_ctx_n_ubatch(const struct moetax_ctx *c) { return c->n_ubatch; }
struct moetax_kvcache *moetax_ctx_kv(struct moetax_ctx *c) { return c->kv; }
void moetax_ctx_set_ledger(struct moetax_ctx *c, struct moetax_ledger *l) { c->step.ledger = l; }
void moetax_ctx_test_delay(struct moetax_ctx *c, int ph, uint64_t ns) {
    c->step.delay_phase = (enum moetax_phase)ph;
    c->step.delay_ns = ns;
}
size_t moetax_ctx_kv_bytes(const struct moetax_ctx *c) { return moetax_kvcache_bytes(c->kv); }

/* ---- batches ------------------------------------------------------------------------ */

moetax_status moetax_batch_init(struct moetax_batch *b, int32_t capacity) {
    memset(b, 0, sizeof *b);
    if (capacity <= 0) return moetax_error(MOETAX_ERR_ARG, "batch capacity %d must be > 0", capacity);
    b->token = malloc(sizeof(int32_t) * (size_t)capacity);
    b->pos = malloc(sizeof(int32_t) * (size_t)capacity);
    b->seq = malloc(sizeof(int32_t) * (size_t)capacity);
    b->logits = malloc(sizeof(bool) * (size_t)capacity);
    if (!b->token || !b->pos || !b->seq || !b->logits) {
        moetax_batch_free(b);
        return moetax_error(MOETAX_ERR_NOMEM, "out of memory for a batch of %d tokens", capacity);
    }
    b->capacity = capacity;
    return MOETAX_OK;
}

void moetax_batch_free(struct moetax_batch *b) {
    free(b->token);
    free(b->pos);
    free(b->seq);
    free(b->logits);
    memset(b, 0, sizeof *b);
}

void moetax_batch_clear(struct moetax_batch *b) { b->n_tokens = 0; }

moetax_status moetax_batch_add(struct moetax_batch *b, int32_t token, int32_t pos, int32_t seq, bool logits) {
    if (b->n_tokens >= b->capacity)
        return moetax_error(MOETAX_ERR_LIMIT, "batch full: it holds %d tokens", b->capacity);
    b->token[b->n_tokens] = token;
    b->pos[b->n_tokens] = pos;
    b->seq[b->n_tokens] = seq;
    b->logits[b->n_tokens] = logits;
    b->n_tokens++;
    return MOETAX_OK;
}

/* Is this micro-batch decode: every sequence in it has one token? */
static bool one_per_sequence(const int32_t *seq, int64_t n) {
    for (int64_t i = 1; i < n; i++)
        for (int64_t j = 0; j < i; j++)
            if (seq[i] == seq[j]) return false;
    return true;
}

static int64_t n_sequences(const int32_t *seq, int64_t n) {
    int64_t k = 0;
    for (int64_t i = 0; i < n; i++) {
        bool seen = false;
        for (int64_t j = 0; j < i && !seen; j++) seen = seq[j] == seq[i];
        k += !seen;
    }
    return k;
}

static moetax_status decode_local(struct moetax_ctx *c, int64_t n, const int32_t *token, const int32_t *pos,
                                  const int32_t *seq, const bool *want, float *out, int64_t n_ub);

#ifdef MOETAX_WITH_MPI
/* Token-sharded dispatch: this rank's share of rank 0's batch (the sequences with
 * seq % P == rank) in as many micro-batches as the rank with the most tokens needs (a rank
 * with none in one still serves its experts), then every rank gets the logits of all. */
static moetax_status decode_sharded(struct moetax_ctx *c, int64_t n, const int32_t *token, const int32_t *pos,
                                    const int32_t *seq, const bool *want, float *out) {
    const int P = c->ep_size, me = c->ep_rank;
    const int64_t V = c->m->hp.n_vocab;
    if (n > c->ep_cap) {
        int32_t *t = realloc(c->ep_tok, sizeof(int32_t) * (size_t)n); if (t) c->ep_tok = t;
        int32_t *p = realloc(c->ep_pos, sizeof(int32_t) * (size_t)n); if (p) c->ep_pos = p;
        int32_t *q = realloc(c->ep_seq, sizeof(int32_t) * (size_t)n); if (q) c->ep_seq = q;
        int32_t *r = realloc(c->ep_src, sizeof(int32_t) * (size_t)n); if (r) c->ep_src = r;
        bool *w = realloc(c->ep_want, sizeof(bool) * (size_t)n); if (w) c->ep_want = w;
        if (!t || !p || !q || !r || !w) return moetax_error(MOETAX_ERR_NOMEM, "out of memory");
        c->ep_cap = n;
    }
    int n_tok[512] = {0}, n_rows[512] = {0};
    if (P > 512) return moetax_error(MOETAX_ERR_LIMIT, "%d ranks: token-sharded dispatch handles at most 512", P);
    int64_t nl = 0, n_want = 0;
    for (int64_t i = 0; i < n; i++) {
        const int r = (int)(((int64_t)seq[i] % P + P) % P);
        n_tok[r]++;
        if (want[i] && out) n_rows[r]++, n_want++;
        if (r != me) continue;
        c->ep_tok[nl] = token[i];
        c->ep_pos[nl] = pos[i];
        c->ep_seq[nl] = seq[i];
        c->ep_want[nl] = want[i];
        c->ep_src[nl++] = (int32_t)i;
    }
    /* the micro-batches: each rank's tokens in pieces of n_ubatch, as many as the rank with the
     * most needs; with a capacity factor the single process's instead (micro-batch j: every
     * rank's tokens among the batch's [j U, (j + 1) U)), so that the cap applies to the same
     * tokens (src/moe/moe.c, ep_global) */
    const int64_t U = c->n_ubatch;
    const bool aligned = c->moe.capacity_factor > 0 && isfinite(c->moe.capacity_factor);
    int64_t n_ub = 0;
    for (int r = 0; r < P; r++) {
        const int64_t u = (n_tok[r] + U - 1) / U;
        n_ub = u > n_ub ? u : n_ub;
    }
    if (aligned) n_ub = (n + U - 1) / U;
    if (n_ub + 1 > c->ep_ub_cap) {
        int32_t *a = realloc(c->ep_ubn, sizeof(int32_t) * (size_t)((n_ub + 1) * P)); if (a) c->ep_ubn = a;
        int64_t *b = realloc(c->ep_ub0, sizeof(int64_t) * (size_t)(n_ub + 1)); if (b) c->ep_ub0 = b;
        if (!a || !b) return moetax_error(MOETAX_ERR_NOMEM, "out of memory");
        c->ep_ub_cap = n_ub + 1;
    }
    memset(c->ep_ubn, 0, sizeof(int32_t) * (size_t)(n_ub * P));
    for (int64_t j = 0; j < n_ub; j++)
        for (int r = 0; r < P && !aligned; r++) {
            const int64_t left = n_tok[r] - j * U;
            c->ep_ubn[j * P + r] = (int32_t)(left <= 0 ? 0 : left < U ? left : U);
        }
    for (int64_t i = 0; aligned && i < n; i++) c->ep_ubn[(i / U) * P + (((int64_t)seq[i] % P + P) % P)]++;
    c->ep_ub0[0] = 0;
    for (int64_t j = 0; j < n_ub; j++) c->ep_ub0[j + 1] = c->ep_ub0[j] + c->ep_ubn[j * P + me];
    if (n_want > c->ep_logits_cap) {
        float *l = realloc(c->ep_logits, sizeof(float) * (size_t)(n_want * V));
        if (!l) return moetax_error(MOETAX_ERR_NOMEM, "out of memory for the logits of %lld tokens", (long long)n_want);
        c->ep_logits = l;
        c->ep_logits_cap = n_want;
    }
    int64_t first = 0; /* this rank's rows in ep_logits */
    for (int r = 0; r < me; r++) first += n_rows[r];
    moetax_status st = decode_local(c, nl, c->ep_tok, c->ep_pos, c->ep_seq, c->ep_want,
                                    out ? c->ep_logits + first * V : NULL, n_ub);
    if (st || !out || !n_want) return st;
    if ((st = moetax_dist_gather_logits(moetax_dist_world(), c->ep_logits, n_rows, V))) {
        moetax_kvcache_abort(c->kv); /* all or nothing, as decode_local's own errors */
        return st;
    }
    /* into the batch's order: entry i's row is its rank's next one */
    int64_t next[512], o = 0;
    for (int r = 0, acc = 0; r < P; r++) next[r] = acc, acc += n_rows[r];
    for (int64_t i = 0; i < n; i++)
        if (want[i]) {
            const int r = (int)(((int64_t)seq[i] % P + P) % P);
            memcpy(out + o++ * V, c->ep_logits + next[r]++ * V, sizeof(float) * (size_t)V);
        }
    return MOETAX_OK;
}
#endif

/* n tokens (token, pos, seq) in micro-batches; want[i]: logits of token i into the next
 * row of out. The cells of all n are reserved first (all or nothing). */
static moetax_status decode(struct moetax_ctx *c, int64_t n, const int32_t *token, const int32_t *pos,
                            const int32_t *seq, const bool *want, float *out) {
    const struct moetax_hparams *hp = &c->m->hp;
    if (n <= 0) return moetax_error(MOETAX_ERR_ARG, "no tokens to evaluate");
#ifdef MOETAX_WITH_MPI
    if (moetax_dist_world()) { /* every rank steps with rank 0's batch */
        moetax_status bst = moetax_dist_sync_batch(moetax_dist_world(), &n, &token, &pos, &seq, &want);
        if (bst) return bst;
    }
#endif
    for (int64_t i = 0; i < n; i++)
        if (token[i] < 0 || token[i] >= hp->n_vocab)
            return moetax_error(MOETAX_ERR_ARG, "token %lld: id %d is outside the vocabulary (0..%d)", (long long)i,
                                token[i], hp->n_vocab - 1);
#ifdef MOETAX_WITH_MPI
    if (c->ep) return decode_sharded(c, n, token, pos, seq, want, out);
#endif
    return decode_local(c, n, token, pos, seq, want, out, (n + c->n_ubatch - 1) / c->n_ubatch);
}

/* adapt_threads, before a micro-batch of nb tokens: the threads to run it on. Every `every`
 * steps of one shape, the next ADAPT_PROBE_STEPS steps of that shape probe the other count (all
 * threads, or half of them); steps of other shapes meanwhile run as before. */
static int adapt_pick(struct moetax_ctx *c, int64_t nb) {
    struct adapt *a = &c->adapt;
    int b = 0;
    while (b + 1 < ADAPT_BUCKETS && ((int64_t)2 << b) <= nb) b++;
    a->bucket = b;
    if (!a->probe && a->ema_ns[b] > 0 && ++a->since[b] >= a->every) {
        a->probe = a->cur == c->n_threads ? (c->n_threads + 1) / 2 : c->n_threads;
        a->probe_n = 0;
        a->probe_b = b;
        a->since[b] = 0;
        a->probes++;
    }
    a->probing = a->probe && b == a->probe_b;
    return a->probing ? a->probe : a->cur;
}

/* After it: a probe whose median step beat the smoothed time of the current count by a clear
 * margin (a busy machine makes the difference several-fold, noise rarely does three times)
 * becomes the count; a probe that lost doubles the period until the next one (at most every
 * 256 steps). */
static void adapt_done(struct moetax_ctx *c, uint64_t ns) {
    struct adapt *a = &c->adapt;
    double *e = &a->ema_ns[a->bucket];
    if (!a->probing) {
        *e = *e > 0 ? 0.75 * *e + 0.25 * (double)ns : (double)ns;
        return;
    }
    a->probe_ns[a->probe_n++] = (double)ns;
    if (a->probe_n < ADAPT_PROBE_STEPS) return;
    double *q = a->probe_ns, t = q[0] > q[1] ? (q[1] > q[2] ? q[1] : q[0] > q[2] ? q[2] : q[0])
                                             : (q[0] > q[2] ? q[0] : q[1] > q[2] ? q[2] : q[1]);
    if (t * 1.25 < *e || a->force) { /* the other buckets' times were at the old count */
        a->cur = a->probe;
        for (int b = 0; b < ADAPT_BUCKETS; b++) a->ema_ns[b] = 0;
        *e = t;
        a->every = 16;
        a->switches++;
    } else if (a->every < 256) {
        a->every *= 2;
    }
    a->probe = 0;
}

int moetax_ctx_threads_now(const struct moetax_ctx *c) { return c->adapt.on ? c->adapt.cur : c->n_threads; }

void moetax_ctx_adapt_stats(const struct moetax_ctx *c, int64_t *probes, int64_t *switches) {
    if (probes) *probes = c->adapt.probes;
    if (switches) *switches = c->adapt.switches;
}

/* decode's micro-batches: n_ub of them (token-sharded: possibly more than n needs, the
 * rest empty) */
static moetax_status decode_local(struct moetax_ctx *c, int64_t n, const int32_t *token, const int32_t *pos,
                                  const int32_t *seq, const bool *want, float *out, int64_t n_ub) {
    const struct moetax_hparams *hp = &c->m->hp;
    struct fw_step *s = &c->step;
    /* with no tokens (a rank's share of a sharded batch) too: it records the lengths an abort goes back to */
    moetax_status st = moetax_kvcache_reserve(c->kv, seq, pos, n);
    if (st) return st;
    /* the ledger books the batch's steps as decode where the batch has one token per sequence: a
     * prompt's micro-batch of one token (its last, after whole micro-batches) is prefill */
    const bool batch_dec = one_per_sequence(seq, n);
    int64_t row = 0;
    for (int64_t ub = 0; ub < n_ub; ub++) {
        int64_t i0 = ub * c->n_ubatch < n ? ub * c->n_ubatch : 0; /* past n: an empty micro-batch */
        int64_t nb = ub * c->n_ubatch >= n ? 0 : n - i0 < c->n_ubatch ? n - i0 : c->n_ubatch;
#ifdef MOETAX_WITH_MPI
        if (c->ep) { /* token-sharded: this micro-batch of every rank (decode_sharded) */
            i0 = c->ep_ub0[ub];
            nb = c->ep_ub0[ub + 1] - i0;
            s->ep_n = c->ep_ubn + ub * c->ep_size;
            s->gidx = c->ep_src + i0;
        }
#endif
        s->tokens = token + i0;
        s->pos = pos + i0;
        s->seq = seq + i0;
        s->n = nb;
        c->n_out = 0;
        for (int64_t t = 0; t < nb; t++)
            if (want[i0 + t]) c->out_tok[c->n_out++] = (int32_t)t;
        c->logits = out && c->n_out ? out + row * hp->n_vocab : NULL;
        moetax_pool_chunk_reset(c->pool, 0, 0);
        moetax_pool_chunk_reset(c->pool, 1, 0);
        fw_rows_reset(s, 0);
        fw_rows_reset(s, 1);
        const bool dec = one_per_sequence(s->seq, nb);
        s->one_per_seq = dec;
        moetax_ledger_step_begin(s->ledger, nb, nb ? s->pos[0] : 0, !(dec && batch_dec));
        moetax_ledger_step_batch(s->ledger, n_sequences(s->seq, nb));
        atomic_store(&s->err_status, 0);
        atomic_store_explicit(&c->logits_bad, 0, memory_order_relaxed);
        if (c->adapt.on) {
            const int na = adapt_pick(c, nb);
            const uint64_t t0 = moetax_pool_now_ns();
            moetax_pool_run_n(c->pool, na, step_worker, c);
            adapt_done(c, moetax_pool_now_ns() - t0);
        } else {
            moetax_pool_run(c->pool, step_worker, c);
        }
        moetax_ledger_step_end(s->ledger);
        int err = atomic_load(&s->err_status);
        if (err) { /* the step's results are not valid: the batch's positions are not added, not even
                    * its earlier micro-batches' (all or nothing, as its reservation) */
            moetax_kvcache_abort(c->kv);
            return moetax_error((moetax_status)err, "%s", s->err_msg);
        }
        if (nb) moetax_kvcache_commit(c->kv, s->seq, s->pos, nb);
        c->sel_n = nb;
        /* a broken model (NaN/inf weights or activations) is an error, not a result: the first
         * bad logit, in order */
        if (c->logits && atomic_load_explicit(&c->logits_bad, memory_order_relaxed)) {
            for (int64_t o = 0; o < c->n_out; o++) {
                const float *lr = c->logits + o * hp->n_vocab;
                for (int64_t v = 0; v < hp->n_vocab; v++)
                    if (!isfinite(lr[v])) {
                        const int64_t t = c->out_tok[o];
                        moetax_kvcache_abort(c->kv); /* the batch fails whole: none of its positions stay */
                        return moetax_error(MOETAX_ERR_NUMERIC,
                                            "logits of token %lld (sequence %d, position %d) are not finite: logit %lld "
                                            "is %g (a model with NaN or inf weights?)",
                                            (long long)(i0 + t), s->seq[t], s->pos[t], (long long)v, (double)lr[v]);
                    }
            }
        }
        row += c->n_out;
    }
    return MOETAX_OK;
}

moetax_status moetax_ctx_decode(struct moetax_ctx *c, const struct moetax_batch *b) {
    const int64_t n = b->n_tokens, V = c->m->hp.n_vocab;
    int64_t n_out = 0;
    for (int64_t i = 0; i < n; i++) n_out += b->logits[i];
    if (n > c->out_row_cap) {
        int32_t *r = realloc(c->out_row, sizeof(int32_t) * (size_t)n);
        if (!r) return moetax_error(MOETAX_ERR_NOMEM, "out of memory");
        c->out_row = r;
        c->out_row_cap = n;
    }
    if (n_out > c->out_cap) {
        float *o = realloc(c->out_buf, sizeof(float) * (size_t)(n_out * V));
        if (!o) return moetax_error(MOETAX_ERR_NOMEM, "out of memory for the logits of %lld tokens", (long long)n_out);
        c->out_buf = o;
        c->out_cap = n_out;
    }
    c->n_entries = 0;
    moetax_status st = decode(c, n, b->token, b->pos, b->seq, b->logits, c->out_buf);
    if (st) return st;
    int32_t r = 0;
    for (int64_t i = 0; i < n; i++) c->out_row[i] = b->logits[i] ? r++ : -1;
    c->n_entries = n;
    return MOETAX_OK;
}

const float *moetax_ctx_logits_ith(const struct moetax_ctx *c, int32_t i) {
    if (i < 0 || i >= c->n_entries || c->out_row[i] < 0) return NULL;
    return c->out_buf + (int64_t)c->out_row[i] * c->m->hp.n_vocab;
}

moetax_status moetax_ctx_eval(struct moetax_ctx *c, const int32_t *tokens, int64_t n, float *logits, bool all_logits) {
    const int64_t pos = moetax_kvcache_seq_len(c->kv, 0);
    if (n <= 0) return moetax_error(MOETAX_ERR_ARG, "no tokens to evaluate");
    if (n > c->n_ctx - pos)
        return moetax_error(MOETAX_ERR_LIMIT,
                            "%lld more tokens at position %lld would exceed the context size of %lld positions (the KV cache); "
                            "raise it with --ctx",
                            (long long)n, (long long)pos, (long long)c->n_ctx);
    if (n > c->eval_cap) {
        int32_t *p = realloc(c->eval_pos, sizeof(int32_t) * (size_t)n);
        if (p) c->eval_pos = p;
        int32_t *q = realloc(c->eval_seq, sizeof(int32_t) * (size_t)n);
        if (q) c->eval_seq = q;
        bool *w = realloc(c->eval_want, sizeof(bool) * (size_t)n);
        if (w) c->eval_want = w;
        if (!p || !q || !w) return moetax_error(MOETAX_ERR_NOMEM, "out of memory");
        c->eval_cap = n;
    }
    for (int64_t i = 0; i < n; i++) {
        c->eval_pos[i] = (int32_t)(pos + i);
        c->eval_seq[i] = 0;
        c->eval_want[i] = logits && (all_logits || i == n - 1);
    }
    return decode(c, n, tokens, c->eval_pos, c->eval_seq, c->eval_want, logits);
}

const int32_t *moetax_ctx_routing(const struct moetax_ctx *c, int layer, const float **weights, int64_t *n_tokens) {
    const struct moetax_hparams *hp = &c->m->hp;
    if (layer < 0 || layer >= hp->n_layer || !c->m->layers[layer].is_moe) return NULL;
    int64_t off = (int64_t)layer * c->n_ubatch * c->n_expert_used;
    if (weights) *weights = c->moe.selw + off;
    if (n_tokens) *n_tokens = c->sel_n;
    return c->moe.sel + off;
}
