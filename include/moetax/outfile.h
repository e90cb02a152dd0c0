/*
 * moetax/outfile.h - safe output files: every file moetax writes (models, ledgers,
 * traces, logits, HTML reports) goes through here.
 *
 * DESIGN
 *   moetax_outfile_open(path) first resolves path: a symbolic link is followed to
 *   the file it names (the link stays, its target is written; a dangling link
 *   creates its target). The target, if it exists, must be a regular file: a
 *   directory, a character or block device, a FIFO or a socket is refused (a
 *   rename over /dev/null, as root, would replace the device). The data goes to a
 *   new file created with O_EXCL next to the target ("<target>.tmp.XXXXXX": same
 *   directory, so same file system), and moetax_outfile_commit flushes, fsyncs and
 *   renames it over the target. The target therefore holds its old content or the
 *   whole new content, never a truncated file. Any error on the way (a write
 *   error, a full disk, a failed fsync or rename) removes the temporary file and
 *   leaves the target as it was.
 *
 *   moetax_outfile_check(path, bytes) runs the same checks, creates and removes a
 *   temporary file in the target's directory (so a missing or read-only directory
 *   shows up), and compares bytes with the free space of the target's file
 *   system: a command calls it for each of its outputs before its work starts.
 *
 *   Temporary files not yet committed are listed in a fixed table;
 *   moetax_outfile_cleanup_signal() removes them and is async-signal-safe: the
 *   CLI calls it from its SIGINT/SIGTERM handler. The library installs no handler.
 *
 * INVARIANTS
 *   - The target's name is never opened for writing: only the temporary file is.
 *   - A replaced file keeps its permission bits; a new one gets 0666 & ~umask.
 *   - Replacing a file gives it a new inode: other hard links to the old file keep
 *     the old content.
 *   - Errors name the path given, and the resolved target when they differ.
 */
#ifndef MOETAX_OUTFILE_H
#define MOETAX_OUTFILE_H

#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>

#include "moetax/status.h"

#ifdef __cplusplus
extern "C" {
#endif

struct moetax_outfile;

/* Would open + commit succeed? MOETAX_ERR_ARG for a target that is not a regular
 * file, MOETAX_ERR_IO for a missing or unwritable directory, MOETAX_ERR_LIMIT when
 * bytes (0: no check) exceed the free space of the target's file system. */
moetax_status moetax_outfile_check(const char *path, uint64_t bytes);

/* Create the temporary file for path; *out is NULL on error. */
moetax_status moetax_outfile_open(const char *path, struct moetax_outfile **out);
/* The stream to write (fully buffered; the caller may setvbuf it before writing). */
FILE *moetax_outfile_file(struct moetax_outfile *o);
/* The path given, the resolved target, the temporary file. */
const char *moetax_outfile_path(const struct moetax_outfile *o);
const char *moetax_outfile_target(const struct moetax_outfile *o);
const char *moetax_outfile_tmp_path(const struct moetax_outfile *o);
/* MOETAX_ERR_LIMIT if bytes more would not fit on the target's file system. */
moetax_status moetax_outfile_reserve(struct moetax_outfile *o, uint64_t bytes);
/* Flush, fsync, close and rename over the target. Frees o, success or not; on an
 * error the temporary file is removed and the target is untouched. */
moetax_status moetax_outfile_commit(struct moetax_outfile *o);
/* Close and remove the temporary file, free o (NULL: nothing). */
void moetax_outfile_abort(struct moetax_outfile *o);

/* A JSON document (a Jansson json_t, dumped with Jansson's `flags`) and a newline written to
 * path through a safe output file; `what` names it in the error ("the profile"). */
struct json_t;
moetax_status moetax_outfile_write_json(const char *path, const struct json_t *doc, size_t flags, const char *what);

/* *same: a and b name the same file (device and inode, links followed); a path
 * that does not exist is the same as nothing. MOETAX_ERR_IO if a cannot be stat'ed. */
moetax_status moetax_same_file(const char *a, const char *b, bool *same);

/* Remove every temporary file not yet committed or aborted. Async-signal-safe. */
void moetax_outfile_cleanup_signal(void);

#ifdef __cplusplus
}
#endif
#endif
