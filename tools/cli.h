/* cli.h - helpers shared by the subcommands: option parsing, sizes, lists,
 * a progress bar, and error reporting. Only the CLI exits; the library returns. */
#ifndef MOETAX_TOOLS_CLI_H
#define MOETAX_TOOLS_CLI_H

#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>

#include "moetax/status.h"

/* Print "moetax <cmd>: <last error>" (or msg) to stderr; return 1 (for main). */
int cli_fail(const char *cmd, moetax_status st);
int cli_usage_error(const char *cmd, const char *fmt, ...);

/* True if argv[*i] is "-s"/"--long"; then *val gets the next argument (or
 * "--long=value"). Missing value: prints an error and sets *err. */
bool cli_opt(int argc, char **argv, int *i, const char *s, const char *l, const char **val, bool *err);
bool cli_flag(char **argv, int i, const char *s, const char *l);

bool cli_parse_i64(const char *s, int64_t *out);
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

/* The whole file at path ("-": standard input) in a malloc'd buffer with a
 * NUL after its *len bytes (the bytes may hold NULs too). MOETAX_ERR_IO names
 * the file and the system's reason; MOETAX_ERR_NOMEM. */
moetax_status cli_read_file(const char *path, char **text, size_t *len);

/* The default model: a small DeepSeek-style MoE trained on Python source (tools/train/,
 * models/README.md), committed in the repository. */
#define CLI_DEFAULT_MODEL "pycode-20m-q8_0.gguf"
/* $MOETAX_MODEL, else models/CLI_DEFAULT_MODEL under the current folder, else under the
 * checkout the executable sits in (<repo>/build/moetax) */
const char *cli_default_model_path(void);

#endif
