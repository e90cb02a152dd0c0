/* requant.h - routed experts re-quantized in memory at load (moetax_model_params.expert_type:
 * the seeds' "INT8 experts"). Internal to src/model.
 *
 * DESIGN
 *   After every layer is bound and before anything is repacked, each routed expert tensor
 *   (ffn_{gate,up,gate_up,down}_exps) whose type is not the target is converted row by row
 *   with moetax_to_float then moetax_from_float - the very steps `moetax quantize` takes for a
 *   tensor - into one anonymous mapping advised into 2 MiB pages (the model's rep_exp buffer),
 *   then repacked in place when the kernel table reads the target type repacked. The weight
 *   then points at it: type, row and matrix bytes are the target's, file_data is NULL (the
 *   bytes are not the file's), and the file's pages of those tensors are released. Everything
 *   else stays as stored. So a model loaded with expert_type T computes what a file whose
 *   expert tensors `moetax quantize` converted to T computes, bit for bit.
 *
 * INVARIANTS
 *   - Tensors already of the target type are left bound to the file (file_data kept).
 *   - A re-quantized expert has no file bytes: the expert store (which reads experts from the
 *     file) refuses such a model, and prefaulting skips the routed experts' mapping.
 */
#ifndef MOETAX_MODEL_REQUANT_H
#define MOETAX_MODEL_REQUANT_H

#include "moetax/membw.h"
#include "moetax/model.h"

/* Convert the routed experts of m to type `to` (F16, BF16, Q8_0, Q4_0, Q4_K, Q5_K, Q6_K) into
 * *buf (allocated here; freed with the model). MOETAX_ERR_ARG names a type that cannot be a
 * target, MOETAX_ERR_SHAPE the tensor whose rows the target's blocks do not divide. */
moetax_status model_requant_experts(struct moetax_model *m, enum moetax_type to, struct moetax_huge_buf *buf);

/* The file's pages wholly inside [p, p + n) of m's mapping are dropped (a tensor read from a
 * copy from now on: repacked at load, or re-quantized); nothing outside the mapping, nothing
 * when the file is not mapped. */
void moetax_model_release_file_pages(const struct moetax_model *m, const void *p, size_t n);

/* true if some routed expert of m was re-quantized at load (it has no bytes in the file) */
bool model_experts_requantized(const struct moetax_model *m);

#endif
