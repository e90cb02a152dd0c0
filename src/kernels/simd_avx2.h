/* simd_avx2.h - small AVX2 helpers shared by the *_avx2.c kernel files
 * (include only from files compiled with -mavx2 -mfma -mf16c). Internal. */
#ifndef MOETAX_SIMD_AVX2_H
#define MOETAX_SIMD_AVX2_H

#include <immintrin.h>

#define ALWAYS_INLINE static inline __attribute__((always_inline))

/* Sum of the 8 lanes. */
ALWAYS_INLINE float hsum_ps(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

#endif
