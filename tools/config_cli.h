/* config_cli.h - `--config FILE`: a configuration `moetax tune` wrote (or a person
 * wrote) that run, bench, perplexity and serve take as their defaults; options on the
 * command line still win.
 *
 * File (JSON): {"moetax_config": 1, "threads": int, "experts_used": int,
 *   "capacity_factor": number (0: off), "overflow": "drop"|"reroute", "no_mmap": bool,
 *   "cache_type": "f32"|"f16"|"q8_0", "expert_budget": str|null, "policy": str|null,
 *   "no_prefetch": bool, "expert_type": "q8_0"|"q4_0"|...|null,
 *   "mla_prefill": "absorbed"|"auto"|"decompressed", ...} - every key optional;
 *   unknown keys are ignored (tune writes its measurements beside them).
 *
 * `--expert-type TYPE` (routed experts re-quantized in memory at load, the rest as stored:
 * moetax_model_params.expert_type) is read here too, from anywhere in argv like --config,
 * and wins over the file's key; cli_config_opt skips it in the tools' own option loops. */
#ifndef MOETAX_TOOLS_CONFIG_CLI_H
#define MOETAX_TOOLS_CONFIG_CLI_H

#include <stdbool.h>
#include <stdint.h>

#include "moetax/model.h"
#include "moetax/status.h"

struct cli_config {
    bool loaded;
    int64_t threads;         /* 0: not set */
    int experts_used;        /* 0: not set */
    double capacity_factor;  /* 0: off / not set */
    enum moetax_overflow overflow;
    bool no_mmap, no_prefetch;
    enum moetax_type cache_type;
    enum moetax_attn_prefill mla_prefill; /* --mla-prefill (0: absorbed) */
    char expert_budget[64];  /* "" : none */
    char policy[16];         /* "" : not set */
    enum moetax_type expert_type; /* MOETAX_EXPERT_TYPE_AS_STORED: not set (file or --expert-type) */
};

/* Find `--config FILE` in argv (anywhere) and read it into *c; MOETAX_OK with
 * c->loaded false when there is none; then `--expert-type TYPE` (anywhere) over
 * c->expert_type. Errors name the file and the key, or the option. */
moetax_status cli_config_scan(int argc, char **argv, struct cli_config *c);
moetax_status cli_config_load(const char *path, struct cli_config *c);
/* Write a config (the same keys) as one JSON object with `extra` (a JSON object
 * or NULL, its reference taken) merged in. */
moetax_status cli_config_write(const char *path, const struct cli_config *c, void *extra_json);
struct cli_store_opts;
/* The store's part of a config (budget, policy, prefetch) as defaults of o. */
void cli_config_store(const struct cli_config *c, struct cli_store_opts *o);
/* true if argv[*i] is --config or --expert-type (its value is skipped: cli_config_scan read it). */
bool cli_config_opt(int argc, char **argv, int *i, bool *err);
#define CLI_CONFIG_HELP \
    "  --config FILE        defaults from a configuration (moetax tune -o FILE); options given here win\n" \
    "  --expert-type TYPE   routed experts re-quantized in memory at load (q8_0, q4_0; also f16, bf16,\n" \
    "                       q2_k..q6_k), the rest as stored (where a command has --expert-budget: one or\n" \
    "                       the other)\n"
/* TYPE of --expert-type or of the "expert_type" key: a target routed experts can take */
bool cli_expert_type_parse(const char *s, enum moetax_type *out);

#endif
