/*
 * forward.c - the inference context and the step scheduler.
 *
 * One moetax_pool_run per micro-batch: every worker walks the same phases
 * (embedding, then per layer attention and FFN/MoE, then the head), splitting
 * each phase's work by (ith, nth) or by the pool's atomic chunk counters, with
 * a barrier between phases. Phases rotate over the pool's chunk counters: at
 * the start of phase p worker 0 resets the counter of phase p+1, and the
 * barrier ending phase p publishes it.
 *
 * Barriers per layer for one decoded token: attention 6 (8 with q_lora), FFN
 * norm 1, then MoE 5 (6 for a batch: the gather) or dense 3. Plus 1 for the
 * embedding and 2 for the head per step.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "model/forward_impl.h"
#include "moetax/store.h"

/* ---- phases ------------------------------------------------------------------- */

/* test hook: spin for delay_ns whenever a worker enters the delayed phase */
static void test_delay(const struct moetax_ctx *c, enum moetax_phase ph) {
    if (c->delay_ns && ph == c->delay_phase) {
        uint64_t t = moetax_ledger_now();
        while (moetax_ledger_now() - t < c->delay_ns) {
        }
    }
}

void fw_phase_begin(struct worker *w, enum moetax_phase ph, int layer) {
    w->phase++;
    if (w->ith == 0) moetax_pool_chunk_reset(w->c->pool, (w->phase + 1) % MOETAX_POOL_N_CHUNK_COUNTERS, 0);
    w->lph = ph;
    w->layer = layer;
    if (w->ledger) w->t0 = moetax_ledger_now();
    test_delay(w->c, ph);
}

void fw_mark(struct worker *w, enum moetax_phase ph) {
    if (ph == w->lph) return;
    if (w->ledger) {
        uint64_t t = moetax_ledger_now();
        moetax_ledger_span(w->ledger, w->ith, w->lph, w->layer, w->t0, t);
        w->t0 = t;
    }
    w->lph = ph;
    test_delay(w->c, ph);
}

void fw_phase_end(struct worker *w) {
    if (!w->ledger) {
        moetax_pool_barrier(w->c->pool, w->ith);
        return;
    }
    uint64_t t = moetax_ledger_now();
    moetax_ledger_span(w->ledger, w->ith, w->lph, w->layer, w->t0, t);
    moetax_pool_barrier(w->c->pool, w->ith);
    uint64_t t2 = moetax_ledger_now();
    moetax_ledger_span(w->ledger, w->ith, MOETAX_PHASE_WAIT, w->layer, t, t2);
}

int64_t fw_chunk(struct worker *w, int64_t n, int64_t step) {
    int64_t i = moetax_pool_chunk_next(w->c->pool, w->phase % MOETAX_POOL_N_CHUNK_COUNTERS, step);
    return i < n ? i : -1;
}

bool fw_rows(struct worker *w, int64_t n, int64_t block, int64_t *r0, int64_t *r1) {
    int64_t b = fw_chunk(w, (n + block - 1) / block, 1);
    if (b < 0) return false;
    *r0 = b * block;
    *r1 = *r0 + block < n ? *r0 + block : n;
    return true;
}

void fw_split(const struct worker *w, int64_t n, int64_t align, int64_t *r0, int64_t *r1) {
    int64_t blocks = (n + align - 1) / align;
    int64_t b0 = blocks * w->ith / w->nth, b1 = blocks * (w->ith + 1) / w->nth;
    *r0 = b0 * align < n ? b0 * align : n;
    *r1 = b1 * align < n ? b1 * align : n;
}

/* ---- activations and matmul ---------------------------------------------------- */

struct act fw_act_view(const struct act *slot, const float *x, int64_t ncols, int64_t n) {
    return (struct act){.x = x, .ncols = ncols, .n = n, .q8 = slot->q8, .q4 = slot->q4, .cap_q8 = slot->cap_q8,
                        .cap_q4 = slot->cap_q4};
}

void fw_act_publish(const struct worker *w, struct act *slot, const struct act *view) {
    if (w->ith != 0) return;
    if (slot->x != view->x) slot->x = view->x; /* unchanged fields are not rewritten: others may read them */
    slot->ncols = view->ncols;
    slot->n = view->n;
}

void fw_act_prep(const struct moetax_ctx *c, struct act *a, int64_t t0, int64_t t1) {
    if (t1 <= t0) return;
    const struct moetax_model *m = c->m;
    if (m->has_q8_0 && a->ncols % 32 == 0) {
        size_t rb = moetax_act_size(MOETAX_TYPE_Q8_0, a->ncols, 1);
        c->K->quantize_act(MOETAX_TYPE_Q8_0, a->x + t0 * a->ncols, a->ncols, a->ncols, t1 - t0,
                           (char *)a->q8 + (size_t)t0 * rb);
    }
    if (m->has_q4_0 && a->ncols % 32 == 0) {
        size_t rb = moetax_act_size(MOETAX_TYPE_Q4_0, a->ncols, 1);
        c->K->quantize_act(MOETAX_TYPE_Q4_0, a->x + t0 * a->ncols, a->ncols, a->ncols, t1 - t0,
                           (char *)a->q4 + (size_t)t0 * rb);
    }
}

const struct act *fw_own_row(struct worker *w, const float *x, int64_t ncols, const float *norm_w) {
    struct moetax_ctx *c = w->c;
    struct scratch *s = &c->scr[w->ith];
    if (norm_w) {
        c->K->rmsnorm(s->own_x, x, norm_w, ncols, c->m->hp.rms_eps);
        x = s->own_x;
    }
    s->own_in.x = x;
    s->own_in.ncols = ncols;
    s->own_in.n = 1;
    fw_act_prep(c, &s->own_in, 0, 1);
    return &s->own_in;
}

/* This worker's share of rows [t_first, n) of src [n, ncols]: normalised with weight into
 * dst (may be src) and prepared in the shared slot c->a_in, which describes all n rows. */
static void norm_rows(struct worker *w, float *dst, const float *src, const float *weight, int64_t ncols,
                      int64_t t_first) {
    struct moetax_ctx *c = w->c;
    int64_t r0, r1;
    fw_split(w, c->n - t_first, 1, &r0, &r1);
    r0 += t_first;
    r1 += t_first;
    for (int64_t t = r0; t < r1; t++) c->K->rmsnorm(dst + t * ncols, src + t * ncols, weight, ncols, c->m->hp.rms_eps);
    struct act v = fw_act_view(&c->a_in, dst, ncols, c->n);
    fw_act_publish(w, &c->a_in, &v);
    fw_act_prep(c, &v, r0, r1);
}

const struct act *fw_norm_input(struct worker *w, enum moetax_phase ph, enum moetax_phase next, int layer, float *dst,
                                const float *src, const float *weight, int64_t ncols) {
    fw_phase_begin(w, ph, layer);
    if (w->c->n == 1) {
        const struct act *a = fw_own_row(w, src, ncols, weight);
        fw_mark(w, next);
        return a;
    }
    norm_rows(w, dst, src, weight, ncols, 0);
    fw_phase_end(w);
    fw_phase_begin(w, next, layer);
    return &w->c->a_in;
}

const struct act *fw_own_eh(struct worker *w, int64_t k) {
    struct moetax_ctx *c = w->c;
    struct scratch *s = &c->scr[w->ith];
    s->own_eh.x = c->eh;
    s->own_eh.ncols = c->m->hp.n_ff_exp;
    s->own_eh.n = k;
    fw_act_prep(c, &s->own_eh, 0, k);
    return &s->own_eh;
}

const void *fw_act_for(const struct act *a, enum moetax_type t) {
    if (t == MOETAX_TYPE_Q8_0) return a->q8;
    if (t == MOETAX_TYPE_Q4_0) return a->q4;
    return a->x;
}

void fw_matmul_rel(const struct moetax_ctx *c, const struct moetax_weight *w, int64_t mat, int64_t r0, int64_t r1,
                   const struct act *a, int64_t b0, int64_t n, float *y, int64_t ldy) {
    if (r1 <= r0 || n <= 0) return;
    const char *wp = (const char *)w->data + (size_t)mat * w->mat_bytes + (size_t)r0 * w->row_bytes;
    const char *xq = fw_act_for(a, w->type);
    xq += (size_t)b0 * moetax_act_size(w->type, w->ne[0], 1);
    c->K->matmul(w->type, wp, w->row_bytes, 0, r1 - r0, w->ne[0], xq, n, y, ldy);
}

void fw_matmul_at(const struct moetax_ctx *c, const struct moetax_weight *w, const void *mat, int64_t r0, int64_t r1,
                  const struct act *a, int64_t b0, int64_t n, float *y, int64_t ldy) {
    if (r1 <= r0 || n <= 0) return;
    const char *wp = (const char *)mat + (size_t)r0 * w->row_bytes;
    const char *xq = fw_act_for(a, w->type);
    xq += (size_t)b0 * moetax_act_size(w->type, w->ne[0], 1);
    c->K->matmul(w->type, wp, w->row_bytes, 0, r1 - r0, w->ne[0], xq, n, y + r0, ldy);
}

void fw_fail(struct moetax_ctx *c, moetax_status st) {
    int expected = 0;
    if (atomic_compare_exchange_strong(&c->err_status, &expected, (int)st))
        snprintf(c->err_msg, sizeof c->err_msg, "%s", moetax_last_error());
}

void fw_matmul(const struct moetax_ctx *c, const struct moetax_weight *w, int64_t mat, int64_t r0, int64_t r1,
               const struct act *a, int64_t b0, int64_t n, float *y, int64_t ldy) {
    fw_matmul_rel(c, w, mat, r0, r1, a, b0, n, y + r0, ldy);
}

/* ---- the step ---------------------------------------------------------------------- */

static void dense_ffn(struct worker *w, const struct moetax_layer *l, int il) {
    struct moetax_ctx *c = w->c;
    const int64_t n = c->n, d = c->m->hp.n_embd, ff = l->ffn_gate.ne[1];
    int64_t r0, r1;
    /* decode: each worker normalises and prepares the row itself (see fw_own_row) */
    fw_phase_begin(w, n == 1 ? MOETAX_PHASE_NORM : MOETAX_PHASE_DENSE, il);
    const struct act *ain = n == 1 ? fw_own_row(w, c->x, d, l->ffn_norm) : &c->a_in;
    fw_mark(w, MOETAX_PHASE_DENSE);
    while (fw_rows(w, ff, 64, &r0, &r1)) {
        fw_matmul(c, &l->ffn_gate, 0, r0, r1, ain, 0, n, c->hid, ff);
        fw_matmul(c, &l->ffn_up, 0, r0, r1, ain, 0, n, c->tmp, ff);
        for (int64_t t = 0; t < n; t++)
            c->K->silu_mul(c->hid + t * ff + r0, c->hid + t * ff + r0, c->tmp + t * ff + r0, r1 - r0);
    }
    fw_phase_end(w);
    fw_phase_begin(w, MOETAX_PHASE_DENSE, il);
    struct act ah = fw_act_view(&c->a_hid, c->hid, ff, n);
    fw_act_publish(w, &c->a_hid, &ah);
    fw_split(w, n, 1, &r0, &r1);
    fw_act_prep(c, &ah, r0, r1);
    fw_phase_end(w);
    fw_phase_begin(w, MOETAX_PHASE_DENSE, il);
    while (fw_rows(w, d, 64, &r0, &r1)) {
        fw_matmul(c, &l->ffn_down, 0, r0, r1, &c->a_hid, 0, n, c->tmp, d);
        for (int64_t t = 0; t < n; t++)
            for (int64_t r = r0; r < r1; r++) c->x[t * d + r] += c->tmp[t * d + r];
    }
    fw_phase_end(w);
}

/* normalise rows of x with `weight` into xn and prepare them in a_in */
static void norm_prep(struct worker *w, const float *weight, int64_t t_first, enum moetax_phase ph, int layer) {
    struct moetax_ctx *c = w->c;
    fw_phase_begin(w, ph, layer);
    norm_rows(w, c->xn, c->x, weight, c->m->hp.n_embd, t_first);
    fw_phase_end(w);
}

static void step_worker(void *ctx, int ith, int nth) {
    struct moetax_ctx *c = ctx;
    const struct moetax_model *m = c->m;
    const struct moetax_hparams *hp = &m->hp;
    struct worker w = {.c = c, .ith = ith, .nth = nth, .phase = 0,
                       .ledger = moetax_ledger_enabled(c->ledger) ? c->ledger : NULL};
    const int64_t n = c->n, d = hp->n_embd, rope = hp->n_embd_head_qk_rope;
    int64_t r0, r1;

    if (ith == 0) memset(c->pred_ok, 0, sizeof(bool) * (size_t)hp->n_layer);
    /* embedding rows and each position's rope cos/sin */
    fw_phase_begin(&w, MOETAX_PHASE_EMBD, -1);
    fw_split(&w, n, 1, &r0, &r1);
    struct moetax_rope_params rp = {
        .n_dims = (int)rope, .mode = MOETAX_ROPE_MODE_NORM, .n_ctx_orig = hp->rope_n_ctx_orig,
        .freq_base = hp->rope_freq_base, .freq_scale = hp->rope_freq_scale, .ext_factor = hp->rope_ext_factor,
        .attn_factor = hp->rope_attn_factor, .beta_fast = hp->rope_beta_fast, .beta_slow = hp->rope_beta_slow,
    };
    for (int64_t t = r0; t < r1; t++) {
        const struct moetax_weight *te = &m->tok_embd;
        moetax_to_float(te->type, (const char *)te->data + (size_t)c->tokens[t] * te->row_bytes, c->x + t * d, d);
        moetax_rope_cache(&rp, c->pos0 + t, c->ropecs + t * rope);
    }
    fw_phase_end(&w);

    for (int il = 0; il < hp->n_layer; il++) {
        const struct moetax_layer *l = &m->layers[il];
        fw_attention(&w, il);
        if (n > 1) norm_prep(&w, l->ffn_norm, 0, MOETAX_PHASE_NORM, il); /* decode: in the FFN's first phase */
        if (l->is_moe) fw_moe(&w, il);
        else dense_ffn(&w, l, il);
    }

    if (!c->logits) return;
    /* head: final norm of the rows that need logits, then the output matrix */
    int64_t t_first = c->all_logits ? 0 : n - 1;
    const struct act *ah = &c->a_in;
    int64_t b0 = t_first;
    if (n - t_first > 1) {
        norm_prep(&w, m->output_norm, t_first, MOETAX_PHASE_HEAD, -1);
        fw_phase_begin(&w, MOETAX_PHASE_HEAD, -1);
    } else { /* one row: each worker normalises and prepares it itself (see fw_own_row) */
        fw_phase_begin(&w, MOETAX_PHASE_HEAD, -1);
        ah = fw_own_row(&w, c->x + t_first * d, d, m->output_norm);
        b0 = 0;
    }
    while (fw_rows(&w, hp->n_vocab, 256, &r0, &r1))
        fw_matmul(c, &m->output, 0, r0, r1, ah, b0, n - t_first, c->logits, hp->n_vocab);
    fw_phase_end(&w);
}

/* ---- context --------------------------------------------------------------------- */

static int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }
static int64_t up32(int64_t a) { return (a + 31) / 32 * 32; }

static moetax_status act_alloc(struct moetax_ctx *c, struct act *a, int64_t ncols, int64_t rows, bool own_x) {
    size_t b8 = moetax_act_size(MOETAX_TYPE_Q8_0, up32(ncols), rows);
    size_t b4 = moetax_act_size(MOETAX_TYPE_Q4_0, up32(ncols), rows);
    a->q8 = c->m->has_q8_0 ? aligned_alloc(64, (b8 + 63) / 64 * 64) : NULL;
    a->q4 = c->m->has_q4_0 ? aligned_alloc(64, (b4 + 63) / 64 * 64) : NULL;
    a->cap_q8 = b8;
    a->cap_q4 = b4;
    if (own_x) a->x = calloc((size_t)(ncols * rows), sizeof(float));
    if ((c->m->has_q8_0 && !a->q8) || (c->m->has_q4_0 && !a->q4) || (own_x && !a->x))
        return moetax_error(MOETAX_ERR_NOMEM, "out of memory for activations");
    return MOETAX_OK;
}

static void act_free(struct act *a, bool own_x) {
    free(a->q8);
    free(a->q4);
    if (own_x) free((void *)a->x);
}

moetax_status moetax_ctx_init(const struct moetax_model *m, const struct moetax_ctx_params *p,
                              struct moetax_ctx **out) {
    *out = NULL;
    const struct moetax_hparams *hp = &m->hp;
    struct moetax_ctx *c = calloc(1, sizeof *c);
    if (!c) return moetax_error(MOETAX_ERR_NOMEM, "out of memory");
    c->m = m;
    c->K = moetax_kernels_get();
    c->n_ctx = p && p->n_ctx > 0 ? p->n_ctx : (hp->n_ctx_train < 4096 ? hp->n_ctx_train : 4096);
    c->n_ubatch = p && p->n_ubatch > 0 ? p->n_ubatch : 64;
    if (c->n_ubatch > c->n_ctx) c->n_ubatch = c->n_ctx;
    moetax_status st = MOETAX_OK;
    if (c->n_ctx > (1 << 24)) {
        st = moetax_error(MOETAX_ERR_ARG, "context size %lld is too large (max %d)", (long long)c->n_ctx, 1 << 24);
        free(c);
        return st;
    }
    c->store = p ? p->store : NULL;
    c->prefetch = c->store && !(p && p->no_prefetch);
    const int32_t k_req = p ? p->n_expert_used : 0;
    if ((st = moetax_model_check_experts_used(m, k_req))) {
        free(c);
        return st;
    }
    c->n_expert_used = k_req ? k_req : hp->n_expert_used;
    if (c->store && hp->n_expert > 0) { /* every expert one layer uses for a micro-batch is pinned at once */
        const int64_t need = c->n_ubatch * c->n_expert_used < hp->n_expert ? c->n_ubatch * c->n_expert_used
                                                                             : hp->n_expert;
        if (moetax_store_n_slots(c->store) < need) {
            st = moetax_error(MOETAX_ERR_ARG,
                              "the expert store holds %d experts, but a micro-batch of %lld tokens with %d experts "
                              "each pins up to %lld: open it with this n_ubatch and n_expert_used",
                              moetax_store_n_slots(c->store), (long long)c->n_ubatch, c->n_expert_used,
                              (long long)need);
            free(c);
            return st;
        }
    }
    /* without a store the experts are read where the model holds them: repacked once if the
     * kernels read their type repacked, else the mapping (prefaulted) */
    if (!c->store && (st = moetax_model_prepare_experts(m))) {
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
    const int64_t U = c->n_ubatch, d = hp->n_embd, H = hp->n_head, nope = hp->n_embd_head_qk_nope;
    const int64_t rope = hp->n_embd_head_qk_rope, vh = hp->n_embd_head_v, kvl = hp->kv_lora_rank;
    const int64_t ql = hp->q_lora_rank, k = hp->n_expert ? c->n_expert_used : 1, E = hp->n_expert;
    const int64_t F = hp->n_ff_exp, Fs = (int64_t)hp->n_expert_shared * hp->n_ff_exp;
    int64_t ffmax = max64(max64(hp->n_ff, Fs), 1);
    for (int il = 0; il < hp->n_layer; il++) ffmax = max64(ffmax, m->layers[il].ffn_gate.ne[1]);
    const int64_t incols = max64(max64(d, ql), H * vh);
    c->kv_row = kvl + rope;
    size_t kvn = (size_t)hp->n_layer * (size_t)c->n_ctx * (size_t)c->kv_row;
    c->kv = malloc(kvn * sizeof(float));
#define A(ptr, count) do { size_t cnt_ = (size_t)(count); \
    if (!st && !((ptr) = calloc(cnt_ ? cnt_ : 1, sizeof *(ptr)))) st = moetax_error(MOETAX_ERR_NOMEM, "out of memory"); } while (0)
    if (!c->kv) st = moetax_error(MOETAX_ERR_NOMEM, "out of memory for a KV cache of %.1f MiB (%lld positions); lower --ctx",
                                  (double)kvn * 4 / (1 << 20), (long long)c->n_ctx);
    A(c->x, U * d);
    A(c->xn, U * max64(d, ql));
    A(c->qa, U * max64(ql, 1));
    A(c->q, U * H * (nope + rope));
    A(c->kva, U * c->kv_row);
    A(c->qabs, U * H * c->kv_row);
    A(c->attv, U * H * vh);
    A(c->oatt, U * H * kvl);
    A(c->tmp, U * max64(d, ffmax));
    A(c->hid, U * ffmax);
    A(c->router, U * max64(E, 1));
    A(c->ropecs, U * rope);
    A(c->eh, U * k * max64(F, 1));
    A(c->eh_g, U * k * max64(F, 1));
    A(c->sel, (int64_t)hp->n_layer * U * k);
    A(c->selw, (int64_t)hp->n_layer * U * k);
    A(c->plan.active, max64(E, 1));
    A(c->plan.count, max64(E, 1));
    A(c->plan.offset, max64(E, 1));
    A(c->plan.slot_token, U * k);
    A(c->plan.slot_w, U * k);
    A(c->scr, c->n_threads);
    A(c->pred, (int64_t)hp->n_layer * U * k);
    A(c->pred_ok, hp->n_layer);
    A(c->hist_n, hp->n_layer);
    A(c->plan.fill, max64(E, 1));
    A(c->ydown, U * k * d);
    A(c->pred_x, d);
    A(c->pred_logits, max64(E, 1));
    A(c->pred_p, 2 * max64(E, 1));
    if (!st && !(c->pred_q = aligned_alloc(64, (moetax_act_size(MOETAX_TYPE_Q4_0, up32(d), 1) + 63) / 64 * 64)))
        st = moetax_error(MOETAX_ERR_NOMEM, "out of memory");
    if (!st) st = act_alloc(c, &c->a_in, incols, U, false);
    if (!st) st = act_alloc(c, &c->a_hid, ffmax, U, false);
    if (!st) st = act_alloc(c, &c->a_exp, d, U * k, true);
    if (!st) st = act_alloc(c, &c->a_eh, max64(F, 1), U * k, false);
    for (int i = 0; !st && i < c->n_threads; i++) {
        struct scratch *s = &c->scr[i];
        s->nf = (size_t)max64(max64(H * (c->n_ctx + kvl), 2 * E + 2),
                              max64(max64(U * k, U) * 64 + nope, U * max64(nope, kvl)));
        s->nq = moetax_act_size(MOETAX_TYPE_Q4_0, up32(max64(nope, kvl)), U) + 64;
        s->f = calloc(s->nf, sizeof(float));
        s->eptr = calloc((size_t)max64(E, 1), sizeof *s->eptr);
        s->acq = calloc((size_t)max64(E, 1), 1);
        s->acq_list = calloc((size_t)max64(E, 1), sizeof(int32_t));
        if (!s->eptr || !s->acq || !s->acq_list) st = moetax_error(MOETAX_ERR_NOMEM, "out of memory");
        s->q = aligned_alloc(64, (s->nq + 63) / 64 * 64);
        if (!s->f || !s->q) st = moetax_error(MOETAX_ERR_NOMEM, "out of memory");
        if (!st) st = act_alloc(c, &s->own_in, max64(incols, ffmax), 1, false);
        if (!st) st = act_alloc(c, &s->own_eh, max64(F, 1), k, false);
        if (!st && !(s->own_x = calloc((size_t)max64(incols, ffmax), sizeof(float))))
            st = moetax_error(MOETAX_ERR_NOMEM, "out of memory");
        A(s->sel, k);
        A(s->selw, k);
        A(s->plan.active, max64(E, 1));
        A(s->plan.count, max64(E, 1));
        A(s->plan.offset, max64(E, 1));
        A(s->plan.fill, max64(E, 1));
        A(s->plan.slot_token, k);
        A(s->plan.slot_w, k);
    }
#undef A
    if (st) {
        moetax_ctx_free(c);
        return st;
    }
    *out = c;
    return MOETAX_OK;
}

void moetax_ctx_free(struct moetax_ctx *c) {
    if (!c) return;
    if (c->own_pool) moetax_pool_free(c->pool);
    free(c->kv);
    free(c->x); free(c->xn); free(c->qa); free(c->q); free(c->kva); free(c->qabs); free(c->attv); free(c->oatt);
    free(c->tmp); free(c->hid); free(c->router); free(c->ropecs); free(c->eh); free(c->eh_g);
    free(c->sel); free(c->selw); free(c->pred); free(c->pred_ok); free(c->hist_n);
    free(c->plan.fill); free(c->ydown); free(c->pred_x); free(c->pred_logits); free(c->pred_p); free(c->pred_q);
    free(c->plan.active); free(c->plan.count); free(c->plan.offset); free(c->plan.slot_token); free(c->plan.slot_w);
    act_free(&c->a_in, false);
    act_free(&c->a_hid, false);
    act_free(&c->a_exp, true);
    act_free(&c->a_eh, false);
    if (c->scr)
        for (int i = 0; i < c->n_threads; i++) {
            free(c->scr[i].f); free(c->scr[i].q); free(c->scr[i].eptr); free(c->scr[i].acq); free(c->scr[i].acq_list);
            act_free(&c->scr[i].own_in, false);
            act_free(&c->scr[i].own_eh, false);
            free(c->scr[i].own_x);
            struct scratch *s = &c->scr[i];
            free(s->sel); free(s->selw); free(s->plan.active); free(s->plan.count); free(s->plan.offset);
            free(s->plan.fill); free(s->plan.slot_token); free(s->plan.slot_w);
        }
    free(c->scr);
    free(c);
}

void moetax_ctx_reset(struct moetax_ctx *c) { c->pos = 0; }
int64_t moetax_ctx_pos(const struct moetax_ctx *c) { return c->pos; }
int64_t moetax_ctx_n_ctx(const struct moetax_ctx *c) { return c->n_ctx; }
int moetax_ctx_n_threads(const struct moetax_ctx *c) { return c->n_threads; }
int moetax_ctx_n_expert_used(const struct moetax_ctx *c) { return c->n_expert_used; }
void moetax_ctx_set_ledger(struct moetax_ctx *c, struct moetax_ledger *l) { c->ledger = l; }
void moetax_ctx_test_delay(struct moetax_ctx *c, int ph, uint64_t ns) {
    c->delay_phase = (enum moetax_phase)ph;
    c->delay_ns = ns;
}
size_t moetax_ctx_kv_bytes(const struct moetax_ctx *c) {
    return (size_t)c->m->hp.n_layer * (size_t)c->n_ctx * (size_t)c->kv_row * sizeof(float);
}

moetax_status moetax_ctx_eval(struct moetax_ctx *c, const int32_t *tokens, int64_t n, float *logits, bool all_logits) {
    const struct moetax_hparams *hp = &c->m->hp;
    if (n <= 0) return moetax_error(MOETAX_ERR_ARG, "no tokens to evaluate");
    if (n > c->n_ctx - c->pos)
        return moetax_error(MOETAX_ERR_LIMIT,
                            "%lld more tokens at position %lld would exceed the context size of %lld positions (the KV cache); "
                            "raise it with --ctx",
                            (long long)n, (long long)c->pos, (long long)c->n_ctx);
    for (int64_t i = 0; i < n; i++)
        if (tokens[i] < 0 || tokens[i] >= hp->n_vocab)
            return moetax_error(MOETAX_ERR_ARG, "token %lld: id %d is outside the vocabulary (0..%d)", (long long)i,
                                tokens[i], hp->n_vocab - 1);
    for (int64_t i0 = 0; i0 < n; i0 += c->n_ubatch) {
        int64_t nb = n - i0 < c->n_ubatch ? n - i0 : c->n_ubatch;
        bool last = i0 + nb == n;
        c->tokens = tokens + i0;
        c->n = nb;
        c->pos0 = c->pos;
        c->all_logits = all_logits;
        c->logits = logits && all_logits ? logits + i0 * hp->n_vocab : logits && last ? logits : NULL;
        moetax_pool_chunk_reset(c->pool, 0, 0);
        moetax_pool_chunk_reset(c->pool, 1, 0);
        moetax_ledger_step_begin(c->ledger, nb, c->pos, n > 1);
        atomic_store(&c->err_status, 0);
        moetax_pool_run(c->pool, step_worker, c);
        moetax_ledger_step_end(c->ledger);
        int err = atomic_load(&c->err_status);
        if (err) /* the step's results are not valid: the position does not advance */
            return moetax_error((moetax_status)err, "%s", c->err_msg);
        c->pos += nb;
        c->sel_n = nb;
    }
    return MOETAX_OK;
}

const int32_t *moetax_ctx_routing(const struct moetax_ctx *c, int layer, const float **weights, int64_t *n_tokens) {
    const struct moetax_hparams *hp = &c->m->hp;
    if (layer < 0 || layer >= hp->n_layer || !c->m->layers[layer].is_moe) return NULL;
    int64_t off = (int64_t)layer * c->n_ubatch * c->n_expert_used;
    if (weights) *weights = c->selw + off;
    if (n_tokens) *n_tokens = c->sel_n;
    return c->sel + off;
}
