/*
 * attend.c - chunked attention over a sequence's cached positions (see attend.h).
 */
#include "attn/attend.h"

#include <math.h>
#include <stdint.h>
#include <string.h>

int64_t attend_scratch_floats(int64_t nh, int64_t v_cols) { return nh * (ATTEND_CHUNK + v_cols + 4); }

static int64_t ru32(int64_t n) { return attend_cell_row_floats(n); } /* whole Q8_0 blocks */

void attend_cell_write(const struct moetax_kernels *K, enum moetax_type ct, const float *row, int64_t n, void *cell) {
    if (ct == MOETAX_TYPE_F16) K->fp32_to_fp16(row, cell, n);
    else moetax_quantize_row_q8_0_ref(row, cell, ru32(n));
}

/* Q8_0 cells: the scores on the table's Q8_0 matmul, as llama.cpp computes them over a q8_0 K cache
 * (ggml's vec_dot_q8_0_q8_0): the queries quantized to Q8_0 blocks once per call (quantize_act,
 * ggml's quantize_row_q8_0), each key row's blocks as stored, gathered per chunk (and put in the
 * table's layout) in the scratch; the exact integer block sums, then the matmul's float chain. The
 * values are converted to float for the weighted sum. A chunk's region of fb: */
struct q8s {
    float *vf;   /* [ATTEND_CHUNK][ru32(v_cols)] the chunk's values in float */
    uint8_t *kq; /* [ATTEND_CHUNK][rbk] the chunk's key blocks as stored */
    uint8_t *kr; /* the same in the table's layout, where it has one (weights_repacked), else NULL */
    uint8_t *xq; /* [nq][act row] the queries prepared */
    float *qp;   /* [nq][ru32(k_cols)] the queries padded to whole blocks (where k_cols is not) */
    size_t rbk, act_row;
};

static size_t up64(size_t n) { return (n + 63) & ~(size_t)63; }
static uint8_t *al64(void *p) { return (uint8_t *)(((uintptr_t)p + 63) & ~(uintptr_t)63); }

/* The regions of fb for nq query rows (q8s_bytes of them). */
static struct q8s q8s_at(const struct moetax_kernels *K, float *fb, int64_t k_cols, int64_t v_cols, int64_t nq) {
    struct q8s s;
    const int64_t k32 = ru32(k_cols);
    s.rbk = moetax_row_size(MOETAX_TYPE_Q8_0, k32);
    s.act_row = moetax_act_size(MOETAX_TYPE_Q8_0, k32, 1);
    s.vf = (float *)al64(fb);
    s.kq = al64(s.vf + ATTEND_CHUNK * ru32(v_cols));
    s.kr = al64(s.kq + ATTEND_CHUNK * s.rbk);
    s.xq = al64(s.kr + ATTEND_CHUNK * s.rbk);
    s.qp = (float *)al64(s.xq + (size_t)nq * s.act_row);
    if (!K->weights_repacked || !K->weights_repacked(MOETAX_TYPE_Q8_0)) s.kr = NULL;
    return s;
}
/* Bytes of q8s_at's regions from any start (each region's start rounded up to 64 bytes). */
static size_t q8s_bytes(int64_t k_cols, int64_t v_cols, int64_t nq) {
    const int64_t k32 = ru32(k_cols);
    const size_t rbk = moetax_row_size(MOETAX_TYPE_Q8_0, k32);
    return 64 + up64(sizeof(float) * ATTEND_CHUNK * (size_t)ru32(v_cols)) + 2 * up64(ATTEND_CHUNK * rbk) +
           up64((size_t)nq * moetax_act_size(MOETAX_TYPE_Q8_0, k32, 1)) + sizeof(float) * (size_t)(nq * k32);
}

int64_t attend_cells_floats(int64_t k_cols, int64_t v_cols, int64_t nq) {
    const int64_t f16 = ATTEND_CHUNK * (k_cols + v_cols), q8 = (int64_t)((q8s_bytes(k_cols, v_cols, nq) + 3) / 4);
    return f16 > q8 ? f16 : q8;
}

/* The nq query rows (row i at q + i * k_cols) prepared for the Q8_0 matmul into s->xq. */
static void q8_queries(const struct moetax_kernels *K, int64_t k_cols, const float *q, int64_t nq, const struct q8s *s) {
    const int64_t k32 = ru32(k_cols);
    if (k32 == k_cols) {
        K->quantize_act(MOETAX_TYPE_Q8_0, q, k_cols, k_cols, nq, s->xq);
        return;
    }
    for (int64_t i = 0; i < nq; i++) {
        memcpy(s->qp + i * k32, q + i * k_cols, sizeof(float) * (size_t)k_cols);
        memset(s->qp + i * k32 + k_cols, 0, sizeof(float) * (size_t)(k32 - k_cols));
    }
    K->quantize_act(MOETAX_TYPE_Q8_0, s->qp, k32, k32, nq, s->xq);
}

struct attend_scratch attend_scratch_at(float *buf, int64_t nh, int64_t v_cols, float *fb) {
    struct attend_scratch w = {.sc = buf, .oc = buf + nh * ATTEND_CHUNK, .fb = fb};
    w.ms = w.oc + nh * v_cols;
    return w;
}

enum { CELL_PF_ROWS = 8 };

/* Where a chunk's values lie among the floats a row of fb holds (F16 cells): inside the keys' part
 * (MLA's) or after them. */
static bool v_in_keys(const struct attend_src *src) {
    return src->v_off >= src->k_off && src->v_off + src->v_cols <= src->k_off + src->k_cols;
}
/* Floats a row of fb takes (F16 cells). */
static int64_t fb_floats(const struct attend_src *src) { return v_in_keys(src) ? src->k_cols : src->k_cols + src->v_cols; }

/* Values [off, off + n) of a cell row in float (Q8_0: off a multiple of 32, the covering blocks). */
static void cell_floats(const struct moetax_kernels *K, enum moetax_type ct, const char *row, int64_t off, int64_t n,
                        float *f) {
    if (ct == MOETAX_TYPE_F16) K->fp16_to_fp32((const uint16_t *)row + off, f, n);
    else K->q8_0_to_fp32((const moetax_block_q8_0 *)row + off / 32, f, ru32(n));
}

/* F16 cells: the rows of positions [c0, c1) in float, side by side in fb (fb_floats a row); the
 * same products as matmuls over the cells (F16 to F32 is exact). Q8_0 cells (q8 given): the rows'
 * key blocks gathered into q8->kq, then put in the table's layout (q8->kr, where it has one), and
 * their values in float into q8->vf. */
static void chunk_cell_rows(const struct moetax_kernels *K, const struct attend_src *src, int64_t c0, int64_t c1,
                            float *fb, const struct q8s *q8) {
    const int64_t bs = moetax_kvcache_block_size(src->kv), fs = fb_floats(src), v32 = ru32(src->v_cols);
    const size_t rb = moetax_kvcache_row_bytes(src->kv);
    const bool v_in_k = v_in_keys(src);
    MOETAX_ASSERT(src->ct != MOETAX_TYPE_Q8_0 || (q8 && src->k_off % 32 == 0 && src->v_off % 32 == 0));
    for (int64_t b = c0 / bs; b * bs < c1; b++) {
        const int64_t r0 = c0 > b * bs ? c0 - b * bs : 0, r1 = c1 - b * bs < bs ? c1 - b * bs : bs;
        const char *rows = moetax_kvcache_block_rows(src->kv, src->layer, src->blk[b]);
        for (int64_t r = r0; r < r1; r++) {
            /* the cells CELL_PF_ROWS positions on into L2: a row's conversion is too short for the
             * hardware's prefetch to hide the memory's latency */
            const int64_t pj = b * bs + r + CELL_PF_ROWS;
            if (pj < c1) {
                const char *pr = (const char *)moetax_kvcache_block_rows(src->kv, src->layer, src->blk[pj / bs]) +
                                 (size_t)(pj % bs) * rb;
                for (size_t off = 0; off < rb; off += 64) __builtin_prefetch(pr + off, 0, 2);
            }
            const int64_t j = b * bs + r - c0;
            if (q8) {
                memcpy(q8->kq + (size_t)j * q8->rbk, rows + (size_t)r * rb + (size_t)(src->k_off / 32) * sizeof(moetax_block_q8_0),
                       q8->rbk);
                cell_floats(K, src->ct, rows + (size_t)r * rb, src->v_off, src->v_cols, q8->vf + j * v32);
                continue;
            }
            float *f = fb + j * fs;
            cell_floats(K, src->ct, rows + (size_t)r * rb, src->k_off, src->k_cols, f);
            if (!v_in_k) cell_floats(K, src->ct, rows + (size_t)r * rb, src->v_off, src->v_cols, f + src->k_cols);
        }
    }
    if (q8 && q8->kr) /* not in place: cannot fail */
        (void)moetax_kernels_repack(K, MOETAX_TYPE_Q8_0, q8->kr, q8->kq, c1 - c0, ru32(src->k_cols));
}

/* The scores of the positions [c0, c1) for nq query rows q into sc (ld cn = c1 - c0): Q8_0 cells one
 * Q8_0 matmul over the chunk's keys with the queries prepared at xq (q8_queries), F16 one F32 matmul
 * over fb (chunk_cell_rows made both), F32 one per cache block over its rows. */
static void chunk_scores(const struct moetax_kernels *K, const struct attend_src *src, int64_t c0, int64_t c1,
                         const float *q, int64_t nq, float *sc, const float *fb, const struct q8s *q8,
                         const uint8_t *xq) {
    const int64_t cn = c1 - c0;
    if (q8) {
        K->matmul(MOETAX_TYPE_Q8_0, q8->kr ? q8->kr : q8->kq, q8->rbk, 0, cn, ru32(src->k_cols), xq, nq, sc, cn);
        return;
    }
    if (src->ct != MOETAX_TYPE_F32) {
        K->matmul(MOETAX_TYPE_F32, fb, sizeof(float) * (size_t)fb_floats(src), 0, cn, src->k_cols, q, nq, sc, cn);
        return;
    }
    const int64_t bs = moetax_kvcache_block_size(src->kv);
    const size_t crow = sizeof(float) * (size_t)src->kvr;
    /* the blocks that hold positions c0 .. c1-1, rows [r0, r1) of each */
    for (int64_t b = c0 / bs; b * bs < c1; b++) {
        const int64_t r0 = c0 > b * bs ? c0 - b * bs : 0, r1 = c1 - b * bs < bs ? c1 - b * bs : bs;
        const char *rows = (const char *)moetax_kvcache_block_rows(src->kv, src->layer, src->blk[b]);
        K->matmul(MOETAX_TYPE_F32, rows + sizeof(float) * (size_t)src->k_off, crow, r0, r1, src->k_cols, q, nq,
                  sc + (b * bs - c0), cn);
    }
}

/* The weighted sums of the values of positions [c0, c0 + n) for nr rows of probabilities p (ld_p)
 * into out (ld_out): one wsum over q8->vf (Q8_0 cells) or fb (F16), else one chain over the cache
 * blocks. */
static void chunk_wsum(const struct moetax_kernels *K, const struct attend_src *src, int64_t c0, int64_t n,
                       const float *p, int64_t ld_p, int64_t nr, float *out, int64_t ld_out, const float *fb,
                       const struct q8s *q8) {
    const int64_t vc = src->v_cols;
    if (q8) {
        K->wsum(out, ld_out, p, ld_p, nr, q8->vf, ru32(vc), n, vc, false);
        return;
    }
    if (src->ct != MOETAX_TYPE_F32) {
        K->wsum(out, ld_out, p, ld_p, nr, fb + (v_in_keys(src) ? src->v_off - src->k_off : src->k_cols),
                fb_floats(src), n, vc, false);
        return;
    }
    const int64_t bs = moetax_kvcache_block_size(src->kv), kvr = src->kvr, c1 = c0 + n;
    for (int64_t b = c0 / bs; b * bs < c1; b++) {
        const int64_t r0 = c0 > b * bs ? c0 - b * bs : 0, r1 = c1 - b * bs < bs ? c1 - b * bs : bs;
        const float *rows = (const float *)moetax_kvcache_block_rows(src->kv, src->layer, src->blk[b]) + r0 * kvr +
                            src->v_off;
        K->wsum(out, ld_out, p + (b * bs + r0 - c0), ld_p, nr, rows, kvr, r1 - r0, vc, b * bs + r0 > c0);
    }
}

/* attend_chunk with the queries already prepared where the cells are Q8_0 (q8 given: q8_queries) */
static void chunk_run(const struct moetax_kernels *K, const struct attend_src *src, const float *q, int64_t nh,
                      int64_t np, int64_t c, float kq_scale, float *o, int64_t ldo, float *ms,
                      const struct attend_scratch *w, const struct q8s *q8) {
    const int64_t c0 = c * ATTEND_CHUNK, c1 = c0 + ATTEND_CHUNK < np ? c0 + ATTEND_CHUNK : np, cn = c1 - c0;
    float *sc = w->sc; /* [nh][cn] */
    if (src->ct != MOETAX_TYPE_F32) chunk_cell_rows(K, src, c0, c1, w->fb, q8);
    chunk_scores(K, src, c0, c1, q, nh, sc, w->fb, q8, q8 ? q8->xq : NULL);
    for (int64_t h = 0; h < nh; h++) {
        K->scale(sc + h * cn, kq_scale, cn);
        K->softmax(sc + h * cn, cn, ms + 2 * h);
    }
    chunk_wsum(K, src, c0, cn, sc, cn, nh, o, ldo, w->fb, q8);
}

/* Q8_0 cells: the scratch's regions for nq queries, the queries prepared; else NULL */
static const struct q8s *q8_begin(const struct moetax_kernels *K, const struct attend_src *src, const float *q,
                                  int64_t nq, float *fb, struct q8s *q8) {
    if (src->ct != MOETAX_TYPE_Q8_0) return NULL;
    *q8 = q8s_at(K, fb, src->k_cols, src->v_cols, nq);
    q8_queries(K, src->k_cols, q, nq, q8);
    return q8;
}

void attend_chunk(const struct moetax_kernels *K, const struct attend_src *src, const float *q, int64_t nh,
                  int64_t np, int64_t c, float kq_scale, float *o, int64_t ldo, float *ms,
                  const struct attend_scratch *w) {
    struct q8s q8s;
    chunk_run(K, src, q, nh, np, c, kq_scale, o, ldo, ms, w, q8_begin(K, src, q, nh, w->fb, &q8s));
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
    struct q8s q8s;
    const struct q8s *q8 = q8_begin(K, src, q, nh, w->fb, &q8s);
    chunk_run(K, src, q, nh, np, 0, kq_scale, o, ldo, run, w, q8);
    for (int64_t c = 1; c < nc; c++) {
        chunk_run(K, src, q, nh, np, c, kq_scale, w->oc, vc, w->ms, w, q8);
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

void attend_tile(const struct moetax_kernels *K, const struct attend_src *src, const float *q, int64_t nh,
                 const int64_t *np, int64_t nt, float kq_scale, float *o, int64_t ldo_t, int64_t ldo,
                 const struct attend_tile_scratch *w) {
    const int64_t vc = src->v_cols, last = np[nt - 1];
    struct q8s q8s;
    const struct q8s *q8 = q8_begin(K, src, q, nt * nh, w->fb, &q8s);
    for (int64_t c0 = 0; c0 < last; c0 += ATTEND_CHUNK) {
        const int64_t c1 = c0 + ATTEND_CHUNK < last ? c0 + ATTEND_CHUNK : last, cn = c1 - c0;
        int64_t i0 = 0; /* the first token that sees the chunk, then the first that sees all of it */
        while (np[i0] <= c0) i0++;
        int64_t i1 = i0;
        while (i1 < nt && np[i1] < c1) i1++;
        /* rows of the tokens from i0, ld cn */
        if (src->ct != MOETAX_TYPE_F32) chunk_cell_rows(K, src, c0, c1, w->fb, q8);
        chunk_scores(K, src, c0, c1, q + i0 * nh * src->k_cols, (nt - i0) * nh, w->sc + i0 * nh * cn, w->fb, q8,
                     q8 ? q8->xq + (size_t)(i0 * nh) * q8->act_row : NULL);
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
            chunk_wsum(K, src, c0, np[i] - c0, w->sc + i * nh * cn, cn, nh, dst + i * nh * vc, vc, w->fb, q8);
        if (nt > i1)
            chunk_wsum(K, src, c0, cn, w->sc + i1 * nh * cn, cn, (nt - i1) * nh, dst + i1 * nh * vc, vc, w->fb, q8);
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
