/* matmul_kq_avx512.c - AVX-512 (F/BW/VL/DQ) + VNNI decode (one batch row) of
 * the k-quant weights (Q4_K, Q5_K, Q6_K, as stored) against block_q8_K
 * activations (kernels.h). Compiled with the avx512 flags; reached only
 * through the avx512 table. Batches (2+ rows) are the avx2 table's.
 *
 * Bit-identical to matmul_kq_avx2.c's decode path: the same 4 rows side by
 * side and the same float steps on 4 lanes, in the same order
 *   acc += (d_x * d_w) * (float)sumi;  acc -= (d_x * dmin_w) * (float)summ
 * (Q6_K: the first only), from 0 over the super-blocks in order; only the
 * exact int32 sums sumi / summ are formed differently:
 *   - 64 values (two 32-value chunks) per 512-bit vector of unsigned levels;
 *   - vpdpbusd (u8 level x s8 activation, 4 products per int32 lane, from 0):
 *     every lane covers 4 values of one chunk (one scale) and is at most
 *     4 * 63 * 128 = 32256 in magnitude (Q6_K; Q4_K 7680, Q5_K 15872), so
 *   - two such vectors pack to int16 exactly (vpackssdw, no saturation) and
 *     vpdpwssd with the chunks' scales (one vpermw of the int16 scales per
 *     128 values) adds sc_j * (4-value sum) into int32 lanes.
 * Every partial sum is exact in int32, so sumi is the same integer as avx2's
 * and the floats get the same bits. */
#include <immintrin.h>
#include <string.h>

#include "kernels_impl.h"
#include "moetax/types.h"

#define KQ5_INLINE static inline __attribute__((always_inline))

static inline uint16_t ld16(const uint8_t *p) { uint16_t v; memcpy(&v, p, 2); return v; }

/* Upper 256 bits shifted right by s bits per 16-bit word (lower kept). */
#define UPPER_SRLI(v, s) _mm512_mask_srli_epi16((v), (__mmask32)0xFFFF0000u, (v), (s))

/* vpermw indices: after vpackssdw of two dpbusd results (A: chunks (p, q) in
 * 256-bit halves, B: chunks (p', q')), 128-bit lane k holds 4 dwords of A's
 * lane k then 4 of B's lane k. */
KQ5_INLINE __m512i scale_idx(int a_lo, int a_hi, int b_lo, int b_hi) {
    /* lanes 0,1: A lower half (a_lo), B lower half (b_lo); lanes 2,3: upper halves */
    short e[32];
    for (int k = 0; k < 4; k++)
        for (int i = 0; i < 8; i++) e[8 * k + i] = (short)(i < 4 ? (k < 2 ? a_lo : a_hi) : (k < 2 ? b_lo : b_hi));
    return _mm512_loadu_si512((const void *)e);
}

/* Q6_K: 128-bit lane k holds A's dwords 4k..4k+3 (16 values of scale b + k)
 * then B's (scale b + 4 + k). */
KQ5_INLINE __m512i scale_idx6(int b) {
    short e[32];
    for (int k = 0; k < 4; k++)
        for (int i = 0; i < 8; i++) e[8 * k + i] = (short)(i < 4 ? b + k : b + 4 + k);
    return _mm512_loadu_si512((const void *)e);
}

/* Q4_K / Q5_K: one row's super-block. s_out: int32 x 8 whose sum is sumi;
 * m_out: int32 x 4 whose sum is summ (as avx2's). A[0..3]: the activations
 * [c0|c2], [c1|c3], [c4|c6], [c5|c7] (32-value chunks). */
KQ5_INLINE void dot_q45k_512(const uint8_t *bp, bool five, const __m512i *A, __m128i q8s, __m512i ix0, __m512i ix1,
                             __m256i *s_out, __m128i *m_out) {
    uint32_t u[4];
    memcpy(u, bp + 4, 12);
    u[3] = ((u[2] >> 4) & 0x0f0f0f0fu) | (((u[1] >> 6) & 0x03030303u) << 4);
    const uint32_t ux = u[1] & 0x3f3f3f3fu;
    u[1] = (u[2] & 0x0f0f0f0fu) | (((u[0] >> 6) & 0x03030303u) << 4);
    u[2] = ux;
    u[0] &= 0x3f3f3f3fu;
    const __m256i ms = _mm256_cvtepu8_epi16(_mm_set_epi32((int)u[3], (int)u[2], (int)u[1], (int)u[0]));
    *m_out = _mm_madd_epi16(_mm256_extracti128_si256(ms, 1), q8s);
    const __m512i sc = _mm512_castsi256_si512(ms); /* words 0..7: scales */
    const __m512i m4 = _mm512_set1_epi8(0x0f);
    const uint8_t *qs = bp + (five ? 48 : 16);
    __m512i hb = _mm512_setzero_si512();
    if (five) {
        const __m512i h = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(bp + 16)));
        hb = UPPER_SRLI(h, 2); /* lower: raw 0 (bits 0,1), upper: raw 1 (bits 2,3) */
    }
    const __m512i one = _mm512_set1_epi8(1);
    __m512i s = _mm512_setzero_si512();
#pragma GCC unroll 2
    for (int p = 0; p < 2; p++) {
        const __m512i raw = _mm512_loadu_si512((const void *)(qs + 64 * p)); /* raw 2p | raw 2p+1 */
        __m512i lo = _mm512_and_si512(raw, m4), hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), m4);
        if (five) {
            const __m512i hp = p ? _mm512_srli_epi16(hb, 4) : hb;
            lo = _mm512_or_si512(lo, _mm512_slli_epi16(_mm512_and_si512(hp, one), 4));
            hi = _mm512_or_si512(hi, _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(hp, 1), one), 4));
        }
        /* lo: chunks 4p | 4p+2, hi: 4p+1 | 4p+3 */
        const __m512i dl = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, A[2 * p]);
        const __m512i dh = _mm512_dpbusd_epi32(_mm512_setzero_si512(), hi, A[2 * p + 1]);
        const __m512i pk = _mm512_packs_epi32(dl, dh);
        s = _mm512_dpwssd_epi32(s, pk, _mm512_permutexvar_epi16(p ? ix1 : ix0, sc));
    }
    *s_out = _mm256_add_epi32(_mm512_castsi512_si256(s), _mm512_extracti64x4_epi64(s, 1));
}

/* Q6_K: int32 x 8 whose sum is sum of sc_j * (q - 32) * x. A[h][0..1]: the
 * activations of values 128h..128h+63, 128h+64..128h+127. */
KQ5_INLINE __m256i dot_q6k_512(const uint8_t *bp, const __m512i A[2][2], __m256i bsums, __m512i ix0, __m512i ix1) {
    const __m512i m4 = _mm512_set1_epi8(0x0f), m3 = _mm512_set1_epi8(0x03);
    const __m128i sc8 = _mm_loadu_si128((const __m128i *)(bp + offsetof(moetax_block_q6_k, scales)));
    const __m256i sc16 = _mm256_cvtepi8_epi16(sc8);
    const __m512i sc = _mm512_castsi256_si512(sc16);
    const __m256i off = _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_madd_epi16(bsums, _mm256_slli_epi16(sc16, 5)));
    __m512i s = _mm512_zextsi256_si512(off);
#pragma GCC unroll 2
    for (int h = 0; h < 2; h++) {
        const uint8_t *ql = bp + 64 * h, *qh = bp + offsetof(moetax_block_q6_k, qh) + 32 * h;
        const __m512i L = _mm512_loadu_si512((const void *)ql); /* l0 | l1 */
        const __m512i Hb = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)qh));
        const __m512i H = UPPER_SRLI(Hb, 2);
        /* [q0 | q1] and [q2 | q3] of avx2's decode_q6k */
        const __m512i q01 = _mm512_or_si512(_mm512_and_si512(L, m4), _mm512_slli_epi16(_mm512_and_si512(H, m3), 4));
        const __m512i q23 = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(L, 4), m4),
                                            _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(H, 4), m3), 4));
        const __m512i d0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), q01, A[h][0]);
        const __m512i d1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), q23, A[h][1]);
        const __m512i pk = _mm512_packs_epi32(d0, d1);
        s = _mm512_dpwssd_epi32(s, pk, _mm512_permutexvar_epi16(h ? ix1 : ix0, sc));
    }
    return _mm256_add_epi32(_mm512_castsi512_si256(s), _mm512_extracti64x4_epi64(s, 1));
}

/* lanes r of the result: the sum of v[r]'s 8 int32 (exact: any order) */
KQ5_INLINE __m128i hsum4_i32(__m256i v0, __m256i v1, __m256i v2, __m256i v3) {
    const __m256i h = _mm256_hadd_epi32(_mm256_hadd_epi32(v0, v1), _mm256_hadd_epi32(v2, v3));
    return _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
}

static void kq_decode_rows_512(enum moetax_type wtype, const uint8_t *w, size_t row_bytes, int64_t row0, int64_t row1,
                               int64_t nb, const moetax_block_q8_k *x, float *y) {
    const size_t bsz = moetax_type_size(wtype);
    const bool six = wtype == MOETAX_TYPE_Q6_K, five = wtype == MOETAX_TYPE_Q5_K;
    const size_t doff = six ? offsetof(moetax_block_q6_k, d) : 0;
    /* Q4_K/Q5_K pair p: A = [c(4p) | c(4p+2)], B = [c(4p+1) | c(4p+3)]
     * Q6_K half h: A = [v(4h) | v(4h+1)] (scales 8h..8h+3 by 16 values), B = [v(4h+2) | v(4h+3)] */
    const __m512i ix0 = six ? scale_idx6(0) : scale_idx(0, 2, 1, 3);
    const __m512i ix1 = six ? scale_idx6(8) : scale_idx(4, 6, 5, 7);
    for (int64_t r = row0; r < row1; r += 4) {
        const int nr = row1 - r < 4 ? (int)(row1 - r) : 4;
        const uint8_t *wr[4];
        for (int k = 0; k < 4; k++) wr[k] = w + (size_t)(r + (k < nr ? k : nr - 1)) * row_bytes;
        __m128 acc = _mm_setzero_ps();
        for (int64_t i = 0; i < nb; i++) {
            const moetax_block_q8_k *a = x + i;
            const size_t off = (size_t)i * bsz;
            for (int k = 0; k < 4; k++) _mm_prefetch((const char *)wr[k] + off + 4 * bsz, _MM_HINT_T0);
            const __m128 ad = _mm_set1_ps(a->d);
            const __m128 dw = _mm_setr_ps(moetax_k_fp16_table[ld16(wr[0] + off + doff)],
                                          moetax_k_fp16_table[ld16(wr[1] + off + doff)],
                                          moetax_k_fp16_table[ld16(wr[2] + off + doff)],
                                          moetax_k_fp16_table[ld16(wr[3] + off + doff)]);
            const __m256i bs = _mm256_loadu_si256((const __m256i *)a->bsums);
            if (six) {
                __m512i A[2][2];
                for (int h = 0; h < 2; h++) {
                    A[h][0] = _mm512_loadu_si512((const void *)(a->qs + 128 * h));
                    A[h][1] = _mm512_loadu_si512((const void *)(a->qs + 128 * h + 64));
                }
                const __m128i si = hsum4_i32(dot_q6k_512(wr[0] + off, A, bs, ix0, ix1),
                                             dot_q6k_512(wr[1] + off, A, bs, ix0, ix1),
                                             dot_q6k_512(wr[2] + off, A, bs, ix0, ix1),
                                             dot_q6k_512(wr[3] + off, A, bs, ix0, ix1));
                acc = _mm_add_ps(acc, _mm_mul_ps(_mm_mul_ps(ad, dw), _mm_cvtepi32_ps(si)));
            } else {
                const __m128i q8s = _mm_hadd_epi16(_mm256_castsi256_si128(bs), _mm256_extracti128_si256(bs, 1));
                __m512i A[4];
                const __m512i lo = _mm512_loadu_si512((const void *)a->qs);        /* c0 | c1 */
                const __m512i lo2 = _mm512_loadu_si512((const void *)(a->qs + 64)); /* c2 | c3 */
                const __m512i hi = _mm512_loadu_si512((const void *)(a->qs + 128)); /* c4 | c5 */
                const __m512i hi2 = _mm512_loadu_si512((const void *)(a->qs + 192)); /* c6 | c7 */
                const __m512i pl = _mm512_setr_epi64(0, 1, 2, 3, 8, 9, 10, 11), ph = _mm512_setr_epi64(4, 5, 6, 7, 12, 13, 14, 15);
                A[0] = _mm512_permutex2var_epi64(lo, pl, lo2);
                A[1] = _mm512_permutex2var_epi64(lo, ph, lo2);
                A[2] = _mm512_permutex2var_epi64(hi, pl, hi2);
                A[3] = _mm512_permutex2var_epi64(hi, ph, hi2);
                __m256i s0, s1, s2, s3;
                __m128i m0, m1, m2, m3;
                dot_q45k_512(wr[0] + off, five, A, q8s, ix0, ix1, &s0, &m0);
                dot_q45k_512(wr[1] + off, five, A, q8s, ix0, ix1, &s1, &m1);
                dot_q45k_512(wr[2] + off, five, A, q8s, ix0, ix1, &s2, &m2);
                dot_q45k_512(wr[3] + off, five, A, q8s, ix0, ix1, &s3, &m3);
                const __m128i si = hsum4_i32(s0, s1, s2, s3);
                const __m128i mi = _mm_hadd_epi32(_mm_hadd_epi32(m0, m1), _mm_hadd_epi32(m2, m3));
                const __m128 dm = _mm_setr_ps(moetax_k_fp16_table[ld16(wr[0] + off + 2)],
                                              moetax_k_fp16_table[ld16(wr[1] + off + 2)],
                                              moetax_k_fp16_table[ld16(wr[2] + off + 2)],
                                              moetax_k_fp16_table[ld16(wr[3] + off + 2)]);
                acc = _mm_add_ps(acc, _mm_mul_ps(_mm_mul_ps(ad, dw), _mm_cvtepi32_ps(si)));
                acc = _mm_sub_ps(acc, _mm_mul_ps(_mm_mul_ps(ad, dm), _mm_cvtepi32_ps(mi)));
            }
        }
        float o[4];
        _mm_storeu_ps(o, acc);
        for (int k = 0; k < nr; k++) y[r + k] = o[k];
    }
}

void moetax_k_matmul_kq_avx512(enum moetax_type wtype, const void *w, size_t row_bytes, int64_t row0, int64_t row1,
                               int64_t ncols, const void *xq, int64_t n_batch, float *y, int64_t ldy) {
    if (row1 <= row0 || n_batch <= 0 || ncols <= 0) return;
    if (n_batch == 1) {
        kq_decode_rows_512(wtype, (const uint8_t *)w, row_bytes, row0, row1, ncols / MOETAX_QK_K,
                           (const moetax_block_q8_k *)xq, y);
        return;
    }
    moetax_k_matmul_kq_avx2(wtype, w, row_bytes, row0, row1, ncols, xq, n_batch, y, ldy);
}
