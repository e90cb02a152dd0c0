/* cmd_inspect.c - `moetax inspect FILE`: metadata, tensor table, totals and the
 * active bytes per decoded token (the denominator of every roofline figure). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "commands.h"
#include "gguf/gguf_impl.h" /* moetax_gguf_hash: FNV-1a 64 */
#include "moetax/gguf.h"
#include "moetax/model.h"

static void usage(FILE *f) {
    fprintf(f, "usage: moetax inspect FILE [--json] [--checksums] [--no-tensors] [--all-metadata]\n\n"
               "Shows a GGUF file: metadata, a tensor table (name, type, shape, bytes), totals, and the\n"
               "bytes of weights a decoded token reads: routed experts count k/E of their bytes (k experts\n"
               "used of E), token_embd one row, every other tensor whole.\n\n"
               "  --json          machine-readable: one JSON object\n"
               "  --checksums     add per tensor the FNV-1a 64 of its bytes and the sum and sum of squares\n"
               "                  of its values (dequantized; f32/f16/bf16/q8_0/q4_0)\n"
               "  --no-tensors    omit the tensor table\n"
               "  --all-metadata  print long arrays in full (default: first 8 elements)\n");
}

static void json_str(FILE *f, const char *s, uint64_t n) {
    fputc('"', f);
    for (uint64_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)s[i];
        if (c == '"' || c == '\\') fprintf(f, "\\%c", c);
        else if (c == '\n') fputs("\\n", f);
        else if (c == '\t') fputs("\\t", f);
        else if (c < 0x20 || c == 0x7f) fprintf(f, "\\u%04x", c);
        else fputc(c, f);
    }
    fputc('"', f);
}

static void print_scalar(FILE *f, const struct moetax_gguf_kv *kv, bool json) {
    switch (kv->type) {
    case MOETAX_GGUF_TYPE_STRING:
        if (json) json_str(f, kv->v.str.data, kv->v.str.len);
        else fprintf(f, "\"%.*s\"", (int)(kv->v.str.len > 200 ? 200 : kv->v.str.len), kv->v.str.data);
        break;
    case MOETAX_GGUF_TYPE_BOOL: fputs(kv->v.u64 ? "true" : "false", f); break;
    case MOETAX_GGUF_TYPE_FLOAT32: case MOETAX_GGUF_TYPE_FLOAT64:
        if (isfinite(kv->v.f64)) fprintf(f, "%.9g", kv->v.f64);
        else fputs(json ? "null" : "nan", f);
        break;
    case MOETAX_GGUF_TYPE_INT8: case MOETAX_GGUF_TYPE_INT16: case MOETAX_GGUF_TYPE_INT32: case MOETAX_GGUF_TYPE_INT64:
        fprintf(f, "%lld", (long long)kv->v.i64);
        break;
    default: fprintf(f, "%llu", (unsigned long long)kv->v.u64);
    }
}

static void print_array(FILE *f, const struct moetax_gguf_kv *kv, bool json, bool all) {
    uint64_t n = kv->arr_n, show = all ? n : (n < 8 ? n : 8);
    if (json && n > 16 && !all) {
        fprintf(f, "{\"type\": \"%s\", \"n\": %llu}", moetax_gguf_type_name(kv->arr_type), (unsigned long long)n);
        return;
    }
    if (json) show = n;
    if (!json) fprintf(f, "[%s x %llu] ", moetax_gguf_type_name(kv->arr_type), (unsigned long long)n);
    fputc('[', f);
    for (uint64_t i = 0; i < show; i++) {
        if (i) fputs(", ", f);
        if (kv->arr_type == MOETAX_GGUF_TYPE_STRING) {
            if (json) json_str(f, kv->arr_str[i].data, kv->arr_str[i].len);
            else fprintf(f, "\"%.*s\"", (int)(kv->arr_str[i].len > 40 ? 40 : kv->arr_str[i].len), kv->arr_str[i].data);
        } else if (kv->arr_type == MOETAX_GGUF_TYPE_ARRAY) {
            fputs(json ? "null" : "[...]", f);
        } else if (kv->arr_type == MOETAX_GGUF_TYPE_FLOAT32 || kv->arr_type == MOETAX_GGUF_TYPE_FLOAT64) {
            double d = 0;
            moetax_gguf_arr_f64(kv, i, &d);
            if (isfinite(d)) fprintf(f, "%.9g", d);
            else fputs(json ? "null" : "nan", f);
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

int cmd_inspect(int argc, char **argv) {
    const char *path = NULL;
    bool json = false, sums = false, tensors = true, all = false;
    for (int i = 1; i < argc; i++) {
        if (cli_flag(argv, i, "-h", "--help")) { usage(stdout); return 0; }
        else if (!strcmp(argv[i], "--json")) json = true;
        else if (!strcmp(argv[i], "--checksums")) sums = true;
        else if (!strcmp(argv[i], "--no-tensors")) tensors = false;
        else if (!strcmp(argv[i], "--all-metadata")) all = true;
        else if (cli_flag(argv, i, "-m", "--model") && i + 1 < argc) path = argv[++i];
        else if (argv[i][0] == '-') return cli_usage_error("inspect", "unknown option '%s'", argv[i]);
        else if (!path) path = argv[i];
        else return cli_usage_error("inspect", "only one file, please ('%s' and '%s')", path, argv[i]);
    }
    if (!path) return cli_usage_error("inspect", "no file given");
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
        fprintf(f, "{\"file\": ");
        json_str(f, path, strlen(path));
        fprintf(f, ", \"version\": %u, \"alignment\": %u, \"data_offset\": %llu, \"file_size\": %llu,\n \"metadata\": {",
                g->version, g->alignment, (unsigned long long)g->data_offset, (unsigned long long)g->size);
        for (uint64_t i = 0; i < g->n_kv; i++) {
            const struct moetax_gguf_kv *kv = &g->kv[i];
            fputs(i ? ",\n  " : "\n  ", f);
            json_str(f, kv->key.data, kv->key.len);
            fputs(": ", f);
            if (kv->type == MOETAX_GGUF_TYPE_ARRAY) print_array(f, kv, true, all);
            else print_scalar(f, kv, true);
        }
        fprintf(f, "},\n \"tensors\": [");
        for (uint64_t i = 0; tensors && i < g->n_tensors; i++) {
            const struct moetax_gguf_tensor *t = &g->tensors[i];
            fputs(i ? ",\n  {\"name\": " : "\n  {\"name\": ", f);
            json_str(f, t->name.data, t->name.len);
            fprintf(f, ", \"type\": \"%s\", \"ne\": [", moetax_type_name(t->type));
            for (uint32_t d = 0; d < t->n_dims; d++) fprintf(f, "%s%lld", d ? ", " : "", (long long)t->ne[d]);
            fprintf(f, "], \"offset\": %llu, \"nbytes\": %llu", (unsigned long long)t->offset, (unsigned long long)t->nbytes);
            if (sums) {
                double s, q;
                fprintf(f, ", \"fnv1a64\": \"%016llx\"", (unsigned long long)moetax_gguf_hash(t->data, t->nbytes));
                if (value_sums(t, &s, &q)) fprintf(f, ", \"sum\": %.17g, \"sumsq\": %.17g", s, q);
            }
            fputc('}', f);
        }
        fprintf(f, "],\n \"n_tensors\": %llu, \"n_params\": %llu, \"tensor_bytes\": %llu, \"routed_expert_bytes\": %llu,"
                   " \"expert_count\": %u, \"expert_used_count\": %u, \"active_params_per_token\": %llu,"
                   " \"active_bytes_per_token\": %.0f}\n",
                (unsigned long long)g->n_tensors, (unsigned long long)n_params, (unsigned long long)n_bytes,
                (unsigned long long)expert_bytes, n_expert, n_used, (unsigned long long)n_params_active, active);
        moetax_gguf_close(g);
        return 0;
    }

    fprintf(f, "%s: GGUF v%u, %llu bytes, %llu metadata keys, %llu tensors, alignment %u, data at byte %llu\n\n", path,
            g->version, (unsigned long long)g->size, (unsigned long long)g->n_kv, (unsigned long long)g->n_tensors,
            g->alignment, (unsigned long long)g->data_offset);
    fprintf(f, "metadata:\n");
    for (uint64_t i = 0; i < g->n_kv; i++) {
        const struct moetax_gguf_kv *kv = &g->kv[i];
        fprintf(f, "  %-48.*s %-8s ", (int)(kv->key.len > 200 ? 200 : kv->key.len), kv->key.data,
                moetax_gguf_type_name(kv->type));
        if (kv->type == MOETAX_GGUF_TYPE_ARRAY) print_array(f, kv, false, all);
        else print_scalar(f, kv, false);
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
            fprintf(f, "  %-40.*s %-6s %-24s %14llu", (int)(t->name.len > 64 ? 64 : t->name.len), t->name.data,
                    moetax_type_name(t->type), shape, (unsigned long long)t->nbytes);
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
