/* cli.h - helpers shared by the subcommands: option parsing, sizes, lists,
 * a progress bar, and error reporting. Only the CLI exits; the library returns. */
#ifndef MOETAX_TOOLS_CLI_H
#define MOETAX_TOOLS_CLI_H

#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>

#include <jansson.h>

#include "moetax/status.h"
#include "moetax/model.h"
#include "moetax/types.h"

/* Print "moetax <cmd>: <last error>" (or msg) to stderr; return 1 (for main). */
int cli_fail(const char *cmd, moetax_status st);
int cli_usage_error(const char *cmd, const char *fmt, ...);

/* True if argv[*i] is "-s"/"--long"; then *val gets the next argument (or
 * "--long=value"). Missing value: prints an error and sets *err. */
bool cli_opt(int argc, char **argv, int *i, const char *s, const char *l, const char **val, bool *err);
bool cli_flag(char **argv, int i, const char *s, const char *l);

bool cli_parse_i64(const char *s, int64_t *out);
/* A capacity factor (> 0, or 0 for off where the caller allows it) for the engine's float: false for
 * a *c > 0 whose float is 0 (which is off); above FLT_MAX it becomes inf (off). */
bool cli_capacity_factor_ok(double *c);
/* --experts-used K: a count in 1..256 (the model checks its own limit later); false otherwise. */
bool cli_parse_experts_used(const char *s, int *out);
bool cli_parse_f64(const char *s, double *out);
/* "1024", "64K", "2.5G", "512MiB" -> bytes */
bool cli_parse_size(const char *s, uint64_t *out);
/* "1,2,4" -> up to max ints; returns count or -1 */
int cli_parse_int_list(const char *s, int64_t *out, int max);
/* A -t list of thread counts, each in 1..MOETAX_POOL_MAX_THREADS; returns the
 * count, or prints a usage error for `cmd` and returns -1. */
int cli_parse_threads(const char *cmd, const char *s, int64_t *out, int max);

/* Progress bar on stderr when it is a terminal (or forced with MOETAX_PROGRESS=1). */
typedef struct cli_progress {
    const char *label;
    uint64_t total;
    double t_start, t_last;
    bool enabled;
} cli_progress;
void cli_progress_init(cli_progress *p, const char *label, uint64_t total);
void cli_progress_update(cli_progress *p, uint64_t done);
void cli_progress_done(cli_progress *p);

double cli_now(void); /* monotonic seconds */
/* The p-quantile (0..1, nearest rank) of v[0..n), sorting v in place; 0 when n <= 0. */
double cli_percentile(double *v, int n, double p);

/* The whole file at path ("-": standard input) through moetax_readfile (moetax/readfile.h): a
 * malloc'd buffer with a NUL after its *len bytes (the bytes may hold NULs too), at most max_bytes of
 * it (0: CLI_MAX_INPUT_DEFAULT): more is MOETAX_ERR_LIMIT, naming the file and --max-input-bytes (a
 * device such as /dev/zero never ends). A directory is MOETAX_ERR_ARG; MOETAX_ERR_IO names the file
 * and the system's reason; MOETAX_ERR_NOMEM. moetax_readfile_check_text then says whether the text
 * may be used as a C string. */
#define CLI_MAX_INPUT_DEFAULT ((uint64_t)256 << 20)
/* path itself, or the regular files in the folder path (sorted by name, hidden files skipped):
 * *out[*n_out] strings to free (and the array). */
moetax_status cli_list_inputs(const char *path, char ***out, int *n_out);
/* st again, its message (moetax_last_error) prefixed with "path: " (a writer's error, said with the file). */
moetax_status cli_error_at(const char *path, moetax_status st);
moetax_status cli_read_file(const char *path, uint64_t max_bytes, char **text, size_t *len);
/* --max-input-bytes SIZE (256M, 1G; at least 1): true if argv[*i] is it; a bad
 * value prints a usage error for cmd and sets *err. */
bool cli_max_input_opt(const char *cmd, int argc, char **argv, int *i, uint64_t *max_bytes, bool *err);
/* --cache-type f32|f16|q8_0 (KV cache cells): true if argv[*i] is it; a bad value prints a usage
 * error for cmd and sets *err. */
bool cli_cache_type_opt(const char *cmd, int argc, char **argv, int *i, enum moetax_type *type, bool *err);
/* A cell type's name (f32, f16, q8_0) into *type; false for any other string or NULL. */
bool cli_cache_type_parse(const char *s, enum moetax_type *type);
#define CLI_CACHE_TYPE_HELP \
    "  --cache-type f32|f16|q8_0 KV cache cells (default f32; f16 halves the cache, llama.cpp's\n" \
    "                       default; q8_0 quarters it, as llama.cpp's -ctk/-ctv q8_0; the logits then\n" \
    "                       differ from an f32 cache's by rounding)\n"
/* --mla-prefill auto|absorbed|decompressed: true if argv[*i] is it; a bad value prints a usage
 * error for cmd and sets *err. */
bool cli_mla_prefill_opt(const char *cmd, int argc, char **argv, int *i, enum moetax_attn_prefill *mode, bool *err);
/* "absorbed", "auto", "decompressed": the form's name, and back (false: none of them). */
const char *cli_mla_prefill_name(enum moetax_attn_prefill mode);
bool cli_mla_prefill_parse(const char *s, enum moetax_attn_prefill *mode);
#define CLI_MLA_PREFILL_HELP \
    "  --mla-prefill M      DeepSeek2 prompts: absorbed (default: attention over the compressed cache\n" \
    "                       rows, as decode: the same bits however a prompt is cut into micro-batches\n" \
    "                       or batched), auto (each head's keys and values decompressed where that takes\n" \
    "                       fewer operations, as llama.cpp does: long prompts faster, their logits then\n" \
    "                       depend in the last bits on the cut) or decompressed (every micro-batch of 2+\n" \
    "                       tokens of one sequence)\n"
#define CLI_MAX_INPUT_HELP \
    "  --max-input-bytes N  read at most N bytes of text (default 256M; sizes like 64K, 1G): a longer\n" \
    "                       input (or a device such as /dev/zero) is refused\n"

/* JSON output: every --json goes through Jansson (strings escaped, valid UTF-8).
 * cli_jnum: a real, or null for NaN/inf (JSON has no such numbers); cli_jstr: a
 * string, its bytes escaped, or null if they are not valid UTF-8. cli_json_print
 * writes o as one line and a newline, drops the reference, and returns 0, or
 * MOETAX_ERR_NOMEM / MOETAX_ERR_IO (o NULL: a failed json_pack). */
json_t *cli_jnum(double x);
json_t *cli_jstr(const char *s);
/* An object from (key, value) pairs, one format letter per pair: s string (NULL or
 * invalid UTF-8: null), i int, I int64_t, f double (NaN/inf: null), b bool (int), o a
 * json_t * whose reference it takes. NULL when out of memory. Like json_pack with
 * NaN/inf and invalid UTF-8 as null instead of a failed pack. */
json_t *cli_jobj(const char *fmt, ...);
moetax_status cli_json_print(FILE *f, json_t *o);

/* Paired ratios (bench -m, bench --batch, bench kernels): the run's GB/s over a plain read of
 * memory just before it. Above CLI_PAIRED_MAX the run went faster than memory reads: the read
 * pass was slowed (another process, page faults, a drifting machine) or the run's bytes came
 * partly from the caches; either way not a fraction of the read bandwidth. Such a ratio is
 * reported as a measurement error, not as a figure: cli_paired_cell writes the table's cell
 * ("87.3%", or "error (116.9%)"), cli_paired_json the JSON fields (name: the ratio or null;
 * name_raw: the measured ratio; name_error: true when it is past the limit). */
#define CLI_PAIRED_MAX 1.1
bool cli_paired_bad(double r);
const char *cli_paired_cell(double r, char *buf, size_t n);
/* the three fields into o (an object); false when out of memory */
bool cli_paired_json(json_t *o, const char *name, double r);
/* The footnote a table with a flagged ratio prints under it. */
void cli_paired_note(FILE *f);
/* A read pass's GB/s as the benches use it: times MOETAX_TEST_READ_PASS_SCALE when set (tests
 * of the error path: 0.05 makes every pass look 20x slower than it was; "A,B" scales the first
 * pass of cli_read_pass's two by A and the second by B), else as measured. */
double cli_read_pass_gbps(double gbps);
/* The read bandwidth just before a repetition: the faster of two passes over the probe's
 * buffer (a pass disturbed by a page fault or another process only reads slower, and with few
 * repetitions one slow pass moved the median), each scaled as cli_read_pass_gbps says; 0 on
 * error. The benches also take passes before their warm-up repetition, unused: the first
 * passes after a model's first steps could read slow. */
struct moetax_membw_probe;
double cli_read_pass(struct moetax_membw_probe *probe);

/* MOETAX_ERR_NUMERIC if a row of n logits (the one for position pos) holds a NaN or
 * an infinity: a broken model must not pass as a token or a perplexity. */
moetax_status cli_check_logits(const float *row, int64_t n, int64_t pos);
/* Encode len bytes of text (BOS first when bos) into *ids, malloc'd with room for extra more: the
 * encoding's length is asked first (a byte can be several tokens: an invalid byte is U+FFFD under most
 * pre-tokenizers, SentencePiece adds its space), so no text is refused for its buffer. */
struct moetax_tokenizer;
moetax_status cli_encode(const struct moetax_tokenizer *tok, const char *text, size_t len, bool bos, int64_t extra,
                         int32_t **ids, int64_t *n);
/* The bytes of token t: *out is buf (cap bytes) or, for a longer token, a malloc'd copy the caller frees
 * (*out != buf); returns their count (0 for none, or when out of memory). */
int cli_token_bytes(const struct moetax_tokenizer *tok, int32_t t, char *buf, int cap, char **out);
/* A warning on stderr ("moetax CMD: warning: WHAT reaches position N, past the T positions the model was
 * trained on ...") where positions run past the model's trained context (none where it is unknown);
 * true if it warned. */
bool cli_warn_past_train(const char *cmd, const struct moetax_model *m, int64_t positions, const char *what);

/* Check each output path given (NULL entries skipped) can be written, before the work
 * starts: moetax_outfile_check. */
moetax_status cli_check_outputs(const char *const *paths, int n);
/* cli_check_outputs, and no output is one of the inputs ins[0..n_in) or another output (by device and
 * inode where the file exists, else by name): MOETAX_ERR_ARG naming both (an output in place of its
 * input would replace it). NULL entries are skipped. */
moetax_status cli_check_io(const char *const *outs, int n_out, const char *const *ins, int n_in);
/* The command line as main received it: cli_check_io then also takes every file an input option of it
 * names (a model, a text, a predictor, a warm-start profile, a config, a placement map, a calibration
 * text, a twin) as an input, so that no command's output can replace a side file it reads. */
void cli_note_argv(int argc, char **argv);

/* The default model: a small DeepSeek-style MoE trained on Python source (tools/train/,
 * models/README.md), committed in the repository. */
#define CLI_DEFAULT_MODEL "pycode-20m-q8_0.gguf"
/* $MOETAX_MODEL, else models/CLI_DEFAULT_MODEL under the current folder, else under the
 * checkout the executable sits in (<repo>/build/moetax) */
const char *cli_default_model_path(void);

#endif
