/* matmul_kq_avx512.c - AVX-512 (F/BW/VL/DQ) + VNNI matmul of the k-quant
 * weights against block_q8_K activations (kernels.h) in the table's Q2_Kx8r ..
 * Q6_Kx8r layouts (8 rows interleaved), any batch (below: decode on 512-bit tiles of
 * two groups, group i of the range's first half beside group i of its second, and
 * batches on 512-bit tiles of two adjacent groups x 1..8 batch rows; a range's odd
 * last group on the avx2 table's tiles, which read the same layouts and give the same
 * bits); a unit's plain tail (n_rows % 8 rows) as stored: decode here, batches here
 * (Q2_K/Q3_K) or the avx2 table's (the others). Compiled with the
 * avx512 flags; reached only through the avx512 table.
 *
 * The plain-layout decode (a unit's plain tail) is
 * bit-identical to matmul_kq_avx2.c's decode path: the same 4 rows side by
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
#include <assert.h>
#include <immintrin.h>
#include <string.h>

#include "kernels_impl.h"
#include "kq_rows.h"
#include "moetax/types.h"

#define KQ5_INLINE static inline __attribute__((always_inline))
/* Where the decode tiles' (JB = 1) block loops, and Q6_K's batch-of-2 tile's, begin within a 64-byte
 * line. The SIMD kernel files are built with -falign-functions=64 (CMakeLists.txt), so that code
 * elsewhere no longer moves them, and these pads (NOPs run once a call, before the loop) put the
 * loops where they read from memory fastest on Zen 4 (swept in steps of 8 bytes): their speed from
 * memory hung on that position, and before the alignment any change to any other code could move
 * it (docs/MEASUREMENTS.md, k-quants). Q2_K/Q3_K's decode and Q4_K/Q5_K's batch-of-2 tiles showed none. */
#define KQ4_DEC_PAD 16
#define KQ5_DEC_PAD 32
#define KQ6_DEC_PAD 16
#define KQ6_B2_PAD 40

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
    const uint8_t *w0 = w + (size_t)row0 * row_bytes, *we = w + (size_t)row1 * row_bytes;
    kq_prefetch_span_l2(w0, we - w0 > 4 * (ptrdiff_t)row_bytes + KQ_ROWS_PFD ? w0 + 4 * row_bytes + KQ_ROWS_PFD : we);
    for (int64_t r = row0; r < row1; r += 4) {
        struct kq_rows4 g;
        kq_rows4_init(&g, w, row_bytes, r, row1);
        const uint8_t *const *wr = g.w;
        __m128 acc = _mm_setzero_ps();
        for (int64_t i = 0; i < nb; i++) {
            const moetax_block_q8_k *a = x + i;
            const size_t off = (size_t)i * bsz;
            kq_rows4_prefetch(&g, bsz);
            const __m128 ad = _mm_set1_ps(a->d);
            const __m128 dw = kq_rows4_f16(&g, off + doff);
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
                const __m128 dm = kq_rows4_f16(&g, off + 2);
                acc = _mm_add_ps(acc, _mm_mul_ps(_mm_mul_ps(ad, dw), _mm_cvtepi32_ps(si)));
                acc = _mm_sub_ps(acc, _mm_mul_ps(_mm_mul_ps(ad, dm), _mm_cvtepi32_ps(mi)));
            }
        }
        kq_rows4_store(&g, acc, y + r);
    }
}

/* ---- Q4_K in Q4_Kx8r (kernels.h, WEIGHT LAYOUTS): 8 rows in the 8 int32 lanes ----
 * As Q4_0x8r: a 32-byte load holds 4 bytes of each of 8 rows, so vpdpbusd against
 * 4 activation bytes broadcast to every lane adds into one lane per row, with no
 * horizontal sums; a sub-block's exact sum (|.| <= 32 * 15 * 127) is multiplied
 * by the row's 6-bit scale and added up per super-block; the mins' term is
 * vpmaddwd of the rows' mins (int16 pairs) with the activation's bsum pairs. The
 * 8 rows' packed scales are unpacked together (ggml's 32-bit mask trick on one
 * dword per lane, as matmul_kq_avx2.c does). Per lane the float steps are avx2's, in its order:
 * acc += (d_x * d_w) * (float)sumi; acc -= (d_x * dmin_w) * (float)summ. The tiles
 * below hold two groups in 512-bit vectors. */

/* Decode (one batch row) of weights streamed from memory (matmul_stream, kernels.h) reads
 * them once at the memory's rate: it prefetches KQ_PFD bytes ahead of where it reads, into
 * L2 (prefetcht1), never past the end of its row range (pfe); cached weights go without
 * (for them those instructions are only added work). An L1 prefetch (prefetcht0) a few super-blocks ahead left Q6_Kx8r's
 * decode far below a plain read of the same bytes, no better than no prefetch at all: the
 * lines wait in L2 without holding the L1's miss buffers that the demand loads need, and
 * the distance covers the memory's latency at full rate. Every k-quant takes the same
 * distance (4 KiB ahead of each stream; two streams per core): on an Intel Xeon, 12 KiB
 * (chosen on Zen 4 against an L1 prefetch) left Q4_K/Q6_K decode further below a plain
 * read than 3-8 KiB did, most with 2 threads, whose row ranges are shorter, each
 * beginning with a burst of that many prefetches (commit messages: measurements). */
#ifndef KQ_PFD
#define KQ_PFD 4096
#endif

/* ... and KQ_NEAR bytes ahead into L1 as well (kq8r_prefetch_dec): the lines are in L2 by
 * then, so these prefetches hold the L1's miss buffers only briefly. Q2_K/Q3_K decode took it
 * later than the others: on an Intel Xeon it did not gain, on an AMD Zen 4 Q3_K's did (commit
 * messages). */
#ifndef KQ_NEAR
#define KQ_NEAR 1024
#endif
/* Q6_K's decode takes twice the distances, its blocks being larger than Q4_K's: with the
 * others' its L1 prefetch came less than a block ahead of the loads, and the tile's speed from
 * memory depended on where the linker placed its code (the same instructions elsewhere in the
 * binary read markedly slower); at these it does not (commit message: measurements). */
#ifndef KQ6_PFD
#define KQ6_PFD 8192
#endif
#ifndef KQ6_NEAR
#define KQ6_NEAR 4096
#endif

/* Decode's prefetch for the n bytes of a block at p (stream end pfe). */
KQ5_INLINE void kq_prefetch_dec(const uint8_t *p, size_t n, const uint8_t *pfe) {
    kq8r_prefetch_dec(p, KQ_PFD, KQ_NEAR, n, pfe);
}

/* A batch tile's prefetch (JB > 1) for block i of its two adjacent groups (g1 = g0 + L, L the
 * group's nb * n bytes; a range's pairs follow one another), for weights streamed from memory
 * (pfe past them; the first tile of a pair's batch rows only: the rest find them in L2): into
 * L2, KQ_BPFD bytes ahead of each group's stream, never past the range's end. With an L1
 * prefetch a few super-blocks ahead alone, as the tiles had, a tile of 2 batch rows waited on
 * the memory's latency and took a multiple of decode's time for the same bytes; 8 KiB ahead
 * without the L1 prefetch came nearest decode's time of the distances tried (commit message:
 * measurements). The two groups are read side by side, so group A's stream, past its end, goes
 * on at the next pair's group B (g1 + L + offset), which nothing else brings in early; group B's
 * runs into the next pair's group A by itself. */
#ifndef KQ_BPFD
#define KQ_BPFD 8192
#endif
KQ5_INLINE void kqz_prefetch_batch(const uint8_t *g0, const uint8_t *g1, size_t L, int64_t i, size_t n,
                                   const uint8_t *pfe) {
    const size_t x = (size_t)i * n + KQ_BPFD; /* the offset to prefetch in each stream */
    kq8r_prefetch_dec(x < L ? g0 + x - KQ_BPFD : g1 + L + x - KQ_BPFD, KQ_BPFD, 0, n, pfe);
    kq8r_prefetch_dec(g1 + x - KQ_BPFD, KQ_BPFD, 0, n, pfe);
}

/* ---- Q6_K in Q6_Kx8r: 8 rows in the 8 int32 lanes, as Q4_Kx8r (two groups a tile below) ----
 * Per half h and 4-byte group p (values l = 4p..4p+3 of the half) one load each of
 * ql groups p and p + 8 and qh group p gives the four 6-bit level vectors of
 * values 128h + 32k + l (k = 0..3: ql[l] low, ql[l+32] low, ql[l] high, ql[l+32]
 * high, with qh bits 2k, 2k+1); sub-block 8h + 2k + p / 4 sums in its own chain,
 * times the rows' int8 scale (vpmulld). The offset of 32 is subtracted once per
 * super-block: 32 * sum_j sc_j * bsums_j by vpmaddwd of int16 scale pairs. */

/* ---- Q2_K in Q2_Kx8r, Q3_K in Q3_Kx8r: 8 rows in the 8 int32 lanes, as Q6_Kx8r ----
 * A 4-byte group g of qs (half h = g / 8, values l = 4p..4p+3 with p = g % 8) holds the
 * 2-bit levels of values 128h + 32k + l at bits 2k, 2k+1 (k = 0..3); Q3_K's hmask group p
 * adds 4 to them where bit 4h + k is set. The levels are kept in place, times 4^k (Q3_K:
 * 1, 4, 16, 16, its k = 3 shifted down by 2 so that the high bit stays in the byte): one
 * AND per level vector (Q3_K: the hmask bit shifted to its place, masked, and ORed in by
 * one vpternlogd). Each sub-block's scale is taken that much less than 64 times (a shift
 * of the scale, once per group and sub-block): S = 64 * sum_j sc_j * sum(level * x), exact
 * in int32 (|S| <= 64 * 256 * 7 * 32 * 127), and sumi = S >> 6. Sub-block j = 8h + 2k + p / 4
 * sums in its own chain per batch row (|.| <= 16 * 192 * 127), multiplied by its scale
 * (vpmulld). The mins (Q2_K) and the offset 4 * sum_j sc_j * bsums_j (Q3_K) are vpdpwssd
 * of the rows' int16 pairs with the bsums' pairs broadcast from memory. Per lane the float
 * steps are avx2's, in its order: acc += (d_x * d_w) * (float)sumi (Q2_K: then acc -=
 * (d_x * dmin_w) * (float)summ). The tiles (q23z_tile below) hold two groups in 512-bit vectors
 * and take the chain's product with its scale by vpdpwssd instead: the chain shifted down by its
 * factor (exact: a multiple of it; |.| <= 16 * 7 * 128 fits the lane's low int16) times the scale
 * in the low int16 of a lane whose high int16 is zero (Q2_K: 64 sc_j, S as above; Q3_K: 256 sc_j
 * by one vpshufb, |S| <= 256 * 16 * 32 * 14336 < 2^31, sumi = S >> 8): the same integers. */

/* ---- Tiles of two groups of 8 rows in 512-bit vectors x up to KQZ_JB batch rows ----
 * Lanes 0-7 hold group A's 8 rows, lanes 8-15 group B's (two 32-byte loads joined), so
 * one 4-byte activation broadcast ({1to16}, embedded in vpdpbusd) serves 16 rows, and a
 * super-block of the two groups is decoded once per tile of JB (1..8) batch rows: the
 * nibbles / 6-bit levels, the unpacked scales and mins and the F16 d / dmin. The integer
 * steps are exact (the same sub-block sums times the same scales as avx2's tiles), and
 * per lane the float steps are avx2's, in its order:
 *   acc += (d_x * d_w) * (float)sumi;  acc -= (d_x * dmin_w) * (float)summ  (Q6_K: the first)
 * so the results are bit-identical to the decode path and to the avx2 table.
 * With JB <= 4 a chunk's two sub-blocks are summed side by side (2 JB chains, latency);
 * with more, one sub-block at a time (JB chains; the 32 vector registers hold the chains,
 * the sums S and the float accumulators). A range's odd last group takes the avx2 table's
 * tiles (same layouts, same bits). Decode (JB = 1) takes these tiles too, prefetching
 * KQ_PFD ahead into L2: on an Intel Xeon, whose 256-bit vpdpbusd issues twice per cycle
 * and the 512-bit one about once, they decode faster from L2 than two groups on 256-bit
 * tiles did, the nibbles, scales and F16 steps of both groups taking one instruction each
 * (commit messages: measurements). */
#define KQZ_JB 8
#ifndef KQZ_W16
#define KQZ_W16 1
#endif

/* acc + vpdpbusd(w, the 4 bytes at p in every lane), the broadcast embedded ({1to16}) */
KQ5_INLINE __m512i dpbusd_b16(__m512i acc, __m512i w, const uint8_t *p) {
    __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*(const int32_t *)p));
    return acc;
}

/* acc + vpdpwssd(w, the int16 pair at p in every lane), the broadcast embedded ({1to16}) */
KQ5_INLINE __m512i dpwssd_b16(__m512i acc, __m512i w, const int32_t *p) {
    __asm__("vpdpwssd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*p));
    return acc;
}

/* Each byte of x through the 8x8 bit matrix m (GFNI's vgf2p8affineqb, every qword of the matrix
 * operand m): bit i of a result byte = parity(byte 7 - i of m & the byte of x). Inline assembly, so
 * the file needs no -mgfni: only the tiles chosen when the CPU has GFNI (moetax_k_avx512_gfni,
 * kernels.c) run it. */
KQ5_INLINE __m512i gf_bits(__m512i x, uint64_t m) {
    __m512i r;
    __asm__("vgf2p8affineqb $0, %2, %1, %0" : "=v"(r) : "v"(x), "v"(_mm512_set1_epi64((long long)m)));
    return r;
}

/* The matrix that moves bit `from` of each byte to bit `to` (the others cleared). */
#define GF_MOVE(from, to) ((uint64_t)(1u << (from)) << (8 * (7 - (to))))

/* 32 bytes at a (lanes 0-7) and 32 at b (lanes 8-15). */
KQ5_INLINE __m512i kq_load_2x32(const uint8_t *a, const uint8_t *b) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)a)),
                              _mm256_loadu_si256((const __m256i *)b), 1);
}

/* The 8 F16 values at a and the 8 at b, widened. */
KQ5_INLINE __m512 kq_cvtph_2x8(const uint8_t *a, const uint8_t *b) {
    return _mm512_cvtph_ps(_mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)a)),
                                                   _mm_loadu_si128((const __m128i *)b), 1));
}

KQ5_INLINE __m512i byte_lane_z(__m512i v, int k) { /* byte k of each dword, zero-extended */
    return k == 3 ? _mm512_srli_epi32(v, 24) : _mm512_and_si512(_mm512_srli_epi32(v, 8 * k), _mm512_set1_epi32(0xff));
}

KQ5_INLINE __m512i sbyte_lane_z(__m512i v, int k) { /* signed byte k of each dword, sign-extended */
    return _mm512_srai_epi32(k == 3 ? v : _mm512_slli_epi32(v, 24 - 8 * k), 24);
}

KQ5_INLINE void store_2x8z(float *a, float *b, __m512 v) {
    _mm256_storeu_ps(a, _mm512_castps512_ps256(v));
    _mm256_storeu_ps(b, _mm512_extractf32x8_ps(v, 1));
}

/* Q4_K / Q5_K (five): the levels of sub-block j (chunk j / 2, high nibbles when j is odd) at
 * 4-byte group q of both groups; Q5_K adds bit j of the group's qh bytes as 16. */
KQ5_INLINE __m512i q45z_levels(const bool five, const bool gf, const uint8_t *bA, const uint8_t *bB, size_t qs_off,
                               int j, int q) {
    const __m512i m4 = _mm512_set1_epi8(0x0f);
    const int c = j >> 1;
    const __m512i v = kq_load_2x32(bA + qs_off + 256 * c + 32 * q, bB + qs_off + 256 * c + 32 * q);
    const __m512i l = (j & 1) ? _mm512_srli_epi16(v, 4) : v;
    if (!five) return _mm512_and_si512(l, m4);
    const __m512i hq = kq_load_2x32(bA + MOETAX_K_Q5KR8_QH_OFF + 32 * q, bB + MOETAX_K_Q5KR8_QH_OFF + 32 * q);
    if (gf) return _mm512_ternarylogic_epi32(l, m4, gf_bits(hq, GF_MOVE(j, 4)), 0xEA); /* bit j alone to bit 4 */
    /* bit j of each qh byte to bit 4 (16-bit shifts; the mask drops what crosses bytes) */
    const __m512i b = _mm512_and_si512(j <= 4 ? _mm512_slli_epi16(hq, 4 - j) : _mm512_srli_epi16(hq, j - 4),
                                       _mm512_set1_epi8(0x10));
    return _mm512_ternarylogic_epi32(l, m4, b, 0xEA); /* (l & m4) | b */
}

KQ5_INLINE void q45z_tile(const bool five, const bool gf, const int JB, const uint8_t *g0, const uint8_t *g1,
                          const uint8_t *xq, size_t act_row, int64_t nb, float *y0, float *y1, int64_t ldy,
                          const uint8_t *pfe) {
    const size_t bbytes = five ? MOETAX_K_Q5KR8_BLOCK_BYTES : MOETAX_K_Q4KR8_BLOCK_BYTES;
    const size_t qs_off = five ? MOETAX_K_Q5KR8_QS_OFF : MOETAX_K_Q4KR8_QS_OFF;
    const bool side = JB <= 4; /* a chunk's two sub-blocks side by side */
    /* Q4_K: a chain of 16 values is within int16 (|.| <= 16 * 15 * 128 = 30720), and the scale is
     * an int32 of 0..63 (upper int16 zero), so vpdpwssd adds chain * scale exactly: one
     * instruction for vpmulld + vpaddd. Q5_K's levels reach 31: 16 values could overflow. */
    const bool W16 = KQZ_W16 && !five;
    const __m512i m6 = _mm512_set1_epi32(0x3f3f3f3f), m2 = _mm512_set1_epi32(0x03030303);
    const __m512i m4d = _mm512_set1_epi32(0x0f0f0f0f), mw = _mm512_set1_epi32(0x00ff00ff);
    const __m128i pairs = _mm_setr_epi8(0, 1, 4, 5, 2, 3, 6, 7, 8, 9, 12, 13, 10, 11, 14, 15);
    __m512 acc[KQZ_JB];
#pragma GCC unroll 8
    for (int t = 0; t < JB; t++) acc[t] = _mm512_setzero_ps();
    if (JB == 1 && (five ? KQ5_DEC_PAD : KQ4_DEC_PAD) != 0)
        __asm__ volatile(".nops %c0" ::"i"(five ? KQ5_DEC_PAD : KQ4_DEC_PAD));
    for (int64_t i = 0; i < nb; i++) {
        const uint8_t *bA = g0 + (size_t)i * bbytes, *bB = g1 + (size_t)i * bbytes;
        if (JB == 1) { /* decode: far ahead into L2 (and L1: kq_prefetch_dec) */
            kq_prefetch_dec(bA, bbytes, pfe);
            kq_prefetch_dec(bB, bbytes, pfe);
        } else
            kqz_prefetch_batch(g0, g1, (size_t)nb * bbytes, i, bbytes, pfe);
        const moetax_block_q8_k *a[KQZ_JB];
#pragma GCC unroll 8
        for (int t = 0; t < JB; t++) a[t] = (const moetax_block_q8_k *)(xq + (size_t)t * act_row) + i;
        const __m512i u0 = kq_load_2x32(bA + MOETAX_K_Q4KR8_SC_OFF, bB + MOETAX_K_Q4KR8_SC_OFF);
        const __m512i u2 = kq_load_2x32(bA + MOETAX_K_Q4KR8_SC_OFF + 64, bB + MOETAX_K_Q4KR8_SC_OFF + 64);
        const __m512i sc03 = _mm512_and_si512(u0, m6); /* bytes: scales 0..3 */
        const __m512i sc47 = _mm512_or_si512(_mm512_and_si512(u2, m4d),
                                             _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(u0, 6), m2), 4));
        __m512i S[KQZ_JB];
#pragma GCC unroll 8
        for (int t = 0; t < JB; t++) S[t] = _mm512_setzero_si512();
        if (side) {
#pragma GCC unroll 4
            for (int c = 0; c < 4; c++) {
                __m512i sA[4], sB[4];
#pragma GCC unroll 4
                for (int t = 0; t < JB; t++) sA[t] = sB[t] = _mm512_setzero_si512();
                const __m512i scA = byte_lane_z(c < 2 ? sc03 : sc47, (2 * c) & 3);
                const __m512i scB = byte_lane_z(c < 2 ? sc03 : sc47, (2 * c + 1) & 3);
#pragma GCC unroll 8
                for (int q = 0; q < 8; q++) {
                    const __m512i lo = q45z_levels(five, gf, bA, bB, qs_off, 2 * c, q);
                    const __m512i hi = q45z_levels(five, gf, bA, bB, qs_off, 2 * c + 1, q);
#pragma GCC unroll 4
                    for (int t = 0; t < JB; t++) {
                        sA[t] = dpbusd_b16(sA[t], lo, (const uint8_t *)a[t]->qs + 64 * c + 4 * q);
                        sB[t] = dpbusd_b16(sB[t], hi, (const uint8_t *)a[t]->qs + 64 * c + 32 + 4 * q);
                    }
                    if (W16 && (q & 3) == 3) /* 16 values: into S by vpdpwssd, the chains from 0 */
#pragma GCC unroll 4
                        for (int t = 0; t < JB; t++) {
                            S[t] = _mm512_dpwssd_epi32(_mm512_dpwssd_epi32(S[t], sA[t], scA), sB[t], scB);
                            sA[t] = sB[t] = _mm512_setzero_si512();
                        }
                }
                if (!W16)
#pragma GCC unroll 4
                    for (int t = 0; t < JB; t++)
                        S[t] = _mm512_add_epi32(S[t], _mm512_add_epi32(_mm512_mullo_epi32(sA[t], scA),
                                                                       _mm512_mullo_epi32(sB[t], scB)));
            }
        } else {
#pragma GCC unroll 8
            for (int j = 0; j < 8; j++) {
                __m512i s[KQZ_JB];
#pragma GCC unroll 8
                for (int t = 0; t < JB; t++) s[t] = _mm512_setzero_si512();
                const __m512i scj = byte_lane_z(j < 4 ? sc03 : sc47, j & 3);
#pragma GCC unroll 8
                for (int q = 0; q < 8; q++) {
                    const __m512i l = q45z_levels(five, gf, bA, bB, qs_off, j, q);
#pragma GCC unroll 8
                    for (int t = 0; t < JB; t++)
                        s[t] = dpbusd_b16(s[t], l, (const uint8_t *)a[t]->qs + 32 * j + 4 * q);
                    if (W16 && (q & 3) == 3)
#pragma GCC unroll 8
                        for (int t = 0; t < JB; t++) {
                            S[t] = _mm512_dpwssd_epi32(S[t], s[t], scj);
                            s[t] = _mm512_setzero_si512();
                        }
                }
                if (!W16)
#pragma GCC unroll 8
                    for (int t = 0; t < JB; t++) S[t] = _mm512_add_epi32(S[t], _mm512_mullo_epi32(s[t], scj));
            }
        }
        /* mins: int16 pairs (m0, m2), (m1, m3), (m4, m6), (m5, m7) per lane */
        const __m512i u1 = kq_load_2x32(bA + MOETAX_K_Q4KR8_SC_OFF + 32, bB + MOETAX_K_Q4KR8_SC_OFF + 32);
        const __m512i mn03 = _mm512_and_si512(u1, m6);
        const __m512i mn47 = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(u2, 4), m4d),
                                             _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(u1, 6), m2), 4));
        const __m512i p02 = _mm512_and_si512(mn03, mw), p13 = _mm512_and_si512(_mm512_srli_epi32(mn03, 8), mw);
        const __m512i p46 = _mm512_and_si512(mn47, mw), p57 = _mm512_and_si512(_mm512_srli_epi32(mn47, 8), mw);
        const __m512 dw = kq_cvtph_2x8(bA, bB);
        const __m512 dm = kq_cvtph_2x8(bA + MOETAX_K_Q4KR8_DMIN_OFF, bB + MOETAX_K_Q4KR8_DMIN_OFF);
#pragma GCC unroll 8
        for (int t = 0; t < JB; t++) {
            const __m256i bs = _mm256_loadu_si256((const __m256i *)a[t]->bsums);
            /* q8s[j] = bsums[2j] + bsums[2j+1], as int16 pairs (q0, q2), (q1, q3), (q4, q6), (q5, q7) */
            const __m128i qp =
                _mm_shuffle_epi8(_mm_hadd_epi16(_mm256_castsi256_si128(bs), _mm256_extracti128_si256(bs, 1)), pairs);
            int32_t qa[4]; /* broadcast from memory by the vpdpwssd */
            _mm_storeu_si128((__m128i *)qa, qp);
            __m512i M = dpwssd_b16(_mm512_setzero_si512(), p02, qa);
            M = dpwssd_b16(M, p13, qa + 1);
            M = dpwssd_b16(M, p46, qa + 2);
            M = dpwssd_b16(M, p57, qa + 3);
            const __m512 ad = _mm512_set1_ps(a[t]->d);
            acc[t] = _mm512_add_ps(acc[t], _mm512_mul_ps(_mm512_mul_ps(ad, dw), _mm512_cvtepi32_ps(S[t])));
            acc[t] = _mm512_sub_ps(acc[t], _mm512_mul_ps(_mm512_mul_ps(ad, dm), _mm512_cvtepi32_ps(M)));
        }
    }
#pragma GCC unroll 8
    for (int t = 0; t < JB; t++) store_2x8z(y0 + t * ldy, y1 + t * ldy, acc[t]);
}

/* Q6_K in Q6_Kx8r, two groups: sub-block j = 8h + 2k + ph (values 128h + 32k + 16ph ..
 * + 15: the 4-byte groups p = 4ph .. 4ph + 3 of level vector k of half h), summed in its own
 * chain per batch row and multiplied by the rows' int8 scale; the offset of 32 once per
 * super-block (32 * sum_j sc_j * bsums_j, vpmaddwd of int16 scale pairs), as the avx2 tiles. */
KQ5_INLINE __m512i q6z_levels(const bool gf, const uint8_t *bA, const uint8_t *bB, int h, int k, int p) {
    const __m512i m4 = _mm512_set1_epi8(0x0f), m30 = _mm512_set1_epi8(0x30);
    const size_t lo = MOETAX_K_Q6KR8_QL_OFF + 512 * h + 32 * p + (k & 1) * 256;
    const size_t ho = MOETAX_K_Q6KR8_QH_OFF + 256 * h + 32 * p;
    const __m512i l = kq_load_2x32(bA + lo, bB + lo), hq = kq_load_2x32(bA + ho, bB + ho);
    const __m512i ls = k >= 2 ? _mm512_srli_epi16(l, 4) : l;
    /* qh bits 2k, 2k + 1 to bits 4, 5 (GFNI: moved there alone, one instruction for shift and mask) */
    if (gf) return _mm512_ternarylogic_epi32(ls, m4, gf_bits(hq, GF_MOVE(2 * k, 4) | GF_MOVE(2 * k + 1, 5)), 0xEA);
    const __m512i hs = k == 0 ? _mm512_slli_epi16(hq, 4) : k == 1 ? _mm512_slli_epi16(hq, 2)
                       : k == 2 ? hq : _mm512_srli_epi16(hq, 2);
    return _mm512_ternarylogic_epi32(ls, m4, _mm512_and_si512(hs, m30), 0xEA);
}

KQ5_INLINE void q6z_tile(const int JB, const bool gf, const uint8_t *g0, const uint8_t *g1, const uint8_t *xq,
                         size_t act_row, int64_t nb, float *y0, float *y1, int64_t ldy, const uint8_t *pfe) {
    const __m128i pairs = _mm_setr_epi8(0, 1, 4, 5, 2, 3, 6, 7, 8, 9, 12, 13, 10, 11, 14, 15);
    const bool side = JB <= 4; /* two sub-blocks (k, k + 1) side by side */
    __m512 acc[KQZ_JB];
#pragma GCC unroll 8
    for (int t = 0; t < JB; t++) acc[t] = _mm512_setzero_ps();
    if (JB == 1 && KQ6_DEC_PAD != 0) __asm__ volatile(".nops %c0" ::"i"(KQ6_DEC_PAD));
    if (JB == 2 && KQ6_B2_PAD != 0) __asm__ volatile(".nops %c0" ::"i"(KQ6_B2_PAD));
    for (int64_t i = 0; i < nb; i++) {
        const uint8_t *bA = g0 + (size_t)i * MOETAX_K_Q6KR8_BLOCK_BYTES, *bB = g1 + (size_t)i * MOETAX_K_Q6KR8_BLOCK_BYTES;
        if (JB == 1) { /* decode: far ahead into L2, and into L1 (KQ6_PFD, KQ6_NEAR) */
            kq8r_prefetch_dec(bA, KQ6_PFD, KQ6_NEAR, MOETAX_K_Q6KR8_BLOCK_BYTES, pfe);
            kq8r_prefetch_dec(bB, KQ6_PFD, KQ6_NEAR, MOETAX_K_Q6KR8_BLOCK_BYTES, pfe);
        } else
            kqz_prefetch_batch(g0, g1, (size_t)nb * MOETAX_K_Q6KR8_BLOCK_BYTES, i, MOETAX_K_Q6KR8_BLOCK_BYTES, pfe);
        const moetax_block_q8_k *a[KQZ_JB];
#pragma GCC unroll 8
        for (int t = 0; t < JB; t++) a[t] = (const moetax_block_q8_k *)(xq + (size_t)t * act_row) + i;
        __m512i S[KQZ_JB];
#pragma GCC unroll 8
        for (int t = 0; t < JB; t++) S[t] = _mm512_setzero_si512();
        /* decode: the halves as a loop, not unrolled, so that its block body takes half the
         * code (unrolled, its speed on Zen 4 depended on where the linker placed it, as for a
         * loop too large for the op cache: commit message). The bound is hidden from the
         * compiler, which otherwise peels the two iterations; batch tiles keep them unrolled. */
        int n_half = 2;
        if (JB == 1) __asm__("" : "+r"(n_half));
        for (int h = 0; h < n_half; h++)
#pragma GCC unroll 4
            for (int k = 0; k < 4; k += side ? 2 : 1)
#pragma GCC unroll 2
                for (int ph = 0; ph < 2; ph++) {
                    __m512i s0[KQZ_JB], s1[4];
#pragma GCC unroll 8
                    for (int t = 0; t < JB; t++) s0[t] = _mm512_setzero_si512();
#pragma GCC unroll 4
                    for (int t = 0; t < 4; t++) s1[t] = _mm512_setzero_si512(); /* used when side */
#pragma GCC unroll 4
                    for (int pp = 0; pp < 4; pp++) {
                        const int p = 4 * ph + pp;
                        const __m512i v0 = q6z_levels(gf, bA, bB, h, k, p);
#pragma GCC unroll 8
                        for (int t = 0; t < JB; t++)
                            s0[t] = dpbusd_b16(s0[t], v0, (const uint8_t *)a[t]->qs + 128 * h + 32 * k + 4 * p);
                        if (side) {
                            const __m512i v1 = q6z_levels(gf, bA, bB, h, k + 1, p);
#pragma GCC unroll 4
                            for (int t = 0; t < JB; t++)
                                s1[t] = dpbusd_b16(s1[t], v1, (const uint8_t *)a[t]->qs + 128 * h + 32 * (k + 1) + 4 * p);
                        }
                    }
                    const int j0 = 8 * h + 2 * k + ph, j1 = j0 + 2;
                    const size_t so0 = MOETAX_K_Q6KR8_SC_OFF + 32 * (j0 >> 2), so1 = MOETAX_K_Q6KR8_SC_OFF + 32 * (j1 >> 2);
                    const __m512i sc0 = sbyte_lane_z(kq_load_2x32(bA + so0, bB + so0), j0 & 3);
#pragma GCC unroll 8
                    for (int t = 0; t < JB; t++) S[t] = _mm512_add_epi32(S[t], _mm512_mullo_epi32(s0[t], sc0));
                    if (side) {
                        const __m512i sc1 = sbyte_lane_z(kq_load_2x32(bA + so1, bB + so1), j1 & 3);
#pragma GCC unroll 4
                        for (int t = 0; t < JB; t++) S[t] = _mm512_add_epi32(S[t], _mm512_mullo_epi32(s1[t], sc1));
                    }
                }
        /* int16 scales: evens and odds of each dword (scale pairs (4k, 4k + 2), (4k + 1, 4k + 3)) */
        __m512i ev[4], od[4];
#pragma GCC unroll 4
        for (int k = 0; k < 4; k++) {
            const __m512i sk = kq_load_2x32(bA + MOETAX_K_Q6KR8_SC_OFF + 32 * k, bB + MOETAX_K_Q6KR8_SC_OFF + 32 * k);
            ev[k] = _mm512_srai_epi16(_mm512_slli_epi16(sk, 8), 8);
            od[k] = _mm512_srai_epi16(sk, 8);
        }
        const __m512 dw = kq_cvtph_2x8(bA, bB);
#pragma GCC unroll 8
        for (int t = 0; t < JB; t++) {
            /* bsums as int16 pairs: dword 2k (bs[4k], bs[4k+2]), dword 2k+1 (bs[4k+1], bs[4k+3]) */
            const __m256i bsp = _mm256_shuffle_epi8(_mm256_loadu_si256((const __m256i *)a[t]->bsums),
                                                    _mm256_broadcastsi128_si256(pairs));
            int32_t qb[8]; /* broadcast from memory by the vpdpwssd */
            _mm256_storeu_si256((__m256i *)qb, bsp);
            __m512i off = _mm512_setzero_si512();
#pragma GCC unroll 4
            for (int k = 0; k < 4; k++) {
                off = dpwssd_b16(off, ev[k], qb + 2 * k);
                off = dpwssd_b16(off, od[k], qb + 2 * k + 1);
            }
            const __m512i sumi = _mm512_sub_epi32(S[t], _mm512_slli_epi32(off, 5));
            const __m512 ad = _mm512_set1_ps(a[t]->d);
            acc[t] = _mm512_add_ps(acc[t], _mm512_mul_ps(_mm512_mul_ps(ad, dw), _mm512_cvtepi32_ps(sumi)));
        }
    }
#pragma GCC unroll 8
    for (int t = 0; t < JB; t++) store_2x8z(y0 + t * ldy, y1 + t * ldy, acc[t]);
}

typedef void (*kqz_fn)(const uint8_t *g0, const uint8_t *g1, const uint8_t *xq, size_t act_row, int64_t nb, float *y0,
                       float *y1, int64_t ldy, const uint8_t *pfe);
#define KQZ_TILE(JB)                                                                                             \
    static void q4kz_tile_##JB(const uint8_t *g0, const uint8_t *g1, const uint8_t *xq, size_t act_row, int64_t nb, \
                               float *y0, float *y1, int64_t ldy, const uint8_t *pfe) {                         \
        q45z_tile(false, false, JB, g0, g1, xq, act_row, nb, y0, y1, ldy, pfe);                                      \
    }                                                                                                           \
    static void q5kz_tile_##JB(const uint8_t *g0, const uint8_t *g1, const uint8_t *xq, size_t act_row, int64_t nb, \
                               float *y0, float *y1, int64_t ldy, const uint8_t *pfe) {                         \
        q45z_tile(true, false, JB, g0, g1, xq, act_row, nb, y0, y1, ldy, pfe);                                       \
    }                                                                                                           \
    static void q5kzg_tile_##JB(const uint8_t *g0, const uint8_t *g1, const uint8_t *xq, size_t act_row, int64_t nb, \
                                float *y0, float *y1, int64_t ldy, const uint8_t *pfe) {                        \
        q45z_tile(true, true, JB, g0, g1, xq, act_row, nb, y0, y1, ldy, pfe);                                        \
    }                                                                                                           \
    static void q6kz_tile_##JB(const uint8_t *g0, const uint8_t *g1, const uint8_t *xq, size_t act_row, int64_t nb, \
                               float *y0, float *y1, int64_t ldy, const uint8_t *pfe) {                         \
        q6z_tile(JB, false, g0, g1, xq, act_row, nb, y0, y1, ldy, pfe);                                              \
    }                                                                                                           \
    static void q6kzg_tile_##JB(const uint8_t *g0, const uint8_t *g1, const uint8_t *xq, size_t act_row, int64_t nb, \
                                float *y0, float *y1, int64_t ldy, const uint8_t *pfe) {                        \
        q6z_tile(JB, true, g0, g1, xq, act_row, nb, y0, y1, ldy, pfe);                                               \
    }
KQZ_TILE(1) KQZ_TILE(2) KQZ_TILE(3) KQZ_TILE(4) KQZ_TILE(5) KQZ_TILE(6) KQZ_TILE(7) KQZ_TILE(8)
static const kqz_fn k_kqz[3][KQZ_JB] = {
    {q4kz_tile_1, q4kz_tile_2, q4kz_tile_3, q4kz_tile_4, q4kz_tile_5, q4kz_tile_6, q4kz_tile_7, q4kz_tile_8},
    {q5kz_tile_1, q5kz_tile_2, q5kz_tile_3, q5kz_tile_4, q5kz_tile_5, q5kz_tile_6, q5kz_tile_7, q5kz_tile_8},
    {q6kz_tile_1, q6kz_tile_2, q6kz_tile_3, q6kz_tile_4, q6kz_tile_5, q6kz_tile_6, q6kz_tile_7, q6kz_tile_8}};
/* with GFNI (Q4_K has no high bits to move: its tiles as above) */
static const kqz_fn k_kqz_gfni[3][KQZ_JB] = {
    {q4kz_tile_1, q4kz_tile_2, q4kz_tile_3, q4kz_tile_4, q4kz_tile_5, q4kz_tile_6, q4kz_tile_7, q4kz_tile_8},
    {q5kzg_tile_1, q5kzg_tile_2, q5kzg_tile_3, q5kzg_tile_4, q5kzg_tile_5, q5kzg_tile_6, q5kzg_tile_7, q5kzg_tile_8},
    {q6kzg_tile_1, q6kzg_tile_2, q6kzg_tile_3, q6kzg_tile_4, q6kzg_tile_5, q6kzg_tile_6, q6kzg_tile_7, q6kzg_tile_8}};

/* Q2_Kx8r / Q3_Kx8r, two groups in 512-bit vectors (the steps above on 16 lanes): the levels of
 * level vector k of 4-byte group p of half h of both groups (bA: lanes 0-7, bB: 8-15). */
KQ5_INLINE __m512i q23z_level(const bool three, const bool gf, const uint8_t *bA, const uint8_t *bB, int h, int p,
                              int k) {
    const size_t qo = (three ? MOETAX_K_Q3KR8_QS_OFF : MOETAX_K_Q2KR8_QS_OFF) + 32 * (8 * h + p);
    const __m512i v = kq_load_2x32(bA + qo, bB + qo);
    if (!three) return _mm512_and_si512(v, _mm512_set1_epi8((char)(3 << 2 * k)));
    const size_t ho = MOETAX_K_Q3KR8_HM_OFF + 32 * p;
    const __m512i hq = kq_load_2x32(bA + ho, bB + ho);
    const int t = k == 3 ? 6 : 2 * k + 2, sb = 4 * h + k, d = t - sb; /* hmask bit sb to bit t */
    const __m512i lo = k == 3 ? _mm512_srli_epi16(v, 2) : v;
    const __m512i ml = _mm512_set1_epi8((char)(k == 3 ? 0x30 : 3 << 2 * k));
    if (gf) return _mm512_ternarylogic_epi32(lo, ml, gf_bits(hq, GF_MOVE(sb, t)), 0xEA); /* moved there alone */
    const __m512i hs = d > 0 ? _mm512_slli_epi16(hq, d) : d < 0 ? _mm512_srli_epi16(hq, -d) : hq;
    return _mm512_ternarylogic_epi32(lo, ml, _mm512_and_si512(hs, _mm512_set1_epi8((char)(1 << t))), 0xEA);
}

/* One super-block of two groups (bA, bB) x JB batch rows (a[t]): acc[t] += its terms. With JB <= 2
 * a group's four level vectors serve 4 JB chains at once; with more, one sub-block at a time (JB
 * chains; the levels' loads repeat, from L1). */
KQ5_INLINE void q23z_blk(const bool three, const bool gf, const int JB, const uint8_t *bA, const uint8_t *bB,
                         const moetax_block_q8_k *const *a, __m512 *acc) {
    __m512i U[4];
    if (three) {
        const __m512i m4 = _mm512_set1_epi8(0x0f), m30 = _mm512_set1_epi8(0x30), c32 = _mm512_set1_epi8(32);
        const __m512i a0 = kq_load_2x32(bA + MOETAX_K_Q3KR8_SC_OFF, bB + MOETAX_K_Q3KR8_SC_OFF);
        const __m512i a1 = kq_load_2x32(bA + MOETAX_K_Q3KR8_SC_OFF + 32, bB + MOETAX_K_Q3KR8_SC_OFF + 32);
        const __m512i a2 = kq_load_2x32(bA + MOETAX_K_Q3KR8_SC_OFF + 64, bB + MOETAX_K_Q3KR8_SC_OFF + 64);
        U[0] = _mm512_ternarylogic_epi32(a0, m4, _mm512_and_si512(_mm512_slli_epi32(a2, 4), m30), 0xEA);
        U[1] = _mm512_ternarylogic_epi32(a1, m4, _mm512_and_si512(_mm512_slli_epi32(a2, 2), m30), 0xEA);
        U[2] = _mm512_ternarylogic_epi32(_mm512_srli_epi32(a0, 4), m4, _mm512_and_si512(a2, m30), 0xEA);
        U[3] = _mm512_ternarylogic_epi32(_mm512_srli_epi32(a1, 4), m4,
                                         _mm512_and_si512(_mm512_srli_epi32(a2, 2), m30), 0xEA);
#pragma GCC unroll 4
        for (int k = 0; k < 4; k++) U[k] = _mm512_sub_epi8(U[k], c32);
    } else {
#pragma GCC unroll 4
        for (int k = 0; k < 4; k++)
            U[k] = kq_load_2x32(bA + MOETAX_K_Q2KR8_SC_OFF + 32 * k, bB + MOETAX_K_Q2KR8_SC_OFF + 32 * k);
    }
    const bool side = JB <= 2;
    __m512i S[KQZ_JB];
#pragma GCC unroll 8
    for (int t = 0; t < JB; t++) S[t] = _mm512_setzero_si512();
#pragma GCC unroll 2
    for (int h = 0; h < 2; h++)
#pragma GCC unroll 2
        for (int s = 0; s < 2; s++)
#pragma GCC unroll 4
            for (int k0 = 0; k0 < 4; k0 += side ? 4 : 1) {
                const int nk = side ? 4 : 1;
                __m512i cs[KQZ_JB][4];
#pragma GCC unroll 8
                for (int t = 0; t < JB; t++)
                    for (int k = 0; k < nk; k++) cs[t][k] = _mm512_setzero_si512();
#pragma GCC unroll 4
                for (int pp = 0; pp < 4; pp++) {
                    const int p = 4 * s + pp;
#pragma GCC unroll 4
                    for (int k = 0; k < nk; k++) {
                        const __m512i L = q23z_level(three, gf, bA, bB, h, p, k0 + k);
#pragma GCC unroll 8
                        for (int t = 0; t < JB; t++) {
                            const uint8_t *x = (const uint8_t *)a[t]->qs + 128 * h + 32 * (k0 + k) + 4 * p;
                            cs[t][k] = dpbusd_b16(cs[t][k], L, x);
                        }
                    }
                }
#pragma GCC unroll 4
                for (int k = 0; k < nk; k++) {
                    const int kk = k0 + k, j = 8 * h + 2 * kk + s, b = j & 3;
                    /* the chain's sum without its factor 4^k (an exact shift: a multiple of it), in the
                     * lane's low int16 (|.| <= 16 * 7 * 128), times the scale in the low int16 of scj (its
                     * high int16 zero): one vpdpwssd instead of vpmulld and an add */
                    const int cshift = three ? (kk == 0 ? 0 : kk == 1 ? 2 : 4) : 2 * kk;
                    __m512i scj;
                    if (three) { /* signed byte b to byte 1 of each lane, zeros around it: 256 * sc_j */
                        const __m512i ix = _mm512_set4_epi32((int)(0x80800080u | (12u + b) << 8), (int)(0x80800080u | (8u + b) << 8),
                                                             (int)(0x80800080u | (4u + b) << 8), (int)(0x80800080u | (unsigned)b << 8));
                        scj = _mm512_shuffle_epi8(U[j >> 2], ix);
                    } else { /* the nibble to bits 6-9: 64 * sc_j */
                        const __m512i f = 8 * b >= 6 ? _mm512_srli_epi32(U[j >> 2], 8 * b - 6)
                                                     : _mm512_slli_epi32(U[j >> 2], 6 - 8 * b);
                        scj = _mm512_and_si512(f, _mm512_set1_epi32(0xf << 6));
                    }
#pragma GCC unroll 8
                    for (int t = 0; t < JB; t++)
                        S[t] = _mm512_dpwssd_epi32(S[t], cshift ? _mm512_srai_epi32(cs[t][k], cshift) : cs[t][k], scj);
                }
            }
    __m512i ev[4], od[4];
#pragma GCC unroll 4
    for (int k = 0; k < 4; k++) {
        if (three) {
            ev[k] = _mm512_srai_epi16(_mm512_slli_epi16(U[k], 8), 8);
            od[k] = _mm512_srai_epi16(U[k], 8);
        } else {
            ev[k] = _mm512_and_si512(_mm512_srli_epi32(U[k], 4), _mm512_set1_epi32(0x000f000f));
            od[k] = _mm512_and_si512(_mm512_srli_epi32(U[k], 12), _mm512_set1_epi32(0x000f000f));
        }
    }
    const __m128i pairs = _mm_setr_epi8(0, 1, 4, 5, 2, 3, 6, 7, 8, 9, 12, 13, 10, 11, 14, 15);
    const __m512 dw = kq_cvtph_2x8(bA, bB);
    const __m512 dm = three ? _mm512_setzero_ps()
                            : kq_cvtph_2x8(bA + MOETAX_K_Q2KR8_DMIN_OFF, bB + MOETAX_K_Q2KR8_DMIN_OFF);
#pragma GCC unroll 8
    for (int t = 0; t < JB; t++) {
        const __m256i bsp = _mm256_shuffle_epi8(_mm256_loadu_si256((const __m256i *)a[t]->bsums),
                                                _mm256_broadcastsi128_si256(pairs));
        int32_t qb[8]; /* broadcast from memory by the vpdpwssd */
        _mm256_storeu_si256((__m256i *)qb, bsp);
        __m512i c = _mm512_setzero_si512();
#pragma GCC unroll 4
        for (int k = 0; k < 4; k++) {
            c = dpwssd_b16(c, ev[k], qb + 2 * k);
            c = dpwssd_b16(c, od[k], qb + 2 * k + 1);
        }
        const __m512i sumi = three ? _mm512_sub_epi32(_mm512_srai_epi32(S[t], 8), _mm512_slli_epi32(c, 2))
                                   : _mm512_srai_epi32(S[t], 6);
        const __m512 ad = _mm512_set1_ps(a[t]->d);
        acc[t] = _mm512_add_ps(acc[t], _mm512_mul_ps(_mm512_mul_ps(ad, dw), _mm512_cvtepi32_ps(sumi)));
        if (!three) acc[t] = _mm512_sub_ps(acc[t], _mm512_mul_ps(_mm512_mul_ps(ad, dm), _mm512_cvtepi32_ps(c)));
    }
}

/* Two groups (g0, g1) x JB batch rows; JB == 1 (decode) prefetches into L2 below pfe and into L1,
 * as the 256-bit decode does, batches into L2 (kqz_prefetch_batch). */
KQ5_INLINE void q23z_tile(const bool three, const bool gf, const int JB, const uint8_t *g0, const uint8_t *g1,
                          const uint8_t *xq, size_t act_row, int64_t nb, float *y0, float *y1, int64_t ldy,
                          const uint8_t *pfe) {
    const size_t bbytes = three ? MOETAX_K_Q3KR8_BLOCK_BYTES : MOETAX_K_Q2KR8_BLOCK_BYTES;
    __m512 acc[KQZ_JB];
#pragma GCC unroll 8
    for (int t = 0; t < JB; t++) acc[t] = _mm512_setzero_ps();
    for (int64_t i = 0; i < nb; i++) {
        const uint8_t *bA = g0 + (size_t)i * bbytes, *bB = g1 + (size_t)i * bbytes;
        if (JB == 1) {
            kq8r_prefetch_dec(bA, KQ_PFD, KQ_NEAR, bbytes, pfe);
            kq8r_prefetch_dec(bB, KQ_PFD, KQ_NEAR, bbytes, pfe);
        } else
            kqz_prefetch_batch(g0, g1, (size_t)nb * bbytes, i, bbytes, pfe);
        const moetax_block_q8_k *a[KQZ_JB];
#pragma GCC unroll 8
        for (int t = 0; t < JB; t++) a[t] = (const moetax_block_q8_k *)(xq + (size_t)t * act_row) + i;
        q23z_blk(three, gf, JB, bA, bB, a, acc);
    }
#pragma GCC unroll 8
    for (int t = 0; t < JB; t++) store_2x8z(y0 + t * ldy, y1 + t * ldy, acc[t]);
}

typedef void (*kq23z_fn)(const uint8_t *g0, const uint8_t *g1, const uint8_t *xq, size_t act_row, int64_t nb,
                         float *y0, float *y1, int64_t ldy, const uint8_t *pfe);
#define KQ23Z_TILE(JB)                                                                                           \
    static void q2kz_tile_##JB(const uint8_t *g0, const uint8_t *g1, const uint8_t *xq, size_t act_row, int64_t nb, \
                               float *y0, float *y1, int64_t ldy, const uint8_t *pfe) {                         \
        q23z_tile(false, false, JB, g0, g1, xq, act_row, nb, y0, y1, ldy, pfe);                                 \
    }                                                                                                           \
    static void q3kz_tile_##JB(const uint8_t *g0, const uint8_t *g1, const uint8_t *xq, size_t act_row, int64_t nb, \
                               float *y0, float *y1, int64_t ldy, const uint8_t *pfe) {                         \
        q23z_tile(true, false, JB, g0, g1, xq, act_row, nb, y0, y1, ldy, pfe);                                  \
    }                                                                                                           \
    static void q3kzg_tile_##JB(const uint8_t *g0, const uint8_t *g1, const uint8_t *xq, size_t act_row, int64_t nb, \
                                float *y0, float *y1, int64_t ldy, const uint8_t *pfe) {                        \
        q23z_tile(true, true, JB, g0, g1, xq, act_row, nb, y0, y1, ldy, pfe);                                   \
    }
KQ23Z_TILE(1) KQ23Z_TILE(2) KQ23Z_TILE(3) KQ23Z_TILE(4) KQ23Z_TILE(5) KQ23Z_TILE(6) KQ23Z_TILE(7) KQ23Z_TILE(8)
static const kq23z_fn k_kq23z[2][KQZ_JB] = {
    {q2kz_tile_1, q2kz_tile_2, q2kz_tile_3, q2kz_tile_4, q2kz_tile_5, q2kz_tile_6, q2kz_tile_7, q2kz_tile_8},
    {q3kz_tile_1, q3kz_tile_2, q3kz_tile_3, q3kz_tile_4, q3kz_tile_5, q3kz_tile_6, q3kz_tile_7, q3kz_tile_8}};
/* with GFNI (Q2_K has no high bits to move: its tiles as above) */
static const kq23z_fn k_kq23z_gfni[2][KQZ_JB] = {
    {q2kz_tile_1, q2kz_tile_2, q2kz_tile_3, q2kz_tile_4, q2kz_tile_5, q2kz_tile_6, q2kz_tile_7, q2kz_tile_8},
    {q3kzg_tile_1, q3kzg_tile_2, q3kzg_tile_3, q3kzg_tile_4, q3kzg_tile_5, q3kzg_tile_6, q3kzg_tile_7, q3kzg_tile_8}};

/* ---- Q3_K / Q2_K as stored (a unit's plain tail), decode: 4 rows side by side ----
 * Bit-identical to matmul_kq_avx2.c's decode (and so its batch path): the same float steps on 4
 * lanes in the same order; the exact int32 sums formed as for Q6_K above: per 64 values one
 * 512-bit vector of unsigned levels (Q3_K: q + 4 in 0..7, Q2_K: 0..3; decode: lower 256 bits
 * values 32m..32m+31, upper 128+32m.., so one 64-byte load of qs serves all four; batches:
 * 64p..64p+31 and 64p+32..), vpdpbusd against the activations (each int32 lane 4 values of one
 * 16-value sub-block), two such vectors packed to int16 exactly (vpackssdw) and vpdpwssd with
 * the sub-blocks' int16 scales. The offsets: Q3_K subtracts 4 * sum_j sc_j bsums[j]; Q2_K's
 * mins m_j * bsums[j] go to dmin's term. */
/* The 16 Q3_K scales minus 32 (byte j: scale j) from the packed scales[12] at p (ggml's 32-bit
 * mask steps, on the 4 dwords at once). The 16 bytes loaded end with the block's d: they start 2
 * bytes before p, in the block's qs, so no byte past the block is read. */
KQ5_INLINE __m128i q3k_scales_512(const uint8_t *p) {
    const __m128i v = _mm_srli_si128(_mm_loadu_si128((const __m128i *)(p - 2)), 2); /* a0, a1, tmp, d */
    const __m128i lo = _mm_and_si128(_mm_srlv_epi32(_mm_shuffle_epi32(v, 0x44), _mm_setr_epi32(0, 0, 4, 4)),
                                     _mm_set1_epi8(0x0f));
    const __m128i hi = _mm_and_si128(_mm_srlv_epi32(_mm_shuffle_epi32(v, 0xaa), _mm_setr_epi32(0, 2, 4, 6)),
                                     _mm_set1_epi8(0x03));
    return _mm_sub_epi8(_mm_or_si128(lo, _mm_slli_epi32(hi, 4)), _mm_set1_epi8(32));
}
_Static_assert(offsetof(moetax_block_q3_k, scales) >= 2 && offsetof(moetax_block_q3_k, scales) + 14 <= sizeof(moetax_block_q3_k),
               "q3k_scales_512 reads scales - 2 .. scales + 13 within the block");

/* vpermw indices of the int16 scales for vpdpwssd with vpackssdw(D_a, D_b) (decode below):
 * 128-bit lane l of D_m holds the 4-value sums of sub-block 2m + (l & 1) + 8 (l >> 1). */
KQ5_INLINE __m512i scale_idx23(int a, int b) {
    short e[32];
    for (int l = 0; l < 4; l++)
        for (int i = 0; i < 8; i++) e[8 * l + i] = (short)(2 * (i < 4 ? a : b) + (l & 1) + 8 * (l >> 1));
    return _mm512_loadu_si512((const void *)e);
}

/* 4 * (sum over a super-block of sc_j * level * x) in int32 x 8 (every lane a multiple of 4).
 * Q = the 64 qs bytes: its lower half (qs[0..31]) holds values 32m + l at bits 2m, the upper
 * half (qs[32..63]) values 128 + 32m + l, so the levels of A[m] = [x(32m..) | x(128 + 32m..)]
 * are (Q >> 2m) & 3; for odd m they are kept in place, as 4 * level (Q & 12, Q >> 4 & 12), and
 * the even m's scales are taken 4 times instead: one 16-bit shift per row and super-block.
 * Q3_K (hm: its 32 hmask bytes) adds 4 (4 * 4) where bit m (upper half: 4 + m) of hmask[l]
 * is set, by a byte test into a mask register and a masked add. */
KQ5_INLINE __m256i dot_q23_512(const uint8_t *qs, const uint8_t *hm, __m128i sc8, const __m512i A[4], __m512i ix02,
                               __m512i ix13) {
    const __m512i m3 = _mm512_set1_epi8(3), m12 = _mm512_set1_epi8(12);
    const __m256i sc16 = _mm256_cvtepi8_epi16(sc8);
    const __m512i Q = _mm512_loadu_si512((const void *)qs), Q4 = _mm512_srli_epi16(Q, 4);
    __m512i L[4] = {_mm512_and_si512(Q, m3), _mm512_and_si512(Q, m12), _mm512_and_si512(Q4, m3),
                    _mm512_and_si512(Q4, m12)};
    if (hm) {
        const __m512i H = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)hm));
#pragma GCC unroll 4
        for (int m = 0; m < 4; m++) {
            const __m512i bit = _mm512_inserti64x4(_mm512_set1_epi8((char)(1 << m)), _mm256_set1_epi8((char)(16 << m)), 1);
            L[m] = _mm512_mask_add_epi8(L[m], _mm512_test_epi8_mask(H, bit), L[m], _mm512_set1_epi8(m & 1 ? 16 : 4));
        }
    }
    __m512i D[4];
#pragma GCC unroll 4
    for (int m = 0; m < 4; m++) D[m] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), L[m], A[m]);
    /* |D| <= 4 * 28 * 128: the packs are exact */
    __m512i s = _mm512_dpwssd_epi32(_mm512_setzero_si512(), _mm512_packs_epi32(D[0], D[2]),
                                    _mm512_permutexvar_epi16(ix02, _mm512_castsi256_si512(_mm256_slli_epi16(sc16, 2))));
    s = _mm512_dpwssd_epi32(s, _mm512_packs_epi32(D[1], D[3]), _mm512_permutexvar_epi16(ix13, _mm512_castsi256_si512(sc16)));
    return _mm256_add_epi32(_mm512_castsi512_si256(s), _mm512_extracti64x4_epi64(s, 1));
}

static void kq23_decode_rows_512(enum moetax_type wtype, const uint8_t *w, size_t row_bytes, int64_t row0,
                                 int64_t row1, int64_t nb, const moetax_block_q8_k *x, float *y) {
    const bool three = wtype == MOETAX_TYPE_Q3_K;
    const size_t bsz = moetax_type_size(wtype);
    const size_t doff = three ? offsetof(moetax_block_q3_k, d) : offsetof(moetax_block_q2_k, d);
    const size_t qoff = three ? offsetof(moetax_block_q3_k, qs) : offsetof(moetax_block_q2_k, qs);
    const size_t mo = offsetof(moetax_block_q2_k, dmin);
    const __m512i ix02 = scale_idx23(0, 2), ix13 = scale_idx23(1, 3);
    const uint8_t *w0 = w + (size_t)row0 * row_bytes, *we = w + (size_t)row1 * row_bytes;
    kq_prefetch_span_l2(w0, we - w0 > 4 * (ptrdiff_t)row_bytes + KQ_ROWS_PFD ? w0 + 4 * row_bytes + KQ_ROWS_PFD : we);
    for (int64_t r = row0; r < row1; r += 4) {
        struct kq_rows4 g;
        kq_rows4_init(&g, w, row_bytes, r, row1);
        const uint8_t *const *wr = g.w;
        __m128 acc = _mm_setzero_ps();
        for (int64_t i = 0; i < nb; i++) {
            const moetax_block_q8_k *a = x + i;
            const size_t off = (size_t)i * bsz;
            kq_rows4_prefetch(&g, bsz);
            const __m128 ad = _mm_set1_ps(a->d);
            const __m128 dw = kq_rows4_f16(&g, off + doff);
            const __m256i bs = _mm256_loadu_si256((const __m256i *)a->bsums);
            __m512i A[4];
#pragma GCC unroll 4
            for (int m = 0; m < 4; m++)
                A[m] = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(a->qs + 32 * m))),
                                          _mm256_loadu_si256((const __m256i *)(a->qs + 128 + 32 * m)), 1);
            __m256i S[4], M[4];
#pragma GCC unroll 4
            for (int k = 0; k < 4; k++) {
                const uint8_t *bp = wr[k] + off;
                if (three) {
                    const __m128i sc8 = q3k_scales_512(bp + offsetof(moetax_block_q3_k, scales));
                    const __m256i corr = _mm256_madd_epi16(bs, _mm256_slli_epi16(_mm256_cvtepi8_epi16(sc8), 2));
                    S[k] = _mm256_sub_epi32(_mm256_srai_epi32(dot_q23_512(bp + qoff, bp, sc8, A, ix02, ix13), 2), corr);
                } else {
                    const __m128i raw = _mm_loadu_si128((const __m128i *)bp);
                    const __m128i sc8 = _mm_and_si128(raw, _mm_set1_epi8(0x0f));
                    M[k] = _mm256_madd_epi16(bs, _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(raw, 4), _mm_set1_epi8(0x0f))));
                    S[k] = _mm256_srai_epi32(dot_q23_512(bp + qoff, NULL, sc8, A, ix02, ix13), 2);
                }
            }
            const __m128i si = hsum4_i32(S[0], S[1], S[2], S[3]);
            acc = _mm_add_ps(acc, _mm_mul_ps(_mm_mul_ps(ad, dw), _mm_cvtepi32_ps(si)));
            if (!three) {
                const __m128i mi = hsum4_i32(M[0], M[1], M[2], M[3]);
                const __m128 dm = kq_rows4_f16(&g, off + mo);
                acc = _mm_sub_ps(acc, _mm_mul_ps(_mm_mul_ps(ad, dm), _mm_cvtepi32_ps(mi)));
            }
        }
        kq_rows4_store(&g, acc, y + r);
    }
}

/* Q3_K / Q2_K batches (as stored: a unit's plain tail): one row's super-block decoded once (levels, permuted scales,
 * offset coefficients) for up to KQ23_BT batch rows, each output's float chain that of
 * matmul_kq_avx2.c's batch path (acc += (d_x * d_w) * (float)sumi; Q2_K: acc -= (d_x * dmin_w) *
 * (float)summ), super-blocks in order: the same bits as avx2's and as the decode above. */
#define KQ23_BT 8 /* batch rows per decoded super-block: two groups of 4 float lanes */
struct q23_blk {
    __m512i L[4];    /* levels of values 64p..64p+63 */
    __m512i p0, p1;  /* int16 scales in the order of vpackssdw(D0, D1) and (D2, D3) */
    __m256i c16;     /* coefficients of bsums: Q3_K 4 sc_j, Q2_K m_j */
    float d, dmin;
};

KQ5_INLINE void decode_q23_512(const uint8_t *bp, bool three, __m512i ix0, __m512i ix1, struct q23_blk *k) {
    const __m512i m3 = _mm512_set1_epi8(3), one = _mm512_set1_epi8(1);
    const uint8_t *qs = bp + (three ? offsetof(moetax_block_q3_k, qs) : offsetof(moetax_block_q2_k, qs));
    __m128i sc8;
    if (three) {
        sc8 = q3k_scales_512(bp + offsetof(moetax_block_q3_k, scales));
        k->c16 = _mm256_slli_epi16(_mm256_cvtepi8_epi16(sc8), 2);
        k->d = moetax_k_fp16_table[ld16(bp + offsetof(moetax_block_q3_k, d))];
        k->dmin = 0.0f;
    } else {
        const __m128i raw = _mm_loadu_si128((const __m128i *)bp);
        sc8 = _mm_and_si128(raw, _mm_set1_epi8(0x0f));
        k->c16 = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(raw, 4), _mm_set1_epi8(0x0f)));
        k->d = moetax_k_fp16_table[ld16(bp + offsetof(moetax_block_q2_k, d))];
        k->dmin = moetax_k_fp16_table[ld16(bp + offsetof(moetax_block_q2_k, dmin))];
    }
    const __m512i sc16 = _mm512_castsi256_si512(_mm256_cvtepi8_epi16(sc8));
    k->p0 = _mm512_permutexvar_epi16(ix0, sc16);
    k->p1 = _mm512_permutexvar_epi16(ix1, sc16);
    const __m512i H = three ? _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)bp)) : _mm512_setzero_si512();
    for (int p = 0; p < 4; p++) {
        const __m512i R = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(qs + 32 * (p / 2))));
        const int k0 = 2 * (p % 2), j0 = 2 * p;
        const __m512i cq = _mm512_inserti64x4(_mm512_set1_epi16((short)(2 * k0)), _mm256_set1_epi16((short)(2 * k0 + 2)), 1);
        __m512i L = _mm512_and_si512(_mm512_srlv_epi16(R, cq), m3);
        if (three) {
            const __m512i ch = _mm512_inserti64x4(_mm512_set1_epi16((short)j0), _mm256_set1_epi16((short)(j0 + 1)), 1);
            L = _mm512_or_si512(L, _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi16(H, ch), one), 2));
        }
        k->L[p] = L;
    }
}

static void kq23_batch_512(enum moetax_type wtype, const uint8_t *w, size_t row_bytes, int64_t row0, int64_t row1,
                           int64_t nb, const uint8_t *xq, size_t act_row, int64_t n_batch, float *y, int64_t ldy) {
    const bool three = wtype == MOETAX_TYPE_Q3_K;
    const size_t bsz = moetax_type_size(wtype);
    const __m512i ix0 = scale_idx6(0), ix1 = scale_idx6(8);
    for (int64_t r = row0; r < row1; r++) {
        const uint8_t *wr = w + (size_t)r * row_bytes;
        for (int64_t b0 = 0; b0 < n_batch; b0 += KQ23_BT) {
            const int nbt = n_batch - b0 < KQ23_BT ? (int)(n_batch - b0) : KQ23_BT;
            __m128 acc[2] = {_mm_setzero_ps(), _mm_setzero_ps()}; /* lane t % 4 of acc[t / 4]: batch row b0 + t */
            for (int64_t i = 0; i < nb; i++) {
                const uint8_t *bp = wr + (size_t)i * bsz;
                _mm_prefetch((const char *)bp + 4 * bsz, _MM_HINT_T0);
                struct q23_blk k;
                decode_q23_512(bp, three, ix0, ix1, &k);
                __m256i S[KQ23_BT], M[KQ23_BT];
                float ad[KQ23_BT];
                for (int t = 0; t < KQ23_BT; t++) {
                    if (t >= nbt) {
                        S[t] = M[t] = _mm256_setzero_si256();
                        ad[t] = 0.0f;
                        continue;
                    }
                    const moetax_block_q8_k *a = (const moetax_block_q8_k *)(xq + (size_t)(b0 + t) * act_row) + i;
                    ad[t] = a->d;
                    __m512i D[4];
                    for (int p = 0; p < 4; p++)
                        D[p] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), k.L[p],
                                                   _mm512_loadu_si512((const void *)(a->qs + 64 * p)));
                    __m512i sv = _mm512_dpwssd_epi32(_mm512_setzero_si512(), _mm512_packs_epi32(D[0], D[1]), k.p0);
                    sv = _mm512_dpwssd_epi32(sv, _mm512_packs_epi32(D[2], D[3]), k.p1);
                    const __m256i corr = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)a->bsums), k.c16);
                    const __m256i s256 = _mm256_add_epi32(_mm512_castsi512_si256(sv), _mm512_extracti64x4_epi64(sv, 1));
                    S[t] = three ? _mm256_sub_epi32(s256, corr) : s256;
                    M[t] = corr;
                }
                /* per lane the scalar steps of avx2's batch path: acc += (d_x * d_w) * (float)sumi, ... */
                for (int g = 0; g < (nbt + 3) / 4; g++) {
                    const __m128 adv = _mm_loadu_ps(ad + 4 * g);
                    const __m128i si = hsum4_i32(S[4 * g], S[4 * g + 1], S[4 * g + 2], S[4 * g + 3]);
                    acc[g] = _mm_add_ps(acc[g], _mm_mul_ps(_mm_mul_ps(adv, _mm_set1_ps(k.d)), _mm_cvtepi32_ps(si)));
                    if (!three) {
                        const __m128i mi = hsum4_i32(M[4 * g], M[4 * g + 1], M[4 * g + 2], M[4 * g + 3]);
                        acc[g] = _mm_sub_ps(acc[g], _mm_mul_ps(_mm_mul_ps(adv, _mm_set1_ps(k.dmin)), _mm_cvtepi32_ps(mi)));
                    }
                }
            }
            float o[KQ23_BT];
            _mm_storeu_ps(o, acc[0]);
            _mm_storeu_ps(o + 4, acc[1]);
            for (int t = 0; t < nbt; t++) y[(b0 + t) * ldy + r] = o[t];
        }
    }
}

/* Any k-quant in its x8r layout: groups of 8 rows x tiles of batch rows; the unit's plain tail as
 * stored (decode: the 4-row paths above; batches: Q2_K/Q3_K the VNNI path above, the others avx2's). */
static void matmul_kq_x8(enum moetax_type wtype, const uint8_t *w, size_t row_bytes, int64_t row0, int64_t row1,
                         int64_t ncols, const uint8_t *xq, int64_t n_batch, float *y, int64_t ldy, bool far) {
    enum { R = MOETAX_K_Q4KR8_ROWS };
    _Static_assert(MOETAX_K_Q4KR8_ROWS == MOETAX_K_Q6KR8_ROWS && MOETAX_K_Q2KR8_ROWS == R && MOETAX_K_Q3KR8_ROWS == R,
                   "one row group (Q5_Kx8r: Q4_Kx8r's)");
    const bool six = wtype == MOETAX_TYPE_Q6_K, q23 = wtype == MOETAX_TYPE_Q2_K || wtype == MOETAX_TYPE_Q3_K;
    const int64_t nb = ncols / MOETAX_QK_K, gend = row1 - (row1 - row0) % R;
    const size_t act_row = moetax_k_act_row_bytes(wtype, ncols);
    const int ti = six ? 2 : wtype == MOETAX_TYPE_Q5_K ? 1 : 0;
    /* Q3_K's, Q5_K's and Q6_K's tiles with GFNI where the CPU has it (the same bits) */
    const kq23z_fn *t23 = (moetax_k_avx512_gfni ? k_kq23z_gfni : k_kq23z)[wtype == MOETAX_TYPE_Q3_K];
    const kqz_fn *tz = (moetax_k_avx512_gfni ? k_kqz_gfni : k_kqz)[ti];
    /* the decode's L2 prefetches end here: cached weights (!far) take none, only the L1's */
    const uint8_t *pfe = w + (size_t)(far ? row1 : row0) * row_bytes;
    const size_t pfd = six ? KQ6_PFD : KQ_PFD; /* decode's prefetch distance */
    const uint8_t *w0 = w + (size_t)row0 * row_bytes; /* also: no L2 prefetch (kq8r_prefetch_dec's bound) */
    if (n_batch == 1) /* decode's first pfd bytes at once (kq_rows.h) */
        kq_prefetch_span_l2(w0, pfe - w0 > (ptrdiff_t)pfd ? w0 + pfd : pfe);
    else if (far && row0 + 2 * R <= gend) { /* a batch: the first pair's two streams' first KQ_BPFD bytes */
        const uint8_t *w1 = w0 + (size_t)R * row_bytes;
        kq_prefetch_span_l2(w0, w0 + KQ_BPFD < w1 ? w0 + KQ_BPFD : w1);
        kq_prefetch_span_l2(w1, pfe - w1 > (ptrdiff_t)KQ_BPFD ? w1 + KQ_BPFD : pfe);
    }
    int64_t r = row0;
    if (q23 && n_batch > 1) /* pairs of adjacent groups in 512-bit vectors, tiles of up to KQZ_JB batch rows */
        for (; r + 2 * R <= gend; r += 2 * R)
            for (int64_t j0 = 0, jb; j0 < n_batch; j0 += jb) {
                const int64_t left = n_batch - j0, tiles_n = (left + KQZ_JB - 1) / KQZ_JB;
                jb = (left + tiles_n - 1) / tiles_n; /* tiles of even size */
                const uint8_t *g = w + (size_t)r * row_bytes, *xj = xq + (size_t)j0 * act_row;
                t23[jb - 1](g, g + (size_t)R * row_bytes, xj, act_row, nb, y + j0 * ldy + r, y + j0 * ldy + r + R,
                            ldy, j0 ? w0 : pfe); /* the pair's later tiles find it in L2 */
            }
    if (n_batch > 1 && !q23) /* pairs of adjacent groups in 512-bit vectors, tiles of up to KQZ_JB batch rows */
        for (; r + 2 * R <= gend; r += 2 * R)
            for (int64_t j0 = 0, jb; j0 < n_batch; j0 += jb) {
                const int64_t left = n_batch - j0, tiles_n = (left + KQZ_JB - 1) / KQZ_JB;
                jb = (left + tiles_n - 1) / tiles_n; /* tiles of even size */
                const uint8_t *g = w + (size_t)r * row_bytes, *xj = xq + (size_t)j0 * act_row;
                tz[jb - 1](g, g + (size_t)R * row_bytes, xj, act_row, nb, y + j0 * ldy + r, y + j0 * ldy + r + R,
                           ldy, j0 ? w0 : pfe); /* the pair's later tiles find it in L2 */
            }
    if (n_batch == 1) { /* decode: group i of the range's first half beside group i of its second */
        const int64_t np = (gend - r) / R / 2;
        const size_t half = (size_t)(np * R) * row_bytes;
        const uint8_t *wr = w + (size_t)r * row_bytes;
        if (far) kq_prefetch_span_l2(wr + half, wr + half + (half > pfd ? pfd : half));
        for (int64_t i = 0; i < np; i++) {
            const int64_t ra = r + i * R, rb = ra + np * R;
            const uint8_t *ga = w + (size_t)ra * row_bytes, *gb = w + (size_t)rb * row_bytes;
            if (q23) t23[0](ga, gb, xq, act_row, nb, y + ra, y + rb, 0, pfe);
            else tz[0](ga, gb, xq, act_row, nb, y + ra, y + rb, 0, pfe);
        }
        r += 2 * np * R;
    }
    if (r < gend) /* a range's odd last group: the avx2 table's tiles, which read the same layouts (same bits) */
        moetax_k_matmul_kq_avx2(wtype, w, row_bytes, r, gend, ncols, xq, n_batch, y, ldy, far);
    if (gend == row1) return;
    if (n_batch == 1 && q23) /* the unit's plain tail */
        kq23_decode_rows_512(wtype, w, row_bytes, gend, row1, nb, (const moetax_block_q8_k *)xq, y);
    else if (n_batch == 1)
        kq_decode_rows_512(wtype, w, row_bytes, gend, row1, nb, (const moetax_block_q8_k *)xq, y);
    else if (q23)
        kq23_batch_512(wtype, w, row_bytes, gend, row1, nb, xq, act_row, n_batch, y, ldy);
    else
        moetax_k_matmul_kq_avx2(wtype, w, row_bytes, gend, row1, ncols, xq, n_batch, y, ldy, far);
}

void moetax_k_matmul_kq_avx512(enum moetax_type wtype, const void *w, size_t row_bytes, int64_t row0, int64_t row1,
                               int64_t ncols, const void *xq, int64_t n_batch, float *y, int64_t ldy, bool far) {
    if (row1 <= row0 || n_batch <= 0 || ncols <= 0) return;
    if (moetax_k_act_is_k(wtype)) { /* *_Kx8r */
        assert(row0 % MOETAX_K_Q4KR8_ROWS == 0); /* ROW RANGES, kernels.h */
        matmul_kq_x8(wtype, (const uint8_t *)w, row_bytes, row0, row1, ncols, (const uint8_t *)xq, n_batch, y, ldy, far);
    }
}
