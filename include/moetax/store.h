/*
 * moetax/store.h - the expert store: routed experts held in a RAM budget of
 * slots, read from the GGUF file on demand and ahead of need by its own I/O
 * workers, with honest accounting (hits, stalls, bytes, achieved GB/s).
 *
 * DESIGN
 *   Keys and slots. An expert is the key (layer, e) -> layer * n_expert + e (a
 *   direct table, no hashing). Each expert is registered as 1..4 byte ranges
 *   of the file (gate, up, down rows of that expert; one range for a fused
 *   gate_up). Ranges are widened to the enclosing 4096-aligned span (GGUF
 *   aligns tensors to 32 only; O_DIRECT needs 4096 for offset, length and
 *   buffer); spans of one expert that touch or overlap are merged, so each
 *   contiguous part of the file costs exactly one pread. The spans of an
 *   expert are packed one after the other in its slot:
 *       slot = [span 0 | span 1 | span 2]      each span a multiple of 4096
 *       range i is at slot + span_pos[i] + (offset_i - span_off[i])
 *   slot_bytes = the largest expert's sum of spans (a multiple of 4096, at most
 *   the expert's bytes + 8 KiB per range). n_slots = budget / slot_bytes,
 *   capped at the number of registered experts. The slots are one
 *   posix_memalign(4096) block allocated once at moetax_store_commit; the
 *   store never allocates on the acquire path (only the optional access trace
 *   grows). Resident memory = n_slots * slot_bytes <= budget, plus the
 *   overhead: ~0.5 KiB per slot (mostly room for an error message), ~200 B
 *   per expert key, 8 B per traced acquire (trace_cap, default 1M acquires =
 *   8 MiB, grown on demand), and the I/O threads' stacks (touched: a few KiB).
 *   For 64 experts x 26 layers that is under 0.5 MiB besides the trace. The
 *   optional read log (read_log_cap, for the timeline; the CLI keeps 64 Ki
 *   reads with --trace) takes sizeof(struct moetax_store_read) = 48 B a read,
 *   allocated at init.
 *
 *   Slot states: EMPTY -> LOADING -> READY | ERROR. A LOADING slot belongs to
 *   the I/O worker that reads it (no one else touches its bytes); completion
 *   is explicit: the worker sets READY or ERROR under the store mutex and
 *   broadcasts a condvar that waiters sleep on.
 *
 *   I/O workers (n_io_threads, default 4, never the compute pool; like Redis
 *   bio.c) take jobs from one queue of slots: a demand load (an acquire that
 *   missed) goes to the head, a prefetch to the tail; an acquire that finds
 *   its expert queued by a prefetch moves it to the head. A worker reads each
 *   span with one pread (looping only on a partial read), or with the io_uring
 *   engine submits all the expert's spans to its own ring at once (same
 *   results, errors and retries), then checks that the file's size and mtime
 *   still match those seen at commit.
 *
 *   Reads go through struct moetax_store_vfs (SQLite's VFS): tests inject
 *   errors, short reads, latency and a changed file signature.
 *
 *   Eviction picks among READY (or ERROR) slots with no pin, by policy, with
 *   `now` a logical clock that ticks once per acquire:
 *     LRU   smallest last_use (tick of the last acquire, or of the prefetch
 *           that loaded it).
 *     LFU   smallest freq[key]; freq counts acquires of the key since init
 *           (kept for every key, resident or not: "perfect" LFU, cheap since
 *           keys are few) and all counts are halved every lfu_aging acquires
 *           (default 8 * number of keys). Ties: LRU.
 *     LFRU  frequency-weighted recency (the CRF of Lee et al., "LRFU", 1999):
 *             crf[key] <- 1 + crf[key] * 2^(-(now - last[key]) / H) on acquire
 *           and the victim is the smallest crf * 2^(-(now - last) / H), i.e.
 *           each past use counts with weight 1/2 per H acquires of age.
 *           H = lfru_halflife (default 4 * n_layer * min_slots, about four
 *           tokens of decode when min_slots = experts used per token).
 *           H -> 0 is LRU, H -> infinity is LFU without aging. Ties: LRU.
 *     NEXT-USE  an online stand-in for Belady's MIN: the victim is the expert
 *           whose next acquire is expected farthest away, in layer steps.
 *           Acquires come round the layers in a fixed cycle: a pass of layer
 *           L begins at an acquire of L while no expert of L is held (the
 *           engine holds a layer's experts from its first acquire to the end
 *           of the layer; prefill's batch is one pass). The layers with
 *           registered experts, in order, are the cycle of n_cycle steps. For
 *           an expert of layer L, d = steps from the last acquired layer to L
 *           (1..n_cycle; n_cycle for the layer just computed) and
 *           p = (uses + 1/2) / (passes + 1), uses = passes of L that acquired
 *           it (once per pass, however many workers acquire it); uses and
 *           passes are halved every lfu_aging acquires (default for this
 *           policy 32 * number of keys). It is next needed when L comes round
 *           (d steps) with probability p, else a whole cycle later, so
 *             E[next use] = d + n_cycle * (1/p - 1),
 *           largest first. An expert named by a prefetch (known demand or a
 *           prediction; resident or loaded by it) counts as certain, E = d
 *           (0 while that pass is under way), until the pass of its layer
 *           that the prefetch was for has ended.
 *           Ties: LRU. Under independent routing the best any online policy
 *           can do is keep the most frequent experts (LFU); the cycle
 *           distance and the prefetches' hints are what it adds.
 *   An ERROR or EMPTY slot is always taken first. A slot loaded by a prefetch
 *   and not yet acquired is evicted only when no other candidate exists (so a
 *   batch of prefetches does not evict itself); evicting it counts as
 *   prefetch_wasted. Under NEXT-USE that protection ends with the pass the
 *   prefetch was for: a prediction its layer did not use is then an ordinary
 *   candidate (under the others it lasts until the expert is acquired).
 *
 *   Pins: acquire pins the slot before it waits (so a demand-loaded expert
 *   cannot be evicted between READY and the waiter waking up) and the pin
 *   lasts until release. If no slot is evictable, a prefetch is dropped
 *   (counted) and an acquire waits for a release.
 *
 * INVARIANTS
 *   - REQUIREMENT (no deadlock): n_slots >= the number of distinct experts
 *     pinned at once by all threads together, counting the ones being
 *     acquired. The caller states it as params.min_slots; commit refuses a
 *     budget that gives fewer slots (MOETAX_ERR_ARG, with the figures).
 *   - acquire returns MOETAX_OK only with every registered range
 *     byte-identical to the file as it was at commit (then passed through
 *     params.on_load, if set, once per read). A failed read, a short
 *     read or a changed size/mtime gives MOETAX_ERR_IO with a message naming
 *     the layer, the expert, the file and the offset; the slot goes to ERROR
 *     (never READY) and the next acquire of that expert retries the read.
 *   - A pinned or LOADING slot is never evicted or reused.
 *   - hits + misses == acquires; a miss is an acquire that had to wait.
 *   - Thread-safe: acquire/release/prefetch/stats from any threads; one
 *     mutex guards the tables (a hit is O(1) under it; eviction is O(n_slots),
 *     paid only on a miss, next to a read of megabytes).
 */
#ifndef MOETAX_STORE_H
#define MOETAX_STORE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "moetax/status.h"

#ifdef __cplusplus
extern "C" {
#endif

#define MOETAX_STORE_MAX_RANGES 4
#define MOETAX_STORE_ALIGN 4096

enum moetax_store_policy {
    MOETAX_STORE_LRU = 0,
    MOETAX_STORE_LFU = 1,
    MOETAX_STORE_LFRU = 2, /* frequency-weighted LRU (CRF, see above) */
    MOETAX_STORE_NEXT_USE = 3, /* expected next use from layer cycle and frequency (see above) */
};

const char *moetax_store_policy_name(enum moetax_store_policy p);
/* "lru", "lfu", "lfru", "next-use" -> policy; false if unknown. */
bool moetax_store_policy_parse(const char *s, enum moetax_store_policy *out);

/* File access, replaceable for tests. Functions return 0 or a positive errno;
 * pread returns the bytes read (0 at end of file) or -errno. */
struct moetax_store_vfs {
    int (*open)(void *user, const char *path, bool direct, int *fd_out);
    ssize_t (*pread)(void *user, int fd, void *buf, size_t n, uint64_t off);
    int (*fstat_sig)(void *user, int fd, uint64_t *size, uint64_t *mtime_ns); /* file changed underneath? */
    void (*close)(void *user, int fd);
    void *user;
    /* Optional, for the io_uring engine: the ring reads the descriptor open gave with the kernel's
     * read, not with pread above; each completed read's result (bytes, 0 at end of file, or
     * -errno) then passes through this and may be changed (tests inject errors and short reads
     * here). A VFS other than the default one that leaves it NULL is read with pread. */
    ssize_t (*uring_result)(void *user, int fd, void *buf, size_t n, uint64_t off, ssize_t res);
};

/* The POSIX one: open(2) with O_DIRECT when asked, pread(2), fstat(2), close(2). */
const struct moetax_store_vfs *moetax_store_vfs_default(void);

/* How the I/O workers read. PREAD: one pread(2) per span, one expert per worker at a time.
 * URING: each worker has an io_uring (liburing) and submits all spans of its expert at once.
 * DEFAULT is the one that measured faster (README, expert store). Without io_uring (a build
 * without liburing, a kernel or sandbox that refuses it: io_uring_queue_init fails) URING
 * reads with pread and says so on stderr once; stats.io_engine tells which one reads. */
enum moetax_store_io_engine {
    MOETAX_STORE_IO_DEFAULT = 0,
    MOETAX_STORE_IO_PREAD = 1,
    MOETAX_STORE_IO_URING = 2,
};
const char *moetax_store_io_engine_name(enum moetax_store_io_engine e); /* "default", "pread", "uring" */
/* "pread", "uring" -> engine; false if unknown. */
bool moetax_store_io_engine_parse(const char *s, enum moetax_store_io_engine *out);
/* What DEFAULT stands for: MOETAX_STORE_IO_PREAD or MOETAX_STORE_IO_URING. */
enum moetax_store_io_engine moetax_store_io_engine_default(void);

struct moetax_store_params {
    const char *path;         /* the model file (copied) */
    uint64_t budget_bytes;    /* RAM for expert slots */
    enum moetax_store_policy policy;
    bool buffered_io;         /* false (default): O_DIRECT, falling back to buffered reads with
                                 stats.direct_io_fallback set if the filesystem refuses it */
    int n_io_threads;         /* I/O workers (experts in flight); 0: 4 */
    enum moetax_store_io_engine io_engine; /* how they read (see above) */
    int min_slots;            /* experts pinned at once by all threads (see INVARIANTS); 0: 1 */
    int64_t lfu_aging;        /* LFU, NEXT-USE: halve all counts every this many acquires; 0: 8 * keys
                                 (NEXT-USE: 32 * keys) */
    double lfru_halflife;     /* LFRU: H in acquires; 0: 4 * n_layer * min_slots */
    int64_t trace_cap;        /* acquires recorded for Belady; 0: 1<<20; <0: none */
    int64_t read_log_cap;     /* reads recorded for the timeline (moetax_store_reads), the newest
                                 kept; 0: none */
    int io_timeout_ms;        /* acquire gives MOETAX_ERR_IO after waiting this long; 0: wait forever */
    const struct moetax_store_vfs *vfs; /* NULL: moetax_store_vfs_default() */
    /* Optional: run by the I/O worker on an expert's ranges once they are read and checked, before
     * the expert becomes resident: ptrs[i] is range i in the slot (to transform in place, e.g. into
     * the layout the kernels read: moetax_kernels_repack), sizes[i] its bytes. The ranges of an
     * expert must not overlap then. Must not fail; runs without the store's lock. NULL: none. */
    void (*on_load)(void *user, int layer, int e, void *const *ptrs, const uint64_t *sizes, int n_ranges);
    void *on_load_user;
    /* How the engine's prefetch reads predictions (see READ-AHEAD below): 1..MOETAX_STORE_READ_AHEAD_MAX
     * layers ahead through the read-ahead list; MOETAX_STORE_READ_AHEAD_OFF: the next layer's only,
     * through moetax_store_prefetch's rules; 0: MOETAX_STORE_READ_AHEAD_DEFAULT. The store only keeps
     * it for the engine (moetax_store_read_ahead_depth). */
    int read_ahead;
    /* A prediction goes on the list only when guesses like it (same distance, similar score
     * margin) were right at least this often on this run; 0: MOETAX_STORE_READ_AHEAD_MIN_PRECISION. */
    double read_ahead_min_precision;
};

struct moetax_store;

/* Open the file (O_DIRECT unless buffered_io) and record its size and mtime.
 * No slots yet: register the experts, then commit. */
moetax_status moetax_store_init(const struct moetax_store_params *p, int n_layer, int n_expert,
                                struct moetax_store **out);
/* Joins the I/O workers (queued prefetches are dropped) and frees everything.
 * No acquire may be in progress. NULL is a no-op. */
void moetax_store_free(struct moetax_store *s);

/* Register expert (layer, e): n_ranges (1..4) byte ranges of the file, in the
 * order acquire returns them. Every range must lie inside the file. Only
 * before commit. */
moetax_status moetax_store_add_expert(struct moetax_store *s, int layer, int e, const uint64_t *offsets,
                                      const uint64_t *sizes, int n_ranges);

/* Fix slot_bytes, allocate the slots and start the I/O workers. MOETAX_ERR_ARG
 * if nothing is registered, or the budget gives fewer than max(1, min_slots)
 * slots (the message gives the budget, slot size and the minimum budget). */
moetax_status moetax_store_commit(struct moetax_store *s);

/* Bytes one slot takes for the experts registered so far (a multiple of 4096),
 * and the smallest budget commit would accept for min_slots slots. */
uint64_t moetax_store_slot_bytes(const struct moetax_store *s);
uint64_t moetax_store_min_budget(const struct moetax_store *s, int min_slots);
int moetax_store_n_slots(const struct moetax_store *s); /* 0 before commit */
/* True once every registered expert is resident and the budget holds them all (no slot can be
 * evicted any more): nothing is left to read, so the engine stops predicting for prefetch.
 * Lock-free; may lag a completing read by a moment. */
bool moetax_store_holds_all(const struct moetax_store *s);

/* Non-blocking: queue reads for the experts of `layer` that are neither
 * resident nor in flight. `predicted` marks prefetches from a prediction (for
 * precision/recall) as opposed to known demand. Unregistered experts are
 * skipped; with no evictable slot the prefetch is dropped (counted). A
 * prediction that needs a read is also dropped while every I/O worker has a
 * load queued or in flight, and while the disk was busy more than this share
 * of the last cycle over the layers (one pass from the first layer with
 * experts to the next: a decoded token). Measured on `small` Q8_0 with a 50%
 * budget on a disk the reads kept busy: guesses (51% of them used) read
 * 9.4 MiB a token instead of 6.0 and decoded at 72 instead of 85 tokens/s. */
#define MOETAX_STORE_PREDICT_MAX_IO_BUSY 0.5
void moetax_store_prefetch(struct moetax_store *s, int layer, const int32_t *experts, int n, bool predicted);

/* READ-AHEAD. Predictions fill the disk's idle time, however many layers ahead they are for:
 * moetax_store_read_ahead replaces the store's read-ahead list (up to MOETAX_STORE_READ_AHEAD_LIST
 * experts, most confident first) and the store starts the list's reads in order, now and each
 * time a read completes, while the bytes queued or in flight stay below the disk's room: what it
 * reads in one layer's compute time. Both are measured by the store on this run: the read rate as
 * bytes read over the time a read was in flight, a layer's compute time as a cycle's time during
 * which no acquire waited, divided by the layers in the cycle (smoothed over cycles); so no read
 * from the list starts before one cycle (a decoded token) has been seen. An item whose layer's
 * pass has begun is dropped (its layer's own reads are queued by then; counted as ahead_stale),
 * as are the items a new list replaces before they were read. Reads from the list count as
 * predicted prefetches (predicted_issued / predicted_used) and on their own (ahead_*). Experts
 * offered that are resident or in flight are marked as needed soon (next-use keeps them).
 * The engine (src/moe/readahead.c) offers, on each MoE layer of a decoded token, the predicted
 * experts of the next read_ahead layers whose kind of guess has been right at least
 * read_ahead_min_precision of the time on this run, ordered by that precision. */
/* The default, two layers ahead, measured faster than OFF while reads bound the step; on a machine
 * whose cores were busy with other work it did not (README, expert store). */
enum { MOETAX_STORE_READ_AHEAD_OFF = -1, MOETAX_STORE_READ_AHEAD_MAX = 2, MOETAX_STORE_READ_AHEAD_DEFAULT = 2 };
#define MOETAX_STORE_READ_AHEAD_LIST 64
#define MOETAX_STORE_READ_AHEAD_MIN_PRECISION 0.7
void moetax_store_read_ahead(struct moetax_store *s, const int32_t *layers, const int32_t *experts, int n);
int moetax_store_read_ahead_depth(const struct moetax_store *s);              /* params.read_ahead, resolved */
double moetax_store_read_ahead_min_precision(const struct moetax_store *s);   /* likewise */

/* A warm start (before the first acquire): read experts[i] of layers[i], in that order,
 * into free slots, and wait until every read is done. Reads past the free slots are
 * dropped (counted as prefetch_dropped); the reads count as prefetches (issued, and used
 * when acquired before eviction). MOETAX_ERR_IO if one failed (the first error). */
moetax_status moetax_store_warm(struct moetax_store *s, const int32_t *layers, const int32_t *experts, int n);
/* A prior for the eviction policies from a routing profile: share[e] = the share of the
 * layer's passes (decoded tokens) that use expert e, as if seen over `weight` passes
 * (next-use: uses and passes; LFU: its counts; LFRU: its recency-frequency). Live
 * statistics then add to it and age it as their own. */
void moetax_store_set_prior(struct moetax_store *s, int layer, const double *share, double weight);

/* A learned predictor (moetax/predict.h) for the engine's prefetch (NULL: none): the MoE
 * block scores it and the router guess on every layer, adds to its fit when it is fitting,
 * and prefetches from it instead of the guess when p->use. Set before any acquire. With own
 * the store frees it (moetax_store_free, or when another is set); else it must outlive the
 * contexts that run on this store. */
struct moetax_predictor;
void moetax_store_set_predictor(struct moetax_store *s, struct moetax_predictor *p, bool own);
struct moetax_predictor *moetax_store_predictor(const struct moetax_store *s);

/* Block until (layer, e) is resident and pin it until release. ptrs[i] gets
 * the address of registered range i in RAM (valid while pinned). *waited_ns
 * (optional) gets the ns this call waited: the caller books it to the ledger
 * phase `load`. Errors (nothing is pinned, ptrs untouched): MOETAX_ERR_IO
 * (see INVARIANTS; also a wait longer than io_timeout_ms when set: the read
 * goes on and a later acquire gets it), MOETAX_ERR_ARG (not committed, or not
 * registered). */
moetax_status moetax_store_acquire(struct moetax_store *s, int layer, int e, const void **ptrs,
                                   uint64_t *waited_ns);
/* Unpin; one release per successful acquire. */
void moetax_store_release(struct moetax_store *s, int layer, int e);

struct moetax_store_stats {
    uint64_t acquires, hits, misses;   /* misses: acquires that had to wait */
    uint64_t errors;                   /* acquires that returned MOETAX_ERR_IO */
    uint64_t prefetch_issued;          /* reads queued by moetax_store_prefetch */
    uint64_t prefetch_used;            /* a prefetched expert acquired before eviction */
    uint64_t prefetch_late;            /* ... but still in flight: the acquire waited */
    uint64_t prefetch_wasted;          /* a prefetched expert evicted before any acquire */
    uint64_t prefetch_dropped;         /* prefetch refused: no evictable slot, or a prediction while
                                          every I/O worker had a load queued or in flight, or while
                                          the disk was busy more than MOETAX_STORE_PREDICT_MAX_IO_BUSY
                                          of the last cycle over the layers */
    uint64_t predicted_issued, predicted_used; /* the same for predicted prefetches */
    uint64_t predicted_loaded;         /* predicted prefetches whose read has completed */
    uint64_t ahead_offered;            /* experts offered to the read-ahead list (distinct per list) */
    uint64_t ahead_issued, ahead_used; /* reads started from it, and of those acquired before eviction */
    uint64_t ahead_stale;              /* items dropped unread: their layer's pass began, or a new list
                                          replaced them */
    uint64_t bytes_read, reads;        /* reads issued by the I/O workers: preads, or io_uring SQEs
                                          (bytes incl. alignment) */
    uint64_t loads;                    /* experts read (one or more reads each) */
    uint64_t evictions;                /* READY experts dropped to make room */
    uint64_t stall_ns;                 /* sum of the ns acquires waited */
    uint64_t read_ns;                  /* sum of per-read latencies (uring: submission to completion) */
    uint64_t read_ns_max;              /* slowest read */
    uint64_t io_busy_ns;               /* wall time at least one worker was loading */
    double read_gbps;                  /* bytes_read / io_busy_ns (1e9 B/s) */
    bool direct_io_active;             /* reads go through O_DIRECT */
    bool direct_io_fallback;           /* O_DIRECT was asked for but refused: buffered reads */
    enum moetax_store_io_engine io_engine; /* the engine reading: PREAD or URING */
    bool io_engine_fallback;           /* URING was asked for but a ring could not be set up: pread */
    int io_engine_errno;               /* then why (io_uring_queue_init's error) */
    int n_slots;
    uint64_t slot_bytes;
    int resident;                      /* READY slots now */
};
void moetax_store_get_stats(const struct moetax_store *s, struct moetax_store_stats *out);

/* Copy up to cap entries of the access trace ((layer, expert) of every
 * acquire since init, oldest first, up to trace_cap); returns the number
 * recorded (which may exceed cap). Either array may be NULL to ask for n. */
int64_t moetax_store_trace(const struct moetax_store *s, int32_t *layer, int32_t *expert, int64_t cap);

/* One expert load by an I/O worker (all its spans), for the trace's I/O tracks. */
enum moetax_store_read_kind {
    MOETAX_STORE_READ_DEMAND = 0,    /* an acquire missed and waits for it */
    MOETAX_STORE_READ_KNOWN = 1,     /* prefetch of an expert the routing chose (known demand) */
    MOETAX_STORE_READ_PREDICTED = 2, /* prefetch of a predicted expert */
};
const char *moetax_store_read_kind_name(enum moetax_store_read_kind k); /* "demand", "known", "predicted" */
struct moetax_store_read {
    uint64_t queued_ns, start_ns, end_ns; /* CLOCK_MONOTONIC: queued, read begun, resident (or failed) */
    uint64_t read_ns;                     /* of that, in reads (checks and on_load are the rest) */
    uint64_t bytes;                       /* read from the file (spans, 4096-aligned) */
    int32_t layer, expert;
    int16_t io_thread;                    /* 0 .. n_io_threads - 1 */
    uint8_t kind;                         /* enum moetax_store_read_kind */
    bool ok;                              /* false: the load failed (ERROR) */
};
/* Copy the kept read records (params.read_log_cap, the newest), oldest first, up to
 * cap; returns how many are kept (out may be NULL to ask), which may exceed cap or grow
 * between calls while the I/O workers run: copied = min(return, cap). Records of loads
 * still in flight are not included. *dropped (optional) gets the older ones not kept. */
int64_t moetax_store_reads(const struct moetax_store *s, struct moetax_store_read *out, int64_t cap,
                           uint64_t *dropped);

/* Compact an access trace in place to expert uses: within each run of consecutive
 * entries of the same layer (a pass over that layer), only the first access of each
 * expert is kept (the engine acquires an expert once per worker and pass). Returns the
 * new length. Passes are told apart by the layer changing: with a single layer of
 * experts, consecutive passes merge (uses are undercounted). A cache's hit rate per use is the share of uses that
 * needed no read; on this trace Belady's is the ceiling for it. */
int64_t moetax_store_trace_uses(int32_t *layer, int32_t *expert, int64_t n);

/* Offline optimal (Belady's MIN) hit rate of a cache of n_slots experts over
 * an access sequence, treating (layer, e) as one key: on a miss with the
 * cache full, evict the key whose next use is farthest (the missing expert
 * must be admitted: it is computed with). Returns hits / n, 0 for n == 0,
 * -1 on invalid input (negative ids, n_slots < 1) or out of memory. */
double moetax_store_belady_hit_rate(const int32_t *layer, const int32_t *expert, int64_t n, int64_t n_slots);

/* The best static cache over the same trace: the n_slots keys used most often held
 * from their first use on (the other keys always miss and are not admitted). Under
 * independent routing (each token's experts drawn afresh) no online policy does better
 * in expectation, while Belady's, knowing the future, does; so it says what an eviction
 * policy can reach on such a trace. The engine has to admit every expert it computes
 * with: compare a store of S slots with n_slots = S minus the experts a layer pins.
 * Returns hits / n (a key's first use is a miss), 0 for n == 0, -1 on invalid input or
 * out of memory. */
double moetax_store_static_hit_rate(const int32_t *layer, const int32_t *expert, int64_t n, int64_t n_slots);

#ifdef __cplusplus
}
#endif
#endif
