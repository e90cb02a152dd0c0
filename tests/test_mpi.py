#!/usr/bin/python3
# ctest-labels: mpi
# ctest-cost: 40
"""test_mpi.py - expert parallelism over MPI (src/dist/dist.h), oversubscribed on one machine:
np 1 and np 2 give the single process's greedy tokens and bit-identical logits (the default,
exact combine) on the tiny preset and the trained default model, prefill and step by step;
MOETAX_MPI_COMBINE=allreduce gives the same tokens and logits within its tolerance; a rank that
cannot load its model makes every rank exit non-zero, within a bounded time, with a message
naming the rank; a different model file (header and tensor table) on one rank is detected at
start-up; --placement FILE interleaving the experts gives bit-identical logits, bad maps
are refused; a rank that stalls past MOETAX_MPI_TIMEOUT makes every rank exit naming it;
--expert-budget is per rank (its own experts' store), exact; token-sharded dispatch (--ep-dispatch
alltoall, with and without --ep-overlap) at np 1, 2 and 4 gives the single process's greedy tokens
(eval, and run --parallel over several sequences) and logits within 1e-4 of their range, its byte
counters are exact on a small case and once per rank moves fewer bytes than once per expert, a
stalled rank is named; each rank's peak RSS (VmHWM, printed at exit) stays within its bound from
`inspect --ranks 2` on the small preset (Q8_0), below the single process's.
SKIP without mpirun or without an MPI build.

usage: test_mpi.py MOETAX_BIN WORKDIR
"""
import array
import json
import re
import os
import shutil
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "ref"))
from checks import check, summary  # noqa: E402  (tests/ref/checks.py)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_MODEL = os.path.join(ROOT, "models", "pycode-20m-q8_0.gguf")
TOKENS = "1,5,9,13,17,21,25,29,33,37,41,45,49,53,57"
ENV = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
           OMPI_MCA_rmaps_base_oversubscribe="1")
TIMEOUT = 120  # a hang is a failure, never a stuck suite


def run(args, env=ENV, timeout=TIMEOUT):
    return subprocess.run(args, capture_output=True, text=True, errors="replace", timeout=timeout, env=env)


def mpirun(np, args, env=ENV, timeout=TIMEOUT):
    return run(["mpirun", "--oversubscribe", "-np", str(np)] + args, env=env, timeout=timeout)


def floats(path):
    with open(path, "rb") as f:
        return array.array("f", f.read())


def main():
    moetax, work = os.path.abspath(sys.argv[1]), os.path.abspath(sys.argv[2])  # the cases cd into subfolders
    work = os.path.join(work, "mpi")
    os.makedirs(work, exist_ok=True)
    if not shutil.which("mpirun"):
        print("SKIP: mpirun is not installed (Debian: openmpi-bin)")
        return 0
    tiny = os.path.join(work, "tiny.gguf")
    r = run([moetax, "gen", "--preset", "tiny", "-o", tiny])
    check(r.returncode == 0, f"gen tiny: {r.stderr[-300:]}")
    probe = mpirun(2, [moetax, "eval", "-m", tiny, "--tokens", "1,2", "--decode", "1"])
    if "built without MPI" in probe.stderr:
        print("SKIP: moetax was built without MPI")
        return 0
    check(probe.returncode == 0, f"np 2 eval runs: {probe.stderr[-500:]}")

    # tokens and logits: np 1, np 2 against the process without mpirun
    for model in (tiny, DEFAULT_MODEL):
        name = os.path.basename(model)
        for mode in ([], ["--step-by-step"]):
            base = [moetax, "eval", "-m", model, "--tokens", TOKENS, "--decode", "8", "-t", "1"] + mode
            ref = os.path.join(work, "ref.f32")
            r0 = run(base + ["--out", ref], env=dict(os.environ))
            check(r0.returncode == 0, f"{name} {mode}: single process: {r0.stderr[-300:]}")
            a = floats(ref)
            for np, combine in ((1, "gather"), (2, "gather"), (2, "allreduce")):
                got = os.path.join(work, f"got{np}{combine}.f32")
                r = mpirun(np, base + ["--out", got], env=dict(ENV, MOETAX_MPI_COMBINE=combine))
                what = f"{name} {' '.join(mode) or 'prefill'} np {np} {combine}"
                check(r.returncode == 0, f"{what}: runs: {r.stderr[-500:]}")
                if r.returncode:
                    continue
                check(r.stdout == r0.stdout, f"{what}: the greedy tokens of the single process")
                b = floats(got)
                if combine == "gather":
                    check(a.tobytes() == b.tobytes(), f"{what}: logits bit-identical")
                else:
                    span = max(a) - min(a)
                    diff = max(abs(x - y) for x, y in zip(a, b)) if len(a) == len(b) else float("inf")
                    check(diff <= 1e-4 * span, f"{what}: logits within 1e-4 of their range ({diff:g} of {span:g})")

    # token-sharded dispatch (--ep-dispatch alltoall, src/dist/dist.h): np 1, 2 and 4, with and without
    # overlap: the greedy tokens of the single process; logits to float rounding (partial sums per rank)
    cases = [(tiny, [], ((1, 0), (2, 1), (4, 0))),
             (DEFAULT_MODEL, [], ((2, 0), (4, 1))),
             (DEFAULT_MODEL, ["--step-by-step"], ((2, 1), (4, 0)))]
    for model, mode, runs in cases:
        name = os.path.basename(model)
        base = [moetax, "eval", "-m", model, "--tokens", TOKENS, "--decode", "8", "-t", "1"] + mode
        ref = os.path.join(work, "aref.f32")
        r0 = run(base + ["--out", ref], env=dict(os.environ))
        a = floats(ref)
        for np, ov in runs:
            got = os.path.join(work, f"a2a{np}{ov}.f32")
            r = mpirun(np, base + ["--ep-dispatch", "alltoall"] + (["--ep-overlap"] if ov else []) + ["--out", got])
            what = f"alltoall {name} {' '.join(mode) or 'prefill'} np {np}{' overlap' if ov else ''}"
            check(r.returncode == 0 and r.stdout == r0.stdout, f"{what}: the greedy tokens of the single process "
                  f"({r.stdout!r} vs {r0.stdout!r}; {r.stderr[-400:]})")
            if r.returncode:
                continue
            b = floats(got)
            span = max(a) - min(a)
            diff = max(abs(x - y) for x, y in zip(a, b)) if len(a) == len(b) else float("inf")
            check(diff <= 1e-4 * span, f"{what}: logits within 1e-4 of their range ({diff:g} of {span:g})")
            check(f"exchanges (alltoall dispatch{', overlapped' if ov else ''})" in r.stderr or np == 1,
                  f"{what}: the exit summary names the mode: {r.stderr[-300:]}")

    # several sequences (run --parallel: each rank runs its own sequences' attention): the single process's text
    prompts = os.path.join(work, "prompts.txt")
    with open(prompts, "w") as f:
        f.write("def main(\nimport os\nclass Foo:\nfor i in range(\nreturn x\n")
    args = [moetax, "run", "-m", DEFAULT_MODEL, "-f", prompts, "--parallel", "4", "-n", "12", "--temp", "0", "-t", "1"]
    text = lambda out: "\n".join(x for x in out.splitlines() if not x.startswith("---") and "t/s" not in x)
    r0 = run(args, env=dict(os.environ))
    check(r0.returncode == 0 and text(r0.stdout).strip(), f"run --parallel 4: {r0.stderr[-300:]}")
    for np, ov in ((2, 0), (4, 1)):
        lpath = os.path.join(work, f"a2a-ledger{np}.json")
        r = mpirun(np, args + ["--ep-dispatch", "alltoall"] + (["--ep-overlap"] if ov else []) + ["--ledger", lpath])
        check(r.returncode == 0 and text(r.stdout) == text(r0.stdout),
              f"run --parallel 4 alltoall np {np}{' overlap' if ov else ''}: the single process's text "
              f"({r.stdout[-300:]!r}; {r.stderr[-300:]})")
        recs = [int(x) for x in re.findall(r"exchanges \(alltoall dispatch[^)]*\), (\d+) records", r.stderr)]
        check(len(recs) == np and sum(x > 0 for x in recs) >= 2,
              f"np {np}: sequences on several ranks send records ({recs})")
        try:
            dist = [x["dist"] for x in json.load(open(lpath))["ranks"]]
        except (OSError, ValueError, KeyError) as e:
            dist = []
            check(False, f"np {np}: the merged ledger has every rank's dist counters ({e})")
        check(len(dist) == np and sorted(x["records"] for x in dist) == sorted(recs) and
              all(0 < x["bytes_once_per_rank"] <= x["bytes_once_per_expert"] for x in dist if x["records"]),
              f"np {np}: the ledger's records and bytes, once per rank <= once per expert ({dist})")

    # the bytes: every expert on rank 1 (tiny: F32, d 64, k 2, 2 MoE layers), one sequence on rank 0: each of
    # rank 0's tokens is one record per MoE layer (a 16-byte header of ids and weights, the 256-byte float
    # row) and one 256-byte partial sum back; once per expert it would be 2 x (256 + 8 + 256)
    one = os.path.join(work, "rank1.txt")
    with open(one, "w") as f:
        f.write("*: " + " ".join("1" for _ in range(8)) + "\n")
    r = mpirun(2, [moetax, "eval", "-m", tiny, "--tokens", TOKENS, "--decode", "4", "-t", "1", "--placement", one,
                   "--ep-dispatch", "alltoall"])
    pat = (r"rank (\d) of 2: (\d+) exchanges \(alltoall dispatch\), (\d+) records, ([0-9.]+) MB sent, ([0-9.]+) MB "
           r"received; once per rank ([0-9.]+) MB vs once per expert ([0-9.]+) MB")
    st = {int(m[0]): [float(x) for x in m[1:]] for m in re.findall(pat, r.stderr)}
    check(r.returncode == 0 and sorted(st) == [0, 1], f"the bytes summary of both ranks: {r.stderr[-500:]}")
    if sorted(st) == [0, 1]:
        ntok = len(TOKENS.split(",")) + 4  # the prompt, then each decoded token evaluated
        recs = st[0][1]
        check(recs == ntok * 2 and st[1][1] == 0, f"rank 0: one record per token and MoE layer ({recs} vs {ntok * 2})")
        check(abs(st[0][2] - recs * 272 / 1e6) < 2e-3 and abs(st[0][3] - recs * 256 / 1e6) < 2e-3,
              f"rank 0 sends 272 bytes per record and receives 256 ({st[0][2:4]})")
        check(abs(st[1][2] - st[0][3]) < 2e-3 and abs(st[1][3] - st[0][2]) < 2e-3, f"rank 1 mirrors rank 0 ({st[1][2:4]})")
        check(abs(st[0][4] - recs * 528 / 1e6) < 2e-3 and abs(st[0][5] - recs * 1040 / 1e6) < 2e-3,
              f"once per rank {st[0][4]} MB, once per expert {st[0][5]} MB ({recs} records)")

    # --placement FILE: experts interleaved over the ranks give the single process's tokens and logits
    E = 32  # models/pycode-20m-q8_0.gguf
    inter = os.path.join(work, "interleaved.txt")
    with open(inter, "w") as f:
        f.write("# expert e on rank e % 2\n*: " + " ".join(str(e % 2) for e in range(E)) + "\n")
    for mode in ([], ["--step-by-step"]):
        base = [moetax, "eval", "-m", DEFAULT_MODEL, "--tokens", TOKENS, "--decode", "8", "-t", "1"] + mode
        ref, got = os.path.join(work, "pref.f32"), os.path.join(work, "pgot.f32")
        r0 = run(base + ["--out", ref], env=dict(os.environ))
        r = mpirun(2, base + ["--placement", inter, "--out", got])
        what = f"--placement interleaved {' '.join(mode) or 'prefill'}"
        check(r.returncode == 0 and r.stdout == r0.stdout, f"{what}: the greedy tokens ({r.stderr[-400:]})")
        check(r.returncode == 0 and floats(ref).tobytes() == floats(got).tobytes(), f"{what}: logits bit-identical")
    for bad, want in (("*: " + " ".join("0" for _ in range(E - 1)) + "\n", "every one of the 32 experts"),
                      ("*: " + " ".join(str(e % 3) for e in range(E)) + "\n", "there are 2 ranks"),
                      ("1: " + " ".join("0" for _ in range(E)) + "\n", "is not placed")):
        path = os.path.join(work, "bad.txt")
        with open(path, "w") as f:
            f.write(bad)
        r = mpirun(2, [moetax, "eval", "-m", DEFAULT_MODEL, "--tokens", "1,2", "--placement", path], timeout=60)
        check(r.returncode != 0 and want in r.stderr, f"a bad placement is refused ({want}): {r.stderr[-300:]}")

    # run: rank 0 alone prints, the text of the single process
    args = [moetax, "run", "-m", DEFAULT_MODEL, "-p", "def main(", "-n", "16", "--temp", "0", "-t", "1"]
    r0 = run(args, env=dict(os.environ))
    r2 = mpirun(2, args)
    check(r2.returncode == 0 and r2.stdout == r0.stdout and r0.stdout.strip(),
          f"run np 2: the single process's text once ({r2.stdout!r} vs {r0.stdout!r})")

    # each rank's expert store holds its own experts only (the budget is per rank): same text
    rs = mpirun(2, args + ["--expert-budget", "3M"])
    check(rs.returncode == 0 and rs.stdout == r0.stdout, f"run np 2 --expert-budget 3M (per rank): the single "
          f"process's text ({rs.stdout!r}; {rs.stderr[-400:]})")
    check(rs.stderr.count("expert store: 25 slots") == 2, f"each rank has its own store: {rs.stderr[-400:]}")

    # a rank that fails to load: every rank exits non-zero, naming it, in bounded time
    t0 = time.monotonic()
    sh = ('if [ "$OMPI_COMM_WORLD_RANK" = 1 ]; then m=/nonexistent/rank1.gguf; else m="$0"; fi; '
          'exec "$1" eval -m "$m" --tokens 1,2 --decode 2')
    r = mpirun(2, ["sh", "-c", sh, tiny, moetax], timeout=60)
    el = time.monotonic() - t0
    check(r.returncode != 0, "a rank that cannot load: non-zero exit")
    check("rank 1" in r.stderr and "rank1.gguf" in r.stderr, f"the message names rank 1 and its file: {r.stderr[-600:]}")
    check(el < 30, f"and comes within 30 s ({el:.1f} s)")

    # a rank that hangs (MOETAX_MPI_TEST_STALL): every rank exits, naming the layer and the rank, soon after the timeout
    t0 = time.monotonic()
    r = mpirun(2, [moetax, "eval", "-m", tiny, "--tokens", "1,2,3", "--decode", "2", "-t", "1"],
               env=dict(ENV, MOETAX_MPI_TIMEOUT="2", MOETAX_MPI_TEST_STALL="1:30"), timeout=60)
    el = time.monotonic() - t0
    check(r.returncode != 0, "a stalled rank: non-zero exit")
    check("rank(s) 1 did not arrive" in r.stderr and "layer" in r.stderr, f"names the layer and rank 1: {r.stderr[-400:]}")
    check(el < 20, f"well before the stalled rank would wake ({el:.1f} s, timeout 2 s, stall 30 s)")
    t0 = time.monotonic()
    r = mpirun(2, [moetax, "eval", "-m", tiny, "--tokens", "1,2,3", "--decode", "2", "-t", "1", "--ep-dispatch", "alltoall"],
               env=dict(ENV, MOETAX_MPI_TIMEOUT="2", MOETAX_MPI_TEST_STALL="1:30"), timeout=60)
    el = time.monotonic() - t0
    check(r.returncode != 0 and "rank(s) 1 did not arrive" in r.stderr and el < 20,
          f"alltoall: a stalled rank is named ({el:.1f} s): {r.stderr[-400:]}")
    # with --ep-overlap the communication thread times out: its message reaches the command's error
    # (it came out empty: "error: (MOETAX_ERR_IO)")
    r = mpirun(2, [moetax, "eval", "-m", tiny, "--tokens", "1,2,3", "--decode", "2", "-t", "1", "--ep-dispatch", "alltoall",
                   "--ep-overlap"], env=dict(ENV, MOETAX_MPI_TIMEOUT="2", MOETAX_MPI_TEST_STALL="1:30"), timeout=60)
    check(r.returncode != 0 and "rank(s) 1 did not arrive" in r.stderr,
          f"--ep-overlap: a stalled rank is named: {r.stderr[-400:]}")

    # a different model file on one rank: detected at start-up
    tiny2 = os.path.join(work, "tiny-v3.gguf")
    r = run([moetax, "gen", "--preset", "tiny-v3", "-o", tiny2])  # other metadata: another header
    check(r.returncode == 0, f"gen a second tiny model: {r.stderr[-300:]}")
    # (the same arguments on every rank, so that the check of the command lines passes: -m model.gguf in a
    # directory of each rank's own)
    for rank, path in ((0, tiny), (1, tiny2)):
        os.makedirs(os.path.join(work, f"r{rank}"), exist_ok=True)
        link = os.path.join(work, f"r{rank}", "model.gguf")
        if os.path.lexists(link):
            os.remove(link)
        os.symlink(path, link)
    sh = 'cd "$0/r$OMPI_COMM_WORLD_RANK" && exec "$1" eval -m model.gguf --tokens 1,2 --decode 2'
    r = mpirun(2, ["sh", "-c", sh, work, moetax], timeout=60)
    check(r.returncode != 0 and "differs from rank 0's" in r.stderr,
          f"mismatched model files are an error naming the rank: {r.returncode} {r.stderr[-600:]}")

    # memory per rank: each rank's peak RSS within `inspect --ranks 2`'s bound (small Q8_0)
    small = os.path.join(work, "small-q8_0.gguf")
    r = run([moetax, "gen", "--preset", "small", "--type", "q8_0", "-o", small])
    check(r.returncode == 0, f"gen small q8_0: {r.stderr[-300:]}")
    r = run([moetax, "inspect", small, "--ranks", "2", "--ctx", "512", "--json"])
    check(r.returncode == 0, f"inspect --ranks 2: {r.stderr[-300:]}")
    if r.returncode == 0:
        plan = json.loads(r.stdout)
        bounds = {x["rank"]: x["bound_bytes"] / 2**20 for x in plan["per_rank"]}
        alone = plan["single_process_bytes"] / 2**20
        check(all(b < alone for b in bounds.values()), f"a rank's bound below one process's ({bounds} vs {alone:.1f})")
        r = mpirun(2, [moetax, "eval", "-m", small, "--tokens", TOKENS, "--decode", "4", "-t", "1"])
        check(r.returncode == 0, f"np 2 eval of small: {r.stderr[-500:]}")
        peaks = {int(a): float(b) for a, b in re.findall(r"rank (\d+) of 2: peak RSS ([0-9.]+) MiB", r.stderr)}
        check(sorted(peaks) == [0, 1], f"each rank prints its peak RSS: {r.stderr[-400:]}")
        for rank, mib in sorted(peaks.items()):
            check(0 < mib <= bounds[rank], f"rank {rank}: peak RSS {mib:.1f} MiB within its bound {bounds[rank]:.1f} MiB")
        print(f"peak RSS per rank (MiB): {peaks}; bounds {bounds}; one process's bound {alone:.1f}")
        r = mpirun(2, [moetax, "eval", "-m", small, "--tokens", TOKENS, "--decode", "4", "-t", "1", "--ep-dispatch",
                       "alltoall", "--ep-overlap"])
        peaks = {int(a): float(b) for a, b in re.findall(r"rank (\d+) of 2: peak RSS ([0-9.]+) MiB", r.stderr)}
        check(r.returncode == 0 and sorted(peaks) == [0, 1], f"alltoall np 2 eval of small: {r.stderr[-500:]}")
        for rank, mib in sorted(peaks.items()):
            check(0 < mib <= bounds[rank], f"alltoall: rank {rank}: peak RSS {mib:.1f} MiB within {bounds[rank]:.1f} MiB")
    return summary()


if __name__ == "__main__":
    sys.exit(main())
