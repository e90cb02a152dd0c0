/*
 * gqa.c - grouped-query attention with a plain K/V cache (qwen3moe, qwen2moe, olmoe, Mixtral, as
 * llama.cpp's graphs): per token at position p, with r = H / Hkv query heads per KV head:
 *   q = W_q x + b_q, k = W_k x + b_k, v = W_v x + b_v (H, Hkv, Hkv heads of hk, hk, hv values;
 *   the biases are qwen2moe's, absent elsewhere)
 *   q/k RMSNorm (qk_norm: per head over hk with a [hk] weight, or over the whole row with a
 *   [H*hk] / [Hkv*hk] weight), then RoPE (NEOX or NORM mode) on each head's first n_rot values
 *   cache[p] = [k of every KV head ; v of every KV head]
 *   s_j = kq_scale * q_h . k_g(j), g = h / r, j <= p;  o_h = sum_j softmax(s)_j v_g(j)
 *   x += W_o [o_0 .. o_H-1]
 *
 * Barriers (phases) per layer, as MLA's (mla.c): 1 norm+prep, 2 q/k/v projections, 3 q/k
 * norm + rope + cache row, 4 attention, 5 prep, 6 W_o. One token has no phases 1 and 5 (each
 * worker normalises / prepares the one row itself, fw_own_row), nor phase 3 when k+v are no
 * bigger than a worker's share of phase 2 and the q/k norm is per head: one item of phase 2
 * computes all of k and v and writes the cache row, and each attention item norms and ropes
 * its own heads' q. So 3 barriers (4 without that fusion). A few tokens past one chunk of
 * positions, where a KV head's query heads would be cut into parts, split over the chunks
 * instead (split_chunks; no fusion, a phase to merge them). A batch of one token per sequence
 * in a model that stays in the caches goes token-parallel instead (gqa_attention_tokens), with
 * one barrier. A prompt's tokens of one sequence attend in tiles (attend_tile: per tile of
 * tokens and KV head, a chunk's rows read, and F16 cells converted, once for the tile; the
 * same bits as each token alone).
 *
 * The cache is paged (moetax/kvcache.h): a token attends over its own sequence's blocks in
 * chunks of a fixed number of positions (attend.h): the scores of each block are one matmul
 * over the block's K rows of KV head g (the cache row's stride) with the item's query heads as
 * the batch, the weighted sum of the V rows one chain over the chunk's blocks (wsum with acc),
 * and the chunks are merged in order: the result does not depend on where the blocks lie nor
 * on the other sequences of the micro-batch. F16 cells: each chunk's K and V rows of the KV
 * head are converted to float once, for its scores and its weighted sum (attend.c).
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "attn/gqa.h"

int64_t gqa_kv_row(const struct moetax_hparams *hp) {
    return (int64_t)hp->n_head_kv * (hp->n_embd_head_k + hp->n_embd_head_v);
}

void gqa_rope_token(struct gqa *a, const struct fw_step *s, int64_t t) {
    const struct moetax_hparams *hp = &s->m->hp;
    const struct moetax_rope_params rp = {
        .n_dims = (int)hp->n_rot, .mode = (enum moetax_rope_mode)hp->rope_mode, .n_ctx_orig = hp->rope_n_ctx_orig,
        .freq_base = hp->rope_freq_base, .freq_scale = hp->rope_freq_scale, .ext_factor = hp->rope_ext_factor,
        .attn_factor = hp->rope_attn_factor, .beta_fast = hp->rope_beta_fast, .beta_slow = hp->rope_beta_slow,
    };
    moetax_rope_cache(&rp, s->pos[t], a->ropecs + t * hp->n_rot);
}

static void add_bias(float *x, const float *b, int64_t n) {
    for (int64_t i = 0; i < n; i++) x[i] += b[i];
}

/* q or k heads [h0, h1) of one token (x: the token's row, heads of hd values): the bias (bias:
 * the whole row's, or NULL; added here only when a full-width norm did not need it first), the
 * per-head norm (per-head qk_norm only; a full-width norm is done on the whole row first) and
 * RoPE. */
static void norm_rope_heads(const struct fw_step *s, const struct gqa *a, float *x, const float *bias,
                            const float *norm_w, int64_t h0, int64_t h1, int64_t t) {
    const struct moetax_hparams *hp = &s->m->hp;
    const int64_t hd = hp->n_embd_head_k;
    for (int64_t h = h0; h < h1; h++) {
        float *xh = x + h * hd;
        if (bias) add_bias(xh, bias + h * hd, hd);
        if (norm_w && hp->qk_norm == MOETAX_QK_NORM_HEAD) s->K->rmsnorm(xh, xh, norm_w, hd, hp->rms_eps);
        s->K->rope_cached(xh, 1, hd, (int)hp->n_rot, (enum moetax_rope_mode)hp->rope_mode, a->ropecs + t * hp->n_rot);
    }
}

/* Token t's q, all heads: full-width norm (if any), per-head norm and rope. */
static void q_token(const struct fw_step *s, const struct gqa *a, int il, int64_t t) {
    const struct moetax_hparams *hp = &s->m->hp;
    const struct moetax_layer *l = &s->m->layers[il];
    const int64_t H = hp->n_head, hk = hp->n_embd_head_k;
    float *q = a->q + t * H * hk;
    const bool full = l->attn_q_norm && hp->qk_norm == MOETAX_QK_NORM_FULL;
    if (full && l->bq) add_bias(q, l->bq, H * hk);
    if (full) s->K->rmsnorm(q, q, l->attn_q_norm, H * hk, hp->rms_eps);
    norm_rope_heads(s, a, q, full ? NULL : l->bq, l->attn_q_norm, 0, H, t);
}

/* Token t's cache row of layer il: [norm+rope(k) ; v] from a->kvp (F16 / Q8_0 cells: made in the
 * worker's float row, then converted). */
static void cache_row(const struct fw_step *s, struct gqa *a, struct gqa_worker *wk, int il, int64_t t) {
    const struct moetax_hparams *hp = &s->m->hp;
    const struct moetax_layer *l = &s->m->layers[il];
    const int64_t Hkv = hp->n_head_kv, hk = hp->n_embd_head_k, kvr = a->kv_row;
    void *cell = moetax_kvcache_row(a->kv, il, s->seq[t], s->pos[t]);
    float *dst = a->ct != MOETAX_TYPE_F32 ? wk->row : cell;
    memcpy(dst, a->kvp + t * kvr, sizeof(float) * (size_t)kvr);
    if (l->bk) add_bias(dst, l->bk, Hkv * hk);
    if (l->bv) add_bias(dst + Hkv * hk, l->bv, kvr - Hkv * hk);
    if (l->attn_k_norm && hp->qk_norm == MOETAX_QK_NORM_FULL) s->K->rmsnorm(dst, dst, l->attn_k_norm, Hkv * hk, hp->rms_eps);
    norm_rope_heads(s, a, dst, NULL, l->attn_k_norm, 0, Hkv, t);
    if (a->ct != MOETAX_TYPE_F32) attend_cell_write(s->K, a->ct, dst, kvr, cell);
}

static void attend(const struct fw_step *s, struct gqa *a, struct gqa_worker *wk, int il, int64_t t, int64_t g,
                   int64_t h0, int64_t h1);
static void gqa_out(struct worker *w, struct gqa *a, int il);

/* Token-parallel, as mla.c's (mla_attention_tokens: when, and why the bits are the same): each
 * worker runs the whole attention of its own tokens, each matmul over them as a batch, and only
 * the end is a barrier. */
static bool token_parallel(const struct worker *w) {
    const struct moetax_hparams *hp = &w->s->m->hp;
    const int64_t hv = hp->n_head * hp->n_embd_head_v;
    return fw_tokens_parallel(w, hp->n_embd > hv ? hp->n_embd : hv);
}

static void gqa_attention_tokens(struct worker *w, struct gqa *a, int il) {
    struct fw_step *s = w->s;
    const struct moetax_hparams *hp = &s->m->hp;
    const struct moetax_layer *l = &s->m->layers[il];
    const int64_t H = hp->n_head, Hkv = hp->n_head_kv, hv = hp->n_embd_head_v;
    const int64_t kvr = a->kv_row, r = H / Hkv;
    struct gqa_worker *wk = &a->wk[w->ith];
    int64_t t0, t1;
    const struct act *ain = fw_tokens_begin(w, il, l->attn_norm, &t0, &t1);
    const int64_t nt = t1 - t0;
    if (ain) {
        const int64_t nq = l->wq.ne[1], nk = l->wk.ne[1], nv = l->wv.ne[1];
        fw_matmul(s, &l->wq, 0, 0, nq, ain, 0, nt, a->q + t0 * nq, nq);
        fw_matmul(s, &l->wk, 0, 0, nk, ain, 0, nt, a->kvp + t0 * kvr, kvr);
        fw_matmul(s, &l->wv, 0, 0, nv, ain, 0, nt, a->kvp + t0 * kvr + nk, kvr);
        for (int64_t t = t0; t < t1; t++) {
            cache_row(s, a, wk, il, t);
            q_token(s, a, il, t);
        }
        /* parts per KV head: one, unless one token's parts (gqa_attention) hold a single head */
        const int64_t S1 = Hkv < 2 * w->nth ? ((2 * w->nth + Hkv - 1) / Hkv < r ? (2 * w->nth + Hkv - 1) / Hkv : r) : 1;
        const int64_t S = S1 == 1 || r / S1 >= 2 ? 1 : S1;
        for (int64_t t = t0; t < t1; t++)
            for (int64_t g = 0; g < Hkv; g++)
                for (int64_t part = 0; part < S; part++)
                    attend(s, a, wk, il, t, g, g * r + r * part / S, g * r + r * (part + 1) / S);
    }
    fw_tokens_end(w, &l->wo, a->attv, H * hv, a->out, t0, t1);
}

/* Split over positions, as MLA's (mla.c, split_chunks): a micro-batch of at most ATTEND_SPLIT_TOKENS
 * tokens of which one attends over two chunks or more, where phase 4 would cut a KV head's query
 * heads into parts (the KV heads fewer than two per worker) and each part read the head's rows
 * again, runs items of (chunk, KV head) with all r of its query heads, into a->sp_o, a->sp_ms, and
 * merges each head's chunks in order in a phase of its own. Not taken where the parts would hold
 * single heads (their bits are another matmul path's; mla.c). first[t]: the chunks before token
 * t's. */
static bool split_chunks(const struct worker *w, const struct gqa *a, int64_t S1, int64_t r, int64_t *first) {
    const struct fw_step *s = w->s;
    const int64_t n = s->n;
    if (w->nth < 2 || n > ATTEND_SPLIT_TOKENS || S1 < 2 || r / S1 < 2) return false;
    return attend_chunks_first(s->pos, n, first) >= 2 && first[n] <= a->sp_cap;
}

void gqa_attention(struct worker *w, struct gqa *a, int il) {
    if (token_parallel(w)) {
        gqa_attention_tokens(w, a, il);
        return;
    }
    struct fw_step *s = w->s;
    const struct moetax_model *m = s->m;
    const struct moetax_hparams *hp = &m->hp;
    const struct moetax_layer *l = &m->layers[il];
    const int64_t n = s->n, d = hp->n_embd, H = hp->n_head, Hkv = hp->n_head_kv;
    const int64_t hk = hp->n_embd_head_k, kvr = a->kv_row, r = H / Hkv;
    int64_t r0, r1;

    /* 1: attn_norm, prepare (one token: each worker itself, in phase 2; see fw_norm_input) */
    const struct act *ain = fw_norm_input(w, MOETAX_PHASE_NORM, MOETAX_PHASE_ATTN, il, s->xn, s->x, l->attn_norm, d);

    /* 2: q, k and v projections, the rows of all three split together (blocks of 64 rows
     * from each matrix's first row: k's rows are numbered from nq rounded up to 64, v's from
     * there plus nk rounded up) */
    const int64_t nq = l->wq.ne[1], nk = l->wk.ne[1], nv = l->wv.ne[1];
    const int64_t nq64 = (nq + 63) / 64 * 64, nk64 = (nk + 63) / 64 * 64;
    const size_t kv_bytes = l->wk.mat_bytes + l->wv.mat_bytes;
    /* phase 4's parts per KV head: split its query heads only when the items would be too few for
     * the workers; a batch of at least two tokens per worker has enough (then each KV row is read
     * once per token and KV head); or split over chunks of positions instead (split_chunks) */
    const int64_t S1 = w->nth > 1 && Hkv < 2 * w->nth
                           ? ((2 * w->nth + Hkv - 1) / Hkv < r ? (2 * w->nth + Hkv - 1) / Hkv : r)
                           : 1; /* one token's; the bits stay only if its parts hold 2+ heads (mla.c) */
    int64_t first[ATTEND_SPLIT_TOKENS + 1], ntiles;
    const bool split = split_chunks(w, a, S1, r, first);
    const int64_t S = Hkv * n >= 2 * w->nth && (S1 == 1 || r / S1 >= 2) ? 1 : S1; /* phase 4's parts */
    const bool fuse = n == 1 && !split && hp->qk_norm != MOETAX_QK_NORM_FULL &&
                      kv_bytes * (size_t)w->nth <= kv_bytes + l->wq.mat_bytes;
    struct gqa_worker *wk = &a->wk[w->ith];
    if (!fuse) {
        while (fw_rows(w, nq64 + nk64 + nv, 64, &r0, &r1)) {
            if (r0 < nq) fw_matmul(s, &l->wq, 0, r0, r1 < nq ? r1 : nq, ain, 0, n, a->q, nq);
            else if (r0 >= nq64 && r0 < nq64 + nk)
                fw_matmul(s, &l->wk, 0, r0 - nq64, (r1 < nq64 + nk ? r1 : nq64 + nk) - nq64, ain, 0, n, a->kvp, kvr);
            else if (r0 >= nq64 + nk64)
                fw_matmul(s, &l->wv, 0, r0 - nq64 - nk64, r1 - nq64 - nk64, ain, 0, n, a->kvp + nk, kvr);
        }
    } else {
        /* item 0 is all of k and v and then the token's cache row (phase 3 needs no item for
         * it); then q's blocks, normed and roped per head by the attention items */
        const int64_t nqb = (nq + 63) / 64;
        for (int64_t it; (it = fw_chunk_own(w, 1 + nqb)) >= 0;) {
            if (it == 0) {
                fw_matmul(s, &l->wk, 0, 0, nk, ain, 0, 1, a->kvp, kvr);
                fw_matmul(s, &l->wv, 0, 0, nv, ain, 0, 1, a->kvp + nk, kvr);
                cache_row(s, a, wk, il, 0);
            } else {
                r0 = (it - 1) * 64;
                r1 = r0 + 64 < nq ? r0 + 64 : nq;
                fw_matmul(s, &l->wq, 0, r0, r1, ain, 0, 1, a->q, nq);
            }
        }
    }
    fw_phase_end(w);

    /* 3: per token: q norm + rope; k norm + rope and [k ; v] into the cache */
    if (!fuse) {
        fw_phase_begin(w, MOETAX_PHASE_ATTN, il);
        for (int64_t it; (it = fw_chunk(w, 2 * n, 1)) >= 0;) {
            if (it < n) cache_row(s, a, wk, il, it);
            else q_token(s, a, il, it - n);
        }
        fw_phase_end(w);
    }

    /* 4: attention per (token, KV head, part of its query heads): the KV head's rows are
     * read once for the item's heads (scores = one matmul per cache block with the item's
     * queries as the batch) */
    fw_phase_begin(w, MOETAX_PHASE_ATTN, il);
    if (split) {
        const int64_t hv = hp->n_embd_head_v;
        for (int64_t it; (it = fw_chunk(w, first[n] * Hkv, 1)) >= 0;) {
            const int64_t ci = it / Hkv, g = it % Hkv;
            int64_t t = 0;
            while (first[t + 1] <= ci) t++;
            int32_t nblk;
            const struct attend_src src = {.kv = a->kv, .layer = il, .blk = moetax_kvcache_seq_blocks(a->kv, s->seq[t], &nblk),
                                           .ct = a->ct, .kvr = kvr, .k_off = g * hk, .k_cols = hk,
                                           .v_off = Hkv * hk + g * hv, .v_cols = hv};
            attend_chunk(s->K, &src, a->q + (t * H + g * r) * hk, r, s->pos[t] + 1, ci - first[t], hp->kq_scale,
                         a->sp_o + (ci * H + g * r) * hv, hv, a->sp_ms + (ci * H + g * r) * 2, &wk->at);
        }
        fw_phase_end(w);
        /* each head's chunks merged in order into attv */
        fw_phase_begin(w, MOETAX_PHASE_ATTN, il);
        for (int64_t it; (it = fw_chunk(w, n * Hkv, 1)) >= 0;) {
            const int64_t t = it / Hkv, g = it % Hkv;
            for (int64_t h = g * r; h < (g + 1) * r; h++)
                attend_merge(s->K, a->sp_o, H * hv, a->sp_ms, H, first[t], first[t + 1], h, hv,
                             a->attv + (t * H + h) * hv);
        }
        fw_phase_end(w);
    } else if (r / S >= 2 && (ntiles = attend_tiles_for(s->seq, s->pos, n, r, Hkv, w->nth, wk->start)) > 0) {
        /* a prompt's tokens in tiles (attend_tile): per (tile, KV head) each chunk's rows read once
         * for the tile's tokens, the same bits as a token's heads alone (only where the per-token
         * items below hold 2+ heads: a head alone takes the one-row matmul's bits) */
        const int64_t hv = hp->n_embd_head_v;
        for (int64_t it; (it = fw_chunk(w, ntiles * Hkv, 1)) >= 0;) {
            const int64_t k = it / Hkv, g = it % Hkv, t0 = wk->start[k], nt = wk->start[k + 1] - t0;
            if (nt == 1) {
                attend(s, a, wk, il, t0, g, g * r, (g + 1) * r);
                continue;
            }
            int64_t np[ATTEND_TILE_ROWS];
            for (int64_t i = 0; i < nt; i++) {
                np[i] = s->pos[t0 + i] + 1;
                memcpy(wk->tq + i * r * hk, a->q + ((t0 + i) * H + g * r) * hk, sizeof(float) * (size_t)(r * hk));
            }
            int32_t nblk;
            const struct attend_src src = {.kv = a->kv, .layer = il, .blk = moetax_kvcache_seq_blocks(a->kv, s->seq[t0], &nblk),
                                           .ct = a->ct, .kvr = kvr, .k_off = g * hk, .k_cols = hk,
                                           .v_off = Hkv * hk + g * hv, .v_cols = hv};
            attend_tile(s->K, &src, wk->tq, r, np, nt, hp->kq_scale, a->attv + (t0 * H + g * r) * hv, H * hv, hv,
                        &wk->tile);
        }
        fw_phase_end(w);
    } else {
        for (int64_t it; (it = fw_chunk(w, n * Hkv * S, 1)) >= 0;) {
            const int64_t t = it / (Hkv * S), g = it / S % Hkv, part = it % S;
            const int64_t h0 = g * r + r * part / S, h1 = g * r + r * (part + 1) / S;
            if (fuse) norm_rope_heads(s, a, a->q + t * H * hk, l->bq, l->attn_q_norm, h0, h1, t);
            attend(s, a, wk, il, t, g, h0, h1);
        }
        fw_phase_end(w);
    }
    gqa_out(w, a, il);
}

/* Heads [h0, h1) of token t (all of KV head g's, or a part of them) over its sequence's
 * positions 0 .. pos (q made) into a->attv, in chunks (attend.h): each chunk's scores are one
 * matmul per cache block over the block's K rows of KV head g with the heads as its batch, the
 * weighted sums of its V rows one chain over its blocks. */
static void attend(const struct fw_step *s, struct gqa *a, struct gqa_worker *wk, int il, int64_t t, int64_t g,
                   int64_t h0, int64_t h1) {
    const struct moetax_hparams *hp = &s->m->hp;
    const int64_t H = hp->n_head, Hkv = hp->n_head_kv, hk = hp->n_embd_head_k, hv = hp->n_embd_head_v;
    int32_t nblk;
    const struct attend_src src = {.kv = a->kv, .layer = il, .blk = moetax_kvcache_seq_blocks(a->kv, s->seq[t], &nblk),
                                   .ct = a->ct, .kvr = a->kv_row, .k_off = g * hk, .k_cols = hk,
                                   .v_off = Hkv * hk + g * hv, .v_cols = hv};
    attend_heads(s->K, &src, a->q + t * H * hk + h0 * hk, h1 - h0, s->pos[t] + 1, hp->kq_scale,
                 a->attv + t * H * hv + h0 * hv, hv, &wk->at);
}

/* Phases 5 and 6 (see gqa_attention) */
static void gqa_out(struct worker *w, struct gqa *a, int il) {
    struct fw_step *s = w->s;
    const struct moetax_hparams *hp = &s->m->hp;
    const struct moetax_layer *l = &s->m->layers[il];
    const int64_t n = s->n, d = hp->n_embd, H = hp->n_head, hv = hp->n_embd_head_v;
    int64_t r0, r1;
    /* 5: prepare the concatenated head outputs (one token: each worker itself, in phase 6) */
    const struct act *aov = &s->a_in;
    if (!fw_own_fits(n, H * hv)) {
        fw_phase_begin(w, MOETAX_PHASE_ATTN, il);
        fw_split(w, n, 1, &r0, &r1);
        struct act av = fw_act_view(&s->a_in, a->attv, H * hv, n);
        fw_act_publish(w, &s->a_in, &av);
        fw_act_prep(s, &av, r0, r1);
        fw_phase_end(w);
        fw_phase_begin(w, MOETAX_PHASE_ATTN, il);
    } else {
        fw_phase_begin(w, MOETAX_PHASE_ATTN, il);
        aov = fw_own_rows(w, a->attv, H * hv, n, NULL);
    }

    /* 6: x += W_o attv; each block of output rows belongs to one worker */
    while (fw_rows(w, d, 64, &r0, &r1)) {
        fw_matmul(s, &l->wo, 0, r0, r1, aov, 0, n, a->out, d);
        for (int64_t t = 0; t < n; t++)
            for (int64_t rr = r0; rr < r1; rr++) s->x[t * d + rr] += a->out[t * d + rr];
    }
    fw_phase_end(w);
}

/* ---- buffers ------------------------------------------------------------------------ */

moetax_status gqa_init(struct gqa *a, const struct fw_step *s, struct moetax_kvcache *kv) {
    const struct moetax_hparams *hp = &s->m->hp;
    const int64_t U = s->n_ubatch, d = hp->n_embd, H = hp->n_head, hk = hp->n_embd_head_k, hv = hp->n_embd_head_v;
    memset(a, 0, sizeof *a);
    a->kv = kv;
    a->kv_row = gqa_kv_row(hp);
    a->ct = moetax_kvcache_type(kv);
    if (a->ct == MOETAX_TYPE_Q8_0 && (hk % 32 || hv % 32))
        return moetax_error(MOETAX_ERR_UNSUPPORTED,
                            "q8_0 KV cache cells hold a head's keys and values in blocks of 32 values, and this "
                            "model's heads have %lld-value keys and %lld-value values: use --cache-type f16 or f32",
                            (long long)hk, (long long)hv);
    a->n_threads = s->n_threads;
    a->q = calloc((size_t)(U * H * hk), sizeof(float));
    a->kvp = calloc((size_t)(U * a->kv_row), sizeof(float));
    a->attv = calloc((size_t)(U * H * hv), sizeof(float));
    a->out = calloc((size_t)(U * d), sizeof(float));
    a->ropecs = calloc((size_t)(U * (hp->n_rot > 0 ? hp->n_rot : 1)), sizeof(float));
    if (s->n_threads > 1) { /* split_chunks' items */
        a->sp_cap = attend_split_cap(moetax_kvcache_n_cells(kv), U);
        a->sp_o = malloc(sizeof(float) * (size_t)(a->sp_cap * H * hv));
        a->sp_ms = malloc(sizeof(float) * (size_t)(a->sp_cap * H * 2));
    }
    a->wk = calloc((size_t)a->n_threads, sizeof *a->wk);
    bool ok = a->q && a->kvp && a->attv && a->out && a->ropecs && a->wk && (!a->sp_cap || (a->sp_o && a->sp_ms));
    for (int i = 0; ok && i < a->n_threads; i++) {
        struct gqa_worker *wk = &a->wk[i];
        wk->sc = calloc((size_t)attend_scratch_floats(H, hv), sizeof(float)); /* an item has at most r <= H heads */
        wk->row = calloc((size_t)attend_cell_row_floats(a->kv_row), sizeof(float));
        const int64_t r = H / hp->n_head_kv, nq = r > ATTEND_TILE_ROWS ? r : ATTEND_TILE_ROWS;
        /* an item's heads are at most H (attend_heads) or a tile's nq rows */
        wk->vb = a->ct != MOETAX_TYPE_F32 ? calloc((size_t)attend_cells_floats(hk, hv, H > nq ? H : nq), sizeof(float)) : NULL;
        wk->at = attend_scratch_at(wk->sc, H, hv, wk->vb);
        wk->tbuf = malloc(sizeof(float) * (size_t)attend_tile_floats(nq, hv));
        wk->tile = attend_tile_at(wk->tbuf, nq, hv, wk->vb);
        wk->tq = malloc(sizeof(float) * (size_t)(nq * hk));
        wk->start = malloc(sizeof(int64_t) * (size_t)(U + 1));
        ok = wk->sc && wk->row && (a->ct == MOETAX_TYPE_F32 || wk->vb) && wk->tbuf && wk->tq && wk->start;
    }
    if (!ok) {
        gqa_free(a);
        return moetax_error(MOETAX_ERR_NOMEM, "out of memory for attention buffers");
    }
    return MOETAX_OK;
}

void gqa_free(struct gqa *a) {
    free(a->q); free(a->kvp); free(a->attv); free(a->out); free(a->ropecs); free(a->sp_o); free(a->sp_ms);
    if (a->wk)
        for (int i = 0; i < a->n_threads; i++) {
            free(a->wk[i].sc);
            free(a->wk[i].row);
            free(a->wk[i].vb);
            free(a->wk[i].tbuf);
            free(a->wk[i].tq);
            free(a->wk[i].start);
        }
    free(a->wk);
    memset(a, 0, sizeof *a);
}
