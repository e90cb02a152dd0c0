/*
 * gguf_sigbus.c - a SIGBUS handler for mapped GGUF files.
 *
 * A file truncated (or replaced in place) while it is mapped turns every read of
 * a page past its new end into SIGBUS, which by default kills the process with
 * "Bus error" and nothing else. Every mapping moetax_gguf_open makes is
 * registered here (a fixed table of atomic slots; registration is cheap and
 * always done); once moetax_gguf_sigbus_install has been called, a SIGBUS whose
 * address lies in a registered mapping prints one line naming the file, the
 * tensor (looked up in the file's tensor table) and the byte offset, and ends
 * the process with _exit(MOETAX_GGUF_SIGBUS_EXIT): in a signal handler nothing
 * else is possible (the faulting read cannot be resumed, and no error can be
 * returned through the kernel that was reading). A SIGBUS anywhere else goes to
 * the handler installed before, or to the default action.
 *
 * Everything the handler does is async-signal-safe: it reads the registered
 * tables, formats with its own integer formatter into a stack buffer, calls
 * write(2), removes the temporary files of unfinished outputs
 * (moetax_outfile_cleanup_signal) and calls _exit(2).
 */
#include "moetax/gguf.h"

#include <signal.h>
#include <stdatomic.h>
#include <string.h>
#include <unistd.h>

#include "gguf/gguf_impl.h"
#include "moetax/outfile.h"

#define SLOTS 64

static _Atomic(const struct moetax_gguf *) g_slots[SLOTS];
static struct sigaction g_prev;
static atomic_flag g_installed = ATOMIC_FLAG_INIT;

void moetax_gguf_sigbus_register(const struct moetax_gguf *g) {
    for (int i = 0; i < SLOTS; i++) {
        const struct moetax_gguf *none = NULL;
        if (atomic_compare_exchange_strong(&g_slots[i], &none, g)) return;
    }
    /* table full: this mapping keeps the default SIGBUS behaviour */
}

void moetax_gguf_sigbus_unregister(const struct moetax_gguf *g) {
    for (int i = 0; i < SLOTS; i++) {
        const struct moetax_gguf *want = g;
        if (atomic_compare_exchange_strong(&g_slots[i], &want, NULL)) return;
    }
}

/* ---- async-signal-safe formatting ---------------------------------------------- */

struct line {
    char buf[768];
    size_t n;
};

static void put(struct line *l, const char *s, size_t n) {
    for (size_t i = 0; i < n && l->n < sizeof l->buf - 1; i++) l->buf[l->n++] = s[i];
}
static void puts0(struct line *l, const char *s) { put(l, s, strlen(s)); }
static void putu(struct line *l, uint64_t v) {
    char d[24];
    int k = 0;
    do { d[k++] = (char)('0' + v % 10); v /= 10; } while (v);
    while (k) put(l, &d[--k], 1);
}

static void on_sigbus(int sig, siginfo_t *si, void *uc) {
    const uintptr_t a = (uintptr_t)si->si_addr;
    for (int i = 0; i < SLOTS; i++) {
        const struct moetax_gguf *g = atomic_load(&g_slots[i]);
        if (!g || !g->mapped || a < (uintptr_t)g->base || a >= (uintptr_t)g->base + g->size) continue;
        const uint64_t off = (uint64_t)(a - (uintptr_t)g->base);
        struct line l = {.n = 0};
        puts0(&l, "moetax: ");
        puts0(&l, g->path);
        puts0(&l, ": bus error reading byte ");
        putu(&l, off);
        const struct moetax_gguf_tensor *hit = NULL;
        for (uint64_t t = 0; t < g->n_tensors; t++) {
            const struct moetax_gguf_tensor *x = &g->tensors[t];
            const uint64_t start = g->data_offset + x->offset;
            if (off >= start && off - start < x->nbytes) { hit = x; break; }
        }
        if (hit) {
            puts0(&l, " (tensor '");
            put(&l, hit->name.data, hit->name.len > 200 ? 200 : hit->name.len);
            puts0(&l, "', its byte ");
            putu(&l, off - (g->data_offset + hit->offset));
            puts0(&l, " of ");
            putu(&l, hit->nbytes);
            puts0(&l, ")");
        } else {
            puts0(&l, off < g->data_offset ? " (the header)" : " (outside any tensor)");
        }
        puts0(&l, " of the ");
        putu(&l, g->size);
        puts0(&l, "-byte mapping: the file was truncated or changed while in use\n");
        ssize_t w = write(STDERR_FILENO, l.buf, l.n);
        (void)w;
        moetax_outfile_cleanup_signal(); /* outputs half written from this file: their temporary files go */
        _exit(MOETAX_GGUF_SIGBUS_EXIT);
    }
    /* not ours: whoever handled SIGBUS before, or the default action (re-raised on return) */
    if (g_prev.sa_flags & SA_SIGINFO) {
        if (g_prev.sa_sigaction) { g_prev.sa_sigaction(sig, si, uc); return; }
    } else if (g_prev.sa_handler != SIG_DFL && g_prev.sa_handler != SIG_IGN) {
        g_prev.sa_handler(sig);
        return;
    }
    struct sigaction dfl;
    memset(&dfl, 0, sizeof dfl);
    dfl.sa_handler = SIG_DFL;
    sigemptyset(&dfl.sa_mask);
    sigaction(SIGBUS, &dfl, NULL);
    raise(sig); /* delivered on return (blocked in here): ends the process as without the handler */
}

moetax_status moetax_gguf_sigbus_install(void) {
    if (atomic_flag_test_and_set(&g_installed)) return MOETAX_OK;
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = on_sigbus;
    sa.sa_flags = SA_SIGINFO;
    sigemptyset(&sa.sa_mask);
    if (sigaction(SIGBUS, &sa, &g_prev) != 0) {
        atomic_flag_clear(&g_installed);
        return moetax_error(MOETAX_ERR_IO, "cannot install the SIGBUS handler");
    }
    return MOETAX_OK;
}
