/*
 * pool.c - persistent compute thread pool (see moetax/pool.h for the design).
 *
 * Synchronization, all with C11 atomics on separate cache lines:
 *   run_gen   bumped by the caller to publish a run (fn, ctx, t_publish and
 *             done_base, on run_gen's own cache line, are written before it and
 *             read by workers after an acquire of it: one line moves per run); its
 *             low bits hold the run's active worker count (moetax_pool_run_n),
 *             so a worker reads a run's generation and count in one load.
 *   n_done    incremented by workers 1..n-1 when their fn returns, never reset:
 *             the caller joins when it has grown by n-1 since done_base.
 * A run moves as few cache lines between cores as it can (each move costs ~0.1-0.3 us
 * on the project's VMs; an empty 2-thread run took ~1 us when the caller also wrote
 * every worker's accounting at the join): the caller writes only its own lines and
 * run_gen's, a worker only its own and n_done's. The run-end barrier's wait is
 * accounted as two sums, each on its owner's line (the join times on the caller's, the
 * arrival times on the worker's), subtracted when the stats are read.
 *   bar_count / bar_gen
 *             a counting barrier: arrivals increment bar_count; the last one
 *             resets it and bumps bar_gen, which the others wait on.
 *   *_sleepers
 *             how many threads sleep (or are about to) in futex on a word;
 *             the publisher stores the word then checks sleepers, the waiter
 *             registers then re-checks the word, all seq_cst (Dekker), so no
 *             wake-up is lost; futex_wait itself re-checks the value.
 */
#include "moetax/pool.h"

#include <errno.h>
#include <limits.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#if defined(__linux__)
#include <linux/futex.h>
#include <sys/syscall.h>
#endif
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define POOL_CPU_RELAX() _mm_pause()
#else
#define POOL_CPU_RELAX() ((void)0)
#endif

#define POOL_CL 64
/* run_gen: the generation above RUN_N_BITS, the run's active worker count below */
#define RUN_N_BITS 10
#define RUN_N_MASK ((1u << RUN_N_BITS) - 1)
_Static_assert(MOETAX_POOL_MAX_THREADS <= (int)RUN_N_MASK, "the active count must fit run_gen's low bits");
#define POOL_DEFAULT_SPIN_US 200

struct pool_worker {
    _Alignas(POOL_CL) struct moetax_pool *pool;
    pthread_t thread;
    int ith;
    bool started;
    /* Accounting: written by this worker inside a run (worker 0's by the caller),
     * read and reset outside runs. Happens-before comes from run_gen / n_done.
     * wait_ns and n_barriers count the barriers inside fn; the run ends' are
     * join_sum - done_sum and the runs (struct pool_join). */
    uint64_t busy_ns, wait_ns, launch_ns, n_barriers, n_runs;
    uint64_t t_mark;   /* start of the current busy stretch */
    uint64_t t_done;   /* when fn returned (the arrival at the run-end barrier) */
    uint64_t done_sum; /* sum of t_done over the runs (mod 2^64) */
};

/* The caller's side of worker i's run ends, on the caller's own lines: the sum of the join
 * times of the runs worker i took part in (mod 2^64), and how many. */
struct pool_join {
    uint64_t sum, runs;
};

struct pool_counter {
    _Alignas(POOL_CL) _Atomic int64_t v;
};

struct moetax_pool {
    _Alignas(POOL_CL) int n;
    bool pin;
    bool yield_spin;   /* more threads than CPUs: yield instead of pause */
    uint64_t spin_ns;  /* 0: sleep at once */
    struct pool_worker *w; /* [n] */
    struct pool_join *join; /* [n] the caller's */
    uint32_t done_next;     /* the caller's: n_done once the current run has joined */

    moetax_pool_barrier_hook hook;
    void *hook_user;

    pthread_t init_thread;
    bool restore_mask;
    cpu_set_t orig_mask;
    int n_cpus_allowed;
    int *cpus_allowed; /* [n_cpus_allowed] */

    _Alignas(POOL_CL) _Atomic uint32_t run_gen;
    /* the current run, on run_gen's line; written by the caller before run_gen is bumped */
    moetax_pool_fn fn;
    void *ctx;
    uint64_t t_publish;
    uint32_t done_base; /* n_done before the run */
    int n_active; /* the run's: workers 0..n_active-1 run fn, the others sit it out (also in
                   * run_gen's low bits, which is what workers read; this copy is for the
                   * barrier, read by the run's workers only) */
    _Alignas(POOL_CL) _Atomic int run_sleepers;
    _Alignas(POOL_CL) _Atomic uint32_t n_done;
    _Alignas(POOL_CL) _Atomic int done_sleepers;
    _Alignas(POOL_CL) _Atomic int bar_count;
    _Alignas(POOL_CL) _Atomic uint32_t bar_gen;
    _Alignas(POOL_CL) _Atomic int bar_sleepers;
    _Alignas(POOL_CL) _Atomic int in_run;
    _Atomic bool stop;
    struct pool_counter chunk[MOETAX_POOL_N_CHUNK_COUNTERS];
};

uint64_t moetax_pool_now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* ---- futex (or a polite poll where there is none) ---------------------- */

static void futex_wait_u32(_Atomic uint32_t *word, uint32_t old) {
#if defined(__linux__)
    syscall(SYS_futex, (uint32_t *)word, FUTEX_WAIT_PRIVATE, old, NULL, NULL, 0);
#else
    (void)word; (void)old;
    struct timespec ts = {0, 50000};
    nanosleep(&ts, NULL);
#endif
}

static void futex_wake_all(_Atomic uint32_t *word) {
#if defined(__linux__)
    syscall(SYS_futex, (uint32_t *)word, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
#else
    (void)word;
#endif
}

#define POOL_YIELD_EVERY_NS 20000u /* while spinning, sched_yield every 20 us */

/* Wait until *word != old: spin for spin_ns (yielding every 20 us), then sleep. Returns with acquire. */
static void wait_change_spin(const struct moetax_pool *p, _Atomic uint32_t *word, uint32_t old,
                             _Atomic int *sleepers, bool spin) {
    if (atomic_load_explicit(word, memory_order_acquire) != old) return;
    if (spin && p->spin_ns > 0) {
        uint64_t t0 = moetax_pool_now_ns(), next_yield = POOL_YIELD_EVERY_NS;
        for (unsigned i = 1;; i++) {
            if (p->yield_spin) sched_yield();
            else POOL_CPU_RELAX();
            if (atomic_load_explicit(word, memory_order_acquire) != old) return;
            if ((i & 31) == 0) {
                uint64_t el = moetax_pool_now_ns() - t0;
                if (el > p->spin_ns) break;
                /* on a machine shared with other work, the thread we wait for may be queued
                 * behind us on this CPU: give it the CPU now and then (~1 us when nobody waits) */
                if (el > next_yield) {
                    sched_yield();
                    next_yield = el + POOL_YIELD_EVERY_NS;
                }
            }
        }
    }
    atomic_fetch_add_explicit(sleepers, 1, memory_order_seq_cst);
    while (atomic_load_explicit(word, memory_order_seq_cst) == old) futex_wait_u32(word, old);
    atomic_fetch_sub_explicit(sleepers, 1, memory_order_relaxed);
}

static void wait_change(const struct moetax_pool *p, _Atomic uint32_t *word, uint32_t old, _Atomic int *sleepers) {
    wait_change_spin(p, word, old, sleepers, true);
}

/* After a seq_cst store/RMW of *word: wake whoever sleeps on it. */
static void wake_sleepers(_Atomic uint32_t *word, _Atomic int *sleepers) {
    if (atomic_load_explicit(sleepers, memory_order_seq_cst) > 0) futex_wake_all(word);
}

/* ---- accounting --------------------------------------------------------- */

static void account_barrier(struct moetax_pool *p, struct pool_worker *w, uint64_t t_arrive,
                            uint64_t t_release) {
    if (t_release < t_arrive) t_release = t_arrive;
    w->wait_ns += t_release - t_arrive;
    w->n_barriers++;
    if (p->hook) p->hook(p->hook_user, w->ith, t_arrive, t_release);
}

/* ---- workers ------------------------------------------------------------ */

static void pin_self(struct moetax_pool *p, int ith) {
    if (!p->pin || p->n_cpus_allowed <= 0) return;
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(p->cpus_allowed[ith % p->n_cpus_allowed], &set);
    (void)pthread_setaffinity_np(pthread_self(), sizeof set, &set); /* best effort */
}

static void *worker_main(void *arg) {
    struct pool_worker *w = arg;
    struct moetax_pool *p = w->pool;
    pin_self(p, w->ith);
    uint32_t seen = 0;
    bool sat_out = false;
    for (;;) {
        /* sitting runs out (fewer active workers): sleep at once, do not spin on a CPU that the
         * active ones may need */
        wait_change_spin(p, &p->run_gen, seen, &p->run_sleepers, !sat_out);
        /* the run's generation and its active count in one word: the caller does not wait for
         * workers that sit a run out, so it may publish the next run meanwhile */
        seen = atomic_load_explicit(&p->run_gen, memory_order_acquire);
        const int na = (int)(seen & RUN_N_MASK);
        if (atomic_load_explicit(&p->stop, memory_order_acquire)) break;
        sat_out = w->ith >= na;
        if (sat_out) continue;

        uint64_t t0 = moetax_pool_now_ns();
        w->launch_ns += t0 > p->t_publish ? t0 - p->t_publish : 0;
        w->n_runs++;
        w->t_mark = t0;
        p->fn(p->ctx, w->ith, na);
        uint64_t t1 = moetax_pool_now_ns();
        w->busy_ns += t1 - w->t_mark;
        w->t_done = t1;
        w->done_sum += t1;
        const uint32_t base = p->done_base; /* read before arriving: the caller may publish the next run after */

        uint32_t d = atomic_fetch_add_explicit(&p->n_done, 1, memory_order_seq_cst) + 1;
        if (d - base == (uint32_t)(na - 1)) wake_sleepers(&p->n_done, &p->done_sleepers);
    }
    return NULL;
}

static void stop_workers(struct moetax_pool *p) {
    atomic_store_explicit(&p->stop, true, memory_order_release);
    atomic_fetch_add_explicit(&p->run_gen, RUN_N_MASK + 1, memory_order_seq_cst);
    wake_sleepers(&p->run_gen, &p->run_sleepers);
    for (int i = 1; i < p->n; i++)
        if (p->w[i].started) pthread_join(p->w[i].thread, NULL);
}

static void release_pool_memory(struct moetax_pool *p) {
    free(p->cpus_allowed);
    free(p->join);
    free(p->w);
    free(p);
}

moetax_status moetax_pool_init(const struct moetax_pool_params *params, struct moetax_pool **out) {
    if (!out) return moetax_error(MOETAX_ERR_ARG, "moetax_pool_init: out is NULL");
    *out = NULL;
    struct moetax_pool_params def = {0};
    if (!params) params = &def;

    long n_online = sysconf(_SC_NPROCESSORS_ONLN);
    if (n_online < 1) n_online = 1;
    int n = params->n_threads > 0 ? params->n_threads : (int)n_online;
    if (n > MOETAX_POOL_MAX_THREADS)
        return moetax_error(MOETAX_ERR_ARG, "moetax_pool_init: n_threads %d exceeds the maximum %d", n,
                            MOETAX_POOL_MAX_THREADS);

    size_t psize = (sizeof(struct moetax_pool) + POOL_CL - 1) / POOL_CL * POOL_CL;
    struct moetax_pool *p = aligned_alloc(POOL_CL, psize);
    if (!p) return moetax_error(MOETAX_ERR_NOMEM, "moetax_pool_init: out of memory");
    memset(p, 0, psize);
    size_t wsize = (sizeof(struct pool_worker) * (size_t)n + POOL_CL - 1) / POOL_CL * POOL_CL;
    p->w = aligned_alloc(POOL_CL, wsize);
    if (!p->w) {
        free(p);
        return moetax_error(MOETAX_ERR_NOMEM, "moetax_pool_init: out of memory");
    }
    memset(p->w, 0, wsize);
    size_t jsize = (sizeof(struct pool_join) * (size_t)n + POOL_CL - 1) / POOL_CL * POOL_CL;
    p->join = aligned_alloc(POOL_CL, jsize);
    if (!p->join) {
        free(p->w);
        free(p);
        return moetax_error(MOETAX_ERR_NOMEM, "moetax_pool_init: out of memory");
    }
    memset(p->join, 0, jsize);

    p->n = n;
    p->pin = params->pin;
    p->yield_spin = n > n_online;
    int spin_us = params->spin_us == 0 ? POOL_DEFAULT_SPIN_US : params->spin_us;
    p->spin_ns = spin_us > 0 ? (uint64_t)spin_us * 1000u : 0;
    p->init_thread = pthread_self();
    atomic_init(&p->run_gen, 0);
    atomic_init(&p->run_sleepers, 0);
    atomic_init(&p->n_done, 0);
    atomic_init(&p->done_sleepers, 0);
    atomic_init(&p->bar_count, 0);
    atomic_init(&p->bar_gen, 0);
    atomic_init(&p->bar_sleepers, 0);
    atomic_init(&p->in_run, 0);
    p->n_active = n;
    atomic_init(&p->stop, false);
    for (int i = 0; i < MOETAX_POOL_N_CHUNK_COUNTERS; i++) atomic_init(&p->chunk[i].v, 0);
    for (int i = 0; i < n; i++) {
        p->w[i].pool = p;
        p->w[i].ith = i;
    }

    if (p->pin) {
        cpu_set_t set;
        CPU_ZERO(&set);
        if (sched_getaffinity(0, sizeof set, &set) == 0) {
            int cnt = CPU_COUNT(&set);
            p->cpus_allowed = malloc(sizeof(int) * (size_t)(cnt > 0 ? cnt : 1));
            if (!p->cpus_allowed) {
                release_pool_memory(p);
                return moetax_error(MOETAX_ERR_NOMEM, "moetax_pool_init: out of memory");
            }
            for (int c = 0; c < CPU_SETSIZE && p->n_cpus_allowed < cnt; c++)
                if (CPU_ISSET(c, &set)) p->cpus_allowed[p->n_cpus_allowed++] = c;
        }
        if (pthread_getaffinity_np(pthread_self(), sizeof p->orig_mask, &p->orig_mask) == 0)
            p->restore_mask = true;
        pin_self(p, 0);
    }

    for (int i = 1; i < n; i++) {
        int rc = pthread_create(&p->w[i].thread, NULL, worker_main, &p->w[i]);
        if (rc != 0) {
            stop_workers(p);
            if (p->restore_mask)
                pthread_setaffinity_np(pthread_self(), sizeof p->orig_mask, &p->orig_mask);
            release_pool_memory(p);
            return moetax_error(MOETAX_ERR_LIMIT, "moetax_pool_init: creating worker %d of %d: %s", i, n,
                                strerror(rc));
        }
        p->w[i].started = true;
    }
    *out = p;
    return MOETAX_OK;
}

void moetax_pool_free(struct moetax_pool *pool) {
    if (!pool) return;
    MOETAX_ASSERT(atomic_load_explicit(&pool->in_run, memory_order_acquire) == 0);
    stop_workers(pool);
    if (pool->restore_mask && pthread_equal(pthread_self(), pool->init_thread))
        pthread_setaffinity_np(pthread_self(), sizeof pool->orig_mask, &pool->orig_mask);
    release_pool_memory(pool);
}

int moetax_pool_n_threads(const struct moetax_pool *pool) { return pool->n; }

void moetax_pool_run(struct moetax_pool *p, moetax_pool_fn fn, void *ctx) { moetax_pool_run_n(p, p->n, fn, ctx); }

void moetax_pool_run_n(struct moetax_pool *p, int n_active, moetax_pool_fn fn, void *ctx) {
    int was = atomic_exchange_explicit(&p->in_run, 1, memory_order_acq_rel);
    MOETAX_ASSERT(was == 0 && "nested or concurrent moetax_pool_run");
    MOETAX_ASSERT(n_active >= 1 && n_active <= p->n);
    const int n = n_active;
    struct pool_worker *w0 = &p->w[0];

    p->fn = fn;
    p->ctx = ctx;
    p->n_active = n;
    p->done_base = p->done_next;
    p->done_next += (uint32_t)(n - 1);
    uint64_t t0 = moetax_pool_now_ns();
    p->t_publish = t0;
    if (n > 1) { /* the next generation, with n in the low bits (a run on the caller alone: none) */
        const uint32_t g = atomic_load_explicit(&p->run_gen, memory_order_relaxed);
        atomic_store_explicit(&p->run_gen, ((g >> RUN_N_BITS) + 1) << RUN_N_BITS | (uint32_t)n, memory_order_seq_cst);
        wake_sleepers(&p->run_gen, &p->run_sleepers);
    }
    w0->n_runs++;
    w0->t_mark = t0;
    fn(ctx, 0, n);
    uint64_t t1 = moetax_pool_now_ns();
    w0->busy_ns += t1 - w0->t_mark;
    w0->t_done = t1;
    w0->done_sum += t1;

    if (n > 1) {
        for (;;) {
            uint32_t d = atomic_load_explicit(&p->n_done, memory_order_acquire);
            if (d == p->done_next) break;
            wait_change(p, &p->n_done, d, &p->done_sleepers);
        }
    }
    uint64_t t_join = n > 1 ? moetax_pool_now_ns() : t1;
    for (int i = 0; i < n; i++) { /* the run-end barrier: on the caller's lines only (see the top) */
        p->join[i].sum += t_join;
        p->join[i].runs++;
    }
    if (p->hook) /* reads the workers' lines: only with a hook */
        for (int i = 0; i < n; i++) p->hook(p->hook_user, i, p->w[i].t_done, t_join);
    atomic_store_explicit(&p->in_run, 0, memory_order_release);
}

void moetax_pool_barrier(struct moetax_pool *p, int ith) {
    MOETAX_ASSERT(ith >= 0 && ith < p->n);
    struct pool_worker *w = &p->w[ith];
    uint64_t ta = moetax_pool_now_ns();
    w->busy_ns += ta > w->t_mark ? ta - w->t_mark : 0;
    uint64_t tr = ta;
    if (p->n_active > 1) {
        /* Read the generation before arriving: the last arrival's bump of
         * bar_gen is ordered after our fetch_add (release sequence of bar_count),
         * so this load cannot already see it. */
        uint32_t gen = atomic_load_explicit(&p->bar_gen, memory_order_acquire);
        if (atomic_fetch_add_explicit(&p->bar_count, 1, memory_order_acq_rel) ==
            p->n_active - 1) {
            atomic_store_explicit(&p->bar_count, 0, memory_order_relaxed);
            atomic_fetch_add_explicit(&p->bar_gen, 1, memory_order_seq_cst);
            wake_sleepers(&p->bar_gen, &p->bar_sleepers);
        } else {
            wait_change(p, &p->bar_gen, gen, &p->bar_sleepers);
        }
        tr = moetax_pool_now_ns();
    }
    account_barrier(p, w, ta, tr);
    w->t_mark = tr;
}

void moetax_pool_chunk_reset(struct moetax_pool *p, int counter, int64_t start) {
    MOETAX_ASSERT(counter >= 0 && counter < MOETAX_POOL_N_CHUNK_COUNTERS);
    atomic_store_explicit(&p->chunk[counter].v, start, memory_order_relaxed);
}

int64_t moetax_pool_chunk_next(struct moetax_pool *p, int counter, int64_t step) {
    MOETAX_ASSERT(counter >= 0 && counter < MOETAX_POOL_N_CHUNK_COUNTERS);
    return atomic_fetch_add_explicit(&p->chunk[counter].v, step, memory_order_relaxed);
}

void moetax_pool_stats(const struct moetax_pool *p, int ith, struct moetax_pool_worker_stats *out) {
    MOETAX_ASSERT(ith >= 0 && ith < p->n);
    const struct pool_worker *w = &p->w[ith];
    const struct pool_join *j = &p->join[ith];
    out->busy_s = 1e-9 * (double)w->busy_ns;
    out->wait_s = 1e-9 * (double)(w->wait_ns + (j->sum - w->done_sum)); /* the sums wrap alike */
    out->launch_s = 1e-9 * (double)w->launch_ns;
    out->n_barriers = w->n_barriers + j->runs;
    out->n_runs = w->n_runs;
}

void moetax_pool_stats_reset(struct moetax_pool *p) {
    for (int i = 0; i < p->n; i++) {
        struct pool_worker *w = &p->w[i];
        w->busy_ns = w->wait_ns = w->launch_ns = w->n_barriers = w->n_runs = w->done_sum = 0;
        p->join[i].sum = p->join[i].runs = 0;
    }
}

void moetax_pool_set_barrier_hook(struct moetax_pool *p, moetax_pool_barrier_hook hook, void *user) {
    p->hook = hook;
    p->hook_user = user;
}

/* ---- barrier round-trip benchmark ---------------------------------------- */

struct bench_barrier_ctx {
    struct moetax_pool *pool;
    int iters, warmup;
    uint64_t *t; /* [iters + 1], written by worker 0 */
};

static void bench_barrier_fn(void *vctx, int ith, int nth) {
    (void)nth;
    struct bench_barrier_ctx *c = vctx;
    for (int i = 0; i < c->warmup; i++) moetax_pool_barrier(c->pool, ith);
    if (ith == 0) c->t[0] = moetax_pool_now_ns();
    for (int i = 0; i < c->iters; i++) {
        moetax_pool_barrier(c->pool, ith);
        if (ith == 0) c->t[i + 1] = moetax_pool_now_ns();
    }
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

moetax_status moetax_pool_bench_barrier(struct moetax_pool *pool, int iters, double *median_ns) {
    if (!pool || !median_ns || iters < 1)
        return moetax_error(MOETAX_ERR_ARG, "moetax_pool_bench_barrier: need a pool, iters >= 1 (got %d)",
                            iters);
    uint64_t *t = malloc(sizeof(uint64_t) * ((size_t)iters + 1));
    double *d = malloc(sizeof(double) * (size_t)iters);
    if (!t || !d) {
        free(t);
        free(d);
        return moetax_error(MOETAX_ERR_NOMEM, "moetax_pool_bench_barrier: out of memory");
    }
    struct bench_barrier_ctx c = {.pool = pool, .iters = iters, .warmup = iters < 1000 ? iters : 1000, .t = t};
    moetax_pool_run(pool, bench_barrier_fn, &c);
    for (int i = 0; i < iters; i++) d[i] = (double)(t[i + 1] - t[i]);
    qsort(d, (size_t)iters, sizeof(double), cmp_double);
    *median_ns = iters % 2 ? d[iters / 2] : 0.5 * (d[iters / 2 - 1] + d[iters / 2]);
    free(t);
    free(d);
    return MOETAX_OK;
}

static void bench_run_fn(void *ctx, int ith, int nth) {
    (void)ctx, (void)ith, (void)nth;
}

moetax_status moetax_pool_bench_run(struct moetax_pool *pool, int iters, double *median_ns) {
    if (!pool || !median_ns || iters < 1)
        return moetax_error(MOETAX_ERR_ARG, "moetax_pool_bench_run: need a pool, iters >= 1 (got %d)", iters);
    enum { BATCH = 64 };
    const int nb = (iters + BATCH - 1) / BATCH;
    double *d = malloc(sizeof(double) * (size_t)nb);
    if (!d) return moetax_error(MOETAX_ERR_NOMEM, "moetax_pool_bench_run: out of memory");
    for (int i = 0; i < (iters < 1000 ? iters : 1000); i++) moetax_pool_run(pool, bench_run_fn, NULL); /* warm */
    for (int b = 0; b < nb; b++) {
        const uint64_t t0 = moetax_pool_now_ns();
        for (int i = 0; i < BATCH; i++) moetax_pool_run(pool, bench_run_fn, NULL);
        d[b] = (double)(moetax_pool_now_ns() - t0) / BATCH;
    }
    qsort(d, (size_t)nb, sizeof(double), cmp_double);
    *median_ns = nb % 2 ? d[nb / 2] : 0.5 * (d[nb / 2 - 1] + d[nb / 2]);
    free(d);
    return MOETAX_OK;
}
