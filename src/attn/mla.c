/*
 * mla.c - DeepSeek2 Multi-head Latent Attention in the absorbed form, with the
 * compressed KV cache: per token and layer only [kv_norm ; k_pe] (kv_lora +
 * rope floats) is stored. For a token at position p and head h:
 *   q = W_q x (or W_qb rmsnorm(W_qa x)), split into q_nope, q_pe; rope(q_pe, p)
 *   [kv ; k_pe] = W_kva x; kv = rmsnorm(kv); rope(k_pe, p); cache[p] = [kv ; k_pe]
 *   Q_h = [W_kb[h] q_nope_h ; q_pe_h]                      (kv_lora + rope)
 *   s_j = kq_scale * Q_h . cache[j], j <= p;  o_h = sum_j softmax(s)_j cache[j][:kv_lora]
 *   out_h = W_vb[h] o_h;  x += W_o [out_0 .. out_H-1]
 *
 * Barriers (phases) per layer: 1 norm+prep, 2 q/kv_a projections, (+2 with
 * q_lora: q_a norm+prep, q_b), 3 rope/cache/q_abs, 4 attention (+v_b for one
 * token; a batch adds 4b: v_b per head over all tokens), 5 prep, 6 W_o. One
 * token (decode) has no phases 1 and 5, nor the q_a norm+prep phase: every
 * worker normalises / prepares the one row itself at the start of the next
 * phase (fw_own_row); nor phase 3 when kv_a is no bigger than a worker's
 * share of phase 2 (2 workers on DeepSeek shapes; not 16): phase 2's kv_a
 * item also writes the cache row, and each attention item makes its own
 * heads' q_abs. So 3 barriers (4 with q_lora, +1 without that fusion).
 */
#include <math.h>
#include <string.h>

#include "model/forward_impl.h"

/* Token t's cache row of layer il: [rmsnorm(kv) ; rope(k_pe)] from c->kva. */
static void cache_row(struct moetax_ctx *c, int il, int64_t t) {
    const struct moetax_hparams *hp = &c->m->hp;
    const struct moetax_layer *l = &c->m->layers[il];
    const int64_t kvl = hp->kv_lora_rank, rope = hp->n_embd_head_qk_rope, kvr = c->kv_row;
    float *dst = c->kv + ((int64_t)il * c->n_ctx + c->pos0 + t) * kvr;
    const float *src = c->kva + t * kvr;
    c->K->rmsnorm(dst, src, l->kv_a_norm, kvl, hp->rms_eps);
    memcpy(dst + kvl, src + kvl, sizeof(float) * (size_t)rope);
    c->K->rope_cached(dst + kvl, 1, rope, (int)rope, MOETAX_ROPE_MODE_NORM, c->ropecs + t * rope);
}

/* Head h, every token of the micro-batch: Q_h = [W_kb[h] q_nope ; rope(q_pe)] into c->qabs
 * (one batched matmul, so W_kb[h] is read once per micro-batch; scratch s->f, s->q). */
static void q_abs_head(struct moetax_ctx *c, struct scratch *s, int il, int64_t h) {
    const struct moetax_hparams *hp = &c->m->hp;
    const struct moetax_layer *l = &c->m->layers[il];
    const int64_t n = c->n, H = hp->n_head, nope = hp->n_embd_head_qk_nope, rope = hp->n_embd_head_qk_rope;
    const int64_t kvl = hp->kv_lora_rank, qrow = H * (nope + rope), kvr = c->kv_row;
    float *qn = s->f; /* [n, nope] gathered q_nope of head h */
    for (int64_t t = 0; t < n; t++) {
        const float *qh = c->q + t * qrow + h * (nope + rope);
        float *Q = c->qabs + (t * H + h) * kvr;
        memcpy(Q + kvl, qh + nope, sizeof(float) * (size_t)rope);
        c->K->rope_cached(Q + kvl, 1, rope, (int)rope, MOETAX_ROPE_MODE_NORM, c->ropecs + t * rope);
        memcpy(qn + t * nope, qh, sizeof(float) * (size_t)nope);
    }
    struct act a = {.x = qn, .ncols = nope, .n = n, .q8 = s->q, .q4 = s->q, .cap_q8 = s->nq, .cap_q4 = s->nq};
    if (l->wk_b.type == MOETAX_TYPE_Q8_0 || l->wk_b.type == MOETAX_TYPE_Q4_0)
        c->K->quantize_act(l->wk_b.type, qn, nope, nope, n, s->q);
    fw_matmul(c, &l->wk_b, h, 0, kvl, &a, 0, n, c->qabs + h * kvr, H * kvr);
}

void fw_attention(struct worker *w, int il) {
    struct moetax_ctx *c = w->c;
    const struct moetax_model *m = c->m;
    const struct moetax_hparams *hp = &m->hp;
    const struct moetax_layer *l = &m->layers[il];
    const struct moetax_kernels *K = c->K;
    const int64_t n = c->n, d = hp->n_embd, H = hp->n_head, nope = hp->n_embd_head_qk_nope;
    const int64_t rope = hp->n_embd_head_qk_rope, vh = hp->n_embd_head_v, kvl = hp->kv_lora_rank;
    const int64_t ql = hp->q_lora_rank, qrow = H * (nope + rope), kvr = c->kv_row;
    int64_t r0, r1;

    /* 1: attn_norm, prepare (one token: each worker itself, in phase 2; see fw_norm_input) */
    const struct act *ain = fw_norm_input(w, MOETAX_PHASE_NORM, MOETAX_PHASE_ATTN, il, c->xn, c->x, l->attn_norm, d);

    /* 2: q (or q_a) and kv_a projections, rows of both split together */
    const struct moetax_weight *wq = ql ? &l->wq_a : &l->wq;
    float *qout = ql ? c->qa : c->q;
    const int64_t nq = wq->ne[1], nkv = l->wkv_a.ne[1];
    /* blocks of 64 rows from each matrix's first row (kernels.h, ROW RANGES): kv_a's
     * rows are numbered from nq rounded up to 64 */
    const int64_t nq64 = (nq + 63) / 64 * 64;
    /* One token, and kv_a no bigger than a worker's share of the phase's bytes: kv_a is one
     * work item that also writes the token's cache row, so phase 3 can go (see below).
     * With many workers (or a kv_a larger than q) that item would hold the phase up. */
    const bool fuse = n == 1 && l->wkv_a.mat_bytes * (size_t)w->nth <= l->wkv_a.mat_bytes + wq->mat_bytes;
    if (!fuse) {
        while (fw_rows(w, nq64 + nkv, 64, &r0, &r1)) {
            if (r0 < nq) fw_matmul(c, wq, 0, r0, r1 < nq ? r1 : nq, ain, 0, n, qout, nq);
            else if (r0 >= nq64) fw_matmul(c, &l->wkv_a, 0, r0 - nq64, r1 - nq64, ain, 0, n, c->kva, nkv);
        }
    } else {
        /* item 0 is all of kv_a and then the token's cache row (so phase 3 needs no item
         * for it and can run into phase 4 without a barrier); then q's blocks */
        const int64_t nqb = (nq + 63) / 64;
        for (int64_t it; (it = fw_chunk(w, 1 + nqb, 1)) >= 0;) {
            if (it == 0) {
                fw_matmul(c, &l->wkv_a, 0, 0, nkv, ain, 0, 1, c->kva, nkv);
                cache_row(c, il, 0);
            } else {
                r0 = (it - 1) * 64;
                r1 = r0 + 64 < nq ? r0 + 64 : nq;
                fw_matmul(c, wq, 0, r0, r1, ain, 0, 1, qout, nq);
            }
        }
    }
    fw_phase_end(w);

    if (ql) { /* q_a norm + prepare (one token: by each worker itself), then q_b */
        const struct act *aqp =
            fw_norm_input(w, MOETAX_PHASE_ATTN, MOETAX_PHASE_ATTN, il, c->qa, c->qa, l->q_a_norm, ql);
        while (fw_rows(w, qrow, 64, &r0, &r1)) fw_matmul(c, &l->wq_b, 0, r0, r1, aqp, 0, n, c->q, qrow);
        fw_phase_end(w);
    }

    /* 3: per token: kv norm + rope(k_pe) into the cache; per head, for all tokens of the
     * micro-batch at once: rope(q_pe) and q_abs = W_kb[h] q_nope (one batched matmul per head,
     * so each head's W_kb is read once per micro-batch). Fused (one token, see phase 2): the
     * cache row was written in phase 2, and each item of phase 4 makes its own heads' q_abs
     * first (no barrier). */
    struct scratch *s = &c->scr[w->ith];
    if (!fuse) {
        fw_phase_begin(w, MOETAX_PHASE_ATTN, il);
        for (int64_t it; (it = fw_chunk(w, n + H, 1)) >= 0;) {
            if (it < n) cache_row(c, il, it);
            else q_abs_head(c, s, il, it - n);
        }
        fw_phase_end(w);
    }

    /* 4: attention per (token, group of heads): the shared compressed KV rows are
     * read once for all heads of the group (scores = one matmul over the cache
     * with the group's queries as the batch), then o_h = sum_j p_hj kv_j with
     * kv_j reused across the group. One token: out_h = W_vb[h] o_h right here;
     * a batch: o goes to c->oatt and phase 4b runs W_vb per head over all tokens. */
    fw_phase_begin(w, MOETAX_PHASE_ATTN, il);
    const float *kvc = c->kv + (int64_t)il * c->n_ctx * kvr;
    const int64_t G = w->nth > 1 ? (H < 2 * w->nth ? H : 2 * w->nth) : 1; /* head groups per token */
    const int64_t np_max = c->pos0 + n;
    float *sc = s->f;                 /* [heads of a group][np_max] scores */
    float *o1 = s->f + H * np_max;    /* [heads of a group][kvl] (one token) */
    for (int64_t it; (it = fw_chunk(w, n * G, 1)) >= 0;) {
        int64_t t = it / G, g = it % G;
        int64_t h0 = H * g / G, h1 = H * (g + 1) / G, nh = h1 - h0;
        int64_t np = c->pos0 + t + 1;
        if (fuse)
            for (int64_t h = h0; h < h1; h++) q_abs_head(c, s, il, h);
        const float *Q = c->qabs + (t * H + h0) * kvr;
        K->matmul(MOETAX_TYPE_F32, kvc, sizeof(float) * (size_t)kvr, 0, np, kvr, Q, nh, sc, np_max);
        for (int64_t hh = 0; hh < nh; hh++) {
            K->scale(sc + hh * np_max, hp->kq_scale, np);
            K->softmax(sc + hh * np_max, np);
        }
        float *o = n == 1 ? o1 : c->oatt + (t * H + h0) * kvl;
        K->wsum(o, kvl, sc, np_max, nh, kvc, kvr, np, kvl);
        if (n > 1) continue;
        for (int64_t hh = 0; hh < nh; hh++) {
            int64_t h = h0 + hh;
            float *oh = o + hh * kvl;
            struct act a = {.x = oh, .ncols = kvl, .n = 1, .q8 = s->q, .q4 = s->q, .cap_q8 = s->nq, .cap_q4 = s->nq};
            if (l->wv_b.type == MOETAX_TYPE_Q8_0 || l->wv_b.type == MOETAX_TYPE_Q4_0)
                K->quantize_act(l->wv_b.type, oh, kvl, kvl, 1, s->q);
            fw_matmul(c, &l->wv_b, h, 0, vh, &a, 0, 1, c->attv + h * vh, vh);
        }
    }
    fw_phase_end(w);

    /* 4b (batches): out_h = W_vb[h] o_h for all tokens, one batched matmul per head */
    if (n > 1) {
        fw_phase_begin(w, MOETAX_PHASE_ATTN, il);
        for (int64_t h; (h = fw_chunk(w, H, 1)) >= 0;) {
            float *og = s->f; /* [n, kvl] gathered o of head h */
            for (int64_t t = 0; t < n; t++) memcpy(og + t * kvl, c->oatt + (t * H + h) * kvl, sizeof(float) * (size_t)kvl);
            struct act a = {.x = og, .ncols = kvl, .n = n, .q8 = s->q, .q4 = s->q, .cap_q8 = s->nq, .cap_q4 = s->nq};
            if (l->wv_b.type == MOETAX_TYPE_Q8_0 || l->wv_b.type == MOETAX_TYPE_Q4_0)
                K->quantize_act(l->wv_b.type, og, kvl, kvl, n, s->q);
            fw_matmul(c, &l->wv_b, h, 0, vh, &a, 0, n, c->attv + h * vh, H * vh);
        }
        fw_phase_end(w);
    }

    /* 5: prepare the concatenated head outputs (one token: each worker itself, in phase 6) */
    const struct act *aov = &c->a_in;
    if (n > 1) {
        fw_phase_begin(w, MOETAX_PHASE_ATTN, il);
        fw_split(w, n, 1, &r0, &r1);
        struct act av = fw_act_view(&c->a_in, c->attv, H * vh, n);
        fw_act_publish(w, &c->a_in, &av);
        fw_act_prep(c, &av, r0, r1);
        fw_phase_end(w);
        fw_phase_begin(w, MOETAX_PHASE_ATTN, il);
    } else {
        fw_phase_begin(w, MOETAX_PHASE_ATTN, il);
        aov = fw_own_row(w, c->attv, H * vh, NULL);
    }

    /* 6: x += W_o attv; each block of output rows belongs to one worker */
    while (fw_rows(w, d, 64, &r0, &r1)) {
        fw_matmul(c, &l->wo, 0, r0, r1, aov, 0, n, c->tmp, d);
        for (int64_t t = 0; t < n; t++)
            for (int64_t r = r0; r < r1; r++) c->x[t * d + r] += c->tmp[t * d + r];
    }
    fw_phase_end(w);
}
