/*
 * moetax/report.h - `moetax report`: the analysis of a run's ledger (or Chrome
 * trace): where the time went, how big the synchronization tax is, and whether
 * the routing makes caching and prefetching experts worthwhile.
 *
 * DESIGN
 *   moetax_report_load() reads one JSON file, written by `moetax run/bench
 *   --ledger` (detected by its "moetax_ledger" key, format in moetax/ledger.h)
 *   or `--trace` (detected by "traceEvents"), validates it completely and
 *   folds it into a struct moetax_report of plain numbers. Everything after the
 *   load is a pure function of that struct: the text and JSON views (tools/
 *   cmd_report.c) and the HTML page (moetax_report_write_html). Nothing here
 *   trusts the file: every key, type, array length, phase name and expert id
 *   is checked, and a bad file gives MOETAX_ERR_FORMAT with a message that
 *   names the file and the field ("steps[3].layer_phase_s[2]: expected 14
 *   numbers").
 *
 *   Seconds are averaged over workers as in the ledger: a phase's seconds are
 *   the sum of its workers' seconds divided by the number of workers, so the
 *   phases of a step add up to the step's wall time. From a trace the same
 *   numbers are rebuilt from the "X" spans (name = phase, tid = worker,
 *   args.layer, args.step, args.tokens); a trace step with more than one
 *   token counts as prefill (the trace has no step kind), the trace's ring may
 *   have dropped the oldest spans (reported), and time added outside the pool
 *   (sampling) is not in a trace.
 *
 * ROUTING STATISTICS (from the ledger's "routing" section)
 *   per MoE layer, over the recorded tokens (k = experts per token, E experts):
 *   - load: tokens routed to each expert; min / mean / max, coefficient of
 *     variation (population std / mean), the hottest experts, and the share of
 *     routings that go to the busiest quarter of the experts (the hit rate of an
 *     oracle cache holding E/4 experts; uniform routing gives 25%);
 *   - batch imbalance: for every step with two or more tokens (prefill, or a
 *     batch), max over experts of tokens routed / (n_tokens * k / E); reported
 *     as the mean over those steps (and over layers);
 *   - overlap: |S_t ∩ S_t+1| / k between the expert sets of adjacent tokens,
 *     the hit rate of a cache holding the previous token's experts; random
 *     routing gives k / E;
 *   - prediction: where a layer has "predicted" sets (its router applied to the
 *     previous layer's residual), precision |P ∩ A| / |P| and recall
 *     |P ∩ A| / |A| at k, averaged over tokens (equal when |P| = |A| = k).
 *
 * INVARIANTS
 *   - all seconds are finite and >= 0; phase arrays are indexed by enum
 *     moetax_phase whatever the order of the file's "phases" list;
 *   - layer_phase_s is [n_layer * MOETAX_PHASE_COUNT], other_phase_s holds the
 *     work outside the layers (layer -1);
 *   - a statistic that cannot be computed (no data) is NAN, never 0.
 */
#ifndef MOETAX_REPORT_H
#define MOETAX_REPORT_H

#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>

#include "moetax/ledger.h"
#include "moetax/status.h"

#ifdef __cplusplus
extern "C" {
#endif

enum moetax_report_source {
    MOETAX_REPORT_SOURCE_LEDGER = 0,
    MOETAX_REPORT_SOURCE_TRACE,
};

/* A group of steps (all, prefill or decode). */
struct moetax_report_agg {
    int64_t steps, tokens;
    double wall_s;
    double phase_s[MOETAX_PHASE_COUNT];       /* summed over layers and the outside row */
    double other_phase_s[MOETAX_PHASE_COUNT]; /* layer -1 */
    double *layer_phase_s;                    /* [n_layer * MOETAX_PHASE_COUNT] */
    double *worker_busy_s, *worker_wait_s;    /* [n_workers] (not averaged) */
};

/* One trace span of the timeline step, relative to the step's first span. */
struct moetax_report_span {
    int worker, layer;
    enum moetax_phase phase;
    double t0_us, dur_us;
};

/* The step drawn as a timeline: the slowest decode step (or the slowest step). */
struct moetax_report_timeline {
    bool valid;
    int64_t step, tokens;
    bool prefill;
    double wall_s;
    double other_phase_s[MOETAX_PHASE_COUNT];
    double *layer_phase_s;               /* [n_layer * MOETAX_PHASE_COUNT] */
    struct moetax_report_span *spans;    /* trace only; NULL for a ledger */
    int64_t n_spans;
};

#define MOETAX_REPORT_N_HOT 3

struct moetax_report_routing_layer {
    int layer;
    int64_t tokens;                      /* tokens with an expert set at this layer */
    int64_t *load;                       /* [n_expert] tokens routed to each expert */
    double load_min, load_mean, load_max, load_cv;
    double top_quarter_share;            /* routings to the busiest ceil(E/4) experts / all routings */
    int hot[MOETAX_REPORT_N_HOT];        /* hottest experts (-1: none) */
    int64_t hot_n[MOETAX_REPORT_N_HOT];
    int64_t n_batches;                   /* steps with >= 2 tokens */
    double batch_imbalance;              /* mean over those steps of max / (n k / E); NAN if none */
    int64_t n_pairs;                     /* adjacent token pairs */
    double overlap;                      /* mean |S_t ∩ S_t+1| / k; NAN if no pair */
    int64_t n_pred;                      /* tokens with a predicted set */
    double precision, recall;            /* NAN if no predicted set */
};

struct moetax_report_routing {
    int n_expert, k;
    int64_t tokens, first_token;
    int n_layers;
    struct moetax_report_routing_layer *layers; /* [n_layers], in file order */
    /* means over layers (of the layers that have the statistic; NAN if none) */
    double load_cv, top_quarter_share, batch_imbalance, overlap, precision, recall;
    /* the CV that uniform random routing of `tokens` tokens would show from sampling noise alone:
     * sqrt((1 - k/E) / (tokens k / E)); a measured CV near it says nothing about skew */
    double load_cv_chance;
};

/* Expert store statistics of the run (ledger "store" section). */
struct moetax_report_store {
    int n_slots;
    double slot_bytes, budget_bytes, bytes_read, read_gbps, stall_s;
    double acquires, hits, loads, reads, predicted_issued, predicted_used, prefetch_wasted, prefetch_dropped;
    int64_t tokens;
    bool direct_io;
};

/* The expert store's reads on the timeline (a trace's I/O tracks, "cat": "io"), over the
 * steps' wall time (reads outside the steps' spans are not counted in busy_s). */
struct moetax_report_io {
    int64_t reads[3];    /* demand, known, predicted (by span name) */
    double bytes;        /* args.bytes summed */
    double busy_s;       /* time in steps with at least one read in flight */
    double inflight_s;   /* sum of the reads' time in steps: / busy_s = mean reads in flight when busy */
    double median_read_ms;
    double stall_s;      /* the steps' `load` time, averaged over workers */
    double wall_s;       /* the steps' wall time */
};

/* Decode steps of one batch size (sequences decoded together; a ledger's
 * steps[].batch, 1 when absent): the batch tax against batch size. */
struct moetax_report_batch {
    int64_t batch;
    int64_t steps, tokens;
    double wall_s, phase_s, wait_s, tax_s; /* wall time; phases (averaged over workers); of them wait, tax */
    /* MoE layer passes (steps[].moe): distinct experts read, assignments, dropped and rerouted
     * by a capacity factor, expert bytes read, and the sum of their imbalance (most
     * assignments on one expert / mean per used expert) */
    int64_t moe_layers, experts, assignments, dropped, rerouted;
    double expert_bytes, imbalance_sum;
};

/* A ledger merged under mpirun (its "ranks" array, tools/ledger_cli.c): each rank's ledger
 * analysed alone, and the transfer counters the rank printed at exit. */
struct moetax_report_rank {
    int rank;
    struct moetax_report *r;             /* that rank's own report (no ranks of its own) */
    bool has_dist;
    double bytes_sent, bytes_recv, collectives, comm_s, wait_s;
    double *layer_sent, *layer_recv;     /* [n_layer] bytes per layer, the whole run (NULL: not in the file) */
};

/* Per MoE layer across the ranks: the rank that worked longest (phases other than comm and
 * wait, in the breakdown's steps), against the mean over ranks. The others wait for it. */
struct moetax_report_rank_layer {
    int layer, slowest;
    double busy_max_s, busy_mean_s, comm_wait_mean_s;
    /* bytes of the whole run (every rank's ledger has them: has_bytes): all ranks' sent, the
     * rank that sent most and its bytes sent and received */
    bool has_bytes;
    double bytes_sent, bytes_max_sent, bytes_max_recv;
    int bytes_max_rank;
};

struct moetax_report {
    enum moetax_report_source source;
    char path[512];
    char model[256];
    int n_workers, n_layer, n_expert, n_expert_used;
    bool *moe_layer;                     /* [n_layer] */
    bool decode_only;                    /* the breakdowns below use `decode` instead of `all` */
    struct moetax_report_agg all, prefill, decode;
    double span_ns;                      /* ledger overhead per span (0 if unknown) */
    int64_t dropped_steps;               /* ledger: step records not in "steps" */
    int64_t dropped_spans;               /* trace: spans lost from the ring */
    struct moetax_report_timeline timeline;
    struct moetax_report_routing *routing; /* NULL when the file has none */
    struct moetax_report_store *store;     /* NULL when the run had no expert store */
    struct moetax_report_io *io;           /* trace only; NULL when it has no I/O tracks */
    struct moetax_report_batch *batches;   /* [n_batches] decode steps by batch size, ascending (ledger) */
    int n_batches;
    struct moetax_report_rank *ranks;      /* [n_ranks] a ledger of `mpirun -np N` (else NULL, 0) */
    int n_ranks;
    struct moetax_report_rank_layer *rank_layers; /* [n_rank_layers] MoE layers, with ranks */
    int n_rank_layers;
};

struct moetax_report_params {
    bool decode_only; /* breakdowns (phases, layers, workers) over decode steps only */
};

/* Read and analyse a ledger or trace JSON file. */
moetax_status moetax_report_load(const char *path, const struct moetax_report_params *p, struct moetax_report **out);
/* The same from text in memory; `name` is used in messages. */
moetax_status moetax_report_parse(const char *text, size_t len, const char *name, const struct moetax_report_params *p,
                                  struct moetax_report **out);
/* The same from a parsed JSON document (a Jansson json_t), which is only read: for a caller that has
 * parsed the file already to tell a ledger from another kind (`report` of a routing profile). */
struct json_t;
moetax_status moetax_report_from_json(const struct json_t *doc, const char *name, const struct moetax_report_params *p,
                                      struct moetax_report **out);
void moetax_report_free(struct moetax_report *r);

/* The group the breakdowns use: decode if decode_only, else all. */
const struct moetax_report_agg *moetax_report_sel(const struct moetax_report *r);
/* tax phases / all phases of a group (0 if empty); efficiency = 100 (1 - share). */
double moetax_report_tax_share(const struct moetax_report_agg *a);
double moetax_report_efficiency(const struct moetax_report_agg *a);
/* Sum of phase seconds of a group (the time the ledger accounts for). */
double moetax_report_phase_total(const struct moetax_report_agg *a);

/* The self-contained HTML page (inline CSS and SVG, no scripts). */
moetax_status moetax_report_write_html(const struct moetax_report *r, FILE *f);
/* s as HTML text (& < > " ' escaped, control bytes but newline and tab, and DEL, as '?'): for pages that
 * show names from a file. */
void moetax_report_html_text(FILE *f, const char *s);

#ifdef __cplusplus
}
#endif
#endif
