// ctest-labels: unit
/* test_profile.c - routing profiles: the counts' invariants on known routings, the
 * file round trip, and malformed files refused with the field named, by the loader and from a
 * parsed document (moetax_profile_from_json, what `report` uses). */
#include <jansson.h>
#include <stdlib.h>
#include <string.h>

#include "moetax/profile.h"
#include "testutil.h"

static void counts_and_roundtrip(void) {
    const int moe[3] = {1, 2, 4}, E = 6, k = 2;
    struct moetax_profile *p = NULL;
    CHECK(moetax_profile_new("m", 5, moe, 3, E, k, &p) == MOETAX_OK);
    if (!p) return;
    /* 3 tokens; layer routings [n][k]; token 2 has a dropped assignment at moe layer 1 */
    const int32_t l0[6] = {0, 1, 0, 2, 5, 4}, l1[6] = {3, 4, 3, 4, 1, -1}, l2[6] = {2, 0, 1, 0, 5, 3};
    const int32_t *r[3] = {l0, l1, l2};
    CHECK(moetax_profile_add(p, 3, r) == MOETAX_OK);
    CHECK_EQ_INT(p->tokens, 3);
    CHECK_EQ_INT(p->freq[0 * E + 0], 2);
    CHECK_EQ_INT(p->freq[1 * E + 3], 2);
    CHECK_EQ_INT(p->freq[1 * E + 4], 2);
    int64_t sum1 = 0;
    for (int e = 0; e < E; e++) sum1 += p->freq[1 * E + e];
    CHECK_EQ_INT(sum1, 5); /* 3 x 2 less the dropped one */
    CHECK_EQ_INT(p->co[(0 * E + 0) * E + 1], 1);
    CHECK_EQ_INT(p->co[(0 * E + 1) * E + 0], 1); /* symmetric */
    CHECK_EQ_INT(p->co[(0 * E + 0) * E + 0], 0); /* zero diagonal */
    CHECK_EQ_INT(p->trans[(0 * E + 0) * E + 3], 2); /* tokens 0 and 1: 0 -> 3 */
    CHECK_EQ_INT(p->trans[(0 * E + 5) * E + 1], 1);
    for (int i = 0; i < E; i++) { /* row i of a transition sums to freq[i] x (the token's experts at the next layer) */
        int64_t row = 0;
        for (int j = 0; j < E; j++) row += p->trans[(1 * E + i) * E + j];
        CHECK_EQ_INT(row, p->freq[1 * E + i] * k);
    }
    const int32_t bad[6] = {0, 9, 0, 1, 0, 1};
    const int32_t *rb[3] = {bad, l1, l2};
    CHECK(moetax_profile_add(p, 3, rb) == MOETAX_ERR_ARG);
    CHECK_EQ_INT(p->tokens, 3); /* nothing counted */
    const char *path = tu_path("profile_rt.json");
    CHECK(moetax_profile_write(p, path) == MOETAX_OK);
    struct moetax_profile *q = NULL;
    CHECK(moetax_profile_load(path, &q) == MOETAX_OK);
    if (q) {
        CHECK_EQ_INT(q->tokens, 3);
        CHECK_EQ_INT(q->n_moe, 3);
        CHECK_EQ_INT(q->moe_layer[2], 4);
        CHECK(!memcmp(q->freq, p->freq, sizeof(int64_t) * 3 * E));
        CHECK(!memcmp(q->co, p->co, sizeof(int64_t) * 3 * E * E));
        CHECK(!memcmp(q->trans, p->trans, sizeof(int64_t) * 2 * E * E));
    }
    moetax_profile_free(q);
    /* the same from the parsed document */
    json_t *doc = json_load_file(path, 0, NULL);
    q = NULL;
    CHECK(doc && moetax_profile_from_json(doc, "doc", &q) == MOETAX_OK);
    if (q) {
        CHECK(!strcmp(q->model, "m") && q->tokens == 3 && q->n_moe == 3);
        CHECK(!memcmp(q->freq, p->freq, sizeof(int64_t) * 3 * E));
        CHECK(!memcmp(q->trans, p->trans, sizeof(int64_t) * 2 * E * E));
    }
    moetax_profile_free(q);
    json_decref(doc);
    moetax_profile_free(p);
}

static void malformed(void) {
    static const struct { const char *text, *field; } cases[] = {
        {"{\"moetax_profile\": 2}", "moetax_profile"},
        {"{\"moetax_profile\": 1, \"n_layer\": 2, \"n_expert\": 2, \"n_expert_used\": 1, \"tokens\": 3, \"layers\": "
         "[{\"layer\": 0, \"freq\": [1, 2]}, {\"layer\": 1, \"freq\": [1]}], \"transitions\": "
         "[{\"counts\": [[0, 0], [0, 0]]}]}", "layers[1].freq"},
        {"{\"moetax_profile\": 1, \"n_layer\": 2, \"n_expert\": 2, \"n_expert_used\": 1, \"tokens\": 3, \"layers\": "
         "[{\"layer\": 0, \"freq\": [1, 2]}, {\"layer\": 1, \"freq\": [1, -1]}], \"transitions\": "
         "[{\"counts\": [[0, 0], [0, 0]]}]}", "layers[1].freq"},
        {"{\"moetax_profile\": 1, \"n_layer\": 2, \"n_expert\": 2, \"n_expert_used\": 1, \"tokens\": 3, \"layers\": "
         "[{\"layer\": 1, \"freq\": [1, 2]}, {\"layer\": 0, \"freq\": [1, 1]}], \"transitions\": "
         "[{\"counts\": [[0, 0], [0, 0]]}]}", "ascending"},
        {"{\"moetax_profile\": 1, \"n_layer\": 2, \"n_expert\": 2, \"n_expert_used\": 1, \"tokens\": 3, \"layers\": "
         "[{\"layer\": 0, \"freq\": [1, 2]}, {\"layer\": 1, \"freq\": [1, 1]}], \"transitions\": []}", "transitions"},
        {"{\"moetax_profile\": 1, \"n_layer\": 2, \"n_expert\": 2, \"n_expert_used\": 1, \"tokens\": 3, \"layers\": "
         "[{\"layer\": 0, \"freq\": [1, 2]}, {\"layer\": 1, \"freq\": [1, 1]}], \"transitions\": "
         "[{\"counts\": [[0, 0]]}]}", "transitions[0].counts"},
        {"{\"moetax_profile\": 1, ", "not valid JSON"},
        /* a layer that is not an integer (it read as layer 0) */
        {"{\"moetax_profile\": 1, \"n_layer\": 3, \"n_expert\": 2, \"n_expert_used\": 1, \"tokens\": 3, \"layers\": "
         "[{\"layer\": 2.0, \"freq\": [1, 2]}], \"transitions\": []}", "layers[0].layer"},
        {"{\"moetax_profile\": 1, \"n_layer\": 3, \"n_expert\": 2, \"n_expert_used\": 1, \"tokens\": 3, \"layers\": "
         "[{\"layer\": \"2\", \"freq\": [1, 2]}], \"transitions\": []}", "layers[0].layer"},
        {"{\"moetax_profile\": 1, \"n_layer\": 3, \"n_expert\": \"2\", \"n_expert_used\": 1, \"tokens\": 3, "
         "\"layers\": [{\"layer\": 2, \"freq\": [1, 2]}], \"transitions\": []}", "n_expert"},
        {"{\"moetax_profile\": 1, \"n_layer\": 3, \"n_expert\": 2, \"n_expert_used\": 1, \"layers\": "
         "[{\"layer\": 2, \"freq\": [1, 2]}], \"transitions\": []}", "tokens"},
        /* more routings than the tokens allow; counts whose sum overflows 64 bits */
        {"{\"moetax_profile\": 1, \"n_layer\": 3, \"n_expert\": 2, \"n_expert_used\": 1, \"tokens\": 2, \"layers\": "
         "[{\"layer\": 2, \"freq\": [1, 2]}], \"transitions\": []}", "layers[0].freq: the counts add up"},
        {"{\"moetax_profile\": 1, \"n_layer\": 3, \"n_expert\": 2, \"n_expert_used\": 1, \"tokens\": 3, \"layers\": "
         "[{\"layer\": 2, \"freq\": [9000000000000000000, 9000000000000000000]}], \"transitions\": []}",
         "layers[0].freq: the counts add up"},
        {"{\"moetax_profile\": 1, \"n_layer\": 2, \"n_expert\": 2, \"n_expert_used\": 1, \"tokens\": 3, \"layers\": "
         "[{\"layer\": 0, \"freq\": [1, 2]}, {\"layer\": 1, \"freq\": [1, 1]}], \"transitions\": "
         "[{\"counts\": [[2, 1], [0, 1]]}]}", "transitions[0].counts: the counts add up"},
        /* 65536 experts with arrays of 2: refused by shape, before E x E counts are allocated */
        {"{\"moetax_profile\": 1, \"n_layer\": 2, \"n_expert\": 65536, \"n_expert_used\": 1, \"tokens\": 3, "
         "\"layers\": [{\"layer\": 0, \"freq\": [1, 2]}, {\"layer\": 1, \"freq\": [1, 1]}], \"transitions\": "
         "[{\"counts\": [[0, 0], [0, 0]]}]}", "layers[0].freq: expected an array of 65536 counts"},
        {"[1, 2]", "top level"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        const char *path = tu_path("profile_bad.json");
        FILE *f = fopen(path, "w");
        if (!f) { CHECK(0); continue; }
        fputs(cases[i].text, f);
        fclose(f);
        struct moetax_profile *p = NULL;
        moetax_status st = moetax_profile_load(path, &p);
        CHECK_MSG(st != MOETAX_OK && p == NULL && strstr(moetax_last_error(), cases[i].field),
                  "case %zu: %s (wanted %s)", i, moetax_last_error(), cases[i].field);
        moetax_profile_free(p);
        json_t *doc = json_loads(cases[i].text, 0, NULL);
        if (!doc) continue; /* the case of text that is not JSON */
        p = (struct moetax_profile *)1;
        st = moetax_profile_from_json(doc, "doc.json", &p);
        CHECK_MSG(st == MOETAX_ERR_FORMAT && p == NULL && strstr(moetax_last_error(), "doc.json: ") &&
                      strstr(moetax_last_error(), cases[i].field),
                  "case %zu from the document: %s (wanted %s)", i, moetax_last_error(), cases[i].field);
        json_decref(doc);
    }
}

int main(int argc, char **argv) {
    tu_init(argc, argv);
    counts_and_roundtrip();
    malformed();
    return tu_finish("test_profile");
}
