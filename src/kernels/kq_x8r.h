/* kq_x8r.h - the per-super-block steps of the k-quant x8r layouts (kernels.h, WEIGHT
 * LAYOUTS: 8 rows interleaved, one row per 32-bit lane of a 256-bit vector) that do not
 * depend on how the levels are multiplied: the scales' and mins' unpacking, the
 * activations' bsums terms and decode's prefetch. Shared by matmul_kq_avx2.c and the
 * 256-bit tiles of matmul_kq_avx512.c (each compiles it with its own flags; only AVX2
 * intrinsics here). Every step is exact integer work. */
#ifndef MOETAX_KQ_X8R_H
#define MOETAX_KQ_X8R_H

#include <immintrin.h>
#include <stdbool.h>
#include <stdint.h>

#include "kernels_impl.h"

#define KQ8R_INLINE static inline __attribute__((always_inline))

/* Decode's prefetch for the n bytes at p: into L2 the lines of [p + d, p + d + n) that lie
 * below pfe (d bytes ahead of where it reads, never past its row range's end) and, with
 * near > 0, into L1 the lines near bytes ahead, which by then are in L2. On an Intel Xeon
 * the avx512 table's decode came nearer a plain read with both than with the L2 prefetch
 * alone (an L1 prefetch alone was worse on Zen 4), while the avx2 table's, bound by its
 * arithmetic, lost to the second instruction (commit messages: measurements). */
KQ8R_INLINE void kq8r_prefetch_dec(const uint8_t *p, size_t d, size_t near, size_t n, const uint8_t *pfe) {
    uintptr_t a = (uintptr_t)p + d, b = a + n;
    if (b > (uintptr_t)pfe) b = (uintptr_t)pfe;
    for (; a < b; a += 64) _mm_prefetch((const char *)a, _MM_HINT_T1);
    if (near > 0)
        for (size_t o = 0; o < n; o += 64) _mm_prefetch((const char *)p + near + o, _MM_HINT_T0);
}

/* Q4_Kx8r / Q5_Kx8r: the 6-bit scales of sub-blocks 0..3 and 4..7 in the bytes of each lane
 * (ggml's 32-bit mask steps on one dword per row). */
KQ8R_INLINE void kq8r_q45_scales(const uint8_t *blk, __m256i *sc03, __m256i *sc47) {
    const __m256i m6 = _mm256_set1_epi32(0x3f3f3f3f), m2 = _mm256_set1_epi32(0x03030303);
    const __m256i m4d = _mm256_set1_epi32(0x0f0f0f0f);
    const __m256i u0 = _mm256_loadu_si256((const __m256i *)(blk + MOETAX_K_Q4KR8_SC_OFF));
    const __m256i u2 = _mm256_loadu_si256((const __m256i *)(blk + MOETAX_K_Q4KR8_SC_OFF + 64));
    *sc03 = _mm256_and_si256(u0, m6);
    *sc47 = _mm256_or_si256(_mm256_and_si256(u2, m4d), _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(u0, 6), m2), 4));
}

/* Q4_Kx8r / Q5_Kx8r: the mins as int16 pairs per lane: p[0] (m0, m2), p[1] (m1, m3), p[2]
 * (m4, m6), p[3] (m5, m7). */
KQ8R_INLINE void kq8r_q45_min_pairs(const uint8_t *blk, __m256i p[4]) {
    const __m256i m6 = _mm256_set1_epi32(0x3f3f3f3f), m2 = _mm256_set1_epi32(0x03030303);
    const __m256i m4d = _mm256_set1_epi32(0x0f0f0f0f), mw = _mm256_set1_epi32(0x00ff00ff);
    const __m256i u1 = _mm256_loadu_si256((const __m256i *)(blk + MOETAX_K_Q4KR8_SC_OFF + 32));
    const __m256i u2 = _mm256_loadu_si256((const __m256i *)(blk + MOETAX_K_Q4KR8_SC_OFF + 64));
    const __m256i mn03 = _mm256_and_si256(u1, m6);
    const __m256i mn47 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(u2, 4), m4d),
                                         _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(u1, 6), m2), 4));
    p[0] = _mm256_and_si256(mn03, mw);
    p[1] = _mm256_and_si256(_mm256_srli_epi32(mn03, 8), mw);
    p[2] = _mm256_and_si256(mn47, mw);
    p[3] = _mm256_and_si256(_mm256_srli_epi32(mn47, 8), mw);
}

/* Q4_K / Q5_K: summ = sum_j m_j * (bsums[2j] + bsums[2j+1]) per lane, for the activation's
 * super-block a and the min pairs p (kq8r_q45_min_pairs). */
KQ8R_INLINE __m256i kq8r_q45_mins(const __m256i p[4], const moetax_block_q8_k *a) {
    const __m128i pairs = _mm_setr_epi8(0, 1, 4, 5, 2, 3, 6, 7, 8, 9, 12, 13, 10, 11, 14, 15);
    const __m256i bs = _mm256_loadu_si256((const __m256i *)a->bsums);
    /* q8s[j] = bsums[2j] + bsums[2j+1], as int16 pairs (q0, q2), (q1, q3), (q4, q6), (q5, q7) */
    const __m256i qp = _mm256_castsi128_si256(
        _mm_shuffle_epi8(_mm_hadd_epi16(_mm256_castsi256_si128(bs), _mm256_extracti128_si256(bs, 1)), pairs));
    __m256i M = _mm256_madd_epi16(p[0], _mm256_permutevar8x32_epi32(qp, _mm256_set1_epi32(0)));
    M = _mm256_add_epi32(M, _mm256_madd_epi16(p[1], _mm256_permutevar8x32_epi32(qp, _mm256_set1_epi32(1))));
    M = _mm256_add_epi32(M, _mm256_madd_epi16(p[2], _mm256_permutevar8x32_epi32(qp, _mm256_set1_epi32(2))));
    return _mm256_add_epi32(M, _mm256_madd_epi16(p[3], _mm256_permutevar8x32_epi32(qp, _mm256_set1_epi32(3))));
}

/* The activation's bsums as int16 pairs: dword 2k (bs[4k], bs[4k+2]), dword 2k+1 (bs[4k+1],
 * bs[4k+3]), in both 128-bit halves' order. */
KQ8R_INLINE __m256i kq8r_bsum_pairs(const moetax_block_q8_k *a) {
    const __m256i pairs = _mm256_setr_epi8(0, 1, 4, 5, 2, 3, 6, 7, 8, 9, 12, 13, 10, 11, 14, 15, 0, 1, 4, 5, 2, 3, 6, 7,
                                           8, 9, 12, 13, 10, 11, 14, 15);
    return _mm256_shuffle_epi8(_mm256_loadu_si256((const __m256i *)a->bsums), pairs);
}

/* sum over k of ev[k] . (bsum pair 2k) + od[k] . (bsum pair 2k + 1) per lane: sum_j c_j * bsums_j
 * for the rows' int16 coefficient pairs ev / od (dword 2k, 2k + 1 of kq8r_bsum_pairs). */
KQ8R_INLINE __m256i kq8r_bsum_dot(const __m256i ev[4], const __m256i od[4], __m256i bsp) {
    __m256i c = _mm256_setzero_si256();
#pragma GCC unroll 4
    for (int k = 0; k < 4; k++) {
        c = _mm256_add_epi32(c, _mm256_madd_epi16(ev[k], _mm256_permutevar8x32_epi32(bsp, _mm256_set1_epi32(2 * k))));
        c = _mm256_add_epi32(c, _mm256_madd_epi16(od[k], _mm256_permutevar8x32_epi32(bsp, _mm256_set1_epi32(2 * k + 1))));
    }
    return c;
}

/* Q6_Kx8r: the rows' int8 scales as int16 pairs (kq8r_bsum_dot's ev / od). */
KQ8R_INLINE void kq8r_q6_coefs(const uint8_t *blk, __m256i ev[4], __m256i od[4]) {
#pragma GCC unroll 4
    for (int k = 0; k < 4; k++) {
        const __m256i sk = _mm256_loadu_si256((const __m256i *)(blk + MOETAX_K_Q6KR8_SC_OFF + 32 * k));
        ev[k] = _mm256_srai_epi16(_mm256_slli_epi16(sk, 8), 8);
        od[k] = _mm256_srai_epi16(sk, 8);
    }
}

/* Q6_Kx8r, half h, 4-byte group p (values l = 4p..4p+3 of the half): the four 6-bit level
 * vectors of values 128h + 32k + l (k = 0..3: ql group p low nibbles, ql group p + 8 low,
 * then their high nibbles, each with qh group p's bits 2k, 2k + 1 above them). */
KQ8R_INLINE void kq8r_q6_levels(const uint8_t *blk, int h, int p, __m256i v[4]) {
    const __m256i m4 = _mm256_set1_epi8(0x0f), m30 = _mm256_set1_epi8(0x30);
    const uint8_t *ql = blk + MOETAX_K_Q6KR8_QL_OFF + 512 * h + 32 * p;
    const __m256i l0 = _mm256_loadu_si256((const __m256i *)ql);
    const __m256i l1 = _mm256_loadu_si256((const __m256i *)(ql + 256));
    const __m256i hq = _mm256_loadu_si256((const __m256i *)(blk + MOETAX_K_Q6KR8_QH_OFF + 256 * h + 32 * p));
    v[0] = _mm256_or_si256(_mm256_and_si256(l0, m4), _mm256_and_si256(_mm256_slli_epi16(hq, 4), m30));
    v[1] = _mm256_or_si256(_mm256_and_si256(l1, m4), _mm256_and_si256(_mm256_slli_epi16(hq, 2), m30));
    v[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4), _mm256_and_si256(hq, m30));
    v[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4), _mm256_and_si256(_mm256_srli_epi16(hq, 2), m30));
}

/* Q6_K: acc + (d_x * d_w) * (float)sumi for one activation super-block a, where sumi = S minus
 * the offset of 32 (32 * sum_j sc_j * bsums_j, the rows' scales as kq8r_q6_coefs' pairs). */
KQ8R_INLINE __m256 kq8r_q6_acc(__m256 acc, __m256i S, const __m256i ev[4], const __m256i od[4],
                               const moetax_block_q8_k *a, __m256 dw) {
    const __m256i off = kq8r_bsum_dot(ev, od, kq8r_bsum_pairs(a));
    const __m256i sumi = _mm256_sub_epi32(S, _mm256_slli_epi32(off, 5));
    const __m256 ad = _mm256_set1_ps(a->d);
    return _mm256_add_ps(acc, _mm256_mul_ps(_mm256_mul_ps(ad, dw), _mm256_cvtepi32_ps(sumi)));
}

/* Q2_Kx8r / Q3_Kx8r: U[k], scales 4k..4k+3 in the bytes of each lane; Q2_K as stored (low
 * nibble: scale, high: min), Q3_K unpacked (ggml's 32-bit mask steps) minus 32, signed. */
KQ8R_INLINE void kq8r_q23_scales(const bool three, const uint8_t *blk, __m256i U[4]) {
    if (!three) {
#pragma GCC unroll 4
        for (int k = 0; k < 4; k++) U[k] = _mm256_loadu_si256((const __m256i *)(blk + MOETAX_K_Q2KR8_SC_OFF + 32 * k));
        return;
    }
    const __m256i m4 = _mm256_set1_epi8(0x0f), m30 = _mm256_set1_epi8(0x30), c32 = _mm256_set1_epi8(32);
    const __m256i a0 = _mm256_loadu_si256((const __m256i *)(blk + MOETAX_K_Q3KR8_SC_OFF));
    const __m256i a1 = _mm256_loadu_si256((const __m256i *)(blk + MOETAX_K_Q3KR8_SC_OFF + 32));
    const __m256i a2 = _mm256_loadu_si256((const __m256i *)(blk + MOETAX_K_Q3KR8_SC_OFF + 64));
    U[0] = _mm256_or_si256(_mm256_and_si256(a0, m4), _mm256_and_si256(_mm256_slli_epi32(a2, 4), m30));
    U[1] = _mm256_or_si256(_mm256_and_si256(a1, m4), _mm256_and_si256(_mm256_slli_epi32(a2, 2), m30));
    U[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(a0, 4), m4), _mm256_and_si256(a2, m30));
    U[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(a1, 4), m4), _mm256_and_si256(_mm256_srli_epi32(a2, 2), m30));
#pragma GCC unroll 4
    for (int k = 0; k < 4; k++) U[k] = _mm256_sub_epi8(U[k], c32);
}

/* Q2_Kx8r / Q3_Kx8r: the rows' int16 coefficient pairs of the bsums (kq8r_bsum_dot's ev / od):
 * Q2_K the mins, Q3_K the signed scales. */
KQ8R_INLINE void kq8r_q23_coefs(const bool three, const __m256i U[4], __m256i ev[4], __m256i od[4]) {
#pragma GCC unroll 4
    for (int k = 0; k < 4; k++) {
        if (three) {
            ev[k] = _mm256_srai_epi16(_mm256_slli_epi16(U[k], 8), 8);
            od[k] = _mm256_srai_epi16(U[k], 8);
        } else {
            ev[k] = _mm256_and_si256(_mm256_srli_epi32(U[k], 4), _mm256_set1_epi32(0x000f000f));
            od[k] = _mm256_and_si256(_mm256_srli_epi32(U[k], 12), _mm256_set1_epi32(0x000f000f));
        }
    }
}

#endif
