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
