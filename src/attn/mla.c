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
 * heads' q_abs. So 3 barriers (4 with q_lora, +1 without that fusion). A few tokens past one
 * chunk of positions (attend.h) split phase 4 over the chunks instead (split_chunks): 4 the
 * chunks, 4b their merge per head and W_vb; no fusion.
 * A batch of one token per sequence in a model that stays in the caches goes
 * token-parallel instead (mla_attention_tokens): each worker runs all of these
 * steps for its own tokens, and only the end is a barrier. A prompt's tokens of
 * one sequence attend in tiles in phase 4 (attend_tile: a chunk's rows read once
 * for several tokens, the same bits). With MOETAX_ATTN_PREFILL_AUTO/DECOMPRESSED a
 * prompt's micro-batch of one sequence may take the decompressed form instead
 * (dec_pays, dec_head below): phase 3 then ropes q_pe in place and makes no
 * q_abs, phase 4 is one item per head into the heads' outputs, and there is no 4b.
 *
 * The cache is paged (moetax/kvcache.h): token t of sequence s at position p
 * writes its row into s's block for p and attends over s's positions 0..p in
 * chunks of a fixed number of positions (attend.h): per chunk the scores of
 * each block's rows are one matmul, the weighted sum one chain over the
 * chunk's blocks (wsum with acc), and the chunks are merged in order, so the
 * result does not depend on where the blocks lie nor on the other sequences
 * of the micro-batch. F16 cells: each chunk's rows are converted to float
 * once, for its scores and its weighted sum (attend.c).
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "attn/mla.h"

/* Token t's cache row of layer il: [rmsnorm(kv) ; rope(k_pe)] from a->kva (F16 / Q8_0 cells: made
 * in the worker's float row, then converted). */
static void cache_row(const struct fw_step *s, struct mla *a, struct mla_worker *wk, int il, int64_t t) {
    const struct moetax_hparams *hp = &s->m->hp;
    const struct moetax_layer *l = &s->m->layers[il];
    const int64_t kvl = hp->kv_lora_rank, rope = hp->n_embd_head_qk_rope, kvr = a->kv_row;
    void *cell = moetax_kvcache_row(a->kv, il, s->seq[t], s->pos[t]);
    float *dst = a->ct != MOETAX_TYPE_F32 ? wk->row : cell;
    const float *src = a->kva + t * kvr;
    s->K->rmsnorm(dst, src, l->kv_a_norm, kvl, hp->rms_eps);
    memcpy(dst + kvl, src + kvl, sizeof(float) * (size_t)rope);
    s->K->rope_cached(dst + kvl, 1, rope, (int)rope, MOETAX_ROPE_MODE_NORM, a->ropecs + t * rope);
    if (a->ct == MOETAX_TYPE_Q8_0) /* the padding to whole blocks zero (dec_head converts whole rows into wk->row) */
        memset(dst + kvr, 0, sizeof(float) * (size_t)(attend_cell_row_floats(kvr) - kvr));
    if (a->ct != MOETAX_TYPE_F32) attend_cell_write(s->K, a->ct, dst, kvr, cell);
}

/* Head h, tokens [t0, t1) of the micro-batch: Q_h = [W_kb[h] q_nope ; rope(q_pe)] into a->qabs
 * (one batched matmul, so W_kb[h] is read once for them; scratch wk->f, wk->q). */
static void q_abs_head_range(const struct fw_step *s, struct mla *a, struct mla_worker *wk, int il, int64_t h,
                             int64_t t0, int64_t t1) {
    const struct moetax_hparams *hp = &s->m->hp;
    const struct moetax_layer *l = &s->m->layers[il];
    const int64_t n = t1 - t0, H = hp->n_head, nope = hp->n_embd_head_qk_nope, rope = hp->n_embd_head_qk_rope;
    const int64_t kvl = hp->kv_lora_rank, qrow = H * (nope + rope), kvr = a->kv_row;
    float *qn = wk->f; /* [n, nope] gathered q_nope of head h */
    for (int64_t t = t0; t < t1; t++) {
        const float *qh = a->q + t * qrow + h * (nope + rope);
        float *Q = a->qabs + (t * H + h) * kvr;
        memcpy(Q + kvl, qh + nope, sizeof(float) * (size_t)rope);
        s->K->rope_cached(Q + kvl, 1, rope, (int)rope, MOETAX_ROPE_MODE_NORM, a->ropecs + t * rope);
        memcpy(qn + (t - t0) * nope, qh, sizeof(float) * (size_t)nope);
    }
    struct act x = {.x = qn, .ncols = nope, .n = n, .q8 = wk->q, .q4 = wk->q, .cap_q8 = wk->nq, .cap_q4 = wk->nq};
    if (moetax_act_is_q8_0(l->wk_b.type) || moetax_act_is_q4_0(l->wk_b.type))
        s->K->quantize_act(l->wk_b.type, qn, nope, nope, n, wk->q);
    fw_matmul(s, &l->wk_b, h, 0, kvl, &x, 0, n, a->qabs + (t0 * H + h) * kvr, H * kvr);
}

static void q_abs_head(const struct fw_step *s, struct mla *a, struct mla_worker *wk, int il, int64_t h) {
    q_abs_head_range(s, a, wk, il, h, 0, s->n);
}

/* Head h, tokens [t0, t1): out_h = W_vb[h] o_h from a->oatt into a->attv (one batched matmul, so
 * W_vb[h] is read once for them; scratch wk->f, wk->q). */
static void v_b_head_range(const struct fw_step *s, struct mla *a, struct mla_worker *wk, int il, int64_t h,
                           int64_t t0, int64_t t1) {
    const struct moetax_hparams *hp = &s->m->hp;
    const struct moetax_layer *l = &s->m->layers[il];
    const int64_t n = t1 - t0, H = hp->n_head, vh = hp->n_embd_head_v, kvl = hp->kv_lora_rank;
    float *og = wk->f; /* [n, kvl] gathered o of head h */
    for (int64_t t = t0; t < t1; t++)
        memcpy(og + (t - t0) * kvl, a->oatt + (t * H + h) * kvl, sizeof(float) * (size_t)kvl);
    struct act x = {.x = og, .ncols = kvl, .n = n, .q8 = wk->q, .q4 = wk->q, .cap_q8 = wk->nq, .cap_q4 = wk->nq};
    if (moetax_act_is_q8_0(l->wv_b.type) || moetax_act_is_q4_0(l->wv_b.type))
        s->K->quantize_act(l->wv_b.type, og, kvl, kvl, n, wk->q);
    fw_matmul(s, &l->wv_b, h, 0, vh, &x, 0, n, a->attv + t0 * H * vh + h * vh, H * vh);
}

void mla_rope_token(struct mla *a, const struct fw_step *s, int64_t t) {
    const struct moetax_hparams *hp = &s->m->hp;
    const struct moetax_rope_params rp = {
        .n_dims = (int)hp->n_embd_head_qk_rope, .mode = MOETAX_ROPE_MODE_NORM, .n_ctx_orig = hp->rope_n_ctx_orig,
        .freq_base = hp->rope_freq_base, .freq_scale = hp->rope_freq_scale, .ext_factor = hp->rope_ext_factor,
        .attn_factor = hp->rope_attn_factor, .beta_fast = hp->rope_beta_fast, .beta_slow = hp->rope_beta_slow,
    };
    moetax_rope_cache(&rp, s->pos[t], a->ropecs + t * hp->n_embd_head_qk_rope);
}

/* Heads [h0, h1) of token t over its sequence's positions 0 .. pos (a->qabs made) into o
 * [heads][kv_lora], in chunks (attend.h): each chunk's scores are one matmul per cache block with
 * the heads as its batch, the weighted sums of its kv parts one chain over its blocks. */
static void attend(const struct fw_step *s, struct mla *a, struct mla_worker *wk, int il, int64_t t, int64_t h0,
                   int64_t h1, float *o) {
    const struct moetax_hparams *hp = &s->m->hp;
    const int64_t H = hp->n_head, kvl = hp->kv_lora_rank, kvr = a->kv_row;
    int32_t nblk;
    const struct attend_src src = {.kv = a->kv, .layer = il, .blk = moetax_kvcache_seq_blocks(a->kv, s->seq[t], &nblk),
                                   .ct = a->ct, .kvr = kvr, .k_off = 0, .k_cols = kvr, .v_off = 0, .v_cols = kvl};
    attend_heads(s->K, &src, a->qabs + (t * H + h0) * kvr, h1 - h0, s->pos[t] + 1, hp->kq_scale, o, kvl, &wk->at);
}

/* Whether this micro-batch's attention runs token-parallel (mla_attention_tokens; fw_tokens_parallel
 * with the widest row a worker holds: the normed input, q_a's or the heads' outputs). */
static bool token_parallel(const struct worker *w) {
    const struct moetax_hparams *hp = &w->s->m->hp;
    const int64_t wide = hp->n_embd > hp->q_lora_rank ? hp->n_embd : hp->q_lora_rank;
    const int64_t hv = hp->n_head * hp->n_embd_head_v;
    return fw_tokens_parallel(w, wide > hv ? wide : hv);
}

/* Token-parallel (token_parallel): each worker runs the whole attention of its own tokens (a
 * static split), each matmul over them as a batch, with one barrier at the end instead of one per
 * phase. The same bits as the phases below: the quantized matmuls are batch-invariant (kernels.h)
 * and float weights go one row at a time in a quantized model (fw_matmul); a token's heads are
 * one group when one token's groups there hold 2+ heads each (see phase 4), else the same groups. */
static void mla_attention_tokens(struct worker *w, struct mla *a, int il) {
    struct fw_step *s = w->s;
    const struct moetax_hparams *hp = &s->m->hp;
    const struct moetax_layer *l = &s->m->layers[il];
    const int64_t H = hp->n_head, nope = hp->n_embd_head_qk_nope;
    const int64_t rope = hp->n_embd_head_qk_rope, vh = hp->n_embd_head_v, kvl = hp->kv_lora_rank;
    const int64_t ql = hp->q_lora_rank, qrow = H * (nope + rope);
    struct mla_worker *wk = &a->wk[w->ith];
    int64_t t0, t1;
    const struct act *ain = fw_tokens_begin(w, il, l->attn_norm, &t0, &t1);
    const int64_t nt = t1 - t0;
    if (ain) {
        const struct moetax_weight *wq = ql ? &l->wq_a : &l->wq;
        const int64_t nq = wq->ne[1], nkv = l->wkv_a.ne[1];
        fw_matmul(s, &l->wkv_a, 0, 0, nkv, ain, 0, nt, a->kva + t0 * nkv, nkv);
        fw_matmul(s, wq, 0, 0, nq, ain, 0, nt, (ql ? a->qa : a->q) + t0 * nq, nq);
        if (ql) {
            const struct act *aq = fw_own_rows(w, a->qa + t0 * ql, ql, nt, l->q_a_norm);
            fw_matmul(s, &l->wq_b, 0, 0, qrow, aq, 0, nt, a->q + t0 * qrow, qrow);
        }
        for (int64_t t = t0; t < t1; t++) cache_row(s, a, wk, il, t);
        for (int64_t h = 0; h < H; h++) q_abs_head_range(s, a, wk, il, h, t0, t1);
        const int64_t G1 = H < 2 * w->nth ? H : 2 * w->nth, G = H / G1 >= 2 ? 1 : G1;
        for (int64_t t = t0; t < t1; t++)
            for (int64_t g = 0; g < G; g++) {
                const int64_t h0 = H * g / G, h1 = H * (g + 1) / G;
                attend(s, a, wk, il, t, h0, h1, a->oatt + (t * H + h0) * kvl);
            }
        for (int64_t h = 0; h < H; h++) v_b_head_range(s, a, wk, il, h, t0, t1);
    }
    fw_tokens_end(w, &l->wo, a->attv, H * vh, a->out, t0, t1);
}

/* Split over positions: a micro-batch of at most ATTEND_SPLIT_TOKENS tokens of which one attends over two
 * chunks (attend.h) or more runs its chunks as the work items of phase 4 (into a->sp_o, a->sp_ms),
 * and merges them per head in phase 4b. Split by heads instead (one group per worker), every
 * worker reads all of a long context's cache rows from memory, and a few tokens cannot be dealt out
 * evenly. An item is a chunk with all heads, or with one of *hg groups of them where the chunks are
 * fewer than two per worker (a short last chunk would otherwise hold the phase up). The same bits:
 * a chunk's results do not depend on the heads computed with it (2 or more), and the merge is
 * attend_heads' in the same order. Where one token's head groups would hold single heads (n_head <
 * 2 x groups) the split is not taken, as the batch path's one group per token is not (phase 4).
 * first[t] (t <= n): the chunks before token t's. */
static bool split_chunks(const struct worker *w, const struct mla *a, int64_t G1, int64_t *first, int64_t *hg) {
    const struct fw_step *s = w->s;
    const int64_t n = s->n, H = s->m->hp.n_head;
    if (w->nth < 2 || n > ATTEND_SPLIT_TOKENS || H / G1 < 2) return false;
    const int64_t most = attend_chunks_first(s->pos, n, first), total = first[n];
    for (*hg = 1; total * *hg < 2 * w->nth && H / (*hg + 1) >= 2;) ++*hg;
    return most >= 2 && total <= a->sp_cap;
}

/* Token t's attention for head h merged from its chunks (split_chunks' items) into o [kv_lora]. */
static void split_merge(const struct fw_step *s, const struct mla *a, const int64_t *first, int64_t t, int64_t h,
                        float *o) {
    const int64_t H = s->m->hp.n_head, kvl = s->m->hp.kv_lora_rank;
    attend_merge(s->K, a->sp_o, H * kvl, a->sp_ms, H, first[t], first[t + 1], h, kvl, o);
}

/* One token (decode): out_h = W_vb[h] o_h for heads [h0, h1), o [h1 - h0][kv_lora]. */
static void v_b_one(const struct fw_step *s, struct mla *a, struct mla_worker *wk, int il, int64_t h0, int64_t h1,
                    const float *o) {
    const struct moetax_hparams *hp = &s->m->hp;
    const struct moetax_layer *l = &s->m->layers[il];
    const int64_t vh = hp->n_embd_head_v, kvl = hp->kv_lora_rank;
    for (int64_t h = h0; h < h1; h++) {
        const float *oh = o + (h - h0) * kvl;
        struct act x = {.x = (float *)oh, .ncols = kvl, .n = 1, .q8 = wk->q, .q4 = wk->q, .cap_q8 = wk->nq, .cap_q4 = wk->nq};
        if (moetax_act_is_q8_0(l->wv_b.type) || moetax_act_is_q4_0(l->wv_b.type))
            s->K->quantize_act(l->wv_b.type, oh, kvl, kvl, 1, wk->q);
        fw_matmul(s, &l->wv_b, h, 0, vh, &x, 0, 1, a->attv + h * vh, vh);
    }
}

/* ---- prefill with the keys and values decompressed ---------------------------------------- *
 * A long prompt's micro-batch: T tokens of one sequence at positions p0 .. p0+T-1 attend over
 * N = p0 + T positions. Absorbed, each (head, query, position) costs a dot product and a
 * weighted sum over the cache's kv_lora + rope and kv_lora values; with the positions' keys and
 * values decompressed per head,
 *   k_h[j] = [W_kb[h]^T kv_j ; k_pe_j],  v_h[j] = W_vb[h] kv_j,
 * it costs nope + rope and v_head (DeepSeek-V2: 192 + 128 against 576 + 512), while the
 * decompression costs N (nope + v_head) kv_lora per head and micro-batch. The mathematics is the
 * same (q_h . k_h[j] = Q_h . cache[j], W_vb[h] sum_j p_j kv_j = sum_j p_j v_h[j]); the float
 * sums are not, so a prompt's logits then depend (in the last bits) on how it is cut into
 * micro-batches, as llama.cpp's do. dec_pays chooses by the two costs; MOETAX_ATTN_PREFILL_ABSORBED
 * keeps the absorbed form everywhere.
 *
 * One work item per head: W_kb[h] transposed and W_vb[h] in float (from the file's bytes), then
 * per chunk of ATTEND_CHUNK positions the chunk's kv rows gathered, its keys and values made, and
 * every query at or past the chunk's start attending to it in tiles of MLA_DEC_TILE queries (the
 * scores one F32 matmul with the queries as its batch, the weighted sum one wsum); the chunks are
 * merged in order as attend.h's. */
/* W_kb[h] and W_vb[h] as stored in the file (or in memory, where not repacked), else NULL. */
static const void *dec_src(const struct moetax_kernels *K, const struct moetax_weight *w) {
    if (!w->data) return NULL;
    if (w->file_data) return w->file_data;
    return K->weights_repacked && K->weights_repacked(w->type) ? NULL : w->data;
}

/* Whether this micro-batch takes the decompressed form: one sequence's consecutive positions,
 * and less time by the two forms' multiply-adds: per (head, query, position) 2 kv_lora + rope
 * against nope + rope + v_head, all on float tiles; per head the absorbed form's W_kb and W_vb
 * products for each query against the decompression's for each position, which run on float tiles
 * too while the absorbed form's run on the integer ones where those weights are quantized
 * (MLA_DEC_INT_SPEED times the multiply-adds a second); and by a margin (MLA_DEC_MARGIN) for what
 * this count leaves out: each head's weights made float, the gathers, the merges. */
static bool dec_pays(const struct fw_step *s, const struct mla *a, int il) {
    if (!a->dec || s->n < 2) return false;
    for (int64_t t = 1; t < s->n; t++)
        if (s->seq[t] != s->seq[0] || s->pos[t] != s->pos[0] + t) return false;
    if (a->dec_mode == MOETAX_ATTN_PREFILL_DECOMPRESSED) return true;
    const struct moetax_hparams *hp = &s->m->hp;
    const struct moetax_layer *l = &s->m->layers[il];
    const double n = (double)s->n, N = (double)s->pos[0] + n, pairs = n * ((double)s->pos[0] + (n + 1) / 2);
    const double kvl = (double)hp->kv_lora_rank, nope = (double)hp->n_embd_head_qk_nope;
    const double rope = (double)hp->n_embd_head_qk_rope, vh = (double)hp->n_embd_head_v;
    const bool fl = l->wk_b.type == MOETAX_TYPE_F32 || l->wk_b.type == MOETAX_TYPE_F16 || l->wk_b.type == MOETAX_TYPE_BF16;
    const double absorbed = pairs * (2 * kvl + rope) + n * (nope + vh) * kvl / (fl ? 1.0 : MLA_DEC_INT_SPEED);
    const double decompressed = pairs * (nope + rope + vh) + N * (nope + vh) * kvl;
    return decompressed < MLA_DEC_MARGIN * absorbed;
}

/* Head h of the micro-batch (dec_pays) into a->attv. */
static void dec_head(const struct fw_step *s, struct mla *a, struct mla_worker *wk, int il, int64_t h) {
    const struct moetax_hparams *hp = &s->m->hp;
    const struct moetax_layer *l = &s->m->layers[il];
    const struct moetax_kernels *K = s->K;
    const int64_t n = s->n, H = hp->n_head, nope = hp->n_embd_head_qk_nope, rope = hp->n_embd_head_qk_rope;
    const int64_t vh = hp->n_embd_head_v, kvl = hp->kv_lora_rank, kvr = a->kv_row, kr = nope + rope;
    const int64_t qrow = H * kr, p0 = s->pos[0], N = p0 + n, bs = moetax_kvcache_block_size(a->kv);
    /* W_kb[h] (kvl rows of nope) transposed, W_vb[h] (vh rows of kvl) */
    const char *kb = (const char *)dec_src(K, &l->wk_b) + (size_t)h * l->wk_b.mat_bytes;
    const char *vb = (const char *)dec_src(K, &l->wv_b) + (size_t)h * l->wv_b.mat_bytes;
    for (int64_t r = 0; r < kvl; r++) {
        moetax_to_float(l->wk_b.type, kb + (size_t)r * l->wk_b.row_bytes, wk->g, nope);
        for (int64_t c = 0; c < nope; c++) wk->wkt[c * kvl + r] = wk->g[c];
    }
    for (int64_t r = 0; r < vh; r++) moetax_to_float(l->wv_b.type, vb + (size_t)r * l->wv_b.row_bytes, wk->wv + r * kvl, kvl);
    int32_t nblk;
    const int32_t *blk = moetax_kvcache_seq_blocks(a->kv, s->seq[0], &nblk);
    float *o = a->attv + h * vh; /* token t's at + t * H * vh */
    const int64_t ldo = H * vh;
    for (int64_t c0 = 0; c0 < N; c0 += ATTEND_CHUNK) {
        const int64_t cn = N - c0 < ATTEND_CHUNK ? N - c0 : ATTEND_CHUNK;
        /* the chunk's keys and values, MLA_DEC_ROWS positions at a time (their kv rows gathered into
         * g, k_pe into kc's last rope columns): what a worker touches stays within its L2 */
        for (int64_t j0 = 0; j0 < cn; j0 += MLA_DEC_ROWS) {
            const int64_t nj = cn - j0 < MLA_DEC_ROWS ? cn - j0 : MLA_DEC_ROWS;
            for (int64_t j = j0; j < j0 + nj; j++) {
                const int64_t p = c0 + j;
                const void *row = (const char *)moetax_kvcache_block_rows(a->kv, il, blk[p / bs]) +
                                  (size_t)(p % bs) * moetax_kvcache_row_bytes(a->kv);
                float *g = wk->g + (j - j0) * kvl;
                if (a->ct == MOETAX_TYPE_F16) {
                    K->fp16_to_fp32(row, g, kvl);
                    K->fp16_to_fp32((const uint16_t *)row + kvl, wk->kc + j * kr + nope, rope);
                } else if (a->ct == MOETAX_TYPE_Q8_0) { /* the whole row's blocks, then its parts */
                    K->q8_0_to_fp32(row, wk->row, attend_cell_row_floats(kvr));
                    memcpy(g, wk->row, sizeof(float) * (size_t)kvl);
                    memcpy(wk->kc + j * kr + nope, wk->row + kvl, sizeof(float) * (size_t)rope);
                } else {
                    memcpy(g, row, sizeof(float) * (size_t)kvl);
                    memcpy(wk->kc + j * kr + nope, (const float *)row + kvl, sizeof(float) * (size_t)rope);
                }
            }
            K->matmul(MOETAX_TYPE_F32, wk->wkt, sizeof(float) * (size_t)kvl, 0, nope, kvl, wk->g, nj, wk->kc + j0 * kr, kr);
            K->matmul(MOETAX_TYPE_F32, wk->wv, sizeof(float) * (size_t)kvl, 0, vh, kvl, wk->g, nj, wk->vc + j0 * vh, vh);
        }
        /* the queries at or past c0, in tiles */
        for (int64_t t0 = c0 > p0 ? c0 - p0 : 0; t0 < n; t0 += MLA_DEC_TILE) {
            const int64_t nt = n - t0 < MLA_DEC_TILE ? n - t0 : MLA_DEC_TILE;
            for (int64_t i = 0; i < nt; i++)
                memcpy(wk->qt + i * kr, a->q + (t0 + i) * qrow + h * kr, sizeof(float) * (size_t)kr);
            float *sc = wk->sc; /* [nt][cn] */
            K->matmul(MOETAX_TYPE_F32, wk->kc, sizeof(float) * (size_t)kr, 0, cn, kr, wk->qt, nt, sc, cn);
            for (int64_t i = 0; i < nt; i++) {
                const int64_t valid = p0 + t0 + i + 1 - c0 < cn ? p0 + t0 + i + 1 - c0 : cn;
                float *si = sc + i * cn;
                K->scale(si, hp->kq_scale, valid);
                K->softmax(si, valid, wk->ms + 2 * i);
                if (valid < cn) memset(si + valid, 0, sizeof(float) * (size_t)(cn - valid));
            }
            if (c0 == 0) {
                K->wsum(o + t0 * ldo, ldo, sc, cn, nt, wk->vc, vh, cn, vh, false);
                for (int64_t i = 0; i < nt; i++) {
                    wk->run[2 * (t0 + i)] = wk->ms[2 * i];
                    wk->run[2 * (t0 + i) + 1] = wk->ms[2 * i + 1];
                }
            } else {
                K->wsum(wk->oc, vh, sc, cn, nt, wk->vc, vh, cn, vh, false);
                for (int64_t i = 0; i < nt; i++)
                    attend_fold(K, o + (t0 + i) * ldo, wk->oc + i * vh, vh, wk->run + 2 * (t0 + i), wk->ms[2 * i],
                                wk->ms[2 * i + 1]);
            }
        }
    }
}

void mla_attention(struct worker *w, struct mla *a, int il) {
    if (token_parallel(w)) {
        mla_attention_tokens(w, a, il);
        return;
    }
    struct fw_step *s = w->s;
    const struct moetax_model *m = s->m;
    const struct moetax_hparams *hp = &m->hp;
    const struct moetax_layer *l = &m->layers[il];
    const struct moetax_kernels *K = s->K;
    const int64_t n = s->n, d = hp->n_embd, H = hp->n_head, nope = hp->n_embd_head_qk_nope;
    const int64_t rope = hp->n_embd_head_qk_rope, vh = hp->n_embd_head_v, kvl = hp->kv_lora_rank;
    const int64_t ql = hp->q_lora_rank, qrow = H * (nope + rope);
    int64_t r0, r1;

    /* 1: attn_norm, prepare (one token: each worker itself, in phase 2; see fw_norm_input) */
    const struct act *ain = fw_norm_input(w, MOETAX_PHASE_NORM, MOETAX_PHASE_ATTN, il, s->xn, s->x, l->attn_norm, d);

    /* 2: q (or q_a) and kv_a projections, rows of both split together */
    const struct moetax_weight *wq = ql ? &l->wq_a : &l->wq;
    float *qout = ql ? a->qa : a->q;
    const int64_t nq = wq->ne[1], nkv = l->wkv_a.ne[1];
    /* blocks of 64 rows from each matrix's first row (kernels.h, ROW RANGES): kv_a's
     * rows are numbered from nq rounded up to 64 */
    const int64_t nq64 = (nq + 63) / 64 * 64;
    /* One token, and kv_a no bigger than a worker's share of the phase's bytes: kv_a is one
     * work item that also writes the token's cache row, so phase 3 can go (see below).
     * With many workers (or a kv_a larger than q) that item would hold the phase up. */
    /* phase 4's head groups per token and whether it splits over positions instead (split_chunks) */
    int64_t np_max = 0;
    for (int64_t t = 0; t < n; t++) np_max = s->pos[t] + 1 > np_max ? s->pos[t] + 1 : np_max;
    const int64_t per = np_max > ATTEND_CHUNK ? 1 : 2;
    const int64_t G1 = w->nth > 1 ? (H < per * w->nth ? H : per * w->nth) : 1; /* one token's */
    int64_t first[ATTEND_SPLIT_TOKENS + 1], hg = 1;
    const bool dec = dec_pays(s, a, il); /* a long prompt's keys and values decompressed (dec_head) */
    const bool split = !dec && split_chunks(w, a, G1, first, &hg);
    const bool fuse = n == 1 && !split && l->wkv_a.mat_bytes * (size_t)w->nth <= l->wkv_a.mat_bytes + wq->mat_bytes;
    if (!fuse) {
        while (fw_rows(w, nq64 + nkv, 64, &r0, &r1)) {
            if (r0 < nq) fw_matmul(s, wq, 0, r0, r1 < nq ? r1 : nq, ain, 0, n, qout, nq);
            else if (r0 >= nq64) fw_matmul(s, &l->wkv_a, 0, r0 - nq64, r1 - nq64, ain, 0, n, a->kva, nkv);
        }
    } else {
        /* item 0 is all of kv_a and then the token's cache row (so phase 3 needs no item
         * for it and can run into phase 4 without a barrier); then q's blocks */
        const int64_t nqb = (nq + 63) / 64;
        for (int64_t it; (it = fw_chunk_own(w, 1 + nqb)) >= 0;) {
            if (it == 0) {
                fw_matmul(s, &l->wkv_a, 0, 0, nkv, ain, 0, 1, a->kva, nkv);
                cache_row(s, a, &a->wk[w->ith], il, 0);
            } else {
                r0 = (it - 1) * 64;
                r1 = r0 + 64 < nq ? r0 + 64 : nq;
                fw_matmul(s, wq, 0, r0, r1, ain, 0, 1, qout, nq);
            }
        }
    }
    fw_phase_end(w);

    if (ql) { /* q_a norm + prepare (one token: by each worker itself), then q_b */
        const struct act *aqp =
            fw_norm_input(w, MOETAX_PHASE_ATTN, MOETAX_PHASE_ATTN, il, a->qa, a->qa, l->q_a_norm, ql);
        while (fw_rows(w, qrow, 64, &r0, &r1)) fw_matmul(s, &l->wq_b, 0, r0, r1, aqp, 0, n, a->q, qrow);
        fw_phase_end(w);
    }

    /* 3: per token: kv norm + rope(k_pe) into the cache; per head, for all tokens of the
     * micro-batch at once: rope(q_pe) and q_abs = W_kb[h] q_nope (one batched matmul per head,
     * so each head's W_kb is read once per micro-batch). Fused (one token, see phase 2): the
     * cache row was written in phase 2, and each item of phase 4 makes its own heads' q_abs
     * first (no barrier). */
    struct mla_worker *wk = &a->wk[w->ith];
    if (!fuse) {
        fw_phase_begin(w, MOETAX_PHASE_ATTN, il);
        /* each worker a contiguous run of heads: their W_kb matrices lie one after another, so
         * the worker reads them as one stream, which the prefetchers follow (one short stream
         * per head, heads dealt out in turn, took half as long again from memory) */
        fw_split(w, n, 1, &r0, &r1);
        for (int64_t t = r0; t < r1; t++) {
            cache_row(s, a, wk, il, t);
            if (dec) /* rope(q_pe) of every head in place: q_h = [q_nope ; rope(q_pe)] */
                K->rope_cached(a->q + t * qrow + nope, H, nope + rope, (int)rope, MOETAX_ROPE_MODE_NORM,
                               a->ropecs + t * rope);
        }
        if (!dec) {
            fw_split(w, H, 1, &r0, &r1);
            for (int64_t h = r0; h < r1; h++) q_abs_head(s, a, wk, il, h);
        }
        fw_phase_end(w);
    }

    /* 4: attention per (token, group of heads): the shared compressed KV rows are
     * read once for all heads of the group (scores = one matmul per cache block
     * with the group's queries as the batch), then o_h = sum_j p_hj kv_j with
     * kv_j reused across the group. One token: out_h = W_vb[h] o_h right here;
     * a batch: o goes to a->oatt and phase 4b runs W_vb per head over all tokens. */
    fw_phase_begin(w, MOETAX_PHASE_ATTN, il);
    /* head groups per token: one token needs them for parallelism; with at least two tokens per
     * worker the tokens give it, and one group of all heads reads each KV row once per token (not
     * once per group) with the heads as the scores matmul's batch. The same bits only if one
     * token's groups hold 2+ heads each: the F32/F16 matmul's per-output chain is the same for
     * any batch of 2+ rows, but one batch row of 512 B - 8 KiB rows takes the decode path's four
     * accumulators (kernels.h, matmul_avx2.c). Each group reads the token's cache rows once: past
     * one chunk of positions (attend.h) one group per worker, else two for balance. */
    if (dec) { /* a head per item, into a->attv */
        for (int64_t h; (h = fw_chunk(w, H, 1)) >= 0;) dec_head(s, a, wk, il, h);
        fw_phase_end(w);
    } else if (split) {
        for (int64_t it; (it = fw_chunk(w, first[n] * hg, 1)) >= 0;) {
            const int64_t ci = it / hg, h0 = H * (it % hg) / hg, h1 = H * (it % hg + 1) / hg;
            int64_t t = 0;
            while (first[t + 1] <= ci) t++;
            int32_t nblk;
            const struct attend_src src = {.kv = a->kv, .layer = il, .blk = moetax_kvcache_seq_blocks(a->kv, s->seq[t], &nblk),
                                           .ct = a->ct, .kvr = a->kv_row, .k_off = 0, .k_cols = a->kv_row, .v_off = 0,
                                           .v_cols = kvl};
            attend_chunk(K, &src, a->qabs + (t * H + h0) * a->kv_row, h1 - h0, s->pos[t] + 1, ci - first[t],
                         hp->kq_scale, a->sp_o + (ci * H + h0) * kvl, kvl, a->sp_ms + (ci * H + h0) * 2, &wk->at);
        }
        fw_phase_end(w);
        /* 4b: each head's chunks merged, then (one token) W_vb, or (a batch) 4b below */
        fw_phase_begin(w, MOETAX_PHASE_ATTN, il);
        if (n == 1) {
            for (int64_t it; (it = fw_chunk(w, G1, 1)) >= 0;) {
                const int64_t h0 = H * it / G1, h1 = H * (it + 1) / G1;
                for (int64_t h = h0; h < h1; h++) split_merge(s, a, first, 0, h, wk->f + (h - h0) * kvl);
                v_b_one(s, a, wk, il, h0, h1, wk->f);
            }
        } else {
            fw_split(w, H, 1, &r0, &r1); /* contiguous heads, as phase 3 */
            for (int64_t h = r0; h < r1; h++) {
                for (int64_t t = 0; t < n; t++) split_merge(s, a, first, t, h, a->oatt + (t * H + h) * kvl);
                v_b_head_range(s, a, wk, il, h, 0, n);
            }
        }
        fw_phase_end(w);
    } else {
        const int64_t G = n >= 2 * w->nth && H / G1 >= 2 ? 1 : G1;
        float *o1 = wk->f; /* [heads of a group][kvl] (one token; q_abs_head's gather is done with wk->f by then) */
        /* (only where the per-token items hold 2+ heads: a head alone takes the one-row matmul's bits) */
        const int64_t ntiles = n > 1 && H / G >= 2 ? attend_tiles_for(s->seq, s->pos, n, H, 1, w->nth, wk->start) : 0;
        /* a prompt's tokens in tiles of all heads (attend_tile): each chunk's rows read once for the
         * tile's tokens, the same bits as each token's heads alone */
        for (int64_t it; ntiles && (it = fw_chunk(w, ntiles, 1)) >= 0;) {
            const int64_t t0 = wk->start[it], nt = wk->start[it + 1] - t0;
            if (nt == 1) {
                attend(s, a, wk, il, t0, 0, H, a->oatt + t0 * H * kvl);
                continue;
            }
            int64_t np[ATTEND_TILE_ROWS];
            for (int64_t i = 0; i < nt; i++) np[i] = s->pos[t0 + i] + 1;
            int32_t nblk;
            const struct attend_src src = {.kv = a->kv, .layer = il, .blk = moetax_kvcache_seq_blocks(a->kv, s->seq[t0], &nblk),
                                           .ct = a->ct, .kvr = a->kv_row, .k_off = 0, .k_cols = a->kv_row, .v_off = 0,
                                           .v_cols = kvl};
            attend_tile(K, &src, a->qabs + t0 * H * a->kv_row, H, np, nt, hp->kq_scale, a->oatt + t0 * H * kvl, H * kvl,
                        kvl, &wk->tile);
        }
        for (int64_t it; !ntiles && (it = fw_chunk(w, n * G, 1)) >= 0;) {
            int64_t t = it / G, g = it % G;
            int64_t h0 = H * g / G, h1 = H * (g + 1) / G;
            if (fuse)
                for (int64_t h = h0; h < h1; h++) q_abs_head(s, a, wk, il, h);
            float *o = n == 1 ? o1 : a->oatt + (t * H + h0) * kvl;
            attend(s, a, wk, il, t, h0, h1, o);
            if (n == 1) v_b_one(s, a, wk, il, h0, h1, o);
        }
        fw_phase_end(w);

        /* 4b (batches): out_h = W_vb[h] o_h for all tokens, one batched matmul per head */
        if (n > 1) {
            fw_phase_begin(w, MOETAX_PHASE_ATTN, il);
            fw_split(w, H, 1, &r0, &r1); /* contiguous heads, as phase 3 */
            for (int64_t h = r0; h < r1; h++) v_b_head_range(s, a, wk, il, h, 0, n);
            fw_phase_end(w);
        }
    }

    /* 5: prepare the concatenated head outputs (one token: each worker itself, in phase 6) */
    const struct act *aov = &s->a_in;
    if (!fw_own_fits(n, H * vh)) {
        fw_phase_begin(w, MOETAX_PHASE_ATTN, il);
        fw_split(w, n, 1, &r0, &r1);
        struct act av = fw_act_view(&s->a_in, a->attv, H * vh, n);
        fw_act_publish(w, &s->a_in, &av);
        fw_act_prep(s, &av, r0, r1);
        fw_phase_end(w);
        fw_phase_begin(w, MOETAX_PHASE_ATTN, il);
    } else {
        fw_phase_begin(w, MOETAX_PHASE_ATTN, il);
        aov = fw_own_rows(w, a->attv, H * vh, n, NULL);
    }

    /* 6: x += W_o attv; each block of output rows belongs to one worker */
    while (fw_rows(w, d, 64, &r0, &r1)) {
        fw_matmul(s, &l->wo, 0, r0, r1, aov, 0, n, a->out, d);
        for (int64_t t = 0; t < n; t++)
            for (int64_t r = r0; r < r1; r++) s->x[t * d + r] += a->out[t * d + r];
    }
    fw_phase_end(w);
}

/* ---- buffers ------------------------------------------------------------------------ */

static int64_t max64(int64_t x, int64_t y) { return x > y ? x : y; }

moetax_status mla_init(struct mla *a, const struct fw_step *s, struct moetax_kvcache *kv,
                       enum moetax_attn_prefill prefill) {
    const struct moetax_hparams *hp = &s->m->hp;
    const int64_t U = s->n_ubatch, d = hp->n_embd, H = hp->n_head, nope = hp->n_embd_head_qk_nope;
    const int64_t rope = hp->n_embd_head_qk_rope, vh = hp->n_embd_head_v, kvl = hp->kv_lora_rank;
    const int64_t ql = hp->q_lora_rank;
    memset(a, 0, sizeof *a);
    a->kv = kv;
    a->kv_row = kvl + rope;
    a->ct = moetax_kvcache_type(kv);
    a->n_threads = s->n_threads;
    a->dec_mode = prefill;
    /* the decompressed form: not where the file's k_b / v_b bytes are gone, nor where it cannot
     * take fewer operations per position (kv_lora no wider than the decompressed heads) */
    a->dec = prefill != MOETAX_ATTN_PREFILL_ABSORBED && U >= 2 &&
             (prefill == MOETAX_ATTN_PREFILL_DECOMPRESSED || nope + rope + vh < 2 * kvl + rope);
    for (int il = 0; a->dec && il < hp->n_layer; il++)
        a->dec = dec_src(s->K, &s->m->layers[il].wk_b) && dec_src(s->K, &s->m->layers[il].wv_b);
    a->qa = calloc((size_t)(U * max64(ql, 1)), sizeof(float));
    a->q = calloc((size_t)(U * H * (nope + rope)), sizeof(float));
    a->kva = calloc((size_t)(U * a->kv_row), sizeof(float));
    a->qabs = calloc((size_t)(U * H * a->kv_row), sizeof(float));
    a->attv = calloc((size_t)(U * H * vh), sizeof(float));
    a->oatt = calloc((size_t)(U * H * kvl), sizeof(float));
    a->out = calloc((size_t)(U * d), sizeof(float));
    a->ropecs = calloc((size_t)(U * max64(rope, 1)), sizeof(float));
    if (s->n_threads > 1) { /* split_chunks' items (a micro-batch that needs more goes by head groups) */
        a->sp_cap = attend_split_cap(moetax_kvcache_n_cells(kv), U);
        a->sp_o = malloc(sizeof(float) * (size_t)(a->sp_cap * H * kvl));
        a->sp_ms = malloc(sizeof(float) * (size_t)(a->sp_cap * H * 2));
    }
    a->wk = calloc((size_t)a->n_threads, sizeof *a->wk);
    bool ok = a->qa && a->q && a->kva && a->qabs && a->attv && a->oatt && a->out && a->ropecs && a->wk &&
              (!a->sp_cap || (a->sp_o && a->sp_ms));
    for (int i = 0; ok && i < a->n_threads; i++) {
        struct mla_worker *wk = &a->wk[i];
        wk->nf = (size_t)max64(H * kvl, U * max64(nope, kvl));
        wk->nq = moetax_act_size(MOETAX_TYPE_Q4_0, (max64(nope, kvl) + 31) / 32 * 32, U) + 64;
        wk->f = calloc(wk->nf, sizeof(float));
        wk->atbuf = calloc((size_t)attend_scratch_floats(H, kvl), sizeof(float));
        wk->q = aligned_alloc(64, (wk->nq + 63) / 64 * 64);
        wk->row = calloc((size_t)attend_cell_row_floats(a->kv_row), sizeof(float));
        const int64_t tnq = H > ATTEND_TILE_ROWS ? H : ATTEND_TILE_ROWS; /* a tile's rows, at least the heads */
        wk->vb = a->ct != MOETAX_TYPE_F32 ? calloc((size_t)attend_cells_floats(a->kv_row, kvl, tnq), sizeof(float)) : NULL;
        wk->at = attend_scratch_at(wk->atbuf, H, kvl, wk->vb);
        wk->tbuf = malloc(sizeof(float) * (size_t)attend_tile_floats(tnq, kvl));
        wk->tile = attend_tile_at(wk->tbuf, tnq, kvl, wk->vb);
        wk->start = malloc(sizeof(int64_t) * (size_t)(U + 1));
        ok = wk->f && wk->atbuf && wk->q && wk->row && (a->ct == MOETAX_TYPE_F32 || wk->vb) && wk->tbuf && wk->start;
        if (ok && a->dec) {
            const int64_t CH = ATTEND_CHUNK, TL = MLA_DEC_TILE;
            wk->wkt = malloc(sizeof(float) * (size_t)(nope * kvl));
            wk->wv = malloc(sizeof(float) * (size_t)(vh * kvl));
            wk->g = malloc(sizeof(float) * (size_t)(MLA_DEC_ROWS * max64(kvl, nope)));
            wk->kc = malloc(sizeof(float) * (size_t)(CH * (nope + rope)));
            wk->vc = malloc(sizeof(float) * (size_t)(CH * vh));
            wk->qt = malloc(sizeof(float) * (size_t)(TL * (nope + rope)));
            wk->sc = malloc(sizeof(float) * (size_t)(TL * CH));
            wk->oc = malloc(sizeof(float) * (size_t)(TL * vh));
            wk->ms = malloc(sizeof(float) * (size_t)(TL * 2));
            wk->run = malloc(sizeof(float) * (size_t)(U * 2));
            ok = wk->wkt && wk->wv && wk->g && wk->kc && wk->vc && wk->qt && wk->sc && wk->oc && wk->ms && wk->run;
        }
    }
    if (!ok) {
        mla_free(a);
        return moetax_error(MOETAX_ERR_NOMEM, "out of memory for attention buffers");
    }
    return MOETAX_OK;
}

void mla_free(struct mla *a) {
    free(a->qa); free(a->q); free(a->kva); free(a->qabs); free(a->attv); free(a->oatt); free(a->out);
    free(a->ropecs);
    free(a->sp_o);
    free(a->sp_ms);
    if (a->wk)
        for (int i = 0; i < a->n_threads; i++) {
            free(a->wk[i].f);
            free(a->wk[i].atbuf);
            free(a->wk[i].q);
            free(a->wk[i].row);
            free(a->wk[i].vb);
            free(a->wk[i].tbuf);
            free(a->wk[i].start);
            free(a->wk[i].wkt); free(a->wk[i].wv); free(a->wk[i].g); free(a->wk[i].kc); free(a->wk[i].vc);
            free(a->wk[i].qt); free(a->wk[i].sc); free(a->wk[i].oc); free(a->wk[i].ms); free(a->wk[i].run);
        }
    free(a->wk);
    memset(a, 0, sizeof *a);
}
