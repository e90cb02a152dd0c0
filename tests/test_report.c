// ctest-labels: unit
/* test_report.c - `moetax report`'s analysis: a synthetic ledger with known
 * numbers gives exactly the expected tax share, phase, layer, worker and
 * routing statistics; a synthetic trace with known spans rebuilds the same
 * totals; spans recorded through the real ledger give the same report from the
 * ledger JSON and from the trace; malformed files (truncated, missing keys,
 * wrong types, negative times, unknown phases, bad trace events) give an error
 * that names the file, never a crash; the HTML escapes text. */
#include "moetax/ledger.h"
#include "moetax/report.h"
#include "testutil.h"

#include <jansson.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#define P MOETAX_PHASE_COUNT
#define NEAR(a, b) (fabs((double)(a) - (double)(b)) <= 1e-9 * (1 + fabs((double)(b))))
#define CHECK_NEAR(a, b) CHECK_MSG(NEAR(a, b), "%s = %.12g, expected %.12g", #a, (double)(a), (double)(b))

/* ---- a synthetic ledger ------------------------------------------------------------ */

static void row(FILE *f, const double *v) {
    fputc('[', f);
    for (int p = 0; p < P; p++) fprintf(f, "%s%.15g", p ? ", " : "", v[p]);
    fputc(']', f);
}

struct rows {
    double other[P], layer[2][P];
    double busy[2], wait[2];
};

static void agg_body(FILE *f, const struct rows *r) {
    fputs("\"phase_s\": {", f);
    for (int p = 0; p < P; p++)
        fprintf(f, "%s\"%s\": %.15g", p ? ", " : "", moetax_phase_name((enum moetax_phase)p),
                r->other[p] + r->layer[0][p] + r->layer[1][p]);
    fputs("}, \"other_phase_s\": ", f);
    row(f, r->other);
    fputs(", \"layer_phase_s\": [", f);
    row(f, r->layer[0]);
    fputs(", ", f);
    row(f, r->layer[1]);
    fprintf(f, "], \"worker_busy_s\": [%.15g, %.15g], \"worker_wait_s\": [%.15g, %.15g]", r->busy[0], r->busy[1],
            r->wait[0], r->wait[1]);
}

static struct rows all_rows(void) {
    struct rows r = {0};
    r.layer[0][MOETAX_PHASE_ATTN] = 0.002;
    r.layer[0][MOETAX_PHASE_NORM] = 0.0005;
    r.layer[0][MOETAX_PHASE_WAIT] = 0.0005;
    r.layer[1][MOETAX_PHASE_ROUTE] = 0.0004;
    r.layer[1][MOETAX_PHASE_DISPATCH] = 0.0002;
    r.layer[1][MOETAX_PHASE_EXPERT] = 0.003;
    r.layer[1][MOETAX_PHASE_COMBINE] = 0.0002;
    r.layer[1][MOETAX_PHASE_WAIT] = 0.0008;
    r.layer[1][MOETAX_PHASE_SHARED] = 0.0004;
    r.other[MOETAX_PHASE_EMBD] = 0.0001;
    r.other[MOETAX_PHASE_HEAD] = 0.0008;
    r.other[MOETAX_PHASE_SAMPLE] = 0.0002;
    r.busy[0] = 0.008; r.busy[1] = 0.0074;
    r.wait[0] = 0.001; r.wait[1] = 0.0016;
    return r;
}

static struct rows decode_rows(void) {
    struct rows r = {0};
    r.layer[1][MOETAX_PHASE_EXPERT] = 0.001;
    r.layer[1][MOETAX_PHASE_WAIT] = 0.001;
    r.busy[0] = 0.001; r.busy[1] = 0.001;
    r.wait[0] = 0.0005; r.wait[1] = 0.0015;
    return r;
}

static const char *k_routing =
    "{\"tokens\": 6, \"first_token\": 0, \"layers\": [\n"
    "  {\"layer\": 1, \"step\": [0,0,0,0,1,2], \"experts\": [[0,1],[0,2],[0,1],[1,0],[0,1],[1,2]],"
    "   \"weights\": [[0.5,0.5],[0.5,0.5],[0.5,0.5],[0.5,0.5],[0.5,0.5],[0.5,0.5]], \"predicted\": null},\n"
    "  {\"layer\": 0, \"step\": [0,0,0,0,1,2], \"experts\": [[2,3],[2,3],[1,2],[0,3],[3,2],null],"
    "   \"weights\": [[0.5,0.5],[0.5,0.5],[0.5,0.5],[0.5,0.5],[0.5,0.5],null],"
    "   \"predicted\": [[2,3],[0,1],[1,3],null,[2,0],[1,1]]}]}";

/* The ledger text; `model` is written verbatim (already JSON-escaped). */
static char *ledger_text(const char *model) {
    char *buf = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&buf, &len);
    fprintf(f, "{\"moetax_ledger\": 1, \"model\": \"%s\", \"threads\": 2, \"n_layer\": 2, \"n_expert\": 4, "
               "\"n_expert_used\": 2, \"moe_layers\": [0, 1],\n \"phases\": [", model);
    for (int p = 0; p < P; p++) fprintf(f, "%s\"%s\"", p ? ", " : "", moetax_phase_name((enum moetax_phase)p));
    fputs("], \"tax_phases\": [\"route\", \"dispatch\", \"load\", \"comm\", \"wait\", \"combine\"],\n"
          " \"overhead\": {\"span_ns\": 25.5},\n \"steps\": [", f);
    /* three steps: a prefill of 4 tokens and two decode steps; step 2 is the slowest decode */
    const double walls[3] = {0.006, 0.0015, 0.0025};
    for (int s = 0; s < 3; s++) {
        struct rows r = {0};
        r.layer[1][MOETAX_PHASE_EXPERT] = walls[s] / 2;
        r.layer[0][MOETAX_PHASE_ATTN] = walls[s] / 4;
        r.other[MOETAX_PHASE_WAIT] = walls[s] / 8;
        fprintf(f, "%s\n  {\"step\": %d, \"kind\": \"%s\", \"tokens\": %d, \"pos\": %d, \"wall_s\": %.15g, ", s ? "," : "",
                s, s ? "decode" : "prefill", s ? 1 : 4, s ? 3 + s : 0, walls[s]);
        agg_body(f, &r);
        fputc('}', f);
    }
    struct rows a = all_rows(), d = decode_rows(), pre = {0};
    fputs("],\n \"totals\": {\"steps\": 3, \"tokens\": 6, \"wall_s\": 0.01, ", f);
    agg_body(f, &a);
    fputs(", \"decode\": {\"steps\": 2, \"tokens\": 2, \"wall_s\": 0.004, ", f);
    agg_body(f, &d);
    fputs("}, \"prefill\": {\"steps\": 1, \"tokens\": 4, \"wall_s\": 0.006, ", f);
    agg_body(f, &pre);
    fprintf(f, "}},\n \"routing\": %s,\n \"dropped_steps\": 0}\n", k_routing);
    fclose(f);
    return buf;
}

static void test_ledger(void) {
    char *text = ledger_text("synthetic");
    const char *path = tu_path("report_ledger.json");
    FILE *f = fopen(path, "w");
    CHECK(f != NULL);
    if (!f) { free(text); return; }
    fputs(text, f);
    fclose(f);
    struct moetax_report *r = NULL;
    moetax_status st = moetax_report_load(path, NULL, &r);
    CHECK_MSG(st == MOETAX_OK, "%s", moetax_last_error());
    if (!r) { free(text); return; }
    CHECK(r->source == MOETAX_REPORT_SOURCE_LEDGER);
    CHECK(!strcmp(r->model, "synthetic"));
    CHECK_EQ_INT(r->n_workers, 2);
    CHECK_EQ_INT(r->n_layer, 2);
    CHECK(r->moe_layer[0] && r->moe_layer[1]);
    CHECK_NEAR(r->span_ns, 25.5);
    /* steps */
    CHECK_EQ_INT(r->all.steps, 3);
    CHECK_EQ_INT(r->all.tokens, 6);
    CHECK_NEAR(r->all.wall_s, 0.01);
    CHECK_EQ_INT(r->prefill.tokens, 4);
    CHECK_EQ_INT(r->decode.steps, 2);
    CHECK_NEAR(r->decode.wall_s, 0.004);
    /* tax share = (0.0005 + 0.0008 + 0.0004 + 0.0002 + 0.0002) / 0.0091 */
    const struct moetax_report_agg *a = moetax_report_sel(r);
    CHECK(a == &r->all);
    CHECK_NEAR(moetax_report_phase_total(a), 0.0091);
    CHECK_NEAR(moetax_report_tax_share(a), 0.0021 / 0.0091);
    CHECK_NEAR(moetax_report_efficiency(a), 100 * (1 - 0.0021 / 0.0091));
    CHECK_NEAR(a->phase_s[MOETAX_PHASE_WAIT], 0.0013);
    CHECK_NEAR(a->phase_s[MOETAX_PHASE_EXPERT], 0.003);
    CHECK_NEAR(a->phase_s[MOETAX_PHASE_HEAD], 0.0008);
    CHECK_NEAR(a->phase_s[MOETAX_PHASE_LOAD], 0);
    CHECK_NEAR(a->other_phase_s[MOETAX_PHASE_SAMPLE], 0.0002);
    CHECK_NEAR(a->layer_phase_s[0 * P + MOETAX_PHASE_ATTN], 0.002);
    CHECK_NEAR(a->layer_phase_s[1 * P + MOETAX_PHASE_ROUTE], 0.0004);
    CHECK_NEAR(a->layer_phase_s[1 * P + MOETAX_PHASE_WAIT], 0.0008);
    CHECK_NEAR(a->worker_busy_s[1], 0.0074);
    CHECK_NEAR(a->worker_wait_s[1], 0.0016);
    /* timeline: the slowest decode step */
    CHECK(r->timeline.valid);
    CHECK_EQ_INT(r->timeline.step, 2);
    CHECK(!r->timeline.prefill);
    CHECK_NEAR(r->timeline.layer_phase_s[1 * P + MOETAX_PHASE_EXPERT], 0.00125);
    CHECK_NEAR(r->timeline.other_phase_s[MOETAX_PHASE_WAIT], 0.0025 / 8);
    CHECK(r->timeline.spans == NULL);

    /* routing (hand-computed, see k_routing) */
    const struct moetax_report_routing *R = r->routing;
    CHECK(R != NULL);
    if (R) {
        CHECK_EQ_INT(R->n_layers, 2);
        CHECK_EQ_INT(R->tokens, 6);
        const struct moetax_report_routing_layer *L1 = &R->layers[0], *L0 = &R->layers[1];
        CHECK_EQ_INT(L1->layer, 1);
        CHECK_EQ_INT(L1->tokens, 6);
        CHECK_EQ_INT(L1->load[0], 5); CHECK_EQ_INT(L1->load[1], 5); CHECK_EQ_INT(L1->load[2], 2); CHECK_EQ_INT(L1->load[3], 0);
        CHECK_NEAR(L1->load_min, 0); CHECK_NEAR(L1->load_mean, 3); CHECK_NEAR(L1->load_max, 5);
        CHECK_NEAR(L1->load_cv, sqrt(4.5) / 3);
        CHECK_EQ_INT(L1->hot[0], 0); CHECK_EQ_INT(L1->hot[1], 1); CHECK_EQ_INT(L1->hot[2], 2);
        CHECK_EQ_INT(L1->hot_n[2], 2);
        CHECK_NEAR(L1->top_quarter_share, 5.0 / 12);
        CHECK_EQ_INT(L1->n_batches, 1);
        CHECK_NEAR(L1->batch_imbalance, 2.0);   /* step 0: e0 gets 4 of 8 routings, mean 2 */
        CHECK_EQ_INT(L1->n_pairs, 5);
        CHECK_NEAR(L1->overlap, 3.5 / 5);
        CHECK_EQ_INT(L1->n_pred, 0);
        CHECK(isnan(L1->precision) && isnan(L1->recall));

        CHECK_EQ_INT(L0->layer, 0);
        CHECK_EQ_INT(L0->tokens, 5);            /* token 5 has no set */
        CHECK_EQ_INT(L0->load[2], 4); CHECK_EQ_INT(L0->load[3], 4); CHECK_EQ_INT(L0->load[0], 1);
        CHECK_NEAR(L0->load_mean, 2.5);
        CHECK_NEAR(L0->load_cv, 0.6);
        CHECK_NEAR(L0->top_quarter_share, 0.4);
        CHECK_NEAR(L0->batch_imbalance, 1.5);
        CHECK_EQ_INT(L0->n_pairs, 4);
        CHECK_NEAR(L0->overlap, 0.5);
        CHECK_EQ_INT(L0->n_pred, 4);            /* tokens 0, 1, 2, 4 */
        CHECK_NEAR(L0->precision, 0.5);
        CHECK_NEAR(L0->recall, 0.5);

        CHECK_NEAR(R->load_cv, (sqrt(4.5) / 3 + 0.6) / 2);
        CHECK_NEAR(R->batch_imbalance, 1.75);
        CHECK_NEAR(R->overlap, 0.6);
        CHECK_NEAR(R->precision, 0.5);
        CHECK_NEAR(R->recall, 0.5);
        CHECK_NEAR(R->load_cv_chance, sqrt(0.5 / 3.0)); /* T k / E = 3 */
    }
    moetax_report_free(r);

    /* --decode-only: the breakdowns use totals.decode */
    struct moetax_report_params dp = {.decode_only = true};
    st = moetax_report_parse(text, strlen(text), "mem", &dp, &r);
    CHECK_MSG(st == MOETAX_OK, "%s", moetax_last_error());
    if (r) {
        CHECK(moetax_report_sel(r) == &r->decode);
        CHECK_NEAR(moetax_report_tax_share(moetax_report_sel(r)), 0.5);
        CHECK_NEAR(moetax_report_sel(r)->worker_wait_s[1], 0.0015);
        moetax_report_free(r);
    }
    /* the same from a parsed document, which stays as it was; other documents refused by name */
    json_t *doc = json_loads(text, 0, NULL);
    CHECK(doc != NULL);
    st = moetax_report_from_json(doc, "doc", &dp, &r);
    CHECK_MSG(st == MOETAX_OK, "%s", moetax_last_error());
    if (r) {
        CHECK(!strcmp(r->path, "doc") && moetax_report_sel(r) == &r->decode);
        CHECK_NEAR(moetax_report_tax_share(moetax_report_sel(r)), 0.5);
        moetax_report_free(r);
    }
    CHECK(doc && doc->refcount == 1 && json_object_get(doc, "moetax_ledger"));
    json_decref(doc);
    doc = json_pack("[i]", 1);
    CHECK(moetax_report_from_json(doc, "arr", NULL, &r) == MOETAX_ERR_FORMAT && r == NULL &&
          strstr(moetax_last_error(), "arr: expected a JSON object"));
    json_decref(doc);
    doc = json_pack("{s:i}", "moetax_profile", 1);
    CHECK(moetax_report_from_json(doc, "prof", NULL, &r) == MOETAX_ERR_FORMAT && r == NULL &&
          strstr(moetax_last_error(), "prof: neither a moetax ledger"));
    json_decref(doc);
    free(text);
}

/* A phases list in another order maps by name. */
static void test_phase_order(void) {
    char *buf = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&buf, &len);
    /* two phases only, reversed: ["expert", "wait"] */
    fputs("{\"moetax_ledger\": 1, \"threads\": 1, \"n_layer\": 1, \"phases\": [\"expert\", \"wait\"], \"steps\": [],"
          " \"totals\": {\"steps\": 1, \"tokens\": 1, \"wall_s\": 0.004, \"other_phase_s\": [0, 0], "
          "\"layer_phase_s\": [[0.003, 0.001]], \"worker_busy_s\": [0.003], \"worker_wait_s\": [0.001],", f);
    fputs(" \"decode\": {\"steps\": 1, \"tokens\": 1, \"wall_s\": 0.004, \"other_phase_s\": [0, 0], "
          "\"layer_phase_s\": [[0.003, 0.001]], \"worker_busy_s\": [0.003], \"worker_wait_s\": [0.001]},"
          " \"prefill\": {\"steps\": 0, \"tokens\": 0, \"wall_s\": 0, \"other_phase_s\": [0, 0], "
          "\"layer_phase_s\": [[0, 0]], \"worker_busy_s\": [0], \"worker_wait_s\": [0]}}, \"routing\": null}", f);
    fclose(f);
    struct moetax_report *r = NULL;
    moetax_status st = moetax_report_parse(buf, len, "order", NULL, &r);
    CHECK_MSG(st == MOETAX_OK, "%s", moetax_last_error());
    if (r) {
        CHECK_NEAR(r->all.phase_s[MOETAX_PHASE_EXPERT], 0.003);
        CHECK_NEAR(r->all.phase_s[MOETAX_PHASE_WAIT], 0.001);
        CHECK_NEAR(moetax_report_tax_share(&r->all), 0.25);
        CHECK(r->routing == NULL);
        CHECK(!r->timeline.valid);
        moetax_report_free(r);
    }
    free(buf);
}

/* ---- malformed inputs --------------------------------------------------------------- */

static char *replace(const char *s, const char *from, const char *to) {
    const char *at = strstr(s, from);
    if (!at) return NULL;
    size_t n = strlen(s) - strlen(from) + strlen(to) + 1;
    char *out = malloc(n);
    size_t pre = (size_t)(at - s);
    memcpy(out, s, pre);
    strcpy(out + pre, to);
    strcat(out, at + strlen(from));
    return out;
}

static void expect_error(const char *text, size_t len, const char *what, const char *needle) {
    struct moetax_report *r = (struct moetax_report *)1;
    moetax_clear_error();
    moetax_status st = moetax_report_parse(text, len, "bad.json", NULL, &r);
    CHECK_MSG(st != MOETAX_OK, "%s: accepted", what);
    CHECK_MSG(r == NULL, "%s: report not NULL on error", what);
    const char *msg = moetax_last_error();
    CHECK_MSG(strstr(msg, "bad.json") != NULL, "%s: message does not name the file: %s", what, msg);
    if (needle) CHECK_MSG(strstr(msg, needle) != NULL, "%s: message '%s' lacks '%s'", what, msg, needle);
    if (st == MOETAX_OK) moetax_report_free(r);
}

static void mutate(const char *text, const char *from, const char *to, const char *needle) {
    char *bad = replace(text, from, to);
    CHECK_MSG(bad != NULL, "'%s' not in the ledger text", from);
    if (!bad) return;
    expect_error(bad, strlen(bad), from, needle);
    free(bad);
}

static void test_malformed_ledger(void) {
    char *text = ledger_text("m");
    size_t len = strlen(text);
    /* every truncation is an error, never a crash */
    int n_trunc = 0;
    for (size_t cut = 0; cut < len - 2; cut += (cut < 400 ? 1 : 13)) {
        struct moetax_report *r = NULL;
        moetax_status st = moetax_report_parse(text, cut, "bad.json", NULL, &r);
        if (st == MOETAX_OK) { moetax_report_free(r); CHECK_MSG(0, "truncated at %zu accepted", cut); break; }
        n_trunc++;
    }
    CHECK(n_trunc > 100);
    expect_error("", 0, "empty", NULL);
    expect_error("[1, 2]", 6, "array", "expected a JSON object");
    expect_error("{}", 2, "neither", "neither");
    expect_error("{\"moetax_ledger\": 1", 19, "unterminated", "not valid JSON");
    mutate(text, "\"moetax_ledger\": 1", "\"moetax_ledger\": 2", "version 2");
    mutate(text, "\"threads\": 2", "\"threads\": \"2\"", "threads");
    mutate(text, "\"totals\"", "\"totalz\"", "totals: missing");
    mutate(text, "\"decode\": {", "\"decodx\": {", "totals.decode");
    mutate(text, "\"phases\": [\"route\"", "\"phases\": [\"rout\"", "unknown phase");
    mutate(text, "\"phase_s\": {\"route\"", "\"phase_s\": {\"rout\"", "unknown phase");
    mutate(text, "\"wall_s\": 0.01,", "\"wall_s\": -0.01,", "negative");
    mutate(text, "\"worker_wait_s\": [0.001", "\"worker_wait_s\": [-0.001", "negative");
    mutate(text, "\"worker_busy_s\": [0.008, 0.0074]", "\"worker_busy_s\": [0.008]", "expected 2 numbers");
    mutate(text, "\"kind\": \"decode\"", "\"kind\": \"decoder\"", "kind");
    mutate(text, "\"steps\": [", "\"steps\": {", NULL);
    mutate(text, "\"layer_phase_s\": [[", "\"layer_phase_s\": [7, [", "layer_phase_s");
    mutate(text, "[[0,1],[0,2]", "[[0,9],[0,2]", "out of range");
    mutate(text, "[[0,1],[0,2]", "[[0],[0,2]", "expert ids");
    mutate(text, "\"step\": [0,0,0,0,1,2]", "\"step\": [0,0,0]", "one per token");
    mutate(text, "\"layer\": 1,", "\"layer\": 7,", "out of range");
    mutate(text, "\"moe_layers\": [0, 1]", "\"moe_layers\": [0, 5]", "moe_layers");
    mutate(text, "\"n_expert\": 4", "\"n_expert\": 0", "n_expert");
    free(text);
}

/* ---- trace -------------------------------------------------------------------------- */

static const char *k_trace =
    "{\"displayTimeUnit\": \"ms\", \"otherData\": {\"producer\": \"test\", \"spans\": 13, \"dropped_spans\": 0},\n"
    " \"traceEvents\": [\n"
    "  {\"name\": \"process_name\", \"ph\": \"M\", \"pid\": 0, \"tid\": 0, \"args\": {\"name\": \"moetax\"}},\n"
    "  {\"name\": \"thread_name\", \"ph\": \"M\", \"pid\": 0, \"tid\": 0, \"args\": {\"name\": \"worker 0\"}},\n"
    "  {\"name\": \"thread_name\", \"ph\": \"M\", \"pid\": 0, \"tid\": 1, \"args\": {\"name\": \"worker 1\"}},\n"
    "  {\"name\": \"embd\", \"ph\": \"X\", \"ts\": 0, \"dur\": 100, \"pid\": 0, \"tid\": 0, \"args\": {\"layer\": -1, \"step\": 0, \"tokens\": 4}},\n"
    "  {\"name\": \"attn\", \"ph\": \"X\", \"ts\": 100, \"dur\": 300, \"pid\": 0, \"tid\": 0, \"args\": {\"layer\": 0, \"step\": 0, \"tokens\": 4}},\n"
    "  {\"name\": \"attn\", \"ph\": \"X\", \"ts\": 100, \"dur\": 200, \"pid\": 0, \"tid\": 1, \"args\": {\"layer\": 0, \"step\": 0, \"tokens\": 4}},\n"
    "  {\"name\": \"wait\", \"ph\": \"X\", \"ts\": 300, \"dur\": 100, \"pid\": 0, \"tid\": 1, \"args\": {\"layer\": 0, \"step\": 0, \"tokens\": 4}},\n"
    "  {\"name\": \"expert\", \"ph\": \"X\", \"ts\": 400, \"dur\": 500, \"pid\": 0, \"tid\": 0, \"args\": {\"layer\": 1, \"step\": 0, \"tokens\": 4}},\n"
    "  {\"name\": \"expert\", \"ph\": \"X\", \"ts\": 400, \"dur\": 400, \"pid\": 0, \"tid\": 1, \"args\": {\"layer\": 1, \"step\": 0, \"tokens\": 4}},\n"
    "  {\"name\": \"wait\", \"ph\": \"X\", \"ts\": 800, \"dur\": 100, \"pid\": 0, \"tid\": 1, \"args\": {\"layer\": 1, \"step\": 0, \"tokens\": 4}},\n"
    "  {\"name\": \"expert\", \"ph\": \"X\", \"ts\": 1050, \"dur\": 200, \"pid\": 0, \"tid\": 0, \"args\": {\"layer\": 1, \"step\": 1, \"tokens\": 1}},\n"
    "  {\"name\": \"route\", \"ph\": \"X\", \"ts\": 1000, \"dur\": 50, \"pid\": 0, \"tid\": 0, \"args\": {\"layer\": 1, \"step\": 1, \"tokens\": 1}},\n"
    "  {\"name\": \"route\", \"ph\": \"X\", \"ts\": 1000, \"dur\": 50, \"pid\": 0, \"tid\": 1, \"args\": {\"layer\": 1, \"step\": 1, \"tokens\": 1}},\n"
    "  {\"name\": \"expert\", \"ph\": \"X\", \"ts\": 1050, \"dur\": 100, \"pid\": 0, \"tid\": 1, \"args\": {\"layer\": 1, \"step\": 1, \"tokens\": 1}},\n"
    "  {\"name\": \"wait\", \"ph\": \"X\", \"ts\": 1150, \"dur\": 100, \"pid\": 0, \"tid\": 1, \"args\": {\"layer\": 1, \"step\": 1, \"tokens\": 1}},\n"
    "  {\"name\": \"mark\", \"ph\": \"i\", \"ts\": 5, \"pid\": 0, \"tid\": 0}\n"
    " ]}\n";

static void test_trace(void) {
    struct moetax_report *r = NULL;
    moetax_status st = moetax_report_parse(k_trace, strlen(k_trace), "trace.json", NULL, &r);
    CHECK_MSG(st == MOETAX_OK, "%s", moetax_last_error());
    if (!r) return;
    CHECK(r->source == MOETAX_REPORT_SOURCE_TRACE);
    CHECK_EQ_INT(r->n_workers, 2);
    CHECK_EQ_INT(r->n_layer, 2);
    const struct moetax_report_agg *a = &r->all;
    CHECK_NEAR(a->phase_s[MOETAX_PHASE_EMBD], 50e-6);
    CHECK_NEAR(a->phase_s[MOETAX_PHASE_ATTN], 250e-6);
    CHECK_NEAR(a->phase_s[MOETAX_PHASE_WAIT], 150e-6);
    CHECK_NEAR(a->phase_s[MOETAX_PHASE_EXPERT], 600e-6);
    CHECK_NEAR(a->phase_s[MOETAX_PHASE_ROUTE], 50e-6);
    CHECK_NEAR(moetax_report_phase_total(a), 1100e-6);
    CHECK_NEAR(moetax_report_tax_share(a), 200.0 / 1100);
    CHECK_NEAR(a->layer_phase_s[1 * P + MOETAX_PHASE_EXPERT], 600e-6);
    CHECK_NEAR(a->other_phase_s[MOETAX_PHASE_EMBD], 50e-6);
    CHECK_NEAR(a->worker_busy_s[0], 1150e-6);
    CHECK_NEAR(a->worker_wait_s[0], 0);
    CHECK_NEAR(a->worker_busy_s[1], 750e-6);
    CHECK_NEAR(a->worker_wait_s[1], 300e-6);
    CHECK_EQ_INT(a->steps, 2);
    CHECK_EQ_INT(a->tokens, 5);
    CHECK_EQ_INT(r->prefill.steps, 1);
    CHECK_EQ_INT(r->prefill.tokens, 4);
    CHECK_NEAR(r->prefill.wall_s, 900e-6);
    CHECK_NEAR(r->decode.wall_s, 250e-6);
    CHECK_NEAR(r->decode.phase_s[MOETAX_PHASE_EXPERT], 150e-6);
    CHECK(r->timeline.valid);
    CHECK_EQ_INT(r->timeline.step, 1);
    CHECK_EQ_INT(r->timeline.n_spans, 5);
    if (r->timeline.n_spans == 5) {
        CHECK_NEAR(r->timeline.spans[0].t0_us, 0);
        CHECK(r->timeline.spans[0].phase == MOETAX_PHASE_ROUTE);
        CHECK_NEAR(r->timeline.spans[4].t0_us, 150);
        CHECK(r->timeline.spans[4].phase == MOETAX_PHASE_WAIT);
    }
    CHECK(r->routing == NULL);
    moetax_report_free(r);

    /* bad events */
    struct { const char *from, *to, *needle; } bad[] = {
        {"\"name\": \"embd\"", "\"name\": \"embed\"", "unknown phase"},
        {"\"dur\": 300", "\"dur\": -300", "negative"},
        {"\"ts\": 100, \"dur\": 200", "\"ts\": -1, \"dur\": 200", "negative"},
        {"\"args\": {\"layer\": 0, \"step\": 0, \"tokens\": 4}},\n  {\"name\": \"attn\"", "\"argz\": 1},\n  {\"name\": \"attn\"", "args"},
        {"\"layer\": 1, \"step\": 1", "\"layer\": \"1\", \"step\": 1", "layer"},
        {"\"step\": 1, \"tokens\": 1}},\n  {\"name\": \"route\"", "\"step\": -1, \"tokens\": 1}},\n  {\"name\": \"route\"", "step"},
        {"\"tid\": 1, \"args\": {\"layer\": 0", "\"tid\": -1, \"args\": {\"layer\": 0", "tid"},
        {"\"ph\": \"X\", \"ts\": 0,", "\"ts\": 0,", "ph"},
        {"{\"name\": \"mark\", \"ph\": \"i\", \"ts\": 5, \"pid\": 0, \"tid\": 0}", "17", "expected an object"},
        {"\"traceEvents\": [", "\"traceEvents\": {\"a\": [", NULL},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        char *t = replace(k_trace, bad[i].from, bad[i].to);
        CHECK_MSG(t != NULL, "case %zu: '%s' not in the trace", i, bad[i].from);
        if (!t) continue;
        expect_error(t, strlen(t), bad[i].from, bad[i].needle);
        free(t);
    }
    const char *empty = "{\"traceEvents\": [{\"name\": \"thread_name\", \"ph\": \"M\", \"tid\": 0}]}";
    expect_error(empty, strlen(empty), "no spans", "no spans");
    for (size_t cut = 0; cut + 3 < strlen(k_trace); cut += 5) {
        struct moetax_report *x = NULL;
        if (moetax_report_parse(k_trace, cut, "bad.json", NULL, &x) == MOETAX_OK) {
            moetax_report_free(x);
            CHECK_MSG(0, "truncated trace at %zu accepted", cut);
            break;
        }
    }
}

/* ---- the real ledger: JSON and trace give the same report --------------------------- */

/* The batch tax: steps written by the ledger with batch sizes and MoE figures come back
 * from the report grouped by batch size (decode steps only), with exact sums. */
static void test_batches(void) {
    struct moetax_ledger_params lp = {.n_workers = 2, .n_layer = 3, .window = 64};
    struct moetax_ledger *l = NULL;
    CHECK(moetax_ledger_init(&lp, &l) == MOETAX_OK);
    if (!l) return;
    const int bs[5] = {4, 1, 4, 2, 4}; /* plus a prefill step of 8 tokens, not counted */
    for (int step = 0; step < 6; step++) {
        const int B = step < 5 ? bs[step] : 1;
        moetax_ledger_step_begin(l, step < 5 ? B : 8, 10 + step, step == 5);
        moetax_ledger_step_batch(l, B);
        uint64_t t = 1000;
        for (int w = 0; w < 2; w++) {
            moetax_ledger_span(l, w, MOETAX_PHASE_EXPERT, 1, t, t + 3000);
            moetax_ledger_span(l, w, MOETAX_PHASE_WAIT, 1, t + 3000, t + 4000);
        }
        for (int layer = 1; layer < 3; layer++) /* layer 0 dense */
            moetax_ledger_moe(l, layer, 2 * B, B, 2 * B + 1, 1000.0 * B, step == 4 ? 1 : 0, 0);
        moetax_ledger_step_end(l);
    }
    struct moetax_ledger_meta meta = {.model = "batches", .n_expert = 8, .n_expert_used = 2};
    const char *lj = tu_path("report_batches.json");
    CHECK(moetax_ledger_write_json(l, &meta, lj) == MOETAX_OK);
    struct moetax_ledger_moe_stats ms;
    moetax_ledger_moe_totals(l, true, &ms);
    CHECK_EQ_INT(ms.moe_layers, 10);
    CHECK_EQ_INT(ms.dropped, 2);
    moetax_ledger_free(l);
    struct moetax_report *r = NULL;
    CHECK(moetax_report_load(lj, NULL, &r) == MOETAX_OK);
    if (!r) return;
    CHECK_EQ_INT(r->n_batches, 3);
    if (r->n_batches == 3) {
        const struct moetax_report_batch *b1 = &r->batches[0], *b2 = &r->batches[1], *b4 = &r->batches[2];
        CHECK_EQ_INT(b1->batch, 1);
        CHECK_EQ_INT(b2->batch, 2);
        CHECK_EQ_INT(b4->batch, 4);
        CHECK_EQ_INT(b4->steps, 3);
        CHECK_EQ_INT(b4->tokens, 12);
        CHECK_EQ_INT(b4->moe_layers, 6);
        CHECK_EQ_INT(b4->experts, 6 * 8);
        CHECK_EQ_INT(b4->assignments, 6 * 9);
        CHECK_EQ_INT(b4->dropped, 2);
        CHECK_NEAR(b4->expert_bytes, 6 * 4000.0);
        CHECK_NEAR(b4->imbalance_sum, 6 * (4.0 * 8 / 9));
        CHECK_NEAR(b4->wait_s / b4->phase_s, 0.25);
        CHECK_EQ_INT(b1->steps, 1); /* the prefill step is not a batch-1 decode step */
        CHECK_NEAR(b1->imbalance_sum, 2 * (1.0 * 2 / 3));
    }
    moetax_report_free(r);
}

static void test_ledger_roundtrip(void) {
    struct moetax_ledger_params lp = {.n_workers = 3, .n_layer = 4, .window = 64, .trace_cap = 100000,
                                      .routing_window = 0, .n_expert_used = 2};
    struct moetax_ledger *l = NULL;
    moetax_status st = moetax_ledger_init(&lp, &l);
    CHECK_MSG(st == MOETAX_OK, "%s", moetax_last_error());
    if (!l) return;
    uint64_t t = 1000000;
    for (int step = 0; step < 5; step++) {
        moetax_ledger_step_begin(l, step ? 1 : 6, step ? 5 + step : 0, step == 0);
        for (int layer = -1; layer < 4; layer++)
            for (int p = 0; p < P; p++) {
                if (p == MOETAX_PHASE_SAMPLE) continue; /* added outside the pool, not in the trace */
                for (int w = 0; w < 3; w++) {
                    uint64_t d = 1000 + 37 * (uint64_t)((p * 7 + w * 3 + layer * 5 + step * 11) % 23);
                    moetax_ledger_span(l, w, (enum moetax_phase)p, layer, t, t + d);
                    t += d;
                }
            }
        moetax_ledger_step_end(l);
    }
    struct moetax_ledger_meta meta = {.model = "roundtrip", .n_expert = 8, .n_expert_used = 2};
    const char *lj = tu_path("report_rt_ledger.json"), *tj = tu_path("report_rt_trace.json");
    CHECK(moetax_ledger_write_json(l, &meta, lj) == MOETAX_OK);
    /* with the expert store's reads as a second process's tracks (which the report skips)
     * and its statistics in otherData (which it reads) */
    const char *const tracks[2] = {"I/O worker 0", "I/O worker 1"};
    struct moetax_trace_span io[2] = {{.t0 = 900000, .t1 = 1500000, .track = 0, .name = "demand read", .cat = "io"},
                                      {.t0 = 1200000, .t1 = 1700000, .track = 1, .name = "predicted read", .cat = "io"}};
    snprintf(io[0].args, sizeof io[0].args, "\"layer\": 1, \"expert\": 5, \"bytes\": 4096");
    snprintf(io[1].args, sizeof io[1].args, "\"layer\": 2, \"expert\": 0, \"bytes\": 8192");
    struct moetax_trace_extra x = {.process = "expert store reads", .track_names = tracks, .n_tracks = 2, .spans = io,
                                   .n_spans = 2, .other_json = "{\"n_slots\": 7, \"hits\": 30, \"acquires\": 40}"};
    CHECK(moetax_ledger_write_trace_ex(l, tj, &x) == MOETAX_OK);
    moetax_ledger_free(l);
    {
        json_error_t je;
        json_t *root = json_load_file(tj, 0, &je);
        CHECK_MSG(root != NULL, "%s: %s", tj, je.text);
        size_t n_io = 0, n_names = 0;
        double t_min = 1e300;
        const json_t *evs = json_object_get(root, "traceEvents"), *e;
        size_t i;
        json_array_foreach(evs, i, e) {
            double ts = json_number_value(json_object_get(e, "ts"));
            if (json_object_get(e, "ts") && ts < t_min) t_min = ts;
            if (json_integer_value(json_object_get(e, "pid")) != 1) continue;
            const char *ph = json_string_value(json_object_get(e, "ph"));
            if (!strcmp(ph, "M")) n_names++;
            else {
                n_io++;
                CHECK(json_integer_value(json_object_get(json_object_get(e, "args"), "bytes")) % 4096 == 0);
                /* the earliest span of all (a read before the first worker span) is at 0 */
                if (json_integer_value(json_object_get(json_object_get(e, "args"), "expert")) == 5)
                    CHECK(json_number_value(json_object_get(e, "ts")) == 0.0);
            }
        }
        CHECK_EQ_INT(n_io, 2);
        CHECK_EQ_INT(n_names, 3); /* process and two threads */
        CHECK(t_min == 0.0);
        json_decref(root);
    }
    struct moetax_report *a = NULL, *b = NULL;
    st = moetax_report_load(lj, NULL, &a);
    CHECK_MSG(st == MOETAX_OK, "%s", moetax_last_error());
    st = moetax_report_load(tj, NULL, &b);
    CHECK_MSG(st == MOETAX_OK, "%s", moetax_last_error());
    if (a && b) {
        CHECK_EQ_INT(b->n_workers, 3); /* the I/O tracks are not workers */
        CHECK_EQ_INT(b->n_layer, 4);
        CHECK(b->store && b->store->n_slots == 7 && b->store->hits == 30 && b->store->acquires == 40);
        /* the two reads on the timeline: 0.6 and 0.5 ms, both running across the first step */
        CHECK(a->io == NULL && b->io != NULL);
        if (b->io) {
            CHECK(b->io->reads[0] == 1 && b->io->reads[1] == 0 && b->io->reads[2] == 1);
            CHECK(b->io->bytes == 12288);
            CHECK(fabs(b->io->median_read_ms - 0.55) < 1e-9);
            CHECK(b->io->wall_s > 0 && fabs(b->io->wall_s - b->all.wall_s) < 1e-12);
            CHECK(b->io->busy_s > 0 && b->io->busy_s <= b->io->wall_s && b->io->inflight_s >= b->io->busy_s);
            CHECK(b->io->busy_s <= 0.7e-3 + 1e-12); /* the reads' union is 0.8 ms, the steps begin 0.1 ms in */
        }
        CHECK_EQ_INT(a->all.steps, b->all.steps);
        CHECK_EQ_INT(a->all.tokens, b->all.tokens);
        CHECK_EQ_INT(a->prefill.steps, 1);
        CHECK_EQ_INT(b->prefill.steps, 1);
        for (int p = 0; p < P; p++)
            CHECK_MSG(fabs(a->all.phase_s[p] - b->all.phase_s[p]) < 1e-8, "phase %s: ledger %.9g trace %.9g",
                      moetax_phase_name((enum moetax_phase)p), a->all.phase_s[p], b->all.phase_s[p]);
        for (int i = 0; i < 4 * P; i++)
            CHECK(fabs(a->all.layer_phase_s[i] - b->all.layer_phase_s[i]) < 1e-8);
        for (int w = 0; w < 3; w++) {
            CHECK(fabs(a->all.worker_busy_s[w] - b->all.worker_busy_s[w]) < 1e-8);
            CHECK(fabs(a->all.worker_wait_s[w] - b->all.worker_wait_s[w]) < 1e-8);
        }
        CHECK(fabs(moetax_report_tax_share(&a->all) - moetax_report_tax_share(&b->all)) < 1e-9);
        CHECK(fabs(moetax_report_tax_share(&a->decode) - moetax_report_tax_share(&b->decode)) < 1e-9);
    }
    moetax_report_free(a);
    moetax_report_free(b);
}

/* ---- HTML --------------------------------------------------------------------------- */

static size_t count(const char *s, const char *needle) {
    size_t n = 0;
    for (const char *p = strstr(s, needle); p; p = strstr(p + 1, needle)) n++;
    return n;
}

static void test_html(void) {
    char *text = ledger_text("<script>alert(1)</script> & \\\"x\\\"");
    struct moetax_report *r = NULL;
    moetax_status st = moetax_report_parse(text, strlen(text), "a<b>.json", NULL, &r);
    CHECK_MSG(st == MOETAX_OK, "%s", moetax_last_error());
    free(text);
    if (!r) return;
    char *html = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&html, &len);
    CHECK(moetax_report_write_html(r, f) == MOETAX_OK);
    fclose(f);
    CHECK(!strncmp(html, "<!DOCTYPE html>", 15));
    CHECK(strstr(html, "</html>") != NULL);
    CHECK_EQ_INT(count(html, "<svg"), 4);  /* layers, timeline, heat map, workers */
    CHECK_EQ_INT(count(html, "</svg>"), 4);
    CHECK(strstr(html, "<script") == NULL);
    CHECK(strstr(html, "&lt;script&gt;alert(1)&lt;/script&gt; &amp; &quot;x&quot;") != NULL);
    CHECK(strstr(html, "a&lt;b&gt;.json") != NULL);
    CHECK(strstr(html, "Expert heat map") != NULL);
    CHECK(strstr(html, "Time per token by layer") != NULL);
    CHECK(strstr(html, "nan") == NULL && strstr(html, "inf\"") == NULL);
    free(html);
    moetax_report_free(r);
}

int main(int argc, char **argv) {
    tu_init(argc, argv);
    test_ledger();
    test_phase_order();
    test_malformed_ledger();
    test_trace();
    test_ledger_roundtrip();
    test_batches();
    test_html();
    return tu_finish("test_report");
}
