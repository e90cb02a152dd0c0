/*
 * sampler.c - penalties -> top-k -> top-p -> min-p -> temperature -> draw;
 * see moetax/sampler.h.
 *
 * Candidates are (logit, id) pairs. Ordering everywhere is "better" = larger
 * logit, then lower id, so every selection is deterministic.
 */
#include "moetax/sampler.h"

#include <math.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#define MAX_LAST_N (1 << 20)

struct tok {
    float logit;
    float w; /* exp(logit - max_logit), or with temperature for the draw */
    int32_t id;
};

struct moetax_sampler {
    struct moetax_sampler_params p;
    int32_t n_vocab;
    struct tok *cur; /* [n_vocab] working candidates */
    struct tok *sel; /* [n_vocab] selection output */
    uint8_t *seen;   /* [n_vocab] distinct-token marks for the penalty */
    int32_t *cand;   /* [n_vocab] top-k: the ids at or above the bound */
    uint32_t *keys;  /* [n_vocab] top-k: block maxima, then the candidates, as ordered keys */
    int32_t *hist;   /* [repeat_last_n] ring of accepted tokens */
    int32_t hist_n, hist_pos;
    uint64_t rng[4];
};

/* ---- PRNG: xoshiro256**, seeded by splitmix64 ---------------------------------- */

static uint64_t splitmix64(uint64_t *x) {
    uint64_t z = (*x += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }

static uint64_t rng_next(uint64_t *s) {
    uint64_t r = rotl(s[1] * 5, 7) * 9, t = s[1] << 17;
    s[2] ^= s[0];
    s[3] ^= s[1];
    s[1] ^= s[2];
    s[0] ^= s[3];
    s[2] ^= t;
    s[3] = rotl(s[3], 45);
    return r;
}

static double rng_uniform(uint64_t *s) { return (double)(rng_next(s) >> 11) * 0x1.0p-53; } /* [0, 1) */

/* ---- params ------------------------------------------------------------------------ */

struct moetax_sampler_params moetax_sampler_default_params(void) {
    struct moetax_sampler_params p = {
        .temp = 0.8f, .top_k = 40, .top_p = 0.95f, .min_p = 0.05f,
        .repeat_penalty = 1.0f, .repeat_last_n = 64, .seed = 0,
    };
    return p;
}

static moetax_status validate(const struct moetax_sampler_params *p, int32_t n_vocab) {
    if (n_vocab <= 0) return moetax_error(MOETAX_ERR_ARG, "sampler: n_vocab %d must be positive", (int)n_vocab);
    if (!isfinite(p->temp)) return moetax_error(MOETAX_ERR_ARG, "sampler: temp %g must be a finite number (<= 0: greedy)", (double)p->temp);
    if (!(p->top_p > 0.0f && p->top_p <= 1.0f))
        return moetax_error(MOETAX_ERR_ARG, "sampler: top_p %g must be in (0, 1] (1: off)", (double)p->top_p);
    if (isnan(p->min_p) || p->min_p > 1.0f)
        return moetax_error(MOETAX_ERR_ARG, "sampler: min_p %g must be <= 1 (<= 0: off)", (double)p->min_p);
    if (!(isfinite(p->repeat_penalty) && p->repeat_penalty > 0.0f))
        return moetax_error(MOETAX_ERR_ARG, "sampler: repeat_penalty %g must be a finite number > 0 (1: off)",
                            (double)p->repeat_penalty);
    if (p->repeat_last_n < 0 || p->repeat_last_n > MAX_LAST_N)
        return moetax_error(MOETAX_ERR_ARG, "sampler: repeat_last_n %d must be in [0, %d] (0: off)",
                            (int)p->repeat_last_n, MAX_LAST_N);
    return MOETAX_OK;
}

moetax_status moetax_sampler_init(const struct moetax_sampler_params *p, int32_t n_vocab,
                                  struct moetax_sampler **out) {
    *out = NULL;
    if (!p) return moetax_error(MOETAX_ERR_ARG, "sampler: params is NULL");
    moetax_status st = validate(p, n_vocab);
    if (st) return st;
    struct moetax_sampler *s = calloc(1, sizeof *s);
    if (!s) return moetax_error(MOETAX_ERR_NOMEM, "sampler: out of memory");
    s->p = *p;
    s->n_vocab = n_vocab;
    s->cur = malloc((size_t)n_vocab * sizeof *s->cur);
    s->sel = malloc((size_t)n_vocab * sizeof *s->sel);
    s->seen = calloc((size_t)n_vocab, 1);
    s->cand = malloc((size_t)n_vocab * sizeof *s->cand);
    s->keys = malloc((size_t)n_vocab * sizeof *s->keys);
    s->hist = malloc((size_t)(p->repeat_last_n > 0 ? p->repeat_last_n : 1) * sizeof *s->hist);
    if (!s->cur || !s->sel || !s->seen || !s->cand || !s->keys || !s->hist) {
        moetax_sampler_free(s);
        return moetax_error(MOETAX_ERR_NOMEM, "sampler: out of memory for %d tokens", (int)n_vocab);
    }
    moetax_sampler_reset(s);
    *out = s;
    return MOETAX_OK;
}

void moetax_sampler_free(struct moetax_sampler *s) {
    if (!s) return;
    free(s->cur);
    free(s->sel);
    free(s->seen);
    free(s->cand);
    free(s->keys);
    free(s->hist);
    free(s);
}

void moetax_sampler_reset(struct moetax_sampler *s) {
    s->hist_n = s->hist_pos = 0;
    uint64_t x = s->p.seed;
    for (int i = 0; i < 4; i++) s->rng[i] = splitmix64(&x);
}

void moetax_sampler_accept(struct moetax_sampler *s, int32_t tok) {
    if (tok < 0 || tok >= s->n_vocab || s->p.repeat_last_n <= 0) return;
    s->hist[s->hist_pos] = tok;
    s->hist_pos = (s->hist_pos + 1) % s->p.repeat_last_n;
    if (s->hist_n < s->p.repeat_last_n) s->hist_n++;
}

/* ---- selection ----------------------------------------------------------------------- */

static inline bool better(const struct tok *a, const struct tok *b) {
    return a->logit > b->logit || (a->logit == b->logit && a->id < b->id);
}

static int cmp_desc(const void *x, const void *y) {
    const struct tok *a = x, *b = y;
    return better(a, b) ? -1 : better(b, a) ? 1 : 0;
}

/* The heap h[0..i) (root = the worst) with x added as its element i. */
static void heap_add(struct tok *h, size_t i, struct tok x) {
    size_t j = i;
    while (j > 0 && better(&h[(j - 1) / 2], &x)) {
        h[j] = h[(j - 1) / 2];
        j = (j - 1) / 2;
    }
    h[j] = x;
}

/* x, better than the root of the full heap h[0..k), replaces it. */
static void heap_replace_root(struct tok *h, size_t k, struct tok x) {
    size_t j = 0;
    for (;;) {
        size_t c = 2 * j + 1;
        if (c >= k) break;
        if (c + 1 < k && better(&h[c], &h[c + 1])) c++;
        if (!better(&x, &h[c])) break;
        h[j] = h[c];
        j = c;
    }
    h[j] = x;
}

/* ---- top-k straight from the logits ---- */

/* A float's order as an unsigned key (larger float, larger key); NaN as -inf. */
static inline uint32_t fkey(float f) {
    if (f != f) f = -INFINITY;
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u & 0x80000000u ? ~u : u | 0x80000000u;
}

static inline float key_float(uint32_t k) {
    const uint32_t u = k & 0x80000000u ? k & 0x7fffffffu : ~k;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

#if defined(__SSE2__)
/* 4 keys (or one, broadcast) with the sign bit flipped: SSE2 compares int32 with sign, and this
 * keeps the keys' unsigned order */
static inline __m128i keys4(const uint32_t *p) {
    return _mm_xor_si128(_mm_loadu_si128((const __m128i *)(const void *)p), _mm_set1_epi32((int)0x80000000u));
}
static inline __m128i key1(uint32_t k) { return _mm_set1_epi32((int)(k ^ 0x80000000u)); }

/* the sum of the 4 lanes (counts) */
static inline uint32_t hsum4(__m128i acc) {
    acc = _mm_add_epi32(acc, _mm_shuffle_epi32(acc, 0x4e));
    acc = _mm_add_epi32(acc, _mm_shuffle_epi32(acc, 0xb1));
    return (uint32_t)_mm_cvtsi128_si32(acc);
}
#endif

/* The k-th largest of keys[0..m) (1 <= k <= m), by bisection over the key space: 32 counting
 * passes that branch the same way whatever the data, where a heap or a quickselect would
 * mispredict about every other comparison of a model's ever-changing logits. */
static uint32_t kth_key(const uint32_t *keys, size_t m, size_t k) {
    uint32_t lo = 0; /* count(keys >= lo) >= k holds */
    for (int bit = 31; bit >= 0; bit--) {
        const uint32_t t = lo | (uint32_t)1 << bit;
        size_t below = 0, i = 0; /* keys < t */
#if defined(__SSE2__)
        const __m128i vt = key1(t);
        __m128i acc = _mm_setzero_si128();
        for (; i + 4 <= m; i += 4) acc = _mm_sub_epi32(acc, _mm_cmpgt_epi32(vt, keys4(keys + i)));
        below = hsum4(acc);
#endif
        for (; i < m; i++) below += keys[i] < t;
        if (m - below >= k) lo = t;
    }
    return lo;
}

/* The k best (NaN as -inf) of the logits x[0..n) into dst[0..k), sorted best first (larger
 * logit, then lower id), 0 < k < n, with the sampler's scratch; false where the bound below
 * does not apply (then select_top_heap does it). A lower bound on the k-th largest logit is
 * the k-th largest of the maxima of the vocabulary's blocks (each is a logit, and k of them
 * are at least that large); the logits at or above it (vector compares, 4 at a time) are the
 * candidates, the exact k-th largest among them the threshold, and the k kept are ranked by
 * counting, all without data-dependent branches but the rare candidate. */
static bool select_top_bound(const float *x, size_t n, struct tok *dst, size_t k, int32_t *cand, uint32_t *keys) {
    size_t blk = 16;
    while (n / blk > 16 * k && blk < 4096) blk *= 2; /* about 8-16 k blocks: a short bisection */
    const size_t nb = n / blk;
    if (nb < 2 * k || k > 256) return false;
    for (size_t b = 0; b < nb; b++) {
        const float *xb = x + b * blk;
        float m = -INFINITY;
#if defined(__SSE2__)
        __m128 v0 = _mm_set1_ps(-INFINITY), v1 = v0, v2 = v0, v3 = v0; /* blk: a multiple of 16 */
        for (size_t j = 0; j < blk; j += 16) { /* NaN: the maximum so far is kept */
            v0 = _mm_max_ps(_mm_loadu_ps(xb + j), v0);
            v1 = _mm_max_ps(_mm_loadu_ps(xb + j + 4), v1);
            v2 = _mm_max_ps(_mm_loadu_ps(xb + j + 8), v2);
            v3 = _mm_max_ps(_mm_loadu_ps(xb + j + 12), v3);
        }
        __m128 v = _mm_max_ps(_mm_max_ps(v0, v1), _mm_max_ps(v2, v3));
        v = _mm_max_ps(v, _mm_movehl_ps(v, v));
        v = _mm_max_ss(v, _mm_shuffle_ps(v, v, 1));
        m = _mm_cvtss_f32(v);
#else
        for (size_t j = 0; j < blk; j++) m = xb[j] > m ? xb[j] : m;
#endif
        keys[b] = fkey(m);
    }
    const float lb = key_float(kth_key(keys, nb, k));
    if (!(lb > -INFINITY)) return false; /* fewer than k finite maxima: NaN and -inf need the heap's order */
    /* only blocks whose maximum reaches the bound hold candidates (about k of them), and
     * the tail past the last whole block */
    const uint32_t klb = fkey(lb);
    size_t nl = 0;
    for (size_t b = 0; b < nb; b++) {
        cand[nl] = (int32_t)b;
        nl += keys[b] >= klb;
    }
    int32_t *const blocks = cand + n - nl; /* moved to the end: cand[0..m) fills from the front */
    memmove(blocks, cand, nl * sizeof *cand);
    size_t m = 0;
    for (size_t l = 0; l <= nl; l++) {
        const size_t i0 = l < nl ? (size_t)blocks[l] * blk : nb * blk, i1 = l < nl ? i0 + blk : n;
        size_t i = i0;
#if defined(__SSE2__)
        const __m128 vlb = _mm_set1_ps(lb);
        for (; i + 4 <= i1; i += 4) {
            const int mask = _mm_movemask_ps(_mm_cmpge_ps(_mm_loadu_ps(x + i), vlb));
            for (int b = 0; b < 4; b++) {
                cand[m] = (int32_t)(i + (size_t)b);
                m += (size_t)(mask >> b & 1);
            }
        }
#endif
        for (; i < i1; i++) {
            cand[m] = (int32_t)i;
            m += x[i] >= lb;
        }
    }
    if (m < k) return false; /* cannot happen for a true bound; kept as a guard */
    for (size_t j = 0; j < m; j++) keys[j] = fkey(x[cand[j]]);
    const uint32_t kk = kth_key(keys, m, k);
    size_t above = 0; /* candidates strictly better than the k-th value */
    for (size_t j = 0; j < m; j++) above += keys[j] > kk;
    size_t o = 0, ties = k - above; /* equal to it: the lowest ids (cand is in id order) */
    for (size_t j = 0; j < m && o < k; j++) {
        const bool take = keys[j] > kk || (keys[j] == kk && ties > 0);
        ties -= keys[j] == kk && ties > 0;
        dst[o] = (struct tok){.logit = key_float(keys[j]), .id = cand[j]};
        keys[o] = keys[j];
        o += take;
    }
    /* rank the k by counting: better = larger key, or the same key and a lower id (earlier) */
    for (size_t a = 0; a < k; a++) {
        size_t r = 0, b = 0;
#if defined(__SSE2__)
        const __m128i va = key1(keys[a]), ia = _mm_set1_epi32((int)a), step = _mm_set1_epi32(4);
        __m128i ib = _mm_setr_epi32(0, 1, 2, 3), acc = _mm_setzero_si128();
        for (; b + 4 <= k; b += 4) {
            const __m128i vb = keys4(keys + b);
            const __m128i better = _mm_or_si128(_mm_cmpgt_epi32(vb, va),
                                                _mm_and_si128(_mm_cmpeq_epi32(vb, va), _mm_cmpgt_epi32(ia, ib)));
            acc = _mm_sub_epi32(acc, better);
            ib = _mm_add_epi32(ib, step);
        }
        r = hsum4(acc);
#endif
        for (; b < k; b++) r += keys[b] > keys[a] || (keys[b] == keys[a] && b < a);
        cand[r] = (int32_t)a;
    }
    for (size_t r = 0; r < k; r++) {
        const size_t a = (size_t)cand[r];
        dst[k + r] = dst[a];
    }
    memmove(dst, dst + k, k * sizeof *dst);
    return true;
}

/* The same selection with a min-heap of the k best so far (root = worst kept); after the
 * first k, a logit enters only if it is larger than the root (an equal one has a larger id,
 * so it is not better), which a vector compare finds 4 at a time. For any k and any logits
 * (NaN, -inf); dst needs room for k. */
static void select_top_heap(const float *x, size_t n, struct tok *dst, size_t k) {
    for (size_t i = 0; i < k; i++)
        heap_add(dst, i, (struct tok){.logit = x[i] == x[i] ? x[i] : -INFINITY, .id = (int32_t)i});
    size_t i = k;
#if defined(__SSE2__)
    for (; i + 4 <= n; i += 4) {
        const int m = _mm_movemask_ps(_mm_cmpgt_ps(_mm_loadu_ps(x + i), _mm_set1_ps(dst[0].logit)));
        if (!m) continue; /* most of a vocabulary */
        for (int b = 0; b < 4; b++) /* the root may rise after each entry */
            if ((m >> b & 1) && x[i + b] > dst[0].logit)
                heap_replace_root(dst, k, (struct tok){.logit = x[i + b], .id = (int32_t)(i + b)});
    }
#endif
    for (; i < n; i++)
        if (x[i] > dst[0].logit) heap_replace_root(dst, k, (struct tok){.logit = x[i], .id = (int32_t)i});
    for (size_t m = k; m > 1; m--) { /* heap sort: the worst to the end, best first */
        const struct tok w = dst[0];
        heap_replace_root(dst, m - 1, dst[m - 1]);
        dst[m - 1] = w;
    }
}

/* Move the best of three positions to the end of [lo, hi) as the pivot, split
 * [lo, hi - 1) into better | worse, put the pivot between them. Returns its
 * position m; *mass = sum of w over [lo, m). */
static size_t partition(struct tok *c, size_t lo, size_t hi, double *mass) {
    size_t a = lo, b = lo + (hi - lo) / 2, z = hi - 1, med;
    if (better(&c[a], &c[b])) med = better(&c[b], &c[z]) ? b : (better(&c[a], &c[z]) ? z : a);
    else med = better(&c[a], &c[z]) ? a : (better(&c[b], &c[z]) ? z : b);
    struct tok t = c[med];
    c[med] = c[z];
    c[z] = t;
    const struct tok pv = c[z];
    size_t i = lo;
    double m = 0.0;
    for (size_t j = lo; j < z; j++) {
        if (better(&c[j], &pv)) {
            m += c[j].w;
            t = c[i];
            c[i] = c[j];
            c[j] = t;
            i++;
        }
    }
    c[z] = c[i];
    c[i] = pv;
    *mass = m;
    return i;
}

/* Smallest k such that the k best of c[0..n) have w summing to >= target;
 * leaves those k in c[0..k) (in no particular order). Quickselect: expected
 * O(n), no full sort. */
static size_t nucleus(struct tok *c, size_t n, double target) {
    size_t lo = 0, hi = n;
    double acc = 0.0; /* mass of c[0..lo), all better than c[lo..) */
    while (hi - lo > 32) {
        double up;
        size_t m = partition(c, lo, hi, &up);
        if (acc + up >= target) {
            hi = m;
        } else if (acc + up + c[m].w >= target) {
            return m + 1;
        } else {
            acc += up + c[m].w;
            lo = m + 1;
        }
    }
    qsort(c + lo, hi - lo, sizeof *c, cmp_desc);
    for (size_t i = lo; i < hi; i++) {
        acc += c[i].w;
        if (acc >= target) return i + 1;
    }
    return hi; /* rounding: everything that is left */
}

/* The first index of the largest value, NaN never winning (0 when none is above -inf): what one
 * compare per value in order gives, without that compare chain's dependency through every value:
 * the maximum over independent running maxima, then the first index that holds it. */
static size_t argmax_first(const float *x, size_t n) {
    float mx = -INFINITY;
    size_t i = 0;
#if defined(__SSE2__)
    __m128 m0 = _mm_set1_ps(-INFINITY), m1 = m0, m2 = m0, m3 = m0;
    for (; i + 16 <= n; i += 16) { /* maxps(v, m) is m where v is NaN */
        m0 = _mm_max_ps(_mm_loadu_ps(x + i), m0);
        m1 = _mm_max_ps(_mm_loadu_ps(x + i + 4), m1);
        m2 = _mm_max_ps(_mm_loadu_ps(x + i + 8), m2);
        m3 = _mm_max_ps(_mm_loadu_ps(x + i + 12), m3);
    }
    float t[4];
    _mm_storeu_ps(t, _mm_max_ps(_mm_max_ps(m0, m1), _mm_max_ps(m2, m3)));
    for (int j = 0; j < 4; j++) mx = t[j] > mx ? t[j] : mx;
#endif
    for (; i < n; i++) mx = x[i] > mx ? x[i] : mx;
    if (!(mx > -INFINITY)) return 0;
    i = 0;
#if defined(__SSE2__)
    const __m128 v = _mm_set1_ps(mx);
    for (; i + 4 <= n; i += 4) {
        const int k = _mm_movemask_ps(_mm_cmpeq_ps(_mm_loadu_ps(x + i), v));
        if (k) return i + (size_t)__builtin_ctz((unsigned)k);
    }
#endif
    for (; i < n; i++)
        if (x[i] == mx) return i;
    return 0;
}

int32_t moetax_sampler_sample(struct moetax_sampler *s, const float *logits) {
    const struct moetax_sampler_params *p = &s->p;
    size_t n = (size_t)s->n_vocab;
    const bool penalize = p->repeat_penalty != 1.0f && s->hist_n > 0;
    const bool top_k = p->temp > 0.0f && p->top_k > 0 && (size_t)p->top_k < n;
    const float *x = logits;
    if (penalize) { /* 1. the penalized logits in a copy, in room the next stage does not write */
        float *pl = (float *)(void *)(top_k ? s->cur : s->sel); /* n floats fit in n candidates */
        memcpy(pl, logits, n * sizeof *pl);
        for (int32_t i = 0; i < s->hist_n; i++) {
            const int32_t t = s->hist[i];
            if (s->seen[t]) continue;
            s->seen[t] = 1;
            if (pl[t] <= 0.0f) pl[t] *= p->repeat_penalty; /* a NaN stays NaN: -inf below, as it is there */
            else pl[t] /= p->repeat_penalty;
        }
        for (int32_t i = 0; i < s->hist_n; i++) s->seen[s->hist[i]] = 0;
        x = pl;
    }
    if (p->temp <= 0.0f) return (int32_t)argmax_first(x, n);

    struct tok *cur = s->cur;
    size_t best = 0;
    float max_logit = -INFINITY; /* NaN never compares greater: it never wins */
    bool sorted = false;
    if (top_k) { /* 2. top-k straight from the logits */
        if (!select_top_bound(x, n, s->sel, (size_t)p->top_k, s->cand, s->keys))
            select_top_heap(x, n, s->sel, (size_t)p->top_k);
        n = (size_t)p->top_k;
        cur = s->sel;
        s->sel = s->cur;
        s->cur = cur;
        sorted = true;
        max_logit = cur[0].logit; /* the best: the largest logit, the lowest id among ties */
        best = (size_t)cur[0].id;
    } else {
        for (size_t i = 0; i < n; i++) {
            const float l = x[i];
            cur[i].logit = l == l ? l : -INFINITY;
            cur[i].id = (int32_t)i;
            if (l > max_logit) { max_logit = l; best = i; }
        }
    }
    if (!isfinite(max_logit)) return (int32_t)best;

    /* 3. top-p over the softmax (before temperature) of the remaining candidates */
    if (p->top_p < 1.0f && n > 1) {
        double z = 0.0;
        for (size_t i = 0; i < n; i++) z += cur[i].w = expf(cur[i].logit - max_logit);
        double target = (double)p->top_p * z;
        if (sorted) {
            double cum = 0.0;
            size_t keep = n;
            for (size_t i = 0; i < n; i++) {
                cum += cur[i].w;
                if (cum >= target) { keep = i + 1; break; }
            }
            n = keep;
        } else {
            n = nucleus(cur, n, target);
        }
    }

    /* 4. min-p relative to the largest logit (always still a candidate) */
    if (p->min_p > 0.0f) {
        float thr = max_logit + logf(p->min_p);
        size_t o = 0;
        for (size_t i = 0; i < n; i++)
            if (cur[i].logit >= thr) cur[o++] = cur[i];
        n = o;
    }

    /* 5. temperature and 6. draw */
    float inv_t = 1.0f / p->temp;
    /* a temperature so small that 1/temp is infinite (below ~2.9e-39): the limit, an even draw among the
     * largest logits (the top logit's weight was 0 x inf = NaN, and the draw always took the last of them) */
    const bool limit = !isfinite(inv_t);
    double z = 0.0;
    for (size_t i = 0; i < n; i++)
        z += cur[i].w = limit ? (cur[i].logit >= max_logit ? 1.0f : 0.0f) : expf((cur[i].logit - max_logit) * inv_t);
    double u = rng_uniform(s->rng) * z, cum = 0.0;
    size_t last = 0;
    for (size_t i = 0; i < n; i++) {
        if (cur[i].w <= 0.0f) continue;
        last = i;
        cum += cur[i].w;
        if (u < cum) return cur[i].id;
    }
    return cur[last].id; /* u rounded up to z */
}
