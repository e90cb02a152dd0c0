/*
 * moetax/profile.h - routing profiles: which experts a model uses on a text.
 *
 * DESIGN
 *   A profile counts, per MoE layer, how often each expert is chosen
 *   (frequencies), how often two experts are chosen for the same token
 *   (co-selection, E x E, kept for E <= MOETAX_PROFILE_CO_MAX), and, for each
 *   pair of consecutive MoE layers, how often expert i at the first and expert
 *   j at the second serve the same token (transitions, E x E). `moetax profile`
 *   builds one from text; `report PROFILE` shows it (heat maps); the expert
 *   store's warm start and predictors read it.
 *
 *   File format (JSON, written with Jansson):
 *     {"moetax_profile": 1, "model": str, "n_layer": int, "n_expert": int,
 *      "n_expert_used": int, "tokens": int,
 *      "layers": [{"layer": int, "freq": [E ints], "co": [[E ints] x E] or null}],
 *      "transitions": [{"from": int, "to": int, "counts": [[E ints] x E]}]}
 *   Layers are the MoE layers in order; transitions join each one to the next.
 *
 * INVARIANTS
 *   - sum of freq over experts = tokens x n_expert_used for every layer (each
 *     token chooses n_expert_used distinct experts; dropped assignments of a
 *     capacity factor are not counted).
 *   - co is symmetric with a zero diagonal. A token counts every pair (i, j)
 *     of its experts at two consecutive MoE layers once, so row i of a
 *     transition sums to freq[i] of the first layer x n_expert_used.
 */
#ifndef MOETAX_PROFILE_H
#define MOETAX_PROFILE_H

#include <stddef.h>
#include <stdint.h>

#include "moetax/status.h"

#ifdef __cplusplus
extern "C" {
#endif

enum { MOETAX_PROFILE_CO_MAX = 128 };

struct moetax_profile {
    char model[256];
    int n_layer, n_expert, n_expert_used;
    int n_moe;          /* MoE layers */
    int *moe_layer;     /* [n_moe] layer index of each */
    int64_t tokens;     /* tokens counted */
    int64_t *freq;      /* [n_moe][E] */
    int64_t *co;        /* [n_moe][E][E] or NULL (E > MOETAX_PROFILE_CO_MAX) */
    int64_t *trans;     /* [n_moe - 1][E][E]: trans[m][i][j] = tokens with i at moe layer m, j at m + 1 */
};

/* An empty profile for a model of n_layer layers, of which moe_layers[0..n_moe) are MoE. */
moetax_status moetax_profile_new(const char *model, int n_layer, const int *moe_layers, int n_moe, int n_expert,
                                 int n_expert_used, struct moetax_profile **out);
void moetax_profile_free(struct moetax_profile *p);
/* Count n tokens: experts[m] is the routing of moe layer m, [n][k] (k = n_expert_used;
 * an expert < 0, a dropped assignment, is skipped). */
moetax_status moetax_profile_add(struct moetax_profile *p, int64_t n, const int32_t *const *experts);
moetax_status moetax_profile_write(const struct moetax_profile *p, const char *path);
/* Read and check a profile (types, shapes, non-negative counts within what its tokens allow);
 * errors name the file and the field. The file is read through moetax_readfile_path: a missing one
 * is MOETAX_ERR_IO, a directory MOETAX_ERR_ARG, more than MOETAX_PROFILE_MAX_BYTES MOETAX_ERR_LIMIT. */
#define MOETAX_PROFILE_MAX_BYTES ((size_t)1 << 30)
moetax_status moetax_profile_load(const char *path, struct moetax_profile **out);
/* The same from a parsed JSON document (a Jansson json_t, e.g. one `report` has read and found a
 * "moetax_profile" key in); name is what the errors call it. The document is only read. */
struct json_t;
moetax_status moetax_profile_from_json(const struct json_t *doc, const char *name, struct moetax_profile **out);

#ifdef __cplusplus
}
#endif
#endif
