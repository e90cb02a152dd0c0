// ctest-labels: unit;threads
// ctest-cost: 19
#ifndef _GNU_SOURCE
#define _GNU_SOURCE /* RTLD_NEXT */
#endif
/* test_store.c - the expert store: byte-exact experts from a synthetic file
 * (32-aligned, not 4096-aligned ranges; the last expert ends at end of file)
 * under every policy and budgets from "all fit" down to the minimum, from two
 * threads; hand-computed hit/miss/eviction counts for LRU, LFU and LFRU at its
 * limits; NEXT-USE's victims (layer cycle against frequency, frequency against
 * recency, prefetch hints and stale prefetches) hand-computed; Belady against hand-computed and brute-force values; prefetch
 * accounting; faults injected through the VFS; budget checks; all of it again with the io_uring
 * engine, which must read what pread reads, report a real short file as clearly, and fall back to
 * pread when ring set-up fails. */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "moetax/store.h"
#include "testutil.h"

#ifdef MOETAX_WITH_URING
#include <dlfcn.h>
#include <liburing.h>
/* liburing's io_uring_submit, interposed: when armed, the next submit fails once with ENOMEM (a
 * transient failure, as under memory pressure) */
static atomic_int g_submit_fail;
int io_uring_submit(struct io_uring *ring) {
    static int (*real)(struct io_uring *);
    if (!real) real = (int (*)(struct io_uring *))dlsym(RTLD_NEXT, "io_uring_submit");
    if (atomic_exchange(&g_submit_fail, 0)) return -ENOMEM;
    return real(ring);
}
#endif

#define NL 3
#define NE 8
#define GM 32000u /* gate/up rows of one expert: a multiple of 32, not of 4096 */
#define DM 35200u /* down rows of one expert */

struct reg {
    int n;
    uint64_t off[4], size[4];
};
static struct reg g_reg[NL][NE];
static uint8_t *g_file;
static size_t g_size;
static char g_path[1024];
/* The I/O engine the stores of open_store read with (the suite runs under both). */
static enum moetax_store_io_engine g_engine = MOETAX_STORE_IO_PREAD;

static void sleep_ms(int ms) {
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    while (nanosleep(&ts, &ts) != 0) {
    }
}

static uint64_t tensor_at(uint64_t *pos, uint64_t bytes) {
    uint64_t off = (*pos + 31) & ~(uint64_t)31;
    *pos = off + bytes + 32; /* a gap, like padding between GGUF tensors */
    return off;
}

/* Layers 0, 1: separate gate, up, down tensors {d, F, E} (three ranges per
 * expert). Layer 2: fused gate_up {d, 2F, E} registered as two adjacent ranges
 * (one merged span) + down, and its down tensor ends the file. */
static void make_file(void) {
    uint64_t pos = 96;
    for (int l = 0; l < NL; l++) {
        if (l < 2) {
            uint64_t g = tensor_at(&pos, NE * GM), u = tensor_at(&pos, NE * GM), d = tensor_at(&pos, NE * DM);
            for (int e = 0; e < NE; e++)
                g_reg[l][e] = (struct reg){3, {g + e * GM, u + e * GM, d + e * DM}, {GM, GM, DM}};
        } else {
            uint64_t gu = tensor_at(&pos, NE * 2 * GM), d = tensor_at(&pos, NE * DM);
            for (int e = 0; e < NE; e++)
                g_reg[l][e] =
                    (struct reg){3, {gu + e * 2 * GM, gu + e * 2 * GM + GM, d + e * DM}, {GM, GM, DM}};
            pos = d + NE * DM; /* end of file right after the last expert */
        }
    }
    g_size = (size_t)pos;
    CHECK(g_size % 4096 != 0);
    g_file = malloc(g_size);
    tu_rng r = {0x5eed5eedull};
    for (size_t i = 0; i < g_size; i++) g_file[i] = (uint8_t)(tu_rand_u64(&r) >> 56);
    snprintf(g_path, sizeof g_path, "%s", tu_path("store_test.bin"));
    FILE *f = fopen(g_path, "wb");
    CHECK(f != NULL);
    if (!f) exit(1);
    CHECK(fwrite(g_file, 1, g_size, f) == g_size);
    fclose(f);
}

static bool same_bytes(int l, int e, const void **ptrs) {
    const struct reg *r = &g_reg[l][e];
    for (int i = 0; i < r->n; i++)
        if (!ptrs[i] || memcmp(ptrs[i], g_file + r->off[i], r->size[i]) != 0) return false;
    return true;
}

static moetax_status open_store(struct moetax_store_params p, struct moetax_store **out) {
    p.path = g_path;
    if (p.io_engine == MOETAX_STORE_IO_DEFAULT) p.io_engine = g_engine;
    moetax_status st = moetax_store_init(&p, NL, NE, out);
    if (st != MOETAX_OK) return st;
    for (int l = 0; l < NL; l++)
        for (int e = 0; e < NE; e++) {
            st = moetax_store_add_expert(*out, l, e, g_reg[l][e].off, g_reg[l][e].size, g_reg[l][e].n);
            if (st != MOETAX_OK) return st;
        }
    return moetax_store_commit(*out);
}

/* Slot size of this layout (also checks the alignment rule). */
static uint64_t slot_bytes(void) {
    struct moetax_store *s = NULL;
    struct moetax_store_params p = {.path = g_path, .budget_bytes = 1ull << 40};
    CHECK_EQ_INT(moetax_store_init(&p, NL, NE, &s), MOETAX_OK);
    for (int l = 0; l < NL; l++)
        for (int e = 0; e < NE; e++)
            moetax_store_add_expert(s, l, e, g_reg[l][e].off, g_reg[l][e].size, g_reg[l][e].n);
    uint64_t sb = moetax_store_slot_bytes(s);
    CHECK(sb % 4096 == 0);
    CHECK(sb >= 2 * GM + DM && sb <= 2 * GM + DM + 3 * 8192);
    moetax_store_free(s);
    return sb;
}

/* ---- budgets ---------------------------------------------------------------- */

static void test_budget(uint64_t sb) {
    struct moetax_store *s = NULL;
    moetax_status st = open_store((struct moetax_store_params){.budget_bytes = sb - 1}, &s);
    CHECK_EQ_INT(st, MOETAX_ERR_ARG);
    CHECK_MSG(strstr(moetax_last_error(), "budget") && strstr(moetax_last_error(), "at least"), "%s",
              moetax_last_error());
    moetax_store_free(s);
    s = NULL;
    st = open_store((struct moetax_store_params){.budget_bytes = 3 * sb + 4095, .min_slots = 4}, &s);
    CHECK_EQ_INT(st, MOETAX_ERR_ARG);
    CHECK_MSG(strstr(moetax_last_error(), "4 experts are pinned at once"), "%s", moetax_last_error());
    moetax_store_free(s);
    s = NULL;
    st = open_store((struct moetax_store_params){.budget_bytes = 4 * sb, .min_slots = 4}, &s);
    CHECK_EQ_INT(st, MOETAX_OK);
    CHECK_EQ_INT(moetax_store_n_slots(s), 4);
    moetax_store_free(s);
    s = NULL;
    /* One slot (the minimum for one expert at a time): every switch is an eviction. */
    st = open_store((struct moetax_store_params){.budget_bytes = sb, .policy = MOETAX_STORE_LFRU}, &s);
    CHECK_EQ_INT(st, MOETAX_OK);
    tu_rng r = {7};
    for (int i = 0; i < 60 && s; i++) {
        int l = (int)(tu_rand_u64(&r) % NL), e = (int)(tu_rand_u64(&r) % NE);
        const void *pp[4] = {0};
        CHECK_EQ_INT(moetax_store_acquire(s, l, e, pp, NULL), MOETAX_OK);
        CHECK(same_bytes(l, e, pp));
        moetax_store_release(s, l, e);
    }
    moetax_store_free(s);
    s = NULL;
    st = open_store((struct moetax_store_params){.budget_bytes = 1000 * sb}, &s); /* capped at the experts */
    CHECK_EQ_INT(moetax_store_n_slots(s), NL * NE);
    const void *ptrs[4];
    CHECK_EQ_INT(moetax_store_acquire(s, 0, NE, ptrs, NULL), MOETAX_ERR_ARG);
    moetax_store_free(s);

    /* A range outside the file is refused at registration. */
    struct moetax_store_params p = {.path = g_path, .budget_bytes = sb};
    CHECK_EQ_INT(moetax_store_init(&p, NL, NE, &s), MOETAX_OK);
    uint64_t off = g_size - 10, size = 11;
    CHECK_EQ_INT(moetax_store_add_expert(s, 0, 0, &off, &size, 1), MOETAX_ERR_ARG);
    CHECK_EQ_INT(moetax_store_commit(s), MOETAX_ERR_ARG); /* nothing registered */
    moetax_store_free(s);
    p.path = tu_path("no-such-file.gguf");
    CHECK_EQ_INT(moetax_store_init(&p, NL, NE, &s), MOETAX_ERR_IO);
    CHECK(strstr(moetax_last_error(), "no-such-file.gguf") != NULL);
}

/* ---- byte-exact under every policy and budget, 1 and 2 threads ------------------ */

struct worker {
    struct moetax_store *s;
    uint64_t seed;
    int iters;
    int bad, errors;
};

static void *worker_main(void *arg) {
    struct worker *w = arg;
    tu_rng r = {w->seed};
    for (int it = 0; it < w->iters; it++) {
        int l = (int)(tu_rand_u64(&r) % NL);
        int e1 = (int)(tu_rand_u64(&r) % NE), e2 = (int)(tu_rand_u64(&r) % NE);
        if (e2 == e1) e2 = (e1 + 1) % NE;
        if (tu_rand_u64(&r) % 3 == 0) {
            int32_t pf[2] = {(int32_t)(tu_rand_u64(&r) % NE), (int32_t)(tu_rand_u64(&r) % NE)};
            moetax_store_prefetch(w->s, (l + 1) % NL, pf, 2, true);
        }
        const void *p1[4] = {0}, *p2[4] = {0};
        uint64_t waited = 0;
        if (moetax_store_acquire(w->s, l, e1, p1, &waited) != MOETAX_OK) { w->errors++; continue; }
        if (moetax_store_acquire(w->s, l, e2, p2, NULL) != MOETAX_OK) {
            w->errors++;
            moetax_store_release(w->s, l, e1);
            continue;
        }
        if (!same_bytes(l, e1, p1) || !same_bytes(l, e2, p2)) w->bad++;
        moetax_store_release(w->s, l, e2);
        moetax_store_release(w->s, l, e1);
    }
    return NULL;
}

static void test_bytes(uint64_t sb, int iters) {
    const enum moetax_store_policy pols[4] = {MOETAX_STORE_LRU, MOETAX_STORE_LFU, MOETAX_STORE_LFRU,
                                              MOETAX_STORE_NEXT_USE};
    const int slots[3] = {NL * NE, NL * NE / 2, 4};
    for (int pi = 0; pi < 4; pi++)
        for (int bi = 0; bi < 3; bi++)
            for (int nt = 1; nt <= 2; nt++) {
                bool buffered = (pi == 2 && bi == 1);
                struct moetax_store *s = NULL;
                struct moetax_store_params p = {.budget_bytes = slots[bi] * sb + 100, .policy = pols[pi],
                                                .min_slots = 4, .buffered_io = buffered,
                                                .n_io_threads = bi + 1};
                CHECK_EQ_INT(open_store(p, &s), MOETAX_OK);
                if (!s) return;
                CHECK_EQ_INT(moetax_store_n_slots(s), slots[bi]);
                struct worker w[2];
                pthread_t th[2];
                for (int t = 0; t < nt; t++) {
                    w[t] = (struct worker){s, 1234u + 77u * (uint64_t)t + (uint64_t)(pi * 10 + bi), iters, 0, 0};
                    pthread_create(&th[t], NULL, worker_main, &w[t]);
                }
                for (int t = 0; t < nt; t++) {
                    pthread_join(th[t], NULL);
                    CHECK_MSG(w[t].bad == 0 && w[t].errors == 0, "%s slots %d threads %d: %d wrong, %d errors (%s)",
                              moetax_store_policy_name(pols[pi]), slots[bi], nt, w[t].bad, w[t].errors,
                              moetax_last_error());
                }
                struct moetax_store_stats st;
                moetax_store_get_stats(s, &st);
                CHECK_EQ_INT(st.acquires, (uint64_t)(2 * iters * nt));
                CHECK_EQ_INT(st.hits + st.misses, st.acquires);
                CHECK(st.resident <= st.n_slots);
                CHECK(st.bytes_read >= st.loads * (2 * GM));
                CHECK(st.direct_io_active == !buffered);
                CHECK(!st.direct_io_fallback);
                CHECK(st.prefetch_used <= st.prefetch_issued);
                if (bi == 0) CHECK(st.evictions == 0);
                else CHECK(st.evictions > 0);
                CHECK_EQ_INT(moetax_store_trace(s, NULL, NULL, 0), (int64_t)st.acquires);
                moetax_store_free(s);
            }
}

/* ---- scripted sequences ---------------------------------------------------------- */

static void run_script(enum moetax_store_policy pol, double halflife, int exp_hits, int exp_misses, int exp_ev,
                       uint64_t sb) {
    /* A B A C B A C C on layer 0, 2 slots, one at a time (see the hand computation below). */
    const int seq[8] = {0, 1, 0, 2, 1, 0, 2, 2};
    struct moetax_store *s = NULL;
    struct moetax_store_params p = {.budget_bytes = 2 * sb, .policy = pol, .lfru_halflife = halflife};
    CHECK_EQ_INT(open_store(p, &s), MOETAX_OK);
    if (!s) return;
    for (int i = 0; i < 8; i++) {
        const void *ptrs[4] = {0};
        CHECK_EQ_INT(moetax_store_acquire(s, 0, seq[i], ptrs, NULL), MOETAX_OK);
        CHECK(same_bytes(0, seq[i], ptrs));
        moetax_store_release(s, 0, seq[i]);
    }
    struct moetax_store_stats st;
    moetax_store_get_stats(s, &st);
    CHECK_MSG(st.hits == (uint64_t)exp_hits && st.misses == (uint64_t)exp_misses && st.evictions == (uint64_t)exp_ev,
              "%s H=%g: hits %llu misses %llu evictions %llu, expected %d %d %d", moetax_store_policy_name(pol),
              halflife, (unsigned long long)st.hits, (unsigned long long)st.misses,
              (unsigned long long)st.evictions, exp_hits, exp_misses, exp_ev);
    CHECK_EQ_INT(st.loads, exp_misses);
    CHECK_EQ_INT(st.reads, 3 * exp_misses); /* gate, up, down: one pread each */
    int32_t tl[8], te[8];
    CHECK_EQ_INT(moetax_store_trace(s, tl, te, 8), 8);
    for (int i = 0; i < 8; i++) CHECK(tl[i] == 0 && te[i] == seq[i]);
    /* MIN on this trace with 2 slots: A m, B m, A h, C m (evict A: next use 6 > B's 5), B h,
     * A m (evict B: never used again), C h, C h = 4 hits. */
    CHECK(moetax_store_belady_hit_rate(tl, te, 8, 2) == 4.0 / 8.0);
    moetax_store_free(s);
}

static void test_scripted(uint64_t sb) {
    /* LRU: A m, B m, A h, C m (evict B), B m (evict A), A m (evict C), C m (evict B), C h */
    run_script(MOETAX_STORE_LRU, 0, 2, 6, 4, sb);
    /* LFU (counts kept for all keys): A m(1), B m(1), A h(2), C m(1; evict B:1 < A:2), B m(2; evict C:1),
     * A h(3), C m(2; evict B:2 < A:3), C h */
    run_script(MOETAX_STORE_LFU, 0, 3, 5, 3, sb);
    /* LFRU at its limits: a tiny half-life is LRU, a huge one is LFU. */
    run_script(MOETAX_STORE_LFRU, 1e-3, 2, 6, 4, sb);
    run_script(MOETAX_STORE_LFRU, 1e12, 3, 5, 3, sb);

    /* Fused gate_up (layer 2): the two adjacent ranges are one read. */
    struct moetax_store *s = NULL;
    CHECK_EQ_INT(open_store((struct moetax_store_params){.budget_bytes = 2 * sb}, &s), MOETAX_OK);
    const void *ptrs[4] = {0};
    CHECK_EQ_INT(moetax_store_acquire(s, 2, NE - 1, ptrs, NULL), MOETAX_OK); /* ends at end of file */
    CHECK(same_bytes(2, NE - 1, ptrs));
    CHECK((const uint8_t *)ptrs[1] == (const uint8_t *)ptrs[0] + GM);
    moetax_store_release(s, 2, NE - 1);
    struct moetax_store_stats st;
    moetax_store_get_stats(s, &st);
    CHECK_EQ_INT(st.reads, 2);
    CHECK(st.read_gbps > 0 && st.read_ns > 0 && st.io_busy_ns > 0);
    moetax_store_free(s);
}

/* ---- NEXT-USE ---------------------------------------------------------------------- */

static void wait_loads(struct moetax_store *s, uint64_t n) {
    struct moetax_store_stats st;
    for (int i = 0; i < 5000; i++) {
        moetax_store_get_stats(s, &st);
        if (st.loads >= n) return;
        sleep_ms(1);
    }
    CHECK_MSG(0, "prefetch did not complete");
}


/* A script of store calls: 'a' acquire and release (l, e), 'h' acquire and hold, 'r' release
 * everything held, 'p' a predicted prefetch of (l, e), 'w' wait until l experts have been
 * read in all. */
struct op {
    char kind;
    int l, e;
};

/* Run ops under pol with n_slots slots; out gets 'h' or 'm' per acquire (a hit or a miss). */
static void run_ops(enum moetax_store_policy pol, int n_slots, const struct op *ops, int n, char *out, uint64_t sb,
                    struct moetax_store_stats *st_out) {
    struct moetax_store *s = NULL;
    struct moetax_store_params p = {.budget_bytes = (uint64_t)n_slots * sb, .policy = pol, .min_slots = 2};
    out[0] = 0;
    CHECK_EQ_INT(open_store(p, &s), MOETAX_OK);
    if (!s) return;
    int held[8][2], nh = 0, no = 0;
    for (int i = 0; i < n; i++) {
        const struct op *o = &ops[i];
        if (o->kind == 'a' || o->kind == 'h') {
            struct moetax_store_stats a, b;
            const void *ptrs[4] = {0};
            moetax_store_get_stats(s, &a);
            CHECK_EQ_INT(moetax_store_acquire(s, o->l, o->e, ptrs, NULL), MOETAX_OK);
            CHECK(same_bytes(o->l, o->e, ptrs));
            moetax_store_get_stats(s, &b);
            out[no++] = b.hits > a.hits ? 'h' : 'm';
            if (o->kind == 'a') moetax_store_release(s, o->l, o->e);
            else if (nh < 8) {
                held[nh][0] = o->l;
                held[nh++][1] = o->e;
            }
        } else if (o->kind == 'r') {
            while (nh > 0) {
                nh--;
                moetax_store_release(s, held[nh][0], held[nh][1]);
            }
        } else if (o->kind == 'p') {
            const int32_t e = o->e;
            moetax_store_prefetch(s, o->l, &e, 1, true);
        } else if (o->kind == 'w') {
            wait_loads(s, (uint64_t)o->l);
        }
    }
    out[no] = 0;
    if (st_out) moetax_store_get_stats(s, st_out);
    moetax_store_free(s);
}

#define CHECK_STR(got, want) CHECK_MSG(strcmp(got, want) == 0, "got %s, expected %s", got, want)
#define A(l, e) {'a', l, e}
#define H(l, e) {'h', l, e}
#define TOKEN(e0, e1, e2) A(0, e0), A(1, e1), A(2, e2) /* one pass over each of the 3 layers */

static void test_next_use(uint64_t sb) {
    CHECK_STR(moetax_store_policy_name(MOETAX_STORE_NEXT_USE), "next-use");
    enum moetax_store_policy pol = MOETAX_STORE_LRU;
    CHECK(moetax_store_policy_parse("next-use", &pol) && pol == MOETAX_STORE_NEXT_USE);
    CHECK(!moetax_store_policy_parse("nextuse", &pol));
    char got[64], other[64];

    /* The layer cycle against a small lead in frequency (3 slots, layers 0 1 2 = one
     * cycle of 3 steps; X = (0,0), Y = (1,0), Z = (2,0), U = (1,1), V = (0,1)). With
     * p = (uses + 1/2) / (passes + 1) and E = d + 3 (1/p - 1):
     *   token 2, U misses at layer 1: X E 2 + 3 * 0.2 = 2.6, Y (p 1.5/3, d 3) 6, Z 2: Y goes.
     *   token 3, Y misses: X 2.43, U (p 1.5/4, d 3) 8, Z 1.6: U goes.
     *   token 5, V misses at layer 0: X (4 uses of 5 passes, p 0.75, d 3) 4,
     *     Y (3 of 4, p 0.7, d 1) 2.29, Z (p 0.9, d 2) 2.33: X goes although it is used
     *     more often than Y, since layer 0 comes round last; Y and Z then hit.
     * LFU evicts Y there (3 uses against 4), which misses right after. */
    const struct op cyc[] = {TOKEN(0, 0, 0), TOKEN(0, 1, 0), TOKEN(0, 0, 0), TOKEN(0, 0, 0), TOKEN(1, 0, 0),
                             A(0, 0)};
    const int ncyc = (int)(sizeof cyc / sizeof cyc[0]);
    run_ops(MOETAX_STORE_NEXT_USE, 3, cyc, ncyc, got, sb, NULL);
    CHECK_STR(got, "mmmhmhhmhhhhmhhm");
    run_ops(MOETAX_STORE_LFU, 3, cyc, ncyc, other, sb, NULL);
    CHECK_STR(other, "mmmhmhhmhhhhmmhh"); /* the test tells the policies apart */

    /* Frequency against recency (4 slots; W = (1,2)): token 4, W misses at layer 1:
     *   X (p 0.9, d 2) 2.33, Y (2 uses of 4, p 0.5, d 3) 6, U (1 of 4, p 0.3, d 3) 10,
     *   Z (p 0.875, d 1) 1.43: U goes, not Y, which LRU would drop (used longest ago)
     *   and then miss in token 5. */
    const struct op freq[] = {TOKEN(0, 0, 0), TOKEN(0, 0, 0), TOKEN(0, 1, 0), TOKEN(0, 2, 0), TOKEN(0, 0, 0)};
    const int nfreq = (int)(sizeof freq / sizeof freq[0]);
    run_ops(MOETAX_STORE_NEXT_USE, 4, freq, nfreq, got, sb, NULL);
    CHECK_STR(got, "mmmhhhhmhhmhhhh");
    run_ops(MOETAX_STORE_LRU, 4, freq, nfreq, other, sb, NULL);
    CHECK_STR(other, "mmmhhhhmhhmhhmh");

    /* Prefetch hints (3 slots).
     *   After 2 tokens a prefetch names X (resident: no read) for layer 0's next pass.
     *   Token 3: V misses at layer 0 with X announced for this very pass (E 0): Y (E 1.6)
     *     and Z (2.6) are the candidates, Z goes; X then hits in the same pass. Once the
     *     pass is over the hint is spent: Z misses at layer 2 and evicts V (p 0.375, E 6).
     *   A prefetch of W = (2,1) for layer 2's next pass evicts Z (d 3, E 3.43) and reads W.
     *   Token 4: Z misses at layer 2 while W, prefetched for this pass, is kept: Y goes
     *     (E 2.33 against X's 1.33).
     *   Token 5: the pass went by without W: no longer protected, never used (p 0.1,
     *     E 28), it is the victim when Y misses (a wasted prefetch); Z hits.
     * LRU evicts X for V in token 3, so X misses. */
    const struct op hint[] = {TOKEN(0, 0, 0), TOKEN(0, 0, 0), {'p', 0, 0}, H(0, 1), H(0, 0), {'r', 0, 0},
                              A(1, 0), A(2, 0), {'p', 2, 1}, {'w', 6, 0}, TOKEN(0, 0, 0), TOKEN(0, 0, 0)};
    const int nhint = (int)(sizeof hint / sizeof hint[0]);
    struct moetax_store_stats st;
    run_ops(MOETAX_STORE_NEXT_USE, 3, hint, nhint, got, sb, &st);
    CHECK_STR(got, "mmmhhhmhhmhhmhmh");
    CHECK_EQ_INT(st.prefetch_issued, 1); /* the hint for resident X reads nothing */
    CHECK_EQ_INT(st.prefetch_wasted, 1);
    CHECK_EQ_INT(st.prefetch_used, 0);
    CHECK_EQ_INT(st.evictions, 5); /* Z, V, Z, Y, W */
    run_ops(MOETAX_STORE_LRU, 3, hint, nhint, other, sb, NULL);
    CHECK(strncmp(other, "mmmhhhmm", 8) == 0);
}

/* ---- Belady ------------------------------------------------------------------------ */

static int brute_hits(const int *seq, int n, int i, int *cache, int nc, int cap) {
    if (i == n) return 0;
    for (int j = 0; j < nc; j++)
        if (cache[j] == seq[i]) return 1 + brute_hits(seq, n, i + 1, cache, nc, cap);
    if (nc < cap) {
        cache[nc] = seq[i];
        return brute_hits(seq, n, i + 1, cache, nc + 1, cap);
    }
    int best = 0;
    for (int j = 0; j < nc; j++) {
        int old = cache[j];
        cache[j] = seq[i];
        int h = brute_hits(seq, n, i + 1, cache, nc, cap);
        if (h > best) best = h;
        cache[j] = old;
    }
    return best;
}

static void test_belady(void) {
    /* expert uses: the first access of each expert per run of one layer */
    int32_t ul[11] = {0, 0, 0, 0, 1, 1, 1, 0, 0, 2, 2}, ue[11] = {3, 5, 3, 5, 3, 3, 4, 3, 3, 3, 3};
    CHECK_EQ_INT(moetax_store_trace_uses(ul, ue, 11), 6);
    const int32_t wl[6] = {0, 0, 1, 1, 0, 2}, we[6] = {3, 5, 3, 4, 3, 3};
    for (int i = 0; i < 6; i++) CHECK(ul[i] == wl[i] && ue[i] == we[i]);
    CHECK_EQ_INT(moetax_store_trace_uses(ul, ue, 0), 0);
    /* the best static cache: keys 0 (x4), 1 (x3), 2 (x1); 1 slot holds key 0: 3 hits of 8;
     * 2 slots 0 and 1: 5 (Belady with 2 slots gets 4: it has to admit key 2) */
    const int32_t sl0[8] = {0}, se[8] = {0, 1, 0, 1, 2, 0, 1, 0};
    CHECK(moetax_store_static_hit_rate(sl0, se, 8, 1) == 3.0 / 8.0);
    CHECK(moetax_store_static_hit_rate(sl0, se, 8, 2) == 5.0 / 8.0);
    CHECK(moetax_store_static_hit_rate(sl0, se, 8, 9) == 5.0 / 8.0);
    CHECK(moetax_store_static_hit_rate(sl0, se, 0, 1) == 0.0);
    CHECK(moetax_store_static_hit_rate(sl0, se, 8, 0) == -1.0);
    CHECK(moetax_store_belady_hit_rate(sl0, se, 8, 2) == 4.0 / 8.0);
    /* Silberschatz's reference string: OPT with 3 frames has 9 faults in 20. */
    const int32_t ref[20] = {7, 0, 1, 2, 0, 3, 0, 4, 2, 3, 0, 3, 2, 1, 2, 0, 1, 7, 0, 1};
    int32_t zero[20] = {0};
    CHECK(moetax_store_belady_hit_rate(zero, ref, 20, 3) == 11.0 / 20.0);
    /* keys are (layer, e): the same e in two layers are two keys */
    const int32_t l2[6] = {0, 1, 0, 1, 0, 1}, e2[6] = {5, 5, 5, 5, 5, 5};
    CHECK(moetax_store_belady_hit_rate(l2, e2, 6, 2) == 4.0 / 6.0);
    CHECK(moetax_store_belady_hit_rate(l2, e2, 6, 1) == 0.0);
    /* cyclic 1 2 3 1 2 3 with 2 slots: 2 hits */
    const int32_t cyc[6] = {1, 2, 3, 1, 2, 3};
    CHECK(moetax_store_belady_hit_rate(zero, cyc, 6, 2) == 2.0 / 6.0);
    CHECK(moetax_store_belady_hit_rate(zero, cyc, 0, 2) == 0.0);
    CHECK(moetax_store_belady_hit_rate(zero, cyc, 6, 0) == -1.0);
    const int32_t neg[1] = {-1};
    CHECK(moetax_store_belady_hit_rate(neg, cyc, 1, 2) == -1.0);
    /* random short sequences against exhaustive search */
    tu_rng r = {99};
    for (int t = 0; t < 60; t++) {
        int n = 4 + (int)(tu_rand_u64(&r) % 9), cap = 1 + (int)(tu_rand_u64(&r) % 3);
        int keys = 2 + (int)(tu_rand_u64(&r) % 4);
        int seq[12];
        int32_t ll[12], ee[12];
        for (int i = 0; i < n; i++) {
            seq[i] = (int)(tu_rand_u64(&r) % (uint64_t)keys);
            ll[i] = seq[i] / 2;
            ee[i] = seq[i] % 2;
        }
        int cache[4];
        int h = brute_hits(seq, n, 0, cache, 0, cap);
        double got = moetax_store_belady_hit_rate(ll, ee, n, cap);
        CHECK_MSG(got == (double)h / n, "n %d cap %d: belady %g, exhaustive %d hits", n, cap, got, h);
    }
}

/* ---- prefetch ------------------------------------------------------------------------ */

/* Fault-injecting VFS over the default one (SQLite's test_vfs.c). */
struct fault {
    _Atomic int mode; /* 0 none, 1 error, 2 short read, 3 latency, 4 changed signature */
    _Atomic uint64_t lo, hi; /* read faults only for offsets in [lo, hi) */
    _Atomic int delay_ms;
    _Atomic int refuse_direct;
    _Atomic int preads;
};
enum { F_NONE, F_ERROR, F_SHORT, F_LATENCY, F_SIG };

static int f_open(void *u, const char *path, bool direct, int *fd) {
    struct fault *f = u;
    if (direct && atomic_load(&f->refuse_direct)) return EINVAL;
    const struct moetax_store_vfs *d = moetax_store_vfs_default();
    return d->open(d->user, path, direct, fd);
}
/* One read at off: counts it, and says which fault applies to it (F_NONE: none); *eof when a
 * short file ends there. F_ERROR and F_LATENCY are the caller's to apply. */
static int f_mode(struct fault *f, uint64_t off, bool *eof) {
    atomic_fetch_add(&f->preads, 1);
    uint64_t lo = atomic_load(&f->lo);
    bool hit = off >= lo && off < atomic_load(&f->hi);
    *eof = atomic_load(&f->mode) == F_SHORT && off > lo && off < lo + (1u << 20);
    int mode = hit ? atomic_load(&f->mode) : F_NONE;
    if (mode == F_LATENCY) sleep_ms(atomic_load(&f->delay_ms));
    return mode;
}
static ssize_t f_pread(void *u, int fd, void *buf, size_t n, uint64_t off) {
    struct fault *f = u;
    const struct moetax_store_vfs *d = moetax_store_vfs_default();
    bool eof;
    int mode = f_mode(f, off, &eof);
    if (eof) return 0; /* "end of file" */
    if (mode == F_ERROR) return -EIO;
    if (mode == F_SHORT) {
        ssize_t r = d->pread(d->user, fd, buf, n / 2, off);
        if (r > 0) memset(buf, 0, (size_t)r); /* and garbage: it must never be served */
        return r;
    }
    return d->pread(d->user, fd, buf, n, off);
}
/* The same faults for the io_uring engine, applied to what the ring read (it has read n bytes
 * at off, or failed with res < 0). */
static ssize_t f_result(void *u, int fd, void *buf, size_t n, uint64_t off, ssize_t res) {
    struct fault *f = u;
    (void)fd;
    bool eof;
    int mode = f_mode(f, off, &eof);
    if (eof) return 0; /* "end of file" */
    if (mode == F_ERROR) return -EIO;
    if (mode == F_SHORT && res > 0) {
        res = (ssize_t)n / 2 < res ? (ssize_t)n / 2 : res;
        memset(buf, 0, (size_t)res); /* and garbage: it must never be served */
    }
    return res;
}
static int f_sig(void *u, int fd, uint64_t *size, uint64_t *mtime) {
    struct fault *f = u;
    const struct moetax_store_vfs *d = moetax_store_vfs_default();
    int rc = d->fstat_sig(d->user, fd, size, mtime);
    if (atomic_load(&f->mode) == F_SIG) *mtime += 1;
    return rc;
}
static void f_close(void *u, int fd) {
    (void)u;
    moetax_store_vfs_default()->close(NULL, fd);
}

static void test_prefetch(uint64_t sb) {
    struct moetax_store *s = NULL;
    CHECK_EQ_INT(open_store((struct moetax_store_params){.budget_bytes = 2 * sb}, &s), MOETAX_OK);
    if (!s) return;
    const int32_t pf[2] = {3, 4};
    moetax_store_prefetch(s, 1, pf, 2, true);
    moetax_store_prefetch(s, 1, pf, 2, true); /* already in flight or resident: nothing */
    wait_loads(s, 2);
    const void *ptrs[4] = {0};
    uint64_t waited = 1;
    CHECK_EQ_INT(moetax_store_acquire(s, 1, 3, ptrs, &waited), MOETAX_OK);
    CHECK(same_bytes(1, 3, ptrs));
    CHECK_EQ_INT(waited, 0);
    struct moetax_store_stats st;
    moetax_store_get_stats(s, &st);
    CHECK_EQ_INT(st.prefetch_issued, 2);
    CHECK_EQ_INT(st.predicted_issued, 2);
    CHECK_EQ_INT(st.hits, 1);
    CHECK_EQ_INT(st.misses, 0);
    CHECK_EQ_INT(st.prefetch_used, 1);
    CHECK_EQ_INT(st.predicted_used, 1);
    /* Holding expert 3 pinned, a demand for 0 must evict the unused prefetch of 4: wasted. */
    CHECK_EQ_INT(moetax_store_acquire(s, 1, 0, ptrs, &waited), MOETAX_OK);
    CHECK(same_bytes(1, 0, ptrs));
    CHECK(waited > 0);
    moetax_store_get_stats(s, &st);
    CHECK_EQ_INT(st.prefetch_wasted, 1);
    CHECK_EQ_INT(st.evictions, 1);
    /* Both slots pinned: a prefetch is dropped, not waited for. */
    const int32_t pf5 = 5;
    moetax_store_prefetch(s, 1, &pf5, 1, false);
    moetax_store_get_stats(s, &st);
    CHECK_EQ_INT(st.prefetch_dropped, 1);
    moetax_store_release(s, 1, 0);
    moetax_store_release(s, 1, 3);
    /* A demand (not predicted) prefetch of an evictable expert is issued; the
     * unused prefetch survives a demand load that can evict something else. */
    moetax_store_prefetch(s, 1, &pf5, 1, false);
    wait_loads(s, 4);
    CHECK_EQ_INT(moetax_store_acquire(s, 1, 6, ptrs, NULL), MOETAX_OK); /* evicts 0 or 3, not 5 */
    moetax_store_release(s, 1, 6);
    CHECK_EQ_INT(moetax_store_acquire(s, 1, 5, ptrs, &waited), MOETAX_OK);
    CHECK(same_bytes(1, 5, ptrs));
    CHECK_EQ_INT(waited, 0);
    moetax_store_release(s, 1, 5);
    moetax_store_get_stats(s, &st);
    CHECK_EQ_INT(st.prefetch_issued, 3);
    CHECK_EQ_INT(st.predicted_issued, 2);
    CHECK_EQ_INT(st.prefetch_used, 2);
    CHECK_EQ_INT(st.predicted_used, 1);
    moetax_store_free(s);

    /* A late prefetch: still in flight when acquired (reads slowed down). */
    struct fault f = {0};
    atomic_store(&f.mode, F_LATENCY);
    atomic_store(&f.hi, UINT64_MAX);
    atomic_store(&f.delay_ms, 30);
    struct moetax_store_vfs vfs = {f_open, f_pread, f_sig, f_close, &f, f_result};
    CHECK_EQ_INT(open_store((struct moetax_store_params){.budget_bytes = 2 * sb, .vfs = &vfs}, &s), MOETAX_OK);
    moetax_store_prefetch(s, 0, pf, 1, true);
    CHECK_EQ_INT(moetax_store_acquire(s, 0, 3, ptrs, &waited), MOETAX_OK);
    CHECK(same_bytes(0, 3, ptrs));
    CHECK(waited > 0);
    moetax_store_release(s, 0, 3);
    moetax_store_get_stats(s, &st);
    CHECK_EQ_INT(st.misses, 1);
    CHECK_EQ_INT(st.prefetch_used, 1);
    CHECK_EQ_INT(st.prefetch_late, 1);
    CHECK(st.stall_ns >= waited);
    CHECK(st.read_ns_max >= 30000000ull);
    moetax_store_free(s);

    /* Predictions use only idle I/O: with the one reader busy on known demand, a predicted
     * prefetch is dropped; once the reads are done, the same prediction is issued. */
    CHECK_EQ_INT(open_store((struct moetax_store_params){.budget_bytes = 3 * sb, .vfs = &vfs, .n_io_threads = 1},
                            &s),
                 MOETAX_OK);
    const int32_t known = 1, guess = 2;
    moetax_store_prefetch(s, 0, &known, 1, false);
    moetax_store_prefetch(s, 1, &guess, 1, true);
    moetax_store_get_stats(s, &st);
    CHECK_EQ_INT(st.prefetch_issued, 1);
    CHECK_EQ_INT(st.predicted_issued, 0);
    CHECK_EQ_INT(st.prefetch_dropped, 1);
    wait_loads(s, 1);
    moetax_store_prefetch(s, 1, &guess, 1, true);
    wait_loads(s, 2);
    moetax_store_get_stats(s, &st);
    CHECK_EQ_INT(st.predicted_issued, 1);
    CHECK_EQ_INT(moetax_store_acquire(s, 1, 2, ptrs, &waited), MOETAX_OK);
    CHECK(same_bytes(1, 2, ptrs));
    CHECK_EQ_INT(waited, 0);
    moetax_store_release(s, 1, 2);
    moetax_store_free(s);

    /* Nor while reads kept the disk busy most of the last cycle over the layers: a cycle
     * of misses (each read 20 ms, back to back) drops a prediction; after a cycle of hits
     * with the disk idle, the same prediction is issued. */
    atomic_store(&f.delay_ms, 20);
    CHECK_EQ_INT(open_store((struct moetax_store_params){.budget_bytes = 6 * sb, .vfs = &vfs}, &s), MOETAX_OK);
    const int32_t guess5 = 5;
    for (int l = 0; l < NL; l++) {
        CHECK_EQ_INT(moetax_store_acquire(s, l, 0, ptrs, NULL), MOETAX_OK);
        moetax_store_release(s, l, 0);
    }
    CHECK_EQ_INT(moetax_store_acquire(s, 0, 1, ptrs, NULL), MOETAX_OK); /* a new cycle: the last was all reads */
    moetax_store_release(s, 0, 1);
    moetax_store_get_stats(s, &st);
    const uint64_t dropped0 = st.prefetch_dropped;
    moetax_store_prefetch(s, 1, &guess5, 1, true);
    moetax_store_get_stats(s, &st);
    CHECK_EQ_INT(st.predicted_issued, 0);
    CHECK_EQ_INT(st.prefetch_dropped, dropped0 + 1);
    for (int l = 1; l < NL; l++) { /* hits */
        CHECK_EQ_INT(moetax_store_acquire(s, l, 0, ptrs, &waited), MOETAX_OK);
        CHECK_EQ_INT(waited, 0);
        moetax_store_release(s, l, 0);
    }
    sleep_ms(150);
    CHECK_EQ_INT(moetax_store_acquire(s, 0, 0, ptrs, NULL), MOETAX_OK); /* a new cycle: 20 ms of reads in 150+ */
    moetax_store_release(s, 0, 0);
    moetax_store_prefetch(s, 1, &guess5, 1, true);
    moetax_store_get_stats(s, &st);
    CHECK_EQ_INT(st.predicted_issued, 1);
    wait_loads(s, st.loads + 1);
    CHECK_EQ_INT(moetax_store_acquire(s, 1, 5, ptrs, &waited), MOETAX_OK);
    CHECK(same_bytes(1, 5, ptrs));
    CHECK_EQ_INT(waited, 0);
    moetax_store_release(s, 1, 5);
    moetax_store_free(s);
}

/* ---- faults ---------------------------------------------------------------------------- */

static bool has(const char *s, const char *sub) { return strstr(s, sub) != NULL; }

/* Acquire (l, e) expecting MOETAX_ERR_IO with the layer, expert, file, offset and `what`. */
static void expect_io_error(struct moetax_store *s, int l, int e, uint64_t off, const char *what) {
    const void *ptrs[4] = {0};
    moetax_status st = moetax_store_acquire(s, l, e, ptrs, NULL);
    CHECK_EQ_INT(st, MOETAX_ERR_IO);
    const char *m = moetax_last_error();
    char lay[32], exp[32], offs[48];
    snprintf(lay, sizeof lay, "layer %d", l);
    snprintf(exp, sizeof exp, "expert %d", e);
    snprintf(offs, sizeof offs, "offset %llu", (unsigned long long)off);
    CHECK_MSG(has(m, lay) && has(m, exp) && has(m, g_path) && has(m, offs) && has(m, what),
              "message '%s' lacks %s / %s / %s / %s / %s", m, lay, exp, g_path, offs, what);
    CHECK(ptrs[0] == NULL);
}

static void expect_ok(struct moetax_store *s, int l, int e) {
    const void *ptrs[4] = {0};
    CHECK_EQ_INT(moetax_store_acquire(s, l, e, ptrs, NULL), MOETAX_OK);
    CHECK(same_bytes(l, e, ptrs));
    moetax_store_release(s, l, e);
}

static void test_faults(uint64_t sb) {
    struct fault f = {0};
    struct moetax_store_vfs vfs = {f_open, f_pread, f_sig, f_close, &f, f_result};
    struct moetax_store *s = NULL;
    CHECK_EQ_INT(open_store((struct moetax_store_params){.budget_bytes = 3 * sb, .vfs = &vfs}, &s), MOETAX_OK);
    if (!s) return;
    /* Faults on the `up` span of layer 1 expert 3. */
    uint64_t up = g_reg[1][3].off[1], span = up & ~4095ull;
    atomic_store(&f.lo, span);
    atomic_store(&f.hi, span + 1);

    atomic_store(&f.mode, F_ERROR);
    expect_io_error(s, 1, 3, span, "Input/output error");
    expect_io_error(s, 1, 3, span, "read failed"); /* retried, fails again */
    expect_ok(s, 1, 2); /* other experts are unaffected */
    atomic_store(&f.mode, F_NONE);
    expect_ok(s, 1, 3); /* the retry succeeds */

    span = g_reg[1][6].off[1] & ~4095ull;
    atomic_store(&f.lo, span);
    atomic_store(&f.hi, span + 1);
    atomic_store(&f.mode, F_SHORT); /* half the bytes, zeroed, then "end of file": never served */
    expect_io_error(s, 1, 6, span, "short read");
    atomic_store(&f.mode, F_NONE);
    expect_ok(s, 1, 6);

    /* A failed prefetch leaves the slot in ERROR; the acquire retries it. */
    atomic_store(&f.lo, g_reg[0][5].off[0] & ~4095ull);
    atomic_store(&f.hi, (g_reg[0][5].off[0] & ~4095ull) + 1);
    atomic_store(&f.mode, F_ERROR);
    const int32_t e5 = 5;
    struct moetax_store_stats st0;
    moetax_store_get_stats(s, &st0);
    moetax_store_prefetch(s, 0, &e5, 1, true);
    wait_loads(s, st0.loads + 1);
    expect_io_error(s, 0, 5, g_reg[0][5].off[0] & ~4095ull, "read failed"); /* retried: fails again */
    moetax_store_get_stats(s, &st0);
    moetax_store_prefetch(s, 0, &e5, 1, true);
    wait_loads(s, st0.loads + 1);
    atomic_store(&f.mode, F_NONE);
    expect_ok(s, 0, 5); /* the stale error is retried, now successfully */

    /* Latency alone is not an error; with io_timeout_ms it is. */
    atomic_store(&f.lo, 0);
    atomic_store(&f.hi, UINT64_MAX);
    atomic_store(&f.delay_ms, 40);
    atomic_store(&f.mode, F_LATENCY);
    const void *ptrs[4] = {0};
    uint64_t waited = 0;
    CHECK_EQ_INT(moetax_store_acquire(s, 2, 0, ptrs, &waited), MOETAX_OK);
    CHECK(same_bytes(2, 0, ptrs));
    CHECK(waited >= 40000000ull);
    moetax_store_release(s, 2, 0);

    /* The file changes underneath (as seen by the VFS). */
    atomic_store(&f.mode, F_SIG);
    expect_io_error(s, 2, 1, g_reg[2][1].off[0] & ~4095ull, "file changed");
    atomic_store(&f.mode, F_NONE);
    expect_ok(s, 2, 1);
    struct moetax_store_stats st;
    moetax_store_get_stats(s, &st);
    CHECK_EQ_INT(st.errors, 5);
    CHECK_EQ_INT(st.hits + st.misses, st.acquires);
    moetax_store_free(s);
    s = NULL;

    /* Timeout: the acquire gives up, the read completes later and is served then. */
    atomic_store(&f.delay_ms, 150);
    atomic_store(&f.mode, F_LATENCY);
    CHECK_EQ_INT(open_store((struct moetax_store_params){.budget_bytes = 2 * sb, .vfs = &vfs, .io_timeout_ms = 20},
                            &s), MOETAX_OK);
    expect_io_error(s, 1, 1, g_reg[1][1].off[0] & ~4095ull, "not complete after 20 ms");
    atomic_store(&f.mode, F_NONE);
    wait_loads(s, 1);
    expect_ok(s, 1, 1);
    moetax_store_free(s);
    s = NULL;

    /* O_DIRECT refused by the "filesystem": buffered reads, flagged. */
    atomic_store(&f.refuse_direct, 1);
    CHECK_EQ_INT(open_store((struct moetax_store_params){.budget_bytes = 2 * sb, .vfs = &vfs}, &s), MOETAX_OK);
    expect_ok(s, 0, 0);
    moetax_store_get_stats(s, &st);
    CHECK(!st.direct_io_active && st.direct_io_fallback);
    moetax_store_free(s);
    s = NULL;

    /* A real change of the file's mtime, with the default VFS. */
    CHECK_EQ_INT(open_store((struct moetax_store_params){.budget_bytes = 2 * sb}, &s), MOETAX_OK);
    expect_ok(s, 0, 1);
    struct timespec ts[2] = {{1000000000, 0}, {1000000000, 0}};
    CHECK(utimensat(AT_FDCWD, g_path, ts, 0) == 0);
    expect_io_error(s, 0, 2, g_reg[0][2].off[0] & ~4095ull, "file changed");
    expect_ok(s, 0, 1); /* read before the change: still resident */
    moetax_store_free(s);
}

/* The read log (the trace's I/O tracks): one record per expert load, of the kind that
 * asked for it, in completion order, the newest read_log_cap kept. */
static void test_read_log(uint64_t sb) {
    struct moetax_store *s = NULL;
    CHECK_EQ_INT(open_store((struct moetax_store_params){.budget_bytes = 4 * sb, .n_io_threads = 2, .read_log_cap = 3},
                            &s),
                 MOETAX_OK);
    if (!s) return;
    const int32_t known = 1, guess = 2;
    moetax_store_prefetch(s, 0, &known, 1, false);
    wait_loads(s, 1);
    moetax_store_prefetch(s, 1, &guess, 1, true);
    wait_loads(s, 2);
    const void *ptrs[4] = {0};
    for (int i = 0; i < 2; i++) { /* a miss (a demand read), then a hit (no read) */
        CHECK_EQ_INT(moetax_store_acquire(s, 2, 3, ptrs, NULL), MOETAX_OK);
        moetax_store_release(s, 2, 3);
    }
    struct moetax_store_read r[4];
    uint64_t dropped = 9;
    CHECK_EQ_INT(moetax_store_reads(s, NULL, 0, NULL), 3);
    CHECK_EQ_INT(moetax_store_reads(s, r, 4, &dropped), 3);
    CHECK_EQ_INT(dropped, 0);
    const int want[3][3] = {{0, 1, MOETAX_STORE_READ_KNOWN}, {1, 2, MOETAX_STORE_READ_PREDICTED}, {2, 3, MOETAX_STORE_READ_DEMAND}};
    struct moetax_store_stats st;
    moetax_store_get_stats(s, &st);
    uint64_t bytes = 0;
    for (int i = 0; i < 3; i++) {
        CHECK_EQ_INT(r[i].layer, want[i][0]);
        CHECK_EQ_INT(r[i].expert, want[i][1]);
        CHECK_EQ_INT(r[i].kind, want[i][2]);
        CHECK(r[i].ok);
        CHECK(r[i].io_thread >= 0 && r[i].io_thread < 2);
        CHECK(r[i].queued_ns <= r[i].start_ns && r[i].start_ns <= r[i].end_ns);
        CHECK(r[i].bytes >= g_reg[r[i].layer][r[i].expert].size[0]);
        if (i) CHECK(r[i - 1].end_ns <= r[i].start_ns); /* each waited for before the next */
        bytes += r[i].bytes;
    }
    CHECK_EQ_INT(bytes, st.bytes_read);
    CHECK(!strcmp(moetax_store_read_kind_name(MOETAX_STORE_READ_PREDICTED), "predicted"));
    /* one more read: the oldest record goes */
    CHECK_EQ_INT(moetax_store_acquire(s, 2, 4, ptrs, NULL), MOETAX_OK);
    moetax_store_release(s, 2, 4);
    CHECK_EQ_INT(moetax_store_reads(s, r, 4, &dropped), 3);
    CHECK_EQ_INT(dropped, 1);
    CHECK_EQ_INT(r[0].expert, 2);
    CHECK_EQ_INT(r[2].layer, 2);
    CHECK_EQ_INT(r[2].expert, 4);
    moetax_store_free(s);
    /* off by default */
    CHECK_EQ_INT(open_store((struct moetax_store_params){.budget_bytes = 2 * sb}, &s), MOETAX_OK);
    if (!s) return;
    CHECK_EQ_INT(moetax_store_acquire(s, 0, 0, ptrs, NULL), MOETAX_OK);
    moetax_store_release(s, 0, 0);
    CHECK_EQ_INT(moetax_store_reads(s, r, 4, &dropped), 0);
    moetax_store_free(s);
}

/* A warm start: three experts of a store of three slots read before any acquire (a
 * fourth dropped: no slot), all there at once, each acquire a hit and a used prefetch;
 * a prior makes next-use keep the expert it says is used most. */
static void test_warm(uint64_t sb) {
    struct moetax_store *s = NULL;
    CHECK_EQ_INT(open_store((struct moetax_store_params){.budget_bytes = 3 * sb, .policy = MOETAX_STORE_NEXT_USE},
                            &s), MOETAX_OK);
    if (!s) return;
    const int32_t wl[4] = {0, 1, 1, 2}, we[4] = {2, 0, 3, 1};
    CHECK_EQ_INT(moetax_store_warm(s, wl, we, 4), MOETAX_OK);
    struct moetax_store_stats st;
    moetax_store_get_stats(s, &st);
    CHECK_EQ_INT(st.loads, 3);
    CHECK_EQ_INT(st.prefetch_dropped, 1);
    CHECK_EQ_INT(st.acquires, 0);
    const void *ptrs[4] = {0};
    for (int i = 0; i < 3; i++) {
        uint64_t waited = 1;
        CHECK_EQ_INT(moetax_store_acquire(s, wl[i], we[i], ptrs, &waited), MOETAX_OK);
        CHECK(same_bytes(wl[i], we[i], ptrs) && waited == 0);
        moetax_store_release(s, wl[i], we[i]);
    }
    moetax_store_get_stats(s, &st);
    CHECK_EQ_INT(st.hits, 3);
    CHECK_EQ_INT(st.prefetch_used, 3);
    /* the prior: at layer 1 expert 0 is used by every pass, expert 3 by none; a new expert of layer 1
     * then evicts 3 (or the layer-0 / layer-2 one), never 0 */
    double share[NE];
    for (int e = 0; e < NE; e++) share[e] = e == 0 ? 1.0 : 0.0;
    moetax_store_set_prior(s, 1, share, 100);
    uint64_t waited = 0;
    CHECK_EQ_INT(moetax_store_acquire(s, 1, 5, ptrs, &waited), MOETAX_OK);
    moetax_store_release(s, 1, 5);
    CHECK_EQ_INT(moetax_store_acquire(s, 1, 0, ptrs, &waited), MOETAX_OK);
    CHECK_EQ_INT(waited, 0);
    moetax_store_release(s, 1, 0);
    moetax_store_free(s);
}

/* ---- read-ahead -------------------------------------------------------------------------- */

static void touch(struct moetax_store *s, int l, int e) {
    const void *ptrs[4] = {0};
    CHECK_EQ_INT(moetax_store_acquire(s, l, e, ptrs, NULL), MOETAX_OK);
    CHECK(same_bytes(l, e, ptrs));
    moetax_store_release(s, l, e);
}

/* holds_all: true only once every registered expert is resident in a budget that holds them all
 * (then nothing can be evicted and the engine stops predicting for prefetch); a budget one slot
 * short never gets there however many experts are read; a warm start of every expert gets there
 * before the first acquire. */
static void test_holds_all(uint64_t sb) {
    struct moetax_store *s = NULL;
    CHECK_EQ_INT(open_store((struct moetax_store_params){.budget_bytes = (uint64_t)(NL * NE) * sb}, &s), MOETAX_OK);
    if (!s) return;
    CHECK(!moetax_store_holds_all(s));
    for (int l = 0; l < NL; l++)
        for (int e = 0; e < NE; e++) {
            CHECK_MSG(!moetax_store_holds_all(s), "holds_all before expert (%d, %d) was read", l, e);
            touch(s, l, e);
        }
    CHECK(moetax_store_holds_all(s));
    touch(s, 0, 0); /* a hit keeps it */
    CHECK(moetax_store_holds_all(s));
    moetax_store_free(s);

    CHECK_EQ_INT(open_store((struct moetax_store_params){.budget_bytes = (uint64_t)(NL * NE - 1) * sb}, &s), MOETAX_OK);
    if (!s) return;
    CHECK_EQ_INT(moetax_store_n_slots(s), NL * NE - 1);
    for (int pass = 0; pass < 2; pass++)
        for (int l = 0; l < NL; l++)
            for (int e = 0; e < NE; e++) {
                touch(s, l, e);
                CHECK_MSG(!moetax_store_holds_all(s), "holds_all with one slot short, after (%d, %d)", l, e);
            }
    moetax_store_free(s);

    CHECK_EQ_INT(open_store((struct moetax_store_params){.budget_bytes = (uint64_t)(NL * NE) * sb}, &s), MOETAX_OK);
    if (!s) return;
    int32_t wl[NL * NE], we[NL * NE];
    for (int i = 0; i < NL * NE; i++) wl[i] = i / NE, we[i] = i % NE;
    CHECK_EQ_INT(moetax_store_warm(s, wl, we, NL * NE - 1), MOETAX_OK);
    CHECK(!moetax_store_holds_all(s));
    CHECK_EQ_INT(moetax_store_warm(s, wl + NL * NE - 1, we + NL * NE - 1, 1), MOETAX_OK);
    CHECK(moetax_store_holds_all(s));
    moetax_store_free(s);
}


/* The read-ahead list: nothing is read before the store has measured a cycle (the disk's room is
 * unknown); then the list is read in order as the queue empties (each completion starts the next),
 * its reads count as predicted prefetches and as its own; an expert resident when offered is not
 * read again; an item whose layer's pass has begun is dropped unread, as are items a new list
 * replaces. Out-of-range parameters are refused. */
static void test_read_ahead(uint64_t sb) {
    struct moetax_store *s = NULL;
    CHECK_EQ_INT(open_store((struct moetax_store_params){.budget_bytes = 8 * sb, .policy = MOETAX_STORE_NEXT_USE},
                            &s), MOETAX_OK);
    if (!s) return;
    CHECK_EQ_INT(moetax_store_read_ahead_depth(s), MOETAX_STORE_READ_AHEAD_DEFAULT);
    const int32_t l1[3] = {1, 1, 2}, e1[3] = {3, 4, 5};
    moetax_store_read_ahead(s, l1, e1, 3);
    struct moetax_store_stats st;
    moetax_store_get_stats(s, &st);
    CHECK_EQ_INT(st.ahead_offered, 3);
    CHECK_EQ_INT(st.ahead_issued, 0); /* no cycle seen yet: no room known */
    CHECK_EQ_INT(st.loads, 0);
    /* two passes over the layers' first one: a cycle with reads, and time that no acquire waited */
    for (int l = 0; l < NL; l++) {
        touch(s, l, 0);
        sleep_ms(2);
    }
    touch(s, 0, 0);
    moetax_store_get_stats(s, &st);
    const uint64_t loads0 = st.loads;
    CHECK_EQ_INT(loads0, NL);
    moetax_store_read_ahead(s, l1, e1, 3); /* the unread items of the first list are replaced */
    wait_loads(s, loads0 + 3);
    moetax_store_get_stats(s, &st);
    CHECK_EQ_INT(st.ahead_issued, 3);
    CHECK_EQ_INT(st.predicted_issued, 3);
    CHECK_EQ_INT(st.ahead_stale, 3);
    uint64_t waited = 1;
    const void *ptrs[4] = {0};
    CHECK_EQ_INT(moetax_store_acquire(s, 1, 3, ptrs, &waited), MOETAX_OK);
    CHECK(same_bytes(1, 3, ptrs));
    CHECK_EQ_INT(waited, 0);
    /* layer 1's pass is under way: an item for it is stale, one for layer 2 is read */
    const int32_t l2[2] = {1, 2}, e2[2] = {6, 6};
    moetax_store_read_ahead(s, l2, e2, 2);
    wait_loads(s, loads0 + 4);
    moetax_store_release(s, 1, 3);
    moetax_store_get_stats(s, &st);
    CHECK_EQ_INT(st.ahead_issued, 4);
    CHECK_EQ_INT(st.ahead_stale, 4);
    CHECK_EQ_INT(st.ahead_used, 1);
    CHECK_EQ_INT(st.predicted_used, 1);
    /* resident: offered, not read */
    moetax_store_read_ahead(s, l1, e1, 3);
    sleep_ms(5);
    moetax_store_get_stats(s, &st);
    CHECK_EQ_INT(st.ahead_offered, 11);
    CHECK_EQ_INT(st.ahead_issued, 4);
    CHECK_EQ_INT(st.loads, loads0 + 4);
    touch(s, 2, 5);
    touch(s, 2, 6);
    moetax_store_get_stats(s, &st);
    CHECK_EQ_INT(st.ahead_used, 3);
    CHECK_EQ_INT(st.misses, NL); /* only the first pass's reads were waited for */
    moetax_store_free(s);

    struct moetax_store_params bad = {.path = g_path, .budget_bytes = sb, .read_ahead = MOETAX_STORE_READ_AHEAD_MAX + 1};
    CHECK_EQ_INT(moetax_store_init(&bad, NL, NE, &s), MOETAX_ERR_ARG);
    bad = (struct moetax_store_params){.path = g_path, .budget_bytes = sb, .read_ahead_min_precision = 1.5};
    CHECK_EQ_INT(moetax_store_init(&bad, NL, NE, &s), MOETAX_ERR_ARG);
}

/* ---- I/O engines ------------------------------------------------------------------------ */

/* Acquire every expert, one at a time, through a store of the minimum budget (each read evicts),
 * checking the bytes; the stats come back in *st. */
static void read_all(struct moetax_store_params p, struct moetax_store_stats *st) {
    struct moetax_store *s = NULL;
    CHECK_EQ_INT(open_store(p, &s), MOETAX_OK);
    if (!s) return;
    for (int round = 0; round < 2; round++)
        for (int l = 0; l < NL; l++)
            for (int e = 0; e < NE; e++) expect_ok(s, l, e);
    moetax_store_get_stats(s, st);
    moetax_store_free(s);
}

/* A short file for real (no VFS): the model is cut inside layer 2's last expert after the
 * store has opened it; both engines report a short read naming the file and the offset. */
static void test_truncated(uint64_t sb, enum moetax_store_io_engine engine) {
    struct moetax_store *s = NULL;
    CHECK_EQ_INT(open_store((struct moetax_store_params){.budget_bytes = 2 * sb, .io_engine = engine}, &s),
                 MOETAX_OK);
    if (!s) return;
    const struct reg *r = &g_reg[2][NE - 1]; /* down (range 2) ends the file */
    uint64_t cut = r->off[2] + r->size[2] / 2, span = r->off[2] & ~4095ull;
    CHECK(truncate(g_path, (off_t)cut) == 0);
    expect_io_error(s, 2, NE - 1, span, "short read");
    char want[64];
    snprintf(want, sizeof want, "(%llu of", (unsigned long long)(cut - span));
    CHECK_MSG(has(moetax_last_error(), want), "engine %s: '%s' lacks '%s'", moetax_store_io_engine_name(engine),
              moetax_last_error(), want);
    moetax_store_free(s);
    FILE *f = fopen(g_path, "wb"); /* whole again */
    CHECK(f && fwrite(g_file, 1, g_size, f) == g_size);
    if (f) fclose(f);
}

static void test_engines(uint64_t sb) {
    struct moetax_store_stats sp = {0}, su = {0};
    read_all((struct moetax_store_params){.budget_bytes = 4 * sb, .min_slots = 4, .io_engine = MOETAX_STORE_IO_PREAD},
             &sp);
    CHECK(sp.io_engine == MOETAX_STORE_IO_PREAD && !sp.io_engine_fallback);
    read_all((struct moetax_store_params){.budget_bytes = 4 * sb, .min_slots = 4, .io_engine = MOETAX_STORE_IO_URING},
             &su);
#ifdef MOETAX_WITH_URING
    /* this build has io_uring: the kernel must give a ring unless a sandbox refuses it */
    CHECK_MSG(su.io_engine == MOETAX_STORE_IO_URING || (su.io_engine_fallback && su.io_engine_errno == EPERM),
              "uring engine not active (fallback %d, errno %d)", su.io_engine_fallback, su.io_engine_errno);
#else
    CHECK(su.io_engine == MOETAX_STORE_IO_PREAD && su.io_engine_fallback && su.io_engine_errno == ENOSYS);
#endif
    /* the same loads, bytes and one request per span */
    CHECK_EQ_INT(su.loads, sp.loads);
    CHECK_EQ_INT(su.bytes_read, sp.bytes_read);
    CHECK_EQ_INT(su.reads, sp.reads);
    CHECK_EQ_INT(su.hits, sp.hits);

    /* Ring set-up refused (as seccomp or an old kernel would): pread, flagged, same bytes. */
    setenv("MOETAX_STORE_URING_FAIL", "EPERM", 1);
    struct moetax_store_stats sf = {0};
    read_all((struct moetax_store_params){.budget_bytes = 4 * sb, .min_slots = 4, .io_engine = MOETAX_STORE_IO_URING},
             &sf);
    unsetenv("MOETAX_STORE_URING_FAIL");
    CHECK(sf.io_engine == MOETAX_STORE_IO_PREAD && sf.io_engine_fallback && sf.io_engine_errno == EPERM);
    CHECK_EQ_INT(sf.bytes_read, sp.bytes_read);

#ifdef MOETAX_WITH_URING
    /* One failed submit: that expert's read fails, naming the error; the worker's ring is replaced and
     * every later read succeeds (the broken ring failed each of them as an I/O error, for good) */
    if (su.io_engine == MOETAX_STORE_IO_URING) {
        struct moetax_store *rs = NULL;
        CHECK_EQ_INT(open_store((struct moetax_store_params){.budget_bytes = 4 * sb, .min_slots = 4, .n_io_threads = 1,
                                                             .io_engine = MOETAX_STORE_IO_URING},
                                &rs),
                     MOETAX_OK);
        if (rs) {
            atomic_store(&g_submit_fail, 1);
            const void *ptrs[4] = {0};
            CHECK_EQ_INT(moetax_store_acquire(rs, 0, 0, ptrs, NULL), MOETAX_ERR_IO);
            CHECK_MSG(has(moetax_last_error(), strerror(ENOMEM)), "%s", moetax_last_error());
            for (int l = 0; l < NL; l++)
                for (int e = 0; e < NE; e++) expect_ok(rs, l, e);
            struct moetax_store_stats rst;
            moetax_store_get_stats(rs, &rst);
            CHECK(rst.io_engine == MOETAX_STORE_IO_URING);
            moetax_store_free(rs);
        }
    }
#endif

    /* A VFS that replaces pread and cannot see ring results is read with its pread. */
    struct fault f = {0};
    struct moetax_store_vfs vfs = {f_open, f_pread, f_sig, f_close, &f, NULL};
    read_all((struct moetax_store_params){.budget_bytes = 4 * sb, .min_slots = 4, .io_engine = MOETAX_STORE_IO_URING,
                                          .vfs = &vfs},
             &sf);
    CHECK(sf.io_engine == MOETAX_STORE_IO_PREAD && !sf.io_engine_fallback);
    CHECK_EQ_INT((uint64_t)atomic_load(&f.preads), sf.reads + 1); /* + the O_DIRECT probe at open */

    CHECK(!strcmp(moetax_store_io_engine_name(moetax_store_io_engine_default()), "pread") ||
          !strcmp(moetax_store_io_engine_name(moetax_store_io_engine_default()), "uring"));
    enum moetax_store_io_engine pe;
    CHECK(moetax_store_io_engine_parse("uring", &pe) && pe == MOETAX_STORE_IO_URING);
    CHECK(!moetax_store_io_engine_parse("aio", &pe));
    struct moetax_store *s = NULL;
    struct moetax_store_params bad = {.path = g_path, .io_engine = (enum moetax_store_io_engine)7};
    CHECK_EQ_INT(moetax_store_init(&bad, NL, NE, &s), MOETAX_ERR_ARG);

    test_truncated(sb, MOETAX_STORE_IO_PREAD);
    test_truncated(sb, MOETAX_STORE_IO_URING);
}

int main(int argc, char **argv) {
    tu_init(argc, argv);
    make_file();
    uint64_t sb = slot_bytes();
    test_budget(sb);
    test_scripted(sb);
    test_next_use(sb);
    test_belady();
    test_prefetch(sb);
    test_warm(sb);
    test_holds_all(sb);
    test_read_ahead(sb);
    test_read_log(sb);
    test_faults(sb);
    test_bytes(sb, 300);
    test_engines(sb);
    /* again with the io_uring engine (faults through the VFS's uring_result) */
    g_engine = MOETAX_STORE_IO_URING;
    test_prefetch(sb);
    test_warm(sb);
    test_read_ahead(sb);
    test_read_log(sb);
    test_faults(sb);
    test_bytes(sb, 100);
    unlink(g_path);
    free(g_file);
    return tu_finish("test_store");
}
