/* cmd_gen.c - `moetax gen`: write a random-weight deepseek2, qwen3moe, qwen2moe, olmoe or Mixtral model (or the
 * dense twin of one). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "cli.h"
#include "commands.h"
#include "moetax/gen.h"
#include "moetax/gguf.h"
#include "moetax/outfile.h"

static void usage(FILE *f) {
    fprintf(f,
            "usage: moetax gen [--preset NAME] [-o FILE] [options]\n"
            "       moetax gen --dense-twin-of MOE.gguf -o TWIN.gguf [--type T] [--seed N]\n\n"
            "Writes a random-weight DeepSeek2 (MLA + MoE), Qwen3-MoE, Qwen2-MoE, OLMoE or Mixtral (GQA + MoE) model\n"
            "in the GGUF layout llama.cpp loads (Mixtral: general.architecture llama).\n\n"
            "  --arch A           deepseek2 (default) | qwen3moe | qwen2moe | olmoe | mixtral\n"
            "  --preset NAME      deepseek2: tiny | tiny-v3 | small (default, ~416M params) | bench-v3 (~2.3G params,\n"
            "                     Q8_0) | v2-lite (DeepSeek-V2-Lite's layer shapes, 6 layers, ~3.0G params; --layers 27\n"
            "                     for its depth); qwen3moe, qwen2moe, olmoe, mixtral: tiny | small (default)\n"
            "  -o, --output FILE  output path (default: models/<preset>-<type>.gguf)\n"
            "  --type T           weight type: f32 f16 bf16 q8_0 q4_0 q2_k q3_k q4_k q5_k q6_k (router, norms,\n"
            "                     biases stay f32; rows a k-quant's 256-value blocks do not fit take q8_0, as\n"
            "                     in quantize)\n"
            "  --seed N           RNG seed (default 42); same seed, same bytes\n"
            "  --dense-twin-of F  write the dense model with the same active parameters per token as MoE model F\n"
            "                     (qwen3moe -> qwen3, qwen2moe -> qwen2, Mixtral -> dense llama; olmoe -> olmoe\n"
            "                     without experts, which llama.cpp does not load)\n"
            "shape knobs (override the preset):\n"
            "  --vocab N --ctx N --embd N --layers N --dense-lead N --ff N --heads N\n"
            "  --q-lora N (0 = plain attn_q) --kv-lora N --nope N --rope-dim N --v-head N\n"
            "  --experts N --experts-used N --shared N --expert-ff N --groups N --groups-used N\n"
            "  qwen3moe, qwen2moe, olmoe, mixtral: --heads-kv N --head-dim N (and --vocab --ctx --embd --layers --ff\n"
            "  --heads --experts --experts-used --expert-ff --rope-base --eps); olmoe and mixtral experts are\n"
            "  feed_forward_length wide (--expert-ff); olmoe's head dim is --embd / --heads; qwen2moe: --shared-ff N\n"
            "  (the gated shared expert's width), --heads x --head-dim = --embd\n"
            "routing and rope:\n"
            "  --routing v2|v3    v2: softmax, no bias; v3: sigmoid + exp_probs_b + renormalise, scale 2.5\n"
            "  --gating softmax|sigmoid  --bias|--no-bias  --norm|--no-norm  --scale X\n"
            "  --rope-base X  --yarn-factor X (0 = off)  --yarn-orig-ctx N  --yarn-log-mul X  --eps X\n"
            "layout variants:\n"
            "  --fused-gate-up    ffn_gate_up_exps instead of ffn_gate_exps + ffn_up_exps\n"
            "  --kv-b-merged      the older attn_kv_b instead of attn_k_b + attn_v_b\n"
            "  --dense-twin       write this shape's dense twin instead of the MoE model\n");
}

struct progress_ctx {
    cli_progress bar;
    bool started;
};

static void on_progress(void *user, uint64_t done, uint64_t total) {
    struct progress_ctx *c = user;
    if (!c->started) {
        cli_progress_init(&c->bar, "writing", total);
        c->started = true;
    }
    cli_progress_update(&c->bar, done);
}

/* Shape of an existing GQA MoE file (qwen3moe, qwen2moe, olmoe, llama with experts), for
 * --dense-twin-of: the keys llama.cpp's loaders read, with their defaults. */
static moetax_status gqa_params_from_file(const struct moetax_gguf *g, const char *path, const char *arch,
                                          enum moetax_gen_arch ga, struct moetax_gen_params *p) {
    const uint64_t seed = p->seed;
    moetax_status st = moetax_gen_preset_arch(ga, "tiny", p);
    if (st) return st;
    p->seed = seed;
    char key[128];
    uint32_t u;
    float f;
#define K(s) (snprintf(key, sizeof key, "%s.%s", arch, s), key)
    /* a value of the file in range, or an error naming the file and the key (0 in an optional key:
     * the fallback stays, as llama.cpp reads them) */
#define U(s, field) do { if ((st = moetax_gguf_get_u32(g, K(s), &u))) return st; \
        if (u < 1 || u > (1u << 30)) return moetax_error(MOETAX_ERR_FORMAT, "%s: %s = %u is out of range", path, key, u); \
        p->field = (int)u; } while (0)
#define UO(s, field) do { if (!moetax_gguf_get_u32(g, K(s), &u) && u) { \
        if (u > (1u << 30)) return moetax_error(MOETAX_ERR_FORMAT, "%s: %s = %u is out of range", path, key, u); \
        p->field = (int)u; } } while (0)
#define FO(s, field) do { if (!moetax_gguf_get_f32(g, K(s), &f)) p->field = f; } while (0)
    U("embedding_length", n_embd);
    U("block_count", n_layer);
    U("attention.head_count", n_head);
    if (!moetax_gguf_get_u32(g, K("expert_count"), &u) && u == 0)
        return moetax_error(MOETAX_ERR_UNSUPPORTED, "%s: %s.expert_count is 0: a dense model has no dense twin", path, arch);
    U("expert_count", n_expert);
    U("expert_used_count", n_expert_used);
    p->n_head_kv = p->n_head;
    UO("attention.head_count_kv", n_head_kv);
    p->n_embd_head = p->n_head > 0 ? p->n_embd / p->n_head : 0;
    UO("attention.key_length", n_embd_head);
    if (ga == MOETAX_GEN_OLMOE) p->n_embd_head = 0;
    p->n_ff = 0;
    UO("feed_forward_length", n_ff);
    if (ga == MOETAX_GEN_OLMOE || ga == MOETAX_GEN_MIXTRAL) {
        p->n_ff_exp = p->n_ff; /* their experts are feed_forward_length wide */
        p->n_ff = 0;
    } else {
        p->n_ff_exp = p->n_expert_used > 0 ? p->n_ff / p->n_expert_used : 0; /* llama.cpp's fallback */
        UO("expert_feed_forward_length", n_ff_exp);
    }
    if (ga == MOETAX_GEN_QWEN2MOE) {
        p->n_ff_shexp = p->n_ff;
        UO("expert_shared_feed_forward_length", n_ff_shexp);
        p->n_ff = 0;
    }
    UO("context_length", n_ctx);
    FO("attention.layer_norm_rms_epsilon", rms_eps);
    FO("rope.freq_base", rope_freq_base);
#undef K
#undef U
#undef UO
#undef FO
    const struct moetax_gguf_tensor *t = moetax_gguf_find_tensor(g, "token_embd.weight");
    if (!t) return moetax_error(MOETAX_ERR_NOT_FOUND, "%s: tensor token_embd.weight is missing", path);
    p->n_vocab = (int)t->ne[1];
    t = moetax_gguf_find_tensor(g, "output.weight");
    if (t && moetax_type_supported(t->type)) p->wtype = t->type;
    return MOETAX_OK;
}

/* Shape of an existing MoE file, for --dense-twin-of. */
static moetax_status params_from_file(const char *path, struct moetax_gen_params *p) {
    struct moetax_gguf *g;
    moetax_status st = moetax_gguf_open(path, &g);
    if (st) return st;
    char arch[64];
    if ((st = moetax_gguf_get_str(g, "general.architecture", arch, sizeof arch))) goto out;
    enum moetax_gen_arch ga;
    if (!strcmp(arch, "llama")) ga = MOETAX_GEN_MIXTRAL;
    else if (!moetax_gen_arch_from_name(arch, &ga) || ga == MOETAX_GEN_MIXTRAL) {
        st = moetax_error(MOETAX_ERR_UNSUPPORTED, "%s: architecture '%s': dense twins are made for deepseek2, qwen3moe, "
                          "qwen2moe, olmoe and llama (Mixtral) models", path, arch);
        goto out;
    }
    if (ga != MOETAX_GEN_DEEPSEEK2) {
        st = gqa_params_from_file(g, path, arch, ga, p);
        goto out;
    }
    uint32_t u;
    float f;
#define U(key, field) do { if ((st = moetax_gguf_get_u32(g, "deepseek2." key, &u))) goto out; \
        if (u < 1 || u > (1u << 30)) { \
            st = moetax_error(MOETAX_ERR_FORMAT, "%s: deepseek2." key " = %u is out of range", path, u); goto out; } \
        p->field = (int)u; } while (0)
#define UO(key, field) do { if (!moetax_gguf_get_u32(g, "deepseek2." key, &u)) { \
        if (u > (1u << 30)) { \
            st = moetax_error(MOETAX_ERR_FORMAT, "%s: deepseek2." key " = %u is out of range", path, u); goto out; } \
        p->field = (int)u; } } while (0)
#define FO(key, field) do { if (!moetax_gguf_get_f32(g, "deepseek2." key, &f)) p->field = f; } while (0)
    U("embedding_length", n_embd);
    U("block_count", n_layer);
    U("attention.head_count", n_head);
    U("attention.kv_lora_rank", kv_lora_rank);
    U("rope.dimension_count", n_embd_head_qk_rope);
    U("expert_count", n_expert);
    U("expert_used_count", n_expert_used);
    U("expert_feed_forward_length", n_ff_exp);
    UO("context_length", n_ctx);
    UO("feed_forward_length", n_ff);
    UO("leading_dense_block_count", n_layer_dense_lead);
    UO("attention.q_lora_rank", q_lora_rank);
    UO("expert_shared_count", n_expert_shared);
    FO("attention.layer_norm_rms_epsilon", rms_eps);
    FO("rope.freq_base", rope_freq_base);
    FO("rope.scaling.factor", rope_yarn_factor);
    UO("rope.scaling.original_context_length", rope_yarn_orig_ctx);
    FO("rope.scaling.yarn_log_multiplier", rope_yarn_log_mul);
    const struct moetax_gguf_tensor *t = moetax_gguf_find_tensor(g, "token_embd.weight");
    if (!t) { st = moetax_error(MOETAX_ERR_NOT_FOUND, "%s: tensor token_embd.weight is missing", path); goto out; }
    p->n_vocab = (int)t->ne[1];
    if (moetax_gguf_find_tensor(g, "blk.0.attn_kv_b.weight")) {
        p->kv_b_merged = true;
        U("attention.key_length", n_embd_head_qk_nope);
        p->n_embd_head_qk_nope -= p->n_embd_head_qk_rope;
        U("attention.value_length", n_embd_head_v);
    } else {
        U("attention.key_length_mla", n_embd_head_qk_nope);
        p->n_embd_head_qk_nope -= p->n_embd_head_qk_rope;
        U("attention.value_length_mla", n_embd_head_v);
    }
    t = moetax_gguf_find_tensor(g, "output.weight");
    if (t && moetax_type_supported(t->type)) p->wtype = t->type;
#undef U
#undef UO
#undef FO
out:
    moetax_gguf_close(g);
    return st;
}

int cmd_gen(int argc, char **argv) {
    const char *preset = "small", *out = NULL, *twin_of = NULL, *type = NULL, *arch_name = "deepseek2";
    /* pass 1: architecture and preset (knobs apply on top of it) */
    for (int i = 1; i < argc; i++) {
        if (cli_flag(argv, i, "-h", "--help")) { usage(stdout); return 0; }
        if (!strcmp(argv[i], "--preset") && i + 1 < argc) preset = argv[++i];
        else if (!strncmp(argv[i], "--preset=", 9)) preset = argv[i] + 9;
        else if (!strcmp(argv[i], "--arch") && i + 1 < argc) arch_name = argv[++i];
        else if (!strncmp(argv[i], "--arch=", 7)) arch_name = argv[i] + 7;
    }
    enum moetax_gen_arch arch;
    if (!moetax_gen_arch_from_name(arch_name, &arch))
        return cli_usage_error("gen", "--arch: unknown architecture '%s' (deepseek2, qwen3moe, qwen2moe, olmoe, mixtral)", arch_name);
    struct moetax_gen_params p;
    moetax_status st = moetax_gen_preset_arch(arch, preset, &p);
    if (st) return cli_usage_error("gen", "%s", moetax_last_error());
    for (int i = 1; i < argc; i++) {
        const char *v = NULL;
        bool err = false;
        int64_t n;
        double x;
        struct { const char *opt; int *field; } ints[] = {
            {"--vocab", &p.n_vocab}, {"--ctx", &p.n_ctx}, {"--embd", &p.n_embd}, {"--layers", &p.n_layer},
            {"--dense-lead", &p.n_layer_dense_lead}, {"--ff", &p.n_ff}, {"--heads", &p.n_head},
            {"--q-lora", &p.q_lora_rank}, {"--kv-lora", &p.kv_lora_rank}, {"--nope", &p.n_embd_head_qk_nope},
            {"--rope-dim", &p.n_embd_head_qk_rope}, {"--v-head", &p.n_embd_head_v}, {"--experts", &p.n_expert},
            {"--experts-used", &p.n_expert_used}, {"--shared", &p.n_expert_shared}, {"--expert-ff", &p.n_ff_exp},
            {"--groups", &p.n_expert_group}, {"--groups-used", &p.n_expert_group_used},
            {"--yarn-orig-ctx", &p.rope_yarn_orig_ctx}, {"--heads-kv", &p.n_head_kv}, {"--head-dim", &p.n_embd_head},
            {"--shared-ff", &p.n_ff_shexp},
        };
        struct { const char *opt; float *field; } floats[] = {
            {"--scale", &p.expert_weights_scale}, {"--rope-base", &p.rope_freq_base},
            {"--yarn-factor", &p.rope_yarn_factor}, {"--yarn-log-mul", &p.rope_yarn_log_mul}, {"--eps", &p.rms_eps},
        };
        bool done = false;
        for (size_t k = 0; k < sizeof ints / sizeof ints[0] && !done; k++)
            if (cli_opt(argc, argv, &i, NULL, ints[k].opt, &v, &err)) {
                if (err) return 2;
                if (!cli_parse_i64(v, &n))
                    return cli_usage_error("gen", "%s: '%s' is not an integer", ints[k].opt, v);
                if (n < 0 || n > 1 << 30)
                    return cli_usage_error("gen", "%s: %s is out of range (0..%d)", ints[k].opt, v, 1 << 30);
                *ints[k].field = (int)n;
                done = true;
            }
        for (size_t k = 0; k < sizeof floats / sizeof floats[0] && !done; k++)
            if (cli_opt(argc, argv, &i, NULL, floats[k].opt, &v, &err)) {
                if (err) return 2;
                if (!cli_parse_f64(v, &x)) return cli_usage_error("gen", "%s: '%s' is not a number", floats[k].opt, v);
                *floats[k].field = (float)x;
                done = true;
            }
        if (done) continue;
        if (cli_opt(argc, argv, &i, NULL, "--preset", &v, &err)) { if (err) return 2; }
        else if (cli_opt(argc, argv, &i, NULL, "--arch", &v, &err)) { if (err) return 2; }
        else if (cli_opt(argc, argv, &i, "-o", "--output", &out, &err)) { if (err) return 2; }
        else if (cli_opt(argc, argv, &i, NULL, "--type", &type, &err)) { if (err) return 2; }
        else if (cli_opt(argc, argv, &i, NULL, "--dense-twin-of", &twin_of, &err)) { if (err) return 2; }
        else if (cli_opt(argc, argv, &i, NULL, "--seed", &v, &err)) {
            if (err || !cli_parse_i64(v, &n)) return cli_usage_error("gen", "--seed: '%s' is not an integer", v ? v : "");
            p.seed = (uint64_t)n;
        } else if (cli_opt(argc, argv, &i, NULL, "--routing", &v, &err)) {
            if (err) return 2;
            if (!strcmp(v, "v2")) {
                p.gating_func = 1; p.exp_probs_b = false; p.expert_weights_norm = false; p.expert_weights_scale = 1.0f;
            } else if (!strcmp(v, "v3")) {
                p.gating_func = 2; p.exp_probs_b = true; p.expert_weights_norm = true; p.expert_weights_scale = 2.5f;
            } else return cli_usage_error("gen", "--routing must be v2 or v3, not '%s'", v);
        } else if (cli_opt(argc, argv, &i, NULL, "--gating", &v, &err)) {
            if (err) return 2;
            if (!strcmp(v, "softmax")) p.gating_func = 1;
            else if (!strcmp(v, "sigmoid")) p.gating_func = 2;
            else return cli_usage_error("gen", "--gating must be softmax or sigmoid, not '%s'", v);
        } else if (!strcmp(argv[i], "--bias")) p.exp_probs_b = true;
        else if (!strcmp(argv[i], "--no-bias")) p.exp_probs_b = false;
        else if (!strcmp(argv[i], "--norm")) p.expert_weights_norm = true;
        else if (!strcmp(argv[i], "--no-norm")) p.expert_weights_norm = false;
        else if (!strcmp(argv[i], "--fused-gate-up")) p.fused_gate_up = true;
        else if (!strcmp(argv[i], "--kv-b-merged")) p.kv_b_merged = true;
        else if (!strcmp(argv[i], "--dense-twin")) p.dense_twin = true;
        else return cli_usage_error("gen", "unknown option '%s'", argv[i]);
    }
    if (twin_of) {
        if ((st = params_from_file(twin_of, &p))) return cli_fail("gen", st);
        p.dense_twin = true;
        p.name = "dense-twin";
    }
    if (type && !moetax_type_from_name(type, &p.wtype))
        return cli_usage_error("gen", "--type: unknown type '%s' (f32, f16, bf16, q8_0, q4_0, q2_k, q3_k, q4_k, q5_k, q6_k)",
                               type);
    if ((st = moetax_gen_validate(&p))) return cli_usage_error("gen", "%s", moetax_last_error());
    char def[256];
    if (!out) {
        snprintf(def, sizeof def, "models/%s%s%s%s-%s.gguf", twin_of ? "twin-" : "",
                 arch == MOETAX_GEN_DEEPSEEK2 ? "" : moetax_gen_arch_name(arch), arch == MOETAX_GEN_DEEPSEEK2 ? "" : "-",
                 preset, moetax_type_name(p.wtype));
        out = def;
    }
    if (!strncmp(out, "models/", 7)) mkdir("models", 0755); /* an error shows up when the file is created */
    uint64_t n_params, n_bytes;
    moetax_gen_size(&p, &n_params, &n_bytes);
    /* the output can be written and the weights fit on its file system: before any work */
    if (n_params > MOETAX_GEN_MAX_PARAMS)
        return cli_usage_error("gen", "%s: the shape has %s%.4g parameters: more than the %.4g a generated model may "
                               "have", preset, n_params == UINT64_MAX ? "over " : "", (double)n_params,
                               (double)MOETAX_GEN_MAX_PARAMS);
    const char *outs[1] = {out}, *ins[1] = {twin_of};
    if (twin_of && (st = cli_check_io(outs, 1, ins, 1))) return cli_usage_error("gen", "%s", moetax_last_error());
    if ((st = moetax_outfile_check(out, n_bytes))) {
        fprintf(stderr, "moetax gen: %s%s: %.1f M parameters, %.1f MiB of %s weights\n", p.dense_twin ? "dense twin of " : "",
                preset, (double)n_params / 1e6, (double)n_bytes / (1 << 20), moetax_type_name(p.wtype));
        return cli_fail("gen", st);
    }
    fprintf(stderr, "moetax gen: %s%s: %.1f M parameters, %.1f MiB of %s weights -> %s\n", p.dense_twin ? "dense twin of " : "",
            preset, (double)n_params / 1e6, (double)n_bytes / (1 << 20), moetax_type_name(p.wtype), out);
    struct progress_ctx pc = {0};
    double t0 = cli_now();
    st = moetax_gen_write(&p, out, on_progress, &pc);
    if (pc.started) cli_progress_done(&pc.bar);
    if (st) return cli_fail("gen", st);
    fprintf(stderr, "moetax gen: wrote %s in %.1f s\n", out, cli_now() - t0);
    return 0;
}
