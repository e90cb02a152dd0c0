#include "testutil.h"

#include "moetax/model.h"
#include "moetax/store.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>

int tu_failures = 0;
int tu_checks = 0;
const char *tu_moetax_bin = "moetax";
const char *tu_workdir = "/tmp";

void tu_init(int argc, char **argv) {
    if (argc > 1) tu_moetax_bin = argv[1];
    if (argc > 2) tu_workdir = argv[2];
}

int tu_finish(const char *name) {
    printf("%s: %d checks, %d failed\n", name, tu_checks, tu_failures);
    return tu_failures ? 1 : 0;
}

uint64_t tu_rand_u64(tu_rng *r) {
    r->s ^= r->s >> 12;
    r->s ^= r->s << 25;
    r->s ^= r->s >> 27;
    return r->s * 2685821657736338717ull;
}

float tu_rand_uniform(tu_rng *r) { return (float)(tu_rand_u64(r) >> 40) / 16777216.0f; }

float tu_rand_normal(tu_rng *r) {
    float u1 = tu_rand_uniform(r), u2 = tu_rand_uniform(r);
    if (u1 < 1e-7f) u1 = 1e-7f;
    return sqrtf(-2.0f * logf(u1)) * cosf(6.2831853f * u2);
}

const char *tu_path(const char *name) {
    static char buf[4][1024];
    static int i = 0;
    i = (i + 1) & 3;
    snprintf(buf[i], sizeof buf[i], "%s/%s", tu_workdir, name);
    return buf[i];
}

int tu_run(const char *cmd, char **out) {
    FILE *p = popen(cmd, "r");
    if (!p) return -1;
    size_t cap = 4096, len = 0;
    char *buf = malloc(cap);
    size_t n;
    while (buf && (n = fread(buf + len, 1, cap - len - 1, p)) > 0) {
        len += n;
        if (cap - len < 1024) { cap *= 2; buf = realloc(buf, cap); }
    }
    if (buf) buf[len] = '\0';
    int st = pclose(p);
    if (out) *out = buf; else free(buf);
    if (st == -1) return -1;
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

uint64_t tu_store_slot_bytes(const struct moetax_model *m, const struct moetax_store_params *sp) {
    struct moetax_store_params p = *sp;
    p.budget_bytes = (uint64_t)1 << 40;
    struct moetax_store *s = NULL;
    int ub = 64;
    if (moetax_model_store_open(m, &p, ub, 0, &s, &ub) != MOETAX_OK || !s) return 0;
    const uint64_t slot = moetax_store_slot_bytes(s);
    moetax_store_free(s);
    return slot;
}
