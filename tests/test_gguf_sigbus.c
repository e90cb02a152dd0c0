/* test_gguf_sigbus.c - a model file truncated while mapped (issue 21 item 5):
 * with moetax_gguf_sigbus_install, touching a tensor past the new end prints a
 * line naming the file and the tensor and exits MOETAX_GGUF_SIGBUS_EXIT; without
 * it the process dies of SIGBUS as before. Each case runs in a forked child. */
#include <fcntl.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "moetax/gguf.h"
#include "testutil.h"

/* Run fn in a child with its stderr into a pipe; returns the wait status, *err the output. */
static int in_child(void (*fn)(const struct moetax_gguf_tensor *), const struct moetax_gguf_tensor *t, char *err,
                    size_t cap) {
    int p[2];
    if (pipe(p) != 0) return -1;
    fflush(NULL);
    pid_t pid = fork();
    if (pid == 0) {
        close(p[0]);
        dup2(p[1], STDERR_FILENO);
        fn(t);
        _exit(0);
    }
    close(p[1]);
    size_t n = 0;
    ssize_t r;
    while (n < cap - 1 && (r = read(p[0], err + n, cap - 1 - n)) > 0) n += (size_t)r;
    err[n] = 0;
    close(p[0]);
    int status = 0;
    waitpid(pid, &status, 0);
    return status;
}

static void touch(const struct moetax_gguf_tensor *t) {
    volatile const uint8_t *b = t->data;
    (void)b[t->nbytes - 1];
}
static void touch_installed(const struct moetax_gguf_tensor *t) {
    moetax_gguf_sigbus_install();
    moetax_gguf_sigbus_install(); /* idempotent */
    touch(t);
}
#ifndef MOETAX_SANITIZED
static void foreign_sigbus(const struct moetax_gguf_tensor *t) {
    (void)t;
    moetax_gguf_sigbus_install();
    raise(SIGBUS); /* no address in a mapping: the default action, as without the handler */
}
#endif

int main(int argc, char **argv) {
    tu_init(argc, argv);
    const char *path = tu_path("sigbus_tiny.gguf");
    char cmd[1024];
    snprintf(cmd, sizeof cmd, "'%s' gen --preset tiny -o '%s' >/dev/null 2>&1", tu_moetax_bin, path);
    CHECK(tu_run(cmd, NULL) == 0);
    struct moetax_gguf *g = NULL;
    CHECK(moetax_gguf_open(path, &g) == MOETAX_OK);
    if (!g) return tu_finish("test_gguf_sigbus");
    /* the tensor stored last; cut the file at the page its data starts in */
    const struct moetax_gguf_tensor *last = &g->tensors[0];
    for (uint64_t i = 1; i < g->n_tensors; i++)
        if (g->tensors[i].offset > last->offset) last = &g->tensors[i];
    long psz = sysconf(_SC_PAGESIZE);
    uint64_t start = g->data_offset + last->offset;
    off_t cut = (off_t)(start / (uint64_t)psz * (uint64_t)psz);
    int fd = open(path, O_WRONLY);
    CHECK(fd >= 0 && ftruncate(fd, cut) == 0);
    if (fd >= 0) close(fd);
    char name[128];
    snprintf(name, sizeof name, "tensor '%.*s'", (int)last->name.len, last->name.data);

    char err[4096];
    int st = in_child(touch_installed, last, err, sizeof err);
    CHECK_MSG(WIFEXITED(st) && WEXITSTATUS(st) == MOETAX_GGUF_SIGBUS_EXIT, "installed: status 0x%x: %s", st, err);
    CHECK_MSG(strstr(err, path) && strstr(err, name) && strstr(err, "bus error reading byte") &&
                  strstr(err, "truncated"),
              "installed: message '%s' should name %s and %s", err, path, name);

#ifndef MOETAX_SANITIZED /* ASan reports SIGBUS itself when no handler is installed */
    st = in_child(touch, last, err, sizeof err);
    CHECK_MSG(WIFSIGNALED(st) && WTERMSIG(st) == SIGBUS, "not installed: status 0x%x (expected death by SIGBUS)", st);
    st = in_child(foreign_sigbus, last, err, sizeof err);
    CHECK_MSG(WIFSIGNALED(st) && WTERMSIG(st) == SIGBUS, "foreign SIGBUS: status 0x%x: %s", st, err);
#endif
    moetax_gguf_close(g);
    /* a closed file is no longer registered: opening the cut file is a plain format error */
    CHECK(moetax_gguf_open(path, &g) == MOETAX_ERR_FORMAT);
    return tu_finish("test_gguf_sigbus");
}
