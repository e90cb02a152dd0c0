/* cmd_run.c - `moetax run`: generate text, streaming tokens as they come, then
 * prefill/decode speed, time to first token and time per output token. */
#include "server/chat_template.h"
#include "server/special_tokens.h"
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "cli.h"
#include "commands.h"
#include "moetax/model.h"
#include "moetax/readfile.h"
#include "moetax/sampler.h"
#include "moetax/tokenizer.h"
#include "ledger_cli.h"
#include "store_cli.h"
#include "run_parallel.h"
#include "config_cli.h"

static void usage(FILE *f) {
    fprintf(f,
            "usage: moetax run [-m FILE] -p TEXT [-n N] [-t THREADS] [options]\n\n"
            "Generates text from a prompt, streaming tokens as they are produced, and ends with prefill\n"
            "and decode speed, time to first token and time per output token (on stderr).\n"
            "Without -m it uses the default model ($MOETAX_MODEL or models/" CLI_DEFAULT_MODEL ", a small\n"
            "DeepSeek-style MoE trained on Python source: see models/README.md).\n\n"
            "  -m, --model FILE     GGUF model\n"
            "  -p, --prompt TEXT    prompt (default: \"def main(\")\n"
            "  -f, --file FILE      read the prompt from a file (with --parallel: one prompt per line)\n"
            "  --parallel N         decode the prompts of -f N at a time in one context (continuous batching:\n"
            "                       a sequence that ends frees its slot for the next prompt); each completion is\n"
            "                       printed when it ends, then the aggregate speed and the batch's ledger;\n"
            "                       not yet with --chat, -sys, --chat-template or --expert-budget\n"
            "  -n, --n-predict N    tokens to generate (default 64)\n"
            "  -t, --threads N      threads (default: online CPUs)\n"
            "  -c, --ctx N          KV cache cells, all sequences together, in blocks of 32 (default: min(model,\n"
            "                       4096); with --parallel: every slot's longest prompt + -n)\n"
            "  --temp X             temperature (default 0.8; 0 = greedy)\n"
            "  --top-k N            (default 40; 0 = off)\n"
            "  --top-p X            (default 0.95; 1 = off)\n"
            "  --min-p X            (default 0.05; 0 = off)\n"
            "  --repeat-penalty X   (default 1.0 = off)   --repeat-last-n N (default 64)\n"
            "  -s, --seed N         sampling seed (default 42)\n"
            "  --ignore-eos         keep generating past the end-of-sequence token\n"
            "  --experts-used K     route each token to K experts instead of the file's count (run-time top-k)\n"
            "  --no-mmap            copy the weights into private memory of 2 MiB pages (see 'moetax bench')\n"
            "  --adapt-threads      run each step on all threads or half of them, whichever the step times say\n"
            "                       is faster (a machine busy with other work: all threads then wait at every\n"
            "                       barrier for a descheduled one); the ledger line says how many ran\n"
            "  --check-finite       check every hidden state after each layer: a NaN or inf is an error naming\n"
            "                       the layer (the logits are always checked)\n"
            "  --no-display-prompt  do not echo the prompt\n"
            "  --chat               the prompt is one user message, rendered with the model's chat template\n"
            "                       (tokenizer.chat_template; control tokens in it are parsed as the server does)\n"
            "  -sys, --system TEXT  with --chat: a system message first\n"
            "  --chat-template NAME with --chat: use this template (chatml, llama2, llama3, phi3, mistral-v7,\n"
            "                       deepseek2, deepseek3, ...) instead of detecting the model's\n"
            "  --json               print the final statistics as one JSON object on stdout (the only thing on\n"
            "                       stdout: the prompt and the text go to stderr)\n"
            CLI_CACHE_TYPE_HELP CLI_MLA_PREFILL_HELP
            "  -ub, --ubatch N      tokens per micro-batch of the prompt (default 512; with --expert-budget\n"
            "                       the store's)\n"
            CLI_CONFIG_HELP
            CLI_MAX_INPUT_HELP
            "%s%s", cli_ledger_help(), cli_store_help());
}

/* The default model is part of the repository; say so if it is gone. */
static moetax_status check_default_model(const char *path) {
    struct stat sb;
    if (stat(path, &sb) == 0) return MOETAX_OK;
    return moetax_error(MOETAX_ERR_IO,
                        "the default model %s is missing: it is committed in the repository (git checkout -- "
                        "models/%s), or pass -m FILE (`moetax gen --preset small -o FILE` writes a random one)",
                        path, CLI_DEFAULT_MODEL);
}

static int cmp_f64(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

int cmd_run(int argc, char **argv) {
    const char *model = NULL, *prompt = NULL, *pfile = NULL;
    int64_t n_predict = 64, n_threads = 0, n_ctx = 0, parallel = 0;
    struct moetax_model_params mp = {0};
    bool check_finite = false; /* --check-finite */
    bool adapt = false;        /* --adapt-threads */
    enum moetax_type kv_type = MOETAX_TYPE_F32; /* --cache-type */
    enum moetax_attn_prefill prefill = MOETAX_ATTN_PREFILL_ABSORBED; /* --mla-prefill */
    int64_t ubatch = 0;                                            /* -ub, --ubatch (0: the default) */
    int k_ctx = 0; /* --experts-used: run-time top-k, a context parameter (0: the model's) */
    bool ignore_eos = false, echo = true, json = false;
    bool chat = false;                               /* --chat */
    const char *sys_msg = NULL, *chat_tmpl = NULL;   /* -sys, --chat-template */
    char *rendered = NULL;                           /* --chat: the prompt */
    struct srv_specials *specials = NULL;
    struct moetax_sampler_params sp = moetax_sampler_default_params();
    struct cli_ledger_opts lo = {0};
    struct cli_store_opts so = {0};
    uint64_t max_input = 0;
    struct cli_config cfg; /* --config: defaults, the options below win */
    if (cli_config_scan(argc, argv, &cfg)) return cli_usage_error("run", "%s", moetax_last_error());
    if (cfg.loaded) {
        n_threads = cfg.threads, k_ctx = cfg.experts_used, mp.no_mmap = cfg.no_mmap, kv_type = cfg.cache_type;
        prefill = cfg.mla_prefill;
        cli_config_store(&cfg, &so);
    }
    mp.expert_type = cfg.expert_type; /* --expert-type or the file's */
    for (int i = 1; i < argc; i++) {
        const char *v = NULL;
        bool err = false;
        int64_t iv;
        double fv;
        if (cli_flag(argv, i, "-h", "--help")) { usage(stdout); return 0; }
        else if (cli_config_opt(argc, argv, &i, &err)) { if (err) return 2; }
        else if (cli_opt(argc, argv, &i, "-m", "--model", &model, &err)) { if (err) return 2; }
        else if (cli_opt(argc, argv, &i, "-p", "--prompt", &prompt, &err)) { if (err) return 2; }
        else if (cli_opt(argc, argv, &i, "-f", "--file", &pfile, &err)) { if (err) return 2; }
#define INT_OPT(s, l, var, lo, hi) else if (cli_opt(argc, argv, &i, s, l, &v, &err)) { \
        if (err || !cli_parse_i64(v, &iv) || iv < (lo) || iv > (hi)) \
            return cli_usage_error("run", "%s: expected an integer in %lld..%lld", l, (long long)(lo), (long long)(hi)); \
        var = iv; }
#define F_OPT(l, var, lo, hi) else if (cli_opt(argc, argv, &i, NULL, l, &v, &err)) { \
        if (err || !cli_parse_f64(v, &fv) || fv < (lo) || fv > (hi)) \
            return cli_usage_error("run", "%s: expected a number in %g..%g", l, (double)(lo), (double)(hi)); \
        var = (float)fv; }
        INT_OPT("-n", "--n-predict", n_predict, 0, 1 << 24)
        INT_OPT("-t", "--threads", n_threads, 1, 512)
        INT_OPT("-c", "--ctx", n_ctx, 1, 1 << 24)
        INT_OPT(NULL, "--parallel", parallel, 1, 4096)
        INT_OPT(NULL, "--top-k", sp.top_k, 0, 1 << 30)
        INT_OPT(NULL, "--repeat-last-n", sp.repeat_last_n, 0, 1 << 20)
        INT_OPT("-s", "--seed", sp.seed, 0, INT64_MAX)
        F_OPT("--temp", sp.temp, 0, 100)
        F_OPT("--top-p", sp.top_p, 0, 1)
        F_OPT("--min-p", sp.min_p, 0, 1)
        F_OPT("--repeat-penalty", sp.repeat_penalty, 0, 100)
        else if (cli_ledger_opt(argc, argv, &i, &lo, &err)) { if (err) return 2; }
        else if (cli_store_opt(argc, argv, &i, &so, &err)) { if (err) return 2; }
        else if (!strcmp(argv[i], "--ignore-eos")) ignore_eos = true;
        else if (cli_opt(argc, argv, &i, NULL, "--experts-used", &v, &err)) {
            if (err || !cli_parse_experts_used(v, &k_ctx)) return cli_usage_error("run", "--experts-used needs a count in 1..256");
        }
        else if (!strcmp(argv[i], "--no-display-prompt")) echo = false;
        else if (!strcmp(argv[i], "--chat")) chat = true;
        else if (cli_opt(argc, argv, &i, "-sys", "--system", &sys_msg, &err)) { if (err) return 2; }
        else if (cli_opt(argc, argv, &i, NULL, "--chat-template", &chat_tmpl, &err)) { if (err) return 2; }
        else if (!strcmp(argv[i], "--no-mmap")) mp.no_mmap = true;
        else if (cli_opt(argc, argv, &i, "-ub", "--ubatch", &v, &err)) {
            if (err || !cli_parse_i64(v, &ubatch) || ubatch < 1 || ubatch > 4096)
                return cli_usage_error("run", "--ubatch needs a count in 1..4096");
        }
        else if (!strcmp(argv[i], "--adapt-threads")) adapt = true;
        else if (!strcmp(argv[i], "--check-finite")) check_finite = true;
        else if (cli_cache_type_opt("run", argc, argv, &i, &kv_type, &err)) { if (err) return 2; }
        else if (cli_mla_prefill_opt("run", argc, argv, &i, &prefill, &err)) { if (err) return 2; }
        else if (!strcmp(argv[i], "--json")) json = true;
        else if (cli_max_input_opt("run", argc, argv, &i, &max_input, &err)) { if (err) return 2; }
        else return cli_usage_error("run", "unknown option '%s'", argv[i]);
#undef INT_OPT
#undef F_OPT
    }
    /* every option and output path is checked before the work starts */
    moetax_status st = cli_store_check(&so, false);
    const char *outputs[] = {lo.json_path, lo.trace_path}, *inputs[] = {model ? model : cli_default_model_path(), pfile};
    if (!st) st = cli_check_io(outputs, 2, inputs, 2);
    if (!st && json && lo.metrics)
        st = moetax_error(MOETAX_ERR_ARG, "--json and --metrics both print on stdout: use one");
    if (!st && prompt && pfile) /* one would be dropped without a word */
        st = moetax_error(MOETAX_ERR_ARG, "-p and -f both given (the prompt and a prompt file); use one");
    if (st) return cli_usage_error("run", "%s", moetax_last_error());
    FILE *txt = json ? stderr : stdout; /* --json: stdout holds the JSON alone */
    char *text = NULL;
    if (pfile) {
        size_t len;
        moetax_status rst = cli_read_file(pfile, max_input, &text, &len);
        const char *pname = strcmp(pfile, "-") ? pfile : "standard input";
        if (!rst && (rst = moetax_readfile_check_text(pname, text, len))) free(text); /* the prompts are C strings */
        if (rst) return cli_usage_error("run", "the prompt file: %s", moetax_last_error());
        prompt = text;
    }
    if (!prompt) prompt = "def main(";
    const bool model_given = model != NULL;
    if (!model) {
        model = cli_default_model_path();
        if ((st = check_default_model(model))) { free(text); return cli_fail("run", st); }
    }
    if (parallel) {
        if (!pfile) { free(text); return cli_usage_error("run", "--parallel needs -f FILE with one prompt per line"); }
        if (n_predict == 0) { /* it sampled one token per prompt all the same */
            free(text);
            return cli_usage_error("run", "--parallel with -n 0 generates nothing (prompts alone: perplexity --parallel)");
        }
        if (so.budgets) { free(text); return cli_usage_error("run", "--parallel does not combine with --expert-budget yet"); }
        const char *chat_opt = chat ? "--chat" : sys_msg ? "-sys" : chat_tmpl ? "--chat-template" : NULL;
        if (chat_opt) { free(text); return cli_usage_error("run", "--parallel does not combine with %s yet", chat_opt); }
        struct run_parallel_opts po = {.model = model, .prompts_path = pfile, .parallel = (int)parallel,
                                       .n_predict = n_predict, .n_threads = n_threads, .n_ctx = n_ctx,
                                       .experts_used = k_ctx, .no_mmap = mp.no_mmap, .expert_type = mp.expert_type, .ignore_eos = ignore_eos,
                                       .echo = echo, .json = json, .sampler = sp, .lo = &lo, .kv_type = kv_type,
                                       .check_finite = check_finite, .adapt_threads = adapt};
        lo.n_expert_used = k_ctx;
        st = run_parallel(&po, text);
        free(text);
        return st ? cli_fail("run", st) : 0;
    }
    if (chat_tmpl && srv_chat_by_name(chat_tmpl) == SRV_CHAT_UNKNOWN) {
        char names[512];
        free(text);
        return cli_usage_error("run", "--chat-template %s: not a template moetax knows; the names are %s", chat_tmpl,
                               srv_chat_names(names, sizeof names));
    }
    struct moetax_model *m = NULL;
    struct moetax_tokenizer *tok = NULL;
    struct moetax_sampler *smp = NULL;
    struct moetax_ctx *c = NULL;
    struct moetax_ledger *led = NULL;
    struct moetax_store *store = NULL;
    int32_t *ids = NULL;
    float *logits = NULL;
    double *tpot = NULL;
    if ((st = moetax_model_load_ex(model, &mp, &m))) {
        const char *env = getenv("MOETAX_MODEL");
        if (!model_given && env && !strcmp(env, model)) /* where the path came from */
            st = moetax_error(st, "%s (the model named by $MOETAX_MODEL)", moetax_last_error());
        goto done;
    }
    /* the store and the ledger are sized for the context's top-k too */
    so.n_expert_used = lo.n_expert_used = k_ctx;
    if ((st = moetax_model_check_experts_used(m, k_ctx))) goto done;
    if ((st = moetax_tokenizer_load(m->gguf, &tok))) goto done;
    if (moetax_tokenizer_n_vocab(tok) != m->hp.n_vocab) {
        st = moetax_error(MOETAX_ERR_FORMAT, "%s: the vocabulary has %d tokens but token_embd has %d rows", model,
                          moetax_tokenizer_n_vocab(tok), m->hp.n_vocab);
        goto done;
    }
    if ((st = moetax_sampler_init(&sp, m->hp.n_vocab, &smp))) goto done;
    struct moetax_ctx_params cp = {.check_finite = check_finite, .kv_type = kv_type, .attn_prefill = prefill, .n_ctx = (int32_t)n_ctx, .n_threads = (int32_t)n_threads, .n_expert_used = k_ctx,
                                   .adapt_threads = adapt, .n_ubatch = (int32_t)ubatch};
    if (so.budgets) {
        uint64_t budget;
        if (!cli_store_parse_budget(so.budgets, moetax_model_store_bytes_all(m), &budget)) {
            st = moetax_error(MOETAX_ERR_ARG, "--expert-budget: '%s' is not a size (2G, 512M) or a percentage (25%%)", so.budgets);
            goto done;
        }
        int ub = 64;
        if (lo.trace_path) so.read_log_cap = (int64_t)1 << 16; /* the trace's I/O tracks */
        if ((st = cli_store_open(m, &so, budget, &ub, &store))) goto done;
        cp.store = store;
        cp.n_ubatch = ub;
        cp.no_prefetch = so.no_prefetch;
    }
    if ((st = moetax_ctx_init(m, &cp, &c))) goto done;
    if ((st = cli_ledger_new(m, moetax_ctx_n_threads(c), &lo, &led))) goto done;
    moetax_ctx_set_ledger(c, led);
    if (chat) {
        enum srv_chat_tmpl ct = SRV_CHAT_UNKNOWN;
        if (chat_tmpl) {
            ct = srv_chat_by_name(chat_tmpl); /* a known name: checked before the model was loaded */
        } else {
            const struct moetax_gguf_kv *kv = moetax_gguf_find_kv(m->gguf, "tokenizer.chat_template");
            if (!kv || kv->type != MOETAX_GGUF_TYPE_STRING) {
                st = moetax_error(MOETAX_ERR_UNSUPPORTED, "--chat: %s has no tokenizer.chat_template; use "
                                  "--chat-template NAME (e.g. chatml) to force one", model);
                goto done;
            }
            char *src = malloc((size_t)kv->v.str.len + 1);
            if (!src) { st = moetax_error(MOETAX_ERR_NOMEM, "out of memory"); goto done; }
            memcpy(src, kv->v.str.data, (size_t)kv->v.str.len);
            src[kv->v.str.len] = 0;
            ct = srv_chat_detect(src);
            free(src);
            if (ct == SRV_CHAT_UNKNOWN) {
                st = moetax_error(MOETAX_ERR_UNSUPPORTED, "--chat: the chat template of %s is not one moetax knows; use "
                                  "--chat-template NAME (e.g. chatml) to force one", model);
                goto done;
            }
        }
        struct srv_chat_msg msgs[2];
        int nm = 0;
        if (sys_msg) msgs[nm++] = (struct srv_chat_msg){"system", sys_msg};
        msgs[nm++] = (struct srv_chat_msg){"user", prompt};
        size_t rl = 0;
        if (!(rendered = srv_chat_render(ct, msgs, nm, true, &rl))) { st = moetax_error(MOETAX_ERR_NOMEM, "out of memory"); goto done; }
        prompt = rendered;
        if ((st = srv_specials_load(m->gguf, &specials))) goto done;
    } else if (sys_msg || chat_tmpl) {
        st = moetax_error(MOETAX_ERR_ARG, "%s needs --chat", sys_msg ? "-sys" : "--chat-template");
        goto done;
    }
    int64_t n_prompt = 0;
    logits = malloc(sizeof(float) * (size_t)m->hp.n_vocab);
    tpot = malloc(sizeof(double) * (size_t)(n_predict + 1));
    if (!logits || !tpot) { st = moetax_error(MOETAX_ERR_NOMEM, "out of memory"); goto done; }
    if (chat) { /* the prompt's ids, then room for the generated ones */
        int32_t *cid = NULL;
        if ((st = srv_encode_special(tok, specials, prompt, strlen(prompt), moetax_tokenizer_add_bos(tok), &cid, &n_prompt)))
            goto done;
        if (!(ids = malloc(sizeof(int32_t) * (size_t)(n_prompt + n_predict + 1)))) {
            free(cid);
            st = moetax_error(MOETAX_ERR_NOMEM, "out of memory");
            goto done;
        }
        memcpy(ids, cid, sizeof(int32_t) * (size_t)n_prompt);
        free(cid);
    } else if ((st = cli_encode(tok, prompt, strlen(prompt), moetax_tokenizer_add_bos(tok), n_predict + 1, &ids, &n_prompt)))
        goto done;
    if (n_prompt == 0) { st = moetax_error(MOETAX_ERR_ARG, "the prompt is empty"); goto done; }
    if (n_prompt + n_predict > moetax_ctx_n_ctx(c)) {
        char why[80] = ""; /* the cache holds whole blocks: a given -c may have been rounded up */
        if (n_ctx > 0 && n_ctx != moetax_ctx_n_ctx(c))
            snprintf(why, sizeof why, " (-c %lld, rounded up to whole KV cache blocks)", (long long)n_ctx);
        const int64_t train = m->hp.n_ctx_train;
        char past[112] = ""; /* a -c past the trained context runs, but its outputs mean little there */
        if (train > 0 && n_prompt + n_predict > train)
            snprintf(past, sizeof past, " (past the %lld positions the model was trained on: a shorter prompt or -n is "
                     "better)", (long long)train);
        st = moetax_error(MOETAX_ERR_LIMIT, "prompt (%lld tokens) + -n %lld exceeds the context of %lld positions%s; "
                          "give -c %lld or more%s", (long long)n_prompt, (long long)n_predict,
                          (long long)moetax_ctx_n_ctx(c), why, (long long)(n_prompt + n_predict), past);
        goto done;
    }
    cli_warn_past_train("run", m, n_prompt + n_predict, "the prompt + -n");
    if (echo) { fputs(prompt, txt); fflush(txt); }
    for (int64_t i = 0; i < n_prompt; i++) moetax_sampler_accept(smp, ids[i]);
    double t0 = cli_now();
    if ((st = moetax_ctx_eval(c, ids, n_prompt, logits, false))) goto done;
    if ((st = cli_check_logits(logits, m->hp.n_vocab, n_prompt - 1))) goto done;
    double t_prefill = cli_now() - t0, t_first = 0, t_last = cli_now();
    int64_t n_gen = 0;
    char piece[256];
    while (n_gen < n_predict) {
        double ts = cli_now();
        int32_t t = moetax_sampler_sample(smp, logits);
        double now = cli_now();
        moetax_ledger_add(led, MOETAX_PHASE_SAMPLE, -1, now - ts);
        if (n_gen == 0) t_first = now - t0;
        else tpot[n_gen - 1] = now - t_last;
        t_last = now;
        n_gen++;
        if (!ignore_eos && moetax_tokenizer_is_eog(tok, t)) break;
        moetax_sampler_accept(smp, t);
        char *bytes;
        int nb = cli_token_bytes(tok, t, piece, sizeof piece, &bytes);
        if (nb > 0) { fwrite(bytes, 1, (size_t)nb, txt); fflush(txt); }
        if (bytes != piece) free(bytes);
        if (n_gen == n_predict) break;
        if ((st = moetax_ctx_eval(c, &t, 1, logits, false))) goto done;
        if ((st = cli_check_logits(logits, m->hp.n_vocab, n_prompt + n_gen - 1))) goto done;
    }
    double t_decode = t_last - t0 - t_first;
    fputc('\n', txt);
    int64_t n_tp = n_gen > 1 ? n_gen - 1 : 0;
    qsort(tpot, (size_t)n_tp, sizeof(double), cmp_f64);
    double p50 = !n_tp ? 0 : n_tp % 2 ? tpot[n_tp / 2] : 0.5 * (tpot[n_tp / 2 - 1] + tpot[n_tp / 2]); /* median */
    double dec_tps = n_tp && t_decode > 0 ? (double)n_tp / t_decode : 0;
    if (json) {
        json_t *o = cli_jobj("IIoooooi", "prompt_tokens", (json_int_t)n_prompt,
                              "generated_tokens", (json_int_t)n_gen, "prefill_tokens_per_s",
                              cli_jnum((double)n_prompt / t_prefill), "decode_tokens_per_s", cli_jnum(dec_tps),
                              "ttft_ms", cli_jnum(1e3 * t_first), "tpot_ms_mean",
                              cli_jnum(n_tp ? 1e3 * t_decode / (double)n_tp : 0), "tpot_ms_p50", cli_jnum(1e3 * p50),
                              "threads", moetax_ctx_n_threads(c));
        if ((st = cli_json_print(stdout, o))) goto done;
    }
    fprintf(stderr, "\nmoetax run: %s, %d threads\n", model, moetax_ctx_n_threads(c));
    fprintf(stderr, "  prefill: %lld tokens in %.1f ms = %.1f tok/s\n", (long long)n_prompt, 1e3 * t_prefill,
            (double)n_prompt / t_prefill);
    fprintf(stderr, "  decode:  %lld tokens in %.1f ms = %.2f tok/s\n", (long long)n_tp, 1e3 * t_decode, dec_tps);
    fprintf(stderr, "  time to first token %.1f ms, time per output token %.2f ms (median %.2f ms)\n", 1e3 * t_first,
            n_tp ? 1e3 * t_decode / (double)n_tp : 0, 1e3 * p50);
    cli_ledger_summary(stderr, led, n_tp > 0);
    /* the tokens evaluated: the prompt and every generated token but the last, which is sampled, not run */
    const int64_t n_eval = n_prompt + (n_gen > 0 ? n_gen - 1 : 0);
    if (store) cli_store_summary(stderr, store, n_eval);
    st = cli_ledger_outputs(led, m, model, &lo, store, n_eval);
done:
    if (c) moetax_ctx_set_ledger(c, NULL);
    moetax_ledger_free(led);
    moetax_ctx_free(c);
    moetax_store_free(store);
    moetax_sampler_free(smp);
    moetax_tokenizer_free(tok);
    moetax_model_free(m);
    free(ids);
    free(logits);
    free(tpot);
    free(text);
    free(rendered);
    srv_specials_free(specials);
    if (st) return cli_fail("run", st);
    return 0;
}
