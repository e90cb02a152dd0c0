/* gather.h - every rank's bytes to rank 0, and the check that every rank runs the same command
 * (built with MOETAX_WITH_MPI). Internal.
 *
 * For outputs that each rank makes of its own and rank 0 writes as one file (the ledger's
 * ranks, one Chrome trace with a process per rank: tools/ledger_cli.c). Collective: every rank
 * calls it at the same point of the command. It runs on a communicator of its own (a duplicate
 * of MPI_COMM_WORLD, made and freed here), so it never matches a message of the forward pass.
 * Up to INT32_MAX bytes per rank (MPI's counts are int). */
#ifndef MOETAX_DIST_GATHER_H
#define MOETAX_DIST_GATHER_H

#include <stddef.h>

#include "moetax/status.h"

/* Rank 0: (*all)[r] holds rank r's n bytes and a terminating 0 (malloc'd, free with
 * moetax_dist_gather_free), (*lens)[r] their length; other ranks: *all = *lens = NULL.
 * *n_ranks: the world's size on every rank. */
moetax_status moetax_dist_gather_bytes(const void *mine, size_t n, char ***all, size_t **lens, int *n_ranks);
void moetax_dist_gather_free(char **all, size_t *lens, int n_ranks);

/* At start-up, collective: every rank's arguments (argv[1..argc-1]) and its MOETAX_MPI_*
 * environment against rank 0's. `mpirun -np N moetax ...` gives them all the same; an MPMD
 * line (`mpirun -np 1 moetax A : -np 1 moetax B`) or a different environment would make the
 * ranks disagree on what to compute and hang in a collective later. Returns an error on every
 * rank when any differs; the rank that differs names its first differing argument. */
moetax_status moetax_dist_same_command(int argc, char **argv);

#endif
