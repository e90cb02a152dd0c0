/*
 * moetax/ledger.h - the tax ledger: where every step's time goes, per phase,
 * per layer and per worker; the Chrome trace; routing records for the report.
 *
 * DESIGN
 *   Workers record spans: a phase, a layer (-1 for work outside the layers),
 *   a start and an end (CLOCK_MONOTONIC ns). Busy time of a phase is the span
 *   between a worker starting the phase's work and arriving at the barrier that
 *   ends it; the time from arriving to being released is `wait`, measured at
 *   every barrier from each worker's own timestamps (shared/docs/DESIGN.md).
 *   Each worker writes only its own accumulators (no atomics, no sharing); the
 *   step owner folds them into the step record after the pool run returns.
 *
 *   Per step the ledger keeps seconds[layer][phase] averaged over workers (so
 *   the phases of a step add up to its wall time), per-worker busy and wait,
 *   the token count and the wall time. A bounded window of step records (the
 *   last `window` steps) plus running totals keep memory constant on long runs;
 *   trace events go to a ring buffer of `trace_cap` spans (oldest dropped, the
 *   count of dropped spans is reported).
 *
 *   Routing records (experts and weights chosen per token and MoE layer, plus
 *   the experts predicted for layer l+1 by applying its router to layer l's
 *   residual) are kept for the last `routing_window` tokens when enabled.
 *
 * PHASES (tax ones first)
 *   route dispatch load comm wait combine | expert shared attn dense norm head embd sample
 *   tax share = sum(tax phases) / sum(all phases); efficiency = 100 (1 - tax share).
 *
 * FILE FORMAT (moetax_ledger_write_json; read by `moetax report`)
 *   {"moetax_ledger": 1, "model": str, "threads": int, "n_layer": int,
 *    "n_expert": int, "n_expert_used": int, "moe_layers": [int],
 *    "phases": [names...], "tax_phases": [names...],
 *    "overhead": {"span_ns": float},          measured cost of recording one span
 *    "steps": [{"step": int, "kind": "prefill"|"decode", "tokens": int, "pos": int,
 *               "batch": int (sequences in the step; a decode step has one token each),
 *               "wall_s": float, "phase_s": {name: s}, "layer_phase_s": [[s per phase] per layer],
 *               "other_phase_s": [s per phase] (layer -1),
 *               "worker_busy_s": [s], "worker_wait_s": [s],
 *               "moe": {"layers", "experts", "assignments", "expert_bytes", "imbalance_sum",
 *                       "dropped", "rerouted"} (when a MoE layer ran: struct moetax_ledger_moe_stats)}],
 *    "totals": {"steps": int, "tokens": int, "wall_s": float, "phase_s": {...},
 *               "layer_phase_s": [[...]], "worker_busy_s": [...], "worker_wait_s": [...], "moe": {...},
 *               "decode": {...same as totals, decode steps only}, "prefill": {...}},
 *    "routing": {"tokens": int, "layers": [{"layer": int, "step": [int per token],
 *                "experts": [[k ids] per token], "weights": [[k] per token],
 *                "predicted": [[k ids] per token] or null}]},
 *    "store": {...} (optional: budget_bytes, n_slots, slot_bytes, policy, direct_io, acquires, hits,
 *              loads, bytes_read, reads, read_gbps, stall_s, predicted_issued, predicted_used,
 *              prefetch_wasted, prefetch_dropped, tokens),
 *    "dropped_steps": int}
 */
#ifndef MOETAX_LEDGER_H
#define MOETAX_LEDGER_H

#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>

#include "moetax/status.h"

#ifdef __cplusplus
extern "C" {
#endif

enum moetax_phase {
    MOETAX_PHASE_ROUTE = 0,
    MOETAX_PHASE_DISPATCH,
    MOETAX_PHASE_LOAD,
    MOETAX_PHASE_COMM,
    MOETAX_PHASE_WAIT,
    MOETAX_PHASE_COMBINE,
    MOETAX_PHASE_EXPERT,
    MOETAX_PHASE_SHARED,
    MOETAX_PHASE_ATTN,
    MOETAX_PHASE_DENSE,
    MOETAX_PHASE_NORM,
    MOETAX_PHASE_HEAD,
    MOETAX_PHASE_EMBD,
    MOETAX_PHASE_SAMPLE,
    MOETAX_PHASE_COUNT,
};
#define MOETAX_PHASE_N_TAX 6 /* phases 0..5 are tax */

const char *moetax_phase_name(enum moetax_phase p);
bool moetax_phase_is_tax(enum moetax_phase p);

struct moetax_ledger_params {
    int n_workers;
    int n_layer;
    int window;          /* step records kept (default 4096) */
    int64_t trace_cap;   /* spans kept for the trace; 0: no trace */
    int routing_window;  /* tokens of routing kept; 0: none */
    int n_expert_used;   /* for routing records */
};

struct moetax_ledger;

moetax_status moetax_ledger_init(const struct moetax_ledger_params *p, struct moetax_ledger **out);
void moetax_ledger_free(struct moetax_ledger *l);
/* Turn recording on/off (off: moetax_ledger_span is a no-op; for overhead measurements). */
void moetax_ledger_enable(struct moetax_ledger *l, bool on);
bool moetax_ledger_enabled(const struct moetax_ledger *l);

uint64_t moetax_ledger_now(void); /* CLOCK_MONOTONIC ns */

/* Called by worker `w` only, during a step. */
void moetax_ledger_span(struct moetax_ledger *l, int w, enum moetax_phase ph, int layer, uint64_t t0, uint64_t t1);

/* Step boundaries, called outside the pool run by the step owner. */
void moetax_ledger_step_begin(struct moetax_ledger *l, int64_t tokens, int64_t pos, bool prefill);
void moetax_ledger_step_end(struct moetax_ledger *l);
/* The step begun last decodes n_seq sequences together (its batch size; 1 if never said). */
void moetax_ledger_step_batch(struct moetax_ledger *l, int64_t n_seq);

/* The batch tax of MoE layers: per layer pass, the distinct experts read, the
 * token-expert assignments, their imbalance and the assignments a capacity
 * factor dropped or moved. Sums over layer passes (divide by moe_layers for a
 * mean per layer; imbalance_sum / moe_layers is the mean imbalance). */
struct moetax_ledger_moe_stats {
    int64_t moe_layers;   /* MoE layer passes */
    int64_t experts;      /* distinct experts read, summed over layer passes */
    int64_t assignments;  /* token-expert assignments computed (after dropping) */
    int64_t dropped;      /* assignments a capacity factor dropped */
    int64_t rerouted;     /* assignments a capacity factor moved to another expert */
    double expert_bytes;  /* bytes of the experts read */
    double imbalance_sum; /* sum of (most assignments on one expert / mean per used expert) */
};
/* Worker 0, once layer `layer` of the current step is planned. */
void moetax_ledger_moe(struct moetax_ledger *l, int layer, int64_t experts, int64_t max_count, int64_t assignments,
                       double expert_bytes, int64_t dropped, int64_t rerouted);
void moetax_ledger_moe_totals(const struct moetax_ledger *l, bool decode_only, struct moetax_ledger_moe_stats *out);
/* Add time outside the pool run (e.g. sampling) to the last step. */
void moetax_ledger_add(struct moetax_ledger *l, enum moetax_phase ph, int layer, double seconds);

/* Routing: experts/weights of n tokens at one MoE layer; predicted may be NULL. */
bool moetax_ledger_routing_on(const struct moetax_ledger *l);
void moetax_ledger_routing(struct moetax_ledger *l, int layer, int64_t n, const int32_t *experts, const float *weights,
                           const int32_t *predicted);

/* Totals (seconds, averaged over workers) of all steps so far, or of decode steps only. */
void moetax_ledger_totals(const struct moetax_ledger *l, bool decode_only, double phase_s[MOETAX_PHASE_COUNT],
                          double *wall_s, int64_t *tokens, int64_t *steps);
double moetax_ledger_tax_share(const double phase_s[MOETAX_PHASE_COUNT]);

/* Measured cost of one span record (ns), for the overhead report. */
double moetax_ledger_span_cost_ns(struct moetax_ledger *l);

/* Output. `meta` fields are written as given. */
struct moetax_ledger_meta {
    const char *model;
    int n_expert, n_expert_used;
    const int *moe_layers;
    int n_moe_layers;
    const char *store_json; /* optional: a JSON object written as "store" (expert store statistics) */
};
moetax_status moetax_ledger_write_json(const struct moetax_ledger *l, const struct moetax_ledger_meta *meta,
                                       const char *path);
moetax_status moetax_ledger_write_trace(const struct moetax_ledger *l, const char *path);
/* Tracks beside the workers', e.g. the expert store's reads: spans of a second process
 * (pid 1, named `process`) on threads named track_names[track], and of a third (pid 2). Times are
 * CLOCK_MONOTONIC ns like the ledger's; args is written as the members of the span's
 * "args" object (e.g. "\"layer\": 3, \"expert\": 7"). other_json (optional) is written
 * into the trace's otherData as "store". Strings are written as given, unescaped: no
 * quotes, backslashes or control characters; none may be NULL. */
struct moetax_trace_span {
    uint64_t t0, t1;
    int32_t track;
    const char *name, *cat;
    char args[192];
};
struct moetax_trace_extra {
    const char *process;
    const char *const *track_names;
    int n_tracks;
    const struct moetax_trace_span *spans;
    int64_t n_spans;
    const char *other_json;
    /* optional: a third process (pid 2, named process2, one thread; e.g. an MPI rank's
     * exchanges) with these spans (their `track` is ignored) */
    const char *process2;
    const struct moetax_trace_span *spans2;
    int64_t n_spans2;
};
moetax_status moetax_ledger_write_trace_ex(const struct moetax_ledger *l, const char *path,
                                           const struct moetax_trace_extra *x);
/* Prometheus text exposition of the totals. */
void moetax_ledger_write_prometheus(const struct moetax_ledger *l, FILE *f);
void moetax_ledger_reset(struct moetax_ledger *l);

#ifdef __cplusplus
}
#endif
#endif
