/* bench_batch.c - `moetax bench -m FILE --batch 1,2,4,8,16`: B sequences decode
 * together, like llama-batched-bench. Each sequence has its own prompt of -p
 * tokens (all prompts prefilled first, in one batch), then every step decodes
 * one token of each sequence. Per B: aggregate tokens/s, per-sequence TPOT
 * percentiles (a step's time: each sequence gets one token per step), and the
 * batch tax from the ledger: distinct experts read per step, expert bytes per
 * token, load imbalance, wait share, tax share, and the step's bandwidth ratio
 * (bytes the step read over the read bandwidth measured just before each
 * repetition, as bench's paired ratio). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench.h"
#include "cli.h"
#include "ledger_cli.h"
#include "store_cli.h"
#include "moetax/kvcache.h"
#include "moetax/ledger.h"
#include "moetax/membw.h"
#include "moetax/model.h"
#include "moetax/pool.h"

/* One B: reps repetitions (after a warm-up) of prefill + n_gen decode steps. */
/* Token i of sequence s in repetition r: from the text (-f; each sequence its own stretch, fresh
 * each repetition) or pseudo-random. */
static int32_t tok_at(const struct bench_batch_opts *o, int64_t V, int64_t r, int s, int B, int64_t i) {
    const int64_t span = o->n_prompt + o->n_gen + 1;
    if (o->text) return o->text[(((r + 1) * B + s) * span + i) % o->n_text];
    return (int32_t)((i * 7919 + s * 104729 + (r + 1) * 15485863LL + 13) % V);
}

/* shared: one ledger for every B (--ledger / --trace), else each B its own. */
static moetax_status one_batch(const struct moetax_model *m, const char *base, struct moetax_pool *pool,
                               struct moetax_membw_probe *probe, double read_gbps, const struct bench_batch_opts *o,
                               int B, struct moetax_ledger *shared, bool *paired_bad) {
    const int64_t V = m->hp.n_vocab, np = o->n_prompt, ng = o->n_gen;
    const int threads = moetax_pool_n_threads(pool);
    const int k = o->experts_used ? o->experts_used : m->hp.n_expert_used;
    const int64_t bs = MOETAX_KV_BLOCK_DEFAULT, per_seq = (np + ng + 1 + bs - 1) / bs * bs; /* whole blocks */
    if (B * per_seq > INT32_MAX || B * (np > 1 ? np : 1) > INT32_MAX) /* the context's and the batch's int32 sizes */
        return moetax_error(MOETAX_ERR_LIMIT, "--batch %d x (-p %lld + -n %lld) is %lld cells, more than a context "
                            "holds (%d)", B, (long long)np, (long long)ng, (long long)(B * per_seq), INT32_MAX);
    struct moetax_ctx_params cp = {.n_ctx = (int32_t)(B * per_seq), .pool = pool, .n_seq_max = B,
                                   .n_ubatch = B < 64 ? 64 : B > 512 ? 512 : B, .n_expert_used = o->experts_used,
                                   .kv_type = o->kv_type,
                                   .capacity_factor = o->capacity_factor, .overflow = o->overflow};
    struct moetax_ctx *c = NULL;
    struct moetax_ledger *led = NULL;
    struct moetax_batch b = {0};
    double *step_t = malloc(sizeof(double) * (size_t)(ng * o->reps + 1));
    double *rep_tps = malloc(sizeof(double) * (size_t)(o->reps + 1)), *rep_pair = malloc(sizeof(double) * (size_t)(o->reps + 1));
    moetax_status st = MOETAX_OK;
    if (!step_t || !rep_tps || !rep_pair) st = moetax_error(MOETAX_ERR_NOMEM, "out of memory");
    if (!st) st = moetax_ctx_init(m, &cp, &c);
    struct moetax_ledger_params lp = {.n_workers = threads, .n_layer = m->hp.n_layer};
    if (!st && !shared) st = moetax_ledger_init(&lp, &led);
    struct moetax_ledger *own = led;
    if (shared) led = shared;
    if (!st) st = moetax_batch_init(&b, (int32_t)(B * (np > 1 ? np : 1)));
    if (st) goto done;
    moetax_ctx_set_ledger(c, led);
    /* bytes a decode step reads besides the experts the ledger counts: the non-expert weights
     * (once per step, whatever B) and each sequence's KV cache rows */
    const double expert_total = (double)cli_store_expert_bytes(m);
    const double nonexpert = moetax_model_active_bytes_k(m, o->experts_used) -
                             (m->hp.n_expert ? expert_total * k / m->hp.n_expert : 0);
    const double kv_row_bytes = (double)moetax_ctx_kv_bytes(c) / (double)moetax_ctx_n_ctx(c); /* a cell, all layers (MLA or GQA) */
    int nt = 0, nrep = 0, npair = 0;
    struct moetax_ledger_moe_stats ms0 = {0}, ms1;
    double ph0[MOETAX_PHASE_COUNT], ph1[MOETAX_PHASE_COUNT], wall0 = 0, wall1;
    int64_t tok0 = 0, tok1, steps0 = 0, steps1;
    for (int64_t r = -1; r < o->reps && !st; r++) {
        moetax_ctx_reset(c);
        /* prompts: B sequences of np tokens, interleaved in one batch; their own tokens each rep */
        moetax_batch_clear(&b);
        for (int64_t i = 0; i < (np > 0 ? np : 1) && !st; i++)
            for (int s = 0; s < B && !st; s++)
                st = moetax_batch_add(&b, tok_at(o, V, r, s, B, i), (int32_t)i, s, i == (np > 0 ? np : 1) - 1);
        if (!st) st = moetax_ctx_decode(c, &b);
        double bw = 0;
        if (probe) bw = cli_read_pass(probe); /* the warm-up's (r < 0) is not used */
        if (r < 0) bw = 0;
        if (r == 0) {
            moetax_ledger_totals(led, true, ph0, &wall0, &tok0, &steps0);
            moetax_ledger_moe_totals(led, true, &ms0);
        }
        double t_rep = 0, bytes_rep = 0;
        struct moetax_ledger_moe_stats mb, ma;
        for (int64_t j = 0; j < ng && !st; j++) {
            moetax_batch_clear(&b);
            const int64_t pos = (np > 0 ? np : 1) + j;
            for (int s = 0; s < B && !st; s++)
                st = moetax_batch_add(&b, tok_at(o, V, r, s, B, pos), (int32_t)pos, s, true);
            moetax_ledger_moe_totals(led, true, &mb);
            double a = cli_now();
            if (!st) st = moetax_ctx_decode(c, &b);
            double dt = cli_now() - a;
            moetax_ledger_moe_totals(led, true, &ma);
            if (r >= 0) {
                step_t[nt++] = dt;
                t_rep += dt;
                bytes_rep += nonexpert + (ma.expert_bytes - mb.expert_bytes) + kv_row_bytes * (double)(B * (pos + 1));
            }
        }
        if (r >= 0 && t_rep > 0) {
            rep_tps[nrep++] = (double)(B * ng) / t_rep;
            if (bw > 0) rep_pair[npair++] = bytes_rep / t_rep / 1e9 / bw;
        }
    }
    if (st) goto done;
    moetax_ledger_totals(led, true, ph1, &wall1, &tok1, &steps1);
    moetax_ledger_moe_totals(led, true, &ms1);
    double dph[MOETAX_PHASE_COUNT], total = 0;
    for (int p = 0; p < MOETAX_PHASE_COUNT; p++) total += (dph[p] = ph1[p] - ph0[p]);
    const int64_t steps = steps1 - steps0, toks = tok1 - tok0;
    const double layers = (double)(ms1.moe_layers - ms0.moe_layers);
    const double uniq_step = steps ? (double)(ms1.experts - ms0.experts) / (double)steps : 0;
    const double uniq_layer = layers > 0 ? (double)(ms1.experts - ms0.experts) / layers : 0;
    const double eb_tok = toks ? (ms1.expert_bytes - ms0.expert_bytes) / (double)toks : 0;
    const double imb = layers > 0 ? (ms1.imbalance_sum - ms0.imbalance_sum) / layers : 0;
    const double wait_share = total > 0 ? dph[MOETAX_PHASE_WAIT] / total : 0;
    const int64_t dropped = ms1.dropped - ms0.dropped, rerouted = ms1.rerouted - ms0.rerouted;
    const int64_t assigned = ms1.assignments - ms0.assignments;
    const double tps = cli_percentile(rep_tps, nrep, 0.5), p50 = 1e3 * cli_percentile(step_t, nt, 0.5), p99 = 1e3 * cli_percentile(step_t, nt, 0.99);
    const double paired = npair ? cli_percentile(rep_pair, npair, 0.5) : 0;
    const double tax = moetax_ledger_tax_share(dph);
    if (o->json) {
        json_t *jo = cli_jobj("ssiiIIffffffffffIIb", "model", base, "test", "batch", "threads", threads,
                              "batch", B, "n_prompt", (int64_t)np, "n_gen", (int64_t)ng, "tokens_per_s", tps,
                              "tpot_p50_ms", p50, "tpot_p99_ms", p99, "unique_experts_per_step", uniq_step,
                              "unique_experts_per_layer", uniq_layer, "expert_bytes_per_token", eb_tok,
                              "imbalance", imb, "wait_share", wait_share, "tax_share", tax,
                              "read_gbps", read_gbps, "dropped", dropped, "rerouted", rerouted,
                              "capacity_factor_on", o->capacity_factor > 0 && isfinite(o->capacity_factor));
        if (jo && !cli_paired_json(jo, "bandwidth_ratio", paired)) {
            json_decref(jo);
            jo = NULL;
        }
        st = cli_json_print(stdout, jo);
    } else {
        char cell[48];
        printf("| %s | %d | %d | %.2f | %.2f | %.3f | %.3f | %.1f (%.1f/layer) | %.2f | %.2f | %.1f%% | %.1f%% | %s |\n",
               base, threads, B, tps, tps / B, p50, p99, uniq_step, uniq_layer, eb_tok / (1 << 20), imb,
               100 * wait_share, 100 * tax, cli_paired_cell(paired, cell, sizeof cell));
        *paired_bad |= cli_paired_bad(paired);
    }
    if (!st && (dropped || rerouted) && !o->json)
        printf("|   | capacity factor: %lld of %lld assignments dropped (%.1f%%), %lld rerouted |\n", (long long)dropped,
               (long long)(assigned + dropped), 100.0 * (double)dropped / (double)(assigned + dropped ? assigned + dropped : 1),
               (long long)rerouted);
    fflush(stdout);
    if (!st && !o->json && !shared) {
        fprintf(stderr, "%s, %d threads, batch %d:\n", base, threads, B);
        cli_ledger_summary(stderr, led, true);
    }
done:
    moetax_batch_free(&b);
    moetax_ctx_free(c);
    moetax_ledger_free(own);
    free(step_t);
    free(rep_tps);
    free(rep_pair);
    return st;
}

moetax_status bench_batch_run(const char *path, struct moetax_pool *pool, double read_gbps,
                              const struct bench_batch_opts *o) {
    struct moetax_model *m;
    struct moetax_model_params mp = {.no_mmap = o->no_mmap, .expert_type = o->expert_type};
    moetax_status st = moetax_model_load_ex(path, &mp, &m);
    if (st) return st;
    struct moetax_membw_probe *probe = NULL;
    if (read_gbps > 0) st = moetax_membw_probe_new(pool, (size_t)512 << 20, &probe);
    const char *base = strrchr(path, '/') ? strrchr(path, '/') + 1 : path;
    if (!st && !o->json)
        printf("| model | threads | B | t/s (all) | t/s per seq | TPOT p50 ms | TPOT p99 ms | experts/step | expert MiB/token "
               "| imbalance | wait | tax | bandwidth |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
    struct moetax_ledger *shared = NULL; /* --ledger / --trace: every B's steps in one ledger */
    if (!st && o->lo && (o->lo->json_path || o->lo->trace_path))
        st = cli_ledger_new(m, moetax_pool_n_threads(pool), o->lo, &shared);
    bool paired_bad = false;
    for (int i = 0; i < o->n_batch && !st; i++)
        st = one_batch(m, base, pool, probe, read_gbps, o, (int)o->batch[i], shared, &paired_bad);
    if (!st && shared) {
        if (!o->json) cli_ledger_summary(stderr, shared, true);
        st = cli_ledger_outputs(shared, m, path, o->lo, NULL, 0);
    }
    moetax_ledger_free(shared);
    if (!st && !o->json)
        printf("\nexperts/step: distinct experts read per decode step, all MoE layers (per layer in brackets); "
               "imbalance: most assignments on one expert / mean per used expert; bandwidth: the bytes a step read "
               "(weights, experts as read, KV rows) over the read bandwidth measured before each repetition (median)\n");
    if (!st && !o->json && paired_bad) cli_paired_note(stdout);
    moetax_membw_probe_free(probe);
    moetax_model_free(m);
    return st;
}
