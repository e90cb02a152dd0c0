/* testutil.h - a minimal test harness: CHECK macros that count failures, a
 * deterministic RNG, and helpers to reach the moetax binary and scratch dir.
 * Each test binary is run by CTest as: test_x MOETAX_BIN WORKDIR. */
#ifndef MOETAX_TESTUTIL_H
#define MOETAX_TESTUTIL_H

#include <stdint.h>
#include <stdio.h>
#include <stdbool.h>

extern int tu_failures;
extern int tu_checks;
extern const char *tu_moetax_bin; /* argv[1] or "moetax" */
extern const char *tu_workdir;    /* argv[2] or "/tmp" */

void tu_init(int argc, char **argv);
int tu_finish(const char *name); /* prints a summary, returns the exit code */

#define CHECK(cond) do { tu_checks++; if (!(cond)) { tu_failures++; \
    fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond); } } while (0)
#define CHECK_MSG(cond, ...) do { tu_checks++; if (!(cond)) { tu_failures++; \
    fprintf(stderr, "%s:%d: CHECK failed: %s: ", __FILE__, __LINE__, #cond); \
    fprintf(stderr, __VA_ARGS__); fputc('\n', stderr); } } while (0)
#define CHECK_EQ_INT(a, b) do { long long _a = (long long)(a), _b = (long long)(b); tu_checks++; \
    if (_a != _b) { tu_failures++; fprintf(stderr, "%s:%d: CHECK failed: %s == %s (%lld vs %lld)\n", \
    __FILE__, __LINE__, #a, #b, _a, _b); } } while (0)

/* xorshift64* RNG */
/* 1 in a ThreadSanitizer build (gcc's __SANITIZE_THREAD__, clang's __has_feature): tests that
 * run many times slower there may check fewer cases that differ only outside threading. */
#if defined(__SANITIZE_THREAD__)
#define TU_UNDER_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define TU_UNDER_TSAN 1
#endif
#endif
#ifndef TU_UNDER_TSAN
#define TU_UNDER_TSAN 0
#endif

typedef struct tu_rng { uint64_t s; } tu_rng;
uint64_t tu_rand_u64(tu_rng *r);
float tu_rand_uniform(tu_rng *r); /* [0,1) */
float tu_rand_normal(tu_rng *r);

/* Path join into a static rotating buffer. */
const char *tu_path(const char *name);
/* Run a shell command, return its exit status (or -1). Output captured to *out (malloc'd) if out != NULL. */
int tu_run(const char *cmd, char **out);

struct moetax_model;
struct moetax_store_params;
/* The bytes of one expert slot of m's store with these parameters (a store opened with an unlimited budget
 * and freed); 0 where it cannot open, with moetax_last_error() saying why. Tests size budgets from it. */
uint64_t tu_store_slot_bytes(const struct moetax_model *m, const struct moetax_store_params *sp);

#endif
