/*
 * outfile.c - safe output files (see moetax/outfile.h): resolve symbolic links,
 * refuse targets that are not regular files, write a temporary file in the
 * target's directory, fsync, rename; remove the temporary file on any error and,
 * through moetax_outfile_cleanup_signal, on SIGINT/SIGTERM.
 */
#include "moetax/outfile.h"

#include <jansson.h>

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#define OUTFILE_MAX_LINKS 40 /* symbolic links followed, as the kernel's ELOOP limit */
#define OUTFILE_MAX_LIVE 64  /* temporary files removed on a signal; beyond that, only on errors */
#define OUTFILE_PATH_MAX 4096

struct moetax_outfile {
    char *path;   /* as given */
    char *target; /* symbolic links resolved */
    char *tmp;    /* <target>.tmp.XXXXXX, or <dir>/.moetax.tmp.XXXXXX for a long name (make_tmp) */
    FILE *f;
    int live;     /* index in g_live, -1: not listed */
};

/* Temporary files in flight: state 0 free, 1 being filled in, 2 listed (removed on a signal). */
static struct {
    atomic_int state;
    char path[OUTFILE_PATH_MAX];
} g_live[OUTFILE_MAX_LIVE];

static int live_add(const char *tmp) {
    size_t n = strlen(tmp);
    if (n >= OUTFILE_PATH_MAX) return -1;
    for (int i = 0; i < OUTFILE_MAX_LIVE; i++) {
        int free_state = 0;
        if (atomic_compare_exchange_strong(&g_live[i].state, &free_state, 1)) {
            memcpy(g_live[i].path, tmp, n + 1);
            atomic_store(&g_live[i].state, 2);
            return i;
        }
    }
    return -1;
}

static void live_remove(int i) {
    if (i >= 0) atomic_store(&g_live[i].state, 0);
}

void moetax_outfile_cleanup_signal(void) {
    for (int i = 0; i < OUTFILE_MAX_LIVE; i++)
        if (atomic_load(&g_live[i].state) == 2) unlink(g_live[i].path);
}

static const char *kind_name(mode_t m) {
    if (S_ISDIR(m)) return "a directory";
    if (S_ISCHR(m)) return "a character device";
    if (S_ISBLK(m)) return "a block device";
    if (S_ISFIFO(m)) return "a FIFO";
    if (S_ISSOCK(m)) return "a socket";
    return "not a regular file";
}

/* "dir" of "dir/name" ("." for "name", "/" for "/name"), malloc'd */
static char *dir_of(const char *p) {
    const char *slash = strrchr(p, '/');
    if (!slash) return strdup(".");
    if (slash == p) return strdup("/");
    return strndup(p, (size_t)(slash - p));
}

/* Follow symbolic links from path to the file to write. *exists and *sb tell
 * whether it exists (its stat). The message names path, and the target if other. */
static moetax_status resolve(const char *path, char **target, bool *exists, struct stat *sb) {
    *target = NULL;
    *exists = false;
    if (!path || !*path) return moetax_error(MOETAX_ERR_ARG, "no output path given");
    if (strlen(path) >= OUTFILE_PATH_MAX)
        return moetax_error(MOETAX_ERR_ARG, "output path '%.64s...' is longer than %d bytes", path, OUTFILE_PATH_MAX);
    char *cur = strdup(path);
    if (!cur) return moetax_error(MOETAX_ERR_NOMEM, "%s: out of memory", path);
    for (int hops = 0;; hops++) {
        if (lstat(cur, sb) != 0) {
            if (errno == ENOENT) break; /* a new file (its directory is checked below) */
            moetax_status st = moetax_error(MOETAX_ERR_IO, "output %s%s%s: %s", path, strcmp(cur, path) ? " -> " : "",
                                            strcmp(cur, path) ? cur : "", strerror(errno));
            free(cur);
            return st;
        }
        if (!S_ISLNK(sb->st_mode)) {
            *exists = true;
            break;
        }
        if (hops == OUTFILE_MAX_LINKS) {
            free(cur);
            return moetax_error(MOETAX_ERR_IO, "output %s: more than %d symbolic links", path, OUTFILE_MAX_LINKS);
        }
        char link[OUTFILE_PATH_MAX];
        ssize_t n = readlink(cur, link, sizeof link - 1);
        if (n < 0 || n >= (ssize_t)sizeof link - 1) {
            moetax_status st = moetax_error(MOETAX_ERR_IO, "output %s: cannot read the symbolic link %s: %s", path, cur,
                                            n < 0 ? strerror(errno) : "too long");
            free(cur);
            return st;
        }
        link[n] = 0;
        char *next;
        if (link[0] == '/') next = strdup(link);
        else {
            char *d = dir_of(cur);
            size_t l = d ? strlen(d) + 1 + (size_t)n + 1 : 0;
            next = d && l <= OUTFILE_PATH_MAX ? malloc(l) : NULL;
            if (next) {
                size_t dl = strlen(d);
                memcpy(next, d, dl);
                next[dl] = '/';
                memcpy(next + dl + 1, link, (size_t)n + 1);
            }
            free(d);
        }
        free(cur);
        if (!next) return moetax_error(MOETAX_ERR_NOMEM, "output %s: out of memory (or a link's path is too long)", path);
        cur = next;
    }
    const bool other = strcmp(cur, path) != 0;
    if (*exists && !S_ISREG(sb->st_mode)) {
        moetax_status st = moetax_error(MOETAX_ERR_ARG,
                                        "output %s%s%s is %s, not a regular file: moetax writes only regular files",
                                        path, other ? " -> " : "", other ? cur : "", kind_name(sb->st_mode));
        free(cur);
        return st;
    }
    if (!*exists) {
        /* "out/" names a directory that does not exist: the message says so */
        size_t l = strlen(cur);
        char *d = dir_of(cur);
        struct stat ds;
        moetax_status st = MOETAX_OK;
        if (!d) st = moetax_error(MOETAX_ERR_NOMEM, "%s: out of memory", path);
        else if (l && cur[l - 1] == '/')
            st = moetax_error(MOETAX_ERR_ARG, "output %s names a directory, not a file", path);
        else if (stat(d, &ds) != 0)
            st = moetax_error(MOETAX_ERR_IO, "output %s%s%s: the directory %s: %s", path, other ? " -> " : "",
                              other ? cur : "", d, strerror(errno));
        else if (!S_ISDIR(ds.st_mode))
            st = moetax_error(MOETAX_ERR_IO, "output %s%s%s: %s is not a directory", path, other ? " -> " : "",
                              other ? cur : "", d);
        free(d);
        if (st) { free(cur); return st; }
    }
    *target = cur;
    return MOETAX_OK;
}

static moetax_status check_space(const char *path, const char *target, int fd, uint64_t bytes) {
    if (!bytes) return MOETAX_OK;
    struct statvfs vs;
    int r = fd >= 0 ? fstatvfs(fd, &vs) : -1;
    if (r != 0) {
        char *d = dir_of(target);
        r = d ? statvfs(d, &vs) : -1;
        free(d);
    }
    if (r != 0) return MOETAX_OK; /* unknown: the writes will tell */
    /* root may use the reserved blocks too, but do not count on them */
    const uint64_t avail = (uint64_t)vs.f_bavail * (uint64_t)vs.f_frsize;
    if (bytes > avail)
        return moetax_error(MOETAX_ERR_LIMIT, "output %s: needs %.1f MiB but its file system has %.1f MiB free", path,
                            (double)bytes / (1 << 20), (double)avail / (1 << 20));
    return MOETAX_OK;
}

/* Create <target>.tmp.XXXXXX with O_EXCL (<dir>/.moetax.tmp.XXXXXX where the target's name is too long
 * for that: a legal name of 245-255 bytes was refused as "File name too long"); *fd and *tmp on success. */
static moetax_status make_tmp(const char *path, const char *target, char **tmp, int *fd) {
    size_t l = strlen(target) + sizeof ".tmp.XXXXXX";
    char *t = malloc(l + sizeof "/.moetax.tmp.XXXXXX");
    if (!t) return moetax_error(MOETAX_ERR_NOMEM, "%s: out of memory", path);
    const char *slash = strrchr(target, '/');
    const char *base = slash ? slash + 1 : target;
    if (strlen(base) + sizeof ".tmp.XXXXXX" - 1 <= 255)
        snprintf(t, l, "%s.tmp.XXXXXX", target);
    else
        snprintf(t, l + sizeof "/.moetax.tmp.XXXXXX", "%.*s.moetax.tmp.XXXXXX", (int)(base - target), target);
    int f = mkostemp(t, O_CLOEXEC);
    if (f < 0) {
        const bool other = strcmp(target, path) != 0;
        moetax_status st = moetax_error(MOETAX_ERR_IO, "output %s%s%s: cannot create a file in its directory: %s", path,
                                        other ? " -> " : "", other ? target : "", strerror(errno));
        free(t);
        return st;
    }
    *tmp = t;
    *fd = f;
    return MOETAX_OK;
}

moetax_status moetax_outfile_check(const char *path, uint64_t bytes) {
    char *target, *tmp;
    bool exists;
    struct stat sb;
    int fd;
    moetax_status st = resolve(path, &target, &exists, &sb);
    if (st) return st;
    if (!(st = make_tmp(path, target, &tmp, &fd))) {
        st = check_space(path, target, fd, bytes);
        close(fd);
        unlink(tmp);
        free(tmp);
    }
    free(target);
    return st;
}

moetax_status moetax_outfile_open(const char *path, struct moetax_outfile **out) {
    *out = NULL;
    struct moetax_outfile *o = calloc(1, sizeof *o);
    if (!o) return moetax_error(MOETAX_ERR_NOMEM, "%s: out of memory", path ? path : "output");
    o->live = -1;
    bool exists;
    struct stat sb;
    int fd = -1;
    moetax_status st = resolve(path, &o->target, &exists, &sb);
    if (!st && !(o->path = strdup(path))) st = moetax_error(MOETAX_ERR_NOMEM, "%s: out of memory", path);
    if (!st) st = make_tmp(path, o->target, &o->tmp, &fd);
    if (st) {
        free(o->target);
        free(o->path);
        free(o);
        return st;
    }
    o->live = live_add(o->tmp);
    /* mkostemp made it 0600: a replaced file keeps its mode, a new one 0666 & ~umask
     * (umask can only be read by setting it; the window is two system calls) */
    mode_t mode;
    if (exists) mode = sb.st_mode & 07777;
    else {
        mode_t um = umask(022);
        umask(um);
        mode = 0666 & ~um;
    }
    (void)fchmod(fd, mode);
    o->f = fdopen(fd, "wb");
    if (!o->f) {
        st = moetax_error(MOETAX_ERR_IO, "%s: %s", o->tmp, strerror(errno));
        close(fd);
        moetax_outfile_abort(o);
        return st;
    }
    *out = o;
    return MOETAX_OK;
}

FILE *moetax_outfile_file(struct moetax_outfile *o) { return o->f; }
const char *moetax_outfile_path(const struct moetax_outfile *o) { return o->path; }
const char *moetax_outfile_target(const struct moetax_outfile *o) { return o->target; }
const char *moetax_outfile_tmp_path(const struct moetax_outfile *o) { return o->tmp; }

moetax_status moetax_outfile_reserve(struct moetax_outfile *o, uint64_t bytes) {
    return check_space(o->path, o->target, o->f ? fileno(o->f) : -1, bytes);
}

static void outfile_free(struct moetax_outfile *o) {
    live_remove(o->live);
    free(o->path);
    free(o->target);
    free(o->tmp);
    free(o);
}

void moetax_outfile_abort(struct moetax_outfile *o) {
    if (!o) return;
    if (o->f) fclose(o->f);
    unlink(o->tmp);
    outfile_free(o);
}

moetax_status moetax_outfile_commit(struct moetax_outfile *o) {
    moetax_status st = MOETAX_OK;
    const char *what = NULL;
    int err = 0;
    if (fflush(o->f) != 0) { what = "write"; err = errno; }
    else if (ferror(o->f)) what = "an earlier write"; /* its errno is gone */
    else if (fsync(fileno(o->f)) != 0 && errno != EINVAL) { what = "fsync"; err = errno; }
    int rc = fclose(o->f);
    o->f = NULL;
    if (!what && rc != 0) { what = "close"; err = errno; }
    if (!what && rename(o->tmp, o->target) != 0) { what = "rename"; err = errno; }
    if (!what) { /* the new name on disk too (a crash after "wrote" could lose it otherwise); best effort */
        const char *slash = strrchr(o->target, '/');
        char *dir = slash ? strndup(o->target, slash == o->target ? 1 : (size_t)(slash - o->target)) : strdup(".");
        const int dfd = dir ? open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC) : -1;
        if (dfd >= 0) {
            (void)fsync(dfd);
            close(dfd);
        }
        free(dir);
    }
    if (what) {
        const bool other = strcmp(o->target, o->path) != 0;
        st = moetax_error(MOETAX_ERR_IO, "output %s%s%s: %s failed%s%s (left as it was; %s removed)", o->path,
                          other ? " -> " : "", other ? o->target : "", what, err ? ": " : "", err ? strerror(err) : "",
                          o->tmp);
        unlink(o->tmp);
    }
    outfile_free(o);
    return st;
}

moetax_status moetax_same_file(const char *a, const char *b, bool *same) {
    *same = false;
    struct stat sa, sb;
    if (stat(a, &sa) != 0) return moetax_error(MOETAX_ERR_IO, "%s: %s", a, strerror(errno));
    if (stat(b, &sb) != 0) return MOETAX_OK; /* b does not exist (or cannot be reached): not a
                                              * (known) same file; writing it reports the rest */
    *same = sa.st_dev == sb.st_dev && sa.st_ino == sb.st_ino;
    return MOETAX_OK;
}

moetax_status moetax_outfile_write_json(const char *path, const struct json_t *doc, size_t flags, const char *what) {
    struct moetax_outfile *out;
    moetax_status st = moetax_outfile_open(path, &out);
    if (st) return st;
    FILE *f = moetax_outfile_file(out);
    if (json_dumpf(doc, f, flags) != 0 || fputc('\n', f) == EOF) {
        moetax_outfile_abort(out);
        return moetax_error(MOETAX_ERR_IO, "%s: writing %s failed", path, what);
    }
    return moetax_outfile_commit(out);
}
