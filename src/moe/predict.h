/* predict.h - the learned expert predictor in the MoE block (src/moe/predict.c): features from
 * the residual, the predictor's scores against the routing, the fit's sums, and the prediction
 * the store's prefetch reads. The predictor is the one attached to the block's expert store
 * (moetax_store_set_predictor); without one this does nothing. Internal. */
#ifndef MOETAX_MOE_PREDICT_H
#define MOETAX_MOE_PREDICT_H

#include "moe/moe.h"

struct moetax_predictor;

/* Worker 0, once layer il is routed (b->router: its logits, b->sel: its experts) and after the
 * router guess for il + 1 was made (b->pred, when b->pred_ok[il + 1]): scores the predictions
 * of layer il (router guess and learned), adds the fit's sums when fitting, and, when the
 * predictor drives the prefetch, replaces the guess for il + 1 with the learned one. */
void moe_predict_learned(const struct fw_step *s, struct moe *b, int il);

/* Router logits of layer `layer` as F32 rows [n_expert][n_embd] in out (converted from the
 * file's type); false for a dense layer or a type that does not convert. */
bool moe_predict_router_rows(const struct moetax_model *m, int layer, float *out);

/* profile --dump-features: open the feature file (include/moetax/predict.h) at path and write its
 * header from the model; the rows of every MoE layer follow as the model runs. Close with commit
 * (false: the file is removed); *records (may be NULL) the rows written. */
moetax_status moe_predict_dump_open(struct moetax_predictor *p, const struct moetax_model *m, const char *path);
moetax_status moe_predict_dump_close(struct moetax_predictor *p, bool commit, uint64_t *records);

#endif
