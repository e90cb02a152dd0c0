/* belady.c - the offline optimal hit rate (Belady's MIN) of an expert cache
 * over a recorded access trace: the ceiling any online policy is compared with.
 *
 * Keys (layer, expert) are compacted to dense ids by sorting; next[i] is the
 * next position of the same key (n if none). On a miss with the cache full the
 * key with the farthest next use is evicted, found in a max-heap of (next, id)
 * with lazy deletion (an entry is live if the key is cached and its current
 * next use matches). O(n log n) time, O(n) memory. */
#include <stdlib.h>

#include "moetax/store.h"

struct kv {
    uint64_t key;
    int64_t idx;
};

static int kv_cmp(const void *a, const void *b) {
    const struct kv *x = a, *y = b;
    if (x->key != y->key) return x->key < y->key ? -1 : 1;
    return x->idx < y->idx ? -1 : (x->idx > y->idx);
}

struct hent {
    int64_t next;
    int64_t id;
};

static void heap_push(struct hent *h, int64_t *n, struct hent v) {
    int64_t i = (*n)++;
    while (i > 0) {
        int64_t p = (i - 1) / 2;
        if (h[p].next >= v.next) break;
        h[i] = h[p];
        i = p;
    }
    h[i] = v;
}

static struct hent heap_pop(struct hent *h, int64_t *n) {
    struct hent top = h[0], v = h[--(*n)];
    int64_t i = 0;
    for (;;) {
        int64_t c = 2 * i + 1;
        if (c >= *n) break;
        if (c + 1 < *n && h[c + 1].next > h[c].next) c++;
        if (h[c].next <= v.next) break;
        h[i] = h[c];
        i = c;
    }
    if (*n > 0) h[i] = v;
    return top;
}

double moetax_store_belady_hit_rate(const int32_t *layer, const int32_t *expert, int64_t n, int64_t n_slots) {
    if (n < 0 || n_slots < 1) return -1.0;
    if (n == 0) return 0.0;
    if (!layer || !expert) return -1.0;
    for (int64_t i = 0; i < n; i++)
        if (layer[i] < 0 || expert[i] < 0) return -1.0;

    struct kv *kv = malloc(sizeof *kv * (size_t)n);
    int64_t *id = malloc(sizeof *id * (size_t)n);
    int64_t *next = malloc(sizeof *next * (size_t)n);
    struct hent *heap = malloc(sizeof *heap * (size_t)n);
    double rate = -1.0;
    int64_t *last = NULL, *cur_next = NULL;
    unsigned char *cached = NULL;
    if (!kv || !id || !next || !heap) goto out;

    for (int64_t i = 0; i < n; i++) {
        kv[i].key = ((uint64_t)(uint32_t)layer[i] << 32) | (uint32_t)expert[i];
        kv[i].idx = i;
    }
    qsort(kv, (size_t)n, sizeof *kv, kv_cmp);
    int64_t n_id = 0;
    for (int64_t i = 0; i < n; i++) {
        if (i > 0 && kv[i].key != kv[i - 1].key) n_id++;
        id[kv[i].idx] = n_id;
    }
    n_id++;
    last = malloc(sizeof *last * (size_t)n_id);
    cur_next = malloc(sizeof *cur_next * (size_t)n_id);
    cached = calloc((size_t)n_id, 1);
    if (!last || !cur_next || !cached) goto out;
    for (int64_t k = 0; k < n_id; k++) last[k] = n;
    for (int64_t i = n - 1; i >= 0; i--) {
        next[i] = last[id[i]];
        last[id[i]] = i;
    }

    int64_t hits = 0, count = 0, hn = 0;
    for (int64_t i = 0; i < n; i++) {
        int64_t k = id[i];
        if (cached[k]) {
            hits++;
        } else {
            if (count == n_slots) {
                for (;;) {
                    struct hent t = heap_pop(heap, &hn);
                    if (cached[t.id] && cur_next[t.id] == t.next) {
                        cached[t.id] = 0;
                        count--;
                        break;
                    }
                }
            }
            cached[k] = 1;
            count++;
        }
        cur_next[k] = next[i];
        /* one push per access: the heap never holds more than n entries */
        heap_push(heap, &hn, (struct hent){next[i], k});
    }
    rate = (double)hits / (double)n;
out:
    free(kv);
    free(id);
    free(next);
    free(heap);
    free(last);
    free(cur_next);
    free(cached);
    return rate;
}

int64_t moetax_store_trace_uses(int32_t *layer, int32_t *expert, int64_t n) {
    int64_t out = 0, run0 = 0; /* kept entries of the current run: [run0, out) */
    for (int64_t i = 0; i < n; i++) {
        if (out > run0 && layer[i] != layer[out - 1]) run0 = out; /* a new pass */
        bool seen = false;
        for (int64_t j = run0; j < out && !seen; j++) seen = expert[j] == expert[i];
        if (seen) continue;
        layer[out] = layer[i];
        expert[out] = expert[i];
        out++;
    }
    return out;
}

static int cnt_desc(const void *a, const void *b) {
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return x < y ? 1 : (x > y ? -1 : 0);
}

double moetax_store_static_hit_rate(const int32_t *layer, const int32_t *expert, int64_t n, int64_t n_slots) {
    if (n < 0 || n_slots < 1) return -1.0;
    if (n == 0) return 0.0;
    if (!layer || !expert) return -1.0;
    struct kv *kv = malloc(sizeof *kv * (size_t)n);
    int64_t *cnt = malloc(sizeof *cnt * (size_t)n);
    double rate = -1.0;
    if (!kv || !cnt) goto out;
    for (int64_t i = 0; i < n; i++) {
        if (layer[i] < 0 || expert[i] < 0) goto out;
        kv[i].key = ((uint64_t)(uint32_t)layer[i] << 32) | (uint32_t)expert[i];
        kv[i].idx = i;
    }
    qsort(kv, (size_t)n, sizeof *kv, kv_cmp);
    int64_t nk = 0;
    for (int64_t i = 0; i < n; i++) {
        if (i == 0 || kv[i].key != kv[i - 1].key) cnt[nk++] = 0;
        cnt[nk - 1]++;
    }
    qsort(cnt, (size_t)nk, sizeof *cnt, cnt_desc);
    int64_t hits = 0;
    for (int64_t k = 0; k < nk && k < n_slots; k++) hits += cnt[k] - 1;
    rate = (double)hits / (double)n;
out:
    free(kv);
    free(cnt);
    return rate;
}
