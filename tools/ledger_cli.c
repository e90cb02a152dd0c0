#include "ledger_cli.h"

#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "moetax/store.h"

bool cli_ledger_opt(int argc, char **argv, int *i, struct cli_ledger_opts *o, bool *err) {
    if (cli_opt(argc, argv, i, NULL, "--ledger", &o->json_path, err)) return true;
    if (cli_opt(argc, argv, i, NULL, "--trace", &o->trace_path, err)) return true;
    if (!strcmp(argv[*i], "--metrics")) { o->metrics = true; return true; }
    if (!strcmp(argv[*i], "--routing-stats")) { o->routing = true; return true; }
    return false;
}

const char *cli_ledger_help(void) {
    return "  --ledger FILE        write the per-step, per-phase, per-layer ledger as JSON (for moetax report)\n"
           "  --trace FILE         write a Chrome/Perfetto trace (one track per worker, last ~1M spans; with an\n"
           "                       expert store also one track per I/O worker: each expert read, demand, known\n"
           "                       or predicted, with layer, expert, bytes, MB/s and time queued)\n"
           "  --routing-stats      keep routing records (experts per token and layer, cross-layer predictions)\n"
           "  --metrics            print the ledger totals in Prometheus text format at the end\n";
}

moetax_status cli_ledger_new(const struct moetax_model *m, int threads, const struct cli_ledger_opts *o,
                             struct moetax_ledger **out) {
    struct moetax_ledger_params p = {
        .n_workers = threads,
        .n_layer = m->hp.n_layer,
        .window = 4096,
        .trace_cap = o && o->trace_path ? (int64_t)1 << 20 : 0,
        .routing_window = o && (o->routing || o->json_path) ? 4096 : 0,
        .n_expert_used = o && o->n_expert_used ? o->n_expert_used : m->hp.n_expert_used,
    };
    if (!(o && o->routing)) p.routing_window = 0;
    return moetax_ledger_init(&p, out);
}

void cli_ledger_summary(FILE *f, const struct moetax_ledger *l, bool decode_only) {
    double ph[MOETAX_PHASE_COUNT], wall;
    int64_t tokens, steps;
    moetax_ledger_totals(l, decode_only, ph, &wall, &tokens, &steps);
    if (!steps || !tokens) return;
    double total = 0, tax = 0;
    for (int p = 0; p < MOETAX_PHASE_COUNT; p++) {
        total += ph[p];
        if (moetax_phase_is_tax((enum moetax_phase)p)) tax += ph[p];
    }
    fprintf(f, "  ledger (%s, %lld steps, per token): ", decode_only ? "decode" : "all", (long long)steps);
    for (int p = 0; p < MOETAX_PHASE_COUNT; p++)
        if (ph[p] > 0) fprintf(f, "%s%s %.1f us", p ? ", " : "", moetax_phase_name((enum moetax_phase)p), 1e6 * ph[p] / (double)tokens);
    fprintf(f, "\n  tax share %.1f%% (route+dispatch+load+comm+wait+combine), efficiency %.1f; ledger covers %.1f%% of wall time\n",
            total > 0 ? 100 * tax / total : 0, total > 0 ? 100 * (1 - tax / total) : 0, wall > 0 ? 100 * total / wall : 0);
}

/* The ledger's trace, with the expert store's reads (if it kept them) as one track per
 * I/O worker: a span per expert load from the start of its read to resident (the preads,
 * the checks and repacking), named by what asked for it (demand: an acquire missed;
 * known: the routing's early reads; predicted), with its layer, expert, bytes, MB/s of
 * the preads alone and the time it waited in the queue. */
static moetax_status write_trace(const struct moetax_ledger *l, const char *path, const struct moetax_store *store,
                                 const char *store_json) {
    int64_t n = store ? moetax_store_reads(store, NULL, 0, NULL) : 0;
    if (n <= 0) {
        struct moetax_trace_extra x = {.other_json = store_json};
        return moetax_ledger_write_trace_ex(l, path, &x);
    }
    struct moetax_store_read *r = malloc(sizeof *r * (size_t)n);
    struct moetax_trace_span *sp = malloc(sizeof *sp * (size_t)n);
    if (!r || !sp) {
        free(r);
        free(sp);
        return moetax_error(MOETAX_ERR_NOMEM, "%s: out of memory for the trace's I/O spans", path);
    }
    uint64_t dropped = 0;
    /* the I/O workers still run: a read may have completed since the count (copied: at most n) */
    int64_t kept = moetax_store_reads(store, r, n, &dropped);
    if (kept < n) n = kept;
    int tracks = 0;
    static const char *const kind_names[3] = {"demand read", "known read", "predicted read"};
    for (int64_t i = 0; i < n; i++) {
        const struct moetax_store_read *q = &r[i];
        double us = 1e-3 * (double)q->read_ns; /* the preads alone (the span also has repacking) */
        sp[i] = (struct moetax_trace_span){.t0 = q->start_ns, .t1 = q->end_ns, .track = q->io_thread,
                                           .name = kind_names[q->kind < 3 ? q->kind : 0], .cat = "io"};
        snprintf(sp[i].args, sizeof sp[i].args,
                 "\"layer\": %d, \"expert\": %d, \"bytes\": %llu, \"mb_per_s\": %.1f, \"queued_us\": %.1f, \"ok\": %s",
                 q->layer, q->expert, (unsigned long long)q->bytes, us > 0 ? (double)q->bytes / us : 0.0,
                 1e-3 * (double)(q->start_ns - q->queued_ns), q->ok ? "true" : "false");
        if (q->io_thread + 1 > tracks) tracks = q->io_thread + 1;
    }
    char names[64][32];
    const char *np[64];
    if (tracks > 64) tracks = 64;
    for (int t = 0; t < tracks; t++) {
        snprintf(names[t], sizeof names[t], "I/O worker %d", t);
        np[t] = names[t];
    }
    char proc[96];
    snprintf(proc, sizeof proc, "expert store reads (%llu older not kept)", (unsigned long long)dropped);
    struct moetax_trace_extra x = {.process = dropped ? proc : "expert store reads", .track_names = np,
                                   .n_tracks = tracks, .spans = sp, .n_spans = n, .other_json = store_json};
    moetax_status st = moetax_ledger_write_trace_ex(l, path, &x);
    free(r);
    free(sp);
    return st;
}

moetax_status cli_ledger_outputs(const struct moetax_ledger *l, const struct moetax_model *m, const char *model_path,
                                 const struct cli_ledger_opts *o, const struct moetax_store *store, int64_t tokens) {
    moetax_status st = MOETAX_OK;
    char sj[1024] = "";
    if (store) {
            struct moetax_store_stats ss;
            moetax_store_get_stats(store, &ss);
            snprintf(sj, sizeof sj,
                     "{\"n_slots\": %d, \"slot_bytes\": %llu, \"budget_bytes\": %llu, \"direct_io\": %s, \"acquires\": %llu, "
                     "\"hits\": %llu, \"loads\": %llu, \"bytes_read\": %llu, \"reads\": %llu, \"read_gbps\": %.4f, "
                     "\"stall_s\": %.6f, \"predicted_issued\": %llu, \"predicted_used\": %llu, \"prefetch_wasted\": %llu, "
                     "\"prefetch_dropped\": %llu, \"tokens\": %lld}",
                     ss.n_slots, (unsigned long long)ss.slot_bytes, (unsigned long long)ss.slot_bytes * (unsigned long long)ss.n_slots,
                     ss.direct_io_active ? "true" : "false", (unsigned long long)ss.acquires, (unsigned long long)ss.hits,
                     (unsigned long long)ss.loads, (unsigned long long)ss.bytes_read, (unsigned long long)ss.reads,
                     ss.read_gbps, 1e-9 * (double)ss.stall_ns, (unsigned long long)ss.predicted_issued,
                     (unsigned long long)ss.predicted_used, (unsigned long long)ss.prefetch_wasted,
                     (unsigned long long)ss.prefetch_dropped, (long long)tokens);
    }
    if (o->json_path) {
        int moe[1024], n = 0;
        for (int i = 0; i < m->hp.n_layer && n < 1024; i++) if (m->layers[i].is_moe) moe[n++] = i;
        struct moetax_ledger_meta meta = {.model = model_path, .n_expert = m->hp.n_expert,
                                          .n_expert_used = o->n_expert_used ? o->n_expert_used : m->hp.n_expert_used, .moe_layers = moe, .n_moe_layers = n,
                                          .store_json = store ? sj : NULL};
        if ((st = moetax_ledger_write_json(l, &meta, o->json_path))) return st;
        fprintf(stderr, "  ledger written to %s (moetax report %s)\n", o->json_path, o->json_path);
    }
    if (o->trace_path) {
        if ((st = write_trace(l, o->trace_path, store, store ? sj : NULL))) return st;
        fprintf(stderr, "  trace written to %s (open in https://ui.perfetto.dev or chrome://tracing)\n", o->trace_path);
    }
    if (o->metrics) moetax_ledger_write_prometheus(l, stdout);
    return st;
}
