/* sched.c - the server's scheduler thread: admission, chunked prefill,
 * continuous batching, stop strings, prefix reuse (see sched.h). */
#include "server/sched.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "moetax/kvcache.h"
#include "moetax/store.h"
#include "dist/dist_cmd.h" /* the script's format (MPI itself only #ifdef MOETAX_WITH_MPI) */
#ifdef MOETAX_WITH_MPI
#include "dist/dist.h"
#endif

#include <jansson.h>

const double srv_hist_bounds[SRV_HIST_N] = {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
                                            0.1,   0.25,   0.5,   1.0,  2.5,   10.0};

double srv_now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static void hist_add(struct srv_hist *h, double x) {
    int i = 0;
    while (i < SRV_HIST_N && x > srv_hist_bounds[i]) i++;
    h->counts[i]++;
    h->sum += x;
    h->n++;
}

const char *srv_finish_name(enum srv_finish f) {
    switch (f) {
    case SRV_FINISH_STOP: return "stop";
    case SRV_FINISH_LENGTH: return "length";
    case SRV_FINISH_CANCELLED: return "cancelled";
    case SRV_FINISH_ERROR: return "error";
    default: return NULL;
    }
}

/* ---- requests ------------------------------------------------------------ */

struct srv_req *srv_req_new(const int32_t *prompt, int64_t n_prompt) {
    struct srv_req *r = calloc(1, sizeof *r);
    if (!r) return NULL;
    r->prompt = malloc(sizeof(int32_t) * (size_t)(n_prompt > 0 ? n_prompt : 1));
    if (!r->prompt) { free(r); return NULL; }
    if (n_prompt > 0) memcpy(r->prompt, prompt, sizeof(int32_t) * (size_t)n_prompt);
    r->n_prompt = n_prompt;
    r->created = (int64_t)time(NULL);
    r->sp = moetax_sampler_default_params();
    pthread_mutex_init(&r->mu, NULL);
    atomic_init(&r->cancel, false);
    atomic_init(&r->refs, 1);
    return r;
}

void srv_req_unref(struct srv_req *r) {
    if (!r || atomic_fetch_sub(&r->refs, 1) != 1) return;
    pthread_mutex_destroy(&r->mu);
    for (int i = 0; i < r->n_stop; i++) free(r->stop[i]);
    free(r->prompt);
    free(r->text);
    free(r->gen);
    free(r);
}

void srv_req_cancel(struct srv_req *r) { atomic_store(&r->cancel, true); }

/* Append n bytes to a growing buffer. */
static bool buf_append(char **buf, size_t *len, size_t *cap, const char *p, size_t n) {
    if (*len + n + 1 > *cap) {
        size_t c = (*len + n + 1) * 2;
        if (c < 256) c = 256;
        char *b = realloc(*buf, c);
        if (!b) return false;
        *buf = b;
        *cap = c;
    }
    memcpy(*buf + *len, p, n);
    *len += n;
    (*buf)[*len] = 0;
    return true;
}

/* A step's wake-ups of the requests' waiters (the HTTP loop) are made at its end, not where its
 * text or end is published (step): a woken HTTP thread preempts the thread that wakes it, and here
 * that held the request's lock (the HTTP thread then blocked on it at once) and the step's
 * bookkeeping; it was counted in the scheduler's time too. All requests of the server share one
 * callback (http.c's kick); another one goes at once. The scheduler's thread only. */
static _Thread_local bool wakes_deferred;
static _Thread_local void (*wake_fn)(void *arg);
static _Thread_local void *wake_arg;

/* Publish gen[len, upto) and, when fin != NONE, finish the request. */
static void req_publish(struct srv_req *r, size_t upto, enum srv_finish fin, const char *err) {
    pthread_mutex_lock(&r->mu);
    bool wake = false;
    if (upto > r->len) {
        if (!buf_append(&r->text, &r->len, &r->cap, r->gen + r->len, upto - r->len)) {
            fin = SRV_FINISH_ERROR;
            err = "out of memory";
        }
        wake = r->want_text;
    }
    if (fin != SRV_FINISH_NONE && r->finish == SRV_FINISH_NONE) {
        r->finish = fin;
        r->t_end = srv_now_s();
        if (err) snprintf(r->err, sizeof r->err, "%s", err);
        wake = true;
    }
    /* only a stream that waits for text is told of text: a paced stream or a whole
     * answer sleeps through the tokens (no wake-up per token) */
    if (wake && r->wake) {
        r->want_text = false;
        if (wakes_deferred && (!wake_fn || (wake_fn == r->wake && wake_arg == r->wake_arg))) {
            wake_fn = r->wake;
            wake_arg = r->wake_arg;
        } else {
            r->wake(r->wake_arg);
        }
    }
    pthread_mutex_unlock(&r->mu);
}

/* Bytes at the end of s[0..n) that start an incomplete UTF-8 character. */
static size_t utf8_incomplete_tail(const char *s, size_t n) {
    for (size_t k = 1; k <= 3 && k <= n; k++) {
        const unsigned char c = (unsigned char)s[n - k];
        if ((c & 0xC0) == 0x80) continue; /* continuation: look further back */
        const size_t want = c >= 0xF0 ? 4 : c >= 0xE0 ? 3 : c >= 0xC0 ? 2 : 1;
        return want > k ? k : 0;
    }
    return 0;
}

/* After text was appended to r->gen: find a stop string (cut there and say
 * so), else how much is safe to publish. */
static size_t stop_scan(struct srv_req *r, bool *stopped) {
    size_t maxlen = 0;
    for (int i = 0; i < r->n_stop; i++) maxlen = strlen(r->stop[i]) > maxlen ? strlen(r->stop[i]) : maxlen;
    *stopped = false;
    if (r->n_stop) {
        /* a stop string can only begin after what was published */
        const size_t from = r->len;
        size_t best = SIZE_MAX;
        for (int i = 0; i < r->n_stop; i++) {
            const char *p = memmem(r->gen + from, r->gen_len - from, r->stop[i], strlen(r->stop[i]));
            if (p && (size_t)(p - r->gen) < best) best = (size_t)(p - r->gen);
        }
        if (best != SIZE_MAX) {
            r->gen_len = best;
            r->gen[best] = 0;
            *stopped = true;
            return best;
        }
    }
    /* hold back the longest suffix that is a proper prefix of a stop string */
    size_t hold = 0;
    for (int i = 0; i < r->n_stop; i++) {
        const size_t sl = strlen(r->stop[i]);
        for (size_t k = sl - 1; k > hold; k--)
            if (k <= r->gen_len && memcmp(r->gen + r->gen_len - k, r->stop[i], k) == 0) { hold = k; break; }
    }
    size_t safe = r->gen_len - hold;
    safe -= utf8_incomplete_tail(r->gen, safe);
    (void)maxlen;
    return safe > r->len ? safe : r->len;
}

/* ---- the scheduler ----------------------------------------------------- */

enum slot_state { SLOT_FREE = 0, SLOT_IDLE, SLOT_ACTIVE };

struct slot {
    enum slot_state state;
    struct srv_req *r;
    int32_t *toks;          /* [max_seq] tokens fed into its sequence, in position order */
    int64_t n_toks;         /* tokens known (prompt + generated); the cache holds the first seq_len */
    int64_t n_past;         /* prompt tokens already in the cache */
    int64_t want_blocks;    /* reserved at admission */
    int32_t next;           /* token to feed next (decoding) */
    bool decoding;          /* prompt done */
    struct moetax_sampler *smp;
    double t_idle;          /* when it became idle (LRU) */
    double t_last_tok;
    uint64_t admit_order;
};

struct srv_sched {
    struct srv_sched_params p;
    /* srv_sched_set_pacer: pace_arg is set last (release), read first (acquire) */
    const _Atomic uint64_t *pace_due;
    void (*pace_poke)(void *arg);
    _Atomic(void *) pace_arg;
    uint64_t pace_poked; /* the due time last poked for (the scheduler's thread only) */
    struct moetax_ctx *ctx;
    struct moetax_kvcache *kv;
    /* the cache the scheduler keeps its books with: kv, or under token-sharded ranks (whose
     * caches hold only their own sequences: rank seq % P) a cache of the same cells, blocks and
     * sequences with no rows (shadow), that sees every operation and every decoded batch of
     * every rank, so admission, prefill and /metrics count all sequences and every rank's real
     * use stays within it */
    struct moetax_kvcache *acct, *shadow;
    struct moetax_ledger *led;
    struct slot *slots;
    int64_t max_seq, blocks_all, bs;
    int64_t lone_chunk;        /* prompt tokens of a step with no sequence decoding (srv_sched_new) */
    struct moetax_batch batch;
    double sched_s; /* srv_metrics.sched_s (the scheduler's thread only) */
    uint64_t admit_counter;

    pthread_mutex_t mu;     /* queue, stopping */
    pthread_cond_t cv;
    struct srv_req *q_head, *q_tail;
    int q_len;
    bool q_changed;         /* requests left the queue since the metrics' last snapshot (scheduler only) */
    atomic_int n_active;    /* slots running a request (the scheduler writes it, submit reads it) */
    bool stopping, stopped, started;
    pthread_t thread;

    /* under mpirun (sched.h, src/dist/dist_cmd.h): rank 0 records its cache operations since
     * the last step (the script the other ranks replay before the same decode) */
    bool mirror;
    bool on_caller;         /* the loop runs on the thread that calls srv_sched_run (MPI) */
    int shard;              /* token-sharded dispatch over P ranks: sequence i's cells live on rank
                               i % P only, so a prefix is copied only between slots of one rank */
    moetax_status fatal;    /* a decode failed under mpirun: the server stops with it */
    pid_t parent;           /* under mpirun: the launcher; another parent means it has gone */
    int32_t *cmd;
    size_t cmd_n, cmd_cap;
    bool cmd_oom;

    pthread_mutex_t mmu;    /* metrics */
    struct srv_metrics m;
    /* /tax: snapshots of the metrics, one begun at most every 50 ms and kept up to date by the steps
     * until the next is begun (so each holds the metrics at its own time t), a ring */
    struct tax_snap { double t; struct srv_metrics m; } *ring;
    int ring_n, ring_head; /* entries; next slot */
    double t_start;        /* srv_now_s() at init: the metrics were zero then */
    double t_newest;       /* when the newest snapshot was begun (its t is its latest update) */
};

enum { TAX_RING = 4096 };

int64_t srv_sched_max_seq(const struct srv_sched *s) { return s->max_seq; }
int srv_sched_n_parallel(const struct srv_sched *s) { return s->p.n_parallel; }
int64_t srv_sched_n_ctx(const struct srv_sched *s) { return moetax_ctx_n_ctx(s->ctx); }

static int64_t blocks_for(const struct srv_sched *s, int64_t n) { return (n + s->bs - 1) / s->bs; }

/* ---- the cache operations, recorded for the other ranks under mpirun ------ */

static void cmd_put(struct srv_sched *s, const int32_t *w, size_t n) {
    if (!s->mirror) return;
    if (s->cmd_n + n > s->cmd_cap) {
        size_t cap = s->cmd_cap ? 2 * s->cmd_cap : 256;
        while (cap < s->cmd_n + n) cap *= 2;
        int32_t *nb = realloc(s->cmd, sizeof(int32_t) * cap);
        if (!nb) { s->cmd_oom = true; return; }
        s->cmd = nb;
        s->cmd_cap = cap;
    }
    memcpy(s->cmd + s->cmd_n, w, sizeof(int32_t) * n);
    s->cmd_n += n;
}

static moetax_status kv_rm(struct srv_sched *s, int seq, int64_t p0, int64_t p1) {
    const int32_t w[4] = {DIST_CMD_RM, seq, (int32_t)p0, (int32_t)p1};
    cmd_put(s, w, 4);
    if (s->shadow) { /* the books of every rank's sequences, then this rank's cells (if it holds them) */
        moetax_status st = moetax_kvcache_seq_rm(s->shadow, seq, p0, p1);
        moetax_kvcache_seq_rm(s->kv, seq, p0, p1);
        return st;
    }
    return moetax_kvcache_seq_rm(s->kv, seq, p0, p1);
}

static moetax_status kv_cp(struct srv_sched *s, int src, int dst, int64_t p0, int64_t p1) {
    const int32_t w[5] = {DIST_CMD_CP, src, dst, (int32_t)p0, (int32_t)p1};
    cmd_put(s, w, 5);
    if (s->shadow) {
        moetax_status st = moetax_kvcache_seq_cp(s->shadow, src, dst, p0, p1);
        moetax_kvcache_seq_cp(s->kv, src, dst, p0, p1);
        return st;
    }
    return moetax_kvcache_seq_cp(s->kv, src, dst, p0, p1);
}

/* The step's script (the operations so far, then the batch) to the other ranks. */
static moetax_status mirror_decode(struct srv_sched *s, const struct moetax_batch *b) {
#ifdef MOETAX_WITH_MPI
    if (!s->mirror) return MOETAX_OK;
    const int32_t h[2] = {DIST_CMD_DECODE, (int32_t)b->n_tokens};
    cmd_put(s, h, 2);
    for (int64_t k = 0; k < b->n_tokens; k++) {
        const int32_t w[4] = {b->token[k], b->pos[k], b->seq[k], b->logits[k] ? 1 : 0};
        cmd_put(s, w, 4);
    }
    moetax_status st = s->cmd_oom ? moetax_error(MOETAX_ERR_NOMEM, "out of memory (the step's script)")
                                  : moetax_dist_cmd_send(s->cmd, s->cmd_n);
    s->cmd_n = 0;
    s->cmd_oom = false;
    return st;
#else
    (void)s, (void)b;
    return MOETAX_OK;
#endif
}

moetax_status srv_sched_submit(struct srv_sched *s, struct srv_req *r) {
    if (r->n_prompt < 1) return moetax_error(MOETAX_ERR_ARG, "the prompt is empty");
    if (r->max_tokens < 1) return moetax_error(MOETAX_ERR_ARG, "max_tokens must be at least 1");
    if (r->n_prompt + r->max_tokens > s->max_seq)
        return moetax_error(MOETAX_ERR_ARG,
                            "the prompt (%lld tokens) + max_tokens (%lld) exceed the %lld positions a request "
                            "may use (the model's context or the server's -c)",
                            (long long)r->n_prompt, (long long)r->max_tokens, (long long)s->max_seq);
    pthread_mutex_lock(&s->mu);
    if (s->stopping) {
        pthread_mutex_unlock(&s->mu);
        return moetax_error(MOETAX_ERR_LIMIT, "the server is shutting down");
    }
    /* the queue holds max_queue requests beyond the free slots: requests that arrive during one
     * step wait in it for the next admission even while slots are free (--max-queue 0: a request
     * is taken only when a slot is free for it) */
    const int free_slots = s->p.n_parallel - atomic_load(&s->n_active);
    if (s->q_len >= s->p.max_queue + (free_slots > 0 ? free_slots : 0)) {
        pthread_mutex_unlock(&s->mu);
        return moetax_error(MOETAX_ERR_LIMIT, "every slot is busy and the queue is full (%d)", s->p.max_queue);
    }
    atomic_fetch_add(&r->refs, 1);
    r->t_queued = srv_now_s();
    r->next = NULL;
    if (s->q_tail) s->q_tail->next = r;
    else s->q_head = r;
    s->q_tail = r;
    s->q_len++;
    pthread_cond_signal(&s->cv);
    pthread_mutex_unlock(&s->mu);
    return MOETAX_OK;
}

/* Give up a slot's request; its cells stay for reuse (idle) or go. */
static void slot_release(struct srv_sched *s, int i, bool keep_cells) {
    struct slot *sl = &s->slots[i];
    if (sl->state == SLOT_ACTIVE) atomic_fetch_sub(&s->n_active, 1);
    if (sl->r) srv_req_unref(sl->r);
    sl->r = NULL;
    if (keep_cells && !s->p.no_prefix_reuse && moetax_kvcache_seq_len(s->acct, i) > 0) {
        sl->state = SLOT_IDLE;
        sl->n_toks = moetax_kvcache_seq_len(s->acct, i); /* what the cache holds */
        sl->t_idle = srv_now_s();
    } else {
        kv_rm(s, i, 0, -1);
        sl->state = SLOT_FREE;
        sl->n_toks = 0;
    }
}

static void slot_evict(struct srv_sched *s, int i) {
    kv_rm(s, i, 0, -1);
    s->slots[i].state = SLOT_FREE;
    s->slots[i].n_toks = 0;
}

/* Blocks the running requests may still add to the cache. */
static int64_t blocks_needed_active(const struct srv_sched *s, int64_t *reserved) {
    int64_t need = 0, res = 0;
    for (int i = 0; i < s->p.n_parallel; i++) {
        const struct slot *sl = &s->slots[i];
        if (sl->state != SLOT_ACTIVE) continue;
        const int64_t cur = blocks_for(s, moetax_kvcache_seq_len(s->acct, i));
        need += sl->want_blocks > cur ? sl->want_blocks - cur : 0;
        res += sl->want_blocks;
    }
    if (reserved) *reserved = res;
    return need;
}

static int64_t common_prefix(const int32_t *a, int64_t na, const int32_t *b, int64_t nb) {
    int64_t n = na < nb ? na : nb, i = 0;
    while (i < n && a[i] == b[i]) i++;
    return i;
}

/* Try to start the queue's head; false if it must wait. */
static bool admit_one(struct srv_sched *s, struct srv_req *r) {
    const int N = s->p.n_parallel;
    const int64_t want = blocks_for(s, r->n_prompt + r->max_tokens) + 1;
    int64_t reserved;
    blocks_needed_active(s, &reserved);
    if (reserved + want > s->blocks_all) return false;
    /* the slot holding the longest prefix of the prompt (at most n_prompt - 1 tokens: the last one is
     * evaluated for its logits) */
    int src = -1, dst = -1;
    int64_t best = 0;
    if (!s->p.no_prefix_reuse)
        for (int i = 0; i < N; i++) {
            const struct slot *sl = &s->slots[i];
            if (sl->state == SLOT_FREE) continue;
            const int64_t held = moetax_kvcache_seq_len(s->acct, i);
            int64_t L = common_prefix(sl->toks, held, r->prompt, r->n_prompt - 1);
            if (L > best) { best = L; src = i; }
        }
    if (s->shard > 1 && src >= 0) {
        /* token-sharded ranks: the cells stay on the source's rank: a free slot there (a copy), else
         * the source itself if idle (in place), else that rank's oldest idle slot; none: no reuse */
        const int rk = src % s->shard;
        for (int i = rk; i < N && dst < 0; i += s->shard)
            if (s->slots[i].state == SLOT_FREE) dst = i;
        if (dst < 0 && s->slots[src].state == SLOT_IDLE) dst = src;
        if (dst < 0)
            for (int i = rk; i < N; i += s->shard)
                if (s->slots[i].state == SLOT_IDLE && (dst < 0 || s->slots[i].t_idle < s->slots[dst].t_idle)) dst = i;
        if (dst < 0) src = -1, best = 0;
    }
    /* the destination: a free slot, else the source if it is idle, else the oldest idle slot */
    for (int i = 0; i < N && dst < 0; i++)
        if (s->slots[i].state == SLOT_FREE) dst = i;
    if (dst < 0 && src >= 0 && s->slots[src].state == SLOT_IDLE) dst = src;
    if (dst < 0)
        for (int i = 0; i < N; i++)
            if (s->slots[i].state == SLOT_IDLE && (dst < 0 || s->slots[i].t_idle < s->slots[dst].t_idle)) dst = i;
    if (dst < 0) return false; /* every slot runs */
    if (dst != src && s->slots[dst].state == SLOT_IDLE) slot_evict(s, dst);
    int64_t reused = 0;
    if (src >= 0 && best > 0) {
        moetax_status st = dst == src ? kv_rm(s, dst, best, -1) : kv_cp(s, src, dst, 0, best);
        if (st == MOETAX_OK) reused = best;
        else kv_rm(s, dst, 0, -1);
    }
    /* room for what the running ones and this one may still take: evict idle slots, oldest first */
    const int64_t need = blocks_needed_active(s, NULL) + want - blocks_for(s, reused);
    while (moetax_kvcache_n_free(s->acct) / s->bs < need) {
        int v = -1;
        for (int i = 0; i < N; i++)
            if (i != dst && s->slots[i].state == SLOT_IDLE && (v < 0 || s->slots[i].t_idle < s->slots[v].t_idle)) v = i;
        if (v < 0) break; /* cannot happen while reserved + want <= blocks_all (see sched.h) */
        slot_evict(s, v);
    }
    struct slot *sl = &s->slots[dst];
    sl->state = SLOT_ACTIVE;
    atomic_fetch_add(&s->n_active, 1);
    sl->r = r;
    memcpy(sl->toks, r->prompt, sizeof(int32_t) * (size_t)r->n_prompt);
    sl->n_toks = r->n_prompt;
    sl->n_past = reused;
    sl->want_blocks = want;
    sl->decoding = false;
    sl->admit_order = s->admit_counter++;
    moetax_sampler_free(sl->smp);
    sl->smp = NULL;
    const double t = srv_now_s();
    if (moetax_sampler_init(&r->sp, s->p.model->hp.n_vocab, &sl->smp) != MOETAX_OK) {
        req_publish(r, 0, SRV_FINISH_ERROR, moetax_last_error());
        sl->r = NULL; /* the queue's reference is dropped by admit() */
        slot_release(s, dst, false);
        return true;
    }
    for (int64_t i = 0; i < r->n_prompt; i++) moetax_sampler_accept(sl->smp, r->prompt[i]);
    pthread_mutex_lock(&r->mu);
    r->t_admitted = t;
    r->n_reused = reused;
    pthread_mutex_unlock(&r->mu);
    pthread_mutex_lock(&s->mmu);
    s->m.prompt_tokens_reused += reused;
    pthread_mutex_unlock(&s->mmu);
    return true;
}

static void account_finish(struct srv_sched *s, struct srv_req *r);

/* Queue -> slots, under s->mu. Requests whose clients went away leave the queue wherever they are
 * (behind a head that waits for cells they would otherwise hold places that live clients get
 * 503 for). */
static void admit(struct srv_sched *s) {
    struct srv_req *last = NULL;
    for (struct srv_req **pp = &s->q_head, *r; (r = *pp);) {
        if (!atomic_load(&r->cancel)) {
            last = r;
            pp = &r->next;
            continue;
        }
        req_publish(r, 0, SRV_FINISH_CANCELLED, "the client went away");
        account_finish(s, r);
        *pp = r->next;
        s->q_len--;
        s->q_changed = true;
        srv_req_unref(r); /* the queue's reference */
    }
    s->q_tail = last;
    /* (a client that goes meanwhile: its request is admitted, and the next step frees its slot) */
    while (s->q_head && admit_one(s, s->q_head)) {
        struct srv_req *r = s->q_head;
        s->q_head = r->next;
        if (!s->q_head) s->q_tail = NULL;
        s->q_len--;
        if (r->finish != SRV_FINISH_NONE) { /* not admitted (no sampler): drop the queue's reference */
            account_finish(s, r);
            srv_req_unref(r);
        }
    }
}

static void account_finish(struct srv_sched *s, struct srv_req *r) {
    pthread_mutex_lock(&s->mmu);
    s->m.requests_total++;
    if (r->finish == SRV_FINISH_CANCELLED) s->m.requests_cancelled++;
    if (r->t_first > 0) {
        s->m.prompt_seconds_total += r->t_first - r->t_admitted;
        s->m.tokens_predicted_seconds_total += r->t_end - r->t_first;
    }
    pthread_mutex_unlock(&s->mmu);
}

/* Take one sampled token for slot i. */
static void slot_token(struct srv_sched *s, int i, int32_t t, double tnow) {
    struct slot *sl = &s->slots[i];
    struct srv_req *r = sl->r;
    const bool eog = !r->ignore_eos && moetax_tokenizer_is_eog(s->p.tok, t);
    bool first = false;
    pthread_mutex_lock(&r->mu);
    r->n_gen++;
    if (r->t_first == 0) { r->t_first = tnow; first = true; }
    const int64_t n_gen = r->n_gen;
    pthread_mutex_unlock(&r->mu);
    pthread_mutex_lock(&s->mmu);
    s->m.tokens_predicted_total++;
    if (first) hist_add(&s->m.ttft, tnow - r->t_queued);
    else hist_add(&s->m.tpot, tnow - sl->t_last_tok);
    pthread_mutex_unlock(&s->mmu);
    sl->t_last_tok = tnow;
    enum srv_finish fin = SRV_FINISH_NONE;
    size_t upto = r->len;
    if (eog) {
        fin = SRV_FINISH_STOP;
        upto = r->gen_len;
    } else {
        char small[256], *piece = small;
        int nb = moetax_tokenizer_token_to_bytes(s->p.tok, t, small, sizeof small);
        if (nb < 0 && (piece = malloc((size_t)-nb))) /* a token longer than the buffer: -nb bytes */
            nb = moetax_tokenizer_token_to_bytes(s->p.tok, t, piece, -nb);
        const bool oom = !piece || (nb > 0 && !buf_append(&r->gen, &r->gen_len, &r->gen_cap, piece, (size_t)nb));
        if (piece != small) free(piece);
        if (oom) {
            req_publish(r, r->len, SRV_FINISH_ERROR, "out of memory");
            account_finish(s, r);
            slot_release(s, i, false);
            return;
        }
        moetax_sampler_accept(sl->smp, t);
        bool stopped;
        upto = stop_scan(r, &stopped);
        if (stopped) fin = SRV_FINISH_STOP;
        else if (n_gen >= r->max_tokens) { fin = SRV_FINISH_LENGTH; upto = r->gen_len; }
    }
    req_publish(r, upto, fin, NULL);
    if (fin != SRV_FINISH_NONE) {
        account_finish(s, r);
        slot_release(s, i, true);
        return;
    }
    sl->toks[sl->n_toks++] = t;
    sl->next = t;
}

static void fail_all(struct srv_sched *s, enum srv_finish fin, const char *msg) {
    for (int i = 0; i < s->p.n_parallel; i++)
        if (s->slots[i].state == SLOT_ACTIVE) {
            req_publish(s->slots[i].r, s->slots[i].r->len, fin, msg);
            account_finish(s, s->slots[i].r);
            slot_release(s, i, false);
        }
}

static void update_metrics(struct srv_sched *s, int seqs, int64_t tokens, bool decode_step) {
    struct srv_metrics *m = &s->m;
    int active = 0;
    int64_t cached = 0, active_cells = 0;
    for (int i = 0; i < s->p.n_parallel; i++) {
        active += s->slots[i].state == SLOT_ACTIVE;
        if (s->slots[i].state == SLOT_ACTIVE) active_cells += moetax_kvcache_seq_len(s->acct, i);
        if (s->slots[i].state == SLOT_IDLE) cached += blocks_for(s, moetax_kvcache_seq_len(s->acct, i)) * s->bs;
    }
    double ph[MOETAX_PHASE_COUNT], wall;
    int64_t tok, steps;
    moetax_ledger_totals(s->led, false, ph, &wall, &tok, &steps);
    double dph[MOETAX_PHASE_COUNT], dwall;
    int64_t dtok, dsteps;
    moetax_ledger_totals(s->led, true, dph, &dwall, &dtok, &dsteps);
    struct moetax_ledger_moe_stats ms;
    moetax_ledger_moe_totals(s->led, true, &ms);
    pthread_mutex_lock(&s->mu);
    const int deferred = s->q_len;
    s->q_changed = false;
    pthread_mutex_unlock(&s->mu);
    pthread_mutex_lock(&s->mmu);
    if (seqs > 0) {
        m->steps++;
        m->decode_steps += decode_step;
        m->last_batch_seqs = seqs;
        m->last_batch_tokens = tokens;
    }
    m->requests_processing = active;
    m->requests_deferred = deferred;
    m->kv_cells = moetax_kvcache_n_cells(s->acct);
    m->kv_cells_used = m->kv_cells - moetax_kvcache_n_free(s->acct);
    m->kv_cells_cached = cached;
    m->kv_cells_active = active_cells;
    memcpy(m->phase_s, ph, sizeof ph);
    m->wall_s = wall;
    m->sched_s = s->sched_s;
    m->tax_share = moetax_ledger_tax_share(ph);
    m->decode_tokens = dtok;
    m->moe_layer_passes = ms.moe_layers;
    m->moe_experts = ms.experts;
    m->moe_dropped = ms.dropped;
    m->moe_assignments = ms.assignments;
    m->store_stall_s = ph[MOETAX_PHASE_LOAD];
    if (s->p.store) {
        struct moetax_store_stats ss;
        moetax_store_get_stats(s->p.store, &ss);
        m->has_store = true;
        m->store_acquires = ss.acquires;
        m->store_hits = ss.hits;
        m->store_loads = ss.loads;
        m->store_bytes_read = ss.bytes_read;
    }
    /* a new snapshot at most every 50 ms; in between the newest one is brought up to date, so that
     * every snapshot holds the metrics at its own time */
    const double t = srv_now_s();
    if (s->ring && s->ring_n && t - s->t_newest < 0.05) {
        s->ring[(s->ring_head + TAX_RING - 1) % TAX_RING] = (struct tax_snap){.t = t, .m = *m};
    } else if (s->ring) {
        s->ring[s->ring_head] = (struct tax_snap){.t = t, .m = *m};
        s->ring_head = (s->ring_head + 1) % TAX_RING;
        if (s->ring_n < TAX_RING) s->ring_n++;
        s->t_newest = t;
    }
    pthread_mutex_unlock(&s->mmu);
}

static bool step_run(struct srv_sched *s);

/* One step (step_run; false: there was nothing to do), then the wake-ups it made (wakes_deferred), and the HTTP loop's when a paced
 * stream's event is due: its own timer would fire in the middle of a step, taking a worker's core
 * while the other waits at the next barrier; woken here it runs between two steps. The wake-up's
 * write is outside the scheduler's time (sched_s): the HTTP thread, which may take this thread's
 * core at once, counts its own. */
static bool step(struct srv_sched *s) {
    wakes_deferred = true;
    const bool did = step_run(s);
    wakes_deferred = false;
    void *pa = atomic_load_explicit(&s->pace_arg, memory_order_acquire);
    if (pa) {
        const uint64_t due = atomic_load_explicit(s->pace_due, memory_order_relaxed);
        if (due != UINT64_MAX && due != s->pace_poked && srv_now_s() * 1e9 >= (double)due) {
            s->pace_poked = due;
            if (wake_fn && (wake_fn != s->pace_poke || wake_arg != pa)) s->pace_poke(pa);
            else wake_fn = s->pace_poke, wake_arg = pa;
        }
    }
    if (wake_fn) {
        void (*fn)(void *) = wake_fn;
        wake_fn = NULL;
        fn(wake_arg);
    }
    return did;
}

/* One step's work: the batch of every running sequence; false when there was nothing to do. */
static bool step_run(struct srv_sched *s) {
    const double t_in = srv_now_s();
    const int N = s->p.n_parallel;
    struct moetax_batch *b = &s->batch;
    moetax_batch_clear(b);
    /* clients gone: their cells go at once */
    for (int i = 0; i < N; i++) {
        struct slot *sl = &s->slots[i];
        if (sl->state == SLOT_ACTIVE && atomic_load(&sl->r->cancel)) {
            req_publish(sl->r, sl->r->len, SRV_FINISH_CANCELLED, "the client went away");
            account_finish(s, sl->r);
            slot_release(s, i, false);
        }
    }
    int seqs = 0, n_decode = 0;
    int64_t prompt_tokens = 0;
    for (int i = 0; i < N; i++) {
        struct slot *sl = &s->slots[i];
        if (sl->state != SLOT_ACTIVE || !sl->decoding) continue;
        moetax_batch_add(b, sl->next, (int32_t)(sl->n_toks - 1), i, true);
        seqs++;
        n_decode++;
    }
    /* prompt chunks, in admission order, at most prefill_chunk tokens in all while sequences decode;
     * with none decoding there is no step to keep short: a micro-batch's worth */
    int64_t budget = n_decode ? s->p.prefill_chunk : s->lone_chunk;
    while (budget > 0) {
        int pick = -1;
        for (int i = 0; i < N; i++) {
            const struct slot *sl = &s->slots[i];
            if (sl->state == SLOT_ACTIVE && !sl->decoding && sl->n_past < sl->n_toks &&
                (moetax_kvcache_seq_len(s->acct, i) == sl->n_past) &&
                (pick < 0 || sl->admit_order < s->slots[pick].admit_order))
                pick = i;
        }
        if (pick < 0) break;
        struct slot *sl = &s->slots[pick];
        int64_t n = sl->n_toks - sl->n_past;
        if (n > budget) n = budget;
        for (int64_t j = 0; j < n; j++) {
            const int64_t pos = sl->n_past + j;
            moetax_batch_add(b, sl->toks[pos], (int32_t)pos, pick, pos == sl->n_toks - 1);
        }
        sl->n_past += n; /* in the cache once the decode succeeds; a failed step fails the request */
        budget -= n;
        prompt_tokens += n;
        seqs++;
        if (sl->n_past < sl->n_toks) break; /* the budget is spent */
    }
    if (b->n_tokens == 0) {
        update_metrics(s, 0, 0, false);
        return false;
    }
    double t_dec = srv_now_s();
    moetax_status st = mirror_decode(s, b);
    if (!st) st = moetax_ctx_decode(s->ctx, b);
    if (st == MOETAX_ERR_LIMIT) {
        /* should not happen (admission reserves); free the idle cells and try once more (the
         * other ranks refuse the same batch on the same cache, and replay the evictions too) */
        for (int i = 0; i < N; i++)
            if (s->slots[i].state == SLOT_IDLE) slot_evict(s, i);
        st = mirror_decode(s, b);
        if (!st) st = moetax_ctx_decode(s->ctx, b);
    }
    t_dec = srv_now_s() - t_dec;
    if (st != MOETAX_OK) {
        char msg[256];
        snprintf(msg, sizeof msg, "decode failed: %s", moetax_last_error());
        fprintf(stderr, "moetax serve: %s\n", msg);
        fail_all(s, SRV_FINISH_ERROR, msg);
        update_metrics(s, 0, 0, false);
        if (s->mirror) { /* under mpirun a failed step (a rank gone, a timeout) ends the server */
            s->fatal = moetax_error(st, "%s", msg);
            pthread_mutex_lock(&s->mu);
            s->stopping = true;
            pthread_mutex_unlock(&s->mu);
        }
        return true;
    }
    if (s->shadow) { /* the batch into the books (every rank took its own share) */
        st = moetax_kvcache_reserve(s->shadow, b->seq, b->pos, b->n_tokens);
        if (st) { /* the books no longer match the ranks' caches: the running requests end (a slot still
                   * prefilling would wait forever for books that never reach its position) */
            char msg[256];
            snprintf(msg, sizeof msg, "the KV books refuse a step the ranks took: %s", moetax_last_error());
            fprintf(stderr, "moetax serve: %s\n", msg);
            fail_all(s, SRV_FINISH_ERROR, msg);
            update_metrics(s, 0, 0, false);
            return true;
        }
        moetax_kvcache_commit(s->shadow, b->seq, b->pos, b->n_tokens);
    }
    pthread_mutex_lock(&s->mmu);
    s->m.prompt_tokens_total += prompt_tokens;
    pthread_mutex_unlock(&s->mmu);
    const double tnow = srv_now_s();
    for (int k = 0; k < b->n_tokens; k++) {
        if (!b->logits[k]) continue;
        const int i = b->seq[k];
        struct slot *sl = &s->slots[i];
        if (sl->state != SLOT_ACTIVE) continue;
        sl->decoding = true;
        const double ts = srv_now_s();
        const int32_t t = moetax_sampler_sample(sl->smp, moetax_ctx_logits_ith(s->ctx, k));
        moetax_ledger_add(s->led, MOETAX_PHASE_SAMPLE, -1, srv_now_s() - ts);
        slot_token(s, i, t, tnow);
    }
    update_metrics(s, seqs, b->n_tokens, prompt_tokens == 0);
    s->sched_s += srv_now_s() - t_in - t_dec; /* in the metrics from the next step's update on */
    return true;
}

void srv_sched_set_pacer(struct srv_sched *s, const _Atomic uint64_t *due_ns, void (*poke)(void *arg), void *arg) {
    s->pace_due = due_ns;
    s->pace_poke = poke;
    atomic_store_explicit(&s->pace_arg, arg, memory_order_release);
}

static void sched_loop(struct srv_sched *s) {
    for (;;) {
        pthread_mutex_lock(&s->mu);
        for (;;) {
            if (s->stopping) break;
            admit(s);
            bool busy = false;
            for (int i = 0; i < s->p.n_parallel; i++) busy |= s->slots[i].state == SLOT_ACTIVE;
            if (busy) break;
            if (s->q_changed) {
                /* the last step's snapshot still counts the requests whose clients went away that
                 * admit() just took from the queue: idle, no step would refresh it (/metrics and
                 * /tax showed them deferred until the next request) */
                pthread_mutex_unlock(&s->mu);
                update_metrics(s, 0, 0, false);
                pthread_mutex_lock(&s->mu);
                continue;
            }
            if (!s->mirror) {
                pthread_cond_wait(&s->cv, &s->mu);
                continue;
            }
            /* under mpirun: wake once a second to see that the job still exists (the other ranks
             * stop by themselves when their launcher goes; so does this one) */
            struct timespec dl;
            clock_gettime(CLOCK_REALTIME, &dl);
            dl.tv_sec += 1;
            pthread_cond_timedwait(&s->cv, &s->mu, &dl);
            if (getppid() != s->parent && !s->stopping) {
                s->fatal = moetax_error(MOETAX_ERR_IO, "mpirun is gone: the server stops");
                s->stopping = true;
            }
        }
        const bool stop = s->stopping;
        pthread_mutex_unlock(&s->mu);
        if (stop) break;
        step(s);
    }
    /* shutting down: every request ends, cancelled */
    fail_all(s, SRV_FINISH_CANCELLED, "the server is shutting down");
    pthread_mutex_lock(&s->mu);
    while (s->q_head) {
        struct srv_req *r = s->q_head;
        s->q_head = r->next;
        req_publish(r, 0, SRV_FINISH_CANCELLED, "the server is shutting down");
        account_finish(s, r);
        srv_req_unref(r);
    }
    s->q_tail = NULL;
    s->q_len = 0;
    pthread_mutex_unlock(&s->mu);
    update_metrics(s, 0, 0, false);
#ifdef MOETAX_WITH_MPI
    if (s->mirror) { /* the other ranks return from srv_sched_follow */
        const int32_t w[1] = {DIST_CMD_STOP};
        moetax_status st = moetax_dist_cmd_send(w, 1);
        if (st && !s->fatal) s->fatal = st;
    }
#endif
}

static void *sched_main(void *arg) {
    sched_loop(arg);
    return NULL;
}

moetax_status srv_sched_run(struct srv_sched *s) {
    if (!s->on_caller) return moetax_error(MOETAX_ERR_INTERNAL, "srv_sched_run: the scheduler has its own thread");
    sched_loop(s);
    return s->fatal;
}

/* The scheduler's state and its context, no thread yet. */
static moetax_status sched_init(const struct srv_sched_params *p, struct srv_sched **out) {
    *out = NULL;
    struct srv_sched *s = calloc(1, sizeof *s);
    if (!s) return moetax_error(MOETAX_ERR_NOMEM, "out of memory");
    s->p = *p;
    pthread_mutex_init(&s->mu, NULL);
    pthread_cond_init(&s->cv, NULL);
    pthread_mutex_init(&s->mmu, NULL);
    const int N = p->n_parallel;
    int ub = p->n_ubatch > 0 ? p->n_ubatch : MOETAX_UBATCH_DEFAULT; /* a step of the defaults in one micro-batch */
    if (p->store && ub > p->n_ubatch_store) ub = p->n_ubatch_store; /* every expert a micro-batch pins fits */
    s->lone_chunk = ub > p->prefill_chunk ? ub : p->prefill_chunk; /* prompt tokens of a step with none decoding */
    struct moetax_ctx_params cp = {.n_ctx = (int32_t)p->n_ctx, .n_seq_max = N, .n_threads = p->n_threads,
                                   .n_expert_used = p->n_expert_used, .n_ubatch = ub, .store = p->store,
                                   .no_prefetch = p->no_prefetch, .kv_type = p->kv_type,
                                   .capacity_factor = p->capacity_factor, .overflow = p->overflow,
                                   .adapt_threads = p->adapt_threads, .attn_prefill = p->attn_prefill};
    moetax_status st;
    if (!(s->ring = calloc(TAX_RING, sizeof *s->ring))) { st = moetax_error(MOETAX_ERR_NOMEM, "out of memory"); goto fail; }
    s->t_start = srv_now_s();
    if ((st = moetax_ctx_init(p->model, &cp, &s->ctx))) goto fail;
    {   /* tests: every step spins this long (a slot stays busy while a test lines up its queue) */
        const char *dl = getenv("MOETAX_TEST_STEP_DELAY_US");
        if (dl && atoi(dl) > 0) moetax_ctx_test_delay(s->ctx, MOETAX_PHASE_HEAD, (uint64_t)atoi(dl) * 1000u);
    }
    s->kv = s->acct = moetax_ctx_kv(s->ctx);
    s->bs = moetax_kvcache_block_size(s->kv);
    s->blocks_all = moetax_kvcache_n_cells(s->kv) / s->bs;
    s->max_seq = moetax_kvcache_n_cells(s->kv);
    if (p->model->hp.n_ctx_train > 0 && p->model->hp.n_ctx_train < s->max_seq) s->max_seq = p->model->hp.n_ctx_train;
    /* one request must fit the reservation rule alone */
    while (s->max_seq > 1 && blocks_for(s, s->max_seq) + 1 > s->blocks_all) s->max_seq -= s->bs;
    if (s->max_seq < 2) { st = moetax_error(MOETAX_ERR_ARG, "-c %lld cells are too few for one request", (long long)p->n_ctx); goto fail; }
    struct moetax_ledger_params lp = {.n_workers = moetax_ctx_n_threads(s->ctx), .n_layer = p->model->hp.n_layer,
                                      .window = 256};
    if ((st = moetax_ledger_init(&lp, &s->led))) goto fail;
    moetax_ctx_set_ledger(s->ctx, s->led);
    if ((st = moetax_batch_init(&s->batch, N + s->lone_chunk))) goto fail;
    if (!(s->slots = calloc((size_t)N, sizeof *s->slots))) { st = moetax_error(MOETAX_ERR_NOMEM, "out of memory"); goto fail; }
    for (int i = 0; i < N; i++)
        if (!(s->slots[i].toks = malloc(sizeof(int32_t) * (size_t)(s->max_seq + 1)))) {
            st = moetax_error(MOETAX_ERR_NOMEM, "out of memory");
            goto fail;
        }
    update_metrics(s, 0, 0, false);
    *out = s;
    return MOETAX_OK;
fail:
    srv_sched_free(s);
    return st;
}

moetax_status srv_sched_start(const struct srv_sched_params *p, struct srv_sched **out) {
    struct srv_sched *s;
    moetax_status st = sched_init(p, &s);
    if (st) return st;
#ifdef MOETAX_WITH_MPI
    if (p->mpi) { /* the main thread runs the loop (srv_sched_run): MPI is FUNNELED */
        if ((st = moetax_dist_cmd_open())) { srv_sched_free(s); return st; }
        s->mirror = s->on_caller = true;
        s->parent = getppid();
        const struct moetax_dist *w = moetax_dist_world();
        s->shard = w && w->dispatch ? w->size : 1;
        if (s->shard > 1) {
            struct moetax_kvcache_params kp = {.n_cells = moetax_kvcache_n_cells(s->kv), .block_size = (int32_t)s->bs,
                                               .n_seq_max = moetax_kvcache_n_seq_max(s->kv)};
            if ((st = moetax_kvcache_init(1, 1, &kp, &s->shadow))) { srv_sched_free(s); return st; }
            s->acct = s->shadow;
        }
        s->started = true;
        *out = s;
        return MOETAX_OK;
    }
#else
    if (p->mpi) {
        srv_sched_free(s);
        return moetax_error(MOETAX_ERR_ARG, "built without MPI");
    }
#endif
    if (pthread_create(&s->thread, NULL, sched_main, s) != 0) {
        srv_sched_free(s);
        return moetax_error(MOETAX_ERR_INTERNAL, "cannot start the scheduler thread");
    }
    s->started = true;
    *out = s;
    return MOETAX_OK;
}

moetax_status srv_sched_follow(const struct srv_sched_params *p) {
#ifdef MOETAX_WITH_MPI
    struct srv_sched *s;
    moetax_status st = sched_init(p, &s);
    if (st) return st;
    if ((st = moetax_dist_cmd_open())) { srv_sched_free(s); return st; }
    int32_t *w = NULL;
    size_t cap = 0, n = 0;
    struct moetax_batch *b = &s->batch;
    for (bool stop = false; !stop && !st;) {
        if ((st = moetax_dist_cmd_recv(&w, &cap, &n))) break;
        for (size_t i = 0; i < n && !stop && !st;) {
            const size_t left = n - i;
            switch (w[i]) {
            case DIST_CMD_RM:
                if (left < 4) goto bad;
                moetax_kvcache_seq_rm(s->kv, w[i + 1], w[i + 2], w[i + 3]);
                i += 4;
                break;
            case DIST_CMD_CP:
                if (left < 5) goto bad;
                moetax_kvcache_seq_cp(s->kv, w[i + 1], w[i + 2], w[i + 3], w[i + 4]);
                i += 5;
                break;
            case DIST_CMD_DECODE: {
                if (left < 2 || w[i + 1] < 0 || (size_t)w[i + 1] > (left - 2) / 4) goto bad;
                const int32_t nt = w[i + 1];
                if (nt > b->capacity) goto bad;
                moetax_batch_clear(b);
                for (int32_t k = 0; k < nt; k++) {
                    const int32_t *e = w + i + 2 + 4 * k;
                    moetax_batch_add(b, e[0], e[1], e[2], e[3] != 0);
                }
                i += 2 + 4 * (size_t)nt;
                st = moetax_ctx_decode(s->ctx, b);
                if (st == MOETAX_ERR_LIMIT) st = MOETAX_OK; /* rank 0 was refused the same: it evicts, retries */
                break;
            }
            case DIST_CMD_STOP: stop = true; break;
            default:
            bad:
                st = moetax_error(MOETAX_ERR_FORMAT, "rank %d: a step script from rank 0 that does not parse "
                                  "(word %zu of %zu)", moetax_dist_rank(), i, n);
            }
        }
    }
    free(w);
    srv_sched_free(s);
    return st;
#else
    (void)p;
    return moetax_error(MOETAX_ERR_ARG, "built without MPI");
#endif
}

void srv_sched_stop(struct srv_sched *s) {
    if (!s || !s->started) return;
    pthread_mutex_lock(&s->mu);
    const bool was = s->stopping;
    s->stopping = true;
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
    if (!was && !s->on_caller) pthread_join(s->thread, NULL); /* on the caller: its srv_sched_run returns */
    s->started = false;
}

void srv_sched_free(struct srv_sched *s) {
    if (!s) return;
    srv_sched_stop(s);
    if (s->slots)
        for (int i = 0; i < s->p.n_parallel; i++) {
            if (s->slots[i].r) srv_req_unref(s->slots[i].r);
            moetax_sampler_free(s->slots[i].smp);
            free(s->slots[i].toks);
        }
    free(s->slots);
    free(s->cmd);
    moetax_kvcache_free(s->shadow);
    moetax_batch_free(&s->batch);
    if (s->ctx) moetax_ctx_set_ledger(s->ctx, NULL);
    moetax_ledger_free(s->led);
    moetax_ctx_free(s->ctx);
    pthread_mutex_destroy(&s->mu);
    pthread_cond_destroy(&s->cv);
    pthread_mutex_destroy(&s->mmu);
    free(s->ring);
    free(s);
}

void srv_sched_metrics(struct srv_sched *s, struct srv_metrics *out) {
    pthread_mutex_lock(&s->mmu);
    *out = s->m;
    pthread_mutex_unlock(&s->mmu);
}

char *srv_sched_tax_json(struct srv_sched *s, double window_s) {
    pthread_mutex_lock(&s->mmu);
    const struct srv_metrics now = s->m;
    const double t = srv_now_s();
    /* the metrics when the window began: the newest snapshot at or before its start (snapshots
     * follow steps: nothing ran between it and the start);
     * none: zeros at the server's start, or the oldest snapshot once the ring has wrapped. The
     * window is then what the server has lived of it (an idle server: its whole window, with
     * nothing in it; it had read the totals since start over a window of 0 s) */
    struct srv_metrics then = {0};
    double t_then = s->t_start;
    bool found = false;
    for (int i = s->ring_n - 1; i >= 0 && !found; i--) {
        const struct tax_snap *x = &s->ring[(s->ring_head + TAX_RING - s->ring_n + i) % TAX_RING];
        if (t - x->t >= window_s) then = x->m, t_then = x->t, found = true;
    }
    if (!found && s->ring_n == TAX_RING) {
        const struct tax_snap *x = &s->ring[s->ring_head]; /* the oldest */
        then = x->m;
        t_then = x->t;
    }
    pthread_mutex_unlock(&s->mmu);
    if (t - t_then > window_s) t_then = t - window_s;
    double ph[MOETAX_PHASE_COUNT], total = 0, tax = 0;
    json_t *phases = json_object();
    for (int p = 0; p < MOETAX_PHASE_COUNT; p++) {
        ph[p] = now.phase_s[p] - then.phase_s[p];
        total += ph[p];
        if (moetax_phase_is_tax((enum moetax_phase)p)) tax += ph[p];
    }
    for (int p = 0; p < MOETAX_PHASE_COUNT; p++)
        json_object_set_new(phases, moetax_phase_name((enum moetax_phase)p), json_real(ph[p]));
    const double span = t - t_then, wall = now.wall_s - then.wall_s;
    const int64_t steps = now.steps - then.steps, dsteps = now.decode_steps - then.decode_steps;
    const int64_t toks = (now.prompt_tokens_total - then.prompt_tokens_total) +
                         (now.tokens_predicted_total - then.tokens_predicted_total);
    const int64_t layers = now.moe_layer_passes - then.moe_layer_passes;
    const int64_t asg = (now.moe_assignments - then.moe_assignments) + (now.moe_dropped - then.moe_dropped);
    const double acq = (double)(now.store_acquires - then.store_acquires);
    json_t *o = json_object();
    json_object_set_new(o, "window_s", json_real(span));
    json_object_set_new(o, "steps", json_integer(steps));
    json_object_set_new(o, "decode_steps", json_integer(dsteps));
    json_object_set_new(o, "step_seconds", json_real(wall));
    json_object_set_new(o, "busy_share", span > 0 ? json_real(wall / span) : json_null());
    json_object_set_new(o, "tokens", json_integer(toks));
    json_object_set_new(o, "tokens_per_s", span > 0 ? json_real((double)toks / span) : json_null());
    json_object_set_new(o, "phase_s", phases);
    json_object_set_new(o, "tax_share", total > 0 ? json_real(tax / total) : json_null());
    json_object_set_new(o, "decode_batch_mean",
                        dsteps > 0 ? json_real((double)(now.decode_tokens - then.decode_tokens) / (double)dsteps) : json_null());
    json_object_set_new(o, "unique_experts_per_layer",
                        layers > 0 ? json_real((double)(now.moe_experts - then.moe_experts) / (double)layers) : json_null());
    json_object_set_new(o, "dropped_share", asg > 0 ? json_real((double)(now.moe_dropped - then.moe_dropped) / (double)asg)
                                                   : json_null());
    /* used = active (running requests) + cached (idle slots' prefixes kept for reuse), as in /metrics */
    json_object_set_new(o, "kv_cells_used", json_integer(now.kv_cells_used));
    json_object_set_new(o, "kv_cells_active", json_integer(now.kv_cells_active));
    json_object_set_new(o, "kv_cells_cached", json_integer(now.kv_cells_cached));
    json_object_set_new(o, "kv_cells", json_integer(now.kv_cells));
    json_object_set_new(o, "requests_processing", json_integer(now.requests_processing));
    json_object_set_new(o, "requests_deferred", json_integer(now.requests_deferred));
    if (now.has_store) {
        json_t *so = json_object();
        json_object_set_new(so, "hit_rate", acq > 0 ? json_real((double)(now.store_hits - then.store_hits) / acq) : json_null());
        json_object_set_new(so, "loads", json_integer((json_int_t)(now.store_loads - then.store_loads)));
        json_object_set_new(so, "bytes_read", json_real((double)(now.store_bytes_read - then.store_bytes_read)));
        json_object_set_new(so, "stall_s", json_real(now.store_stall_s - then.store_stall_s));
        json_object_set_new(o, "store", so);
    } else {
        json_object_set_new(o, "store", json_null());
    }
    char *text = json_dumps(o, JSON_COMPACT | JSON_REAL_PRECISION(9));
    json_decref(o);
    return text;
}

