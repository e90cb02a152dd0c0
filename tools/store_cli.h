/* store_cli.h - the expert store in the CLI: --expert-budget, --policy,
 * --no-prefetch, --buffered-io, and the statistics printed after run/bench. */
#ifndef MOETAX_TOOLS_STORE_CLI_H
#define MOETAX_TOOLS_STORE_CLI_H

#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>

#include "moetax/model.h"
#include "moetax/store.h"

struct cli_store_opts {
    const char *budgets;   /* --expert-budget: "2G", "50%", or a list "100%,50%" (bench) */
    enum moetax_store_policy policy; /* --policy, when policy_set; else cli_store_policy's default */
    bool policy_set;
    int n_expert_used;     /* the context's top-k (--experts-used); 0: the model's */
    bool no_prefetch;
    int read_ahead;        /* --read-ahead: layers ahead, MOETAX_STORE_READ_AHEAD_OFF; 0: the store's default */
    double read_ahead_min; /* --read-ahead-min; 0: the store's default */
    bool buffered;
    int io_threads;
    enum moetax_store_io_engine io_engine; /* --io-engine; 0: the store's default */
    int64_t read_log_cap;  /* reads kept for the trace's I/O tracks (set with --trace); 0: none */
    const char *warm;      /* --warm PROFILE: fill the store from a routing profile and take it as the prior */
    const char *predictor; /* --predictor FILE: a learned predictor (moetax profile --fit-predictor) drives
                              the prefetch; both it and the router guess are scored */
    const char *given;     /* the first store option on the command line other than --expert-budget (as
                              given, =VALUE included), for cli_store_check; NULL: none */
};

bool cli_store_opt(int argc, char **argv, int *i, struct cli_store_opts *o, bool *err);
const char *cli_store_help(void);
/* The eviction policy: --policy, or the default (next-use: the best hit rate in every deterministic
 * case measured, issue 6's notes). */
enum moetax_store_policy cli_store_policy(const struct cli_store_opts *o);
/* Total bytes of the routed experts of a model, as in the file (a store's slots are larger: see
 * moetax_model_store_bytes_all). */
uint64_t cli_store_expert_bytes(const struct moetax_model *m);
/* Check the syntax and range of --expert-budget before any work: one budget, or a
 * comma-separated list when list is true. MOETAX_ERR_ARG names the item and why. */
moetax_status cli_store_check_budgets(const char *budgets, bool list);
/* cli_store_check_budgets on o->budgets, and a store option given without a budget (o->given: --warm,
 * --predictor, --policy, ...; set only from the command line, not from --config) is MOETAX_ERR_ARG
 * naming it: without a store it would do nothing. */
moetax_status cli_store_check(const struct cli_store_opts *o, bool list);
/* Parse one budget ("2G", "512M", "50%"); a percentage is of `all`, the budget that holds every expert
 * (moetax_model_store_bytes_all), so 100% does; false if invalid. */
bool cli_store_parse_budget(const char *s, uint64_t all, uint64_t *out);
/* Open the store for a budget; *n_ubatch is fitted to it. */
moetax_status cli_store_open(const struct moetax_model *m, const struct cli_store_opts *o, uint64_t budget,
                             int *n_ubatch, struct moetax_store **out);
/* --warm PROFILE on an open store (cli_store_open does it when o->warm is set). */
moetax_status cli_store_warm(const struct moetax_model *m, struct moetax_store *s, const char *path);
/* --predictor FILE: load it, check it against the model and attach it to the store (owned by it). */
moetax_status cli_store_predictor(const struct moetax_model *m, struct moetax_store *s, const char *path);
/* The predictors' scores side by side (router guess, learned), per distance and per target layer;
 * nothing when the store has no predictor. */
struct moetax_predictor;
void cli_predictor_summary(FILE *f, const struct moetax_predictor *p, const struct moetax_model *m);
/* Per-token recall (= precision: k experts predicted) of the store's predictor of `kind` (0: the router
 * guess, 1: the learned one) one layer ahead so far; NAN without a predictor or scores. */
double cli_predictor_recall(const struct moetax_store *s, int kind);
/* One-paragraph summary (hit rate, prefetch precision, bytes, GB/s; with tokens > 0 also MiB read and
 * stall ms per token). */
void cli_store_summary(FILE *f, const struct moetax_store *s, int64_t tokens);
/* Reset the process's peak RSS (VmHWM) to its RSS now (Linux: "5" into /proc/self/clear_refs);
 * false if refused (then the peak is since the process began). */
bool cli_peak_rss_reset(void);
/* Peak RSS since the last reset, bytes (VmHWM in /proc/self/status); 0 if unknown. */
uint64_t cli_peak_rss_bytes(void);
/* Process memory besides the weights, slots and KV cache that the expert store's RSS bound
 * allows: code, libraries, heap, the context's buffers, the store's tables and access trace. */
#define CLI_RSS_OVERHEAD_BYTES ((uint64_t)64 << 20)
/* Resident set size of this process now, in bytes (from /proc/self/statm). */
uint64_t cli_rss_bytes(void);

#endif
