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
           "  --trace FILE         write a Chrome/Perfetto trace (one track per worker, last ~1M spans)\n"
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

moetax_status cli_ledger_outputs(const struct moetax_ledger *l, const struct moetax_model *m, const char *model_path,
                                 const struct cli_ledger_opts *o, const struct moetax_store *store, int64_t tokens) {
    moetax_status st = MOETAX_OK;
    if (o->json_path) {
        int moe[1024], n = 0;
        for (int i = 0; i < m->hp.n_layer && n < 1024; i++) if (m->layers[i].is_moe) moe[n++] = i;
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
        struct moetax_ledger_meta meta = {.model = model_path, .n_expert = m->hp.n_expert,
                                          .n_expert_used = o->n_expert_used ? o->n_expert_used : m->hp.n_expert_used, .moe_layers = moe, .n_moe_layers = n,
                                          .store_json = store ? sj : NULL};
        if ((st = moetax_ledger_write_json(l, &meta, o->json_path))) return st;
        fprintf(stderr, "  ledger written to %s (moetax report %s)\n", o->json_path, o->json_path);
    }
    if (o->trace_path) {
        if ((st = moetax_ledger_write_trace(l, o->trace_path))) return st;
        fprintf(stderr, "  trace written to %s (open in https://ui.perfetto.dev or chrome://tracing)\n", o->trace_path);
    }
    if (o->metrics) moetax_ledger_write_prometheus(l, stdout);
    return st;
}
