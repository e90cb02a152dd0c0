#!/usr/bin/python3
# ctest-labels: mpi
# ctest-cost: 31
"""test_mpi_capacity.py - the capacity factor under mpirun (src/dist/dist.h, "Capacity factor"):
- bench --batch 8 --capacity-factor 1 --ledger L, np 2, replicated and token-sharded (alltoall, with
  and without --ep-overlap): every rank's ledger books the same dropped and
  rerouted assignments and the same MoE figures as the single process's ledger, and nothing is lost:
  assignments + dropped = the step's tokens (all ranks') x k x MoE layers;
- perplexity --parallel 8 --capacity-factor C: the replicated dispatch gives the single process's
  perplexity and shares exactly; the token-sharded one within float rounding (its partial sums are
  added in another order, so near-ties of the routing may fall the other way);
- --capacity-factor inf is the run without the option (same output, no gather of router logits).
SKIP without mpirun or without an MPI build.

usage: test_mpi_capacity.py MOETAX_BIN WORKDIR
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
           OMPI_MCA_rmaps_base_oversubscribe="1")
TIMEOUT = 180
K, MOE_LAYERS = 4, 5  # the trained default model
MOE_KEYS = ("layers", "experts", "assignments", "dropped", "rerouted")


def run(args, env=ENV, timeout=TIMEOUT):
    return subprocess.run(args, capture_output=True, text=True, errors="replace", timeout=timeout, env=env)


def mpirun(np, args, env=ENV, timeout=TIMEOUT):
    return run(["mpirun", "--oversubscribe", "-np", str(np)] + args, env=env, timeout=timeout)


def ledger_moe(path):
    """[(tokens, moe totals)] per rank (one entry without mpirun)"""
    d = json.load(open(path))
    docs = d["ranks"] if "ranks" in d else [d]
    return [(x["totals"]["tokens"], {k: x["totals"]["moe"][k] for k in MOE_KEYS}) for x in docs]


def main():
    moetax, work = sys.argv[1], sys.argv[2]
    work = os.path.join(work, "mpi_capacity")
    os.makedirs(work, exist_ok=True)
    if not shutil.which("mpirun"):
        print("SKIP: mpirun is not installed (Debian: openmpi-bin)")
        return 0
    probe = mpirun(2, [moetax, "eval", "-m", MODEL, "--tokens", "1,2", "--decode", "1"])
    if "built without MPI" in probe.stderr:
        print("SKIP: moetax was built without MPI")
        return 0
    check(probe.returncode == 0, f"np 2 eval runs: {probe.stderr[-500:]}")

    text = os.path.join(ROOT, "tests", "test_mpi.py")
    modes = {"replicated": [], "alltoall": ["--ep-dispatch", "alltoall"],
             "alltoall+overlap": ["--ep-dispatch", "alltoall", "--ep-overlap"]}

    # bench --batch 8: the ledgers' MoE figures, every rank alike and the single process's
    bench = [moetax, "bench", "-m", MODEL, "-f", text, "--batch", "8", "-p", "16", "-n", "8", "-t", "1", "-r", "1"]
    for cap in (["--capacity-factor", "1"],):  # (bench has no --overflow: reroute below, with perplexity)
        ref = os.path.join(work, "ref.json")
        r0 = run(bench + cap + ["--ledger", ref], env=dict(os.environ))
        check(r0.returncode == 0, f"single process {' '.join(cap)}: {r0.stderr[-300:]}")
        if r0.returncode:
            continue
        [(tok0, moe0)] = ledger_moe(ref)
        check(moe0["dropped"] + moe0["rerouted"] > 0, f"{' '.join(cap)}: the cap bites ({moe0})")
        for name, opts in modes.items():
            lp = os.path.join(work, f"l-{name}.json")
            r = mpirun(2, bench + cap + opts + ["--ledger", lp])
            what = f"np 2 {name} {' '.join(cap)}"
            check(r.returncode == 0, f"{what}: runs: {r.stderr[-500:]}")
            if r.returncode:
                continue
            per = ledger_moe(lp)
            check(len(per) == 2 and all(m == per[0][1] for _, m in per),
                  f"{what}: every rank books the same MoE figures ({per})")
            check(per[0][1] == moe0, f"{what}: the single process's dropped / rerouted / assignments "
                  f"({per[0][1]} vs {moe0})")
            # replicated: each rank's ledger counts every token; token-sharded: its own only
            tokens = per[0][0] if name == "replicated" else sum(t for t, _ in per)
            check(tokens == tok0, f"{what}: the ranks' tokens add up to the single process's ({tokens} vs {tok0})")
            m = per[0][1]
            check(m["assignments"] + m["dropped"] == tokens * K * MOE_LAYERS,
                  f"{what}: no assignment lost: {m['assignments']} planned + {m['dropped']} dropped = "
                  f"{tokens} tokens x {K} x {MOE_LAYERS}")
            gathers = re.findall(r"rank \d of 2: (\d+) global views", r.stderr)
            check(name == "replicated" or (len(gathers) == 2 and int(gathers[0]) > 0),
                  f"{what}: the router logits gathered per layer ({gathers})")

    # perplexity --parallel 8: the quality cost under mpirun
    part = os.path.join(work, "part.txt")
    with open(text, "rb") as f, open(part, "wb") as g:
        g.write(f.read(6000))
    ppl = [moetax, "perplexity", "-m", MODEL, "-f", part, "-c", "64", "-t", "1",
           "--parallel", "8", "--json"]
    for cap in (["--capacity-factor", "1"], ["--capacity-factor", "1.25", "--overflow", "reroute"]):
        r0 = run(ppl + cap, env=dict(os.environ))
        check(r0.returncode == 0, f"perplexity single process {' '.join(cap)}: {r0.stderr[-300:]}")
        if r0.returncode:
            continue
        j0 = json.loads(r0.stdout)
        for np, name in ((2, "replicated"), (2, "alltoall"), (4, "alltoall+overlap")):
            r = mpirun(np, ppl + cap + modes[name])
            what = f"perplexity np {np} {name} {' '.join(cap)}"
            check(r.returncode == 0, f"{what}: runs: {r.stderr[-400:]}")
            if r.returncode:
                continue
            j = json.loads(r.stdout)
            if name == "replicated":
                check(j["ppl"] == j0["ppl"] and j["dropped_share"] == j0["dropped_share"] and
                      j["rerouted_share"] == j0["rerouted_share"], f"{what}: the single process's figures exactly "
                      f"({j['ppl']}, {j['dropped_share']}, {j['rerouted_share']} vs {j0['ppl']}, "
                      f"{j0['dropped_share']}, {j0['rerouted_share']})")
            else:
                check(abs(j["ppl"] - j0["ppl"]) <= 5e-3 * j0["ppl"], f"{what}: perplexity {j['ppl']} within 0.5% "
                      f"of {j0['ppl']}")
                for key in ("dropped_share", "rerouted_share"):
                    check(abs(j[key] - j0[key]) <= 1e-3, f"{what}: {key} {j[key]} vs {j0[key]}")

    # C = inf: the run without the option, and no gather
    base = ppl + modes["alltoall"]
    ra, rb = mpirun(2, base), mpirun(2, base + ["--capacity-factor", "inf"])
    check(ra.returncode == 0 and rb.returncode == 0, f"--capacity-factor inf np 2: {rb.stderr[-300:]}")
    if ra.returncode == 0 and rb.returncode == 0:
        ja, jb = json.loads(ra.stdout), json.loads(rb.stdout)
        check(ja["ppl"] == jb["ppl"] and ja["nll"] == jb["nll"], f"--capacity-factor inf = no option ({ja} vs {jb})")
        check("global views" not in rb.stderr, f"--capacity-factor inf gathers nothing: {rb.stderr[-300:]}")
    return summary()


if __name__ == "__main__":
    sys.exit(main())
