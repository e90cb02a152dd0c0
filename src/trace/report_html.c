/*
 * report_html.c - the report as one self-contained HTML5 page: inline CSS and
 * inline SVG, no scripts, no network. Charts: a headline, us per token by
 * layer stacked by phase (tax warm, useful work cool), one step's timeline,
 * the expert heat map (layers x experts) and per-worker busy/wait bars.
 * Hover titles (<title> in SVG) give exact values without JavaScript.
 */
#include "moetax/report.h"
#include "core/printable.h"

#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#define P MOETAX_PHASE_COUNT

/* tax phases warm, useful work cool; indexed by enum moetax_phase */
static const char *k_color[P] = {
    "#d62728", /* route    */
    "#ff7f0e", /* dispatch */
    "#8c564b", /* load     */
    "#e377c2", /* comm     */
    "#f2b701", /* wait     */
    "#b5452c", /* combine  */
    "#1f5fa8", /* expert   */
    "#5b9bd5", /* shared   */
    "#2a9d8f", /* attn     */
    "#66c2a5", /* dense    */
    "#a6cee3", /* norm     */
    "#3c5488", /* head     */
    "#7fb3a6", /* embd     */
    "#8172b2", /* sample   */
};

static const char *pname(int p) { return moetax_phase_name((enum moetax_phase)p); }

void moetax_report_html_text(FILE *f, const char *s) {
    for (; s && *s; s++) {
        switch (*s) {
        case '&': fputs("&amp;", f); break;
        case '<': fputs("&lt;", f); break;
        case '>': fputs("&gt;", f); break;
        case '"': fputs("&quot;", f); break;
        case '\'': fputs("&#39;", f); break;
        default:
            if (moetax_is_control((unsigned char)*s) && *s != '\n' && *s != '\t') fputc('?', f);
            else fputc(*s, f);
        }
    }
}

/* A "nice" tick step for an axis from 0 to max with about n ticks. */
static double nice_step(double max, int n) {
    if (!(max > 0)) return 1;
    double raw = max / n, mag = pow(10, floor(log10(raw))), r = raw / mag;
    return (r <= 1 ? 1 : r <= 2 ? 2 : r <= 5 ? 5 : 10) * mag;
}

static void fmt_num(char *buf, size_t n, double v) {
    if (v == 0) snprintf(buf, n, "0");
    else if (fabs(v) >= 100) snprintf(buf, n, "%.0f", v);
    else if (fabs(v) >= 10) snprintf(buf, n, "%.1f", v);
    else if (fabs(v) >= 1) snprintf(buf, n, "%.2f", v);
    else snprintf(buf, n, "%.3g", v);
}

/* x axis with ticks and a label, from x0 (value 0) to x0 + w (value max). */
static void x_axis(FILE *f, double x0, double y, double w, double max, const char *label) {
    double step = nice_step(max, 6);
    fprintf(f, "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" class=\"ax\"/>\n", x0, y, x0 + w, y);
    /* counted ticks: with a max near DBL_MAX, max * 1.0001 and v reach inf and a loop on v never ended */
    for (int i = 0; i <= 64 && max > 0 && isfinite(max) && isfinite(step); i++) {
        const double v = i * step;
        if (v > max * 1.0001) break;
        double x = x0 + w * (v / max);
        char t[32];
        fmt_num(t, sizeof t, v);
        fprintf(f, "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" class=\"ax\"/>"
                   "<text x=\"%.1f\" y=\"%.1f\" class=\"tick\" text-anchor=\"middle\">%s</text>\n",
                x, y, x, y + 4, x, y + 16, t);
    }
    fprintf(f, "<text x=\"%.1f\" y=\"%.1f\" class=\"axl\" text-anchor=\"middle\">", x0 + w / 2, y + 32);
    moetax_report_html_text(f, label);
    fputs("</text>\n", f);
}

static void legend(FILE *f, double x, double y, const bool *show) {
    double cx = x;
    for (int p = 0; p < P; p++) {
        if (!show[p]) continue;
        fprintf(f, "<rect x=\"%.1f\" y=\"%.1f\" width=\"12\" height=\"12\" fill=\"%s\"/>"
                   "<text x=\"%.1f\" y=\"%.1f\" class=\"tick\">%s%s</text>\n",
                cx, y, k_color[p], cx + 16, y + 10, pname(p), p < MOETAX_PHASE_N_TAX ? " (tax)" : "");
        cx += 16 + 7.0 * (double)(strlen(pname(p)) + (p < MOETAX_PHASE_N_TAX ? 6 : 0)) + 14;
    }
}

static void svg_open(FILE *f, double w, double h, const char *title) {
    fprintf(f, "<svg xmlns=\"http://www.w3.org/2000/svg\" viewBox=\"0 0 %.0f %.0f\" width=\"%.0f\" height=\"%.0f\" "
               "role=\"img\" aria-label=\"", w, h, w, h);
    moetax_report_html_text(f, title);
    fputs("\">\n<title>", f);
    moetax_report_html_text(f, title);
    fputs("</title>\n", f);
}

/* ---- charts ----------------------------------------------------------------------- */

static void chart_layers(FILE *f, const struct moetax_report *r, const struct moetax_report_agg *a) {
    const int n = r->n_layer + 1; /* layers, then the work outside the layers */
    const double W = 1100, left = 90, right = 30, cw = W - left - right;
    double rowh = n > 40 ? 12 : n > 20 ? 16 : 22, top = 40, H = top + n * rowh + 60;
    double tok = a->tokens > 0 ? 1e6 / (double)a->tokens : 0, max = 0;
    bool show[P] = {false};
    for (int i = 0; i < n; i++) {
        const double *row = i < r->n_layer ? a->layer_phase_s + (size_t)i * P : a->other_phase_s;
        double t = 0;
        for (int p = 0; p < P; p++) { t += row[p] * tok; if (row[p] > 0) show[p] = true; }
        if (t > max) max = t;
    }
    if (max <= 0) max = 1;
    svg_open(f, W, H, "Time per token by layer, split by phase");
    legend(f, left, 10, show);
    for (int i = 0; i < n; i++) {
        const double *row = i < r->n_layer ? a->layer_phase_s + (size_t)i * P : a->other_phase_s;
        double y = top + i * rowh, x = left;
        char lab[32];
        if (i < r->n_layer) snprintf(lab, sizeof lab, "layer %d%s", i, r->moe_layer[i] ? " (MoE)" : "");
        else snprintf(lab, sizeof lab, "outside");
        fprintf(f, "<text x=\"%.1f\" y=\"%.1f\" class=\"tick\" text-anchor=\"end\">%s</text>\n", left - 6,
                y + rowh * 0.7, lab);
        /* tax phases first (left), then useful work */
        for (int p = 0; p < P; p++) {
            double us = row[p] * tok, w = cw * us / max;
            if (w <= 0) continue;
            fprintf(f, "<rect x=\"%.2f\" y=\"%.1f\" width=\"%.2f\" height=\"%.1f\" fill=\"%s\"><title>%s, %s: %.2f us/token"
                       "</title></rect>\n", x, y + 1, w, rowh - 2, k_color[p], lab, pname(p), us);
            x += w;
        }
    }
    x_axis(f, left, top + n * rowh + 4, cw, max, "microseconds per token");
    fputs("</svg>\n", f);
}

/* Execution order inside a layer for the ledger timeline (the ledger has no timestamps). */
static const int k_order[] = {MOETAX_PHASE_EMBD, MOETAX_PHASE_NORM, MOETAX_PHASE_ATTN, MOETAX_PHASE_DENSE,
                              MOETAX_PHASE_ROUTE, MOETAX_PHASE_DISPATCH, MOETAX_PHASE_LOAD, MOETAX_PHASE_COMM,
                              MOETAX_PHASE_EXPERT, MOETAX_PHASE_SHARED, MOETAX_PHASE_COMBINE, MOETAX_PHASE_HEAD,
                              MOETAX_PHASE_SAMPLE, MOETAX_PHASE_WAIT};

static void chart_timeline_ledger(FILE *f, const struct moetax_report *r) {
    const struct moetax_report_timeline *t = &r->timeline;
    const int n = r->n_layer + 2; /* "embd" row, layers, "head" row */
    const double W = 1100, left = 90, right = 30, cw = W - left - right;
    double rowh = n > 40 ? 12 : n > 20 ? 16 : 22, top = 40, H = top + n * rowh + 60, total = 0;
    bool show[P] = {false};
    for (int p = 0; p < P; p++) {
        total += t->other_phase_s[p];
        show[p] |= t->other_phase_s[p] > 0;
        for (int l = 0; l < r->n_layer; l++) {
            total += t->layer_phase_s[(size_t)l * P + p];
            show[p] |= t->layer_phase_s[(size_t)l * P + p] > 0;
        }
    }
    double max_us = total > 0 ? 1e6 * total : 1, x_us = 0;
    svg_open(f, W, H, "Timeline of one step, phases per layer in order");
    legend(f, left, 10, show);
    for (int i = 0; i < n; i++) {
        char lab[32];
        double row[P] = {0};
        if (i == 0) { snprintf(lab, sizeof lab, "embed"); row[MOETAX_PHASE_EMBD] = t->other_phase_s[MOETAX_PHASE_EMBD]; }
        else if (i == n - 1) {
            snprintf(lab, sizeof lab, "output");
            memcpy(row, t->other_phase_s, sizeof row);
            row[MOETAX_PHASE_EMBD] = 0;
        } else {
            snprintf(lab, sizeof lab, "layer %d", i - 1);
            memcpy(row, t->layer_phase_s + (size_t)(i - 1) * P, sizeof row);
        }
        double y = top + i * rowh;
        fprintf(f, "<text x=\"%.1f\" y=\"%.1f\" class=\"tick\" text-anchor=\"end\">%s</text>\n", left - 6,
                y + rowh * 0.7, lab);
        for (size_t o = 0; o < sizeof k_order / sizeof k_order[0]; o++) {
            int p = k_order[o];
            double us = 1e6 * row[p];
            if (us <= 0) continue;
            fprintf(f, "<rect x=\"%.2f\" y=\"%.1f\" width=\"%.2f\" height=\"%.1f\" fill=\"%s\"><title>%s, %s: %.2f us"
                       " (starts at %.1f us)</title></rect>\n",
                    left + cw * x_us / max_us, y + 1, fmax(cw * us / max_us, 0.3), rowh - 2, k_color[p], lab, pname(p),
                    us, x_us);
            x_us += us;
        }
    }
    x_axis(f, left, top + n * rowh + 4, cw, max_us, "microseconds since the start of the step (phases summed over workers / workers)");
    fputs("</svg>\n", f);
}

static void chart_timeline_trace(FILE *f, const struct moetax_report *r) {
    const struct moetax_report_timeline *t = &r->timeline;
    const int n = r->n_workers;
    const double W = 1100, left = 90, right = 30, cw = W - left - right;
    double rowh = n > 32 ? 14 : 28, top = 40, H = top + n * rowh + 60, max = 0;
    bool show[P] = {false};
    for (int64_t i = 0; i < t->n_spans; i++) {
        double e = t->spans[i].t0_us + t->spans[i].dur_us;
        if (e > max) max = e;
        show[t->spans[i].phase] = true;
    }
    if (max <= 0) max = 1;
    svg_open(f, W, H, "Timeline of one step, spans per worker");
    legend(f, left, 10, show);
    for (int w = 0; w < n; w++)
        fprintf(f, "<text x=\"%.1f\" y=\"%.1f\" class=\"tick\" text-anchor=\"end\">worker %d</text>\n"
                   "<rect x=\"%.1f\" y=\"%.1f\" width=\"%.1f\" height=\"%.1f\" class=\"lane\"/>\n",
                left - 6, top + w * rowh + rowh * 0.6, w, left, top + w * rowh + 1, cw, rowh - 2);
    for (int64_t i = 0; i < t->n_spans; i++) {
        const struct moetax_report_span *s = &t->spans[i];
        fprintf(f, "<rect x=\"%.2f\" y=\"%.1f\" width=\"%.2f\" height=\"%.1f\" fill=\"%s\"><title>worker %d, layer %d, %s:"
                   " %.2f us at %.2f us</title></rect>\n",
                left + cw * s->t0_us / max, top + s->worker * rowh + 2, fmax(cw * s->dur_us / max, 0.3), rowh - 4,
                k_color[s->phase], s->worker, s->layer, pname(s->phase), s->dur_us, s->t0_us);
    }
    x_axis(f, left, top + n * rowh + 4, cw, max, "microseconds since the start of the step");
    fputs("</svg>\n", f);
}

static void heat_color(double t, char *buf, size_t n) {
    /* white-ish (#f7fbff) to dark blue (#08306b) */
    if (t < 0) t = 0;
    if (t > 1) t = 1;
    int rr = (int)(247 + (8 - 247) * t), gg = (int)(251 + (48 - 251) * t), bb = (int)(255 + (107 - 255) * t);
    snprintf(buf, n, "#%02x%02x%02x", rr, gg, bb);
}

static void chart_heatmap(FILE *f, const struct moetax_report_routing *R) {
    const int E = R->n_expert, n = R->n_layers;
    const double left = 90, top = 30;
    double cellw = E > 0 ? fmin(40, fmax(2, 960.0 / E)) : 10, cellh = n > 30 ? 10 : 22;
    double W = left + cellw * E + 140, H = top + cellh * n + 60;
    if (W < 600) W = 600;
    int64_t max = 1;
    for (int i = 0; i < n; i++)
        for (int e = 0; e < E; e++)
            if (R->layers[i].load[e] > max) max = R->layers[i].load[e];
    svg_open(f, W, H, "Expert heat map: tokens routed per expert and layer");
    fprintf(f, "<text x=\"%.1f\" y=\"18\" class=\"tick\">rows: MoE layers; columns: experts; darker = more tokens "
               "(hover a cell for its count)</text>\n", left);
    for (int i = 0; i < n; i++) {
        const struct moetax_report_routing_layer *L = &R->layers[i];
        double y = top + i * cellh;
        fprintf(f, "<text x=\"%.1f\" y=\"%.1f\" class=\"tick\" text-anchor=\"end\">layer %d</text>\n", left - 6,
                y + cellh * 0.7, L->layer);
        for (int e = 0; e < E; e++) {
            char c[16];
            heat_color((double)L->load[e] / (double)max, c, sizeof c);
            fprintf(f, "<rect x=\"%.2f\" y=\"%.1f\" width=\"%.2f\" height=\"%.1f\" fill=\"%s\"><title>layer %d, expert %d:"
                       " %lld tokens</title></rect>\n",
                    left + e * cellw, y, cellw, cellh, c, L->layer, e, (long long)L->load[e]);
        }
    }
    double ya = top + n * cellh;
    int step = E <= 16 ? 1 : E <= 64 ? 8 : E <= 128 ? 16 : 32;
    for (int e = 0; e < E; e += step)
        fprintf(f, "<text x=\"%.1f\" y=\"%.1f\" class=\"tick\" text-anchor=\"middle\">%d</text>\n",
                left + (e + 0.5) * cellw, ya + 14, e);
    fprintf(f, "<text x=\"%.1f\" y=\"%.1f\" class=\"axl\" text-anchor=\"middle\">expert</text>\n",
            left + cellw * E / 2, ya + 34);
    /* color scale */
    double lx = left + cellw * E + 20;
    fputs("<defs><linearGradient id=\"heat\" x1=\"0\" y1=\"1\" x2=\"0\" y2=\"0\">"
          "<stop offset=\"0\" stop-color=\"#f7fbff\"/><stop offset=\"1\" stop-color=\"#08306b\"/></linearGradient></defs>\n", f);
    double gh = fmax(40, cellh * n);
    fprintf(f, "<rect x=\"%.1f\" y=\"%.1f\" width=\"14\" height=\"%.1f\" fill=\"url(#heat)\" stroke=\"#888\"/>\n", lx, top, gh);
    fprintf(f, "<text x=\"%.1f\" y=\"%.1f\" class=\"tick\">%lld tokens</text>\n", lx + 18, top + 10, (long long)max);
    fprintf(f, "<text x=\"%.1f\" y=\"%.1f\" class=\"tick\">0</text>\n", lx + 18, top + gh);
    fputs("</svg>\n", f);
}

static void chart_workers(FILE *f, const struct moetax_report *r, const struct moetax_report_agg *a) {
    const int n = r->n_workers;
    const double W = 1100, left = 90, right = 130, cw = W - left - right;
    double rowh = n > 32 ? 14 : 24, top = 40, H = top + n * rowh + 60, max = 0;
    for (int w = 0; w < n; w++) max = fmax(max, 1e3 * (a->worker_busy_s[w] + a->worker_wait_s[w]));
    if (max <= 0) max = 1;
    svg_open(f, W, H, "Per-worker busy and wait time");
    bool show[P] = {false};
    show[MOETAX_PHASE_WAIT] = true;
    fprintf(f, "<rect x=\"%.1f\" y=\"10\" width=\"12\" height=\"12\" fill=\"#1f5fa8\"/><text x=\"%.1f\" y=\"20\" "
               "class=\"tick\">busy (all phases but wait)</text>\n", left, left + 16);
    legend(f, left + 200, 10, show);
    for (int w = 0; w < n; w++) {
        double b = 1e3 * a->worker_busy_s[w], wt = 1e3 * a->worker_wait_s[w], y = top + w * rowh;
        fprintf(f, "<text x=\"%.1f\" y=\"%.1f\" class=\"tick\" text-anchor=\"end\">worker %d</text>\n", left - 6,
                y + rowh * 0.7, w);
        fprintf(f, "<rect x=\"%.2f\" y=\"%.1f\" width=\"%.2f\" height=\"%.1f\" fill=\"#1f5fa8\"><title>worker %d busy: %.3f ms"
                   "</title></rect>\n", left, y + 2, cw * b / max, rowh - 4, w, b);
        fprintf(f, "<rect x=\"%.2f\" y=\"%.1f\" width=\"%.2f\" height=\"%.1f\" fill=\"%s\"><title>worker %d wait: %.3f ms"
                   "</title></rect>\n", left + cw * b / max, y + 2, cw * wt / max, rowh - 4, k_color[MOETAX_PHASE_WAIT], w, wt);
        fprintf(f, "<text x=\"%.2f\" y=\"%.1f\" class=\"tick\">wait %.1f%%</text>\n", left + cw * (b + wt) / max + 6,
                y + rowh * 0.7, b + wt > 0 ? 100 * wt / (b + wt) : 0);
    }
    x_axis(f, left, top + n * rowh + 4, cw, max, "milliseconds (whole run)");
    fputs("</svg>\n", f);
}

/* ---- page ------------------------------------------------------------------------- */

/* The batch tax against batch size: a table and, per batch size, bars of tokens/s and of the
 * distinct experts read per MoE layer and step. */
static void batch_section(FILE *f, const struct moetax_report *r) {
    bool any = false;
    double max_tps = 0, max_exp = 0;
    for (int i = 0; i < r->n_batches; i++) {
        const struct moetax_report_batch *b = &r->batches[i];
        any |= b->batch > 1; /* one sequence: no batch axis to show */
        if (b->wall_s > 0) max_tps = fmax(max_tps, (double)b->tokens / b->wall_s);
        if (b->moe_layers > 0) max_exp = fmax(max_exp, (double)b->experts / (double)b->moe_layers);
    }
    if (!any) return;
    fputs("<h2>Batch</h2>\n<p class=\"note\">Decode steps by the number of sequences decoded together. A step reads "
          "each expert once for all its tokens, but waits for its most loaded expert (imbalance: most assignments on "
          "one expert / mean per used expert), and more sequences touch more distinct experts.</p>\n"
          "<table><tr><th>B</th><th>steps</th><th>tokens/s</th><th>step ms</th><th>experts per layer</th>"
          "<th>expert MiB/token</th><th>imbalance</th><th>wait</th><th>tax</th><th>dropped</th></tr>\n", f);
    for (int i = 0; i < r->n_batches; i++) {
        const struct moetax_report_batch *b = &r->batches[i];
        const double L = b->moe_layers > 0 ? (double)b->moe_layers : NAN, n_asg = (double)(b->assignments + b->dropped);
        fprintf(f, "<tr><td>%lld</td><td>%lld</td><td>%.1f</td><td>%.3f</td><td>%.1f</td><td>%.2f</td><td>%.2f</td>"
                   "<td>%.1f%%</td><td>%.1f%%</td><td>%.2f%%</td></tr>\n",
                (long long)b->batch, (long long)b->steps, b->wall_s > 0 ? (double)b->tokens / b->wall_s : 0,
                b->steps ? 1e3 * b->wall_s / (double)b->steps : 0, (double)b->experts / L,
                b->tokens ? b->expert_bytes / 1048576.0 / (double)b->tokens : 0, b->imbalance_sum / L,
                b->phase_s > 0 ? 100 * b->wait_s / b->phase_s : 0, b->phase_s > 0 ? 100 * b->tax_s / b->phase_s : 0,
                n_asg > 0 ? 100 * (double)b->dropped / n_asg : 0);
    }
    fputs("</table>\n", f);
    const double W = 1100, left = 90, cw = (W - left - 40) / 2 - 20, rowh = 22, top = 30;
    const double H = top + r->n_batches * rowh + 50;
    svg_open(f, W, H, "Tokens per second and distinct experts per layer, by batch size");
    fprintf(f, "<text x=\"%.1f\" y=\"18\" class=\"tick\">tokens/s (all sequences)</text>\n", left);
    fprintf(f, "<text x=\"%.1f\" y=\"18\" class=\"tick\">distinct experts read per MoE layer and step</text>\n",
            left + cw + 40);
    for (int i = 0; i < r->n_batches; i++) {
        const struct moetax_report_batch *b = &r->batches[i];
        const double y = top + i * rowh, tps = b->wall_s > 0 ? (double)b->tokens / b->wall_s : 0;
        const double ex = b->moe_layers > 0 ? (double)b->experts / (double)b->moe_layers : 0;
        fprintf(f, "<text x=\"%.1f\" y=\"%.1f\" class=\"tick\" text-anchor=\"end\">B = %lld</text>\n", left - 6,
                y + rowh * 0.7, (long long)b->batch);
        fprintf(f, "<rect x=\"%.1f\" y=\"%.1f\" width=\"%.2f\" height=\"%.1f\" fill=\"%s\"><title>B = %lld: %.1f "
                   "tokens/s</title></rect>\n", left, y + 1, max_tps > 0 ? cw * tps / max_tps : 0, rowh - 2,
                k_color[MOETAX_PHASE_EXPERT], (long long)b->batch, tps);
        fprintf(f, "<rect x=\"%.1f\" y=\"%.1f\" width=\"%.2f\" height=\"%.1f\" fill=\"%s\"><title>B = %lld: %.1f "
                   "experts per layer</title></rect>\n", left + cw + 40, y + 1, max_exp > 0 ? cw * ex / max_exp : 0,
                rowh - 2, k_color[MOETAX_PHASE_DISPATCH], (long long)b->batch, ex);
    }
    x_axis(f, left, top + r->n_batches * rowh + 4, cw, max_tps > 0 ? max_tps : 1, "tokens/s");
    x_axis(f, left + cw + 40, top + r->n_batches * rowh + 4, cw, max_exp > 0 ? max_exp : 1, "experts");
    fputs("</svg>\n", f);
}

static void card(FILE *f, const char *label, const char *value, const char *note) {
    fputs("<div class=\"card\"><div class=\"lab\">", f);
    moetax_report_html_text(f, label);
    fputs("</div><div class=\"val\">", f);
    moetax_report_html_text(f, value);
    fputs("</div><div class=\"note\">", f);
    moetax_report_html_text(f, note);
    fputs("</div></div>\n", f);
}

static void step_row(FILE *f, const char *label, const struct moetax_report_agg *a) {
    fprintf(f, "<tr><td>%s</td><td>%lld</td><td>%lld</td><td>%.2f</td><td>%.3f</td><td>%.1f</td><td>%.1f%%</td></tr>\n",
            label, (long long)a->steps, (long long)a->tokens, 1e3 * a->wall_s,
            a->tokens ? 1e3 * a->wall_s / (double)a->tokens : 0, a->wall_s > 0 ? (double)a->tokens / a->wall_s : 0,
            100 * moetax_report_tax_share(a));
}

static void pct_or_dash(FILE *f, double v) {
    if (isnan(v)) fputs("<td>-</td>", f);
    else fprintf(f, "<td>%.1f%%</td>", 100 * v);
}

moetax_status moetax_report_write_html(const struct moetax_report *r, FILE *f) {
    const struct moetax_report_agg *a = moetax_report_sel(r);
    const char *scope = r->decode_only ? "decode steps" : "all steps";
    double share = moetax_report_tax_share(a), total = moetax_report_phase_total(a);
    fputs("<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n"
          "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\n<title>moetax report: ", f);
    moetax_report_html_text(f, r->path);
    fputs("</title>\n<style>\n"
          "body{font-family:system-ui,-apple-system,'Segoe UI',Helvetica,Arial,sans-serif;margin:24px auto;max-width:1160px;"
          "color:#222;background:#fff;padding:0 16px}\n"
          "h1{font-size:24px;margin:0 0 4px}h2{font-size:18px;margin:28px 0 6px;border-bottom:1px solid #ddd;padding-bottom:4px}\n"
          ".sub{color:#666;font-size:13px;margin-bottom:16px}\n"
          ".cards{display:flex;flex-wrap:wrap;gap:12px;margin:12px 0}\n"
          ".card{border:1px solid #ddd;border-radius:6px;padding:10px 16px;min-width:150px}\n"
          ".card .lab{font-size:12px;color:#666;text-transform:uppercase;letter-spacing:.04em}\n"
          ".card .val{font-size:28px;font-weight:600}.card .note{font-size:12px;color:#888}\n"
          ".tax{color:#c0392b}.ok{color:#1f5fa8}\n"
          "table{border-collapse:collapse;font-size:13px;margin:8px 0}td,th{padding:3px 10px;text-align:right;"
          "border-bottom:1px solid #eee}th{background:#f6f6f6}td:first-child,th:first-child{text-align:left}\n"
          "svg{display:block;max-width:100%;height:auto;margin:6px 0}\n"
          "svg .tick{font-size:11px;fill:#333}svg .axl{font-size:12px;fill:#222}svg .ax{stroke:#888;stroke-width:1;fill:none}\n"
          "svg .lane{fill:#f4f4f4}\n"
          "p.note{font-size:13px;color:#555;margin:4px 0}ul.verdict{font-size:14px}\n"
          "</style>\n</head>\n<body>\n<h1>moetax report</h1>\n<div class=\"sub\">", f);
    moetax_report_html_text(f, r->path);
    fprintf(f, " &middot; %s", r->source == MOETAX_REPORT_SOURCE_LEDGER ? "ledger" : "Chrome trace");
    if (r->model[0]) { fputs(" &middot; model ", f); moetax_report_html_text(f, r->model); }
    fprintf(f, " &middot; %d workers &middot; %d layers", r->n_workers, r->n_layer);
    if (r->n_expert) fprintf(f, " &middot; %d experts, %d used per token", r->n_expert, r->n_expert_used);
    fprintf(f, " &middot; breakdowns over %s</div>\n", scope);

    /* headline */
    char v[64], note[128];
    fputs("<div class=\"cards\">\n", f);
    snprintf(v, sizeof v, "%.1f%%", 100 * share);
    card(f, "tax share", v, "route+dispatch+load+comm+wait+combine");
    snprintf(v, sizeof v, "%.1f", 100 * (1 - share));
    card(f, "efficiency", v, "100 x (1 - tax share)");
    const struct moetax_report_agg *tp = r->decode.steps ? &r->decode : &r->all;
    snprintf(v, sizeof v, "%.1f", tp->wall_s > 0 ? (double)tp->tokens / tp->wall_s : 0);
    snprintf(note, sizeof note, "%s, %.2f ms per token", r->decode.steps ? "decode" : "all steps",
             tp->tokens ? 1e3 * tp->wall_s / (double)tp->tokens : 0);
    card(f, "tokens/s", v, note);
    if (r->prefill.steps) {
        snprintf(v, sizeof v, "%.1f", r->prefill.wall_s > 0 ? (double)r->prefill.tokens / r->prefill.wall_s : 0);
        snprintf(note, sizeof note, "prefill, %lld tokens", (long long)r->prefill.tokens);
        card(f, "prefill tokens/s", v, note);
    }
    fputs("</div>\n", f);
    if (r->dropped_spans) fprintf(f, "<p class=\"note\">The trace ring dropped %lld spans; the oldest steps are incomplete.</p>\n",
                                  (long long)r->dropped_spans);
    if (r->source == MOETAX_REPORT_SOURCE_TRACE)
        fputs("<p class=\"note\">Rebuilt from trace spans: steps with more than one token count as prefill; sampling "
              "time is not in a trace.</p>\n", f);

    fputs("<h2>Steps</h2>\n<table><tr><th>steps</th><th>count</th><th>tokens</th><th>wall (ms)</th><th>ms/token</th>"
          "<th>tokens/s</th><th>tax share</th></tr>\n", f);
    step_row(f, "all", &r->all);
    step_row(f, "prefill", &r->prefill);
    step_row(f, "decode", &r->decode);
    fputs("</table>\n", f);

    fprintf(f, "<h2>Phases</h2>\n<table><tr><th>phase</th><th>kind</th><th>seconds</th><th>us/token</th><th>share</th></tr>\n");
    for (int p = 0; p < P; p++) {
        if (a->phase_s[p] == 0) continue;
        fprintf(f, "<tr><td><span style=\"color:%s\">&#9632;</span> %s</td><td class=\"%s\">%s</td><td>%.6f</td>"
                   "<td>%.1f</td><td>%.1f%%</td></tr>\n",
                k_color[p], pname(p), p < MOETAX_PHASE_N_TAX ? "tax" : "ok", p < MOETAX_PHASE_N_TAX ? "tax" : "work",
                a->phase_s[p], a->tokens ? 1e6 * a->phase_s[p] / (double)a->tokens : 0,
                total > 0 ? 100 * a->phase_s[p] / total : 0);
    }
    fprintf(f, "<tr><th>total</th><th></th><th>%.6f</th><th>%.1f</th><th>100%%</th></tr>\n</table>\n", total,
            a->tokens ? 1e6 * total / (double)a->tokens : 0);

    fputs("<h2>Time per token by layer</h2>\n<p class=\"note\">Microseconds per token of each layer, split by phase "
          "(averaged over workers): tax phases in warm colors, useful work in cool colors.</p>\n", f);
    chart_layers(f, r, a);

    if (r->timeline.valid) {
        fprintf(f, "<h2>Timeline of one step</h2>\n<p class=\"note\">Step %lld (%s, %lld token%s, %.3f ms wall), the slowest "
                   "%s step. ",
                (long long)r->timeline.step, r->timeline.prefill ? "prefill" : "decode", (long long)r->timeline.tokens,
                r->timeline.tokens == 1 ? "" : "s", 1e3 * r->timeline.wall_s, r->timeline.prefill ? "" : "decode");
        if (r->timeline.spans)
            fputs("Real spans per worker lane from the trace.</p>\n", f);
        else
            fputs("The ledger keeps phase seconds per layer but no timestamps, so each layer's phases are drawn in "
                  "execution order, one row per layer, one after the other.</p>\n", f);
        if (r->timeline.spans) chart_timeline_trace(f, r);
        else chart_timeline_ledger(f, r);
    }

    if (r->routing) {
        const struct moetax_report_routing *R = r->routing;
        fprintf(f, "<h2>Expert heat map</h2>\n<p class=\"note\">Tokens routed to each expert over the last %lld tokens "
                   "(top-%d of %d).</p>\n", (long long)R->tokens, R->k, R->n_expert);
        chart_heatmap(f, R);
        fputs("<h2>Routing statistics</h2>\n<table><tr><th>layer</th><th>tokens</th><th>load min / mean / max</th>"
              "<th>CV</th><th>busiest quarter</th><th>batch max/mean</th><th>adjacent overlap</th><th>precision</th>"
              "<th>recall</th></tr>\n", f);
        for (int i = 0; i < R->n_layers; i++) {
            const struct moetax_report_routing_layer *L = &R->layers[i];
            fprintf(f, "<tr><td>%d</td><td>%lld</td><td>%.0f / %.2f / %.0f</td><td>%.2f</td>", L->layer,
                    (long long)L->tokens, L->load_min, L->load_mean, L->load_max, L->load_cv);
            pct_or_dash(f, L->top_quarter_share);
            if (isnan(L->batch_imbalance)) fputs("<td>-</td>", f);
            else fprintf(f, "<td>%.2f</td>", L->batch_imbalance);
            pct_or_dash(f, L->overlap);
            pct_or_dash(f, L->precision);
            pct_or_dash(f, L->recall);
            fputs("</tr>\n", f);
        }
        fputs("</table>\n<ul class=\"verdict\">\n", f);
        double chance = (double)R->k / R->n_expert, uq = (double)((R->n_expert + 3) / 4) / R->n_expert;
        if (!isnan(R->top_quarter_share))
            fprintf(f, "<li>Caching: the busiest quarter of the experts takes %.0f%% of routings (uniform %.0f%%; load CV "
                       "%.2f, sampling noise alone %.2f): %s.</li>\n",
                    100 * R->top_quarter_share, 100 * uq, R->load_cv, R->load_cv_chance,
                    !(R->load_cv > 1.5 * R->load_cv_chance) ? "the skew is within sampling noise, record more tokens"
                    : R->top_quarter_share > 1.5 * uq       ? "load is skewed, a frequency-aware cache pays off"
                                                            : "load is near uniform, a cache pays only if most experts fit");
        if (!isnan(R->overlap))
            fprintf(f, "<li>Reuse: adjacent tokens share %.0f%% of their experts (chance %.0f%%): %s.</li>\n",
                    100 * R->overlap, 100 * chance,
                    R->overlap > chance + 0.15 ? "keeping the previous token's experts resident pays off"
                    : R->overlap > chance     ? "recent-token caching helps a little"
                                              : "no temporal locality");
        if (!isnan(R->precision)) {
            double base = fmax(chance, isnan(R->overlap) ? 0 : R->overlap);
            fprintf(f, "<li>Prefetch: next-layer prediction precision %.0f%%, recall %.0f%% (previous-token baseline %.0f%%): %s.</li>\n",
                    100 * R->precision, 100 * R->recall, 100 * base,
                    R->precision > base + 0.1 ? "prefetching from the prediction pays off"
                    : R->precision > base     ? "prefetching helps a little over reuse"
                                              : "prediction is no better than reuse");
        }
        if (!isnan(R->batch_imbalance))
            fprintf(f, "<li>Batches: the busiest expert of a batch gets %.2fx the mean load: %s.</li>\n",
                    R->batch_imbalance,
                    R->batch_imbalance > 2 ? "split hot experts' rows across threads or replicate them"
                                           : "balanced enough");
        fputs("</ul>\n", f);
    } else {
        fputs("<h2>Expert heat map</h2>\n<p class=\"note\">No routing recorded (run with --routing-stats and report the "
              "ledger).</p>\n", f);
    }

    fprintf(f, "<h2>Per-worker wait</h2>\n<p class=\"note\">Busy and wait time of each worker over %s.</p>\n", scope);
    chart_workers(f, r, a);
    batch_section(f, r);
    if (r->store) {
        const struct moetax_report_store *st = r->store;
        double tok = st->tokens > 0 ? (double)st->tokens : 0;
        fprintf(f, "<h2>Expert store</h2>\n<table><tr><th>slots</th><th>budget MiB</th><th>hit rate</th><th>experts read</th>"
                   "<th>MiB read</th><th>read GB/s</th><th>stall ms/token</th><th>prefetch precision</th><th>I/O</th></tr>\n");
        fprintf(f, "<tr><td>%d</td><td>%.1f</td><td>%.1f%%</td><td>%.0f</td><td>%.1f</td><td>%.2f</td><td>%s%.2f</td>"
                   "<td>%.1f%%</td><td>%s</td></tr></table>\n",
                st->n_slots, st->budget_bytes / 1048576.0, st->acquires > 0 ? 100 * st->hits / st->acquires : 0, st->loads,
                st->bytes_read / 1048576.0, st->read_gbps, tok > 0 ? "" : "~", tok > 0 ? 1e3 * st->stall_s / tok : 0,
                st->predicted_issued > 0 ? 100 * st->predicted_used / st->predicted_issued : 0,
                st->direct_io ? "O_DIRECT" : "buffered");
    }
    if (r->io && r->io->wall_s > 0) {
        const struct moetax_report_io *io = r->io;
        fprintf(f, "<h2>Expert store reads on the timeline</h2>\n<p class=\"note\">From the trace's I/O tracks, over the steps' "
                   "wall time. The disk's idle share is the most that earlier reads (prefetch) could fill.</p>\n"
                   "<table><tr><th>demand reads</th><th>known reads</th><th>predicted reads</th><th>MiB</th>"
                   "<th>median read ms</th><th>read in flight</th><th>mean in flight</th><th>workers stalled</th></tr>\n");
        fprintf(f, "<tr><td>%lld</td><td>%lld</td><td>%lld</td><td>%.1f</td><td>%.2f</td><td>%.0f%%</td><td>%.1f</td>"
                   "<td>%.0f%%</td></tr></table>\n",
                (long long)io->reads[0], (long long)io->reads[1], (long long)io->reads[2], io->bytes / 1048576.0,
                io->median_read_ms, 100 * io->busy_s / io->wall_s, io->busy_s > 0 ? io->inflight_s / io->busy_s : 0,
                100 * io->stall_s / io->wall_s);
    }
    if (r->n_ranks > 0) {
        fprintf(f, "<h2>Ranks</h2>\n<p class=\"note\">mpirun -np %d: each rank's own ledger over %s. comm: time in "
                   "transfers; wait: time waiting for the other ranks.</p>\n<table><tr><th>rank</th><th>wall ms</th>"
                   "<th>tax</th><th>comm ms</th><th>wait ms</th><th>expert ms</th><th>MB sent</th><th>MB received</th>"
                   "</tr>\n", r->n_ranks, scope);
        for (int i = 0; i < r->n_ranks; i++) {
            const struct moetax_report_rank *k = &r->ranks[i];
            const struct moetax_report_agg *ka = moetax_report_sel(k->r);
            fprintf(f, "<tr><td>%d</td><td>%.2f</td><td>%.1f%%</td><td>%.2f</td><td>%.2f</td><td>%.2f</td>", k->rank,
                    1e3 * ka->wall_s, 100 * moetax_report_tax_share(ka), 1e3 * ka->phase_s[MOETAX_PHASE_COMM],
                    1e3 * ka->phase_s[MOETAX_PHASE_WAIT], 1e3 * ka->phase_s[MOETAX_PHASE_EXPERT]);
            if (k->has_dist) fprintf(f, "<td>%.3f</td><td>%.3f</td></tr>\n", 1e-6 * k->bytes_sent, 1e-6 * k->bytes_recv);
            else fputs("<td>-</td><td>-</td></tr>\n", f);
        }
        fputs("</table>\n", f);
        if (r->n_rank_layers > 0) {
            fputs("<table><tr><th>MoE layer</th><th>slowest rank</th><th>its work ms</th><th>mean ms</th>"
                  "<th>comm + wait ms per rank</th><th>MB sent, all ranks (run)</th></tr>\n", f);
            for (int i = 0; i < r->n_rank_layers; i++) {
                const struct moetax_report_rank_layer *x = &r->rank_layers[i];
                fprintf(f, "<tr><td>%d</td><td>%d</td><td>%.3f</td><td>%.3f</td><td>%.3f</td>", x->layer,
                        x->slowest, 1e3 * x->busy_max_s, 1e3 * x->busy_mean_s, 1e3 * x->comm_wait_mean_s);
                if (x->has_bytes) fprintf(f, "<td>%.3f</td></tr>\n", 1e-6 * x->bytes_sent);
                else fputs("<td>-</td></tr>\n", f);
            }
            fputs("</table>\n", f);
        }
    }
    fputs("<p class=\"note\">Generated by moetax report.</p>\n</body>\n</html>\n", f);
    const int e = fflush(f) ? errno : 0; /* the failed write again, with its reason */
    return e || ferror(f) ? moetax_error(MOETAX_ERR_IO, "writing the HTML page failed%s%s", e ? ": " : "",
                                         e ? strerror(e) : "")
                          : MOETAX_OK;
}
