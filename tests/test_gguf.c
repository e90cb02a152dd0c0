// ctest-labels: unit
/* test_gguf.c - GGUF round trip for every metadata and tensor type, the Q8_0/Q4_0
 * and f16/bf16 references, and malformed files (every truncation, huge counts,
 * bad offsets, overlaps, unknown types, invalid names) that must give a clear
 * error and never crash. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "moetax/gguf.h"
#include "testutil.h"

/* ---- a file with every metadata type and several tensor types ----------------- */

static const char *k_strs[] = {"alpha", "", "γάμμα", "line\nbreak"};

static void write_all_types(const char *path) {
    struct moetax_gguf_writer *w;
    CHECK(moetax_gguf_writer_init(path, &w) == MOETAX_OK);
    CHECK(moetax_gguf_writer_set_alignment(w, 64) == MOETAX_OK);
    CHECK(moetax_gguf_writer_set_u8(w, "t.u8", 250) == MOETAX_OK);
    CHECK(moetax_gguf_writer_set_i8(w, "t.i8", -120) == MOETAX_OK);
    CHECK(moetax_gguf_writer_set_u16(w, "t.u16", 65000) == MOETAX_OK);
    CHECK(moetax_gguf_writer_set_i16(w, "t.i16", -32000) == MOETAX_OK);
    CHECK(moetax_gguf_writer_set_u32(w, "t.u32", 4000000000u) == MOETAX_OK);
    CHECK(moetax_gguf_writer_set_i32(w, "t.i32", -2000000000) == MOETAX_OK);
    CHECK(moetax_gguf_writer_set_u64(w, "t.u64", 18000000000000000000ull) == MOETAX_OK);
    CHECK(moetax_gguf_writer_set_i64(w, "t.i64", -9000000000000000000ll) == MOETAX_OK);
    CHECK(moetax_gguf_writer_set_f32(w, "t.f32", 3.25f) == MOETAX_OK);
    CHECK(moetax_gguf_writer_set_f64(w, "t.f64", -1.0e300) == MOETAX_OK);
    CHECK(moetax_gguf_writer_set_bool(w, "t.bool", true) == MOETAX_OK);
    CHECK(moetax_gguf_writer_set_str(w, "t.str", "hello, мир") == MOETAX_OK);
    int32_t ai[5] = {1, -2, 3, -4, 5};
    float af[3] = {0.5f, -1.5f, 1e30f};
    uint8_t ab[4] = {1, 0, 1, 1};
    CHECK(moetax_gguf_writer_set_arr(w, "t.arr_i32", MOETAX_GGUF_TYPE_INT32, ai, 5) == MOETAX_OK);
    CHECK(moetax_gguf_writer_set_arr(w, "t.arr_f32", MOETAX_GGUF_TYPE_FLOAT32, af, 3) == MOETAX_OK);
    CHECK(moetax_gguf_writer_set_arr(w, "t.arr_bool", MOETAX_GGUF_TYPE_BOOL, ab, 4) == MOETAX_OK);
    CHECK(moetax_gguf_writer_set_arr(w, "t.arr_empty", MOETAX_GGUF_TYPE_UINT64, NULL, 0) == MOETAX_OK);
    CHECK(moetax_gguf_writer_set_arr_str(w, "t.arr_str", k_strs, 4) == MOETAX_OK);
    /* errors the writer must refuse */
    CHECK(moetax_gguf_writer_set_u8(w, "t.u8", 1) == MOETAX_ERR_ARG);          /* duplicate */
    CHECK(moetax_gguf_writer_set_u8(w, "", 1) == MOETAX_ERR_ARG);              /* empty key */
    CHECK(moetax_gguf_writer_set_u8(w, "bad\xff", 1) == MOETAX_ERR_ARG);       /* invalid UTF-8 */
    CHECK(moetax_gguf_writer_set_arr(w, "t.x", MOETAX_GGUF_TYPE_STRING, ai, 1) == MOETAX_ERR_ARG);

    /* tensors: f32, f16, bf16, q8_0, q4_0, and raw bytes of types moetax does not compute */
    int64_t ne_f[2] = {33, 3}, ne_q[3] = {64, 2, 2}, ne_k[1] = {256};
    CHECK(moetax_gguf_writer_add_tensor(w, "w.f32", MOETAX_TYPE_F32, 2, ne_f) == MOETAX_OK);
    CHECK(moetax_gguf_writer_add_tensor(w, "w.f16", MOETAX_TYPE_F16, 2, ne_f) == MOETAX_OK);
    CHECK(moetax_gguf_writer_add_tensor(w, "w.bf16", MOETAX_TYPE_BF16, 2, ne_f) == MOETAX_OK);
    CHECK(moetax_gguf_writer_add_tensor(w, "w.q8_0", MOETAX_TYPE_Q8_0, 3, ne_q) == MOETAX_OK);
    CHECK(moetax_gguf_writer_add_tensor(w, "w.q4_0", MOETAX_TYPE_Q4_0, 3, ne_q) == MOETAX_OK);
    CHECK(moetax_gguf_writer_add_tensor(w, "w.q4_k", MOETAX_TYPE_Q4_K, 1, ne_k) == MOETAX_OK);
    CHECK(moetax_gguf_writer_add_tensor(w, "w.f32", MOETAX_TYPE_F32, 2, ne_f) == MOETAX_ERR_ARG); /* duplicate */
    CHECK(moetax_gguf_writer_add_tensor(w, "w.bad", MOETAX_TYPE_Q8_0, 1, ne_f) == MOETAX_ERR_ARG); /* 33 % 32 */

    tu_rng r = {12345};
    float x[256];
    uint8_t buf[1024];
    for (int i = 0; i < 256; i++) x[i] = tu_rand_normal(&r);
    for (int t = 0; t < 3; t++) {
        enum moetax_type ty = t == 0 ? MOETAX_TYPE_F32 : t == 1 ? MOETAX_TYPE_F16 : MOETAX_TYPE_BF16;
        for (int row = 0; row < 3; row++) {
            CHECK(moetax_from_float(ty, x + row * 33, buf, 33));
            /* write in odd-sized pieces: the writer handles chunking */
            size_t n = moetax_row_size(ty, 33);
            CHECK(moetax_gguf_writer_write(w, buf, 7) == MOETAX_OK);
            CHECK(moetax_gguf_writer_write(w, buf + 7, n - 7) == MOETAX_OK);
        }
    }
    CHECK(moetax_from_float(MOETAX_TYPE_Q8_0, x, buf, 256));
    CHECK(moetax_gguf_writer_write(w, buf, moetax_row_size(MOETAX_TYPE_Q8_0, 256)) == MOETAX_OK);
    CHECK(moetax_from_float(MOETAX_TYPE_Q4_0, x, buf, 256));
    CHECK(moetax_gguf_writer_write(w, buf, moetax_row_size(MOETAX_TYPE_Q4_0, 256)) == MOETAX_OK);
    for (int i = 0; i < 144; i++) buf[i] = (uint8_t)i;
    CHECK(moetax_gguf_writer_write(w, buf, 144) == MOETAX_OK);
    CHECK(moetax_gguf_writer_write(w, buf, 1) == MOETAX_ERR_ARG); /* more than declared */
    moetax_gguf_writer_free(w);
}

static void write_good(const char *path) {
    struct moetax_gguf_writer *w;
    CHECK(moetax_gguf_writer_init(path, &w) == MOETAX_OK);
    CHECK(moetax_gguf_writer_set_u8(w, "t.u8", 250) == MOETAX_OK);
    CHECK(moetax_gguf_writer_set_arr_str(w, "t.arr_str", k_strs, 4) == MOETAX_OK);
    int64_t ne[2] = {32, 2};
    CHECK(moetax_gguf_writer_add_tensor(w, "a", MOETAX_TYPE_Q8_0, 2, ne) == MOETAX_OK);
    CHECK(moetax_gguf_writer_add_tensor(w, "b", MOETAX_TYPE_F32, 1, ne) == MOETAX_OK);
    uint8_t buf[256] = {0};
    CHECK(moetax_gguf_writer_write(w, buf, 68) == MOETAX_OK);
    CHECK(moetax_gguf_writer_write(w, buf, 128) == MOETAX_OK);
    CHECK(moetax_gguf_writer_finish(w) == MOETAX_OK);
    moetax_gguf_writer_free(w);
}

static void test_round_trip(void) {
    const char *path = tu_path("gguf_all_types.gguf");
    /* a writer freed without finish leaves nothing behind */
    remove(path);
    write_all_types(path);
    FILE *f = fopen(path, "rb");
    CHECK_MSG(f == NULL, "unfinished writer left %s", path);
    if (f) fclose(f);

    /* now write it fully */
    struct moetax_gguf_writer *w;
    CHECK(moetax_gguf_writer_init(path, &w) == MOETAX_OK);
    moetax_gguf_writer_free(w);
    write_good(path);
    struct moetax_gguf *g;
    CHECK(moetax_gguf_open(path, &g) == MOETAX_OK);
    if (g) {
        CHECK_EQ_INT(g->n_tensors, 2);
        CHECK_EQ_INT(g->data_offset % 32, 0);
        moetax_gguf_close(g);
    }
}

static void test_all_types(void) {
    const char *path = tu_path("gguf_all_types2.gguf");
    /* same as write_all_types but finished */
    struct moetax_gguf_writer *w;
    CHECK(moetax_gguf_writer_init(path, &w) == MOETAX_OK);
    CHECK(moetax_gguf_writer_set_alignment(w, 64) == MOETAX_OK);
    CHECK(moetax_gguf_writer_set_u8(w, "t.u8", 250) == MOETAX_OK);
    CHECK(moetax_gguf_writer_set_i8(w, "t.i8", -120) == MOETAX_OK);
    CHECK(moetax_gguf_writer_set_u16(w, "t.u16", 65000) == MOETAX_OK);
    CHECK(moetax_gguf_writer_set_i16(w, "t.i16", -32000) == MOETAX_OK);
    CHECK(moetax_gguf_writer_set_u32(w, "t.u32", 4000000000u) == MOETAX_OK);
    CHECK(moetax_gguf_writer_set_i32(w, "t.i32", -2000000000) == MOETAX_OK);
    CHECK(moetax_gguf_writer_set_u64(w, "t.u64", 18000000000000000000ull) == MOETAX_OK);
    CHECK(moetax_gguf_writer_set_i64(w, "t.i64", -9000000000000000000ll) == MOETAX_OK);
    CHECK(moetax_gguf_writer_set_f32(w, "t.f32", 3.25f) == MOETAX_OK);
    CHECK(moetax_gguf_writer_set_f64(w, "t.f64", -1.0e300) == MOETAX_OK);
    CHECK(moetax_gguf_writer_set_bool(w, "t.bool", true) == MOETAX_OK);
    CHECK(moetax_gguf_writer_set_str(w, "t.str", "hello, мир") == MOETAX_OK);
    int32_t ai[5] = {1, -2, 3, -4, 5};
    float af[3] = {0.5f, -1.5f, 1e30f};
    CHECK(moetax_gguf_writer_set_arr(w, "t.arr_i32", MOETAX_GGUF_TYPE_INT32, ai, 5) == MOETAX_OK);
    CHECK(moetax_gguf_writer_set_arr(w, "t.arr_f32", MOETAX_GGUF_TYPE_FLOAT32, af, 3) == MOETAX_OK);
    CHECK(moetax_gguf_writer_set_arr(w, "t.arr_empty", MOETAX_GGUF_TYPE_UINT64, NULL, 0) == MOETAX_OK);
    CHECK(moetax_gguf_writer_set_arr_str(w, "t.arr_str", k_strs, 4) == MOETAX_OK);
    enum moetax_type types[] = {MOETAX_TYPE_F32, MOETAX_TYPE_F16, MOETAX_TYPE_BF16, MOETAX_TYPE_Q8_0, MOETAX_TYPE_Q4_0};
    const char *names[] = {"w.f32", "w.f16", "w.bf16", "w.q8_0", "w.q4_0"};
    int64_t ne[3] = {64, 3, 2};
    for (int t = 0; t < 5; t++) CHECK(moetax_gguf_writer_add_tensor(w, names[t], types[t], 3, ne) == MOETAX_OK);
    int64_t ne_k[1] = {512};
    CHECK(moetax_gguf_writer_add_tensor(w, "w.q6_k", MOETAX_TYPE_Q6_K, 1, ne_k) == MOETAX_OK);
    tu_rng r = {777};
    static float x[5][384];
    static uint8_t enc[5][384 * 4];
    for (int t = 0; t < 5; t++) {
        for (int i = 0; i < 384; i++) x[t][i] = tu_rand_normal(&r) * (t + 1);
        CHECK(moetax_from_float(types[t], x[t], enc[t], 384));
        CHECK(moetax_gguf_writer_write(w, enc[t], moetax_row_size(types[t], 384)) == MOETAX_OK);
    }
    uint8_t k6[420];
    for (int i = 0; i < 420; i++) k6[i] = (uint8_t)(i * 7);
    CHECK(moetax_gguf_writer_write(w, k6, 420) == MOETAX_OK);
    CHECK(moetax_gguf_writer_finish(w) == MOETAX_OK);
    moetax_gguf_writer_free(w);

    struct moetax_gguf *g;
    moetax_status st = moetax_gguf_open(path, &g);
    CHECK_MSG(st == MOETAX_OK, "%s", moetax_last_error());
    if (st) return;
    CHECK_EQ_INT(g->version, 3);
    CHECK_EQ_INT(g->alignment, 64);
    CHECK_EQ_INT(g->data_offset % 64, 0);
    uint32_t u32; uint64_t u64; int64_t i64; float f; bool b; char s[64];
    CHECK(moetax_gguf_get_u32(g, "t.u8", &u32) == MOETAX_OK && u32 == 250);
    CHECK(moetax_gguf_get_i64(g, "t.i8", &i64) == MOETAX_OK && i64 == -120);
    CHECK(moetax_gguf_get_u32(g, "t.i8", &u32) == MOETAX_ERR_FORMAT); /* negative into unsigned */
    CHECK(moetax_gguf_get_u32(g, "t.u16", &u32) == MOETAX_OK && u32 == 65000);
    CHECK(moetax_gguf_get_i64(g, "t.i16", &i64) == MOETAX_OK && i64 == -32000);
    CHECK(moetax_gguf_get_u32(g, "t.u32", &u32) == MOETAX_OK && u32 == 4000000000u);
    CHECK(moetax_gguf_get_i64(g, "t.i32", &i64) == MOETAX_OK && i64 == -2000000000);
    CHECK(moetax_gguf_get_u64(g, "t.u64", &u64) == MOETAX_OK && u64 == 18000000000000000000ull);
    CHECK(moetax_gguf_get_u32(g, "t.u64", &u32) == MOETAX_ERR_FORMAT); /* does not fit */
    CHECK(moetax_gguf_get_i64(g, "t.i64", &i64) == MOETAX_OK && i64 == -9000000000000000000ll);
    CHECK(moetax_gguf_get_f32(g, "t.f32", &f) == MOETAX_OK && f == 3.25f);
    const struct moetax_gguf_kv *kv = moetax_gguf_find_kv(g, "t.f64");
    CHECK(kv && kv->type == MOETAX_GGUF_TYPE_FLOAT64 && kv->v.f64 == -1.0e300);
    CHECK(moetax_gguf_get_bool(g, "t.bool", &b) == MOETAX_OK && b);
    CHECK(moetax_gguf_get_str(g, "t.str", s, sizeof s) == MOETAX_OK && !strcmp(s, "hello, мир"));
    CHECK(moetax_gguf_get_str(g, "t.str", s, 4) == MOETAX_ERR_FORMAT); /* does not fit */
    CHECK(moetax_gguf_get_str(g, "t.u8", s, sizeof s) == MOETAX_ERR_FORMAT);
    CHECK(moetax_gguf_get_u32(g, "missing", &u32) == MOETAX_ERR_NOT_FOUND);
    CHECK(strstr(moetax_last_error(), "missing") != NULL);
    enum moetax_gguf_type at; uint64_t an;
    CHECK(moetax_gguf_get_arr(g, "t.arr_i32", &at, &an) == MOETAX_OK && at == MOETAX_GGUF_TYPE_INT32 && an == 5);
    kv = moetax_gguf_find_kv(g, "t.arr_i32");
    for (int i = 0; kv && i < 5; i++) { CHECK(moetax_gguf_arr_i64(kv, (uint64_t)i, &i64) && i64 == ai[i]); }
    CHECK(kv && !moetax_gguf_arr_i64(kv, 5, &i64));
    kv = moetax_gguf_find_kv(g, "t.arr_f32");
    double d;
    for (int i = 0; kv && i < 3; i++) { CHECK(moetax_gguf_arr_f64(kv, (uint64_t)i, &d) && (float)d == af[i]); }
    CHECK(moetax_gguf_get_arr(g, "t.arr_empty", &at, &an) == MOETAX_OK && an == 0 && at == MOETAX_GGUF_TYPE_UINT64);
    kv = moetax_gguf_find_kv(g, "t.arr_str");
    CHECK(kv && kv->arr_n == 4 && kv->arr_str);
    for (int i = 0; kv && kv->arr_str && i < 4; i++)
        CHECK(kv->arr_str[i].len == strlen(k_strs[i]) && !memcmp(kv->arr_str[i].data, k_strs[i], kv->arr_str[i].len));
    CHECK_EQ_INT(g->n_tensors, 6);
    for (int t = 0; t < 5; t++) {
        const struct moetax_gguf_tensor *tt = moetax_gguf_find_tensor(g, names[t]);
        CHECK(tt != NULL);
        if (!tt) continue;
        CHECK(tt->type == types[t] && tt->n_dims == 3 && tt->ne[0] == 64 && tt->ne[1] == 3 && tt->ne[2] == 2);
        CHECK(tt->offset % 64 == 0);
        CHECK_EQ_INT(tt->nbytes, moetax_row_size(types[t], 384));
        CHECK(memcmp(tt->data, enc[t], tt->nbytes) == 0);
        /* dequantized values within the type's error bound */
        float y[384];
        CHECK(moetax_to_float(types[t], tt->data, y, 384));
        double err = 0, mag = 0;
        for (int i = 0; i < 384; i++) { err = fmax(err, fabs(y[i] - x[t][i])); mag = fmax(mag, fabs(x[t][i])); }
        double bound = types[t] == MOETAX_TYPE_F32 ? 0 : types[t] == MOETAX_TYPE_F16 ? mag * 1e-3
                     : types[t] == MOETAX_TYPE_BF16 ? mag * 8e-3 : types[t] == MOETAX_TYPE_Q8_0 ? mag / 127 : mag / 7;
        CHECK_MSG(err <= bound, "%s: max error %g > %g", names[t], err, bound);
    }
    const struct moetax_gguf_tensor *k = moetax_gguf_find_tensor(g, "w.q6_k");
    CHECK(k && k->type == MOETAX_TYPE_Q6_K && k->nbytes == 420 && !memcmp(k->data, k6, 420));
    CHECK(moetax_gguf_find_tensor(g, "nope") == NULL);

    /* copy every kv into a new file, byte for byte the same metadata */
    const char *path2 = tu_path("gguf_copy.gguf");
    CHECK(moetax_gguf_writer_init(path2, &w) == MOETAX_OK);
    for (uint64_t i = 0; i < g->n_kv; i++) CHECK(moetax_gguf_writer_copy_kv(w, g, &g->kv[i]) == MOETAX_OK);
    CHECK(moetax_gguf_writer_finish(w) == MOETAX_OK);
    moetax_gguf_writer_free(w);
    struct moetax_gguf *g2;
    CHECK(moetax_gguf_open(path2, &g2) == MOETAX_OK);
    if (g2) {
        CHECK_EQ_INT(g2->n_kv, g->n_kv);
        for (uint64_t i = 0; i < g->n_kv && i < g2->n_kv; i++)
            CHECK(g2->kv[i].value_size == g->kv[i].value_size &&
                  !memcmp(g2->base + g2->kv[i].value_offset, g->base + g->kv[i].value_offset, g->kv[i].value_size));
        moetax_gguf_close(g2);
    }
    moetax_gguf_close(g);
}

/* ---- scalar conversions --------------------------------------------------------- */

static void test_conversions(void) {
    /* every finite half survives f16 -> f32 -> f16 */
    int bad = 0;
    for (uint32_t h = 0; h < 65536; h++) {
        if ((h & 0x7c00) == 0x7c00) continue; /* inf/nan */
        if (moetax_fp32_to_fp16(moetax_fp16_to_fp32((uint16_t)h)) != h) bad++;
    }
    CHECK_EQ_INT(bad, 0);
    CHECK(moetax_fp16_to_fp32(0x3c00) == 1.0f);
    CHECK(moetax_fp16_to_fp32(0xc000) == -2.0f);
    CHECK(moetax_fp16_to_fp32(0x0001) == 5.9604644775390625e-8f);
    CHECK(moetax_fp32_to_fp16(65504.0f) == 0x7bff);
    CHECK(moetax_fp32_to_fp16(70000.0f) == 0x7c00);
    CHECK(moetax_fp32_to_fp16(1.0f + 1.0f / 2048) == 0x3c00);             /* tie to even */
    CHECK(moetax_fp32_to_fp16(1.0f + 3.0f / 2048) == 0x3c02);             /* tie to even, up */
    CHECK(isnan(moetax_fp16_to_fp32(moetax_fp32_to_fp16(NAN))));
    CHECK(moetax_bf16_to_fp32(moetax_fp32_to_bf16(1.5f)) == 1.5f);
    CHECK(moetax_fp32_to_bf16(1.0f + 1.0f / 256) == 0x3f80);              /* tie to even */
    CHECK(isnan(moetax_bf16_to_fp32(moetax_fp32_to_bf16(NAN))));

    /* Q8_0 and Q4_0 on known blocks */
    float x[32];
    for (int i = 0; i < 32; i++) x[i] = (float)(i - 16) / 4.0f; /* -4 .. 3.75 */
    moetax_block_q8_0 q8;
    moetax_quantize_row_q8_0_ref(x, &q8, 32);
    CHECK(moetax_fp16_to_fp32(q8.d) == moetax_fp16_to_fp32(moetax_fp32_to_fp16(4.0f / 127)));
    CHECK(q8.qs[0] == -127 && q8.qs[16] == 0);
    moetax_block_q4_0 q4;
    moetax_quantize_row_q4_0_ref(x, &q4, 32);
    CHECK(moetax_fp16_to_fp32(q4.d) == 0.5f); /* max by magnitude is -4: d = -4 / -8 */
    float y[32];
    moetax_dequantize_row_q4_0_ref(&q4, y, 32);
    CHECK(y[0] == -4.0f && y[16] == 0.0f);
    for (int i = 0; i < 32; i++) CHECK_MSG(fabsf(y[i] - x[i]) <= 0.25f + 1e-6f, "q4_0 %d: %g vs %g", i, y[i], x[i]);
    /* all zeros: scale 0, values 0 */
    float z[32] = {0};
    moetax_quantize_row_q8_0_ref(z, &q8, 32);
    moetax_dequantize_row_q8_0_ref(&q8, y, 32);
    for (int i = 0; i < 32; i++) CHECK(y[i] == 0.0f);
    /* random rows: error bound d/2 per value */
    tu_rng r = {99};
    for (int rep = 0; rep < 100; rep++) {
        for (int i = 0; i < 32; i++) x[i] = tu_rand_normal(&r) * (float)(rep + 1);
        moetax_quantize_row_q8_0_ref(x, &q8, 32);
        moetax_dequantize_row_q8_0_ref(&q8, y, 32);
        float d8 = moetax_fp16_to_fp32(q8.d);
        for (int i = 0; i < 32; i++) CHECK(fabsf(y[i] - x[i]) <= d8 * 0.5f + fabsf(x[i]) * 1e-3f);
        moetax_quantize_row_q4_0_ref(x, &q4, 32);
        moetax_dequantize_row_q4_0_ref(&q4, y, 32);
        float d4 = fabsf(moetax_fp16_to_fp32(q4.d));
        for (int i = 0; i < 32; i++) CHECK(fabsf(y[i] - x[i]) <= d4 * 1.0f + fabsf(x[i]) * 1e-3f);
    }
    /* type table */
    CHECK_EQ_INT(moetax_type_size(MOETAX_TYPE_Q8_0), 34);
    CHECK_EQ_INT(moetax_type_size(MOETAX_TYPE_Q4_0), 18);
    CHECK_EQ_INT(moetax_row_size(MOETAX_TYPE_Q8_0, 33), 0);
    CHECK(!moetax_type_valid(4) && !moetax_type_valid(31) && !moetax_type_valid(1000));
    enum moetax_type t;
    CHECK(moetax_type_from_name("Q8_0", &t) && t == MOETAX_TYPE_Q8_0);
    CHECK(!moetax_type_from_name("q9_9", &t));
}

/* ---- malformed files -------------------------------------------------------------- */

static uint8_t *read_all(const char *path, size_t *n) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    long sz = ftell(f);
    fseek(f, 0, SEEK_SET);
    uint8_t *b = malloc((size_t)sz);
    if (b && fread(b, 1, (size_t)sz, f) != (size_t)sz) { free(b); b = NULL; }
    fclose(f);
    *n = (size_t)sz;
    return b;
}

/* parse a buffer (copied into an exactly-sized allocation so ASan sees overreads) */
static moetax_status parse_copy(const uint8_t *b, size_t n) {
    uint8_t *c = malloc(n ? n : 1);
    memcpy(c, b, n);
    struct moetax_gguf *g;
    moetax_status st = moetax_gguf_open_memory(c, n, &g);
    if (!st) moetax_gguf_close(g);
    free(c);
    return st;
}

static void expect_format_error(const uint8_t *b, size_t n, const char *what, const char *needle) {
    moetax_clear_error();
    moetax_status st = parse_copy(b, n);
    CHECK_MSG(st == MOETAX_ERR_FORMAT, "%s: got %s", what, moetax_status_name(st));
    CHECK_MSG(strlen(moetax_last_error()) > 10, "%s: no message", what);
    if (needle) CHECK_MSG(strstr(moetax_last_error(), needle) != NULL, "%s: message '%s' lacks '%s'", what,
                          moetax_last_error(), needle);
}

static void put_u64(uint8_t *p, uint64_t v) { memcpy(p, &v, 8); }
static void put_u32(uint8_t *p, uint32_t v) { memcpy(p, &v, 4); }

/* moetax_tensor_nbytes: the one checked size helper (issue 21) */
static void test_nbytes(void) {
    uint64_t nb = 0;
    int64_t nel = 0;
    int64_t ok[2] = {64, 3};
    CHECK(moetax_tensor_nbytes(MOETAX_TYPE_Q8_0, 2, ok, &nb, &nel) == MOETAX_NBYTES_OK && nb == 2 * 34 * 3 && nel == 192);
    int64_t big0[1] = {INT64_C(1) << 62};
    CHECK(moetax_tensor_nbytes(MOETAX_TYPE_F32, 1, big0, &nb, NULL) == MOETAX_NBYTES_OVERFLOW);
    CHECK(moetax_tensor_nbytes(MOETAX_TYPE_F16, 1, big0, &nb, NULL) == MOETAX_NBYTES_OVERFLOW); /* 2^63 > INT64_MAX */
    CHECK(moetax_tensor_nbytes(MOETAX_TYPE_Q8_0, 1, big0, &nb, NULL) == MOETAX_NBYTES_OK && nb == (UINT64_C(1) << 57) * 34);
    int64_t big1[2] = {32, INT64_C(1) << 62};
    CHECK(moetax_tensor_nbytes(MOETAX_TYPE_F32, 2, big1, &nb, NULL) == MOETAX_NBYTES_OVERFLOW);
    int64_t odd[1] = {33};
    CHECK(moetax_tensor_nbytes(MOETAX_TYPE_Q4_0, 1, odd, &nb, NULL) == MOETAX_NBYTES_NOT_BLOCKS);
    int64_t zero[2] = {32, 0};
    CHECK(moetax_tensor_nbytes(MOETAX_TYPE_F32, 2, zero, &nb, NULL) == MOETAX_NBYTES_BAD_DIM);
    CHECK(moetax_tensor_nbytes((enum moetax_type)4, 1, ok, &nb, NULL) == MOETAX_NBYTES_BAD_TYPE);
    CHECK(moetax_row_size(MOETAX_TYPE_F32, INT64_C(1) << 62) == 0);
    CHECK(moetax_row_size(MOETAX_TYPE_Q8_0, 64) == 68);
}

static void test_malformed(void) {
    const char *path = tu_path("gguf_good.gguf");
    write_good(path);
    size_t n;
    uint8_t *good = read_all(path, &n);
    CHECK(good != NULL);
    if (!good) return;
    CHECK(parse_copy(good, n) == MOETAX_OK);
    /* layout of write_good: header 24 | kv "t.u8" u8 | kv "t.arr_str" | tensor infos a, b | pad | data */
    size_t kv0 = 24, kv1 = kv0 + 8 + 4 + 4 + 1;
    size_t ti0 = kv1 + 8 + 9 + 4 + 4 + 8;
    for (int i = 0; i < 4; i++) ti0 += 8 + strlen(k_strs[i]);
    size_t ti1 = ti0 + 8 + 1 + 4 + 16 + 4 + 8;
    size_t hdr_end = ti1 + 8 + 1 + 4 + 8 + 4 + 8;
    CHECK(good[ti0 + 8] == 'a' && good[ti1 + 8] == 'b');

    /* every truncation of the header, and of the data, is an error */
    for (size_t k = 0; k < n; k++) {
        moetax_status st = parse_copy(good, k);
        if (st != MOETAX_ERR_FORMAT) {
            CHECK_MSG(0, "truncated to %zu bytes: got %s", k, moetax_status_name(st));
            break;
        }
    }
    expect_format_error(good, 2, "2 bytes", "byte 0");
    expect_format_error(good, hdr_end - 3, "cut tensor info", "tensor 'b'");
    expect_format_error(good, n - 1, "cut data", "past the end");

    uint8_t *b = malloc(n);
#define MUTATE(code, what, needle) do { memcpy(b, good, n); code; expect_format_error(b, n, what, needle); } while (0)
    MUTATE(b[0] = 'X', "bad magic", "magic");
    MUTATE(put_u32(b + 4, 7), "bad version", "version 7");
    MUTATE(put_u64(b + 8, 1ull << 60), "huge tensor count", "tensor count");
    MUTATE(put_u64(b + 16, 1ull << 60), "huge kv count", "metadata count");
    MUTATE(put_u64(b + 16, 3), "kv count one too many", NULL);
    MUTATE(put_u64(b + kv0, 1ull << 62), "huge key length", "string length");
    MUTATE(put_u64(b + kv0, 0), "empty key", "empty name");
    MUTATE(b[kv0 + 8] = 0xff, "key not UTF-8", "UTF-8");
    MUTATE(b[kv0 + 9] = 0, "key with NUL", "UTF-8");
    MUTATE(put_u32(b + kv0 + 12, 13), "unknown value type", "unknown value type 13");
    MUTATE(put_u32(b + kv1 + 21, 99), "unknown array element type", "array element type");
    MUTATE(put_u64(b + kv1 + 25, 1ull << 61), "huge array count", "cannot fit");
    MUTATE(put_u64(b + kv1 + 33, 1ull << 40), "huge string in array", "string length");
    MUTATE(put_u32(b + ti0 + 9, 0), "n_dims 0", "n_dims 0");
    MUTATE(put_u32(b + ti0 + 9, 5), "n_dims 5", "n_dims 5");
    MUTATE(put_u64(b + ti0 + 13, 0), "zero dimension", "dimension 0");
    MUTATE(put_u64(b + ti0 + 21, 1ull << 62), "huge dimension", "dimension 1");
    MUTATE(put_u32(b + ti0 + 29, 4), "removed tensor type 4", "unknown tensor type 4");
    MUTATE(put_u32(b + ti0 + 29, 1000), "unknown tensor type", "unknown tensor type 1000");
    MUTATE(put_u64(b + ti0 + 13, 33), "ne0 not a multiple of the block", "block size");
    MUTATE(put_u64(b + ti0 + 33, 8), "unaligned offset", "alignment");
    MUTATE(put_u64(b + ti1 + 25, 64), "overlapping tensors", "overlap");
    MUTATE(put_u64(b + ti1 + 25, 1ull << 40), "offset past end", "past the end");
    MUTATE(put_u64(b + ti1 + 25, UINT64_MAX - 31), "offset overflow", "past the end");
    /* issue 21: F32 with ne0 = 2^62 had byte size 2^64 = 0 and passed the bounds checks */
    MUTATE(put_u64(b + ti1 + 13, 1ull << 62), "F32 ne0 = 2^62", "tensor 'b': byte size overflows");
    MUTATE(put_u64(b + ti1 + 13, 1ull << 61), "F32 ne0 = 2^61", "tensor 'b': byte size overflows");
    MUTATE(put_u64(b + ti1 + 13, 1ull << 40), "F32 ne0 = 2^40", "past the end");
    MUTATE(b[ti1 + 8] = 'a', "duplicate tensor name", "twice");
    MUTATE(b[ti1 + 8] = 0x80, "tensor name not UTF-8", "UTF-8");
#undef MUTATE
    free(b);

    /* general.alignment of the wrong type or not a power of two */
    struct moetax_gguf_writer *w;
    const char *p2 = tu_path("gguf_badalign.gguf");
    CHECK(moetax_gguf_writer_init(p2, &w) == MOETAX_OK);
    CHECK(moetax_gguf_writer_set_u64(w, "general.alignment", 32) == MOETAX_OK);
    CHECK(moetax_gguf_writer_finish(w) == MOETAX_OK);
    moetax_gguf_writer_free(w);
    size_t n2;
    uint8_t *b2 = read_all(p2, &n2);
    if (b2) {
        expect_format_error(b2, n2, "alignment as u64", "general.alignment");
        free(b2);
    }
    CHECK(moetax_gguf_writer_init(p2, &w) == MOETAX_OK);
    CHECK(moetax_gguf_writer_set_alignment(w, 48) == MOETAX_ERR_ARG);
    moetax_gguf_writer_free(w);

    /* duplicate keys */
    CHECK(moetax_gguf_writer_init(p2, &w) == MOETAX_OK);
    CHECK(moetax_gguf_writer_set_u8(w, "k.a1", 1) == MOETAX_OK);
    CHECK(moetax_gguf_writer_set_u8(w, "k.a2", 2) == MOETAX_OK);
    CHECK(moetax_gguf_writer_finish(w) == MOETAX_OK);
    moetax_gguf_writer_free(w);
    b2 = read_all(p2, &n2);
    if (b2) {
        CHECK(parse_copy(b2, n2) == MOETAX_OK);
        b2[24 + 8 + 3] = '2';
        expect_format_error(b2, n2, "duplicate key", "twice");
        free(b2);
    }

    /* deeply nested arrays are refused, not recursed into */
    uint8_t nest[24 + 8 + 1 + 4 + 12 * 20];
    memset(nest, 0, sizeof nest);
    memcpy(nest, "GGUF", 4);
    put_u32(nest + 4, 3);
    put_u64(nest + 8, 0);
    put_u64(nest + 16, 1);
    put_u64(nest + 24, 1);
    nest[32] = 'k';
    put_u32(nest + 33, MOETAX_GGUF_TYPE_ARRAY);
    for (int i = 0; i < 20; i++) {
        put_u32(nest + 37 + 12 * i, MOETAX_GGUF_TYPE_ARRAY);
        put_u64(nest + 41 + 12 * i, 1);
    }
    expect_format_error(nest, sizeof nest, "nested arrays", "nested");

    /* file-level errors */
    struct moetax_gguf *g;
    CHECK(moetax_gguf_open(tu_path("does-not-exist.gguf"), &g) == MOETAX_ERR_IO);
    CHECK(strstr(moetax_last_error(), "does-not-exist.gguf") != NULL);
    CHECK(moetax_gguf_open(tu_workdir, &g) == MOETAX_ERR_IO); /* a directory */
    const char *empty = tu_path("gguf_empty.gguf");
    FILE *f = fopen(empty, "wb");
    if (f) fclose(f);
    CHECK(moetax_gguf_open(empty, &g) == MOETAX_ERR_FORMAT);
    CHECK(strstr(moetax_last_error(), "empty") != NULL);
    free(good);
}

int main(int argc, char **argv) {
    tu_init(argc, argv);
    test_conversions();
    test_round_trip();
    test_all_types();
    test_nbytes();
    test_malformed();
    return tu_finish("test_gguf");
}
