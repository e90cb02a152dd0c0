#!/usr/bin/python3
# ctest-labels: mpi
"""test_mpi_ledger.py - the ledger and trace of `mpirun -np 2 moetax bench` (tools/ledger_cli.c):
rank 0 writes one ledger with every rank's ("ranks", each with its transfer counters, equal to
what the rank printed at exit and consistent across ranks) and one Chrome trace with a process
per rank on one clock, each with a track of its exchanges whose bytes per layer are the ledger's; each rank's bytes per layer add up to its totals (MoE layers only, one
rank's sent the other's received); `moetax report` shows the ranks, the bytes and the slowest rank
and the bytes per MoE layer (text, JSON and HTML), still reads the merged trace, and names the field of a merged ledger
that is wrong. Both dispatch modes. SKIP without mpirun or an MPI build.

usage: test_mpi_ledger.py MOETAX_BIN WORKDIR
"""
import json
import os
import re
import shutil
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "ref"))
from checks import check, summary  # noqa: E402  (tests/ref/checks.py)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = os.path.join(ROOT, "models", "pycode-20m-q8_0.gguf")
ENV = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
           OMPI_MCA_rmaps_base_oversubscribe="1", MOETAX_MPI_TIMEOUT="60")


def run(args, env=None, timeout=180):
    return subprocess.run(args, capture_output=True, text=True, errors="replace", timeout=timeout, env=env or ENV)


def main():
    moetax, work = os.path.abspath(sys.argv[1]), os.path.join(sys.argv[2], "mpi-ledger")
    os.makedirs(work, exist_ok=True)
    if not shutil.which("mpirun"):
        print("SKIP: mpirun is not installed (Debian: openmpi-bin)")
        return 0
    for mode, env in (("replicated", {}), ("alltoall", {"MOETAX_MPI_DISPATCH": "alltoall"})):
        led, tr = os.path.join(work, f"{mode}.ledger.json"), os.path.join(work, f"{mode}.trace.json")
        for p in (led, tr):
            if os.path.exists(p):
                os.unlink(p)
        r = run(["mpirun", "--oversubscribe", "-np", "2", moetax, "bench", "-m", MODEL, "-p", "8", "-n", "8", "-t", "1",
                 "-r", "1", "--no-mem", "--batch", "2", "--ledger", led, "--trace", tr], env=dict(ENV, **env))
        if "built without MPI" in r.stderr:
            print("SKIP: moetax was built without MPI")
            return 0
        if not check(r.returncode == 0, f"{mode}: np 2 bench --ledger --trace: {r.stderr[-1500:]}"):
            continue
        check(f"ledger of 2 ranks written to {led}" in r.stderr, f"{mode}: rank 0 says it wrote the merged ledger")
        d = json.load(open(led))
        check(d.get("mpi_ranks") == 2 and len(d.get("ranks", [])) == 2, f"{mode}: the ledger holds 2 ranks")
        check("moetax_ledger" in d and "totals" in d, f"{mode}: the top level is still a ledger (rank 0's)")
        ranks = d.get("ranks", [])
        check([k.get("rank") for k in ranks] == [0, 1], f"{mode}: ranks in order")
        # what each rank printed at exit: "rank R of 2: ... X MB sent, Y MB received"
        printed = {int(m.group(1)): (float(m.group(2)), float(m.group(3))) for m in
                   re.finditer(r"rank (\d) of 2: .*?([\d.]+) MB sent, ([\d.]+) MB received", r.stderr)}
        if mode == "replicated" and check(len(printed) == 2, f"{mode}: both ranks printed their bytes"):
            for k in ranks:
                s, rv = printed[k["rank"]]
                check(abs(k["dist"]["bytes_sent"] / 1e6 - s) < 0.0015 and abs(k["dist"]["bytes_recv"] / 1e6 - rv) < 0.0015,
                      f"{mode}: rank {k['rank']}'s ledger bytes {k['dist']} equal its exit summary {s, rv} MB")
        if len(ranks) == 2:
            check(ranks[0]["dist"]["bytes_sent"] == ranks[1]["dist"]["bytes_recv"] and
                  ranks[1]["dist"]["bytes_sent"] == ranks[0]["dist"]["bytes_recv"],
                  f"{mode}: what one rank sent the other received: {ranks[0]['dist']} {ranks[1]['dist']}")
            check(all(k["dist"]["collectives"] > 0 for k in ranks), f"{mode}: collectives counted")
            # bytes per layer: they add up to the totals, only MoE layers move any, and at np 2 what one rank
            # sent in a layer the other received there
            L, moe = d["n_layer"], set(d["moe_layers"])
            per = [(k["dist"].get("layer_bytes_sent", []), k["dist"].get("layer_bytes_recv", [])) for k in ranks]
            check(all(len(a) == L and len(b) == L for a, b in per), f"{mode}: bytes per layer in each rank's dist")
            if all(len(a) == L and len(b) == L for a, b in per):
                check(all(sum(a) == k["dist"]["bytes_sent"] and sum(b) == k["dist"]["bytes_recv"]
                          for (a, b), k in zip(per, ranks)), f"{mode}: the layers' bytes add up to the totals {per}")
                check(all((a[l] > 0) == (l in moe) and (b[l] > 0) == (l in moe) for a, b in per for l in range(L)),
                      f"{mode}: bytes in the MoE layers {sorted(moe)} only: {per}")
                check(per[0][0] == per[1][1] and per[1][0] == per[0][1], f"{mode}: per layer, one rank's sent is the "
                      f"other's received: {per}")
        # the trace: a process per rank, one clock
        t = json.load(open(tr))
        ev = t["traceEvents"]
        names = sorted(e["args"]["name"] for e in ev if e.get("name") == "process_name")
        check("rank 0: moetax" in names and "rank 1: moetax" in names, f"{mode}: a process per rank: {names}")
        x0 = [e for e in ev if e.get("ph") == "X" and e.get("pid") == 0]
        x1 = [e for e in ev if e.get("ph") == "X" and e.get("pid") == 100]
        if check(x0 and x1, f"{mode}: spans of both ranks"):
            a0, b0 = min(e["ts"] for e in x0), max(e["ts"] + e["dur"] for e in x0)
            a1, b1 = min(e["ts"] for e in x1), max(e["ts"] + e["dur"] for e in x1)
            ov = min(b0, b1) - max(a0, a1)
            check(ov > 0.5 * min(b0 - a0, b1 - a1), f"{mode}: the ranks' spans line up in time "
                  f"([{a0:.0f}, {b0:.0f}] vs [{a1:.0f}, {b1:.0f}] us)")
        # each rank's exchanges as a track of its own: their bytes are the ledger's, layer by layer
        for k in ranks:
            pid = 100 * k["rank"] + 2
            procs = [e["args"]["name"] for e in ev if e.get("name") == "process_name" and e.get("pid") == pid]
            xs = [e for e in ev if e.get("pid") == pid and e.get("name") == "exchange" and e.get("ph") == "X"]
            check(procs == [f"rank {k['rank']}: MPI exchanges"] and xs and
                  all(e.get("cat") == "comm" and e["dur"] >= 0 for e in xs),
                  f"{mode}: rank {k['rank']}'s exchanges in the trace: process {procs}, {len(xs)} spans")
            by = [[0, 0] for _ in range(d["n_layer"])]
            for e in xs:
                by[e["args"]["layer"]][0] += e["args"]["bytes_sent"]
                by[e["args"]["layer"]][1] += e["args"]["bytes_recv"]
            check([b[0] for b in by] == k["dist"]["layer_bytes_sent"] and [b[1] for b in by] == k["dist"]["layer_bytes_recv"],
                  f"{mode}: rank {k['rank']}'s exchanges in the trace carry its bytes per layer: {by} vs "
                  f"{k['dist']['layer_bytes_sent']} {k['dist']['layer_bytes_recv']}")
        # report: text and JSON
        rt = run([moetax, "report", led])
        check(rt.returncode == 0 and "ranks (mpirun -np 2" in rt.stdout and "the rank that works longest" in rt.stdout,
              f"{mode}: report shows the ranks: {rt.stdout[-800:]} {rt.stderr[-300:]}")
        rj = run([moetax, "report", led, "--json"])
        if check(rj.returncode == 0, f"{mode}: report --json: {rj.stderr[-300:]}"):
            j = json.loads(rj.stdout)
            check(len(j["ranks"]) == 2 and j["ranks"][1]["bytes_sent"] == ranks[1]["dist"]["bytes_sent"],
                  f"{mode}: report --json ranks with their bytes")
            # recomputed here from each rank's totals.layer_phase_s (phases in the file's order)
            names = d["ranks"][0]["phases"]
            busy = [[sum(v for n, v in zip(names, row) if n not in ("comm", "wait"))
                     for row in k["totals"]["layer_phase_s"]] for k in ranks]
            ok = len(j["rank_layers"]) == len(d["moe_layers"])
            for x in j["rank_layers"]:
                L = x["layer"]
                want = max(range(len(ranks)), key=lambda q: busy[q][L])
                ok &= x["slowest_rank"] == want and abs(x["busy_max_s"] - busy[want][L]) < 1e-9 and \
                    abs(x["busy_mean_s"] - sum(b[L] for b in busy) / len(busy)) < 1e-9
            check(ok, f"{mode}: the slowest rank per MoE layer and its time equal what the ranks' ledgers say: "
                  f"{j['rank_layers']} vs {busy}")
            check(all(x.get("bytes_sent_all_ranks") == sum(k["dist"]["layer_bytes_sent"][x["layer"]] for k in ranks)
                      and x.get("bytes_most_sent") == max(k["dist"]["layer_bytes_sent"][x["layer"]] for k in ranks)
                      for x in j["rank_layers"]), f"{mode}: report --json's bytes per MoE layer: {j['rank_layers']}")
            check("MB sent by all ranks" in rt.stdout, f"{mode}: the text report shows the bytes per MoE layer")
        html = os.path.join(work, f"{mode}.html")
        rh = run([moetax, "report", led, "--html", html])
        if check(rh.returncode == 0, f"{mode}: report --html: {rh.stderr[-300:]}"):
            page = open(html).read()
            check("<h2>Ranks</h2>" in page and page.count("<tr><td>1</td>") >= 1, f"{mode}: the page has the ranks")
        rtt = run([moetax, "report", tr])
        check(rtt.returncode == 0 and "Chrome trace" in rtt.stdout, f"{mode}: report reads the merged trace: "
              f"{rtt.stderr[-300:]}")
    # a merged ledger that is wrong: the field is named
    good = os.path.join(work, "replicated.ledger.json")
    if os.path.exists(good):
        d = json.load(open(good))
        d["ranks"][1]["rank"] = 5
        bad = os.path.join(work, "bad.ledger.json")
        json.dump(d, open(bad, "w"))
        rb = run([moetax, "report", bad])
        check(rb.returncode != 0 and "ranks[1]" in rb.stderr, f"a wrong rank is named: {rb.stderr[-300:]}")
        d["ranks"][1]["rank"] = 1
        d["ranks"][1]["dist"]["comm_s"] = -1
        json.dump(d, open(bad, "w"))
        rb = run([moetax, "report", bad])
        check(rb.returncode != 0 and "ranks[1].dist" in rb.stderr, f"a negative counter is named: {rb.stderr[-300:]}")
    return summary()


if __name__ == "__main__":
    sys.exit(main())
