/*
 * attend.c - chunked attention over a sequence's cached positions (see attend.h).
 */
#include "attn/attend.h"

#include <math.h>
#include <string.h>

int64_t attend_scratch_floats(int64_t nh, int64_t v_cols) { return nh * (ATTEND_CHUNK + v_cols + 4); }

int64_t attend_f16_floats(int64_t k_cols, int64_t v_cols) { return ATTEND_CHUNK * (k_cols + v_cols); }

struct attend_scratch attend_scratch_at(float *buf, int64_t nh, int64_t v_cols, float *fb) {
    struct attend_scratch w = {.sc = buf, .oc = buf + nh * ATTEND_CHUNK, .fb = fb};
    w.ms = w.oc + nh * v_cols;
    return w;
}

enum { F16_PF_ROWS = 8 };

void attend_chunk(const struct moetax_kernels *K, const struct attend_src *src, const float *q, int64_t nh,
                  int64_t np, int64_t c, float kq_scale, float *o, int64_t ldo, float *ms,
                  const struct attend_scratch *w) {
    const int64_t bs = moetax_kvcache_block_size(src->kv), kvr = src->kvr;
    const int64_t c0 = c * ATTEND_CHUNK, c1 = c0 + ATTEND_CHUNK < np ? c0 + ATTEND_CHUNK : np, cn = c1 - c0;
    float *sc = w->sc; /* [nh][cn] */
    if (src->f16) {
        /* the chunk's keys and values in float, rows side by side in fb (values inside the keys'
         * part, as MLA's, are taken from there): one F32 matmul for the scores and one weighted
         * sum over them, the same products as F16 matmuls over the cells (F16 to F32 is exact) */
        const bool v_in_k = src->v_off >= src->k_off && src->v_off + src->v_cols <= src->k_off + src->k_cols;
        const int64_t fs = v_in_k ? src->k_cols : src->k_cols + src->v_cols; /* floats a row */
        for (int64_t b = c0 / bs; b * bs < c1; b++) {
            const int64_t r0 = c0 > b * bs ? c0 - b * bs : 0, r1 = c1 - b * bs < bs ? c1 - b * bs : bs;
            const uint16_t *rows = moetax_kvcache_block_rows(src->kv, src->layer, src->blk[b]);
            for (int64_t r = r0; r < r1; r++) {
                /* the cells F16_PF_ROWS positions on into L2: a row's conversion is too short for the
                 * hardware's prefetch to hide the memory's latency */
                const int64_t pj = b * bs + r + F16_PF_ROWS;
                if (pj < c1) {
                    const char *pr = (const char *)((const uint16_t *)moetax_kvcache_block_rows(src->kv, src->layer,
                                                                                                src->blk[pj / bs]) +
                                                    pj % bs * kvr);
                    for (int64_t off = 0; off < kvr * 2; off += 64) __builtin_prefetch(pr + off, 0, 2);
                }
                float *f = w->fb + (b * bs + r - c0) * fs;
                K->fp16_to_fp32(rows + r * kvr + src->k_off, f, src->k_cols);
                if (!v_in_k) K->fp16_to_fp32(rows + r * kvr + src->v_off, f + src->k_cols, src->v_cols);
            }
        }
        K->matmul(MOETAX_TYPE_F32, w->fb, sizeof(float) * (size_t)fs, 0, cn, src->k_cols, q, nh, sc, cn);
        for (int64_t h = 0; h < nh; h++) {
            K->scale(sc + h * cn, kq_scale, cn);
            K->softmax(sc + h * cn, cn, ms + 2 * h);
        }
        K->wsum(o, ldo, sc, cn, nh, w->fb + (v_in_k ? src->v_off - src->k_off : src->k_cols), fs, cn, src->v_cols,
                false);
        return;
    }
    const size_t crow = sizeof(float) * (size_t)kvr;
    /* the blocks that hold positions c0 .. c1-1, rows [r0, r1) of each */
    for (int64_t b = c0 / bs; b * bs < c1; b++) {
        const int64_t r0 = c0 > b * bs ? c0 - b * bs : 0, r1 = c1 - b * bs < bs ? c1 - b * bs : bs;
        const char *rows = (const char *)moetax_kvcache_block_rows(src->kv, src->layer, src->blk[b]);
        K->matmul(MOETAX_TYPE_F32, rows + sizeof(float) * (size_t)src->k_off, crow, r0, r1, src->k_cols, q, nh,
                  sc + (b * bs - c0), cn);
    }
    for (int64_t h = 0; h < nh; h++) {
        K->scale(sc + h * cn, kq_scale, cn);
        K->softmax(sc + h * cn, cn, ms + 2 * h);
    }
    for (int64_t b = c0 / bs; b * bs < c1; b++) {
        const int64_t r0 = c0 > b * bs ? c0 - b * bs : 0, r1 = c1 - b * bs < bs ? c1 - b * bs : bs;
        const float *rows = (const float *)moetax_kvcache_block_rows(src->kv, src->layer, src->blk[b]) +
                            r0 * kvr + src->v_off;
        K->wsum(o, ldo, sc + (b * bs + r0 - c0), cn, nh, rows, kvr, r1 - r0, src->v_cols, b * bs + r0 > c0);
    }
}

void attend_fold(const struct moetax_kernels *K, float *o, const float *oc, int64_t n, float *run, float m,
                 float l) {
    const float mx = fmaxf(run[0], m), a = run[1] * expf(run[0] - mx), b = l * expf(m - mx), z = a + b;
    K->scale(o, a / z, n);
    K->axpy(o, b / z, oc, n);
    run[0] = mx;
    run[1] = z;
}

void attend_heads(const struct moetax_kernels *K, const struct attend_src *src, const float *q, int64_t nh,
                  int64_t np, float kq_scale, float *o, int64_t ldo, const struct attend_scratch *w) {
    const int64_t nc = attend_n_chunks(np), vc = src->v_cols;
    float *run = w->ms + 2 * nh; /* [nh][2] */
    attend_chunk(K, src, q, nh, np, 0, kq_scale, o, ldo, run, w);
    for (int64_t c = 1; c < nc; c++) {
        attend_chunk(K, src, q, nh, np, c, kq_scale, w->oc, vc, w->ms, w);
        for (int64_t h = 0; h < nh; h++)
            attend_fold(K, o + h * ldo, w->oc + h * vc, vc, run + 2 * h, w->ms[2 * h], w->ms[2 * h + 1]);
    }
}

int64_t attend_chunks_first(const int32_t *pos, int64_t n, int64_t *first) {
    int64_t total = 0, most = 0;
    for (int64_t t = 0; t < n; t++) {
        const int64_t nc = attend_n_chunks(pos[t] + 1);
        first[t] = total;
        total += nc;
        most = nc > most ? nc : most;
    }
    first[n] = total;
    return most;
}

void attend_merge(const struct moetax_kernels *K, const float *oi, int64_t ldi, const float *msi, int64_t nh_items,
                  int64_t i0, int64_t i1, int64_t h, int64_t v_cols, float *o) {
    memcpy(o, oi + i0 * ldi + h * v_cols, sizeof(float) * (size_t)v_cols);
    float run[2] = {msi[(i0 * nh_items + h) * 2], msi[(i0 * nh_items + h) * 2 + 1]};
    for (int64_t i = i0 + 1; i < i1; i++)
        attend_fold(K, o, oi + i * ldi + h * v_cols, v_cols, run, msi[(i * nh_items + h) * 2],
                    msi[(i * nh_items + h) * 2 + 1]);
}

int64_t attend_tile_floats(int64_t nq, int64_t v_cols) { return nq * (ATTEND_CHUNK + 2 * v_cols + 4); }

struct attend_tile_scratch attend_tile_at(float *buf, int64_t nq, int64_t v_cols, float *fb) {
    struct attend_tile_scratch w = {.sc = buf, .fb = fb};
    w.oc = w.sc + nq * ATTEND_CHUNK;
    w.ot = w.oc + nq * v_cols;
    w.ms = w.ot + nq * v_cols;
    w.run = w.ms + 2 * nq;
    return w;
}

/* The chunk's F16 rows [c0, c1) in float into fb, as attend_chunk makes them. */
static void tile_f16_rows(const struct moetax_kernels *K, const struct attend_src *src, int64_t c0, int64_t c1,
                          float *fb, int64_t fs, bool v_in_k) {
    const int64_t bs = moetax_kvcache_block_size(src->kv), kvr = src->kvr;
    for (int64_t b = c0 / bs; b * bs < c1; b++) {
        const int64_t r0 = c0 > b * bs ? c0 - b * bs : 0, r1 = c1 - b * bs < bs ? c1 - b * bs : bs;
        const uint16_t *rows = moetax_kvcache_block_rows(src->kv, src->layer, src->blk[b]);
        for (int64_t r = r0; r < r1; r++) {
            float *f = fb + (b * bs + r - c0) * fs;
            K->fp16_to_fp32(rows + r * kvr + src->k_off, f, src->k_cols);
            if (!v_in_k) K->fp16_to_fp32(rows + r * kvr + src->v_off, f + src->k_cols, src->v_cols);
        }
    }
}

/* Weighted sums of the chunk [c0, c0 + n) for nr rows of probabilities p (ld cn) into out (ld v_cols):
 * attend_chunk's calls for a chunk of n positions. */
static void tile_wsum(const struct moetax_kernels *K, const struct attend_src *src, int64_t c0, int64_t n,
                      const float *p, int64_t cn, int64_t nr, float *out, int64_t fs, bool v_in_k, const float *fb) {
    const int64_t vc = src->v_cols;
    if (src->f16) {
        K->wsum(out, vc, p, cn, nr, fb + (v_in_k ? src->v_off - src->k_off : src->k_cols), fs, n, vc, false);
        return;
    }
    const int64_t bs = moetax_kvcache_block_size(src->kv), kvr = src->kvr, c1 = c0 + n;
    for (int64_t b = c0 / bs; b * bs < c1; b++) {
        const int64_t r0 = c0 > b * bs ? c0 - b * bs : 0, r1 = c1 - b * bs < bs ? c1 - b * bs : bs;
        const float *rows = (const float *)moetax_kvcache_block_rows(src->kv, src->layer, src->blk[b]) + r0 * kvr +
                            src->v_off;
        K->wsum(out, vc, p + (b * bs + r0 - c0), cn, nr, rows, kvr, r1 - r0, vc, b * bs + r0 > c0);
    }
}

void attend_tile(const struct moetax_kernels *K, const struct attend_src *src, const float *q, int64_t nh,
                 const int64_t *np, int64_t nt, float kq_scale, float *o, int64_t ldo_t, int64_t ldo,
                 const struct attend_tile_scratch *w) {
    const int64_t vc = src->v_cols, last = np[nt - 1], bs = moetax_kvcache_block_size(src->kv);
    const bool v_in_k = src->v_off >= src->k_off && src->v_off + src->v_cols <= src->k_off + src->k_cols;
    const int64_t fs = v_in_k ? src->k_cols : src->k_cols + src->v_cols;
    for (int64_t c0 = 0; c0 < last; c0 += ATTEND_CHUNK) {
        const int64_t c1 = c0 + ATTEND_CHUNK < last ? c0 + ATTEND_CHUNK : last, cn = c1 - c0;
        int64_t i0 = 0; /* the first token that sees the chunk, then the first that sees all of it */
        while (np[i0] <= c0) i0++;
        int64_t i1 = i0;
        while (i1 < nt && np[i1] < c1) i1++;
        const int64_t nq = (nt - i0) * nh;
        float *sc = w->sc + i0 * nh * cn; /* rows of the tokens from i0, ld cn */
        const float *qt = q + i0 * nh * src->k_cols;
        if (src->f16) {
            tile_f16_rows(K, src, c0, c1, w->fb, fs, v_in_k);
            K->matmul(MOETAX_TYPE_F32, w->fb, sizeof(float) * (size_t)fs, 0, cn, src->k_cols, qt, nq, sc, cn);
        } else {
            const size_t crow = sizeof(float) * (size_t)src->kvr;
            for (int64_t b = c0 / bs; b * bs < c1; b++) {
                const int64_t r0 = c0 > b * bs ? c0 - b * bs : 0, r1 = c1 - b * bs < bs ? c1 - b * bs : bs;
                const char *rows = (const char *)moetax_kvcache_block_rows(src->kv, src->layer, src->blk[b]);
                K->matmul(MOETAX_TYPE_F32, rows + sizeof(float) * (size_t)src->k_off, crow, r0, r1, src->k_cols, qt, nq,
                          sc + (b * bs - c0), cn);
            }
        }
        for (int64_t i = i0; i < nt; i++) {
            const int64_t n = np[i] - c0 < cn ? np[i] - c0 : cn; /* the positions token i sees */
            for (int64_t h = 0; h < nh; h++) {
                float *s = w->sc + (i * nh + h) * cn;
                K->scale(s, kq_scale, n);
                K->softmax(s, n, (c0 ? w->ms : w->run) + 2 * (i * nh + h));
            }
        }
        /* the weighted sums: the first chunk's into ot, a later one's into oc, merged in order */
        float *dst = c0 ? w->oc : w->ot;
        for (int64_t i = i0; i < i1; i++) /* each over its own part of the chunk */
            tile_wsum(K, src, c0, np[i] - c0, w->sc + i * nh * cn, cn, nh, dst + i * nh * vc, fs, v_in_k, w->fb);
        if (nt > i1)
            tile_wsum(K, src, c0, cn, w->sc + i1 * nh * cn, cn, (nt - i1) * nh, dst + i1 * nh * vc, fs, v_in_k,
                      w->fb);
        if (c0)
            for (int64_t r = i0 * nh; r < nt * nh; r++)
                attend_fold(K, w->ot + r * vc, w->oc + r * vc, vc, w->run + 2 * r, w->ms[2 * r], w->ms[2 * r + 1]);
    }
    for (int64_t i = 0; i < nt; i++)
        for (int64_t h = 0; h < nh; h++)
            memcpy(o + i * ldo_t + h * ldo, w->ot + (i * nh + h) * vc, sizeof(float) * (size_t)vc);
}

int64_t attend_tiles(const int32_t *seq, const int32_t *pos, int64_t n, int64_t tq, int64_t *start) {
    int64_t k = 0;
    for (int64_t t = 0; t < n; t++)
        if (t == 0 || seq[t] != seq[t - 1] || pos[t] != pos[t - 1] + 1 || t - start[k - 1] >= tq) start[k++] = t;
    start[k] = n;
    return k;
}

int64_t attend_tiles_for(const int32_t *seq, const int32_t *pos, int64_t n, int64_t nh, int64_t per_tile, int nth,
                         int64_t *start) {
    if (nh < 2) return 0; /* one head: attend_heads' matmul of one row has other bits */
    for (int64_t tq = attend_tile_tokens(nh); tq > 1; tq /= 2) {
        const int64_t k = attend_tiles(seq, pos, n, tq, start);
        if (k == n) return 0;
        if (k * per_tile >= 2 * nth || tq == 2) return k;
    }
    return 0;
}
