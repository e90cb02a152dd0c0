/* kernels.c - the kernel tables and their one-time selection from cpuid, the weight repacks
 * (their dword interleave with AVX2: only the AVX2 and AVX-512 tables read repacked weights),
 * plus the ISA-independent helpers (activation sizes, RoPE angles). */
#include "kernels_impl.h"

#include <math.h>
#include <pthread.h>
#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#include <immintrin.h>
#endif
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "moetax/types.h"

#ifndef M_PI
#define M_PI 3.14159265358979323846
#endif

float moetax_k_fp16_table[1 << 16];

static void tables_init_once(void) {
    for (uint32_t i = 0; i < (1u << 16); i++) moetax_k_fp16_table[i] = moetax_fp16_to_fp32((uint16_t)i);
}

static pthread_once_t g_tables_once = PTHREAD_ONCE_INIT;
void moetax_k_tables_init(void) { pthread_once(&g_tables_once, tables_init_once); }

/* ---- weight layouts ---- */

static bool g_has_avx2, g_has_avx512; /* set once by select_once (below), before any table is handed out */

/* The x8r layouts' common step: for each of the 8 rows r, the n consecutive dwords at p[r] + off
 * go to dword j of row r in the 8-row interleave at o (o + 32 j + 4 r), j = 0..n-1; flip: each
 * byte with its sign bit flipped (Q8_0x8r). Eight dwords of the 8 rows are an 8x8 transpose of
 * dwords: with AVX2 (every table that reads these layouts has it) 8 loads, 24 shuffles and 8
 * stores instead of 64 dword copies (the model's load and the expert store repack with it). */
static inline __attribute__((always_inline)) void x8r_dwords_scalar(uint8_t *o, const uint8_t *const *p, size_t off,
                                                                   int j0, int n, bool flip) {
    for (int r = 0; r < 8; r++)
        for (int j = j0; j < n; j++) {
            uint8_t *d = o + 32 * j + 4 * r;
            memcpy(d, p[r] + off + 4 * (size_t)j, 4);
            if (flip)
                for (int i = 0; i < 4; i++) d[i] ^= 0x80;
        }
}

#if defined(__x86_64__) || defined(__i386__)
#define X8R_AVX2 __attribute__((target("avx2"), always_inline)) static inline
X8R_AVX2 __m256i x8r_ld(const uint8_t *const *p, int r, size_t o) {
    return _mm256_loadu_si256((const __m256i *)(p[r] + o));
}

__attribute__((target("avx2"))) static void x8r_dwords_avx2(uint8_t *o, const uint8_t *const *p, size_t off, int n,
                                                            bool flip) {
    const __m256i fx = _mm256_set1_epi8(flip ? (char)0x80 : 0);
    int j0 = 0;
    for (; j0 + 8 <= n; j0 += 8) {
        const size_t f = off + 4 * (size_t)j0;
        const __m256i r0 = x8r_ld(p, 0, f), r1 = x8r_ld(p, 1, f), r2 = x8r_ld(p, 2, f), r3 = x8r_ld(p, 3, f);
        const __m256i r4 = x8r_ld(p, 4, f), r5 = x8r_ld(p, 5, f), r6 = x8r_ld(p, 6, f), r7 = x8r_ld(p, 7, f);
        /* rows (2i, 2i+1) x dwords (0, 1 | 4, 5) and (2, 3 | 6, 7) */
        const __m256i t0 = _mm256_unpacklo_epi32(r0, r1), t1 = _mm256_unpackhi_epi32(r0, r1);
        const __m256i t2 = _mm256_unpacklo_epi32(r2, r3), t3 = _mm256_unpackhi_epi32(r2, r3);
        const __m256i t4 = _mm256_unpacklo_epi32(r4, r5), t5 = _mm256_unpackhi_epi32(r4, r5);
        const __m256i t6 = _mm256_unpacklo_epi32(r6, r7), t7 = _mm256_unpackhi_epi32(r6, r7);
        /* rows 0-3 (u0-u3) and 4-7 (u4-u7) x dword k | k + 4 */
        const __m256i u0 = _mm256_unpacklo_epi64(t0, t2), u1 = _mm256_unpackhi_epi64(t0, t2);
        const __m256i u2 = _mm256_unpacklo_epi64(t1, t3), u3 = _mm256_unpackhi_epi64(t1, t3);
        const __m256i u4 = _mm256_unpacklo_epi64(t4, t6), u5 = _mm256_unpackhi_epi64(t4, t6);
        const __m256i u6 = _mm256_unpacklo_epi64(t5, t7), u7 = _mm256_unpackhi_epi64(t5, t7);
        __m256i *d = (__m256i *)(o + 32 * j0);
        _mm256_storeu_si256(d + 0, _mm256_xor_si256(_mm256_permute2x128_si256(u0, u4, 0x20), fx));
        _mm256_storeu_si256(d + 1, _mm256_xor_si256(_mm256_permute2x128_si256(u1, u5, 0x20), fx));
        _mm256_storeu_si256(d + 2, _mm256_xor_si256(_mm256_permute2x128_si256(u2, u6, 0x20), fx));
        _mm256_storeu_si256(d + 3, _mm256_xor_si256(_mm256_permute2x128_si256(u3, u7, 0x20), fx));
        _mm256_storeu_si256(d + 4, _mm256_xor_si256(_mm256_permute2x128_si256(u0, u4, 0x31), fx));
        _mm256_storeu_si256(d + 5, _mm256_xor_si256(_mm256_permute2x128_si256(u1, u5, 0x31), fx));
        _mm256_storeu_si256(d + 6, _mm256_xor_si256(_mm256_permute2x128_si256(u2, u6, 0x31), fx));
        _mm256_storeu_si256(d + 7, _mm256_xor_si256(_mm256_permute2x128_si256(u3, u7, 0x31), fx));
    }
    if (j0 + 4 <= n) { /* four dwords: rows r and r + 4 side by side in one vector, one 4x4 transpose */
        const size_t f = off + 4 * (size_t)j0;
#define X8R_PAIR(r) \
    _mm256_set_m128i(_mm_loadu_si128((const __m128i *)(p[(r) + 4] + f)), _mm_loadu_si128((const __m128i *)(p[r] + f)))
        const __m256i a0 = X8R_PAIR(0), a1 = X8R_PAIR(1), a2 = X8R_PAIR(2), a3 = X8R_PAIR(3);
#undef X8R_PAIR
        const __m256i t0 = _mm256_unpacklo_epi32(a0, a1), t1 = _mm256_unpackhi_epi32(a0, a1);
        const __m256i t2 = _mm256_unpacklo_epi32(a2, a3), t3 = _mm256_unpackhi_epi32(a2, a3);
        __m256i *d = (__m256i *)(o + 32 * j0);
        _mm256_storeu_si256(d + 0, _mm256_xor_si256(_mm256_unpacklo_epi64(t0, t2), fx));
        _mm256_storeu_si256(d + 1, _mm256_xor_si256(_mm256_unpackhi_epi64(t0, t2), fx));
        _mm256_storeu_si256(d + 2, _mm256_xor_si256(_mm256_unpacklo_epi64(t1, t3), fx));
        _mm256_storeu_si256(d + 3, _mm256_xor_si256(_mm256_unpackhi_epi64(t1, t3), fx));
        j0 += 4;
    }
    x8r_dwords_scalar(o, p, off, j0, n, flip);
}
#endif

static void x8r_dwords(uint8_t *o, const uint8_t *const *p, size_t off, int n, bool flip) {
#if defined(__x86_64__) || defined(__i386__)
    if (g_has_avx2) {
        x8r_dwords_avx2(o, p, off, n, flip);
        return;
    }
#endif
    x8r_dwords_scalar(o, p, off, 0, n, flip);
}

/* The 8 rows' blocks b (block size bs, row size rb) at src. */
static void x8r_rows(const uint8_t **p, const uint8_t *src, size_t rb, int64_t b, size_t bs) {
    for (int r = 0; r < 8; r++) p[r] = src + (size_t)r * rb + (size_t)b * bs;
}

/* The 8 rows' 2 bytes at p[r] + off (an F16 scale) to o + 2 r. */
static void x8r_halves(uint8_t *o, const uint8_t *const *p, size_t off) {
    for (int r = 0; r < 8; r++) memcpy(o + 2 * r, p[r] + off, 2);
}

static bool repacked_none(enum moetax_type t) {
    (void)t;
    return false;
}

/* avx2 and avx512: every quantized type in a layout of rows interleaved (kernels.h): Q4_0x8r, Q5_0x8r,
 * IQ4_NLx8r, Q4_1x8r, Q5_1x8r, every k-quant's x8r, and Q8_0 in Q8_0x4r (avx2) or Q8_0x8r (avx512) */
static bool repacked_simd(enum moetax_type t) { return moetax_k_act_is_q(t) || moetax_k_act_is_k(t); }


/* The x8r layouts (kernels_impl.h): per group of 8 rows and block, each row's F16 halves (n == 0)
 * and dword fields (n dwords) from offset src of its block to offset dst of the group's block. */
struct x8r_field {
    uint16_t dst, src;
    uint8_t n;
};
struct x8r_layout {
    size_t bs, gbs; /* a row's block, the group's block (8 x bs) */
    bool flip;      /* Q8_0x8r: each quant plus 128 */
    int nf;
    struct x8r_field f[5];
};
#define X8R_OFF(blk, f) offsetof(moetax_block_##blk, f)
static const struct x8r_layout k_x8r_q4_0 = {sizeof(moetax_block_q4_0), MOETAX_K_Q4R8_BLOCK_BYTES, false, 2,
                                             {{0, X8R_OFF(q4_0, d), 0}, {MOETAX_K_Q4R8_QS_OFF, X8R_OFF(q4_0, qs), 4}}};
static const struct x8r_layout k_x8r_q8_0 = {sizeof(moetax_block_q8_0), MOETAX_K_Q8R8_BLOCK_BYTES, true, 2,
                                             {{0, X8R_OFF(q8_0, d), 0}, {MOETAX_K_Q8R8_QS_OFF, X8R_OFF(q8_0, qs), 8}}};
static const struct x8r_layout k_x8r_q4_k = {sizeof(moetax_block_q4_k), MOETAX_K_Q4KR8_BLOCK_BYTES, false, 4,
                                             {{0, X8R_OFF(q4_k, d), 0},
                                              {MOETAX_K_Q4KR8_DMIN_OFF, X8R_OFF(q4_k, dmin), 0},
                                              {MOETAX_K_Q4KR8_SC_OFF, X8R_OFF(q4_k, scales), 3},
                                              {MOETAX_K_Q4KR8_QS_OFF, X8R_OFF(q4_k, qs), 32}}};
static const struct x8r_layout k_x8r_q5_k = {sizeof(moetax_block_q5_k), MOETAX_K_Q5KR8_BLOCK_BYTES, false, 5,
                                             {{0, X8R_OFF(q5_k, d), 0},
                                              {MOETAX_K_Q4KR8_DMIN_OFF, X8R_OFF(q5_k, dmin), 0},
                                              {MOETAX_K_Q4KR8_SC_OFF, X8R_OFF(q5_k, scales), 3},
                                              {MOETAX_K_Q5KR8_QH_OFF, X8R_OFF(q5_k, qh), 8},
                                              {MOETAX_K_Q5KR8_QS_OFF, X8R_OFF(q5_k, qs), 32}}};
static const struct x8r_layout k_x8r_q6_k = {sizeof(moetax_block_q6_k), MOETAX_K_Q6KR8_BLOCK_BYTES, false, 4,
                                             {{0, X8R_OFF(q6_k, d), 0},
                                              {MOETAX_K_Q6KR8_SC_OFF, X8R_OFF(q6_k, scales), 4},
                                              {MOETAX_K_Q6KR8_QL_OFF, X8R_OFF(q6_k, ql), 32},
                                              {MOETAX_K_Q6KR8_QH_OFF, X8R_OFF(q6_k, qh), 16}}};
static const struct x8r_layout k_x8r_q2_k = {sizeof(moetax_block_q2_k), MOETAX_K_Q2KR8_BLOCK_BYTES, false, 4,
                                             {{0, X8R_OFF(q2_k, d), 0},
                                              {MOETAX_K_Q2KR8_DMIN_OFF, X8R_OFF(q2_k, dmin), 0},
                                              {MOETAX_K_Q2KR8_SC_OFF, X8R_OFF(q2_k, scales), 4},
                                              {MOETAX_K_Q2KR8_QS_OFF, X8R_OFF(q2_k, qs), 16}}};
static const struct x8r_layout k_x8r_q3_k = {sizeof(moetax_block_q3_k), MOETAX_K_Q3KR8_BLOCK_BYTES, false, 4,
                                             {{0, X8R_OFF(q3_k, d), 0},
                                              {MOETAX_K_Q3KR8_SC_OFF, X8R_OFF(q3_k, scales), 3},
                                              {MOETAX_K_Q3KR8_QS_OFF, X8R_OFF(q3_k, qs), 16},
                                              {MOETAX_K_Q3KR8_HM_OFF, X8R_OFF(q3_k, hmask), 8}}};
#undef X8R_OFF
/* each layout's block is its 8 rows' blocks, and its fields end where kernels_impl.h says */
#define X8R_SIZE(L, blk) \
    _Static_assert(MOETAX_K_##L##_BLOCK_BYTES == 8 * sizeof(moetax_block_##blk), #L ": 8 blocks of " #blk)
X8R_SIZE(Q4R8, q4_0);
X8R_SIZE(Q8R8, q8_0);
X8R_SIZE(Q4KR8, q4_k);
X8R_SIZE(Q5KR8, q5_k);
X8R_SIZE(Q6KR8, q6_k);
X8R_SIZE(Q2KR8, q2_k);
X8R_SIZE(Q3KR8, q3_k);
#undef X8R_SIZE
_Static_assert(MOETAX_K_Q4R8_QS_OFF + 4 * 8 * 4 == MOETAX_K_Q4R8_BLOCK_BYTES, "scales + 4 chunks of 8 rows x 4 bytes");
_Static_assert(MOETAX_K_Q8R8_QS_OFF + 8 * 8 * 4 == MOETAX_K_Q8R8_BLOCK_BYTES, "scales + 8 chunks of 8 rows x 4 quants");
_Static_assert(MOETAX_K_Q4KR8_QS_OFF + 4 * 8 * 8 * 4 == MOETAX_K_Q4KR8_BLOCK_BYTES, "scales + 4 x 8 groups x 8 rows");
_Static_assert(MOETAX_K_Q5KR8_QS_OFF + 4 * 8 * 8 * 4 == MOETAX_K_Q5KR8_BLOCK_BYTES, "scales, qh, then qs");
_Static_assert(MOETAX_K_Q6KR8_QH_OFF + 2 * 8 * 8 * 4 == MOETAX_K_Q6KR8_BLOCK_BYTES, "d, scales, ql, then qh");
_Static_assert(MOETAX_K_Q2KR8_SC_OFF == 2 * 2 * 8 && MOETAX_K_Q2KR8_QS_OFF == MOETAX_K_Q2KR8_SC_OFF + 4 * 8 * 4 &&
                   MOETAX_K_Q2KR8_QS_OFF + 16 * 8 * 4 == MOETAX_K_Q2KR8_BLOCK_BYTES,
               "d, dmin, 4 dwords of scales x 8 rows, then 16 groups x 8 rows x 4 bytes of qs");
_Static_assert(MOETAX_K_Q3KR8_SC_OFF == 2 * 8 && MOETAX_K_Q3KR8_QS_OFF == MOETAX_K_Q3KR8_SC_OFF + 3 * 8 * 4 &&
                   MOETAX_K_Q3KR8_HM_OFF == MOETAX_K_Q3KR8_QS_OFF + 16 * 8 * 4 &&
                   MOETAX_K_Q3KR8_HM_OFF + 8 * 8 * 4 == MOETAX_K_Q3KR8_BLOCK_BYTES,
               "d, 3 dwords of packed scales, 16 groups of qs, then 8 of hmask, each x 8 rows");

/* One group of 8 rows of nb blocks (row stride nb x bs) in layout L, from src to dst (no overlap). */
static void x8r_group(const struct x8r_layout *L, void *dst, const void *src, int64_t nb) {
    const size_t rb = (size_t)nb * L->bs;
    for (int64_t b = 0; b < nb; b++) {
        uint8_t *o = (uint8_t *)dst + (size_t)b * L->gbs;
        const uint8_t *p[8];
        x8r_rows(p, src, rb, b, L->bs);
        for (int i = 0; i < L->nf; i++) {
            const struct x8r_field *f = &L->f[i];
            if (f->n) x8r_dwords(o + f->dst, p, f->src, f->n, L->flip);
            else x8r_halves(o + f->dst, p, f->src);
        }
    }
}

void moetax_k_repack_group_q8r4(void *dst, const void *src, int64_t nb) {
    enum { R = MOETAX_K_Q8R4_ROWS, BB = MOETAX_K_Q8R4_BLOCK_BYTES };
    _Static_assert(BB == R * sizeof(moetax_block_q8_0), "a group block has the size of its 4 blocks");
    _Static_assert(MOETAX_K_Q8R4_QS_OFF + R * 32 == BB, "scales + 4 rows x 32 quants");
    const size_t rb = (size_t)nb * sizeof(moetax_block_q8_0);
    const uint8_t *s = src;
    uint8_t *d = dst;
    for (int64_t b = 0; b < nb; b++) {
        uint8_t *o = d + (size_t)b * BB;
        for (int r = 0; r < R; r++) {
            const uint8_t *blk = s + (size_t)r * rb + (size_t)b * sizeof(moetax_block_q8_0);
            memcpy(o + 2 * r, blk, 2);
            memcpy(o + MOETAX_K_Q8R4_QS_OFF + 32 * r, blk + 2, 32);
        }
    }
}


static const struct moetax_kernels k_avx512;


/* One group of 8 Q5_0 rows of nb blocks -> Q5_0x8r (kernels_impl.h): the d halves and the nibble
 * dwords as the x8r layouts place them, the rows' qh bits transposed into the 8 chunk masks. */
static void x8r_group_q5(enum moetax_type t, void *dst, const void *src, int64_t nb) {
    /* Q5_0 / Q4_1 / Q5_1: the block's d (and m) halves, then its qh (if any), then 16 nibble bytes */
    const bool five = t != MOETAX_TYPE_Q4_1, with_m = t != MOETAX_TYPE_Q5_0;
    const size_t bs = moetax_type_size(t), qh_src = with_m ? 4 : 2, qs_src = bs - 16;
    const size_t qh_dst = with_m ? MOETAX_K_Q51R8_QH_OFF : MOETAX_K_Q5R8_QH_OFF;
    const size_t qs_dst = t == MOETAX_TYPE_Q5_0 ? MOETAX_K_Q5R8_QS_OFF
                        : t == MOETAX_TYPE_Q5_1 ? MOETAX_K_Q51R8_QS_OFF : MOETAX_K_Q41R8_QS_OFF;
    const size_t rb = (size_t)nb * bs;
    for (int64_t b = 0; b < nb; b++) {
        uint8_t *o = (uint8_t *)dst + (size_t)b * 8 * bs;
        const uint8_t *p[8];
        x8r_rows(p, src, rb, b, bs);
        x8r_halves(o, p, 0);
        if (with_m) x8r_halves(o + MOETAX_K_QX1R8_M_OFF, p, 2);
        x8r_dwords(o + qs_dst, p, qs_src, 4, false);
        if (!five) continue;
        uint32_t m[8] = {0};
        for (int r = 0; r < 8; r++) {
            const uint32_t qh = moetax_k_le32(p[r] + qh_src);
            for (int c = 0; c < 4; c++)
                for (int hh = 0; hh < 2; hh++) m[2 * c + hh] |= (qh >> (16 * hh + 4 * c) & 0xfu) << (4 * r);
        }
        memcpy(o + qh_dst, m, sizeof m);
    }
}
_Static_assert(offsetof(moetax_block_q5_0, qh) == 2 && offsetof(moetax_block_q5_1, qh) == 4 &&
                   offsetof(moetax_block_q5_0, qs) == sizeof(moetax_block_q5_0) - 16 &&
                   offsetof(moetax_block_q4_1, qs) == sizeof(moetax_block_q4_1) - 16 &&
                   offsetof(moetax_block_q5_1, qs) == sizeof(moetax_block_q5_1) - 16 &&
                   offsetof(moetax_block_q4_1, m) == 2 && offsetof(moetax_block_q5_1, m) == 2,
               "Q5_0 / Q4_1 / Q5_1: d (and m), then qh, then the 16 nibble bytes last");
_Static_assert(MOETAX_K_Q41R8_BLOCK_BYTES == 8 * sizeof(moetax_block_q4_1) &&
                   MOETAX_K_Q51R8_BLOCK_BYTES == 8 * sizeof(moetax_block_q5_1) &&
                   MOETAX_K_Q41R8_QS_OFF + 4 * 8 * 4 == MOETAX_K_Q41R8_BLOCK_BYTES &&
                   MOETAX_K_Q51R8_QS_OFF == MOETAX_K_Q51R8_QH_OFF + 8 * 4 &&
                   MOETAX_K_Q51R8_QS_OFF + 4 * 8 * 4 == MOETAX_K_Q51R8_BLOCK_BYTES,
               "Q4_1x8r / Q5_1x8r: d, m, (masks), then 4 chunks of 8 rows x 4 bytes");
_Static_assert(sizeof(moetax_block_iq4_nl) == sizeof(moetax_block_q4_0) &&
                   offsetof(moetax_block_iq4_nl, qs) == offsetof(moetax_block_q4_0, qs),
               "IQ4_NLx8r is Q4_0x8r's layout: the blocks have the same fields");
_Static_assert(MOETAX_K_Q5R8_BLOCK_BYTES == 8 * sizeof(moetax_block_q5_0) &&
                   MOETAX_K_Q5R8_QS_OFF == MOETAX_K_Q5R8_QH_OFF + 8 * 4 && MOETAX_K_Q5R8_QH_OFF == 2 * 8,
               "Q5_0x8r: d, 8 masks, then 4 chunks of 8 rows x 4 bytes");

/* One group of rows in layout L (NULL: Q8_0x4r, or Q5_0x8r, Q4_1x8r, Q5_1x8r for those types). */
static void repack_group(enum moetax_type t, const struct x8r_layout *L, void *dst, const void *src, int64_t nb) {
    if (L) x8r_group(L, dst, src, nb);
    else if (t == MOETAX_TYPE_Q5_0 || t == MOETAX_TYPE_Q4_1 || t == MOETAX_TYPE_Q5_1) x8r_group_q5(t, dst, src, nb);
    else moetax_k_repack_group_q8r4(dst, src, nb);
}

moetax_status moetax_kernels_repack(const struct moetax_kernels *k, enum moetax_type t, void *dst, const void *src,
                                    int64_t n_rows, int64_t ncols) {
    const size_t rb = moetax_row_size(t, ncols);
    if (n_rows <= 0 || rb == 0) return MOETAX_OK;
    /* the repacked layouts (repacked_simd), groups of R rows */
    if (!k->weights_repacked || !k->weights_repacked(t)) {
        if (dst != src) memmove(dst, src, rb * (size_t)n_rows);
        return MOETAX_OK;
    }
    const bool q8x8 = t == MOETAX_TYPE_Q8_0 && k == &k_avx512;
    const struct x8r_layout *L = t == MOETAX_TYPE_Q4_0 || t == MOETAX_TYPE_IQ4_NL ? &k_x8r_q4_0
                                 : t == MOETAX_TYPE_Q4_K ? &k_x8r_q4_k
                                 : t == MOETAX_TYPE_Q5_K ? &k_x8r_q5_k
                                 : t == MOETAX_TYPE_Q6_K ? &k_x8r_q6_k
                                 : t == MOETAX_TYPE_Q2_K ? &k_x8r_q2_k
                                 : t == MOETAX_TYPE_Q3_K ? &k_x8r_q3_k
                                 : q8x8                  ? &k_x8r_q8_0
                                                         : NULL; /* Q8_0x4r */
    const int R = L || t == MOETAX_TYPE_Q5_0 || t == MOETAX_TYPE_Q4_1 || t == MOETAX_TYPE_Q5_1 ? 8 : MOETAX_K_Q8R4_ROWS;
    const int64_t bpr = moetax_k_act_is_k(t) ? ncols / MOETAX_QK_K : ncols / 32; /* blocks per row */
    const int64_t ng = n_rows / R;
    const size_t gb = (size_t)R * rb;
    if (ng > 0 && dst == src) { /* in place: each group's source bytes go through a copy */
        _Alignas(64) uint8_t stack[MOETAX_KERNELS_REPACK_STACK];
        uint8_t *tmp = gb <= sizeof stack ? stack : malloc(gb);
        if (!tmp)
            return moetax_error(MOETAX_ERR_NOMEM, "repack: cannot allocate %zu bytes for a group of %d rows of %lld columns",
                                gb, R, (long long)ncols);
        for (int64_t g = 0; g < ng; g++) {
            uint8_t *p = (uint8_t *)dst + (size_t)g * gb;
            memcpy(tmp, p, gb);
            repack_group(t, L, p, tmp, bpr);
        }
        if (tmp != stack) free(tmp);
    } else {
        for (int64_t g = 0; g < ng; g++)
            repack_group(t, L, (uint8_t *)dst + (size_t)g * gb, (const uint8_t *)src + (size_t)g * gb, bpr);
    }
    /* the last n_rows % R rows stay as they are */
    const size_t done = (size_t)ng * gb, tail = (size_t)(n_rows - ng * R) * rb;
    if (dst != src && tail) memmove((uint8_t *)dst + done, (const uint8_t *)src + done, tail);
    return MOETAX_OK;
}

static const struct moetax_kernels k_ref = {
    .name = "ref",
    .quantize_act = moetax_k_quantize_act_ref,
    .matmul = moetax_k_matmul_ref,
    .matmul_stream = moetax_k_matmul_ref,
    .weights_repacked = repacked_none,
    .rmsnorm = moetax_k_rmsnorm_ref,
    .softmax = moetax_k_softmax_ref,
    .sigmoid = moetax_k_sigmoid_ref,
    .topk = moetax_k_topk_ref,
    .silu_mul = moetax_k_silu_mul_ref,
    .rope = moetax_k_rope_ref,
    .rope_cached = moetax_k_rope_cached_ref,
    .scatter_add = moetax_k_scatter_add_ref,
    .dot = moetax_k_dot_ref,
    .axpy = moetax_k_axpy_ref,
    .wsum = moetax_k_wsum_ref,
    .scale = moetax_k_scale_ref,
    .fp16_to_fp32 = moetax_k_fp16_to_fp32_ref,
    .fp32_to_fp16 = moetax_k_fp32_to_fp16_ref,
    .bf16_to_fp32 = moetax_k_bf16_to_fp32_ref,
    .fp32_to_bf16 = moetax_k_fp32_to_bf16_ref,
    .q8_0_to_fp32 = moetax_k_q8_0_to_fp32_ref,
};

static const struct moetax_kernels k_avx2 = {
    .name = "avx2",
    .quantize_act = moetax_k_quantize_act_avx2,
    .matmul = moetax_k_matmul_avx2,
    .matmul_stream = moetax_k_matmul_avx2_stream,
    .weights_repacked = repacked_simd,
    .rmsnorm = moetax_k_rmsnorm_avx2,
    .softmax = moetax_k_softmax_avx2,
    .sigmoid = moetax_k_sigmoid_avx2,
    .topk = moetax_k_topk_ref,        /* branchy, tiny n: scalar is right */
    .silu_mul = moetax_k_silu_mul_avx2,
    .rope = moetax_k_rope_ref,        /* sin/cos dominated, once per head */
    .rope_cached = moetax_k_rope_cached_ref,
    .scatter_add = moetax_k_scatter_add_avx2,
    .dot = moetax_k_dot_avx2,
    .axpy = moetax_k_axpy_avx2,
    .wsum = moetax_k_wsum_avx2,
    .scale = moetax_k_scale_avx2,
    .fp16_to_fp32 = moetax_k_fp16_to_fp32_avx2,
    .fp32_to_fp16 = moetax_k_fp32_to_fp16_avx2,
    .bf16_to_fp32 = moetax_k_bf16_to_fp32_avx2,
    .fp32_to_bf16 = moetax_k_fp32_to_bf16_avx2,
    .q8_0_to_fp32 = moetax_k_q8_0_to_fp32_avx2,
};

/* The avx2 table with the matmuls (Q8_0 / Q4_0 / k-quants on AVX-512 VNNI, F32/F16/BF16 batches), the
 * attention's weighted sum and the Q8_0 cells' conversion on AVX-512 (matmul_avx512.c); the rest is avx2's. */
static const struct moetax_kernels k_avx512 = {
    .name = "avx512",
    .quantize_act = moetax_k_quantize_act_avx2,
    .matmul = moetax_k_matmul_avx512,
    .matmul_stream = moetax_k_matmul_avx512_stream,
    .weights_repacked = repacked_simd, /* its own Q8_0x8r where avx2 has Q8_0x4r */
    .rmsnorm = moetax_k_rmsnorm_avx2,
    .softmax = moetax_k_softmax_avx2,
    .sigmoid = moetax_k_sigmoid_avx2,
    .topk = moetax_k_topk_ref,
    .silu_mul = moetax_k_silu_mul_avx2,
    .rope = moetax_k_rope_ref,
    .rope_cached = moetax_k_rope_cached_ref,
    .scatter_add = moetax_k_scatter_add_avx2,
    .dot = moetax_k_dot_avx2,
    .axpy = moetax_k_axpy_avx2,
    .wsum = moetax_k_wsum_avx512,
    .scale = moetax_k_scale_avx2,
    .fp16_to_fp32 = moetax_k_fp16_to_fp32_avx2,
    .fp32_to_fp16 = moetax_k_fp32_to_fp16_avx2,
    .bf16_to_fp32 = moetax_k_bf16_to_fp32_avx2,
    .fp32_to_bf16 = moetax_k_fp32_to_bf16_avx2,
    .q8_0_to_fp32 = moetax_k_q8_0_to_fp32_avx512,
};

static const struct moetax_kernels *g_best;
static pthread_once_t g_once = PTHREAD_ONCE_INIT;

/* cpuid: AVX2 (leaf 7 ebx bit 5), FMA and F16C (leaf 1 ecx bits 12, 29), and the OS saving YMM
 * state (OSXSAVE, XCR0 bits 1-2). Read directly: compilers differ in the feature names they accept. */
static bool cpu_has_avx2_fma_f16c(void) {
#if defined(__x86_64__) || defined(__i386__)
    unsigned a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d)) return false;
    bool fma = c & (1u << 12), osxsave = c & (1u << 27), avx = c & (1u << 28), f16c = c & (1u << 29);
    if (!(fma && osxsave && avx && f16c)) return false;
    unsigned xlo, xhi;
    __asm__ volatile("xgetbv" : "=a"(xlo), "=d"(xhi) : "c"(0));
    if ((xlo & 6u) != 6u) return false;
    if (__get_cpuid_max(0, NULL) < 7) return false;
    __cpuid_count(7, 0, a, b, c, d);
    return b & (1u << 5);
#else
    return false;
#endif
}

/* AVX-512 F, DQ, BW, VL (leaf 7 ebx bits 16, 17, 30, 31) and VNNI (leaf 7 ecx bit 11), and the OS
 * saving the opmask and all ZMM state (XCR0 bits 5-7) besides YMM (bits 1-2). */
static bool cpu_has_avx512_vnni(void) {
#if defined(__x86_64__) || defined(__i386__)
    if (!cpu_has_avx2_fma_f16c()) return false;
    unsigned a, b, c, d, xlo, xhi;
    __asm__ volatile("xgetbv" : "=a"(xlo), "=d"(xhi) : "c"(0));
    if ((xlo & 0xe6u) != 0xe6u) return false;
    __cpuid_count(7, 0, a, b, c, d);
    const unsigned need_b = (1u << 16) | (1u << 17) | (1u << 30) | (1u << 31);
    return (b & need_b) == need_b && (c & (1u << 11));
#else
    return false;
#endif
}

/* GFNI (leaf 7 ecx bit 8); its vgf2p8affineqb on ZMM needs AVX-512 F besides. */
static bool cpu_has_gfni(void) {
#if defined(__x86_64__) || defined(__i386__)
    unsigned a, b, c, d;
    if (__get_cpuid_max(0, NULL) < 7) return false;
    __cpuid_count(7, 0, a, b, c, d);
    return c & (1u << 8);
#else
    return false;
#endif
}

bool moetax_k_avx512_gfni;

/* MOETAX_FORCE_REF (non-empty, not "0") forces ref; else MOETAX_KERNELS=ref|avx2|avx512 names a
 * table; one this CPU cannot run, or an unknown name, is a warning on stderr and the best table. */
static void select_once(void) {
    moetax_k_tables_init();
    g_has_avx2 = cpu_has_avx2_fma_f16c();
    g_has_avx512 = g_has_avx2 && cpu_has_avx512_vnni();
    g_best = g_has_avx512 ? &k_avx512 : g_has_avx2 ? &k_avx2 : &k_ref;
    const char *gfni = getenv("MOETAX_GFNI"); /* "0": the avx512 table without GFNI (A/B runs, tests) */
    moetax_k_avx512_gfni = g_has_avx512 && cpu_has_gfni() && !(gfni && strcmp(gfni, "0") == 0);
    const char *force = getenv("MOETAX_FORCE_REF");
    if (force && force[0] && strcmp(force, "0") != 0) {
        g_best = &k_ref;
        return;
    }
    const char *want = getenv("MOETAX_KERNELS");
    if (!want || !want[0]) return;
    if (strcmp(want, "ref") == 0) g_best = &k_ref;
    else if (strcmp(want, "avx2") == 0 && g_has_avx2) g_best = &k_avx2;
    else if (strcmp(want, "avx512") == 0 && g_has_avx512) g_best = &k_avx512;
    else if (strcmp(want, "avx2") == 0 || strcmp(want, "avx512") == 0)
        fprintf(stderr, "moetax: MOETAX_KERNELS=%s: this CPU (or OS) does not support it; using %s\n", want,
                g_best->name);
    else
        fprintf(stderr, "moetax: MOETAX_KERNELS=%s: unknown table (ref, avx2, avx512); using %s\n", want,
                g_best->name);
}

const struct moetax_kernels *moetax_kernels_get(void) {
    pthread_once(&g_once, select_once);
    return g_best;
}

uint64_t moetax_cpu_llc_bytes(void) {
    static _Atomic uint64_t cached;
    uint64_t v = atomic_load(&cached);
    if (v) return v;
    /* the kernel's view first (sysfs: the largest cache CPU 0 lists, e.g. "32768K"): in a VM, glibc's
       sysconf can take a socket-wide figure from cpuid (an AMD EPYC VM: 320 MiB for a 32 MiB L3) */
    for (int i = 0; i < 8; i++) {
        char path[80], buf[32];
        snprintf(path, sizeof path, "/sys/devices/system/cpu/cpu0/cache/index%d/size", i);
        FILE *f = fopen(path, "r");
        if (!f) break;
        unsigned long long n = 0;
        char unit = 0;
        if (fgets(buf, sizeof buf, f) && sscanf(buf, "%llu%c", &n, &unit) >= 1) {
            const uint64_t b = (uint64_t)n * (unit == 'K' ? 1024u : unit == 'M' ? 1048576u : 1u);
            if (b > v) v = b;
        }
        fclose(f);
    }
#ifdef _SC_LEVEL3_CACHE_SIZE
    if (!v) {
        const long l3 = sysconf(_SC_LEVEL3_CACHE_SIZE);
        if (l3 > 0) v = (uint64_t)l3;
    }
#endif
    if (!v) v = (uint64_t)32 << 20;
    atomic_store(&cached, v);
    return v;
}

bool moetax_kernels_streamed(uint64_t weight_bytes) {
    const char *e = getenv("MOETAX_STREAM"); /* "1" or "0" forces the choice (A/B runs; a VM's L3 figure) */
    if (e && (!strcmp(e, "0") || !strcmp(e, "1"))) return e[0] == '1';
    static atomic_bool warned;
    if (e && *e && !atomic_exchange(&warned, true)) /* as MOETAX_KERNELS: a warning, not a failure */
        fprintf(stderr, "moetax: MOETAX_STREAM='%s' is not 0 or 1; ignored (the model's size decides)\n", e);
    return weight_bytes > moetax_cpu_llc_bytes();
}

const struct moetax_kernels *moetax_kernels_ref(void) {
    pthread_once(&g_once, select_once);
    return &k_ref;
}

const struct moetax_kernels *moetax_kernels_avx2(void) {
    pthread_once(&g_once, select_once);
    return g_has_avx2 ? &k_avx2 : NULL;
}

const struct moetax_kernels *moetax_kernels_avx512(void) {
    pthread_once(&g_once, select_once);
    return g_has_avx512 ? &k_avx512 : NULL;
}

const char *moetax_kernels_extras(const struct moetax_kernels *k) {
    pthread_once(&g_once, select_once);
    return k == &k_avx512 && moetax_k_avx512_gfni ? "gfni" : "";
}

size_t moetax_act_size(enum moetax_type wtype, int64_t ncols, int64_t n_batch) {
    if (ncols < 0 || n_batch < 0) return 0;
    if (moetax_k_act_is_q(wtype) && ncols % 32 != 0) return 0;
    if (moetax_k_act_is_k(wtype) && ncols % 256 != 0) return 0;
    return moetax_k_act_row_bytes(wtype, ncols) * (size_t)n_batch;
}

/* ---- RoPE angles (ggml's rope_yarn, computed per pair without the running
 * product, so theta is as exact as powf allows) ---- */

static float corr_dim(int n_dims, int n_ctx_orig, float n_rot, float base) {
    return (float)n_dims * logf((float)n_ctx_orig / (n_rot * 2.0f * (float)M_PI)) / (2.0f * logf(base));
}

void moetax_rope_corr_dims(int n_dims, int n_ctx_orig, float freq_base, float beta_fast, float beta_slow,
                           float dims[2]) {
    const float start = floorf(corr_dim(n_dims, n_ctx_orig, beta_fast, freq_base));
    const float end = ceilf(corr_dim(n_dims, n_ctx_orig, beta_slow, freq_base));
    dims[0] = fmaxf(0.0f, start);
    dims[1] = fminf((float)(n_dims - 1), end);
}

void moetax_rope_cache(const struct moetax_rope_params *p, int64_t pos, float *cs) {
    const int n_dims = p->n_dims;
    float corr[2] = {0.0f, 0.0f};
    float mscale = p->attn_factor;
    if (p->ext_factor != 0.0f) {
        moetax_rope_corr_dims(n_dims, p->n_ctx_orig, p->freq_base, p->beta_fast, p->beta_slow, corr);
        mscale *= 1.0f + 0.1f * logf(1.0f / p->freq_scale);
    }
    for (int i = 0; i < n_dims / 2; i++) {
        const int i0 = 2 * i;
        float theta_extrap = (float)pos * powf(p->freq_base, -(float)i0 / (float)n_dims);
        if (p->freq_factors) theta_extrap /= p->freq_factors[i];
        const float theta_interp = p->freq_scale * theta_extrap;
        float theta = theta_interp;
        if (p->ext_factor != 0.0f) {
            const float y = ((float)i - corr[0]) / fmaxf(0.001f, corr[1] - corr[0]);
            const float ramp = 1.0f - fminf(1.0f, fmaxf(0.0f, y));
            const float mix = ramp * p->ext_factor;
            theta = theta_interp * (1.0f - mix) + theta_extrap * mix;
        }
        cs[2 * i] = cosf(theta) * mscale;
        cs[2 * i + 1] = sinf(theta) * mscale;
    }
}
