/*
 * moetax/pool.h - the persistent compute thread pool.
 *
 * DESIGN
 *   n_threads - 1 worker threads are created once, at moetax_pool_init, and live
 *   until moetax_pool_free. The thread that calls moetax_pool_run is worker 0:
 *   it runs fn(ctx, 0, nth) itself while workers 1..nth-1 run fn(ctx, ith, nth),
 *   and it returns when every worker has returned from fn (the "join"). Work is
 *   split by (ith, nth), statically or dynamically with the atomic chunk
 *   counters below (ggml-cpu's model).
 *
 *   Waiting is spin-then-sleep, both between runs and at barriers: a waiter
 *   spins for spin_us microseconds (with _mm_pause, or sched_yield when there
 *   are more threads than online CPUs), then sleeps on a futex until it is woken.
 *   Hot workers therefore meet in well under a microsecond, and idle workers
 *   stop burning CPU spin_us after the last run.
 *
 *   All shared state is C11 atomics, each on its own cache line; the pool is
 *   clean under ThreadSanitizer.
 *
 * ACCOUNTING (for the ledger)
 *   Every worker records, per barrier, the CLOCK_MONOTONIC time it arrived and
 *   the time it was released (it resumed), so wait time is measured, not
 *   inferred. The end of a run is an implicit barrier: a worker "arrives" when
 *   its fn returns and is "released" at the join (when the caller has seen every
 *   worker finish). Per worker:
 *     busy_s     time inside fn, not waiting at a barrier
 *     wait_s     sum of (release - arrival) over all barriers, incl. run ends
 *     launch_s   time from the caller publishing a run to the worker starting
 *                fn (wake-up latency; 0 for worker 0)
 *     n_barriers barriers passed, incl. the implicit one at each run end
 *     n_runs     runs executed
 *   An optional hook sees every (ith, t_arrive, t_release) pair as it happens.
 *
 * INVARIANTS / RULES
 *   - moetax_pool_run is not reentrant: calling it from inside fn (nested) or
 *     from two threads at once is a bug and fails MOETAX_ASSERT.
 *   - Inside fn, every one of the nth workers must call moetax_pool_barrier the
 *     same number of times (as with any barrier).
 *   - Chunk counters: reset a counter either before moetax_pool_run (the run's
 *     start publishes it) or inside fn by one worker followed by a
 *     moetax_pool_barrier before any worker calls moetax_pool_chunk_next on it.
 *     A worker that finds the counter past the end must not reset it again in
 *     the same phase.
 *   - moetax_pool_stats, moetax_pool_stats_reset and moetax_pool_set_barrier_hook
 *     are called outside a run (not from fn).
 *   - The barrier hook runs on the worker's own thread for barriers inside fn,
 *     and on the caller's thread (for every ith) at each run end; it must be
 *     thread-safe and cheap.
 */
#ifndef MOETAX_POOL_H
#define MOETAX_POOL_H

#include <stdbool.h>
#include <stdint.h>

#include "moetax/status.h"

#ifdef __cplusplus
extern "C" {
#endif

#define MOETAX_POOL_MAX_THREADS 512
#define MOETAX_POOL_N_CHUNK_COUNTERS 4 /* counters 0..3 for moetax_pool_chunk_* */

struct moetax_pool;

struct moetax_pool_params {
    int n_threads; /* <= 0: number of online CPUs */
    bool pin;      /* pin worker i to the i-th CPU of the process's affinity mask
                      (worker 0 = the thread calling moetax_pool_init; its mask is
                      restored by moetax_pool_free when called from that thread) */
    int spin_us;   /* spin before sleeping: 0 = default (200 us), < 0 = never spin */
};

moetax_status moetax_pool_init(const struct moetax_pool_params *p, struct moetax_pool **out);
void moetax_pool_free(struct moetax_pool *pool); /* NULL is fine */
int moetax_pool_n_threads(const struct moetax_pool *pool);

typedef void (*moetax_pool_fn)(void *ctx, int ith, int nth);

/* Run fn on all workers; the caller is worker 0. Returns when all have finished. */
void moetax_pool_run(struct moetax_pool *pool, moetax_pool_fn fn, void *ctx);
/* Run fn on workers 0..n_active-1 only (1 <= n_active <= n_threads), as if the pool had
 * n_active threads (fn gets nth = n_active, barriers count n_active); the others sit the run
 * out asleep, without spinning (for a machine busy with other work, where a worker that waits
 * for a descheduled one costs more than it adds; see moetax_ctx_params.adapt_threads). */
void moetax_pool_run_n(struct moetax_pool *pool, int n_active, moetax_pool_fn fn, void *ctx);

/* Inside fn: all nth workers meet. Full memory barrier (acquire + release). */
void moetax_pool_barrier(struct moetax_pool *pool, int ith);

/* Dynamic balance inside fn. chunk_next atomically adds step to the counter and
 * returns its previous value (the start of the caller's chunk); the caller stops
 * when that start is >= its end. See the reset rule above. */
void moetax_pool_chunk_reset(struct moetax_pool *pool, int counter, int64_t start);
int64_t moetax_pool_chunk_next(struct moetax_pool *pool, int counter, int64_t step);

/* ---- accounting ---- */
struct moetax_pool_worker_stats {
    double busy_s;       /* in fn, not at a barrier */
    double wait_s;       /* at barriers (incl. run ends): sum of release - arrival */
    double launch_s;     /* run published -> worker started fn */
    uint64_t n_barriers; /* incl. the implicit barrier at each run end */
    uint64_t n_runs;
};
void moetax_pool_stats(const struct moetax_pool *pool, int ith, struct moetax_pool_worker_stats *out);
void moetax_pool_stats_reset(struct moetax_pool *pool);

typedef void (*moetax_pool_barrier_hook)(void *user, int ith, uint64_t t_arrive_ns, uint64_t t_release_ns);
/* Install (or with hook == NULL remove) a per-barrier hook. */
void moetax_pool_set_barrier_hook(struct moetax_pool *pool, moetax_pool_barrier_hook hook, void *user);

/* The clock used for all timestamps above: CLOCK_MONOTONIC in nanoseconds. */
uint64_t moetax_pool_now_ns(void);

/* Barrier round trip: nth workers pass iters barriers back to back (hot); the
 * median time per barrier seen by worker 0, in ns. iters >= 1. */
moetax_status moetax_pool_bench_barrier(struct moetax_pool *pool, int iters, double *median_ns);
/* Run round trip: the caller runs an empty fn on all workers iters times back to back (the
 * publish, the wake-up and the join of moetax_pool_run); the median ns per run over batches of
 * 64 runs. Outside a run; iters >= 1. */
moetax_status moetax_pool_bench_run(struct moetax_pool *pool, int iters, double *median_ns);

#ifdef __cplusplus
}
#endif
#endif
