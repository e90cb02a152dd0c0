/* cmd_quantize.c - `moetax quantize IN OUT TYPE`: convert a model's weights.
 * Like llama-quantize: the router (ffn_gate_inp), norms, biases, exp_probs_b
 * and all 1-D tensors stay F32; a tensor whose rows do not fit the target
 * block size falls back: k-quants (rows not a multiple of 256) as llama-quantize
 * does: Q4_K to Q5_0, Q5_K to Q5_1, Q6_K to Q8_0; Q2_K and Q3_K to Q8_0 (llama.cpp
 * 82bb485: Q4_0); anything else to F16 (moetax_type_fit).
 * Metadata is copied, general.file_type updated (q2_k: MOSTLY_Q2_K = 10,
 * q3_k: Q3_K_M = 12, q4_k: MOSTLY_Q4_K_M = 15, q5_k: Q5_K_M = 17,
 * q6_k: Q6_K = 18, as `llama-quantize --pure IN OUT Q4_K_M` writes).
 * --experts-only converts the routed expert tensors (*_exps.*) alone and copies every
 * other tensor, general.file_type included, as stored: the file `--expert-type TYPE`
 * computes in memory (src/model/requant.h; tensors already of TYPE are copied too) where every
 * expert's rows fit TYPE's blocks; where they do not, quantize falls back as above and
 * --expert-type refuses the model. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "commands.h"
#include "moetax/gguf.h"
#include "moetax/model.h"
#include "moetax/outfile.h"

static void usage(FILE *f) {
    fprintf(f, "usage: moetax quantize [--experts-only] IN.gguf OUT.gguf TYPE\n\n"
               "TYPE: f32 f16 bf16 q8_0 q4_0 q4_1 q5_0 q5_1 iq4_nl q2_k q3_k q4_k q5_k q6_k. Routers, norms, biases\n"
               "and 1-D tensors stay f32; k-quant tensors whose rows are not a multiple of 256 become q5_0 (q4_k),\n"
               "q5_1 (q5_k) or q8_0 (q6_k, q2_k, q3_k; llama-quantize: q4_0 for those two), and rows that 32 does not\n"
               "divide f16 (each named on stderr).\n"
               "  --experts-only  convert the routed expert tensors only, the rest copied as stored (what\n"
               "                  run/bench/eval --expert-type TYPE compute in memory; where the experts' rows\n"
               "                  do not fit TYPE, --expert-type refuses and this falls back as above)\n");
}

static bool keep_f32(const struct moetax_gguf_tensor *t) {
    char name[256];
    size_t n = t->name.len < 255 ? t->name.len : 255;
    memcpy(name, t->name.data, n);
    name[n] = 0;
    return t->n_dims == 1 || strstr(name, "ffn_gate_inp") || strstr(name, "_norm") || strstr(name, ".bias") ||
           strstr(name, "exp_probs_b");
}

int cmd_quantize(int argc, char **argv) {
    const char *pos[3];
    int np = 0;
    bool experts_only = false;
    for (int i = 1; i < argc; i++) {
        if (cli_flag(argv, i, "-h", "--help")) { usage(stdout); return 0; }
        if (!strcmp(argv[i], "--experts-only")) { experts_only = true; continue; }
        if (argv[i][0] == '-') return cli_usage_error("quantize", "unknown option '%s'", argv[i]);
        if (np == 3) return cli_usage_error("quantize", "too many arguments");
        pos[np++] = argv[i];
    }
    if (np != 3) return cli_usage_error("quantize", "need IN OUT TYPE");
    enum moetax_type to;
    if (!moetax_type_from_name(pos[2], &to) || !moetax_type_supported(to))
        return cli_usage_error("quantize",
                               "unknown type '%s' (f32, f16, bf16, q8_0, q4_0, q4_1, q5_0, q5_1, iq4_nl, q2_k, q3_k, q4_k, q5_k, "
                               "q6_k)", pos[2]);
    /* the same file by device and inode, not by name (./../dir/IN, a link to IN) */
    bool same = false;
    moetax_status st = moetax_same_file(pos[0], pos[1], &same);
    if (st) return cli_fail("quantize", st);
    if (same) return cli_usage_error("quantize", "input %s and output %s are the same file", pos[0], pos[1]);
    if ((st = moetax_outfile_check(pos[1], 0))) return cli_fail("quantize", st);
    struct moetax_gguf *g;
    if ((st = moetax_gguf_open(pos[0], &g))) return cli_fail("quantize", st);
    struct moetax_gguf_writer *w = NULL;
    float *row = NULL;
    void *out = NULL;
    enum moetax_type *types = calloc(g->n_tensors + 1, sizeof *types);
    if (!types) { st = moetax_error(MOETAX_ERR_NOMEM, "out of memory"); goto done; }
    if ((st = moetax_gguf_writer_init(pos[1], &w))) goto done;
    const uint32_t ftype = moetax_type_llama_ftype(to);
    for (uint64_t i = 0; i < g->n_kv; i++) {
        const struct moetax_gguf_kv *kv = &g->kv[i];
        if (kv->key.len == 17 && !memcmp(kv->key.data, "general.file_type", 17) && !experts_only)
            st = moetax_gguf_writer_set_u32(w, "general.file_type", ftype);
        else st = moetax_gguf_writer_copy_kv(w, g, kv);
        if (st) goto done;
    }
    if (!experts_only && !moetax_gguf_find_kv(g, "general.file_type") && (st = moetax_gguf_writer_set_u32(w, "general.file_type", ftype)))
        goto done;
    int64_t max_ne0 = 1;
    bool requant_said = false;
    for (uint64_t i = 0; i < g->n_tensors; i++) {
        const struct moetax_gguf_tensor *t = &g->tensors[i];
        char name[256];
        if (t->name.len >= sizeof name) { /* a shortened copy would rename it (or clash with another) */
            st = moetax_error(MOETAX_ERR_UNSUPPORTED, "%s: a tensor name of %llu bytes (at most %zu are written; "
                              "llama.cpp takes 63): '%.60s...'", pos[0], (unsigned long long)t->name.len,
                              sizeof name - 1, t->name.data);
            goto done;
        }
        snprintf(name, sizeof name, "%.*s", (int)t->name.len, t->name.data);
        if (!moetax_type_supported(t->type)) {
            st = moetax_error(MOETAX_ERR_UNSUPPORTED, "%s: tensor '%s' has type %s, which moetax cannot convert", pos[0],
                              name, moetax_type_name(t->type));
            goto done;
        }
        enum moetax_type ty = keep_f32(t) ? MOETAX_TYPE_F32 : to;
        if (experts_only && (!moetax_tensor_is_routed_expert(t) || t->type == to)) ty = t->type; /* as stored */
        /* rows that the type's blocks do not divide: a k-quant falls back to q5_0 or q8_0, then (or a
         * 32-block type) to f16 (moetax_type_fit); the final type is named once */
        const enum moetax_type want = ty;
        ty = moetax_type_fit(ty, t->ne[0]);
        if (ty != want)
            fprintf(stderr, "moetax quantize: %s: %lld columns are not a multiple of %lld (%s): %s instead\n", name,
                    (long long)t->ne[0], (long long)moetax_type_blck_size(want), moetax_type_name(want),
                    moetax_type_name(ty));
        types[i] = ty;
        /* already quantized, to another type: its rounding stays and the new one's comes on top (llama.cpp's
         * quantize refuses this without --allow-requantize); said, once */
        if (ty != t->type && moetax_type_blck_size(t->type) > 1 && !requant_said) {
            fprintf(stderr, "moetax quantize: warning: %s is already %s: converting it to %s keeps %s's error and "
                    "adds %s's (quantize from the f32, f16 or bf16 file where there is one)\n", name,
                    moetax_type_name(t->type), moetax_type_name(ty), moetax_type_name(t->type), moetax_type_name(ty));
            requant_said = true;
        }
        if (t->ne[0] > max_ne0) max_ne0 = t->ne[0];
        if ((st = moetax_gguf_writer_add_tensor(w, name, ty, t->n_dims, t->ne))) goto done;
    }
    row = malloc(sizeof(float) * (size_t)max_ne0);
    out = malloc(sizeof(float) * (size_t)max_ne0);
    if (!row || !out) { st = moetax_error(MOETAX_ERR_NOMEM, "out of memory"); goto done; }
    cli_progress bar;
    cli_progress_init(&bar, "quantizing", moetax_gguf_writer_data_total(w));
    for (uint64_t i = 0; i < g->n_tensors; i++) {
        const struct moetax_gguf_tensor *t = &g->tensors[i];
        int64_t rows = t->ne[1] * t->ne[2] * t->ne[3];
        size_t rb_in = moetax_row_size(t->type, t->ne[0]), rb_out = moetax_row_size(types[i], t->ne[0]);
        if (experts_only && types[i] == t->type) { /* copied as stored */
            if ((st = moetax_gguf_writer_write(w, t->data, (size_t)t->nbytes))) goto done;
            cli_progress_update(&bar, moetax_gguf_writer_data_written(w));
            continue;
        }
        const bool quantized = moetax_type_blck_size(types[i]) > 1;
        char tname[256];
        snprintf(tname, sizeof tname, "%.*s", (int)t->name.len, t->name.data);
        for (int64_t r = 0; r < rows; r++) {
            moetax_to_float(t->type, (const char *)t->data + (size_t)r * rb_in, row, t->ne[0]);
            const int64_t bad = quantized ? moetax_nonfinite_at(row, t->ne[0]) : -1;
            if (bad >= 0) { /* the output is left unwritten (the writer renames it only when finished) */
                st = moetax_error(MOETAX_ERR_NUMERIC, "%s: tensor %s, row %lld, column %lld holds %g: %s cannot hold a "
                                  "NaN or an infinity (the input's weights are damaged); nothing written", pos[0],
                                  tname, (long long)r, (long long)bad, (double)row[bad], moetax_type_name(types[i]));
                goto done;
            }
            moetax_from_float(types[i], row, out, t->ne[0]);
            if ((st = moetax_gguf_writer_write(w, out, rb_out))) goto done;
        }
        cli_progress_update(&bar, moetax_gguf_writer_data_written(w));
    }
    cli_progress_done(&bar);
    st = moetax_gguf_writer_finish(w);
done:
    moetax_gguf_writer_free(w);
    moetax_gguf_close(g);
    free(types);
    free(row);
    free(out);
    if (st) return cli_fail("quantize", st);
    fprintf(stderr, "moetax quantize: wrote %s (%s)\n", pos[1], moetax_type_name(to));
    return 0;
}
