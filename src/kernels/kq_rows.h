/* kq_rows.h - the 4-row loop of the plain-layout k-quant decode (one batch row) and the
 * x8r layouts' decode prefetch, shared by matmul_kq_avx2.c and matmul_kq_avx512.c (each compiles it with its own
 * flags; only SSE/AVX2 intrinsics here).
 *
 * Decode streams the weights once, so it is bound by how many of their lines are on
 * the way from memory: each block step prefetches, into L2 (prefetcht1), the bytes
 * KQ_ROWS_PFD ahead of the group of 4 rows after the current one, as one linear
 * stream through the row range (4 rows of a plain matrix are contiguous, and a block
 * step consumes 4 blocks of them), and never past the range's end. (One L1 prefetch
 * per row and block, a few blocks ahead, covered only part of each row's lines.) */
#ifndef MOETAX_KQ_ROWS_H
#define MOETAX_KQ_ROWS_H

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "kernels_impl.h"

#ifndef KQ_ROWS_PFD
#define KQ_ROWS_PFD 12288
#endif

/* Rows r .. r + nr - 1 (nr = min(4, row1 - r)); a short group repeats its last row. */
struct kq_rows4 {
    const uint8_t *w[4];
    int nr;
    uintptr_t pf, pfe; /* the next byte to prefetch, the range's end */
};

static inline __attribute__((always_inline)) void kq_rows4_init(struct kq_rows4 *g, const uint8_t *w,
                                                                  size_t row_bytes, int64_t r, int64_t row1) {
    g->nr = row1 - r < 4 ? (int)(row1 - r) : 4;
    for (int k = 0; k < 4; k++) g->w[k] = w + (size_t)(r + (k < g->nr ? k : g->nr - 1)) * row_bytes;
    g->pf = (uintptr_t)(w + (size_t)(r + 4) * row_bytes) + KQ_ROWS_PFD;
    g->pfe = (uintptr_t)(w + (size_t)row1 * row_bytes);
}

/* Into L2, the lines of [a, b): a decode's first KQ_ROWS_PFD bytes at its start, so that they
 * come in together rather than one demand miss after another (the steady-state prefetch
 * starts that far ahead). */
static inline void kq_prefetch_span_l2(const uint8_t *a, const uint8_t *b) {
    for (uintptr_t p = (uintptr_t)a & ~(uintptr_t)63; p < (uintptr_t)b; p += 64) _mm_prefetch((const char *)p, _MM_HINT_T1);
}

/* The x8r layouts' decode (both tables), for the n bytes of a block at p: into L2 the lines
 * of [p + d, p + d + n) that lie below pfe (d bytes ahead of where it reads, never past its
 * row range's end) and, with near > 0, into L1 the lines near bytes ahead, which by then are
 * in L2. On an Intel Xeon the avx512 table's decode came nearer a plain read with both than
 * with the L2 prefetch alone (an L1 prefetch alone was worse on Zen 4), while the avx2
 * table's, bound by its arithmetic, lost to the second instruction (commit messages). */
static inline __attribute__((always_inline)) void kq8r_prefetch_dec(const uint8_t *p, size_t d, size_t near, size_t n,
                                                                    const uint8_t *pfe) {
    uintptr_t a = (uintptr_t)p + d, b = a + n;
    if (b > (uintptr_t)pfe) b = (uintptr_t)pfe;
    for (; a < b; a += 64) _mm_prefetch((const char *)a, _MM_HINT_T1);
    if (near > 0)
        for (size_t o = 0; o < n; o += 64) _mm_prefetch((const char *)p + near + o, _MM_HINT_T0);
}

/* One block step of bsz-byte blocks: the next 4 * bsz bytes of the stream into L2. */
static inline __attribute__((always_inline)) void kq_rows4_prefetch(struct kq_rows4 *g, size_t bsz) {
    uintptr_t a = g->pf, b = a + 4 * bsz;
    g->pf = b;
    if (b > g->pfe) b = g->pfe;
    for (a &= ~(uintptr_t)63; a < b; a += 64) _mm_prefetch((const char *)a, _MM_HINT_T1);
}

static inline uint16_t kq_ld16(const uint8_t *p) {
    uint16_t v;
    memcpy(&v, p, 2);
    return v;
}

/* The F16 at byte off of each row's block, widened (moetax_k_fp16_table: exact). */
static inline __attribute__((always_inline)) __m128 kq_rows4_f16(const struct kq_rows4 *g, size_t off) {
    return _mm_setr_ps(moetax_k_fp16_table[kq_ld16(g->w[0] + off)], moetax_k_fp16_table[kq_ld16(g->w[1] + off)],
                       moetax_k_fp16_table[kq_ld16(g->w[2] + off)], moetax_k_fp16_table[kq_ld16(g->w[3] + off)]);
}

/* The group's 4 outputs (lanes of acc; a short group stores nr of them). */
static inline __attribute__((always_inline)) void kq_rows4_store(const struct kq_rows4 *g, __m128 acc, float *y) {
    float o[4];
    _mm_storeu_ps(o, acc);
    for (int k = 0; k < g->nr; k++) y[k] = o[k];
}

#endif
