/* membw_avx2.c - the AVX2 streaming read kernel (compiled with -mavx2 -mfma -mf16c).
 *
 * The range is read as four interleaved streams (its quarters), 256 bytes of
 * each per iteration into four independent accumulators, with a software
 * prefetch 2 KiB ahead of every stream. On the development machine (KVM,
 * Sapphire Rapids) this reads ~10-15% faster with one thread than a single
 * stream without prefetch: more misses in flight per core. */
#include <immintrin.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

uint64_t moetax_membw_sum_avx2(const void *buf, size_t bytes); /* called from membw.c */

#define MEMBW_PF_AHEAD 2048

#define LOAD(q, o) _mm256_loadu_si256((const __m256i *)((q) + (o)))
#define BLOCK256(q)                                                                                  \
    do {                                                                                             \
        a0 = _mm256_add_epi64(a0, LOAD(q, 0));                                                       \
        a1 = _mm256_add_epi64(a1, LOAD(q, 32));                                                      \
        a2 = _mm256_add_epi64(a2, LOAD(q, 64));                                                      \
        a3 = _mm256_add_epi64(a3, LOAD(q, 96));                                                      \
        a0 = _mm256_add_epi64(a0, LOAD(q, 128));                                                     \
        a1 = _mm256_add_epi64(a1, LOAD(q, 160));                                                     \
        a2 = _mm256_add_epi64(a2, LOAD(q, 192));                                                     \
        a3 = _mm256_add_epi64(a3, LOAD(q, 224));                                                     \
    } while (0)
#define PREFETCH256(q)                                                                               \
    do {                                                                                             \
        _mm_prefetch((const char *)(q) + MEMBW_PF_AHEAD, _MM_HINT_T0);                               \
        _mm_prefetch((const char *)(q) + MEMBW_PF_AHEAD + 64, _MM_HINT_T0);                          \
        _mm_prefetch((const char *)(q) + MEMBW_PF_AHEAD + 128, _MM_HINT_T0);                         \
        _mm_prefetch((const char *)(q) + MEMBW_PF_AHEAD + 192, _MM_HINT_T0);                         \
    } while (0)

uint64_t moetax_membw_sum_avx2(const void *buf, size_t bytes) {
    const uint8_t *p = buf;
    __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
    size_t q = bytes / 4 / 256 * 256; /* quarter, a multiple of 256 bytes */
    const uint8_t *s0 = p, *s1 = p + q, *s2 = p + 2 * q, *s3 = p + 3 * q;
    for (size_t i = 0; i < q; i += 256) {
        PREFETCH256(s0 + i);
        PREFETCH256(s1 + i);
        PREFETCH256(s2 + i);
        PREFETCH256(s3 + i);
        BLOCK256(s0 + i);
        BLOCK256(s1 + i);
        BLOCK256(s2 + i);
        BLOCK256(s3 + i);
    }
    size_t i = 4 * q; /* the rest, < 1 KiB + 3 bytes */
    for (; i + 32 <= bytes; i += 32) a0 = _mm256_add_epi64(a0, LOAD(p, i));
    a0 = _mm256_add_epi64(_mm256_add_epi64(a0, a1), _mm256_add_epi64(a2, a3));
    uint64_t lanes[4];
    _mm256_storeu_si256((__m256i *)lanes, a0);
    uint64_t s = lanes[0] + lanes[1] + lanes[2] + lanes[3];
    for (; i + 8 <= bytes; i += 8) {
        uint64_t v;
        memcpy(&v, p + i, 8);
        s += v;
    }
    for (; i < bytes; i++) s += p[i];
    return s;
}
