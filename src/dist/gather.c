/* gather.c - every rank's bytes to rank 0 (see gather.h). */
#include "dist/gather.h"

#include <mpi.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <stdio.h>
#include <string.h>

static moetax_status fail(int rc, const char *what) {
    char s[MPI_MAX_ERROR_STRING];
    int len = 0;
    MPI_Error_string(rc, s, &len);
    return moetax_error(MOETAX_ERR_IO, "%s: %.*s", what, len, s);
}

void moetax_dist_gather_free(char **all, size_t *lens, int n_ranks) {
    if (all)
        for (int r = 0; r < n_ranks; r++) free(all[r]);
    free(all);
    free(lens);
}

moetax_status moetax_dist_gather_bytes(const void *mine, size_t n, char ***all, size_t **lens, int *n_ranks) {
    *all = NULL;
    *lens = NULL;
    MPI_Comm c;
    int rc = MPI_Comm_dup(MPI_COMM_WORLD, &c);
    if (rc != MPI_SUCCESS) return fail(rc, "MPI_Comm_dup");
    MPI_Comm_set_errhandler(c, MPI_ERRORS_RETURN);
    int rank = 0, P = 1;
    MPI_Comm_rank(c, &rank);
    MPI_Comm_size(c, &P);
    *n_ranks = P;
    /* a rank with too much to send says so with -1: every rank still takes part in both steps */
    int my = n > (size_t)INT32_MAX ? -1 : (int)n;
    int *cnt = rank == 0 ? calloc((size_t)P, sizeof *cnt) : NULL, *dis = rank == 0 ? calloc((size_t)P, sizeof *dis) : NULL;
    char *buf = NULL;
    moetax_status st = MOETAX_OK;
    if (rank == 0 && (!cnt || !dis)) st = moetax_error(MOETAX_ERR_NOMEM, "out of memory");
    if ((rc = MPI_Gather(&my, 1, MPI_INT, cnt, 1, MPI_INT, 0, c)) != MPI_SUCCESS && !st) st = fail(rc, "MPI_Gather");
    int64_t total = 0;
    bool ok = !st;
    if (rank == 0 && ok) {
        for (int r = 0; r < P && ok; r++) {
            if (cnt[r] < 0) {
                st = moetax_error(MOETAX_ERR_LIMIT, "rank %d: more than %d bytes to gather", r, INT32_MAX);
                ok = false;
            }
            dis[r] = (int)total;
            total += cnt[r] > 0 ? cnt[r] : 0;
            if (total > INT32_MAX) {
                st = moetax_error(MOETAX_ERR_LIMIT, "more than %d bytes from all ranks together", INT32_MAX);
                ok = false;
            }
        }
        if (ok && !(buf = malloc((size_t)total + 1))) {
            st = moetax_error(MOETAX_ERR_NOMEM, "out of memory (%lld bytes from the ranks)", (long long)total);
            ok = false;
        }
        if (!ok) /* nothing is received: every count 0 (the others still send theirs: truncated away) */
            for (int r = 0; r < P && cnt; r++) cnt[r] = 0, dis[r] = 0;
    }
    char dummy = 0;
    rc = MPI_Gatherv(my > 0 ? mine : &dummy, my > 0 ? my : 0, MPI_BYTE, buf ? buf : &dummy, cnt, dis, MPI_BYTE, 0, c);
    if (rc != MPI_SUCCESS && !st) st = fail(rc, "MPI_Gatherv");
    if (rank == 0 && !st) {
        char **a = calloc((size_t)P, sizeof *a);
        size_t *l = calloc((size_t)P, sizeof *l);
        if (!a || !l) st = moetax_error(MOETAX_ERR_NOMEM, "out of memory");
        for (int r = 0; r < P && !st; r++) {
            if (!(a[r] = malloc((size_t)cnt[r] + 1))) { st = moetax_error(MOETAX_ERR_NOMEM, "out of memory"); break; }
            memcpy(a[r], buf + dis[r], (size_t)cnt[r]);
            a[r][cnt[r]] = 0;
            l[r] = (size_t)cnt[r];
        }
        if (st) moetax_dist_gather_free(a, l, P);
        else *all = a, *lens = l;
    }
    free(buf);
    free(cnt);
    free(dis);
    MPI_Comm_free(&c);
    return st;
}

/* The command as one string: the arguments and the MOETAX_MPI_* variables, 0-separated. */
static char *command_text(int argc, char **argv, size_t *n) {
    static const char *const vars[] = {"MOETAX_MPI_DISPATCH", "MOETAX_MPI_OVERLAP", "MOETAX_MPI_COMBINE",
                                        "MOETAX_MPI_REPLICAS", "MOETAX_MPI_REPLAN"};
    size_t len = 0;
    for (int i = 1; i < argc; i++) len += strlen(argv[i]) + 1;
    for (size_t v = 0; v < sizeof vars / sizeof vars[0]; v++)
        len += strlen(vars[v]) + 2 + (getenv(vars[v]) ? strlen(getenv(vars[v])) : 0);
    char *t = malloc(len + 1), *p = t;
    if (!t) return NULL;
    for (int i = 1; i < argc; i++) p += sprintf(p, "%s", argv[i]) + 1;
    for (size_t v = 0; v < sizeof vars / sizeof vars[0]; v++)
        p += sprintf(p, "%s=%s", vars[v], getenv(vars[v]) ? getenv(vars[v]) : "") + 1;
    *n = (size_t)(p - t);
    return t;
}

moetax_status moetax_dist_same_command(int argc, char **argv) {
    size_t n = 0;
    char *mine = command_text(argc, argv, &n);
    int rank = 0, P = 1, rc;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &P);
    long long len0 = mine && n <= (size_t)INT32_MAX ? (long long)n : -1;
    if ((rc = MPI_Bcast(&len0, 1, MPI_LONG_LONG, 0, MPI_COMM_WORLD)) != MPI_SUCCESS) {
        free(mine);
        return fail(rc, "MPI_Bcast (the command)");
    }
    char *zero = len0 >= 0 ? malloc((size_t)len0 + 1) : NULL;
    int bad_local = 0;
    if (len0 >= 0 && zero) {
        if (rank == 0) memcpy(zero, mine, (size_t)len0);
        if ((rc = MPI_Bcast(zero, (int)len0, MPI_CHAR, 0, MPI_COMM_WORLD)) != MPI_SUCCESS) {
            free(mine);
            free(zero);
            return fail(rc, "MPI_Bcast (the command)");
        }
    } else {
        bad_local = 2; /* could not compare (out of memory): fail all the same */
    }
    char what[512] = "";
    if (!bad_local && (!mine || (size_t)len0 != n || memcmp(mine, zero, n) != 0)) {
        bad_local = 1;
        /* the first differing item (an argument, or NAME=VALUE of an MOETAX_MPI_ variable) */
        size_t a = 0, b = 0, prev = SIZE_MAX;
        while (mine && a < n && b < (size_t)len0 && !strcmp(mine + a, zero + b)) {
            prev = a;
            a += strlen(mine + a) + 1;
            b += strlen(zero + b) + 1;
        }
        const char *before = prev != SIZE_MAX ? mine + prev : "";
        snprintf(what, sizeof what, "'%.100s%s%.150s' where rank 0 has '%.100s%s%.150s'", before, *before ? " " : "",
                 mine && a < n ? mine + a : "(nothing)", before, *before ? " " : "",
                 b < (size_t)len0 ? zero + b : "(nothing)");
    }
    free(mine);
    free(zero);
    int any = 0;
    if ((rc = MPI_Allreduce(&bad_local, &any, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD)) != MPI_SUCCESS)
        return fail(rc, "MPI_Allreduce (the command check)");
    if (!any) return MOETAX_OK;
    if (bad_local == 1)
        return moetax_error(MOETAX_ERR_ARG, "rank %d of %d runs another command than rank 0 (%s): every rank must run "
                            "the same arguments and MOETAX_MPI_* settings", rank, P, what);
    return moetax_error(MOETAX_ERR_ARG, "rank %d of %d: another rank runs another command than rank 0 (its error says "
                        "which)", rank, P);
}
