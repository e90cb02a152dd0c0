/* run_parallel.c - `moetax run --parallel N -f PROMPTS`: the prompts of a file
 * (one per line) decoded N at a time in one context, continuously batched: each
 * step decodes one token of every running sequence (and the whole prompt of a
 * sequence that just joined), and a sequence that ends (end of text or -n
 * tokens) frees its cache cells and slot for the next prompt. Each completion
 * is printed when it ends, then the aggregate speed and the ledger's batch
 * figures. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "ledger_cli.h"
#include "run_parallel.h"
#include "moetax/kvcache.h"
#include "moetax/ledger.h"
#include "moetax/model.h"
#include "moetax/sampler.h"
#include "moetax/tokenizer.h"

struct seq_state {
    int prompt;               /* index of its prompt, -1: slot free */
    int64_t n_prompt, n_gen;
    int64_t blocks;           /* cache blocks it may take: its prompt and -n tokens */
    int32_t next;             /* the token to feed at the next step */
    struct moetax_sampler *smp;
    char *out;                /* generated text */
    size_t out_len, out_cap;
    double t_start, t_first;
};

static bool append(struct seq_state *s, const char *p, size_t n) {
    if (s->out_len + n + 1 > s->out_cap) {
        size_t cap = (s->out_len + n + 1) * 2;
        char *o = realloc(s->out, cap);
        if (!o) return false;
        s->out = o;
        s->out_cap = cap;
    }
    memcpy(s->out + s->out_len, p, n);
    s->out_len += n;
    s->out[s->out_len] = 0;
    return true;
}

/* Split text into non-empty lines (in place). */
static int split_lines(char *text, char ***out) {
    int n = 0, cap = 16;
    char **v = malloc(sizeof(char *) * (size_t)cap);
    if (!v) return -1;
    for (char *save = NULL, *l = strtok_r(text, "\n", &save); l; l = strtok_r(NULL, "\n", &save)) {
        size_t len = strlen(l);
        if (len && l[len - 1] == '\r') l[--len] = 0;
        if (!len) continue;
        if (n == cap) {
            char **w = realloc(v, sizeof(char *) * (size_t)(cap *= 2));
            if (!w) { free(v); return -1; }
            v = w;
        }
        v[n++] = l;
    }
    *out = v;
    return n;
}

moetax_status run_parallel(const struct run_parallel_opts *o, char *prompts_text) {
    char **prompts = NULL;
    const int np = split_lines(prompts_text, &prompts);
    if (np < 0) return moetax_error(MOETAX_ERR_NOMEM, "out of memory");
    if (np == 0) { free(prompts); return moetax_error(MOETAX_ERR_ARG, "%s: no prompts (one per line)", o->prompts_path); }
    const int N = o->parallel < np ? o->parallel : np;
    struct moetax_model *m = NULL;
    struct moetax_tokenizer *tok = NULL;
    struct moetax_ctx *c = NULL;
    struct moetax_ledger *led = NULL;
    struct moetax_batch b = {0};
    struct seq_state *seqs = calloc((size_t)N, sizeof *seqs);
    int32_t **ids = calloc((size_t)np, sizeof *ids);
    int64_t *n_ids = calloc((size_t)np, sizeof *n_ids), max_prompt = 0, total_prompt = 0;
    float *logits = NULL;
    moetax_status st = MOETAX_OK;
    if (!seqs || !ids || !n_ids) { st = moetax_error(MOETAX_ERR_NOMEM, "out of memory"); goto done; }
    struct moetax_model_params mp = {.no_mmap = o->no_mmap, .expert_type = o->expert_type};
    if ((st = moetax_model_load_ex(o->model, &mp, &m))) goto done;
    if ((st = moetax_tokenizer_load(m->gguf, &tok))) goto done;
    for (int i = 0; i < np; i++) { /* every prompt tokenized (and checked) before any work */
        const size_t len = strlen(prompts[i]);
        if ((st = cli_encode(tok, prompts[i], len, moetax_tokenizer_add_bos(tok), 0, &ids[i], &n_ids[i]))) goto done;
        max_prompt = n_ids[i] > max_prompt ? n_ids[i] : max_prompt;
        total_prompt += n_ids[i];
    }
    for (int i = 0; i < np; i++) {
        char what[48];
        snprintf(what, sizeof what, "prompt %d (%lld tokens) + -n", i + 1, (long long)n_ids[i]);
        if (cli_warn_past_train("run", m, n_ids[i] + o->n_predict, what)) break; /* the first is enough */
    }
    /* cells: every slot holding the longest prompt and all its tokens, unless -c says */
    const int64_t bs = MOETAX_KV_BLOCK_DEFAULT;
    const int64_t need = (int64_t)N * ((max_prompt + o->n_predict + bs - 1) / bs * bs);
    if (!o->n_ctx && need > (1 << 24)) { /* (int32_t) below wrapped: the model's context, and no prompt fit */
        st = moetax_error(MOETAX_ERR_LIMIT, "%d slots of the longest prompt (%lld tokens) + -n %lld need %lld KV cells, "
                          "more than %d: lower -n or --parallel", N, (long long)max_prompt, (long long)o->n_predict,
                          (long long)need, 1 << 24);
        goto done;
    }
    struct moetax_ctx_params cp = {.n_ctx = (int32_t)(o->n_ctx ? o->n_ctx : need), .n_threads = (int32_t)o->n_threads,
                                   .n_expert_used = o->experts_used, .n_seq_max = N, .kv_type = o->kv_type,
                                   .check_finite = o->check_finite, .adapt_threads = o->adapt_threads,
                                   .n_ubatch = N < 64 ? 64 : N > 512 ? 512 : N}; /* a decode step in one micro-batch */
    if (o->n_ctx && o->n_ctx < max_prompt + o->n_predict) {
        st = moetax_error(MOETAX_ERR_LIMIT, "-c %lld cells cannot hold the longest prompt (%lld tokens) + -n %lld",
                          (long long)o->n_ctx, (long long)max_prompt, (long long)o->n_predict);
        goto done;
    }
    if ((st = moetax_ctx_init(m, &cp, &c))) goto done;
    if ((st = cli_ledger_new(m, moetax_ctx_n_threads(c), o->lo, &led))) goto done;
    moetax_ctx_set_ledger(c, led);
    if ((st = moetax_batch_init(&b, (int32_t)(N * max_prompt + N)))) goto done;
    for (int s = 0; s < N; s++) {
        seqs[s].prompt = -1;
        struct moetax_sampler_params sp = o->sampler;
        sp.seed = o->sampler.seed + (uint64_t)s;
        if ((st = moetax_sampler_init(&sp, m->hp.n_vocab, &seqs[s].smp))) goto done;
    }
    fprintf(stderr, "moetax run: %d prompts, %d at a time, %lld KV cells\n", np, N, (long long)moetax_ctx_n_ctx(c));
    const double t0 = cli_now();
    int next_prompt = 0, done_n = 0;
    int64_t n_gen_total = 0, steps = 0, max_running = 0, blocks_held = 0;
    struct moetax_kvcache *kv = moetax_ctx_kv(c);
    const int64_t blocks_all = moetax_kvcache_n_cells(kv) / moetax_kvcache_block_size(kv);
    while (done_n < np && !st) {
        /* free slots take the next prompts; then one batch: the new prompts and a token of the others */
        moetax_batch_clear(&b);
        int running = 0;
        for (int s = 0; s < N && !st; s++) {
            struct seq_state *q = &seqs[s];
            if (q->prompt < 0 && next_prompt < np) {
                /* a new prompt starts only when the cache can hold all it may need besides what the
                 * running ones may still take: nobody meets a full cache halfway */
                const int64_t bsz = moetax_kvcache_block_size(kv);
                const int64_t want = (n_ids[next_prompt] + o->n_predict + bsz - 1) / bsz;
                if (blocks_held + want > blocks_all) continue;
                blocks_held += want;
                q->blocks = want;
                q->prompt = next_prompt++;
                q->n_prompt = n_ids[q->prompt];
                q->n_gen = 0;
                q->out_len = 0;
                q->t_start = cli_now();
                moetax_sampler_reset(q->smp);
                for (int64_t i = 0; i < q->n_prompt && !st; i++) {
                    moetax_sampler_accept(q->smp, ids[q->prompt][i]);
                    st = moetax_batch_add(&b, ids[q->prompt][i], (int32_t)i, s, i == q->n_prompt - 1);
                }
            } else if (q->prompt >= 0) {
                st = moetax_batch_add(&b, q->next, (int32_t)(q->n_prompt + q->n_gen - 1), s, true);
            }
            running += q->prompt >= 0;
        }
        if (st) break;
        max_running = running > max_running ? running : max_running;
        if ((st = moetax_ctx_decode(c, &b))) break;
        steps++;
        for (int i = 0; i < b.n_tokens; i++) {
            if (!b.logits[i]) continue;
            struct seq_state *q = &seqs[b.seq[i]];
            const double ts = cli_now();
            int32_t t = moetax_sampler_sample(q->smp, moetax_ctx_logits_ith(c, i));
            moetax_ledger_add(led, MOETAX_PHASE_SAMPLE, -1, cli_now() - ts);
            if (q->n_gen == 0) q->t_first = cli_now() - q->t_start;
            q->n_gen++;
            n_gen_total++;
            const bool eog = !o->ignore_eos && moetax_tokenizer_is_eog(tok, t);
            const bool end = eog || q->n_gen >= o->n_predict;
            if (!eog) {
                char piece[256], *bytes;
                int nb = cli_token_bytes(tok, t, piece, sizeof piece, &bytes);
                const bool ok = nb <= 0 || append(q, bytes, (size_t)nb);
                if (bytes != piece) free(bytes);
                if (!ok) { st = moetax_error(MOETAX_ERR_NOMEM, "out of memory"); break; }
                moetax_sampler_accept(q->smp, t);
            }
            q->next = t;
            if (!end) continue;
            /* done: print it, free its cells and slot */
            FILE *f = o->json ? stderr : stdout;
            fprintf(f, "--- [%d] %.1f ms to first token, %lld tokens\n", q->prompt, 1e3 * q->t_first, (long long)q->n_gen);
            if (o->echo) fputs(prompts[q->prompt], f);
            fputs(q->out ? q->out : "", f);
            fputc('\n', f);
            fflush(f);
            moetax_kvcache_seq_rm(kv, b.seq[i], 0, -1);
            blocks_held -= q->blocks;
            q->prompt = -1;
            done_n++;
        }
    }
    if (st) goto done;
    const double wall = cli_now() - t0;
    struct moetax_ledger_moe_stats ms;
    moetax_ledger_moe_totals(led, true, &ms);
    double ph[MOETAX_PHASE_COUNT], dwall;
    int64_t dtok, dsteps;
    moetax_ledger_totals(led, true, ph, &dwall, &dtok, &dsteps);
    const double imb = ms.moe_layers ? ms.imbalance_sum / (double)ms.moe_layers : 0;
    const double uniq = ms.moe_layers ? (double)ms.experts / (double)ms.moe_layers : 0;
    if (o->json) {
        st = cli_json_print(stdout, cli_jobj("iiIIIIfffffi", "prompts", np, "parallel", N, "prompt_tokens", total_prompt,
                                             "generated_tokens", n_gen_total, "steps", steps, "decode_steps", dsteps,
                                             "wall_s", wall, "tokens_per_s", (double)(total_prompt + n_gen_total) / wall,
                                             "generated_per_s", (double)n_gen_total / wall,
                                             "experts_per_layer_step", uniq, "imbalance", imb,
                                             "threads", moetax_ctx_n_threads(c)));
    }
    fprintf(stderr, "\nmoetax run --parallel %d: %d prompts (%lld tokens), %lld generated in %.2f s: %.1f generated tok/s "
            "(%.1f tok/s with the prompts), %lld steps, up to %lld sequences at once\n",
            N, np, (long long)total_prompt, (long long)n_gen_total, wall, (double)n_gen_total / wall,
            (double)(total_prompt + n_gen_total) / wall, (long long)steps, (long long)max_running);
    fprintf(stderr, "  decode steps: %lld, %.1f sequences per step, %.1f distinct experts per MoE layer and step, "
            "imbalance %.2f\n", (long long)dsteps, dsteps ? (double)dtok / (double)dsteps : 0, uniq, imb);
    cli_ledger_summary(stderr, led, dsteps > 0);
    if (!st) st = cli_ledger_outputs(led, m, o->model, o->lo, NULL, total_prompt + n_gen_total);
done:
    if (c) moetax_ctx_set_ledger(c, NULL);
    moetax_batch_free(&b);
    if (seqs)
        for (int s = 0; s < N; s++) {
            moetax_sampler_free(seqs[s].smp);
            free(seqs[s].out);
        }
    free(seqs);
    if (ids)
        for (int i = 0; i < np; i++) free(ids[i]);
    free(ids);
    free(n_ids);
    free(logits);
    free(prompts);
    moetax_ledger_free(led);
    moetax_ctx_free(c);
    moetax_tokenizer_free(tok);
    moetax_model_free(m);
    return st;
}
