/* dist.c - the MPI world of one moetax command, placement, the load check, the batch
 * broadcast and the combine's collectives (see dist.h). */
#include <errno.h>
#include <math.h>
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sched.h>
#include <time.h>
#include <unistd.h>

#include "core/printable.h"
#include "dist/dist.h"
#include "moetax/gguf.h"
#include "moetax/ledger.h"
#include "moetax/readfile.h"

static struct moetax_dist *g_world;
static const char *g_placement; /* --placement FILE */
static bool g_dispatch_chosen;  /* --ep-dispatch / --ep-overlap or MOETAX_MPI_DISPATCH / _OVERLAP given */

void moetax_dist_set_placement(const char *path) { g_placement = path; }
static moetax_status place_experts(struct moetax_dist *d, struct moetax_model *m);
static moetax_status read_placement(struct moetax_dist *d, const struct moetax_model *m, const char *path);

/* A MOETAX_MPI_* number: def when unset or empty, else the whole string a finite number in [0, max];
 * false when it is not, said by every rank (a message from rank 0 alone is lost when another rank
 * ends the job first). */
static bool env_number(int rank, const char *name, double def, double max, const char *expected, double *out) {
    const char *v = getenv(name);
    *out = def;
    if (!v || !*v) return true;
    char *end;
    errno = 0;
    const double x = strtod(v, &end);
    if (end == v || *end || errno || !isfinite(x) || x < 0 || x > max) {
        fprintf(stderr, "moetax: rank %d: %s=%.40s: expected %s\n", rank, name, v, expected);
        return false;
    }
    *out = x;
    return true;
}

static bool under_mpirun(void) {
    /* OpenMPI's mpirun (and PMIx launchers) set these; a plain `moetax` never joins MPI */
    return getenv("OMPI_COMM_WORLD_SIZE") || getenv("PMIX_RANK") || getenv("PMI_RANK");
}

int moetax_dist_init(int *argc, char ***argv) {
    if (!under_mpirun()) return 0;
    int provided = 0;
    /* SERIALIZED: with --ep-overlap the communication thread makes the step's MPI calls */
    if (MPI_Init_thread(argc, argv, MPI_THREAD_SERIALIZED, &provided) != MPI_SUCCESS) {
        fprintf(stderr, "moetax: MPI_Init_thread failed\n");
        return 1;
    }
    MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
    struct moetax_dist *d = calloc(1, sizeof *d);
    if (!d) {
        fprintf(stderr, "moetax: out of memory\n");
        MPI_Abort(MPI_COMM_WORLD, 1);
        return 1;
    }
    MPI_Comm_rank(MPI_COMM_WORLD, &d->rank);
    MPI_Comm_size(MPI_COMM_WORLD, &d->size);
    d->counts = calloc((size_t)d->size, sizeof(int));
    d->displs = calloc((size_t)d->size, sizeof(int));
    const char *cm = getenv("MOETAX_MPI_COMBINE");
    double nap_us = 0;
    if (cm && !strcmp(cm, "allreduce")) d->combine = MOETAX_DIST_COMBINE_ALLREDUCE;
    else if (cm && *cm && strcmp(cm, "gather")) {
        fprintf(stderr, "moetax: rank %d: MOETAX_MPI_COMBINE=%.40s: expected gather or allreduce\n", d->rank, cm);
        MPI_Finalize();
        return 1;
    }
    if (!env_number(d->rank, "MOETAX_MPI_TIMEOUT", 60, 1e6, "seconds, a number from 0 (no limit) to 1000000",
                    &d->timeout_s) ||
        !env_number(d->rank, "MOETAX_MPI_NAP_US", 20, 999999, "microseconds, a number from 0 (no nap) to 999999",
                    &nap_us)) {
        MPI_Finalize();
        return 1;
    }
    d->nap_ns = (long)(nap_us * 1000);
    if (provided < MPI_THREAD_FUNNELED && d->rank == 0)
        fprintf(stderr, "moetax: warning: MPI gives thread level %d, FUNNELED wanted\n", provided);
    d->thread_level = provided;
    g_world = d;
    const char *dm = getenv("MOETAX_MPI_DISPATCH"), *ov = getenv("MOETAX_MPI_OVERLAP");
    const bool ovl = ov && *ov && strcmp(ov, "0");
    if (moetax_dist_set_dispatch(dm && *dm ? dm : ovl ? "alltoall" : "replicated", ovl)) {
        g_world = NULL;
        MPI_Finalize();
        return 1;
    }
    g_dispatch_chosen = (dm && *dm) || ovl; /* else moetax_dist_default_dispatch may pick alltoall */
    /* only rank 0 writes results; errors stay on each rank's stderr */
    if (d->rank > 0 && !freopen("/dev/null", "w", stdout)) fprintf(stderr, "moetax: rank %d: cannot silence stdout\n", d->rank);
    return 0;
}

int moetax_dist_set_dispatch(const char *mode, bool overlap) {
    struct moetax_dist *d = g_world;
    g_dispatch_chosen = true;
    if (!strcmp(mode, "alltoall")) d->dispatch = true;
    else if (!strcmp(mode, "replicated")) d->dispatch = false;
    else {
        if (d->rank == 0) fprintf(stderr, "moetax: dispatch '%s': expected alltoall or replicated\n", mode);
        return 1;
    }
    d->overlap = overlap;
    if (overlap && !d->dispatch) {
        if (d->rank == 0) fprintf(stderr, "moetax: --ep-overlap needs --ep-dispatch alltoall\n");
        return 1;
    }
    if (overlap && d->thread_level < MPI_THREAD_SERIALIZED) {
        if (d->rank == 0)
            fprintf(stderr, "moetax: warning: MPI gives thread level %d, not SERIALIZED: no overlap\n", d->thread_level);
        d->overlap = false;
    }
    return 0;
}

void moetax_dist_default_dispatch(int64_t n_seq) {
    struct moetax_dist *d = g_world;
    if (!d || g_dispatch_chosen || d->size < 2) return;
    d->dispatch = n_seq >= MOETAX_DIST_A2A_MIN_SEQ;
    d->overlap = false;
}

/* this process's peak RSS (VmHWM of /proc/self/status) in bytes; 0 if unknown */
static uint64_t peak_rss_bytes(void) {
    FILE *f = fopen("/proc/self/status", "r");
    char line[256];
    unsigned long long kb = 0;
    while (f && fgets(line, sizeof line, f))
        if (sscanf(line, "VmHWM: %llu kB", &kb) == 1) break;
    if (f) fclose(f);
    return (uint64_t)kb << 10;
}

void moetax_dist_finalize(int rc) {
    if (!g_world) return;
    moetax_dist_a2a_stop();
    const struct moetax_dist *d = g_world;
    /* read by tests/test_mpi.py against `inspect --ranks N` */
    fprintf(stderr, "moetax: rank %d of %d: peak RSS %.2f MiB (VmHWM)\n", d->rank, d->size,
            (double)peak_rss_bytes() / (1 << 20));
    if (d->size > 1 && d->n_collectives && d->dispatch)
        fprintf(stderr, "moetax: rank %d of %d: %llu exchanges (alltoall dispatch%s), %llu records, %.3f MB sent, "
                "%.3f MB received; once per rank %.3f MB vs once per expert %.3f MB (%.1f%%); comm %.3f s, wait %.3f s "
                "(counts before each), blocked %.3f s; logits %.3f MB received in %.3f s\n", d->rank, d->size,
                (unsigned long long)d->n_collectives, d->overlap ? ", overlapped" : "", (unsigned long long)d->n_records,
                (double)d->bytes_sent / 1e6, (double)d->bytes_recv / 1e6, (double)d->a2a_bytes_rank / 1e6,
                (double)d->a2a_bytes_expert / 1e6,
                d->a2a_bytes_expert ? 100.0 * (double)d->a2a_bytes_rank / (double)d->a2a_bytes_expert : 0.0,
                (double)d->ns_comm / 1e9, (double)d->ns_wait / 1e9, (double)d->ns_blocked / 1e9,
                (double)d->bytes_logits / 1e6, (double)d->ns_logits / 1e9);
    if (d->size > 1 && d->n_global)
        fprintf(stderr, "moetax: rank %d of %d: %llu global views (replicas' counts or the capacity's router logits, one "
                "gather per MoE layer and micro-batch), %.3f MB sent + received (in the totals above)\n", d->rank, d->size,
                (unsigned long long)d->n_global, (double)d->bytes_global / 1e6);
    else if (d->size > 1 && d->n_collectives && !d->dispatch)
        fprintf(stderr, "moetax: rank %d of %d: %llu combines (%s), %.3f MB sent, %.3f MB received (%.1f KB per "
                "combine), comm %.3f s, wait %.3f s (MPI_Barrier before each)\n", d->rank, d->size,
                (unsigned long long)d->n_collectives, d->combine ? "allreduce" : "gather", (double)d->bytes_sent / 1e6,
                (double)d->bytes_recv / 1e6, (double)d->bytes_recv / 1e3 / (double)d->n_collectives,
                (double)d->ns_comm / 1e9, (double)d->ns_wait / 1e9);
    if (d->size > 1) moetax_dist_replicas_summary(d);
    fflush(stdout);
    fflush(stderr);
    if (rc) MPI_Abort(MPI_COMM_WORLD, rc); /* a rank that quits must not leave the others waiting */
    MPI_Finalize();
    free(g_world->owner);
    free(g_world->layer_sent);
    free(g_world->layer_recv);
    free(g_world->xrec);
    moetax_dist_replicas_free(g_world);
    free(g_world->counts);
    free(g_world->displs);
    free(g_world->b_tok); free(g_world->b_pos); free(g_world->b_seq); free(g_world->b_want);
    free(g_world);
    g_world = NULL;
}

struct moetax_dist *moetax_dist_world(void) { return g_world; }
int moetax_dist_rank(void) { return g_world ? g_world->rank : 0; }

void moetax_dist_expert_range(const struct moetax_dist *d, int32_t E, int rank, int32_t *lo, int32_t *hi) {
    *lo = (int32_t)((int64_t)E * rank / d->size);
    *hi = (int32_t)((int64_t)E * (rank + 1) / d->size);
}

static moetax_status mpi_fail(int rc, const char *what) {
    char s[MPI_MAX_ERROR_STRING];
    int n = 0;
    MPI_Error_string(rc, s, &n);
    return moetax_error(MOETAX_ERR_IO, "rank %d: %s failed: %s", g_world ? g_world->rank : -1, what, s);
}

/* FNV-1a of the file's header and tensor table (everything before the data section) and its size */
static uint64_t header_hash(const struct moetax_model *m) {
    const struct moetax_gguf *g = m->gguf;
    uint64_t h = 1469598103934665603ull;
    for (uint64_t i = 0; g->base && i < g->data_offset && i < g->size; i++) h = (h ^ g->base[i]) * 1099511628211ull;
    return (h ^ g->size) * 1099511628211ull;
}

moetax_status moetax_dist_model_loaded(moetax_status st, struct moetax_model **m) {
    struct moetax_dist *d = g_world;
    if (!d) return st;
    /* 1: every rank's result: the lowest failing rank's message goes to all */
    int mine = st ? d->rank : d->size, first = d->size;
    int rc = MPI_Allreduce(&mine, &first, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
    if (rc != MPI_SUCCESS) st = st ? st : mpi_fail(rc, "MPI_Allreduce (load check)");
    if (rc == MPI_SUCCESS && first < d->size) {
        char msg[512] = {0};
        if (d->rank == first) snprintf(msg, sizeof msg, "%s", moetax_last_error());
        MPI_Bcast(msg, sizeof msg, MPI_CHAR, first, MPI_COMM_WORLD);
        msg[sizeof msg - 1] = 0;
        if (d->rank == first) st = moetax_error(st, "rank %d of %d: %s", d->rank, d->size, msg);
        else st = moetax_error(MOETAX_ERR_IO, "rank %d of %d failed to load the model: %s", first, d->size, msg);
    }
    /* 2: the same file everywhere (header and tensor table) */
    if (!st) {
        uint64_t h = header_hash(*m), *all = calloc((size_t)d->size, sizeof *all);
        if (!all) st = moetax_error(MOETAX_ERR_NOMEM, "out of memory");
        rc = all ? MPI_Allgather(&h, 1, MPI_UINT64_T, all, 1, MPI_UINT64_T, MPI_COMM_WORLD) : MPI_SUCCESS;
        if (!st && rc != MPI_SUCCESS) st = mpi_fail(rc, "MPI_Allgather (model check)");
        for (int r = 1; !st && r < d->size; r++)
            if (all[r] != all[0])
                st = moetax_error(MOETAX_ERR_ARG,
                                  "rank %d's model file (%s on rank %d) differs from rank 0's (header and tensor "
                                  "table checksum %016llx vs %016llx): every rank needs the same file",
                                  r, d->rank == r ? (*m)->gguf->path : "its path", r, (unsigned long long)all[r],
                                  (unsigned long long)all[0]);
        free(all);
    }
    if (!st && (*m)->hp.n_expert > 0) st = place_experts(d, *m);
    if (st && *m) {
        moetax_model_free(*m);
        *m = NULL;
    }
    return st;
}

/* A placement file is text of one short line per MoE layer; a larger file is refused before it is
 * parsed (a device such as /dev/zero never ends). A line may hold DIST_PLACEMENT_LINE_MAX bytes of
 * spaces and comment plus DIST_PLACEMENT_RANK_BYTES per expert (a rank of up to 10 digits and a space). */
#define DIST_PLACEMENT_MAX_BYTES ((size_t)16 << 20)
#define DIST_PLACEMENT_LINE_MAX ((size_t)64 << 10)
#define DIST_PLACEMENT_RANK_BYTES 12

/* the 1-based line of byte off in text */
static int placement_line_of(const char *text, size_t off) {
    int ln = 1;
    for (const char *q = text; (q = memchr(q, '\n', (size_t)(text + off - q))); q++) ln++;
    return ln;
}

/* The whole placement file at path in a malloc'd, NUL-terminated buffer: text only (a NUL byte is an
 * error naming its line and offset), at most DIST_PLACEMENT_MAX_BYTES, each line at most line_max
 * bytes (fgets would cut a longer one and take its tail for a line of its own). */
static moetax_status read_placement_text(const char *path, size_t line_max, char **text) {
    char name[1024];
    snprintf(name, sizeof name, "--placement %s", path);
    size_t n;
    const size_t max = DIST_PLACEMENT_MAX_BYTES;
    const struct moetax_readfile_params rp = {.max_bytes = max, .text = true, .name = name};
    moetax_status st = moetax_readfile_path(path, &rp, text, &n);
    if (st == MOETAX_ERR_LIMIT)
        return moetax_error(st, "--placement %s: more than %zu bytes (%zu MiB); a placement file has one line per "
                            "MoE layer", path, max, max >> 20);
    for (size_t a = 0; !st && a < n;) { /* every line within line_max */
        const char *e = memchr(*text + a, '\n', n - a);
        const size_t b = e ? (size_t)(e - *text) : n;
        if (b - a > line_max)
            st = moetax_error(MOETAX_ERR_FORMAT, "--placement %s:%d: the line is too long (%zu bytes from byte offset "
                              "%zu, at most %zu)", path, placement_line_of(*text, a), b - a, a, line_max);
        a = b + 1;
    }
    if (st) {
        free(*text);
        *text = NULL;
    }
    return st;
}

/* the placement file (see moetax_dist_set_placement) into d->owner */
static moetax_status read_placement(struct moetax_dist *d, const struct moetax_model *m, const char *path) {
    const int L = m->hp.n_layer, E = m->hp.n_expert;
    const size_t line_max = DIST_PLACEMENT_LINE_MAX + (size_t)E * DIST_PLACEMENT_RANK_BYTES;
    char *text = NULL;
    moetax_status st = read_placement_text(path, line_max, &text);
    if (st) return st;
    int32_t *all = malloc(sizeof(int32_t) * (size_t)E);
    bool *set = calloc((size_t)L, sizeof(bool)), have_all = false;
    if (!all || !set) st = moetax_error(MOETAX_ERR_NOMEM, "out of memory");
    char *next = text;
    for (int ln = 1; !st && next; ln++) {
        char *line = next, *nl = strchr(line, '\n');
        next = nl ? nl + 1 : NULL;
        if (nl) *nl = 0;
        char *h = strchr(line, '#'), *p = line, *end;
        if (h) *h = 0;
        while (*p == ' ' || *p == '\t') p++;
        if (!*p || *p == '\n' || *p == '\r') continue;
        long il = -1;
        if (*p == '*') p++;
        else {
            il = strtol(p, &end, 10);
            if (end != p && il >= 0 && il < L && !m->layers[il].is_moe) {
                st = moetax_error(MOETAX_ERR_FORMAT, "--placement %s:%d: layer %ld is a dense layer (no experts to place)",
                                  path, ln, il);
                break;
            }
            if (end == p || il < 0 || il >= L) {
                st = moetax_error(MOETAX_ERR_FORMAT, "--placement %s:%d: expected a MoE layer (0..%d) or '*' before ':'",
                                  path, ln, L - 1);
                break;
            }
            p = end;
        }
        while (*p == ' ') p++;
        if (*p++ != ':') { st = moetax_error(MOETAX_ERR_FORMAT, "--placement %s:%d: expected ':' after the layer", path, ln); break; }
        if ((il < 0 && have_all) || (il >= 0 && set[il])) {
            char which[24] = "*";
            if (il >= 0) snprintf(which, sizeof which, "%ld", il);
            st = moetax_error(MOETAX_ERR_FORMAT, "--placement %s:%d: layer %s placed twice", path, ln, which);
            break;
        }
        int32_t *row = il < 0 ? all : d->owner + (size_t)il * (size_t)E;
        int n = 0;
        for (;;) {
            long r = strtol(p, &end, 10);
            if (end == p) break;
            if (r < 0 || r >= d->size) {
                st = moetax_error(MOETAX_ERR_FORMAT, "--placement %s:%d: expert %d on rank %ld, but there are %d ranks",
                                  path, ln, n, r, d->size);
                break;
            }
            if (n < E) row[n] = (int32_t)r;
            n++;
            p = end;
        }
        while (!st && (*p == ' ' || *p == '\t' || *p == '\n' || *p == '\r')) p++;
        if (!st && *p) {
            char shown[21]; /* what is there, printable: a binary file's bytes stay off the terminal */
            moetax_printable(shown, sizeof shown, p, SIZE_MAX, MOETAX_PRINTABLE_ASCII);
            st = moetax_error(MOETAX_ERR_FORMAT, "--placement %s:%d: '%s' is not a rank", path, ln, shown);
        }
        if (!st && n != E)
            st = moetax_error(MOETAX_ERR_FORMAT, "--placement %s:%d: %d ranks, but every one of the %d experts needs "
                              "exactly one", path, ln, n, E);
        if (il < 0) have_all = true;
        else set[il] = true;
    }
    for (int il = 0; !st && il < L; il++) {
        if (!m->layers[il].is_moe || set[il]) continue;
        if (!have_all) st = moetax_error(MOETAX_ERR_FORMAT, "--placement %s: MoE layer %d is not placed (no line for it, "
                                         "no '*' line)", path, il);
        else memcpy(d->owner + (size_t)il * (size_t)E, all, sizeof(int32_t) * (size_t)E);
    }
    free(text);
    free(all);
    free(set);
    return st;
}

/* The placement (contiguous ranges, or the file's) and this rank's experts in the model. */
static moetax_status place_experts(struct moetax_dist *d, struct moetax_model *m) {
    const int L = m->hp.n_layer, E = m->hp.n_expert;
    free(d->owner);
    d->owner = calloc((size_t)L * (size_t)E, sizeof(int32_t));
    uint8_t *own = calloc((size_t)L * (size_t)E, 1);
    moetax_status st = d->owner && own ? MOETAX_OK : moetax_error(MOETAX_ERR_NOMEM, "out of memory");
    for (int il = 0; !st && il < L; il++)
        for (int r = 0; r < d->size; r++) {
            int32_t lo, hi;
            moetax_dist_expert_range(d, E, r, &lo, &hi);
            for (int32_t e = lo; e < hi; e++) d->owner[(size_t)il * (size_t)E + (size_t)e] = r;
        }
    if (!st && g_placement) st = read_placement(d, m, g_placement);
    d->contiguous = true;
    for (int il = 0; !st && il < L; il++)
        for (int e = 0; e < E; e++) {
            const int32_t r = d->owner[(size_t)il * (size_t)E + (size_t)e];
            if (e && r < d->owner[(size_t)il * (size_t)E + (size_t)e - 1]) d->contiguous = false;
            own[(size_t)il * (size_t)E + (size_t)e] = r == d->rank;
        }
    if (!st) st = moetax_dist_replicas_init(d, m, own);
    if (!st) st = moetax_model_set_expert_owned(m, own);
    free(d->layer_sent);
    free(d->layer_recv);
    d->layer_sent = calloc((size_t)L, sizeof(uint64_t));
    d->layer_recv = calloc((size_t)L, sizeof(uint64_t));
    d->n_layer_b = d->layer_sent && d->layer_recv ? L : 0;
    free(own);
    return st;
}

moetax_status moetax_dist_plan_offline(const struct moetax_model *m, int n_ranks, const char *placement,
                                       struct moetax_dist **out) {
    *out = NULL;
    if (g_world) return moetax_error(MOETAX_ERR_ARG, "a placement plan outside mpirun only");
    struct moetax_dist *d = calloc(1, sizeof *d);
    if (!d) return moetax_error(MOETAX_ERR_NOMEM, "out of memory");
    d->size = n_ranks;
    d->rank = 0;
    g_world = d; /* for the messages of the replicas' settings (rank 0 prints) */
    const char *old = g_placement;
    g_placement = placement;
    moetax_status st = m->hp.n_expert > 0 ? MOETAX_OK : moetax_error(MOETAX_ERR_ARG, "the model has no routed experts");
    if (!st) {
        const int L = m->hp.n_layer, E = m->hp.n_expert;
        free(d->owner);
        d->owner = calloc((size_t)L * (size_t)E, sizeof(int32_t));
        uint8_t *own = calloc((size_t)L * (size_t)E, 1);
        if (!d->owner || !own) st = moetax_error(MOETAX_ERR_NOMEM, "out of memory");
        for (int il = 0; !st && il < L; il++)
            for (int r = 0; r < n_ranks; r++) {
                int32_t lo, hi;
                moetax_dist_expert_range(d, E, r, &lo, &hi);
                for (int32_t e = lo; e < hi; e++) d->owner[(size_t)il * (size_t)E + (size_t)e] = r;
            }
        if (!st && placement) st = read_placement(d, m, placement);
        if (!st) st = moetax_dist_replicas_init(d, m, own);
        free(own);
    }
    g_placement = old;
    g_world = NULL;
    if (st) {
        moetax_dist_replicas_free(d);
        free(d->owner);
        free(d);
        return st;
    }
    *out = d;
    return MOETAX_OK;
}

void moetax_dist_plan_free(struct moetax_dist *d) {
    if (!d) return;
    moetax_dist_replicas_free(d);
    free(d->owner);
    free(d);
}

static bool grow_batch(struct moetax_dist *d, int64_t n) {
    if (n <= d->b_cap) return true;
    int32_t *t = realloc(d->b_tok, sizeof(int32_t) * (size_t)n);
    if (t) d->b_tok = t;
    int32_t *p = realloc(d->b_pos, sizeof(int32_t) * (size_t)n);
    if (p) d->b_pos = p;
    int32_t *s = realloc(d->b_seq, sizeof(int32_t) * (size_t)n);
    if (s) d->b_seq = s;
    bool *w = realloc(d->b_want, sizeof(bool) * (size_t)n);
    if (w) d->b_want = w;
    if (!t || !p || !s || !w) return false;
    d->b_cap = n;
    return true;
}

moetax_status moetax_dist_sync_batch(struct moetax_dist *d, int64_t *n, const int32_t **token, const int32_t **pos,
                                     const int32_t **seq, const bool **want) {
    if (d->size == 1) return MOETAX_OK;
    int64_t n0 = *n;
    int rc = MPI_Bcast(&n0, 1, MPI_INT64_T, 0, MPI_COMM_WORLD);
    if (rc != MPI_SUCCESS) return mpi_fail(rc, "MPI_Bcast (batch size)");
    if (n0 != *n)
        return moetax_error(MOETAX_ERR_INTERNAL, "rank %d: a batch of %lld tokens where rank 0 has %lld: the ranks "
                            "diverged", d->rank, (long long)*n, (long long)n0);
    if (!grow_batch(d, n0)) return moetax_error(MOETAX_ERR_NOMEM, "out of memory");
    if (d->rank == 0) {
        memcpy(d->b_tok, *token, sizeof(int32_t) * (size_t)n0);
        memcpy(d->b_pos, *pos, sizeof(int32_t) * (size_t)n0);
        memcpy(d->b_seq, *seq, sizeof(int32_t) * (size_t)n0);
        memcpy(d->b_want, *want, sizeof(bool) * (size_t)n0);
    }
    int32_t *bufs[3] = {d->b_tok, d->b_pos, d->b_seq};
    for (int i = 0; i < 3; i++)
        if ((rc = MPI_Bcast(bufs[i], (int)n0, MPI_INT32_T, 0, MPI_COMM_WORLD)) != MPI_SUCCESS)
            return mpi_fail(rc, "MPI_Bcast (batch)");
    if ((rc = MPI_Bcast(d->b_want, (int)(n0 * (int64_t)sizeof(bool)), MPI_BYTE, 0, MPI_COMM_WORLD)) != MPI_SUCCESS)
        return mpi_fail(rc, "MPI_Bcast (batch)");
    if (d->rank > 0) {
        *token = d->b_tok;
        *pos = d->b_pos;
        *seq = d->b_seq;
        *want = d->b_want;
    }
    return MOETAX_OK;
}

enum { DIST_TAG_BARRIER = 7001, DIST_REQ_MAX = 1024 };

/* After a timeout in the barrier: which ranks are missing. Every rank still waiting there
 * times out too, so each announces itself to all with one message and listens for the others'
 * for a second; the ranks not heard from are the late ones. (The announcements to a rank that
 * never comes stay unmatched: the job is aborted right after.) */
void moetax_dist_late_ranks(const struct moetax_dist *d, char *out, size_t cap) {
    const int P = d->size;
    static char here = 1;
    bool heard[DIST_REQ_MAX / 2] = {false};
    heard[d->rank] = true;
    for (int r = 0; r < P; r++) {
        MPI_Request q;
        if (r != d->rank && MPI_Isend(&here, 1, MPI_CHAR, r, DIST_TAG_BARRIER + 1, MPI_COMM_WORLD, &q) == MPI_SUCCESS)
            MPI_Request_free(&q);
    }
    const uint64_t t0 = moetax_ledger_now();
    while (moetax_ledger_now() - t0 < 1000000000ull) {
        int flag = 0;
        MPI_Status stt;
        if (MPI_Iprobe(MPI_ANY_SOURCE, DIST_TAG_BARRIER + 1, MPI_COMM_WORLD, &flag, &stt) != MPI_SUCCESS) break;
        if (flag) {
            char c;
            MPI_Recv(&c, 1, MPI_CHAR, stt.MPI_SOURCE, DIST_TAG_BARRIER + 1, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
            if (stt.MPI_SOURCE >= 0 && stt.MPI_SOURCE < P) heard[stt.MPI_SOURCE] = true;
        } else {
            sched_yield();
        }
    }
    size_t o = 0;
    out[0] = 0;
    for (int r = 0; r < P; r++)
        if (!heard[r] && o + 16 < cap) o += (size_t)snprintf(out + o, cap - o, "%s%d", o ? ", " : "", r);
}

void moetax_dist_test_stall(const struct moetax_dist *d) {
    static bool stalled;
    const char *stall = getenv("MOETAX_MPI_TEST_STALL");
    int sr = -1, ss = 0;
    if (!stalled && stall && sscanf(stall, "%d:%d", &sr, &ss) == 2 && sr == d->rank && ss > 0) sleep((unsigned)ss);
    stalled = true;
}

void moetax_dist_book_layer(struct moetax_dist *d, int il, uint64_t t0, uint64_t t1, uint64_t sent, uint64_t recv) {
    if (d->xrec_cap > 0) {
        const int64_t i = atomic_fetch_add_explicit(&d->xrec_n, 1, memory_order_relaxed);
        d->xrec[i % d->xrec_cap] =
            (struct moetax_dist_xrec){.t0 = t0, .t1 = t1, .sent = sent, .recv = recv, .layer = il};
    }
    if (il < 0 || il >= d->n_layer_b) return;
    d->layer_sent[il] += sent;
    d->layer_recv[il] += recv;
}

moetax_status moetax_dist_keep_exchanges(struct moetax_dist *d, int64_t cap) {
    free(d->xrec);
    d->xrec = NULL;
    d->xrec_cap = 0;
    atomic_store(&d->xrec_n, 0);
    if (cap <= 0) return MOETAX_OK;
    if (!(d->xrec = calloc((size_t)cap, sizeof *d->xrec)))
        return moetax_error(MOETAX_ERR_NOMEM, "rank %d: out of memory for %lld exchange records", d->rank, (long long)cap);
    d->xrec_cap = cap;
    return MOETAX_OK;
}

int64_t moetax_dist_exchanges(const struct moetax_dist *d, struct moetax_dist_xrec *out, int64_t cap,
                              uint64_t *dropped) {
    const int64_t n = atomic_load(&d->xrec_n), kept = n < d->xrec_cap ? n : d->xrec_cap;
    if (dropped) *dropped = (uint64_t)(n - kept);
    if (!out) return kept;
    const int64_t m = kept < cap ? kept : cap; /* the newest m */
    for (int64_t i = 0; i < m; i++) out[i] = d->xrec[(n - m + i) % d->xrec_cap];
    return m;
}

moetax_status moetax_dist_barrier(struct moetax_dist *d, int il) {
    d->cur_layer = il;
    moetax_dist_test_stall(d);
    const double limit = d->timeout_s;
    const int P = d->size;
    if (P > DIST_REQ_MAX / 2)
        return moetax_error(MOETAX_ERR_LIMIT, "rank %d: %d ranks: the barrier handles at most %d", d->rank, P, DIST_REQ_MAX / 2);
    /* MPI_Ibarrier polled with a deadline: as fast as MPI_Barrier (a hand-made exchange of empty
     * messages with every rank measured half the decode speed at np 2), and a rank that does not
     * come makes the others fail instead of hanging; late_ranks then names it. */
    MPI_Request req = MPI_REQUEST_NULL;
    uint64_t t0 = moetax_ledger_now();
    int rc = MPI_Ibarrier(MPI_COMM_WORLD, &req), done = 0;
    while (rc == MPI_SUCCESS && !done) {
        rc = MPI_Test(&req, &done, MPI_STATUS_IGNORE);
        if (done || rc != MPI_SUCCESS) break;
        if (limit > 0 && (double)(moetax_ledger_now() - t0) / 1e9 > limit) {
            char late[256];
            moetax_dist_late_ranks(d, late, sizeof late);
            d->ns_wait += moetax_ledger_now() - t0;
            return moetax_error(MOETAX_ERR_IO, "rank %d of %d: waited more than %g s (MOETAX_MPI_TIMEOUT) before layer %d's "
                                "combine: rank(s) %s did not arrive", d->rank, P, limit, il, late[0] ? late : "?");
        }
        sched_yield();
    }
    d->ns_wait += moetax_ledger_now() - t0;
    return rc == MPI_SUCCESS ? MOETAX_OK : mpi_fail(rc, "barrier (MPI_Ibarrier)");
}

moetax_status moetax_dist_gather_rows(struct moetax_dist *d, float *y, int64_t ld, const int64_t *slot_lo) {
    const int64_t total = slot_lo[d->size] * ld;
    if (total > INT32_MAX)
        return moetax_error(MOETAX_ERR_LIMIT, "rank %d: %lld floats in one gather: more than MPI's int counts",
                            d->rank, (long long)total);
    for (int r = 0; r < d->size; r++) {
        d->counts[r] = (int)((slot_lo[r + 1] - slot_lo[r]) * ld);
        d->displs[r] = (int)(slot_lo[r] * ld);
    }
    uint64_t t0 = moetax_ledger_now();
    int rc = MPI_Allgatherv(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, y, d->counts, d->displs, MPI_FLOAT, MPI_COMM_WORLD);
    d->ns_comm += moetax_ledger_now() - t0;
    const uint64_t own = (uint64_t)d->counts[d->rank] * sizeof(float);
    d->bytes_sent += own * (uint64_t)(d->size - 1);
    d->bytes_recv += (uint64_t)total * sizeof(float) - own;
    moetax_dist_book_layer(d, d->cur_layer, t0, moetax_ledger_now(), own * (uint64_t)(d->size - 1), (uint64_t)total * sizeof(float) - own);
    d->n_collectives++;
    return rc == MPI_SUCCESS ? MOETAX_OK : mpi_fail(rc, "MPI_Allgatherv (combine)");
}

moetax_status moetax_dist_allreduce(struct moetax_dist *d, float *x, int64_t n) {
    if (n > INT32_MAX) return moetax_error(MOETAX_ERR_LIMIT, "rank %d: %lld floats in one allreduce", d->rank, (long long)n);
    uint64_t t0 = moetax_ledger_now();
    int rc = MPI_Allreduce(MPI_IN_PLACE, x, (int)n, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
    d->ns_comm += moetax_ledger_now() - t0;
    /* a ring allreduce sends and receives 2 (P - 1) / P of the buffer per rank */
    const uint64_t b = (uint64_t)n * sizeof(float) * 2 * (uint64_t)(d->size - 1) / (uint64_t)d->size;
    d->bytes_sent += b;
    d->bytes_recv += b;
    moetax_dist_book_layer(d, d->cur_layer, t0, moetax_ledger_now(), b, b);
    d->n_collectives++;
    return rc == MPI_SUCCESS ? MOETAX_OK : mpi_fail(rc, "MPI_Allreduce (combine)");
}

moetax_status moetax_dist_agree_min(moetax_status st, int *v) {
    struct moetax_dist *d = g_world;
    if (!d) return st;
    int in[2] = {st ? d->rank : d->size, st ? INT32_MAX : *v}, out[2];
    int rc = MPI_Allreduce(&in[0], &out[0], 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
    if (rc == MPI_SUCCESS) rc = MPI_Allreduce(&in[1], &out[1], 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
    if (rc != MPI_SUCCESS) return st ? st : mpi_fail(rc, "MPI_Allreduce (agreement)");
    if (st) return st;
    if (out[0] < d->size)
        return moetax_error(MOETAX_ERR_ARG, "rank %d of %d failed to open its expert store (its stderr says why)",
                            out[0], d->size);
    *v = out[1];
    return MOETAX_OK;
}
