#!/usr/bin/python3
# ctest-labels: mpi
"""test_mpi_args.py - ranks that would compute different things are stopped at start-up
(src/dist/gather.h, moetax_dist_same_command): an MPMD line giving one rank another option, or
another MOETAX_MPI_* setting, makes every rank exit non-zero within a bounded time, and the rank
that differs names the argument; the same command runs. The default dispatch follows the batch
(src/dist/dist.h, moetax_dist_default_dispatch): bench --batch 64 (or run --parallel 64) is
token-sharded, --batch 32,64 and a chosen mode (--ep-dispatch replicated,
MOETAX_MPI_DISPATCH=replicated) are not. SKIP without mpirun or an MPI build.

usage: test_mpi_args.py MOETAX_BIN WORKDIR
"""
import os
import shutil
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "ref"))
from checks import check, summary  # noqa: E402  (tests/ref/checks.py)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = os.path.join(ROOT, "models", "pycode-20m-q8_0.gguf")
ENV = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
           OMPI_MCA_rmaps_base_oversubscribe="1")


def mpirun(args, timeout=120):
    return subprocess.run(["mpirun", "--oversubscribe"] + args, capture_output=True, text=True, errors="replace",
                          timeout=timeout, env=ENV)


def main():
    moetax = os.path.abspath(sys.argv[1])
    if not shutil.which("mpirun"):
        print("SKIP: mpirun is not installed (Debian: openmpi-bin)")
        return 0
    ev = [moetax, "eval", "-m", MODEL, "--tokens", "1,2,3", "-t"]
    r = mpirun(["-np", "2"] + ev + ["1"])
    if "built without MPI" in r.stderr:
        print("SKIP: moetax was built without MPI")
        return 0
    check(r.returncode == 0, f"the same command on both ranks runs: {r.stderr[-500:]}")
    r = mpirun(["-np", "1"] + ev + ["1", ":", "-np", "1"] + ev + ["2"])
    check(r.returncode != 0, "an MPMD line with another -t fails")
    check("rank 1 of 2 runs another command than rank 0 ('-t 2' where rank 0 has '-t 1')" in r.stderr,
          f"the differing rank names the argument: {r.stderr[-600:]}")
    check("rank 0 of 2: another rank runs another command" in r.stderr, f"rank 0 says so too: {r.stderr[-600:]}")
    r = mpirun(["-np", "1", "-x", "MOETAX_MPI_DISPATCH=alltoall"] + ev + ["1", ":", "-np", "1"] + ev + ["1"])
    check(r.returncode != 0 and "MOETAX_MPI_DISPATCH=" in r.stderr, f"another MOETAX_MPI_DISPATCH fails, named: "
          f"{r.stderr[-600:]}")
    r = mpirun(["-np", "1"] + ev + ["1", "--ep-dispatch", "alltoall", ":", "-np", "1"] + ev + ["1"])
    check(r.returncode != 0 and "runs another command than rank 0" in r.stderr and "--ep-dispatch" in r.stderr,
          f"an --ep-dispatch on one rank only is named (the options main() takes out are checked too): "
          f"{r.stderr[-600:]}")
    # MOETAX_MPI_* numbers that are not numbers in range stop every rank at start-up, each saying so
    # (MOETAX_MPI_TIMEOUT=abc read as 0 turned the hang timeout off; -5 too); an empty one is the default
    for var, val in (("MOETAX_MPI_TIMEOUT", "abc"), ("MOETAX_MPI_TIMEOUT", "-5"), ("MOETAX_MPI_NAP_US", "2000000"),
                     ("MOETAX_MPI_COMBINE", "sum")):
        r = mpirun(["-np", "2", "-x", f"{var}={val}"] + ev + ["1"], timeout=60)
        said = [k for k in (0, 1) if f"rank {k}: {var}={val}: expected" in r.stderr]
        check(r.returncode != 0 and said == [0, 1], f"{var}={val}: every rank stops and says why (ranks {said}): "
              f"{r.stderr[-400:]}")
    for var, val in (("MOETAX_MPI_TIMEOUT", "2.5"), ("MOETAX_MPI_NAP_US", "")):
        r = mpirun(["-np", "2", "-x", f"{var}={val}"] + ev + ["1"], timeout=60)
        check(r.returncode == 0, f"{var}={val!r} runs: {r.stderr[-400:]}")
    # the default dispatch of a batch: token-sharded from 64 sequences (the exit summary says which ran)
    bench = [moetax, "bench", "-m", MODEL, "-p", "2", "-n", "1", "-t", "1", "-r", "1", "--no-mem"]
    for opts, env, want in ((["--batch", "64"], [], "alltoall"), (["--batch=128,64"], [], "alltoall"),
                            (["--batch", "32,64"], [], "replicated"),
                            (["--batch", "64", "--ep-dispatch", "replicated"], [], "replicated"),
                            (["--batch", "64"], ["-x", "MOETAX_MPI_DISPATCH=replicated"], "replicated")):
        r = mpirun(["-np", "2"] + env + bench + opts)
        got = "alltoall" if "exchanges (alltoall dispatch" in r.stderr else \
              "replicated" if "combines (gather)" in r.stderr else "?"
        check(r.returncode == 0 and got == want, f"bench {' '.join(env + opts)}: the {want} dispatch ({got}): "
              f"{r.stderr[-400:]}")
    prompts = os.path.join(sys.argv[2], "args-prompts.txt")
    os.makedirs(sys.argv[2], exist_ok=True)
    with open(prompts, "w") as f:
        f.write("def f(x):\nimport os\n")
    r = mpirun(["-np", "2", moetax, "run", "-m", MODEL, "-f", prompts, "--parallel", "64", "-n", "2", "--temp", "0",
                "-t", "1"])
    check(r.returncode == 0 and "exchanges (alltoall dispatch" in r.stderr, f"run --parallel 64: the alltoall "
          f"dispatch: {r.stderr[-400:]}")
    return summary()


if __name__ == "__main__":
    sys.exit(main())
