/* run_parallel.h - `moetax run --parallel N`: many prompts decoded together. */
#ifndef MOETAX_TOOLS_RUN_PARALLEL_H
#define MOETAX_TOOLS_RUN_PARALLEL_H

#include <stdbool.h>
#include <stdint.h>

#include "moetax/sampler.h"
#include "moetax/status.h"

struct cli_ledger_opts;

struct run_parallel_opts {
    const char *model, *prompts_path;
    int parallel;                  /* sequences decoded at once */
    int64_t n_predict, n_threads, n_ctx;
    int experts_used;
    bool no_mmap, ignore_eos, echo, json;
    bool check_finite, adapt_threads; /* --check-finite, --adapt-threads (moetax_ctx_params) */
    enum moetax_type expert_type;  /* --expert-type (moetax_model_params) */
    struct moetax_sampler_params sampler;
    const struct cli_ledger_opts *lo;
    enum moetax_type kv_type;
};

/* prompts_text: the file's text, one prompt per line (split in place). */
moetax_status run_parallel(const struct run_parallel_opts *o, char *prompts_text);

#endif
