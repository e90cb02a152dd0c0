/* membw.c - read bandwidth (the roofline); see moetax/membw.h. */
#include "moetax/membw.h"

#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#define MEMBW_PAGE 4096u

#if defined(__x86_64__) || defined(__i386__)
#define MEMBW_HAVE_AVX2 1
uint64_t moetax_membw_sum_avx2(const void *buf, size_t bytes); /* membw_avx2.c */
#endif

uint64_t moetax_membw_sum_ref(const void *buf, size_t bytes) {
    const uint8_t *p = buf;
    uint64_t s0 = 0, s1 = 0, s2 = 0, s3 = 0;
    size_t i = 0;
    for (; i + 32 <= bytes; i += 32) {
        uint64_t v[4];
        memcpy(v, p + i, 32);
        s0 += v[0];
        s1 += v[1];
        s2 += v[2];
        s3 += v[3];
    }
    uint64_t s = s0 + s1 + s2 + s3;
    for (; i + 8 <= bytes; i += 8) {
        uint64_t v;
        memcpy(&v, p + i, 8);
        s += v;
    }
    for (; i < bytes; i++) s += p[i];
    return s;
}

/* ---- kernel choice, once -------------------------------------------------- */

typedef uint64_t (*membw_sum_fn)(const void *buf, size_t bytes);
static membw_sum_fn g_sum = moetax_membw_sum_ref;
static const char *g_sum_name = "ref";
static pthread_once_t g_once = PTHREAD_ONCE_INIT;

static void choose_kernel(void) {
    const char *ref = getenv("MOETAX_FORCE_REF");
    if (ref && *ref && strcmp(ref, "0") != 0) return;
#ifdef MEMBW_HAVE_AVX2
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2")) {
        g_sum = moetax_membw_sum_avx2;
        g_sum_name = "avx2";
    }
#endif
}

uint64_t moetax_membw_sum(const void *buf, size_t bytes) {
    pthread_once(&g_once, choose_kernel);
    return g_sum(buf, bytes);
}

const char *moetax_membw_kernel_name(void) {
    pthread_once(&g_once, choose_kernel);
    return g_sum_name;
}

/* ---- the measurement -------------------------------------------------------- */

struct membw_ctx {
    struct moetax_pool *pool;
    uint8_t *buf;
    size_t bytes, share; /* share: per worker, 4 KiB aligned; the last takes the rest */
    bool touch;          /* write the buffer first (the first run over a new buffer) */
    uint64_t t0, t1;     /* the pass's start and end, written by worker 0 */
    uint64_t *sink;      /* [nth * 8]: one cache line per worker */
};

static void membw_range(const struct membw_ctx *c, int ith, int nth, uint8_t **p, size_t *n) {
    size_t off = c->share * (size_t)ith;
    size_t end = ith == nth - 1 ? c->bytes : off + c->share;
    *p = c->buf + off;
    *n = end - off;
}

static void membw_fn(void *vctx, int ith, int nth) {
    struct membw_ctx *c = vctx;
    uint8_t *p;
    size_t n;
    membw_range(c, ith, nth, &p, &n);
    /* First touch by the reader: pages exist (not the zero page), on its node. */
    if (c->touch) memset(p, 0x5a + ith, n);
    moetax_pool_barrier(c->pool, ith);
    if (ith == 0) c->t0 = moetax_pool_now_ns();
    const uint64_t acc = moetax_membw_sum(p, n);
    moetax_pool_barrier(c->pool, ith);
    if (ith == 0) c->t1 = moetax_pool_now_ns();
    c->sink[(size_t)ith * 8] = acc;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* One pass of all workers over c (timed between barriers) and the sums consumed. */
static void run_pass(struct membw_ctx *c) {
    moetax_pool_run(c->pool, membw_fn, c);
    uint64_t check = 0;
    for (int i = 0; i < moetax_pool_n_threads(c->pool); i++) check += c->sink[(size_t)i * 8];
    volatile uint64_t consume = check; /* the sums are used */
    (void)consume;
}

moetax_status moetax_membw_pass(struct moetax_pool *pool, const void *buf, size_t bytes, double *gbps) {
    if (!pool || !buf || !bytes || !gbps)
        return moetax_error(MOETAX_ERR_ARG, "moetax_membw_pass: pool, buf, bytes > 0 and gbps are required");
    const int nth = moetax_pool_n_threads(pool);
    uint64_t *sink = calloc((size_t)nth * 8, sizeof *sink);
    if (!sink) return moetax_error(MOETAX_ERR_NOMEM, "moetax_membw_pass: out of memory");
    struct membw_ctx c = {.pool = pool, .buf = (uint8_t *)buf, .bytes = bytes, .sink = sink,
                          .share = bytes / (size_t)nth / MEMBW_PAGE * MEMBW_PAGE, .touch = false};
    run_pass(&c);
    free(sink);
    *gbps = (double)bytes / (double)(c.t1 > c.t0 ? c.t1 - c.t0 : 1); /* bytes per ns == GB/s */
    return MOETAX_OK;
}

/* ---- a reusable probe: one buffer of its own, written once ---------------------------- */

struct moetax_membw_probe {
    struct moetax_pool *pool;
    struct moetax_huge_buf mem;
    size_t bytes;
    uint8_t *buf;
};

moetax_status moetax_membw_probe_new(struct moetax_pool *pool, size_t bytes, struct moetax_membw_probe **out) {
    *out = NULL;
    if (!pool || bytes < MEMBW_PAGE)
        return moetax_error(MOETAX_ERR_ARG, "moetax_membw_probe_new: need a pool and bytes >= %u (got %zu)", MEMBW_PAGE,
                            bytes);
    const int nth = moetax_pool_n_threads(pool);
    struct moetax_membw_probe *p = calloc(1, sizeof *p);
    uint64_t *sink = calloc((size_t)nth * 8, sizeof *sink);
    if (!p || !sink) {
        free(p), free(sink);
        return moetax_error(MOETAX_ERR_NOMEM, "moetax_membw_probe_new: out of memory");
    }
    p->buf = moetax_huge_alloc(bytes, &p->mem); /* 2 MiB pages, like the weights' copies */
    if (!p->buf) {
        moetax_status st = moetax_error(MOETAX_ERR_NOMEM, "moetax_membw_probe_new: mmap of %zu bytes: %s", bytes,
                                        strerror(errno));
        free(p), free(sink);
        return st;
    }
    p->pool = pool;
    p->bytes = bytes;
    /* first touch by the workers that read it, and an untimed warm-up pass */
    struct membw_ctx c = {.pool = pool, .buf = p->buf, .bytes = bytes, .sink = sink,
                          .share = bytes / (size_t)nth / MEMBW_PAGE * MEMBW_PAGE, .touch = true};
    run_pass(&c);
    free(sink);
    *out = p;
    return MOETAX_OK;
}

moetax_status moetax_membw_probe_pass(struct moetax_membw_probe *p, double *gbps) {
    return moetax_membw_pass(p->pool, p->buf, p->bytes, gbps);
}

void moetax_membw_probe_free(struct moetax_membw_probe *p) {
    if (!p) return;
    moetax_huge_free(&p->mem);
    free(p);
}

/* ---- the measurement: a probe, reps passes, the median ------------------------------- */

moetax_status moetax_membw_read_ex(struct moetax_pool *pool, size_t bytes, int reps,
                                   struct moetax_membw_result *out) {
    if (!pool || !out) return moetax_error(MOETAX_ERR_ARG, "moetax_membw_read: pool and out are required");
    if (bytes < MEMBW_PAGE || reps < 1)
        return moetax_error(MOETAX_ERR_ARG, "moetax_membw_read: need bytes >= %u and reps >= 1 (got %zu, %d)",
                            MEMBW_PAGE, bytes, reps);
    memset(out, 0, sizeof *out);
    double *g = calloc((size_t)reps, sizeof *g);
    if (!g) return moetax_error(MOETAX_ERR_NOMEM, "moetax_membw_read: out of memory");
    struct moetax_membw_probe *p = NULL;
    moetax_status st = moetax_membw_probe_new(pool, bytes, &p);
    for (int r = 0; !st && r < reps; r++) st = moetax_membw_probe_pass(p, &g[r]);
    moetax_membw_probe_free(p);
    if (!st) {
        qsort(g, (size_t)reps, sizeof *g, cmp_double);
        out->gbps_median = reps % 2 ? g[reps / 2] : 0.5 * (g[reps / 2 - 1] + g[reps / 2]);
        out->gbps_min = g[0];
        out->gbps_max = g[reps - 1];
        out->bytes = bytes;
        out->threads = moetax_pool_n_threads(pool);
        out->reps = reps;
        out->kernel = moetax_membw_kernel_name();
        if (!isfinite(out->gbps_median) || out->gbps_median <= 0)
            st = moetax_error(MOETAX_ERR_INTERNAL, "moetax_membw_read: bad measurement %g GB/s", out->gbps_median);
    }
    free(g);
    return st;
}

moetax_status moetax_membw_read(struct moetax_pool *pool, size_t bytes, int reps, double *gbps_median) {
    if (!gbps_median) return moetax_error(MOETAX_ERR_ARG, "moetax_membw_read: gbps_median is NULL");
    struct moetax_membw_result r;
    moetax_status st = moetax_membw_read_ex(pool, bytes, reps, &r);
    if (st == MOETAX_OK) *gbps_median = r.gbps_median;
    return st;
}
