/* fuzz_files.c - libFuzzer target for the side files moetax reads besides models: a ledger or a
 * trace (`report`, moetax_report_parse, then its HTML page), a routing profile (`report PROFILE`,
 * `--warm`, `--ep-load`: moetax_profile_from_json) and a learned predictor (`--predictor`: the
 * binary file of moetax_predictor_load, for the tiny preset's shape: 3 layers of 64, layer 0 dense,
 * 8 experts). The first byte of an input chooses the reader (its value mod 3: 0 report, 1 profile,
 * 2 predictor). A predictor's trailing FNV-1a 64 checksum is made right before it is loaded, so
 * that mutations reach the fields behind it rather than stop at the sum. Each file must load or be
 * refused with a message, never crash, leak, overread or take unbounded memory. Built with
 * -DMOETAX_FUZZ=ON (clang); fuzz_files_seed.sh seeds it with files the release build writes. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE /* memfd_create */
#endif
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include <jansson.h>

#include "moetax/predict.h"
#include "moetax/profile.h"
#include "moetax/report.h"
#include "moetax/status.h"

/* A failed call must leave a message (the trap makes libFuzzer report the input); FUZZ_FILES_SAY=1
 * prints it (to see that the seeds load). */
static void must_say(moetax_status st) {
    if (st != MOETAX_OK && moetax_last_error()[0] == 0) __builtin_trap();
    if (st != MOETAX_OK && getenv("FUZZ_FILES_SAY")) fprintf(stderr, "fuzz_files: %s\n", moetax_last_error());
    moetax_clear_error();
}

static void fuzz_report(const uint8_t *data, size_t size) {
    static FILE *null_out;
    if (!null_out && !(null_out = fopen("/dev/null", "w"))) __builtin_trap();
    struct moetax_report *r = NULL;
    for (int decode_only = 0; decode_only < 2; decode_only++) {
        const struct moetax_report_params p = {.decode_only = decode_only};
        moetax_status st = moetax_report_parse((const char *)data, size, "fuzz", &p, &r);
        must_say(st);
        if (st) return;
        const struct moetax_report_agg *a = moetax_report_sel(r);
        volatile double sink = moetax_report_tax_share(a) + moetax_report_phase_total(a);
        (void)sink;
        must_say(moetax_report_write_html(r, null_out));
        moetax_report_free(r);
        r = NULL;
    }
}

static void fuzz_profile(const uint8_t *data, size_t size) {
    json_error_t je;
    json_t *doc = json_loadb((const char *)data, size, 0, &je);
    if (!doc) return;
    struct moetax_profile *p = NULL;
    moetax_status st = moetax_profile_from_json(doc, "fuzz", &p);
    must_say(st);
    if (!st) { /* what --warm and the report read: every count */
        int64_t sum = 0;
        const int64_t E = p->n_expert;
        for (int m = 0; m < p->n_moe; m++)
            for (int64_t e = 0; e < E; e++) {
                sum += p->freq[m * E + e];
                if (p->co) sum += p->co[(m * E + e) * E + e];
                if (m + 1 < p->n_moe) sum += p->trans[(m * E + e) * E + (E - 1 - e)];
            }
        volatile int64_t sink = sum + p->moe_layer[p->n_moe > 0 ? p->n_moe - 1 : 0];
        (void)sink;
        moetax_profile_free(p);
    }
    json_decref(doc);
}

static uint64_t fnv1a64(const uint8_t *b, size_t n) {
    uint64_t h = 0xcbf29ce484222325ull;
    for (size_t i = 0; i < n; i++) h = (h ^ b[i]) * 0x100000001b3ull;
    return h;
}

static void fuzz_predictor(const uint8_t *data, size_t size) {
    static int fd = -1;
    if (fd < 0 && (fd = memfd_create("fuzz_files_pred", 0)) < 0) __builtin_trap();
    uint8_t *b = malloc(size ? size : 1);
    if (!b) __builtin_trap();
    memcpy(b, data, size);
    if (size >= 8) { /* the writer's checksum over everything before it, little-endian */
        uint64_t h = fnv1a64(b, size - 8);
        for (int i = 0; i < 8; i++) b[size - 8 + i] = (uint8_t)(h >> (8 * i));
    }
    if (ftruncate(fd, 0) != 0 || pwrite(fd, b, size, 0) != (ssize_t)size) __builtin_trap();
    free(b);
    char path[64];
    snprintf(path, sizeof path, "/proc/self/fd/%d", fd);
    static const bool is_moe[3] = {false, true, true};
    const struct moetax_predict_model model = {.n_layer = 3, .n_embd = 64, .n_expert = 8, .is_moe = is_moe};
    struct moetax_predictor *p = NULL;
    moetax_status st = moetax_predictor_load(path, &model, &p);
    must_say(st);
    if (st) return;
    /* every pair it holds evaluated once, as the engine's prefetch would */
    float *f = calloc((size_t)p->n_feat, sizeof(float)), *z = malloc(sizeof(float) * (size_t)p->n_expert);
    float *scratch = malloc(sizeof(float) * (size_t)(p->n_hidden > 0 ? p->n_hidden : 1));
    if (!f || !z || !scratch) __builtin_trap();
    for (int i = 0; i < p->n_feat; i++) f[i] = (float)(i % 7) - 3.0f;
    for (int l = 0; l < p->n_layer; l++)
        for (int a = 1; a <= p->ahead; a++)
            if (p->have[l * p->ahead + a - 1]) moetax_predictor_eval(p, l, a, f, z, scratch);
    free(f), free(z), free(scratch);
    moetax_predictor_free(p);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 1) return 0;
    const int kind = data[0] % 3;
    data++, size--;
    if (kind == 0) fuzz_report(data, size);
    else if (kind == 1) fuzz_profile(data, size);
    else fuzz_predictor(data, size);
    moetax_clear_error();
    return 0;
}
