/*
 * moe.c - the fused MoE block for a whole micro-batch.
 *
 * Input: the ffn-normed tokens c->xn, prepared in c->a_in. Output: added into
 * the residual c->x. Phases (each ends with a barrier):
 *   1. router logits [n, E] and the shared experts' gate/up (silu-gated) [n, Fs],
 *      rows of both split across workers.
 *   2. worker 0 routes every token (softmax or sigmoid, selection bias, group
 *      limit, top-k, renormalise, scale) and builds one dispatch plan (slots
 *      grouped by expert); meanwhile the other workers prepare the shared hidden.
 *   3. (only when n > 1) gather: each slot's prepared input row is copied so
 *      that an expert's rows are contiguous (one batched matmul per expert).
 *   4. gate/up: one work item per (active expert, block of F rows), dynamic.
 *   5. prepare the expert hidden rows.
 *   6. down + combine: one work item per block of d output rows; it runs every
 *      active expert's down projection on that block and adds w * y into the
 *      residual rows of the expert's tokens, then the shared expert's. Blocks
 *      are disjoint, so the combine needs no atomics and no extra pass, and the
 *      summation order (experts ascending, then shared) is fixed.
 * So 6 barriers per MoE layer for a batch (plus the ffn norm's phase before it).
 * One token (decode) needs 3: each worker normalises and prepares the token's row
 * at the start of phase 1 (fw_own_row), routes it and plans into its own copy at
 * the start of phase 4 (phase 2 goes), and prepares the expert hidden rows and the
 * shared hidden row at the start of phase 6 (phase 5 goes): the same small work
 * on every worker instead of a phase and a barrier each, with the same bits. No
 * barrier per expert.
 */
#include <math.h>
#include <string.h>

#include "model/forward_impl.h"
#include "moetax/store.h"

/* The gate, up and down matrices of expert e for this worker: from the mapping,
 * or acquired from the expert store (blocking only this worker, booked to
 * `load`) and held until release_experts at the end of the block. false on a
 * read error (recorded with fw_fail). */
static bool expert_ptrs(struct worker *w, int il, int32_t e, const void **gate, const void **up, const void **down) {
    struct moetax_ctx *c = w->c;
    const struct moetax_layer *l = &c->m->layers[il];
    if (!c->store) {
        /* fused gate_up: gate_exps and up_exps share the fused tensor's 2F-row stride, up
         * starting F rows in (see deepseek2.c), so one formula serves both layouts */
        *gate = (const char *)l->gate_exps.data + (size_t)e * l->gate_exps.mat_bytes;
        *up = (const char *)l->up_exps.data + (size_t)e * l->up_exps.mat_bytes;
        *down = (const char *)l->down_exps.data + (size_t)e * l->down_exps.mat_bytes;
        return true;
    }
    struct scratch *s = &c->scr[w->ith];
    if (!s->acq[e]) {
        enum moetax_phase prev = w->lph;
        fw_mark(w, MOETAX_PHASE_LOAD);
        const void *ptrs[4];
        moetax_status st = moetax_store_acquire(c->store, il, e, ptrs, NULL);
        fw_mark(w, prev);
        if (st) {
            fw_fail(c, st);
            return false;
        }
        if (l->fused_gate_up) {
            s->eptr[e][0] = ptrs[0];
            s->eptr[e][1] = (const char *)ptrs[0] + (size_t)c->m->hp.n_ff_exp * l->gate_exps.row_bytes;
            s->eptr[e][2] = ptrs[1];
        } else {
            s->eptr[e][0] = ptrs[0];
            s->eptr[e][1] = ptrs[1];
            s->eptr[e][2] = ptrs[2];
        }
        s->acq[e] = 1;
        s->acq_list[s->n_acq++] = e;
    }
    *gate = s->eptr[e][0];
    *up = s->eptr[e][1];
    *down = s->eptr[e][2];
    return true;
}

static void release_experts(struct worker *w, int il) {
    struct moetax_ctx *c = w->c;
    struct scratch *s = &c->scr[w->ith];
    for (int i = 0; i < s->n_acq; i++) {
        moetax_store_release(c->store, il, s->acq_list[i]);
        s->acq[s->acq_list[i]] = 0;
    }
    s->n_acq = 0;
}

/* Route token logits [E] -> k experts and weights (GGUF-MOE.md "The MoE block"). */
static void route_token(const struct moetax_kernels *K, const struct moetax_hparams *hp, int64_t k, const float *bias,
                        const float *logits, float *p, float *s, int32_t *idx, float *wout) {
    const int64_t E = hp->n_expert;
    memcpy(p, logits, sizeof(float) * (size_t)E);
    if (hp->gating_func == 2) K->sigmoid(p, E);
    else K->softmax(p, E);
    for (int64_t e = 0; e < E; e++) s[e] = bias ? p[e] + bias[e] : p[e];
    if (hp->n_expert_group > 1) {
        const int64_t G = hp->n_expert_group, per = E / G;
        float gscore[256];
        int32_t gidx[256];
        for (int64_t g = 0; g < G; g++) {
            float a = -INFINITY, b = -INFINITY; /* top-2 of the group */
            for (int64_t e = g * per; e < (g + 1) * per; e++) {
                if (s[e] > a) { b = a; a = s[e]; }
                else if (s[e] > b) b = s[e];
            }
            gscore[g] = a + b;
        }
        K->topk(gscore, G, hp->n_expert_group_used, gidx, NULL);
        bool keep[256] = {false};
        for (int64_t j = 0; j < hp->n_expert_group_used; j++) keep[gidx[j]] = true;
        for (int64_t g = 0; g < G; g++)
            if (!keep[g])
                for (int64_t e = g * per; e < (g + 1) * per; e++) s[e] = -INFINITY;
    }
    K->topk(s, E, k, idx, NULL);
    float sum = 0;
    for (int64_t j = 0; j < k; j++) {
        wout[j] = p[idx[j]];
        sum += wout[j];
    }
    if (hp->expert_weights_norm) {
        float den = sum > 6.103515625e-5f ? sum : 6.103515625e-5f;
        for (int64_t j = 0; j < k; j++) wout[j] /= den;
    }
    if (hp->expert_weights_scale != 0.0f && hp->expert_weights_scale != 1.0f)
        for (int64_t j = 0; j < k; j++) wout[j] *= hp->expert_weights_scale;
}

/* Route the micro-batch's tokens into sel/selw [n, k] (scratch: s->f). */
static void route_tokens(struct moetax_ctx *c, struct scratch *s, int il, int32_t *sel, float *selw) {
    const struct moetax_hparams *hp = &c->m->hp;
    const struct moetax_layer *l = &c->m->layers[il];
    const int64_t E = hp->n_expert, k = c->n_expert_used, n = c->n;
    float *p = s->f, *sc = s->f + E;
    for (int64_t t = 0; t < n; t++)
        route_token(c->K, hp, k, l->exp_probs_b, c->router + t * E, p, sc, sel + t * k, selw + t * k);
}

/* The dispatch plan of sel/selw [n, k]: slots grouped by expert (ascending), tokens in order. */
static void plan(const struct moetax_ctx *c, const int32_t *sel, const float *selw, struct plan *pl) {
    const struct moetax_hparams *hp = &c->m->hp;
    const int64_t E = hp->n_expert, k = c->n_expert_used, n = c->n;
    memset(pl->count, 0, sizeof(int32_t) * (size_t)E);
    for (int64_t i = 0; i < n * k; i++) pl->count[sel[i]]++;
    pl->n_active = 0;
    int32_t off = 0;
    for (int32_t e = 0; e < E; e++) {
        pl->offset[e] = off;
        if (pl->count[e]) pl->active[pl->n_active++] = e;
        off += pl->count[e];
    }
    int32_t *fill = pl->fill; /* next free slot per expert */
    memcpy(fill, pl->offset, sizeof(int32_t) * (size_t)E);
    for (int64_t t = 0; t < n; t++)
        for (int64_t j = 0; j < k; j++) {
            int32_t e = sel[t * k + j], slot = fill[e]++;
            pl->slot_token[slot] = (int32_t)t;
            pl->slot_w[slot] = selw[t * k + j];
        }
}

/* copy prepared row `src_row` of a into row `dst_row` of b (same ncols) */
static void copy_prepared_row(const struct moetax_ctx *c, const struct act *a, int64_t src_row, struct act *b,
                              int64_t dst_row) {
    const int64_t nc = a->ncols;
    memcpy((float *)b->x + dst_row * nc, a->x + src_row * nc, sizeof(float) * (size_t)nc);
    if (c->m->has_q8_0) {
        size_t rb = moetax_act_size(MOETAX_TYPE_Q8_0, nc, 1);
        memcpy((char *)b->q8 + (size_t)dst_row * rb, (const char *)a->q8 + (size_t)src_row * rb, rb);
    }
    if (c->m->has_q4_0) {
        size_t rb = moetax_act_size(MOETAX_TYPE_Q4_0, nc, 1);
        memcpy((char *)b->q4 + (size_t)dst_row * rb, (const char *)a->q4 + (size_t)src_row * rb, rb);
    }
}

/* Experts layer il+1 would pick when its router is applied to the current
 * residual (what a cross-layer prefetcher would predict); for the report. */
static void predict_next(struct moetax_ctx *c, int il) {
    const struct moetax_hparams *hp = &c->m->hp;
    if (il + 1 >= hp->n_layer || !c->m->layers[il + 1].is_moe) return;
    const struct moetax_layer *nl = &c->m->layers[il + 1];
    const int64_t d = hp->n_embd, E = hp->n_expert, k = c->n_expert_used;
    for (int64_t t = 0; t < c->n; t++) {
        c->K->rmsnorm(c->pred_x, c->x + t * d, nl->ffn_norm, d, hp->rms_eps);
        struct act a = {.x = c->pred_x, .ncols = d, .n = 1, .q8 = c->pred_q, .q4 = c->pred_q};
        if (nl->gate_inp.type == MOETAX_TYPE_Q8_0 || nl->gate_inp.type == MOETAX_TYPE_Q4_0)
            c->K->quantize_act(nl->gate_inp.type, c->pred_x, d, d, 1, c->pred_q);
        fw_matmul(c, &nl->gate_inp, 0, 0, E, &a, 0, 1, c->pred_logits, E);
        float wdummy[256];
        route_token(c->K, hp, k, nl->exp_probs_b, c->pred_logits, c->pred_p, c->pred_p + E,
                    c->pred + ((int64_t)(il + 1) * c->n_ubatch + t) * k, wdummy);
    }
    c->pred_ok[il + 1] = true;
}

/* Worker 0, once the layer's tokens are routed (c->sel / selw): the routing record and
 * the next layer's prediction (for the record and the store). */
static void record_and_predict(struct moetax_ctx *c, int il) {
    const int64_t slots = (int64_t)il * c->n_ubatch * c->n_expert_used;
    bool routing_rec = moetax_ledger_routing_on(c->ledger);
    if (routing_rec)
        moetax_ledger_routing(c->ledger, il, c->n, c->sel + slots, c->selw + slots,
                              c->pred_ok[il] ? c->pred + slots : NULL);
    if (routing_rec || (c->store && c->prefetch)) predict_next(c, il);
}

/* Worker 0, once the layer is planned (pl): the expert store's reads for this layer's
 * experts and the predicted ones of the next layer. */
static void issue_reads(struct worker *w, int il, const struct plan *pl) {
    struct moetax_ctx *c = w->c;
    const struct moetax_hparams *hp = &c->m->hp;
    const int64_t E = hp->n_expert, k = c->n_expert_used, n = c->n;
    if (c->store && c->prefetch) {
        /* reads for all of this layer's experts now, in parallel (other items proceed while
         * they load), then the experts the next layer's router predicts from this residual.
         * Without prefetch each expert is read only when a work item needs it. */
        fw_mark(w, MOETAX_PHASE_LOAD);
        moetax_store_prefetch(c->store, il, pl->active, pl->n_active, false);
        if (il + 1 < hp->n_layer && c->pred_ok[il + 1]) {
            /* the cross-layer prediction, ranked by recent-token history: first the predicted
             * experts that layer il + 1 also chose for the last micro-batch (c->sel still holds
             * that routing: this step has not reached il + 1), then the other predicted ones,
             * each in the router's order. The store reads from the front while I/O is idle.
             * Experts the history alone names are not read: on random routing only k / E of
             * them are used again, and each read of one would evict a cached expert. */
            int32_t *uniq = c->scr[w->ith].plan.fill; /* scratch [E]: this worker's plan is made */
            const int32_t *pred = c->pred + (int64_t)(il + 1) * c->n_ubatch * k;
            const int32_t *hist = c->sel + (int64_t)(il + 1) * c->n_ubatch * k;
            const int64_t nhist = c->hist_n[il + 1] * k;
            int nu = 0;
            for (int pass = 0; pass < 2; pass++)
                for (int64_t i = 0; i < n * k; i++) {
                    int32_t e = pred[i];
                    bool recent = false, seen = false;
                    for (int64_t j = 0; j < nhist && !recent; j++) recent = hist[j] == e;
                    if (recent != (pass == 0)) continue;
                    for (int j = 0; j < nu && !seen; j++) seen = uniq[j] == e;
                    if (!seen && nu < E) uniq[nu++] = e;
                }
            moetax_store_prefetch(c->store, il + 1, uniq, nu, true);
        }
        fw_mark(w, MOETAX_PHASE_DISPATCH);
    }
}

void fw_moe(struct worker *w, int il) {
    struct moetax_ctx *c = w->c;
    const struct moetax_hparams *hp = &c->m->hp;
    const struct moetax_layer *l = &c->m->layers[il];
    const struct moetax_kernels *K = c->K;
    const int64_t n = c->n, d = hp->n_embd, E = hp->n_expert, F = hp->n_ff_exp, k = c->n_expert_used;
    const int64_t Fs = l->gate_sh.data ? l->gate_sh.ne[1] : 0;
    struct scratch *s = &c->scr[w->ith];
    struct plan *pl = &c->plan;
    int64_t r0, r1;

    /* 1: router + shared gate/up (one token: each worker first normalises and prepares the
     * row itself, see fw_own_row; the caller skipped the ffn norm's phase) */
    const struct act *ain = &c->a_in;
    if (n == 1) {
        fw_phase_begin(w, MOETAX_PHASE_NORM, il);
        ain = fw_own_row(w, c->x, d, l->ffn_norm);
        fw_mark(w, MOETAX_PHASE_ROUTE);
    } else fw_phase_begin(w, MOETAX_PHASE_ROUTE, il);
    /* blocks of 64 rows from each matrix's first row (kernels.h, ROW RANGES): the
     * shared expert's rows are numbered from E rounded up to 64 */
    const int64_t E64 = (E + 63) / 64 * 64;
    while (fw_rows(w, E64 + Fs, 64, &r0, &r1)) {
        if (r0 < E) {
            fw_mark(w, MOETAX_PHASE_ROUTE);
            fw_matmul(c, &l->gate_inp, 0, r0, r1 < E ? r1 : E, ain, 0, n, c->router, E);
        } else if (r0 >= E64) {
            fw_mark(w, MOETAX_PHASE_SHARED);
            int64_t a = r0 - E64, b = r1 - E64;
            fw_matmul(c, &l->gate_sh, 0, a, b, ain, 0, n, c->hid, Fs);
            fw_matmul(c, &l->up_sh, 0, a, b, ain, 0, n, c->tmp, Fs);
            for (int64_t t = 0; t < n; t++)
                K->silu_mul(c->hid + t * Fs + a, c->hid + t * Fs + a, c->tmp + t * Fs + a, b - a);
        }
    }
    fw_phase_end(w);

    /* 2: routing and the dispatch plan. A batch: worker 0 routes every token and plans while
     * the others prepare the shared hidden, then a barrier. One token: every worker routes it
     * and plans into its own copy (the same bits everywhere) and goes on to phase 4 without a
     * barrier; the shared hidden is prepared by each worker in phase 6 (fw_own_row). Worker 0
     * also records the routing, predicts the next layer and issues the store's reads. */
    const int64_t slots = (int64_t)il * c->n_ubatch * k; /* this layer's rows of c->sel / selw */
    if (n > 1) {
        fw_phase_begin(w, MOETAX_PHASE_ROUTE, il);
        struct act ah = fw_act_view(&c->a_hid, c->hid, Fs, n);
        fw_act_publish(w, &c->a_hid, &ah);
        if (w->ith == 0) {
            route_tokens(c, s, il, c->sel + slots, c->selw + slots);
            c->hist_n[il] = n;
            record_and_predict(c, il);
            fw_mark(w, MOETAX_PHASE_DISPATCH);
            plan(c, c->sel + slots, c->selw + slots, pl);
            issue_reads(w, il, pl);
        }
        if (Fs) {
            fw_mark(w, MOETAX_PHASE_SHARED);
            if (w->nth == 1) fw_act_prep(c, &ah, 0, n);
            else if (w->ith > 0) {
                struct worker sub = {.c = c, .ith = w->ith - 1, .nth = w->nth - 1};
                fw_split(&sub, n, 1, &r0, &r1);
                fw_act_prep(c, &ah, r0, r1);
            }
        }
        fw_phase_end(w);
    } else {
        fw_phase_begin(w, MOETAX_PHASE_ROUTE, il);
        route_tokens(c, s, il, s->sel, s->selw);
        if (w->ith == 0) {
            memcpy(c->sel + slots, s->sel, sizeof(int32_t) * (size_t)k);
            memcpy(c->selw + slots, s->selw, sizeof(float) * (size_t)k);
            c->hist_n[il] = 1;
        }
        pl = &s->plan;
        fw_mark(w, MOETAX_PHASE_DISPATCH);
        plan(c, s->sel, s->selw, pl);
        if (w->ith == 0) {
            record_and_predict(c, il);
            issue_reads(w, il, pl);
        }
    }

    /* 3: gather each slot's input row (batches only) */
    if (n > 1) {
        fw_phase_begin(w, MOETAX_PHASE_DISPATCH, il);
        struct act ae = fw_act_view(&c->a_exp, c->a_exp.x, d, n * k);
        fw_act_publish(w, &c->a_exp, &ae);
        fw_split(w, n * k, 1, &r0, &r1);
        for (int64_t i = r0; i < r1; i++) copy_prepared_row(c, &c->a_in, pl->slot_token[i], &ae, i);
        fw_phase_end(w);
        ain = &c->a_exp;
    }

    /* 4: gate/up per (expert, block of F rows) (one token: the phase began with routing) */
    if (n > 1) fw_phase_begin(w, MOETAX_PHASE_EXPERT, il);
    else fw_mark(w, MOETAX_PHASE_EXPERT);
    const int64_t bf = F >= 128 ? 64 : F;
    const int64_t nbf = (F + bf - 1) / bf;
    for (int64_t it; (it = fw_chunk(w, pl->n_active * nbf, 1)) >= 0;) {
        int32_t e = pl->active[it / nbf];
        int64_t f0 = (it % nbf) * bf, f1 = f0 + bf < F ? f0 + bf : F;
        int64_t b0 = n > 1 ? pl->offset[e] : 0, cnt = pl->count[e];
        float *g = c->eh_g + (int64_t)pl->offset[e] * F, *u = c->eh + (int64_t)pl->offset[e] * F;
        const void *wg, *wu, *wd;
        if (!expert_ptrs(w, il, e, &wg, &wu, &wd)) continue;
        fw_matmul_at(c, &l->gate_exps, wg, f0, f1, ain, b0, cnt, g, F);
        fw_matmul_at(c, &l->up_exps, wu, f0, f1, ain, b0, cnt, u, F);
        for (int64_t i = 0; i < cnt; i++) K->silu_mul(u + i * F + f0, g + i * F + f0, u + i * F + f0, f1 - f0);
    }
    fw_phase_end(w);

    /* 5: prepare (quantize) the expert hidden rows (one token: each worker all k rows
     * itself, in phase 6) */
    const struct act *aeh = &c->a_eh;
    if (n > 1) {
        fw_phase_begin(w, MOETAX_PHASE_DISPATCH, il);
        struct act v = fw_act_view(&c->a_eh, c->eh, F, n * k);
        fw_act_publish(w, &c->a_eh, &v);
        fw_split(w, n * k, 1, &r0, &r1);
        fw_act_prep(c, &v, r0, r1);
        fw_phase_end(w);
        fw_phase_begin(w, MOETAX_PHASE_EXPERT, il);
    } else {
        fw_phase_begin(w, MOETAX_PHASE_DISPATCH, il);
        aeh = fw_own_eh(w, k);
        fw_mark(w, MOETAX_PHASE_EXPERT);
    }

    /* 6: down projections per block of output rows into ydown, then this
     * worker's blocks are combined into the residual, then the shared expert */
    const int64_t bd = 64, nbd = (d + bd - 1) / bd;
    int32_t mine[512];
    int nmine = 0;
    float *yd = c->ydown; /* [n*k, d] */
    for (int64_t it; (it = fw_chunk(w, nbd, 1)) >= 0;) {
        int64_t d0 = it * bd, d1 = d0 + bd < d ? d0 + bd : d;
        for (int32_t ai = 0; ai < pl->n_active; ai++) {
            int32_t e = pl->active[ai];
            const void *wg, *wu, *wd;
            if (!expert_ptrs(w, il, e, &wg, &wu, &wd)) continue;
            fw_matmul_at(c, &l->down_exps, wd, d0, d1, aeh, pl->offset[e], pl->count[e], yd + pl->offset[e] * d, d);
        }
        if (nmine < 512) mine[nmine++] = (int32_t)it;
        else { /* more blocks than the local list holds: combine this one now */
            fw_mark(w, MOETAX_PHASE_COMBINE);
            K->scatter_add(c->x + d0, d, yd + d0, d, pl->slot_token, pl->slot_w, n * k, d1 - d0);
            fw_mark(w, MOETAX_PHASE_EXPERT);
        }
    }
    fw_mark(w, MOETAX_PHASE_COMBINE);
    for (int i = 0; i < nmine; i++) {
        int64_t d0 = (int64_t)mine[i] * bd, d1 = d0 + bd < d ? d0 + bd : d;
        /* slots are grouped by expert in ascending order: a fixed summation order */
        K->scatter_add(c->x + d0, d, yd + d0, d, pl->slot_token, pl->slot_w, n * k, d1 - d0);
    }
    if (Fs) {
        fw_mark(w, MOETAX_PHASE_SHARED);
        const struct act *ahid = n == 1 && nmine > 0 ? fw_own_row(w, c->hid, Fs, NULL) : &c->a_hid;
        float *y = s->f;
        for (int i = 0; i < nmine; i++) {
            int64_t d0 = (int64_t)mine[i] * bd, d1 = d0 + bd < d ? d0 + bd : d;
            fw_matmul_rel(c, &l->down_sh, 0, d0, d1, ahid, 0, n, y, bd);
            for (int64_t t = 0; t < n; t++) K->axpy(c->x + t * d + d0, 1.0f, y + t * bd, d1 - d0);
        }
    }
    if (c->store) release_experts(w, il);
    fw_phase_end(w);
}
