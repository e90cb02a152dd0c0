/* main.c - `moetax <subcommand>`: dispatch from the table in commands.h. */
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "commands.h"
#include "moetax/gguf.h"
#include "moetax/outfile.h"
#ifdef MOETAX_WITH_MPI
#include "dist/dist.h"
#include "dist/gather.h"
#endif

struct command {
    const char *name;
    int (*fn)(int, char **);
    const char *help;
};

static const struct command k_commands[] = {
#define X(name, help) {#name, cmd_##name, help},
    MOETAX_COMMANDS(X)
#undef X
};

static void usage(FILE *f) {
    fprintf(f, "usage: moetax <command> [options]   (moetax <command> --help for details)\n\n"
               "moetax runs Mixture-of-Experts models on CPUs and shows what each step spends\n"
               "on the MoE synchronization tax (routing, dispatch, loading, waiting, combining).\n\ncommands:\n");
    for (size_t i = 0; i < sizeof k_commands / sizeof k_commands[0]; i++)
        fprintf(f, "  %-10s %s\n", k_commands[i].name, k_commands[i].help);
}

/* A signal that ends the process (SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGPIPE, SIGXFSZ, ...): remove
 * the temporary files of outputs not yet complete, then die of the signal as before (the targets
 * keep their old content). */
static void on_signal(int sig) {
    moetax_outfile_cleanup_signal();
    signal(sig, SIG_DFL);
    raise(sig);
}

#ifdef MOETAX_WITH_MPI
/* The sequences a command decodes together, as its options say: bench --batch LIST (its smallest),
 * run / perplexity --parallel N; 1 otherwise (one sequence, serve's varying batches, a bad value:
 * the command reports that itself). */
static int64_t batch_of(int argc, char **argv) {
    const char *opt = !strcmp(argv[1], "bench") ? "--batch"
                    : !strcmp(argv[1], "run") || !strcmp(argv[1], "perplexity") ? "--parallel" : NULL;
    const size_t n = opt ? strlen(opt) : 0;
    const char *v = NULL;
    for (int a = 2; opt && a < argc; a++) {
        if (!strcmp(argv[a], opt) && a + 1 < argc) v = argv[a + 1];
        else if (!strncmp(argv[a], opt, n) && argv[a][n] == '=') v = argv[a] + n + 1;
    }
    if (!v) return 1;
    int64_t lo = 0;
    for (const char *p = v; *p;) {
        char *end;
        const long long b = strtoll(p, &end, 10);
        if (end == p || b < 1) return 1;
        lo = lo && lo < b ? lo : b;
        p = *end == ',' ? end + 1 : end;
        if (*end && *end != ',') return 1;
    }
    return lo ? lo : 1;
}
#endif

/* The results went to standard output: a write that failed there (a full disk, /dev/full) is the
 * command's failure, said, and not an exit status 0 with the output cut short. */
static int stdout_checked(int rc) {
    errno = 0;
    if (fflush(stdout) == 0 && !ferror(stdout)) return rc;
    const int e = errno;
    fprintf(stderr, "moetax: cannot write standard output: %s\n", e ? strerror(e) : "a write failed");
    return rc ? rc : 1;
}

int main(int argc, char **argv) {
    static const int sigs[] = {SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGPIPE, SIGXFSZ, SIGUSR1, SIGUSR2, SIGALRM};
    for (size_t i = 0; i < sizeof sigs / sizeof sigs[0]; i++) {
        struct sigaction sa = {0}, old;
        sa.sa_handler = on_signal;
        sigemptyset(&sa.sa_mask);
        if (sigaction(sigs[i], NULL, &old) == 0 && old.sa_handler != SIG_IGN) sigaction(sigs[i], &sa, NULL);
    }
    (void)moetax_gguf_sigbus_install(); /* a model file cut while mapped: a message naming file and tensor */
    if (argc < 2) { usage(stderr); return 2; }
    if (!strcmp(argv[1], "-h") || !strcmp(argv[1], "--help") || !strcmp(argv[1], "help")) {
        usage(stdout);
        return stdout_checked(0);
    }
    if (!strcmp(argv[1], "--version")) { printf("moetax 0.1.0\n"); return stdout_checked(0); }
    for (size_t i = 0; i < sizeof k_commands / sizeof k_commands[0]; i++)
        if (!strcmp(argv[1], k_commands[i].name)) {
#ifdef MOETAX_WITH_MPI
            /* under mpirun: join the world (src/dist/dist.h); rank 0 writes the results */
            if (moetax_dist_init(&argc, &argv)) return 1;
#endif
            /* the whole command line, --placement and --ep-* included (taken out of argv below): the
             * files it reads, which no output may replace (cli_check_io) */
            char **all_args = malloc(sizeof *all_args * (size_t)(argc + 1)); /* kept to the end, held by cli.c */
            if (all_args) {
                memcpy(all_args, argv, sizeof *argv * (size_t)(argc + 1));
                cli_note_argv(argc, all_args);
            }
#ifdef MOETAX_WITH_MPI
            /* every rank runs rank 0's command (an MPMD line or another environment would hang in a
             * later collective): checked on the arguments as given, --placement and --ep-* included */
            if (moetax_dist_world() && moetax_dist_same_command(argc, argv)) {
                fprintf(stderr, "moetax: %s\n", moetax_last_error());
                moetax_dist_finalize(2);
                return 2;
            }
            /* inspect outside mpirun reads --placement and --ep-* itself (inspect --ranks N) */
            const bool offline = !moetax_dist_world() && !strcmp(argv[1], "inspect");
            /* --placement FILE, anywhere after the subcommand: the map of experts to ranks */
            for (int a = 2; !offline && a + 1 < argc; a++)
                if (!strcmp(argv[a], "--placement")) {
                    if (!moetax_dist_world()) {
                        fprintf(stderr, "moetax: --placement is for expert parallelism: run under mpirun\n");
                        return 2;
                    }
                    moetax_dist_set_placement(argv[a + 1]);
                    memmove(argv + a, argv + a + 2, sizeof *argv * (size_t)(argc - a - 1)); /* with the NULL */
                    argc -= 2;
                    break;
                }
            /* --ep-dispatch MODE and --ep-overlap (token-sharded dispatch, see src/dist/dist.h) */
            const char *ep_mode = NULL;
            bool ep_overlap = false;
            for (int a = 2; !offline && a < argc;) {
                int take = !strcmp(argv[a], "--ep-overlap") ? 1 : !strcmp(argv[a], "--ep-dispatch") && a + 1 < argc ? 2 : 0;
                if (!take) { a++; continue; }
                if (!moetax_dist_world()) {
                    fprintf(stderr, "moetax: %s is for expert parallelism: run under mpirun\n", argv[a]);
                    return 2;
                }
                if (take == 1) ep_overlap = true;
                else ep_mode = argv[a + 1];
                memmove(argv + a, argv + a + take, sizeof *argv * (size_t)(argc - a - take + 1)); /* with the NULL */
                argc -= take;
            }
            /* --ep-replicas R, --ep-replan K, --ep-load PROFILE (replicas of hot experts, src/dist/eplb.c) */
            const char *ep_rep[3] = {NULL, NULL, NULL};
            static const char *const rep_opts[3] = {"--ep-replicas", "--ep-replan", "--ep-load"};
            for (int a = 2; !offline && a < argc;) {
                int o = 0;
                while (o < 3 && strcmp(argv[a], rep_opts[o])) o++;
                if (o == 3) { a++; continue; }
                if (!moetax_dist_world()) {
                    fprintf(stderr, "moetax: %s is for expert parallelism: run under mpirun\n", argv[a]);
                    return 2;
                }
                if (a + 1 >= argc) {
                    fprintf(stderr, "moetax: %s needs a value\n", argv[a]);
                    moetax_dist_finalize(0);
                    return 2;
                }
                ep_rep[o] = argv[a + 1];
                memmove(argv + a, argv + a + 2, sizeof *argv * (size_t)(argc - a - 1)); /* with the NULL */
                argc -= 2;
            }
            if ((ep_rep[0] || ep_rep[1] || ep_rep[2]) && moetax_dist_set_replicas(ep_rep[0], ep_rep[1], ep_rep[2])) {
                moetax_dist_finalize(0);
                return 2;
            }
            if ((ep_mode || ep_overlap) &&
                moetax_dist_set_dispatch(ep_mode ? ep_mode : "alltoall", ep_overlap || moetax_dist_world()->overlap)) {
                moetax_dist_finalize(0);
                return 2;
            }
            /* none chosen: the token-sharded dispatch for batches where it measured faster (src/dist/dist.h) */
            if (!offline && moetax_dist_world()) moetax_dist_default_dispatch(batch_of(argc, argv));
            int rc = stdout_checked(k_commands[i].fn(argc - 1, argv + 1));
            moetax_dist_finalize(rc);
            return rc;
#else
            if (getenv("OMPI_COMM_WORLD_SIZE") && strcmp(getenv("OMPI_COMM_WORLD_SIZE"), "1"))
                fprintf(stderr, "moetax: built without MPI (Debian: libopenmpi-dev): each of the %s processes "
                                "runs alone\n", getenv("OMPI_COMM_WORLD_SIZE"));
            return stdout_checked(k_commands[i].fn(argc - 1, argv + 1));
#endif
        }
    fprintf(stderr, "moetax: unknown command '%s'\n\n", argv[1]);
    usage(stderr);
    return 2;
}
