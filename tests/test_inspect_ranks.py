#!/usr/bin/python3
# ctest-labels: mpi
"""test_inspect_ranks.py - `moetax inspect FILE --ranks N` shows the placement (tools/cmd_inspect.c):
per MoE layer every expert on exactly one rank (contiguous ranges by default, the --placement
file's map otherwise), each rank's expert bytes = its experts' bytes; with --ep-replicas R
--ep-load PROFILE the profile's first plan: at most R replicas per layer, none on its owner, each
rank's bytes grow by its replicas, and the counts equal what `mpirun -np N eval` with the same
options says each rank maps beyond its own; --ep-replicas without a profile: every rank maps all
experts. Bad input is refused, named. SKIP without an MPI build (the plan is src/dist/'s).

usage: test_inspect_ranks.py MOETAX_BIN WORKDIR
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
E = 32  # the trained default model


def run(args, env=None, timeout=120):
    return subprocess.run(args, capture_output=True, text=True, errors="replace", timeout=timeout,
                          env=env or dict(os.environ))


def inspect(moetax, *opts):
    r = run([moetax, "inspect", MODEL, "--json"] + list(opts))
    return r, (json.loads(r.stdout) if r.returncode == 0 else None)


def check_plan(what, j, n, per_expert):
    """every expert on one rank per MoE layer; each rank's bytes = (own + replicas or all) x per expert"""
    ok = True
    for layer in j["placement"]:
        owned = sorted(e for x in layer["ranks"] for e in x["experts"])
        ok &= owned == list(range(E)) and len(layer["ranks"]) == n
        for x in layer["ranks"]:
            ok &= not set(x["replicas"]) & set(x["experts"])
    check(ok, f"{what}: every expert of every MoE layer on exactly one rank, no replica on its owner")
    for x in j["per_rank"]:
        r = x["rank"]
        mapped = sum(l["ranks"][r]["mapped"] for l in j["placement"])
        own = sum(len(l["ranks"][r]["experts"]) for l in j["placement"])
        check(x["own_expert_bytes"] == own * per_expert and x["expert_bytes"] == mapped * per_expert and
              x["bound_bytes"] == x["replicated_bytes"] + x["expert_bytes"] + x["kv_bytes"] + x["runtime_bytes"],
              f"{what}: rank {r}'s bytes: {own} own, {mapped} mapped experts of {per_expert} bytes ({x})")


def main():
    moetax, work = os.path.abspath(sys.argv[1]), os.path.join(sys.argv[2], "inspect-ranks")
    os.makedirs(work, exist_ok=True)
    r, j = inspect(moetax, "--ranks", "2")
    check(r.returncode == 0, f"inspect --ranks 2: {r.stderr[-300:]}")
    if not j:
        return summary()
    n_moe = len(j["placement"])
    per_expert = j["routed_expert_bytes"] // (E * n_moe)
    check(n_moe == 5 and j["routed_expert_bytes"] == per_expert * E * n_moe, f"5 MoE layers of {E} experts ({n_moe})")
    check(all(l["ranks"][0]["experts"] == list(range(16)) and l["ranks"][1]["experts"] == list(range(16, 32))
              for l in j["placement"]), "contiguous ranges by default")
    check_plan("--ranks 2", j, 2, per_expert)
    # --kv-type: the trained model's cells hold 80 values a layer (kv_lora 64 + rope 16): 320 bytes in F32,
    # 160 in F16, 3 Q8_0 blocks of 34 (the last padded) = 102
    kvb = {}
    for t in ("f32", "f16", "q8_0"):
        r_, j_ = inspect(moetax, "--ranks", "1", "--ctx", "1024", "--kv-type", t)
        kvb[t] = j_["per_rank"][0]["kv_bytes"] if j_ else None
    check(kvb["f32"] == 1024 * 6 * 320 and kvb["f16"] == 1024 * 6 * 160 and kvb["q8_0"] == 1024 * 6 * 102,
          f"inspect --kv-type: KV bytes {kvb}")
    rt = run([moetax, "inspect", MODEL, "--ranks", "2"])
    check(rt.returncode == 0 and "placement: experts per rank and MoE layer" in rt.stdout and
          "rank 0: 16 [0-15]  rank 1: 16 [16-31]" in rt.stdout, f"the text shows the placement: {rt.stdout[-500:]}")

    inter = os.path.join(work, "interleaved.txt")
    with open(inter, "w") as f:
        f.write("*: " + " ".join(str(e % 2) for e in range(E)) + "\n")
    r, j = inspect(moetax, "--ranks", "2", "--placement", inter)
    if "without MPI" in r.stderr:
        print("SKIP: moetax was built without MPI (--placement / --ep-replicas)")
        return summary()
    check(r.returncode == 0 and j and all(l["ranks"][1]["experts"] == list(range(1, E, 2)) for l in j["placement"]),
          f"--placement: the file's map ({r.stderr[-300:]})")
    if j:
        check_plan("--placement interleaved", j, 2, per_expert)

    # replicas: the profile's first plan, as the run makes it
    prof_in = os.path.join(work, "prof.txt")
    with open(prof_in, "w") as f:
        f.write(open(os.path.join(ROOT, "tests", "test_mpi.py")).read())
    prof = os.path.join(work, "profile.json")
    rp = run([moetax, "profile", "-m", MODEL, "-f", prof_in, "-o", prof])
    check(rp.returncode == 0, f"profile: {rp.stderr[-300:]}")
    r, j = inspect(moetax, "--ranks", "4", "--ep-replicas", "8", "--ep-load", prof)
    check(r.returncode == 0 and j and j.get("replicas") == 8, f"--ep-replicas 8 --ep-load: {r.stderr[-300:]}")
    if j:
        check_plan("--ranks 4 --ep-replicas 8 --ep-load", j, 4, per_expert)
        reps = [sum(len(x["replicas"]) for x in l["ranks"]) for l in j["placement"]]
        check(all(0 < n <= 8 for n in reps), f"at most 8 replicas per layer, some: {reps}")
        extra = {x["rank"]: sum(l["ranks"][x["rank"]]["mapped"] - len(l["ranks"][x["rank"]]["experts"])
                                for l in j["placement"]) for x in j["per_rank"]}
        check(all(extra[q] == sum(len(l["ranks"][q]["replicas"]) for l in j["placement"]) for q in extra),
              f"with a profile a rank maps only the replicas it hosts ({extra})")
        if shutil.which("mpirun"):
            rr = run(["mpirun", "--oversubscribe", "-np", "4", moetax, "eval", "-m", MODEL, "--tokens", "1,2,3",
                      "--decode", "1", "-t", "1", "--ep-replicas", "8", "--ep-load", prof], env=ENV, timeout=120)
            said = {int(a): int(b) for a, b in re.findall(r"rank (\d) of 4: replicas .*? it maps (\d+) experts beyond",
                                                        rr.stderr)}
            check(rr.returncode == 0 and said == extra, f"the run maps what inspect says, rank by rank: {said} vs "
                  f"{extra} ({rr.stderr[-300:]})")
    r, j = inspect(moetax, "--ranks", "2", "--ep-replicas", "2")
    check(r.returncode == 0 and j and all(x["expert_bytes"] == j["routed_expert_bytes"] for x in j["per_rank"]),
          f"--ep-replicas without a profile: every rank maps every expert ({r.stderr[-300:]})")

    # bad input, named
    bad = os.path.join(work, "bad.txt")
    with open(bad, "w") as f:
        f.write("*: " + " ".join("0" for _ in range(E - 1)) + "\n")
    for opts, want in ((["--ranks", "2", "--placement", bad], "every one of the 32 experts"),
                       (["--ranks", "2", "--placement", os.path.join(work, "none.txt")], "none.txt"),
                       (["--ranks", "2", "--ep-replicas", "x"], "--ep-replicas 'x'"),
                       (["--ranks", "2", "--ep-replicas", "2", "--ep-load", os.path.join(work, "no.json")], "no.json"),
                       (["--ep-load", prof], "go with --ranks")):
        r = run([moetax, "inspect", MODEL] + opts)
        check(r.returncode != 0 and want in r.stderr, f"inspect {' '.join(opts)}: refused, naming {want!r}: "
              f"{r.stderr[-300:]}")
    return summary()


if __name__ == "__main__":
    sys.exit(main())
