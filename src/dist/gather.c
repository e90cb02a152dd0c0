/* gather.c - every rank's bytes to rank 0 (see gather.h). */
#include "dist/gather.h"

#include <mpi.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
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
