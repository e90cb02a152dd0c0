/* simd_avx2.h - small AVX2 helpers shared by the *_avx2.c kernel files and matmul_avx512.c
 * (include only from files compiled with -mavx2 -mfma -mf16c or more). Internal. */
#ifndef MOETAX_SIMD_AVX2_H
#define MOETAX_SIMD_AVX2_H

#include <immintrin.h>
#include <stddef.h>
#include <string.h>

#include "moetax/types.h"

#define ALWAYS_INLINE static inline __attribute__((always_inline))

/* Sum of the 8 lanes. */
ALWAYS_INLINE float hsum_ps(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* The 32 levels of a Q5_0 / IQ4_NL (signed) or Q4_1 / Q5_1 (unsigned) block at blk (byte j: value
 * j; see matmul_avx2.c's tile_q5nl). */
ALWAYS_INLINE __m256i nib_bytes(const uint8_t *qs) {
    const __m128i q = _mm_loadu_si128((const __m128i *)qs);
    return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(q, 4), q), _mm256_set1_epi8(0x0f));
}

/* 0xFF in byte j where bit j of the 4 bytes at qh4 (a little-endian uint32) is set, else 0. */
ALWAYS_INLINE __m256i fifth_bits(const uint8_t *qh4) {
    uint32_t qh;
    memcpy(&qh, qh4, 4);
    /* byte j of the 32 gets byte j / 8 of qh, then the bit j % 8 of it alone */
    const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                            2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ull);
    const __m256i h = _mm256_shuffle_epi8(_mm256_set1_epi32((int)qh), spread);
    return _mm256_cmpeq_epi8(_mm256_and_si256(h, bit), bit);
}

/* q - 16 as int8: the nibble ORed with 0xF0 where the fifth bit is clear */
ALWAYS_INLINE __m256i levels_q5_0(const uint8_t *blk) {
    return _mm256_or_si256(nib_bytes(blk + offsetof(moetax_block_q5_0, qs)),
                           _mm256_andnot_si256(fifth_bits(blk + offsetof(moetax_block_q5_0, qh)),
                                               _mm256_set1_epi8((char)0xf0)));
}

/* q in 0..15 (Q4_1) or 0..31 (Q5_1) */
ALWAYS_INLINE __m256i levels_q4_1(const uint8_t *blk) { return nib_bytes(blk + offsetof(moetax_block_q4_1, qs)); }
ALWAYS_INLINE __m256i levels_q5_1(const uint8_t *blk) {
    return _mm256_or_si256(nib_bytes(blk + offsetof(moetax_block_q5_1, qs)),
                           _mm256_and_si256(fifth_bits(blk + offsetof(moetax_block_q5_1, qh)), _mm256_set1_epi8(0x10)));
}

ALWAYS_INLINE __m256i levels_iq4nl(const uint8_t *blk) {
    const __m128i t = _mm_loadu_si128((const __m128i *)moetax_iq4nl_values);
    return _mm256_shuffle_epi8(_mm256_set_m128i(t, t), nib_bytes(blk + offsetof(moetax_block_iq4_nl, qs)));
}

#endif
