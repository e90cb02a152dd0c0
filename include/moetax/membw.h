/*
 * moetax/membw.h - memory read bandwidth of this machine: the roofline.
 *
 * DESIGN
 *   Every throughput figure moetax reports (kernels, experts, decode) is divided
 *   by the read bandwidth measured here, so this must be what a well-written
 *   streaming kernel can reach, not a pessimistic number:
 *     - one buffer far larger than the last-level cache (the caller passes its
 *       size; 512 MiB - 1 GiB is typical), mmap'd with transparent huge pages
 *       requested, and written once (first touch by the thread that will read
 *       it) so every page exists and is not the shared zero page;
 *     - each pool worker streams its own contiguous share (4 KiB aligned) with
 *       AVX2 256-bit loads into four independent accumulators (scalar 64-bit
 *       loads without AVX2, or with MOETAX_FORCE_REF=1 in the environment); the sums
 *       are stored, so the loads cannot be dropped;
 *     - all workers start together (barrier) and the time runs until the last
 *       one finishes (barrier); one warm-up pass, then reps timed passes; the
 *       median is the figure.
 *
 * INVARIANTS
 *   - GB/s are 1e9 bytes per second.
 *   - moetax_membw_sum and moetax_membw_sum_ref return the same value for the
 *     same bytes: the wrapping sum of the little-endian 64-bit words of the
 *     first bytes/8*8 bytes plus each remaining byte.
 */
#ifndef MOETAX_MEMBW_H
#define MOETAX_MEMBW_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "moetax/pool.h"
#include "moetax/status.h"

#ifdef __cplusplus
extern "C" {
#endif

struct moetax_membw_result {
    double gbps_median, gbps_min, gbps_max;
    size_t bytes;       /* buffer size actually read per pass */
    int threads, reps;
    const char *kernel; /* "avx2" or "ref" */
};

/* Read bandwidth with all of the pool's workers over a bytes-sized buffer,
 * median of reps passes. bytes >= 4096, reps >= 1. */
moetax_status moetax_membw_read(struct moetax_pool *pool, size_t bytes, int reps, double *gbps_median);
moetax_status moetax_membw_read_ex(struct moetax_pool *pool, size_t bytes, int reps,
                                   struct moetax_membw_result *out);

/* One timed pass with all of the pool's workers over a caller's buffer
 * (each worker its 4 KiB-aligned share; no warm-up, the buffer as it is):
 * e.g. the bytes another kernel is about to read, for a paired comparison. */
moetax_status moetax_membw_pass(struct moetax_pool *pool, const void *buf, size_t bytes, double *gbps);

/* A reusable probe: one buffer of bytes (allocated and first touched once),
 * then one timed pass with all of the pool's workers per call. For pairing a
 * bandwidth reading with each repetition of another measurement on a machine
 * whose bandwidth drifts. The pool must outlive the probe. */
struct moetax_membw_probe;
moetax_status moetax_membw_probe_new(struct moetax_pool *pool, size_t bytes, struct moetax_membw_probe **out);
moetax_status moetax_membw_probe_pass(struct moetax_membw_probe *p, double *gbps);
void moetax_membw_probe_free(struct moetax_membw_probe *p);

/* The streaming read kernel on its own (fastest available, and the scalar reference). */
uint64_t moetax_membw_sum(const void *buf, size_t bytes);
uint64_t moetax_membw_sum_ref(const void *buf, size_t bytes);
const char *moetax_membw_kernel_name(void);

/* How the mapping (VMA) that holds addr is paged, from /proc/self/smaps:
 * streaming weights through 4 KiB pages reads them measurably slower than
 * through 2 MiB pages (a TLB walk and a hardware prefetcher restart every
 * 4 KiB), and this probe's buffer uses 2 MiB pages. The figures cover the
 * whole mapping, which the kernel may have merged with a neighbour of the
 * same kind. MOETAX_ERR_IO without /proc, MOETAX_ERR_NOT_FOUND if no mapping
 * holds addr. */
struct moetax_mem_paging {
    const void *start;   /* the mapping's first byte */
    uint64_t bytes;      /* its size */
    uint64_t resident;   /* bytes of it in memory (Rss) */
    uint64_t huge;       /* of those, mapped as 2 MiB pages (AnonHugePages + FilePmdMapped + ShmemPmdMapped) */
};
moetax_status moetax_mem_pages(const void *addr, struct moetax_mem_paging *out);
/* moetax_mem_pages makes the kernel walk the page tables of every mapping up to
 * the one asked for: not for timed sections. moetax_mem_pages_from parses a
 * stream in the smaps format instead (tests). */
moetax_status moetax_mem_pages_from(FILE *smaps, const void *addr, struct moetax_mem_paging *out);

/* Anonymous memory for data that kernels stream (weight copies, expert slots, the
 * read probe): bytes rounded up to whole 2 MiB pages, 2 MiB aligned, advised into
 * 2 MiB pages, between inaccessible pages so that the kernel cannot merge it with
 * a neighbour (moetax_mem_pages then describes it alone). Zero-filled. Returns
 * b->ptr, or NULL with errno set; moetax_huge_free releases it (a zeroed b: no-op). */
struct moetax_huge_buf {
    uint8_t *ptr;   /* the usable bytes */
    void *map;      /* the whole mapping */
    size_t map_len;
};
uint8_t *moetax_huge_alloc(size_t bytes, struct moetax_huge_buf *b);
void moetax_huge_free(struct moetax_huge_buf *b);

#ifdef __cplusplus
}
#endif
#endif
