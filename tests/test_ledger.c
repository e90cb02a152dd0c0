// ctest-labels: unit;threads;serial
/* test_ledger.c - the ledger: spans fold into per-phase, per-layer, per-worker
 * totals exactly; wait is measured at barriers; an artificial delay injected
 * into one phase of a real model run shows up in that phase and nowhere else;
 * the JSON and trace outputs are written; Prometheus text lists every phase. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "moetax/ledger.h"
#include "moetax/model.h"
#include "testutil.h"

static void synthetic(void) {
    struct moetax_ledger_params p = {.n_workers = 2, .n_layer = 3, .window = 4, .trace_cap = 64, .routing_window = 8,
                                     .n_expert_used = 2};
    struct moetax_ledger *l;
    CHECK(moetax_ledger_init(&p, &l) == MOETAX_OK);
    if (!l) return;
    /* step 1 (prefill of 4 tokens): worker 0: 3 ms expert in layer 1, 1 ms wait; worker 1: 1 ms expert, 3 ms wait */
    moetax_ledger_step_begin(l, 4, 0, true);
    moetax_ledger_span(l, 0, MOETAX_PHASE_EXPERT, 1, 1000000, 4000000);
    moetax_ledger_span(l, 0, MOETAX_PHASE_WAIT, 1, 4000000, 5000000);
    moetax_ledger_span(l, 1, MOETAX_PHASE_EXPERT, 1, 1000000, 2000000);
    moetax_ledger_span(l, 1, MOETAX_PHASE_WAIT, 1, 2000000, 5000000);
    moetax_ledger_span(l, 0, MOETAX_PHASE_ROUTE, -1, 0, 2000000); /* layer -1: outside the layers */
    moetax_ledger_step_end(l);
    /* step 2 (decode): 1 ms combine on each worker in layer 2 */
    moetax_ledger_step_begin(l, 1, 4, false);
    moetax_ledger_span(l, 0, MOETAX_PHASE_COMBINE, 2, 0, 1000000);
    moetax_ledger_span(l, 1, MOETAX_PHASE_COMBINE, 2, 0, 1000000);
    moetax_ledger_step_end(l);
    moetax_ledger_add(l, MOETAX_PHASE_SAMPLE, -1, 0.5e-3);
    double ph[MOETAX_PHASE_COUNT], wall;
    int64_t tokens, steps;
    moetax_ledger_totals(l, false, ph, &wall, &tokens, &steps);
    CHECK_EQ_INT(steps, 2);
    CHECK_EQ_INT(tokens, 5);
    CHECK(fabs(ph[MOETAX_PHASE_EXPERT] - 2e-3) < 1e-12);  /* (3 + 1) / 2 workers */
    CHECK(fabs(ph[MOETAX_PHASE_WAIT] - 2e-3) < 1e-12);    /* (1 + 3) / 2 */
    CHECK(fabs(ph[MOETAX_PHASE_ROUTE] - 1e-3) < 1e-12);   /* 2 / 2 */
    CHECK(fabs(ph[MOETAX_PHASE_COMBINE] - 1e-3) < 1e-12);
    CHECK(fabs(ph[MOETAX_PHASE_SAMPLE] - 0.5e-3) < 1e-12);
    /* tax = route 1 + wait 2 + combine 1 = 4 of 6.5 */
    CHECK(fabs(moetax_ledger_tax_share(ph) - 4.0 / 6.5) < 1e-9);
    moetax_ledger_totals(l, true, ph, &wall, &tokens, &steps);
    CHECK_EQ_INT(steps, 1);
    CHECK(fabs(ph[MOETAX_PHASE_COMBINE] - 1e-3) < 1e-12 && ph[MOETAX_PHASE_EXPERT] == 0);
    /* routing records and the JSON file */
    int32_t ex[4] = {0, 1, 2, 3}, pr[4] = {0, 5, 2, 3};
    float wt[4] = {0.5f, 0.5f, 0.7f, 0.3f};
    moetax_ledger_step_begin(l, 2, 5, true);
    moetax_ledger_routing(l, 1, 2, ex, wt, NULL);
    moetax_ledger_routing(l, 2, 2, ex, wt, pr);
    moetax_ledger_step_end(l);
    const char *path = tu_path("ledger_synth.json");
    struct moetax_ledger_meta meta = {.model = "synthetic \"model\"", .n_expert = 8, .n_expert_used = 2};
    CHECK(moetax_ledger_write_json(l, &meta, path) == MOETAX_OK);
    char cmd[1024];
    snprintf(cmd, sizeof cmd,
             "/usr/bin/python3 -c \"import json,sys; d=json.load(open('%s')); "
             "assert d['moetax_ledger']==1 and len(d['steps'])==3 and d['totals']['steps']==3; "
             "assert abs(d['totals']['phase_s']['expert']-2e-3)<1e-12; "
             "r=d['routing']['layers']; assert [x['layer'] for x in r]==[1,2]; "
             "assert r[1]['predicted']==[[0,5],[2,3]] and r[0]['predicted']==[None,None]; "
             "assert r[0]['experts']==[[0,1],[2,3]]; assert len(d['totals']['layer_phase_s'])==3\"",
             path);
    CHECK_EQ_INT(tu_run(cmd, NULL), 0);
    const char *tpath = tu_path("ledger_synth_trace.json");
    CHECK(moetax_ledger_write_trace(l, tpath) == MOETAX_OK);
    snprintf(cmd, sizeof cmd,
             "/usr/bin/python3 -c \"import json; d=json.load(open('%s')); e=[x for x in d['traceEvents'] if x['ph']=='X']; "
             "assert len(e)==7, len(e); assert all(x['ts']>=0 and x['dur']>=0 and x['tid'] in (0,1) for x in e); "
             "assert {x['name'] for x in e}=={'expert','wait','route','combine'}\"", tpath);
    CHECK_EQ_INT(tu_run(cmd, NULL), 0);
    /* window: only the last 4 step records are kept, totals keep counting */
    for (int i = 0; i < 10; i++) { moetax_ledger_step_begin(l, 1, 0, false); moetax_ledger_step_end(l); }
    CHECK(moetax_ledger_write_json(l, &meta, path) == MOETAX_OK);
    snprintf(cmd, sizeof cmd, "/usr/bin/python3 -c \"import json; d=json.load(open('%s')); "
                              "assert len(d['steps'])==4 and d['totals']['steps']==13 and d['dropped_steps']==9\"", path);
    CHECK_EQ_INT(tu_run(cmd, NULL), 0);
    char *buf = NULL;
    size_t len = 0;
    FILE *mf = open_memstream(&buf, &len);
    moetax_ledger_write_prometheus(l, mf);
    fclose(mf);
    for (int p2 = 0; p2 < MOETAX_PHASE_COUNT; p2++) {
        char needle[64];
        snprintf(needle, sizeof needle, "phase=\"%s\"", moetax_phase_name((enum moetax_phase)p2));
        CHECK(buf && strstr(buf, needle));
    }
    CHECK(buf && strstr(buf, "moetax_tax_share"));
    free(buf);
    moetax_ledger_free(l);
}

/* run a tiny model with the ledger; returns per-phase seconds per step of decode */
static void run_model(struct moetax_model *m, int threads, int delay_phase, uint64_t delay_ns, double out[MOETAX_PHASE_COUNT]) {
    struct moetax_ctx_params cp = {.n_ctx = 64, .n_threads = threads};
    struct moetax_ctx *c;
    CHECK(moetax_ctx_init(m, &cp, &c) == MOETAX_OK);
    struct moetax_ledger_params lp = {.n_workers = threads, .n_layer = m->hp.n_layer};
    struct moetax_ledger *l;
    CHECK(moetax_ledger_init(&lp, &l) == MOETAX_OK);
    moetax_ctx_set_ledger(c, l);
    moetax_ctx_test_delay(c, delay_phase, delay_ns);
    int32_t t[40];
    for (int i = 0; i < 40; i++) t[i] = (i * 13 + 1) % m->hp.n_vocab;
    for (int i = 0; i < 40; i++) CHECK(moetax_ctx_eval(c, t + i, 1, NULL, false) == MOETAX_OK);
    double wall;
    int64_t tokens, steps;
    moetax_ledger_totals(l, true, out, &wall, &tokens, &steps);
    CHECK_EQ_INT(steps, 40);
    double sum = 0;
    for (int p = 0; p < MOETAX_PHASE_COUNT; p++) { out[p] /= (double)steps; sum += out[p] * (double)steps; }
    /* the phases account for (nearly) all of the wall time */
    CHECK_MSG(sum <= wall * 1.001 && sum >= wall * 0.5, "phases %g s vs wall %g s", sum, wall);
    moetax_ctx_free(c);
    moetax_ledger_free(l);
}

static void delay_injection(void) {
    char path[512];
    snprintf(path, sizeof path, "%s", tu_path("ledger_tiny.gguf"));
    char cmd[1024];
    snprintf(cmd, sizeof cmd, "%s gen --preset tiny-v3 -o %s >/dev/null 2>&1", tu_moetax_bin, path);
    CHECK_EQ_INT(tu_run(cmd, NULL), 0);
    struct moetax_model *m;
    if (moetax_model_load(path, &m) != MOETAX_OK) { CHECK_MSG(0, "%s", moetax_last_error()); return; }
    int n_moe = 0;
    for (int i = 0; i < m->hp.n_layer; i++) n_moe += m->layers[i].is_moe;
    const enum moetax_phase targets[] = {MOETAX_PHASE_COMBINE, MOETAX_PHASE_ROUTE, MOETAX_PHASE_ATTN};
    for (int threads = 1; threads <= 2; threads++) {
        for (size_t ti = 0; ti < sizeof targets / sizeof targets[0]; ti++) {
            /* 500 us per entry (3 ms in sanitizer builds). The delay is a real cost on the machine,
             * not only a booking: while a worker spins, other tenants evict the model's working set
             * from the shared caches, so the phases after it run slower (here +2-40 us a step in
             * Release, +70-600 us in TSan whose shadow memory makes the working set several times
             * larger). That effect levels off while a misbooked delay grows with it, so sanitizer
             * builds inject a longer one: measured leak 1-5% of it, against 10% allowed (with
             * 500 us, TSan leaked up to 18% and failed CI once). */
#ifdef MOETAX_SANITIZED
            const uint64_t delay = 3000000;
#else
            const uint64_t delay = 500000;
#endif
            /* every worker enters combine once per MoE layer; route twice per MoE layer (router, then
             * routing); attention (decoding one token) 3 times per layer (phases 2, 4, 6), 4 with
             * q_lora */
            double entries = targets[ti] == MOETAX_PHASE_COMBINE ? n_moe
                           : targets[ti] == MOETAX_PHASE_ROUTE ? 2.0 * n_moe
                           : (m->hp.q_lora_rank ? 4.0 : 3.0) * m->hp.n_layer;
            double want = entries * delay * 1e-9;
            /* with 2 threads on a shared 2-core machine (ctest -j2, other tests) a worker can be
             * descheduled mid-phase; that time is honestly booked where it falls, so the strict
             * "there and nowhere else" bounds are checked with one thread, and with two only that
             * the delay shows up in its phase. A timing comparison on a shared machine can meet a
             * burst of noise: up to 3 attempts (a fresh baseline each); a real leak fails them all. */
            bool strict = threads == 1;
            char msg[256] = "";
            for (int attempt = 0; attempt < 3; attempt++) {
                double base[MOETAX_PHASE_COUNT], got[MOETAX_PHASE_COUNT];
                run_model(m, threads, 0, 0, base);
                run_model(m, threads, targets[ti], delay, got);
                double added = got[targets[ti]] - base[targets[ti]];
                msg[0] = 0;
                if (!(added > 0.8 * want && (!strict || added < 1.5 * want)))
                    snprintf(msg, sizeof msg, "%d threads, delay in %s: +%.0f us, want +%.0f us", threads,
                             moetax_phase_name(targets[ti]), 1e6 * added, 1e6 * want);
                for (int p = 0; strict && !msg[0] && p < MOETAX_PHASE_COUNT; p++) {
                    if (p == (int)targets[ti]) continue;
                    double diff = got[p] - base[p];
                    /* noise allowance: a tenth of the injected time or a fifth of the phase itself
                     * (sanitizer builds run the phases many times slower) */
                    if (!(fabs(diff) < fmax(0.1 * want, 0.2 * base[p])))
                        snprintf(msg, sizeof msg, "%d threads, delay in %s leaked into %s: %+.0f us (of %.0f)",
                                 threads, moetax_phase_name(targets[ti]), moetax_phase_name((enum moetax_phase)p),
                                 1e6 * diff, 1e6 * want);
                }
                if (!msg[0]) break;
                fprintf(stderr, "test_ledger: attempt %d: %s\n", attempt + 1, msg);
            }
            CHECK_MSG(!msg[0], "%s", msg);
        }
    }
    moetax_model_free(m);
}

int main(int argc, char **argv) {
    tu_init(argc, argv);
    synthetic();
    delay_injection();
    return tu_finish("test_ledger");
}
