/*
 * moe.c - the fused MoE block for a whole micro-batch.
 *
 * Input: the ffn-normed tokens c->xn, prepared in s->a_in. Output: added into
 * the residual s->x. Phases (each ends with a barrier):
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
 * So 6 barriers per MoE layer for a batch (plus the ffn norm's phase before it); a small
 * batch routes on every worker (phases 2 and 3 go) and, when its gate/up items are whole
 * experts, runs phase 5 in them (moe_block): 3 barriers.
 * One token (decode) needs 3: each worker normalises and prepares the token's row
 * at the start of phase 1 (fw_own_row), routes it and plans into its own copy at
 * the start of phase 4 (phase 2 goes), and prepares the expert hidden rows and the
 * shared hidden row at the start of phase 6 (phase 5 goes): the same small work
 * on every worker instead of a phase and a barrier each, with the same bits. No
 * barrier per expert.
 *
 * Token-sharded dispatch under mpirun (src/dist/dist.h): moe_block_ep instead. This rank's
 * tokens are routed here and sent as records to the ranks of their experts; the records
 * that arrive (and those for this rank itself) are computed as units of the same gate/up,
 * prepare and down phases, and one partial sum per record goes back.
 */
#include <math.h>
#include <sched.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "moe/moe.h"
#include "moetax/predict.h"
#include "moetax/store.h"
#ifdef MOETAX_WITH_MPI
#include "dist/dist.h"
#endif

/* The gate, up and down matrices of expert e for this worker: from the mapping,
 * or acquired from the expert store (blocking only this worker, booked to
 * `load`) and held until release_experts at the end of the block. false on a
 * read error (recorded with fw_fail). */
static bool expert_ptrs(struct worker *w, struct moe *b, int il, int32_t e, const void **gate, const void **up, const void **down) {
    struct fw_step *s = w->s;
    const struct moetax_layer *l = &s->m->layers[il];
    if (!b->store) {
        /* fused gate_up: gate_exps and up_exps share the fused tensor's 2F-row stride, up
         * starting F rows in (see src/model/arch_deepseek2.c), so one formula serves both layouts */
        *gate = (const char *)l->gate_exps.data + (size_t)e * l->gate_exps.mat_bytes;
        *up = (const char *)l->up_exps.data + (size_t)e * l->up_exps.mat_bytes;
        *down = (const char *)l->down_exps.data + (size_t)e * l->down_exps.mat_bytes;
        return true;
    }
    struct moe_worker *wk = &b->wk[w->ith];
    if (!wk->acq[e]) {
        enum moetax_phase prev = w->lph;
        fw_mark(w, MOETAX_PHASE_LOAD);
        const void *ptrs[4];
        moetax_status st = moetax_store_acquire(b->store, il, e, ptrs, NULL);
        fw_mark(w, prev);
        if (st) {
            fw_fail(w->s, st);
            return false;
        }
        if (l->fused_gate_up) {
            wk->eptr[e][0] = ptrs[0];
            wk->eptr[e][1] = (const char *)ptrs[0] + (size_t)s->m->hp.n_ff_exp * l->gate_exps.row_bytes;
            wk->eptr[e][2] = ptrs[1];
        } else {
            wk->eptr[e][0] = ptrs[0];
            wk->eptr[e][1] = ptrs[1];
            wk->eptr[e][2] = ptrs[2];
        }
        wk->acq[e] = 1;
        wk->acq_list[wk->n_acq++] = e;
    }
    *gate = wk->eptr[e][0];
    *up = wk->eptr[e][1];
    *down = wk->eptr[e][2];
    return true;
}

static void release_experts(struct worker *w, struct moe *b, int il) {
    struct moe_worker *wk = &b->wk[w->ith];
    for (int i = 0; i < wk->n_acq; i++) {
        moetax_store_release(b->store, il, wk->acq_list[i]);
        wk->acq[wk->acq_list[i]] = 0;
    }
    wk->n_acq = 0;
}

/* One token: the k expert hidden rows of b->eh prepared in this worker's own slot. */
static const struct act *own_eh(struct worker *w, struct moe *b, int64_t k) {
    struct moe_worker *wk = &b->wk[w->ith];
    wk->own_eh.x = b->eh;
    wk->own_eh.ncols = w->s->m->hp.n_ff_exp;
    wk->own_eh.n = k;
    fw_act_prep(w->s, &wk->own_eh, 0, k);
    return &wk->own_eh;
}

/* A token's routing probabilities p [E] and selection scores s [E] (bias added, experts
 * of the groups it may not use at -inf). */
static void token_scores(const struct moetax_kernels *K, const struct moetax_hparams *hp, const float *bias,
                         const float *logits, float *p, float *s) {
    const int64_t E = hp->n_expert;
    memcpy(p, logits, sizeof(float) * (size_t)E);
    if (hp->gating_func == 2) K->sigmoid(p, E);
    else K->softmax(p, E, NULL);
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
}

/* Route token logits [E] -> k experts and weights (GGUF-MOE.md "The MoE block"). */
static void route_token(const struct moetax_kernels *K, const struct moetax_hparams *hp, int64_t k, const float *bias,
                        const float *logits, float *p, float *s, int32_t *idx, float *wout) {
    const int64_t E = hp->n_expert;
    token_scores(K, hp, bias, logits, p, s);
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

/* Route the micro-batch's tokens into sel/selw [n, k] (scratch: wk->f). */
static void route_tokens(const struct fw_step *s, const struct moe *b, struct moe_worker *wk, int il, int32_t *sel,
                         float *selw) {
    const struct moetax_hparams *hp = &s->m->hp;
    const struct moetax_layer *l = &s->m->layers[il];
    const int64_t E = hp->n_expert, k = b->k, n = s->n;
    float *p = wk->f, *sc = wk->f + E;
    for (int64_t t = 0; t < n; t++)
        route_token(s->K, hp, k, l->exp_probs_b, b->router + t * E, p, sc, sel + t * k, selw + t * k);
}

static int cmp_u64(const void *a, const void *b) {
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return (x > y) - (x < y);
}

/* The capacity factor (worker 0, a batch of n tokens with router logits router [n, E]): each
 * expert takes at most ceil(C n k / E) assignments of the micro-batch, those of the highest
 * routing weights. The others are
 * moved to the token's best other expert with room (reroute: weight scaled by the
 * probability ratio) or dropped (sel -1; the token's remaining weights scaled back to its
 * total). Counts into *dropped and *rerouted. */
static void apply_capacity(const struct fw_step *s, struct moe *b, int il, int64_t n, const float *router, int32_t *sel,
                           float *selw, int64_t *dropped, int64_t *rerouted) {
    const struct moetax_hparams *hp = &s->m->hp;
    const struct moetax_layer *l = &s->m->layers[il];
    const int64_t E = hp->n_expert, k = b->k, nk = n * k;
    const double capd = ceil((double)b->capacity_factor * (double)nk / (double)E);
    const int32_t cap = capd < 1 ? 1 : capd > (double)nk ? (int32_t)nk : (int32_t)capd;
    int32_t *count = b->cap_count;
    uint64_t *order = b->cap_order;
    memset(count, 0, sizeof(int32_t) * (size_t)E);
    for (int64_t i = 0; i < nk; i++) { /* weights are >= 0: their bits order like the values */
        uint32_t bits;
        memcpy(&bits, &selw[i], sizeof bits);
        order[i] = ((uint64_t)~bits << 32) | (uint64_t)i; /* ascending: highest weight first, then slot */
    }
    qsort(order, (size_t)nk, sizeof *order, cmp_u64);
    int64_t n_over = 0;
    for (int64_t j = 0; j < nk; j++) {
        const int64_t i = (int64_t)(order[j] & 0xffffffffu);
        if (count[sel[i]] < cap) count[sel[i]]++;
        else order[n_over++] = (uint64_t)i; /* overflowing, still by weight */
    }
    if (!n_over) return;
    float *tot = b->cap_tot; /* each touched token's weight total before */
    for (int64_t j = 0; j < n_over; j++) {
        const int64_t t = (int64_t)order[j] / k;
        float sum = 0;
        for (int64_t q = 0; q < k; q++) sum += selw[t * k + q] > 0 && sel[t * k + q] >= 0 ? selw[t * k + q] : 0;
        if (tot[t] < 0) tot[t] = sum;
    }
    float *p = b->cap_p, *sc = b->cap_p + E;
    for (int64_t j = 0; j < n_over; j++) {
        const int64_t i = (int64_t)order[j], t = i / k;
        const int32_t e = sel[i];
        int32_t best = -1;
        if (b->reroute) {
            token_scores(s->K, hp, l->exp_probs_b, router + t * E, p, sc);
            for (int32_t c = 0; c < E; c++) {
                if (count[c] >= cap || sc[c] == -INFINITY) continue;
                bool mine = false;
                for (int64_t q = 0; q < k && !mine; q++) mine = sel[t * k + q] == c;
                if (!mine && (best < 0 || sc[c] > sc[best])) best = c;
            }
        }
        if (best >= 0) {
            selw[i] = p[e] > 0 ? selw[i] * (p[best] / p[e]) : selw[i];
            sel[i] = best;
            count[best]++;
            (*rerouted)++;
        } else {
            sel[i] = -1;
            selw[i] = 0;
            (*dropped)++;
        }
    }
    for (int64_t j = 0; j < n_over; j++) { /* renormalise each touched token once, back to its total */
        const int64_t t = (int64_t)order[j] / k;
        if (tot[t] < 0) continue;
        float sum = 0;
        for (int64_t q = 0; q < k; q++) sum += sel[t * k + q] >= 0 ? selw[t * k + q] : 0;
        if (sum > 0)
            for (int64_t q = 0; q < k; q++) selw[t * k + q] *= tot[t] / sum;
        tot[t] = -1;
    }
}

/* The dispatch plan of sel/selw [n, k]: slots grouped by expert (ascending), tokens in
 * order; assignments with expert -1 (dropped) get no slot. */
static void plan(const struct fw_step *s, const struct moe *b, int il, const int32_t *sel, const float *selw,
                 int64_t n, struct plan *pl) {
    const struct moetax_hparams *hp = &s->m->hp;
    const int64_t E = hp->n_expert, k = b->k;
    memset(pl->count, 0, sizeof(int32_t) * (size_t)E);
    pl->n_slots = 0;
    for (int64_t i = 0; i < n * k; i++)
        if (sel[i] >= 0) pl->count[sel[i]]++, pl->n_slots++;
    pl->n_active = 0;
    int32_t off = 0;
    for (int32_t e = 0; e < E; e++) {
        pl->offset[e] = off;
        if (pl->count[e]) pl->active[pl->n_active++] = e;
        off += pl->count[e];
    }
    /* expert parallelism: this rank's (token-sharded: every slot of the records it received) */
    const int32_t *own = b->owner && !b->ep ? b->owner + (int64_t)il * E : NULL;
    pl->n_mine = 0;
#ifdef MOETAX_WITH_MPI
    if (b->dist && b->dist->n_rep && !b->ep) { /* replicas: this rank's part of each expert it hosts */
        /* the layer's hosts from this micro-batch's own counts, which every rank has (each routes
         * every token), so every rank plans the same, no message; into the plan's own arrays (one
         * token: every worker plans its own copy, without a barrier) */
        moetax_dist_plan_micro(b->dist, il, pl->count, pl->rep_nh, pl->rep_hosts, pl->part);
        for (int32_t a = 0; a < pl->n_active; a++) {
            const int32_t e = pl->active[a];
            int32_t lo, c;
            moetax_dist_host_range_in(b->dist, pl->rep_nh, pl->rep_hosts, e, pl->part, b->rank, &lo, &c);
            if (!c) continue;
            pl->m_off[pl->n_mine] = pl->offset[e] + lo;
            pl->m_cnt[pl->n_mine] = c;
            pl->mine[pl->n_mine++] = e;
        }
        own = NULL;
    } else
#endif
    for (int32_t a = 0; a < pl->n_active; a++)
        if (!own || own[pl->active[a]] == b->rank) {
            pl->m_off[pl->n_mine] = pl->offset[pl->active[a]];
            pl->m_cnt[pl->n_mine] = pl->count[pl->active[a]];
            pl->mine[pl->n_mine++] = pl->active[a];
        }
    int32_t *fill = pl->fill; /* next free slot per expert */
    memcpy(fill, pl->offset, sizeof(int32_t) * (size_t)E);
    for (int64_t t = 0; t < n; t++)
        for (int64_t j = 0; j < k; j++) {
            int32_t e = sel[t * k + j];
            if (e < 0) continue;
            int32_t slot = fill[e]++;
            pl->slot_token[slot] = (int32_t)t;
            pl->slot_w[slot] = selw[t * k + j];
        }
}

/* Worker 0: the layer's batch figures for the ledger (distinct experts, bytes, imbalance). */
static void record_plan(const struct fw_step *s, int il, const struct plan *pl, int64_t dropped, int64_t rerouted) {
    if (!moetax_ledger_enabled(s->ledger)) return;
    const struct moetax_layer *l = &s->m->layers[il];
    const int64_t F = s->m->hp.n_ff_exp;
    const double eb = (double)(l->gate_exps.row_bytes + l->up_exps.row_bytes) * (double)F + (double)l->down_exps.mat_bytes;
    int32_t mx = 0;
    for (int32_t a = 0; a < pl->n_active; a++) mx = pl->count[pl->active[a]] > mx ? pl->count[pl->active[a]] : mx;
    moetax_ledger_moe(s->ledger, il, pl->n_active, mx, pl->n_slots, eb * pl->n_active, dropped, rerouted);
}

/* copy prepared row `src_row` of a into row `dst_row` of b (same ncols) */
static void copy_prepared_row(const struct fw_step *s, const struct act *a, int64_t src_row, struct act *b,
                              int64_t dst_row) {
    const int64_t nc = a->ncols;
    memcpy((float *)b->x + dst_row * nc, a->x + src_row * nc, sizeof(float) * (size_t)nc);
    if (s->m->has_q8_0) {
        size_t rb = moetax_act_size(MOETAX_TYPE_Q8_0, nc, 1);
        memcpy((char *)b->q8 + (size_t)dst_row * rb, (const char *)a->q8 + (size_t)src_row * rb, rb);
    }
    if (s->m->has_q4_0) {
        size_t rb = moetax_act_size(MOETAX_TYPE_Q4_0, nc, 1);
        memcpy((char *)b->q4 + (size_t)dst_row * rb, (const char *)a->q4 + (size_t)src_row * rb, rb);
    }
    if (fw_act_has_qk(b)) { /* b's k-quant rows are read from its slot: a's must be prepared too */
        MOETAX_ASSERT(fw_act_has_qk(a));
        size_t rb = moetax_act_size(FW_ACT_KQ_TYPE, nc, 1);
        memcpy((char *)b->qk + (size_t)dst_row * rb, (const char *)a->qk + (size_t)src_row * rb, rb);
    }
}

/* The router guess: the experts layer T would pick for token t when its router is applied to
 * the token's residual now, into idx [k]; with margins (optional) also their score margins
 * (moe/readahead.h). */
static void router_guess(const struct fw_step *s, struct moe *b, int T, int64_t t, int32_t *idx, float *margins) {
    const struct moetax_hparams *hp = &s->m->hp;
    const struct moetax_layer *nl = &s->m->layers[T];
    const int64_t d = hp->n_embd, E = hp->n_expert, k = b->k;
    s->K->rmsnorm(b->pred_x, s->x + t * d, nl->ffn_norm, d, hp->rms_eps);
    struct act a = {.x = b->pred_x, .ncols = d, .n = 1, .q8 = b->pred_q, .q4 = b->pred_q};
    if (moetax_act_is_q8_0(nl->gate_inp.type) || moetax_act_is_q4_0(nl->gate_inp.type))
        s->K->quantize_act(nl->gate_inp.type, b->pred_x, d, d, 1, b->pred_q);
    fw_matmul(s, &nl->gate_inp, 0, 0, E, &a, 0, 1, b->pred_logits, E);
    float wdummy[256];
    route_token(s->K, hp, k, nl->exp_probs_b, b->pred_logits, b->pred_p, b->pred_p + E, idx, wdummy);
    if (margins) moe_ra_margins(b->pred_p + E, E, idx, k, margins);
}

void moe_offer(struct moe *b, int64_t E, int T, int a, const int32_t *experts, const float *margins, int n) {
    int32_t e[512];
    float m[512];
    int j = 0;
    for (int i = 0; i < n && j < 512; i++) {
        if (experts[i] < 0 || experts[i] >= E || (b->owner && b->owner[(int64_t)T * E + experts[i]] != b->rank))
            continue;
        e[j] = experts[i];
        m[j++] = margins[i];
    }
    moe_ra_offer(&b->ra, T, a, e, m, j);
}

/* Decoding's prefetch work: the router guesses for the store, the read-ahead's offers and the
 * queued reads. Skipped once the store holds every expert it registered (nothing is left to
 * read: a budget of the whole model, after its first reads), unless a learned predictor rides on
 * the store (it scores itself against the router guess, as `profile` does on a full store). */
static bool prefetching(const struct moe *b) {
    return b->store && b->prefetch && (!moetax_store_holds_all(b->store) || moetax_store_predictor(b->store));
}

/* Experts layer il+1 would pick when its router is applied to the current
 * residual (what a cross-layer prefetcher would predict); for the report. Decoding with the
 * read-ahead, also the offers of the router guess for il + 1 and, read_ahead >= 2, il + 2 (where
 * no learned predictor makes that one). */
static void predict_next(const struct fw_step *s, struct moe *b, int il) {
    const struct moetax_hparams *hp = &s->m->hp;
    const int64_t k = b->k;
    const bool ra = b->read_ahead > 0 && prefetching(b) && s->n == 1 && k <= 256;
    float mg[256];
    if (il + 1 < hp->n_layer && s->m->layers[il + 1].is_moe) {
        for (int64_t t = 0; t < s->n; t++)
            router_guess(s, b, il + 1, t, b->pred + ((int64_t)(il + 1) * s->n_ubatch + t) * k, ra ? mg : NULL);
        b->pred_ok[il + 1] = true;
        if (ra) moe_offer(b, hp->n_expert, il + 1, 1, b->pred + (int64_t)(il + 1) * s->n_ubatch * k, mg, (int)k);
    }
    if (ra && b->read_ahead >= 2 && il + 2 < hp->n_layer && s->m->layers[il + 2].is_moe) {
        const struct moetax_predictor *p = moetax_store_predictor(b->store);
        if (p && p->use && p->n_layer == hp->n_layer && moetax_predictor_weights(p, il, 2)) return;
        int32_t idx[256];
        router_guess(s, b, il + 2, 0, idx, mg);
        moe_offer(b, hp->n_expert, il + 2, 2, idx, mg, (int)k);
    }
}

#include "moe/predict.h" /* the store's learned predictor (moe_predict_learned) */

/* Worker 0, once the layer's tokens are routed (b->sel / selw): the routing record and
 * the next layer's prediction (for the record and the store). */
static void record_and_predict(const struct fw_step *s, struct moe *b, int il) {
    const int64_t slots = (int64_t)il * s->n_ubatch * b->k;
    bool routing_rec = moetax_ledger_routing_on(s->ledger);
    if (routing_rec)
        moetax_ledger_routing(s->ledger, il, s->n, b->sel + slots, b->selw + slots,
                              b->pred_ok[il] ? b->pred + slots : NULL);
    const bool pf = prefetching(b);
    if (b->read_ahead > 0 && s->n == 1 && pf) {
        moe_ra_score(&b->ra, il, b->sel + slots, (int)b->k);
        /* the guesses below take two router products: this layer's experts are queued first
         * (issue_reads queues them again: a no-op) */
        int32_t mine[256];
        int nm = 0;
        for (int64_t j = 0; j < b->k && nm < 256; j++) {
            const int32_t e = b->sel[slots + j];
            if (e >= 0 && (!b->owner || b->owner[(int64_t)il * s->m->hp.n_expert + e] == b->rank)) mine[nm++] = e;
        }
        moetax_store_prefetch(b->store, il, mine, nm, false);
    }
    if (routing_rec || pf) predict_next(s, b, il);
    if (b->store) moe_predict_learned(s, b, il);
}

/* Worker 0, once the layer is planned (pl): the expert store's reads for this layer's
 * experts and the predicted ones of the next layer. */
static void issue_reads(struct worker *w, struct moe *b, int il, const struct plan *pl) {
    struct fw_step *s = w->s;
    const struct moetax_hparams *hp = &s->m->hp;
    const int64_t E = hp->n_expert, k = b->k, n = s->n;
    if (prefetching(b)) {
        /* reads for all of this layer's experts now, in parallel (other items proceed while
         * they load), then the experts the next layer's router predicts from this residual.
         * Without prefetch each expert is read only when a work item needs it. */
        fw_mark(w, MOETAX_PHASE_LOAD);
        moetax_store_prefetch(b->store, il, pl->mine, pl->n_mine, false); /* this rank's experts only */
        if (b->read_ahead > 0 && n == 1) {
            /* decoding: the offers for the next layers, by confidence, as the disk has room */
            moe_ra_issue(&b->ra, b->store, il, b->read_ahead);
        } else if (il + 1 < hp->n_layer && b->pred_ok[il + 1]) {
            /* the cross-layer prediction, ranked by recent-token history: first the predicted
             * experts that layer il + 1 also chose for the last micro-batch (b->sel still holds
             * that routing: this step has not reached il + 1), then the other predicted ones,
             * each in the router's order. The store reads from the front while I/O is idle.
             * Experts the history alone names are not read: on random routing only k / E of
             * them are used again, and each read of one would evict a cached expert. */
            int32_t *uniq = b->wk[w->ith].plan.fill; /* scratch [E]: this worker's plan is made */
            const int32_t *pred = b->pred + (int64_t)(il + 1) * s->n_ubatch * k;
            const int32_t *hist = b->sel + (int64_t)(il + 1) * s->n_ubatch * k;
            const int64_t nhist = b->hist_n[il + 1] * k;
            int nu = 0;
            for (int pass = 0; pass < 2; pass++)
                for (int64_t i = 0; i < n * k; i++) {
                    int32_t e = pred[i];
                    bool recent = false, seen = false;
                    for (int64_t j = 0; j < nhist && !recent; j++) recent = hist[j] == e;
                    if (recent != (pass == 0)) continue;
                    for (int j = 0; j < nu && !seen; j++) seen = uniq[j] == e;
                    if (!seen && nu < E && (!b->owner || b->owner[(int64_t)(il + 1) * E + e] == b->rank)) uniq[nu++] = e;
                }
            moetax_store_prefetch(b->store, il + 1, uniq, nu, true);
        }
        fw_mark(w, MOETAX_PHASE_DISPATCH);
    }
}

/* Expert parallelism: block [d0, d1) of the residual gets the routed experts' sum, from
 * all of ydown (gathered: the single process's order) or from the ranks' partial sums. */
static void dist_combine_block(const struct fw_step *s, const struct moe *b, const struct plan *pl, int64_t d0,
                               int64_t d1) {
    const int64_t d = s->m->hp.n_embd;
    if (b->partial)
        for (int64_t t = 0; t < s->n; t++) s->K->axpy(s->x + t * d + d0, 1.0f, b->partial + t * d + d0, d1 - d0);
    else s->K->scatter_add(s->x + d0, d, b->ydown + d0, d, pl->slot_token, pl->slot_w, pl->n_slots, d1 - d0);
}

/* Expert parallelism: ends the down phase; worker 0 waits for the other ranks (MPI_Barrier,
 * booked to `wait`), then runs the combine's collective (`comm`) while the other workers
 * wait at the barrier that ends this phase. */
static void dist_exchange(struct worker *w, struct moe *b, int il, const struct plan *pl) {
    fw_phase_end(w);
    fw_phase_begin(w, MOETAX_PHASE_COMM, il);
#ifdef MOETAX_WITH_MPI
    struct fw_step *s = w->s;
    struct moetax_dist *D = b->dist;
    if (w->ith == 0) {
        fw_mark(w, MOETAX_PHASE_WAIT);
        moetax_status st = moetax_dist_barrier(D, il);
        fw_mark(w, MOETAX_PHASE_COMM);
        const int64_t d = s->m->hp.n_embd;
        if (!st && D->n_rep) moetax_dist_account_in(D, il, pl->rep_nh, pl->rep_hosts, pl->count, pl->part); /* the work counts */
        if (!st && b->partial) st = moetax_dist_allreduce(D, b->partial, s->n * d);
        else if (!st) {
            /* rank r's rows: its active experts' slots, ascending. Contiguous ranges: slots
             * [slot_lo[r], slot_lo[r + 1]) of ydown in place; any other placement: packed by
             * rank into gbuf, gathered, and put back in slot order (the same bits either way) */
            const int32_t *own = b->owner + (int64_t)il * s->m->hp.n_expert;
            int64_t acc = 0;
            if (D->n_rep) { /* replicas: rank r's parts of its experts, ascending */
                for (int r = 0; r < D->size; r++) {
                    b->slot_lo[r] = acc;
                    for (int32_t ai = 0; ai < pl->n_active; ai++) {
                        int32_t lo, c;
                        moetax_dist_host_range_in(D, pl->rep_nh, pl->rep_hosts, pl->active[ai], pl->part, r, &lo, &c);
                        acc += c;
                    }
                }
                b->slot_lo[D->size] = acc;
                int64_t o = b->slot_lo[D->rank];
                for (int32_t i = 0; i < pl->n_mine; i++) {
                    memcpy(b->gbuf + o * d, b->ydown + (int64_t)pl->m_off[i] * d, sizeof(float) * (size_t)(pl->m_cnt[i] * d));
                    o += pl->m_cnt[i];
                }
                st = moetax_dist_gather_rows(D, b->gbuf, d, b->slot_lo);
                for (int r = 0; !st && r < D->size; r++) {
                    o = b->slot_lo[r];
                    for (int32_t ai = 0; ai < pl->n_active; ai++) {
                        const int32_t e = pl->active[ai];
                        int32_t lo, c;
                        moetax_dist_host_range_in(D, pl->rep_nh, pl->rep_hosts, e, pl->part, r, &lo, &c);
                        if (c && r != D->rank)
                            memcpy(b->ydown + (int64_t)(pl->offset[e] + lo) * d, b->gbuf + o * d,
                                   sizeof(float) * (size_t)(c * d));
                        o += c;
                    }
                }
            } else {
            for (int r = 0; r < D->size; r++) {
                b->slot_lo[r] = acc;
                for (int32_t ai = 0; ai < pl->n_active; ai++)
                    if (own[pl->active[ai]] == r) acc += pl->count[pl->active[ai]];
            }
            b->slot_lo[D->size] = acc;
            if (D->contiguous) st = moetax_dist_gather_rows(D, b->ydown, d, b->slot_lo);
            else {
                int64_t o = b->slot_lo[D->rank];
                for (int32_t i = 0; i < pl->n_mine; i++) {
                    const int32_t e = pl->mine[i];
                    memcpy(b->gbuf + o * d, b->ydown + (int64_t)pl->offset[e] * d, sizeof(float) * (size_t)(pl->count[e] * d));
                    o += pl->count[e];
                }
                st = moetax_dist_gather_rows(D, b->gbuf, d, b->slot_lo);
                for (int r = 0; !st && r < D->size; r++) {
                    o = b->slot_lo[r];
                    for (int32_t ai = 0; ai < pl->n_active; ai++) {
                        const int32_t e = pl->active[ai];
                        if (own[e] != r) continue;
                        if (r != D->rank)
                            memcpy(b->ydown + (int64_t)pl->offset[e] * d, b->gbuf + o * d,
                                   sizeof(float) * (size_t)(pl->count[e] * d));
                        o += pl->count[e];
                    }
                }
            }
            }
        }
        if (st) fw_fail(s, st);
    }
#else
    (void)b; (void)pl;
#endif
    fw_phase_end(w);
}

/* ---- expert parallelism: token-sharded dispatch (src/dist/dist.h) ----------------------- */

#ifdef MOETAX_WITH_MPI
static bool plan_alloc(struct plan *pl, int64_t E, int64_t slots, int64_t H);
static void plan_free(struct plan *pl);

enum { EP_GROUPS = 2 }; /* micro-batches of the layer's tokens in flight at once (overlap) */
enum ep_row { EP_ROW_F32, EP_ROW_Q8, EP_ROW_Q4 }; /* the input row a record carries */

/* One micro-batch of this rank's tokens: its records out (by destination rank, tokens
 * ascending within a rank), the records in, the partial sums back. */
struct ep_group {
    int32_t t0, t1;               /* its local tokens [t0, t1) */
    int *cnt;                     /* [9 * P]: the two exchanges' counts and displacements */
    uint8_t *sbuf, *rbuf;         /* records out [U * P], in [U * P] */
    int32_t n_rec, *rec_tok;      /* records out, the local token of each [U * P] */
    int32_t *rec_lo;              /* [P + 1] first record out of each destination rank */
    float *ret;                   /* [U * P, d] partial sum of each record out (self: computed here) */
    float *out;                   /* [U * P, d] partial sums of the records in, to return */
    struct moetax_dist_a2a xd, xc; /* dispatch, combine */
    void *req_d, *req_c;          /* their MPI requests */
    bool pd, pc;                  /* overlap: dispatch / combine posted (not after an error) */
};

struct moe_ep {
    int P, n_groups;
    bool overlap;
    enum ep_row row;
    size_t row_bytes, hdr_bytes, rec_bytes;
    struct ep_group g[EP_GROUPS];
    /* the unit being computed: records from any rank, the partial sum row of each */
    const uint8_t **u_rec;        /* [2 P U] */
    float **u_out;                /* [2 P U] */
    int32_t u_n;
    int32_t *u_sel;               /* [2 P U k] */
    float *u_selw;
    struct plan plan;
    float *eh, *eh_g, *ydown;     /* [P U k, F], [P U k, F], [P U k, d] */
    struct act a_exp, a_eh;
    float *sh_out;                /* [U, d] the shared experts' output */
    int32_t *cnt_e;               /* [E] assignments of the layer on this rank (the ledger's figures) */
    int32_t cnt_slots;
    int32_t *dest;                /* [U k] the rank computing each assignment of this rank's tokens */
    /* the layer's global view (ep_global: with replicas or a capacity factor) */
    int32_t *g_cnt;               /* [P, E] assignments of each rank's tokens per expert */
    int32_t *g_count, *g_part;    /* [E] all ranks' per expert, [E, H] the split over its hosts */
    int32_t *g_flow, *g_used;     /* [E, H] how many of this rank's go to each host, [E] taken so far */
    float *g_router;              /* [P U, E] capacity: every rank's router logits, batch order */
    int32_t *g_sel;               /* [P U, k] */
    float *g_selw;
    int32_t *g_src;               /* [P U] capacity: each global token's rank, then local index (2 each) */
    uint8_t *g_send, *g_recv;     /* [U (1 + E) 4], [P U (1 + E) 4] the allgather's bytes */
    int *g_bytes;                 /* [P] */
    uint64_t *g_key;              /* [P U] batch index << 32 | row */
    bool global, cap;             /* ep_global runs (replicas or a capacity factor); the latter */
    int64_t dropped, rerouted;    /* the layer's, over every rank's tokens (the same on every rank) */
};

/* record layout: int32 ids[k] (-1: none), float w[k], padded to 16 bytes, then the row */
static int32_t *rec_ids(const uint8_t *r) { return (int32_t *)(void *)r; }
static float *rec_w(const uint8_t *r, int64_t k) { return (float *)(void *)(r + 4 * k); }

/* Worker 0: pack group g's records (tokens [t0, t1) of the routing sel / selw) and count
 * the bytes against once-per-expert dispatch. */
static void ep_pack(const struct fw_step *s, struct moe *b, int il, struct ep_group *g, const int32_t *sel,
                    const float *selw) {
    struct moe_ep *ep = b->ep;
    struct moetax_dist *D = b->dist;
    const int64_t k = b->k, E = s->m->hp.n_expert, d = s->m->hp.n_embd, P = ep->P;
    const int32_t *own = b->owner + (int64_t)il * E;
    int *scount = g->cnt, *sdispl = g->cnt + P;
    /* the rank of each assignment: the expert's owner, or with replicas its flows' hosts in
     * turn (ep_global; groups are packed in token order, so the counts run on across them) */
    int32_t *dest = ep->dest;
    const int H = D->n_rep ? D->H : 1;
    for (int64_t i = (int64_t)g->t0 * k; i < (int64_t)g->t1 * k; i++) {
        const int32_t e = sel[i];
        dest[i] = e < 0 ? -1 : own[e];
        if (e < 0 || !D->n_rep || D->n_hosts[(int64_t)il * E + e] == 1) continue;
        int32_t u = ep->g_used[e]++, j = 0;
        while (j < H - 1 && u >= ep->g_flow[e * H + j]) u -= ep->g_flow[e * H + j++];
        dest[i] = D->hosts[((int64_t)il * E + e) * H + j];
    }
    g->n_rec = 0;
    uint64_t remote_pairs = 0;
    for (int r = 0; r < P; r++) {
        g->rec_lo[r] = g->n_rec;
        sdispl[r] = (int)((size_t)g->n_rec * ep->rec_bytes);
        for (int32_t t = g->t0; t < g->t1; t++) {
            int n_here = 0;
            for (int64_t j = 0; j < k; j++) n_here += dest[t * k + j] == r;
            if (!n_here) continue;
            uint8_t *rec = g->sbuf + (size_t)g->n_rec * ep->rec_bytes;
            int32_t *ids = rec_ids(rec);
            float *w = rec_w(rec, k);
            for (int64_t j = 0; j < k; j++) {
                const bool here = dest[t * k + j] == r;
                ids[j] = here ? sel[t * k + j] : -1;
                w[j] = here ? selw[t * k + j] : 0.0f;
            }
            const void *src = ep->row == EP_ROW_Q8 ? (const char *)s->a_in.q8 + (size_t)t * ep->row_bytes
                            : ep->row == EP_ROW_Q4 ? (const char *)s->a_in.q4 + (size_t)t * ep->row_bytes
                            : (const void *)(s->a_in.x + t * d);
            memcpy(rec + ep->hdr_bytes, src, ep->row_bytes);
            g->rec_tok[g->n_rec++] = t;
            if (r != D->rank) remote_pairs += (uint64_t)n_here;
        }
        scount[r] = (int)((size_t)(g->n_rec - g->rec_lo[r]) * ep->rec_bytes);
    }
    g->rec_lo[P] = g->n_rec;
    const uint64_t remote_recs = (uint64_t)(g->n_rec - (g->rec_lo[D->rank + 1] - g->rec_lo[D->rank]));
    /* both directions: records out and partial sums back */
    D->a2a_bytes_rank += remote_recs * (ep->rec_bytes + (uint64_t)d * sizeof(float));
    D->a2a_bytes_expert += remote_pairs * (ep->row_bytes + 2 * sizeof(int32_t) + (uint64_t)d * sizeof(float));
    D->n_records += remote_recs;
    g->xd = (struct moetax_dist_a2a){.scount = scount, .sdispl = sdispl, .rcount = g->cnt + 2 * P,
                                     .rdispl = g->cnt + 3 * P, .sbuf = g->sbuf, .rbuf = g->rbuf,
                                     .rcap = (int64_t)(P * s->n_ubatch) * (int64_t)ep->rec_bytes, .layer = il,
                                     .what = "dispatch", .req = g->req_d};
}

/* Worker 0, every rank (one collective): the layer's view over every rank's tokens.
 * - A capacity factor: every rank's router logits of the micro-batch are gathered, each with
 *   its token's index in the batch; every rank routes all of them in the batch's order and
 *   applies the capacity to the whole step (its cap from all the step's tokens), then keeps its
 *   own tokens' result in sel / selw [n, k]. So every rank drops and reroutes the same
 *   assignments and counts them alike (*dropped, *rerouted: the step's), and a step that is the
 *   single process's micro-batch (a batch within n_ubatch, or one rank's sequences) drops what
 *   the single process drops.
 * - Else (replicas): the per-expert counts of each rank's tokens are gathered.
 * Replicas then: the global counts are split over each expert's hosts as the replicated dispatch
 * splits them (moetax_dist_split), this rank's flows follow (moetax_dist_flows: a host keeps its
 * own first), and the work is booked (the same on every rank, so every rank re-plans alike). */
static moetax_status ep_global(struct worker *w, struct moe *b, int il, int32_t *sel, float *selw, int64_t *dropped,
                               int64_t *rerouted) {
    struct fw_step *s = w->s;
    struct moe_ep *ep = b->ep;
    struct moetax_dist *D = b->dist;
    const struct moetax_hparams *hp = &s->m->hp;
    const struct moetax_layer *l = &s->m->layers[il];
    const int64_t E = hp->n_expert, k = b->k, n = s->n;
    const int P = ep->P, me = D->rank;
    const enum moetax_phase prev = w->lph;
    moetax_status st = MOETAX_OK;
    if (!s->ep_n || s->ep_n[me] != n)
        return moetax_error(MOETAX_ERR_INTERNAL, "rank %d: layer %d: the micro-batch's token counts are missing", me, il);
    fw_mark(w, MOETAX_PHASE_WAIT);
    memset(ep->g_cnt, 0, sizeof(int32_t) * (size_t)(P * E));
    if (ep->cap) {
        const size_t rb = (size_t)(1 + E) * 4;
        int64_t N = 0, first[513];
        for (int r = 0; r < P; r++) {
            ep->g_bytes[r] = (int)((size_t)s->ep_n[r] * rb);
            first[r] = N;
            N += s->ep_n[r];
        }
        first[P] = N;
        for (int64_t t = 0; t < n; t++) {
            const int32_t gi = s->gidx ? s->gidx[t] : (int32_t)t;
            memcpy(ep->g_send + (size_t)t * rb, &gi, 4);
            memcpy(ep->g_send + (size_t)t * rb + 4, b->router + t * E, sizeof(float) * (size_t)E);
        }
        st = moetax_dist_allgather(D, ep->g_send, ep->g_recv, ep->g_bytes, il, "capacity's router logits");
        if (st) goto out;
        for (int64_t i = 0; i < N; i++) { /* the batch's order */
            int32_t gi;
            memcpy(&gi, ep->g_recv + (size_t)i * rb, 4);
            ep->g_key[i] = (uint64_t)(uint32_t)gi << 32 | (uint64_t)i;
        }
        qsort(ep->g_key, (size_t)N, sizeof *ep->g_key, cmp_u64);
        for (int64_t t = 0, r = 0; t < N; t++) {
            const int64_t i = (int64_t)(ep->g_key[t] & 0xffffffffu);
            for (r = 0; r < P && i >= first[r + 1]; r++) {}
            ep->g_src[2 * t] = (int32_t)r;
            ep->g_src[2 * t + 1] = (int32_t)(i - first[r]);
            memcpy(ep->g_router + t * E, ep->g_recv + (size_t)i * rb + 4, sizeof(float) * (size_t)E);
            route_token(s->K, hp, k, l->exp_probs_b, ep->g_router + t * E, b->cap_p, b->cap_p + E, ep->g_sel + t * k,
                        ep->g_selw + t * k);
        }
        apply_capacity(s, b, il, N, ep->g_router, ep->g_sel, ep->g_selw, dropped, rerouted);
        for (int64_t t = 0; t < N; t++) {
            const int32_t r = ep->g_src[2 * t], li = ep->g_src[2 * t + 1];
            for (int64_t j = 0; j < k; j++)
                if (ep->g_sel[t * k + j] >= 0) ep->g_cnt[(int64_t)r * E + ep->g_sel[t * k + j]]++;
            if (r != me) continue;
            memcpy(sel + (int64_t)li * k, ep->g_sel + t * k, sizeof(int32_t) * (size_t)k);
            memcpy(selw + (int64_t)li * k, ep->g_selw + t * k, sizeof(float) * (size_t)k);
        }
    } else {
        int32_t *mine = (int32_t *)(void *)ep->g_send;
        memset(mine, 0, sizeof(int32_t) * (size_t)E);
        for (int64_t i = 0; i < n * k; i++)
            if (sel[i] >= 0) mine[sel[i]]++;
        for (int r = 0; r < P; r++) ep->g_bytes[r] = (int)(sizeof(int32_t) * (size_t)E);
        st = moetax_dist_allgather(D, mine, ep->g_cnt, ep->g_bytes, il, "replicas' counts");
        if (st) goto out;
    }
    for (int64_t e = 0; e < E; e++) {
        ep->g_count[e] = 0;
        for (int r = 0; r < P; r++) ep->g_count[e] += ep->g_cnt[(int64_t)r * E + e];
    }
    if (D->n_rep) {
        const int H = D->H;
        int32_t c[512];
        moetax_dist_plan_now(D, il, ep->g_count, ep->g_cnt); /* this micro-batch's replicas */
        moetax_dist_split(D, il, ep->g_count, ep->g_part);
        for (int64_t e = 0; e < E; e++) {
            ep->g_used[e] = 0;
            if (D->n_hosts[(int64_t)il * E + e] == 1) continue;
            for (int r = 0; r < P && r < 512; r++) c[r] = ep->g_cnt[(int64_t)r * E + e];
            moetax_dist_flows(D, il, (int)e, c, ep->g_part + e * H, me, ep->g_flow + e * H);
        }
        moetax_dist_account(D, il, ep->g_count, ep->g_part);
    }
out:
    fw_mark(w, prev);
    return st;
}

/* Worker 0, once group g's records have arrived: the combine's exchange (partial sums of
 * the records in go back to their ranks, into ret at the records' own places). */
static void ep_prep_combine(const struct fw_step *s, struct moe *b, int il, struct ep_group *g) {
    struct moe_ep *ep = b->ep;
    const int64_t P = ep->P, d = s->m->hp.n_embd;
    const int *rcount = g->cnt + 2 * P, *rdispl = g->cnt + 3 * P;
    int *bs = g->cnt + 4 * P, *bsd = g->cnt + 5 * P, *brd = g->cnt + 6 * P, *bexp = g->cnt + 7 * P;
    const size_t rowb = (size_t)d * sizeof(float);
    for (int r = 0; r < P; r++) {
        bs[r] = (int)((size_t)rcount[r] / ep->rec_bytes * rowb);
        bsd[r] = (int)((size_t)rdispl[r] / ep->rec_bytes * rowb);
        bexp[r] = r == b->rank ? 0 : (int)((size_t)(g->rec_lo[r + 1] - g->rec_lo[r]) * rowb);
        brd[r] = (int)((size_t)g->rec_lo[r] * rowb);
    }
    g->xc = (struct moetax_dist_a2a){.scount = bs, .sdispl = bsd, .rcount = g->cnt + 8 * P, .rdispl = brd,
                                     .expect = bexp, .sbuf = g->out, .rbuf = g->ret,
                                     .rcap = (int64_t)(P * s->n_ubatch) * (int64_t)rowb, .layer = il,
                                     .what = "combine", .req = g->req_c};
}

/* Worker 0: run exchange x inline (no overlap) or wait for it on the communication thread,
 * booking the time before every rank has arrived to wait and the transfer to comm. */
static void ep_on_counts(void *arg) { fw_mark(arg, MOETAX_PHASE_COMM); }

static moetax_status ep_exchange(struct worker *w, struct moe *b, struct moetax_dist_a2a *x) {
    struct moetax_dist *D = b->dist;
    const enum moetax_phase prev = w->lph;
    const uint64_t t0 = moetax_ledger_now();
    moetax_status st;
    fw_mark(w, MOETAX_PHASE_WAIT);
    if (!b->ep->overlap) {
        x->on_counts = ep_on_counts;
        x->arg = w;
        st = moetax_dist_a2a(D, x);
    } else {
        int state;
        bool comm = false;
        for (int spin = 0; (state = moetax_dist_a2a_state(x)) < 2;) {
            if (state == 1 && !comm) {
                fw_mark(w, MOETAX_PHASE_COMM);
                comm = true;
            }
            if (++spin > 256) {
                struct timespec ts = {0, 10000};
                nanosleep(&ts, NULL);
            } else sched_yield();
        }
        st = moetax_dist_a2a_done(D, x);
    }
    D->ns_blocked += moetax_ledger_now() - t0;
    fw_mark(w, prev);
    return st;
}

/* Worker 0: the dispatch plan of the unit's records (u_rec [0, u_n)): their ids and weights
 * as a routing [u_n, k] (-1: an expert of another rank), slots grouped by expert */
static void ep_unit_plan(const struct fw_step *s, struct moe *b, int il) {
    struct moe_ep *ep = b->ep;
    const int64_t k = b->k;
    for (int32_t i = 0; i < ep->u_n; i++) {
        memcpy(ep->u_sel + i * k, rec_ids(ep->u_rec[i]), sizeof(int32_t) * (size_t)k);
        memcpy(ep->u_selw + i * k, rec_w(ep->u_rec[i], k), sizeof(float) * (size_t)k);
    }
    plan(s, b, il, ep->u_sel, ep->u_selw, ep->u_n, &ep->plan);
    for (int32_t a = 0; a < ep->plan.n_active; a++) ep->cnt_e[ep->plan.active[a]] += ep->plan.count[ep->plan.active[a]];
    ep->cnt_slots += ep->plan.n_slots;
}

/* All workers: this rank's experts for the unit's records, each record's partial sum (its
 * experts ascending) into its u_out row. Five phases. Worker 0 sets the unit (u_rec, u_out,
 * u_n) before it enters the first, whose barrier publishes the plan it makes there. */
static void ep_unit(struct worker *w, struct moe *b, int il) {
    struct fw_step *s = w->s;
    struct moe_ep *ep = b->ep;
    const struct moetax_layer *l = &s->m->layers[il];
    const struct moetax_kernels *K = s->K;
    const int64_t d = s->m->hp.n_embd, F = s->m->hp.n_ff_exp;
    struct plan *pl = &ep->plan;
    int64_t r0, r1;
    fw_phase_begin(w, MOETAX_PHASE_DISPATCH, il);
    if (w->ith == 0) {
        ep_unit_plan(s, b, il);
        issue_reads(w, b, il, pl);
    }
    fw_phase_end(w);
    /* the slots' input rows, grouped by expert */
    fw_phase_begin(w, MOETAX_PHASE_DISPATCH, il);
    struct act ae = fw_act_view(&ep->a_exp, ep->a_exp.x, d, pl->n_slots);
    fw_act_publish(w, &ep->a_exp, &ae);
    fw_split(w, pl->n_slots, 1, &r0, &r1);
    for (int64_t i = r0; i < r1; i++) {
        const uint8_t *src = ep->u_rec[pl->slot_token[i]] + ep->hdr_bytes;
        void *dst = ep->row == EP_ROW_Q8 ? (char *)ae.q8 + (size_t)i * ep->row_bytes
                  : ep->row == EP_ROW_Q4 ? (char *)ae.q4 + (size_t)i * ep->row_bytes
                  : (void *)((float *)ae.x + i * d);
        memcpy(dst, src, ep->row_bytes);
    }
    if (ep->row == EP_ROW_F32) fw_act_prep(s, &ae, r0, r1); /* float rows: any prepared copies the experts read */
    fw_phase_end(w);
    /* gate/up per (expert, block of F rows) */
    fw_phase_begin(w, MOETAX_PHASE_EXPERT, il);
    const int64_t bf = F >= 256 ? 256 : F, nbf = (F + bf - 1) / bf;
    for (int64_t it; (it = fw_chunk(w, (int64_t)pl->n_mine * nbf, 1)) >= 0;) {
        const int32_t e = pl->mine[it / nbf];
        const int64_t f0 = (it % nbf) * bf, f1 = f0 + bf < F ? f0 + bf : F, cnt = pl->count[e];
        float *g = ep->eh_g + (int64_t)pl->offset[e] * F, *u = ep->eh + (int64_t)pl->offset[e] * F;
        const void *wg, *wu, *wd;
        if (!expert_ptrs(w, b, il, e, &wg, &wu, &wd)) continue;
        fw_matmul2_at(s, &l->gate_exps, wg, &l->up_exps, wu, f0, f1, &ep->a_exp, pl->offset[e], cnt, g, u, F);
        for (int64_t i = 0; i < cnt; i++) K->silu_mul(u + i * F + f0, g + i * F + f0, u + i * F + f0, f1 - f0);
    }
    fw_phase_end(w);
    fw_phase_begin(w, MOETAX_PHASE_DISPATCH, il);
    struct act v = fw_act_view(&ep->a_eh, ep->eh, F, pl->n_slots);
    fw_act_publish(w, &ep->a_eh, &v);
    fw_split(w, pl->n_slots, 1, &r0, &r1);
    fw_act_prep(s, &v, r0, r1);
    fw_phase_end(w);
    /* down per block of output rows, then each record's partial sum of the block: its
     * experts in ascending order (slots are grouped by expert), a fixed order */
    fw_phase_begin(w, MOETAX_PHASE_EXPERT, il);
    const int64_t bd = 64, nbd = (d + bd - 1) / bd;
    for (int64_t it; (it = fw_chunk(w, nbd, 1)) >= 0;) {
        const int64_t d0 = it * bd, d1 = d0 + bd < d ? d0 + bd : d;
        for (int32_t ai = 0; ai < pl->n_mine; ai++) {
            const int32_t e = pl->mine[ai];
            const void *wg, *wu, *wd;
            if (!expert_ptrs(w, b, il, e, &wg, &wu, &wd)) continue;
            fw_matmul_at(s, &l->down_exps, wd, d0, d1, &ep->a_eh, pl->offset[e], pl->count[e],
                         ep->ydown + (int64_t)pl->offset[e] * d, d);
        }
        fw_mark(w, MOETAX_PHASE_COMBINE);
        for (int32_t i = 0; i < ep->u_n; i++) memset(ep->u_out[i] + d0, 0, sizeof(float) * (size_t)(d1 - d0));
        for (int32_t i = 0; i < pl->n_slots; i++)
            K->axpy(ep->u_out[pl->slot_token[i]] + d0, pl->slot_w[i], ep->ydown + (int64_t)i * d + d0, d1 - d0);
        fw_mark(w, MOETAX_PHASE_EXPERT);
    }
    fw_phase_end(w);
}

/* Worker 0: the unit of group g's records for this rank itself (self) or from the others */
static void ep_unit_set(struct moe *b, const struct ep_group *g, bool self, int64_t d) {
    struct moe_ep *ep = b->ep;
    if (self)
        for (int32_t j = g->rec_lo[b->rank]; j < g->rec_lo[b->rank + 1]; j++) {
            ep->u_rec[ep->u_n] = g->sbuf + (size_t)j * ep->rec_bytes;
            ep->u_out[ep->u_n++] = g->ret + (int64_t)j * d;
        }
    else {
        int64_t nin = 0;
        for (int r = 0; r < ep->P; r++) nin += g->xd.rcount[r];
        nin /= (int64_t)ep->rec_bytes;
        for (int64_t j = 0; j < nin; j++) {
            ep->u_rec[ep->u_n] = g->rbuf + (size_t)j * ep->rec_bytes;
            ep->u_out[ep->u_n++] = g->out + j * d;
        }
    }
}

static void moe_block_ep(struct worker *w, struct moe *b, int il) {
    struct fw_step *s = w->s;
    struct moe_ep *ep = b->ep;
    const struct moetax_hparams *hp = &s->m->hp;
    const struct moetax_layer *l = &s->m->layers[il];
    const struct moetax_kernels *K = s->K;
    const int64_t n = s->n, d = hp->n_embd, E = hp->n_expert, k = b->k;
    const int64_t Fs = l->gate_sh.data ? l->gate_sh.ne[1] : 0;
    struct moe_worker *wk = &b->wk[w->ith];
    int64_t r0, r1;

    /* 1: router + shared gate/up of this rank's tokens (normed and prepared in s->a_in) */
    fw_phase_begin(w, MOETAX_PHASE_ROUTE, il);
    const int64_t E64 = (E + 63) / 64 * 64;
    while (n > 0 && fw_rows(w, E64 + Fs, 64, &r0, &r1)) {
        if (r0 < E) {
            fw_mark(w, MOETAX_PHASE_ROUTE);
            fw_matmul(s, &l->gate_inp, 0, r0, r1 < E ? r1 : E, &s->a_in, 0, n, b->router, E);
        } else if (r0 >= E64) {
            fw_mark(w, MOETAX_PHASE_SHARED);
            int64_t ra = r0 - E64, rb = r1 - E64;
            fw_matmul2_at(s, &l->gate_sh, l->gate_sh.data, &l->up_sh, l->up_sh.data, ra, rb, &s->a_in, 0, n, b->sh_hid,
                          b->sh_tmp, Fs);
            for (int64_t t = 0; t < n; t++)
                K->silu_mul(b->sh_hid + t * Fs + ra, b->sh_hid + t * Fs + ra, b->sh_tmp + t * Fs + ra, rb - ra);
        }
    }
    fw_phase_end(w);

    /* 2: worker 0 routes, packs the records and starts the dispatch (overlap: both
     * micro-batches on the communication thread; else the one exchange, here); the others
     * prepare the shared hidden */
    const int64_t slots = (int64_t)il * s->n_ubatch * k;
    fw_phase_begin(w, MOETAX_PHASE_ROUTE, il);
    struct act ah = fw_act_view(&b->a_sh, b->sh_hid, Fs, n);
    fw_act_publish(w, &b->a_sh, &ah);
    if (w->ith == 0) {
        moetax_status st = MOETAX_OK;
        if (n > 0) {
            route_tokens(s, b, wk, il, b->sel + slots, b->selw + slots);
            b->hist_n[il] = n;
            record_and_predict(s, b, il);
        }
        fw_mark(w, MOETAX_PHASE_DISPATCH);
        int64_t dropped = 0, rerouted = 0;
        /* after an error (a rank that did not arrive) no more MPI: the step ends, the command aborts */
        if (atomic_load(&s->err_status)) st = (moetax_status)atomic_load(&s->err_status);
        if (ep->global && !st) st = ep_global(w, b, il, b->sel + slots, b->selw + slots, &dropped, &rerouted);
        ep->dropped = dropped;
        ep->rerouted = rerouted;
        memset(ep->cnt_e, 0, sizeof(int32_t) * (size_t)E);
        ep->cnt_slots = 0;
        ep->n_groups = ep->overlap ? EP_GROUPS : 1;
        for (int gi = 0; gi < ep->n_groups; gi++) {
            struct ep_group *g = &ep->g[gi];
            g->t0 = (int32_t)(n * gi / ep->n_groups);
            g->t1 = (int32_t)(n * (gi + 1) / ep->n_groups);
            ep_pack(s, b, il, g, b->sel + slots, b->selw + slots);
            g->pd = g->pc = false;
            if (ep->overlap && !st) g->pd = !(st = moetax_dist_a2a_post(b->dist, &g->xd));
        }
        if (!ep->overlap && !st) st = ep_exchange(w, b, &ep->g[0].xd);
        if (st) fw_fail(s, st);
    }
    if (Fs && n > 0) {
        fw_mark(w, MOETAX_PHASE_SHARED);
        if (w->nth == 1) fw_act_prep(s, &ah, 0, n);
        else if (w->ith > 0) {
            struct worker sub = {.s = s, .ith = w->ith - 1, .nth = w->nth - 1};
            fw_split(&sub, n, 1, &r0, &r1);
            fw_act_prep(s, &ah, r0, r1);
        }
    }
    fw_phase_end(w);

    /* 3: the experts. Overlap: first the records for this rank itself (both micro-batches,
     * while their records travel), then each micro-batch's records from the others as they
     * arrive, its partial sums sent back at once. Else one unit of all records. */
    if (ep->overlap) {
        if (w->ith == 0) {
            ep->u_n = 0;
            for (int gi = 0; gi < ep->n_groups; gi++) ep_unit_set(b, &ep->g[gi], true, d);
        }
        ep_unit(w, b, il);
        for (int gi = 0; gi < ep->n_groups; gi++) {
            struct ep_group *g = &ep->g[gi];
            if (w->ith == 0) { /* in the unit's first phase, before its barrier: see ep_unit */
                moetax_status st = g->pd ? ep_exchange(w, b, &g->xd) : MOETAX_OK; /* not posted: failed before */
                if (st) fw_fail(s, st);
                ep->u_n = 0;
                if (!st && g->pd) ep_unit_set(b, g, false, d);
            }
            ep_unit(w, b, il);
            if (w->ith == 0) {
                ep_prep_combine(s, b, il, g);
                moetax_status st = MOETAX_OK;
                if (g->pd && !atomic_load(&s->err_status)) g->pc = !(st = moetax_dist_a2a_post(b->dist, &g->xc));
                if (st) fw_fail(s, st);
            }
        }
    } else {
        if (w->ith == 0) {
            ep->u_n = 0;
            ep_unit_set(b, &ep->g[0], true, d);
            if (!atomic_load(&s->err_status)) ep_unit_set(b, &ep->g[0], false, d);
        }
        ep_unit(w, b, il);
    }

    /* 4: the shared experts' down projections into sh_out (overlap: while the last partial
     * sums travel); worker 0 then completes the combine's exchanges */
    fw_phase_begin(w, MOETAX_PHASE_SHARED, il);
    const int64_t bd = 64, nbd = (d + bd - 1) / bd;
    for (int64_t it; Fs && n > 0 && (it = fw_chunk(w, nbd, 1)) >= 0;) {
        const int64_t d0 = it * bd, d1 = d0 + bd < d ? d0 + bd : d;
        fw_matmul(s, &l->down_sh, 0, d0, d1, &b->a_sh, 0, n, ep->sh_out, d);
    }
    if (w->ith == 0) {
        moetax_status st = MOETAX_OK;
        if (!ep->overlap && !atomic_load(&s->err_status)) {
            ep_prep_combine(s, b, il, &ep->g[0]);
            st = ep_exchange(w, b, &ep->g[0].xc);
        } else if (ep->overlap)
            /* every posted exchange waited for, the first error kept: one left to the communication thread
             * would go on receiving into buffers the error path frees */
            for (int gi = 0; gi < ep->n_groups; gi++) {
                const moetax_status sg = ep->g[gi].pc ? ep_exchange(w, b, &ep->g[gi].xc) : MOETAX_OK;
                if (!st) st = sg;
            }
        if (st) fw_fail(s, st);
        if (moetax_ledger_enabled(s->ledger)) {
            const struct moetax_layer *ll = &s->m->layers[il];
            const double eb = (double)(ll->gate_exps.row_bytes + ll->up_exps.row_bytes) * (double)hp->n_ff_exp +
                              (double)ll->down_exps.mat_bytes;
            /* this rank's expert work; with the global view (replicas, a capacity factor) the
             * step's over every rank, as the replicated dispatch and the single process book it */
            const int32_t *ce = ep->global ? ep->g_count : ep->cnt_e;
            int32_t na = 0, mx = 0, asg = 0;
            for (int32_t e = 0; e < E; e++) {
                na += ce[e] > 0;
                mx = ce[e] > mx ? ce[e] : mx;
                asg += ce[e];
            }
            moetax_ledger_moe(s->ledger, il, na, mx, asg, eb * na, ep->dropped, ep->rerouted);
        }
    }
    fw_phase_end(w);

    /* 5: the combine: each token's partial sums in rank order, then the shared experts */
    fw_phase_begin(w, MOETAX_PHASE_COMBINE, il);
    for (int64_t it; n > 0 && (it = fw_chunk(w, nbd, 1)) >= 0;) {
        const int64_t d0 = it * bd, d1 = d0 + bd < d ? d0 + bd : d;
        for (int gi = 0; gi < ep->n_groups; gi++) {
            const struct ep_group *g = &ep->g[gi];
            for (int32_t j = 0; j < g->n_rec; j++) /* records by destination rank, ascending */
                K->axpy(s->x + (int64_t)g->rec_tok[j] * d + d0, 1.0f, g->ret + (int64_t)j * d + d0, d1 - d0);
        }
        /* qwen2moe: the shared FFN's output scaled per token by sigmoid(gate_inp_shexp . xn) */
        for (int64_t t = 0; Fs && t < n; t++) {
            const float g = l->gate_inp_shexp
                                ? 1.0f / (1.0f + expf(-K->dot(l->gate_inp_shexp, s->a_in.x + t * d, d))) : 1.0f;
            K->axpy(s->x + t * d + d0, g, ep->sh_out + t * d + d0, d1 - d0);
        }
    }
    if (b->store) release_experts(w, b, il);
    fw_phase_end(w);
}

static void ep_free(struct moe_ep *ep) {
    if (!ep) return;
    for (int gi = 0; gi < EP_GROUPS; gi++) {
        struct ep_group *g = &ep->g[gi];
        free(g->req_d); free(g->req_c);
        free(g->cnt); free(g->sbuf); free(g->rbuf); free(g->rec_tok); free(g->rec_lo); free(g->ret); free(g->out);
    }
    free(ep->u_rec); free(ep->u_out); free(ep->u_sel); free(ep->u_selw);
    free(ep->eh); free(ep->eh_g); free(ep->ydown); free(ep->sh_out); free(ep->cnt_e);
    free(ep->dest); free(ep->g_cnt); free(ep->g_count); free(ep->g_part); free(ep->g_flow); free(ep->g_used);
    free(ep->g_router); free(ep->g_sel); free(ep->g_selw); free(ep->g_src); free(ep->g_send); free(ep->g_recv);
    free(ep->g_bytes); free(ep->g_key);
    plan_free(&ep->plan);
    fw_act_free(&ep->a_exp, ep->row == EP_ROW_F32);
    fw_act_free(&ep->a_eh, false);
    free(ep);
}

static moetax_status ep_init(struct moe *b, const struct fw_step *s, const struct moetax_dist *D) {
    const struct moetax_model *m = s->m;
    const int64_t P = D->size, U = s->n_ubatch, k = b->k, d = m->hp.n_embd, F = m->hp.n_ff_exp, E = m->hp.n_expert;
    struct moe_ep *ep = calloc(1, sizeof *ep);
    if (!ep) return moetax_error(MOETAX_ERR_NOMEM, "out of memory");
    ep->P = (int)P;
    ep->overlap = D->overlap;
    ep->cap = b->capacity_factor > 0 && isfinite(b->capacity_factor);
    ep->global = ep->cap || D->n_rep;
    /* the row the experts read: Q8_0 / Q4_0 prepared rows when gate and up are both of that
     * type (as the local path prepares them), else the float row */
    enum moetax_type tg = MOETAX_TYPE_F32, tu = MOETAX_TYPE_F32;
    for (int il = 0; il < m->hp.n_layer; il++)
        if (m->layers[il].is_moe) {
            tg = m->layers[il].gate_exps.type;
            tu = m->layers[il].up_exps.type;
            break;
        }
    ep->row = d % 32 ? EP_ROW_F32 : tg == MOETAX_TYPE_Q8_0 && tu == tg ? EP_ROW_Q8
            : tg == MOETAX_TYPE_Q4_0 && tu == tg ? EP_ROW_Q4 : EP_ROW_F32;
    for (int il = 0; il < m->hp.n_layer; il++) /* one row type for every layer, else float rows */
        if (m->layers[il].is_moe && (m->layers[il].gate_exps.type != tg || m->layers[il].up_exps.type != tu))
            ep->row = EP_ROW_F32;
    ep->row_bytes = ep->row == EP_ROW_Q8 ? moetax_act_size(MOETAX_TYPE_Q8_0, d, 1)
                  : ep->row == EP_ROW_Q4 ? moetax_act_size(MOETAX_TYPE_Q4_0, d, 1) : sizeof(float) * (size_t)d;
    ep->hdr_bytes = (size_t)(8 * k + 15) / 16 * 16;
    ep->rec_bytes = (ep->hdr_bytes + ep->row_bytes + 15) / 16 * 16;
    const int64_t R = P * U, slots = P * U * k;
    moetax_status st = MOETAX_OK;
#define A(ptr, count) do { size_t cnt_ = (size_t)(count); \
    if (!st && !((ptr) = calloc(cnt_ ? cnt_ : 1, sizeof *(ptr)))) st = moetax_error(MOETAX_ERR_NOMEM, "out of memory"); } while (0)
    for (int gi = 0; gi < EP_GROUPS; gi++) {
        struct ep_group *g = &ep->g[gi];
        A(g->cnt, 9 * P);
        A(g->sbuf, (size_t)R * ep->rec_bytes);
        A(g->rbuf, (size_t)R * ep->rec_bytes);
        A(g->rec_tok, R);
        A(g->rec_lo, P + 1);
        A(g->ret, R * d);
        A(g->out, R * d);
        if (!st && (!(g->req_d = moetax_dist_a2a_requests(D)) || !(g->req_c = moetax_dist_a2a_requests(D))))
            st = moetax_error(MOETAX_ERR_NOMEM, "out of memory");
    }
    A(ep->u_rec, 2 * R);
    A(ep->u_out, 2 * R);
    A(ep->u_sel, 2 * R * k);
    A(ep->u_selw, 2 * R * k);
    A(ep->eh, slots * F);
    A(ep->eh_g, slots * F);
    A(ep->ydown, slots * d);
    A(ep->sh_out, U * d);
    A(ep->cnt_e, E);
    const int64_t H = D->n_rep ? D->H : 1;
    const bool cap = ep->cap;
    A(ep->dest, U * k);
    A(ep->g_cnt, P * E);
    A(ep->g_count, E);
    A(ep->g_part, E * H);
    A(ep->g_flow, E * H);
    A(ep->g_used, E);
    A(ep->g_bytes, P);
    A(ep->g_router, cap ? R * E : 1);
    A(ep->g_sel, cap ? R * k : 1);
    A(ep->g_selw, cap ? R * k : 1);
    A(ep->g_src, cap ? 2 * R : 1);
    A(ep->g_key, cap ? R : 1);
    A(ep->g_send, (size_t)U * (size_t)(1 + E) * 4);
    A(ep->g_recv, (size_t)R * (size_t)(1 + E) * 4);
#undef A
    if (!st && !plan_alloc(&ep->plan, E, 2 * R * k, 1)) st = moetax_error(MOETAX_ERR_NOMEM, "out of memory");
    if (!st) st = fw_act_alloc(m, &ep->a_exp, d, slots, ep->row == EP_ROW_F32);
    if (!st) st = fw_act_alloc(m, &ep->a_eh, F, slots, false);
    b->ep = ep;
    return st;
}
#else
static void moe_block_ep(struct worker *w, struct moe *b, int il) { (void)w; (void)b; (void)il; }
#endif

/* (own_route) this worker's share of the n tokens' shared-expert hidden rows, prepared
 * (quantized) for the shared down projection, booked as shared */
static void shared_hidden_prep(struct worker *w, struct moe *b, int64_t Fs) {
    struct fw_step *s = w->s;
    int64_t r0, r1;
    fw_mark(w, MOETAX_PHASE_SHARED);
    struct act ah = fw_act_view(&b->a_sh, b->sh_hid, Fs, s->n);
    fw_act_publish(w, &b->a_sh, &ah);
    fw_split(w, s->n, 1, &r0, &r1);
    fw_act_prep(s, &ah, r0, r1);
}

/* The shared experts' down projections of output rows [d0, d1) for the n tokens (prepared
 * hidden ahid), added into the residual; qwen2moe gates each token's by sigmoid(gate_inp_shexp
 * . xg), xg the ffn-normed float rows (NULL: no gate). */
static void shared_down_block(struct worker *w, struct moe *b, const struct moetax_layer *l, const struct act *ahid,
                              const float *xg, int64_t d0, int64_t d1) {
    struct fw_step *s = w->s;
    const struct moetax_kernels *K = s->K;
    const int64_t n = s->n, d = s->m->hp.n_embd, bd = d1 - d0;
    float *y = b->wk[w->ith].f;
    fw_matmul_rel(s, &l->down_sh, 0, d0, d1, ahid, 0, n, y, bd);
    for (int64_t t = 0; t < n; t++) {
        const float g = xg ? 1.0f / (1.0f + expf(-K->dot(l->gate_inp_shexp, xg + t * d, d))) : 1.0f;
        K->axpy(s->x + t * d + d0, g, y + t * bd, d1 - d0);
    }
}

/* A batch's down projections in pieces of whole 64-row blocks, so that no expert's item is larger
 * than about a quarter of a worker's share of the phase: with few experts and many tokens (Mixtral's
 * 8 at a long prefill, 2 per token) one item per expert left workers idle while the busiest
 * expert's ran (8 items for 16 threads). Pieces of an expert: ceil(4 nth cnt / slots), at most
 * d / 256 (pieces of at least 256 rows keep their streams long). Writes the running sum of pieces
 * per active expert into ends[n_mine] and returns the total; n_mine when nothing is split (then
 * each item prepares its expert's hidden rows, as before; split, the last gate/up block of each
 * expert does it in phase 4, b->gu_done). Every worker computes the same (plans are the same). */
static int64_t down_pieces(const struct plan *pl, int nth, int64_t d, int32_t *ends) {
    int64_t total = 0, slots = 0;
    for (int32_t i = 0; i < pl->n_mine; i++) slots += pl->m_cnt[i];
    const int64_t maxp = d / 256 > 1 ? d / 256 : 1;
    for (int32_t i = 0; i < pl->n_mine; i++) {
        int64_t np = slots > 0 ? (4 * (int64_t)nth * pl->m_cnt[i] + slots - 1) / slots : 1;
        np = np < 1 ? 1 : np > maxp ? maxp : np;
        total += np;
        ends[i] = (int32_t)total;
    }
    return total;
}

/* Phases 5 and 6 of a batch (n > 1, one process), after gate/up's barrier (a small batch of
 * whole-expert items runs phase 5 in phase 4's items instead, moe_block):
 *   5. one work item per active expert: it prepares the expert's hidden rows (its slots of
 *      b->a_eh, disjoint from every other expert's) and runs the expert's whole down
 *      projection into its rows of ydown; (own_route) the shared hidden is prepared too.
 *      With few experts and many tokens, pieces of an expert's down rows instead (down_pieces;
 *      the hidden rows were prepared by the expert's last gate/up block).
 *   6. one work item per block of output rows: the block's combine (every slot, in slot
 *      order: experts ascending), then the shared experts' down projection of the block.
 * Barriers as before (gate/up | 5 | 6). Down items per block of 64 output rows across all
 * experts, as decode runs them, read each expert's down matrix in pieces of 64 rows: short
 * streams that the prefetchers barely start on before they end (whole matrices stream about
 * twice as fast). The results are the same bits: every output element is computed
 * by one matmul call whatever its row range (kernels.h), and the combine's order is unchanged. */
static void moe_down_batch(struct worker *w, struct moe *b, int il, const struct plan *pl, bool own_route) {
    struct fw_step *s = w->s;
    const struct moetax_hparams *hp = &s->m->hp;
    const struct moetax_layer *l = &s->m->layers[il];
    const int64_t d = hp->n_embd, F = hp->n_ff_exp;
    const int64_t Fs = l->gate_sh.data ? l->gate_sh.ne[1] : 0;
    float *yd = b->ydown; /* [n*k, d] */

    fw_phase_begin(w, MOETAX_PHASE_EXPERT, il);
    if (own_route && Fs) { /* the shared hidden (phase 2 prepares it otherwise) */
        shared_hidden_prep(w, b, Fs);
        fw_mark(w, MOETAX_PHASE_EXPERT);
    }
    struct act v = fw_act_view(&b->a_eh, b->eh, F, pl->n_slots);
    int32_t *ends = b->wk[w->ith].plan.fill; /* scratch [E]: the plans are made */
    const int64_t n_items = down_pieces(pl, w->nth, d, ends);
    const bool split = n_items > pl->n_mine;
    for (int64_t it; (it = fw_chunk(w, n_items, 1)) >= 0;) {
        int64_t mi = 0;
        while (ends[mi] <= it) mi++;
        const int64_t np = ends[mi] - (mi ? ends[mi - 1] : 0), pc = it - (mi ? ends[mi - 1] : 0);
        const int32_t e = pl->mine[mi], o0 = pl->m_off[mi], c = pl->m_cnt[mi];
        if (split && pc == 0) /* for the next layer (phase 4 counted every block, read error or not) */
            atomic_store_explicit(&b->gu_done[mi], 0, memory_order_relaxed);
        const void *wg, *wu, *wd;
        if (!expert_ptrs(w, b, il, e, &wg, &wu, &wd)) continue;
        if (!split) {
            fw_mark(w, MOETAX_PHASE_DISPATCH);
            fw_act_prep(s, &v, o0, o0 + c);
            fw_mark(w, MOETAX_PHASE_EXPERT);
        }
        /* piece pc of np: whole 64-row blocks (kernels.h, ROW RANGES) */
        const int64_t nb64 = (d + 63) / 64, r0 = nb64 * pc / np * 64, r1e = nb64 * (pc + 1) / np * 64;
        const int64_t r1 = r1e < d ? r1e : d;
        fw_matmul_at(s, &l->down_exps, wd, r0, r1, &v, o0, c, yd + (int64_t)o0 * d, d);
    }
    fw_phase_end(w);
}

/* Phase 6 of a batch (see moe_down_batch). */
static void moe_combine_batch(struct worker *w, struct moe *b, int il, const struct plan *pl, const struct act *anorm) {
    struct fw_step *s = w->s;
    const struct moetax_layer *l = &s->m->layers[il];
    const int64_t d = s->m->hp.n_embd;
    const int64_t Fs = l->gate_sh.data ? l->gate_sh.ne[1] : 0;
    const float *yd = b->ydown; /* [n*k, d] */
    fw_phase_begin(w, MOETAX_PHASE_COMBINE, il);
    const int64_t bd = 64, nbd = (d + bd - 1) / bd;
    const float *xg = l->gate_inp_shexp ? anorm->x : NULL;
    for (int64_t it; (it = fw_chunk_own(w, nbd)) >= 0;) {
        const int64_t d0 = it * bd, d1 = d0 + bd < d ? d0 + bd : d;
        fw_mark(w, MOETAX_PHASE_COMBINE);
        /* slots are grouped by expert in ascending order: a fixed summation order */
        s->K->scatter_add(s->x + d0, d, yd + d0, d, pl->slot_token, pl->slot_w, pl->n_slots, d1 - d0);
        if (Fs) {
            fw_mark(w, MOETAX_PHASE_SHARED);
            shared_down_block(w, b, l, &b->a_sh, xg, d0, d1);
        }
    }
    if (b->store) release_experts(w, b, il);
    fw_phase_end(w);
}

void moe_block(struct worker *w, struct moe *b, int il) {
    struct fw_step *s = w->s;
    const struct moetax_hparams *hp = &s->m->hp;
    const struct moetax_layer *l = &s->m->layers[il];
    const struct moetax_kernels *K = s->K;
    const int64_t n = s->n, d = hp->n_embd, E = hp->n_expert, F = hp->n_ff_exp, k = b->k;
    const int64_t Fs = l->gate_sh.data ? l->gate_sh.ne[1] : 0;
    struct moe_worker *wk = &b->wk[w->ith];
    struct plan *pl = &b->plan;
    int64_t r0, r1;
    if (b->ep) {
        moe_block_ep(w, b, il);
        return;
    }

    /* 1: router + shared gate/up (one token: each worker first normalises and prepares the
     * row itself, see fw_own_row; the caller skipped the ffn norm's phase) */
    const struct act *ain = &s->a_in;
    if (fw_own_fits(n, d)) { /* a small batch too (the caller skipped the norm's phase) */
        fw_phase_begin(w, MOETAX_PHASE_NORM, il);
        ain = fw_own_rows(w, s->x, d, n, l->ffn_norm);
        fw_mark(w, MOETAX_PHASE_ROUTE);
    } else fw_phase_begin(w, MOETAX_PHASE_ROUTE, il);
    const struct act *anorm = ain; /* the normalised rows (this worker's own or the shared ones) */
    const int64_t slots = (int64_t)il * s->n_ubatch * k; /* this layer's rows of b->sel / selw */
    /* A small batch (without the capacity factor's shared counts, without a world): like one
     * token, every worker plans into its own copy, and each gate/up item gathers its expert's
     * rows itself, so phases 2 and 3 and their barriers go; the shared hidden is prepared in
     * phase 4 or 5. With at most 64 experts the worker whose item computes the router logits
     * routes the tokens there and then (into the layer's rows of sel / selw), while the others
     * take the shared experts' blocks; otherwise every worker routes them after the barrier. */
    const bool own_route = n > 1 && n <= FW_OWN_ROWS && anorm != &s->a_in && !b->dist &&
                           !(b->capacity_factor > 0 && isfinite(b->capacity_factor));
    const bool route_early = own_route && E <= 64;
    /* blocks of 64 rows from each matrix's first row (kernels.h, ROW RANGES): the
     * shared expert's rows are numbered from E rounded up to 64 */
    const int64_t E64 = (E + 63) / 64 * 64;
    while (fw_rows(w, E64 + Fs, 64, &r0, &r1)) {
        if (r0 < E) {
            fw_mark(w, MOETAX_PHASE_ROUTE);
            fw_matmul(s, &l->gate_inp, 0, r0, r1 < E ? r1 : E, ain, 0, n, b->router, E);
            if (route_early) {
                route_tokens(s, b, wk, il, b->sel + slots, b->selw + slots);
                b->hist_n[il] = n;
            }
        } else if (r0 >= E64) {
            fw_mark(w, MOETAX_PHASE_SHARED);
            int64_t ra = r0 - E64, rb = r1 - E64;
            fw_matmul2_at(s, &l->gate_sh, l->gate_sh.data, &l->up_sh, l->up_sh.data, ra, rb, ain, 0, n, b->sh_hid,
                          b->sh_tmp, Fs);
            for (int64_t t = 0; t < n; t++)
                K->silu_mul(b->sh_hid + t * Fs + ra, b->sh_hid + t * Fs + ra, b->sh_tmp + t * Fs + ra, rb - ra);
        }
    }
    fw_phase_end(w);

    /* 2: routing and the dispatch plan. A batch: worker 0 routes every token and plans while
     * the others prepare the shared hidden, then a barrier. One token: every worker routes it
     * and plans into its own copy (the same bits everywhere) and goes on to phase 4 without a
     * barrier; the shared hidden is prepared by each worker in phase 6 (fw_own_row). Worker 0
     * also records the routing, predicts the next layer and issues the store's reads. */
    if (own_route) {
        const int32_t *sel = b->sel + slots;
        const float *selw = b->selw + slots;
        fw_phase_begin(w, MOETAX_PHASE_ROUTE, il);
        if (!route_early) {
            route_tokens(s, b, wk, il, wk->sel, wk->selw);
            if (w->ith == 0) {
                memcpy(b->sel + slots, wk->sel, sizeof(int32_t) * (size_t)(n * k));
                memcpy(b->selw + slots, wk->selw, sizeof(float) * (size_t)(n * k));
                b->hist_n[il] = n;
            }
            sel = wk->sel;
            selw = wk->selw;
        }
        pl = &wk->plan;
        fw_mark(w, MOETAX_PHASE_DISPATCH);
        plan(s, b, il, sel, selw, n, pl);
        if (w->ith == 0) {
            record_and_predict(s, b, il);
            record_plan(s, il, pl, 0, 0);
            issue_reads(w, b, il, pl);
        }
    } else if (n > 1) {
        fw_phase_begin(w, MOETAX_PHASE_ROUTE, il);
        struct act ah = fw_act_view(&b->a_sh, b->sh_hid, Fs, n);
        fw_act_publish(w, &b->a_sh, &ah);
        if (w->ith == 0) {
            route_tokens(s, b, wk, il, b->sel + slots, b->selw + slots);
            b->hist_n[il] = n;
            record_and_predict(s, b, il);
            fw_mark(w, MOETAX_PHASE_DISPATCH);
            int64_t dropped = 0, rerouted = 0;
            if (b->capacity_factor > 0 && isfinite(b->capacity_factor))
                apply_capacity(s, b, il, n, b->router, b->sel + slots, b->selw + slots, &dropped, &rerouted);
            plan(s, b, il, b->sel + slots, b->selw + slots, s->n, pl);
            record_plan(s, il, pl, dropped, rerouted);
            issue_reads(w, b, il, pl);
        }
        if (Fs) {
            fw_mark(w, MOETAX_PHASE_SHARED);
            if (w->nth == 1) fw_act_prep(s, &ah, 0, n);
            else if (w->ith > 0) {
                struct worker sub = {.s = s, .ith = w->ith - 1, .nth = w->nth - 1};
                fw_split(&sub, n, 1, &r0, &r1);
                fw_act_prep(s, &ah, r0, r1);
            }
        }
        fw_phase_end(w);
    } else {
        fw_phase_begin(w, MOETAX_PHASE_ROUTE, il);
        route_tokens(s, b, wk, il, wk->sel, wk->selw);
        if (w->ith == 0) {
            memcpy(b->sel + slots, wk->sel, sizeof(int32_t) * (size_t)k);
            memcpy(b->selw + slots, wk->selw, sizeof(float) * (size_t)k);
            b->hist_n[il] = 1;
        }
        pl = &wk->plan;
        fw_mark(w, MOETAX_PHASE_DISPATCH);
        plan(s, b, il, wk->sel, wk->selw, 1, pl);
        if (w->ith == 0) {
            record_and_predict(s, b, il);
            record_plan(s, il, pl, 0, 0); /* one token: at most one assignment per expert, nothing to cap */
            issue_reads(w, b, il, pl);
        }
    }

    /* 3: gather each slot's input row (batches only; a small batch: in each gate/up item) */
    if (n > 1 && !own_route) {
        fw_phase_begin(w, MOETAX_PHASE_DISPATCH, il);
        struct act ae = fw_act_view(&b->a_exp, b->a_exp.x, d, pl->n_slots);
        fw_act_publish(w, &b->a_exp, &ae);
        fw_split(w, pl->n_slots, 1, &r0, &r1);
        for (int64_t i = r0; i < r1; i++) copy_prepared_row(s, anorm, pl->slot_token[i], &ae, i);
        fw_phase_end(w);
        ain = &b->a_exp;
    }

    /* 4: gate/up per (expert, block of F rows) (one token: the phase began with routing) */
    if (n > 1 && !own_route) fw_phase_begin(w, MOETAX_PHASE_EXPERT, il);
    else fw_mark(w, MOETAX_PHASE_EXPERT);
    const int64_t bf = F >= 256 ? 256 : F; /* gate/up rows per work item: a multiple of 64 (kernels.h, ROW RANGES) */
    const int64_t nbf = (F + bf - 1) / bf;
    /* a batch whose down projections go in pieces prepares each expert's hidden rows here */
    const bool split_down = n > 1 && !b->dist && down_pieces(pl, w->nth, d, wk->plan.fill) > pl->n_mine;
    /* A small batch whose experts' items are whole experts (one block of F rows each, and at
     * least 4 of them per worker): each item goes on to prepare its hidden rows and run the expert's
     * down projection (phase 5 of moe_down_batch), so phase 5 and its barrier go; the shared
     * hidden is prepared here first (phase 1's barrier made it whole). The same calls on the
     * same rows as phase 5's, so the same bits. */
    const bool fused = own_route && !split_down && nbf == 1 && pl->n_mine >= 4 * w->nth;
    if (fused && Fs) {
        shared_hidden_prep(w, b, Fs);
        fw_mark(w, MOETAX_PHASE_EXPERT);
    }
    /* this rank's active experts (all without a world), each worker's share in order: an expert's
     * blocks one after the other */
    for (int64_t it; (it = fw_chunk_own(w, (int64_t)pl->n_mine * nbf)) >= 0;) {
        const int64_t mi = it / nbf;
        int32_t e = pl->mine[mi];
        int64_t f0 = (it % nbf) * bf, f1 = f0 + bf < F ? f0 + bf : F;
        int64_t b0 = n > 1 ? pl->m_off[mi] : 0, cnt = pl->m_cnt[mi];
        float *g = b->eh_g + (int64_t)pl->m_off[mi] * F, *u = b->eh + (int64_t)pl->m_off[mi] * F;
        const void *wg, *wu, *wd;
        if (!expert_ptrs(w, b, il, e, &wg, &wu, &wd)) continue;
        const struct act *ai = ain;
        if (own_route) { /* this expert's rows, gathered here (the same bits as phase 3's copies) */
            struct act *ga = &wk->gat;
            ga->ncols = d;
            ga->n = cnt;
            for (int64_t i = 0; i < cnt; i++) copy_prepared_row(s, anorm, pl->slot_token[b0 + i], ga, i);
            ai = ga;
            b0 = 0;
        }
        fw_matmul2_at(s, &l->gate_exps, wg, &l->up_exps, wu, f0, f1, ai, b0, cnt, g, u, F);
        for (int64_t i = 0; i < cnt; i++) K->silu_mul(u + i * F + f0, g + i * F + f0, u + i * F + f0, f1 - f0);
        if (fused) { /* phase 5's item for this expert */
            const int32_t o0 = pl->m_off[mi];
            fw_mark(w, MOETAX_PHASE_DISPATCH);
            struct act v = fw_act_view(&b->a_eh, b->eh, F, pl->n_slots);
            fw_act_prep(s, &v, o0, o0 + cnt);
            fw_mark(w, MOETAX_PHASE_EXPERT);
            fw_matmul_at(s, &l->down_exps, wd, 0, d, &v, o0, cnt, b->ydown + (int64_t)o0 * d, d);
            continue;
        }
        if (split_down && atomic_fetch_add_explicit(&b->gu_done[mi], 1, memory_order_acq_rel) == nbf - 1) {
            /* the expert's last block: its hidden rows are whole, prepare them for the down pieces */
            fw_mark(w, MOETAX_PHASE_DISPATCH);
            struct act v = fw_act_view(&b->a_eh, b->eh, F, pl->n_slots);
            fw_act_prep(s, &v, pl->m_off[mi], pl->m_off[mi] + cnt);
            fw_mark(w, MOETAX_PHASE_EXPERT);
        }
    }
    fw_phase_end(w);

    if (n > 1 && !b->dist) {
        if (!fused) moe_down_batch(w, b, il, pl, own_route);
        moe_combine_batch(w, b, il, pl, anorm);
        return;
    }

    /* 5: prepare (quantize) the expert hidden rows (one token: each worker all k rows
     * itself, in phase 6) */
    const struct act *aeh = &b->a_eh;
    if (n > 1) {
        fw_phase_begin(w, MOETAX_PHASE_DISPATCH, il);
        struct act v = fw_act_view(&b->a_eh, b->eh, F, pl->n_slots);
        fw_act_publish(w, &b->a_eh, &v);
        fw_split(w, pl->n_slots, 1, &r0, &r1);
        fw_act_prep(s, &v, r0, r1);
        if (own_route && Fs) shared_hidden_prep(w, b, Fs); /* phase 2 prepares it otherwise */
        fw_phase_end(w);
        fw_phase_begin(w, MOETAX_PHASE_EXPERT, il);
    } else {
        fw_phase_begin(w, MOETAX_PHASE_DISPATCH, il);
        aeh = own_eh(w, b, k);
        fw_mark(w, MOETAX_PHASE_EXPERT);
    }

    /* 6: down projections per block of output rows into ydown, then this
     * worker's blocks are combined into the residual, then the shared expert */
    const int64_t bd = 64, nbd = (d + bd - 1) / bd;
    int32_t mine[512];
    int nmine = 0;
    float *yd = b->ydown; /* [n*k, d] */
    for (int64_t it; (it = fw_chunk_own(w, nbd)) >= 0;) {
        int64_t d0 = it * bd, d1 = d0 + bd < d ? d0 + bd : d;
        for (int32_t ai = 0; ai < pl->n_mine; ai++) {
            int32_t e = pl->mine[ai];
            const void *wg, *wu, *wd;
            if (!expert_ptrs(w, b, il, e, &wg, &wu, &wd)) continue;
            fw_matmul_at(s, &l->down_exps, wd, d0, d1, aeh, pl->m_off[ai], pl->m_cnt[ai], yd + (int64_t)pl->m_off[ai] * d, d);
        }
        if (b->dist) { /* the others' rows come with the collective: combine after it */
            if (b->partial) { /* allreduce: this rank's weighted sum per token of this block */
                for (int64_t t = 0; t < n; t++) memset(b->partial + t * d + d0, 0, sizeof(float) * (size_t)(d1 - d0));
                for (int32_t ai = 0; ai < pl->n_mine; ai++) {
                    const int32_t o0 = pl->m_off[ai], c = pl->m_cnt[ai];
                    K->scatter_add(b->partial + d0, d, yd + (int64_t)o0 * d + d0, d, pl->slot_token + o0,
                                   pl->slot_w + o0, c, d1 - d0);
                }
            }
            continue;
        }
        if (nmine < 512) mine[nmine++] = (int32_t)it;
        else { /* more blocks than the local list holds: combine this one now */
            fw_mark(w, MOETAX_PHASE_COMBINE);
            K->scatter_add(s->x + d0, d, yd + d0, d, pl->slot_token, pl->slot_w, pl->n_slots, d1 - d0);
            fw_mark(w, MOETAX_PHASE_EXPERT);
        }
    }
    if (b->dist) {
        dist_exchange(w, b, il, pl);
        fw_phase_begin(w, MOETAX_PHASE_COMBINE, il);
        for (int64_t it; (it = fw_chunk(w, nbd, 1)) >= 0;) {
            if (nmine < 512) mine[nmine++] = (int32_t)it;
            else {
                int64_t d0 = it * bd, d1 = d0 + bd < d ? d0 + bd : d;
                dist_combine_block(s, b, pl, d0, d1);
            }
        }
    }
    fw_mark(w, MOETAX_PHASE_COMBINE);
    for (int i = 0; i < nmine; i++) {
        int64_t d0 = (int64_t)mine[i] * bd, d1 = d0 + bd < d ? d0 + bd : d;
        /* slots are grouped by expert in ascending order: a fixed summation order */
        if (b->partial) dist_combine_block(s, b, pl, d0, d1);
        else K->scatter_add(s->x + d0, d, yd + d0, d, pl->slot_token, pl->slot_w, pl->n_slots, d1 - d0);
    }
    if (Fs) {
        fw_mark(w, MOETAX_PHASE_SHARED);
        /* qwen2moe gates the shared FFN per token by sigmoid(gate_inp_shexp . xn), xn the ffn-normed
         * float row (one token: this worker's own row, read before fw_own_row repoints it) */
        const float *xg = l->gate_inp_shexp ? anorm->x : NULL;
        const struct act *ahid = n == 1 && nmine > 0 ? fw_own_row(w, b->sh_hid, Fs, NULL) : &b->a_sh;
        float *y = wk->f;
        for (int i = 0; i < nmine; i++) {
            int64_t d0 = (int64_t)mine[i] * bd, d1 = d0 + bd < d ? d0 + bd : d;
            fw_matmul_rel(s, &l->down_sh, 0, d0, d1, ahid, 0, n, y, bd);
            for (int64_t t = 0; t < n; t++) {
                const float g = xg ? 1.0f / (1.0f + expf(-K->dot(l->gate_inp_shexp, xg + t * d, d))) : 1.0f;
                K->axpy(s->x + t * d + d0, g, y + t * bd, d1 - d0);
            }
        }
    }
    if (b->store) release_experts(w, b, il);
    fw_phase_end(w);
}

/* ---- buffers ------------------------------------------------------------------------ */

static int64_t max64(int64_t x, int64_t y) { return x > y ? x : y; }

void moe_step_begin(struct moe *b, const struct fw_step *s) {
    memset(b->pred_ok, 0, sizeof(bool) * (size_t)s->m->hp.n_layer);
    if (b->read_ahead > 0) moe_ra_reset(&b->ra);
#ifdef MOETAX_WITH_MPI
    if (b->dist && b->dist->n_rep) moetax_dist_step(b->dist); /* the replicas' step count */
#endif
}

static bool plan_alloc(struct plan *pl, int64_t E, int64_t slots, int64_t H) {
    pl->m_off = calloc((size_t)E, sizeof(int32_t));
    pl->m_cnt = calloc((size_t)E, sizeof(int32_t));
    pl->part = calloc((size_t)(E * H), sizeof(int32_t));
    pl->rep_nh = calloc((size_t)E, sizeof(int32_t));
    pl->rep_hosts = calloc((size_t)(E * H), sizeof(int32_t));
    if (!pl->m_off || !pl->m_cnt || !pl->part || !pl->rep_nh || !pl->rep_hosts) return false;
    pl->active = calloc((size_t)E, sizeof(int32_t));
    pl->count = calloc((size_t)E, sizeof(int32_t));
    pl->offset = calloc((size_t)E, sizeof(int32_t));
    pl->fill = calloc((size_t)E, sizeof(int32_t));
    pl->mine = calloc((size_t)E, sizeof(int32_t));
    pl->slot_token = calloc((size_t)slots, sizeof(int32_t));
    pl->slot_w = calloc((size_t)slots, sizeof(float));
    return pl->active && pl->count && pl->offset && pl->fill && pl->mine && pl->slot_token && pl->slot_w;
}

static void plan_free(struct plan *pl) {
    free(pl->m_off); free(pl->m_cnt); free(pl->part); free(pl->rep_nh); free(pl->rep_hosts);
    free(pl->active); free(pl->count); free(pl->offset); free(pl->fill); free(pl->mine); free(pl->slot_token); free(pl->slot_w);
}

moetax_status moe_init(struct moe *b, const struct fw_step *s, const struct moe_params *p) {
    const struct moetax_model *m = s->m;
    const struct moetax_hparams *hp = &m->hp;
    memset(b, 0, sizeof *b);
    const int64_t k = p->k;
    b->k = p->k;
    b->store = p->store;
    b->prefetch = p->prefetch;
    b->read_ahead = p->store && p->prefetch ? moetax_store_read_ahead_depth(p->store) : 0;
    if (b->read_ahead < 0) b->read_ahead = 0;
    b->capacity_factor = p->capacity_factor;
    b->reroute = p->reroute;
    b->n_threads = s->n_threads;
    const int64_t U = s->n_ubatch, d = hp->n_embd, E = max64(hp->n_expert, 1), F = max64(hp->n_ff_exp, 1);
    int64_t Fs = 1;
    for (int il = 0; il < hp->n_layer; il++) Fs = max64(Fs, m->layers[il].gate_sh.data ? m->layers[il].gate_sh.ne[1] : 0);
    const int64_t L = hp->n_layer;
    int64_t H = 1; /* hosts per expert (replicas) */
#ifdef MOETAX_WITH_MPI
    if (p->dist && p->dist->size > 1 && p->dist->n_rep) H = p->dist->H;
#endif
    moetax_status st = MOETAX_OK;
#define A(ptr, count) do { size_t cnt_ = (size_t)(count); \
    if (!st && !((ptr) = calloc(cnt_ ? cnt_ : 1, sizeof *(ptr)))) st = moetax_error(MOETAX_ERR_NOMEM, "out of memory"); } while (0)
    A(b->router, U * E);
    A(b->sh_hid, U * Fs);
    A(b->sh_tmp, U * Fs);
    A(b->eh, U * k * F);
    A(b->eh_g, U * k * F);
    A(b->ydown, U * k * d);
    A(b->sel, L * U * k);
    A(b->selw, L * U * k);
    A(b->pred, L * U * k);
    A(b->pred_ok, L);
    A(b->hist_n, L);
    A(b->gu_done, E);
    A(b->pred_x, d);
    A(b->pred_logits, E);
    A(b->pred_p, 2 * E);
    A(b->wk, s->n_threads);
    A(b->cap_count, E);
    int64_t UP = U; /* the capacity's tokens: token-sharded, every rank's of the micro-batch */
#ifdef MOETAX_WITH_MPI
    if (p->dist && p->dist->size > 1 && p->dist->dispatch) UP = U * p->dist->size;
#endif
    A(b->cap_order, UP * k);
    A(b->cap_tot, UP);
    A(b->cap_p, 2 * E);
    for (int64_t t = 0; !st && t < UP; t++) b->cap_tot[t] = -1;
#ifdef MOETAX_WITH_MPI
    if (p->dist && p->dist->size > 1 && hp->n_expert > 0) {
        b->dist = p->dist;
        b->owner = p->dist->owner;
        b->rank = p->dist->rank;
        A(b->slot_lo, p->dist->size + 1);
        if (!p->dist->contiguous || p->dist->n_rep) A(b->gbuf, U * k * d);
        if (p->dist->combine == MOETAX_DIST_COMBINE_ALLREDUCE) A(b->partial, U * d);
        if (!st && p->dist->dispatch) st = ep_init(b, s, p->dist);
    }
#endif
    if (!st && !plan_alloc(&b->plan, E, U * k, H)) st = moetax_error(MOETAX_ERR_NOMEM, "out of memory");
    if (!st && b->read_ahead > 0) st = moe_ra_init(&b->ra, (int)L, (int)k);
    if (!st && !(b->pred_q = aligned_alloc(64, (moetax_act_size(MOETAX_TYPE_Q4_0, (d + 31) / 32 * 32, 1) + 63) / 64 * 64)))
        st = moetax_error(MOETAX_ERR_NOMEM, "out of memory");
    if (!st) st = fw_act_alloc(m, &b->a_sh, Fs, U, false);
    if (!st) st = fw_act_alloc(m, &b->a_exp, d, U * k, true);
    if (!st) st = fw_act_alloc(m, &b->a_eh, F, U * k, false);
    for (int i = 0; !st && i < s->n_threads; i++) {
        struct moe_worker *wk = &b->wk[i];
        wk->nf = (size_t)max64(2 * E + 2, U * 64);
        A(wk->f, wk->nf);
        A(wk->eptr, E);
        A(wk->acq, E);
        A(wk->acq_list, E);
        A(wk->sel, FW_OWN_ROWS * k);
        A(wk->selw, FW_OWN_ROWS * k);
        if (!st && !plan_alloc(&wk->plan, E, FW_OWN_ROWS * k, H)) st = moetax_error(MOETAX_ERR_NOMEM, "out of memory");
        if (!st) st = fw_act_alloc(m, &wk->own_eh, F, k, false);
        if (!st) st = fw_act_alloc(m, &wk->gat, d, FW_OWN_ROWS, true);
    }
#undef A
    if (st) moe_free(b);
    return st;
}

void moe_free(struct moe *b) {
    free(b->router); free(b->sh_hid); free(b->sh_tmp); free(b->eh); free(b->eh_g); free(b->ydown);
    free(b->sel); free(b->selw); free(b->pred); free(b->pred_ok); free(b->hist_n); free((void *)b->gu_done);
    free(b->pred_x); free(b->pred_logits); free(b->pred_p); free(b->pred_q);
    free(b->cap_count); free(b->cap_order); free(b->cap_tot); free(b->cap_p);
    free(b->slot_lo); free(b->partial); free(b->gbuf);
#ifdef MOETAX_WITH_MPI
    ep_free(b->ep);
#endif
    plan_free(&b->plan);
    moe_ra_free(&b->ra);
    fw_act_free(&b->a_sh, false);
    fw_act_free(&b->a_exp, true);
    fw_act_free(&b->a_eh, false);
    if (b->wk)
        for (int i = 0; i < b->n_threads; i++) {
            struct moe_worker *wk = &b->wk[i];
            free(wk->f); free(wk->eptr); free(wk->acq); free(wk->acq_list); free(wk->sel); free(wk->selw);
            plan_free(&wk->plan);
            fw_act_free(&wk->own_eh, false);
            fw_act_free(&wk->gat, true);
        }
    free(b->wk);
    memset(b, 0, sizeof *b);
}
