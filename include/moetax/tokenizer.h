/*
 * moetax/tokenizer.h - byte-level BPE ("gpt2") and SentencePiece ("llama")
 * tokenizers read from GGUF metadata.
 *
 * DESIGN
 *   moetax_tokenizer_load reads the tokenizer.ggml.* keys of an open GGUF file
 *   (shared/docs/GGUF-MOE.md, "Tokenizer metadata") and copies what it needs,
 *   so the GGUF handle may be closed afterwards. tokenizer.ggml.model = "gpt2"
 *   (below) and "llama" (SentencePiece, see SPM at the end of this block) are
 *   supported; any other model ("bert", "t5", ...) gives MOETAX_ERR_UNSUPPORTED
 *   naming the model.
 *
 *   Tokens are stored in GPT-2's byte-to-unicode encoding: the printable bytes
 *   '!'..'~', 0xA1..0xAC and 0xAE..0xFF stand for themselves, the other 68
 *   bytes map in order to U+0100..U+0143. Merge i ("left right") has rank i;
 *   lower ranks merge first.
 *
 *   encode = pre-tokenize, then BPE within each pre-token:
 *     1. Pre-tokenization follows GPT-2's regex
 *          's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
 *        hand-written in C over code points. For valid UTF-8 it splits exactly
 *        as Python's `regex` module does (findall; the first alternative that
 *        matches wins, runs are greedy, ` ?` is one U+0020 SPACE, `\s+(?!\S)`
 *        gives back the last white-space code point when a non-space follows,
 *        the contractions are ASCII lower case only). \p{L}, \p{N} and \s are
 *        the regex module's own tables (src/runtime/unicode_classes.h, generated
 *        from the module by tools/train/gen_unicode_tables.py; the Unicode
 *        version is named there); everything else, combining marks \p{M}
 *        included, is "other". Checked against tools/train/bpe.py by
 *        tests/test_tokenizer_gpt2.py. Bytes that are not valid UTF-8 (no
 *        Python text holds them): a byte that does not start a valid sequence
 *        (shortest form, not a surrogate, at most U+10FFFF) is one code point of
 *        class "other" on its own, which is also how the regex splits Python's
 *        errors="surrogateescape" decoding of such bytes.
 *        tokenizer.ggml.pre picks the rule set as llama.cpp maps the names
 *        (src/runtime/tokenizer.c, pre_names): GPT-2's above for "default", "gpt2",
 *        "gpt-2", "olmo", "mpt", "phi-2", ...; llama.cpp's own scanners for
 *        "llama3"/"llama-bpe"/... (digits in threes) and "qwen2"/... (single
 *        digits); llama.cpp's regex lists for "deepseek-llm", "deepseek-coder" and
 *        "deepseek-v3" (each regex splits the pieces the previous one left, with
 *        llama.cpp's std::regex class semantics: tokenizer.c says which). For
 *        these, text is decoded as llama.cpp does (a bad byte becomes U+FFFD).
 *        Any other value warns on stderr (once per process), naming it and the
 *        rule used instead (GPT-2's). Checked against llama.cpp's test-tokenizer-0
 *        suites by tests/test_tokenizer_llama.c (gpt-2, deepseek-llm,
 *        deepseek-coder, llama-spm pass 100%). llama3's ignore_merges (the
 *        pre-tokenizers llama.cpp gives it: llama3, llama-v3, llama-bpe, falcon3,
 *        falcon-h1, pixtral, midm-2.0, lfm2): a pre-token whose bytes are the
 *        decoded text of a normal/byte/user-defined token is that token, unmerged
 *        (the llama-bpe suite's vocabulary is not in the mirror; not run).
 *        User-defined tokens (type 4) are cut out of the text first, longest
 *        text first, as llama.cpp does with parse_special = false.
 *     2. Each pre-token starts as one byte token per byte and the adjacent pair
 *        with the lowest merge rank is merged until no pair has a merge (ties:
 *        the leftmost pair). A hash map from (left id, right id) to (rank,
 *        result id) makes this O(n log n) per pre-token (a plain scan for short
 *        ones).
 *        (A single pre-token longer than 1 GiB is merged in 1 GiB pieces.)
 *   Every byte has a token (checked at load), so any byte string encodes,
 *   including bytes that are not valid UTF-8, and decode(encode(x)) == x.
 *
 *   Special tokens: control (token_type 3), unused (5) and unknown (2) tokens
 *   never come out of encoding plain text; a merge whose result is such a token
 *   is ignored. Text such as "<|end_of_text|>" is NOT parsed as a special token
 *   (it encodes as ordinary bytes); add BOS with add_bos, or append control ids
 *   yourself. User-defined tokens (4) are split out of the text first (see 1.).
 *
 *   Decoding: normal (1), byte (6), undefined (0) and out-of-range types decode
 *   byte-level (each code point of the token text back to its byte; a code
 *   point outside the mapping, or a byte that is not valid UTF-8, is copied as
 *   is); user-defined (4) tokens give their text unchanged; control, unused and
 *   unknown tokens give "" (llama.cpp's token_to_piece with special = false).
 *
 *   add_bos (llama.cpp facts): tokenizer.ggml.add_bos_token if the key is
 *   present; otherwise false for "gpt2", except true for the pre-tokenizers for
 *   which llama.cpp turns it on (llama3, llama-v3, llama-bpe, falcon3,
 *   falcon-h1, pixtral, midm-2.0, lfm2, tekken, chameleon). Always false when
 *   there is no BOS token. Files written by `moetax gen` set the key to true.
 *
 *   SPM ("llama", llama.cpp's llm_tokenizer_spm): tokenizer.ggml.scores (float32,
 *   one per token; all 0 without the key), token_type as above,
 *   tokenizer.ggml.add_space_prefix (default true), add_bos default true.
 *   After the user-defined tokens are cut out, each raw fragment gets a space in
 *   front when add_space_prefix holds and it is the first fragment or follows a
 *   token (as llama.cpp does, even without BOS), every space becomes U+2581,
 *   and the text is split into symbols by UTF-8 lead byte alone (0xC0-0xDF: 2,
 *   0xE0-0xEF: 3, 0xF0-0xFF: 4 bytes, clipped at the end; no other check). A
 *   priority queue of adjacent pairs whose joined text is a (non-control,
 *   non-unused, non-unknown) token merges the highest score first, the leftmost
 *   on ties (an entry is stale when its two symbols' lengths no longer add up).
 *   Each final symbol is its token, or else one token per byte: "<0xXX>", else
 *   the one-byte token, else unknown (load fails if a byte has none of these).
 *   Decoding: normal and undefined tokens with U+2581 back to a space, byte
 *   tokens "<0xXX>" to their byte, user-defined as is, control/unused/unknown
 *   "". moetax_tokenizer_decode with add_space_prefix drops one leading space of
 *   the first token, or of the second when the first is BOS, so
 *   decode(encode(x)) == x for valid UTF-8 without U+2581 and without
 *   user-defined tokens (after one, the text gets a space in front again).
 *   token_to_bytes keeps the space (" Hello"), for streaming. Invalid UTF-8 is
 *   not round-tripped exactly: a lead byte before a space swallows bytes of its
 *   U+2581 (llama.cpp does the same).
 *
 * VALIDATION (load)
 *   A missing required key (tokenizer.ggml.model, .tokens, .merges for gpt2)
 *   gives MOETAX_ERR_NOT_FOUND; a key of the wrong type, a token count of 0 or
 *   over INT32_MAX, a token_type array of the wrong length, a merge that is not
 *   "left right" or whose left, right or joined text is not a token, a missing
 *   byte token, or a bos/eos/eot/eom id outside [0, n_vocab) gives
 *   MOETAX_ERR_FORMAT. Messages name the key and the index. An id of -1 means
 *   "none". token_type is optional (all tokens normal without it).
 *
 * INVARIANTS
 *   - A loaded tokenizer is immutable: encode/decode may run concurrently from
 *     several threads (encode allocates its own scratch memory).
 *   - encode only produces ids of non-control, non-unused, non-unknown tokens,
 *     plus BOS in front when asked (SPM: plus unknown for a byte without a
 *     byte token).
 *   - Output buffers: encode and decode never write past cap; when cap is too
 *     small they return MOETAX_ERR_LIMIT and set *n_out to the size needed, so
 *     a caller can query the size with cap = 0.
 *   - The tokenizer does not check that n_vocab matches the model's
 *     token_embd rows; the model loader does.
 */
#ifndef MOETAX_TOKENIZER_H
#define MOETAX_TOKENIZER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "moetax/gguf.h"
#include "moetax/status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* token_type values (llama.cpp's llama_token_type). */
enum moetax_token_type {
    MOETAX_TOKEN_TYPE_UNDEFINED = 0,
    MOETAX_TOKEN_TYPE_NORMAL = 1,
    MOETAX_TOKEN_TYPE_UNKNOWN = 2,
    MOETAX_TOKEN_TYPE_CONTROL = 3,
    MOETAX_TOKEN_TYPE_USER_DEFINED = 4,
    MOETAX_TOKEN_TYPE_UNUSED = 5,
    MOETAX_TOKEN_TYPE_BYTE = 6,
};

struct moetax_tokenizer;

/* Read the tokenizer from g's metadata. On error *out is NULL and
 * moetax_last_error() names the key and index. */
moetax_status moetax_tokenizer_load(const struct moetax_gguf *g, struct moetax_tokenizer **out);
void moetax_tokenizer_free(struct moetax_tokenizer *t);

int32_t moetax_tokenizer_n_vocab(const struct moetax_tokenizer *t);
int32_t moetax_tokenizer_bos(const struct moetax_tokenizer *t); /* -1 if none */
int32_t moetax_tokenizer_eos(const struct moetax_tokenizer *t); /* -1 if none */
/* Whether a prompt should start with BOS (see add_bos above). */
bool moetax_tokenizer_add_bos(const struct moetax_tokenizer *t);
/* End of generation: the EOS, EOT (tokenizer.ggml.eot_token_id) or EOM
 * (tokenizer.ggml.eom_token_id) token. False for ids out of range. */
bool moetax_tokenizer_is_eog(const struct moetax_tokenizer *t, int32_t tok);
/* token_type of a token (MOETAX_TOKEN_TYPE_NORMAL when the file has no
 * token_type array); -1 for an id out of range. */
int32_t moetax_tokenizer_token_type(const struct moetax_tokenizer *t, int32_t tok);

/* Encode len bytes of text (any bytes; NUL is an ordinary byte; text may be
 * NULL when len is 0). With add_bos and a BOS token, BOS comes first (with no
 * BOS token, add_bos is ignored). Writes at most cap ids to out (out may be
 * NULL when cap is 0) and sets *n_out to the number of ids of the encoding;
 * MOETAX_ERR_LIMIT if that is more than cap (out then holds the first cap). */
moetax_status moetax_tokenizer_encode(const struct moetax_tokenizer *t, const char *text, size_t len,
                                      bool add_bos, int32_t *out, int64_t cap, int64_t *n_out);

/* The raw bytes a token stands for (see Decoding above; "" for control tokens
 * and for ids out of range). Returns the number of bytes written, or -needed
 * if cap is too small (nothing written then). No NUL terminator. */
int moetax_tokenizer_token_to_bytes(const struct moetax_tokenizer *t, int32_t tok, char *buf, int cap);

/* Concatenated bytes of n tokens. *n_out = bytes of the decoding; a NUL is
 * appended when *n_out < cap (the text itself may contain NUL bytes).
 * MOETAX_ERR_LIMIT if *n_out > cap (buf then holds a prefix), MOETAX_ERR_ARG for
 * an id out of range (the message names its index). */
moetax_status moetax_tokenizer_decode(const struct moetax_tokenizer *t, const int32_t *toks, int64_t n,
                                      char *buf, size_t cap, size_t *n_out);

#ifdef __cplusplus
}
#endif
#endif
