#include "ledger_cli.h"

#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "moetax/outfile.h"
#include "moetax/store.h"

#ifdef MOETAX_WITH_MPI
#include <jansson.h>
#include <stdio.h>
#include <unistd.h>

#include "dist/dist.h"
#include "dist/gather.h"
#endif

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
#ifdef MOETAX_WITH_MPI
    /* the trace shows each rank's exchanges (write_trace): as many records as the ledger's spans */
    struct moetax_dist *D = moetax_dist_world();
    if (D && p.trace_cap > 0 && !D->xrec_cap) {
        moetax_status st = moetax_dist_keep_exchanges(D, p.trace_cap / 8);
        if (st) return st;
    }
#endif
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
    const char *sep = ""; /* a comma before every phase but the first one shown (a dense model has no route) */
    for (int p = 0; p < MOETAX_PHASE_COUNT; p++)
        if (ph[p] > 0) {
            fprintf(f, "%s%s %.1f us", sep, moetax_phase_name((enum moetax_phase)p), 1e6 * ph[p] / (double)tokens);
            sep = ", ";
        }
    fprintf(f, "\n  tax share %.1f%% (route+dispatch+load+comm+wait+combine), efficiency %.1f; ledger covers %.1f%% of wall time\n",
            total > 0 ? 100 * tax / total : 0, total > 0 ? 100 * (1 - tax / total) : 0, wall > 0 ? 100 * total / wall : 0);
}

/* The ledger's trace, with the expert store's reads (if it kept them) as one track per
 * I/O worker: a span per expert load from the start of its read to resident (the preads,
 * the checks and repacking), named by what asked for it (demand: an acquire missed;
 * known: the routing's early reads; predicted), with its layer, expert, bytes, MB/s of
 * the preads alone and the time it waited in the queue. */
static moetax_status write_trace_io(const struct moetax_ledger *l, const char *path, const struct moetax_store *store,
                                    struct moetax_trace_extra *x0) {
    int64_t n = store ? moetax_store_reads(store, NULL, 0, NULL) : 0;
    if (n <= 0) return moetax_ledger_write_trace_ex(l, path, x0);
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
    struct moetax_trace_extra x = *x0;
    x.process = dropped ? proc : "expert store reads";
    x.track_names = np;
    x.n_tracks = tracks;
    x.spans = sp;
    x.n_spans = n;
    moetax_status st = moetax_ledger_write_trace_ex(l, path, &x);
    free(r);
    free(sp);
    return st;
}

/* The trace (write_trace_io); under mpirun with records kept (cli_ledger_new asks for them with
 * --trace) also this rank's exchanges as a process of their own (pid 2: `moetax report` reads
 * pid 0's spans as the phases): a span per exchange, gather or combine from its counts to its
 * last byte, with its layer and this rank's bytes. */
static moetax_status write_trace(const struct moetax_ledger *l, const char *path, const struct moetax_store *store,
                                 const char *store_json) {
    struct moetax_trace_extra x = {.other_json = store_json};
#ifdef MOETAX_WITH_MPI
    const struct moetax_dist *D = moetax_dist_world();
    uint64_t dropped = 0;
    const int64_t n = D ? moetax_dist_exchanges(D, NULL, 0, &dropped) : 0;
    if (n > 0) {
        struct moetax_dist_xrec *r = malloc(sizeof *r * (size_t)n);
        struct moetax_trace_span *sp = malloc(sizeof *sp * (size_t)n);
        if (!r || !sp) {
            free(r);
            free(sp);
            return moetax_error(MOETAX_ERR_NOMEM, "%s: out of memory for the trace's exchanges", path);
        }
        const int64_t kept = moetax_dist_exchanges(D, r, n, NULL);
        for (int64_t i = 0; i < kept; i++) {
            const double us = 1e-3 * (double)(r[i].t1 > r[i].t0 ? r[i].t1 - r[i].t0 : 0);
            sp[i] = (struct moetax_trace_span){.t0 = r[i].t0, .t1 = r[i].t1, .name = "exchange", .cat = "comm"};
            snprintf(sp[i].args, sizeof sp[i].args,
                     "\"layer\": %d, \"bytes_sent\": %llu, \"bytes_recv\": %llu, \"mb_per_s\": %.1f", r[i].layer,
                     (unsigned long long)r[i].sent, (unsigned long long)r[i].recv,
                     us > 0 ? (double)(r[i].sent + r[i].recv) / us : 0.0);
        }
        char name[96];
        snprintf(name, sizeof name, "MPI exchanges (%llu older not kept)", (unsigned long long)dropped);
        x.process2 = dropped ? name : "MPI exchanges";
        x.spans2 = sp;
        x.n_spans2 = kept;
        moetax_status st = write_trace_io(l, path, store, &x);
        free(r);
        free(sp);
        return st;
    }
#endif
    return write_trace_io(l, path, store, &x);
}

#ifdef MOETAX_WITH_MPI
/* Under mpirun (2+ ranks) every rank writes its ledger and trace as usual, but to a file of its
 * own in $TMPDIR, reads it back (the ledger with "rank" and this rank's "dist" counters added),
 * and rank 0 gathers the texts and writes ONE file at the path asked for:
 *   ledger: rank 0's ledger (so `moetax report` reads it as before) plus "ranks": every rank's
 *           ledger in rank order, each with "rank" and "dist" {bytes_sent, bytes_recv,
 *           collectives, comm_s, wait_s; with --ep-dispatch alltoall also dispatch, records,
 *           bytes_once_per_rank, bytes_once_per_expert, blocked_s, logits_bytes; with --ep-replicas
 *           also replicas, work_plans, work_assignments, work_busiest, work_busiest_without_replicas,
 *           work_even_split, work_mine, replica_experts_mapped, replica_bytes_mapped; and
 *           layer_bytes_sent, layer_bytes_recv: [n_layer] this rank's bytes per layer} (what the
 *           exit summary prints);
 *   trace:  one Chrome trace, a process per rank and track kind: rank r's pid p becomes
 *           100 r + p, its process names "rank r: ...", and its times are shifted by its first
 *           span's CLOCK_MONOTONIC time against rank 0's ("t0_ns" in otherData), so the ranks of
 *           one host line up (ranks on other hosts have clocks of their own).
 * Collective: every rank calls cli_ledger_outputs with the same options. */
enum { RANK_PID_STRIDE = 100 };

static moetax_status read_text(const char *path, char **text, size_t *n) {
    json_error_t e;
    json_t *d = json_load_file(path, 0, &e);
    if (!d) return moetax_error(MOETAX_ERR_FORMAT, "%s: %s (line %d)", path, e.text, e.line);
    *text = json_dumps(d, JSON_COMPACT);
    json_decref(d);
    if (!*text) return moetax_error(MOETAX_ERR_NOMEM, "out of memory");
    *n = strlen(*text);
    return MOETAX_OK;
}

/* This rank's document of one kind, as text; trace: write it with write_trace. */
static moetax_status rank_doc(const struct moetax_ledger *l, const struct moetax_ledger_meta *meta, bool trace,
                              const struct moetax_store *store, const char *sj, const struct moetax_dist *D,
                              char **text, size_t *n) {
    const char *tmp = getenv("TMPDIR");
    char path[512];
    snprintf(path, sizeof path, "%s/moetax-rank%d-%ld.%s.json", tmp && *tmp ? tmp : "/tmp", D->rank, (long)getpid(),
             trace ? "trace" : "ledger");
    moetax_status st = trace ? write_trace(l, path, store, sj) : moetax_ledger_write_json(l, meta, path);
    if (!st) st = read_text(path, text, n);
    unlink(path);
    if (st || trace) return st;
    json_t *d = json_loads(*text, 0, NULL);
    free(*text);
    *text = NULL;
    if (!d) return moetax_error(MOETAX_ERR_INTERNAL, "rank %d: its own ledger does not parse", D->rank);
    json_t *dj = json_pack("{s:I, s:I, s:I, s:f, s:f}", "bytes_sent", (json_int_t)D->bytes_sent, "bytes_recv",
                           (json_int_t)D->bytes_recv, "collectives", (json_int_t)D->n_collectives, "comm_s",
                           1e-9 * (double)D->ns_comm, "wait_s", 1e-9 * (double)D->ns_wait);
    if (dj && D->dispatch) { /* token-sharded dispatch (src/dist/dist.h): its bytes against once per expert */
        json_object_set_new(dj, "dispatch", json_string(D->overlap ? "alltoall+overlap" : "alltoall"));
        json_object_set_new(dj, "records", json_integer((json_int_t)D->n_records));
        json_object_set_new(dj, "bytes_once_per_rank", json_integer((json_int_t)D->a2a_bytes_rank));
        json_object_set_new(dj, "bytes_once_per_expert", json_integer((json_int_t)D->a2a_bytes_expert));
        json_object_set_new(dj, "blocked_s", json_real(1e-9 * (double)D->ns_blocked));
        json_object_set_new(dj, "logits_bytes", json_integer((json_int_t)D->bytes_logits));
    }
    if (dj && D->n_rep) { /* replicas (src/dist/eplb.c): the expert work counts of the exit summary */
        json_object_set_new(dj, "replicas", json_integer(D->n_rep));
        json_object_set_new(dj, "work_plans", json_integer((json_int_t)D->n_planned));
        json_object_set_new(dj, "work_assignments", json_integer((json_int_t)D->work_total));
        json_object_set_new(dj, "work_busiest", json_integer((json_int_t)D->work_max));
        json_object_set_new(dj, "work_busiest_without_replicas", json_integer((json_int_t)D->work_max_base));
        json_object_set_new(dj, "work_even_split", json_integer((json_int_t)D->work_floor));
        json_object_set_new(dj, "work_mine", json_integer((json_int_t)D->work_mine));
        json_object_set_new(dj, "replica_experts_mapped", json_integer(D->n_extra));
        json_object_set_new(dj, "replica_bytes_mapped", json_integer((json_int_t)D->extra_bytes));
    }
    if (dj && D->n_layer_b) { /* bytes per layer (the whole run: every exchange, gather and combine) */
        json_t *ls = json_array(), *lr = json_array();
        for (int il = 0; il < D->n_layer_b; il++) {
            json_array_append_new(ls, json_integer((json_int_t)D->layer_sent[il]));
            json_array_append_new(lr, json_integer((json_int_t)D->layer_recv[il]));
        }
        json_object_set_new(dj, "layer_bytes_sent", ls);
        json_object_set_new(dj, "layer_bytes_recv", lr);
    }
    json_object_set_new(d, "rank", json_integer(D->rank));
    if (dj) json_object_set_new(d, "dist", dj);
    *text = json_dumps(d, JSON_COMPACT);
    json_decref(d);
    if (!*text) return moetax_error(MOETAX_ERR_NOMEM, "out of memory");
    *n = strlen(*text);
    return MOETAX_OK;
}

static moetax_status merge_ledgers(char **all, int P, const char *path) {
    json_t *ranks = json_array(), *root = NULL;
    moetax_status st = MOETAX_OK;
    for (int r = 0; r < P && !st; r++) {
        json_t *d = json_loads(all[r], 0, NULL);
        if (!d) { st = moetax_error(MOETAX_ERR_FORMAT, "the ledger of rank %d does not parse", r); break; }
        if (r == 0) root = json_deep_copy(d);
        json_array_append_new(ranks, d);
    }
    if (!st && root) {
        json_object_del(root, "rank");
        json_object_del(root, "dist");
        json_object_set_new(root, "mpi_ranks", json_integer(P));
        json_object_set(root, "ranks", ranks);
        st = moetax_outfile_write_json(path, root, JSON_INDENT(1), "the ledger");
    }
    json_decref(root);
    json_decref(ranks);
    return st;
}

static moetax_status merge_traces(char **all, int P, const char *path) {
    json_t *docs[64] = {0};
    if (P > 64) return moetax_error(MOETAX_ERR_LIMIT, "--trace under mpirun: at most 64 ranks in one trace");
    moetax_status st = MOETAX_OK;
    double t0[64] = {0};
    for (int r = 0; r < P && !st; r++) {
        if (!(docs[r] = json_loads(all[r], 0, NULL)) || !json_is_array(json_object_get(docs[r], "traceEvents")))
            st = moetax_error(MOETAX_ERR_FORMAT, "the trace of rank %d does not parse", r);
        else
            t0[r] = json_number_value(json_object_get(json_object_get(docs[r], "otherData"), "t0_ns"));
    }
    json_t *root = NULL, *events = NULL;
    if (!st) {
        root = json_deep_copy(docs[0]);
        events = json_array();
        json_object_set_new(json_object_get(root, "otherData"), "mpi_ranks", json_integer(P));
        for (int r = 0; r < P; r++) {
            const json_t *ev = json_object_get(docs[r], "traceEvents");
            const double shift_us = 1e-3 * (t0[r] - t0[0]);
            size_t i;
            json_t *e;
            json_array_foreach(ev, i, e) {
                json_t *c = json_deep_copy(e);
                json_t *pid = json_object_get(c, "pid"), *ts = json_object_get(c, "ts");
                if (json_is_integer(pid)) json_object_set_new(c, "pid", json_integer(RANK_PID_STRIDE * r + json_integer_value(pid)));
                if (json_is_number(ts)) json_object_set_new(c, "ts", json_real(json_number_value(ts) + shift_us));
                const char *nm = json_string_value(json_object_get(c, "name"));
                json_t *args = json_object_get(c, "args");
                if (nm && !strcmp(nm, "process_name") && json_is_object(args)) {
                    char buf[256];
                    snprintf(buf, sizeof buf, "rank %d: %s", r, json_string_value(json_object_get(args, "name")) ?
                             json_string_value(json_object_get(args, "name")) : "");
                    json_object_set_new(args, "name", json_string(buf));
                }
                json_array_append_new(events, c);
            }
        }
        json_object_set_new(root, "traceEvents", events);
        st = moetax_outfile_write_json(path, root, JSON_COMPACT, "the trace");
    }
    json_decref(root);
    for (int r = 0; r < P; r++) json_decref(docs[r]);
    return st;
}

/* One kind of output of every rank, merged by rank 0 into path. */
static moetax_status rank_outputs(const struct moetax_ledger *l, const struct moetax_ledger_meta *meta, bool trace,
                                  const struct moetax_store *store, const char *sj, const char *path) {
    const struct moetax_dist *D = moetax_dist_world();
    char *text = NULL, **all = NULL;
    size_t n = 0, *lens = NULL;
    int P = 1;
    moetax_status st = rank_doc(l, meta, trace, store, sj, D, &text, &n);
    /* a rank that failed still takes part (with nothing), and rank 0 reports it */
    moetax_status gs = moetax_dist_gather_bytes(st ? "" : text, st ? 0 : n, &all, &lens, &P);
    free(text);
    if (st) return st;
    if (gs) return gs;
    if (D->rank != 0) return MOETAX_OK;
    for (int r = 0; r < P && !st; r++)
        if (lens[r] == 0) st = moetax_error(MOETAX_ERR_IO, "rank %d could not write its %s", r, trace ? "trace" : "ledger");
    if (!st) st = trace ? merge_traces(all, P, path) : merge_ledgers(all, P, path);
    moetax_dist_gather_free(all, lens, P);
    return st;
}
#endif

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
#ifdef MOETAX_WITH_MPI
        if (moetax_dist_world() && moetax_dist_world()->size > 1) {
            if ((st = rank_outputs(l, &meta, false, store, store ? sj : NULL, o->json_path))) return st;
            if (moetax_dist_world()->rank == 0)
                fprintf(stderr, "  ledger of %d ranks written to %s (moetax report %s)\n", moetax_dist_world()->size,
                        o->json_path, o->json_path);
        } else
#endif
        {
            if ((st = moetax_ledger_write_json(l, &meta, o->json_path))) return st;
            fprintf(stderr, "  ledger written to %s (moetax report %s)\n", o->json_path, o->json_path);
        }
    }
    if (o->trace_path) {
#ifdef MOETAX_WITH_MPI
        if (moetax_dist_world() && moetax_dist_world()->size > 1) {
            if ((st = rank_outputs(l, NULL, true, store, store ? sj : NULL, o->trace_path))) return st;
            if (moetax_dist_world()->rank == 0)
                fprintf(stderr, "  trace of %d ranks (a process each) written to %s (open in https://ui.perfetto.dev)\n",
                        moetax_dist_world()->size, o->trace_path);
        } else
#endif
        {
            if ((st = write_trace(l, o->trace_path, store, store ? sj : NULL))) return st;
            fprintf(stderr, "  trace written to %s (open in https://ui.perfetto.dev or chrome://tracing)\n", o->trace_path);
        }
    }
    if (o->metrics) moetax_ledger_write_prometheus(l, stdout);
    return st;
}
