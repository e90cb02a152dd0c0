#!/usr/bin/python3
# ctest-labels: mpi
"""test_serve_mpi.py - `mpirun -np 2 moetax serve` (src/dist/dist_cmd.h): rank 0 speaks HTTP,
every rank steps together, with replicated attention (the default) and with token-sharded
dispatch (MOETAX_MPI_DISPATCH=alltoall: each rank holds its own sequences' cells, rank 0 keeps the
books of all), and token-sharded with replicas (MOETAX_MPI_REPLICAS=4, re-planned every step). Prompts are prefilled 8 tokens per step. Greedy completions equal `moetax run
--temp 0` of the single process, one at a time and 4 in flight (two of them longer than a chunk);
a prompt that extends a finished one reuses that slot's cells, one that extends a running one
gets its prefix copied into another slot, both replayed on the other rank, and both still give
the single process's answer; the KV cells in use return to 0; SIGTERM to rank 0 stops every rank
and mpirun exits 0; a follower rank killed with SIGKILL ends the whole job within a bounded time
(no hang). SKIP without mpirun, an MPI build or libmicrohttpd.

usage: test_serve_mpi.py MOETAX_BIN WORKDIR
"""
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "ref"))
from checks import check, summary  # noqa: E402  (tests/ref/checks.py)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = os.path.join(ROOT, "models", "pycode-20m-q8_0.gguf")
ENV = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
           OMPI_MCA_rmaps_base_oversubscribe="1", MOETAX_MPI_TIMEOUT="10")
PROMPTS = ["def __init__(self", "import os\nimport sys\n", "class Parser:\n    def", "for i in range(",
           "    return self._",
           # longer than the servers' --prefill-chunk (8): prefilled over several steps, on every rank
           "import os\nimport sys\nimport json\nimport time\n\n\ndef main(argv):\n    parser = argparse.ArgumentParser()\n",
           "class Config(object):\n    \"\"\"Settings read from a file.\"\"\"\n\n    def __init__(self, path, encoding=None):\n"]


class MpiServer:
    def __init__(self, moetax, work, name, *args, env=None):
        self.log_path = os.path.join(work, f"serve-mpi-{name}.log")
        self.log = open(self.log_path, "w+b")
        self.moetax = moetax
        self.p = subprocess.Popen(["mpirun", "--oversubscribe", "-np", "2", moetax, "serve", "-m", MODEL, "--port",
                                   "0", "-t", "1", "--parallel", "4", "--prefill-chunk", "8", *args],
                                  stdout=self.log, stderr=self.log,
                                  env=dict(ENV, **(env or {})))
        self.port = None
        deadline = time.time() + 90
        while time.time() < deadline and self.port is None and self.p.poll() is None:
            m = re.search(r"listening on http://127\.0\.0\.1:(\d+)", self.text())
            if m:
                self.port = int(m.group(1))
            else:
                time.sleep(0.05)

    def text(self):
        with open(self.log_path, "rb") as f:
            return f.read().decode(errors="replace")

    def ranks(self):
        """pids of the ranks (children of mpirun running moetax serve), rank order unknown."""
        out = subprocess.run(["ps", "-o", "pid=,ppid=,args=", "-e"], capture_output=True, text=True).stdout
        pids = []
        for line in out.splitlines():
            pid, ppid, args = line.split(None, 2)
            if int(ppid) == self.p.pid and args.startswith(self.moetax + " serve"):
                pids.append(int(pid))
        return pids

    def post(self, body, timeout=60):
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())

    def metric(self, name):
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=30) as r:
            m = re.search(rf"^{re.escape(name)} (\S+)$", r.read().decode(), re.M)
            return float(m.group(1)) if m else None

    def wait(self, timeout):
        try:
            return self.p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.p.kill()
            self.p.wait()
            return None

    def close(self):
        if self.p.poll() is None:
            self.p.kill()
            self.p.wait()
        self.log.close()


def serve_checks(moetax, work, mode, env, refs, refs_ext, n):
    """One server in this dispatch mode: the answers, prefix reuse, cells, SIGTERM."""
    s = MpiServer(moetax, work, mode, env=env)
    try:
        if not check(s.port is not None, f"{mode}: np 2 serve starts: {s.text()[-1500:]}"):
            return False
        if "built without MPI" in s.text():
            print("SKIP: moetax was built without MPI")
            return None
        # one at a time
        usage = {}
        for p in PROMPTS[:2]:
            o = s.post({"prompt": p, "max_tokens": n, "temperature": 0})
            usage[p] = o["usage"]
            check(o["choices"][0]["text"] == refs[p], f"{mode}: np 2 serve {p!r}: {o['choices'][0]['text']!r} != run's "
                  f"{refs[p]!r}")
        # a prompt that extends a finished one: its slot's cells are reused (every rank replays it)
        p0 = PROMPTS[0]
        ext = p0 + refs[p0][:12]
        o = s.post({"prompt": ext, "max_tokens": 8, "temperature": 0})
        cached = o["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0)
        check(cached >= usage[p0]["prompt_tokens"] - 1, f"{mode}: the extended prompt reused the finished one's "
              f"cells: cached_tokens {cached}, its prompt had {usage[p0]['prompt_tokens']}")
        check(o["choices"][0]["text"] == refs_ext[0], f"{mode}: np 2 serve, prefix reuse: {o['choices'][0]['text']!r}"
              f" != {refs_ext[0]!r}")
        # a prompt that extends a RUNNING one: its prefix is copied into another slot (of the same rank
        # when the ranks hold their own sequences)
        p2 = PROMPTS[2]
        running = {}

        def long_one():
            running["o"] = s.post({"prompt": p2, "max_tokens": 3 * n, "temperature": 0})
        t = threading.Thread(target=long_one)
        t.start()
        time.sleep(0.3)  # admitted and decoding
        o2 = s.post({"prompt": p2 + refs[p2][:10], "max_tokens": 8, "temperature": 0})
        t.join()
        cached = o2["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0)
        check("o" in running and running["o"]["choices"][0]["text"].startswith(refs[p2]),
              f"{mode}: the running request is undisturbed by the copy")
        check(cached >= running.get("o", {}).get("usage", {}).get("prompt_tokens", 99) - 1,
              f"{mode}: a running request's prefix copied to another slot: cached_tokens {cached}")
        check(o2["choices"][0]["text"] == refs_ext[1], f"{mode}: np 2 serve, copied prefix: "
              f"{o2['choices'][0]['text']!r} != {refs_ext[1]!r}")
        # 4 in flight at once (one step holds several sequences, prompt chunks and decodes mixed), two
        # of them longer than the prefill chunk
        outs = {}

        def one(p):
            outs[p] = s.post({"prompt": p, "max_tokens": n, "temperature": 0}, timeout=120)["choices"][0]["text"]
        batch = PROMPTS[3:]
        th = [threading.Thread(target=one, args=(p,)) for p in batch]
        for t in th:
            t.start()
        for t in th:
            t.join()
        for p in batch:
            check(outs.get(p) == refs[p], f"{mode}: np 2 serve, {len(batch)} in flight, {p!r}: {outs.get(p)!r} != "
                  f"{refs[p]!r}")
        deadline = time.time() + 10  # the scheduler refreshes /metrics after its step: poll
        while s.metric("moetax_kv_cells_active") != 0 and time.time() < deadline:
            time.sleep(0.05)
        check(s.metric("moetax_kv_cells_active") == 0, f"{mode}: KV cells of running requests back to 0")
        # SIGTERM to rank 0: every rank stops, mpirun exits 0
        ranks = s.ranks()
        check(len(ranks) == 2, f"two ranks under mpirun: {ranks}")
        lsn = subprocess.run(["ss", "-ltnpH", f"sport = :{s.port}"], capture_output=True, text=True).stdout
        pid0 = [pid for pid in ranks if f"pid={pid}," in lsn]
        if check(len(pid0) == 1, f"rank 0 found by its listening socket: {lsn!r}"):
            os.kill(pid0[0], signal.SIGTERM)
            rc = s.wait(60)
            check(rc == 0, f"{mode}: SIGTERM to rank 0: mpirun exits 0 (got {rc}): {s.text()[-800:]}")
            check("SIGTERM, stopping" in s.text(), "rank 0 says it stops")
            check(len(re.findall(r"rank \d of 2: peak RSS", s.text())) == 2, "both ranks ended normally")
    finally:
        s.close()
    return True


def greedy(moetax, prompt, n):
    r = subprocess.run([moetax, "run", "-m", MODEL, "-p", prompt, "-n", str(n), "--temp", "0", "-t", "1"],
                       capture_output=True, text=True, timeout=120)
    check(r.returncode == 0, f"run -p {prompt!r}: {r.stderr[-300:]}")
    assert r.stdout.startswith(prompt), r.stdout[:200]
    out = r.stdout[len(prompt):]
    return out[:-1] if out.endswith("\n") else out  # run ends its output with a newline


def main():
    moetax, work = os.path.abspath(sys.argv[1]), os.path.join(sys.argv[2], "serve-mpi")
    os.makedirs(work, exist_ok=True)
    if not shutil.which("mpirun"):
        print("SKIP: mpirun is not installed (Debian: openmpi-bin)")
        return 0
    h = subprocess.run([moetax, "serve", "--help"], capture_output=True, text=True)
    if "without libmicrohttpd" in (h.stdout + h.stderr):
        print("SKIP: moetax was built without libmicrohttpd")
        return 0
    n = 24
    refs = {p: greedy(moetax, p, n) for p in PROMPTS}
    refs_ext = [greedy(moetax, PROMPTS[0] + refs[PROMPTS[0]][:12], 8), greedy(moetax, PROMPTS[2] + refs[PROMPTS[2]][:10], 8)]
    modes = [("replicated", {}), ("alltoall", {"MOETAX_MPI_DISPATCH": "alltoall"}),
             ("alltoall+replicas", {"MOETAX_MPI_DISPATCH": "alltoall", "MOETAX_MPI_REPLICAS": "4"})]

    for mode, env in modes:
        if serve_checks(moetax, work, mode, env, refs, refs_ext, n) is None:
            return 0

    # a follower killed: the job ends (mpirun notices), no rank left waiting
    s = MpiServer(moetax, work, "kill")
    try:
        if check(s.port is not None, f"np 2 serve starts again: {s.text()[-800:]}"):
            lsn = subprocess.run(["ss", "-ltnpH", f"sport = :{s.port}"], capture_output=True, text=True).stdout
            others = [pid for pid in s.ranks() if f"pid={pid}," not in lsn]
            if check(len(others) == 1, f"the follower rank found: {s.ranks()} {lsn!r}"):
                os.kill(others[0], signal.SIGKILL)
                t0 = time.time()
                rc = s.wait(60)
                check(rc is not None and rc != 0, f"a killed follower ends the job non-zero (got {rc})")
                check(time.time() - t0 < 60, "within 60 s")
    finally:
        s.close()
    return summary()


if __name__ == "__main__":
    sys.exit(main())
