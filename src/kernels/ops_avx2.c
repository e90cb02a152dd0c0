/* ops_avx2.c - AVX2/FMA/F16C vector ops: rmsnorm, softmax, sigmoid, SiLU
 * gating (with a vector expf), combine, BLAS-1 and row conversions.
 * Tails (n not a multiple of 8) go through an 8-float stack buffer so every
 * element sees the same arithmetic. */
#include "kernels_impl.h"

#include <immintrin.h>
#include <math.h>
#include <string.h>

#include "moetax/types.h"
#include "simd_avx2.h"


ALWAYS_INLINE float hmax_ps(__m256 v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* expf to ~2 ulp (Cody-Waite reduction + Cephes polynomial). Inputs above 88
 * saturate to e^88; inputs below -87.3 (and -inf) give 0. */
ALWAYS_INLINE __m256 exp_ps(__m256 x) {
    const __m256 lo = _mm256_set1_ps(-87.3f);
    const __m256 zero_mask = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
    x = _mm256_min_ps(_mm256_max_ps(x, lo), _mm256_set1_ps(88.0f));
    const __m256 fx = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                      _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(zero_mask, _mm256_mul_ps(y, _mm256_castsi256_ps(e)));
}

ALWAYS_INLINE __m256 sigmoid_ps(__m256 x) {
    const __m256 one = _mm256_set1_ps(1.0f);
    return _mm256_div_ps(one, _mm256_add_ps(one, exp_ps(_mm256_sub_ps(_mm256_setzero_ps(), x))));
}

/* Load/store the last n % 8 floats through a padded buffer (pad value pad). */
ALWAYS_INLINE __m256 load_tail(const float *x, int64_t n, float pad) {
    float buf[8];
    for (int i = 0; i < 8; i++) buf[i] = i < n ? x[i] : pad;
    return _mm256_loadu_ps(buf);
}
ALWAYS_INLINE void store_tail(float *x, int64_t n, __m256 v) {
    float buf[8];
    _mm256_storeu_ps(buf, v);
    for (int64_t i = 0; i < n; i++) x[i] = buf[i];
}

void moetax_k_rmsnorm_avx2(float *out, const float *x, const float *w, int64_t n, float eps) {
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        const __m256 v0 = _mm256_loadu_ps(x + i), v1 = _mm256_loadu_ps(x + i + 8);
        a0 = _mm256_fmadd_ps(v0, v0, a0);
        a1 = _mm256_fmadd_ps(v1, v1, a1);
    }
    for (; i + 8 <= n; i += 8) {
        const __m256 v = _mm256_loadu_ps(x + i);
        a0 = _mm256_fmadd_ps(v, v, a0);
    }
    if (i < n) {
        const __m256 v = load_tail(x + i, n - i, 0.0f);
        a1 = _mm256_fmadd_ps(v, v, a1);
    }
    const double ss = (double)hsum_ps(_mm256_add_ps(a0, a1));
    const float scale = n > 0 ? (float)(1.0 / sqrt(ss / (double)n + (double)eps)) : 0.0f;
    const __m256 vs = _mm256_set1_ps(scale);
    for (i = 0; i + 8 <= n; i += 8) {
        __m256 v = _mm256_mul_ps(_mm256_loadu_ps(x + i), vs);
        if (w) v = _mm256_mul_ps(v, _mm256_loadu_ps(w + i));
        _mm256_storeu_ps(out + i, v);
    }
    for (; i < n; i++) out[i] = x[i] * scale * (w ? w[i] : 1.0f);
}

void moetax_k_softmax_avx2(float *x, int64_t n, float ms[2]) {
    if (n <= 0) return;
    __m256 vm = _mm256_set1_ps(-INFINITY);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) vm = _mm256_max_ps(vm, _mm256_loadu_ps(x + i));
    float max = hmax_ps(vm);
    for (int64_t j = i; j < n; j++) max = fmaxf(max, x[j]);
    const __m256 vmax = _mm256_set1_ps(max);
    __m256 sum = _mm256_setzero_ps();
    for (i = 0; i + 8 <= n; i += 8) {
        const __m256 e = exp_ps(_mm256_sub_ps(_mm256_loadu_ps(x + i), vmax));
        _mm256_storeu_ps(x + i, e);
        sum = _mm256_add_ps(sum, e);
    }
    if (i < n) {
        const __m256 e = exp_ps(_mm256_sub_ps(load_tail(x + i, n - i, -INFINITY), vmax));
        store_tail(x + i, n - i, e);
        sum = _mm256_add_ps(sum, e);
    }
    const float total = hsum_ps(sum), inv = 1.0f / total;
    moetax_k_scale_avx2(x, inv, n);
    if (ms) ms[0] = max, ms[1] = total;
}

void moetax_k_sigmoid_avx2(float *x, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(x + i, sigmoid_ps(_mm256_loadu_ps(x + i)));
    if (i < n) store_tail(x + i, n - i, sigmoid_ps(load_tail(x + i, n - i, 0.0f)));
}

void moetax_k_silu_mul_avx2(float *out, const float *g, const float *u, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 gv = _mm256_loadu_ps(g + i);
        _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_mul_ps(gv, sigmoid_ps(gv)), _mm256_loadu_ps(u + i)));
    }
    if (i < n) {
        const __m256 gv = load_tail(g + i, n - i, 0.0f);
        store_tail(out + i, n - i, _mm256_mul_ps(_mm256_mul_ps(gv, sigmoid_ps(gv)), load_tail(u + i, n - i, 0.0f)));
    }
}

void moetax_k_axpy_avx2(float *y, float a, const float *x, int64_t n) {
    const __m256 va = _mm256_set1_ps(a);
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        _mm256_storeu_ps(y + i, _mm256_fmadd_ps(va, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
        _mm256_storeu_ps(y + i + 8, _mm256_fmadd_ps(va, _mm256_loadu_ps(x + i + 8), _mm256_loadu_ps(y + i + 8)));
    }
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(y + i, _mm256_fmadd_ps(va, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
    for (; i < n; i++) y[i] = fmaf(a, x[i], y[i]);
}

/* wsum: 4 rows of p (heads) x 16 columns of v in 8 accumulators; per j one
 * load of v's 16 columns serves the 4 heads (FMA-bound: 8 FMAs per 2 loads +
 * 4 broadcasts). Columns left over go by 8, then one at a time (fmaf: the
 * same chain per element). The rows of v go in chunks of WSUM_J that stay in
 * L2 while every (heads, columns) tile passes over them; a tile continues its
 * chain from out (cont: j0 > 0, or the caller's acc), so chunking does not change a bit. */
enum { WSUM_J = 128 };
ALWAYS_INLINE void wsum_tile(const int HB, const int VB, float *out, int64_t ld_out, const float *p, int64_t ld_p,
                             const float *v, int64_t ld_v, int64_t j0, int64_t j1, bool cont) {
    __m256 acc[4][2];
#pragma GCC unroll 4
    for (int h = 0; h < HB; h++)
#pragma GCC unroll 2
        for (int k = 0; k < VB; k++)
            acc[h][k] = cont ? _mm256_loadu_ps(out + h * ld_out + 8 * k) : _mm256_setzero_ps();
    for (int64_t j = j0; j < j1; j++) {
        __m256 vv[2];
#pragma GCC unroll 2
        for (int k = 0; k < VB; k++) vv[k] = _mm256_loadu_ps(v + j * ld_v + 8 * k);
#pragma GCC unroll 4
        for (int h = 0; h < HB; h++) {
            const __m256 ph = _mm256_broadcast_ss(p + h * ld_p + j);
#pragma GCC unroll 2
            for (int k = 0; k < VB; k++) acc[h][k] = _mm256_fmadd_ps(ph, vv[k], acc[h][k]);
        }
    }
#pragma GCC unroll 4
    for (int h = 0; h < HB; h++)
#pragma GCC unroll 2
        for (int k = 0; k < VB; k++) _mm256_storeu_ps(out + h * ld_out + 8 * k, acc[h][k]);
}

#define WSUM_TILE(HB, VB)                                                                                      \
    static void wsum_tile_##HB##x##VB(float *out, int64_t ld_out, const float *p, int64_t ld_p, const float *v, \
                                      int64_t ld_v, int64_t j0, int64_t j1, bool cont) {                       \
        wsum_tile(HB, VB, out, ld_out, p, ld_p, v, ld_v, j0, j1, cont);                                        \
    }
WSUM_TILE(1, 1) WSUM_TILE(2, 1) WSUM_TILE(3, 1) WSUM_TILE(4, 1)
WSUM_TILE(1, 2) WSUM_TILE(2, 2) WSUM_TILE(3, 2) WSUM_TILE(4, 2)
typedef void (*wsum_fn)(float *, int64_t, const float *, int64_t, const float *, int64_t, int64_t, int64_t, bool);
static const wsum_fn k_wsum[2][4] = {{wsum_tile_1x1, wsum_tile_2x1, wsum_tile_3x1, wsum_tile_4x1},
                                     {wsum_tile_1x2, wsum_tile_2x2, wsum_tile_3x2, wsum_tile_4x2}};

void moetax_k_wsum_avx2(float *out, int64_t ld_out, const float *p, int64_t ld_p, int64_t nh, const float *v,
                        int64_t ld_v, int64_t np, int64_t n, bool acc) {
    const int64_t n16 = n / 16 * 16, n8 = n / 8 * 8;
    if (acc && np == 0) return;
    for (int64_t j0 = 0; j0 < np || j0 == 0; j0 += WSUM_J) {
        const bool cont = acc || j0 > 0;
        const int64_t j1 = np - j0 < WSUM_J ? np : j0 + WSUM_J;
        for (int64_t h0 = 0; h0 < nh; h0 += 4) {
            const int hb = nh - h0 < 4 ? (int)(nh - h0) : 4;
            const float *ph = p + h0 * ld_p;
            float *oh = out + h0 * ld_out;
            for (int64_t c = 0; c < n16; c += 16) k_wsum[1][hb - 1](oh + c, ld_out, ph, ld_p, v + c, ld_v, j0, j1, cont);
            for (int64_t c = n16; c < n8; c += 8) k_wsum[0][hb - 1](oh + c, ld_out, ph, ld_p, v + c, ld_v, j0, j1, cont);
            for (int64_t c = n8; c < n; c++)
                for (int h = 0; h < hb; h++) {
                    float s = cont ? oh[h * ld_out + c] : 0.0f;
                    for (int64_t j = j0; j < j1; j++) s = fmaf(ph[h * ld_p + j], v[j * ld_v + c], s);
                    oh[h * ld_out + c] = s;
                }
        }
    }
}

void moetax_k_scatter_add_avx2(float *dst, int64_t ld_dst, const float *src, int64_t ld_src, const int32_t *rows,
                               const float *w, int64_t n_rows, int64_t n) {
    for (int64_t i = 0; i < n_rows; i++)
        moetax_k_axpy_avx2(dst + (rows ? (int64_t)rows[i] : i) * ld_dst, w[i], src + i * ld_src, n);
}

float moetax_k_dot_avx2(const float *a, const float *b, int64_t n) {
    __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps(), s2 = _mm256_setzero_ps(), s3 = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) {
        s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
        s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), s1);
        s2 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 16), _mm256_loadu_ps(b + i + 16), s2);
        s3 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 24), _mm256_loadu_ps(b + i + 24), s3);
    }
    for (; i + 8 <= n; i += 8) s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
    float s = hsum_ps(_mm256_add_ps(_mm256_add_ps(s0, s1), _mm256_add_ps(s2, s3)));
    for (; i < n; i++) s = fmaf(a[i], b[i], s);
    return s;
}

void moetax_k_scale_avx2(float *x, float a, int64_t n) {
    const __m256 va = _mm256_set1_ps(a);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(x + i, _mm256_mul_ps(va, _mm256_loadu_ps(x + i)));
    for (; i < n; i++) x[i] *= a;
}

void moetax_k_fp16_to_fp32_avx2(const uint16_t *x, float *y, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(x + i))));
    for (; i < n; i++) y[i] = moetax_k_fp16_table[x[i]];
}

void moetax_k_fp32_to_fp16_avx2(const float *x, uint16_t *y, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)(y + i), _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT));
    for (; i < n; i++) y[i] = moetax_fp32_to_fp16(x[i]);
}

void moetax_k_bf16_to_fp32_avx2(const uint16_t *x, float *y, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(x + i)));
        _mm256_storeu_ps(y + i, _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)));
    }
    for (; i < n; i++) y[i] = moetax_bf16_to_fp32(x[i]);
}

/* Round to nearest even on the bit pattern; NaN -> quiet NaN (as types.c). */
ALWAYS_INLINE __m256i fp32_to_bf16_8(__m256i u) {
    const __m256i abs = _mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff));
    const __m256i nan = _mm256_cmpgt_epi32(abs, _mm256_set1_epi32(0x7f800000));
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i rnd = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
    const __m256i qn = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(64));
    return _mm256_blendv_epi8(rnd, qn, nan);
}

void moetax_k_fp32_to_bf16_avx2(const float *x, uint16_t *y, int64_t n) {
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        const __m256i a = fp32_to_bf16_8(_mm256_loadu_si256((const __m256i *)(x + i)));
        const __m256i b = fp32_to_bf16_8(_mm256_loadu_si256((const __m256i *)(x + i + 8)));
        const __m256i p = _mm256_permute4x64_epi64(_mm256_packus_epi32(a, b), 0xd8);
        _mm256_storeu_si256((__m256i *)(y + i), p);
    }
    for (; i < n; i++) y[i] = moetax_fp32_to_bf16(x[i]);
}

void moetax_k_q8_0_to_fp32_avx2(const void *x, float *y, int64_t n) {
    const moetax_block_q8_0 *b = x;
    for (int64_t i = 0; i < n / 32; i++) {
        const __m256 d = _mm256_set1_ps(moetax_k_fp16_table[b[i].d]);
        for (int j = 0; j < 32; j += 8) {
            const __m256i q = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(b[i].qs + j)));
            _mm256_storeu_ps(y + i * 32 + j, _mm256_mul_ps(d, _mm256_cvtepi32_ps(q)));
        }
    }
}
