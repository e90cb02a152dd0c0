/* pages.c - how the memory under an address is paged (4 KiB or 2 MiB); see
 * moetax_mem_pages in moetax/membw.h. Linux: /proc/self/smaps. */
#include <errno.h>
#include <inttypes.h>
#include <stdbool.h>
#include <stdio.h>
#include <string.h>

#include <sys/mman.h>

#include "moetax/membw.h"

uint8_t *moetax_huge_alloc(size_t bytes, struct moetax_huge_buf *b) {
    const size_t huge = (size_t)2 << 20, page = 4096;
    memset(b, 0, sizeof *b);
    const size_t rb = (bytes + huge - 1) / huge * huge; /* a partial last one would stay in 4 KiB pages */
    const size_t len = rb + huge + page;                /* room to align, and a page after */
    uint8_t *p = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) return NULL;
    uint8_t *start = (uint8_t *)(((uintptr_t)p + page + huge - 1) & ~(uintptr_t)(huge - 1));
    (void)mprotect(p, (size_t)(start - p), PROT_NONE);
    (void)mprotect(start + rb, (size_t)(p + len - (start + rb)), PROT_NONE);
#ifdef MADV_HUGEPAGE
    (void)madvise(start, rb, MADV_HUGEPAGE);
#endif
    *b = (struct moetax_huge_buf){.ptr = start, .map = p, .map_len = len};
    return start;
}

void moetax_huge_free(struct moetax_huge_buf *b) {
    if (b->map) munmap(b->map, b->map_len);
    memset(b, 0, sizeof *b);
}

moetax_status moetax_mem_pages(const void *addr, struct moetax_mem_paging *out) {
    memset(out, 0, sizeof *out);
    FILE *f = fopen("/proc/self/smaps", "r");
    if (!f) return moetax_error(MOETAX_ERR_IO, "/proc/self/smaps: %s", strerror(errno));
    moetax_status st = moetax_mem_pages_from(f, addr, out);
    fclose(f);
    return st;
}

moetax_status moetax_mem_pages_from(FILE *f, const void *addr, struct moetax_mem_paging *out) {
    memset(out, 0, sizeof *out);
    const uintptr_t a = (uintptr_t)addr;
    char line[512];
    bool in = false, found = false, line_start = true;
    while (fgets(line, sizeof line, f)) {
        const bool whole = line_start; /* the rest of a long line (a path) is skipped */
        line_start = strchr(line, '\n') != NULL;
        if (!whole) continue;
        uintptr_t lo, hi;
        unsigned long long kb;
        /* a mapping's header: "lo-hi perms offset dev inode [path]"; its fields follow as "Name:   N kB" */
        if (sscanf(line, "%" SCNxPTR "-%" SCNxPTR " ", &lo, &hi) == 2) {
            if (found && in) break;
            in = a >= lo && a < hi;
            if (in) {
                found = true;
                out->start = (const void *)lo;
                out->bytes = hi - lo;
            }
            continue;
        }
        if (!in) continue;
        if (sscanf(line, "Rss: %llu kB", &kb) == 1) out->resident = kb << 10;
        else if (sscanf(line, "AnonHugePages: %llu kB", &kb) == 1) out->huge += kb << 10;
        else if (sscanf(line, "FilePmdMapped: %llu kB", &kb) == 1) out->huge += kb << 10;
        else if (sscanf(line, "ShmemPmdMapped: %llu kB", &kb) == 1) out->huge += kb << 10;
    }
    if (!found) return moetax_error(MOETAX_ERR_NOT_FOUND, "/proc/self/smaps: no mapping holds address %p", addr);
    return MOETAX_OK;
}
