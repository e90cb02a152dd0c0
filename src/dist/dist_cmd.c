/* dist_cmd.c - the server's command stream under mpirun (see dist_cmd.h). */
#include "dist/dist_cmd.h"

#include <mpi.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

enum { CMD_TAG = 7101, SPIN_PROBES = 20000 };

static MPI_Comm g_cmd = MPI_COMM_NULL;

static moetax_status fail(int rc, const char *what) {
    char s[MPI_MAX_ERROR_STRING];
    int len = 0;
    MPI_Error_string(rc, s, &len);
    return moetax_error(MOETAX_ERR_IO, "%s: %.*s", what, len, s);
}

moetax_status moetax_dist_cmd_open(void) {
    if (g_cmd != MPI_COMM_NULL) return MOETAX_OK;
    int rc = MPI_Comm_dup(MPI_COMM_WORLD, &g_cmd);
    if (rc != MPI_SUCCESS) return fail(rc, "MPI_Comm_dup (the server's command stream)");
    MPI_Comm_set_errhandler(g_cmd, MPI_ERRORS_RETURN);
    return MOETAX_OK;
}

void moetax_dist_cmd_close(void) {
    if (g_cmd != MPI_COMM_NULL) MPI_Comm_free(&g_cmd);
}

moetax_status moetax_dist_cmd_send(const int32_t *words, size_t n) {
    if (g_cmd == MPI_COMM_NULL) return moetax_error(MOETAX_ERR_INTERNAL, "the command stream is not open");
    if (n > (size_t)INT32_MAX) return moetax_error(MOETAX_ERR_LIMIT, "a step script of %zu words", n);
    int size = 1;
    MPI_Comm_size(g_cmd, &size);
    for (int r = 1; r < size; r++) {
        int rc = MPI_Send(words, (int)n, MPI_INT32_T, r, CMD_TAG, g_cmd);
        if (rc != MPI_SUCCESS) return fail(rc, "MPI_Send (a step to a follower rank)");
    }
    return MOETAX_OK;
}

moetax_status moetax_dist_cmd_recv(int32_t **buf, size_t *cap, size_t *n) {
    if (g_cmd == MPI_COMM_NULL) return moetax_error(MOETAX_ERR_INTERNAL, "the command stream is not open");
    MPI_Status stt;
    int flag = 0, rc;
    const pid_t parent = getppid();
    struct timespec t0;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (long probes = 0; !flag; probes++) {
        if ((rc = MPI_Iprobe(0, CMD_TAG, g_cmd, &flag, &stt)) != MPI_SUCCESS) return fail(rc, "MPI_Iprobe");
        if (flag || probes < SPIN_PROBES) continue;
        /* idle: let the core go, longer the longer the server has been idle (a step after 1 s of
         * idleness waits at most 1 ms more, after 10 s at most 5 ms) */
        struct timespec now;
        clock_gettime(CLOCK_MONOTONIC, &now);
        const double idle = (double)(now.tv_sec - t0.tv_sec) + 1e-9 * (double)(now.tv_nsec - t0.tv_nsec);
        struct timespec ts = {0, idle < 1 ? 200 * 1000 : idle < 10 ? 1000 * 1000 : 5000 * 1000};
        nanosleep(&ts, NULL);
        if (getppid() != parent) /* the launcher (mpirun or its daemon) is gone: so is the job */
            return moetax_error(MOETAX_ERR_IO, "the server's other ranks are gone (this rank's launcher exited)");
    }
    int count = 0;
    MPI_Get_count(&stt, MPI_INT32_T, &count);
    if (count < 0) return moetax_error(MOETAX_ERR_FORMAT, "a step message that is not whole int32 words");
    if ((size_t)count > *cap) {
        int32_t *nb = realloc(*buf, sizeof(int32_t) * (size_t)count);
        if (!nb) return moetax_error(MOETAX_ERR_NOMEM, "out of memory (a step of %d words)", count);
        *buf = nb;
        *cap = (size_t)count;
    }
    if ((rc = MPI_Recv(*buf, count, MPI_INT32_T, 0, CMD_TAG, g_cmd, MPI_STATUS_IGNORE)) != MPI_SUCCESS)
        return fail(rc, "MPI_Recv (a step from rank 0)");
    *n = (size_t)count;
    return MOETAX_OK;
}
