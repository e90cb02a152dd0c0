/*
 * server/sched.h - the server's scheduler: one thread that owns the context
 * and runs continuously batched decode steps; requests that the HTTP side hands
 * to it; per-request text that the HTTP side reads.
 *
 * DESIGN
 *   The context (KV cache, pool, buffers) is touched by the scheduler thread
 *   only. The HTTP side builds a struct srv_req (its prompt tokens, sampling
 *   parameters, stop strings, a wake-up callback), submits it and reads its
 *   text under the request's own mutex: the scheduler appends text there after
 *   every step and marks the request finished (stop, length, error or
 *   cancelled), and calls the request's wake callback at the end and at the
 *   first text after the HTTP side asked for it (want_text), never once per
 *   token otherwise. The request is reference counted (the HTTP side and the
 *   scheduler each hold one) so either side may go first.
 *
 *   Slots: n_parallel sequences (sequence id = slot). Each step
 *     1. admits queued requests (FIFO) into free slots, when the cache can
 *        hold everything the running requests and the new one may still take
 *        (prompt + max_tokens, in blocks, + 1 block for a copy on write): so a
 *        running request never meets a full cache halfway;
 *     2. builds one batch: one token of every decoding sequence, then at most
 *        prefill_chunk prompt tokens of the sequences still prefilling (in
 *        admission order), so a long prompt does not stall the decoding ones;
 *        with no sequence decoding, up to a micro-batch's (the context's
 *        n_ubatch: 512, or the expert store's), so a prompt alone is not cut
 *        into steps of prefill_chunk;
 *     3. decodes it, samples the sequences whose prompt is done, applies the
 *        stop strings (text that might be the start of a stop string, or of a
 *        UTF-8 character, is held back until it is not), publishes the text.
 *   A request whose client went away (srv_req_cancel) is dropped at the next
 *   step and its cells freed at once (moetax_kvcache_seq_rm).
 *
 *   Prefix reuse: a request that finished normally leaves its cells in its
 *   slot (an idle slot) until the space or the slot is needed (oldest idle
 *   first). A new prompt that starts with the tokens some slot holds (idle or
 *   running) shares those cells (moetax_kvcache_seq_cp: blocks shared, copy on
 *   write) and prefills only the rest (at least its last token, for logits).
 *
 * INVARIANTS
 *   - Sum over running requests of their reserved blocks <= the cache's blocks;
 *     the free blocks always cover what the running ones may still append.
 *   - A request's published text only grows; it never holds a stop string nor
 *     anything after one.
 */
#ifndef MOETAX_SERVER_SCHED_H
#define MOETAX_SERVER_SCHED_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "moetax/model.h"
#include "moetax/sampler.h"
#include "moetax/status.h"
#include "moetax/tokenizer.h"
#include "moetax/ledger.h"

enum srv_finish {
    SRV_FINISH_NONE = 0,  /* still running or queued */
    SRV_FINISH_STOP,      /* end of generation token or a stop string */
    SRV_FINISH_LENGTH,    /* max_tokens */
    SRV_FINISH_CANCELLED, /* the client went away, or the server shuts down */
    SRV_FINISH_ERROR,     /* a decode error (the message is in err) */
};
const char *srv_finish_name(enum srv_finish f); /* OpenAI's finish_reason: "stop", "length", ... */

enum { SRV_MAX_STOP = 8, SRV_MAX_STOP_LEN = 256 };

struct srv_req {
    /* set before srv_sched_submit, read-only afterwards */
    int32_t *prompt;            /* [n_prompt] owned */
    int64_t n_prompt;
    int64_t max_tokens;
    struct moetax_sampler_params sp;
    char *stop[SRV_MAX_STOP];   /* owned, NUL-terminated, non-empty */
    int n_stop;
    bool ignore_eos;            /* generate past end-of-text (max_tokens still ends it) */

    /* set before srv_sched_submit, read-only afterwards (NULL: nobody is told) */
    void (*wake)(void *arg);    /* called by the scheduler, with mu held, when the request finishes
                                 * and when its text grows while want_text is set (which it then
                                 * clears): it must not block nor take mu */
    void *wake_arg;

    /* shared: guarded by mu */
    pthread_mutex_t mu;
    bool want_text;             /* the next growth of the text calls wake (a stream waiting for
                                 * it); otherwise only the end does, so that a paced stream or a
                                 * whole answer costs no wake-up per token */
    char *text;                 /* published text (may hold invalid UTF-8 only at the very end) */
    size_t len, cap;
    int64_t n_gen;              /* tokens generated (counted in usage) */
    int64_t n_reused;           /* prompt tokens whose cells were shared from another sequence */
    enum srv_finish finish;
    char err[256];
    double t_queued, t_admitted, t_first, t_end; /* monotonic seconds */
    int64_t created;            /* Unix seconds when it arrived (the answer's "created") */

    atomic_bool cancel;         /* set by the HTTP side: the client went away */
    atomic_int refs;

    /* scheduler-owned */
    char *gen;                  /* all generated text; published up to `len` */
    size_t gen_len, gen_cap;
    struct srv_req *next;       /* queue link */
};

/* A request with refs = 1 (the caller's); the prompt is copied. NULL when out of memory. */
struct srv_req *srv_req_new(const int32_t *prompt, int64_t n_prompt);
void srv_req_unref(struct srv_req *r);
/* The client went away: the scheduler drops the request at its next step. */
void srv_req_cancel(struct srv_req *r);
/* CLOCK_MONOTONIC in seconds (the clock of the request's times). */
double srv_now_s(void);

struct srv_sched_params {
    const struct moetax_model *model;      /* not owned */
    const struct moetax_tokenizer *tok;    /* not owned */
    int n_parallel;                        /* slots (sequences decoded together) */
    int64_t n_ctx;                         /* KV cells in all */
    int n_threads;                         /* 0: online CPUs */
    int n_expert_used;                     /* 0: the model's */
    int max_queue;                         /* requests waiting beyond the free slots before 503 */
    int prefill_chunk;                     /* prompt tokens per step, all sequences together, while any decodes */
    int n_ubatch;                          /* tokens per micro-batch (0: MOETAX_UBATCH_DEFAULT) */
    bool no_prefix_reuse;                  /* free a finished sequence's cells at once */
    bool adapt_threads;                    /* moetax_ctx_params.adapt_threads */
    struct moetax_store *store;            /* optional expert store (not owned; opened for n_ubatch_store) */
    int n_ubatch_store;                    /* the micro-batch the store was fitted to */
    enum moetax_attn_prefill attn_prefill; /* moetax_ctx_params' */
    bool no_prefetch;                      /* with a store: no early reads */
    enum moetax_type kv_type;              /* KV cells: f32 (0), f16 or q8_0 */
    float capacity_factor;                 /* 0: off */
    enum moetax_overflow overflow;
    bool mpi;                              /* under mpirun with 2+ ranks, on rank 0: every step's cache
                                              operations and batch go to the other ranks first
                                              (src/dist/dist_cmd.h), and the loop runs on the caller,
                                              the thread that initialised MPI (srv_sched_run) */
};

struct srv_sched;

/* Create the context and the ledger and start the scheduler thread (p->mpi: no thread; the
 * caller then runs the loop with srv_sched_run). */
moetax_status srv_sched_start(const struct srv_sched_params *p, struct srv_sched **out);
/* p->mpi: run the scheduler on this thread until srv_sched_stop (from another thread) or a
 * failed step; returns that step's error, else MOETAX_OK. */
moetax_status srv_sched_run(struct srv_sched *s);
/* Under mpirun, ranks > 0: the same context as rank 0's scheduler (the same params), stepping
 * with rank 0's scripts until it stops; an error (a script that does not parse, a failed step)
 * is returned. */
moetax_status srv_sched_follow(const struct srv_sched_params *p);
/* The HTTP side's pacing (http.c): *due_ns is when its next paced stream event is due
 * (srv_now_s in nanoseconds; UINT64_MAX: none); at the end of the first step past that time the
 * scheduler calls poke(arg) (from its thread, with no lock held), so that the HTTP thread sends
 * the event between two steps rather than in the middle of one, where it would take a worker's
 * core while the other waits at a barrier. Set once, before requests arrive; arg must outlive the
 * scheduler's steps (stop it before freeing arg). */
void srv_sched_set_pacer(struct srv_sched *s, const _Atomic uint64_t *due_ns, void (*poke)(void *arg), void *arg);
/* Hand a request to the scheduler (it takes a reference). MOETAX_ERR_LIMIT:
 * the queue is full (503); MOETAX_ERR_ARG: prompt + max_tokens do not fit a
 * sequence (srv_sched_max_seq; 400), or the server is shutting down. */
moetax_status srv_sched_submit(struct srv_sched *s, struct srv_req *r);
/* Most positions one request may use: min(cells, the model's context_length). */
int64_t srv_sched_max_seq(const struct srv_sched *s);
int srv_sched_n_parallel(const struct srv_sched *s);
int64_t srv_sched_n_ctx(const struct srv_sched *s);
/* Finish every request (cancelled) and stop the thread; idempotent. */
void srv_sched_stop(struct srv_sched *s);
void srv_sched_free(struct srv_sched *s);

/* What /metrics shows: a snapshot the scheduler refreshes after every step. */
enum { SRV_HIST_N = 12 };
extern const double srv_hist_bounds[SRV_HIST_N]; /* seconds, the histogram buckets' upper bounds */
struct srv_hist {
    int64_t counts[SRV_HIST_N + 1]; /* per bucket (not cumulative); last: +Inf */
    double sum;
    int64_t n;
};
struct srv_metrics {
    int64_t prompt_tokens_total;     /* prompt tokens evaluated (not those reused) */
    int64_t prompt_tokens_reused;    /* prompt tokens whose cells were shared */
    int64_t tokens_predicted_total;
    double prompt_seconds_total;     /* per request: admission to first token */
    double tokens_predicted_seconds_total; /* per request: first token to the end */
    int64_t requests_total, requests_cancelled;
    int requests_processing, requests_deferred;
    int64_t steps, decode_steps;
    int last_batch_seqs;             /* sequences in the last step */
    int64_t last_batch_tokens;
    int64_t kv_cells, kv_cells_used; /* all cells, cells of blocks in use */
    int64_t kv_cells_active;        /* positions held by running requests */
    int64_t kv_cells_cached;        /* cells of the blocks idle slots hold for reuse (shared ones counted per slot) */
    double phase_s[MOETAX_PHASE_COUNT]; /* all steps, averaged over workers */
    double wall_s;
    double sched_s;                  /* the scheduler's time in steps outside the decode call (the
                                      * batch, sampling, token text, stop strings, these metrics; up to the
                                      * step before) */
    double http_cpu_s;               /* set by the HTTP side: its thread's CPU time (http.c) */
    double tax_share;
    int64_t decode_tokens;           /* tokens of decode steps (batch size sum) */
    int64_t moe_layer_passes, moe_experts; /* decode steps: distinct experts summed over layer passes */
    int64_t moe_dropped, moe_assignments;
    bool has_store;                  /* the expert store's counts since start */
    uint64_t store_acquires, store_hits, store_loads, store_bytes_read;
    double store_stall_s;            /* the ledger's load phase */
    struct srv_hist ttft, tpot;
    uint64_t http_read_timeouts;     /* set by the HTTP side: connections shut down by the request
                                      * deadline (--read-timeout) with a request begun (its first line) */
    uint64_t http_idle_closed;       /* ... and with none: new ones that sent no request line, kept-alive
                                      * ones idle after an answer */
    int http_streams;                /* ... streams being written now, and the pacing interval they get
                                      * (--stream-interval, stretched with many streams: http.c) */
    double http_stream_interval_s;
};
void srv_sched_metrics(struct srv_sched *s, struct srv_metrics *out);

/* GET /tax: the bill over the last `window_s` seconds (a ring of the metrics after each
 * step): phases, tax share, tokens/s, batch size, distinct experts, dropped share, store
 * hit rate. A JSON text to free(), NULL when out of memory. */
char *srv_sched_tax_json(struct srv_sched *s, double window_s);

#endif
