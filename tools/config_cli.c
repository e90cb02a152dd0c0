/* config_cli.c - `--config FILE` (see config_cli.h). */
#include "config_cli.h"

#include <jansson.h>
#include <stdio.h>
#include <string.h>

#include "cli.h"
#include "store_cli.h"
#include "moetax/outfile.h"
#include "moetax/store.h"

static moetax_status bad(const char *path, const char *key, const char *what) {
    return moetax_error(MOETAX_ERR_FORMAT, "%s: \"%s\": %s", path, key, what);
}

moetax_status cli_config_load(const char *path, struct cli_config *c) {
    memset(c, 0, sizeof *c);
    /* a configuration is a few hundred bytes: read within a bound (a directory or /dev/zero is said as
     * such), and a key given twice is an error, not the last one winning */
    char *text = NULL;
    size_t len = 0;
    if (!strcmp(path, "-")) return moetax_error(MOETAX_ERR_ARG, "--config: a file, not '-' (standard input)");
    moetax_status rst = cli_read_file(path, (uint64_t)1 << 20, &text, &len);
    if (rst == MOETAX_ERR_LIMIT)
        return moetax_error(rst, "%s: more than 1 MiB: not a configuration (a file moetax tune -o wrote)", path);
    if (rst) { /* cannot read it, or a directory */
        char why[512];
        snprintf(why, sizeof why, "%s", moetax_last_error());
        return moetax_error(rst, "--config: %s", why);
    }
    json_error_t je;
    json_t *o = json_loadb(text, len, JSON_REJECT_DUPLICATES, &je);
    free(text);
    if (!o) return moetax_error(MOETAX_ERR_FORMAT, "%s: line %d: not a valid configuration (JSON): %s", path, je.line,
                                je.text);
    moetax_status st = MOETAX_OK;
    const json_t *v;
    if (!json_is_object(o) || json_integer_value(json_object_get(o, "moetax_config")) != 1)
        st = bad(path, "moetax_config", "expected 1 (a file moetax tune -o wrote)");
    if (!st && (v = json_object_get(o, "threads")) && !json_is_null(v)) {
        if (!json_is_integer(v) || json_integer_value(v) < 1 || json_integer_value(v) > 512)
            st = bad(path, "threads", "expected an integer in 1..512");
        else c->threads = json_integer_value(v);
    }
    if (!st && (v = json_object_get(o, "experts_used")) && !json_is_null(v)) {
        if (!json_is_integer(v) || json_integer_value(v) < 0 || json_integer_value(v) > 256)
            st = bad(path, "experts_used", "expected an integer in 0..256 (0: the model's)");
        else c->experts_used = (int)json_integer_value(v);
    }
    if (!st && (v = json_object_get(o, "capacity_factor")) && !json_is_null(v)) {
        double cf = json_number_value(v);
        if (!json_is_number(v) || cf < 0 || !cli_capacity_factor_ok(&cf))
            st = bad(path, "capacity_factor", "expected 0 (off) or a number >= 1e-45");
        else c->capacity_factor = cf;
    }
    if (!st && (v = json_object_get(o, "overflow")) && !json_is_null(v)) {
        const char *s = json_string_value(v);
        if (!s || (strcmp(s, "drop") && strcmp(s, "reroute"))) st = bad(path, "overflow", "expected \"drop\" or \"reroute\"");
        else c->overflow = strcmp(s, "drop") ? MOETAX_OVERFLOW_REROUTE : MOETAX_OVERFLOW_DROP;
    }
    if (!st && (v = json_object_get(o, "cache_type")) && !json_is_null(v)) {
        if (!cli_cache_type_parse(json_string_value(v), &c->cache_type))
            st = bad(path, "cache_type", "expected \"f32\", \"f16\" or \"q8_0\"");
    }
    if (!st && (v = json_object_get(o, "mla_prefill")) && !json_is_null(v)) {
        if (!cli_mla_prefill_parse(json_string_value(v), &c->mla_prefill)) st = bad(path, "mla_prefill", "expected \"absorbed\", \"auto\" or \"decompressed\"");
    }
    const char *flags[2] = {"no_mmap", "no_prefetch"};
    bool *dst[2] = {&c->no_mmap, &c->no_prefetch};
    for (int i = 0; !st && i < 2; i++)
        if ((v = json_object_get(o, flags[i])) && !json_is_null(v)) {
            if (!json_is_boolean(v)) st = bad(path, flags[i], "expected true or false");
            else *dst[i] = json_is_true(v);
        }
    if (!st && (v = json_object_get(o, "expert_budget")) && !json_is_null(v)) {
        const char *s = json_string_value(v);
        if (!s || strlen(s) >= sizeof c->expert_budget || cli_store_check_budgets(s, false))
            st = bad(path, "expert_budget", "expected a size (2G, 512M) or a percentage (25%)");
        else snprintf(c->expert_budget, sizeof c->expert_budget, "%s", s);
    }
    if (!st && (v = json_object_get(o, "expert_type")) && !json_is_null(v)) {
        if (!json_string_value(v) || !cli_expert_type_parse(json_string_value(v), &c->expert_type))
            st = bad(path, "expert_type", "expected q8_0, q4_0, q4_1, q5_0, q5_1, f16, bf16, q2_k..q6_k or null (as stored)");
    }
    if (!st && (v = json_object_get(o, "policy")) && !json_is_null(v)) {
        const char *s = json_string_value(v);
        enum moetax_store_policy pol;
        if (!s || !moetax_store_policy_parse(s, &pol)) st = bad(path, "policy", "expected lru, lfu, lfru or next-use");
        else snprintf(c->policy, sizeof c->policy, "%s", s);
    }
    json_decref(o);
    if (st) memset(c, 0, sizeof *c);
    else c->loaded = true;
    return st;
}

bool cli_expert_type_parse(const char *s, enum moetax_type *out) {
    enum moetax_type t;
    if (!moetax_type_from_name(s, &t)) return false;
    switch (t) {
    case MOETAX_TYPE_F16: case MOETAX_TYPE_BF16: case MOETAX_TYPE_Q8_0: case MOETAX_TYPE_Q4_0: case MOETAX_TYPE_Q5_0:
    case MOETAX_TYPE_Q4_1: case MOETAX_TYPE_Q5_1:
    case MOETAX_TYPE_Q2_K: case MOETAX_TYPE_Q3_K: case MOETAX_TYPE_Q4_K: case MOETAX_TYPE_Q5_K:
    case MOETAX_TYPE_Q6_K: *out = t; return true;
    default: return false;
    }
}

moetax_status cli_config_scan(int argc, char **argv, struct cli_config *c) {
    memset(c, 0, sizeof *c);
    moetax_status st = MOETAX_OK;
    for (int i = 1; i < argc && !st; i++)
        if (!strcmp(argv[i], "--config")) {
            if (i + 1 >= argc) return moetax_error(MOETAX_ERR_ARG, "--config needs a file");
            st = cli_config_load(argv[i + 1], c);
            break;
        }
    for (int i = 1; i < argc && !st; i++)
        if (!strcmp(argv[i], "--expert-type")) {
            if (i + 1 >= argc || !cli_expert_type_parse(argv[i + 1], &c->expert_type))
                st = moetax_error(MOETAX_ERR_ARG, "--expert-type: expected q8_0, q4_0, q4_1, q5_0, q5_1, f16, bf16, q2_k..q6_k%s%s",
                                  i + 1 < argc ? ", not " : "", i + 1 < argc ? argv[i + 1] : "");
        }
    return st;
}

void cli_config_store(const struct cli_config *c, struct cli_store_opts *o) {
    if (!c->loaded) return;
    if (c->expert_budget[0]) o->budgets = c->expert_budget;
    if (c->policy[0] && moetax_store_policy_parse(c->policy, &o->policy)) o->policy_set = true;
    if (c->no_prefetch) o->no_prefetch = true;
}

bool cli_config_opt(int argc, char **argv, int *i, bool *err) {
    const char *v = NULL;
    return cli_opt(argc, argv, i, NULL, "--config", &v, err) || cli_opt(argc, argv, i, NULL, "--expert-type", &v, err);
}

moetax_status cli_config_write(const char *path, const struct cli_config *c, void *extra_json) {
    json_t *o = json_object();
    json_object_set_new(o, "moetax_config", json_integer(1));
    json_object_set_new(o, "threads", c->threads ? json_integer(c->threads) : json_null());
    json_object_set_new(o, "experts_used", json_integer(c->experts_used));
    json_object_set_new(o, "capacity_factor", json_real(c->capacity_factor));
    json_object_set_new(o, "overflow", json_string(c->overflow == MOETAX_OVERFLOW_REROUTE ? "reroute" : "drop"));
    json_object_set_new(o, "no_mmap", json_boolean(c->no_mmap));
    json_object_set_new(o, "cache_type", json_string(moetax_type_name(c->cache_type)));
    json_object_set_new(o, "mla_prefill", json_string(cli_mla_prefill_name(c->mla_prefill)));
    json_object_set_new(o, "expert_budget", c->expert_budget[0] ? json_string(c->expert_budget) : json_null());
    json_object_set_new(o, "policy", c->policy[0] ? json_string(c->policy) : json_null());
    json_object_set_new(o, "no_prefetch", json_boolean(c->no_prefetch));
    json_object_set_new(o, "expert_type", c->expert_type != MOETAX_EXPERT_TYPE_AS_STORED
                                              ? json_string(moetax_type_name(c->expert_type)) : json_null());
    if (extra_json) json_object_update(o, (json_t *)extra_json), json_decref((json_t *)extra_json);
    moetax_status st = moetax_outfile_write_json(path, o, JSON_INDENT(1) | JSON_REAL_PRECISION(6), "the configuration");
    json_decref(o);
    return st;
}
