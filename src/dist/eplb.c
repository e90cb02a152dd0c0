/* eplb.c - replicas of hot experts (EPLB-style; see dist.h, "Replication"). No MPI call here:
 * every rank sees the same counts (the replicated dispatch routes every token everywhere; the
 * token-sharded one gathers the counts per layer), so every rank plans the same replicas and
 * the same split of the slots from them. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "dist/dist.h"
#include "moetax/profile.h"

static int g_replicas = -1, g_replan = -1; /* -1: not given (environment, then the default) */
static const char *g_load;                 /* --ep-load PROFILE */

/* a whole number in [lo, hi], else -1 */
static int parse_count(const char *s, int lo, int hi) {
    char *end;
    if (!s || !*s) return -1;
    long v = strtol(s, &end, 10);
    return *end || v < lo || v > hi ? -1 : (int)v;
}

int moetax_dist_set_replicas(const char *replicas, const char *replan, const char *load) {
    const int rank = moetax_dist_rank();
    if (replicas) {
        g_replicas = parse_count(replicas, 0, 4096);
        if (g_replicas < 0) {
            if (rank == 0)
                fprintf(stderr, "moetax: --ep-replicas '%s': expected a whole number of extra expert replicas per MoE "
                        "layer, 0 to 4096\n", replicas);
            return 1;
        }
    }
    if (replan) {
        g_replan = parse_count(replan, 1, 1 << 30);
        if (g_replan < 0) {
            if (rank == 0)
                fprintf(stderr, "moetax: --ep-replan '%s': expected a whole number of steps >= 1\n", replan);
            return 1;
        }
        if (rank == 0) /* kept so that command lines that had it still run */
            fprintf(stderr, "moetax: warning: --ep-replan has no effect: every MoE layer plans its replicas from each "
                    "micro-batch's own counts\n");
    }
    if (load) g_load = load;
    return 0;
}

/* The replicas' settings from the options or MOETAX_MPI_REPLICAS / MOETAX_MPI_REPLAN; a bad value is
 * every rank's error (a message printed by rank 0 alone could be lost when another rank ends the job
 * first). */
static moetax_status settings(struct moetax_dist *d) {
    if (g_replicas < 0 && getenv("MOETAX_MPI_REPLICAS") && *getenv("MOETAX_MPI_REPLICAS")) {
        const char *v = getenv("MOETAX_MPI_REPLICAS");
        if ((g_replicas = parse_count(v, 0, 4096)) < 0)
            return moetax_error(MOETAX_ERR_ARG, "MOETAX_MPI_REPLICAS=%.40s: expected a whole number, 0 to 4096", v);
    }
    if (g_replan < 0 && getenv("MOETAX_MPI_REPLAN") && *getenv("MOETAX_MPI_REPLAN")) {
        const char *v = getenv("MOETAX_MPI_REPLAN");
        if ((g_replan = parse_count(v, 1, 1 << 30)) < 0)
            return moetax_error(MOETAX_ERR_ARG, "MOETAX_MPI_REPLAN=%.40s: expected a whole number of steps >= 1", v);
        if (d->rank == 0)
            fprintf(stderr, "moetax: warning: MOETAX_MPI_REPLAN has no effect: every MoE layer plans its replicas from "
                    "each micro-batch's own counts\n");
    }
    d->n_rep = g_replicas > 0 ? g_replicas : 0;
    d->replan = g_replan > 0 ? g_replan : 1;
    return MOETAX_OK;
}

/* A layer's hosts: nh [E] hosts per expert, hosts [E, H] (D's own plan, or a micro-batch's copy). */
static double rank_load(const struct moetax_dist *d, const int32_t *nhs, const int32_t *hosts, const double *w,
                        double *lr) {
    const int E = d->n_expert, H = d->H, P = d->size;
    for (int r = 0; r < P; r++) lr[r] = 0;
    for (int e = 0; e < E; e++) {
        const int nh = nhs[e];
        for (int j = 0; j < nh; j++) lr[hosts[(size_t)e * H + j]] += w[e] / nh;
    }
    double mx = 0;
    for (int r = 0; r < P; r++) mx = lr[r] > mx ? lr[r] : mx;
    return mx;
}

/* Layer il's hosts from the loads w [E]: the owner first, then n_rep replicas (while an expert
 * with load can still take a host), each on the least-loaded rank that may hold the expert
 * (avail): first for the busiest rank's expert that lowers the expected busiest load most, when
 * none does (eplb_rule) for the expert with the largest load per host (EPLB's rule): its slots of
 * each micro-batch are then split to balance that micro-batch's own counts (moetax_dist_split).
 * local [P, E] (or NULL): how many of each expert's assignments come from each rank's own tokens;
 * between equally loaded ranks the one with most of them takes the replica (it keeps those, the
 * token-sharded dispatch sends them nowhere). */
static void plan_layer(const struct moetax_dist *d, int il, const double *w, bool eplb_rule, const int32_t *local,
                       int32_t *nhs, int32_t *hosts) {
    const int E = d->n_expert, H = d->H, P = d->size;
    double lr[1024], nl[1024];
    for (int e = 0; e < E; e++) {
        nhs[e] = 1;
        hosts[(size_t)e * H] = d->owner[(size_t)il * E + e];
    }
    if (P > 1024) return;
    for (int i = 0; i < d->n_rep; i++) {
        const double mx = rank_load(d, nhs, hosts, w, lr);
        int busy = 0;
        for (int r = 1; r < P; r++) busy = lr[r] > lr[busy] ? r : busy;
        int best_e = -1, best_t = -1;
        double best_mx = mx;
        for (int e = 0; e < E; e++) {
            const size_t ie = (size_t)il * E + e;
            const int nh = nhs[e];
            bool on_busy = false;
            for (int j = 0; j < nh; j++) on_busy |= hosts[(size_t)e * H + j] == busy;
            if (!on_busy || nh >= H || w[e] <= 0) continue;
            int t = -1; /* the least-loaded rank that may take it (ties: most of e's own assignments) */
            for (int r = 0; r < P; r++) {
                bool host = false;
                for (int j = 0; j < nh; j++) host |= hosts[(size_t)e * H + j] == r;
                if (host || !d->avail[ie * P + r]) continue;
                if (t < 0 || (!local && lr[r] < lr[t]) || (local && lr[r] < lr[t] - 1e-9) ||
                    (local && lr[r] <= lr[t] + 1e-9 && local[(size_t)r * E + e] > local[(size_t)t * E + e]))
                    t = r;
            }
            if (t < 0) continue;
            /* the loads with e on nh + 1 hosts */
            memcpy(nl, lr, sizeof(double) * (size_t)P);
            for (int j = 0; j < nh; j++) nl[hosts[(size_t)e * H + j]] -= w[e] / nh - w[e] / (nh + 1);
            nl[t] += w[e] / (nh + 1);
            double m2 = 0;
            for (int r = 0; r < P; r++) m2 = nl[r] > m2 ? nl[r] : m2;
            if (m2 < best_mx - 1e-9) best_mx = m2, best_e = e, best_t = t;
        }
        if (best_e < 0 && eplb_rule) { /* else (EPLB): the hottest share per host anywhere, to the least-loaded rank */
            double bw = 0;
            for (int e = 0; e < E; e++) {
                const size_t ie = (size_t)il * E + e;
                const int nh = nhs[e];
                if (nh >= H || w[e] / nh <= bw) continue;
                int t = -1;
                for (int r = 0; r < P; r++) {
                    bool host = false;
                    for (int j = 0; j < nh; j++) host |= hosts[(size_t)e * H + j] == r;
                    if (!host && d->avail[ie * P + r] && (t < 0 || lr[r] < lr[t])) t = r;
                }
                if (t >= 0) bw = w[e] / nh, best_e = e, best_t = t;
            }
        }
        if (best_e < 0) break;
        hosts[(size_t)best_e * H + nhs[best_e]++] = best_t;
    }
}

void moetax_dist_replan(struct moetax_dist *d) {
    const int E = d->n_expert;
    double *w = malloc(sizeof(double) * (size_t)E);
    if (!w) return; /* keeps the current plan */
    for (int il = 0; il < d->n_layer; il++) {
        if (!d->is_moe[il]) continue;
        for (int e = 0; e < E; e++) w[e] = (double)d->load[(size_t)il * E + e];
        plan_layer(d, il, w, true, NULL, d->n_hosts + (size_t)il * E, d->hosts + (size_t)il * E * d->H);
        /* recent steps weigh most: the counts halve at every plan (the same sequences' next tokens
         * tend to use the same experts; measured: halving beat cumulative counts on held-out text) */
        for (int e = 0; e < E; e++) d->load[(size_t)il * E + e] /= 2;
    }
    free(w);
    d->n_replans++;
}

void moetax_dist_step(struct moetax_dist *d) {
    /* every layer's micro-batch is planned from its own counts (token-sharded: plan_now; replicated:
     * plan_micro): nothing to plan between steps */
    if (d->n_rep) d->steps++;
}

moetax_status moetax_dist_replicas_init(struct moetax_dist *d, const struct moetax_model *m, uint8_t *own) {
    const int L = m->hp.n_layer, E = m->hp.n_expert, P = d->size;
    moetax_status st = settings(d);
    if (st) return st;
    if (!d->n_rep) {
        if (g_load) return moetax_error(MOETAX_ERR_ARG, "--ep-load %s needs --ep-replicas R (R > 0)", g_load);
        return MOETAX_OK;
    }
    moetax_dist_replicas_free(d); /* a model loaded before (its plan and mapped replicas) */
    d->n_extra = 0;
    d->extra_bytes = 0;
    d->n_layer = L;
    d->n_expert = E;
    d->H = (d->n_rep < P - 1 ? d->n_rep : P - 1) + 1;
    d->is_moe = calloc((size_t)L, 1);
    d->hosts = calloc((size_t)L * E * d->H, sizeof(int32_t));
    d->n_hosts = calloc((size_t)L * E, sizeof(int32_t));
    d->load = calloc((size_t)L * E, sizeof(uint64_t));
    d->avail = calloc((size_t)L * E * P, 1);
    if (!d->is_moe || !d->hosts || !d->n_hosts || !d->load || !d->avail)
        return moetax_error(MOETAX_ERR_NOMEM, "out of memory");
    for (int il = 0; il < L; il++) d->is_moe[il] = m->layers[il].is_moe;
    if (g_load) { /* the profile's frequencies are the prior load; only its planned replicas are mapped */
        struct moetax_profile *p = NULL;
        st = moetax_profile_load(g_load, &p);
        if (st) st = moetax_error(st, "--ep-load: %s", moetax_last_error());
        if (!st && (p->n_layer != L || p->n_expert != E))
            st = moetax_error(MOETAX_ERR_ARG, "--ep-load %s: a profile of %d layers x %d experts, the model has %d x %d",
                              g_load, p->n_layer, p->n_expert, L, E);
        for (int i = 0; !st && i < p->n_moe; i++) {
            const int il = p->moe_layer[i];
            if (il < 0 || il >= L || !d->is_moe[il]) {
                st = moetax_error(MOETAX_ERR_ARG, "--ep-load %s: layer %d is not a MoE layer of the model", g_load, il);
                break;
            }
            for (int e = 0; e < E; e++) d->load[(size_t)il * E + e] = (uint64_t)p->freq[(size_t)i * E + e];
        }
        moetax_profile_free(p);
        if (st) return st;
        /* every rank may take any expert while the profile's plan is made, then only those */
        memset(d->avail, 1, (size_t)L * E * P);
        moetax_dist_replan(d);
        memset(d->avail, 0, (size_t)L * E * P);
        for (size_t i = 0; i < (size_t)L * E; i++)
            for (int j = 0; j < d->n_hosts[i]; j++) d->avail[i * P + d->hosts[i * d->H + j]] = 1;
    } else {
        /* no profile: any expert may become a replica anywhere, so every rank maps them all */
        memset(d->avail, 1, (size_t)L * E * P);
        moetax_dist_replan(d); /* no counts yet: no replicas until the first re-plan */
    }
    d->n_replans = 0;
    for (int il = 0; il < L; il++) {
        if (!d->is_moe[il]) continue;
        const struct moetax_layer *l = &m->layers[il];
        const uint64_t eb = (uint64_t)(l->gate_exps.row_bytes + l->up_exps.row_bytes) * (uint64_t)m->hp.n_ff_exp +
                            (uint64_t)l->down_exps.mat_bytes;
        for (int e = 0; e < E; e++) {
            const size_t ie = (size_t)il * E + e;
            if (d->avail[ie * P + d->rank] && !own[ie]) {
                own[ie] = 1;
                d->n_extra++;
                d->extra_bytes += eb;
            }
        }
    }
    return MOETAX_OK;
}

void moetax_dist_plan_now(struct moetax_dist *d, int il, const int32_t *count, const int32_t *local) {
    const int E = d->n_expert;
    double w[4096];
    if (E > 4096) return; /* keeps the last plan */
    for (int e = 0; e < E; e++) w[e] = count[e];
    /* no EPLB fallback: these are the loads themselves, a replica that does not lower the
     * busiest rank's would only split tokens over more ranks (more records) */
    plan_layer(d, il, w, false, local, d->n_hosts + (size_t)il * E, d->hosts + (size_t)il * E * d->H);
    d->n_replans++;
}

void moetax_dist_plan_micro(const struct moetax_dist *d, int il, const int32_t *count, int32_t *nh, int32_t *hosts,
                            int32_t *part) {
    const int E = d->n_expert;
    double w[4096];
    if (E > 4096) { /* beyond the loads' array: no replicas, each expert on its owner */
        for (int e = 0; e < E; e++) nh[e] = 1, hosts[(size_t)e * d->H] = d->owner[(size_t)il * E + e];
    } else {
        for (int e = 0; e < E; e++) w[e] = count[e];
        plan_layer(d, il, w, false, NULL, nh, hosts); /* as plan_now: the loads themselves */
    }
    moetax_dist_split_in(d, nh, hosts, count, part);
}

void moetax_dist_split(const struct moetax_dist *d, int il, const int32_t *count, int32_t *part) {
    moetax_dist_split_in(d, d->n_hosts + (size_t)il * d->n_expert, d->hosts + (size_t)il * d->n_expert * d->H, count,
                         part);
}

void moetax_dist_split_in(const struct moetax_dist *d, const int32_t *nhs, const int32_t *hosts, const int32_t *count,
                          int32_t *part) {
    const int E = d->n_expert, H = d->H, P = d->size;
    int64_t lr[1024] = {0};
    int32_t order[4096];
    int n = 0;
    for (int e = 0; e < E; e++) {
        for (int j = 0; j < H; j++) part[e * H + j] = 0;
        if (nhs[e] == 1 || P > 1024 || E > 4096) {
            part[e * H] = count[e];
            lr[hosts[(size_t)e * H] % 1024] += count[e];
        } else if (count[e]) {
            order[n++] = e;
        }
    }
    /* the replicated experts, most slots first (ties: lower id): each slot to its least-loaded host */
    for (int i = 1; i < n; i++)
        for (int j = i; j > 0 && (count[order[j]] > count[order[j - 1]] ||
                                  (count[order[j]] == count[order[j - 1]] && order[j] < order[j - 1])); j--) {
            int32_t t = order[j];
            order[j] = order[j - 1];
            order[j - 1] = t;
        }
    for (int i = 0; i < n; i++) {
        const int e = order[i];
        const int nh = nhs[e];
        const int32_t *h = hosts + (size_t)e * H;
        for (int32_t c = 0; c < count[e]; c++) {
            int bj = 0;
            for (int j = 1; j < nh; j++)
                if (lr[h[j]] < lr[h[bj]]) bj = j;
            part[e * H + bj]++;
            lr[h[bj]]++;
        }
    }
}

void moetax_dist_flows(const struct moetax_dist *d, int il, int e, const int32_t *c, const int32_t *part, int me,
                       int32_t *flow) {
    const size_t ie = (size_t)il * d->n_expert + e;
    const int nh = d->n_hosts[ie], P = d->size;
    const int32_t *h = d->hosts + ie * d->H;
    int32_t room[1024], left[1024];
    for (int j = 0; j < nh; j++) flow[j] = 0;
    if (P > 1024) return;
    for (int r = 0; r < P; r++) left[r] = c[r];
    for (int j = 0; j < nh; j++) { /* each host its own first */
        const int32_t keep = c[h[j]] < part[j] ? c[h[j]] : part[j];
        room[j] = part[j] - keep;
        left[h[j]] -= keep;
        if (h[j] == me) flow[j] += keep;
    }
    for (int r = 0, j = 0; r < P; r++) /* then the rest, ranks in order, into the hosts' room */
        while (left[r] > 0 && j < nh) {
            const int32_t mv = left[r] < room[j] ? left[r] : room[j];
            if (r == me) flow[j] += mv;
            left[r] -= mv;
            room[j] -= mv;
            if (!room[j]) j++;
        }
}

void moetax_dist_host_range_in(const struct moetax_dist *d, const int32_t *nhs, const int32_t *hosts, int e,
                               const int32_t *part, int r, int32_t *lo, int32_t *cnt) {
    int32_t acc = 0;
    *lo = 0;
    *cnt = 0;
    for (int j = 0; j < nhs[e]; j++) {
        if (hosts[(size_t)e * d->H + j] == r) {
            *lo = acc;
            *cnt = part[e * d->H + j];
            return;
        }
        acc += part[e * d->H + j];
    }
}

void moetax_dist_account(struct moetax_dist *d, int il, const int32_t *count, const int32_t *part) {
    moetax_dist_account_in(d, il, d->n_hosts + (size_t)il * d->n_expert, d->hosts + (size_t)il * d->n_expert * d->H,
                           count, part);
}

void moetax_dist_account_in(struct moetax_dist *d, int il, const int32_t *nhs, const int32_t *hosts,
                            const int32_t *count, const int32_t *part) {
    const int E = d->n_expert, H = d->H, P = d->size;
    if (P > 1024) return;
    int64_t lr[1024] = {0}, lb[1024] = {0}, tot = 0;
    if (nhs != d->n_hosts + (size_t)il * E) { /* a micro-batch's own plan: the layer's latest, for the summary */
        memcpy(d->n_hosts + (size_t)il * E, nhs, sizeof(int32_t) * (size_t)E);
        memcpy(d->hosts + (size_t)il * E * H, hosts, sizeof(int32_t) * (size_t)E * (size_t)H);
        d->n_replans++;
    }
    for (int e = 0; e < E; e++) {
        const size_t ie = (size_t)il * E + e;
        if (!count[e]) continue;
        tot += count[e];
        lb[d->owner[ie]] += count[e];
        for (int j = 0; j < nhs[e]; j++) lr[hosts[(size_t)e * H + j]] += part[e * H + j];
    }
    int64_t mr = 0, mb = 0;
    for (int r = 0; r < P; r++) mr = lr[r] > mr ? lr[r] : mr, mb = lb[r] > mb ? lb[r] : mb;
    d->work_max += (uint64_t)mr;
    d->work_max_base += (uint64_t)mb;
    d->work_total += (uint64_t)tot;
    d->work_floor += (uint64_t)((tot + P - 1) / P);
    d->work_mine += (uint64_t)lr[d->rank];
    d->n_planned++;
}

void moetax_dist_replicas_summary(const struct moetax_dist *d) {
    if (!d->n_rep) return;
    int nrep = 0;
    for (int il = 0; d->n_hosts && il < d->n_layer; il++)
        for (int e = 0; d->is_moe[il] && e < d->n_expert; e++) nrep += d->n_hosts[(size_t)il * d->n_expert + e] - 1;
    const double mean = d->work_total ? (double)d->work_total / d->size : 0;
    const double with = mean > 0 ? (double)d->work_max / mean : 0, without = mean > 0 ? (double)d->work_max_base / mean : 0;
    char how[96];
    snprintf(how, sizeof how, "planned for each layer's micro-batch from its %scounts", d->dispatch ? "gathered " : "");
    fprintf(stderr, "moetax: rank %d of %d: replicas (--ep-replicas %d, %s, %llu times%s): "
            "%d now; expert work over %llu layer plans, %llu assignments: busiest rank %llu = %.4f x the mean with "
            "replicas, %llu = %.4f x without (excess %.2f%% -> %.2f%%; an even split of every plan: %.4f); this rank %llu; it maps %d experts beyond its "
            "own (%.2f MiB)\n", d->rank, d->size, d->n_rep, how, (unsigned long long)d->n_replans,
            g_load ? ", profile prior" : "", nrep, (unsigned long long)d->n_planned,
            (unsigned long long)d->work_total, (unsigned long long)d->work_max, with,
            (unsigned long long)d->work_max_base, without, 100 * (without - 1), 100 * (with - 1),
            mean > 0 ? (double)d->work_floor / mean : 0, (unsigned long long)d->work_mine, d->n_extra, (double)d->extra_bytes / (1 << 20));
}

void moetax_dist_replicas_free(struct moetax_dist *d) {
    free(d->is_moe); free(d->hosts); free(d->n_hosts); free(d->load); free(d->avail);
    d->is_moe = NULL, d->hosts = NULL, d->n_hosts = NULL, d->load = NULL, d->avail = NULL;
}
