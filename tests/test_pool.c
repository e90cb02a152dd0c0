// ctest-labels: unit;threads
/* test_pool.c - the persistent thread pool (runs, barriers, chunk counters,
 * accounting) and a smoke check of the read-bandwidth measurement. */
#include <math.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

#include "moetax/membw.h"
#include "moetax/pool.h"
#include "testutil.h"

static void sleep_ms(int ms) {
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    while (nanosleep(&ts, &ts) != 0) {
    }
}

/* ---- runs ------------------------------------------------------------------ */

static void empty_fn(void *ctx, int ith, int nth) { (void)ctx; (void)ith; (void)nth; }

struct count_ctx {
    _Atomic int64_t calls;
    _Atomic int64_t ith_mask;
    int nth_seen_bad;
};

static void count_fn(void *vctx, int ith, int nth) {
    struct count_ctx *c = vctx;
    atomic_fetch_add(&c->calls, 1);
    atomic_fetch_or(&c->ith_mask, (int64_t)1 << ith);
    (void)nth;
}

static void test_runs(int n, int spin_us) {
    struct moetax_pool *pool = NULL;
    struct moetax_pool_params pp = {.n_threads = n, .spin_us = spin_us};
    CHECK_EQ_INT(moetax_pool_init(&pp, &pool), MOETAX_OK);
    if (!pool) return;
    CHECK_EQ_INT(moetax_pool_n_threads(pool), n);

    for (int i = 0; i < 500; i++) moetax_pool_run(pool, empty_fn, NULL);

    struct count_ctx c;
    atomic_init(&c.calls, 0);
    atomic_init(&c.ith_mask, 0);
    const int runs = 5000;
    for (int i = 0; i < runs; i++) moetax_pool_run(pool, count_fn, &c);
    CHECK_EQ_INT(atomic_load(&c.calls), (int64_t)runs * n);
    CHECK_EQ_INT(atomic_load(&c.ith_mask), ((int64_t)1 << n) - 1);

    struct moetax_pool_worker_stats st;
    for (int i = 0; i < n; i++) {
        moetax_pool_stats(pool, i, &st);
        CHECK_EQ_INT(st.n_runs, runs + 500);
        CHECK_EQ_INT(st.n_barriers, runs + 500); /* the implicit run-end barrier */
        CHECK(st.busy_s >= 0 && st.wait_s >= 0 && st.launch_s >= 0);
        CHECK(isfinite(st.busy_s) && isfinite(st.wait_s) && isfinite(st.launch_s));
    }
    moetax_pool_free(pool);
}

/* ---- static split, including zero-size and fewer items than workers -------- */

struct split_ctx {
    int64_t n;
    _Atomic int *hits; /* [n] */
};

static void split_fn(void *vctx, int ith, int nth) {
    struct split_ctx *c = vctx;
    int64_t lo = c->n * ith / nth, hi = c->n * (ith + 1) / nth;
    for (int64_t i = lo; i < hi; i++) atomic_fetch_add_explicit(&c->hits[i], 1, memory_order_relaxed);
}

static void test_static_split(struct moetax_pool *pool) {
    static const int64_t sizes[] = {0, 1, 2, 3, 5, 1000, 4099};
    for (size_t s = 0; s < sizeof sizes / sizeof sizes[0]; s++) {
        int64_t n = sizes[s];
        _Atomic int *hits = calloc((size_t)n + 1, sizeof *hits);
        struct split_ctx c = {.n = n, .hits = hits};
        moetax_pool_run(pool, split_fn, &c);
        int bad = 0;
        for (int64_t i = 0; i < n; i++) bad += atomic_load(&hits[i]) != 1;
        CHECK_MSG(bad == 0, "static split n=%lld nth=%d: %d indices not hit exactly once", (long long)n,
                  moetax_pool_n_threads(pool), bad);
        free(hits);
    }
}

/* ---- dynamic chunks ------------------------------------------------------------ */

struct chunk_ctx {
    struct moetax_pool *pool;
    int64_t n, step;
    int phases;        /* > 0: reset inside fn by worker 0, separated by a barrier */
    _Atomic int *hits; /* [phases * n] or [n] */
    _Atomic int64_t chunks_taken[MOETAX_POOL_MAX_THREADS];
};

static void chunk_fn(void *vctx, int ith, int nth) {
    struct chunk_ctx *c = vctx;
    (void)nth;
    int phases = c->phases > 0 ? c->phases : 1;
    for (int ph = 0; ph < phases; ph++) {
        if (c->phases > 0) {
            if (ith == 0) moetax_pool_chunk_reset(c->pool, ph % MOETAX_POOL_N_CHUNK_COUNTERS, 0);
            moetax_pool_barrier(c->pool, ith);
        }
        int ctr = c->phases > 0 ? ph % MOETAX_POOL_N_CHUNK_COUNTERS : 1;
        _Atomic int *hits = c->hits + (c->phases > 0 ? (size_t)ph * (size_t)c->n : 0);
        for (;;) {
            int64_t lo = moetax_pool_chunk_next(c->pool, ctr, c->step);
            if (lo >= c->n) break;
            int64_t hi = lo + c->step < c->n ? lo + c->step : c->n;
            atomic_fetch_add(&c->chunks_taken[ith], 1);
            for (int64_t i = lo; i < hi; i++) atomic_fetch_add_explicit(&hits[i], 1, memory_order_relaxed);
        }
        /* the next phase's reset must not overlap this phase's chunk_next */
        if (c->phases > 0) moetax_pool_barrier(c->pool, ith);
    }
}

static void test_chunks(struct moetax_pool *pool) {
    static const int64_t sizes[] = {0, 1, 7, 64, 10007};
    static const int64_t steps[] = {1, 3, 64, 100000};
    int nth = moetax_pool_n_threads(pool);
    for (size_t a = 0; a < sizeof sizes / sizeof sizes[0]; a++) {
        for (size_t b = 0; b < sizeof steps / sizeof steps[0]; b++) {
            int64_t n = sizes[a], step = steps[b];
            struct chunk_ctx *c = calloc(1, sizeof *c);
            c->pool = pool;
            c->n = n;
            c->step = step;
            c->hits = calloc((size_t)n + 1, sizeof *c->hits);
            moetax_pool_chunk_reset(pool, 1, 0); /* before the run */
            moetax_pool_run(pool, chunk_fn, c);
            int bad = 0;
            for (int64_t i = 0; i < n; i++) bad += atomic_load(&c->hits[i]) != 1;
            CHECK_MSG(bad == 0, "chunks n=%lld step=%lld nth=%d: %d indices not hit exactly once",
                      (long long)n, (long long)step, nth, bad);
            int64_t taken = 0;
            for (int i = 0; i < nth; i++) taken += atomic_load(&c->chunks_taken[i]);
            CHECK_EQ_INT(taken, (n + step - 1) / step);
            free(c->hits);
            free(c);
        }
    }
    /* many phases in one run, reset inside fn, more chunks than workers */
    struct chunk_ctx *c = calloc(1, sizeof *c);
    c->pool = pool;
    c->n = 1000;
    c->step = 7;
    c->phases = 50;
    c->hits = calloc((size_t)c->phases * (size_t)c->n, sizeof *c->hits);
    moetax_pool_run(pool, chunk_fn, c);
    int bad = 0;
    for (int64_t i = 0; i < (int64_t)c->phases * c->n; i++) bad += atomic_load(&c->hits[i]) != 1;
    CHECK_MSG(bad == 0, "phased chunks nth=%d: %d indices not hit exactly once", nth, bad);
    free(c->hits);
    free(c);
}

/* ---- back-to-back barriers with a shared counter -------------------------------- */

struct barrier_ctx {
    struct moetax_pool *pool;
    int iters;
    bool jitter; /* uneven work before each barrier: waiters cross from spinning to sleeping */
    _Atomic int64_t counter;
    _Atomic int errors;
    int64_t plain[MOETAX_POOL_MAX_THREADS]; /* plain memory: the barrier must order it */
};

static void barrier_fn(void *vctx, int ith, int nth) {
    struct barrier_ctx *c = vctx;
    tu_rng rng = {0x9e3779b97f4a7c15ull ^ (uint64_t)(ith + 1)};
    for (int i = 0; i < c->iters; i++) {
        if (c->jitter) {
            uint64_t spin = tu_rand_u64(&rng) % 4 == 0 ? tu_rand_u64(&rng) % 20000 : 0;
            volatile uint64_t x = 0;
            for (uint64_t k = 0; k < spin; k++) x += k;
            (void)x;
        }
        atomic_fetch_add_explicit(&c->counter, 1, memory_order_relaxed);
        c->plain[ith] = i;
        moetax_pool_barrier(c->pool, ith);
        if (atomic_load_explicit(&c->counter, memory_order_relaxed) != (int64_t)(i + 1) * nth)
            atomic_fetch_add(&c->errors, 1);
        for (int j = 0; j < nth; j++)
            if (c->plain[j] != i) atomic_fetch_add(&c->errors, 1);
        moetax_pool_barrier(c->pool, ith);
    }
}

static void test_barriers(struct moetax_pool *pool, int iters, bool jitter) {
    struct barrier_ctx *c = calloc(1, sizeof *c);
    c->pool = pool;
    c->iters = iters;
    c->jitter = jitter;
    atomic_init(&c->counter, 0);
    atomic_init(&c->errors, 0);
    moetax_pool_run(pool, barrier_fn, c);
    CHECK_MSG(atomic_load(&c->errors) == 0, "barriers nth=%d: %d mismatches", moetax_pool_n_threads(pool),
              atomic_load(&c->errors));
    CHECK_EQ_INT(atomic_load(&c->counter), (int64_t)iters * moetax_pool_n_threads(pool));
    free(c);
}

/* ---- runs on fewer workers (moetax_pool_run_n) ------------------------------------- */

struct part_ctx {
    _Atomic int64_t calls[MOETAX_POOL_MAX_THREADS];
    _Atomic int bad_nth;
    int want_nth;
};

static void part_fn(void *vctx, int ith, int nth) {
    struct part_ctx *c = vctx;
    atomic_fetch_add(&c->calls[ith], 1);
    if (nth != c->want_nth) atomic_fetch_add(&c->bad_nth, 1);
}

/* Active counts that change from run to run (the sat-out workers may still be waking when the
 * next run is published): each run's fn runs exactly on workers 0..k-1 with nth = k, and the
 * barriers of a run on k workers meet k (barrier_fn checks the counts and the ordering). */
static void test_run_n(struct moetax_pool *pool) {
    const int n = moetax_pool_n_threads(pool);
    struct part_ctx *c = calloc(1, sizeof *c);
    int64_t want[MOETAX_POOL_MAX_THREADS] = {0};
    tu_rng rng = {12345u + (uint64_t)n};
    for (int r = 0; r < 3000; r++) {
        const int k = 1 + (int)(tu_rand_u64(&rng) % (uint64_t)n);
        c->want_nth = k;
        moetax_pool_run_n(pool, k, part_fn, c);
        for (int i = 0; i < k; i++) want[i]++;
        if (r % 100 == 0) {
            struct barrier_ctx *b = calloc(1, sizeof *b);
            b->pool = pool;
            b->iters = 50;
            b->jitter = true;
            moetax_pool_run_n(pool, k, barrier_fn, b);
            CHECK_MSG(atomic_load(&b->errors) == 0 && atomic_load(&b->counter) == 50 * k,
                      "run_n %d of %d: barriers wrong (%d errors, counter %lld)", k, n, atomic_load(&b->errors),
                      (long long)atomic_load(&b->counter));
            free(b);
        }
    }
    int bad = 0;
    for (int i = 0; i < n; i++) bad += atomic_load(&c->calls[i]) != want[i];
    CHECK_MSG(bad == 0 && atomic_load(&c->bad_nth) == 0, "run_n on %d threads: %d workers ran a wrong number of times, "
              "%d calls saw a wrong nth", n, bad, atomic_load(&c->bad_nth));
    free(c);
}

/* ---- accounting: a slow worker shows up as the others' wait ------------------------ */

struct hook_acc {
    _Atomic int64_t calls[4];
    _Atomic int64_t wait_ns[4];
    _Atomic int bad;
};

static void hook_fn(void *user, int ith, uint64_t t_arrive, uint64_t t_release) {
    struct hook_acc *h = user;
    if (ith < 0 || ith >= 4 || t_release < t_arrive) {
        atomic_fetch_add(&h->bad, 1);
        return;
    }
    atomic_fetch_add(&h->calls[ith], 1);
    atomic_fetch_add(&h->wait_ns[ith], (int64_t)(t_release - t_arrive));
}

struct slow_ctx {
    struct moetax_pool *pool;
};

static void slow_fn(void *vctx, int ith, int nth) {
    struct slow_ctx *c = vctx;
    (void)nth;
    if (ith == 1) sleep_ms(60); /* worker 0 waits ~60 ms at the barrier */
    moetax_pool_barrier(c->pool, ith);
    if (ith == 1) sleep_ms(40); /* worker 0 waits ~40 ms at the run end */
}

static void test_stats(void) {
    struct moetax_pool *pool = NULL;
    CHECK_EQ_INT(moetax_pool_init(&(struct moetax_pool_params){.n_threads = 2}, &pool), MOETAX_OK);
    if (!pool) return;
    moetax_pool_run(pool, empty_fn, NULL);
    moetax_pool_stats_reset(pool);
    struct hook_acc h;
    memset(&h, 0, sizeof h);
    moetax_pool_set_barrier_hook(pool, hook_fn, &h);

    struct slow_ctx c = {.pool = pool};
    moetax_pool_run(pool, slow_fn, &c);
    moetax_pool_set_barrier_hook(pool, NULL, NULL);

    struct moetax_pool_worker_stats s0, s1;
    moetax_pool_stats(pool, 0, &s0);
    moetax_pool_stats(pool, 1, &s1);
    printf("stats: w0 busy %.3f ms wait %.3f ms; w1 busy %.3f ms wait %.3f ms launch %.3f ms\n",
           1e3 * s0.busy_s, 1e3 * s0.wait_s, 1e3 * s1.busy_s, 1e3 * s1.wait_s, 1e3 * s1.launch_s);
    CHECK_EQ_INT(s0.n_barriers, 2);
    CHECK_EQ_INT(s1.n_barriers, 2);
    CHECK_EQ_INT(s0.n_runs, 1);
    CHECK_EQ_INT(s1.n_runs, 1);
    CHECK_MSG(s0.wait_s >= 0.090, "worker 0 wait %.4f s, expected >= 0.090 (60 + 40 ms slept by worker 1)",
              s0.wait_s);
    CHECK_MSG(s0.busy_s < 0.020, "worker 0 busy %.4f s, expected tiny", s0.busy_s);
    CHECK_MSG(s1.busy_s >= 0.095, "worker 1 busy %.4f s, expected >= 0.095", s1.busy_s);
    CHECK(s1.wait_s >= 0 && s1.launch_s >= 0);
    CHECK_MSG(s1.wait_s < s0.wait_s, "slow worker waited %.4f s >= fast worker %.4f s", s1.wait_s, s0.wait_s);

    /* the hook saw exactly what the stats accumulated */
    CHECK_EQ_INT(atomic_load(&h.bad), 0);
    CHECK_EQ_INT(atomic_load(&h.calls[0]), 2);
    CHECK_EQ_INT(atomic_load(&h.calls[1]), 2);
    CHECK(fabs(1e-9 * (double)atomic_load(&h.wait_ns[0]) - s0.wait_s) < 1e-6);
    CHECK(fabs(1e-9 * (double)atomic_load(&h.wait_ns[1]) - s1.wait_s) < 1e-6);

    moetax_pool_stats_reset(pool);
    moetax_pool_stats(pool, 0, &s0);
    CHECK(s0.busy_s == 0 && s0.wait_s == 0 && s0.n_barriers == 0 && s0.n_runs == 0);

    /* idle workers go to sleep and are woken for the next run */
    sleep_ms(5);
    struct count_ctx cc;
    atomic_init(&cc.calls, 0);
    atomic_init(&cc.ith_mask, 0);
    moetax_pool_run(pool, count_fn, &cc);
    CHECK_EQ_INT(atomic_load(&cc.calls), 2);
    moetax_pool_free(pool);
}

/* ---- errors and the barrier benchmark ---------------------------------------------------- */

static void test_errors_and_bench(void) {
    struct moetax_pool *pool = NULL;
    CHECK_EQ_INT(moetax_pool_init(NULL, NULL), MOETAX_ERR_ARG);
    CHECK_EQ_INT(moetax_pool_init(&(struct moetax_pool_params){.n_threads = MOETAX_POOL_MAX_THREADS + 1}, &pool),
                 MOETAX_ERR_ARG);
    CHECK(pool == NULL);
    moetax_pool_free(NULL);

    CHECK_EQ_INT(moetax_pool_init(NULL, &pool), MOETAX_OK); /* defaults: online CPUs */
    if (!pool) return;
    CHECK(moetax_pool_n_threads(pool) >= 1);
    double ns = -1;
    CHECK_EQ_INT(moetax_pool_bench_barrier(pool, 0, &ns), MOETAX_ERR_ARG);
    CHECK_EQ_INT(moetax_pool_bench_barrier(pool, 2000, &ns), MOETAX_OK);
    printf("barrier round trip, %d threads: median %.0f ns\n", moetax_pool_n_threads(pool), ns);
    CHECK(ns > 0 && isfinite(ns));
    CHECK_EQ_INT(moetax_pool_bench_run(pool, 0, &ns), MOETAX_ERR_ARG);
    CHECK_EQ_INT(moetax_pool_bench_run(NULL, 10, &ns), MOETAX_ERR_ARG);
    struct moetax_pool_worker_stats st0, st1;
    moetax_pool_stats(pool, 0, &st0);
    ns = -1;
    CHECK_EQ_INT(moetax_pool_bench_run(pool, 2000, &ns), MOETAX_OK);
    moetax_pool_stats(pool, 0, &st1);
    printf("empty run, %d threads: median %.0f ns\n", moetax_pool_n_threads(pool), ns);
    CHECK(ns > 0 && isfinite(ns));
    CHECK(st1.n_runs - st0.n_runs >= 2000); /* the runs happened (after a warm-up) */
    moetax_pool_free(pool);

    CHECK_EQ_INT(moetax_pool_init(&(struct moetax_pool_params){.n_threads = 1}, &pool), MOETAX_OK);
    CHECK_EQ_INT(moetax_pool_bench_barrier(pool, 1, &ns), MOETAX_OK);
    CHECK(ns >= 0 && isfinite(ns));
    moetax_pool_free(pool);
}

/* ---- membw ------------------------------------------------------------------------ */

/* moetax_mem_pages: a mapping's resident bytes and its 2 MiB pages, from /proc/self/smaps */
static void test_mem_pages(void) {
    const size_t mib = 1u << 20, len = 8 * mib;
    for (int huge_ok = 0; huge_ok < 2; huge_ok++) {
        uint8_t *p = mmap(NULL, len + 2 * mib, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        CHECK(p != MAP_FAILED);
        if (p == MAP_FAILED) return;
        uint8_t *a = (uint8_t *)(((uintptr_t)p + 2 * mib - 1) & ~(uintptr_t)(2 * mib - 1));
        (void)madvise(a, len, huge_ok ? MADV_HUGEPAGE : MADV_NOHUGEPAGE);
        memset(a, 1, len);
        struct moetax_mem_paging pg;
        moetax_status st = moetax_mem_pages(a + 12345, &pg);
        CHECK_MSG(st == MOETAX_OK, "%s", moetax_last_error());
        /* the advice splits the mapping: [a, a+len) is one VMA, unless a neighbour of the same kind merged */
        CHECK((const uint8_t *)pg.start <= a && pg.bytes >= len && pg.resident >= len && pg.huge <= pg.resident);
        if (!huge_ok) CHECK_MSG(pg.huge == 0, "no huge pages advised, %llu bytes in them", (unsigned long long)pg.huge);
        else printf("mem pages: 8 MiB advised huge: %llu of %llu resident bytes in 2 MiB pages\n",
                    (unsigned long long)pg.huge, (unsigned long long)pg.resident);
        munmap(p, len + 2 * mib);
    }
    struct moetax_mem_paging pg;
    CHECK_EQ_INT(moetax_mem_pages((const void *)16, &pg), MOETAX_ERR_NOT_FOUND); /* the zero page is never mapped */

    /* the parser on a known text: a long path (its rest, "dead-beef ...", is not a mapping), fields
     * that start with hex letters, the next mapping's fields not counted */
    char text[2048];
    int n = snprintf(text, sizeof text, "7f0000000000-7f0000400000 r--p 00000000 fd:01 123 /m/");
    for (int i = 0; i < 600; i++) text[n++] = 'x';
    n += snprintf(text + n, sizeof text - (size_t)n,
                  " dead-beef r--p\nSize:               4096 kB\nRss:                4096 kB\n"
                  "AnonHugePages:         0 kB\nFilePmdMapped:      2048 kB\nVmFlags: rd mr hg\n"
                  "7f0000400000-7f0000600000 rw-p 00000000 00:00 0\nRss:                 100 kB\n"
                  "AnonHugePages:      2048 kB\nVmFlags: rd wr\n");
    FILE *f = fmemopen(text, (size_t)n, "r");
    CHECK(f != NULL);
    if (!f) return;
    CHECK_EQ_INT(moetax_mem_pages_from(f, (const void *)0x7f0000001000, &pg), MOETAX_OK);
    CHECK(pg.start == (const void *)0x7f0000000000 && pg.bytes == 4u << 20 && pg.resident == 4u << 20 &&
          pg.huge == 2u << 20);
    rewind(f);
    CHECK_EQ_INT(moetax_mem_pages_from(f, (const void *)0x7f00005fffff, &pg), MOETAX_OK);
    CHECK(pg.resident == 100u << 10 && pg.huge == 2u << 20 && pg.bytes == 2u << 20);
    rewind(f);
    CHECK_EQ_INT(moetax_mem_pages_from(f, (const void *)0xdead, &pg), MOETAX_ERR_NOT_FOUND);
    fclose(f);
}

static void test_membw(void) {
    /* the kernel against its reference: odd sizes and misaligned starts */
    tu_rng rng = {0x1234567u};
    size_t cap = 70000;
    uint8_t *buf = malloc(cap + 64);
    for (size_t i = 0; i < cap + 64; i++) buf[i] = (uint8_t)tu_rand_u64(&rng);
    int bad = 0;
    for (int k = 0; k < 300; k++) {
        size_t n = k < 100 ? (size_t)k : (size_t)(tu_rand_u64(&rng) % cap);
        size_t off = (size_t)(tu_rand_u64(&rng) % 33);
        bad += moetax_membw_sum(buf + off, n) != moetax_membw_sum_ref(buf + off, n);
    }
    CHECK_MSG(bad == 0, "membw kernel %s differs from the reference in %d cases", moetax_membw_kernel_name(), bad);
    free(buf);

    for (int n = 1; n <= 2; n++) {
        struct moetax_pool *pool = NULL;
        CHECK_EQ_INT(moetax_pool_init(&(struct moetax_pool_params){.n_threads = n}, &pool), MOETAX_OK);
        if (!pool) continue;
        double g = -1;
        CHECK_EQ_INT(moetax_membw_read(pool, 8u << 20, 3, &g), MOETAX_OK);
        printf("membw smoke: %d threads, 8 MiB (%s): %.2f GB/s\n", n, moetax_membw_kernel_name(), g);
        CHECK(g > 0 && isfinite(g));
        struct moetax_membw_result r;
        CHECK_EQ_INT(moetax_membw_read_ex(pool, 3 * 4096 + 5, 2, &r), MOETAX_OK); /* odd size */
        CHECK(r.gbps_min <= r.gbps_median && r.gbps_median <= r.gbps_max && r.threads == n && r.reps == 2);
        CHECK_EQ_INT(moetax_membw_read(pool, 100, 3, &g), MOETAX_ERR_ARG);
        CHECK_EQ_INT(moetax_membw_read(pool, 1u << 20, 0, &g), MOETAX_ERR_ARG);
        /* the reusable probe: passes over one buffer, an odd size, and bad arguments refused */
        struct moetax_membw_probe *pr = NULL;
        CHECK_EQ_INT(moetax_membw_probe_new(pool, 5 * 4096 + 3, &pr), MOETAX_OK);
        for (int i = 0; pr && i < 3; i++) {
            double gp = -1;
            CHECK_EQ_INT(moetax_membw_probe_pass(pr, &gp), MOETAX_OK);
            CHECK(gp > 0 && isfinite(gp));
        }
        moetax_membw_probe_free(pr);
        moetax_membw_probe_free(NULL);
        pr = (struct moetax_membw_probe *)&g;
        CHECK_EQ_INT(moetax_membw_probe_new(pool, 100, &pr), MOETAX_ERR_ARG);
        CHECK(pr == NULL);
        moetax_pool_free(pool);
    }
}

int main(int argc, char **argv) {
    tu_init(argc, argv);

    for (int n = 1; n <= 4; n++) {
        /* default spin, never spin (futex at once), and a tiny spin (both paths) */
        static const int spins[] = {0, -1, 2};
        for (size_t s = 0; s < sizeof spins / sizeof spins[0]; s++) {
            test_runs(n, spins[s]);
            struct moetax_pool *pool = NULL;
            struct moetax_pool_params pp = {.n_threads = n, .spin_us = spins[s], .pin = n == 2 && s == 0};
            CHECK_EQ_INT(moetax_pool_init(&pp, &pool), MOETAX_OK);
            if (!pool) continue;
            test_static_split(pool);
            test_chunks(pool);
            test_barriers(pool, s == 0 ? 10000 : 2000, false);
            test_barriers(pool, 1000, true);
            test_run_n(pool);
            moetax_pool_free(pool);
        }
    }
    test_stats();
    test_errors_and_bench();
    test_membw();
    test_mem_pages();
    return tu_finish("test_pool");
}
