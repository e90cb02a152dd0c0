/* dist.h - expert parallelism over MPI (built when CMake finds MPI: MOETAX_WITH_MPI).
 * Internal.
 *
 * DESIGN
 *   `mpirun -np P moetax run|bench|perplexity|eval ...` starts P copies of the same command.
 *   main() calls moetax_dist_init, which joins MPI only under mpirun (its environment says
 *   so); otherwise there is no world and nothing here is called. Every rank parses the same
 *   options, loads the same file, tokenizes the same prompt and samples with the same seed;
 *   rank 0's batch is what counts: moetax_ctx_decode broadcasts it (moetax_dist_sync_batch)
 *   and the others use it, so every rank steps with the same tokens. Only rank 0 writes to
 *   stdout (the others' stdout is /dev/null); errors go to each rank's stderr.
 *
 *   Placement: the routed experts of every MoE layer are cut into P contiguous ranges,
 *   rank r owns [r E / P, (r + 1) E / P). Attention, dense layers, the router and the shared
 *   experts are replicated: every rank holds the whole residual of the micro-batch and
 *   routes every token itself (the same inputs and the same router give the same routing,
 *   hence the same dispatch plan, everywhere: no counts need to be exchanged). A rank
 *   repacks, prefaults and reads only its own experts (moetax_model_set_expert_range).
 *
 *   Combine (per MoE layer), two ways:
 *   - GATHER (default, exact): each rank computes the down outputs of its own experts' slots.
 *     Slots are grouped by expert in ascending order, so one rank's slots are one contiguous
 *     range; an MPI_Allgatherv of those rows gives every rank all of ydown in slot order,
 *     and the combine is then the single process's (experts ascending, then shared): logits
 *     bit-identical to `moetax` without mpirun. Moves n_slots x d floats per rank and layer.
 *   - ALLREDUCE (MOETAX_MPI_COMBINE=allreduce): each rank sums w * y of its own slots per
 *     token into a zeroed [n, d] buffer, one MPI_Allreduce(SUM) adds the ranks' partial sums.
 *     Moves n x d floats (each way), k / P times fewer for top-k, but the summation order
 *     differs from the single process: logits agree to float rounding (tested: max |diff|
 *     relative to the logits' range below 1e-4), not bit for bit.
 *   Only worker 0 (the thread that called moetax_ctx_decode; with --ep-overlap the communication
 *   thread instead, while worker 0 makes no MPI call: MPI_THREAD_SERIALIZED) calls MPI,
 *   between two barriers of the step. The ledger books an MPI_Barrier just before the
 *   collective to `wait` (this rank waiting for the slowest), the collective itself to `comm`.
 *
 *   Replication (--ep-replicas R, EPLB-style): per MoE layer up to R extra hosts for the hottest
 *   experts, chosen greedily, each on the least-loaded rank that has its weights, for the busiest
 *   rank's expert while that lowers the busiest rank's load. Every rank routes every token, so once
 *   it has routed, every rank has the micro-batch's exact counts and plans the same from them: no
 *   message (moetax_dist_plan_micro, into the plan's own arrays: for one token every worker plans
 *   its own copy, without a barrier; D's arrays hold the latest plan, for the exit summary). With
 *   --ep-load PROFILE only the replicas planned once from the profile's frequencies (then EPLB's
 *   rule: the largest load per host) are mapped and may be used. --ep-replan K has no effect: it
 *   was the period of plans made between steps from the counts so far, which balanced less (the
 *   README has the counts). A micro-batch's
 *   slots of a replicated expert are split between its hosts (each slot, most-used expert first,
 *   to the host with the fewest slots of the layer so far), each host computing a contiguous
 *   part; the gather puts every row back in slot order, so the logits stay bit-identical.
 *   Without a profile any expert may become a replica anywhere, so every rank maps all of them
 *   (the exit summary says how much beyond its own); with one, only the profile's replicas.
 *   With the token-sharded dispatch (below) a rank sees only its own tokens, so each MoE layer
 *   first gathers every rank's per-expert counts (E ints from each rank: one small
 *   MPI_Iallgatherv per layer and micro-batch, booked to `wait`). Since every rank then knows the
 *   micro-batch's own counts before anything is sent, the layer's hosts are planned from them
 *   (moetax_dist_plan_now: the same greedy, the loads being the counts themselves, without the
 *   EPLB fallback; between equally loaded ranks the one whose own tokens use the expert most),
 *   as DeepSeek-V3's decoding computes its redundant experts' routing on the fly before each
 *   layer's all-to-all. Replicas planned between steps from past counts (as both dispatches once
 *   did) gave none to the first step and only a forecast to the others (the README has the busiest
 *   rank's excess either way). Every rank then splits the
 *   global counts over the hosts exactly as above and derives the same flows: a host keeps its
 *   own tokens' assignments up to its part (no transfer), the rest fill the other hosts' parts,
 *   ranks in order (moetax_dist_flows). Each token still goes once to each rank that computes
 *   one of its assignments. The counts booked are the same on every rank, so the plans need
 *   no message either. With --ep-load the plan may use only the replicas the profile mapped.
 *
 *   Capacity factor (--capacity-factor C): the replicated dispatch routes every token on every
 *   rank and applies the single process's rule (src/moe/moe.c, apply_capacity) to the same
 *   micro-batch. The token-sharded one gathers every rank's router logits of the micro-batch
 *   (with each token's index in the batch) in the same per-layer gather, and every rank routes
 *   and caps the whole step in the batch's order: the cap ceil(C N k / E) counts the step's N
 *   tokens of all ranks, and every rank drops and reroutes the same assignments; the ledger of
 *   every rank books the step's dropped and rerouted assignments (the same numbers on every
 *   rank, not a per-rank share). C off (0 or inf) gathers nothing.
 *
 *   Faults: the loader's result is agreed on by every rank (moetax_dist_model_loaded): a rank
 *   that failed makes every rank fail with a message naming it, and a file whose header and
 *   tensor table differ from rank 0's is an error naming both. MPI errors return (not abort);
 *   a command that ends with an error calls MPI_Abort so that no rank is left waiting.
 *
 *   Token-sharded dispatch (MOETAX_MPI_DISPATCH=alltoall or --ep-dispatch alltoall; without either,
 *   and without --ep-overlap, the default for commands of 64 or more sequences: moetax_dist_default_dispatch), as
 *   DeepSeek-V3's inference and DeepEP do: rank r runs the embedding, attention (its own KV
 *   cells), the dense layers, the router, the shared experts and the head only for the batch's
 *   sequences with seq % P == r (the context, src/model/forward.c, picks them from rank 0's
 *   batch; the ranks agree on the number of micro-batches, a rank with no tokens in one still
 *   serves its experts). Each MoE layer then (src/moe/moe.c, moe_block_ep): the rank routes its
 *   tokens and packs one record per (token, destination rank that owns at least one of its
 *   experts): the token's prepared input row (Q8_0 / Q4_0 rows when the experts are of that
 *   type, else float rows) and the ids and weights of that rank's experts only. Counts first,
 *   then the records (moetax_dist_a2a: a message of its byte count to every other rank, then
 *   one of the bytes to every rank that has some, point to point); the owner computes its
 *   experts for every record it received and returns one weighted partial sum per record (an
 *   exchange back); the token's rank adds the partial
 *   sums in rank order, then the shared experts. Records for the rank itself never touch
 *   MPI. The logits of the tokens that want them are gathered to every rank (each rank's
 *   caller samples as the single process does, so the ranks' control flow stays the same).
 *   The summation order is not the single process's (experts within a rank's partial sum,
 *   then the ranks' sums), so logits agree to float rounding, not bit for bit.
 *   Overlap (MOETAX_MPI_OVERLAP=1 or --ep-overlap): the exchanges run on a communication
 *   thread (moetax_dist_a2a_post / _state), the layer's local tokens go as two micro-batches,
 *   and the records for this rank itself are computed while both travel, the first
 *   micro-batch's remote records while the second's arrive and its partial sums go back while
 *   the second is computed, the shared experts while the last partial sums return. The
 *   arithmetic per token is the same with and without overlap (batch-invariant matmuls, a
 *   fixed order of the sums), so the two give the same bits.
 *   Ledger: the counts exchange completes only when every rank has reached it, so its time is
 *   `wait` (this rank waiting for the slowest), the payload's is `comm`: no barrier. With
 *   overlap, the time worker 0 is blocked on an exchange is booked the same way (before the
 *   counts arrived: wait, after: comm); the transfers' own times are in the exit summary.
 */
#ifndef MOETAX_DIST_H
#define MOETAX_DIST_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "moetax/model.h"
#include "moetax/status.h"

enum moetax_dist_combine {
    MOETAX_DIST_COMBINE_GATHER = 0,    /* exact: ydown rows gathered in slot order */
    MOETAX_DIST_COMBINE_ALLREDUCE = 1, /* partial sums per token, added by MPI_Allreduce */
};

struct moetax_dist {
    int rank, size;
    enum moetax_dist_combine combine;
    /* totals since init, of this rank (bytes as MPI moves them: what this rank sends and receives) */
    uint64_t bytes_sent, bytes_recv, n_collectives;
    uint64_t ns_comm, ns_wait;
    /* what a token-sharded dispatch would move (counted from the plans, not sent): rows of d
     * prepared activations to remote ranks, once per (token, rank) vs once per (token, expert) */
    uint64_t rows_per_rank, rows_per_expert;
    /* placement: the rank of every routed expert, [n_layer, n_expert] (contiguous ranges, or
     * --placement FILE); contiguous: every layer's ranks are nondecreasing in the expert id */
    int32_t *owner;
    bool contiguous;
    /* token-sharded dispatch (see above): on, overlapped; its exchanges' bytes as sent (records
     * and partial sums, self excluded) and what once-per-expert dispatch would move (the same
     * rows once per (token, remote expert), each with its id and weight, and one partial row
     * back per (token, remote expert)); the time worker 0 was blocked on an exchange */
    bool dispatch, overlap;
    int thread_level; /* what MPI_Init_thread gave */
    /* MOETAX_MPI_TIMEOUT (seconds a wait may last, default 60; 0: no limit) and MOETAX_MPI_NAP_US
     * (the communication thread's nap between polls, default 20 us; 0: sched_yield only), read
     * and checked once at init: a value that is not a number in range stops every rank there */
    double timeout_s;
    long nap_ns;
    uint64_t a2a_bytes_rank, a2a_bytes_expert, ns_blocked, n_records, bytes_logits, ns_logits;
    /* the layers' global views (replicas' counts, a capacity factor's router logits: alltoall
     * only): gathers and their bytes (sent + received; also in bytes_sent / bytes_recv) */
    uint64_t n_global, bytes_global;
    /* bytes sent and received per layer [n_layer_b] (every exchange, gather and combine of a MoE
     * layer; the replicated dispatch's combine books to the layer its barrier named, cur_layer) */
    uint64_t *layer_sent, *layer_recv;
    int n_layer_b, cur_layer;
    /* with --trace (moetax_dist_keep_exchanges): every booked exchange, gather and combine as a
     * record, the last xrec_cap of them in a ring (xrec_n: records booked) */
    struct moetax_dist_xrec *xrec;
    int64_t xrec_cap;
    _Atomic int64_t xrec_n;
    /* replicas of hot experts (see "Replication" above): up to n_rep extra hosts per MoE layer,
     * planned per layer and micro-batch from its own counts (replicated: plan_micro; token-sharded:
     * plan_now from its gathered counts; n_replans counts those plans); hosts/n_hosts hold the
     * start-up plan from `load` (a profile's frequencies, --ep-load), which decides what is mapped;
     * `replan` is checked and kept but nothing is planned between steps */
    int n_rep, replan, H;     /* H: the most hosts an expert can have, min(n_rep, P - 1) + 1 */
    int n_layer, n_expert;
    uint8_t *is_moe;          /* [n_layer] */
    int32_t *hosts;           /* [n_layer, E, H] ranks computing expert e (hosts[0]: its owner) */
    int32_t *n_hosts;         /* [n_layer, E] */
    uint64_t *load;           /* [n_layer, E] a profile's frequencies (--ep-load), for the plan of what to map */
    uint8_t *avail;           /* [n_layer, E, P] rank r has expert e's weights (may host it) */
    uint64_t steps, n_replans;
    int n_extra;              /* experts this rank maps beyond its own */
    uint64_t extra_bytes;
    /* expert work, summed over the (micro-batch, MoE layer) plans: the busiest rank's slots with
     * the replicas and with the placement alone (the same routing), all slots, this rank's */
    uint64_t work_max, work_max_base, work_total, work_mine, n_planned;
    uint64_t work_floor;      /* the sum of ceil(slots / P): no split can do better */
    /* scratch */
    int *counts, *displs;     /* [size] */
    int32_t *b_tok, *b_pos, *b_seq; /* the broadcast batch (ranks > 0) */
    bool *b_want;
    int64_t b_cap;
};

/* Under mpirun: MPI_Init_thread(FUNNELED), the world; elsewhere nothing (0). Nonzero: error printed. */
int moetax_dist_init(int *argc, char ***argv);
/* rc 0: MPI_Finalize; else MPI_Abort(rc), so no rank waits for one that quit. */
void moetax_dist_finalize(int rc);
/* The world, or NULL when not under mpirun (or P = 1 ... still the world: P may be 1). */
struct moetax_dist *moetax_dist_world(void);
/* --placement FILE (before the load): the map of experts to ranks, read by every rank. FORMAT:
 * one line per MoE layer, `LAYER: R0 R1 ... R(E-1)` (the rank of each expert, E of them), or
 * `*: ...` for every layer without a line of its own; `#` starts a comment. Checked at the load:
 * every MoE layer placed, each expert exactly once (E ranks per line), every rank < N. */
void moetax_dist_set_placement(const char *path);
/* `moetax inspect --ranks N` (outside mpirun, no MPI call): the placement of N ranks as a run
 * would make it (contiguous, or the --placement file; with moetax_dist_set_replicas' settings
 * the replicas' first plan: a profile's (--ep-load), else none yet but every expert mappable
 * everywhere, avail). Free with moetax_dist_plan_free. */
moetax_status moetax_dist_plan_offline(const struct moetax_model *m, int n_ranks, const char *placement,
                                       struct moetax_dist **out);
void moetax_dist_plan_free(struct moetax_dist *d);
/* Routed experts [*lo, *hi) of `rank` among E (the default placement). */
void moetax_dist_expert_range(const struct moetax_dist *d, int32_t E, int rank, int32_t *lo, int32_t *hi);
/* After a load (st its result): every rank's result and model header compared; this rank's
 * expert range set. On any failure every rank returns an error naming the rank (*m freed). */
moetax_status moetax_dist_model_loaded(moetax_status st, struct moetax_model **m);
/* Rank 0's batch to every rank (*n, the arrays: replaced by rank 0's on the others). */
moetax_status moetax_dist_sync_batch(struct moetax_dist *d, int64_t *n, const int32_t **token, const int32_t **pos,
                                     const int32_t **seq, const bool **want);
/* A barrier before layer il's combine, booked to `wait` (time this rank waits for the slowest):
 * one empty message to and from every other rank, polled (MPI_Test) until MOETAX_MPI_TIMEOUT
 * seconds (default 60; 0: no limit); past it, an error naming the layer and the ranks that did
 * not arrive (the command then ends with MPI_Abort: no rank is left hanging). Test hook:
 * MOETAX_MPI_TEST_STALL=R:S makes rank R sleep S seconds once, before its first barrier. */
moetax_status moetax_dist_barrier(struct moetax_dist *d, int il);
/* Allgatherv of rows [slot_lo[r], slot_lo[r + 1]) of y [*, ld] from each rank r, in place. */
moetax_status moetax_dist_gather_rows(struct moetax_dist *d, float *y, int64_t ld, const int64_t *slot_lo);
/* Book bytes sent / received to layer il (ignored outside [0, n_layer_b)) by an exchange of
 * [t0, t1] (moetax_ledger_now); kept as a record too when the records are on. */
void moetax_dist_book_layer(struct moetax_dist *d, int il, uint64_t t0, uint64_t t1, uint64_t sent, uint64_t recv);
/* One exchange (MPI_Alltoall[v] records, a gather, a combine's Allgatherv or Allreduce) of one
 * layer: [t0, t1] in the ledger's clock, this rank's bytes. */
struct moetax_dist_xrec {
    uint64_t t0, t1, sent, recv;
    int32_t layer;
};
/* Keep the last cap exchanges as records from now on (for --trace); 0 stops. */
moetax_status moetax_dist_keep_exchanges(struct moetax_dist *d, int64_t cap);
/* The kept records: without out, how many (at most xrec_cap); with out, the newest min(that, cap)
 * copied there oldest first, and how many were copied. *dropped: how many older ones the ring
 * has overwritten. Call it when no exchange runs. */
int64_t moetax_dist_exchanges(const struct moetax_dist *d, struct moetax_dist_xrec *out, int64_t cap,
                              uint64_t *dropped);
/* In-place MPI_Allreduce(SUM) of x [n]. */
moetax_status moetax_dist_allreduce(struct moetax_dist *d, float *x, int64_t n);
/* Every rank's *v becomes the smallest of all ranks' (st: this rank's result so far; a rank's
 * error is returned as is, and the others get one naming it). */
moetax_status moetax_dist_agree_min(moetax_status st, int *v);
/* The default dispatch when none was chosen (no --ep-dispatch / --ep-overlap, no MOETAX_MPI_DISPATCH /
 * MOETAX_MPI_OVERLAP), from the command's batch: token-sharded (alltoall) for n_seq >= MOETAX_DIST_A2A_MIN_SEQ
 * sequences decoded together, else replicated (exact). Measured (small Q8_0, np 2, 1 thread per rank,
 * batch decode, alternating pairs, this 2-core machine at load 2-12 from other jobs): alltoall /
 * replicated tokens/s, paired medians B 8 0.77 (8 pairs), B 16 0.90 (15), B 32 0.96 (13), B 64 1.12
 * (19, 13 of them above 1), B 128 1.41 (8 of 8); a quiet machine, an earlier session: B 64 1.44. */
enum { MOETAX_DIST_A2A_MIN_SEQ = 64 };
void moetax_dist_default_dispatch(int64_t n_seq);
/* --ep-dispatch MODE (alltoall | replicated) and --ep-overlap, after init; 0 or an error printed. */
int moetax_dist_set_dispatch(const char *mode, bool overlap);
/* The test hook MOETAX_MPI_TEST_STALL=R:S: rank R sleeps S seconds, once. */
void moetax_dist_test_stall(const struct moetax_dist *d);
/* After a timeout: the ranks not heard from, as text ("1, 3"). */
void moetax_dist_late_ranks(const struct moetax_dist *d, char *out, size_t cap);

/* One all-to-all exchange of bytes: this rank sends scount[r] bytes at sbuf + sdispl[r] to
 * each rank r (the own rank's count is ignored: records for the rank itself never go through
 * MPI) and receives rcount[r] bytes at rbuf + rdispl[r] (at most rcap bytes from rbuf).
 * expect NULL: the counts come from the senders, rdispl is set (packed in rank order); else
 * the counts that must arrive (the return trip) and rdispl is the caller's. Times and bytes
 * of the exchange itself. */
struct moetax_dist_a2a {
    int *scount, *sdispl, *rcount, *rdispl, *expect; /* [P] */
    const void *sbuf;
    void *rbuf;
    int64_t rcap;
    int layer;
    const char *what;
    void *req;                    /* MPI_Request [2 P] (moetax_dist_a2a_requests; the caller frees it) */
    void (*on_counts)(void *arg); /* optional: called once the counts are in (inline exchanges) */
    void *arg;
    /* results */
    moetax_status st;
    char why[256]; /* st's message, from the thread that ran the exchange (messages are per thread) */
    _Atomic int state; /* 0 posted, 1 counts exchanged (every rank is here), 2 done */
    uint64_t ns_wait, ns_comm, bytes_sent, bytes_recv;
    uint64_t t_begin; /* when its counts began (moetax_ledger_now) */
};
/* Room for an exchange's requests (free()), NULL without memory. */
void *moetax_dist_a2a_requests(const struct moetax_dist *d);
/* On the calling thread. */
moetax_status moetax_dist_a2a(struct moetax_dist *d, struct moetax_dist_a2a *x);
/* To the communication thread (started at the first post; exchanges run in posting order; it
 * polls with naps of MOETAX_MPI_NAP_US microseconds, default 20, 0: sched_yield only);
 * the caller polls moetax_dist_a2a_state until 2, then calls moetax_dist_a2a_done. The
 * caller makes no MPI call while an exchange is in flight (MPI_THREAD_SERIALIZED). */
moetax_status moetax_dist_a2a_post(struct moetax_dist *d, struct moetax_dist_a2a *x);
int moetax_dist_a2a_state(const struct moetax_dist_a2a *x);
moetax_status moetax_dist_a2a_done(struct moetax_dist *d, struct moetax_dist_a2a *x);
/* Ends the communication thread (at finalize). */
void moetax_dist_a2a_stop(void);
/* Every rank's bytes[r] bytes to all, packed in rank order into all (mine: this rank's);
 * MPI_Iallgatherv polled until MOETAX_MPI_TIMEOUT (then an error naming layer il, `what` and
 * the late ranks); its time is booked as wait (it ends when the last rank has arrived). */
moetax_status moetax_dist_allgather(struct moetax_dist *d, const void *mine, void *all, const int *bytes, int il,
                                    const char *what);
/* Allgatherv of rows of `width` floats: rank r contributes n_rows[r] rows (mine at
 * all + first[rank] * width is sent), every rank gets all of them in rank order. */
moetax_status moetax_dist_gather_logits(struct moetax_dist *d, float *all, const int *n_rows, int64_t width);

/* Replication (src/dist/eplb.c). --ep-replicas R, --ep-replan K, --ep-load PROFILE (any NULL:
 * not given; then MOETAX_MPI_REPLICAS / MOETAX_MPI_REPLAN): 0, or an error printed. */
int moetax_dist_set_replicas(const char *replicas, const char *replan, const char *load);
/* At the placement: the settings, the first plan (from the profile), and the experts this rank
 * maps beyond its own added to own [n_layer, E]. */
moetax_status moetax_dist_replicas_init(struct moetax_dist *d, const struct moetax_model *m, uint8_t *own);
/* Worker 0 at the start of each step: counts the steps (every micro-batch plans its own hosts). */
void moetax_dist_step(struct moetax_dist *d);
void moetax_dist_replan(struct moetax_dist *d);
/* Token-sharded dispatch, worker 0, before the split: layer il's hosts for this micro-batch from
 * its global counts [E] (every rank has them from the layer's gather, so every rank plans the
 * same) and each rank's own share of them, local [P, E] (ties go to the rank that keeps them). */
void moetax_dist_plan_now(struct moetax_dist *d, int il, const int32_t *count, const int32_t *local);
/* Replicated dispatch, any worker, each into its own arrays (a token's workers plan without a
 * barrier): layer il's hosts for this micro-batch from its counts [E] (every rank routed every
 * token, so every rank and worker plans the same), nh [E] and hosts [E, H], and its split, part
 * [E, H]. D's own arrays are not touched (worker 0 copies its plan there in account_in). */
void moetax_dist_plan_micro(const struct moetax_dist *d, int il, const int32_t *count, int32_t *nh, int32_t *hosts,
                            int32_t *part);
/* A micro-batch's split of layer il: count [E] slots per expert -> part [E, H] slots per host
 * (_in: over the layer's hosts nh [E], hosts [E, H] given; else D's). */
void moetax_dist_split(const struct moetax_dist *d, int il, const int32_t *count, int32_t *part);
void moetax_dist_split_in(const struct moetax_dist *d, const int32_t *nh, const int32_t *hosts, const int32_t *count,
                          int32_t *part);
/* Rank r's slots of expert e: [*lo, *lo + *cnt) within the expert's (0 if r is no host), over the
 * layer's hosts nh [E], hosts [E, H] that the split used. */
void moetax_dist_host_range_in(const struct moetax_dist *d, const int32_t *nh, const int32_t *hosts, int e,
                               const int32_t *part, int r, int32_t *lo, int32_t *cnt);
/* Worker 0, once per (micro-batch, MoE layer): the loads and the work counts (_in: of a plan in
 * the given arrays, which then become layer il's latest in D, for the exit summary). */
void moetax_dist_account(struct moetax_dist *d, int il, const int32_t *count, const int32_t *part);
void moetax_dist_account_in(struct moetax_dist *d, int il, const int32_t *nh, const int32_t *hosts,
                            const int32_t *count, const int32_t *part);
/* Token-sharded dispatch with replicas: expert e of layer il has c[r] assignments from each
 * rank r's tokens and the split gave its hosts part [H] slots (moetax_dist_split of the global
 * counts): how many of rank `me`'s go to each host, flow [H] (host order). Each host keeps its
 * own first (no transfer), up to its part; the rest, ranks in order, fill the hosts' room in
 * host order. Every rank computes the same flows from the same counts. */
void moetax_dist_flows(const struct moetax_dist *d, int il, int e, const int32_t *c, const int32_t *part, int me,
                       int32_t *flow);
void moetax_dist_replicas_summary(const struct moetax_dist *d);
void moetax_dist_replicas_free(struct moetax_dist *d);

/* 0 on rank 0 (or without a world), else the rank. */
int moetax_dist_rank(void);

#endif
