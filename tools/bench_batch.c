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

/* Token i of sequence s in repetition r: from the text (-f; each sequence its own stretch, fresh
 * each repetition) or pseudo-random. */
static int32_t tok_at(const struct bench_batch_opts *o, int64_t V, int64_t r, int s, int B, int64_t i) {
    const int64_t span = o->n_prompt + o->n_gen + 1;
    if (o->text) return o->text[(((r + 1) * B + s) * span + i) % o->n_text];
    return (int32_t)((i * 7919 + s * 104729 + (r + 1) * 15485863LL + 13) % V);
}

/* One B: its context and what its repetitions measured. The repetitions of every B take turns
 * (repetition r of each B, then r + 1 of each), so that a machine whose speed drifts (the read
 * bandwidth of these VMs moves by a third between runs) slows every B alike, and each B's
 * tokens/s is paired with the first B's of the same repetition. */
struct bb {
    int B;
    struct moetax_ctx *c;
    struct moetax_ledger *own, *led; /* led: own, or the one shared by every B (--ledger / --trace) */
    struct moetax_batch b;
    double nonexpert, kv_row_bytes;  /* bytes a decode step reads besides the experts the ledger counts */
    double *step_t, *rep_tps, *rep_pair;
    int nt, nrep, npair;
    /* the decode steps' ledger figures, summed over the timed repetitions (each its own window, so
     * that a shared ledger's other B's steps are not counted) */
    double dph[MOETAX_PHASE_COUNT];
    int64_t toks, steps;
    struct moetax_ledger_moe_stats ms;
};

static void bb_free(struct bb *x) {
    moetax_batch_free(&x->b);
    moetax_ctx_free(x->c);
    moetax_ledger_free(x->own);
    free(x->step_t);
    free(x->rep_tps);
    free(x->rep_pair);
}

static moetax_status bb_init(const struct moetax_model *m, struct moetax_pool *pool, const struct bench_batch_opts *o,
                             int B, struct moetax_ledger *shared, struct bb *x) {
    memset(x, 0, sizeof *x);
    x->B = B;
    const int64_t np = o->n_prompt, ng = o->n_gen;
    const int k = o->experts_used ? o->experts_used : m->hp.n_expert_used;
    const int64_t bs = MOETAX_KV_BLOCK_DEFAULT, per_seq = (np + ng + 1 + bs - 1) / bs * bs; /* whole blocks */
    if (B * per_seq > INT32_MAX || B * (np > 1 ? np : 1) > INT32_MAX) /* the context's and the batch's int32 sizes */
        return moetax_error(MOETAX_ERR_LIMIT, "--batch %d x (-p %lld + -n %lld) is %lld cells, more than a context "
                            "holds (%d)", B, (long long)np, (long long)ng, (long long)(B * per_seq), INT32_MAX);
    struct moetax_ctx_params cp = {.n_ctx = (int32_t)(B * per_seq), .pool = pool, .n_seq_max = B,
                                   .n_ubatch = B < 64 ? 64 : B > 512 ? 512 : B, .n_expert_used = o->experts_used,
                                   .kv_type = o->kv_type,
                                   .capacity_factor = o->capacity_factor, .overflow = o->overflow};
    x->step_t = malloc(sizeof(double) * (size_t)(ng * o->reps + 1));
    x->rep_tps = malloc(sizeof(double) * (size_t)(o->reps + 1));
    x->rep_pair = malloc(sizeof(double) * (size_t)(o->reps + 1));
    if (!x->step_t || !x->rep_tps || !x->rep_pair) return moetax_error(MOETAX_ERR_NOMEM, "out of memory");
    moetax_status st = moetax_ctx_init(m, &cp, &x->c);
    struct moetax_ledger_params lp = {.n_workers = moetax_pool_n_threads(pool), .n_layer = m->hp.n_layer};
    if (!st && !shared) st = moetax_ledger_init(&lp, &x->own);
    x->led = shared ? shared : x->own;
    if (!st) st = moetax_batch_init(&x->b, (int32_t)(B * (np > 1 ? np : 1)));
    if (st) return st;
    moetax_ctx_set_ledger(x->c, x->led);
    const double expert_total = (double)cli_store_expert_bytes(m);
    x->nonexpert = moetax_model_active_bytes_k(m, o->experts_used) -
                   (m->hp.n_expert ? expert_total * k / m->hp.n_expert : 0);
    x->kv_row_bytes = (double)moetax_ctx_kv_bytes(x->c) / (double)moetax_ctx_n_ctx(x->c); /* a cell, all layers */
    return MOETAX_OK;
}

/* Repetition r of B (r < 0: the warm-up, not counted): prefill B prompts of -p tokens (their own
 * tokens each repetition), read the memory once (the bandwidth this repetition is paired with),
 * then -n decode steps of one token per sequence. */
static moetax_status bb_rep(struct bb *x, const struct moetax_model *m, const struct bench_batch_opts *o,
                            struct moetax_membw_probe *probe, int64_t r) {
    const int64_t V = m->hp.n_vocab, np = o->n_prompt, ng = o->n_gen;
    const int B = x->B;
    moetax_status st = MOETAX_OK;
    moetax_ctx_reset(x->c);
    moetax_batch_clear(&x->b);
    for (int64_t i = 0; i < (np > 0 ? np : 1) && !st; i++)
        for (int s = 0; s < B && !st; s++)
            st = moetax_batch_add(&x->b, tok_at(o, V, r, s, B, i), (int32_t)i, s, i == (np > 0 ? np : 1) - 1);
    if (!st) st = moetax_ctx_decode(x->c, &x->b);
    double bw = 0;
    if (!st && probe) bw = cli_read_pass(probe);
    if (st) return st;
    double ph0[MOETAX_PHASE_COUNT], ph1[MOETAX_PHASE_COUNT], wall;
    int64_t tok0, tok1, steps0, steps1;
    struct moetax_ledger_moe_stats ms0, ms1, mb, ma;
    moetax_ledger_totals(x->led, true, ph0, &wall, &tok0, &steps0);
    moetax_ledger_moe_totals(x->led, true, &ms0);
    double t_rep = 0, bytes_rep = 0;
    for (int64_t j = 0; j < ng && !st; j++) {
        moetax_batch_clear(&x->b);
        const int64_t pos = (np > 0 ? np : 1) + j;
        for (int s = 0; s < B && !st; s++) st = moetax_batch_add(&x->b, tok_at(o, V, r, s, B, pos), (int32_t)pos, s, true);
        moetax_ledger_moe_totals(x->led, true, &mb);
        const double a = cli_now();
        if (!st) st = moetax_ctx_decode(x->c, &x->b);
        const double dt = cli_now() - a;
        moetax_ledger_moe_totals(x->led, true, &ma);
        if (r >= 0) {
            x->step_t[x->nt++] = dt;
            t_rep += dt;
            bytes_rep += x->nonexpert + (ma.expert_bytes - mb.expert_bytes) + x->kv_row_bytes * (double)(B * (pos + 1));
        }
    }
    if (st || r < 0) return st;
    moetax_ledger_totals(x->led, true, ph1, &wall, &tok1, &steps1);
    moetax_ledger_moe_totals(x->led, true, &ms1);
    for (int p = 0; p < MOETAX_PHASE_COUNT; p++) x->dph[p] += ph1[p] - ph0[p];
    x->toks += tok1 - tok0;
    x->steps += steps1 - steps0;
    x->ms.moe_layers += ms1.moe_layers - ms0.moe_layers;
    x->ms.experts += ms1.experts - ms0.experts;
    x->ms.expert_bytes += ms1.expert_bytes - ms0.expert_bytes;
    x->ms.imbalance_sum += ms1.imbalance_sum - ms0.imbalance_sum;
    x->ms.dropped += ms1.dropped - ms0.dropped;
    x->ms.rerouted += ms1.rerouted - ms0.rerouted;
    x->ms.assignments += ms1.assignments - ms0.assignments;
    /* the repetition's slot stays (0 where it took no time) so that ratios pair by repetition */
    x->rep_tps[x->nrep++] = t_rep > 0 ? (double)(B * ng) / t_rep : 0;
    if (t_rep > 0 && bw > 0) x->rep_pair[x->npair++] = bytes_rep / t_rep / 1e9 / bw;
    return MOETAX_OK;
}

/* B's row (table or JSON); ref: the first B (NULL: this is it), against whose tokens/s in the same
 * repetition this B's are taken (the median of those ratios). */
static moetax_status bb_report(const struct bb *x, const struct bb *ref, const char *base, int threads, double read_gbps,
                               const struct bench_batch_opts *o, bool shared, bool *paired_bad) {
    /* cli_percentile sorts: copies, so that every B's repetitions stay in order for the pairing */
    double *v = malloc(sizeof(double) * (size_t)(x->nrep + x->npair + 1));
    if (!v) return moetax_error(MOETAX_ERR_NOMEM, "out of memory");
    int nr = 0;
    for (int i = 0; ref && i < x->nrep && i < ref->nrep; i++)
        if (x->rep_tps[i] > 0 && ref->rep_tps[i] > 0) v[nr++] = x->rep_tps[i] / ref->rep_tps[i];
    const double vs = nr ? cli_percentile(v, nr, 0.5) : NAN;
    int ntps = 0;
    for (int i = 0; i < x->nrep; i++)
        if (x->rep_tps[i] > 0) v[ntps++] = x->rep_tps[i];
    const double tps = ntps ? cli_percentile(v, ntps, 0.5) : 0;
    for (int i = 0; i < x->npair; i++) v[i] = x->rep_pair[i];
    const double paired = x->npair ? cli_percentile(v, x->npair, 0.5) : 0;
    free(v);
    double total = 0;
    for (int p = 0; p < MOETAX_PHASE_COUNT; p++) total += x->dph[p];
    const double layers = (double)x->ms.moe_layers;
    const double uniq_step = x->steps ? (double)x->ms.experts / (double)x->steps : 0;
    const double uniq_layer = layers > 0 ? (double)x->ms.experts / layers : 0;
    const double eb_tok = x->toks ? x->ms.expert_bytes / (double)x->toks : 0;
    const double imb = layers > 0 ? x->ms.imbalance_sum / layers : 0;
    const double wait_share = total > 0 ? x->dph[MOETAX_PHASE_WAIT] / total : 0;
    const int64_t dropped = x->ms.dropped, rerouted = x->ms.rerouted, assigned = x->ms.assignments;
    /* (the step times are not needed in order: sorted in place) */
    const double p50 = 1e3 * cli_percentile(x->step_t, x->nt, 0.5), p99 = 1e3 * cli_percentile(x->step_t, x->nt, 0.99);
    const double tax = moetax_ledger_tax_share(x->dph);
    moetax_status st = MOETAX_OK;
    if (o->json) {
        json_t *jo = cli_jobj("ssiiIIffffffffffIIb", "model", base, "test", "batch", "threads", threads,
                              "batch", x->B, "n_prompt", (int64_t)o->n_prompt, "n_gen", (int64_t)o->n_gen,
                              "tokens_per_s", tps, "tpot_p50_ms", p50, "tpot_p99_ms", p99,
                              "unique_experts_per_step", uniq_step, "unique_experts_per_layer", uniq_layer,
                              "expert_bytes_per_token", eb_tok, "imbalance", imb, "wait_share", wait_share,
                              "tax_share", tax, "read_gbps", read_gbps, "dropped", dropped, "rerouted", rerouted,
                              "capacity_factor_on", o->capacity_factor > 0 && isfinite(o->capacity_factor));
        if (jo && !cli_paired_json(jo, "bandwidth_ratio", paired)) {
            json_decref(jo);
            jo = NULL;
        }
        if (jo) { /* against the first B, paired by repetition (null where none of both took time) */
            json_object_set_new(jo, "vs_batch", json_integer(ref ? ref->B : x->B));
            json_object_set_new(jo, "tokens_per_s_ratio", !ref && ntps ? json_real(1.0) : nr ? json_real(vs) : json_null());
        }
        st = cli_json_print(stdout, jo);
    } else {
        char cell[48], vcell[32];
        if (ref && nr) snprintf(vcell, sizeof vcell, "%.2fx", vs);
        else snprintf(vcell, sizeof vcell, "%s", ref ? "-" : "1.00x");
        printf("| %s | %d | %d | %.2f | %s | %.2f | %.3f | %.3f | %.1f (%.1f/layer) | %.2f | %.2f | %.1f%% | %.1f%% | %s |\n",
               base, threads, x->B, tps, vcell, tps / x->B, p50, p99, uniq_step, uniq_layer, eb_tok / (1 << 20), imb,
               100 * wait_share, 100 * tax, cli_paired_cell(paired, cell, sizeof cell));
        *paired_bad |= cli_paired_bad(paired);
    }
    if (!st && (dropped || rerouted) && !o->json)
        printf("|   | capacity factor: %lld of %lld assignments dropped (%.1f%%), %lld rerouted |\n", (long long)dropped,
               (long long)(assigned + dropped), 100.0 * (double)dropped / (double)(assigned + dropped ? assigned + dropped : 1),
               (long long)rerouted);
    fflush(stdout);
    if (!st && !o->json && !shared) {
        fprintf(stderr, "%s, %d threads, batch %d:\n", base, threads, x->B);
        cli_ledger_summary(stderr, x->led, true);
    }
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
    const int threads = moetax_pool_n_threads(pool);
    struct moetax_ledger *shared = NULL; /* --ledger / --trace: every B's steps in one ledger */
    if (!st && o->lo && (o->lo->json_path || o->lo->trace_path))
        st = cli_ledger_new(m, threads, o->lo, &shared);
    struct bb *bbs = st ? NULL : calloc((size_t)o->n_batch, sizeof *bbs);
    if (!st && !bbs) st = moetax_error(MOETAX_ERR_NOMEM, "out of memory");
    int n_init = 0;
    for (; !st && n_init < o->n_batch; n_init++)
        st = bb_init(m, pool, o, (int)o->batch[n_init], shared, &bbs[n_init]);
    /* the repetitions take turns: repetition r of every B, then r + 1 (the warm-up, r = -1, first) */
    for (int64_t r = -1; !st && r < o->reps; r++)
        for (int i = 0; !st && i < o->n_batch; i++) st = bb_rep(&bbs[i], m, o, probe, r);
    bool paired_bad = false;
    if (!st && !o->json)
        printf("| model | threads | B | t/s (all) | vs B%d | t/s per seq | TPOT p50 ms | TPOT p99 ms | experts/step "
               "| expert MiB/token | imbalance | wait | tax | bandwidth |\n"
               "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n", (int)o->batch[0]);
    for (int i = 0; !st && i < o->n_batch; i++)
        st = bb_report(&bbs[i], i ? &bbs[0] : NULL, base, threads, read_gbps, o, shared != NULL, &paired_bad);
    for (int i = 0; bbs && i < n_init; i++) bb_free(&bbs[i]);
    free(bbs);
    if (!st && shared) {
        if (!o->json) cli_ledger_summary(stderr, shared, true);
        st = cli_ledger_outputs(shared, m, path, o->lo, NULL, 0);
    }
    moetax_ledger_free(shared);
    if (!st && !o->json)
        printf("\nvs B%d: the median over repetitions of this B's tokens/s over B%d's in the same repetition (the "
               "repetitions of every B take turns); experts/step: distinct experts read per decode step, all MoE "
               "layers (per layer in brackets); imbalance: most assignments on one expert / mean per used expert; "
               "bandwidth: the bytes a step read (weights, experts as read, KV rows) over the read bandwidth measured "
               "before each repetition (median)\n", (int)o->batch[0], (int)o->batch[0]);
    if (!st && !o->json && paired_bad) cli_paired_note(stdout);
    moetax_membw_probe_free(probe);
    moetax_model_free(m);
    return st;
}
