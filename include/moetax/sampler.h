/*
 * moetax/sampler.h - pick the next token from a row of logits.
 *
 * DESIGN
 *   The chain is llama.cpp's common sampler order (common/sampling.cpp default
 *   "penalties;dry;top_n_sigma;top_k;typ_p;top_p;min_p;xtc;temperature", then
 *   the seeded "dist" draw), restricted to the stages moetax has:
 *     1. repetition penalty: each distinct token among the last repeat_last_n
 *        accepted tokens has its logit divided by repeat_penalty if positive,
 *        multiplied by it if <= 0 (llama.cpp's fix of the CTRL rule);
 *     2. top-k: keep the k largest logits (a heap selection, O(n log k); ties
 *        go to the lower id). A logit enters the heap only if it is larger
 *        than the worst kept, which a vector compare finds 4 logits at a time,
 *        so the candidates of the whole vocabulary are never written out; with
 *        the penalty, stages 1 and 2 run on a copy of the logits;
 *     3. top-p: softmax over what is left, keep the smallest prefix in
 *        descending order whose probability sum reaches top_p (the token that
 *        crosses it is kept; at least one token). Without top-k the prefix is
 *        found by quickselect on the probability mass (expected O(n)), not by
 *        sorting the whole vocabulary;
 *     4. min-p: keep tokens with p >= min_p * p_max, i.e. logit >= max_logit +
 *        log(min_p);
 *     5. temperature: logits / temp;
 *     6. draw from the softmax of what is left with a xoshiro256** generator
 *        seeded from seed (splitmix64), so a seed gives the same sequence.
 *   Note top-p and min-p see the distribution before temperature, as in
 *   llama.cpp. temp <= 0 is greedy: the argmax of the penalized logits (ties:
 *   lower id), the filters do not matter and the generator is not advanced.
 *
 *   Parameters: temp <= 0 greedy; top_k <= 0 off; top_p == 1 off; min_p <= 0
 *   off; repeat_penalty == 1 or repeat_last_n == 0 off. Rejected with
 *   MOETAX_ERR_ARG (the message names the field): a NaN or infinite temp,
 *   top_p NaN or outside (0, 1], min_p NaN or > 1, repeat_penalty NaN,
 *   infinite or <= 0, repeat_last_n < 0 or > 1 << 20, n_vocab <= 0.
 *
 * INVARIANTS
 *   - moetax_sampler_sample never modifies the logits; NaN logits count as
 *     -inf; if no logit is finite, or the largest is +inf, the result is the
 *     argmax (lowest id among ties; 0 if all are NaN or -inf).
 *   - The result is always in [0, n_vocab) and is never a token excluded by
 *     an enabled filter.
 *   - A sampler holds scratch memory of O(n_vocab) allocated once by init;
 *     sample does not allocate. One sampler per sequence; not thread-safe.
 */
#ifndef MOETAX_SAMPLER_H
#define MOETAX_SAMPLER_H

#include <stdint.h>

#include "moetax/status.h"

#ifdef __cplusplus
extern "C" {
#endif

struct moetax_sampler_params {
    float temp;             /* <= 0: greedy */
    int32_t top_k;          /* <= 0: off */
    float top_p;            /* 1: off; (0, 1] */
    float min_p;            /* <= 0: off; <= 1 */
    float repeat_penalty;   /* 1: off; > 0 */
    int32_t repeat_last_n;  /* tokens of history the penalty looks at; 0: off */
    uint64_t seed;
};

/* llama.cpp's defaults: temp 0.8, top_k 40, top_p 0.95, min_p 0.05,
 * repeat_penalty 1 (off), repeat_last_n 64, seed 0. */
struct moetax_sampler_params moetax_sampler_default_params(void);

struct moetax_sampler;

moetax_status moetax_sampler_init(const struct moetax_sampler_params *p, int32_t n_vocab,
                                  struct moetax_sampler **out);
void moetax_sampler_free(struct moetax_sampler *s);

/* Sample from logits[n_vocab] (not modified). */
int32_t moetax_sampler_sample(struct moetax_sampler *s, const float *logits);
/* Record a token in the history for the repetition penalty (ids outside
 * [0, n_vocab) are ignored). */
void moetax_sampler_accept(struct moetax_sampler *s, int32_t tok);
/* Clear the history and reseed the generator from params.seed. */
void moetax_sampler_reset(struct moetax_sampler *s);

#ifdef __cplusplus
}
#endif
#endif
