/*
 * server/special_tokens.h - tokenize a rendered chat prompt with its control
 * tokens as single ids.
 *
 * DESIGN
 *   moetax's tokenizer encodes "<|im_start|>" as ordinary bytes (see
 *   moetax/tokenizer.h). A chat template's markers are control (or
 *   user-defined) tokens of the model, so the server splits the rendered
 *   prompt at the texts of those tokens first (at each position the longest
 *   that matches), as llama.cpp does with parse_special, and encodes the text
 *   between them as usual. Only chat prompts go through this; a completion's
 *   prompt is encoded as plain text, exactly as `moetax run` does.
 */
#ifndef MOETAX_SERVER_SPECIAL_TOKENS_H
#define MOETAX_SERVER_SPECIAL_TOKENS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "moetax/gguf.h"
#include "moetax/status.h"
#include "moetax/tokenizer.h"

struct srv_specials;
/* The control and user-defined tokens of g (tokenizer.ggml.tokens / token_type), copied. A file
 * without token types has none (not an error). */
moetax_status srv_specials_load(const struct moetax_gguf *g, struct srv_specials **out);
void srv_specials_free(struct srv_specials *s);
int srv_specials_count(const struct srv_specials *s);
/* Encode len bytes: special token texts as their ids, the rest with moetax_tokenizer_encode (BOS first
 * when add_bos). *ids is malloc'd. s may be NULL (plain encoding). */
moetax_status srv_encode_special(const struct moetax_tokenizer *tok, const struct srv_specials *s, const char *text,
                                 size_t len, bool add_bos, int32_t **ids, int64_t *n);

#endif
