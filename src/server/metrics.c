/* metrics.c - /metrics in Prometheus' text format: llama-server's names where
 * they exist (llamacpp:*), moetax's own for the ledger and the KV cache. */
#include "server/metrics.h"

#include <stdio.h>
#include <stdlib.h>

static void metric(FILE *f, const char *name, const char *type, const char *help, double v) {
    fprintf(f, "# HELP %s %s\n# TYPE %s %s\n%s %.17g\n", name, help, name, type, name, v);
}

static void hist(FILE *f, const char *name, const char *help, const struct srv_hist *h) {
    fprintf(f, "# HELP %s %s\n# TYPE %s histogram\n", name, help, name);
    int64_t cum = 0;
    for (int i = 0; i < SRV_HIST_N; i++) {
        cum += h->counts[i];
        fprintf(f, "%s_bucket{le=\"%g\"} %lld\n", name, srv_hist_bounds[i], (long long)cum);
    }
    cum += h->counts[SRV_HIST_N];
    fprintf(f, "%s_bucket{le=\"+Inf\"} %lld\n%s_sum %.17g\n%s_count %lld\n", name, (long long)cum, name, h->sum, name,
            (long long)h->n);
}

char *srv_metrics_text(const struct srv_metrics *m, size_t *len) {
    char *buf = NULL;
    size_t n = 0;
    FILE *f = open_memstream(&buf, &n);
    if (!f) return NULL;
    metric(f, "llamacpp:prompt_tokens_total", "counter", "Number of prompt tokens processed.",
           (double)m->prompt_tokens_total);
    metric(f, "llamacpp:prompt_seconds_total", "counter", "Prompt process time", m->prompt_seconds_total);
    metric(f, "llamacpp:tokens_predicted_total", "counter", "Number of generation tokens processed.",
           (double)m->tokens_predicted_total);
    metric(f, "llamacpp:tokens_predicted_seconds_total", "counter", "Predict process time",
           m->tokens_predicted_seconds_total);
    metric(f, "llamacpp:requests_processing", "gauge", "Number of requests processing.", m->requests_processing);
    metric(f, "llamacpp:requests_deferred", "gauge", "Number of requests deferred.", m->requests_deferred);
    metric(f, "llamacpp:kv_cache_usage_ratio", "gauge", "KV-cache usage. 1 means 100 percent usage.",
           m->kv_cells ? (double)m->kv_cells_used / (double)m->kv_cells : 0);
    metric(f, "llamacpp:kv_cache_tokens", "gauge", "KV-cache tokens.", (double)m->kv_cells_used);
    metric(f, "moetax_requests_total", "counter", "Requests finished (any reason).", (double)m->requests_total);
    metric(f, "moetax_requests_cancelled_total", "counter", "Requests ended because the client went away or the server stopped.",
           (double)m->requests_cancelled);
    metric(f, "moetax_prompt_tokens_reused_total", "counter", "Prompt tokens whose KV cells were shared from another sequence.",
           (double)m->prompt_tokens_reused);
    metric(f, "moetax_steps_total", "counter", "Decode steps (batches) run.", (double)m->steps);
    metric(f, "moetax_decode_steps_total", "counter", "Steps with one token per sequence (no prompt tokens).",
           (double)m->decode_steps);
    metric(f, "moetax_kv_cells", "gauge", "KV cache cells in all.", (double)m->kv_cells);
    metric(f, "moetax_kv_cells_used", "gauge", "KV cache cells in blocks in use.", (double)m->kv_cells_used);
    metric(f, "moetax_kv_cells_active", "gauge", "KV cache positions held by running requests.", (double)m->kv_cells_active);
    metric(f, "moetax_kv_cells_cached", "gauge", "KV cache cells idle slots keep for prefix reuse.", (double)m->kv_cells_cached);
    metric(f, "moetax_batch_size", "gauge", "Sequences in the last step.", m->last_batch_seqs);
    metric(f, "moetax_batch_tokens", "gauge", "Tokens in the last step.", (double)m->last_batch_tokens);
    metric(f, "moetax_decode_batch_size_mean", "gauge", "Mean sequences per decode step (ledger).",
           m->decode_steps ? (double)m->decode_tokens / (double)m->decode_steps : 0);
    metric(f, "moetax_unique_experts_per_layer_step", "gauge",
           "Distinct experts read per MoE layer and decode step, mean (ledger).",
           m->moe_layer_passes ? (double)m->moe_experts / (double)m->moe_layer_passes : 0);
    metric(f, "moetax_dropped_assignments_total", "counter", "Token-expert assignments a capacity factor dropped.",
           (double)m->moe_dropped);
    metric(f, "moetax_tax_share", "gauge", "Share of step time in the tax phases (route dispatch load comm wait combine).",
           m->tax_share);
    metric(f, "moetax_step_seconds_total", "counter", "Wall time of the steps (ledger).", m->wall_s);
    fprintf(f, "# HELP moetax_phase_seconds_total Seconds per ledger phase, averaged over workers.\n"
               "# TYPE moetax_phase_seconds_total counter\n");
    for (int p = 0; p < MOETAX_PHASE_COUNT; p++)
        fprintf(f, "moetax_phase_seconds_total{phase=\"%s\",tax=\"%s\"} %.17g\n", moetax_phase_name((enum moetax_phase)p),
                moetax_phase_is_tax((enum moetax_phase)p) ? "true" : "false", m->phase_s[p]);
    if (m->has_store) {
        metric(f, "moetax_store_acquires_total", "counter", "Expert acquisitions from the expert store.",
               (double)m->store_acquires);
        metric(f, "moetax_store_hits_total", "counter", "Acquisitions that found the expert resident.", (double)m->store_hits);
        metric(f, "moetax_store_misses_total", "counter", "Acquisitions that did not.",
               (double)(m->store_acquires - m->store_hits));
        metric(f, "moetax_store_loads_total", "counter", "Experts read from the model file.", (double)m->store_loads);
        metric(f, "moetax_store_bytes_read_total", "counter", "Bytes the expert store read.", (double)m->store_bytes_read);
    }
    metric(f, "moetax_http_read_timeouts_total", "counter",
           "Requests begun (their first line in) but not complete within --read-timeout: connection closed.",
           (double)m->http_read_timeouts);
    metric(f, "moetax_http_idle_closed_total", "counter",
           "Connections closed by --read-timeout before a request line had arrived whole (new, or kept alive after an answer).",
           (double)m->http_idle_closed);
    metric(f, "moetax_http_cpu_seconds_total", "counter",
           "CPU time of the HTTP side's thread (connections accepted, requests read and parsed, prompts tokenized, "
           "answers and streams written).",
           m->http_cpu_s);
    metric(f, "moetax_sched_seconds_total", "counter",
           "The scheduler's time in steps outside the model (the batch, sampling, token text, stop strings, the metrics).",
           m->sched_s);
    metric(f, "moetax_streams", "gauge", "Streaming answers (server-sent events) being written now, from their first token.", (double)m->http_streams);
    metric(f, "moetax_stream_interval_seconds", "gauge",
           "The least time between two events of a stream now: --stream-interval, times streams/2 with more than two "
           "streams (at most 25 ms, or --stream-interval where that is longer).",
           m->http_stream_interval_s);
    hist(f, "moetax_ttft_seconds", "Time to first token (queued to first token).", &m->ttft);
    hist(f, "moetax_tpot_seconds", "Time per output token after the first.", &m->tpot);
    if (fclose(f) != 0) { free(buf); return NULL; }
    *len = n;
    return buf;
}
