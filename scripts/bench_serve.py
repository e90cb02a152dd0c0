#!/usr/bin/env python3
"""bench_serve.py - measure `moetax serve` against the serving targets of issue 15, in one run.

Usage:
  python3 scripts/bench_serve.py [--moetax build/moetax] [-m MODEL] [-t 2] [--rounds 3]
                                 [--clients 8] [--pairs 5] [-n 96] [--long-prompt 512] [--pin]
                                 [--keep-alive] [--json OUT]

Standard library only (any python3). Starts one server (`--parallel CLIENTS`, 127.0.0.1, a free
port) and measures, in alternating rounds so that a drifting machine hits every figure alike:

  engine      `moetax bench -m MODEL --batch 1 -p P -n N -t T` (the engine alone: TPOT p50 of one
              sequence, its decode tokens/s), and `--batch CLIENTS` (the same for CLIENTS sequences)
  one         one streaming client (/v1/completions, stream, ignore_eos, max_tokens N): its TPOT
              ((last token - first) / (tokens - 1)), the p99 of the gaps between its chunks, tokens/s;
              PAIRS times per round alternately with the engine's --batch 1 run (--pairs, default 5):
              the medians of each
  many        CLIENTS streaming clients at once: aggregate tokens/s (every completion token over the
              time from the first request sent to the last one done), the worst client's TPOT and
              the p99 of every client's chunk gaps
  long        CLIENTS - 1 clients decoding, then one request with a LONG_PROMPT-token prompt: the
              decoding clients' p99 TPOT while that prompt is prefilled against their p99 before it

and prints per round and the medians:

  own_share        the server's own time per token over the one-client runs, from its /metrics
                   (moetax_http_cpu_seconds_total: CPU of the HTTP thread; moetax_sched_seconds_total:
                   the scheduler's time in steps outside the model), over the engine's mean TPOT: HTTP,
                   JSON, SSE, scheduling, without the clients' CPU time (target <= 5% on the trained
                   default model); own_http_us, own_sched_us: its two parts per token
  server_cost      one client's TPOT / the engine's mean TPOT - 1 (1 / its decode tokens/s: a mean,
                   like TPOT): the same cost seen from the client, which on a machine whose cores all
                   decode also pays for the client's own CPU time and every wake-up (--pin separates them)
  scale            many / one aggregate tokens/s (target >= 2.2x on `small` Q8_0 with 8 clients)
  tpot_ratio       the worst of the many clients' TPOT / one client's (target: p99 <= 3.5x; with
                   CLIENTS requests a round the worst is its p99); gap_p99_ratio: the same for the
                   p99 of chunk gaps
  long_raise_ms    p99 TPOT during the long prefill - p99 before, against one prefill chunk's time
                   (measured on a second server with --stream-interval 0, an event per token, so that
                   the gaps are the steps' and not the stream's pacing; one/many use the server's
                   default pacing, as a user gets it, and their gaps include it)
                   (--prefill-chunk tokens of the engine's ppN time per token: `bench -p CHUNK`);
                   target: the raise <= one chunk

Each request opens a connection of its own (as curl does); --keep-alive makes the clients keep theirs
open from one request to the next, as the OpenAI SDKs and browsers do, which spares the server a
connection's accept, memory pool and close per request.

--pin puts the server and the engine's runs on the first T CPUs and this script (the clients) on the
rest, so that server_cost is the server's own (its HTTP thread shares the server's CPUs) and not
also the clients' CPU time; it needs more CPUs than -t (2 cores: -t 1).

Nothing here asserts a figure: these are measurements, printed with the medians of the rounds.
"""
import argparse
import http.client
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def ratio(a, b):
    """a / b, NaN where either is not positive (a figure that could not be measured, e.g. a stream whose
    chunks were all read at once, on a loaded machine or a model whose whole completion takes less than
    the stream's pacing interval: its TPOT reads 0 and it has no gaps)."""
    return a / b if a > 0 and b > 0 else float("nan")


def nanmedian(xs):
    """The median of the figures that were measured (NaN where none was)."""
    v = [x for x in xs if x == x]
    return statistics.median(v) if v else float("nan")


def pct(xs, q):
    if not xs:
        return float("nan")
    s = sorted(xs)
    i = min(len(s) - 1, max(0, int(round(q / 100.0 * (len(s) - 1)))))
    return s[i]


PIN = None  # --pin: (CPUs of the server and the engine, CPUs of this script's clients)


def pinned():
    """preexec_fn of the server and the engine runs: the first CPU set of --pin."""
    if PIN:
        os.sched_setaffinity(0, PIN[0])


class Server:
    def __init__(self, exe, model, threads, parallel, extra, log_dir):
        self.log_path = os.path.join(log_dir, "serve.log")
        self.log = open(self.log_path, "w+b")
        self.p = subprocess.Popen([exe, "serve", "-m", model, "--host", "127.0.0.1", "--port", "0", "-t",
                                   str(threads), "--parallel", str(parallel), *extra],
                                  stdout=self.log, stderr=self.log, preexec_fn=pinned)
        self.port = None
        self.idle, self.idle_lock = [], threading.Lock()  # --keep-alive: open connections between requests
        self.opened = 0  # connections the requests opened
        deadline = time.time() + 120
        while time.time() < deadline and self.port is None:
            if self.p.poll() is not None:
                break
            with open(self.log_path, "rb") as f:
                m = re.search(rb"listening on http://127\.0\.0\.1:(\d+)", f.read())
            if m:
                self.port = int(m.group(1))
            else:
                time.sleep(0.05)
        self.positions = None
        if self.port is not None:
            with open(self.log_path, "rb") as f:
                m = re.search(rb"(\d+) positions per request", f.read())
            self.positions = int(m.group(1)) if m else None
        if self.port is None:
            self.stop()
            with open(self.log_path, "rb") as f:
                sys.exit("bench_serve: the server did not start:\n" + f.read().decode(errors="replace")[-2000:])

    def stop(self):
        if self.p.poll() is None:
            self.p.terminate()
            try:
                self.p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait()
        self.log.close()

    def metrics(self):
        """GET /metrics as {name: value}."""
        c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        c.request("GET", "/metrics")
        text = c.getresponse().read().decode()
        c.close()
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                k, v = line.rsplit(" ", 1)
                out[k] = float(v)
        return out

    def request(self, body, timeout=300):
        """POST /v1/completions: (connection, response). --keep-alive: a connection an earlier request of
        this server left open (release), else a new one; one the server has closed meanwhile (its idle
        deadline) is replaced."""
        data = json.dumps(body)
        while KEEP_ALIVE:
            with self.idle_lock:
                c = self.idle.pop() if self.idle else None
            if c is None:
                break
            try:
                c.request("POST", "/v1/completions", data, {"Content-Type": "application/json"})
                return c, c.getresponse()
            except (http.client.HTTPException, OSError):
                c.close()
        c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        with self.idle_lock:
            self.opened += 1
        c.request("POST", "/v1/completions", data, {"Content-Type": "application/json"})
        return c, c.getresponse()

    def release(self, c, whole):
        """A request's connection after its answer: kept for the next request (--keep-alive, the answer
        read to its end), else closed."""
        if KEEP_ALIVE and whole:
            with self.idle_lock:
                self.idle.append(c)
        else:
            c.close()


TEMPERATURE = 0.0  # --temperature: the clients' sampling (a fixed seed)
KEEP_ALIVE = False  # --keep-alive: clients reuse their connections, as the OpenAI SDKs do


def stream(srv, prompt, n, out, start_evt=None, stop_evt=None):
    """One streaming completion; out gets t0, chunk arrival times, usage. stop_evt set: the client
    hangs up (the server cancels the request)."""
    if start_evt is not None:
        start_evt.wait()
    body = {"prompt": prompt, "max_tokens": n, "temperature": TEMPERATURE, "seed": 1, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    times, usage = out.setdefault("times", []), None  # filled as chunks arrive (others may watch it)
    c, r = srv.request(body)
    if r.status != 200:
        out.update(error=f"HTTP {r.status}: {r.read()[:300]!r}")
        c.close()
        return
    buf, whole = b"", False
    while True:
        if stop_evt is not None and stop_evt.is_set():
            break
        chunk = r.read1(65536) if hasattr(r, "read1") else r.read(1)
        if not chunk:
            whole = True
            break
        now = time.perf_counter()
        buf += chunk
        while b"\n\n" in buf:
            ev, buf = buf.split(b"\n\n", 1)
            for line in ev.split(b"\n"):
                if not line.startswith(b"data: "):
                    continue
                data = line[6:]
                if data == b"[DONE]":
                    continue
                o = json.loads(data)
                if o.get("usage"):
                    usage = o["usage"]
                if o.get("choices") and o["choices"][0].get("text"):
                    times.append(now)
    srv.release(c, whole)
    out.update(t0=t0, usage=usage, t_end=time.perf_counter())


def gaps(times):
    return [(b - a) * 1e3 for a, b in zip(times, times[1:])]


def tpot(o):
    """A request's TPOT as serving benchmarks define it: (last token - first token) / (tokens - 1).
    Robust to chunks that arrive together (an HTTP thread that runs late sends several tokens in one
    write; the gaps between chunks then read 0 and a multiple of the step)."""
    n = o["usage"]["completion_tokens"]
    return (o["times"][-1] - o["times"][0]) * 1e3 / max(1, n - 1)


def run_clients(srv, prompts, n):
    outs = [dict() for _ in prompts]
    go = threading.Event()
    th = [threading.Thread(target=stream, args=(srv, p, n, o, go)) for p, o in zip(prompts, outs)]
    for t in th:
        t.start()
    go.set()
    for t in th:
        t.join()
    for o in outs:
        if "error" in o:
            sys.exit("bench_serve: " + o["error"])
    return outs


def aggregate(outs):
    """Output throughput as serving benchmarks define it: every completion token over the time from
    the first request sent to the last one finished (prefill included, for one client and many alike)."""
    tok = sum(o["usage"]["completion_tokens"] for o in outs)
    return tok / (max(o["t_end"] for o in outs) - min(o["t0"] for o in outs))


def bench_engine(exe, model, threads, batch, p, n):
    cmd = [exe, "bench", "-m", model, "--batch", str(batch), "-p", str(p), "-n", str(n), "-t", str(threads),
           "-r", "1", "--json", "--no-mem"]
    r = subprocess.run(cmd, capture_output=True, text=True, preexec_fn=pinned)
    if r.returncode != 0:
        sys.exit(f"bench_serve: {' '.join(cmd)} failed:\n{r.stderr[-2000:]}")
    rows = [json.loads(l) for l in r.stdout.splitlines() if l.startswith("{")]
    return rows[-1]


def bench_pp(exe, model, threads, chunk):
    cmd = [exe, "bench", "-m", model, "-p", str(chunk), "-n", "0", "-t", str(threads), "-r", "3", "--json",
           "--no-mem"]
    r = subprocess.run(cmd, capture_output=True, text=True, preexec_fn=pinned)
    if r.returncode != 0:
        sys.exit(f"bench_serve: {' '.join(cmd)} failed:\n{r.stderr[-2000:]}")
    rows = [json.loads(l) for l in r.stdout.splitlines() if l.startswith("{")]
    return chunk / rows[-1]["tokens_per_s"] * 1e3  # ms for one chunk


def make_prompt(srv, words, target):
    """A prompt of about `target` tokens (the server's usage.prompt_tokens tells)."""
    k = max(1, target // 2)
    for _ in range(12):
        text = " ".join(words[i % len(words)] for i in range(k))
        c, r = srv.request({"prompt": text, "max_tokens": 1, "temperature": 0})
        o = json.loads(r.read())
        c.close()
        if "usage" not in o:
            sys.exit(f"bench_serve: a prompt of ~{target} tokens was refused: {o}")
        got = o["usage"]["prompt_tokens"]
        if abs(got - target) <= max(2, target // 50):
            return text, got
        k = max(1, int(k * target / max(1, got)))
    return text, got


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--moetax", default=os.path.join(REPO, "build", "moetax"))
    ap.add_argument("-m", "--model", default=os.path.join(REPO, "models", "pycode-20m-q8_0.gguf"))
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--pairs", type=int, default=5,
                    help="per round, alternating runs of the engine alone and of one client (medians)")
    ap.add_argument("-n", type=int, default=128, help="tokens per request")
    ap.add_argument("-p", type=int, default=32, help="prompt tokens of the decoding clients")
    ap.add_argument("--long-prompt", type=int, default=512)
    ap.add_argument("--prefill-chunk", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="the clients' sampling temperature (seed 1; default 0, greedy)")
    ap.add_argument("--pin", action="store_true",
                    help="the server and the engine on the first -t CPUs, this script's clients on the others "
                         "(the server's own cost without the clients' CPU time; needs more CPUs than -t)")
    ap.add_argument("--keep-alive", action="store_true",
                    help="clients keep their connections open from one request to the next (as the OpenAI SDKs "
                         "do; default: a new connection per request, as curl makes)")
    ap.add_argument("--json", help="write the rounds and medians here")
    ap.add_argument("serve_args", nargs="*", help="after --: more `moetax serve` options")
    a = ap.parse_args()
    global TEMPERATURE, PIN, KEEP_ALIVE
    TEMPERATURE = a.temperature
    KEEP_ALIVE = a.keep_alive
    if a.pin:
        cpus = sorted(os.sched_getaffinity(0))
        if len(cpus) <= a.threads:
            sys.exit(f"bench_serve: --pin needs more CPUs than -t {a.threads} (this process may use {len(cpus)})")
        PIN = (set(cpus[:a.threads]), set(cpus[a.threads:]))
        os.sched_setaffinity(0, PIN[1])
        print(f"pinned: server and engine on CPUs {sorted(PIN[0])}, clients on {sorted(PIN[1])}")
    if a.rounds < 1 or a.clients < 2 or a.n < 2 or a.pairs < 1:
        sys.exit("bench_serve: --rounds must be >= 1, --clients >= 2, -n >= 2 and --pairs >= 1")
    words = ("def return self import class for while yield lambda async await with try except raise "
             "value index result items key data list dict none true false print open path").split()
    # the servers' logs: removed after a run that ends normally, kept (and named) otherwise
    tmp = tempfile.mkdtemp(prefix="bench_serve.")
    os.mkdir(os.path.join(tmp, "paced"))
    os.mkdir(os.path.join(tmp, "unpaced"))
    common = ["--prefill-chunk", str(a.prefill_chunk), "-c", str(a.clients * (a.long_prompt + a.n + a.p + 64))]
    ended = False
    try:
        srv = Server(a.moetax, a.model, a.threads, a.clients, [*common, *a.serve_args], os.path.join(tmp, "paced"))
    except BaseException:
        print(f"bench_serve: the server's log is kept in {tmp}", file=sys.stderr)
        raise
    rounds = []
    srv0 = None
    try:
        srv0 = Server(a.moetax, a.model, a.threads, a.clients, [*common, *a.serve_args, "--stream-interval", "0"],
                      os.path.join(tmp, "unpaced"))
        prompt, p_tok = make_prompt(srv, words, a.p)
        if srv.positions and a.long_prompt + 16 > srv.positions:
            print(f"the model takes {srv.positions} positions per request: the long prompt is "
                  f"{srv.positions - 16} tokens instead of {a.long_prompt}")
            a.long_prompt = srv.positions - 16
        if srv.positions and p_tok + 2 * a.n > srv.positions:
            a.n = (srv.positions - p_tok) // 2 - 1
            print(f"the model takes {srv.positions} positions per request: -n {a.n}")
        long_prompt, long_tok = make_prompt(srv, words[3:] + words[:3], a.long_prompt)
        # distinct prompts per client, so that prefix reuse does not share them
        prompts = [f"{i} {prompt}" for i in range(a.clients)]
        chunk_ms = bench_pp(a.moetax, a.model, a.threads, a.prefill_chunk)
        print(f"model {os.path.basename(a.model)}, {a.threads} threads, {a.clients} clients, prompts of {p_tok} "
              f"tokens, {a.n} tokens each, long prompt {long_tok} tokens, prefill chunk {a.prefill_chunk} = "
              f"{chunk_ms:.2f} ms (engine pp{a.prefill_chunk}), "
              f"{'connections kept alive' if KEEP_ALIVE else 'a new connection per request'}", flush=True)
        for rd in range(a.rounds):
            # a prefix of their own in every round (and for the one client apart from the eight), so
            # that the server's prefix reuse never skips a prefill an earlier request made: rounds
            # after the first had measured the long prompt's TTFT far below its real prefill time
            rp = [f"r{rd}a {q}" for q in prompts[:1]], [f"r{rd}b {q}" for q in prompts]
            long_rd = f"r{rd} {long_prompt}"
            # the engine alone and one client, alternately, a.pairs times: one request of the trained
            # model is ~30 ms, so a single pair is at the mercy of whatever else the machine runs then
            e1s, one = [], []
            m_before, opened0 = srv.metrics(), srv.opened
            for k in range(a.pairs):
                e1s.append(bench_engine(a.moetax, a.model, a.threads, 1, p_tok, a.n))
                one += run_clients(srv, [f"{q} {k}" for q in rp[0]], a.n)
            m_after, one_conns = srv.metrics(), srv.opened - opened0
            d_m = {k: m_after[k] - m_before[k] for k in ("moetax_http_cpu_seconds_total", "moetax_sched_seconds_total",
                                                         "llamacpp:tokens_predicted_total")}
            e1 = {"tokens_per_s": statistics.median(e["tokens_per_s"] for e in e1s),
                  "tpot_p50_ms": statistics.median(e["tpot_p50_ms"] for e in e1s)}
            eB = bench_engine(a.moetax, a.model, a.threads, a.clients, p_tok, a.n)
            many = run_clients(srv, rp[1], a.n)
            # long: CLIENTS-1 decode, the long prompt arrives once they all stream
            outs = [dict() for _ in range(a.clients - 1)]
            # they decode until the long prompt's answer is in (then they hang up), so the whole
            # prefill falls inside their streams whatever the machine's speed
            go, done = threading.Event(), threading.Event()
            # (within each client's share of the cells, so that all of them are admitted at once)
            n_long = min(a.long_prompt + a.n, (srv.positions or 4096) - p_tok - 8)
            th = [threading.Thread(target=stream, args=(srv0, f"r{rd}c {prompts[i]}", n_long, outs[i], go, done))
                  for i in range(a.clients - 1)]
            for t in th:
                t.start()
            go.set()
            # send it once every decoding client has streamed 3 chunks (prefilled and decoding)
            t_wait = time.perf_counter() + 120
            while time.perf_counter() < t_wait and not all(len(o.get("times", ())) >= 3 for o in outs):
                time.sleep(0.002)
            lo = {}
            t_send = time.perf_counter()
            stream(srv0, long_rd, 4, lo)
            if "error" in lo:
                sys.exit("bench_serve: the long prompt's request failed: " + lo["error"])
            t_first = lo["times"][0] if lo.get("times") else lo["t_end"]
            time.sleep(0.05)  # a few gaps after it
            done.set()
            for t in th:
                t.join()
            before, during = [], []
            for o in outs:
                ts = o["times"]
                for x, y in zip(ts, ts[1:]):
                    g = (y - x) * 1e3
                    if y < t_send:
                        before.append(g)
                    elif x < t_first:  # the gap overlaps [sent, its first token]: the prefill
                        during.append(g)
            g1 = [g for o in one for g in gaps(o["times"])]
            gB = [g for o in many for g in gaps(o["times"])]
            t1 = [tpot(o) for o in one]
            tB = [tpot(o) for o in many]
            r = {
                "engine_tpot_p50_ms": e1["tpot_p50_ms"], "engine_tpot_mean_ms": 1e3 / e1["tokens_per_s"],
                "engine_tps_1": e1["tokens_per_s"],
                "engine_tps_many": eB["tokens_per_s"], "one_requests": len(one), "one_connections": one_conns,
                "one_tpot_ms": statistics.median(t1), "one_gap_p99_ms": pct(g1, 99),
                "one_tps": statistics.median(aggregate([o]) for o in one),
                "many_tpot_max_ms": max(tB), "many_gap_p99_ms": pct(gB, 99), "many_tps": aggregate(many),
                "long_before_p99_ms": pct(before, 99), "long_during_p99_ms": pct(during, 99),
                "long_during_n": len(during), "long_ttft_ms": (t_first - t_send) * 1e3,
            }
            # a stream shows only tokens with text: where its last text came long before its end, most steps
            # decoded tokens without text and the TPOT from the stream undercounts them
            dark = max((o["t_end"] - o["times"][-1]) / max(o["t_end"] - o["times"][0], 1e-9) for o in one + many if o.get("times"))
            if dark > 0.2:
                print(f"bench_serve: warning: a stream's last text came {100 * dark:.0f}% of its time before its end "
                      "(tokens without text: `gen`'s random models such as `small` have 8192 ids of which only the "
                      "bytes and merges carry text): TPOT and gaps are not measurable from the stream; the aggregate "
                      "tokens/s (from usage) still are", file=sys.stderr)
            r["dark_share"] = dark
            # the server's own time per token, from its counters over the one-client runs: CPU of the HTTP
            # threads and the scheduler's time outside the model (neither includes the clients' CPU time)
            ntok = max(1.0, d_m["llamacpp:tokens_predicted_total"])
            r["own_http_us"] = d_m["moetax_http_cpu_seconds_total"] / ntok * 1e6
            r["own_sched_us"] = d_m["moetax_sched_seconds_total"] / ntok * 1e6
            r["own_share"] = (r["own_http_us"] + r["own_sched_us"]) / (r["engine_tpot_mean_ms"] * 1e3)
            r["server_cost"] = r["one_tpot_ms"] / r["engine_tpot_mean_ms"] - 1
            r["scale"] = r["many_tps"] / r["one_tps"]
            r["engine_scale"] = r["engine_tps_many"] / r["engine_tps_1"]
            r["tpot_ratio"] = ratio(r["many_tpot_max_ms"], r["one_tpot_ms"])
            r["gap_p99_ratio"] = ratio(r["many_gap_p99_ms"], r["one_gap_p99_ms"])
            if not (r["one_tpot_ms"] > 0 and r["one_gap_p99_ms"] > 0 and r["many_tpot_max_ms"] > 0
                    and r["many_gap_p99_ms"] > 0):
                print("bench_serve: warning: a stream's chunks arrived together (a loaded machine, or completions "
                      "shorter than the stream's pacing interval): the TPOT and gap ratios of this round are not "
                      "measured (NaN)", file=sys.stderr)
            r["long_raise_ms"] = r["long_during_p99_ms"] - r["long_before_p99_ms"]
            rounds.append(r)
            print(f"round {rd + 1}: server's own time {100 * r['own_share']:.1f}% of the engine's TPOT (HTTP CPU "
                  f"{r['own_http_us']:.1f} + scheduler {r['own_sched_us']:.1f} us per token); "
                  f"server_cost {100 * r['server_cost']:+.1f}% (TPOT {r['one_tpot_ms']:.2f} "
                  f"vs engine mean {r['engine_tpot_mean_ms']:.2f} ms, p50 {r['engine_tpot_p50_ms']:.2f}); scale {r['scale']:.2f}x ({r['many_tps']:.1f} vs "
                  f"{r['one_tps']:.1f} t/s; engine alone {r['engine_scale']:.2f}x); worst TPOT {r['many_tpot_max_ms']:.2f} "
                  f"vs {r['one_tpot_ms']:.2f} ms = {r['tpot_ratio']:.2f}x (p99 of gaps {r['gap_p99_ratio']:.2f}x); long prompt: p99 {r['long_before_p99_ms']:.2f}"
                  f" -> {r['long_during_p99_ms']:.2f} ms over {r['long_during_n']} gaps (raise "
                  f"{r['long_raise_ms']:.2f} ms vs one chunk {chunk_ms:.2f} ms), its TTFT {r['long_ttft_ms']:.0f} ms",
                  flush=True)
        ended = True
    finally:
        srv.stop()
        if srv0 is not None:
            srv0.stop()
        if ended:
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            print(f"bench_serve: the servers' logs are kept in {tmp}", file=sys.stderr)
    med = {k: nanmedian(r[k] for r in rounds) for k in rounds[0]}
    print(f"medians of {len(rounds)} rounds: server's own time {100 * med['own_share']:.1f}% of a step (HTTP CPU "
          f"{med['own_http_us']:.1f} + scheduler {med['own_sched_us']:.1f} us per token; target <= 5%), "
          f"server_cost {100 * med['server_cost']:+.1f}% (the clients' CPU time included where they share the "
          f"server's CPUs), scale "
          f"{med['scale']:.2f}x (target >= 2.2x; the engine alone {med['engine_scale']:.2f}x), worst TPOT "
          f"ratio {med['tpot_ratio']:.2f}x (target: p99 <= 3.5x; p99 of chunk gaps {med['gap_p99_ratio']:.2f}x), long-prompt raise {med['long_raise_ms']:.2f} ms vs one chunk "
          f"{chunk_ms:.2f} ms (target: <= one chunk)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"model": a.model, "threads": a.threads, "clients": a.clients, "pairs": a.pairs, "n": a.n,
                       "prompt_tokens": p_tok,
                       "long_prompt_tokens": long_tok, "chunk_ms": chunk_ms, "rounds": rounds, "medians": med}, f,
                      indent=1)
            f.write("\n")


if __name__ == "__main__":
    main()
