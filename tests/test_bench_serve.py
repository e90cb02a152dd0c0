#!/usr/bin/env python3
# ctest-labels: model;threads
"""test_bench_serve.py - scripts/bench_serve.py runs end to end (one short round, 2 clients, the
default model) and writes every figure it promises, each finite and in range; a request opens a
connection of its own, and with --keep-alive one client's requests share one. It checks that the
measurement works, not what it measures (timings inside a parallel test run are not measurements).

Usage: test_bench_serve.py MOETAX WORKDIR
"""
import json
import math
import os
import subprocess
import sys

MOETAX = os.path.abspath(sys.argv[1])
WORK = os.path.abspath(sys.argv[2])
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
out = os.path.join(WORK, "bench_serve.json")
if os.path.exists(out):
    os.unlink(out)
r = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "bench_serve.py"), "--moetax", MOETAX,
                    "--rounds", "1", "--pairs", "2", "--clients", "2", "-n", "12", "-p", "8", "--long-prompt", "96",
                    "--json", out], capture_output=True, text=True, timeout=600)
print(r.stdout[-3000:], r.stderr[-3000:])
fails = []
if r.returncode != 0:
    fails.append(f"bench_serve.py exited {r.returncode}")
else:
    d = json.load(open(out))
    med = d["medians"]
    # the TPOT and gap ratios are NaN, and said so, only where a stream's chunks all arrived at once (its
    # TPOT or p99 gap reads 0, or it has no gaps: a loaded machine, or a completion shorter than the
    # stream's pacing interval on a fast one); else finite
    unmeasured = not all(isinstance(med.get(k), (int, float)) and med[k] > 0
                         for k in ("one_tpot_ms", "one_gap_p99_ms", "many_tpot_max_ms", "many_gap_p99_ms"))
    for k in ("server_cost", "scale", "engine_scale", "tpot_ratio", "gap_p99_ratio", "long_raise_ms",
              "one_tps", "many_tps", "engine_tps_1", "engine_tps_many", "one_tpot_ms", "engine_tpot_p50_ms",
              "long_ttft_ms", "own_share", "own_http_us", "own_sched_us"):
        v = med.get(k)
        if k in ("tpot_ratio", "gap_p99_ratio") and unmeasured and isinstance(v, float) and math.isnan(v):
            if "arrived together" not in r.stderr:
                fails.append(f"medians.{k} is NaN without the warning that says why")
            continue
        if not isinstance(v, (int, float)) or not math.isfinite(v):
            fails.append(f"medians.{k} = {v!r}, not a finite number")
    for k in ("one_tps", "many_tps", "engine_tps_1", "engine_tps_many", "one_tpot_ms", "long_ttft_ms", "own_share",
              "own_http_us", "own_sched_us"):
        if k == "one_tpot_ms" and unmeasured and "arrived together" in r.stderr:
            continue
        if isinstance(med.get(k), (int, float)) and not med[k] > 0:
            fails.append(f"medians.{k} = {med[k]} is not positive")
    if d.get("pairs") != 2 or med.get("one_requests") != 2:
        fails.append(f"--pairs 2: {d.get('pairs')} pairs, {med.get('one_requests')} one-client requests in the round")
    if med.get("one_connections") != 2:
        fails.append(f"a connection per request: the one-client requests opened {med.get('one_connections')} for 2")
    if d["long_prompt_tokens"] < 80:
        fails.append(f"the long prompt has {d['long_prompt_tokens']} tokens, asked 96")
    if med.get("long_during_n", 0) < 1:
        fails.append("no decoding gap fell inside the long prompt's prefill")
    if "medians of 1 rounds" not in r.stdout:
        fails.append("no summary line")
# --keep-alive: the one client's requests go over one connection (a second only if the server closed the
# first meanwhile, which its 30 s idle deadline does not in a run this short)
outk = os.path.join(WORK, "bench_serve_keep.json")
rk = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "bench_serve.py"), "--moetax", MOETAX, "--keep-alive",
                     "--rounds", "1", "--pairs", "3", "--clients", "2", "-n", "8", "-p", "8", "--long-prompt", "32",
                     "--json", outk], capture_output=True, text=True, timeout=600)
if rk.returncode != 0:
    fails.append(f"--keep-alive: exited {rk.returncode}: {rk.stderr[-500:]!r}")
else:
    mk = json.load(open(outk))["medians"]
    if mk.get("one_requests") != 3 or mk.get("one_connections") != 1:
        fails.append(f"--keep-alive: {mk.get('one_requests')} one-client requests opened {mk.get('one_connections')} "
                     "connections (want 3 over 1)")
    if "connections kept alive" not in rk.stdout:
        fails.append("--keep-alive: the run's header does not say that connections are kept alive")
# --pin with as many threads as CPUs leaves the clients none: refused, said so
ncpu = len(os.sched_getaffinity(0))
rp = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "bench_serve.py"), "--moetax", MOETAX, "--pin",
                     "-t", str(ncpu)], capture_output=True, text=True, timeout=120)
if rp.returncode == 0 or "--pin needs more CPUs" not in rp.stderr:
    fails.append(f"--pin -t {ncpu}: exit {rp.returncode}, {rp.stderr[-300:]!r}")
for f in fails:
    print("FAIL:", f)
print("test_bench_serve:", "FAIL" if fails else "ok")
sys.exit(1 if fails else 0)
