/* report_profile.c - `moetax report PROFILE`: a routing profile (moetax profile) as
 * text, JSON or an HTML page of heat maps: layer x expert frequencies and, per pair of
 * consecutive MoE layers, expert-to-expert transitions. The figures that say whether
 * caching and prefetching can pay: the busiest quarter's share of each layer's
 * routings (a static cache's ceiling), and how much of the next layer's routings the k
 * most frequent successors of each expert cover (a transition table's ceiling as a
 * predictor). */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <jansson.h>

#include "cli.h"
#include "report_profile.h"
#include "moetax/outfile.h"
#include "moetax/report.h"

static int cmp_desc(const void *a, const void *b) {
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x < y) - (x > y);
}

/* Share of layer m's routings that go to its busiest ceil(E/4) experts. */
static double top_quarter(const struct moetax_profile *p, int m) {
    const int64_t E = p->n_expert, q = (E + 3) / 4;
    int64_t *v = malloc(sizeof(int64_t) * (size_t)E), tot = 0, top = 0;
    if (!v) return NAN;
    memcpy(v, p->freq + m * E, sizeof(int64_t) * (size_t)E);
    qsort(v, (size_t)E, sizeof *v, cmp_desc);
    for (int64_t e = 0; e < E; e++) tot += v[e], top += e < q ? v[e] : 0;
    free(v);
    return tot ? (double)top / (double)tot : NAN;
}

/* Of the next layer's routings of tokens that chose expert i at layer m, the share the k most
 * frequent successors of i cover, weighted over i: a transition table's ceiling as a predictor. */
static double successor_coverage(const struct moetax_profile *p, int m) {
    const int64_t E = p->n_expert, k = p->n_expert_used;
    int64_t *row = malloc(sizeof(int64_t) * (size_t)E), all = 0, hit = 0;
    if (!row) return NAN;
    for (int64_t i = 0; i < E; i++) {
        memcpy(row, p->trans + (m * E + i) * E, sizeof(int64_t) * (size_t)E);
        qsort(row, (size_t)E, sizeof *row, cmp_desc);
        for (int64_t j = 0; j < E; j++) all += row[j], hit += j < k ? row[j] : 0;
    }
    free(row);
    return all ? (double)hit / (double)all : NAN;
}

static void heat(FILE *f, const int64_t *v, int rows, int cols, double x0, double y0, double cw, double ch,
                 const char *const *row_labels, const char *what) {
    int64_t mx = 1;
    for (int64_t i = 0; i < (int64_t)rows * cols; i++) mx = v[i] > mx ? v[i] : mx;
    const int every = ch >= 11 ? 1 : (int)ceil(11.0 / ch); /* labels that do not overlap */
    for (int r = 0; r < rows; r++) {
        if (row_labels && r % every == 0)
            fprintf(f, "<text x=\"%.1f\" y=\"%.1f\" class=\"tick\" text-anchor=\"end\">%s</text>\n", x0 - 4,
                    y0 + r * ch + ch * 0.75, row_labels[r]);
        for (int c = 0; c < cols; c++) {
            const double t = sqrt((double)v[(int64_t)r * cols + c] / (double)mx); /* sqrt: low counts stay visible */
            const int g = (int)(255 - 200 * t), b = (int)(255 - 120 * t);
            fprintf(f, "<rect x=\"%.2f\" y=\"%.2f\" width=\"%.2f\" height=\"%.2f\" fill=\"rgb(%d,%d,%d)\"><title>%s %d, "
                       "expert %d: %lld</title></rect>\n", x0 + c * cw, y0 + r * ch, cw, ch, g, g, b, what, r, c,
                    (long long)v[(int64_t)r * cols + c]);
        }
    }
}

static moetax_status write_html(const struct moetax_profile *p, const char *path, FILE *f) {
    const int E = p->n_expert;
    fputs("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>moetax routing profile</title>\n"
          "<style>body{font-family:sans-serif;margin:24px;color:#222}.tick{font-size:10px;fill:#444}"
          "table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:3px 8px;font-size:13px}"
          ".note{color:#555;font-size:13px}</style></head><body>\n<h1>Routing profile</h1>\n", f);
    fputs("<p class=\"note\">", f);
    moetax_report_html_text(f, p->model);
    fprintf(f, ": %lld tokens, %d MoE layers, %d experts, %d used per token.</p>\n", (long long)p->tokens, p->n_moe, E,
            p->n_expert_used);
    fputs("<h2>Experts by layer</h2>\n<p class=\"note\">Routings of each expert (darker: more; square-root "
          "scale). A column that stays dark is an expert worth keeping resident.</p>\n", f);
    const double cw = E > 128 ? 3 : E > 64 ? 6 : 12, ch = 14, x0 = 70, y0 = 10;
    const double W = x0 + E * cw + 20, H = y0 + p->n_moe * ch + 20;
    char (*labels)[24] = malloc(sizeof *labels * (size_t)(p->n_moe > E ? p->n_moe : E));
    const char **lp = malloc(sizeof *lp * (size_t)(p->n_moe > E ? p->n_moe : E));
    if (!labels || !lp) { free(labels); free(lp); return moetax_error(MOETAX_ERR_NOMEM, "out of memory"); }
    for (int m = 0; m < p->n_moe; m++) snprintf(labels[m], sizeof labels[m], "layer %d", p->moe_layer[m]), lp[m] = labels[m];
    fprintf(f, "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%.0f\" height=\"%.0f\" role=\"img\" "
               "aria-label=\"experts by layer\">\n<title>Experts by layer</title>\n", W, H);
    heat(f, p->freq, p->n_moe, E, x0, y0, cw, ch, lp, "layer row");
    fputs("</svg>\n<table><tr><th>layer</th><th>busiest quarter's share</th><th>successor coverage</th></tr>\n", f);
    for (int m = 0; m < p->n_moe; m++) {
        fprintf(f, "<tr><td>%d</td><td>%.1f%%</td><td>", p->moe_layer[m], 100 * top_quarter(p, m));
        if (m + 1 < p->n_moe) fprintf(f, "%.1f%%", 100 * successor_coverage(p, m));
        else fputs("-", f);
        fputs("</td></tr>\n", f);
    }
    fputs("</table>\n<h2>Transitions</h2>\n<p class=\"note\">Row: an expert at the first layer; column: an expert at "
          "the next MoE layer; darker: more tokens took both.</p>\n", f);
    for (int e = 0; e < E; e++) snprintf(labels[e], sizeof labels[e], "%d", e), lp[e] = labels[e];
    const double tc = E > 64 ? 3 : 8, W2 = 40 + E * tc + 10, H2 = 30 + E * tc + 10;
    for (int m = 0; m + 1 < p->n_moe && m < 8; m++) {
        fprintf(f, "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%.0f\" height=\"%.0f\" role=\"img\" "
                   "aria-label=\"transitions\">\n<title>Layer %d to layer %d</title>\n<text x=\"40\" y=\"18\" "
                   "class=\"tick\">layer %d to layer %d</text>\n", W2, H2, p->moe_layer[m], p->moe_layer[m + 1],
                p->moe_layer[m], p->moe_layer[m + 1]);
        heat(f, p->trans + (int64_t)m * E * E, E, E, 40, 26, tc, tc, E <= 64 ? lp : NULL, "expert");
        fputs("</svg>\n", f);
    }
    fputs("<p class=\"note\">Generated by moetax report.</p>\n</body></html>\n", f);
    free(labels);
    free(lp);
    (void)path;
    const int e = fflush(f) ? errno : 0; /* the failed write again, with its reason */
    return e || ferror(f) ? moetax_error(MOETAX_ERR_IO, "writing the HTML page failed%s%s", e ? ": " : "",
                                         e ? strerror(e) : "")
                          : MOETAX_OK;
}

int report_profile(const char *path, const json_t *doc, bool json, const char *html) {
    struct moetax_profile *p;
    moetax_status st = moetax_profile_from_json(doc, path, &p);
    if (st) return cli_fail("report", st);
    if (html) {
        struct moetax_outfile *of;
        if (!(st = moetax_outfile_open(html, &of))) {
            if ((st = write_html(p, path, moetax_outfile_file(of)))) {
                st = cli_error_at(html, st); /* the page's path with the reason */
                moetax_outfile_abort(of);
            }
            else st = moetax_outfile_commit(of);
        }
        if (st) { moetax_profile_free(p); return cli_fail("report", st); }
    }
    if (json) {
        json_t *layers = json_array();
        for (int m = 0; m < p->n_moe; m++) {
            json_t *l = json_object();
            json_object_set_new(l, "layer", json_integer(p->moe_layer[m]));
            json_object_set_new(l, "top_quarter_share", cli_jnum(top_quarter(p, m)));
            json_object_set_new(l, "successor_coverage", m + 1 < p->n_moe ? cli_jnum(successor_coverage(p, m)) : json_null());
            json_array_append_new(layers, l);
        }
        st = cli_json_print(stdout, cli_jobj("ssIiiio", "profile", path, "model", p->model, "tokens", (int64_t)p->tokens,
                                             "n_expert", p->n_expert, "n_expert_used", p->n_expert_used, "moe_layers",
                                             p->n_moe, "layers", layers));
    } else {
        printf("moetax report: %s (routing profile of %s: %lld tokens, %d MoE layers, %d experts, %d used)\n\n", path,
               p->model, (long long)p->tokens, p->n_moe, p->n_expert, p->n_expert_used);
        printf("  layer  busiest quarter  successor coverage  hottest experts (share of routings)\n");
        for (int m = 0; m < p->n_moe; m++) {
            const int64_t E = p->n_expert;
            int64_t tot = 0;
            for (int64_t e = 0; e < E; e++) tot += p->freq[m * E + e];
            printf("  %5d  %14.1f%%  ", p->moe_layer[m], 100 * top_quarter(p, m));
            if (m + 1 < p->n_moe) printf("%17.1f%%  ", 100 * successor_coverage(p, m));
            else printf("%18s  ", "-");
            bool used[1 << 16] = {false};
            for (int h = 0; h < 4 && h < E; h++) {
                int64_t best = -1;
                for (int64_t e = 0; e < E; e++)
                    if (!used[e] && (best < 0 || p->freq[m * E + e] > p->freq[m * E + best])) best = e;
                used[best] = true;
                printf("%s%lld (%.1f%%)", h ? ", " : "", (long long)best, tot ? 100.0 * (double)p->freq[m * E + best] / (double)tot : 0);
            }
            printf("\n");
        }
        printf("\n  busiest quarter: the share of a layer's routings that go to its ceil(E/4) busiest experts (uniform\n"
               "  routing gives 25%%: a static cache of a quarter of the experts can serve at most this share);\n"
               "  successor coverage: of the next layer's routings, the share the k most frequent successors of the\n"
               "  current expert cover (uniform: k/E) - how far a transition table could predict the next layer\n");
        if (html) printf("\nHTML report written to %s\n", html);
    }
    moetax_profile_free(p);
    return st ? cli_fail("report", st) : 0;
}
