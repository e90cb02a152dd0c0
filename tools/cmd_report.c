/* cmd_report.c - `moetax report FILE`: the bill of a run, from its ledger (or
 * Chrome trace): steps and speed, tax share and efficiency, time by phase, by
 * layer and by worker, and the routing statistics that say whether caching
 * and prefetching experts can pay off. Text, --json, or an --html page. */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <jansson.h>

#include "cli.h"
#include "commands.h"
#include "core/printable.h"
#include "moetax/outfile.h"
#include "moetax/report.h"
#include "report_profile.h"

#define P MOETAX_PHASE_COUNT

static void usage(FILE *f) {
    fprintf(f, "usage: moetax report FILE [--json] [--html OUT.html] [--decode-only] [--max-input-bytes N]\n\n"
               "Reads a ledger (moetax run/bench --ledger FILE) or a Chrome trace (--trace FILE) and shows\n"
               "where the time went: steps, tokens and time per token (all / prefill / decode), the tax share\n"
               "(route+dispatch+load+comm+wait+combine of all phases) and efficiency, seconds and us per token\n"
               "by phase, a layer x phase table, per-worker busy and wait, and, when the run recorded routing\n"
               "(--routing-stats), expert load, batch imbalance, adjacent-token overlap and cross-layer\n"
               "prediction precision/recall, each with a one-line verdict on caching and prefetching.\n"
               "A routing profile (moetax profile -o FILE) is shown as expert heat maps by layer and transitions.\n\n"
               "  --json          one JSON object instead of text\n"
               "  --html OUT      also write a self-contained HTML page (charts as inline SVG)\n"
               "  --decode-only   phase, layer and worker breakdowns over decode steps only\n"
               "  --max-input-bytes N  read at most N bytes of FILE (default 256M; sizes like 512M, 4G): a longer\n"
               "                  file (or a device such as /dev/zero) is refused. Reading takes about 18x the\n"
               "                  file's size in memory (the parsed JSON)\n");
}

static const char *pname(int p) { return moetax_phase_name((enum moetax_phase)p); }

static double per_tok_us(double s, int64_t tokens) { return tokens > 0 ? 1e6 * s / (double)tokens : 0; }

static void vec_stats(const double *v, int n, double *mean, double *max) {
    double s = 0, m = 0;
    for (int i = 0; i < n; i++) { s += v[i]; if (v[i] > m) m = v[i]; }
    *mean = n ? s / n : 0;
    *max = m;
}

/* ---- text ------------------------------------------------------------------------- */

static void step_line(FILE *f, const char *label, const struct moetax_report_agg *a) {
    if (!a->steps) { fprintf(f, "  %-8s %7d\n", label, 0); return; }
    fprintf(f, "  %-8s %7lld %8lld %11.2f %10.3f %10.1f\n", label, (long long)a->steps, (long long)a->tokens,
            1e3 * a->wall_s, a->tokens ? 1e3 * a->wall_s / (double)a->tokens : 0,
            a->wall_s > 0 ? (double)a->tokens / a->wall_s : 0);
}

static void print_store(FILE *f, const struct moetax_report *r) {
    const struct moetax_report_store *s = r->store;
    if (!s) return;
    double tok = s->tokens > 0 ? (double)s->tokens : 0;
    fprintf(f, "\nexpert store: %d slots of %.2f MiB (budget %.1f MiB), %s\n", s->n_slots, s->slot_bytes / 1048576.0,
            s->budget_bytes / 1048576.0, s->direct_io ? "O_DIRECT" : "buffered reads");
    fprintf(f, "  hit rate %.1f%% (%.0f of %.0f acquires did not wait); %.0f experts read\n",
            s->acquires > 0 ? 100 * s->hits / s->acquires : 0, s->hits, s->acquires, s->loads);
    fprintf(f, "  read %.1f MiB in %.0f requests at %.2f GB/s%s", s->bytes_read / 1048576.0, s->reads, s->read_gbps,
            tok > 0 ? "" : "\n");
    if (tok > 0) fprintf(f, ": %.2f MiB and %.2f ms of stalls per token\n", s->bytes_read / 1048576.0 / tok, 1e3 * s->stall_s / tok);
    fprintf(f, "  prefetch: %.0f predicted reads, precision %.1f%%; %.0f wasted, %.0f dropped\n", s->predicted_issued,
            s->predicted_issued > 0 ? 100 * s->predicted_used / s->predicted_issued : 0, s->prefetch_wasted,
            s->prefetch_dropped);
}

/* The store's reads against the workers' steps (a trace with I/O tracks). */
static void print_io(FILE *f, const struct moetax_report *r) {
    const struct moetax_report_io *o = r->io;
    if (!o || o->wall_s <= 0) return;
    fprintf(f, "\nexpert store reads on the timeline (trace, all kept reads): %lld demand, %lld known (the layer's routing),"
               " %lld predicted; %.1f MiB, median %.2f ms from start to resident\n",
            (long long)o->reads[0], (long long)o->reads[1], (long long)o->reads[2], o->bytes / 1048576.0, o->median_read_ms);
    fprintf(f, "  during the traced steps: a read in flight %.0f%% of the time (%.1f on average then), workers stalled in load %.0f%%;\n"
               "  the disk idled %.0f%% of the steps: the most that earlier reads (prefetch) could fill\n",
            100 * o->busy_s / o->wall_s, o->busy_s > 0 ? o->inflight_s / o->busy_s : 0, 100 * o->stall_s / o->wall_s,
            100 * (1 - o->busy_s / o->wall_s));
}

/* The batch tax against batch size: decode steps by the number of sequences decoded together. */
static void print_batches(FILE *f, const struct moetax_report *r) {
    bool any = false;
    for (int i = 0; i < r->n_batches; i++) any |= r->batches[i].batch > 1; /* one sequence: no batch axis to show */
    if (!any) return;
    fprintf(f, "\nbatch (decode steps by sequences decoded together)\n"
               "  %5s %6s %10s %9s %12s %14s %9s %6s %6s %9s\n", "B", "steps", "tokens/s", "step ms", "experts/layer",
            "expert MiB/tok", "imbalance", "wait", "tax", "dropped");
    for (int i = 0; i < r->n_batches; i++) {
        const struct moetax_report_batch *b = &r->batches[i];
        const double L = b->moe_layers > 0 ? (double)b->moe_layers : NAN;
        const double n_asg = (double)(b->assignments + b->dropped);
        fprintf(f, "  %5lld %6lld %10.1f %9.3f %12.1f %14.2f %9.2f %5.1f%% %5.1f%% %8.2f%%\n", (long long)b->batch,
                (long long)b->steps, b->wall_s > 0 ? (double)b->tokens / b->wall_s : 0,
                b->steps ? 1e3 * b->wall_s / (double)b->steps : 0, (double)b->experts / L,
                b->tokens ? b->expert_bytes / 1048576.0 / (double)b->tokens : 0, b->imbalance_sum / L,
                b->phase_s > 0 ? 100 * b->wait_s / b->phase_s : 0, b->phase_s > 0 ? 100 * b->tax_s / b->phase_s : 0,
                n_asg > 0 ? 100 * (double)b->dropped / n_asg : 0);
    }
    fprintf(f, "  imbalance: most assignments on one expert / mean per used expert, per MoE layer pass; a step\n"
               "  waits for its most loaded expert, and more sequences touch more distinct experts\n");
}

static void print_routing(FILE *f, const struct moetax_report *r) {
    const struct moetax_report_routing *R = r->routing;
    if (!R) {
        fprintf(f, "\nrouting: not recorded (run with --routing-stats%s)\n",
                r->source == MOETAX_REPORT_SOURCE_TRACE ? " and report the ledger" : "");
        return;
    }
    int quarter = (R->n_expert + 3) / 4;
    double chance = (double)R->k / R->n_expert, uni_q = (double)quarter / R->n_expert;
    fprintf(f, "\nrouting (%lld tokens, %d experts, top-%d, %d MoE layers)\n", (long long)R->tokens, R->n_expert,
            R->k, R->n_layers);
    fprintf(f, "  layer  tokens  load min/mean/max      cv  top-1/4  hottest (tokens)          batch max/mean"
               "  overlap  pred prec / rec\n");
    for (int i = 0; i < R->n_layers; i++) {
        const struct moetax_report_routing_layer *L = &R->layers[i];
        char hot[64] = "", mm[40], bi[16] = "-", ov[16] = "-", pr[32] = "-";
        int o = 0;
        for (int h = 0; h < MOETAX_REPORT_N_HOT; h++)
            if (L->hot[h] >= 0)
                o += snprintf(hot + o, sizeof hot - (size_t)o, "%se%d (%lld)", h ? " " : "", L->hot[h],
                              (long long)L->hot_n[h]);
        snprintf(mm, sizeof mm, "%.0f / %.2f / %.0f", L->load_min, L->load_mean, L->load_max);
        if (!isnan(L->batch_imbalance)) snprintf(bi, sizeof bi, "%.2f", L->batch_imbalance);
        if (!isnan(L->overlap)) snprintf(ov, sizeof ov, "%.1f%%", 100 * L->overlap);
        if (!isnan(L->precision)) snprintf(pr, sizeof pr, "%.1f%% / %.1f%%", 100 * L->precision, 100 * L->recall);
        fprintf(f, "  %5d %7lld  %-20s %6.2f %7.1f%%  %-25s %14s %8s  %s\n", L->layer, (long long)L->tokens, mm,
                L->load_cv, 100 * L->top_quarter_share, hot, bi, ov, pr);
    }
    char bi[16] = "-", ov[16] = "-", pr[32] = "-";
    if (!isnan(R->batch_imbalance)) snprintf(bi, sizeof bi, "%.2f", R->batch_imbalance);
    if (!isnan(R->overlap)) snprintf(ov, sizeof ov, "%.1f%%", 100 * R->overlap);
    if (!isnan(R->precision)) snprintf(pr, sizeof pr, "%.1f%% / %.1f%%", 100 * R->precision, 100 * R->recall);
    fprintf(f, "  %5s %7s  %-20s %6.2f %7.1f%%  %-25s %14s %8s  %s\n", "mean", "", "", R->load_cv,
            100 * R->top_quarter_share, "", bi, ov, pr);

    /* verdicts, one line each */
    if (!isnan(R->top_quarter_share)) {
        bool skew = R->top_quarter_share > 1.5 * uni_q, noise = !(R->load_cv > 1.5 * R->load_cv_chance);
        fprintf(f, "  caching:  the busiest %d of %d experts take %.0f%% of routings (uniform: %.0f%%; load CV %.2f, "
                   "sampling noise alone %.2f): %s\n", quarter, R->n_expert, 100 * R->top_quarter_share, 100 * uni_q,
                R->load_cv, R->load_cv_chance,
                noise  ? "the skew is within sampling noise, record more tokens before sizing a cache"
                : skew ? "load is skewed, a frequency-aware cache of hot experts pays off"
                       : "load is near uniform, a cache pays only if most experts fit in it");
    }
    if (!isnan(R->overlap))
        fprintf(f, "  reuse:    adjacent tokens share %.0f%% of their experts (chance: %.0f%%): %s\n", 100 * R->overlap,
                100 * chance,
                R->overlap > chance + 0.15 ? "keeping the previous token's experts resident pays off"
                : R->overlap > chance     ? "recent-token caching helps a little"
                                          : "no temporal locality, caching recent experts does not pay");
    if (!isnan(R->precision)) {
        double base = isnan(R->overlap) ? chance : R->overlap;
        if (base < chance) base = chance;
        fprintf(f, "  prefetch: next-layer prediction hits %.0f%% (precision %.0f%%, recall %.0f%%; previous-token cache %s%.0f%%, "
                   "chance %.0f%%): %s\n",
                100 * R->precision, 100 * R->precision, 100 * R->recall, isnan(R->overlap) ? "n/a, " : "",
                isnan(R->overlap) ? 0 : 100 * R->overlap, 100 * chance,
                R->precision > base + 0.1 ? "prefetching from the prediction pays off"
                : R->precision > base     ? "prefetching helps a little over reuse"
                                          : "prediction is no better than reuse; do not prefetch from it");
    } else {
        fprintf(f, "  prefetch: no predicted sets recorded (cross-layer prediction not measured)\n");
    }
    if (!isnan(R->batch_imbalance))
        fprintf(f, "  batches:  the busiest expert of a batch gets %.2fx the mean load: %s\n", R->batch_imbalance,
                R->batch_imbalance > 2 ? "hot experts dominate a batch; split their rows across threads or replicate them"
                                       : "expert work within a batch is balanced enough");
    else fprintf(f, "  batches:  no step with two or more tokens recorded (batch imbalance not measured)\n");
}

/* A ledger of `mpirun -np N`: each rank's bill and transfers, and per MoE layer the rank the
 * others wait for. */
static void print_ranks(FILE *f, const struct moetax_report *r) {
    if (r->n_ranks == 0) return;
    const char *scope = r->decode_only ? "decode steps" : "all steps";
    fprintf(f, "\nranks (mpirun -np %d; each rank's own ledger, %s)\n", r->n_ranks, scope);
    fprintf(f, "  rank   wall (ms)   tax    comm (ms)  wait (ms)  expert (ms)   MB sent   MB recv  collectives\n");
    for (int i = 0; i < r->n_ranks; i++) {
        const struct moetax_report_rank *k = &r->ranks[i];
        const struct moetax_report_agg *a = moetax_report_sel(k->r);
        fprintf(f, "  %4d %11.2f %5.1f%% %11.2f %10.2f %12.2f", k->rank, 1e3 * a->wall_s,
                100 * moetax_report_tax_share(a), 1e3 * a->phase_s[MOETAX_PHASE_COMM], 1e3 * a->phase_s[MOETAX_PHASE_WAIT],
                1e3 * a->phase_s[MOETAX_PHASE_EXPERT]);
        if (k->has_dist) fprintf(f, " %9.3f %9.3f %12.0f\n", 1e-6 * k->bytes_sent, 1e-6 * k->bytes_recv, k->collectives);
        else fprintf(f, " %9s %9s %12s\n", "-", "-", "-");
    }
    if (r->n_rank_layers == 0) return;
    fprintf(f, "  per MoE layer, the rank that works longest (phases but comm and wait) and how much longer than the mean;\n"
               "  the others wait for it:\n");
    double excess = 0, cw = 0;
    for (int i = 0; i < r->n_rank_layers; i++) {
        const struct moetax_report_rank_layer *x = &r->rank_layers[i];
        fprintf(f, "    layer %3d: rank %d, %.3f ms (+%.1f%% over the mean %.3f ms); comm + wait %.3f ms per rank", x->layer,
                x->slowest, 1e3 * x->busy_max_s, x->busy_mean_s > 0 ? 100 * (x->busy_max_s / x->busy_mean_s - 1) : 0,
                1e3 * x->busy_mean_s, 1e3 * x->comm_wait_mean_s);
        if (x->has_bytes)
            fprintf(f, "; %.3f MB sent by all ranks (the whole run), most by rank %d: %.3f MB sent, %.3f MB received",
                    1e-6 * x->bytes_sent, x->bytes_max_rank, 1e-6 * x->bytes_max_sent, 1e-6 * x->bytes_max_recv);
        fputc('\n', f);
        excess += x->busy_max_s - x->busy_mean_s;
        cw += x->comm_wait_mean_s;
    }
    fprintf(f, "  all MoE layers: comm + wait %.3f ms per rank, of which the slowest ranks' excess work explains up to %.3f ms\n",
            1e3 * cw, 1e3 * excess);
}

static void print_text(FILE *f, const struct moetax_report *r) {
    const struct moetax_report_agg *a = moetax_report_sel(r);
    const char *scope = r->decode_only ? "decode steps" : "all steps";
    fprintf(f, "moetax report: %s (%s", r->path, r->source == MOETAX_REPORT_SOURCE_LEDGER ? "ledger" : "Chrome trace");
    if (r->model[0]) { /* a name from the file: its control bytes stay off the terminal */
        char model[sizeof r->model];
        moetax_printable(model, sizeof model, r->model, SIZE_MAX, 0);
        fprintf(f, ", model %s", model);
    }
    fprintf(f, ", %d workers, %d layers", r->n_workers, r->n_layer);
    if (r->n_expert) fprintf(f, ", %d experts, %d used", r->n_expert, r->n_expert_used);
    fprintf(f, ")\n");
    if (r->source == MOETAX_REPORT_SOURCE_TRACE)
        fprintf(f, "  (rebuilt from trace spans: steps with more than one token count as prefill; sampling is not in a "
                   "trace%s)\n", r->dropped_spans ? "" : "");
    if (r->dropped_spans)
        fprintf(f, "  warning: the trace ring dropped %lld spans; the oldest steps are incomplete\n",
                (long long)r->dropped_spans);
    if (r->dropped_steps)
        fprintf(f, "  note: %lld step records are not in the file (totals still cover them)\n",
                (long long)r->dropped_steps);

    fprintf(f, "\nsteps       steps   tokens   wall (ms)   ms/token   tokens/s\n");
    step_line(f, "all", &r->all);
    step_line(f, "prefill", &r->prefill);
    step_line(f, "decode", &r->decode);

    double total = moetax_report_phase_total(a), share = moetax_report_tax_share(a);
    fprintf(f, "\ntax share %.1f%% (route+dispatch+load+comm+wait+combine / all phases), efficiency %.1f  [%s]\n",
            100 * share, 100 * (1 - share), scope);
    if (a->wall_s > 0)
        fprintf(f, "the phases account for %.1f%% of wall time%s\n", 100 * total / a->wall_s,
                r->span_ns > 0 ? "" : "");
    if (r->span_ns > 0) fprintf(f, "ledger overhead: %.1f ns per span\n", r->span_ns);

    fprintf(f, "\nphases (%s)     seconds   us/token   share\n", scope);
    for (int p = 0; p < P; p++) {
        if (a->phase_s[p] == 0 && p != MOETAX_PHASE_WAIT) continue;
        fprintf(f, "  %-9s %-4s %11.6f %10.1f %6.1f%%\n", pname(p), p < MOETAX_PHASE_N_TAX ? "tax" : "", a->phase_s[p],
                per_tok_us(a->phase_s[p], a->tokens), total > 0 ? 100 * a->phase_s[p] / total : 0);
    }
    fprintf(f, "  %-14s %11.6f %10.1f %6.1f%%\n", "total", total, per_tok_us(total, a->tokens), total > 0 ? 100.0 : 0);

    /* layer x phase table over the phases that occur */
    bool col[P];
    for (int p = 0; p < P; p++) col[p] = a->phase_s[p] > 0;
    fprintf(f, "\nlayers (us per token, %s; * = MoE layer)\n  layer  ", scope);
    for (int p = 0; p < P; p++)
        if (col[p]) fprintf(f, "%9s", pname(p));
    fprintf(f, "%10s %6s\n", "total", "tax%");
    for (int l = -1; l < r->n_layer; l++) {
        const double *row = l < 0 ? a->other_phase_s : a->layer_phase_s + (size_t)l * P;
        double t = 0, tx = 0;
        for (int p = 0; p < P; p++) { t += row[p]; if (p < MOETAX_PHASE_N_TAX) tx += row[p]; }
        if (l < 0) fprintf(f, "  %-6s ", "out");
        else fprintf(f, "  %5d%c ", l, r->moe_layer[l] ? '*' : ' ');
        for (int p = 0; p < P; p++)
            if (col[p]) fprintf(f, "%9.1f", per_tok_us(row[p], a->tokens));
        fprintf(f, "%10.1f %5.1f%%\n", per_tok_us(t, a->tokens), t > 0 ? 100 * tx / t : 0);
    }

    fprintf(f, "\nworkers (%s)   busy (ms)   wait (ms)   wait share\n", scope);
    for (int w = 0; w < r->n_workers; w++) {
        double b = a->worker_busy_s[w], wt = a->worker_wait_s[w];
        fprintf(f, "  %-13d %11.3f %11.3f %11.1f%%\n", w, 1e3 * b, 1e3 * wt, b + wt > 0 ? 100 * wt / (b + wt) : 0);
    }
    double bm, bx, wm, wx;
    vec_stats(a->worker_busy_s, r->n_workers, &bm, &bx);
    vec_stats(a->worker_wait_s, r->n_workers, &wm, &wx);
    fprintf(f, "  imbalance: busy max/mean %.2f, wait max/mean %.2f\n", bm > 0 ? bx / bm : 0, wm > 0 ? wx / wm : 0);

    print_routing(f, r);
    print_batches(f, r);
    print_store(f, r);
    print_io(f, r);
    print_ranks(f, r);
}

/* ---- JSON ------------------------------------------------------------------------- */

static json_t *jnum(double v) { return isfinite(v) ? json_real(v) : json_null(); }

static json_t *phase_map(const double *s, double scale) {
    json_t *o = json_object();
    for (int p = 0; p < P; p++) json_object_set_new(o, pname(p), jnum(s[p] * scale));
    return o;
}

static json_t *agg_json(const struct moetax_report_agg *a) {
    json_t *o = json_object();
    json_object_set_new(o, "steps", json_integer(a->steps));
    json_object_set_new(o, "tokens", json_integer(a->tokens));
    json_object_set_new(o, "wall_s", jnum(a->wall_s));
    json_object_set_new(o, "s_per_token", a->tokens ? jnum(a->wall_s / (double)a->tokens) : json_null());
    json_object_set_new(o, "tokens_per_s", a->wall_s > 0 ? jnum((double)a->tokens / a->wall_s) : json_null());
    json_object_set_new(o, "tax_share", jnum(moetax_report_tax_share(a)));
    return o;
}

static json_t *routing_json(const struct moetax_report_routing *R) {
    if (!R) return json_null();
    json_t *o = json_object(), *layers = json_array();
    json_object_set_new(o, "tokens", json_integer(R->tokens));
    json_object_set_new(o, "n_expert", json_integer(R->n_expert));
    json_object_set_new(o, "k", json_integer(R->k));
    json_object_set_new(o, "chance_overlap", jnum((double)R->k / R->n_expert));
    json_object_set_new(o, "load_cv", jnum(R->load_cv));
    json_object_set_new(o, "load_cv_chance", jnum(R->load_cv_chance));
    json_object_set_new(o, "top_quarter_share", jnum(R->top_quarter_share));
    json_object_set_new(o, "batch_imbalance", jnum(R->batch_imbalance));
    json_object_set_new(o, "overlap", jnum(R->overlap));
    json_object_set_new(o, "precision", jnum(R->precision));
    json_object_set_new(o, "recall", jnum(R->recall));
    for (int i = 0; i < R->n_layers; i++) {
        const struct moetax_report_routing_layer *L = &R->layers[i];
        json_t *l = json_object(), *load = json_array(), *hot = json_array();
        for (int e = 0; e < R->n_expert; e++) json_array_append_new(load, json_integer(L->load[e]));
        for (int h = 0; h < MOETAX_REPORT_N_HOT; h++)
            if (L->hot[h] >= 0) {
                json_t *x = json_object();
                json_object_set_new(x, "expert", json_integer(L->hot[h]));
                json_object_set_new(x, "tokens", json_integer(L->hot_n[h]));
                json_array_append_new(hot, x);
            }
        json_object_set_new(l, "layer", json_integer(L->layer));
        json_object_set_new(l, "tokens", json_integer(L->tokens));
        json_object_set_new(l, "load", load);
        json_object_set_new(l, "load_min", jnum(L->load_min));
        json_object_set_new(l, "load_mean", jnum(L->load_mean));
        json_object_set_new(l, "load_max", jnum(L->load_max));
        json_object_set_new(l, "load_cv", jnum(L->load_cv));
        json_object_set_new(l, "top_quarter_share", jnum(L->top_quarter_share));
        json_object_set_new(l, "hottest", hot);
        json_object_set_new(l, "batches", json_integer(L->n_batches));
        json_object_set_new(l, "batch_imbalance", jnum(L->batch_imbalance));
        json_object_set_new(l, "overlap", jnum(L->overlap));
        json_object_set_new(l, "predicted_tokens", json_integer(L->n_pred));
        json_object_set_new(l, "precision", jnum(L->precision));
        json_object_set_new(l, "recall", jnum(L->recall));
        json_array_append_new(layers, l);
    }
    json_object_set_new(o, "layers", layers);
    return o;
}

static int print_json(FILE *f, const struct moetax_report *r) {
    const struct moetax_report_agg *a = moetax_report_sel(r);
    double tok = a->tokens > 0 ? 1e6 / (double)a->tokens : 0;
    json_t *o = json_object();
    json_object_set_new(o, "file", json_string(r->path));
    json_object_set_new(o, "source", json_string(r->source == MOETAX_REPORT_SOURCE_LEDGER ? "ledger" : "trace"));
    json_object_set_new(o, "model", json_string(r->model));
    json_object_set_new(o, "n_workers", json_integer(r->n_workers));
    json_object_set_new(o, "n_layer", json_integer(r->n_layer));
    json_object_set_new(o, "n_expert", json_integer(r->n_expert));
    json_object_set_new(o, "n_expert_used", json_integer(r->n_expert_used));
    json_object_set_new(o, "scope", json_string(r->decode_only ? "decode" : "all"));
    json_object_set_new(o, "tax_share", jnum(moetax_report_tax_share(a)));
    json_object_set_new(o, "efficiency", jnum(moetax_report_efficiency(a)));
    json_object_set_new(o, "phase_total_s", jnum(moetax_report_phase_total(a)));
    json_object_set_new(o, "phase_s", phase_map(a->phase_s, 1));
    json_object_set_new(o, "per_token_us", phase_map(a->phase_s, tok));
    json_t *steps = json_object();
    json_object_set_new(steps, "all", agg_json(&r->all));
    json_object_set_new(steps, "prefill", agg_json(&r->prefill));
    json_object_set_new(steps, "decode", agg_json(&r->decode));
    json_object_set_new(o, "steps", steps);
    json_t *layers = json_array();
    for (int l = 0; l < r->n_layer; l++) {
        json_t *x = json_object();
        json_object_set_new(x, "layer", json_integer(l));
        json_object_set_new(x, "moe", json_boolean(r->moe_layer[l]));
        json_object_set_new(x, "phase_s", phase_map(a->layer_phase_s + (size_t)l * P, 1));
        json_object_set_new(x, "per_token_us", phase_map(a->layer_phase_s + (size_t)l * P, tok));
        json_array_append_new(layers, x);
    }
    json_object_set_new(o, "layers", layers);
    json_t *other = json_object();
    json_object_set_new(other, "phase_s", phase_map(a->other_phase_s, 1));
    json_object_set_new(other, "per_token_us", phase_map(a->other_phase_s, tok));
    json_object_set_new(o, "outside_layers", other);
    json_t *workers = json_array();
    for (int w = 0; w < r->n_workers; w++) {
        json_t *x = json_object();
        json_object_set_new(x, "worker", json_integer(w));
        json_object_set_new(x, "busy_s", jnum(a->worker_busy_s[w]));
        json_object_set_new(x, "wait_s", jnum(a->worker_wait_s[w]));
        json_array_append_new(workers, x);
    }
    json_object_set_new(o, "workers", workers);
    double bm, bx, wm, wx;
    vec_stats(a->worker_busy_s, r->n_workers, &bm, &bx);
    vec_stats(a->worker_wait_s, r->n_workers, &wm, &wx);
    json_object_set_new(o, "busy_imbalance", bm > 0 ? jnum(bx / bm) : json_null());
    json_object_set_new(o, "wait_imbalance", wm > 0 ? jnum(wx / wm) : json_null());
    json_object_set_new(o, "dropped_steps", json_integer(r->dropped_steps));
    json_object_set_new(o, "dropped_spans", json_integer(r->dropped_spans));
    json_object_set_new(o, "routing", routing_json(r->routing));
    json_t *bj = json_array();
    for (int i = 0; i < r->n_batches; i++) {
        const struct moetax_report_batch *b = &r->batches[i];
        const double L = (double)b->moe_layers, n_asg = (double)(b->assignments + b->dropped);
        json_t *x = json_object();
        json_object_set_new(x, "batch", json_integer(b->batch));
        json_object_set_new(x, "steps", json_integer(b->steps));
        json_object_set_new(x, "tokens", json_integer(b->tokens));
        json_object_set_new(x, "tokens_per_s", b->wall_s > 0 ? jnum((double)b->tokens / b->wall_s) : json_null());
        json_object_set_new(x, "step_s", b->steps ? jnum(b->wall_s / (double)b->steps) : json_null());
        json_object_set_new(x, "experts_per_layer", L > 0 ? jnum((double)b->experts / L) : json_null());
        json_object_set_new(x, "expert_bytes_per_token", b->tokens ? jnum(b->expert_bytes / (double)b->tokens) : json_null());
        json_object_set_new(x, "imbalance", L > 0 ? jnum(b->imbalance_sum / L) : json_null());
        json_object_set_new(x, "wait_share", b->phase_s > 0 ? jnum(b->wait_s / b->phase_s) : json_null());
        json_object_set_new(x, "tax_share", b->phase_s > 0 ? jnum(b->tax_s / b->phase_s) : json_null());
        json_object_set_new(x, "dropped", json_integer(b->dropped));
        json_object_set_new(x, "rerouted", json_integer(b->rerouted));
        json_object_set_new(x, "dropped_share", n_asg > 0 ? jnum((double)b->dropped / n_asg) : json_null());
        json_array_append_new(bj, x);
    }
    json_object_set_new(o, "batches", bj);
    if (r->store) {
        const struct moetax_report_store *s = r->store;
        json_t *so = json_object();
        json_object_set_new(so, "n_slots", json_integer(s->n_slots));
        json_object_set_new(so, "budget_bytes", jnum(s->budget_bytes));
        json_object_set_new(so, "hit_rate", jnum(s->acquires > 0 ? s->hits / s->acquires : 0));
        json_object_set_new(so, "bytes_read", jnum(s->bytes_read));
        json_object_set_new(so, "read_gbps", jnum(s->read_gbps));
        json_object_set_new(so, "stall_s", jnum(s->stall_s));
        json_object_set_new(so, "prefetch_precision", jnum(s->predicted_issued > 0 ? s->predicted_used / s->predicted_issued : 0));
        json_object_set_new(so, "direct_io", json_boolean(s->direct_io));
        json_object_set_new(o, "store", so);
    } else {
        json_object_set_new(o, "store", json_null());
    }
    if (r->io) {
        const struct moetax_report_io *io = r->io;
        json_t *jo = json_object();
        json_object_set_new(jo, "demand_reads", json_integer(io->reads[0]));
        json_object_set_new(jo, "known_reads", json_integer(io->reads[1]));
        json_object_set_new(jo, "predicted_reads", json_integer(io->reads[2]));
        json_object_set_new(jo, "bytes", jnum(io->bytes));
        json_object_set_new(jo, "median_read_ms", jnum(io->median_read_ms));
        json_object_set_new(jo, "busy_share", jnum(io->wall_s > 0 ? io->busy_s / io->wall_s : 0));
        json_object_set_new(jo, "mean_in_flight", jnum(io->busy_s > 0 ? io->inflight_s / io->busy_s : 0));
        json_object_set_new(jo, "stall_share", jnum(io->wall_s > 0 ? io->stall_s / io->wall_s : 0));
        json_object_set_new(o, "io", jo);
    } else {
        json_object_set_new(o, "io", json_null());
    }
    if (r->n_ranks) {
        json_t *ra = json_array(), *la = json_array();
        for (int i = 0; i < r->n_ranks; i++) {
            const struct moetax_report_rank *k = &r->ranks[i];
            const struct moetax_report_agg *ka = moetax_report_sel(k->r);
            json_t *x = json_object();
            json_object_set_new(x, "rank", json_integer(k->rank));
            json_object_set_new(x, "wall_s", jnum(ka->wall_s));
            json_object_set_new(x, "tax_share", jnum(moetax_report_tax_share(ka)));
            json_object_set_new(x, "phase_s", phase_map(ka->phase_s, 1.0));
            json_object_set_new(x, "bytes_sent", k->has_dist ? jnum(k->bytes_sent) : json_null());
            json_object_set_new(x, "bytes_recv", k->has_dist ? jnum(k->bytes_recv) : json_null());
            json_object_set_new(x, "collectives", k->has_dist ? jnum(k->collectives) : json_null());
            json_array_append_new(ra, x);
        }
        for (int i = 0; i < r->n_rank_layers; i++) {
            const struct moetax_report_rank_layer *x = &r->rank_layers[i];
            json_t *lj = json_pack("{s:i, s:i, s:o, s:o, s:o}", "layer", x->layer, "slowest_rank", x->slowest,
                                   "busy_max_s", jnum(x->busy_max_s), "busy_mean_s", jnum(x->busy_mean_s),
                                   "comm_wait_mean_s", jnum(x->comm_wait_mean_s));
            if (lj && x->has_bytes) { /* the whole run's bytes of the layer */
                json_object_set_new(lj, "bytes_sent_all_ranks", jnum(x->bytes_sent));
                json_object_set_new(lj, "bytes_most_rank", json_integer(x->bytes_max_rank));
                json_object_set_new(lj, "bytes_most_sent", jnum(x->bytes_max_sent));
                json_object_set_new(lj, "bytes_most_recv", jnum(x->bytes_max_recv));
            }
            json_array_append_new(la, lj);
        }
        json_object_set_new(o, "ranks", ra);
        json_object_set_new(o, "rank_layers", la);
    } else {
        json_object_set_new(o, "ranks", json_null());
    }
    int rc = json_dumpf(o, f, JSON_INDENT(1) | JSON_REAL_PRECISION(10));
    fputc('\n', f);
    json_decref(o);
    return rc;
}

int cmd_report(int argc, char **argv) {
    const char *path = NULL, *html = NULL;
    bool json = false, err = false;
    struct moetax_report_params p = {0};
    /* a trace of a million spans is ~150 MB; the parsed JSON takes ~18x a file's size, so 1 GiB asked for
     * ~18 GB (a 24 GB machine's) */
    uint64_t max_input = (uint64_t)256 << 20;
    for (int i = 1; i < argc; i++) {
        if (cli_flag(argv, i, "-h", "--help")) { usage(stdout); return 0; }
        else if (!strcmp(argv[i], "--json")) json = true;
        else if (!strcmp(argv[i], "--decode-only")) p.decode_only = true;
        else if (cli_opt(argc, argv, &i, NULL, "--html", &html, &err)) { if (err) return 2; }
        else if (cli_max_input_opt("report", argc, argv, &i, &max_input, &err)) { if (err) return 2; }
        else if (argv[i][0] == '-' && argv[i][1]) return cli_usage_error("report", "unknown option '%s'", argv[i]);
        else if (!path) path = argv[i];
        else return cli_usage_error("report", "only one file, please ('%s' and '%s')", path, argv[i]);
    }
    if (!path) return cli_usage_error("report", "no file given (a ledger from --ledger or a trace from --trace)");
    moetax_status st;
    const char *outs[1] = {html}, *ins[1] = {strcmp(path, "-") ? path : NULL};
    if ((st = cli_check_io(outs, 1, ins, 1))) return cli_usage_error("report", "%s", moetax_last_error());
    /* read here, with a limit (the library's loader reads any length) */
    char *text;
    size_t len;
    if ((st = cli_read_file(path, max_input, &text, &len))) return cli_fail("report", st);
    if (len == 0) {
        free(text);
        return cli_fail("report", moetax_error(MOETAX_ERR_FORMAT, "%s: the file is empty", path));
    }
    /* parsed once: a routing profile (moetax profile) goes to its reader, a ledger or trace to the report's */
    json_error_t je;
    json_t *root = json_loadb(text, len, 0, &je);
    free(text);
    if (!root)
        return cli_fail("report", moetax_error(MOETAX_ERR_FORMAT, "%s: not valid JSON: line %d, column %d: %s", path,
                                               je.line, je.column, je.text));
    if (json_is_object(root) && json_object_get(root, "moetax_profile")) {
        const int rc = report_profile(path, root, json, html);
        json_decref(root);
        return rc;
    }
    struct moetax_report *r;
    st = moetax_report_from_json(root, path, &p, &r);
    json_decref(root);
    if (st) return cli_fail("report", st);
    if (p.decode_only && r->decode.steps == 0) { /* its breakdowns would be zeros, its tax share 0% */
        moetax_report_free(r);
        return cli_fail("report", moetax_error(MOETAX_ERR_ARG, "%s holds no decode steps (a prefill-only run): "
                                               "--decode-only has nothing to break down; leave it out", path));
    }
    if (html) { /* a temporary file renamed into place */
        struct moetax_outfile *of;
        if (!(st = moetax_outfile_open(html, &of))) {
            if ((st = moetax_report_write_html(r, moetax_outfile_file(of)))) {
                st = cli_error_at(html, st); /* the page's path with the reason */
                moetax_outfile_abort(of);
            }
            else st = moetax_outfile_commit(of);
        }
        if (st) { moetax_report_free(r); return cli_fail("report", st); }
    }
    int rc = 0;
    if (json) rc = print_json(stdout, r) ? 1 : 0;
    else {
        print_text(stdout, r);
        if (html) printf("\nHTML report written to %s\n", html);
    }
    moetax_report_free(r);
    return rc;
}
