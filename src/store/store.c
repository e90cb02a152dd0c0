/* store.c - the expert store: slots, the residency table, cache policies and
 * acquire / release / prefetch. See include/moetax/store.h for the design. */
#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "moetax/membw.h"
#include "moetax/predict.h"
#include "store/store_impl.h"

enum { SLOT_EMPTY = 0, SLOT_LOADING, SLOT_READY, SLOT_ERROR };

#define STORE_ERR_LEN 400

struct span {
    uint64_t off, len; /* 4096-aligned file span read with one pread */
    uint64_t need;     /* bytes of it that must be read (to the last range end) */
    uint64_t pos;      /* where it lands in the slot */
};

struct expert {
    bool registered;
    uint8_t n_ranges, n_spans;
    uint64_t rpos[MOETAX_STORE_MAX_RANGES]; /* range i at slot + rpos[i] */
    uint64_t rsize[MOETAX_STORE_MAX_RANGES]; /* its bytes */
    struct span span[MOETAX_STORE_MAX_RANGES];
    uint64_t bytes;   /* sum of span lengths */
    int32_t slot;     /* -1: not in a slot */
    uint32_t freq;    /* LFU: acquires, halved every lfu_aging acquires */
    double crf;       /* LFRU: combined recency-frequency at tick `last` */
    uint64_t last;    /* tick of the last acquire */
    double uses;      /* next-use: passes of its layer that acquired it (aged with pass_w) */
    uint64_t use_pass; /* next-use: the pass of its layer counted last in `uses` */
    uint64_t hint;    /* pass of its layer a prefetch announced it for; 0: none */
};

struct slot {
    uint8_t *buf;      /* slot_bytes, 4096-aligned */
    int32_t key;       /* -1: none */
    uint8_t state;
    bool pf, pf_pred;  /* loaded by a (predicted) prefetch and not acquired since */
    bool pf_ahead;     /* ... started from the read-ahead list (moetax_store_read_ahead) */
    uint8_t kind;      /* of the load in progress or last done (enum moetax_store_read_kind) */
    uint64_t queued_ns; /* when that load was queued */
    int32_t pins;
    uint64_t last_use; /* tick of the last acquire or of the prefetch that loaded it */
    uint64_t seq;      /* load generation */
    char err[STORE_ERR_LEN];
};

struct moetax_store {
    char *path;
    struct moetax_store_params p;
    const struct moetax_store_vfs *vfs;
    int fd;
    bool direct, direct_fallback;
    uint64_t file_size, file_mtime;

    int n_layer, n_expert, n_keys, n_registered;
    struct expert *ex; /* [n_keys], immutable spans after commit */

    bool committed;
    bool warming;     /* moetax_store_warm: fill empty slots only, never evict what it read */
    uint64_t slot_bytes;
    int n_slots;
    int n_ready;               /* slots READY (under mu) */
    _Atomic bool holds_all;    /* n_ready == n_registered == n_slots (moetax_store_holds_all) */
    struct moetax_huge_buf mem; /* the slots (moetax_huge_alloc: the kernels stream experts from them) */
    struct slot *slots;
    struct store_io *io;
    enum moetax_store_io_engine engine; /* PREAD or URING, fixed at commit */
    bool engine_fallback;
    int engine_errno;
    struct store_ring **rings; /* URING: [n_io_threads], one per I/O worker */

    pthread_mutex_t mu;
    pthread_cond_t cv; /* any slot completed or unpinned (CLOCK_MONOTONIC) */
    uint64_t now;      /* logical clock: one tick per acquire */
    int64_t lfu_aging;
    double lfru_h;
    /* passes over layers (next-use policy; kept under every policy, cheap): a pass of layer
     * L begins at an acquire of L while no expert of L is held (the engine holds a layer's
     * experts from its first acquire to the end of the layer) */
    int32_t cur_layer;  /* layer of the last acquire; -1: none yet */
    int32_t *lheld;     /* [n_layer] acquires of the layer in progress or not yet released */
    uint64_t *passes;   /* [n_layer] passes begun */
    double *pass_w;     /* [n_layer] passes, aged like expert.uses */
    int32_t *lrank;     /* [n_layer] position among the layers with registered experts; -1: none */
    int n_cycle;        /* layers with registered experts */
    int io_active;
    int pending;       /* loads queued or in flight */
    uint64_t io_busy_start;
    /* I/O busy share of the last cycle over the layers (from one pass of the first layer
     * with experts to the next; a decoded token): < 0 until one cycle has been seen */
    uint64_t cyc_t0, cyc_busy0;
    double cyc_util;
    /* read-ahead (moetax_store_read_ahead): the disk's room is what it reads in one layer's
     * compute time, both measured here: bytes of the loads queued or in flight, wall time with
     * an acquire waiting, and per cycle the time no acquire waited, per layer (smoothed) */
    uint64_t queued_bytes;
    int n_waiting;
    uint64_t wait_start, wait_ns, cyc_wait0;
    double layer_ns;   /* 0 until a cycle has been seen */
    struct ahead_item { int32_t key; uint64_t pass; } *ahead; /* [MOETAX_STORE_READ_AHEAD_LIST] */
    int n_ahead, ahead_pos; /* items in the list, the next to read */
    struct moetax_store_stats st;

    struct moetax_predictor *pred; /* moetax_store_set_predictor */
    bool pred_own;
    struct moetax_store_read *rlog; /* ring of read_log_cap records; rlog_n written in all */
    uint64_t rlog_n;
    int32_t *trace; /* pairs (layer, expert) */
    int64_t trace_n, trace_alloc, trace_max;
};

const char *moetax_store_read_kind_name(enum moetax_store_read_kind k) {
    switch (k) {
    case MOETAX_STORE_READ_DEMAND: return "demand";
    case MOETAX_STORE_READ_KNOWN: return "known";
    case MOETAX_STORE_READ_PREDICTED: return "predicted";
    }
    return "?";
}

const char *moetax_store_policy_name(enum moetax_store_policy p) {
    switch (p) {
    case MOETAX_STORE_LRU: return "lru";
    case MOETAX_STORE_LFU: return "lfu";
    case MOETAX_STORE_LFRU: return "lfru";
    case MOETAX_STORE_NEXT_USE: return "next-use";
    }
    return "?";
}

/* Measured on this project's disk (README, expert store): see moetax_store_io_engine_default. */
static const enum moetax_store_io_engine default_engine = MOETAX_STORE_IO_URING;

const char *moetax_store_io_engine_name(enum moetax_store_io_engine e) {
    switch (e) {
    case MOETAX_STORE_IO_DEFAULT: return "default";
    case MOETAX_STORE_IO_PREAD: return "pread";
    case MOETAX_STORE_IO_URING: return "uring";
    }
    return "?";
}

bool moetax_store_io_engine_parse(const char *s, enum moetax_store_io_engine *out) {
    if (!s) return false;
    if (!strcmp(s, "pread")) *out = MOETAX_STORE_IO_PREAD;
    else if (!strcmp(s, "uring")) *out = MOETAX_STORE_IO_URING;
    else return false;
    return true;
}

enum moetax_store_io_engine moetax_store_io_engine_default(void) { return default_engine; }

bool moetax_store_policy_parse(const char *s, enum moetax_store_policy *out) {
    if (!s) return false;
    if (!strcmp(s, "lru")) *out = MOETAX_STORE_LRU;
    else if (!strcmp(s, "lfu")) *out = MOETAX_STORE_LFU;
    else if (!strcmp(s, "lfru")) *out = MOETAX_STORE_LFRU;
    else if (!strcmp(s, "next-use")) *out = MOETAX_STORE_NEXT_USE;
    else return false;
    return true;
}

/* ---- init / free -------------------------------------------------------------- */

static moetax_status open_file(struct moetax_store *s) {
    const struct moetax_store_vfs *v = s->vfs;
    int fd = -1, rc;
    if (!s->p.buffered_io) {
        rc = v->open(v->user, s->path, true, &fd);
        if (rc == 0) {
            /* Some filesystems accept O_DIRECT at open and refuse the reads: probe one block. */
            void *probe = NULL;
            if (posix_memalign(&probe, MOETAX_STORE_ALIGN, MOETAX_STORE_ALIGN) != 0) {
                v->close(v->user, fd);
                return moetax_error(MOETAX_ERR_NOMEM, "expert store: out of memory");
            }
            uint64_t ns;
            int calls;
            int64_t r = store_io_read(v, fd, probe, MOETAX_STORE_ALIGN, 1, 0, &ns, &calls);
            free(probe);
            if (r == -EINVAL) {
                v->close(v->user, fd);
                fd = -1;
            } else {
                s->fd = fd;
                s->direct = true;
                return MOETAX_OK;
            }
        } else if (rc != EINVAL && rc != EOPNOTSUPP) {
            return moetax_error(MOETAX_ERR_IO, "expert store: %s: cannot open: %s", s->path, strerror(rc));
        }
        s->direct_fallback = true; /* the filesystem refuses O_DIRECT: buffered reads */
    }
    rc = v->open(v->user, s->path, false, &fd);
    if (rc != 0) return moetax_error(MOETAX_ERR_IO, "expert store: %s: cannot open: %s", s->path, strerror(rc));
    s->fd = fd;
    return MOETAX_OK;
}

moetax_status moetax_store_init(const struct moetax_store_params *p, int n_layer, int n_expert,
                                struct moetax_store **out) {
    *out = NULL;
    if (!p || !p->path) return moetax_error(MOETAX_ERR_ARG, "expert store: no file path");
    if (n_layer < 1 || n_expert < 1 || (int64_t)n_layer * n_expert > (1 << 24))
        return moetax_error(MOETAX_ERR_ARG, "expert store: bad shape %d layers x %d experts", n_layer, n_expert);
    if (p->policy != MOETAX_STORE_LRU && p->policy != MOETAX_STORE_LFU && p->policy != MOETAX_STORE_LFRU &&
        p->policy != MOETAX_STORE_NEXT_USE)
        return moetax_error(MOETAX_ERR_ARG, "expert store: unknown policy %d", (int)p->policy);
    if (p->n_io_threads < 0 || p->n_io_threads > 64)
        return moetax_error(MOETAX_ERR_ARG, "expert store: n_io_threads %d out of range 0..64", p->n_io_threads);
    if (p->min_slots < 0) return moetax_error(MOETAX_ERR_ARG, "expert store: min_slots %d < 0", p->min_slots);
    if (p->io_engine != MOETAX_STORE_IO_DEFAULT && p->io_engine != MOETAX_STORE_IO_PREAD &&
        p->io_engine != MOETAX_STORE_IO_URING)
        return moetax_error(MOETAX_ERR_ARG, "expert store: unknown I/O engine %d", (int)p->io_engine);
    if (p->read_ahead < MOETAX_STORE_READ_AHEAD_OFF || p->read_ahead > MOETAX_STORE_READ_AHEAD_MAX)
        return moetax_error(MOETAX_ERR_ARG, "expert store: read_ahead %d out of range -1..%d", p->read_ahead,
                            MOETAX_STORE_READ_AHEAD_MAX);
    if (!(p->read_ahead_min_precision >= 0 && p->read_ahead_min_precision <= 1))
        return moetax_error(MOETAX_ERR_ARG, "expert store: read_ahead_min_precision %g outside 0..1",
                            p->read_ahead_min_precision);
    if (p->lfu_aging < 0 || p->lfru_halflife < 0 || !(p->lfru_halflife == p->lfru_halflife))
        return moetax_error(MOETAX_ERR_ARG, "expert store: negative lfu_aging or lfru_halflife");

    struct moetax_store *s = calloc(1, sizeof *s);
    if (!s) return moetax_error(MOETAX_ERR_NOMEM, "expert store: out of memory");
    s->p = *p;
    s->fd = -1;
    s->vfs = p->vfs ? p->vfs : moetax_store_vfs_default();
    s->p.vfs = s->vfs;
    if (s->p.n_io_threads == 0) s->p.n_io_threads = 4; /* measured: qd 4 gets ~90% of this disk's random-read bandwidth, qd 2 ~65% */
    if (s->p.min_slots == 0) s->p.min_slots = 1;
    if (s->p.read_ahead == 0) s->p.read_ahead = MOETAX_STORE_READ_AHEAD_DEFAULT;
    if (s->p.read_ahead_min_precision == 0) s->p.read_ahead_min_precision = MOETAX_STORE_READ_AHEAD_MIN_PRECISION;
    s->n_layer = n_layer;
    s->n_expert = n_expert;
    s->n_keys = n_layer * n_expert;
    /* next-use ages slower: its counts estimate a rate per pass, and a longer window is a
     * better estimate while routing is stationary (replaying pycode-20m's trace: 4x LFU's
     * window gains about a point of hit rate at 25% and 50% budgets) */
    s->lfu_aging = p->lfu_aging                            ? p->lfu_aging
                   : p->policy == MOETAX_STORE_NEXT_USE ? 32 * (int64_t)s->n_keys
                                                         : 8 * (int64_t)s->n_keys;
    s->lfru_h = p->lfru_halflife > 0 ? p->lfru_halflife : 4.0 * n_layer * s->p.min_slots;
    s->trace_max = p->trace_cap == 0 ? (int64_t)1 << 20 : (p->trace_cap < 0 ? 0 : p->trace_cap);
    if (p->read_log_cap < 0) s->p.read_log_cap = 0;
    pthread_mutex_init(&s->mu, NULL);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&s->cv, &ca);
    pthread_condattr_destroy(&ca);

    s->path = strdup(p->path);
    s->ex = calloc((size_t)s->n_keys, sizeof *s->ex);
    s->cur_layer = -1;
    s->cyc_util = -1.0;
    s->lheld = calloc((size_t)n_layer, sizeof *s->lheld);
    s->passes = calloc((size_t)n_layer, sizeof *s->passes);
    s->pass_w = calloc((size_t)n_layer, sizeof *s->pass_w);
    s->lrank = calloc((size_t)n_layer, sizeof *s->lrank);
    if (s->p.read_log_cap > 0) s->rlog = calloc((size_t)s->p.read_log_cap, sizeof *s->rlog);
    s->ahead = calloc(MOETAX_STORE_READ_AHEAD_LIST, sizeof *s->ahead);
    if (!s->path || !s->ex || !s->lheld || !s->passes || !s->pass_w || !s->lrank || !s->ahead ||
        (s->p.read_log_cap > 0 && !s->rlog)) {
        moetax_store_free(s);
        return moetax_error(MOETAX_ERR_NOMEM, "expert store: out of memory");
    }
    s->p.path = s->path;
    for (int k = 0; k < s->n_keys; k++) s->ex[k].slot = -1;

    moetax_status st = open_file(s);
    if (st == MOETAX_OK) {
        int rc = s->vfs->fstat_sig(s->vfs->user, s->fd, &s->file_size, &s->file_mtime);
        if (rc != 0) st = moetax_error(MOETAX_ERR_IO, "expert store: %s: cannot stat: %s", s->path, strerror(rc));
    }
    if (st != MOETAX_OK) {
        moetax_store_free(s);
        return st;
    }
    *out = s;
    return MOETAX_OK;
}

void moetax_store_free(struct moetax_store *s) {
    if (!s) return;
    store_io_stop(s->io); /* joins: no worker touches the slots after this */
    if (s->rings)
        for (int t = 0; t < s->p.n_io_threads; t++) store_ring_free(s->rings[t]);
    free(s->rings);
    if (s->pred_own) moetax_predictor_free(s->pred);
    if (s->fd >= 0) s->vfs->close(s->vfs->user, s->fd);
    moetax_huge_free(&s->mem);
    free(s->slots);
    free(s->ex);
    free(s->lheld);
    free(s->passes);
    free(s->pass_w);
    free(s->lrank);
    free(s->trace);
    free(s->rlog);
    free(s->ahead);
    free(s->path);
    pthread_cond_destroy(&s->cv);
    pthread_mutex_destroy(&s->mu);
    free(s);
}

/* ---- registration --------------------------------------------------------------- */

#define ALIGN_DOWN(x) ((x) & ~(uint64_t)(MOETAX_STORE_ALIGN - 1))
#define ALIGN_UP(x) ALIGN_DOWN((x) + MOETAX_STORE_ALIGN - 1)

moetax_status moetax_store_add_expert(struct moetax_store *s, int layer, int e, const uint64_t *offsets,
                                      const uint64_t *sizes, int n_ranges) {
    if (s->committed) return moetax_error(MOETAX_ERR_ARG, "expert store: add_expert after commit");
    if (layer < 0 || layer >= s->n_layer || e < 0 || e >= s->n_expert)
        return moetax_error(MOETAX_ERR_ARG, "expert store: expert (layer %d, %d) outside %d x %d", layer, e,
                            s->n_layer, s->n_expert);
    if (n_ranges < 1 || n_ranges > MOETAX_STORE_MAX_RANGES)
        return moetax_error(MOETAX_ERR_ARG, "expert store: layer %d expert %d: %d ranges (1..%d)", layer, e,
                            n_ranges, MOETAX_STORE_MAX_RANGES);
    for (int i = 0; i < n_ranges; i++) {
        if (sizes[i] == 0 || offsets[i] > s->file_size || sizes[i] > s->file_size - offsets[i])
            return moetax_error(MOETAX_ERR_ARG,
                                "expert store: layer %d expert %d: range %d [%llu, +%llu) outside %s (%llu bytes)",
                                layer, e, i, (unsigned long long)offsets[i], (unsigned long long)sizes[i],
                                s->path, (unsigned long long)s->file_size);
    }
    struct expert *x = &s->ex[layer * s->n_expert + e];
    if (!x->registered) s->n_registered++;
    memset(x, 0, sizeof *x);
    x->registered = true;
    x->slot = -1;
    x->n_ranges = (uint8_t)n_ranges;

    /* Ranges by file offset; merge the aligned spans that touch or overlap. */
    int ord[MOETAX_STORE_MAX_RANGES];
    for (int i = 0; i < n_ranges; i++) ord[i] = i;
    for (int i = 1; i < n_ranges; i++)
        for (int j = i; j > 0 && offsets[ord[j]] < offsets[ord[j - 1]]; j--) {
            int t = ord[j];
            ord[j] = ord[j - 1];
            ord[j - 1] = t;
        }
    int span_of[MOETAX_STORE_MAX_RANGES];
    int ns = 0;
    uint64_t end_max = 0;
    for (int k = 0; k < n_ranges; k++) {
        int i = ord[k];
        uint64_t a = ALIGN_DOWN(offsets[i]), b = ALIGN_UP(offsets[i] + sizes[i]);
        if (ns > 0 && a <= x->span[ns - 1].off + x->span[ns - 1].len) {
            struct span *sp = &x->span[ns - 1];
            if (b > sp->off + sp->len) sp->len = b - sp->off;
        } else {
            x->span[ns].off = a;
            x->span[ns].len = b - a;
            ns++;
            end_max = 0;
        }
        if (offsets[i] + sizes[i] > end_max) end_max = offsets[i] + sizes[i];
        x->span[ns - 1].need = end_max - x->span[ns - 1].off;
        span_of[i] = ns - 1;
    }
    x->n_spans = (uint8_t)ns;
    uint64_t pos = 0;
    for (int k = 0; k < ns; k++) {
        x->span[k].pos = pos;
        pos += x->span[k].len;
    }
    x->bytes = pos;
    for (int i = 0; i < n_ranges; i++) {
        const struct span *sp = &x->span[span_of[i]];
        x->rpos[i] = sp->pos + (offsets[i] - sp->off);
        x->rsize[i] = sizes[i];
    }
    return MOETAX_OK;
}

uint64_t moetax_store_slot_bytes(const struct moetax_store *s) {
    if (s->committed) return s->slot_bytes;
    uint64_t m = 0;
    for (int k = 0; k < s->n_keys; k++)
        if (s->ex[k].registered && s->ex[k].bytes > m) m = s->ex[k].bytes;
    return m;
}

uint64_t moetax_store_min_budget(const struct moetax_store *s, int min_slots) {
    return moetax_store_slot_bytes(s) * (uint64_t)(min_slots < 1 ? 1 : min_slots);
}

int moetax_store_n_slots(const struct moetax_store *s) { return s->committed ? s->n_slots : 0; }
bool moetax_store_holds_all(const struct moetax_store *s) {
    return atomic_load_explicit(&((struct moetax_store *)s)->holds_all, memory_order_acquire);
}

static void io_job(void *ctx, int job, int worker);
static void ahead_pump(struct moetax_store *s);

/* The I/O engine: with URING, one ring per worker, deep enough for an expert's spans. A VFS
 * other than the default that cannot see ring results (no uring_result) is read with pread;
 * a ring that cannot be set up gives pread, said once on stderr. */
static moetax_status start_engine(struct moetax_store *s) {
    enum moetax_store_io_engine e = s->p.io_engine == MOETAX_STORE_IO_DEFAULT ? default_engine : s->p.io_engine;
    s->engine = MOETAX_STORE_IO_PREAD;
    if (e != MOETAX_STORE_IO_URING) return MOETAX_OK;
    if (s->vfs != moetax_store_vfs_default() && !s->vfs->uring_result) return MOETAX_OK;
    s->rings = calloc((size_t)s->p.n_io_threads, sizeof *s->rings);
    if (!s->rings) return moetax_error(MOETAX_ERR_NOMEM, "expert store: out of memory (rings)");
    int rc = 0;
    for (int t = 0; t < s->p.n_io_threads && !rc; t++) rc = store_ring_init(MOETAX_STORE_MAX_RANGES, &s->rings[t]);
    if (rc) {
        for (int t = 0; t < s->p.n_io_threads; t++) store_ring_free(s->rings[t]);
        free(s->rings);
        s->rings = NULL;
        s->engine_fallback = true;
        s->engine_errno = -rc;
        const char *why = store_ring_built() ? "io_uring_queue_init" : "built without liburing";
        const char *forced = getenv(store_ring_fail_env());
        if (forced && *forced && strcmp(forced, "0") != 0) why = store_ring_fail_env();
        fprintf(stderr, "moetax: expert store: io_uring unavailable (%s: %s): reading with pread\n", why,
                strerror(-rc));
        return MOETAX_OK;
    }
    s->engine = MOETAX_STORE_IO_URING;
    return MOETAX_OK;
}

moetax_status moetax_store_commit(struct moetax_store *s) {
    if (s->committed) return moetax_error(MOETAX_ERR_ARG, "expert store: committed twice");
    if (s->n_registered == 0) return moetax_error(MOETAX_ERR_ARG, "expert store: no experts registered");
    uint64_t sb = moetax_store_slot_bytes(s);
    uint64_t fit = s->p.budget_bytes / sb;
    int need = s->p.min_slots < s->n_registered ? s->p.min_slots : s->n_registered;
    if (fit < (uint64_t)need)
        return moetax_error(MOETAX_ERR_ARG,
                            "expert store: budget of %llu bytes (%.1f MiB) holds %llu expert slot%s of %llu bytes "
                            "(the largest expert, as 4096-aligned spans) but %d %s pinned at once: "
                            "the budget must be at least %llu bytes (%.1f MiB)",
                            (unsigned long long)s->p.budget_bytes, s->p.budget_bytes / 1048576.0,
                            (unsigned long long)fit, fit == 1 ? "" : "s", (unsigned long long)sb, need,
                            need == 1 ? "expert is" : "experts are", (unsigned long long)(sb * (uint64_t)need),
                            (double)(sb * (uint64_t)need) / 1048576.0);
    int n_slots = fit > (uint64_t)s->n_registered ? s->n_registered : (int)fit;
    if (!moetax_huge_alloc((size_t)sb * (size_t)n_slots, &s->mem))
        return moetax_error(MOETAX_ERR_NOMEM, "expert store: cannot allocate %d slots of %llu bytes", n_slots,
                            (unsigned long long)sb);
    s->slots = calloc((size_t)n_slots, sizeof *s->slots);
    if (!s->slots) {
        moetax_huge_free(&s->mem);
        return moetax_error(MOETAX_ERR_NOMEM, "expert store: out of memory");
    }
    s->slot_bytes = sb;
    s->n_cycle = 0;
    for (int l = 0; l < s->n_layer; l++) {
        bool any = false;
        for (int e = 0; e < s->n_expert && !any; e++) any = s->ex[l * s->n_expert + e].registered;
        s->lrank[l] = any ? s->n_cycle++ : -1;
    }
    s->n_slots = n_slots;
    for (int i = 0; i < n_slots; i++) {
        s->slots[i].buf = s->mem.ptr + (size_t)i * sb;
        s->slots[i].key = -1;
    }
    moetax_status st = start_engine(s);
    if (st == MOETAX_OK) st = store_io_start(s->p.n_io_threads, n_slots, io_job, s, &s->io);
    if (st != MOETAX_OK) {
        if (s->rings) /* start_engine's, so that another commit does not leak them */
            for (int t = 0; t < s->p.n_io_threads; t++) store_ring_free(s->rings[t]);
        free(s->rings);
        s->rings = NULL;
        free(s->slots);
        moetax_huge_free(&s->mem);
        s->slots = NULL;
        return st;
    }
    s->committed = true;
    return MOETAX_OK;
}

/* ---- I/O job: read one expert into its slot ------------------------------------ */

static void io_job(void *ctx, int job, int worker) {
    struct moetax_store *s = ctx;
    struct slot *sl = &s->slots[job];
    pthread_mutex_lock(&s->mu);
    int key = sl->key; /* fixed while LOADING */
    MOETAX_ASSERT(sl->state == SLOT_LOADING && key >= 0);
    const uint64_t t_start = store_now_ns();
    if (s->io_active++ == 0) s->io_busy_start = t_start;
    pthread_mutex_unlock(&s->mu);

    const struct expert *x = &s->ex[key];
    int layer = key / s->n_expert, e = key % s->n_expert;
    char err[STORE_ERR_LEN];
    bool ok = true;
    uint64_t bytes = 0, reads = 0, rns = 0, rmax = 0;
    struct store_ring_req rq[MOETAX_STORE_MAX_RANGES];
    /* this worker's ring (only this worker touches it): one that failed is replaced, and where no new
     * one can be set up the worker reads with pread (a failed submit once left every later read of the
     * worker failing, as an I/O error of the disk) */
    struct store_ring *ring = s->rings ? s->rings[worker] : NULL;
    if (s->rings && (!ring || store_ring_broken(ring))) {
        store_ring_free(ring);
        if (store_ring_init(MOETAX_STORE_MAX_RANGES, &ring) < 0) ring = NULL;
        s->rings[worker] = ring;
    }
    if (ring) { /* all spans in flight at once */
        for (int k = 0; k < x->n_spans; k++)
            rq[k] = (struct store_ring_req){.buf = sl->buf + x->span[k].pos, .len = x->span[k].len,
                                            .need = x->span[k].need, .off = x->span[k].off};
        store_ring_read(ring, s->vfs, s->fd, rq, x->n_spans);
    }
    for (int k = 0; k < x->n_spans && ok; k++) {
        const struct span *sp = &x->span[k];
        uint64_t ns;
        int calls;
        int64_t r;
        if (ring) {
            r = rq[k].res;
            ns = rq[k].ns;
            calls = rq[k].calls;
        } else {
            r = store_io_read(s->vfs, s->fd, sl->buf + sp->pos, sp->len, sp->need, sp->off, &ns, &calls);
        }
        reads += (uint64_t)calls;
        rns += ns;
        if (ns > rmax) rmax = ns;
        if (r > 0) bytes += (uint64_t)r;
        if (r < 0) {
            snprintf(err, sizeof err, "expert store: layer %d expert %d: %s: offset %llu (%llu bytes): read failed: %s",
                     layer, e, s->path, (unsigned long long)sp->off, (unsigned long long)sp->len,
                     strerror((int)-r));
            ok = false;
        } else if ((uint64_t)r < sp->need) {
            snprintf(err, sizeof err,
                     "expert store: layer %d expert %d: %s: offset %llu: short read (%llu of %llu bytes)", layer, e,
                     s->path, (unsigned long long)sp->off, (unsigned long long)r, (unsigned long long)sp->need);
            ok = false;
        }
    }
    if (ok) { /* the bytes are the file as it was at init only if it has not changed since */
        uint64_t size = 0, mtime = 0;
        int rc = s->vfs->fstat_sig(s->vfs->user, s->fd, &size, &mtime);
        if (rc != 0) {
            snprintf(err, sizeof err, "expert store: layer %d expert %d: %s: offset %llu: cannot stat: %s", layer, e,
                     s->path, (unsigned long long)x->span[0].off, strerror(rc));
            ok = false;
        } else if (size != s->file_size || mtime != s->file_mtime) {
            snprintf(err, sizeof err,
                     "expert store: layer %d expert %d: %s: offset %llu: file changed since it was opened "
                     "(size %llu -> %llu bytes, mtime %llu -> %llu ns)",
                     layer, e, s->path, (unsigned long long)x->span[0].off, (unsigned long long)s->file_size,
                     (unsigned long long)size, (unsigned long long)s->file_mtime, (unsigned long long)mtime);
            ok = false;
        }
    }
    if (ok && s->p.on_load) { /* e.g. repack into the kernels' layout, while the slot is still ours */
        void *ptrs[MOETAX_STORE_MAX_RANGES];
        for (int i = 0; i < x->n_ranges; i++) ptrs[i] = sl->buf + x->rpos[i];
        s->p.on_load(s->p.on_load_user, layer, e, ptrs, x->rsize, x->n_ranges);
    }

    pthread_mutex_lock(&s->mu);
    if (s->rlog) /* kind: a queued prefetch an acquire then waited for still reads as a prefetch */
        s->rlog[s->rlog_n++ % (uint64_t)s->p.read_log_cap] = (struct moetax_store_read){
            .queued_ns = sl->queued_ns, .start_ns = t_start, .end_ns = store_now_ns(), .read_ns = rns, .bytes = bytes,
            .layer = layer, .expert = e, .io_thread = (int16_t)worker, .kind = sl->kind, .ok = ok};
    s->st.bytes_read += bytes;
    s->st.reads += reads;
    s->st.read_ns += rns;
    if (rmax > s->st.read_ns_max) s->st.read_ns_max = rmax;
    s->st.loads++;
    if (sl->kind == MOETAX_STORE_READ_PREDICTED) s->st.predicted_loaded++;
    s->pending--;
    s->queued_bytes -= x->bytes;
    if (--s->io_active == 0) s->st.io_busy_ns += store_now_ns() - s->io_busy_start;
    if (ok) {
        sl->state = SLOT_READY;
        if (++s->n_ready == s->n_registered && s->n_slots == s->n_registered)
            atomic_store_explicit(&s->holds_all, true, memory_order_release);
    } else {
        sl->state = SLOT_ERROR;
        memcpy(sl->err, err, sizeof err);
    }
    ahead_pump(s);
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
}

/* ---- policies --------------------------------------------------------------------- */

/* An acquire of `layer` begins (under the lock): count passes, then update the policies'
 * figures of x. */
/* Time with at least one read in flight, up to t (under the lock). */
static uint64_t io_busy_until(const struct moetax_store *s, uint64_t t) {
    return s->st.io_busy_ns + (s->io_active > 0 && t > s->io_busy_start ? t - s->io_busy_start : 0);
}

/* A pass over the cycle's first layer begins: the I/O busy share of the cycle that ends. */
static void cycle_mark(struct moetax_store *s) {
    uint64_t t = store_now_ns(), busy = io_busy_until(s, t);
    uint64_t waited = s->wait_ns + (s->n_waiting > 0 && t > s->wait_start ? t - s->wait_start : 0);
    if (s->cyc_t0 && t > s->cyc_t0) {
        s->cyc_util = (double)(busy - s->cyc_busy0) / (double)(t - s->cyc_t0);
        /* the cycle's time with no acquire waiting, per layer: what the layers compute. Smoothed
         * (a quarter per cycle): one token on a shared machine is noisy */
        const uint64_t w = waited - s->cyc_wait0, c = t - s->cyc_t0;
        const double per = (double)(c > w ? c - w : 0) / (double)(s->n_cycle > 0 ? s->n_cycle : 1);
        s->layer_ns = s->layer_ns > 0 ? 0.75 * s->layer_ns + 0.25 * per : per;
    }
    s->cyc_t0 = t;
    s->cyc_busy0 = busy;
    s->cyc_wait0 = waited;
}

static void policy_touch(struct moetax_store *s, int layer, struct expert *x) {
    uint64_t now = s->now;
    if (s->lheld[layer]++ == 0) { /* none of its experts held: a new pass over the layer */
        s->passes[layer]++;
        s->pass_w[layer] += 1.0;
        if (s->lrank[layer] == 0) cycle_mark(s);
    }
    s->cur_layer = layer;
    x->freq++;
    if (s->p.policy == MOETAX_STORE_LFU && now % (uint64_t)s->lfu_aging == 0)
        for (int k = 0; k < s->n_keys; k++) s->ex[k].freq >>= 1;
    x->crf = 1.0 + x->crf * exp2(-(double)(now - x->last) / s->lfru_h);
    x->last = now;
    if (x->use_pass != s->passes[layer]) { /* once per pass, however many workers acquire it */
        x->use_pass = s->passes[layer];
        x->uses += 1.0;
    }
    if (s->p.policy == MOETAX_STORE_NEXT_USE && now % (uint64_t)s->lfu_aging == 0) {
        for (int k = 0; k < s->n_keys; k++) s->ex[k].uses *= 0.5;
        for (int l = 0; l < s->n_layer; l++) s->pass_w[l] *= 0.5;
    }
}

/* The pass of `layer` that a prefetch issued now is for: the next one, or the one in
 * progress if the layer's experts are being acquired now. */
static uint64_t pass_ahead(const struct moetax_store *s, int layer) {
    return s->passes[layer] + (s->lheld[layer] > 0 ? 0 : 1);
}

/* x (of `layer`) was announced by a prefetch for a pass that has not ended yet. */
static bool hint_live(const struct moetax_store *s, int layer, const struct expert *x) {
    return x->hint != 0 && (s->passes[layer] < x->hint || (s->passes[layer] == x->hint && s->lheld[layer] > 0));
}

/* next-use: the expected number of layer steps until (layer, .) is acquired again, an online
 * stand-in for Belady's "farthest next use". Layers come round in a fixed cycle, so the
 * expert's layer is next computed d steps ahead (d = n_cycle for the layer just computed);
 * there it is used with probability p (its share of the layer's passes), else one more
 * cycle: E = d + n_cycle * (1/p - 1). An expert a live prefetch announced is taken as
 * certain (p = 1): E = d, or 0 once the pass it was announced for is under way. */
static double next_use(const struct moetax_store *s, int key) {
    const struct expert *x = &s->ex[key];
    int layer = key / s->n_expert, nc = s->n_cycle;
    int r = s->lrank[layer], rc = s->cur_layer >= 0 ? s->lrank[s->cur_layer] : -1;
    int d = rc >= 0 ? ((r - rc) % nc + nc) % nc : r + 1;
    if (d == 0) d = nc;
    if (hint_live(s, layer, x)) /* its layer's pass in progress: needed now */
        return s->passes[layer] == x->hint && s->lheld[layer] > 0 ? 0 : d;
    /* +0.5 / +1: a prior, so a key never used is not certain to stay unused */
    double p = (x->uses + 0.5) / (s->pass_w[layer] + 1.0);
    if (p > 1.0) p = 1.0;
    return d + nc * (1.0 / p - 1.0);
}

/* Lower evicts first: (tier, primary, last_use) compared in order. */
struct victim_key {
    int tier;
    double primary;
    uint64_t last_use;
};

static struct victim_key victim_key(const struct moetax_store *s, const struct slot *sl) {
    const struct expert *x = &s->ex[sl->key];
    struct victim_key v = {.tier = sl->pf ? 1 : 0, .last_use = sl->last_use};
    int layer = sl->key / s->n_expert;
    switch (s->p.policy) {
    case MOETAX_STORE_LRU: v.primary = (double)sl->last_use; break;
    case MOETAX_STORE_LFU: v.primary = (double)x->freq; break;
    case MOETAX_STORE_LFRU:
        v.primary = x->crf > 0 ? log2(x->crf) - (double)(s->now - x->last) / s->lfru_h : -INFINITY;
        break;
    case MOETAX_STORE_NEXT_USE:
        /* a prefetch whose pass went by without acquiring it was a wrong guess: no longer kept */
        v.tier = sl->pf && hint_live(s, layer, x) ? 1 : 0;
        v.primary = -next_use(s, sl->key);
        break;
    }
    return v;
}

static bool victim_less(struct victim_key a, struct victim_key b) {
    if (a.tier != b.tier) return a.tier < b.tier;
    if (a.primary != b.primary) return a.primary < b.primary;
    return a.last_use < b.last_use;
}

/* A slot to load into: EMPTY or unpinned ERROR first, else the policy's victim
 * among READY unpinned slots (evicted here). -1 if every slot is pinned or loading. */
static int take_slot(struct moetax_store *s) {
    int best = -1;
    struct victim_key bk = {0, 0, 0};
    for (int i = 0; i < s->n_slots; i++) {
        struct slot *sl = &s->slots[i];
        if (sl->pins > 0 || sl->state == SLOT_LOADING) continue;
        if (sl->state == SLOT_EMPTY || sl->state == SLOT_ERROR) {
            best = i;
            break;
        }
        if (s->warming) continue;
        struct victim_key k = victim_key(s, sl);
        if (best < 0 || victim_less(k, bk)) {
            best = i;
            bk = k;
        }
    }
    if (best < 0) return -1;
    struct slot *sl = &s->slots[best];
    if (sl->key >= 0) {
        if (sl->state == SLOT_READY) {
            s->n_ready--;
            atomic_store_explicit(&s->holds_all, false, memory_order_relaxed);
            s->st.evictions++;
            if (sl->pf) s->st.prefetch_wasted++;
        }
        s->ex[sl->key].slot = -1;
    }
    sl->key = -1;
    sl->state = SLOT_EMPTY;
    sl->pf = sl->pf_pred = sl->pf_ahead = false;
    return best;
}

/* Mark slot i LOADING for key and queue it (demand: head of the queue). */
static void start_load(struct moetax_store *s, int i, int key, bool demand) {
    struct slot *sl = &s->slots[i];
    sl->key = key;
    sl->state = SLOT_LOADING;
    sl->seq++;
    sl->last_use = s->now;
    sl->kind = demand ? MOETAX_STORE_READ_DEMAND : sl->pf_pred ? MOETAX_STORE_READ_PREDICTED : MOETAX_STORE_READ_KNOWN;
    sl->queued_ns = store_now_ns();
    s->ex[key].slot = i;
    s->pending++;
    s->queued_bytes += s->ex[key].bytes;
    store_io_push(s->io, i, demand);
}

/* ---- acquire / release / prefetch -------------------------------------------------- */

static void trace_add(struct moetax_store *s, int layer, int e) {
    if (s->trace_n >= s->trace_max) return;
    if (s->trace_n == s->trace_alloc) {
        int64_t n = s->trace_alloc ? s->trace_alloc * 2 : 4096;
        if (n > s->trace_max) n = s->trace_max;
        int32_t *t = realloc(s->trace, sizeof(int32_t) * 2 * (size_t)n);
        if (!t) return; /* the trace is best effort */
        s->trace = t;
        s->trace_alloc = n;
    }
    s->trace[2 * s->trace_n] = layer;
    s->trace[2 * s->trace_n + 1] = e;
    s->trace_n++;
}

static void ptrs_of(const struct moetax_store *s, const struct expert *x, const struct slot *sl, const void **ptrs) {
    (void)s;
    if (!ptrs) return;
    for (int i = 0; i < x->n_ranges; i++) ptrs[i] = sl->buf + x->rpos[i];
}

moetax_status moetax_store_acquire(struct moetax_store *s, int layer, int e, const void **ptrs,
                                   uint64_t *waited_ns) {
    if (waited_ns) *waited_ns = 0;
    if (layer < 0 || layer >= s->n_layer || e < 0 || e >= s->n_expert)
        return moetax_error(MOETAX_ERR_ARG, "expert store: expert (layer %d, %d) outside %d x %d", layer, e,
                            s->n_layer, s->n_expert);
    int key = layer * s->n_expert + e;
    struct expert *x = &s->ex[key];
    if (!s->committed) return moetax_error(MOETAX_ERR_ARG, "expert store: acquire before commit");
    if (!x->registered)
        return moetax_error(MOETAX_ERR_ARG, "expert store: layer %d expert %d is not registered", layer, e);

    pthread_mutex_lock(&s->mu);
    s->now++;
    s->st.acquires++;
    trace_add(s, layer, e);
    policy_touch(s, layer, x);

    int mine = -1;        /* slot this call has pinned */
    uint64_t my_seq = 0;  /* load generation it waits for */
    uint64_t t_wait = 0;  /* first wait */
    bool timed_out = false;
    struct timespec deadline = {0, 0};
    if (s->p.io_timeout_ms > 0) {
        clock_gettime(CLOCK_MONOTONIC, &deadline);
        uint64_t ns = (uint64_t)deadline.tv_nsec + (uint64_t)s->p.io_timeout_ms * 1000000ull;
        deadline.tv_sec += (time_t)(ns / 1000000000ull);
        deadline.tv_nsec = (long)(ns % 1000000000ull);
    }
    moetax_status st = MOETAX_OK;
    for (;;) {
        int i = x->slot;
        MOETAX_ASSERT(mine < 0 || i == mine); /* a pinned slot keeps its key */
        if (i >= 0) {
            struct slot *sl = &s->slots[i];
            if (mine < 0) {
                sl->pins++;
                mine = i;
                my_seq = sl->seq;
            }
            if (sl->state == SLOT_READY) break;
            if (sl->state == SLOT_ERROR) {
                if (sl->seq == my_seq && t_wait != 0) { /* the load this call waited for failed */
                    st = moetax_error(MOETAX_ERR_IO, "%s", sl->err);
                    break;
                }
                /* an earlier failure (another acquire's or a prefetch's): retry the read */
                sl->pf = sl->pf_pred = sl->pf_ahead = false;
                start_load(s, i, key, true);
                my_seq = sl->seq;
            } else if (sl->state == SLOT_LOADING) {
                store_io_promote(s->io, i);
            }
        } else {
            i = take_slot(s);
            if (i >= 0) {
                start_load(s, i, key, true);
                s->slots[i].pins = 1;
                mine = i;
                my_seq = s->slots[i].seq;
            }
            /* else: every slot is pinned or loading; wait for a release */
        }
        if (timed_out) {
            uint64_t off = x->span[0].off;
            st = moetax_error(MOETAX_ERR_IO,
                              "expert store: layer %d expert %d: %s: offset %llu: %s after %d ms (io_timeout_ms)",
                              layer, e, s->path, (unsigned long long)off,
                              mine >= 0 ? "read not complete" : "no free slot (all pinned or loading)",
                              s->p.io_timeout_ms);
            break;
        }
        if (t_wait == 0) {
            t_wait = store_now_ns();
            if (s->n_waiting++ == 0) s->wait_start = t_wait;
        }
        if (s->p.io_timeout_ms > 0) {
            if (pthread_cond_timedwait(&s->cv, &s->mu, &deadline) == ETIMEDOUT) timed_out = true;
        } else {
            pthread_cond_wait(&s->cv, &s->mu);
        }
    }
    uint64_t waited = t_wait ? store_now_ns() - t_wait : 0;
    if (t_wait && --s->n_waiting == 0) s->wait_ns += t_wait + waited - s->wait_start;
    if (t_wait) {
        s->st.misses++;
        s->st.stall_ns += waited;
    } else {
        s->st.hits++;
    }
    if (st == MOETAX_OK) {
        struct slot *sl = &s->slots[mine];
        if (sl->pf) {
            s->st.prefetch_used++;
            if (sl->pf_pred) s->st.predicted_used++;
            if (sl->pf_ahead) s->st.ahead_used++;
            if (t_wait) s->st.prefetch_late++;
            sl->pf = sl->pf_pred = sl->pf_ahead = false;
        }
        sl->last_use = s->now;
        ptrs_of(s, x, sl, ptrs);
    } else {
        s->st.errors++;
        s->lheld[layer]--; /* nothing to release */
        if (mine >= 0 && --s->slots[mine].pins == 0) pthread_cond_broadcast(&s->cv);
    }
    pthread_mutex_unlock(&s->mu);
    if (waited_ns) *waited_ns = waited;
    return st;
}

void moetax_store_release(struct moetax_store *s, int layer, int e) {
    if (layer < 0 || layer >= s->n_layer || e < 0 || e >= s->n_expert) return;
    pthread_mutex_lock(&s->mu);
    int i = s->ex[layer * s->n_expert + e].slot;
    MOETAX_ASSERT(i >= 0 && s->slots[i].pins > 0 && s->lheld[layer] > 0); /* release without acquire: a bug in the caller */
    s->lheld[layer]--;
    if (--s->slots[i].pins == 0) pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
}

moetax_status moetax_store_warm(struct moetax_store *s, const int32_t *layers, const int32_t *experts, int n) {
    if (!s->committed) return moetax_error(MOETAX_ERR_ARG, "expert store: warm start before commit");
    /* the ranked experts into empty slots only: one whose read has already finished is not a
     * victim for a lower-ranked one (with fast reads, e.g. io_uring, it would be) */
    pthread_mutex_lock(&s->mu);
    s->warming = true;
    pthread_mutex_unlock(&s->mu);
    for (int i = 0; i < n; i++) moetax_store_prefetch(s, layers[i], &experts[i], 1, false);
    moetax_status st = MOETAX_OK;
    pthread_mutex_lock(&s->mu);
    s->warming = false;
    while (s->pending > 0) pthread_cond_wait(&s->cv, &s->mu);
    for (int i = 0; i < s->n_slots && !st; i++)
        if (s->slots[i].state == SLOT_ERROR) st = moetax_error(MOETAX_ERR_IO, "%s", s->slots[i].err);
    pthread_mutex_unlock(&s->mu);
    return st;
}

void moetax_store_set_prior(struct moetax_store *s, int layer, const double *share, double weight) {
    if (layer < 0 || layer >= s->n_layer || !(weight > 0)) return;
    pthread_mutex_lock(&s->mu);
    s->pass_w[layer] = weight;
    for (int e = 0; e < s->n_expert; e++) {
        struct expert *x = &s->ex[layer * s->n_expert + e];
        const double u = share[e] > 0 ? (share[e] < 1 ? share[e] : 1) * weight : 0;
        x->uses = u;
        x->freq = (uint32_t)(u + 0.5);
        x->crf = u;
    }
    pthread_mutex_unlock(&s->mu);
}

void moetax_store_prefetch(struct moetax_store *s, int layer, const int32_t *experts, int n, bool predicted) {
    if (!s->committed || layer < 0 || layer >= s->n_layer) return;
    pthread_mutex_lock(&s->mu);
    for (int k = 0; k < n; k++) {
        int e = experts[k];
        if (e < 0 || e >= s->n_expert) continue;
        int key = layer * s->n_expert + e;
        struct expert *x = &s->ex[key];
        if (!x->registered) continue;
        int i = x->slot;
        /* a prediction only uses I/O the known demand leaves idle: with every reader busy it
         * would queue behind needed reads and, when wrong, cost the disk time it was meant to
         * save and evict an expert that may be reused (random routing: ~40% are wrong). Nor
         * while the disk was busy most of the last cycle (a token): then reads, not compute,
         * bound the step, and a read of a guess delays the reads of what is needed. */
        if (predicted && i < 0 &&
            (s->pending >= s->p.n_io_threads || s->cyc_util > MOETAX_STORE_PREDICT_MAX_IO_BUSY)) {
            s->st.prefetch_dropped++;
            continue;
        }
        x->hint = pass_ahead(s, layer); /* needed soon: next-use keeps it until that pass ends */
        if (i >= 0) {
            struct slot *sl = &s->slots[i];
            if (sl->state != SLOT_ERROR || sl->pins > 0) continue; /* resident or in flight */
        } else {
            i = take_slot(s);
            if (i < 0) {
                s->st.prefetch_dropped++;
                continue;
            }
        }
        s->slots[i].pf = true;
        s->slots[i].pf_pred = predicted;
        s->slots[i].pf_ahead = false;
        start_load(s, i, key, false);
        s->st.prefetch_issued++;
        if (predicted) s->st.predicted_issued++;
    }
    pthread_mutex_unlock(&s->mu);
}

/* The disk's room (under the lock): bytes it reads in one layer's compute time, at the read rate
 * measured so far (bytes over the time a read was in flight); 0 until both are measured. */
static double ahead_room(const struct moetax_store *s) {
    const uint64_t busy = io_busy_until(s, store_now_ns());
    if (!busy || !(s->layer_ns > 0)) return 0;
    return (double)s->st.bytes_read / (double)busy * s->layer_ns;
}

/* Read from the read-ahead list while the bytes queued or in flight are below the disk's room
 * (under the lock). An item whose layer's pass has begun is stale: that layer's own reads are
 * queued by then, and a wrong guess would only take the disk from them. */
static void ahead_pump(struct moetax_store *s) {
    if (s->ahead_pos >= s->n_ahead) return;
    const double room = ahead_room(s);
    while (s->ahead_pos < s->n_ahead && (double)s->queued_bytes < room) {
        const struct ahead_item it = s->ahead[s->ahead_pos++];
        const int layer = it.key / s->n_expert;
        struct expert *x = &s->ex[it.key];
        if (s->passes[layer] >= it.pass) {
            s->st.ahead_stale++;
            continue;
        }
        if (x->slot >= 0) continue; /* read meanwhile (or failed: the acquire retries it) */
        const int i = take_slot(s);
        if (i < 0) {
            s->st.prefetch_dropped++;
            continue;
        }
        x->hint = it.pass;
        s->slots[i].pf = s->slots[i].pf_pred = s->slots[i].pf_ahead = true;
        start_load(s, i, it.key, false);
        s->st.prefetch_issued++;
        s->st.predicted_issued++;
        s->st.ahead_issued++;
    }
}

void moetax_store_read_ahead(struct moetax_store *s, const int32_t *layers, const int32_t *experts, int n) {
    if (!s->committed) return;
    pthread_mutex_lock(&s->mu);
    s->st.ahead_stale += (uint64_t)(s->n_ahead - s->ahead_pos); /* replaced before they were read */
    s->n_ahead = s->ahead_pos = 0;
    for (int k = 0; k < n && s->n_ahead < MOETAX_STORE_READ_AHEAD_LIST; k++) {
        const int layer = layers[k], e = experts[k];
        if (layer < 0 || layer >= s->n_layer || e < 0 || e >= s->n_expert) continue;
        const int key = layer * s->n_expert + e;
        struct expert *x = &s->ex[key];
        if (!x->registered) continue;
        bool dup = false;
        for (int j = 0; j < s->n_ahead && !dup; j++) dup = s->ahead[j].key == key;
        if (dup) continue;
        s->st.ahead_offered++;
        if (x->slot >= 0) { /* resident or in flight: needed soon, as a prefetch says (next-use) */
            x->hint = pass_ahead(s, layer);
            continue;
        }
        s->ahead[s->n_ahead++] = (struct ahead_item){.key = key, .pass = pass_ahead(s, layer)};
    }
    ahead_pump(s);
    pthread_mutex_unlock(&s->mu);
}

int moetax_store_read_ahead_depth(const struct moetax_store *s) { return s->p.read_ahead; }
double moetax_store_read_ahead_min_precision(const struct moetax_store *s) { return s->p.read_ahead_min_precision; }

void moetax_store_set_predictor(struct moetax_store *s, struct moetax_predictor *p, bool own) {
    if (s->pred_own && s->pred != p) moetax_predictor_free(s->pred);
    s->pred = p;
    s->pred_own = own && p;
}
struct moetax_predictor *moetax_store_predictor(const struct moetax_store *s) { return s ? s->pred : NULL; }

/* ---- stats and trace ------------------------------------------------------------------ */

void moetax_store_get_stats(const struct moetax_store *cs, struct moetax_store_stats *out) {
    struct moetax_store *s = (struct moetax_store *)cs; /* the mutex is not part of the value */
    pthread_mutex_lock(&s->mu);
    *out = s->st;
    uint64_t busy = io_busy_until(s, store_now_ns());
    out->io_busy_ns = busy;
    out->read_gbps = busy ? (double)s->st.bytes_read / (double)busy : 0.0;
    out->direct_io_active = s->direct;
    out->direct_io_fallback = s->direct_fallback;
    out->io_engine = s->committed ? s->engine : MOETAX_STORE_IO_PREAD;
    out->io_engine_fallback = s->engine_fallback;
    out->io_engine_errno = s->engine_errno;
    out->n_slots = s->committed ? s->n_slots : 0;
    out->slot_bytes = moetax_store_slot_bytes(s);
    int r = 0;
    for (int i = 0; i < out->n_slots; i++) r += s->slots[i].state == SLOT_READY;
    out->resident = r;
    pthread_mutex_unlock(&s->mu);
}

int64_t moetax_store_trace(const struct moetax_store *cs, int32_t *layer, int32_t *expert, int64_t cap) {
    struct moetax_store *s = (struct moetax_store *)cs;
    pthread_mutex_lock(&s->mu);
    int64_t n = s->trace_n;
    if (layer && expert)
        for (int64_t i = 0; i < n && i < cap; i++) {
            layer[i] = s->trace[2 * i];
            expert[i] = s->trace[2 * i + 1];
        }
    pthread_mutex_unlock(&s->mu);
    return n;
}

int64_t moetax_store_reads(const struct moetax_store *cs, struct moetax_store_read *out, int64_t cap,
                           uint64_t *dropped) {
    struct moetax_store *s = (struct moetax_store *)cs;
    pthread_mutex_lock(&s->mu);
    const uint64_t keep = s->p.read_log_cap > 0 ? (uint64_t)s->p.read_log_cap : 0;
    const uint64_t n = s->rlog_n < keep ? s->rlog_n : keep, first = s->rlog_n - n;
    if (out)
        for (uint64_t i = 0; i < n && (int64_t)i < cap; i++) out[i] = s->rlog[(first + i) % keep];
    if (dropped) *dropped = first;
    pthread_mutex_unlock(&s->mu);
    return (int64_t)n;
}
