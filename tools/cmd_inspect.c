/* cmd_inspect.c - `moetax inspect FILE`: metadata, tensor table, totals and the
 * active bytes per decoded token (the denominator of every roofline figure). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "core/printable.h"
#include "commands.h"
#include "gguf/gguf_impl.h" /* moetax_gguf_hash: FNV-1a 64 */
#include "moetax/gguf.h"
#include "moetax/model.h"
#include "attn/gqa.h" /* gqa_kv_row: a KV cell's floats per layer */
#include "moetax/kvcache.h"
#ifdef MOETAX_WITH_MPI
#include "dist/dist.h"
#endif

/* each rank's runtime beyond weights and KV: step buffers, tokenizer, libc, MPI's shared memory */
#define INSPECT_RUNTIME_BYTES ((uint64_t)96 << 20)

static void usage(FILE *f) {
    fprintf(f, "usage: moetax inspect FILE [--json] [--checksums] [--no-tensors] [--all-metadata]\n"
               "       moetax inspect FILE --ranks N [--ctx N] [--kv-type f32|f16|q8_0] [--placement FILE]\n"
               "                      [--ep-replicas R [--ep-load PROFILE]] [--json]\n\n"
               "Shows a GGUF file: metadata, a tensor table (name, type, shape, bytes), totals, and the\n"
               "bytes of weights a decoded token reads: routed experts count k/E of their bytes (k experts\n"
               "used of E), token_embd one row, every other tensor whole.\n\n"
               "  --json          machine-readable: one JSON object\n"
               "  --checksums     add per tensor the FNV-1a 64 of its bytes and the sum and sum of squares\n"
               "                  of its values (dequantized; f32/f16/bf16/q8_0/q4_0/q4_k/q5_k/q6_k)\n"
               "  --no-tensors    omit the tensor table\n"
               "  --all-metadata  print long arrays in full (default: first 8 elements)\n"
               "  --ranks N       the memory of each rank of `mpirun -np N moetax ...` (expert parallelism):\n"
               "                  replicated weights (every tensor but the routed experts) + that rank's\n"
               "                  routed experts (contiguous ranges) + its KV cache at --ctx cells (default:\n"
               "                  min(context_length, 4096), as run) + %d MiB of runtime (buffers, MPI): a\n"
               "                  bound on each rank's peak RSS without an expert store; then the placement:\n"
               "                  each rank's experts per MoE layer\n"
               "  --placement FILE  the run's --placement map instead of contiguous ranges\n"
               "  --ep-replicas R   with replicas (as the run's option): without --ep-load every rank maps\n"
               "                  every expert (any may become a replica anywhere); with --ep-load PROFILE\n"
               "                  the profile's first plan: the replicas each rank hosts and maps\n",
            (int)(INSPECT_RUNTIME_BYTES >> 20));
}

/* len bytes of a file's text as the terminal may show them (core/printable.h: control bytes, C1 controls
 * and NULs as '?'; they moved the cursor, retitled the window or forged lines), padded with spaces to width. */
static void put_text(FILE *f, const char *s, size_t len, int width) {
    char buf[256];
    int shown = 0;
    for (size_t i = 0; i < len;) {
        size_t took = s[i] ? moetax_printable(buf, sizeof buf, s + i, len - i, 0) : 0;
        if (!took) { /* a NUL (where the copy stops), or nothing taken */
            fputc('?', f);
            shown++;
            i++;
            continue;
        }
        fputs(buf, f);
        shown += (int)strlen(buf);
        i += took;
    }
    for (; shown < width; shown++) fputc(' ', f);
}

static void print_scalar(FILE *f, const struct moetax_gguf_kv *kv) {
    switch (kv->type) {
    case MOETAX_GGUF_TYPE_STRING:
        fputc('"', f);
        put_text(f, kv->v.str.data, kv->v.str.len > 200 ? 200 : kv->v.str.len, 0);
        fputc('"', f);
        break;
    case MOETAX_GGUF_TYPE_BOOL: fputs(kv->v.u64 ? "true" : "false", f); break;
    case MOETAX_GGUF_TYPE_FLOAT32: case MOETAX_GGUF_TYPE_FLOAT64:
        fprintf(f, "%.9g", kv->v.f64);
        break;
    case MOETAX_GGUF_TYPE_INT8: case MOETAX_GGUF_TYPE_INT16: case MOETAX_GGUF_TYPE_INT32: case MOETAX_GGUF_TYPE_INT64:
        fprintf(f, "%lld", (long long)kv->v.i64);
        break;
    default: fprintf(f, "%llu", (unsigned long long)kv->v.u64);
    }
}

static void print_array(FILE *f, const struct moetax_gguf_kv *kv, bool all) {
    uint64_t n = kv->arr_n, show = all ? n : (n < 8 ? n : 8);
    fprintf(f, "[%s x %llu] [", moetax_gguf_type_name(kv->arr_type), (unsigned long long)n);
    for (uint64_t i = 0; i < show; i++) {
        if (i) fputs(", ", f);
        if (kv->arr_type == MOETAX_GGUF_TYPE_STRING) {
            fputc('"', f);
            put_text(f, kv->arr_str[i].data, kv->arr_str[i].len > 40 ? 40 : kv->arr_str[i].len, 0);
            fputc('"', f);
        } else if (kv->arr_type == MOETAX_GGUF_TYPE_ARRAY) {
            fputs("[...]", f);
        } else if (kv->arr_type == MOETAX_GGUF_TYPE_FLOAT32 || kv->arr_type == MOETAX_GGUF_TYPE_FLOAT64) {
            double d = 0;
            moetax_gguf_arr_f64(kv, i, &d);
            fprintf(f, "%.9g", d);
        } else if (kv->arr_type == MOETAX_GGUF_TYPE_BOOL) {
            int64_t v = 0;
            moetax_gguf_arr_i64(kv, i, &v);
            fputs(v ? "true" : "false", f);
        } else {
            int64_t v = 0;
            if (moetax_gguf_arr_i64(kv, i, &v)) fprintf(f, "%lld", (long long)v);
            else {
                uint64_t u;
                memcpy(&u, (const char *)kv->arr_data + i * 8, 8);
                fprintf(f, "%llu", (unsigned long long)u);
            }
        }
    }
    if (show < n) fputs(", ...", f);
    fputc(']', f);
}

/* ---- --json: built with Jansson (strings escaped, NaN/inf as null) ---------------- */

static json_t *jstrn(const char *s, uint64_t n) {
    json_t *j = json_stringn(s, (size_t)n); /* NULL if not valid UTF-8 */
    return j ? j : json_null();
}

static json_t *json_scalar(const struct moetax_gguf_kv *kv) {
    switch (kv->type) {
    case MOETAX_GGUF_TYPE_STRING: return jstrn(kv->v.str.data, kv->v.str.len);
    case MOETAX_GGUF_TYPE_BOOL: return json_boolean(kv->v.u64);
    case MOETAX_GGUF_TYPE_FLOAT32: case MOETAX_GGUF_TYPE_FLOAT64: return cli_jnum(kv->v.f64);
    case MOETAX_GGUF_TYPE_INT8: case MOETAX_GGUF_TYPE_INT16: case MOETAX_GGUF_TYPE_INT32: case MOETAX_GGUF_TYPE_INT64:
        return json_integer((json_int_t)kv->v.i64);
    default: /* unsigned: above INT64_MAX as a real */
        return kv->v.u64 > (uint64_t)INT64_MAX ? json_real((double)kv->v.u64) : json_integer((json_int_t)kv->v.u64);
    }
}

static json_t *json_array_kv(const struct moetax_gguf_kv *kv, bool all) {
    uint64_t n = kv->arr_n;
    if (n > 16 && !all)
        return cli_jobj("sI", "type", moetax_gguf_type_name(kv->arr_type), "n", (int64_t)n);
    json_t *a = json_array();
    for (uint64_t i = 0; a && i < n; i++) {
        json_t *e;
        if (kv->arr_type == MOETAX_GGUF_TYPE_STRING) e = jstrn(kv->arr_str[i].data, kv->arr_str[i].len);
        else if (kv->arr_type == MOETAX_GGUF_TYPE_ARRAY) e = json_null();
        else if (kv->arr_type == MOETAX_GGUF_TYPE_FLOAT32 || kv->arr_type == MOETAX_GGUF_TYPE_FLOAT64) {
            double d = 0;
            moetax_gguf_arr_f64(kv, i, &d);
            e = cli_jnum(d);
        } else if (kv->arr_type == MOETAX_GGUF_TYPE_BOOL) {
            int64_t v = 0;
            moetax_gguf_arr_i64(kv, i, &v);
            e = json_boolean(v);
        } else {
            int64_t v = 0;
            if (moetax_gguf_arr_i64(kv, i, &v)) e = json_integer((json_int_t)v);
            else {
                uint64_t u;
                memcpy(&u, (const char *)kv->arr_data + i * 8, 8);
                e = json_real((double)u);
            }
        }
        json_array_append_new(a, e);
    }
    return a;
}

/* sum and sum of squares of the dequantized values; false if the type is not computable */
static bool value_sums(const struct moetax_gguf_tensor *t, double *sum, double *sumsq) {
    if (!moetax_type_supported(t->type)) return false;
    int64_t rows = t->ne[1] * t->ne[2] * t->ne[3];
    size_t rb = moetax_row_size(t->type, t->ne[0]);
    float *row = malloc(sizeof(float) * (size_t)t->ne[0]);
    if (!row) return false;
    double s = 0, q = 0;
    for (int64_t r = 0; r < rows; r++) {
        moetax_to_float(t->type, (const char *)t->data + (size_t)r * rb, row, t->ne[0]);
        for (int64_t i = 0; i < t->ne[0]; i++) { s += row[i]; q += (double)row[i] * row[i]; }
    }
    free(row);
    *sum = s;
    *sumsq = q;
    return true;
}

static bool is_embd(const struct moetax_gguf_tensor *t) {
    return t->name.len == 17 && !memcmp(t->name.data, "token_embd.weight", 17);
}

/* the expert ids of `set` [E] as ranges ("0-15,20"), into out */
static void id_ranges(const uint8_t *set, int32_t E, char *out, size_t cap) {
    size_t o = 0;
    out[0] = 0;
    for (int32_t e = 0; e < E && o + 24 < cap; e++) {
        if (!set[e]) continue;
        int32_t f = e;
        while (e + 1 < E && set[e + 1]) e++;
        o += (size_t)snprintf(out + o, cap - o, f == e ? "%s%d" : "%s%d-%d", o ? "," : "", f, e);
    }
    if (!o) snprintf(out, cap, "-");
}

/* --ranks N: each rank's memory under expert parallelism (src/dist/dist.h: the routed experts of
 * every MoE layer cut into N contiguous ranges, or --placement FILE's map; with --ep-replicas R
 * the replicas each rank maps: a profile's first plan with --ep-load, else every expert), and the
 * placement per MoE layer. */
static int inspect_ranks(const char *path, int n_ranks, int64_t n_ctx, enum moetax_type kv_type, bool json, const char *placement,
                         const char *replicas, const char *load) {
    struct moetax_model *m;
    struct moetax_model_params mp = {0};
    moetax_status st = moetax_model_load_ex(path, &mp, &m);
    if (st) return cli_fail("inspect", st);
    const struct moetax_hparams *hp = &m->hp;
    const struct moetax_gguf *g = m->gguf;
    const int32_t E = hp->n_expert;
    const int L = hp->n_layer, P = n_ranks;
    /* the tables and loops below go over layers x experts x ranks */
    if ((int64_t)L * (E > 0 ? E : 1) * P > ((int64_t)1 << 26)) {
        moetax_model_free(m);
        return cli_usage_error("inspect", "--ranks %d: %d layers x %d experts x %d ranks is more than this view "
                               "handles (2^26); a rank past the routed experts' count would own none", P, L, E, P);
    }
    /* owner [L, E] and what each rank maps, has [L, E, P] */
    int32_t *owner = calloc((size_t)L * (size_t)(E > 0 ? E : 1), sizeof *owner);
    uint8_t *has = calloc((size_t)L * (size_t)(E > 0 ? E : 1) * (size_t)P, 1);
    int n_rep = 0;
    const int32_t *hosts = NULL, *n_hosts = NULL;
    int H = 1;
    if (!owner || !has) st = moetax_error(MOETAX_ERR_NOMEM, "out of memory");
    for (int il = 0; !st && il < L; il++)
        for (int r = 0; r < P; r++) /* as moetax_dist_expert_range */
            for (int32_t e = (int32_t)((int64_t)E * r / P); e < (int32_t)((int64_t)E * (r + 1) / P); e++)
                owner[(size_t)il * E + e] = r;
#ifdef MOETAX_WITH_MPI
    struct moetax_dist *D = NULL;
    if (!st && (placement || replicas || load)) {
        if (E <= 0) st = moetax_error(MOETAX_ERR_ARG, "%s has no routed experts to place", path);
        else if ((replicas || load) && moetax_dist_set_replicas(replicas, NULL, load))
            st = moetax_error(MOETAX_ERR_ARG, "bad --ep-replicas / --ep-load (see above)");
        else if (!(st = moetax_dist_plan_offline(m, P, placement, &D))) {
            memcpy(owner, D->owner, sizeof *owner * (size_t)L * (size_t)E);
            n_rep = D->n_rep;
            hosts = D->hosts, n_hosts = D->n_hosts, H = D->H;
        }
    }
    for (int il = 0; !st && n_rep && il < L; il++)
        for (int32_t e = 0; e < E; e++)
            for (int r = 0; r < P; r++)
                has[((size_t)il * E + e) * P + r] = D->avail[((size_t)il * E + e) * P + r];
#else
    if (!st && (placement || replicas || load))
        st = moetax_error(MOETAX_ERR_UNSUPPORTED, "--placement / --ep-replicas / --ep-load: this moetax is built without "
                          "MPI (Debian: libopenmpi-dev), so there is no expert parallelism to plan");
#endif
    for (size_t i = 0; !st && i < (size_t)L * (size_t)(E > 0 ? E : 0); i++) has[i * P + owner[i]] = 1;
    if (st) {
        free(owner);
        free(has);
#ifdef MOETAX_WITH_MPI
        moetax_dist_plan_free(D);
#endif
        moetax_model_free(m);
        return cli_fail("inspect", st);
    }
    if (n_ctx <= 0) n_ctx = hp->n_ctx_train > 0 && hp->n_ctx_train < 4096 ? hp->n_ctx_train : 4096;
    const int64_t bs = MOETAX_KV_BLOCK_DEFAULT, cells = (n_ctx + bs - 1) / bs * bs;
    const int64_t row = hp->attn == MOETAX_ATTN_GQA ? gqa_kv_row(hp) : hp->kv_lora_rank + hp->n_embd_head_qk_rope;
    const uint64_t row_bytes = kv_type == MOETAX_TYPE_Q8_0 ? (uint64_t)(row + 31) / 32 * sizeof(moetax_block_q8_0)
                                                            : (uint64_t)row * (kv_type == MOETAX_TYPE_F16 ? 2u : 4u);
    const uint64_t kv = (uint64_t)cells * (uint64_t)hp->n_layer * row_bytes;
    uint64_t repl = 0, experts = 0;
    uint64_t *mine = calloc((size_t)n_ranks, sizeof *mine), *own_b = calloc((size_t)n_ranks, sizeof *own_b);
    if (!mine || !own_b) {
        free(mine); free(own_b); free(owner); free(has);
        moetax_model_free(m);
        return cli_fail("inspect", moetax_error(MOETAX_ERR_NOMEM, "out of memory"));
    }
    for (uint64_t i = 0; i < g->n_tensors; i++) {
        const struct moetax_gguf_tensor *t = &g->tensors[i];
        int il = -1;
        char nm[64];
        snprintf(nm, sizeof nm, "%.*s", (int)(t->name.len < 63 ? t->name.len : 63), t->name.data);
        if (!moetax_tensor_is_routed_expert(t) || E <= 0 || t->ne[2] != E || sscanf(nm, "blk.%d.", &il) != 1 ||
            il < 0 || il >= L) {
            repl += t->nbytes;
            continue;
        }
        experts += t->nbytes;
        const uint64_t per = t->nbytes / (uint64_t)E;
        for (int32_t e = 0; e < E; e++)
            for (int r = 0; r < n_ranks; r++) {
                mine[r] += has[((size_t)il * E + e) * P + r] ? per : 0;
                own_b[r] += owner[(size_t)il * E + e] == r ? per : 0;
            }
    }
    /* per MoE layer and rank: the experts it owns, the replicas it hosts in the first plan */
    uint8_t *set = calloc((size_t)(E > 0 ? E : 1), 1), *rset = calloc((size_t)(E > 0 ? E : 1), 1);
    char ids[4096], rids[4096];
    FILE *f = stdout;
    if (json) {
        json_t *rs = json_array(), *pl = json_array();
        for (int r = 0; rs && r < n_ranks; r++) {
            const int32_t lo = (int32_t)((int64_t)E * r / n_ranks), hi = (int32_t)((int64_t)E * (r + 1) / n_ranks);
            json_t *o = cli_jobj("iIIIIII", "rank", r, "replicated_bytes", (json_int_t)repl, "expert_bytes",
                                 (json_int_t)mine[r], "own_expert_bytes", (json_int_t)own_b[r], "kv_bytes",
                                 (json_int_t)kv, "runtime_bytes", (json_int_t)INSPECT_RUNTIME_BYTES, "bound_bytes",
                                 (json_int_t)(repl + mine[r] + kv + INSPECT_RUNTIME_BYTES));
            if (!placement) { /* contiguous: the same range in every layer */
                json_object_set_new(o, "expert_lo", json_integer(lo));
                json_object_set_new(o, "expert_hi", json_integer(hi));
            }
            json_array_append_new(rs, o);
        }
        for (int il = 0; pl && il < L; il++) {
            if (!m->layers[il].is_moe || E <= 0) continue;
            json_t *lr = json_array();
            for (int r = 0; r < n_ranks; r++) {
                json_t *ex = json_array(), *rp = json_array();
                int n_map = 0;
                for (int32_t e = 0; e < E; e++) {
                    const size_t ie = (size_t)il * E + e;
                    if (owner[ie] == r) json_array_append_new(ex, json_integer(e));
                    for (int j = 1; n_rep && j < n_hosts[ie]; j++)
                        if (hosts[ie * H + j] == r) json_array_append_new(rp, json_integer(e));
                    n_map += has[ie * P + r];
                }
                json_array_append_new(lr, cli_jobj("iooi", "rank", r, "experts", ex, "replicas", rp, "mapped", n_map));
            }
            json_array_append_new(pl, cli_jobj("io", "layer", il, "ranks", lr));
        }
        json_t *root = cli_jobj("siIIIIoo", "file", path, "ranks", n_ranks, "n_ctx", (json_int_t)cells,
                                "routed_expert_bytes", (json_int_t)experts, "replicated_bytes", (json_int_t)repl,
                                "single_process_bytes", (json_int_t)(repl + experts + kv + INSPECT_RUNTIME_BYTES),
                                "per_rank", rs, "placement", pl);
        if (placement) json_object_set_new(root, "placement_file", json_string(placement));
        if (n_rep) json_object_set_new(root, "replicas", json_integer(n_rep));
        if (load) json_object_set_new(root, "load_profile", json_string(load));
        free(mine); free(own_b); free(owner); free(has); free(set); free(rset);
#ifdef MOETAX_WITH_MPI
        moetax_dist_plan_free(D);
#endif
        moetax_model_free(m);
        if ((st = cli_json_print(f, root))) return cli_fail("inspect", st);
        return 0;
    }
    fprintf(f, "%s: expert parallelism over %d ranks (routed experts %s; the rest replicated), KV cache of %lld "
               "cells (%s)\n", path, n_ranks, placement ? "placed by the file" : "in contiguous ranges",
            (long long)cells, moetax_type_name(kv_type));
    if (n_rep)
        fprintf(f, "replicas: up to %d per MoE layer, %s\n", n_rep,
                load ? "the profile's first plan (each rank maps only the replicas it hosts)"
                     : "planned from the run's counts (no profile: every rank maps every expert)");
    fprintf(f, "\n  %-5s %-11s %14s %14s %12s %12s %14s\n", "rank", "experts", "replicated MiB", "experts MiB",
            "KV MiB", "runtime MiB", "bound MiB");
    for (int r = 0; r < n_ranks; r++) {
        const int32_t lo = (int32_t)((int64_t)E * r / n_ranks), hi = (int32_t)((int64_t)E * (r + 1) / n_ranks);
        char ex[32];
        if (placement) snprintf(ex, sizeof ex, "(below)");
        else snprintf(ex, sizeof ex, "[%d, %d)", lo, hi);
        fprintf(f, "  %-5d %-11s %14.2f %14.2f %12.2f %12.2f %14.2f\n", r, ex, (double)repl / (1 << 20),
                (double)mine[r] / (1 << 20), (double)kv / (1 << 20), (double)INSPECT_RUNTIME_BYTES / (1 << 20),
                (double)(repl + mine[r] + kv + INSPECT_RUNTIME_BYTES) / (1 << 20));
    }
    fprintf(f, "\n  one process: %.2f MiB (all %.2f MiB of routed experts)\n",
            (double)(repl + experts + kv + INSPECT_RUNTIME_BYTES) / (1 << 20), (double)experts / (1 << 20));
    /* the placement: per MoE layer, each rank's experts (count [ids]) and replicas (+count {ids}) */
    fprintf(f, "\n  placement: experts per rank and MoE layer%s\n", n_rep ? " (+ replicas it hosts)" : "");
    for (int il = 0; set && rset && E > 0 && il < L; il++) {
        if (!m->layers[il].is_moe) continue;
        fprintf(f, "  layer %-3d", il);
        for (int r = 0; r < n_ranks; r++) {
            int n_own = 0, n_r = 0;
            for (int32_t e = 0; e < E; e++) {
                const size_t ie = (size_t)il * E + e;
                set[e] = owner[ie] == r;
                n_own += set[e];
                rset[e] = 0;
                for (int j = 1; n_rep && j < n_hosts[ie]; j++) rset[e] |= hosts[ie * H + j] == r;
                n_r += rset[e];
            }
            id_ranges(set, E, ids, sizeof ids);
            id_ranges(rset, E, rids, sizeof rids);
            if (n_r) fprintf(f, "  rank %d: %d [%s] +%d {%s}", r, n_own, ids, n_r, rids);
            else fprintf(f, "  rank %d: %d [%s]", r, n_own, ids);
        }
        fputc('\n', f);
    }
    free(mine); free(own_b); free(owner); free(has); free(set); free(rset);
#ifdef MOETAX_WITH_MPI
    moetax_dist_plan_free(D);
#endif
    moetax_model_free(m);
    return 0;
}

int cmd_inspect(int argc, char **argv) {
    const char *path = NULL;
    bool json = false, sums = false, tensors = true, all = false;
    enum moetax_type kv_type = MOETAX_TYPE_F32;
    int64_t n_ranks = 0, n_ctx = 0;
    const char *v = NULL, *placement = NULL, *replicas = NULL, *load = NULL;
    for (int i = 1; i < argc; i++) {
        if (cli_flag(argv, i, "-h", "--help")) { usage(stdout); return 0; }
        else if (!strcmp(argv[i], "--json")) json = true;
        else if (!strcmp(argv[i], "--checksums")) sums = true;
        else if (!strcmp(argv[i], "--no-tensors")) tensors = false;
        else if (!strcmp(argv[i], "--all-metadata")) all = true;
        else if (cli_flag(argv, i, "-m", "--model") && i + 1 < argc) path = argv[++i];
        else if (!strcmp(argv[i], "--ranks") && i + 1 < argc) {
            if (!cli_parse_i64(argv[++i], &n_ranks) || n_ranks < 1 || n_ranks > 65536) return cli_usage_error("inspect", "--ranks: expected 1..65536");
        } else if (cli_flag(argv, i, "-c", "--ctx") && i + 1 < argc) {
            if (!cli_parse_i64(argv[++i], &n_ctx) || n_ctx < 1 || n_ctx > (1 << 24)) return cli_usage_error("inspect", "--ctx: expected 1..16777216");
        } else if (!strcmp(argv[i], "--kv-type") && i + 1 < argc) {
            v = argv[++i];
            if (!cli_cache_type_parse(v, &kv_type)) return cli_usage_error("inspect", "--kv-type: expected f32, f16 or q8_0");
        }
        else if (!strcmp(argv[i], "--placement") && i + 1 < argc) placement = argv[++i];
        else if (!strcmp(argv[i], "--ep-replicas") && i + 1 < argc) replicas = argv[++i];
        else if (!strcmp(argv[i], "--ep-load") && i + 1 < argc) load = argv[++i];
        else if (argv[i][0] == '-') return cli_usage_error("inspect", "unknown option '%s'", argv[i]);
        else if (!path) path = argv[i];
        else return cli_usage_error("inspect", "only one file, please ('%s' and '%s')", path, argv[i]);
    }
    if (!path) return cli_usage_error("inspect", "no file given");
    if (!n_ranks && (placement || replicas || load))
        return cli_usage_error("inspect", "--placement, --ep-replicas and --ep-load go with --ranks N");
    if (n_ranks) return inspect_ranks(path, (int)n_ranks, n_ctx, kv_type, json, placement, replicas, load);
    struct moetax_gguf *g;
    moetax_status st = moetax_gguf_open(path, &g);
    if (st) return cli_fail("inspect", st);

    char arch[64] = "", key[160];
    moetax_gguf_get_str(g, "general.architecture", arch, sizeof arch);
    uint32_t n_expert = 0, n_used = 0;
    snprintf(key, sizeof key, "%s.expert_count", arch);
    moetax_gguf_get_u32(g, key, &n_expert);
    snprintf(key, sizeof key, "%s.expert_used_count", arch);
    moetax_gguf_get_u32(g, key, &n_used);
    double frac = n_expert ? (double)n_used / n_expert : 1.0;

    uint64_t n_params = 0, n_bytes = 0, expert_bytes = 0, n_params_active = 0;
    double active = 0;
    uint64_t by_type_bytes[MOETAX_TYPE_COUNT] = {0}, by_type_n[MOETAX_TYPE_COUNT] = {0};
    for (uint64_t i = 0; i < g->n_tensors; i++) {
        const struct moetax_gguf_tensor *t = &g->tensors[i];
        uint64_t nel = (uint64_t)moetax_gguf_tensor_nelements(t);
        n_params += nel;
        n_bytes += t->nbytes;
        by_type_bytes[t->type] += t->nbytes;
        by_type_n[t->type]++;
        if (moetax_tensor_is_routed_expert(t)) {
            expert_bytes += t->nbytes;
            active += (double)t->nbytes * frac;
            n_params_active += (uint64_t)((double)nel * frac);
        } else if (is_embd(t)) {
            active += (double)t->nbytes / (double)t->ne[1];
            n_params_active += (uint64_t)t->ne[0];
        } else {
            active += (double)t->nbytes;
            n_params_active += nel;
        }
    }

    FILE *f = stdout;
    if (json) {
        json_t *md = json_object(), *ts = json_array();
        for (uint64_t i = 0; md && i < g->n_kv; i++) {
            const struct moetax_gguf_kv *kv = &g->kv[i];
            char *k = strndup(kv->key.data, (size_t)kv->key.len);
            if (k) json_object_set_new(md, k, kv->type == MOETAX_GGUF_TYPE_ARRAY ? json_array_kv(kv, all) : json_scalar(kv));
            free(k);
        }
        for (uint64_t i = 0; ts && tensors && i < g->n_tensors; i++) {
            const struct moetax_gguf_tensor *t = &g->tensors[i];
            json_t *ne = json_array();
            for (uint32_t d = 0; d < t->n_dims; d++) json_array_append_new(ne, json_integer((json_int_t)t->ne[d]));
            json_t *o = cli_jobj("osoII", "name", jstrn(t->name.data, t->name.len), "type",
                                  moetax_type_name(t->type), "ne", ne, "offset", (json_int_t)t->offset, "nbytes",
                                  (json_int_t)t->nbytes);
            if (o && sums) {
                double sm, q;
                char h[17];
                snprintf(h, sizeof h, "%016llx", (unsigned long long)moetax_gguf_hash(t->data, t->nbytes));
                json_object_set_new(o, "fnv1a64", json_string(h));
                if (value_sums(t, &sm, &q)) {
                    json_object_set_new(o, "sum", cli_jnum(sm));
                    json_object_set_new(o, "sumsq", cli_jnum(q));
                }
            }
            json_array_append_new(ts, o);
        }
        json_t *root = cli_jobj("oiiIIooIIIIiiIo",
                                 "file", cli_jstr(path), "version", (int)g->version, "alignment", (int)g->alignment,
                                 "data_offset", (json_int_t)g->data_offset, "file_size", (json_int_t)g->size,
                                 "metadata", md, "tensors", ts, "n_tensors", (json_int_t)g->n_tensors, "n_params",
                                 (json_int_t)n_params, "tensor_bytes", (json_int_t)n_bytes, "routed_expert_bytes",
                                 (json_int_t)expert_bytes, "expert_count", (int)n_expert, "expert_used_count",
                                 (int)n_used, "active_params_per_token", (json_int_t)n_params_active,
                                 "active_bytes_per_token", cli_jnum(round(active)));
        moetax_gguf_close(g);
        if ((st = cli_json_print(f, root))) return cli_fail("inspect", st);
        return 0;
    }

    fprintf(f, "%s: GGUF v%u, %llu bytes, %llu metadata keys, %llu tensors, alignment %u, data at byte %llu\n\n", path,
            g->version, (unsigned long long)g->size, (unsigned long long)g->n_kv, (unsigned long long)g->n_tensors,
            g->alignment, (unsigned long long)g->data_offset);
    fprintf(f, "metadata:\n");
    for (uint64_t i = 0; i < g->n_kv; i++) {
        const struct moetax_gguf_kv *kv = &g->kv[i];
        fputs("  ", f);
        put_text(f, kv->key.data, kv->key.len > 200 ? 200 : kv->key.len, 48);
        fprintf(f, " %-8s ", moetax_gguf_type_name(kv->type));
        if (kv->type == MOETAX_GGUF_TYPE_ARRAY) print_array(f, kv, all);
        else print_scalar(f, kv);
        fputc('\n', f);
    }
    if (tensors) {
        fprintf(f, "\ntensors:\n  %-40s %-6s %-24s %14s%s\n", "name", "type", "shape (ne0, ne1, ...)", "bytes",
                sums ? "  fnv1a64           sum" : "");
        for (uint64_t i = 0; i < g->n_tensors; i++) {
            const struct moetax_gguf_tensor *t = &g->tensors[i];
            char shape[96];
            int o = 0;
            for (uint32_t d = 0; d < t->n_dims; d++)
                o += snprintf(shape + o, sizeof shape - (size_t)o, "%s%lld", d ? ", " : "", (long long)t->ne[d]);
            fputs("  ", f);
            put_text(f, t->name.data, t->name.len > 64 ? 64 : t->name.len, 40);
            fprintf(f, " %-6s %-24s %14llu", moetax_type_name(t->type), shape, (unsigned long long)t->nbytes);
            if (sums) {
                double s, q;
                fprintf(f, "  %016llx", (unsigned long long)moetax_gguf_hash(t->data, t->nbytes));
                if (value_sums(t, &s, &q)) fprintf(f, "  %.6g", s);
            }
            fputc('\n', f);
        }
    }
    fprintf(f, "\ntotals:\n  parameters        %12.3f M\n  tensor bytes      %12.2f MiB\n", (double)n_params / 1e6,
            (double)n_bytes / (1 << 20));
    for (int t = 0; t < MOETAX_TYPE_COUNT; t++)
        if (by_type_n[t])
            fprintf(f, "    %-6s %5llu tensors %12.2f MiB\n", moetax_type_name((enum moetax_type)t),
                    (unsigned long long)by_type_n[t], (double)by_type_bytes[t] / (1 << 20));
    if (n_expert)
        fprintf(f, "  routed experts    %12.2f MiB (%u experts, %u used per token)\n", (double)expert_bytes / (1 << 20),
                n_expert, n_used);
    fprintf(f, "  active per token  %12.3f M parameters, %.2f MiB of weights read per decoded token\n",
            (double)n_params_active / 1e6, active / (1 << 20));
    moetax_gguf_close(g);
    return 0;
}
