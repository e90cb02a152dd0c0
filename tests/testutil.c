#include "testutil.h"

#include "moetax/model.h"
#include "moetax/store.h"

#include <math.h>
#include <pthread.h>
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

/* Standard normal samples: drawn (by r) from a fixed table of 2^20 Box-Muller values made once
 * per process. Box-Muller per call (logf, cosf) was most of test_kernels' time under ASan. */
enum { TU_NORMAL_BITS = 20 };
static float *tu_normal_table;
static void tu_normal_init(void) {
    tu_normal_table = malloc(sizeof(float) << TU_NORMAL_BITS);
    if (!tu_normal_table) abort();
    tu_rng g = {0x9e3779b97f4a7c15ull};
    for (size_t i = 0; i < (size_t)1 << TU_NORMAL_BITS; i += 2) {
        float u1 = tu_rand_uniform(&g), u2 = tu_rand_uniform(&g);
        if (u1 < 1e-7f) u1 = 1e-7f;
        const float rad = sqrtf(-2.0f * logf(u1));
        tu_normal_table[i] = rad * cosf(6.2831853f * u2);
        tu_normal_table[i + 1] = rad * sinf(6.2831853f * u2);
    }
}
float tu_rand_normal(tu_rng *r) {
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    pthread_once(&once, tu_normal_init);
    return tu_normal_table[tu_rand_u64(r) >> (64 - TU_NORMAL_BITS)];
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
