#!/usr/bin/python3
# ctest-labels: mpi
# ctest-cost: 47
"""test_eplb.py - replicas of hot experts (--ep-replicas R, src/dist/eplb.c) in the default
replicated dispatch and in the token-sharded one (--ep-dispatch alltoall, with and without
--ep-overlap: greedy tokens, logits to float rounding, the same work counts): np 2 and np 4, prefill and step by step, with --ep-replicas (and
MOETAX_MPI_REPLICAS), with --ep-load PROFILE and with an interleaved --placement, give the single
process's greedy tokens and bit-identical logits on the trained default model; the exit
summary's work counts: every rank prints the same figures, the ranks' own slots add up to all
assignments (tokens x k x MoE layers), the busiest rank with replicas never above the busiest
without, both at or above an even split; a profile maps fewer experts beyond a rank's own than no
profile; on real text (a held-out stdlib file, bench --batch 8) the replicas cut the busiest
rank's excess over the mean by at least half at np 2 and np 4 (both dispatches), as they do for one token
per step (np 2, replicated), and the merged ledger's
dist objects hold the same counts; bad values are refused, named; a rank that stalls before the
token-sharded gather of the counts is named within the timeout.
SKIP without mpirun or without an MPI build.

usage: test_eplb.py MOETAX_BIN WORKDIR
"""
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "ref"))
from checks import check, summary  # noqa: E402  (tests/ref/checks.py)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = os.path.join(ROOT, "models", "pycode-20m-q8_0.gguf")
TOKENS = "1,5,9,13,17,21,25,29,33,37,41,45,49,53,57"
ENV = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
           OMPI_MCA_rmaps_base_oversubscribe="1")
TIMEOUT = 120
K, MOE_LAYERS, E = 4, 5, 32  # the trained default model

SUMMARY = (r"rank (\d+) of (\d+): replicas \(--ep-replicas (\d+), (?:re-planned every (\d+) steps|planned for each "
           r"layer's micro-batch from its (?:gathered )?counts), (\d+) times[^)]*\): "
           r"(-?\d+) now; expert work over (\d+) layer plans, (\d+) assignments: busiest rank (\d+) = ([0-9.]+) x the "
           r"mean with replicas, (\d+) = ([0-9.]+) x without \(excess [^;]*; an even split of every plan: ([0-9.]+)\); "
           r"this rank (\d+); it maps (\d+) experts beyond its own")


def run(args, env=ENV, timeout=TIMEOUT):
    return subprocess.run(args, capture_output=True, text=True, errors="replace", timeout=timeout, env=env)


def mpirun(np, args, env=ENV, timeout=TIMEOUT):
    return run(["mpirun", "--oversubscribe", "-np", str(np)] + args, env=env, timeout=timeout)


def read(path):
    with open(path, "rb") as f:
        return f.read()


def close(a, b):
    """logits of two runs within 1e-4 of their range (the token-sharded partial sums)"""
    import array
    x, y = array.array("f"), array.array("f")
    x.frombytes(a)
    y.frombytes(b)
    if len(x) != len(y) or not x:
        return False
    return max(abs(p - q) for p, q in zip(x, y)) <= 1e-4 * (max(x) - min(x))


def summaries(stderr):
    """rank -> dict of the summary's figures"""
    out = {}
    for m in re.findall(SUMMARY, stderr):
        v = [float(x) if "." in x else int(x) if x else 0 for x in m]  # K 0: alltoall plans per micro-batch
        out[v[0]] = dict(P=v[1], R=v[2], K=v[3], replans=v[4], now=v[5], plans=v[6], total=v[7], busy=v[8],
                         busy_x=v[9], base=v[10], base_x=v[11], even_x=v[12], mine=v[13], extra=v[14])
    return out


def check_counts(what, np, r, ntok):
    s = summaries(r.stderr)
    check(sorted(s) == list(range(np)), f"{what}: every rank prints the replicas' summary: {r.stderr[-600:]}")
    if sorted(s) != list(range(np)):
        return s
    same = [{k: v for k, v in x.items() if k not in ("mine", "extra")} for x in s.values()]
    check(all(x == same[0] for x in same), f"{what}: every rank counts the same work ({same})")
    x = s[0]
    if ntok:
        check(x["total"] == ntok * K * MOE_LAYERS, f"{what}: {x['total']} assignments = {ntok} tokens x {K} x "
              f"{MOE_LAYERS} layers")
    check(sum(v["mine"] for v in s.values()) == x["total"], f"{what}: the ranks' own slots add up to all "
          f"({[v['mine'] for v in s.values()]} vs {x['total']})")
    check(max(v["mine"] for v in s.values()) <= x["busy"], f"{what}: no rank above the busiest's sum")
    check(x["busy"] <= x["base"], f"{what}: the busiest rank with replicas ({x['busy']}) not above without ({x['base']})")
    check(x["even_x"] <= x["busy_x"] + 1e-9 and x["even_x"] >= 1.0, f"{what}: an even split at or below "
          f"({x['even_x']} vs {x['busy_x']})")
    check(x["now"] > 0 and x["now"] <= x["R"] * MOE_LAYERS, f"{what}: {x['now']} replicas, at most R per layer")
    return s


def main():
    moetax, work = sys.argv[1], sys.argv[2]
    work = os.path.join(work, "eplb")
    os.makedirs(work, exist_ok=True)
    if not shutil.which("mpirun"):
        print("SKIP: mpirun is not installed (Debian: openmpi-bin)")
        return 0
    probe = mpirun(2, [moetax, "eval", "-m", MODEL, "--tokens", "1,2", "--decode", "1", "--ep-replicas", "1"])
    if "built without MPI" in probe.stderr:
        print("SKIP: moetax was built without MPI")
        return 0
    check(probe.returncode == 0, f"np 2 eval --ep-replicas 1 runs: {probe.stderr[-500:]}")

    # a profile of some text (the prior of --ep-load)
    prof_in = os.path.join(work, "prof.txt")
    with open(prof_in, "w") as f:
        f.write(open(os.path.join(ROOT, "tests", "test_mpi.py")).read())
    prof = os.path.join(work, "profile.json")
    r = run([moetax, "profile", "-m", MODEL, "-f", prof_in, "-o", prof])
    check(r.returncode == 0, f"profile: {r.stderr[-300:]}")
    inter = os.path.join(work, "interleaved.txt")
    with open(inter, "w") as f:
        f.write("*: " + " ".join(str(e % 2) for e in range(E)) + "\n")

    ntok = len(TOKENS.split(",")) + 8
    extra = {}
    for mode in ([], ["--step-by-step"]):
        base = [moetax, "eval", "-m", MODEL, "--tokens", TOKENS, "--decode", "8", "-t", "1"] + mode
        ref = os.path.join(work, "ref.f32")
        r0 = run(base + ["--out", ref], env=dict(os.environ))
        check(r0.returncode == 0, f"single process: {r0.stderr[-300:]}")
        cases = [(2, ["--ep-replicas", "4"], {}), (4, ["--ep-replicas", "6"], {}),
                 (2, [], {"MOETAX_MPI_REPLICAS": "3", "MOETAX_MPI_REPLAN": "2"}),
                 (4, ["--ep-replicas", "8", "--ep-load", prof], {}),
                 (2, ["--ep-replicas", "4", "--placement", inter], {}),
                 (2, ["--ep-replicas", "4", "--ep-dispatch", "alltoall"], {}),
                 (2, ["--ep-replicas", "4", "--ep-replan", "2", "--ep-dispatch", "alltoall", "--ep-overlap"], {}),
                 (4, ["--ep-replicas", "6", "--ep-dispatch", "alltoall"], {}),
                 (4, ["--ep-replicas", "8", "--ep-load", prof, "--ep-dispatch", "alltoall", "--ep-overlap"], {})]
        for np, opts, env in cases:
            if np == 4 and "alltoall" in opts and mode:  # np 4 token-sharded: prefill only (the test's time)
                continue
            got = os.path.join(work, "got.f32")
            if os.path.exists(got):
                os.remove(got)
            r = mpirun(np, base + opts + ["--out", got], env=dict(ENV, **env))
            what = f"{' '.join(mode) or 'prefill'} np {np} {' '.join(opts)} {env or ''}".strip()
            check(r.returncode == 0 and r.stdout == r0.stdout, f"{what}: the single process's greedy tokens "
                  f"({r.stdout!r} vs {r0.stdout!r}; {r.stderr[-400:]})")
            if "alltoall" in opts:
                check(r.returncode == 0 and close(read(got), read(ref)), f"{what}: logits within 1e-4 of their range")
            else:
                check(r.returncode == 0 and read(got) == read(ref), f"{what}: logits bit-identical")
            if "--ep-replan" in opts or "MOETAX_MPI_REPLAN" in env:
                check(r.stderr.count("REPLAN has no effect" if env else "--ep-replan has no effect") == 1,
                      f"{what}: rank 0 warns once that the replan period does nothing ({r.stderr[-300:]})")
            s = check_counts(what, np, r, ntok)
            if mode and np == 2 and opts == ["--ep-replicas", "4"] and 0 in s:
                # one token per step: its 4 assignments planned per layer (each worker its own copy); planned
                # between steps from the counts so far they cut only about a third of the excess
                x = s[0]
                cut = (x["base_x"] - x["busy_x"]) / (x["base_x"] - 1) if x["base_x"] > 1 else 1
                check(cut >= 0.5, f"{what}: single tokens' replicas cut the busiest rank's excess by at least half "
                      f"({x['base_x']:.4f} -> {x['busy_x']:.4f})")
            if "alltoall" in opts:
                check(re.search(r"global views", r.stderr) is not None, f"{what}: the counts gathered per layer")
            elif s and np == 4:
                extra["--ep-load" in opts] = max(v["extra"] for v in s.values())
    check(extra.get(True, 99) < extra.get(False, 0), f"a profile maps fewer experts beyond a rank's own ({extra})")

    # real text: a held-out stdlib file (tools/train/corpus.py: path hash % 20 == 0), 8 sequences decoding together
    srcs = sorted(glob.glob("/usr/lib/python3*/copy.py")) or [os.path.join(ROOT, "tools", "train", "corpus.py")]
    bench = [moetax, "bench", "-m", MODEL, "-f", srcs[0], "--batch", "8", "-p", "32", "-n", "16", "-t", "1", "-r", "1"]
    lpath = os.path.join(work, "ledger.json")
    # np 4: both dispatches plan a batch's replicas per layer and micro-batch from its own counts (planned
    # between steps, alltoall's first prefill, one micro-batch, had none, and both cut less: README)
    for np, disp in ((2, ["--ep-dispatch", "alltoall"]), (2, []), (4, ["--ep-dispatch", "alltoall"]), (4, [])):
        r = mpirun(np, bench + ["--ep-replicas", "8", "--ledger", lpath] + disp, timeout=300)
        what = f"bench --batch 8 np {np} --ep-replicas 8 {' '.join(disp)}".strip()
        check(r.returncode == 0, f"{what}: {r.stderr[-500:]}")
        s = check_counts(what, np, r, 0)
        if 0 in s:
            x = s[0]
            cut = (x["base_x"] - x["busy_x"]) / (x["base_x"] - 1) if x["base_x"] > 1 else 0
            print(f"{what} on {srcs[0]}: busiest/mean {x['base_x']:.4f} without, {x['busy_x']:.4f} "
                  f"with replicas (even split {x['even_x']:.4f}): the excess cut by {100 * cut:.1f}%")
            check(cut >= 0.5, f"{what}: the replicas cut the busiest rank's excess over the mean by at least half "
                  f"({cut:.3f})")
            try:
                dist = [x["dist"] for x in json.load(open(lpath))["ranks"]]
            except (OSError, ValueError, KeyError) as e:
                dist = []
                check(False, f"{what}: the merged ledger has every rank's dist counters ({e})")
            check(len(dist) == np and all(d.get("work_busiest") == x["busy"] and d.get("work_busiest_without_replicas") ==
                                         x["base"] and d.get("work_assignments") == x["total"] for d in dist) and
                  sorted(d.get("work_mine") for d in dist) == sorted(v["mine"] for v in s.values()),
                  f"{what}: the merged ledger's dist objects hold the summary's work counts ({dist})")

    # bad values, named
    tiny = [moetax, "eval", "-m", MODEL, "--tokens", "1,2", "--decode", "1"]
    for opts, env, want in ((["--ep-replicas", "-1"], {}, "--ep-replicas '-1'"),
                            (["--ep-replicas", "two"], {}, "--ep-replicas 'two'"),
                            (["--ep-replicas", "99999"], {}, "0 to 4096"),
                            (["--ep-replicas", "2", "--ep-replan", "0"], {}, "--ep-replan '0'"),
                            (["--ep-replicas"], {}, "--ep-replicas needs a value"),
                            ([], {"MOETAX_MPI_REPLICAS": "x"}, "MOETAX_MPI_REPLICAS=x"),
                            (["--ep-load", prof], {}, "needs --ep-replicas"),
                            (["--ep-replicas", "2", "--ep-load", os.path.join(work, "none.json")], {}, "none.json")):
        r = mpirun(2, tiny + opts, env=dict(ENV, **env), timeout=60)
        check(r.returncode != 0 and want in r.stderr, f"{' '.join(opts)} {env or ''}: refused, naming {want!r}: "
              f"{r.returncode} {r.stderr[-300:]}")
    # a rank that hangs before a layer's gather of the counts (alltoall): named, well before it wakes
    t0 = time.time()
    r = mpirun(2, tiny + ["--ep-replicas", "2", "--ep-dispatch", "alltoall"],
               env=dict(ENV, MOETAX_MPI_TIMEOUT="2", MOETAX_MPI_TEST_STALL="1:30"), timeout=60)
    el = time.time() - t0
    check(r.returncode != 0 and "replicas' counts" in r.stderr and "rank(s) 1 did not arrive" in r.stderr and el < 20,
          f"alltoall replicas: a stalled rank is named ({el:.1f} s): {r.stderr[-400:]}")
    r = run(tiny + ["--ep-replicas", "2"], env=dict(os.environ))
    check(r.returncode != 0 and "run under mpirun" in r.stderr, f"--ep-replicas without mpirun: {r.stderr[-300:]}")
    return summary()


if __name__ == "__main__":
    sys.exit(main())
