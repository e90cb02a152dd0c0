/* dist_cmd.h - the server's command stream under mpirun (built with MOETAX_WITH_MPI). Internal.
 *
 * DESIGN
 *   `mpirun -np N moetax serve ...`: rank 0 speaks HTTP and runs the scheduler; every rank
 *   holds a context of its own (the same parameters: the same KV cache, its own experts) and
 *   every rank must step with the same batch on the same cache. run/bench/perplexity get that
 *   for free (every rank runs the same program), a server does not: only rank 0 sees the
 *   requests. So rank 0's scheduler sends, before each decode, one message to every other rank:
 *   the script of the KV cache operations it made since the last step, in order, then the batch.
 *   The other ranks (followers, src/server/sched.c srv_sched_follow) replay the script on their
 *   own cache and decode the same batch; the context's own collectives (src/dist/dist.h) then run
 *   as in any other command. Operations are deterministic, so replaying the same script on the
 *   same state gives the same state (a refused copy is refused everywhere alike).
 *
 *   The messages travel on a communicator of their own (a duplicate of MPI_COMM_WORLD), so they
 *   never match a collective of the forward pass. A follower waits for the next one polling
 *   (MPI_Iprobe): tight for a few milliseconds (the next step of a busy server), then with
 *   sleeps of 200 us, 1 ms after a second of idleness and 5 ms after ten (an idle server's
 *   followers measured 5% of a core each with 200 us sleeps), and a follower whose launcher
 *   (mpirun or its daemon) has gone returns an error instead of polling forever. Only the thread that
 *   initialised MPI calls these (MPI_THREAD_FUNNELED): under mpirun the scheduler runs on the
 *   main thread (srv_sched_run).
 *
 * MESSAGE (int32 words)
 *   DIST_CMD_RM seq p0 p1          moetax_kvcache_seq_rm(kv, seq, p0, p1)   (p1 = -1: to the end)
 *   DIST_CMD_CP src dst p0 p1      moetax_kvcache_seq_cp(kv, src, dst, p0, p1)
 *   DIST_CMD_DECODE n  then n x (token, pos, seq, logits)   moetax_ctx_decode of that batch
 *   DIST_CMD_STOP                  the server is stopping: the follower returns
 *   (positions are int32: the cache's cells are at most INT32_MAX.)
 */
#ifndef MOETAX_DIST_CMD_H
#define MOETAX_DIST_CMD_H

#include <stddef.h>
#include <stdint.h>

#include "moetax/status.h"

enum dist_cmd_op { DIST_CMD_RM = 1, DIST_CMD_CP = 2, DIST_CMD_DECODE = 3, DIST_CMD_STOP = 4 };

/* Collective (every rank, at the same point): the stream's communicator. */
moetax_status moetax_dist_cmd_open(void);
void moetax_dist_cmd_close(void);
/* Rank 0: words [n] to every other rank. */
moetax_status moetax_dist_cmd_send(const int32_t *words, size_t n);
/* Other ranks: the next message from rank 0 into *buf (grown as needed, *cap its words), *n its
 * words. Waits as long as it takes (an idle server is not an error; a rank 0 that died ends the
 * job through mpirun). */
moetax_status moetax_dist_cmd_recv(int32_t **buf, size_t *cap, size_t *n);

#endif
