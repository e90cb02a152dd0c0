/* ledger_cli.h - the ledger in the CLI: creation for a model/context, the
 * summary printed after run/bench, and the --ledger/--trace/--metrics outputs. */
#ifndef MOETAX_TOOLS_LEDGER_CLI_H
#define MOETAX_TOOLS_LEDGER_CLI_H

#include <stdbool.h>
#include <stdio.h>

#include "moetax/ledger.h"
#include "moetax/model.h"

struct cli_ledger_opts {
    const char *json_path;   /* --ledger FILE */
    const char *trace_path;  /* --trace FILE */
    bool metrics;            /* --metrics: Prometheus text on stdout */
    bool routing;            /* --routing-stats: keep routing records (adds a router pass per layer) */
    int n_expert_used;       /* the context's top-k (--experts-used); 0: the model's */
};

/* Parse one ledger option at argv[*i]; true if consumed (*err on a missing value). */
bool cli_ledger_opt(int argc, char **argv, int *i, struct cli_ledger_opts *o, bool *err);
const char *cli_ledger_help(void);

moetax_status cli_ledger_new(const struct moetax_model *m, int threads, const struct cli_ledger_opts *o,
                             struct moetax_ledger **out);
/* Per-token phase table of the decode steps (or all steps) and the tax share. */
void cli_ledger_summary(FILE *f, const struct moetax_ledger *l, bool decode_only);
/* Write what the options ask for. */
struct moetax_store;
moetax_status cli_ledger_outputs(const struct moetax_ledger *l, const struct moetax_model *m, const char *model_path,
                                 const struct cli_ledger_opts *o, const struct moetax_store *store, int64_t tokens);

#endif
