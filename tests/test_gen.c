// ctest-labels: unit
/* test_gen.c - `moetax gen` output read back: every key and tensor shape checked
 * against the layout in shared/docs/GGUF-MOE.md (computed here independently of
 * the generator), type rules, determinism, dense twins, and the CLI's errors. */
#include <stdlib.h>
#include <string.h>

#include "moetax/gen.h"
#include "moetax/gguf.h"
#include "moetax/tokenizer.h"
#include "testutil.h"

struct shape {
    int vocab, d, L, lead, ff, H, ql, kvl, nope, rope, vh, E, k, S, F, G, Gu;
    bool fused, merged, twin;
};

static void check_tensor(struct moetax_gguf *g, const char *name, int n_dims, int64_t a, int64_t b, int64_t c,
                         enum moetax_type want) {
    const struct moetax_gguf_tensor *t = moetax_gguf_find_tensor(g, name);
    CHECK_MSG(t != NULL, "tensor %s missing", name);
    if (!t) return;
    int64_t ne[3] = {a, b, c};
    CHECK_MSG((int)t->n_dims == n_dims, "%s: n_dims %u, want %d", name, t->n_dims, n_dims);
    for (int i = 0; i < n_dims; i++)
        CHECK_MSG(t->ne[i] == ne[i], "%s: ne[%d] = %lld, want %lld", name, i, (long long)t->ne[i], (long long)ne[i]);
    /* rows the blocks do not fit: a k-quant (256-value blocks) takes q5_0 (q4_k), q5_1 (q5_k), q8_0 (q6_k)
     * or q8_0 (q6_k, q2_k, q3_k) where 32 fits, else f16 */
    enum moetax_type ty = want;
    if (ty != MOETAX_TYPE_F32 && a % moetax_type_blck_size(ty))
        ty = moetax_type_blck_size(ty) == 256 && a % 32 == 0
                 ? (want == MOETAX_TYPE_Q4_K   ? MOETAX_TYPE_Q5_0
                    : want == MOETAX_TYPE_Q5_K ? MOETAX_TYPE_Q5_1
                                               : MOETAX_TYPE_Q8_0)
                 : MOETAX_TYPE_F16;
    CHECK_MSG(t->type == ty, "%s: type %s, want %s", name, moetax_type_name(t->type), moetax_type_name(ty));
}

static uint32_t u32(struct moetax_gguf *g, const char *key) {
    char k[128];
    snprintf(k, sizeof k, "deepseek2.%s", key);
    uint32_t v = 0xffffffffu;
    CHECK_MSG(moetax_gguf_get_u32(g, k, &v) == MOETAX_OK, "%s", moetax_last_error());
    return v;
}

static void check_model(const char *path, const struct shape *s, enum moetax_type wt, bool v3) {
    struct moetax_gguf *g;
    moetax_status st = moetax_gguf_open(path, &g);
    CHECK_MSG(st == MOETAX_OK, "%s", moetax_last_error());
    if (st) return;
    char str[64];
    CHECK(moetax_gguf_get_str(g, "general.architecture", str, sizeof str) == MOETAX_OK && !strcmp(str, "deepseek2"));
    /* llama_ftype as llama-quantize writes it: ALL_F32 0, MOSTLY_F16 1, Q4_0 2, Q4_1 3, Q8_0 7, Q5_0 8, Q5_1 9, Q2_K 10, IQ4_NL 25,
     * Q3_K_M 12, Q4_K_M 15, Q5_K_M 17, Q6_K 18, BF16 32 */
    static const struct { enum moetax_type t; uint32_t ft; } fts[] = {
        {MOETAX_TYPE_F32, 0}, {MOETAX_TYPE_F16, 1}, {MOETAX_TYPE_Q4_0, 2}, {MOETAX_TYPE_Q8_0, 7}, {MOETAX_TYPE_Q2_K, 10},
        {MOETAX_TYPE_Q3_K, 12}, {MOETAX_TYPE_Q4_K, 15}, {MOETAX_TYPE_Q5_K, 17}, {MOETAX_TYPE_Q6_K, 18},
        {MOETAX_TYPE_BF16, 32}, {MOETAX_TYPE_Q5_0, 8}, {MOETAX_TYPE_Q4_1, 3}, {MOETAX_TYPE_Q5_1, 9},
        {MOETAX_TYPE_IQ4_NL, 25}};
    uint32_t ftype = 0xffffffffu, want_ft = 0xfffffffeu;
    for (size_t i = 0; i < sizeof fts / sizeof fts[0]; i++)
        if (fts[i].t == wt) want_ft = fts[i].ft;
    CHECK(moetax_gguf_get_u32(g, "general.file_type", &ftype) == MOETAX_OK);
    CHECK_MSG(ftype == want_ft, "%s: general.file_type %u, want %u", moetax_type_name(wt), ftype, want_ft);
    CHECK_EQ_INT(u32(g, "embedding_length"), s->d);
    CHECK_EQ_INT(u32(g, "block_count"), s->L);
    CHECK_EQ_INT(u32(g, "attention.head_count"), s->H);
    CHECK_EQ_INT(u32(g, "attention.kv_lora_rank"), s->kvl);
    CHECK_EQ_INT(u32(g, "rope.dimension_count"), s->rope);
    CHECK_EQ_INT(u32(g, "leading_dense_block_count"), s->twin ? s->L : s->lead);
    float eps;
    CHECK(moetax_gguf_get_f32(g, "deepseek2.attention.layer_norm_rms_epsilon", &eps) == MOETAX_OK && eps > 0);
    if (s->merged) {
        CHECK_EQ_INT(u32(g, "attention.head_count_kv"), s->H);
        CHECK_EQ_INT(u32(g, "attention.key_length"), s->nope + s->rope);
        CHECK_EQ_INT(u32(g, "attention.value_length"), s->vh);
    } else {
        CHECK_EQ_INT(u32(g, "attention.head_count_kv"), 1);
        CHECK_EQ_INT(u32(g, "attention.key_length"), s->kvl + s->rope);
        CHECK_EQ_INT(u32(g, "attention.value_length"), s->kvl);
        CHECK_EQ_INT(u32(g, "attention.key_length_mla"), s->nope + s->rope);
        CHECK_EQ_INT(u32(g, "attention.value_length_mla"), s->vh);
    }
    if (!s->twin) {
        CHECK_EQ_INT(u32(g, "expert_count"), s->E);
        CHECK_EQ_INT(u32(g, "expert_used_count"), s->k);
        CHECK_EQ_INT(u32(g, "expert_shared_count"), s->S);
        CHECK_EQ_INT(u32(g, "expert_feed_forward_length"), s->F);
        CHECK_EQ_INT(u32(g, "expert_gating_func"), v3 ? 2 : 1);
        bool norm;
        CHECK(moetax_gguf_get_bool(g, "deepseek2.expert_weights_norm", &norm) == MOETAX_OK && norm == v3);
        if (s->G > 1) {
            CHECK_EQ_INT(u32(g, "expert_group_count"), s->G);
            CHECK_EQ_INT(u32(g, "expert_group_used_count"), s->Gu);
        }
    }
    /* tokenizer: tokens count equals the rows of token_embd, merges present, ids in range */
    enum moetax_gguf_type at;
    uint64_t n_tok = 0, n_merges = 0;
    CHECK(moetax_gguf_get_arr(g, "tokenizer.ggml.tokens", &at, &n_tok) == MOETAX_OK && at == MOETAX_GGUF_TYPE_STRING);
    CHECK_EQ_INT(n_tok, s->vocab);
    CHECK(moetax_gguf_get_arr(g, "tokenizer.ggml.merges", &at, &n_merges) == MOETAX_OK && n_merges > 10);
    CHECK(moetax_gguf_get_arr(g, "tokenizer.ggml.token_type", &at, &n_tok) == MOETAX_OK && n_tok == (uint64_t)s->vocab);
    CHECK(moetax_gguf_get_str(g, "tokenizer.ggml.model", str, sizeof str) == MOETAX_OK && !strcmp(str, "gpt2"));
    CHECK(u32(g, "vocab_size") == (uint32_t)s->vocab);
    uint32_t bos = 0, eos = 0;
    CHECK(moetax_gguf_get_u32(g, "tokenizer.ggml.bos_token_id", &bos) == MOETAX_OK && bos < (uint32_t)s->vocab);
    CHECK(moetax_gguf_get_u32(g, "tokenizer.ggml.eos_token_id", &eos) == MOETAX_OK && eos < (uint32_t)s->vocab);
    /* every id but BOS/EOS decodes to text (a random model's samples show in a stream), and text
     * never encodes to the made-up words past the merges (ids > EOS) */
    struct moetax_tokenizer *tk = NULL;
    CHECK_EQ_INT(moetax_tokenizer_load(g, &tk), MOETAX_OK);
    if (tk) {
        int empty = 0, control = 0;
        for (int32_t id = 0; id < s->vocab; id++) {
            char buf[64];
            const int nb = moetax_tokenizer_token_to_bytes(tk, id, buf, sizeof buf);
            if (moetax_tokenizer_token_type(tk, id) == MOETAX_TOKEN_TYPE_CONTROL) control++;
            else empty += nb <= 0;
        }
        CHECK_EQ_INT(control, 2);
        CHECK_EQ_INT(empty, 0);
        static const char text[] = "def main(argv=None):\n    for i in range(10):\n        print(i) # quick brown fox\n"
                                   "The bakelo and the gidafe zz qq 12345 {}[]<>";
        int32_t ids[256];
        int64_t n = 0;
        CHECK_EQ_INT(moetax_tokenizer_encode(tk, text, sizeof text - 1, false, ids, 256, &n), MOETAX_OK);
        int past = 0;
        for (int64_t i = 0; i < n; i++) past += ids[i] > (int32_t)eos;
        CHECK_MSG(n > 10 && past == 0, "%lld ids, %d past EOS", (long long)n, past);
        moetax_tokenizer_free(tk);
    }

    const enum moetax_type F32 = MOETAX_TYPE_F32;
    int n_expected = 3;
    char nm[96];
    check_tensor(g, "token_embd.weight", 2, s->d, s->vocab, 1, wt);
    check_tensor(g, "output_norm.weight", 1, s->d, 1, 1, F32);
    check_tensor(g, "output.weight", 2, s->d, s->vocab, 1, wt);
    for (int il = 0; il < s->L; il++) {
#define T(suffix, nd, a, b, c, ty) do { snprintf(nm, sizeof nm, "blk.%d." suffix, il); check_tensor(g, nm, nd, a, b, c, ty); n_expected++; } while (0)
        T("attn_norm.weight", 1, s->d, 1, 1, F32);
        if (s->ql) {
            T("attn_q_a.weight", 2, s->d, s->ql, 1, wt);
            T("attn_q_a_norm.weight", 1, s->ql, 1, 1, F32);
            T("attn_q_b.weight", 2, s->ql, s->H * (s->nope + s->rope), 1, wt);
        } else {
            T("attn_q.weight", 2, s->d, s->H * (s->nope + s->rope), 1, wt);
        }
        T("attn_kv_a_mqa.weight", 2, s->d, s->kvl + s->rope, 1, wt);
        T("attn_kv_a_norm.weight", 1, s->kvl, 1, 1, F32);
        if (s->merged) {
            T("attn_kv_b.weight", 2, s->kvl, s->H * (s->nope + s->vh), 1, wt);
        } else {
            T("attn_k_b.weight", 3, s->nope, s->kvl, s->H, wt);
            T("attn_v_b.weight", 3, s->kvl, s->vh, s->H, wt);
        }
        T("attn_output.weight", 2, s->H * s->vh, s->d, 1, wt);
        T("ffn_norm.weight", 1, s->d, 1, 1, F32);
        if (il < s->lead || s->twin) {
            int ff = il < s->lead ? s->ff : (s->k + s->S) * s->F;
            T("ffn_gate.weight", 2, s->d, ff, 1, wt);
            T("ffn_up.weight", 2, s->d, ff, 1, wt);
            T("ffn_down.weight", 2, ff, s->d, 1, wt);
            continue;
        }
        T("ffn_gate_inp.weight", 2, s->d, s->E, 1, F32);
        if (v3) T("exp_probs_b.bias", 1, s->E, 1, 1, F32);
        if (s->fused) {
            T("ffn_gate_up_exps.weight", 3, s->d, 2 * s->F, s->E, wt);
        } else {
            T("ffn_gate_exps.weight", 3, s->d, s->F, s->E, wt);
            T("ffn_up_exps.weight", 3, s->d, s->F, s->E, wt);
        }
        T("ffn_down_exps.weight", 3, s->F, s->d, s->E, wt);
        if (s->S) {
            T("ffn_gate_shexp.weight", 2, s->d, s->S * s->F, 1, wt);
            T("ffn_up_shexp.weight", 2, s->d, s->S * s->F, 1, wt);
            T("ffn_down_shexp.weight", 2, s->S * s->F, s->d, 1, wt);
        }
#undef T
    }
    CHECK_MSG(g->n_tensors == (uint64_t)n_expected, "%s: %llu tensors, expected %d", path,
              (unsigned long long)g->n_tensors, n_expected);
    /* values are O(1)-scaled: the router's rows have unit-ish norm, norms are near 1 */
    const struct moetax_gguf_tensor *r = moetax_gguf_find_tensor(g, "output_norm.weight");
    if (r) {
        const float *w = r->data;
        for (int i = 0; i < s->d; i++) CHECK(w[i] > 0.9f && w[i] < 1.1f);
    }
    moetax_gguf_close(g);
}

static int run_gen(const char *args, const char *out) {
    char cmd[2048];
    snprintf(cmd, sizeof cmd, "%s gen %s -o %s 2>&1", tu_moetax_bin, args, out);
    char *o = NULL;
    int rc = tu_run(cmd, &o);
    if (rc != 0) fprintf(stderr, "%s\n-> rc %d: %s\n", cmd, rc, o ? o : "");
    free(o);
    return rc;
}

static bool same_file(const char *a, const char *b) {
    char cmd[1024];
    snprintf(cmd, sizeof cmd, "cmp -s %s %s", a, b);
    return tu_run(cmd, NULL) == 0;
}

int main(int argc, char **argv) {
    tu_init(argc, argv);
    struct shape tiny = {.vocab = 512, .d = 64, .L = 3, .lead = 1, .ff = 128, .H = 4, .ql = 0, .kvl = 32,
                         .nope = 16, .rope = 8, .vh = 16, .E = 8, .k = 2, .S = 1, .F = 32};
    /* every weight type; k-quants with rows of 256 values (--embd 256), which take the type, while
     * the others (expert ff 32, kv lora 32, heads of 16..24) take q5_0 (q4_k) or q8_0, as quantize does */
    struct shape wide = tiny;
    wide.d = 256;
    const char *types[] = {"f32", "f16", "bf16", "q8_0", "q4_0", "q2_k", "q3_k", "q4_k", "q5_k", "q6_k", "q5_0", "q4_1", "q5_1", "iq4_nl"};
    enum moetax_type tys[] = {MOETAX_TYPE_F32,  MOETAX_TYPE_F16,  MOETAX_TYPE_BF16, MOETAX_TYPE_Q8_0, MOETAX_TYPE_Q4_0,
                              MOETAX_TYPE_Q2_K, MOETAX_TYPE_Q3_K, MOETAX_TYPE_Q4_K, MOETAX_TYPE_Q5_K, MOETAX_TYPE_Q6_K,
                              MOETAX_TYPE_Q5_0, MOETAX_TYPE_Q4_1, MOETAX_TYPE_Q5_1, MOETAX_TYPE_IQ4_NL};
    for (int t = 0; t < 14; t++) {
        const bool kq = moetax_type_blck_size(tys[t]) == 256;
        char args[128], out[256];
        snprintf(args, sizeof args, "--preset tiny%s --type %s", kq ? " --embd 256" : "", types[t]);
        snprintf(out, sizeof out, "%s", tu_path("gen_tiny.gguf"));
        CHECK_EQ_INT(run_gen(args, out), 0);
        check_model(out, kq ? &wide : &tiny, tys[t], false);
    }
    struct shape v3 = tiny;
    v3.ql = 48; v3.G = 4; v3.Gu = 2;
    CHECK_EQ_INT(run_gen("--preset tiny-v3 --type q8_0", tu_path("gen_tiny_v3.gguf")), 0);
    check_model(tu_path("gen_tiny_v3.gguf"), &v3, MOETAX_TYPE_Q8_0, true);

    /* knobs and layout variants */
    struct shape k = {.vocab = 300, .d = 96, .L = 4, .lead = 2, .ff = 160, .H = 3, .ql = 64, .kvl = 64, .nope = 32,
                      .rope = 16, .vh = 32, .E = 16, .k = 4, .S = 2, .F = 64, .G = 4, .Gu = 3, .fused = true, .merged = true};
    CHECK_EQ_INT(run_gen("--preset tiny --vocab 300 --embd 96 --layers 4 --dense-lead 2 --ff 160 --heads 3 --q-lora 64 "
                         "--kv-lora 64 --nope 32 --rope-dim 16 --v-head 32 --experts 16 --experts-used 4 --shared 2 "
                         "--expert-ff 64 --groups 4 --groups-used 3 --routing v3 --fused-gate-up --kv-b-merged --type q4_0",
                         tu_path("gen_knobs.gguf")), 0);
    check_model(tu_path("gen_knobs.gguf"), &k, MOETAX_TYPE_Q4_0, true);

    /* dense twin: same attention, FFN width k*F + S*F in every MoE layer */
    char twin_args[512];
    snprintf(twin_args, sizeof twin_args, "--dense-twin-of %s", tu_path("gen_knobs.gguf"));
    CHECK_EQ_INT(run_gen(twin_args, tu_path("gen_twin.gguf")), 0);
    struct shape tw = k;
    tw.twin = true;
    tw.fused = false;
    check_model(tu_path("gen_twin.gguf"), &tw, MOETAX_TYPE_Q4_0, true);

    /* determinism: same seed, same bytes; other seed, other bytes */
    CHECK_EQ_INT(run_gen("--preset tiny-v3 --type q8_0", tu_path("gen_tiny_v3b.gguf")), 0);
    CHECK(same_file(tu_path("gen_tiny_v3.gguf"), tu_path("gen_tiny_v3b.gguf")));
    CHECK_EQ_INT(run_gen("--preset tiny-v3 --type q8_0 --seed 7", tu_path("gen_tiny_v3c.gguf")), 0);
    CHECK(!same_file(tu_path("gen_tiny_v3.gguf"), tu_path("gen_tiny_v3c.gguf")));

    /* library-level presets and validation */
    struct moetax_gen_params p;
    CHECK(moetax_gen_preset("small", &p) == MOETAX_OK);
    uint64_t n_params, n_bytes;
    moetax_gen_size(&p, &n_params, &n_bytes);
    CHECK_MSG(n_params > 380000000ull && n_params < 450000000ull, "small: %llu params", (unsigned long long)n_params);
    CHECK(moetax_gen_preset("bench-v3", &p) == MOETAX_OK);
    moetax_gen_size(&p, &n_params, &n_bytes);
    CHECK_MSG(n_bytes > 2000000000ull && n_bytes < 3200000000ull, "bench-v3: %llu bytes", (unsigned long long)n_bytes);
    /* v2-lite: DeepSeek-V2-Lite's layer shapes (issue 18's benchmark file), the heads ik_llama.cpp accepts */
    CHECK(moetax_gen_preset("v2-lite", &p) == MOETAX_OK);
    CHECK(moetax_gen_validate(&p) == MOETAX_OK);
    CHECK(p.n_embd == 2048 && p.kv_lora_rank + p.n_embd_head_qk_rope == 576 && p.n_embd_head_qk_rope == 64 &&
          p.n_expert == 64 && p.n_expert_used == 6 && p.n_ff_exp == 1408 && p.n_ff == 10944);
    moetax_gen_size(&p, &n_params, &n_bytes);
    CHECK_MSG(n_params > 2900000000ull && n_params < 3100000000ull, "v2-lite: %llu params",
              (unsigned long long)n_params);
    CHECK(moetax_gen_preset("nope", &p) == MOETAX_ERR_ARG);
    CHECK(moetax_gen_preset("tiny", &p) == MOETAX_OK);
    p.n_expert_used = 9;
    CHECK(moetax_gen_validate(&p) == MOETAX_ERR_ARG && strstr(moetax_last_error(), "experts-used"));

    /* impossible options: exit 2 with a message, and no output file */
    const char *bad[] = {"--preset huge", "--type q9_9", "--experts 8 --experts-used 9", "--groups 3",
                         "--rope-dim 7", "--layers 0", "--vocab 100", "--embd abc", "--frobnicate", "--seed"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        char cmd[512];
        char *o = NULL;
        remove(tu_path("gen_bad.gguf"));
        snprintf(cmd, sizeof cmd, "%s gen --preset tiny %s -o %s 2>&1", tu_moetax_bin, bad[i], tu_path("gen_bad.gguf"));
        int rc = tu_run(cmd, &o);
        CHECK_MSG(rc == 2, "'%s': rc %d", bad[i], rc);
        CHECK_MSG(o && strstr(o, "moetax"), "'%s': no message", bad[i]);
        FILE *f = fopen(tu_path("gen_bad.gguf"), "rb");
        CHECK_MSG(!f, "'%s' left a file", bad[i]);
        if (f) fclose(f);
        free(o);
    }
    /* inspect: a corrupt file gives an error naming the file and the byte */
    {
        char cmd[1024];
        char *o = NULL;
        snprintf(cmd, sizeof cmd, "head -c 5000 %s > %s && %s inspect %s 2>&1", tu_path("gen_tiny_v3.gguf"),
                 tu_path("gen_cut.gguf"), tu_moetax_bin, tu_path("gen_cut.gguf"));
        int rc = tu_run(cmd, &o);
        CHECK_EQ_INT(rc, 1);
        CHECK_MSG(o && strstr(o, "gen_cut.gguf") && strstr(o, "byte"), "inspect said: %s", o ? o : "");
        free(o);
        snprintf(cmd, sizeof cmd, "%s inspect %s --json", tu_moetax_bin, tu_path("gen_tiny_v3.gguf"));
        rc = tu_run(cmd, &o);
        CHECK_EQ_INT(rc, 0);
        CHECK(o && strstr(o, "\"active_bytes_per_token\""));
        free(o);
    }
    return tu_finish("test_gen");
}
