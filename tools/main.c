/* main.c - `moetax <subcommand>`: dispatch from the table in commands.h. */
#include <stdio.h>
#include <string.h>

#include "commands.h"

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

int main(int argc, char **argv) {
    if (argc < 2) { usage(stderr); return 2; }
    if (!strcmp(argv[1], "-h") || !strcmp(argv[1], "--help") || !strcmp(argv[1], "help")) {
        usage(stdout);
        return 0;
    }
    if (!strcmp(argv[1], "--version")) { printf("moetax 0.1.0\n"); return 0; }
    for (size_t i = 0; i < sizeof k_commands / sizeof k_commands[0]; i++)
        if (!strcmp(argv[1], k_commands[i].name)) return k_commands[i].fn(argc - 1, argv + 1);
    fprintf(stderr, "moetax: unknown command '%s'\n\n", argv[1]);
    usage(stderr);
    return 2;
}
