/*
 * step.c - the phases of a step and the helpers every stage uses (see step.h).
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "model/step.h"

/* ---- phases ------------------------------------------------------------------- */

/* test hook: spin for delay_ns whenever a worker enters the delayed phase */
static void test_delay(const struct fw_step *s, enum moetax_phase ph) {
    if (s->delay_ns && ph == s->delay_phase) {
        uint64_t t = moetax_ledger_now();
        while (moetax_ledger_now() - t < s->delay_ns) {
        }
    }
}

void fw_rows_reset(struct fw_step *s, int counter) {
    for (int i = 0; i < s->n_threads; i++)
        atomic_store_explicit(&s->rowctr[(size_t)counter * (size_t)s->n_threads + (size_t)i].v, 0, memory_order_relaxed);
}

void fw_phase_begin(struct worker *w, enum moetax_phase ph, int layer) {
    w->phase++;
    if (w->ith == 0) {
        const int next = (w->phase + 1) % MOETAX_POOL_N_CHUNK_COUNTERS;
        moetax_pool_chunk_reset(w->s->pool, next, 0);
        fw_rows_reset(w->s, next);
    }
    w->lph = ph;
    w->layer = layer;
    if (w->ledger) w->t0 = moetax_ledger_now();
    test_delay(w->s, ph);
}

void fw_mark(struct worker *w, enum moetax_phase ph) {
    if (ph == w->lph) return;
    if (w->ledger) {
        uint64_t t = moetax_ledger_now();
        moetax_ledger_span(w->ledger, w->ith, w->lph, w->layer, w->t0, t);
        w->t0 = t;
    }
    w->lph = ph;
    test_delay(w->s, ph);
}

void fw_phase_end(struct worker *w) {
    if (!w->ledger) {
        moetax_pool_barrier(w->s->pool, w->ith);
        return;
    }
    uint64_t t = moetax_ledger_now();
    moetax_ledger_span(w->ledger, w->ith, w->lph, w->layer, w->t0, t);
    moetax_pool_barrier(w->s->pool, w->ith);
    uint64_t t2 = moetax_ledger_now();
    moetax_ledger_span(w->ledger, w->ith, MOETAX_PHASE_WAIT, w->layer, t, t2);
}

int64_t fw_chunk(struct worker *w, int64_t n, int64_t step) {
    int64_t i = moetax_pool_chunk_next(w->s->pool, w->phase % MOETAX_POOL_N_CHUNK_COUNTERS, step);
    return i < n ? i : -1;
}

int64_t fw_chunk_own(struct worker *w, int64_t nb) {
    struct fw_rowctr *c = w->s->rowctr + (size_t)(w->phase % MOETAX_POOL_N_CHUNK_COUNTERS) * (size_t)w->s->n_threads;
    int64_t b = -1;
    for (int j = 0; j < w->nth && b < 0; j++) { /* its own share first, then the others' in turn */
        const int i = (w->ith + j) % w->nth;
        const int64_t lo = nb * i / w->nth, len = nb * (i + 1) / w->nth - lo;
        if (len <= 0 || atomic_load_explicit(&c[i].v, memory_order_relaxed) >= len) continue;
        const int64_t k = atomic_fetch_add_explicit(&c[i].v, 1, memory_order_relaxed);
        if (k < len) b = lo + k;
    }
    return b;
}

bool fw_rows(struct worker *w, int64_t n, int64_t block, int64_t *r0, int64_t *r1) {
    const int64_t b = fw_chunk_own(w, (n + block - 1) / block);
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

static int64_t up32(int64_t a) { return (a + 31) / 32 * 32; }

enum { ACT_KQ_BLOCK = 256 }; /* values per block_q8_K */

moetax_status fw_act_alloc(const struct moetax_model *m, struct act *a, int64_t ncols, int64_t rows, bool own_x) {
    size_t b8 = moetax_act_size(MOETAX_TYPE_Q8_0, up32(ncols), rows);
    size_t b4 = moetax_act_size(MOETAX_TYPE_Q4_0, up32(ncols), rows);
    /* k-quant rows of every width up to ncols that is a multiple of 256 */
    size_t bk = ncols >= ACT_KQ_BLOCK ? moetax_act_size(FW_ACT_KQ_TYPE, ncols / ACT_KQ_BLOCK * ACT_KQ_BLOCK, rows) : 0;
    a->q8 = m->has_q8_0 ? aligned_alloc(64, (b8 + 63) / 64 * 64) : NULL;
    a->q4 = m->has_q4_0 ? aligned_alloc(64, (b4 + 63) / 64 * 64) : NULL;
    a->qk = m->has_kq && bk ? aligned_alloc(64, (bk + 63) / 64 * 64) : NULL;
    a->cap_q8 = b8;
    a->cap_q4 = b4;
    a->cap_qk = a->qk ? bk : 0;
    if (own_x) a->x = calloc((size_t)(ncols * rows), sizeof(float));
    if ((m->has_q8_0 && !a->q8) || (m->has_q4_0 && !a->q4) || (m->has_kq && bk && !a->qk) || (own_x && !a->x))
        return moetax_error(MOETAX_ERR_NOMEM, "out of memory for activations");
    return MOETAX_OK;
}

void fw_act_free(struct act *a, bool own_x) {
    free(a->q8);
    free(a->q4);
    free(a->qk);
    if (own_x) free((void *)a->x);
    a->q8 = a->q4 = a->qk = NULL;
    if (own_x) a->x = NULL;
}

struct act fw_act_view(const struct act *slot, const float *x, int64_t ncols, int64_t n) {
    return (struct act){.x = x, .ncols = ncols, .n = n, .q8 = slot->q8, .q4 = slot->q4, .qk = slot->qk,
                        .cap_q8 = slot->cap_q8, .cap_q4 = slot->cap_q4, .cap_qk = slot->cap_qk};
}

bool fw_act_has_qk(const struct act *a) {
    return a->qk && a->ncols % ACT_KQ_BLOCK == 0 &&
           moetax_act_size(FW_ACT_KQ_TYPE, a->ncols, a->n) <= a->cap_qk;
}

void fw_act_publish(const struct worker *w, struct act *slot, const struct act *view) {
    if (w->ith != 0) return;
    if (slot->x != view->x) slot->x = view->x; /* unchanged fields are not rewritten: others may read them */
    slot->ncols = view->ncols;
    slot->n = view->n;
}

void fw_act_prep(const struct fw_step *s, struct act *a, int64_t t0, int64_t t1) {
    if (t1 <= t0) return;
    const struct moetax_model *m = s->m;
    if (m->has_q8_0 && a->ncols % 32 == 0) {
        size_t rb = moetax_act_size(MOETAX_TYPE_Q8_0, a->ncols, 1);
        s->K->quantize_act(MOETAX_TYPE_Q8_0, a->x + t0 * a->ncols, a->ncols, a->ncols, t1 - t0,
                           (char *)a->q8 + (size_t)t0 * rb);
    }
    if (m->has_q4_0 && a->ncols % 32 == 0) {
        size_t rb = moetax_act_size(MOETAX_TYPE_Q4_0, a->ncols, 1);
        s->K->quantize_act(MOETAX_TYPE_Q4_0, a->x + t0 * a->ncols, a->ncols, a->ncols, t1 - t0,
                           (char *)a->q4 + (size_t)t0 * rb);
    }
    if (fw_act_has_qk(a)) {
        size_t rb = moetax_act_size(FW_ACT_KQ_TYPE, a->ncols, 1);
        s->K->quantize_act(FW_ACT_KQ_TYPE, a->x + t0 * a->ncols, a->ncols, a->ncols, t1 - t0,
                           (char *)a->qk + (size_t)t0 * rb);
    }
}

const struct act *fw_own_rows(struct worker *w, const float *x, int64_t ncols, int64_t n, const float *norm_w) {
    struct fw_step *s = w->s;
    struct fw_own *o = &s->own[w->ith];
    MOETAX_ASSERT(n >= 1 && n <= FW_OWN_ROWS && ncols <= s->max_cols);
    if (norm_w) {
        for (int64_t t = 0; t < n; t++)
            s->K->rmsnorm(o->x + t * ncols, x + t * ncols, norm_w, ncols, s->m->hp.rms_eps);
        x = o->x;
    }
    o->in.x = x;
    o->in.ncols = ncols;
    o->in.n = n;
    fw_act_prep(s, &o->in, 0, n);
    return &o->in;
}

const struct act *fw_own_row(struct worker *w, const float *x, int64_t ncols, const float *norm_w) {
    return fw_own_rows(w, x, ncols, 1, norm_w);
}

void fw_norm_rows(struct worker *w, float *dst, const float *src, const float *weight, int64_t ncols,
                  int64_t t_first) {
    struct fw_step *s = w->s;
    int64_t r0, r1;
    fw_split(w, s->n - t_first, 1, &r0, &r1);
    r0 += t_first;
    r1 += t_first;
    for (int64_t t = r0; t < r1; t++) s->K->rmsnorm(dst + t * ncols, src + t * ncols, weight, ncols, s->m->hp.rms_eps);
    struct act v = fw_act_view(&s->a_in, dst, ncols, s->n);
    fw_act_publish(w, &s->a_in, &v);
    fw_act_prep(s, &v, r0, r1);
}

const struct act *fw_norm_input(struct worker *w, enum moetax_phase ph, enum moetax_phase next, int layer, float *dst,
                                const float *src, const float *weight, int64_t ncols) {
    fw_phase_begin(w, ph, layer);
    if (fw_own_fits(w->s->n, ncols)) {
        const struct act *a = fw_own_rows(w, src, ncols, w->s->n, weight);
        fw_mark(w, next);
        return a;
    }
    fw_norm_rows(w, dst, src, weight, ncols, 0);
    fw_phase_end(w);
    fw_phase_begin(w, next, layer);
    return &w->s->a_in;
}

bool fw_tokens_parallel(const struct worker *w, int64_t width) {
    const struct fw_step *s = w->s;
    const int64_t n = s->n;
    return s->one_per_seq && !s->streamed && w->nth > 1 && n >= w->nth && fw_own_fits((n + w->nth - 1) / w->nth, width);
}

const struct act *fw_tokens_begin(struct worker *w, int layer, const float *norm_w, int64_t *t0, int64_t *t1) {
    struct fw_step *s = w->s;
    const int64_t d = s->m->hp.n_embd;
    fw_split(w, s->n, 1, t0, t1);
    fw_phase_begin(w, MOETAX_PHASE_NORM, layer);
    if (*t1 <= *t0) return NULL;
    const struct act *a = fw_own_rows(w, s->x + *t0 * d, d, *t1 - *t0, norm_w);
    fw_mark(w, MOETAX_PHASE_ATTN);
    return a;
}

void fw_tokens_end(struct worker *w, const struct moetax_weight *wo, const float *attv, int64_t width, float *out,
                   int64_t t0, int64_t t1) {
    struct fw_step *s = w->s;
    const int64_t d = s->m->hp.n_embd;
    if (t1 > t0) {
        const struct act *aov = fw_own_rows(w, attv + t0 * width, width, t1 - t0, NULL);
        fw_matmul(s, wo, 0, 0, d, aov, 0, t1 - t0, out + t0 * d, d);
        for (int64_t t = t0; t < t1; t++)
            for (int64_t r = 0; r < d; r++) s->x[t * d + r] += out[t * d + r];
    }
    fw_phase_end(w);
}

const void *fw_act_for(const struct act *a, enum moetax_type t) {
    if (moetax_act_is_q8_0(t)) return a->q8;
    if (moetax_act_is_q4_0(t)) return a->q4;
    return a->x;
}

/* k-quant weights (Q2_K .. Q6_K): their block_q8_K activations come from the act's qk slot,
 * prepared once with the other slots (fw_act_prep, or copied with them); an act without one (made
 * by hand: attention's per-head scratch, the router guess) has them prepared here, per call,
 * from the float rows a->x[b0 .. b0 + n), in chunks that fit a stack buffer. quantize_act is a
 * pure function of a row and the k-quant matmul is batch-invariant (kernels.h), so the results
 * are the same either way. Per call, a matrix split into row blocks quantized its input rows
 * once per block. */
static void matmul_kq2(const struct fw_step *s, const struct moetax_weight *w, const char *wp,
                       const struct moetax_weight *w2, const char *wp2, int64_t nrows, const struct act *a, int64_t b0,
                       int64_t n, float *y, float *y2, int64_t ldy);

static void matmul_kq(const struct fw_step *s, const struct moetax_weight *w, const char *wp, int64_t nrows,
                      const struct act *a, int64_t b0, int64_t n, float *y, int64_t ldy) {
    matmul_kq2(s, w, wp, NULL, NULL, nrows, a, b0, n, y, NULL, ldy);
}

/* The same for w and, when w2 is set (a k-quant weight of w's width: the same block_q8_K rows
 * for any k-quant type), w2 into y2 from one preparation of the rows (gate and up). */
static void matmul_kq2(const struct fw_step *s, const struct moetax_weight *w, const char *wp,
                       const struct moetax_weight *w2, const char *wp2, int64_t nrows, const struct act *a, int64_t b0,
                       int64_t n, float *y, float *y2, int64_t ldy) {
    const int64_t nc = w->ne[0];
    const size_t rb = moetax_act_size(w->type, nc, 1);
    if (fw_act_has_qk(a) && a->ncols == nc) { /* prepared rows */
        const char *xq = (const char *)a->qk + (size_t)b0 * rb;
        s->mm(w->type, wp, w->row_bytes, 0, nrows, nc, xq, n, y, ldy);
        if (w2) s->mm(w2->type, wp2, w2->row_bytes, 0, nrows, nc, xq, n, y2, ldy);
        return;
    }
    enum { STACK = 64 * 1024 };
    _Alignas(64) unsigned char stack[STACK];
    int64_t chunk = rb && rb <= STACK ? (int64_t)(STACK / rb) : 1;
    unsigned char *buf = rb <= STACK ? stack : malloc(rb);
    if (!buf) { /* a row over 64 KiB of activations (ncols > 57344) and no memory: no result */
        for (int64_t b = 0; b < n; b++)
            for (int64_t r = 0; r < nrows; r++) y[b * ldy + r] = NAN;
        return;
    }
    for (int64_t c = 0; c < n; c += chunk) {
        const int64_t m = n - c < chunk ? n - c : chunk;
        s->K->quantize_act(w->type, a->x + (b0 + c) * a->ncols, a->ncols, nc, m, buf);
        s->mm(w->type, wp, w->row_bytes, 0, nrows, nc, buf, m, y + c * ldy, ldy);
        if (w2) s->mm(w2->type, wp2, w2->row_bytes, 0, nrows, nc, buf, m, y2 + c * ldy, ldy);
    }
    if (buf != stack) free(buf);
}

static bool is_float(enum moetax_type t) {
    return t == MOETAX_TYPE_F32 || t == MOETAX_TYPE_F16 || t == MOETAX_TYPE_BF16;
}

/* Weights whose activations are prepared in the act's slots (or are its float rows).
 * In a quantized model (s->float_by_row) float weights (F32/F16/BF16) with several
 * batch rows go one batch row at a time: the SIMD tables sum a float row in one chain
 * in their one-row (decode) path and in another in their batch tiles (kernels.h), so a
 * batched call would give a token other bits than decoding it alone, and a row's
 * logits would depend on the batch (the F32 router moves every later layer's input by
 * rounding, which k-quant matmuls, quantizing float rows, pass on). Those float weights
 * are small (router, narrow projections). A float model keeps the batch tiles: going
 * row by row cost its prefill ~0.6x, and its batch results stay within rounding of
 * decode's (test_batch's F32 tolerance). */
static void matmul_prepared(const struct fw_step *s, const struct moetax_weight *w, const char *wp, int64_t nrows,
                            const struct act *a, int64_t b0, int64_t n, float *y, int64_t ldy) {
    const char *xq = fw_act_for(a, w->type);
    const size_t xrow = moetax_act_size(w->type, w->ne[0], 1);
    xq += (size_t)b0 * xrow;
    if (!is_float(w->type) || !s->float_by_row) {
        s->mm(w->type, wp, w->row_bytes, 0, nrows, w->ne[0], xq, n, y, ldy);
        return;
    }
    for (int64_t b = 0; b < n; b++)
        s->mm(w->type, wp, w->row_bytes, 0, nrows, w->ne[0], xq + (size_t)b * xrow, 1, y + b * ldy, ldy);
}

void fw_matmul_rel(const struct fw_step *s, const struct moetax_weight *w, int64_t mat, int64_t r0, int64_t r1,
                   const struct act *a, int64_t b0, int64_t n, float *y, int64_t ldy) {
    if (r1 <= r0 || n <= 0) return;
    const char *wp = (const char *)w->data + (size_t)mat * w->mat_bytes + (size_t)r0 * w->row_bytes;
    if (moetax_type_is_kquant(w->type)) {
        matmul_kq(s, w, wp, r1 - r0, a, b0, n, y, ldy);
        return;
    }
    matmul_prepared(s, w, wp, r1 - r0, a, b0, n, y, ldy);
}

void fw_matmul_at(const struct fw_step *s, const struct moetax_weight *w, const void *mat, int64_t r0, int64_t r1,
                  const struct act *a, int64_t b0, int64_t n, float *y, int64_t ldy) {
    if (r1 <= r0 || n <= 0) return;
    const char *wp = (const char *)mat + (size_t)r0 * w->row_bytes;
    if (moetax_type_is_kquant(w->type)) {
        matmul_kq(s, w, wp, r1 - r0, a, b0, n, y + r0, ldy);
        return;
    }
    matmul_prepared(s, w, wp, r1 - r0, a, b0, n, y + r0, ldy);
}

void fw_matmul(const struct fw_step *s, const struct moetax_weight *w, int64_t mat, int64_t r0, int64_t r1,
               const struct act *a, int64_t b0, int64_t n, float *y, int64_t ldy) {
    fw_matmul_rel(s, w, mat, r0, r1, a, b0, n, y + r0, ldy);
}

void fw_matmul2_at(const struct fw_step *s, const struct moetax_weight *w, const void *mat,
                   const struct moetax_weight *w2, const void *mat2, int64_t r0, int64_t r1, const struct act *a,
                   int64_t b0, int64_t n, float *y, float *y2, int64_t ldy) {
    if (r1 <= r0 || n <= 0) return;
    if (moetax_type_is_kquant(w->type) && moetax_type_is_kquant(w2->type) && w->ne[0] == w2->ne[0]) {
        matmul_kq2(s, w, (const char *)mat + (size_t)r0 * w->row_bytes, w2,
                   (const char *)mat2 + (size_t)r0 * w2->row_bytes, r1 - r0, a, b0, n, y + r0, y2 + r0, ldy);
        return;
    }
    fw_matmul_at(s, w, mat, r0, r1, a, b0, n, y, ldy);
    fw_matmul_at(s, w2, mat2, r0, r1, a, b0, n, y2, ldy);
}

void fw_fail(struct fw_step *s, moetax_status st) {
    int expected = 0;
    if (atomic_compare_exchange_strong(&s->err_status, &expected, (int)st))
        snprintf(s->err_msg, sizeof s->err_msg, "%s", moetax_last_error());
}

/* ---- the step's shared buffers ---------------------------------------------------- */

/* Whether any of the model's large projections is quantized (not F32/F16/BF16). */
static bool quantized(const struct moetax_model *m) {
    if (m->has_q8_0 || m->has_q4_0 || (m->output.data && !is_float(m->output.type))) return true;
    for (int il = 0; il < m->hp.n_layer; il++) {
        const struct moetax_layer *l = &m->layers[il];
        const struct moetax_weight *ws[] = {&l->wq, &l->wq_a, &l->wkv_a, &l->wo, &l->ffn_gate, &l->gate_exps,
                                            &l->gate_sh, &l->down_exps};
        for (size_t i = 0; i < sizeof ws / sizeof ws[0]; i++)
            if (ws[i]->data && !is_float(ws[i]->type)) return true;
    }
    return false;
}

moetax_status fw_step_init(struct fw_step *s, const struct moetax_model *m, struct moetax_pool *pool, int64_t U,
                           int64_t incols, int64_t max_cols) {
    const struct moetax_hparams *hp = &m->hp;
    s->m = m;
    s->K = moetax_kernels_get();
    const double wbytes = moetax_model_active_bytes_k(m, hp->n_expert > 0 ? (int)hp->n_expert : 0);
    s->streamed = moetax_kernels_streamed((uint64_t)wbytes);
    s->mm = s->streamed ? s->K->matmul_stream : s->K->matmul;
    s->pool = pool;
    s->n_threads = moetax_pool_n_threads(pool);
    s->n_ubatch = U;
    s->max_cols = max_cols;
    s->float_by_row = quantized(m);
    const int64_t d = hp->n_embd, xnc = d > hp->q_lora_rank ? d : hp->q_lora_rank;
    s->x = calloc((size_t)(U * d), sizeof(float));
    s->xn = calloc((size_t)(U * xnc), sizeof(float));
    s->own = calloc((size_t)s->n_threads, sizeof *s->own);
    s->rowctr = aligned_alloc(64, sizeof *s->rowctr * (size_t)MOETAX_POOL_N_CHUNK_COUNTERS * (size_t)s->n_threads);
    if (!s->x || !s->xn || !s->own || !s->rowctr) return moetax_error(MOETAX_ERR_NOMEM, "out of memory");
    for (int c = 0; c < MOETAX_POOL_N_CHUNK_COUNTERS; c++) fw_rows_reset(s, c);
    moetax_status st = fw_act_alloc(m, &s->a_in, incols, U, false);
    for (int i = 0; !st && i < s->n_threads; i++) {
        st = fw_act_alloc(m, &s->own[i].in, max_cols, FW_OWN_ROWS, false);
        if (!st && !(s->own[i].x = calloc((size_t)max_cols * FW_OWN_ROWS, sizeof(float))))
            st = moetax_error(MOETAX_ERR_NOMEM, "out of memory");
    }
    return st;
}

void fw_step_free(struct fw_step *s) {
    free(s->x);
    free(s->xn);
    fw_act_free(&s->a_in, false);
    if (s->own)
        for (int i = 0; i < s->n_threads; i++) {
            fw_act_free(&s->own[i].in, false);
            free(s->own[i].x);
        }
    free(s->own);
    free(s->rowctr);
}
