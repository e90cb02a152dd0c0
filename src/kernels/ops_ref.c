/* ops_ref.c - scalar reference vector ops (F32): norms, activations, top-k,
 * RoPE, combine, BLAS-1, and row conversions. Plain C11. */
#include "kernels_impl.h"

#include <math.h>

#include "moetax/types.h"

void moetax_k_rmsnorm_ref(float *out, const float *x, const float *w, int64_t n, float eps) {
    double ss = 0.0;
    for (int64_t i = 0; i < n; i++) ss += (double)x[i] * (double)x[i];
    const float scale = n > 0 ? (float)(1.0 / sqrt(ss / (double)n + (double)eps)) : 0.0f;
    for (int64_t i = 0; i < n; i++) out[i] = x[i] * scale * (w ? w[i] : 1.0f);
}

void moetax_k_softmax_ref(float *x, int64_t n, float ms[2]) {
    if (n <= 0) return;
    float max = x[0];
    for (int64_t i = 1; i < n; i++) max = fmaxf(max, x[i]);
    double sum = 0.0;
    for (int64_t i = 0; i < n; i++) {
        x[i] = expf(x[i] - max);
        sum += x[i];
    }
    const float inv = (float)(1.0 / sum);
    for (int64_t i = 0; i < n; i++) x[i] *= inv;
    if (ms) ms[0] = max, ms[1] = (float)sum;
}

void moetax_k_sigmoid_ref(float *x, int64_t n) {
    for (int64_t i = 0; i < n; i++) x[i] = 1.0f / (1.0f + expf(-x[i]));
}

/* a ranks above b (value, then lower index); NaN ranks below everything. */
static inline int ranks_above(float a, int64_t ia, float b, int64_t ib) {
    if (isnan(a)) return isnan(b) && ia < ib;
    if (isnan(b)) return 1;
    return a > b || (a == b && ia < ib);
}

void moetax_k_topk_ref(const float *x, int64_t n, int64_t k, int32_t *idx, float *val) {
    if (k > n) k = n;
    int64_t cnt = 0;
    for (int64_t i = 0; i < n && k > 0; i++) {
        const float v = x[i];
        if (cnt == k && !ranks_above(v, i, x[idx[k - 1]], idx[k - 1])) continue;
        int64_t pos = cnt < k ? cnt++ : k - 1; /* slot to fill, then bubble up */
        while (pos > 0 && ranks_above(v, i, x[idx[pos - 1]], idx[pos - 1])) {
            idx[pos] = idx[pos - 1];
            pos--;
        }
        idx[pos] = (int32_t)i;
    }
    if (val)
        for (int64_t j = 0; j < k; j++) val[j] = x[idx[j]];
}

void moetax_k_silu_mul_ref(float *out, const float *g, const float *u, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        const float gi = g[i];
        out[i] = gi / (1.0f + expf(-gi)) * u[i];
    }
}

void moetax_k_rope_cached_ref(float *x, int64_t n_head, int64_t head_stride, int n_dims,
                              enum moetax_rope_mode mode, const float *cs) {
    const int half = n_dims / 2;
    for (int64_t h = 0; h < n_head; h++) {
        float *xh = x + h * head_stride;
        for (int i = 0; i < half; i++) {
            const int a = mode == MOETAX_ROPE_MODE_NEOX ? i : 2 * i;
            const int b = mode == MOETAX_ROPE_MODE_NEOX ? i + half : 2 * i + 1;
            const float c = cs[2 * i], s = cs[2 * i + 1];
            const float x0 = xh[a], x1 = xh[b];
            xh[a] = x0 * c - x1 * s;
            xh[b] = x0 * s + x1 * c;
        }
    }
}

void moetax_k_rope_ref(float *x, int64_t n_head, int64_t head_stride, int64_t pos,
                       const struct moetax_rope_params *p) {
    float cs[MOETAX_ROPE_MAX_DIMS];
    const int n_dims = p->n_dims > MOETAX_ROPE_MAX_DIMS ? MOETAX_ROPE_MAX_DIMS : p->n_dims & ~1;
    struct moetax_rope_params q = *p;
    q.n_dims = n_dims;
    moetax_rope_cache(&q, pos, cs);
    moetax_k_rope_cached_ref(x, n_head, head_stride, n_dims, p->mode, cs);
}

void moetax_k_scatter_add_ref(float *dst, int64_t ld_dst, const float *src, int64_t ld_src, const int32_t *rows,
                              const float *w, int64_t n_rows, int64_t n) {
    for (int64_t i = 0; i < n_rows; i++) {
        float *d = dst + (rows ? (int64_t)rows[i] : i) * ld_dst;
        const float *s = src + i * ld_src;
        for (int64_t j = 0; j < n; j++) d[j] += w[i] * s[j];
    }
}

float moetax_k_dot_ref(const float *a, const float *b, int64_t n) {
    double acc = 0.0;
    for (int64_t i = 0; i < n; i++) acc += (double)a[i] * (double)b[i];
    return (float)acc;
}

void moetax_k_axpy_ref(float *y, float a, const float *x, int64_t n) {
    for (int64_t i = 0; i < n; i++) y[i] += a * x[i];
}

void moetax_k_wsum_ref(float *out, int64_t ld_out, const float *p, int64_t ld_p, int64_t nh, const float *v,
                       int64_t ld_v, int64_t np, int64_t n, bool acc) {
    for (int64_t h = 0; h < nh; h++)
        for (int64_t c = 0; c < n; c++) {
            float s = acc ? out[h * ld_out + c] : 0.0f;
            for (int64_t j = 0; j < np; j++) s = fmaf(p[h * ld_p + j], v[j * ld_v + c], s);
            out[h * ld_out + c] = s;
        }
}

void moetax_k_scale_ref(float *x, float a, int64_t n) {
    for (int64_t i = 0; i < n; i++) x[i] *= a;
}

void moetax_k_fp16_to_fp32_ref(const uint16_t *x, float *y, int64_t n) {
    for (int64_t i = 0; i < n; i++) y[i] = moetax_fp16_to_fp32(x[i]);
}

void moetax_k_fp32_to_fp16_ref(const float *x, uint16_t *y, int64_t n) {
    for (int64_t i = 0; i < n; i++) y[i] = moetax_fp32_to_fp16(x[i]);
}

void moetax_k_bf16_to_fp32_ref(const uint16_t *x, float *y, int64_t n) {
    for (int64_t i = 0; i < n; i++) y[i] = moetax_bf16_to_fp32(x[i]);
}

void moetax_k_fp32_to_bf16_ref(const float *x, uint16_t *y, int64_t n) {
    for (int64_t i = 0; i < n; i++) y[i] = moetax_fp32_to_bf16(x[i]);
}

void moetax_k_q8_0_to_fp32_ref(const void *x, float *y, int64_t n) { moetax_dequantize_row_q8_0_ref(x, y, n); }
