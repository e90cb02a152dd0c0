// ctest-labels: unit
/* test_sampler.c - greedy, top-k/top-p/min-p exclusion, the empirical
 * distribution against softmax, seeding, the repetition penalty, parameter
 * validation, and the time per sample on a 128k vocabulary. */
#include "moetax/sampler.h"
#include "testutil.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static struct moetax_sampler_params params(float temp, int32_t top_k, float top_p, float min_p, uint64_t seed) {
    struct moetax_sampler_params p = {.temp = temp, .top_k = top_k, .top_p = top_p, .min_p = min_p,
                                      .repeat_penalty = 1.0f, .repeat_last_n = 0, .seed = seed};
    return p;
}

static struct moetax_sampler *make(const struct moetax_sampler_params *p, int32_t n) {
    struct moetax_sampler *s = NULL;
    moetax_status st = moetax_sampler_init(p, n, &s);
    CHECK_MSG(st == MOETAX_OK, "%s", moetax_last_error());
    return s;
}

static int32_t ref_argmax(const float *l, int n) {
    int b = 0;
    for (int i = 1; i < n; i++)
        if (l[i] > l[b]) b = i;
    return b;
}

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* Pearson chi-square of counts against probabilities (cells with p > 0). */
static double chi2(const int *count, const double *p, int n, int draws) {
    double x = 0;
    for (int i = 0; i < n; i++) {
        if (p[i] <= 0) continue;
        double e = p[i] * draws;
        x += (count[i] - e) * (count[i] - e) / e;
    }
    return x;
}

static void softmax(const float *l, int n, double temp, double *p) {
    double m = -INFINITY, z = 0;
    for (int i = 0; i < n; i++) m = fmax(m, l[i]);
    for (int i = 0; i < n; i++) z += (p[i] = exp((l[i] - m) / temp));
    for (int i = 0; i < n; i++) p[i] /= z;
}

static void test_greedy(void) {
    float l[6] = {1.0f, 5.0f, 3.0f, 5.0f, -2.0f, 5.0f};
    struct moetax_sampler_params p = params(0.0f, 0, 1.0f, 0.0f, 1);
    struct moetax_sampler *s = make(&p, 6);
    if (!s) return;
    CHECK_EQ_INT(moetax_sampler_sample(s, l), 1); /* ties: lower id */
    float nan_l[6] = {NAN, 0.5f, NAN, 0.25f, -1.0f, NAN};
    CHECK_EQ_INT(moetax_sampler_sample(s, nan_l), 1);
    float ninf[6] = {-INFINITY, -INFINITY, -INFINITY, -INFINITY, NAN, -INFINITY};
    CHECK_EQ_INT(moetax_sampler_sample(s, ninf), 0);
    float nan0[6] = {NAN, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY}; /* nothing above -inf: id 0, */
    CHECK_EQ_INT(moetax_sampler_sample(s, nan0), 0);                            /* as one compare per id in order */
    moetax_sampler_free(s);
    p.temp = -1.0f; /* any temp <= 0 */
    s = make(&p, 6);
    CHECK_EQ_INT(moetax_sampler_sample(s, l), 1);
    moetax_sampler_free(s);

    /* vocabularies of every size around the 16-wide blocks, with NaNs, infinities and ties: the
     * first id of the largest value (what one compare per id in order gives) */
    {
        tu_rng rr = {17};
        float v[200];
        for (int trial = 0; trial < 3000; trial++) {
            const int nv = 1 + trial % 200;
            for (int i = 0; i < nv; i++) {
                const uint32_t k = (uint32_t)(tu_rand_u64(&rr) % 16);
                v[i] = k == 0 ? NAN : k == 1 ? -INFINITY : k == 2 && trial % 7 == 0 ? INFINITY
                     : trial % 2 ? tu_rand_normal(&rr) /* half the trials: few values, many ties */
                                 : (float)(int)(tu_rand_u64(&rr) % 9) - 4.0f;
            }
            int want = 0;
            float best = -INFINITY;
            for (int i = 0; i < nv; i++)
                if (v[i] > best) { best = v[i]; want = i; }
            struct moetax_sampler_params q = params(0.0f, 0, 1.0f, 0.0f, 1);
            struct moetax_sampler *sv = make(&q, nv);
            if (!sv) break;
            const int got = moetax_sampler_sample(sv, v);
            moetax_sampler_free(sv);
            CHECK_MSG(got == want, "greedy over %d ids (trial %d): %d, want %d", nv, trial, got, want);
            if (got != want) break;
        }
    }
    /* random vocabularies; filters do not change the argmax */
    tu_rng r = {11};
    int n = 50000;
    float *big = malloc(sizeof(float) * (size_t)n);
    for (int trial = 0; trial < 5; trial++) {
        for (int i = 0; i < n; i++) big[i] = 4.0f * tu_rand_normal(&r);
        struct moetax_sampler_params q = params(0.0f, trial * 10, trial ? 0.5f : 1.0f, trial ? 0.1f : 0.0f, 3);
        s = make(&q, n);
        CHECK_EQ_INT(moetax_sampler_sample(s, big), ref_argmax(big, n));
        moetax_sampler_free(s);
    }
    free(big);
}

static void test_top_k_1(void) {
    tu_rng r = {12};
    const float temps[] = {0.1f, 0.7f, 1.0f, 5.0f, 100.0f};
    float l[1000];
    for (int trial = 0; trial < 50; trial++) {
        for (int i = 0; i < 1000; i++) l[i] = tu_rand_normal(&r);
        if (trial % 5 == 0) l[999] = l[ref_argmax(l, 1000)]; /* a tie: the lower id wins */
        struct moetax_sampler_params p = params(temps[trial % 5], 1, 1.0f, 0.0f, (uint64_t)trial);
        struct moetax_sampler *s = make(&p, 1000);
        if (!s) return;
        for (int k = 0; k < 5; k++) CHECK_EQ_INT(moetax_sampler_sample(s, l), ref_argmax(l, 1000));
        moetax_sampler_free(s);
    }
}

/* A temperature whose inverse is infinite (1e-40): an even draw among the tied largest logits, other
 * tokens never (the draw always took the last of the tied ones: the top weight was 0 x inf = NaN). */
static void test_tiny_temp(void) {
    float l[64];
    for (int i = 0; i < 64; i++) l[i] = (float)(i % 7) * 0.25f;
    int hits[64] = {0};
    for (int seed = 0; seed < 400; seed++) {
        struct moetax_sampler_params p = params(1e-40f, 0, 1.0f, 0.0f, (uint64_t)seed);
        struct moetax_sampler *s = make(&p, 64);
        if (!s) return;
        hits[moetax_sampler_sample(s, l)]++;
        moetax_sampler_free(s);
    }
    int tied = 0, other = 0, least = 400;
    for (int i = 0; i < 64; i++) {
        if (i % 7 == 6) tied++, least = hits[i] < least ? hits[i] : least;
        else other += hits[i];
    }
    CHECK_EQ_INT(other, 0);
    CHECK_MSG(tied == 9 && least >= 15, "each of the 9 tied tokens drawn (the least %d of 400 times)", least);
}

static void test_seed(void) {
    float l[64];
    for (int i = 0; i < 64; i++) l[i] = 0.05f * (float)(i % 7);
    struct moetax_sampler_params p = params(1.0f, 0, 1.0f, 0.0f, 42);
    struct moetax_sampler *a = make(&p, 64), *b = make(&p, 64);
    p.seed = 43;
    struct moetax_sampler *c = make(&p, 64);
    if (!a || !b || !c) return;
    int32_t first[500];
    int same_ab = 0, same_ac = 0;
    for (int i = 0; i < 500; i++) {
        int32_t x = moetax_sampler_sample(a, l), y = moetax_sampler_sample(b, l), z = moetax_sampler_sample(c, l);
        first[i] = x;
        same_ab += x == y;
        same_ac += x == z;
    }
    CHECK_EQ_INT(same_ab, 500);
    CHECK_MSG(same_ac < 100, "seeds 42 and 43 agree on %d of 500 draws", same_ac);
    moetax_sampler_reset(a); /* reseeds: the same sequence again */
    int again = 0;
    for (int i = 0; i < 500; i++) again += moetax_sampler_sample(a, l) == first[i];
    CHECK_EQ_INT(again, 500);
    moetax_sampler_free(a);
    moetax_sampler_free(b);
    moetax_sampler_free(c);
}

static void test_distribution(void) {
    float l[8] = {0.0f, 1.0f, 2.0f, -1.0f, 0.5f, 3.0f, -2.0f, 1.5f};
    const int draws = 100000;
    /* df = 7: P(chi2 > 24.3) = 0.001; the draws are fixed by the seed */
    const float temps[] = {1.0f, 0.5f, 2.0f};
    for (int ti = 0; ti < 3; ti++) {
        struct moetax_sampler_params p = params(temps[ti], 0, 1.0f, 0.0f, 2024 + (uint64_t)ti);
        struct moetax_sampler *s = make(&p, 8);
        if (!s) return;
        int count[8] = {0};
        float copy[8];
        memcpy(copy, l, sizeof l);
        for (int i = 0; i < draws; i++) count[moetax_sampler_sample(s, l)]++;
        CHECK(memcmp(copy, l, sizeof l) == 0); /* logits untouched */
        double pr[8];
        softmax(l, 8, temps[ti], pr);
        double x = chi2(count, pr, 8, draws);
        printf("temp %.1f: chi2 = %.2f (df 7)\n", (double)temps[ti], x);
        CHECK_MSG(x < 24.3, "temp %g: chi2 %.2f", (double)temps[ti], x);
        moetax_sampler_free(s);
    }
    /* top-k 3 renormalizes over the three best */
    struct moetax_sampler_params p = params(1.0f, 3, 1.0f, 0.0f, 5);
    struct moetax_sampler *s = make(&p, 8);
    if (!s) return;
    int count[8] = {0};
    for (int i = 0; i < draws; i++) count[moetax_sampler_sample(s, l)]++;
    float top3[3] = {l[5], l[2], l[7]};
    double p3[3], pr[8] = {0};
    softmax(top3, 3, 1.0, p3);
    pr[5] = p3[0];
    pr[2] = p3[1];
    pr[7] = p3[2];
    double x = chi2(count, pr, 8, draws);
    CHECK_MSG(x < 13.8, "top-k 3: chi2 %.2f (df 2)", x);
    CHECK_EQ_INT(count[0] + count[1] + count[3] + count[4] + count[6], 0);
    moetax_sampler_free(s);
}

/* Draw many times; fail on any id not in allowed[]; count how many allowed ids were seen. */
static int draw_within(struct moetax_sampler *s, const float *l, const bool *allowed, int draws, int n) {
    int *seen = calloc((size_t)n, sizeof(int)), distinct = 0, bad = 0;
    for (int i = 0; i < draws; i++) {
        int32_t t = moetax_sampler_sample(s, l);
        if (t < 0 || t >= n || !allowed[t]) { bad++; continue; }
        if (!seen[t]++) distinct++;
    }
    CHECK_EQ_INT(bad, 0);
    free(seen);
    return distinct;
}

/* descending logit, lower id first (qsort has no context pointer) */
static const float *order_key;
static int cmp_order(const void *x, const void *y) {
    int a = *(const int *)x, b = *(const int *)y;
    if (order_key[a] != order_key[b]) return order_key[a] > order_key[b] ? -1 : 1;
    return (a > b) - (a < b);
}

static void test_filters(void) {
    /* small: probabilities 0.5, 0.3, 0.15, 0.05 in a shuffled order */
    float l[4];
    const double pr[4] = {0.15, 0.5, 0.05, 0.3};
    for (int i = 0; i < 4; i++) l[i] = (float)log(pr[i]);
    struct moetax_sampler_params p = params(1.0f, 0, 0.7f, 0.0f, 9); /* 0.5 + 0.3 crosses 0.7 */
    struct moetax_sampler *s = make(&p, 4);
    if (!s) return;
    bool allow_p[4] = {false, true, false, true};
    CHECK_EQ_INT(draw_within(s, l, allow_p, 20000, 4), 2);
    moetax_sampler_free(s);
    p = params(1.0f, 0, 0.8f, 0.0f, 9); /* exactly reaches 0.8 with two; float rounding may add the third */
    s = make(&p, 4);
    bool allow_p8[4] = {true, true, false, true};
    CHECK(draw_within(s, l, allow_p8, 20000, 4) >= 2);
    moetax_sampler_free(s);
    p = params(1.0f, 0, 1.0f, 0.2f, 9); /* min-p 0.2 * 0.5 = 0.1: drops 0.05 */
    s = make(&p, 4);
    bool allow_m[4] = {true, true, false, true};
    CHECK_EQ_INT(draw_within(s, l, allow_m, 20000, 4), 3);
    moetax_sampler_free(s);
    p = params(1.0f, 0, 1.0f, 0.7f, 9); /* min-p 0.7 * 0.5 = 0.35: only the best */
    s = make(&p, 4);
    bool allow_m1[4] = {false, true, false, false};
    CHECK_EQ_INT(draw_within(s, l, allow_m1, 2000, 4), 1);
    moetax_sampler_free(s);
    /* top-k then top-p: p renormalized over the top 3 (0.5, 0.3, 0.15)/0.95; 0.6 needs two */
    p = params(1.0f, 3, 0.6f, 0.0f, 9);
    s = make(&p, 4);
    CHECK_EQ_INT(draw_within(s, l, allow_p, 20000, 4), 2);
    moetax_sampler_free(s);

    /* large: 5000 logits (the quickselect path), hot temperature so the tails do get drawn */
    int n = 5000;
    float *big = malloc(sizeof(float) * (size_t)n);
    bool *allow = malloc((size_t)n);
    int *order = malloc(sizeof(int) * (size_t)n);
    tu_rng r = {77};
    for (int i = 0; i < n; i++) big[i] = 3.0f * tu_rand_normal(&r);
    /* reference order: descending logit, lower id first */
    for (int i = 0; i < n; i++) order[i] = i;
    order_key = big;
    qsort(order, (size_t)n, sizeof(int), cmp_order);
    /* top-k 50 */
    memset(allow, 0, (size_t)n);
    for (int i = 0; i < 50; i++) allow[order[i]] = true;
    p = params(50.0f, 50, 1.0f, 0.0f, 1);
    s = make(&p, n);
    CHECK_EQ_INT(draw_within(s, big, allow, 5000, n), 50);
    moetax_sampler_free(s);
    /* top-p 0.9 without top-k: the nucleus from a full reference sort */
    double mx = big[order[0]], z = 0, cum = 0;
    for (int i = 0; i < n; i++) z += exp(big[i] - mx);
    memset(allow, 0, (size_t)n);
    int nucleus = 0;
    for (int i = 0; i < n && cum < 0.9 * z; i++) {
        cum += exp(big[order[i]] - mx);
        allow[order[i]] = true;
        nucleus++;
    }
    /* one more at the boundary in case of float rounding */
    if (nucleus < n) allow[order[nucleus]] = true;
    p = params(1000.0f, 0, 0.9f, 0.0f, 2);
    s = make(&p, n);
    int d = draw_within(s, big, allow, 3000, n);
    printf("top-p 0.9: nucleus %d of %d tokens, %d distinct drawn\n", nucleus, n, d);
    CHECK(d > nucleus / 10);
    moetax_sampler_free(s);
    /* min-p 0.05 */
    double thr = mx + log(0.05);
    for (int i = 0; i < n; i++) allow[i] = big[i] >= thr - 1e-5;
    p = params(1000.0f, 0, 1.0f, 0.05f, 3);
    s = make(&p, n);
    CHECK(draw_within(s, big, allow, 3000, n) > 1);
    moetax_sampler_free(s);
    free(order);
    free(allow);
    free(big);
}

/* top-p keeps exactly the smallest prefix reaching p, the crossing token
 * included, on the quickselect path (no top-k, n > 32): compare the set drawn
 * at a very high temperature (close to uniform) with a reference sort. */
static void test_top_p_exact(void) {
    enum { N = 300 };
    float l[N];
    int order[N];
    bool allow[N];
    tu_rng r = {31};
    int checked = 0;
    for (int trial = 0; trial < 60; trial++) {
        for (int i = 0; i < N; i++) l[i] = 4.0f * tu_rand_normal(&r);
        for (int i = 0; i < N; i++) order[i] = i;
        order_key = l;
        qsort(order, N, sizeof(int), cmp_order);
        float top_p = 0.3f + 0.01f * (float)(trial % 60);
        double mx = l[order[0]], z = 0, cum = 0;
        for (int i = 0; i < N; i++) z += exp(l[i] - mx);
        int k = 0;
        double target = (double)top_p * z;
        while (k < N && cum < target) cum += exp(l[order[k++]] - mx);
        /* skip vectors where float rounding could move the boundary */
        double before = cum - exp(l[order[k - 1]] - mx);
        if (fabs(cum - target) < 1e-4 * z || fabs(before - target) < 1e-4 * z || k > 25) continue;
        memset(allow, 0, sizeof allow);
        for (int i = 0; i < k; i++) allow[order[i]] = true;
        struct moetax_sampler_params p = params(1e4f, 0, top_p, 0.0f, (uint64_t)trial);
        struct moetax_sampler *s = make(&p, N);
        if (!s) return;
        int d = draw_within(s, l, allow, 600, N);
        CHECK_MSG(d == k, "trial %d: top_p %.2f: %d of the %d nucleus tokens drawn", trial, (double)top_p, d, k);
        moetax_sampler_free(s);
        checked++;
    }
    CHECK(checked >= 20);
}

static void test_penalty(void) {
    struct moetax_sampler_params p = params(0.0f, 0, 1.0f, 0.0f, 1);
    p.repeat_penalty = 1.1f;
    p.repeat_last_n = 2;
    struct moetax_sampler *s = make(&p, 4);
    if (!s) return;
    float pos[4] = {2.0f, 1.9f, 0.0f, 0.0f};
    CHECK_EQ_INT(moetax_sampler_sample(s, pos), 0);
    moetax_sampler_accept(s, 0);
    CHECK_EQ_INT(moetax_sampler_sample(s, pos), 1); /* 2 / 1.1 = 1.82 < 1.9 */
    float close[4] = {2.0f, 1.7f, 0.0f, 0.0f};
    moetax_sampler_accept(s, 0);
    CHECK_EQ_INT(moetax_sampler_sample(s, close), 0); /* once per distinct token: 1.82 > 1.7 */
    moetax_sampler_accept(s, 2);
    moetax_sampler_accept(s, 3); /* 0 leaves the window of 2 */
    CHECK_EQ_INT(moetax_sampler_sample(s, pos), 0);
    moetax_sampler_accept(s, 99); /* out of range: ignored */
    moetax_sampler_accept(s, -1);
    float neg[4] = {-5.0f, -5.0f, -1.0f, -1.05f};
    CHECK_EQ_INT(moetax_sampler_sample(s, neg), 2); /* both penalized: -1.1 > -1.155 */
    moetax_sampler_reset(s);
    CHECK_EQ_INT(moetax_sampler_sample(s, neg), 2);
    moetax_sampler_accept(s, 2);
    CHECK_EQ_INT(moetax_sampler_sample(s, neg), 3); /* -1 * 1.1 = -1.1 < -1.05 */
    moetax_sampler_reset(s);
    float copy[4];
    memcpy(copy, pos, sizeof pos);
    moetax_sampler_accept(s, 0);
    (void)moetax_sampler_sample(s, pos);
    CHECK(memcmp(copy, pos, sizeof pos) == 0);
    moetax_sampler_free(s);
    /* penalty 1: off */
    p.repeat_penalty = 1.0f;
    s = make(&p, 4);
    moetax_sampler_accept(s, 0);
    CHECK_EQ_INT(moetax_sampler_sample(s, pos), 0);
    moetax_sampler_free(s);
}

static void expect_bad(struct moetax_sampler_params p, int32_t n, const char *field) {
    struct moetax_sampler *s = (struct moetax_sampler *)&p;
    moetax_status st = moetax_sampler_init(&p, n, &s);
    CHECK_MSG(st == MOETAX_ERR_ARG, "%s: got %s", field, moetax_status_name(st));
    CHECK(s == NULL);
    CHECK_MSG(strstr(moetax_last_error(), field) != NULL, "message \"%s\" lacks \"%s\"", moetax_last_error(), field);
    if (st == MOETAX_OK) moetax_sampler_free(s);
}

static void test_invalid(void) {
    struct moetax_sampler_params ok = moetax_sampler_default_params(), p;
    struct moetax_sampler *s = NULL;
    CHECK(moetax_sampler_init(&ok, 10, &s) == MOETAX_OK);
    moetax_sampler_free(s);
    p = ok; p.temp = NAN; expect_bad(p, 10, "temp");
    p = ok; p.temp = INFINITY; expect_bad(p, 10, "temp");
    p = ok; p.top_p = 0.0f; expect_bad(p, 10, "top_p");
    p = ok; p.top_p = 1.5f; expect_bad(p, 10, "top_p");
    p = ok; p.top_p = NAN; expect_bad(p, 10, "top_p");
    p = ok; p.min_p = NAN; expect_bad(p, 10, "min_p");
    p = ok; p.min_p = 1.5f; expect_bad(p, 10, "min_p");
    p = ok; p.repeat_penalty = -1.0f; expect_bad(p, 10, "repeat_penalty");
    p = ok; p.repeat_penalty = 0.0f; expect_bad(p, 10, "repeat_penalty");
    p = ok; p.repeat_penalty = NAN; expect_bad(p, 10, "repeat_penalty");
    p = ok; p.repeat_last_n = -1; expect_bad(p, 10, "repeat_last_n");
    expect_bad(ok, 0, "n_vocab");
    /* the documented "off" values are fine */
    p = ok; p.top_k = -5; p.min_p = -1.0f; p.top_p = 1.0f; p.temp = -3.0f;
    CHECK(moetax_sampler_init(&p, 10, &s) == MOETAX_OK);
    moetax_sampler_free(s);
}

/* Top-k on logits with ties, NaNs and infinities, k from 1 to n - 1: at a very high temperature
 * the tokens drawn are exactly the k best of a reference sort (larger logit, then lower id; NaN
 * as -inf), those with a finite logit each drawn, a +inf one alone. And the repetition penalty
 * gives the draws (one seed) of the same sampler without it on logits penalized here by the
 * documented rule (divided if positive, multiplied if <= 0, once per distinct token). */
/* The order of the top-k candidates among equal logits (lower id first) decides where top-p
 * cuts a tie: 40 tied logits at scattered ids, top-k 40, top-p 0.29 keep the 12 lowest of those
 * ids (0.29: 11 of 40 fall short, 12 reach it), through the block-bound selection (large vocabularies) and the heap (small ones); the
 * logits come ascending, descending or shuffled around them. */
static void test_top_k_tie_order(void) {
    static const int ns[] = {64, 300, 4099, 40000};
    tu_rng r = {23};
    for (size_t ni = 0; ni < sizeof ns / sizeof ns[0]; ni++) {
        const int n = ns[ni];
        float *l = malloc(sizeof(float) * (size_t)n);
        bool *allow = calloc((size_t)n, 1);
        int tied[40];
        for (int shape = 0; shape < 3; shape++) {
            for (int i = 0; i < n; i++)
                l[i] = shape == 0 ? -10.0f + 5.0f * (float)i / (float)n : shape == 1 ? -5.0f - 5.0f * (float)i / (float)n
                                                                            : -10.0f + 5.0f * tu_rand_uniform(&r);
            for (int j = 0; j < 40; j++) tied[j] = (int)((int64_t)(j * 7 + 3) * n / 283 % n);
            for (int j = 0; j < 40; j++) l[tied[j]] = 5.0f;
            int m = 0;
            for (int i = 0; i < n; i++) m += l[i] == 5.0f;
            CHECK_EQ_INT(m, 40);
            memset(allow, 0, (size_t)n);
            for (int i = 0, kept = 0; i < n && kept < 12; i++)
                if (l[i] == 5.0f) allow[i] = true, kept++;
            struct moetax_sampler_params pk = params(1.0f, 40, 0.29f, 0.0f, 3);
            struct moetax_sampler *s = make(&pk, n);
            if (!s) return;
            const int d = draw_within(s, l, allow, 3000, n);
            CHECK_MSG(d == 12, "n %d shape %d: %d distinct drawn of the 12 lowest tied ids", n, shape, d);
            moetax_sampler_free(s);
        }
        free(l);
        free(allow);
    }
}

static void test_top_k_paths(void) {
    static const int ns[] = {2, 3, 7, 41, 64, 1000, 4099};
    tu_rng r = {11};
    for (size_t ni = 0; ni < sizeof ns / sizeof ns[0]; ni++) {
        const int n = ns[ni];
        float *l = malloc(sizeof(float) * (size_t)n), *key = malloc(sizeof(float) * (size_t)n);
        float *pen = malloc(sizeof(float) * (size_t)n);
        int *order = malloc(sizeof(int) * (size_t)n);
        bool *allow = malloc((size_t)n);
        for (int variant = 0; variant < 4; variant++) {
            for (int i = 0; i < n; i++) l[i] = (float)(int)(4.0f * tu_rand_normal(&r)) * 0.5f; /* many ties */
            if (variant >= 1)
                for (int i = 0; i < n; i += 5) l[i] = NAN;
            if (variant >= 2)
                for (int i = 1; i < n; i += 7) l[i] = -INFINITY;
            if (variant == 3) l[n - 1] = l[n / 2] = INFINITY;
            for (int i = 0; i < n; i++) key[i] = l[i] == l[i] ? l[i] : -INFINITY, order[i] = i;
            order_key = key;
            qsort(order, (size_t)n, sizeof(int), cmp_order);
            const int ks[] = {1, 2, 8, n - 1};
            for (int ki = 0; ki < 4; ki++) {
                const int k = ks[ki];
                if (k < 1 || k >= n) continue;
                memset(allow, 0, (size_t)n);
                int finite = 0;
                for (int i = 0; i < k; i++) allow[order[i]] = true, finite += isfinite(key[order[i]]);
                struct moetax_sampler_params pk = params(1e4f, k, 1.0f, 0.0f, 5 + (uint64_t)ki);
                struct moetax_sampler *s = make(&pk, n);
                if (!s) return;
                const int d = draw_within(s, l, allow, k <= 8 ? 4000 : 200, n);
                if (variant == 3) CHECK_EQ_INT(d, 1); /* the first +inf, every time */
                else if (k <= 8) /* none finite: the argmax, token 0 (the header's rule) */
                    CHECK_MSG(d == (finite ? finite : 1), "n %d variant %d top-k %d: %d distinct drawn, %d finite", n,
                              variant, k, d, finite);
                moetax_sampler_free(s);

                /* the penalty: remembered tokens of positive, zero, negative, NaN and infinite logits */
                struct moetax_sampler_params pa = params(1.5f, k, 0.9f, 0.01f, 7 + (uint64_t)ki), pb = pa;
                pa.repeat_penalty = 1.25f;
                pa.repeat_last_n = 8;
                struct moetax_sampler *a = make(&pa, n), *b = make(&pb, n);
                if (!a || !b) return;
                memcpy(pen, l, sizeof(float) * (size_t)n);
                const int hist[] = {0, n - 1, n / 2, 1, n / 3, 0, n - 1, 2 % n};
                bool done[8] = {false};
                for (int h = 0; h < 8; h++) {
                    moetax_sampler_accept(a, hist[h]);
                    bool dup = false;
                    for (int g = 0; g < h; g++) dup |= hist[g] == hist[h];
                    if (dup || done[h]) continue;
                    const int t = hist[h];
                    pen[t] = pen[t] <= 0.0f ? pen[t] * 1.25f : pen[t] / 1.25f;
                }
                int differ = 0;
                for (int dd = 0; dd < 300; dd++) differ += moetax_sampler_sample(a, l) != moetax_sampler_sample(b, pen);
                CHECK_MSG(differ == 0, "n %d variant %d top-k %d: %d of 300 draws differ with the penalty", n,
                          variant, k, differ);
                moetax_sampler_free(a);
                moetax_sampler_free(b);
            }
        }
        free(l), free(key), free(pen), free(order), free(allow);
    }
}

static void test_speed(void) {
    int n = 129280; /* DeepSeek-V3's vocabulary */
    float *l = malloc(sizeof(float) * (size_t)n);
    tu_rng r = {5};
    for (int i = 0; i < n; i++) l[i] = 2.0f * tu_rand_normal(&r);
    struct { const char *name; struct moetax_sampler_params p; } cfg[] = {
        {"greedy", params(0.0f, 0, 1.0f, 0.0f, 1)},
        {"defaults (top-k 40)", moetax_sampler_default_params()},
        {"top-p 0.95 + min-p 0.05, no top-k", params(0.8f, 0, 0.95f, 0.05f, 1)},
        {"temp only", params(1.0f, 0, 1.0f, 0.0f, 1)},
    };
    cfg[1].p.repeat_penalty = 1.1f;
    for (size_t c = 0; c < sizeof cfg / sizeof cfg[0]; c++) {
        struct moetax_sampler *s = make(&cfg[c].p, n);
        if (!s) continue;
        for (int i = 0; i < 64; i++) moetax_sampler_accept(s, i * 7);
        int iters = 100;
        double t0 = now_s();
        for (int i = 0; i < iters; i++) {
            int32_t t = moetax_sampler_sample(s, l);
            CHECK(t >= 0 && t < n);
        }
        double us = (now_s() - t0) / iters * 1e6;
        printf("sample %-36s %8.1f us (n_vocab %d)\n", cfg[c].name, us, n);
        CHECK_MSG(us < 50000, "%s: %.0f us per sample", cfg[c].name, us);
        moetax_sampler_free(s);
    }
    free(l);
}

int main(int argc, char **argv) {
    tu_init(argc, argv);
    test_greedy();
    test_top_k_1();
    test_tiny_temp();
    test_seed();
    test_distribution();
    test_filters();
    test_top_p_exact();
    test_penalty();
    test_invalid();
    test_top_k_paths();
    test_top_k_tie_order();
    test_speed();
    return tu_finish("test_sampler");
}
