/* cmd_serve.c - `moetax serve`: an OpenAI-compatible HTTP server with continuous
 * batching (src/server/: http.c the HTTP side, sched.c the one thread that
 * decodes, api.c the request/response shapes, chat_template.c the templates).
 * SIGINT/SIGTERM: stop accepting, cancel the requests in flight (their streams
 * end with an error event and [DONE]), join every thread, exit 0. */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "commands.h"
#include "store_cli.h"
#include "config_cli.h"
#include "moetax/store.h"
#include "moetax/kvcache.h"
#include "moetax/model.h"
#include "moetax/tokenizer.h"

#ifdef MOETAX_WITH_MHD
#include "server/chat_template.h"
#include "server/http.h"
#include "server/sched.h"

#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <unistd.h>

#ifdef MOETAX_WITH_MPI
#include "dist/dist.h"
#endif

/* Under mpirun the scheduler runs on the main thread, and MPI's own threads, started before
 * serve could block SIGINT/SIGTERM in them, may be the ones the signal is delivered to. So
 * on every rank the signal only writes its number into a pipe (async-signal-safe); on rank 0
 * a thread of its own reads it and stops the server, which tells the other ranks (they do not
 * stop on a signal of their own: mpirun forwards it to every rank). */
static int g_sig_pipe[2] = {-1, -1};

static void on_stop_signal(int sig) {
    const unsigned char b = (unsigned char)sig;
    if (g_sig_pipe[1] >= 0) (void)!write(g_sig_pipe[1], &b, 1);
}

#ifdef MOETAX_WITH_MPI /* only mpirun's serve installs it (the stop thread itself serves both) */
static bool install_stop_pipe(void) {
    if (pipe(g_sig_pipe) != 0) return false;
    struct sigaction sa = {0};
    sa.sa_handler = on_stop_signal;
    sigemptyset(&sa.sa_mask);
    sa.sa_flags = SA_RESTART;
    return sigaction(SIGINT, &sa, NULL) == 0 && sigaction(SIGTERM, &sa, NULL) == 0;
}
#endif

struct stop_waiter {
    struct srv_http *http;
    struct srv_sched *sched;
    atomic_bool done; /* the scheduler has returned on its own: the wake-up is not a signal */
};

static void *stop_on_signal(void *arg) {
    struct stop_waiter *w = arg;
    sigset_t ss; /* blocked in every thread serve starts; this one takes them (MPI's own threads may not) */
    sigemptyset(&ss);
    sigaddset(&ss, SIGINT);
    sigaddset(&ss, SIGTERM);
    pthread_sigmask(SIG_UNBLOCK, &ss, NULL);
    unsigned char b = 0;
    while (read(g_sig_pipe[0], &b, 1) < 0 && errno == EINTR) {}
    const int sig = b;
    if (!atomic_load(&w->done)) {
        fprintf(stderr, "moetax serve: %s, stopping\n", sig == SIGTERM ? "SIGTERM" : "SIGINT");
        srv_http_quiesce(w->http);
        srv_sched_stop(w->sched); /* the main thread's srv_sched_run returns */
    }
    return NULL;
}
#endif

static void usage(FILE *f) {
    fprintf(f,
            "usage: moetax serve [-m FILE] [--host ADDR] [--port N] [options]\n\n"
            "An OpenAI-compatible HTTP server: GET / (a dashboard page), POST /v1/completions, POST /v1/chat/completions (models with\n"
            "a known chat template), GET /v1/models, GET /health, GET /metrics (Prometheus text). Requests are\n"
            "decoded together, continuously batched: a request joins at the next step, long prompts are\n"
            "prefilled in chunks, a client that goes away frees its sequence at once.\n\n"
            "  -m, --model FILE       GGUF model (default: the trained default model)\n"
            "  --host ADDR            numeric address to bind (default 127.0.0.1; 0.0.0.0 for every interface)\n"
            "  --port N               TCP port (default 8080; 0: any free port, printed at start)\n"
            "  --api-key KEY          require \"Authorization: Bearer KEY\" (all but /health and the page /); also $MOETAX_API_KEY\n"
            "  --parallel N           sequences decoded together (default 4)\n"
            "  -c, --ctx N            KV cache cells, all sequences together (default: N x min(model context, 4096))\n"
            "  -t, --threads N        threads (default: online CPUs)\n"
            "  --experts-used K       route each token to K experts (run-time top-k)\n"
            "  --no-mmap              copy the weights into private memory of 2 MiB pages\n"
            "  --max-queue N          requests waiting for a busy slot before 503 + Retry-After (default 64;\n"
            "                         0: a request is taken only while a slot is free)\n"
            "  --max-body BYTES       largest request body (default 1M; sizes like 64K); larger is 413\n"
            "  --max-conn N           connections at once (default 256)\n"
            "  --read-timeout S       a request must arrive whole (headers and body) within S seconds of its\n"
            "                         connection's accept or previous answer, else the connection is closed,\n"
            "                         however it trickles in; so a connection idle for S seconds, a new one or\n"
            "                         a kept-alive one after its answer, is closed too (default 30; 0: no deadline)\n"
            "  -to, --timeout S       close a connection that sends and receives nothing for S seconds; time\n"
            "                         spent generating its answer does not count (default 120; 0: never). An\n"
            "                         idle connection meets --read-timeout first when that is shorter\n"
            "  --prefill-chunk N      prompt tokens per step, all sequences together, while any sequence decodes\n"
            "                         (default 64; a step with none decoding takes up to a micro-batch)\n"
            "  -ub, --ubatch N        tokens per micro-batch (default 512; with --expert-budget at most the\n"
            "                         store's): a prompt alone is prefilled this many tokens a step\n"
            "  --default-max-tokens N max_tokens when a request gives none (default 256; at most what fits)\n"
            "  --stream-interval MS   a stream sends at most one event per MS milliseconds, with the text of\n"
            "                         every token since the last one (default 5; 0: one event per step); the\n"
            "                         first token and the end go at once. Steps faster than that (small models)\n"
            "                         then do not wake the client and the server's HTTP thread every token.\n"
            "                         With N > 2 streams at once each waits MS x N/2 (all of them together\n"
            "                         send at most 2 events per MS), at most 25 ms or MS where that is longer\n"
            "  --adapt-threads        run each step on all threads or half of them, whichever measures faster\n"
            "                         (a machine busy with other work; see 'moetax run --help')\n"
            "  --no-prefix-reuse      free a finished request's KV cells at once (default: keep them until the\n"
            "                         space is needed, for a next prompt that starts with the same tokens)\n"
            "  --chat-template NAME   use this template (chatml, llama3, deepseek2, deepseek3, mistral-v7, ...)\n"
            "                         instead of detecting it from tokenizer.chat_template\n"
            "  --capacity-factor C    cap each expert at ceil(C x tokens x k / E) assignments per step (off by\n"
            "                         default); --overflow drop|reroute\n"
            CLI_CACHE_TYPE_HELP CLI_MLA_PREFILL_HELP
            CLI_CONFIG_HELP
            "%s"
            "A request's prompt + max_tokens must fit min(-c, the model's context length) positions (else 400).\n"
            "GET /tax[?window=S] gives the bill of the last S seconds (default 60) as JSON.\n", cli_store_help());
}

#ifndef MOETAX_WITH_MHD
int cmd_serve(int argc, char **argv) {
    for (int i = 1; i < argc; i++)
        if (cli_flag(argv, i, "-h", "--help")) { usage(stdout); return 0; }
    fprintf(stderr, "moetax serve: this moetax was built without libmicrohttpd (Debian: libmicrohttpd-dev; "
                    "scripts/deps.sh installs it): rebuild to get the server\n");
    return 1;
}
#else

int cmd_serve(int argc, char **argv) {
    const char *model = NULL, *host = "127.0.0.1", *api_key = getenv("MOETAX_API_KEY"), *tmpl_name = NULL;
    int64_t port = 8080, parallel = 4, n_ctx = 0, n_threads = 0, max_queue = 64, max_conn = 256, chunk = 64, ubatch = 0;
    int64_t default_max = 256, read_timeout = 30, idle_timeout = 120;
    double stream_iv_ms = 5;
    bool adapt = false;
    uint64_t max_body = 1 << 20;
    int k_ctx = 0;
    bool no_mmap = false, no_reuse = false;
    enum moetax_type kv_type = MOETAX_TYPE_F32;
    enum moetax_attn_prefill prefill = MOETAX_ATTN_PREFILL_ABSORBED; /* --mla-prefill */
    double capf = 0;
    enum moetax_overflow overflow = MOETAX_OVERFLOW_DROP;
    bool overflow_given = false, cf_given = false;
    struct cli_store_opts so = {0};
    struct cli_config cfg; /* --config: defaults, the options below win */
    if (cli_config_scan(argc, argv, &cfg)) return cli_usage_error("serve", "%s", moetax_last_error());
    if (cfg.loaded) {
        n_threads = cfg.threads, k_ctx = cfg.experts_used, no_mmap = cfg.no_mmap, kv_type = cfg.cache_type;
        prefill = cfg.mla_prefill;
        capf = cfg.capacity_factor, overflow = cfg.overflow;
        cli_config_store(&cfg, &so);
    }
    for (int i = 1; i < argc; i++) {
        const char *v = NULL;
        bool err = false;
        int64_t iv;
        if (cli_config_opt(argc, argv, &i, &err)) { if (err) return 2; continue; }
        if (cli_flag(argv, i, "-h", "--help")) { usage(stdout); return 0; }
        else if (cli_opt(argc, argv, &i, "-m", "--model", &model, &err)) { if (err) return 2; }
        else if (cli_opt(argc, argv, &i, NULL, "--host", &host, &err)) { if (err) return 2; }
        else if (cli_opt(argc, argv, &i, NULL, "--api-key", &api_key, &err)) { if (err) return 2; }
        else if (cli_opt(argc, argv, &i, NULL, "--chat-template", &tmpl_name, &err)) { if (err) return 2; }
#define INT_OPT(s, l, var, lo, hi) else if (cli_opt(argc, argv, &i, s, l, &v, &err)) { \
        if (err || !cli_parse_i64(v, &iv) || iv < (lo) || iv > (hi)) \
            return cli_usage_error("serve", "%s: expected an integer in %lld..%lld", l, (long long)(lo), (long long)(hi)); \
        var = iv; }
        INT_OPT(NULL, "--port", port, 0, 65535)
        INT_OPT(NULL, "--parallel", parallel, 1, 256)
        INT_OPT("-c", "--ctx", n_ctx, 1, 1 << 24)
        INT_OPT("-t", "--threads", n_threads, 1, 512)
        INT_OPT(NULL, "--max-queue", max_queue, 0, 1 << 20)
        INT_OPT(NULL, "--max-conn", max_conn, 1, 1 << 16)
        INT_OPT(NULL, "--prefill-chunk", chunk, 1, 4096)
        INT_OPT("-ub", "--ubatch", ubatch, 1, 4096)
        INT_OPT(NULL, "--default-max-tokens", default_max, 1, 1 << 24)
#undef INT_OPT
        else if (cli_opt(argc, argv, &i, NULL, "--read-timeout", &v, &err)) {
            if (err || !cli_parse_i64(v, &iv) || iv < 0 || iv > 86400)
                return cli_usage_error("serve", "--read-timeout: expected whole seconds in 0..86400 (0: no deadline)");
            read_timeout = iv;
        }
        else if (cli_opt(argc, argv, &i, "-to", "--timeout", &v, &err)) {
            if (err || !cli_parse_i64(v, &iv) || iv < 0 || iv > 86400)
                return cli_usage_error("serve", "--timeout: expected whole seconds in 0..86400 (0: never)");
            idle_timeout = iv;
        }
        else if (cli_opt(argc, argv, &i, NULL, "--stream-interval", &v, &err)) {
            if (err || !cli_parse_f64(v, &stream_iv_ms) || !(stream_iv_ms >= 0 && stream_iv_ms <= 1000))
                return cli_usage_error("serve", "--stream-interval: expected milliseconds in 0..1000");
        }
        else if (cli_opt(argc, argv, &i, NULL, "--max-body", &v, &err)) {
            if (err || !cli_parse_size(v, &max_body) || max_body < 16 || max_body > ((uint64_t)1 << 32))
                return cli_usage_error("serve", "--max-body: expected a size from 16 bytes to 4G (64K, 1M)");
        }
        else if (cli_opt(argc, argv, &i, NULL, "--experts-used", &v, &err)) {
            if (err || !cli_parse_experts_used(v, &k_ctx)) return cli_usage_error("serve", "--experts-used needs a count in 1..256");
        }
        else if (cli_opt(argc, argv, &i, NULL, "--capacity-factor", &v, &err)) {
            if (!err && !strcmp(v, "inf")) capf = 0;
            else if (err || !cli_parse_f64(v, &capf) || !(capf > 0) || !cli_capacity_factor_ok(&capf))
                return cli_usage_error("serve", "--capacity-factor needs a number >= 1e-45 (inf: off)");
            cf_given = true;
        }
        else if (cli_opt(argc, argv, &i, NULL, "--overflow", &v, &err)) {
            if (err || (strcmp(v, "drop") && strcmp(v, "reroute")))
                return cli_usage_error("serve", "--overflow: expected drop or reroute");
            overflow_given = true;
            overflow = strcmp(v, "drop") ? MOETAX_OVERFLOW_REROUTE : MOETAX_OVERFLOW_DROP;
        }
        else if (cli_cache_type_opt("serve", argc, argv, &i, &kv_type, &err)) { if (err) return 2; }
        else if (cli_mla_prefill_opt("serve", argc, argv, &i, &prefill, &err)) { if (err) return 2; }
        else if (cli_store_opt(argc, argv, &i, &so, &err)) { if (err) return 2; }
        else if (cli_flag(argv, i, NULL, "--no-mmap")) no_mmap = true;
        else if (cli_flag(argv, i, NULL, "--no-prefix-reuse")) no_reuse = true;
        else if (cli_flag(argv, i, NULL, "--adapt-threads")) adapt = true;
        else return cli_usage_error("serve", "unknown option '%s' (see --help)", argv[i]);
    }
    if (overflow_given && !cf_given && capf == 0) /* the overflow of a cap that is not there */
        return cli_usage_error("serve", "--overflow goes with --capacity-factor C (without it nothing overflows)");
    /* an empty key (--api-key "$UNSET") would have turned the check off without a word */
    if (api_key && !*api_key) return cli_usage_error("serve", "--api-key (or $MOETAX_API_KEY) is empty: give a key, or "
                                                     "neither for a server without one");
    {
        moetax_status bst = cli_store_check(&so, false);
        if (bst) return cli_usage_error("serve", "%s", moetax_last_error());
    }
    if (!model) model = cli_default_model_path();
    enum srv_chat_tmpl tmpl = SRV_CHAT_UNKNOWN;
    char tmpl_names[512];
    if (tmpl_name && (tmpl = srv_chat_by_name(tmpl_name)) == SRV_CHAT_UNKNOWN)
        return cli_usage_error("serve", "--chat-template %s: not a template moetax knows; the names are %s", tmpl_name,
                               srv_chat_names(tmpl_names, sizeof tmpl_names));

    /* SIGINT/SIGTERM are taken by sigwait below: blocked in every thread started from here on */
    sigset_t sigs;
    sigemptyset(&sigs);
    sigaddset(&sigs, SIGINT);
    sigaddset(&sigs, SIGTERM);
    pthread_sigmask(SIG_BLOCK, &sigs, NULL);
    signal(SIGPIPE, SIG_IGN);

    struct moetax_model *m = NULL;
    struct moetax_tokenizer *tok = NULL;
    struct srv_sched *sched = NULL;
    struct srv_http *http = NULL;
    struct srv_specials *specials = NULL;
    struct moetax_store *store = NULL;
    int store_ub = 0;
    moetax_status st;
    struct moetax_model_params mp = {.no_mmap = no_mmap, .expert_type = cfg.expert_type};
    if ((st = moetax_model_load_ex(model, &mp, &m))) goto done;
    if ((st = moetax_model_check_experts_used(m, k_ctx))) goto done;
    if ((st = moetax_tokenizer_load(m->gguf, &tok))) goto done;
    if (moetax_tokenizer_n_vocab(tok) != m->hp.n_vocab) {
        st = moetax_error(MOETAX_ERR_FORMAT, "%s: the vocabulary has %d tokens but token_embd has %d rows", model,
                          moetax_tokenizer_n_vocab(tok), m->hp.n_vocab);
        goto done;
    }
    const struct moetax_gguf_kv *kv = moetax_gguf_find_kv(m->gguf, "tokenizer.chat_template");
    char *tmpl_src = NULL;
    if (!tmpl_name && kv && kv->type == MOETAX_GGUF_TYPE_STRING && (tmpl_src = malloc(kv->v.str.len + 1))) {
        memcpy(tmpl_src, kv->v.str.data, kv->v.str.len);
        tmpl_src[kv->v.str.len] = 0;
        tmpl = srv_chat_detect(tmpl_src);
        if (tmpl == SRV_CHAT_UNKNOWN)
            fprintf(stderr, "moetax serve: tokenizer.chat_template is not one moetax knows; /v1/chat/completions "
                            "is off (--chat-template NAME picks one)\n");
        free(tmpl_src);
    }
    if (so.budgets) { /* routed experts behind an expert store of this budget */
        uint64_t budget;
        so.n_expert_used = k_ctx;
        if (!cli_store_parse_budget(so.budgets, moetax_model_store_bytes_all(m), &budget)) {
            st = moetax_error(MOETAX_ERR_ARG, "--expert-budget: '%s' is not a size (2G, 512M) or a percentage (25%%)",
                              so.budgets);
            goto done;
        }
        store_ub = (int)(parallel + chunk < 512 ? parallel + chunk : 512);
        if ((st = cli_store_open(m, &so, budget, &store_ub, &store))) goto done;
    }
    const int64_t per_seq = m->hp.n_ctx_train > 0 && m->hp.n_ctx_train < 4096 ? m->hp.n_ctx_train : 4096;
    struct srv_sched_params sp = {.model = m, .tok = tok, .n_parallel = (int)parallel,
                                  .n_ctx = n_ctx ? n_ctx : parallel * (per_seq + MOETAX_KV_BLOCK_DEFAULT),
                                  .n_threads = (int)n_threads, .n_expert_used = k_ctx, .max_queue = (int)max_queue,
                                  .prefill_chunk = (int)chunk, .n_ubatch = (int)ubatch, .no_prefix_reuse = no_reuse, .adapt_threads = adapt, .store = store,
                                  .n_ubatch_store = store_ub, .no_prefetch = so.no_prefetch, .kv_type = kv_type, .attn_prefill = prefill,
                                  .capacity_factor = (float)capf, .overflow = overflow};
    if (sp.n_ctx > INT32_MAX) { st = moetax_error(MOETAX_ERR_ARG, "-c: too many cells"); goto done; }
    if ((st = srv_specials_load(m->gguf, &specials))) goto done;
#ifdef MOETAX_WITH_MPI
    const struct moetax_dist *world = moetax_dist_world();
    if (world && world->size > 1) {
        if (!install_stop_pipe()) {
            st = moetax_error(MOETAX_ERR_IO, "cannot install the signal handlers");
            goto done;
        }
        if (world->rank > 0) { /* a follower: rank 0's steps on this rank's experts, until it stops */
            st = srv_sched_follow(&sp);
            goto done;
        }
        sp.mpi = true;
    }
#endif
    if ((st = srv_sched_start(&sp, &sched))) goto done;
    const char *base = strrchr(model, '/');
    struct srv_http_params hp = {.host = host, .port = (int)port, .api_key = api_key, .max_body = (size_t)max_body,
                                 .max_conn = (int)max_conn, .model_name = base ? base + 1 : model, .sched = sched,
                                 .tok = tok, .tmpl = tmpl, .specials = specials, .default_max_tokens = default_max,
                                 .stream_interval_s = stream_iv_ms * 1e-3, .read_timeout_s = (double)read_timeout,
                                 .idle_timeout_s = (unsigned)idle_timeout};
    if ((st = srv_http_start(&hp, &http))) goto done;
    fprintf(stderr, "moetax serve: %s, %d slots, %lld KV cells, %lld positions per request, chat template %s\n", model,
            (int)parallel, (long long)srv_sched_n_ctx(sched), (long long)srv_sched_max_seq(sched), srv_chat_name(tmpl));
    fprintf(stderr, "moetax serve: listening on http://%s%s%s:%d\n", strchr(host, ':') ? "[" : "", host,
            strchr(host, ':') ? "]" : "", srv_http_port(http));
    if (sp.mpi) { /* the scheduler runs here (MPI is FUNNELED); a thread of its own waits for the signal */
        struct stop_waiter sw = {.http = http, .sched = sched};
        pthread_t th;
        if (pthread_create(&th, NULL, stop_on_signal, &sw) != 0) {
            st = moetax_error(MOETAX_ERR_INTERNAL, "cannot start the signal thread");
            srv_sched_stop(sched);
            (void)srv_sched_run(sched); /* returns at once: the other ranks get their stop */
            goto done;
        }
        st = srv_sched_run(sched); /* until the signal, or a failed step (a rank gone) */
        if (st) fprintf(stderr, "moetax serve: stopping: %s\n", moetax_last_error());
        atomic_store(&sw.done, true);
        on_stop_signal(0); /* wakes it if no signal came */
        pthread_join(th, NULL);
        srv_http_drain(http, 2000);
        goto done;
    }
    int sig = 0;
    sigwait(&sigs, &sig);
    fprintf(stderr, "moetax serve: %s, stopping\n", sig == SIGTERM ? "SIGTERM" : "SIGINT");
    srv_http_quiesce(http);
    srv_sched_stop(sched); /* every request ends: the connections' threads return */
    srv_http_drain(http, 2000); /* the streams' endings reach their clients; idle keep-alive ones are cut */
done:
    srv_http_stop(http);
    srv_sched_free(sched);
    moetax_store_free(store);
    srv_specials_free(specials);
    moetax_tokenizer_free(tok);
    moetax_model_free(m);
    return st ? cli_fail("serve", st) : 0;
}
#endif
