/*
 * hparams.c - the rules for the values of a model's float hyper-parameters, in
 * one place: the loader (src/model/arch_*.c) applies them to what it derived from a
 * file, `moetax gen` (gen.c) to what it is about to write. A value outside its
 * range is refused with a message naming the metadata key, the value and the
 * range; the ranges are wide enough for every published DeepSeek2/V3 file and
 * narrow enough that no value makes the forward pass divide by zero, take the
 * log of a negative number or scale the attention by NaN.
 */
#include <math.h>

#include "moetax/model.h"

/* One rule: the key it is stored under (after "<arch>."), the value checked and
 * its closed range (lo_open: lo itself excluded). derived: the value is computed
 * from the key (named so in the message); inverse: the key holds 1/value. */
struct rule {
    const char *key;
    float value;
    double lo, hi;
    bool lo_open;
    const char *expected;
    const char *derived;
    bool inverse;
};

moetax_status moetax_hparams_check(const struct moetax_hparams *hp, const char *where) {
    const bool moe = hp->n_expert > 0;
    const struct rule rules[] = {
        {.key = "attention.layer_norm_rms_epsilon", .value = hp->rms_eps, .lo = 0.0, .hi = 1.0, .lo_open = true,
         .expected = "in (0, 1]"},
        {.key = "rope.freq_base", .value = hp->rope_freq_base, .lo = 1.0, .hi = 1e12, .expected = "in [1, 1e12]"},
        /* freq_scale is 1/rope.scaling.factor (1 when the file has none) */
        {.key = "rope.scaling.factor", .value = hp->rope_freq_scale, .lo = 0.0, .hi = 1.0, .lo_open = true,
         .expected = "0 (none) or >= 1", .inverse = true},
        {.key = "rope.scaling.yarn_ext_factor", .value = hp->rope_ext_factor, .lo = 0.0, .hi = 1.0,
         .expected = "in [0, 1]"},
        {.key = "rope.scaling.attn_factor", .value = hp->rope_attn_factor, .lo = 0.0, .hi = 100.0, .lo_open = true,
         .expected = "in (0, 100]", .derived = "attention factor (with the YaRN correction)"},
        {.key = "rope.scaling.yarn_beta_fast", .value = hp->rope_beta_fast, .lo = -1e6, .hi = 1e6,
         .expected = "finite, |x| <= 1e6"},
        {.key = "rope.scaling.yarn_beta_slow", .value = hp->rope_beta_slow, .lo = -1e6, .hi = 1e6,
         .expected = "finite, |x| <= 1e6"},
        /* mscale^2 / sqrt(head dim): rope.scaling.yarn_log_multiplier and attn_factor enter it */
        {.key = "rope.scaling.yarn_log_multiplier", .value = hp->kq_scale, .lo = 0.0, .hi = 1e4, .lo_open = true,
         .expected = "in (0, 1e4]", .derived = "attention scale mscale^2/sqrt(head dim)"},
        {.key = "expert_weights_scale", .value = moe ? hp->expert_weights_scale : 1.0f, .lo = 0.0, .hi = 1e4,
         .lo_open = true, .expected = "in (0, 1e4]"},
    };
    for (size_t i = 0; i < sizeof rules / sizeof rules[0]; i++) {
        const struct rule *r = &rules[i];
        const double v = r->value;
        const bool ok = isfinite(v) && (r->lo_open ? v > r->lo : v >= r->lo) && v <= r->hi;
        if (ok) continue;
        const char *arch = hp->arch[0] ? hp->arch : "deepseek2";
        if (r->derived)
            return moetax_error(MOETAX_ERR_FORMAT, "%s: %s.%s gives %s %g: expected %s", where, arch, r->key,
                                r->derived, v, r->expected);
        return moetax_error(MOETAX_ERR_FORMAT, "%s: %s.%s = %g: expected %s", where, arch, r->key,
                            r->inverse && v != 0.0 ? 1.0 / v : v, r->expected);
    }
    return MOETAX_OK;
}
