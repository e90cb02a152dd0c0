/*
 * profile.c - routing profiles: counting, writing and reading (see moetax/profile.h).
 */
#include "moetax/profile.h"

#include <jansson.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/printable.h"
#include "moetax/outfile.h"
#include "moetax/readfile.h"

moetax_status moetax_profile_new(const char *model, int n_layer, const int *moe_layers, int n_moe, int n_expert,
                                 int n_expert_used, struct moetax_profile **out) {
    *out = NULL;
    if (n_moe < 1 || n_expert < 1 || n_expert > 1 << 16 || n_expert_used < 1 || n_expert_used > n_expert)
        return moetax_error(MOETAX_ERR_ARG, "profile: %d MoE layers, %d experts, %d used: a MoE model is needed", n_moe,
                            n_expert, n_expert_used);
    struct moetax_profile *p = calloc(1, sizeof *p);
    if (!p) return moetax_error(MOETAX_ERR_NOMEM, "out of memory");
    snprintf(p->model, sizeof p->model, "%s", model ? model : "");
    p->n_layer = n_layer;
    p->n_moe = n_moe;
    p->n_expert = n_expert;
    p->n_expert_used = n_expert_used;
    const size_t E = (size_t)n_expert;
    p->moe_layer = malloc(sizeof(int) * (size_t)n_moe);
    p->freq = calloc((size_t)n_moe * E, sizeof(int64_t));
    p->trans = calloc((size_t)(n_moe > 1 ? n_moe - 1 : 1) * E * E, sizeof(int64_t));
    p->co = n_expert <= MOETAX_PROFILE_CO_MAX ? calloc((size_t)n_moe * E * E, sizeof(int64_t)) : NULL;
    if (!p->moe_layer || !p->freq || !p->trans || (n_expert <= MOETAX_PROFILE_CO_MAX && !p->co)) {
        moetax_profile_free(p);
        return moetax_error(MOETAX_ERR_NOMEM, "out of memory for a profile of %d layers x %d experts", n_moe, n_expert);
    }
    memcpy(p->moe_layer, moe_layers, sizeof(int) * (size_t)n_moe);
    *out = p;
    return MOETAX_OK;
}

void moetax_profile_free(struct moetax_profile *p) {
    if (!p) return;
    free(p->moe_layer);
    free(p->freq);
    free(p->co);
    free(p->trans);
    free(p);
}

moetax_status moetax_profile_add(struct moetax_profile *p, int64_t n, const int32_t *const *experts) {
    const int64_t E = p->n_expert, k = p->n_expert_used;
    for (int m = 0; m < p->n_moe; m++)
        for (int64_t i = 0; i < n * k; i++)
            if (experts[m][i] >= E)
                return moetax_error(MOETAX_ERR_ARG, "profile: expert %d at MoE layer %d is outside 0..%lld", experts[m][i],
                                    m, (long long)E - 1);
    for (int64_t t = 0; t < n; t++)
        for (int m = 0; m < p->n_moe; m++) {
            const int32_t *s = experts[m] + t * k, *s2 = m + 1 < p->n_moe ? experts[m + 1] + t * k : NULL;
            for (int64_t a = 0; a < k; a++) {
                if (s[a] < 0) continue;
                p->freq[m * E + s[a]]++;
                if (p->co)
                    for (int64_t b = 0; b < k; b++)
                        if (b != a && s[b] >= 0) p->co[(m * E + s[a]) * E + s[b]]++;
                if (s2)
                    for (int64_t b = 0; b < k; b++)
                        if (s2[b] >= 0) p->trans[(m * E + s[a]) * E + s2[b]]++;
            }
        }
    p->tokens += n;
    return MOETAX_OK;
}

static json_t *int_row(const int64_t *v, int64_t n) {
    json_t *a = json_array();
    for (int64_t i = 0; i < n; i++) json_array_append_new(a, json_integer(v[i]));
    return a;
}

static json_t *int_matrix(const int64_t *v, int64_t n) {
    json_t *a = json_array();
    for (int64_t i = 0; i < n; i++) json_array_append_new(a, int_row(v + i * n, n));
    return a;
}

moetax_status moetax_profile_write(const struct moetax_profile *p, const char *path) {
    const int64_t E = p->n_expert;
    json_t *o = json_object(), *layers = json_array(), *trans = json_array();
    json_object_set_new(o, "moetax_profile", json_integer(1));
    json_object_set_new(o, "model", json_string(p->model));
    json_object_set_new(o, "n_layer", json_integer(p->n_layer));
    json_object_set_new(o, "n_expert", json_integer(p->n_expert));
    json_object_set_new(o, "n_expert_used", json_integer(p->n_expert_used));
    json_object_set_new(o, "tokens", json_integer(p->tokens));
    for (int m = 0; m < p->n_moe; m++) {
        json_t *l = json_object();
        json_object_set_new(l, "layer", json_integer(p->moe_layer[m]));
        json_object_set_new(l, "freq", int_row(p->freq + m * E, E));
        json_object_set_new(l, "co", p->co ? int_matrix(p->co + m * E * E, E) : json_null());
        json_array_append_new(layers, l);
    }
    for (int m = 0; m + 1 < p->n_moe; m++) {
        json_t *t = json_object();
        json_object_set_new(t, "from", json_integer(p->moe_layer[m]));
        json_object_set_new(t, "to", json_integer(p->moe_layer[m + 1]));
        json_object_set_new(t, "counts", int_matrix(p->trans + m * E * E, E));
        json_array_append_new(trans, t);
    }
    json_object_set_new(o, "layers", layers);
    json_object_set_new(o, "transitions", trans);
    moetax_status st = moetax_outfile_write_json(path, o, JSON_COMPACT, "the profile");
    json_decref(o);
    return st;
}

static moetax_status bad(const char *path, const char *where, const char *what) {
    return moetax_error(MOETAX_ERR_FORMAT, "%s: %s: %s", path, where, what);
}

/* Is a an array of n entries, each (cols > 0) an array of cols? Checked before anything of that
 * size is allocated. */
static moetax_status shape(const char *path, const char *where, const json_t *a, int64_t n, int64_t cols) {
    bool ok = json_is_array(a) && (int64_t)json_array_size(a) == n;
    for (int64_t i = 0; ok && cols > 0 && i < n; i++) {
        const json_t *r = json_array_get(a, (size_t)i);
        ok = json_is_array(r) && (int64_t)json_array_size(r) == cols;
    }
    if (ok) return MOETAX_OK;
    char what[96];
    if (cols > 0) snprintf(what, sizeof what, "expected an array of %lld arrays of %lld counts", (long long)n, (long long)cols);
    else snprintf(what, sizeof what, "expected an array of %lld counts", (long long)n);
    return bad(path, where, what);
}

/* n counts of array a (its shape checked) into v; each >= 0, their running total within *left */
static moetax_status get_row(const char *path, const char *where, const json_t *a, int64_t n, int64_t *v,
                             int64_t *left, const char *bound) {
    for (int64_t i = 0; i < n; i++) {
        const json_t *x = json_array_get(a, (size_t)i);
        if (!json_is_integer(x) || json_integer_value(x) < 0) return bad(path, where, "expected counts >= 0");
        v[i] = json_integer_value(x);
        if (v[i] > *left) {
            char what[160];
            snprintf(what, sizeof what, "the counts add up to more than %s allows", bound);
            return bad(path, where, what);
        }
        *left -= v[i];
    }
    return MOETAX_OK;
}

static moetax_status get_matrix(const char *path, const char *where, const json_t *a, int64_t n, int64_t *v,
                                int64_t limit, const char *bound) {
    moetax_status st = MOETAX_OK;
    for (int64_t i = 0; i < n && !st; i++)
        st = get_row(path, where, json_array_get(a, (size_t)i), n, v + i * n, &limit, bound);
    return st;
}

/* an integer member within lo..hi */
static moetax_status get_int(const char *path, const json_t *o, const char *key, int64_t lo, int64_t hi, int64_t *v) {
    const json_t *x = json_object_get(o, key);
    if (!json_is_integer(x) || json_integer_value(x) < lo || json_integer_value(x) > hi) {
        char what[96];
        snprintf(what, sizeof what, "expected an integer in %lld..%lld", (long long)lo, (long long)hi);
        return bad(path, key, what);
    }
    *v = json_integer_value(x);
    return MOETAX_OK;
}

moetax_status moetax_profile_from_json(const json_t *o, const char *path, struct moetax_profile **out) {
    *out = NULL;
    moetax_status st = MOETAX_OK;
    struct moetax_profile *p = NULL;
    int64_t version = 0, E = 0, k = 0, L = 0, tokens = 0;
    const json_t *layers = json_object_get(o, "layers"), *trans = json_object_get(o, "transitions");
    if (!json_is_object(o)) st = bad(path, "top level", "expected an object");
    else if (get_int(path, o, "moetax_profile", 1, 1, &version)) st = bad(path, "moetax_profile", "expected 1");
    else if ((st = get_int(path, o, "n_layer", 1, 1 << 16, &L)) || (st = get_int(path, o, "n_expert", 1, 1 << 16, &E)) ||
             (st = get_int(path, o, "n_expert_used", 1, E, &k)) ||
             (st = get_int(path, o, "tokens", 0, (int64_t)1 << 40, &tokens))) {
    } else if (!json_is_array(layers) || json_array_size(layers) < 1 || (int64_t)json_array_size(layers) > L)
        st = bad(path, "layers", "expected an array of 1..n_layer MoE layers");
    else if (!json_is_array(trans) || json_array_size(trans) + 1 != json_array_size(layers))
        st = bad(path, "transitions", "expected one per pair of consecutive MoE layers");
    const int n_moe = st ? 0 : (int)json_array_size(layers);
    int *ml = st ? NULL : malloc(sizeof(int) * (size_t)n_moe);
    if (!st && !ml) st = moetax_error(MOETAX_ERR_NOMEM, "out of memory");
    char w[64];
    for (int m = 0; !st && m < n_moe; m++) { /* the layers and every array's shape, before allocating */
        const json_t *l = json_array_get(layers, (size_t)m), *x = json_object_get(l, "layer"), *co = json_object_get(l, "co");
        snprintf(w, sizeof w, "layers[%d].layer", m);
        if (!json_is_integer(x) || json_integer_value(x) < 0 || json_integer_value(x) >= L ||
            (m > 0 && json_integer_value(x) <= ml[m - 1]))
            st = bad(path, w, "expected ascending integer layers within 0..n_layer-1");
        else ml[m] = (int)json_integer_value(x);
        snprintf(w, sizeof w, "layers[%d].freq", m);
        if (!st) st = shape(path, w, json_object_get(l, "freq"), E, 0);
        snprintf(w, sizeof w, "layers[%d].co", m);
        if (!st && E <= MOETAX_PROFILE_CO_MAX && co && !json_is_null(co)) st = shape(path, w, co, E, E);
        snprintf(w, sizeof w, "transitions[%d].counts", m);
        if (!st && m + 1 < n_moe) st = shape(path, w, json_object_get(json_array_get(trans, (size_t)m), "counts"), E, E);
    }
    const json_t *mj = json_object_get(o, "model");
    if (!st && mj && !json_is_string(mj)) st = bad(path, "model", "expected a string (the model's file name)");
    if (!st) st = moetax_profile_new(json_string_value(mj), (int)L, ml, n_moe, (int)E, (int)k, &p);
    if (p) /* printed by report: no control bytes on a terminal */
        moetax_printable(p->model, sizeof p->model, p->model, SIZE_MAX, 0);
    /* every token adds k to a layer's frequencies and at most k x k to its co-occurrences and
     * transitions: larger totals are damage (and would overflow the report's sums) */
    const int64_t per_layer = tokens * k, per_pair = k && tokens > INT64_MAX / (k * k) ? INT64_MAX : tokens * k * k;
    for (int m = 0; !st && m < n_moe; m++) {
        const json_t *l = json_array_get(layers, (size_t)m), *co = json_object_get(l, "co");
        int64_t left = per_layer;
        snprintf(w, sizeof w, "layers[%d].freq", m);
        st = get_row(path, w, json_object_get(l, "freq"), E, p->freq + m * E, &left, "tokens x n_expert_used");
        snprintf(w, sizeof w, "layers[%d].co", m);
        if (!st && p->co && co && !json_is_null(co))
            st = get_matrix(path, w, co, E, p->co + m * E * E, per_pair, "tokens x n_expert_used^2");
    }
    for (int m = 0; !st && m + 1 < n_moe; m++) {
        snprintf(w, sizeof w, "transitions[%d].counts", m);
        st = get_matrix(path, w, json_object_get(json_array_get(trans, (size_t)m), "counts"), E, p->trans + m * E * E,
                        per_pair, "tokens x n_expert_used^2");
    }
    if (!st) p->tokens = tokens;
    free(ml);
    if (st) {
        moetax_profile_free(p);
        return st;
    }
    *out = p;
    return MOETAX_OK;
}

moetax_status moetax_profile_load(const char *path, struct moetax_profile **out) {
    *out = NULL;
    char *buf = NULL;
    size_t len = 0;
    /* through the reader: a missing file, a directory or a device get its messages, not Jansson's */
    const struct moetax_readfile_params rp = {.max_bytes = MOETAX_PROFILE_MAX_BYTES, .text = true}; /* JSON holds no NUL */
    moetax_status st = moetax_readfile_path(path, &rp, &buf, &len);
    if (st == MOETAX_ERR_LIMIT)
        return moetax_error(MOETAX_ERR_LIMIT, "%s: larger than %d MiB, the most a routing profile is read to", path,
                            (int)(MOETAX_PROFILE_MAX_BYTES >> 20));
    if (st) return st;
    json_error_t je;
    json_t *o = json_loadb(buf, len, 0, &je);
    free(buf);
    if (!o) return moetax_error(MOETAX_ERR_FORMAT, "%s: line %d: not valid JSON: %s", path, je.line, je.text);
    st = moetax_profile_from_json(o, path, out);
    json_decref(o);
    return st;
}
